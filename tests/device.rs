//! `--device` on the command line: without a CUDA driver (CI, dev machines) an explicit CUDA
//! device is refused with a message naming the cause and a way out, exit code 1 rather than a
//! panic's 101; `auto` falls back to the CPU. On a GPU machine the same commands succeed.

use std::process::Command;

fn wasmserve(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_wasmserve")).args(args).env("RUST_LOG", "info").env_remove("WASMSERVE_DEVICE").output().expect("run wasmserve")
}

fn has_cuda_driver() -> bool {
    // SAFETY: dlopen of a system library by name.
    ["libcuda.so.1", "libcuda.so"].iter().any(|n| unsafe { libloading_probe(n) })
}

/// dlopen without a crate dependency: the same check the backend makes before touching cudarc.
unsafe fn libloading_probe(name: &str) -> bool {
    extern "C" {
        fn dlopen(filename: *const std::ffi::c_char, flag: i32) -> *mut std::ffi::c_void;
    }
    let c = std::ffi::CString::new(name).unwrap();
    !unsafe { dlopen(c.as_ptr(), 1) }.is_null()
}

#[test]
fn explicit_cuda_device_without_a_driver_is_a_clear_error_not_a_panic() {
    if has_cuda_driver() {
        eprintln!("SKIPPED explicit_cuda_device_without_a_driver_is_a_clear_error_not_a_panic: this machine has libcuda");
        return;
    }
    // Device selection comes before the model load, so the missing model is never reached.
    let out = wasmserve(&["--device", "cuda:0", "generate", "--prompt", "hi", "--model", "/nonexistent/model.gguf"]);
    let err2 = String::from_utf8_lossy(&out.stderr);
    eprintln!("{err2}");
    assert_eq!(out.status.code(), Some(1), "exit status (101 would be a panic): {err2}");
    assert!(err2.contains("cannot use CUDA device 0"), "{err2}");
    assert!(err2.contains("libcuda"), "the missing library is named: {err2}");
    assert!(err2.contains("--device cpu"), "a way out is given: {err2}");
    assert!(!err2.contains("panicked"), "{err2}");
}

#[test]
fn auto_falls_back_to_the_cpu_with_a_reason() {
    if has_cuda_driver() {
        eprintln!("SKIPPED auto_falls_back_to_the_cpu_with_a_reason: this machine has libcuda");
        return;
    }
    // The model is missing, so the command fails after device selection, at the model load.
    let out = wasmserve(&["--device", "auto", "generate", "--prompt", "hi", "--model", "/nonexistent/model.gguf"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no usable CUDA device") && err.contains("running on the CPU"), "{err}");
    assert!(err.contains("/nonexistent/model.gguf"), "got past device selection to the model load: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_device_strings_are_rejected_by_the_parser() {
    let out = wasmserve(&["--device", "gpu0", "generate", "--prompt", "hi"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("expected cpu, auto or cuda:N"), "{err}");
}
