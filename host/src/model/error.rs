//! Errors from reading model files. Each names the file and, where there is one, the tensor.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{file}: {source}")]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: truncated: {detail}")]
    Truncated { file: PathBuf, detail: String },
    #[error("{file}: corrupt: {detail}")]
    Corrupt { file: PathBuf, detail: String },
    #[error("{file}: tensor '{tensor}': {detail}")]
    BadTensor { file: PathBuf, tensor: String, detail: String },
    #[error("{file}: missing tensor '{tensor}'")]
    MissingTensor { file: PathBuf, tensor: String },
    #[error("{file}: unknown architecture '{arch}' (supported: {supported})")]
    UnknownArchitecture { file: PathBuf, arch: String, supported: String },
    #[error("{file}: invalid config: {detail}")]
    Config { file: PathBuf, detail: String },
    #[error("{file}: {count} checkpoint tensor(s) that no layer of this architecture reads: {names} (a tensor the forward ignores would give wrong outputs silently)")]
    UnusedTensors { file: PathBuf, count: usize, names: String },
    #[error("{file}: tokenizer: {detail}")]
    Tokenizer { file: PathBuf, detail: String },
}
