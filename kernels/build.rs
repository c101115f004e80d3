//! Compiles the CPU simulator (kernels/sim) and, with it, every CUDA source listed in
//! src/cuda/sources.rs for the host, so `crate::sim::SimRuntime` can run the real kernels without a
//! GPU. Each source is wrapped in its own namespace (CUDA modules are separate, so two sources may
//! define the same helper) after the same prelude NVRTC gets, and a registry of its `extern "C"`
//! kernels is generated from their `__global__` declarations.
//!
//! Without a C++ compiler the build still succeeds: it warns and leaves `cfg(wasmserve_sim)` unset,
//! and the simulator tests skip (or fail under `WASMSERVE_REQUIRE_SIM=1`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rustc-check-cfg=cfg(wasmserve_sim)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src/cuda/sources.rs");
    println!("cargo::rerun-if-changed=cuda");
    println!("cargo::rerun-if-changed=sim");
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());

    let listed = std::fs::read_to_string(root.join("src/cuda/sources.rs")).expect("read src/cuda/sources.rs");
    let mut sources: Vec<PathBuf> = listed_sources(&listed).into_iter().map(|f| root.join("cuda").join(f)).collect();
    // Test-only kernels for the simulator's own barrier/shuffle/deadlock tests.
    sources.push(root.join("sim/selftest.cu"));

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .warnings(false)
        .flag("-ffp-contract=off")
        .include(root.join("sim"))
        .include(root.join("cuda"));
    let compiler = match build.try_get_compiler() {
        Ok(c) if std::process::Command::new(c.path()).arg("--version").output().is_ok_and(|o| o.status.success()) => c,
        _ => {
            println!(
                "cargo::warning=no C++ compiler found: the CUDA simulator is not built and its tests will be SKIPPED"
            );
            return;
        }
    };
    let _ = compiler;

    let mut registry = String::from("#include \"cuda_sim.h\"\n");
    let mut tables = Vec::new();
    for src in &sources {
        for f in [src.clone(), root.join("cuda/prelude.cuh")] {
            println!("cargo::rerun-if-changed={}", f.display());
        }
        let code = std::fs::read_to_string(src).unwrap_or_else(|e| panic!("read {}: {e}", src.display()));
        let stem = src.file_stem().unwrap().to_str().unwrap().replace(|c: char| !c.is_ascii_alphanumeric(), "_");
        let ns = format!("wsim_{stem}");
        let table = format!("wsim_entries_{stem}");
        let mut w = String::new();
        // The simulator compiles a copy whose `__shared__` declarations poison their variables
        // for each block (cuda_sim.h, fresh_shared); NVRTC gets the source as written.
        let copy = out.join(format!("sim_src_{stem}.cu"));
        write_if_changed(&copy, &with_fresh_shared(&code, src));
        writeln!(
            w,
            "#include \"cuda_sim.h\"\nnamespace {ns} {{\n#include \"prelude.cuh\"\n#include \"{}\"\n}}",
            copy.display()
        )
        .unwrap();
        writeln!(w, "extern \"C\" const cuda_sim::Entry {table}[] = {{").unwrap();
        for k in kernel_names(&code) {
            writeln!(w, "    {{\"{k}\", &cuda_sim::invoke<&{ns}::{k}>, cuda_sim::signature(&{ns}::{k})}},").unwrap();
        }
        writeln!(w, "    {{nullptr, nullptr, nullptr}},\n}};").unwrap();
        let file = out.join(format!("sim_{stem}.cpp"));
        write_if_changed(&file, &w);
        build.file(&file);
        writeln!(registry, "extern \"C\" const cuda_sim::Entry {table}[];").unwrap();
        tables.push(table);
    }
    writeln!(registry, "extern \"C\" const cuda_sim::Entry* const wsim_tables[] = {{{}, nullptr}};", tables.join(", "))
        .unwrap();
    let reg = out.join("sim_registry.cpp");
    write_if_changed(&reg, &registry);
    build.file(&reg).file(root.join("sim/sim.cpp"));
    // A compiler that exists but rejects the sources is a real error (a .cu the simulator cannot
    // compile), not a reason to skip.
    build.compile("wasmserve_cuda_sim");
    println!("cargo::rustc-cfg=wasmserve_sim");
}

/// `code` with a `cuda_sim::fresh_shared` call for each variable of every `__shared__`
/// declaration, placed right after the declaration's `;` on the same line (a `#line` at the top and
/// no added lines keep `__FILE__`/`__LINE__`, which the simulator's errors report, the source's).
/// A declaration must fit on one line; one that does not stops the build instead of going unpoisoned.
fn with_fresh_shared(code: &str, src: &Path) -> String {
    let mut out = format!("#line 1 \"{}\"\n", src.display());
    for (n, line) in code.lines().enumerate() {
        match line.trim_start().strip_prefix("__shared__ ") {
            None => out.push_str(line),
            Some(decl) => {
                let end = line.find(';').unwrap_or_else(|| {
                    panic!("{}:{}: a __shared__ declaration must end on its line", src.display(), n + 1)
                });
                let decl = &decl[..decl.find(';').unwrap()];
                out.push_str(&line[..=end]);
                for name in declared_names(decl) {
                    write!(out, " cuda_sim::fresh_shared(&{name}, sizeof({name}));").unwrap();
                }
                out.push_str(&line[end + 1..]);
            }
        }
        out.push('\n');
    }
    out
}

/// The variables `float a[N], b[M][K]` declares (what follows `__shared__`, up to its `;`).
fn declared_names(decl: &str) -> Vec<String> {
    decl.split(',')
        .map(|d| {
            let head = d.split('[').next().unwrap().trim_end();
            let name: String = head.chars().rev().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            name.chars().rev().collect()
        })
        .collect()
}

/// The file names in `src!("name.cu", [...])` entries.
fn listed_sources(text: &str) -> Vec<String> {
    // rustfmt may put the file name on its own line: `src!(\n    "name.cu",`.
    text.split("src!(")
        .skip(1)
        .filter_map(|rest| rest.trim_start().strip_prefix('"')?.split('"').next())
        .filter(|f| f.ends_with(".cu"))
        .map(str::to_string)
        .collect()
}

/// Names of the kernels a source defines: `extern "C" __global__ void NAME(`.
fn kernel_names(code: &str) -> Vec<String> {
    code.split("__global__ void ")
        .skip(1)
        .filter_map(|rest| {
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            rest[name.len()..].trim_start().starts_with('(').then_some(name)
        })
        .collect()
}

fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
}
