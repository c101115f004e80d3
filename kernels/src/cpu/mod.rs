//! CPU kernels. Hand-written because they sit on the decode hot path: every generated token runs
//! each of them once per layer, so they must vectorise and spread over all cores.
pub mod activation;
pub mod attention;
pub mod attn_res;
pub mod bitpack;
pub mod cubic;
pub mod cubic_pack;
pub mod dequant;
pub mod dot;
pub mod fp8;
pub mod gather;
pub mod int8_matmul;
pub mod kda;
pub mod kv_write;
pub mod matmul;
pub mod mla;
pub mod moe;
pub mod mxfp4;
pub mod norm;
pub mod packed_matmul;
pub mod quant_int;
pub mod rope;
pub mod sample;
pub mod softmax;
