//! The `kimi_k3` reasoning parser plugin (logic in wasmserve-parsers).
wasmserve_guest::export_reasoning_parser!(wasmserve_parsers::kimi_k3::KimiK3Reasoning);
