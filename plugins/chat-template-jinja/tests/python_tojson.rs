//! The plugin's logic compiled natively: `tojson` writes what Python's json.dumps writes for
//! every keyword combination in tests/reference/templates/tojson_expected.json (made by
//! transformers). tests/plugins.rs in the host runs the same fixture through the Wasm build.

use chat_template_jinja::JinjaTemplate;
use serde_json::{json, Value};
use wasmserve_guest::{ChatTemplate, Plugin, RenderOptions};

#[test]
fn tojson_matches_python_json_dumps() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/reference/templates/tojson_expected.json");
    let data: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = data["cases"].as_array().unwrap();
    let mut failures = Vec::new();
    for case in cases {
        let t = JinjaTemplate::configure(&json!({"template": case["template"]}).to_string()).unwrap();
        let opts = RenderOptions {
            add_generation_prompt: false,
            reasoning_effort: None,
            extra: json!({"value": case["value"]}).to_string(),
        };
        let got = t.render("[]", None, &opts).map(|r| r.prompt);
        if got.as_deref() != Ok(case["expected"].as_str().unwrap()) {
            failures
                .push(format!("{} {}: got {got:?}, want {}", case["value_name"], case["template"], case["expected"]));
        }
    }
    assert!(failures.is_empty(), "{} of {} differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
    assert!(cases.len() >= 60);
}

#[test]
fn bad_separators_are_an_error() {
    let t =
        JinjaTemplate::configure(&json!({"template": "{{ [1] | tojson(separators=(',',)) }}"}).to_string()).unwrap();
    let opts = RenderOptions { add_generation_prompt: false, reasoning_effort: None, extra: "{}".into() };
    assert!(t.render("[]", None, &opts).unwrap_err().contains("separators"));
}
