//! How a model is cut over ranks: which part of a weight matrix a rank holds, cutting that part
//! out of a loaded tensor or Linear layer, and loading every rank of a sharded model.
//!
//! Matrices are in PyTorch order `[out_features, in_features]`: a column-parallel layer keeps a
//! range of rows (output features), a row-parallel layer a range of columns (input features).

use std::ops::Range;

use kernels::cpu::bitpack::PackedRows;
use kernels::cpu::cubic::AnyCubic;
use kernels::cpu::mxfp4::Mxfp4Matrix;
use kernels::cpu::packed_matmul::LANES;
use kernels::cpu::quant_int::IntMatrix;

use crate::model::config::ModelConfig;
use crate::model::error::LoadError;
use crate::model::format::quant::IntLinear;
use crate::model::format::source::WeightSource;
use crate::model::layers::linear::Linear;
use crate::model::tensor::Tensor;
use crate::parallel::EpRank;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    /// The whole tensor (replicated on every rank).
    Full,
    /// Rows `range` of a 1-D or 2-D tensor.
    Rows(Range<usize>),
    /// Columns `range` of a 2-D tensor.
    Cols(Range<usize>),
}

/// Part `idx` of `total` items cut into `parts` contiguous ranges whose sizes differ by at most
/// one (the first `total % parts` ranges get the extra item).
pub fn even_range(total: usize, parts: usize, idx: usize) -> Range<usize> {
    assert!(parts >= 1 && idx < parts, "even_range: part {idx} of {parts}");
    let (base, extra) = (total / parts, total % parts);
    let start = idx * base + idx.min(extra);
    start..start + base + usize::from(idx < extra)
}

impl Split {
    /// The shape of the part of a `shape` tensor this split keeps, or why it does not fit.
    pub fn shape(&self, shape: &[usize]) -> Result<Vec<usize>, String> {
        match self {
            Split::Full => Ok(shape.to_vec()),
            Split::Rows(r) => {
                let rows = *shape.first().ok_or("a scalar has no rows")?;
                if r.start > r.end || r.end > rows {
                    return Err(format!("rows {r:?} out of range for shape {shape:?}"));
                }
                let mut s = shape.to_vec();
                s[0] = r.len();
                Ok(s)
            }
            Split::Cols(c) => {
                if shape.len() != 2 {
                    return Err(format!("a column split needs a 2-D tensor, not shape {shape:?}"));
                }
                if c.start > c.end || c.end > shape[1] {
                    return Err(format!("columns {c:?} out of range for shape {shape:?}"));
                }
                Ok(vec![shape[0], c.len()])
            }
        }
    }
}

/// Copies the part `split` of `t` (`t` is dropped by the caller; mapped tensors stay mapped).
pub fn slice_tensor(t: Tensor, split: &Split) -> Result<Tensor, String> {
    let shape = split.shape(&t.shape)?;
    let data = t.as_slice();
    match split {
        Split::Full => Ok(t),
        Split::Rows(r) => {
            let width: usize = t.shape[1..].iter().product();
            Ok(Tensor::owned(shape, data[r.start * width..r.end * width].to_vec()))
        }
        Split::Cols(c) => {
            let cols = t.shape[1];
            let mut out = Vec::with_capacity(shape[0] * shape[1]);
            for row in data.chunks_exact(cols.max(1)) {
                out.extend_from_slice(&row[c.clone()]);
            }
            Ok(Tensor::owned(shape, out))
        }
    }
}

