//! `--device` on the command line: without a CUDA driver (CI, dev machines) an explicit CUDA
//! device is refused with a message naming the cause and a way out, exit code 1 rather than a
//! panic's 101; `auto` falls back to the CPU. On a GPU machine the same commands succeed.

mod common;

use std::process::Command;

fn wasmserve(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_wasmserve"))
        .args(args)
        .env("RUST_LOG", "info")
        .env_remove("WASMSERVE_DEVICE")
        .output()
        .expect("run wasmserve")
}

/// `generate` of a tiny checkpoint under `tests/reference/` (or at an absolute path) on `device` (greedy, 12 tokens, with
/// the extra global/`generate` options `args`); asserts it succeeded without falling back to the
/// CPU forward and, on the simulator, that the log says `uploaded` when given. Returns the text.
fn generate_text(checkpoint: &str, device: &str, args: &[&str], uploaded: Option<&str>) -> String {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference").join(checkpoint);
    let mut all = vec![
        "--device",
        device,
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hello world",
        "--max-tokens",
        "12",
        "--ignore-eos",
    ];
    all.extend_from_slice(args);
    let out = wasmserve(&all);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "--device {device} {args:?}: {err}");
    assert!(!err.contains("forward runs on the CPU"), "{err}");
    if let (Some(marker), "sim") = (uploaded, device) {
        assert!(err.contains(marker), "{err}");
    }
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Whether the CUDA-kernel simulator was built; a test without it skips, saying so (unless
/// `WASMSERVE_REQUIRE_SIM` is set, when the `--device sim` run itself must work).
fn simulator_built(test: &str) -> bool {
    let built = kernels::sim::SimGpu::sim().is_ok() || std::env::var_os("WASMSERVE_REQUIRE_SIM").is_some();
    if !built {
        eprintln!("SKIPPED {test}: the simulator was not built");
    }
    built
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
        eprintln!(
            "SKIPPED explicit_cuda_device_without_a_driver_is_a_clear_error_not_a_panic: this machine has libcuda"
        );
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

/// A running server on `--device sim` (the device forward on the CUDA-kernel simulator) answers
/// a completion with the same greedy text as `--device cpu`.
#[test]
fn serve_on_the_simulator_answers_like_the_cpu() {
    use std::io::{Read, Write};
    if !simulator_built("serve_on_the_simulator_answers_like_the_cpu") {
        return;
    }
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/tiny_llama");
    let complete = |device: &str, tp: &str| -> String {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut child = Command::new(env!("CARGO_BIN_EXE_wasmserve"))
            .args([
                "--device",
                device,
                "serve",
                "--model",
                model.to_str().unwrap(),
                "--port",
                &port.to_string(),
                "--kv-cache-memory",
                "4MiB",
                "--tensor-parallel-size",
                tp,
            ])
            .env_remove("WASMSERVE_DEVICE")
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start wasmserve serve");
        let body = r#"{"model":"tiny_llama","prompt":"hello world","max_tokens":6,"temperature":0}"#;
        let mut answer = String::new();
        for _ in 0..100 {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
                s.read_to_string(&mut answer).unwrap();
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
        let json =
            answer.split("\r\n\r\n").nth(1).unwrap_or_else(|| panic!("--device {device}: no HTTP answer: {answer:?}"));
        let v: serde_json::Value =
            serde_json::from_str(json.trim()).unwrap_or_else(|e| panic!("--device {device}: {e}: {json:?}"));
        v["choices"][0]["text"].as_str().unwrap_or_else(|| panic!("--device {device}: {v}")).to_string()
    };
    let cpu = complete("cpu", "1");
    assert_eq!(complete("sim", "1"), cpu);
    // Two simulated devices, one tensor-parallel rank each.
    assert_eq!(complete("sim", "2"), cpu);
}

/// `generate` on `--device sim` (one and two simulated devices) runs the device forward with a pool
/// sized for the request and prints the CPU's greedy text. The pool is f32 like the CPU's cache:
/// this random checkpoint's near-tied logits flip under bf16 K/V.
#[test]
fn generate_on_the_simulator_prints_the_cpus_text() {
    if !simulator_built("generate_on_the_simulator_prints_the_cpus_text") {
        return;
    }
    let run = |device: &str, tp: &str| {
        generate_text("tiny_llama", device, &["--tensor-parallel-size", tp, "--kv-cache-dtype", "f32"], None)
    };
    let cpu = run("cpu", "1");
    assert!(!cpu.trim().is_empty());
    assert_eq!(run("sim", "1"), cpu);
    assert_eq!(run("sim", "2"), cpu);
}

/// `generate --kv-cache-dtype` sizes the request's device pool in the asked storage (`auto` is
/// bf16 under the default `--dtype bfloat16`); every storage decodes the full 12 tokens.
#[test]
fn generate_on_the_simulator_allocates_the_asked_kv_cache_dtype() {
    if !simulator_built("generate_on_the_simulator_allocates_the_asked_kv_cache_dtype") {
        return;
    }
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/tiny_llama");
    for (asked, logged) in [("auto", "Bf16"), ("f32", "F32"), ("fp8", "Fp8E4m3")] {
        let out = wasmserve(&[
            "--device",
            "sim",
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "hello world",
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--kv-cache-dtype",
            asked,
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "--kv-cache-dtype {asked}: {err}");
        assert!(err.contains(&format!("device KV pool of {logged} allocated")), "--kv-cache-dtype {asked}: {err}");
        assert!(err.contains("12 generated"), "{err}");
    }
    let out = wasmserve(&[
        "--device",
        "sim",
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hi",
        "--kv-cache-dtype",
        "int3",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("unknown KV cache dtype 'int3'"), "{err}");
}

/// `bench engine` through the device forward (on the simulator): the engine is built with the
/// device pool, and a model with a short context (the tiny checkpoint's 128 positions) gets
/// prompts that fit it instead of a rejected request.
#[test]
fn bench_engine_runs_the_device_forward_within_the_models_context() {
    if !simulator_built("bench_engine_runs_the_device_forward_within_the_models_context") {
        return;
    }
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/tiny_llama");
    let out = wasmserve(&[
        "--device",
        "sim",
        "bench",
        "engine",
        "--model",
        model.to_str().unwrap(),
        "--concurrency",
        "1,2",
        "--steps",
        "2",
    ]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stderr.contains("K/V live in the device pool"), "{stderr}");
    assert!(
        stdout.contains("| aggregate decode, 2 streams |") && stdout.contains("| TTFT 126-token prompt, cold |"),
        "{stdout}"
    );
}

/// DeepSeek-V3 (MLA, MoE) through the command line on the simulator: `generate` with f32 dense
/// weights (`--dtype float32`: the CPU forward's numbers to summation order, so greedy text
/// must match) on one device and on two (`--tensor-parallel-size 2`: MLA heads and routed
/// experts split), and `bench engine` in the serving precision with the latent rows in the
/// device pool.
#[test]
fn deepseek_runs_on_the_simulator_like_the_cpu() {
    if !simulator_built("deepseek_runs_on_the_simulator_like_the_cpu") {
        return;
    }
    let run = |device: &str, tp: &str| {
        generate_text(
            "deepseek_v3/model",
            device,
            &["--dtype", "float32", "--tensor-parallel-size", tp],
            Some("DeepSeek-V3 weights uploaded to the device"),
        )
    };
    let cpu = run("cpu", "1");
    assert!(!cpu.trim().is_empty());
    assert_eq!(run("sim", "1"), cpu);
    assert_eq!(run("sim", "2"), cpu);

    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/deepseek_v3/model");
    let out = wasmserve(&[
        "--device",
        "sim",
        "bench",
        "engine",
        "--model",
        model.to_str().unwrap(),
        "--concurrency",
        "1,2",
        "--steps",
        "2",
    ]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stderr.contains("K/V live in the device pool"), "{stderr}");
    assert!(stdout.contains("| aggregate decode, 2 streams |"), "{stdout}");
}

/// Kimi-Linear (KDA state in a device slot, a NoPE MLA layer, MoE) through `generate` on the
/// simulator with f32 weights: the CPU's greedy text on one device and on two expert-parallel
/// ones (`--expert-parallel-size 2`: each device its own KDA states and latent rows); and, on a
/// copy with 3 MLA heads, on three tensor-parallel devices (`--tensor-parallel-size 3`: one KDA
/// and one MLA head per device).
#[test]
fn kimi_linear_generates_on_the_simulator_like_the_cpu() {
    if !simulator_built("kimi_linear_generates_on_the_simulator_like_the_cpu") {
        return;
    }
    let uploaded = Some("Kimi-Linear weights uploaded to the device");
    let run = |device: &str, ep: &str| {
        generate_text("kimi_linear/model", device, &["--dtype", "float32", "--expert-parallel-size", ep], uploaded)
    };
    let cpu = run("cpu", "1");
    assert!(!cpu.trim().is_empty());
    assert_eq!(run("sim", "1"), cpu);
    assert_eq!(run("sim", "2"), cpu);

    let three = common::kimi_linear_three_mla_heads("device");
    let run = |device: &str, tp: &str| {
        generate_text(three.to_str().unwrap(), device, &["--dtype", "float32", "--tensor-parallel-size", tp], uploaded)
    };
    let cpu = run("cpu", "1");
    assert_eq!(run("cpu", "3"), cpu);
    assert_eq!(run("sim", "3"), cpu);
    std::fs::remove_dir_all(&three).ok();
}

#[test]
fn a_bad_dtype_is_a_clear_error() {
    let out = wasmserve(&["--dtype", "float8", "generate", "--prompt", "hi"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("unknown dtype 'float8' (expected bfloat16 or float32)"), "{err}");
}
