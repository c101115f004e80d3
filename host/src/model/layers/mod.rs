//! Building blocks the architectures share: attention kinds (MLA, KDA), mixture-of-experts and
//! MLPs, Linear layers in every weight format, and the decoder's embedding / residual / final norm.

pub mod attn_res;
pub mod decoder;
pub mod kda;
pub mod linear;
pub mod mla;
pub mod moe;
