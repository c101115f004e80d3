//! The per-token arithmetic of a KDA layer, written against plain slices so each piece can be
//! read next to its formula (docs/formats.md §3.1-3.2, transformers `modeling_kimi_linear.py`).
//! It lives in `kernels::cpu::kda`, where the device kernels' CPU references are built from it.
pub use kernels::cpu::kda::*;
