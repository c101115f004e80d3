//! The CUDA C sources in `kernels/cuda/`, embedded in the binary so a deployed server compiles
//! them with NVRTC at start-up without needing the source tree.

/// Prepended to every source (shared helpers; see the file's own comment).
pub const PRELUDE: &str = include_str!("../../cuda/prelude.cuh");

/// One `.cu` file and the `extern "C"` kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    pub name: &'static str,
    pub code: &'static str,
    pub kernels: &'static [&'static str],
}

impl Source {
    /// The text handed to NVRTC: the prelude, then the file.
    pub fn full_text(&self) -> String {
        format!("{PRELUDE}\n#line 1 \"{}\"\n{}", self.name, self.code)
    }
}

macro_rules! src {
    ($file:literal, [$($k:literal),* $(,)?]) => {
        Source { name: $file, code: include_str!(concat!("../../cuda/", $file)), kernels: &[$($k),*] }
    };
}

pub const SOURCES: &[Source] = &[
    src!("int_gemv.cu", ["int_gemv", "int4_gemv", "moe_int_gemv", "moe_int4_gemv"]),
    src!("cubic_gemv.cu", ["cubic_gemv", "moe_cubic_gemv"]),
    src!("mxfp4_gemv.cu", ["mxfp4_gemv", "moe_mxfp4_gemv"]),
    src!("dequant.cu", ["dequant_int_bf16", "dequant_cubic_bf16", "dequant_mxfp4_bf16", "f32_to_bf16_rows"]),
    src!("norm.cu", ["rms_norm", "add_rms_norm"]),
    src!("rope.cu", ["rope_neox"]),
    src!("swiglu.cu", ["silu_mul", "situ_mul"]),
    src!("attn_res.cu", ["attn_res_mix", "add_f32"]),
    src!(
        "paged_attention.cu",
        [
            "paged_attention_f32",
            "paged_attention_bf16",
            "paged_attention_fp8",
            "paged_prefill_f32",
            "paged_prefill_bf16",
            "paged_prefill_fp8",
            "paged_flash_prefill_bf16",
            "paged_flash_prefill_fp8",
            "mla_attention_f32",
            "mla_attention_bf16",
            "mla_attention_fp8",
            "mla_combine",
            "mla_flash_prefill_bf16",
            "mla_flash_prefill_fp8"
        ]
    ),
    src!("sampling.cu", ["sample_top_k_top_p"]),
    src!(
        "moe.cu",
        [
            "moe_count",
            "moe_offsets",
            "moe_scatter",
            "moe_tiles",
            "moe_gather_bf16",
            "moe_scatter_rows",
            "moe_gemv_bf16",
            "moe_gemv_f32",
            "matmul_f32",
            "moe_route",
            "moe_combine"
        ]
    ),
    src!("gather.cu", ["gather_rows_f32", "gather_rows_bf16", "narrow_bf16"]),
    src!(
        "kv_write.cu",
        [
            "kv_write_f32",
            "kv_write_bf16",
            "kv_write_fp8",
            "copy_span_f32",
            "copy_span_u16",
            "copy_span_u8",
            "kv_store_f32",
            "kv_store_bf16",
            "kv_store_fp8"
        ]
    ),
    src!("mla.cu", ["copy_cols", "rope_rows", "head_matvec_bf16", "head_matvec_f32", "sigmoid_mul"]),
    src!("kda.cu", ["kda_conv_silu", "kda_recurrent", "zero_span_f32"]),
];

pub fn source(name: &str) -> Option<&'static Source> {
    SOURCES.iter().find(|s| s.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `.cu` file in kernels/cuda is listed (a new file must not silently go uncompiled),
    /// and every listed kernel is defined `extern "C"` in its file.
    #[test]
    fn every_source_file_is_listed_and_declares_its_kernels() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let mut listed: Vec<String> = SOURCES.iter().map(|s| s.name.to_string()).collect();
        listed.sort();
        assert_eq!(on_disk, listed);
        for s in SOURCES {
            for k in s.kernels {
                assert!(s.code.contains(&format!("__global__ void {k}(")), "{} does not define {k}", s.name);
            }
        }
    }
}
