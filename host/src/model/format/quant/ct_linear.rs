//! One compressed-tensors `pack-quantized` Linear from its checkpoint tensors
//! (docs/formats.md §1; compressed-tensors `compressors/pack_quantized`):
//! `weight_packed` int32 `[out, ceil(in·b/32)]` (dense LSB-first codes `u = q + 2^(b−1)`),
//! `weight_scale` `[out, groups]` (channel `[out, 1]`, tensor `[1]`), `weight_zero_point` int32
//! packed along dim 0 `[ceil(out·b/32), groups]` when asymmetric, `weight_shape` int64 `[2]`,
//! `weight_g_idx` int32 `[in]` with activation ordering.

use half::{bf16, f16};
use kernels::cpu::bitpack::{code_at, pack_row, PackedRows};
use kernels::cpu::packed_matmul::LANES;
use kernels::cpu::quant_int::IntMatrix;
use safetensors::Dtype;

use crate::model::error::LoadError;
use crate::model::format::hf_source::{RawTensor, SafetensorsSource};
use crate::model::format::quant::ct_config::{Strategy, WeightArgs};
use crate::model::format::quant::int_linear::IntLinear;
use crate::model::format::source::WeightSource;

fn bad(t: &RawTensor, name: &str, detail: String) -> LoadError {
    LoadError::BadTensor { file: t.file.to_path_buf(), tensor: name.to_string(), detail }
}

/// Floating-point tensor (f32/f16/bf16) widened to f32 (exactly).
pub(crate) fn floats(t: &RawTensor, name: &str) -> Result<Vec<f32>, LoadError> {
    let b = t.bytes;
    Ok(match t.dtype {
        Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        d => return Err(bad(t, name, format!("dtype {d:?}, expected F32, F16 or BF16"))),
    })
}

fn expect(t: &RawTensor, name: &str, dtype: Dtype, shape: &[usize]) -> Result<(), LoadError> {
    if t.dtype != dtype || t.shape != shape {
        return Err(bad(t, name, format!("{:?} {:?}, expected {dtype:?} {shape:?}", t.dtype, t.shape)));
    }
    Ok(())
}

fn ints(t: &RawTensor) -> Vec<i64> {
    match t.dtype {
        Dtype::I32 => t.bytes.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect(),
        Dtype::I64 => t.bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect(),
        _ => Vec::new(),
    }
}

