//! Run-time compilation of the kernel sources with NVRTC, with an on-disk PTX cache.
//!
//! libnvrtc is dlopen-ed (cudarc's dynamic loading). cudarc panics when the library is missing, so
//! [`nvrtc_available`] looks for it first and every call into cudarc runs under `catch_unwind`:
//! a missing or broken NVRTC is an error value, never a crash.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use super::sources::Source;
use super::CudaError;

/// The file names cudarc tries for libnvrtc (the first that loads wins; LD_LIBRARY_PATH applies).
fn nvrtc_candidates() -> Vec<String> {
    cudarc::get_lib_name_candidates("nvrtc")
}

/// `Ok(library name)` when a libnvrtc can be loaded, else why not.
pub fn nvrtc_available() -> Result<String, CudaError> {
    for name in nvrtc_candidates() {
        // SAFETY: loading a shared library runs its initialisers; libnvrtc's are benign.
        if unsafe { libloading::Library::new(&name) }.is_ok() {
            return Ok(name);
        }
    }
    Err(CudaError::LibraryMissing {
        lib: "nvrtc",
        hint: "install the CUDA toolkit or the `nvidia-cuda-nvrtc-cu12` wheel and put its lib/ on LD_LIBRARY_PATH",
    })
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    nvrtc_available()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints through valid pointers.
    let rc = guarded("nvrtcVersion", || unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) })?;
    if rc != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Nvrtc { source_name: "-".into(), log: format!("nvrtcVersion: {rc:?}") });
    }
    Ok((major, minor))
}

/// Compiles one source to PTX for `arch` (e.g. `"sm_90"`).
pub fn compile(src: &Source, arch: &'static str) -> Result<String, CudaError> {
    nvrtc_available()?;
    let text = src.full_text();
    let opts = CompileOptions {
        arch: Some(arch),
        name: Some(src.name.to_string()),
        // Full-precision division and sqrt: the CPU references are IEEE.
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(true),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let ptx = guarded("nvrtc compile", || compile_ptx_with_opts(&text, opts))?.map_err(|e| CudaError::Nvrtc {
        source_name: src.name.to_string(),
        log: match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        },
    })?;
    Ok(ptx.to_src())
}

/// Runs `f`, turning a panic inside cudarc (missing symbol, missing library) into an error.
pub fn guarded<T>(what: &'static str, f: impl FnOnce() -> T) -> Result<T, CudaError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        CudaError::Panicked { what, msg }
    })
}

/// Compiled PTX kept on disk, keyed by a hash of (source text, arch, NVRTC version), so start-up
/// compiles each kernel file once per machine and toolkit rather than on every launch.
pub struct PtxCache {
    dir: PathBuf,
}

impl PtxCache {
    /// `$WASMSERVE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/wasmserve/ptx`, else `~/.cache/wasmserve/ptx`.
    pub fn default_dir() -> PathBuf {
        if let Some(d) = std::env::var_os("WASMSERVE_KERNEL_CACHE") {
            return d.into();
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(std::env::temp_dir);
        base.join("wasmserve").join("ptx")
    }

    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    /// The cache file for `src` on `arch` with NVRTC `version`.
    pub fn path(&self, src: &Source, arch: &str, version: (i32, i32)) -> PathBuf {
        let key = fnv1a(format!("{}\0{arch}\0{}.{}", src.full_text(), version.0, version.1).as_bytes());
        self.dir.join(format!("{}-{arch}-{key:016x}.ptx", src.name.trim_end_matches(".cu")))
    }

    /// PTX for `src`, from the cache or freshly compiled (and then stored; a cache that cannot be
    /// written only costs a recompile next time, so that is logged, not fatal).
    pub fn get_or_compile(&self, src: &Source, arch: &'static str) -> Result<String, CudaError> {
        let version = nvrtc_version()?;
        let path = self.path(src, arch, version);
        if let Ok(ptx) = std::fs::read_to_string(&path) {
            tracing::debug!(file = %path.display(), "PTX cache hit");
            return Ok(ptx);
        }
        let t = std::time::Instant::now();
        let ptx = compile(src, arch)?;
        tracing::info!(
            source = src.name,
            arch,
            ms = t.elapsed().as_millis() as u64,
            "compiled kernel source with NVRTC"
        );
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let stored = std::fs::create_dir_all(&self.dir)
            .and_then(|_| std::fs::write(&tmp, &ptx))
            .and_then(|_| std::fs::rename(&tmp, &path));
        if let Err(e) = stored {
            tracing::warn!(dir = %self.dir.display(), error = %e, "could not store compiled PTX");
        }
        Ok(ptx)
    }
}

/// 64-bit FNV-1a: a stable content hash for cache file names (not security relevant).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::sources::SOURCES;
    use std::path::Path;

