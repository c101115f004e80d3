//! Quantized checkpoints: parsing their configs, loading their packed tensors into Linear
//! layers that multiply straight from the packed form.

pub mod ct_config;
pub mod ct_linear;
pub mod cubic;
pub mod cubic_pack;
pub mod int_linear;
pub mod mxfp4_linear;
pub mod source;

pub use int_linear::IntLinear;
pub use source::QuantizedSource;
