//! The plugin host against the real built components (target/plugins/, from
//! scripts/build-plugins): hostile fixtures are contained (each failure fails only its own
//! call, within its limit, and the next call succeeds), parsers give vLLM's answers through
//! Wasm, instance caps and the compiled-component cache work.
//!
//! Without built components these tests skip, unless WASMSERVE_REQUIRE_PLUGINS=1 (scripts/test).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use wasmserve::plugins::metrics::PluginMetrics;
use wasmserve::plugins::parsers::{self, ToolPool};
use wasmserve::plugins::policy::{self, Decision, PolicyPool, RequestInfo};
use wasmserve::plugins::{FailureKind, PluginLimits, RequestContext, Runtime};

fn component(name: &str) -> Option<Vec<u8>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/plugins").join(format!("{name}.wasm"));
    match std::fs::read(&path) {
        Ok(b) => Some(b),
        Err(_) if std::env::var("WASMSERVE_REQUIRE_PLUGINS").is_ok_and(|v| v == "1") => {
            panic!("{} is missing: run scripts/build-plugins", path.display())
        }
        Err(_) => {
            eprintln!("SKIPPED: {} not built (run scripts/build-plugins)", path.display());
            None
        }
    }
}

fn limits() -> PluginLimits {
    PluginLimits {
        memory_bytes: 32 << 20,
        call_timeout_ms: 50,
        max_output_bytes: 1 << 20,
        max_instances: 4,
        pool_size: 2,
        ..Default::default()
    }
}

fn tool_pool(rt: &Runtime, name: &str, limits: PluginLimits) -> Option<Arc<ToolPool>> {
    let c = rt.compile(&component(name)?).unwrap();
    Some(ToolPool::new(rt, name, &c, "{}", limits, Arc::new(PluginMetrics::default())).unwrap())
}

#[test]
fn hostile_tool_parser_failures_are_contained() {
    let rt = Runtime::new(None).unwrap();
    let Some(pool) = tool_pool(&rt, "hostile-tool", limits()) else { return };
    // The allocation bomb gets time to reach its memory limit rather than its deadline, even on
    // a loaded machine (page faults of 32 MiB).
    let bomb_pool = tool_pool(&rt, "hostile-tool", PluginLimits { call_timeout_ms: 5000, ..limits() }).unwrap();
    let ctx = RequestContext::default();
    let cases = [
        ("LOOP", FailureKind::Timeout),
        ("BOMB", FailureKind::OutOfMemory),
        ("TRAP", FailureKind::Trap),
        ("HUGE", FailureKind::InvalidOutput),
        ("BADUTF8", FailureKind::InvalidOutput),
    ];
    for (trigger, kind) in cases {
        let pool = if trigger == "BOMB" { &bomb_pool } else { &pool };
        let t = Instant::now();
        let err = parsers::tool_parse(pool, &format!("please {trigger} now"), &ctx).unwrap_err();
        let took = t.elapsed();
        eprintln!("{trigger}: {:?} in {:.1} ms: {}", err.kind, took.as_secs_f64() * 1e3, err.message);
        assert_eq!(err.kind, kind, "{trigger}: {err}");
        assert_eq!(err.plugin, "hostile-tool");
        assert!(took < Duration::from_millis(5000), "{trigger} took {took:?}");
        // The next, normal call on the same deployment succeeds.
        let ok = parsers::tool_parse(pool, "fine", &ctx).unwrap();
        assert_eq!(ok.content.as_deref(), Some("fine"));
    }
    let m = pool.metrics.to_json();
    eprintln!("metrics: {m}");
    assert_eq!(m["timeouts"], 1);
    assert_eq!(bomb_pool.metrics.to_json()["out_of_memory"], 1);
    assert_eq!(m["traps"], 1);
    assert_eq!(m["invalid_output"], 2);
    assert_eq!(m["instances_discarded"], 4);
    // The timeout is enforced close to its limit (one epoch tick of slack, plus scheduling).
    let t = Instant::now();
    let _ = parsers::tool_parse(&pool, "LOOP", &ctx).unwrap_err();
    assert!(t.elapsed() < Duration::from_millis(50 + 500), "timeout took {:?}", t.elapsed());
}