/// The part `split` of a loaded Linear layer, exactly: the sliced layer multiplies like the same
/// part of the whole one. Packed quantized layers stay packed (see [`slice_grouped`] for a column
/// cut inside a quantization group); refused with the reason: MXFP4 columns cut inside a 32-wide
/// block, and activation-ordered INT (`g_idx`) cut by columns.
pub fn slice_linear(l: Linear, split: &Split) -> Result<Linear, String> {
    // A one-way mesh asks for the whole range (`Rows(0..out)`): that is no slicing at all, and
    // packed layers must keep loading there.
    let whole = match split {
        Split::Full => true,
        Split::Rows(r) => r.start == 0 && r.end == l.out_features(),
        Split::Cols(c) => c.start == 0 && c.end == l.in_features(),
    };
    if whole {
        return Ok(l);
    }
    let (out, inp) = (l.out_features(), l.in_features());
    let (rows, cols) = match split {
        Split::Full => (0..out, 0..inp),
        Split::Rows(r) => (r.clone(), 0..inp),
        Split::Cols(c) => (0..out, c.clone()),
    };
    if rows.start > rows.end || rows.end > out || cols.start > cols.end || cols.end > inp {
        return Err(format!("{split:?} out of range for a {out}x{inp} layer"));
    }
    match l {
        Linear::Dense(t) => slice_tensor(t, split).map(Linear::Dense),
        Linear::Int(q) => {
            if q.perm.is_some() && cols.len() != inp {
                return Err("an activation-ordered (g_idx) INT layer cannot be split by input columns: its packed columns are permuted across the cut".into());
            }
            let (packed, g, params) = q.w.parts();
            let s = slice_grouped(packed, g, params, rows, cols)?;
            Ok(Linear::Int(IntLinear::new(IntMatrix::new(s.packed, s.group_size, &s.p0, &s.p1), q.perm.clone())))
        }
        Linear::Cubic(c) => {
            let (packed, g, params) = c.parts();
            let s = slice_grouped(packed, g, params, rows, cols)?;
            Ok(Linear::Cubic(AnyCubic::new(s.packed, s.group_size, &s.p0, &s.p1)))
        }
        Linear::Mxfp4(m) => slice_mxfp4(&m, rows, cols).map(Linear::Mxfp4),
        // QuantTrio's K3 checkpoints quantize only routed experts, which expert parallelism
        // keeps whole.
        Linear::CubicPack(_) => {
            Err("a cubic-pack-quantized layer cannot be split over tensor-parallel ranks yet".into())
        }
    }
}

