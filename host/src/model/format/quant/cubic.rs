//! Loading the Cubic format (docs/cubic-format.md): `quantization_config` with
//! `quant_method: "cubic"` listing each quantized module's bits and group size, and per module
//! `cubic_codes` (u8 bit streams), `cubic_scale` and `cubic_shape` (f16 per group).

use std::collections::BTreeMap;

use kernels::cpu::bitpack::{row_bytes, PackedRows};
use kernels::cpu::cubic::AnyCubic;
use kernels::cpu::packed_matmul::LANES;
use safetensors::Dtype;
use serde_json::Value;

use crate::model::error::LoadError;
use crate::model::format::hf_source::SafetensorsSource;
use crate::model::format::quant::ct_linear::floats;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CubicLayer {
    pub bits: u32,
    pub group_size: usize,
}

#[derive(Clone, Debug, Default)]
pub struct CubicConfig {
    pub modules: BTreeMap<String, CubicLayer>,
}

impl CubicConfig {
    /// Parses `quantization_config`; `Ok(None)` when it is not a Cubic config.
    pub fn parse(q: &Value) -> Result<Option<Self>, String> {
        if q.get("quant_method").and_then(Value::as_str) != Some("cubic") {
            return Ok(None);
        }
        match q.get("version").and_then(Value::as_u64) {
            Some(1) => {}
            v => return Err(format!("cubic version {v:?} is not supported (1)")),
        }
        let mut modules = BTreeMap::new();
        for (name, m) in q.get("modules").and_then(Value::as_object).ok_or("cubic: modules is missing")? {
            let bits = m.get("bits").and_then(Value::as_u64).unwrap_or(0) as u32;
            let group_size = m.get("group_size").and_then(Value::as_u64).unwrap_or(0) as usize;
            if !(1..=8).contains(&bits) {
                return Err(format!("cubic module '{name}': bits {bits} outside 1..=8"));
            }
            if !(32..=1024).contains(&group_size) || !group_size.is_multiple_of(LANES) {
                return Err(format!(
                    "cubic module '{name}': group_size {group_size} must be a multiple of {LANES} in 32..=1024"
                ));
            }
            modules.insert(name.clone(), CubicLayer { bits, group_size });
        }
        Ok(Some(Self { modules }))
    }
}

pub fn load_cubic(
    src: &SafetensorsSource,
    module: &str,
    rows: usize,
    cols: usize,
    layer: CubicLayer,
) -> Result<AnyCubic, LoadError> {
    let groups = cols.div_ceil(layer.group_size);
    let codes_name = format!("{module}.cubic_codes");
    let codes = src.raw(&codes_name)?;
    let stride = row_bytes(cols, layer.bits);
    let bad = |t: &str, file: &std::path::Path, detail: String| LoadError::BadTensor {
        file: file.to_path_buf(),
        tensor: t.to_string(),
        detail,
    };
    if codes.dtype != Dtype::U8 || codes.shape != [rows, stride] {
        return Err(bad(
            &codes_name,
            codes.file,
            format!(
                "{:?} {:?}, expected U8 [{rows}, {stride}] for {}-bit codes of {cols} inputs",
                codes.dtype, codes.shape, layer.bits
            ),
        ));
    }
    let mut params = Vec::new();
    for leaf in ["cubic_scale", "cubic_shape"] {
        let n = format!("{module}.{leaf}");
        let t = src.raw(&n)?;
        if t.dtype != Dtype::F16 || t.shape != [rows, groups] {
            return Err(bad(&n, t.file, format!("{:?} {:?}, expected F16 [{rows}, {groups}]", t.dtype, t.shape)));
        }
        params.push(floats(&t, &n)?);
    }
    Ok(AnyCubic::new(
        PackedRows::new(layer.bits, rows, cols, stride, codes.bytes),
        layer.group_size,
        &params[0],
        &params[1],
    ))
}
