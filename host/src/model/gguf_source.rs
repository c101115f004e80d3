//! Weights from a GGUF file, presented under Hugging Face tensor names and layouts.

use std::path::PathBuf;

use super::error::LoadError;
use super::ggml::{dequantize, GgmlType};
use super::gguf::{GgufFile, MetaValue};
use super::source::{check_shape, WeightSource};
use super::tensor::Tensor;

pub struct GgufSource {
    pub file: GgufFile,
    n_heads: usize,
    n_kv_heads: usize,
}

/// Maps a Hugging Face Llama tensor name to its GGUF name.
fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, leaf) = rest.split_once('.')?;
    let leaf = match leaf {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{leaf}"))
}

/// llama.cpp's converter permutes Q/K rows so RoPE can rotate adjacent pairs; Hugging Face rotates
/// the two halves of each head. Undo it: GGUF row `h*d + 2i + j` holds HF row `h*d + j*d/2 + i`.
fn unpermute_rows(data: &[f32], n_heads: usize, cols: usize) -> Vec<f32> {
    let rows = data.len() / cols;
    let d = rows / n_heads;
    let mut out = vec![0.0; data.len()];
    for h in 0..n_heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let src = h * d + 2 * i + j;
                let dst = h * d + j * (d / 2) + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

impl GgufSource {
    pub fn new(file: GgufFile) -> Self {
        let arch = file.meta("general.architecture").and_then(MetaValue::as_str).unwrap_or("llama").to_string();
        let n_heads = file.meta(&format!("{arch}.attention.head_count")).and_then(MetaValue::as_u64).unwrap_or(1) as usize;
        let n_kv_heads = file.meta(&format!("{arch}.attention.head_count_kv")).and_then(MetaValue::as_u64).map(|v| v as usize).unwrap_or(n_heads);
        Self { file, n_heads, n_kv_heads }
    }
}

impl WeightSource for GgufSource {
    fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
        let path = &self.file.path;
        let gname = gguf_name(name).unwrap_or_else(|| name.to_string());
        let info = self.file.tensor(&gname).ok_or_else(|| LoadError::MissingTensor { file: path.clone(), tensor: gname.clone() })?;
        let tshape = info.torch_shape();
        check_shape(path, &gname, &tshape, shape)?;
        let bytes = self.file.tensor_bytes(info);
        let n = info.n_elements() as usize;
        let permute_heads = if name.ends_with("self_attn.q_proj.weight") {
            Some(self.n_heads)
        } else if name.ends_with("self_attn.k_proj.weight") {
            Some(self.n_kv_heads)
        } else {
            None
        };
        if info.ggml_type == GgmlType::F32 && permute_heads.is_none() {
            if let Some(t) = Tensor::mapped(tshape.clone(), self.file.mmap(), info.offset, n) {
                return Ok(t);
            }
        }
        let mut data = vec![0.0f32; n];
        dequantize(info.ggml_type, bytes, &mut data).map_err(|detail| LoadError::BadTensor { file: path.clone(), tensor: gname.clone(), detail })?;
        if let Some(heads) = permute_heads {
            data = unpermute_rows(&data, heads, *tshape.last().unwrap_or(&1));
        }
        Ok(Tensor::owned(tshape, data))
    }

    fn contains(&self, name: &str) -> bool {
        self.file.tensor(&gguf_name(name).unwrap_or_else(|| name.to_string())).is_some()
    }

    fn file_of(&self, _name: &str) -> PathBuf {
        self.file.path.clone()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // HF layout: 2 heads of dim 4, 1 column; llama.cpp permute: reshape(h, 2, d/2).swap(1,2).
        let hf: Vec<f32> = (0..8).map(|v| v as f32).collect();
        let mut gguf = vec![0.0; 8];
        for h in 0..2 {
            for i in 0..2 {
                for j in 0..2 {
                    gguf[h * 4 + 2 * i + j] = hf[h * 4 + j * 2 + i];
                }
            }
        }
        assert_eq!(super::unpermute_rows(&gguf, 2, 1), hf);
    }

    #[test]
    fn names_map_to_gguf() {
        assert_eq!(super::gguf_name("model.layers.3.mlp.down_proj.weight").unwrap(), "blk.3.ffn_down.weight");
        assert_eq!(super::gguf_name("model.embed_tokens.weight").unwrap(), "token_embd.weight");
    }
}