/// A grouped matrix's part: its codes and per-(row, group) parameters.
pub struct GroupedPart {
    pub packed: PackedRows,
    pub group_size: usize,
    pub p0: Vec<f32>,
    pub p1: Vec<f32>,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Rows `rows`, columns `cols` of a group-quantized matrix (`params[r * groups_per_row + g]`).
///
/// A column cut inside a group (TP splits need not fall on 128-column boundaries: a 64-wide head
/// slice, a 192-wide MLP slice) stays exact: the part's group size is the largest that divides
/// both the original group size and the cut's offset inside its group, so original group
/// boundaries fall on new group boundaries, every new group lies inside one original group and
/// takes its parameters (vLLM instead refuses such a split). A cut on a group boundary keeps the
/// original group size; the part's last group may be partial, as a matrix's may.
///
/// The packed kernels need groups of a multiple of their vector width
/// (`packed_matmul::LANES` = 16 columns) or one group per row, so a cut finer than that is an
/// error.
pub fn slice_grouped(
    p: &PackedRows,
    group_size: usize,
    params: &[[f32; 2]],
    rows: Range<usize>,
    cols: Range<usize>,
) -> Result<GroupedPart, String> {
    let (bits, all_cols) = (p.bits(), p.cols());
    let groups_per_row = all_cols.div_ceil(group_size);
    let g = gcd(group_size, cols.start % group_size);
    if g != group_size && !g.is_multiple_of(LANES) && g < cols.len() {
        return Err(format!(
            "columns {cols:?} cut {} columns into a quantization group of {group_size}: the part's groups would be {g} columns wide, and the packed kernels need a multiple of {LANES}",
            cols.start % group_size
        ));
    }
    let packed = if cols.len() == all_cols {
        // Whole rows: their packed bytes as they are.
        let st = p.stride();
        PackedRows::new(bits, rows.len(), all_cols, st, &p.bytes()[rows.start * st..rows.end * st])
    } else {
        let codes: Vec<u8> = rows.clone().flat_map(|r| cols.clone().map(move |c| p.code(r, c) as u8)).collect();
        PackedRows::from_codes(bits, rows.len(), cols.len(), &codes)
    };
    let new_groups = cols.len().div_ceil(g.max(1));
    let (mut p0, mut p1) = (Vec::with_capacity(rows.len() * new_groups), Vec::with_capacity(rows.len() * new_groups));
    for r in rows {
        for j in 0..new_groups {
            let [a, b] = params[r * groups_per_row + (cols.start + j * g) / group_size];
            p0.push(a);
            p1.push(b);
        }
    }
    Ok(GroupedPart { packed, group_size: g.max(1), p0, p1 })
}

/// Rows `rows`, columns `cols` of an MXFP4 matrix; columns must stay on its 32-wide scale blocks.
fn slice_mxfp4(m: &Mxfp4Matrix, rows: Range<usize>, cols: Range<usize>) -> Result<Mxfp4Matrix, String> {
    const BLOCK: usize = 32;
    if !cols.start.is_multiple_of(BLOCK) || !cols.len().is_multiple_of(BLOCK) {
        return Err(format!("MXFP4 columns {cols:?} are not on its {BLOCK}-column scale blocks"));
    }
    let (packed, scales) = m.parts();
    let (all, blocks) = (m.cols(), m.cols() / BLOCK);
    let (mut pk, mut sc) =
        (Vec::with_capacity(rows.len() * cols.len() / 2), Vec::with_capacity(rows.len() * cols.len() / BLOCK));
    for r in rows.clone() {
        pk.extend_from_slice(&packed[r * all / 2 + cols.start / 2..r * all / 2 + cols.end / 2]);
        sc.extend_from_slice(&scales[r * blocks + cols.start / BLOCK..r * blocks + cols.end / BLOCK]);
    }
    Ok(Mxfp4Matrix::new(rows.len(), cols.len(), &pk, &sc))
}

/// Loads ranks 0..ep of `ep`, each on its own thread (`load(config, rank)`, reading only its
/// experts from the source). Refuses `ep == 0`.
pub(crate) fn load_on_threads<M: Send>(
    cfg: &ModelConfig,
    src: &dyn WeightSource,
    ep: usize,
    load: impl Fn(ModelConfig, EpRank) -> Result<M, LoadError> + Sync,
) -> Result<Vec<M>, LoadError> {
    if ep == 0 {
        return Err(LoadError::Config {
            file: src.file_of("model.embed_tokens.weight"),
            detail: "expert parallel size must be at least 1".into(),
        });
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..ep)
            .map(|rank| {
                let (cfg, load) = (cfg.clone(), &load);
                s.spawn(move || load(cfg, EpRank { rank, size: ep }))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_ranges_cover_without_overlap() {
        for total in 0..20 {
            for parts in 1..6 {
                let rs: Vec<_> = (0..parts).map(|i| even_range(total, parts, i)).collect();
                assert_eq!(rs[0].start, 0);
                assert_eq!(rs[parts - 1].end, total);
                for w in rs.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len() && w[0].len() - w[1].len() <= 1);
                }
            }
        }
    }

    fn lcg(seed: &mut u64) -> u32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*seed >> 33) as u32
    }

    fn dequant(l: &Linear) -> Vec<Vec<f32>> {
        (0..l.out_features())
            .map(|r| match l {
                Linear::Int(q) => q.dequantize_row(r),
                Linear::Cubic(c) => c.dequantize_row(r),
                Linear::CubicPack(c) => c.dequantize_row(r),
                Linear::Mxfp4(m) => m.dequantize_row(r),
                Linear::Dense(t) => t.as_slice()[r * l.in_features()..(r + 1) * l.in_features()].to_vec(),
            })
            .collect()
    }

    /// Every part is the same part of the whole matrix, bit for bit, dequantised, including
    /// column cuts inside a group (which re-index the parameters at a finer group size) and a
    /// partial last group.
    #[test]
    fn packed_parts_dequantise_to_the_same_part_of_the_whole() {
        let (rows, cols, g) = (6usize, 100usize, 32usize);
        let mut seed = 3u64;
        let groups = rows * cols.div_ceil(g);
        let codes = |bits: u32, seed: &mut u64| -> Vec<u8> {
            (0..rows * cols).map(|_| (lcg(seed) % (1 << bits)) as u8).collect()
        };
        let scale: Vec<f32> = (0..groups).map(|i| 0.01 + i as f32 * 1e-3).collect();
        let zero: Vec<f32> = (0..groups).map(|i| (i % 16) as f32).collect();
        let make = |which: usize, seed: &mut u64| -> Linear {
            match which {
                0 => Linear::Int(IntLinear::new(
                    IntMatrix::new(PackedRows::from_codes(4, rows, cols, &codes(4, seed)), g, &scale, &zero),
                    None,
                )),
                1 => Linear::Int(IntLinear::new(
                    IntMatrix::new(PackedRows::from_codes(3, rows, cols, &codes(3, seed)), g, &scale, &zero),
                    None,
                )),
                _ => {
                    let shape: Vec<f32> = (0..groups).map(|i| (i as f32 * 0.37).sin() * 0.3).collect();
                    Linear::Cubic(AnyCubic::new(
                        PackedRows::from_codes(2, rows, cols, &codes(2, seed)),
                        g,
                        &scale,
                        &shape,
                    ))
                }
            }
        };
        for which in 0..3 {
            for split in [
                Split::Rows(1..4),
                Split::Cols(0..50),
                Split::Cols(48..100),
                Split::Cols(16..80),
                Split::Cols(64..100),
                Split::Cols(96..98),
            ] {
                let whole = dequant(&make(which, &mut seed.clone()));
                let part = slice_linear(make(which, &mut seed.clone()), &split).unwrap();
                let got = dequant(&part);
                let want: Vec<Vec<f32>> = match &split {
                    Split::Rows(r) => whole[r.clone()].to_vec(),
                    Split::Cols(c) => whole.iter().map(|row| row[c.clone()].to_vec()).collect(),
                    Split::Full => unreachable!(),
                };
                assert_eq!(got, want, "format {which}, {split:?}");
            }
            seed += 1;
        }
        // A cut that would leave groups narrower than the kernels' vector width is refused.
        let e = slice_linear(make(0, &mut seed.clone()), &Split::Cols(50..100)).err().unwrap();
        assert!(e.contains("groups would be 2 columns wide"), "{e}");
        // MXFP4: whole 32-column blocks only.
        let (r, c) = (4, 128);
        let packed: Vec<u8> = (0..r * c / 2).map(|_| lcg(&mut seed) as u8).collect();
        let scales: Vec<u8> = (0..r * c / 32).map(|i| 120 + (i % 7) as u8).collect();
        let m = || Linear::Mxfp4(Mxfp4Matrix::new(r, c, &packed, &scales));
        let whole = dequant(&m());
        assert_eq!(
            dequant(&slice_linear(m(), &Split::Cols(32..96)).unwrap()),
            whole.iter().map(|row| row[32..96].to_vec()).collect::<Vec<_>>()
        );
        assert_eq!(dequant(&slice_linear(m(), &Split::Rows(2..4)).unwrap()), whole[2..4].to_vec());
        assert!(slice_linear(m(), &Split::Cols(16..80)).err().unwrap().contains("scale blocks"));
        // Activation order cannot be cut by columns (rows are fine).
        let perm: Vec<u32> = (0..cols as u32).rev().collect();
        let act = || {
            Linear::Int(IntLinear::new(
                IntMatrix::new(PackedRows::from_codes(4, rows, cols, &codes(4, &mut 1)), g, &scale, &zero),
                Some(perm.clone()),
            ))
        };
        assert!(slice_linear(act(), &Split::Cols(0..50)).err().unwrap().contains("g_idx"));
        assert!(slice_linear(act(), &Split::Rows(0..3)).is_ok());
    }

    #[test]
    fn slices_rows_and_columns() {
        let t = || Tensor::owned(vec![3, 4], (0..12).map(|v| v as f32).collect());
        assert_eq!(slice_tensor(t(), &Split::Rows(1..3)).unwrap().as_slice(), &[4., 5., 6., 7., 8., 9., 10., 11.]);
        let c = slice_tensor(t(), &Split::Cols(1..3)).unwrap();
        assert_eq!(c.shape, vec![3, 2]);
        assert_eq!(c.as_slice(), &[1., 2., 5., 6., 9., 10.]);
        assert!(slice_tensor(t(), &Split::Cols(3..5)).is_err());
        assert!(slice_tensor(Tensor::owned(vec![4], vec![0.; 4]), &Split::Cols(0..1)).is_err());
    }
}