/// Loads `module` (e.g. `model.layers.0.mlp.down_proj`) of `[rows, cols]` quantized per `args`.
pub fn load_int_linear(
    src: &SafetensorsSource,
    module: &str,
    rows: usize,
    cols: usize,
    args: &WeightArgs,
) -> Result<IntLinear, LoadError> {
    let b = args.num_bits;
    let name = |leaf: &str| format!("{module}.{leaf}");

    let packed_name = name("weight_packed");
    let packed = src.raw(&packed_name)?;
    let words = (cols * b as usize).div_ceil(32);
    expect(&packed, &packed_name, Dtype::I32, &[rows, words])?;

    if src.contains(&name("weight_shape")) {
        let n = name("weight_shape");
        let t = src.raw(&n)?;
        let v = ints(&t);
        if v != [rows as i64, cols as i64] {
            return Err(bad(&t, &n, format!("says {v:?}, the model expects [{rows}, {cols}]")));
        }
    }

    let (group_size, groups) = match args.strategy {
        Strategy::Group => {
            let gs = args.group_size.expect("group strategy has a group size");
            (gs, cols.div_ceil(gs))
        }
        Strategy::Channel | Strategy::Tensor => (cols, 1),
    };
    if group_size % LANES != 0 && group_size < cols {
        return Err(bad(
            &packed,
            &packed_name,
            format!("group_size {group_size} is not supported (a multiple of {LANES}, or the whole row)"),
        ));
    }

    let scale_name = name("weight_scale");
    let st = src.raw(&scale_name)?;
    let scale_shape_ok = match args.strategy {
        Strategy::Group => st.shape == [rows, groups],
        Strategy::Channel => st.shape == [rows, 1] || st.shape == [rows],
        Strategy::Tensor => st.shape.iter().product::<usize>() == 1,
    };
    if !scale_shape_ok {
        return Err(bad(
            &st,
            &scale_name,
            format!(
                "shape {:?} does not fit {:?} quantization (group size {group_size}) of [{rows}, {cols}]",
                st.shape, args.strategy
            ),
        ));
    }
    let mut scale = floats(&st, &scale_name)?;
    if args.strategy == Strategy::Tensor {
        scale = vec![scale[0]; rows];
    }

    let zero: Vec<f32> = if args.symmetric {
        vec![(1u32 << (b - 1)) as f32; rows * groups]
    } else {
        if args.strategy == Strategy::Tensor {
            return Err(bad(&st, &scale_name, "asymmetric per-tensor quantization is not supported".into()));
        }
        let zp_name = name("weight_zero_point");
        let zt = src.raw(&zp_name)?;
        expect(&zt, &zp_name, Dtype::I32, &[(rows * b as usize).div_ceil(32), groups])?;
        // Packed along dim 0: column g's words, read top to bottom, are one bit stream of codes.
        let zw = zt.shape[0];
        let mut zero = vec![0.0f32; rows * groups];
        let mut column = vec![0u8; zw * 4 + 1];
        for g in 0..groups {
            for w in 0..zw {
                let at = (w * groups + g) * 4;
                column[w * 4..w * 4 + 4].copy_from_slice(&zt.bytes[at..at + 4]);
            }
            for o in 0..rows {
                zero[o * groups + g] = code_at(&column, b, o) as f32;
            }
        }
        zero
    };

    let stride = words * 4;
    let mut matrix_bytes = packed.bytes.to_vec();
    let mut perm = None;
    if src.contains(&name("weight_g_idx")) {
        let gi_name = name("weight_g_idx");
        let gt = src.raw(&gi_name)?;
        expect(&gt, &gi_name, Dtype::I32, &[cols])?;
        let g_idx = ints(&gt);
        if let Some(v) = g_idx.iter().find(|&&g| g < 0 || g as usize >= groups) {
            return Err(bad(&gt, &gi_name, format!("group index {v} outside 0..{groups}")));
        }
        let trivial = g_idx.iter().enumerate().all(|(i, &g)| g as usize == i / group_size);
        if !trivial {
            // Sort columns by group (stable) so each group becomes one contiguous run.
            let mut order: Vec<u32> = (0..cols as u32).collect();
            order.sort_by_key(|&i| g_idx[i as usize]);
            for (j, &i) in order.iter().enumerate() {
                if g_idx[i as usize] as usize != j / group_size {
                    return Err(bad(
                        &gt,
                        &gi_name,
                        format!("groups are not all {group_size} columns; irregular g_idx is not supported"),
                    ));
                }
            }
            let mut row_codes = vec![0u8; cols];
            let mut repacked = Vec::with_capacity(rows * stride);
            for r in 0..rows {
                let row = &packed.bytes[r * stride..(r + 1) * stride];
                for (j, &i) in order.iter().enumerate() {
                    row_codes[j] = code_at(row, b, i as usize) as u8;
                }
                let mut packed_row = pack_row(&row_codes, b);
                packed_row.resize(stride, 0);
                repacked.extend_from_slice(&packed_row);
            }
            matrix_bytes = repacked;
            perm = Some(order);
        }
    } else if args.g_idx {
        return Err(LoadError::MissingTensor { file: src.file_of(&packed_name), tensor: name("weight_g_idx") });
    }

    let rows_packed = PackedRows::new(b, rows, cols, stride, &matrix_bytes);
    Ok(IntLinear::new(IntMatrix::new(rows_packed, group_size, &scale, &zero), perm))
}
