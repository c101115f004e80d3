//! The `hermes` tool parser plugin (logic in wasmserve-parsers).
wasmserve_guest::export_tool_parser!(wasmserve_parsers::hermes::Hermes);
