//! The `kimi-k2` reasoning parser plugin (logic in wasmserve-parsers).
wasmserve_guest::export_reasoning_parser!(wasmserve_parsers::think::KimiK2);
