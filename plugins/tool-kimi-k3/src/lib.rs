//! The `kimi_k3` tool parser plugin (logic in wasmserve-parsers).
wasmserve_guest::export_tool_parser!(wasmserve_parsers::kimi_k3::KimiK3Tools);
