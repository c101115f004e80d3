//! A checkpoint whose tensors all sit under one prefix (Kimi K3 stores its text model as
//! `language_model.model.layers.*`): the model asks for `model.layers.*` and this adds the prefix,
//! so errors still name the tensor as the checkpoint stores it.

use std::path::PathBuf;

use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::layers::linear::Linear;
use crate::model::shard::Split;
use crate::model::tensor::Tensor;

pub struct Prefixed<'a> {
    inner: &'a dyn WeightSource,
    prefix: &'static str,
}

impl<'a> Prefixed<'a> {
    pub fn new(inner: &'a dyn WeightSource, prefix: &'static str) -> Self {
        Self { inner, prefix }
    }

    fn name(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }
}

impl WeightSource for Prefixed<'_> {
    fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
        self.inner.load(&self.name(name), shape)
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(&self.name(name))
    }

    fn file_of(&self, name: &str) -> PathBuf {
        self.inner.file_of(&self.name(name))
    }

    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.inner.shape_of(&self.name(name))
    }

    fn linear(&self, module: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
        self.inner.linear(&self.name(module), rows, cols)
    }

    fn keeps_packed(&self, name: &str) -> bool {
        self.inner.keeps_packed(&self.name(name))
    }

    fn load_split(&self, name: &str, shape: &[usize], split: &Split) -> Result<Tensor, LoadError> {
        self.inner.load_split(&self.name(name), shape, split)
    }

    fn linear_split(&self, module: &str, rows: usize, cols: usize, split: &Split) -> Result<Linear, LoadError> {
        self.inner.linear_split(&self.name(module), rows, cols, split)
    }
}
