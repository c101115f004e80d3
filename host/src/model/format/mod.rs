//! Checkpoint formats: GGUF (with llama.cpp's block-quantized types), Hugging Face safetensors
//! directories, and the quantized layouts read from them (compressed-tensors INT, MXFP4, Cubic).
//! Every format serves weights through [`source::WeightSource`].

pub mod ggml;
pub mod gguf;
pub mod gguf_packed;
pub mod gguf_source;
pub mod hf_source;
pub mod prefixed;
pub mod quant;
pub mod source;
