//! A Linear layer holding uniform integer codes (compressed-tensors pack-quantized).

use kernels::cpu::quant_int::IntMatrix;

pub struct IntLinear {
    pub(crate) w: IntMatrix,
    /// Activation-ordered checkpoints (`weight_g_idx`) are repacked at load so each group is a
    /// contiguous run of columns; column `j` of the packed matrix is input feature `perm[j]`.
    pub(crate) perm: Option<Vec<u32>>,
}

impl IntLinear {
    pub fn new(w: IntMatrix, perm: Option<Vec<u32>>) -> Self {
        if let Some(p) = &perm {
            assert_eq!(p.len(), w.cols());
        }
        Self { w, perm }
    }

    pub fn out_features(&self) -> usize {
        self.w.rows()
    }

    pub fn in_features(&self) -> usize {
        self.w.cols()
    }

    pub fn bits(&self) -> u32 {
        self.w.bits()
    }

    /// Row `r` of the weight in input-feature order, dequantised (tests and tools only).
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let packed = self.w.dequantize_row(r);
        match &self.perm {
            None => packed,
            Some(p) => {
                let mut out = vec![0.0; packed.len()];
                for (j, &src) in p.iter().enumerate() {
                    out[src as usize] = packed[j];
                }
                out
            }
        }
    }

    pub fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) {
        match &self.perm {
            None => self.w.matmul_t(x, out, n),
            Some(p) => {
                let k = self.in_features();
                let mut xp = vec![0.0f32; x.len()];
                for (dst, src) in xp.chunks_exact_mut(k).zip(x.chunks_exact(k)) {
                    for (d, &j) in dst.iter_mut().zip(p) {
                        *d = src[j as usize];
                    }
                }
                self.w.matmul_t(&xp, out, n)
            }
        }
    }
}