#[test]
fn a_failing_stream_does_not_disturb_other_streams() {
    let rt = Runtime::new(None).unwrap();
    let Some(pool) = tool_pool(&rt, "hostile-tool", limits()) else { return };
    let ctx = RequestContext::default();
    let mut good = parsers::tool_session(&pool, &ctx).unwrap();
    let mut bad = parsers::tool_session(&pool, &ctx).unwrap();
    assert_eq!(good.feed("a", &[]).unwrap().content, "a");
    assert_eq!(bad.feed("b", &[]).unwrap().content, "b");
    assert_eq!(bad.feed("TRAP", &[]).unwrap_err().kind, FailureKind::Trap);
    assert_eq!(bad.feed("c", &[]).unwrap_err().kind, FailureKind::Trap, "a failed session stays failed");
    assert_eq!(good.feed("c", &[]).unwrap().content, "c");
    drop(bad);
    drop(good);
    let mut again = parsers::tool_session(&pool, &ctx).unwrap();
    assert_eq!(again.feed("d", &[]).unwrap().content, "d");
}

#[test]
fn instance_cap_answers_busy() {
    let rt = Runtime::new(None).unwrap();
    let Some(pool) = tool_pool(&rt, "hostile-tool", PluginLimits { max_instances: 2, pool_size: 1, ..limits() }) else {
        return;
    };
    let ctx = RequestContext::default();
    let a = parsers::tool_session(&pool, &ctx).unwrap();
    let _b = parsers::tool_session(&pool, &ctx).unwrap();
    assert_eq!(parsers::tool_session(&pool, &ctx).err().unwrap().kind, FailureKind::Busy);
    drop(a);
    assert!(parsers::tool_session(&pool, &ctx).is_ok());
}