    /// Skips (saying so) when libnvrtc is absent, unless `WASMSERVE_REQUIRE_NVRTC=1` (CI sets it
    /// after installing the NVRTC wheel, so there a missing library fails the test).
    pub(crate) fn nvrtc_or_skip(test: &str) -> bool {
        match nvrtc_available() {
            Ok(_) => true,
            Err(e) if std::env::var_os("WASMSERVE_REQUIRE_NVRTC").is_some_and(|v| v == "1") => panic!("{test}: {e}"),
            Err(e) => {
                eprintln!("SKIPPED {test}: {e}");
                false
            }
        }
    }

    /// The real check that the kernels are valid CUDA: every source compiles to PTX with zero
    /// errors for Hopper, Ampere and Turing (which takes the no-MMA fallbacks), and the PTX has an
    /// entry per kernel. With `ptxas` (`WASMSERVE_PTXAS`, as scripts/setup-nvrtc installs it)
    /// the PTX is also assembled for its arch: NVRTC passes inline PTX (the tensor-core MMAs)
    /// through unchecked, so only the assembler, or the driver at load time, would reject it.
    #[test]
    fn every_kernel_source_compiles_with_nvrtc() {
        if !nvrtc_or_skip("every_kernel_source_compiles_with_nvrtc") {
            return;
        }
        let version = nvrtc_version().unwrap();
        eprintln!("NVRTC {}.{}", version.0, version.1);
        let ptxas = std::env::var_os("WASMSERVE_PTXAS").map(PathBuf::from);
        if ptxas.is_none() {
            eprintln!("(WASMSERVE_PTXAS unset: the PTX is not assembled)");
        }
        let dir = std::env::temp_dir().join(format!("wasmserve-ptxas-{}", std::process::id()));
        for arch in ["sm_90", "sm_80", "sm_75"] {
            for src in SOURCES {
                let ptx = compile(src, arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
                for k in src.kernels {
                    assert!(ptx.contains(&format!(".entry {k}(")), "{}: no PTX entry for {k} on {arch}", src.name);
                }
                if let Some(ptxas) = &ptxas {
                    assemble(ptxas, &dir, src.name, arch, &ptx);
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `ptxas -arch=<arch> -v` on one source's PTX; a failure shows the assembler's log. Every
    /// kernel must assemble without register spills: a spill is local-memory traffic in the
    /// inner loops, which only a GPU profile would otherwise reveal (the heaviest kernels are
    /// sized to their `__launch_bounds__`, and a change that no longer fits must say so here).
    fn assemble(ptxas: &Path, dir: &Path, name: &str, arch: &str, ptx: &str) {
        std::fs::create_dir_all(dir).unwrap();
        let file = dir.join(format!("{}-{arch}.ptx", name.trim_end_matches(".cu")));
        std::fs::write(&file, ptx).unwrap();
        let out = std::process::Command::new(ptxas)
            .arg(format!("-arch={arch}"))
            .arg("-v")
            .arg(&file)
            .arg("-o")
            .arg(file.with_extension("cubin"))
            .output();
        let out = out.unwrap_or_else(|e| panic!("run {}: {e}", ptxas.display()));
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "ptxas {name} for {arch}:\n{log}");
        for usage in register_usage(&log) {
            assert_eq!(
                usage.spill_bytes, 0,
                "{} on {arch} spills {} bytes of registers:\n{log}",
                usage.kernel, usage.spill_bytes
            );
            if arch == "sm_90" && usage.registers > 96 {
                eprintln!("{arch} {}: {} registers", usage.kernel, usage.registers);
            }
        }
    }

    struct RegisterUsage {
        kernel: String,
        registers: u32,
        spill_bytes: u32,
    }

    /// Per kernel of a `ptxas -v` log: registers used and spill stores + loads in bytes.
    fn register_usage(log: &str) -> Vec<RegisterUsage> {
        let number_before = |line: &str, label: &str| -> Option<u32> {
            line.split(label).next()?.split_whitespace().last()?.parse().ok()
        };
        let mut found: Vec<RegisterUsage> = Vec::new();
        for line in log.lines() {
            if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                let kernel = rest.split('\'').next().unwrap_or_default().to_string();
                found.push(RegisterUsage { kernel, registers: 0, spill_bytes: 0 });
            } else if let Some(last) = found.last_mut() {
                if line.contains("spill stores") {
                    last.spill_bytes = number_before(line, "bytes spill stores").unwrap_or(0)
                        + number_before(line, "bytes spill loads").unwrap_or(0);
                } else if line.contains("Used ") {
                    last.registers = number_before(line, "registers").unwrap_or(0);
                }
            }
        }
        found
    }

    #[test]
    fn register_usage_reads_ptxas_verbose_output() {
        let log = "ptxas info    : Compiling entry function 'a' for 'sm_90'
ptxas info    : Function properties for a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 127 registers, used 1 barriers, 35200 bytes smem
ptxas info    : Compiling entry function 'b' for 'sm_90'
ptxas info    : Function properties for b
    40 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, 380 bytes cmem[0]";
        let usage = register_usage(log);
        assert_eq!(usage.len(), 2);
        assert_eq!((usage[0].kernel.as_str(), usage[0].registers, usage[0].spill_bytes), ("a", 127, 0));
        assert_eq!((usage[1].kernel.as_str(), usage[1].registers, usage[1].spill_bytes), ("b", 255, 40));
    }

    #[test]
    fn a_compile_error_is_reported_with_the_log_not_a_panic() {
        if !nvrtc_or_skip("a_compile_error_is_reported_with_the_log_not_a_panic") {
            return;
        }
        let bad = Source {
            name: "bad.cu",
            code: "extern \"C\" __global__ void k() { undeclared_thing(); }",
            kernels: &["k"],
        };
        match compile(&bad, "sm_90") {
            Err(CudaError::Nvrtc { source_name, log }) => {
                assert_eq!(source_name, "bad.cu");
                assert!(log.contains("undeclared_thing"), "{log}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }

    #[test]
    fn the_cache_compiles_once_then_hits() {
        if !nvrtc_or_skip("the_cache_compiles_once_then_hits") {
            return;
        }
        let dir = std::env::temp_dir().join(format!("wasmserve-ptx-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache = PtxCache::new(dir.clone());
        let src = &SOURCES[0];
        let first = cache.get_or_compile(src, "sm_90").unwrap();
        let path = cache.path(src, "sm_90", nvrtc_version().unwrap());
        assert!(path.exists());
        // A planted file under the key is returned as is: proof the second call read the cache.
        std::fs::write(&path, "// cached").unwrap();
        assert_eq!(cache.get_or_compile(src, "sm_90").unwrap(), "// cached");
        assert_ne!(first, "// cached");
        // Another arch is another key.
        assert_ne!(cache.path(src, "sm_80", nvrtc_version().unwrap()), path);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
