//! wasmserve: an LLM inference server with a native engine and Wasm component plugins.

pub mod backend;
pub mod bench;
pub mod chat_template;
pub mod decode_bench;
pub mod engine;
pub mod generate;
pub mod model;
pub mod moe_bench;
pub mod parallel;
pub mod perplexity;
pub mod plan;
pub mod plugins;
pub mod quantize;
pub mod sampling;
pub mod server;
pub mod tenancy;

/// Where `scripts/fetch-default-model` puts the default model, relative to the repository root.
pub const DEFAULT_MODEL_PATH: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
