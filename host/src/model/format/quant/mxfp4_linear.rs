//! MXFP4 weights from checkpoints (docs/formats.md §2): compressed-tensors `mxfp4-pack-quantized`
//! (`weight_packed` u8 `[out, in/2]`, `weight_scale` u8 E8M0 `[out, in/32]`) and gpt-oss expert
//! tensors (`*_blocks` u8 `[E, out, in/32, 16]`, `*_scales` u8 `[E, out, in/32]`). Both store the
//! same bytes per row, so both become the same `Mxfp4Matrix`.

use kernels::cpu::mxfp4::{Mxfp4Matrix, BLOCK};
use safetensors::Dtype;

use crate::model::error::LoadError;
use crate::model::format::hf_source::{RawTensor, SafetensorsSource};

fn check(t: &RawTensor, name: &str, shape: &[usize]) -> Result<(), LoadError> {
    if t.dtype != Dtype::U8 || t.shape != shape {
        return Err(LoadError::BadTensor {
            file: t.file.to_path_buf(),
            tensor: name.to_string(),
            detail: format!("{:?} {:?}, expected U8 {shape:?}", t.dtype, t.shape),
        });
    }
    Ok(())
}

/// compressed-tensors `mxfp4-pack-quantized` Linear `module` of `[rows, cols]`.
pub fn load_ct_mxfp4(
    src: &SafetensorsSource,
    module: &str,
    rows: usize,
    cols: usize,
) -> Result<Mxfp4Matrix, LoadError> {
    let (pn, sn) = (format!("{module}.weight_packed"), format!("{module}.weight_scale"));
    let (p, s) = (src.raw(&pn)?, src.raw(&sn)?);
    if !cols.is_multiple_of(BLOCK) {
        return Err(LoadError::BadTensor {
            file: p.file.to_path_buf(),
            tensor: pn,
            detail: format!("{cols} input features is not a multiple of {BLOCK}"),
        });
    }
    check(&p, &pn, &[rows, cols / 2])?;
    check(&s, &sn, &[rows, cols / BLOCK])?;
    Ok(Mxfp4Matrix::new(rows, cols, p.bytes, s.bytes))
}

/// Expert `expert` of a gpt-oss `{prefix}_blocks` / `{prefix}_scales` pair (e.g.
/// `model.layers.0.mlp.experts.down_proj`): an `[out, in]` matrix for `y = x · Wᵀ`.
/// (transformers transposes these to `[in, out]` for `x @ W`; the stored rows are output features.)
pub fn load_gpt_oss_expert(src: &SafetensorsSource, prefix: &str, expert: usize) -> Result<Mxfp4Matrix, LoadError> {
    let (bn, sn) = (format!("{prefix}_blocks"), format!("{prefix}_scales"));
    let (b, s) = (src.raw(&bn)?, src.raw(&sn)?);
    let [e, rows, groups, 16] = b.shape[..] else {
        return Err(LoadError::BadTensor {
            file: b.file.to_path_buf(),
            tensor: bn,
            detail: format!("shape {:?}, expected [E, out, in/32, 16]", b.shape),
        });
    };
    check(&b, &bn, &[e, rows, groups, 16])?;
    check(&s, &sn, &[e, rows, groups])?;
    if expert >= e {
        return Err(LoadError::BadTensor {
            file: b.file.to_path_buf(),
            tensor: bn,
            detail: format!("expert {expert} of {e}"),
        });
    }
    let (pb, sb) = (rows * groups * 16, rows * groups);
    Ok(Mxfp4Matrix::new(
        rows,
        groups * BLOCK,
        &b.bytes[expert * pb..(expert + 1) * pb],
        &s.bytes[expert * sb..(expert + 1) * sb],
    ))
}