#[test]
fn hostile_policy_invalid_json_and_loop_are_contained() {
    let rt = Runtime::new(None).unwrap();
    let Some(bytes) = component("hostile-policy") else { return };
    let c = rt.compile(&bytes).unwrap();
    let pool = PolicyPool::new(&rt, "hostile-policy", &c, "{}", limits(), Arc::new(PluginMetrics::default())).unwrap();
    let req = |params: &str| RequestInfo { params: params.into(), ..Default::default() };
    let e = policy::check(&pool, &req(r#"{"user": "BADJSON"}"#)).unwrap_err();
    assert_eq!(e.kind, FailureKind::InvalidOutput, "{e}");
    assert!(e.message.contains("not valid JSON"), "{e}");
    assert_eq!(policy::check(&pool, &req("{}")).unwrap(), Decision::Allow);
    assert_eq!(policy::check(&pool, &req(r#"{"user": "LOOP"}"#)).unwrap_err().kind, FailureKind::Timeout);
    assert_eq!(policy::check(&pool, &req("{}")).unwrap(), Decision::Allow);
}

#[test]
fn shipped_policies_decide() {
    let rt = Runtime::new(None).unwrap();
    let (Some(cap), Some(allow), Some(len)) = (
        component("policy-max-tokens-cap"),
        component("policy-model-allow-list"),
        component("policy-prompt-length-limit"),
    ) else {
        return;
    };
    let mk = |b: &[u8], cfg: &str| {
        PolicyPool::new(&rt, "p", &rt.compile(b).unwrap(), cfg, limits(), Arc::new(PluginMetrics::default()))
    };
    let cap = mk(&cap, r#"{"max_tokens": 64, "tenants": {"free": 8}}"#).unwrap();
    let allow = mk(&allow, r#"{"models": ["m1"]}"#).unwrap();
    let len = mk(&len, r#"{"max_prompt_tokens": 10}"#).unwrap();
    let req = RequestInfo {
        tenant: "free".into(),
        model: "m2".into(),
        prompt_tokens: 11,
        params: "{}".into(),
        ..Default::default()
    };
    assert!(matches!(policy::check(&cap, &req).unwrap(), Decision::Rewrite { max_tokens_cap: Some(8), .. }));
    assert!(matches!(policy::check(&allow, &req).unwrap(), Decision::Reject { status: 403, .. }));
    assert!(matches!(policy::check(&len, &req).unwrap(), Decision::Reject { status: 400, .. }));
    // A config the plugin refuses fails the deployment, naming the problem.
    let e = mk(
        &std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/plugins/policy-prompt-length-limit.wasm"),
        )
        .unwrap(),
        "{}",
    )
    .err()
    .unwrap();
    assert!(e.contains("max_prompt_tokens"), "{e}");
}

#[test]
fn a_component_of_the_wrong_world_is_refused() {
    let rt = Runtime::new(None).unwrap();
    let Some(bytes) = component("policy-max-tokens-cap") else { return };
    let c = rt.compile(&bytes).unwrap();
    let e = ToolPool::new(&rt, "x", &c, "{}", limits(), Arc::new(PluginMetrics::default())).err().unwrap();
    assert!(e.contains("tool-parser-plugin"), "{e}");
    assert!(rt.compile(b"not wasm").is_err());
}

#[test]
fn compiled_components_are_cached_in_memory_and_on_disk() {
    let Some(bytes) = component("tool-hermes") else { return };
    let dir = std::env::temp_dir().join(format!("wasmserve-cache-{}", std::process::id()));
    let rt = Runtime::new(Some(dir.clone())).unwrap();
    let t = Instant::now();
    rt.compile(&bytes).unwrap();
    let cold = t.elapsed();
    let t = Instant::now();
    rt.compile(&bytes).unwrap();
    let warm = t.elapsed();
    // A new runtime (a restart) loads the serialized code instead of compiling.
    let rt2 = Runtime::new(Some(dir.clone())).unwrap();
    let t = Instant::now();
    rt2.compile(&bytes).unwrap();
    let disk = t.elapsed();
    eprintln!("compile: cold {cold:?}, memory cache {warm:?}, disk cache {disk:?}");
    assert!(warm < cold && disk < cold);
    let _ = std::fs::remove_dir_all(dir);
}

/// The Wasm parsers give the same answers as the native ones checked against vLLM
/// (plugins/parsers/tests/vllm_fixtures.rs), whole and streamed char by char.
#[test]
fn wasm_parsers_match_vllm_fixtures() {
    let rt = Runtime::new(None).unwrap();
    let (Some(kimi), Some(hermes)) =
        (tool_pool(&rt, "tool-kimi-k2", limits()), tool_pool(&rt, "tool-hermes", limits()))
    else {
        return;
    };
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/parsers/vllm_expected.json");
    let data: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut n = 0;
    for case in data["cases"].as_array().unwrap() {
        // Tool parser alone on the text: the cases with no reasoning parser.
        if !case["reasoning_parser"].is_null() {
            continue;
        }
        let pool = match case["tool_parser"].as_str() {
            Some("hermes") => &hermes,
            Some("kimi_k2") => &kimi,
            _ => continue,
        };
        let text = case["text"].as_str().unwrap();
        let want = &case["expected"];
        let ctx = RequestContext::default();
        let got = parsers::tool_parse(pool, text, &ctx).unwrap();
        assert_eq!(got.content.as_deref(), want["content"].as_str(), "{text:?}");
        let names: Vec<&str> = got.tool_calls.iter().map(|c| c.name.as_str()).collect();
        let want_names: Vec<&str> =
            want["tool_calls"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
        assert_eq!(names, want_names, "{text:?}");
        let mut s = parsers::tool_session(pool, &ctx).unwrap();
        let mut args = vec![String::new(); names.len()];
        let mut content = String::new();
        let mut deltas: Vec<_> =
            text.char_indices().map(|(i, c)| s.feed(&text[i..i + c.len_utf8()], &[]).unwrap()).collect();
        deltas.push(s.finish().unwrap());
        for d in deltas {
            content.push_str(&d.content);
            for c in d.tool_calls {
                args[c.index as usize].push_str(&c.arguments);
            }
        }
        let want_args: Vec<&str> =
            want["tool_calls"].as_array().unwrap().iter().map(|c| c["arguments"].as_str().unwrap()).collect();
        assert_eq!(args, want_args, "{text:?}");
        n += 1;
    }
    assert!(n >= 9, "only {n} cases ran");
}

/// The host's parser chain (reasoning deployment, then the tool deployment on its content, as
/// chat completions run them) with the real Kimi K3 and Qwen3 components gives vLLM's answers
/// (vllm_expected.json), for the whole text and streamed one char per delta.
#[test]
fn wasm_parser_chain_matches_vllm_for_kimi_k3_and_qwen3() {
    use wasmserve::plugins::output_parsers::ChatParsers;
    use wasmserve::plugins::registry::{DeploymentSpec, Kind, Registry};
    let names = ["reasoning-kimi-k3", "tool-kimi-k3", "reasoning-qwen3", "tool-qwen3"];
    let mut bytes = std::collections::HashMap::new();
    for n in names {
        let Some(b) = component(n) else { return };
        bytes.insert(n, b);
    }
    let registry = |reasoning: Option<&str>, tool: &str| {
        let reg = Registry::new(Runtime::new(None).unwrap());
        let deploy = |name: &str, kind: Kind, comp: &str| {
            let spec = DeploymentSpec {
                name: name.into(),
                kind,
                component: None,
                models: vec![],
                tenants: vec![],
                config: serde_json::json!({}),
                limits: limits(),
            };
            reg.deploy(spec, &bytes[comp]).unwrap();
        };
        if let Some(r) = reasoning {
            deploy("reasoning", Kind::ReasoningParser, r);
        }
        deploy("tools", Kind::ToolParser, tool);
        reg
    };
    let k3 = registry(Some("reasoning-kimi-k3"), "tool-kimi-k3");
    let qwen = registry(Some("reasoning-qwen3"), "tool-qwen3");
    let qwen_tools_only = registry(None, "tool-qwen3");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/parsers/vllm_expected.json");
    let data: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let (mut n, mut failures) = (0, Vec::new());
    for case in data["cases"].as_array().unwrap() {
        let reg = match (case["reasoning_parser"].as_str(), case["tool_parser"].as_str()) {
            (Some("kimi_k3"), _) => &k3,
            (Some("qwen3"), Some("qwen3_coder" | "hermes")) => &qwen,
            (None, Some("qwen3_coder" | "hermes")) => &qwen_tools_only,
            _ => continue,
        };
        let tools: Vec<Value> = case["tools"].as_array().unwrap().clone();
        // The host gives the tool parser the request's tools (none: no tool parsing).
        let tools = (!tools.is_empty() && !case["tool_parser"].is_null()).then_some(tools);
        let kwargs = case.get("chat_template_kwargs").and_then(Value::as_object);
        let parsers = ChatParsers::select(reg, "m", "", tools.as_deref(), kwargs).unwrap();
        let text = case["text"].as_str().unwrap();
        let want = &case["expected"];
        let want_calls: Vec<(String, String)> = want["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["name"].as_str().unwrap().into(), c["arguments"].as_str().unwrap().into()))
            .collect();
        let k3_ids = case["tool_parser"] == "kimi_k3";
        let want_ids: Vec<&str> =
            want["tool_calls"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap()).collect();

        let (msg, _) = parsers.message(text).unwrap();
        let calls: Vec<(String, String)> = msg["tool_calls"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|c| {
                        (
                            c["function"]["name"].as_str().unwrap().into(),
                            c["function"]["arguments"].as_str().unwrap().into(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let ids: Vec<&str> = msg["tool_calls"]
            .as_array()
            .map(|a| a.iter().map(|c| c["id"].as_str().unwrap()).collect())
            .unwrap_or_default();
        let label = format!("{}/{} {text:?}", case["reasoning_parser"], case["tool_parser"]);
        if msg["content"] != want["content"]
            || msg["reasoning_content"] != want["reasoning"]
            || calls != want_calls
            || (k3_ids && ids != want_ids)
        {
            failures.push(format!("whole {label}: got {msg}, want {want}"));
        }

        let mut s = parsers.stream().unwrap();
        let (mut reasoning, mut content) = (String::new(), String::new());
        let mut streamed: Vec<(String, String, String)> = Vec::new();
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        for (k, (i, c)) in chars.iter().enumerate() {
            let Some(d) = s.delta(&text[*i..i + c.len_utf8()], &[], k + 1 == chars.len()).unwrap() else { continue };
            reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
            content.push_str(d["content"].as_str().unwrap_or(""));
            for c in d["tool_calls"].as_array().into_iter().flatten() {
                let i = c["index"].as_u64().unwrap() as usize;
                if i == streamed.len() {
                    streamed.push((
                        c["id"].as_str().unwrap().into(),
                        c["function"]["name"].as_str().unwrap().into(),
                        String::new(),
                    ));
                }
                streamed[i].2.push_str(c["function"]["arguments"].as_str().unwrap());
            }
        }
        if case.get("truncated_call") == Some(&Value::Bool(true)) {
            streamed.pop();
        }
        let got_calls: Vec<(String, String)> = streamed.iter().map(|c| (c.1.clone(), c.2.clone())).collect();
        let content = Some(content).filter(|c| if got_calls.is_empty() { !c.is_empty() } else { !c.trim().is_empty() });
        let stream_ids: Vec<&str> = streamed.iter().map(|c| c.0.as_str()).collect();
        if content.as_deref() != want["content"].as_str()
            || Some(reasoning.as_str()).filter(|r| !r.is_empty()) != want["reasoning"].as_str()
            || got_calls != want_calls
            || (k3_ids && stream_ids != want_ids)
        {
            failures.push(format!("stream {label}: got {reasoning:?} {content:?} {streamed:?}, want {want}"));
        }
        n += 1;
    }
    eprintln!("{n} cases through the Wasm parser chain");
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    assert!(n >= 50, "only {n} cases ran");
}

/// The chat-template-jinja plugin renders the real templates (tests/reference/templates/) byte
/// for byte as transformers' `apply_chat_template` does (expected.json, made by transformers),
/// and refuses what transformers refuses.
#[test]
fn chat_template_plugin_matches_transformers() {
    use wasmserve::plugins::template::{self, TemplatePool};
    let Some(bytes) = component("chat-template-jinja") else { return };
    let rt = Runtime::new(None).unwrap();
    let c = rt.compile(&bytes).unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference");
    let data: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("templates/expected.json")).unwrap()).unwrap();
    let smol: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("smollm2/fixtures.json")).unwrap()).unwrap();
    let mut pools: std::collections::HashMap<String, Arc<TemplatePool>> = Default::default();
    let (mut same, mut refused) = (0, 0);
    let mut failures = Vec::new();
    for case in data["cases"].as_array().unwrap() {
        let name = case["template"].as_str().unwrap();
        let pool = pools.entry(name.to_string()).or_insert_with(|| {
            let src = if name == "SmolLM2-135M-Instruct" {
                smol["chat_template"].as_str().unwrap().to_string()
            } else {
                std::fs::read_to_string(dir.join(format!("templates/{name}.jinja"))).unwrap()
            };
            let cfg =
                serde_json::json!({"template": src, "bos_token": case["bos_token"], "eos_token": case["eos_token"]});
            let limits = PluginLimits { call_timeout_ms: 2000, ..limits() };
            TemplatePool::new(&rt, name, &c, &cfg.to_string(), limits, Arc::new(PluginMetrics::default())).unwrap()
        });
        let tools = (!case["tools"].is_null()).then(|| case["tools"].to_string());
        // Template options as the server passes them: reasoning_effort in the render options,
        // the other chat_template_kwargs as extra variables.
        let mut kwargs = case["kwargs"].as_object().cloned().unwrap_or_default();
        let effort = kwargs.remove("reasoning_effort").map(|v| v.as_str().unwrap().to_string());
        let extra = Value::Object(kwargs).to_string();
        let got = template::render(
            pool,
            &case["messages"].to_string(),
            tools.as_deref(),
            case["add_generation_prompt"].as_bool().unwrap(),
            effort.as_deref(),
            &extra,
        );
        let label = format!("{name}/{}/gen={}/{}", case["conversation"], case["add_generation_prompt"], case["kwargs"]);
        match (got, case["prompt"].as_str()) {
            (Ok(r), Some(want)) if r.prompt == want => same += 1,
            (Err(e), None) => {
                assert_eq!(e.kind, FailureKind::PluginError, "{label}: {e}");
                refused += 1
            }
            (Ok(r), Some(want)) => failures.push(format!("{label}:\n--- got\n{}\n--- want\n{want}", r.prompt)),
            (got, want) => {
                failures.push(format!("{label}: got {:?}, want {want:?}", got.map(|r| r.prompt).map_err(|e| e.message)))
            }
        }
    }
    eprintln!("{same} renderings identical to transformers, {refused} refused by both, {} templates", pools.len());
    assert!(failures.is_empty(), "{} differ:\n{}", failures.len(), failures.join("\n"));
    assert!(same >= 280 && refused >= 20, "{same} same, {refused} refused");
}

/// `tojson` inside the Wasm template plugin honours ensure_ascii / indent / separators /
/// sort_keys exactly as Python's json.dumps (tojson_expected.json, made by transformers).
#[test]
fn chat_template_plugin_tojson_matches_python() {
    use wasmserve::plugins::template::{self, TemplatePool};
    let Some(bytes) = component("chat-template-jinja") else { return };
    let rt = Runtime::new(None).unwrap();
    let c = rt.compile(&bytes).unwrap();
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/templates/tojson_expected.json");
    let data: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut failures = Vec::new();
    let cases = data["cases"].as_array().unwrap();
    for case in cases {
        let cfg = serde_json::json!({"template": case["template"]});
        let pool = TemplatePool::new(&rt, "tojson", &c, &cfg.to_string(), limits(), Arc::new(PluginMetrics::default()))
            .unwrap();
        let extra = serde_json::json!({"value": case["value"]}).to_string();
        let got = template::render(&pool, "[]", None, false, None, &extra).map(|r| r.prompt).map_err(|e| e.message);
        if got.as_deref() != Ok(case["expected"].as_str().unwrap()) {
            failures
                .push(format!("{} {}: got {got:?}, want {}", case["value_name"], case["template"], case["expected"]));
        }
    }
    assert!(failures.is_empty(), "{} of {} differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
    assert!(cases.len() >= 60);
}

fn percentiles(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[(v.len() * 99 / 100).min(v.len() - 1)])
}

/// Benchmark (printed; run with --nocapture): the cost of a plugin call through Wasm against
/// the same parser compiled natively, per call and per streamed token.
#[test]
fn plugin_overhead_benchmark() {
    use wasmserve::plugins::parsers::ReasoningPool;
    use wasmserve_guest::{ReasoningStream as _, ToolStream as _};
    use wasmserve_parsers::{kimi_k2::KimiStream, think};
    let rt = Runtime::new(None).unwrap();
    let (Some(rb), Some(kimi)) = (component("reasoning-kimi-k2"), tool_pool(&rt, "tool-kimi-k2", limits())) else {
        return;
    };
    let reasoning =
        ReasoningPool::new(&rt, "r", &rt.compile(&rb).unwrap(), "{}", limits(), Arc::new(PluginMetrics::default()))
            .unwrap();
    let ctx = RequestContext::default();
    let gctx = wasmserve_guest::RequestContext::default();
    let us = |t: Instant| t.elapsed().as_secs_f64() * 1e6;
    const N: usize = 20_000;

    // 1. Whole-text parse of a short output: lease, call, lift, return.
    let text = "<think>short</think>Hello!";
    let wasm: Vec<f64> = (0..N)
        .map(|_| {
            let t = Instant::now();
            parsers::reasoning_parse(&reasoning, text, &ctx).unwrap();
            us(t)
        })
        .collect();
    let native: Vec<f64> = (0..N)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(think::parse(think::Flavor::KimiK2, text, &gctx));
            us(t)
        })
        .collect();
    let (wp50, wp99) = percentiles(wasm);
    let (np50, np99) = percentiles(native);
    eprintln!("BENCH parse call (kimi_k2 reasoning, 26 bytes): wasm p50 {wp50:.2} us p99 {wp99:.2} us | native p50 {np50:.2} us p99 {np99:.2} us");

    // 2. One streamed delta (a token's text) into a live session.
    let mut s = parsers::reasoning_session(&reasoning, &ctx).unwrap();
    let wasm: Vec<f64> = (0..N)
        .map(|_| {
            let t = Instant::now();
            s.feed("tok ", &[1]).unwrap();
            us(t)
        })
        .collect();
    drop(s);
    let mut ns = think::ThinkStream::new(think::Flavor::KimiK2, &gctx);
    let native: Vec<f64> = (0..N)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(ns.feed("tok ", &[1]));
            us(t)
        })
        .collect();
    let (wp50, wp99) = percentiles(wasm);
    let (np50, np99) = percentiles(native);
    eprintln!("BENCH feed call (one token delta):             wasm p50 {wp50:.2} us p99 {wp99:.2} us | native p50 {np50:.2} us p99 {np99:.2} us");

    // 3. A whole streamed Kimi answer, reasoning then tool parser, per generated token.
    let args: String = (0..200).map(|i| format!("\"k{i}\": \"value {i}\", ")).collect();
    let body = format!(
        "<think>{}</think>Calling.<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{{{args}\"end\": 1}}<|tool_call_end|><|tool_calls_section_end|>",
        "Let me think about this step by step. ".repeat(100)
    );
    let markers = [
        "<think>",
        "</think>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ];
    // ~4 chars per token, markers whole.
    let mut tokens: Vec<String> = Vec::new();
    for piece in wasmserve_guest::harness::token_like_chunks(&body, &markers) {
        match tokens.last_mut() {
            Some(last) if piece.len() == 1 && last.len() < 4 && !markers.contains(&last.as_str()) => {
                last.push_str(piece)
            }
            _ => tokens.push(piece.to_string()),
        }
    }
    let rounds = 5;
    let t = Instant::now();
    let mut wasm_args = String::new();
    for _ in 0..rounds {
        let mut r = parsers::reasoning_session(&reasoning, &ctx).unwrap();
        let mut k = parsers::tool_session(&kimi, &ctx).unwrap();
        wasm_args.clear();
        for tok in &tokens {
            let d = r.feed(tok, &[]).unwrap();
            for c in k.feed(&d.content, &[]).unwrap().tool_calls {
                wasm_args.push_str(&c.arguments);
            }
        }
        let d = r.finish().unwrap();
        k.feed(&d.content, &[]).unwrap();
        k.finish().unwrap();
    }
    let wasm_tok = us(t) / (rounds * tokens.len()) as f64;
    let t = Instant::now();
    let mut native_args = String::new();
    for _ in 0..rounds {
        let mut r = think::ThinkStream::new(think::Flavor::KimiK2, &gctx);
        let mut k = KimiStream::default();
        native_args.clear();
        for tok in &tokens {
            let d = r.feed(tok, &[]);
            for c in k.feed(&d.content, &[]).tool_calls {
                native_args.push_str(&c.arguments);
            }
        }
        let d = r.finish();
        k.feed(&d.content, &[]);
        k.finish();
    }
    let native_tok = us(t) / (rounds * tokens.len()) as f64;
    assert_eq!(wasm_args, native_args);
    eprintln!(
        "BENCH streamed answer, {} tokens ({} bytes), reasoning+tool parser: wasm {wasm_tok:.2} us/token | native {native_tok:.3} us/token | added by Wasm {:.2} us/token",
        tokens.len(),
        body.len(),
        wasm_tok - native_tok
    );
}
