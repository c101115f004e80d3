//! CPU kernels. Hand-written because they sit on the decode hot path: every generated token runs
//! each of them once per layer, so they must vectorise and spread over all cores.
pub mod dot;
pub mod matmul;
pub mod norm;
pub mod rope;
pub mod activation;
pub mod softmax;
pub mod fp8;
pub mod bitpack;
pub mod packed_matmul;
pub mod quant_int;
pub mod int8_matmul;
pub mod mxfp4;
pub mod cubic;
pub mod dequant;
pub mod attention;
pub mod sample;
pub mod moe;
pub mod gather;
pub mod kv_write;
pub mod mla;
pub mod kda;
