//! What a quantize run may read: float checkpoints, and MXFP4 checkpoints in compressed-tensors
//! `mxfp4-pack-quantized` form (Kimi K3: `<m>.weight_packed` u8 `[out, in/2]` + `<m>.weight_scale`
//! u8 E8M0 `[out, in/32]`, docs/formats.md §2.3). MXFP4 Linear weights are decoded
//! to f32 one tensor at a time (the same decoder the model loader uses) and then requantized like
//! any float weight, so memory stays at one tensor.

use anyhow::{bail, Result};
use safetensors::Dtype;
use serde_json::Value;

use crate::model::format::hf_source::SafetensorsSource;
use crate::model::format::quant::mxfp4_linear::load_ct_mxfp4;
use crate::model::format::source::WeightSource;

/// How a Linear weight is stored in the source checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    /// `<m>.weight` in F32/F16/BF16.
    Float,
    /// `<m>.weight_packed` + `<m>.weight_scale` (MXFP4).
    Mxfp4,
}

/// Refuses source checkpoints whose quantization this command cannot decode. `None` or an
/// all-MXFP4 compressed-tensors config is accepted; anything else gets a one-line reason.
pub fn check_source_config(dir: &std::path::Path, cfg: &Value) -> Result<()> {
    let Some(q) = cfg.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(());
    };
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("(none)");
    if method == "compressed-tensors" {
        let global = q.get("format").and_then(Value::as_str);
        let groups = q.get("config_groups").and_then(Value::as_object);
        let formats: Vec<Option<&str>> = match groups {
            Some(g) if !g.is_empty() => {
                g.values().map(|grp| grp.get("format").and_then(Value::as_str).or(global)).collect()
            }
            _ => vec![global],
        };
        if formats.iter().all(|f| *f == Some("mxfp4-pack-quantized")) {
            return Ok(());
        }
        bail!(
            "{} is already quantized (compressed-tensors format {:?}); only mxfp4-pack-quantized sources can be requantized",
            dir.display(),
            formats.iter().flatten().collect::<Vec<_>>()
        );
    }
    if method == "mxfp4" {
        bail!(
            "{}: gpt-oss mxfp4 expert tensors (*_blocks/*_scales) are not supported as quantize input yet",
            dir.display()
        );
    }
    bail!("{} is already quantized (quant_method '{method}'); only float or mxfp4-pack-quantized sources can be quantized", dir.display())
}

/// `Some(module)` when `name` is the `weight_packed` half of an MXFP4 pair (u8 codes with a u8
/// `weight_scale` beside it); INT `pack-quantized` stores int32 and is never matched.
pub fn mxfp4_module<'a>(src: &SafetensorsSource, name: &'a str) -> Option<&'a str> {
    let module = name.strip_suffix(".weight_packed")?;
    let packed = src.raw(name).ok()?;
    let scale = src.raw(&format!("{module}.weight_scale")).ok()?;
    (packed.dtype == Dtype::U8 && scale.dtype == Dtype::U8 && packed.shape.len() == 2).then_some(module)
}

/// True for the `weight_scale` half of an MXFP4 pair (consumed with its `weight_packed`).
pub fn is_mxfp4_scale(src: &SafetensorsSource, name: &str) -> bool {
    name.strip_suffix(".weight_scale").is_some_and(|m| mxfp4_module(src, &format!("{m}.weight_packed")).is_some())
}

/// The weight of `module` as f32 `[rows, cols]`, decoded if stored as MXFP4.
pub fn load_f32(src: &SafetensorsSource, module: &str, rows: usize, cols: usize, stored: Stored) -> Result<Vec<f32>> {
    Ok(match stored {
        Stored::Float => src.load(&format!("{module}.weight"), &[rows, cols])?.as_slice().to_vec(),
        Stored::Mxfp4 => {
            let m = load_ct_mxfp4(src, module, rows, cols)?;
            let mut w = Vec::with_capacity(rows * cols);
            for r in 0..rows {
                w.extend_from_slice(&m.dequantize_row(r));
            }
            w
        }
    })
}
