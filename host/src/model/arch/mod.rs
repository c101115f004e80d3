//! One folder per architecture: its configuration and CPU forward (`mod.rs`), its sharded forms
//! (`parallel.rs`: tensor- and expert-parallel ranks) and how it moves onto devices
//! (`device.rs`). `model::registry` lists them; docs/architecture.md says what to touch to add one.

pub mod deepseek_v3;
pub mod kimi_k3;
pub mod kimi_linear;
pub mod llama;
