//! Which part of a weight matrix a rank holds, and cutting that part out of a loaded tensor.
//!
//! Matrices are in PyTorch order `[out_features, in_features]`: a column-parallel layer keeps a
//! range of rows (output features), a row-parallel layer a range of columns (input features).

use std::ops::Range;

use crate::model::linear::Linear;
use crate::model::tensor::Tensor;

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

/// The part `split` of a loaded Linear layer. Dense layers slice any way; packed quantized
/// layers are refused with the reason (see docs/sharding.md).
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
    match l {
        Linear::Dense(t) => slice_tensor(t, split).map(Linear::Dense),
        Linear::Int(_) => Err("tensor-parallel slicing of pack-quantized (compressed-tensors INT) weights is not supported yet".into()),
        Linear::Mxfp4(_) => Err("tensor-parallel slicing of MXFP4 weights is not supported yet".into()),
        Linear::Cubic(_) => Err("tensor-parallel slicing of Cubic weights is not supported yet".into()),
    }
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
