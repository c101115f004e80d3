//! Shared helpers for the end-to-end tests: locating and loading the real default model.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use wasmserve::model::LoadedModel;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

pub fn default_model_path() -> PathBuf {
    let p = repo_root().join(wasmserve::DEFAULT_MODEL_PATH);
    assert!(p.exists(), "{} is missing: run scripts/fetch-default-model first", p.display());
    p
}

/// The SmolLM2 model, loaded once per test binary.
pub fn smollm2() -> Arc<LoadedModel> {
    static MODEL: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    MODEL.get_or_init(|| Arc::new(wasmserve::model::load(&default_model_path()).expect("loading SmolLM2"))).clone()
}
