//! A linear layer `y = x · Wᵀ`. An enum so quantized storage formats can sit beside dense f32
//! without the model code knowing which one it multiplies with.

use kernels::cpu::cubic::AnyCubic;
use kernels::cpu::cubic_pack::CubicPackMatrix;
use kernels::cpu::matmul::matmul_t;
use kernels::cpu::mxfp4::Mxfp4Matrix;

use crate::model::format::quant::IntLinear;
use crate::model::tensor::Tensor;

pub enum Linear {
    Dense(Tensor),
    /// Integer codes kept packed (compressed-tensors pack-quantized), multiplied from the packed form.
    Int(IntLinear),
    /// MXFP4 codes and E8M0 block scales kept packed.
    Mxfp4(Mxfp4Matrix),
    /// The earlier in-house cubic layout (`cubic_codes` / `cubic_scale` / `cubic_shape`), kept packed.
    Cubic(AnyCubic),
    /// QuantTrio's Cubic (`cubic-pack-quantized`, docs/cubic-format.md), kept packed.
    CubicPack(CubicPackMatrix),
}

impl Linear {
    pub fn out_features(&self) -> usize {
        match self {
            Linear::Dense(t) => t.shape[0],
            Linear::Int(q) => q.out_features(),
            Linear::Mxfp4(q) => q.rows(),
            Linear::Cubic(q) => q.rows(),
            Linear::CubicPack(q) => q.rows(),
        }
    }

    pub fn in_features(&self) -> usize {
        match self {
            Linear::Dense(t) => t.shape[1],
            Linear::Int(q) => q.in_features(),
            Linear::Mxfp4(q) => q.cols(),
            Linear::Cubic(q) => q.cols(),
            Linear::CubicPack(q) => q.cols(),
        }
    }

    /// Bytes of weight storage a forward pass reads (codes plus scales for quantized formats).
    pub fn weight_bytes(&self) -> usize {
        match self {
            Linear::Dense(t) => t.len() * 4,
            Linear::Int(q) => q.w.bytes(),
            Linear::Mxfp4(q) => q.bytes(),
            Linear::Cubic(q) => q.bytes(),
            Linear::CubicPack(q) => q.bytes(),
        }
    }

    /// The weight decoded to f32, `[out_features, in_features]` row-major (for the few weights a
    /// model only uses dense).
    pub fn to_dense(&self) -> Vec<f32> {
        let rows = 0..self.out_features();
        match self {
            Linear::Dense(t) => t.as_slice().to_vec(),
            Linear::Int(q) => rows.flat_map(|r| q.dequantize_row(r)).collect(),
            Linear::Mxfp4(q) => rows.flat_map(|r| q.dequantize_row(r)).collect(),
            Linear::Cubic(q) => rows.flat_map(|r| q.dequantize_row(r)).collect(),
            Linear::CubicPack(q) => rows.flat_map(|r| q.dequantize_row(r)).collect(),
        }
    }

    /// `x` holds `n` rows of `in_features`; returns `n` rows of `out_features`.
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0.0; n * self.out_features()];
        match self {
            Linear::Dense(t) => matmul_t(x, t.as_slice(), &mut out, n, self.in_features(), self.out_features()),
            Linear::Int(q) => q.forward(x, n, &mut out),
            Linear::Mxfp4(q) => q.matmul_t(x, &mut out, n),
            Linear::Cubic(q) => q.matmul_t(x, &mut out, n),
            Linear::CubicPack(q) => q.matmul_t(x, &mut out, n),
        }
        out
    }
}
