//! `--cpu-activations`: whether the CPU multiplies packed integer layers with f32 inputs (exact
//! to the dequantised weights, the default) or with inputs quantised to 8 bits per 32 values and
//! integer dot products (`kernels::cpu::int8_matmul`: llama.cpp's arithmetic for GGUF Q4/Q8,
//! about twice the single-stream decode speed on AVX2).
//!
//! The choice is made while loading, by wrapping the checkpoint's [`WeightSource`]: every INT
//! Linear layer it hands out (whole, or one rank's split) is switched over when its layout allows
//! it (4- or 8-bit codes, whole 32-value blocks); other layers keep f32 inputs. It only changes
//! the CPU forward: a device forward uploads the same codes and runs its own kernels.

use std::path::PathBuf;

use crate::model::shard::Split;

use crate::model::error::LoadError;
use crate::model::format::quant::int_linear::IntLinear;
use crate::model::format::source::WeightSource;
use crate::model::layers::linear::Linear;
use crate::model::tensor::Tensor;

/// How a CPU forward feeds packed integer layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CpuActivations {
    /// f32 inputs: results are the f32 product with the dequantised weights (what transformers
    /// computes on the same weights, to summation order).
    #[default]
    F32,
    /// 8-bit inputs per 32-value block for every 4- and 8-bit INT layer (GGUF Q4_0/Q4_1/Q8_0,
    /// compressed-tensors INT4/INT8): faster decode, input rounding of up to 1/254 of a block's
    /// largest value.
    Int8,
}

impl std::fmt::Display for CpuActivations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CpuActivations::F32 => "f32",
            CpuActivations::Int8 => "int8",
        })
    }
}

/// `inner` with every eligible INT Linear layer multiplied with 8-bit activations.
pub struct Int8ActivationSource<'a> {
    inner: &'a dyn WeightSource,
}

impl<'a> Int8ActivationSource<'a> {
    pub fn new(inner: &'a dyn WeightSource) -> Self {
        Self { inner }
    }
}

/// `l` switched to 8-bit activations where its layout allows (otherwise unchanged).
fn with_int8_activations(l: Linear) -> Linear {
    match l {
        Linear::Int(q) if kernels::cpu::int8_matmul::eligible(&q.w) => {
            let IntLinear { w, perm } = q;
            let w = w.with_int8_activations().expect("eligible layouts take 8-bit activations");
            Linear::Int(IntLinear::new(w, perm))
        }
        // QuantTrio's Cubic: its dynamic-A8 mode (int8 carriers, per-token int8 activations).
        Linear::CubicPack(c) => Linear::CubicPack(c.with_a8()),
        other => other,
    }
}

impl WeightSource for Int8ActivationSource<'_> {
    fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
        self.inner.load(name, shape)
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn file_of(&self, name: &str) -> PathBuf {
        self.inner.file_of(name)
    }
    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.inner.shape_of(name)
    }
    fn linear(&self, module: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
        self.inner.linear(module, rows, cols).map(with_int8_activations)
    }
    fn keeps_packed(&self, name: &str) -> bool {
        self.inner.keeps_packed(name)
    }
    fn unread(&self) -> Option<Vec<String>> {
        self.inner.unread()
    }
    fn load_split(&self, name: &str, shape: &[usize], split: &Split) -> Result<Tensor, LoadError> {
        self.inner.load_split(name, shape, split)
    }
    fn linear_split(&self, module: &str, rows: usize, cols: usize, split: &Split) -> Result<Linear, LoadError> {
        self.inner.linear_split(module, rows, cols, split).map(with_int8_activations)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::cpu::bitpack::PackedRows;
    use kernels::cpu::quant_int::IntMatrix;

    /// A source of one 4-bit INT layer `int` (64 columns), one 3-bit layer `narrow` and dense
    /// tensors otherwise.
    struct Fake;
    impl WeightSource for Fake {
        fn load(&self, _name: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
            Ok(Tensor::owned(shape.to_vec(), vec![0.5; shape.iter().product()]))
        }
        fn contains(&self, _name: &str) -> bool {
            true
        }
        fn file_of(&self, _name: &str) -> PathBuf {
            PathBuf::from("fake")
        }
        fn linear(&self, module: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
            let bits = match module {
                "int" => 4,
                "narrow" => 3,
                _ => return self.load(module, &[rows, cols]).map(Linear::Dense),
            };
            let codes: Vec<u8> = (0..rows * cols).map(|i| (i * 7 % (1 << bits)) as u8).collect();
            let groups = rows * cols / 32;
            Ok(Linear::Int(IntLinear::new(
                IntMatrix::new(
                    PackedRows::from_codes(bits, rows, cols, &codes),
                    32,
                    &vec![0.01; groups],
                    &vec![4.0; groups],
                ),
                None,
            )))
        }
    }

    fn int8(l: &Linear) -> Option<bool> {
        match l {
            Linear::Int(q) => Some(q.w.int8_activations()),
            _ => None,
        }
    }

    #[test]
    fn only_eligible_int_layers_switch_and_splits_keep_the_switch() {
        let src = Int8ActivationSource::new(&Fake);
        assert_eq!(int8(&Fake.linear("int", 4, 64).unwrap()), Some(false));
        assert_eq!(int8(&src.linear("int", 4, 64).unwrap()), Some(true));
        assert_eq!(int8(&src.linear("narrow", 4, 64).unwrap()), Some(false));
        assert_eq!(int8(&src.linear("dense", 4, 64).unwrap()), None);
        // A tensor-parallel rank's part is switched too (slicing builds a new matrix).
        assert_eq!(int8(&src.linear_split("int", 4, 64, &Split::Rows(0..2)).unwrap()), Some(true));
        assert_eq!(int8(&src.linear_split("int", 4, 64, &Split::Cols(0..32)).unwrap()), Some(true));
    }

    #[test]
    fn switched_layers_compute_with_quantised_inputs() {
        let (f32_layer, int8_layer) =
            (Fake.linear("int", 4, 64).unwrap(), Int8ActivationSource::new(&Fake).linear("int", 4, 64).unwrap());
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 0.731).collect();
        let (a, b) = (f32_layer.forward(&x, 1), int8_layer.forward(&x, 1));
        assert_ne!(a, b, "8-bit activations round the inputs");
        for (a, b) in a.iter().zip(&b) {
            assert!((a - b).abs() < 0.01 * (1.0 + a.abs()), "{a} vs {b}");
        }
    }
}
