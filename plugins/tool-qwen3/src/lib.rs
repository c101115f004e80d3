//! The `qwen3` tool parser plugin: Qwen3 JSON and Qwen3-Coder XML calls (logic in wasmserve-parsers).
wasmserve_guest::export_tool_parser!(wasmserve_parsers::qwen3::Qwen3);
