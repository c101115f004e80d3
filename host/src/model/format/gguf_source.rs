//! Weights from a GGUF file, presented under Hugging Face tensor names and layouts.

use std::path::PathBuf;

use crate::model::error::LoadError;
use crate::model::format::ggml::{dequantize, GgmlType};
use crate::model::format::gguf::{GgufFile, GgufTensorInfo, MetaValue};
use crate::model::format::gguf_packed::{int_matrix, packable};
use crate::model::format::quant::int_linear::IntLinear;
use crate::model::format::source::{check_shape, WeightSource};
use crate::model::layers::linear::Linear;
use crate::model::tensor::Tensor;

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
/// the two halves of each head. Undone by reading HF row `h*d + j*d/2 + i` from GGUF row
/// `h*d + 2i + j` (`d` the head's rows): this is the GGUF row of HF row `row`.
fn gguf_row(row: usize, n_heads: usize, rows: usize) -> usize {
    let d = rows / n_heads;
    let (h, r) = (row / d, row % d);
    h * d + 2 * (r % (d / 2)) + r / (d / 2)
}

fn unpermute_rows(data: &[f32], n_heads: usize, cols: usize) -> Vec<f32> {
    let rows = data.len() / cols;
    let mut out = vec![0.0; data.len()];
    for (dst, row) in out.chunks_exact_mut(cols).enumerate() {
        let src = gguf_row(dst, n_heads, rows);
        row.copy_from_slice(&data[src * cols..(src + 1) * cols]);
    }
    out
}

impl GgufSource {
    pub fn new(file: GgufFile) -> Self {
        let arch = file.meta("general.architecture").and_then(MetaValue::as_str).unwrap_or("llama").to_string();
        let n_heads =
            file.meta(&format!("{arch}.attention.head_count")).and_then(MetaValue::as_u64).unwrap_or(1) as usize;
        let n_kv_heads = file
            .meta(&format!("{arch}.attention.head_count_kv"))
            .and_then(MetaValue::as_u64)
            .map(|v| v as usize)
            .unwrap_or(n_heads);
        Self { file, n_heads, n_kv_heads }
    }

    /// The heads whose rows llama.cpp permuted in tensor `name` (HF name): Q and K only.
    fn permuted_heads(&self, name: &str) -> Option<usize> {
        if name.ends_with("self_attn.q_proj.weight") {
            Some(self.n_heads)
        } else if name.ends_with("self_attn.k_proj.weight") {
            Some(self.n_kv_heads)
        } else {
            None
        }
    }

    fn info(&self, name: &str) -> Result<(String, &GgufTensorInfo), LoadError> {
        let gname = gguf_name(name).unwrap_or_else(|| name.to_string());
        let info = self
            .file
            .tensor(&gname)
            .ok_or_else(|| LoadError::MissingTensor { file: self.file.path.clone(), tensor: gname.clone() })?;
        Ok((gname, info))
    }
}

impl WeightSource for GgufSource {
    fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
        let path = &self.file.path;
        let (gname, info) = self.info(name)?;
        let tshape = info.torch_shape();
        check_shape(path, &gname, &tshape, shape)?;
        let bytes = self.file.tensor_bytes(info);
        let n = info.n_elements() as usize;
        let permute_heads = self.permuted_heads(name);
        if info.ggml_type == GgmlType::F32 && permute_heads.is_none() {
            if let Some(t) = Tensor::mapped(tshape.clone(), self.file.mmap(), info.offset, n) {
                return Ok(t);
            }
        }
        let mut data = vec![0.0f32; n];
        dequantize(info.ggml_type, bytes, &mut data).map_err(|detail| LoadError::BadTensor {
            file: path.clone(),
            tensor: gname.clone(),
            detail,
        })?;
        if let Some(heads) = permute_heads {
            data = unpermute_rows(&data, heads, *tshape.last().unwrap_or(&1));
        }
        Ok(Tensor::owned(tshape, data))
    }

    /// Q4_0 / Q4_1 / Q8_0 layers stay packed ([`super::gguf_packed`]); others load dense.
    fn linear(&self, module: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
        let name = format!("{module}.weight");
        let (gname, info) = self.info(&name)?;
        if packable(info.ggml_type) {
            check_shape(&self.file.path, &gname, &info.torch_shape(), &[rows, cols])?;
            let heads = self.permuted_heads(&name);
            let source_row = |r: usize| heads.map_or(r, |h| gguf_row(r, h, rows));
            let packed = int_matrix(info.ggml_type, self.file.tensor_bytes(info), rows, cols, source_row)
                .map_err(|detail| LoadError::BadTensor { file: self.file.path.clone(), tensor: gname, detail })?;
            if let Some(m) = packed {
                return Ok(Linear::Int(IntLinear::new(m, None)));
            }
        }
        self.load(&name, &[rows, cols]).map(Linear::Dense)
    }

    fn keeps_packed(&self, name: &str) -> bool {
        self.info(name).is_ok_and(|(_, info)| packable(info.ggml_type))
    }

    fn contains(&self, name: &str) -> bool {
        self.info(name).is_ok()
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
