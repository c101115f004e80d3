//! Where weights come from. The model asks for tensors by their Hugging Face name and expected
//! shape; each source translates names, decodes the stored dtype to f32 and reports a clear error
//! naming the file and tensor when anything is missing or wrong.

use std::path::{Path, PathBuf};

use crate::model::shard::{slice_linear, slice_tensor, Split};

use crate::model::error::LoadError;
use crate::model::layers::linear::Linear;
use crate::model::tensor::Tensor;

pub trait WeightSource: Send + Sync {
    /// Loads `name` as f32, checking that its shape is `shape` (PyTorch order).
    fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError>;
    /// Whether the checkpoint holds a tensor with this (Hugging Face) name.
    fn contains(&self, name: &str) -> bool;
    /// The file a tensor lives in, or the checkpoint's main file for errors about missing ones.
    fn file_of(&self, name: &str) -> PathBuf;
    /// The stored shape of `name`, where the source can tell without loading it (for tensors whose
    /// checkpoints disagree on the shape, e.g. KDA's `A_log`); `None` if absent or unknown.
    fn shape_of(&self, _name: &str) -> Option<Vec<usize>> {
        None
    }
    /// The Linear layer `module` (e.g. `model.layers.0.mlp.up_proj`) of `[rows, cols]`: dense
    /// from `{module}.weight` unless the source keeps it quantized.
    fn linear(&self, module: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
        self.load(&format!("{module}.weight"), &[rows, cols]).map(Linear::Dense)
    }
    /// Whether [`Self::linear`] keeps tensor `name` packed (a quantized GGUF embedding, say):
    /// then a tied output projection is worth multiplying from it instead of from the dense
    /// embedding.
    fn keeps_packed(&self, _name: &str) -> bool {
        false
    }
    /// The stored tensors nothing has read so far, where the source keeps count (a safetensors
    /// checkpoint); `None` where it cannot tell (GGUF). See `model::unused`.
    fn unread(&self) -> Option<Vec<String>> {
        None
    }
    /// The part `split` of `name` (whose full shape is `shape`): what one tensor-parallel rank
    /// holds. The default loads the whole tensor and copies the part out; a source that can
    /// decode just the part overrides it.
    fn load_split(&self, name: &str, shape: &[usize], split: &Split) -> Result<Tensor, LoadError> {
        let t = self.load(name, shape)?;
        slice_tensor(t, split).map_err(|detail| LoadError::BadTensor {
            file: self.file_of(name),
            tensor: name.to_string(),
            detail,
        })
    }
    /// The part `split` of the Linear layer `module` of full shape `[rows, cols]`.
    fn linear_split(&self, module: &str, rows: usize, cols: usize, split: &Split) -> Result<Linear, LoadError> {
        if *split == Split::Full {
            return self.linear(module, rows, cols);
        }
        let l = self.linear(module, rows, cols)?;
        let name = format!("{module}.weight");
        slice_linear(l, split).map_err(|detail| LoadError::BadTensor {
            file: self.file_of(&name),
            tensor: name,
            detail,
        })
    }
}

pub(crate) fn check_shape(file: &Path, name: &str, got: &[usize], want: &[usize]) -> Result<(), LoadError> {
    if got != want {
        return Err(LoadError::BadTensor {
            file: file.to_path_buf(),
            tensor: name.to_string(),
            detail: format!("shape {got:?}, expected {want:?}"),
        });
    }
    Ok(())
}
