//! The parsers against vLLM's own output (tests/reference/parsers/vllm_expected.json, made by
//! running vLLM 0.33's parsers): whole-output parsing, and streaming split at every char
//! boundary and fed token by token, each assembled back, must give vLLM's answer.

use serde_json::Value;
use wasmserve_guest::harness::{boundaries, split_at, token_like_chunks, ToolAssembler};
use wasmserve_guest::{ReasoningStream, RequestContext, ToolCall, ToolParser, ToolStream};
use wasmserve_parsers::{hermes::Hermes, kimi_k2::KimiK2, kimi_k3, qwen3::Qwen3, think};

#[derive(Debug, PartialEq)]
struct Out {
    reasoning: Option<String>,
    content: Option<String>,
    calls: Vec<(String, String, String)>,
}

#[derive(Clone, Copy)]
enum R {
    None,
    Think(think::Flavor),
    KimiK3,
}
#[derive(Clone, Copy, Debug)]
enum T {
    None,
    Hermes,
    Kimi,
    KimiK3,
    Qwen3,
}

fn reasoning_stream(r: &R, ctx: &RequestContext) -> Option<Box<dyn ReasoningStream>> {
    match r {
        R::None => None,
        R::Think(f) => Some(Box::new(think::ThinkStream::new(*f, ctx))),
        R::KimiK3 => Some(Box::new(kimi_k3::K3ReasoningStream::new(ctx))),
    }
}

fn boxed<S: ToolStream + 'static>(mut s: S) -> Box<dyn FnMut(&str, bool) -> wasmserve_guest::ToolDelta> {
    Box::new(move |x: &str, fin: bool| {
        let mut d = s.feed(x, &[]);
        if fin {
            let e = s.finish();
            d.content.push_str(&e.content);
            d.tool_calls.extend(e.tool_calls);
        }
        d
    })
}

fn tool_stream(t: &T, ctx: &RequestContext) -> Option<Box<dyn FnMut(&str, bool) -> wasmserve_guest::ToolDelta>> {
    match t {
        T::None => None,
        T::Hermes => Some(boxed(Hermes.stream(ctx))),
        T::Kimi => Some(boxed(KimiK2.stream(ctx))),
        T::KimiK3 => Some(boxed(kimi_k3::KimiK3Tools.stream(ctx))),
        T::Qwen3 => Some(boxed(Qwen3.stream(ctx))),
    }
}

/// What the server does with a finished text: reasoning parser, then the tool parser on the content.
fn whole(r: &R, t: &T, text: &str, ctx: &RequestContext) -> Out {
    let (reasoning, content) = match r {
        R::None => (None, Some(text.to_string())),
        R::Think(f) => {
            let x = think::parse(*f, text, ctx);
            (x.reasoning, x.content)
        }
        R::KimiK3 => {
            let x = kimi_k3::parse_reasoning(text, ctx);
            (x.reasoning, x.content)
        }
    };
    let c = content.as_deref().unwrap_or("");
    let res = match t {
        T::None => None,
        T::Hermes => Some(Hermes.parse(c, ctx)),
        T::Kimi => Some(KimiK2.parse(c, ctx)),
        T::KimiK3 => Some(kimi_k3::KimiK3Tools.parse(c, ctx)),
        T::Qwen3 => Some(Qwen3.parse(c, ctx)),
    };
    // As the host does: with calls, whitespace-only content is dropped; without, the tool
    // parser's content is the message content.
    match res {
        Some(res) if !res.tool_calls.is_empty() => {
            Out { reasoning, content: res.content.filter(|c| !c.trim().is_empty()), calls: calls(res.tool_calls) }
        }
        Some(res) => Out { reasoning, content: res.content.filter(|c| !c.is_empty()), calls: vec![] },
        None => Out { reasoning, content, calls: vec![] },
    }
}

fn calls(c: Vec<ToolCall>) -> Vec<(String, String, String)> {
    c.into_iter().map(|c| (c.id, c.name, c.arguments)).collect()
}

fn streamed(r: &R, t: &T, chunks: &[&str], ctx: &RequestContext) -> Out {
    let mut rs = reasoning_stream(r, ctx);
    let mut ts = tool_stream(t, ctx);
    let mut reasoning = String::new();
    let mut asm = ToolAssembler::default();
    let n = chunks.len();
    for (i, c) in chunks.iter().enumerate() {
        let last = i + 1 == n;
        let mut content = String::new();
        if let Some(s) = rs.as_mut() {
            let d = s.feed(c, &[]);
            reasoning.push_str(&d.reasoning);
            content.push_str(&d.content);
            if last {
                let d = s.finish();
                reasoning.push_str(&d.reasoning);
                content.push_str(&d.content);
            }
        } else {
            content.push_str(c);
        }
        match ts.as_mut() {
            Some(f) => asm.add(f(&content, last)).unwrap(),
            None => asm.content.push_str(&content),
        }
    }
    let content = Some(asm.content).filter(|c| if asm.calls.is_empty() { !c.is_empty() } else { !c.trim().is_empty() });
    Out { reasoning: Some(reasoning).filter(|r| !r.is_empty()), content, calls: calls(asm.calls) }
}

fn expected(e: &Value) -> Out {
    let s = |v: &Value| v.as_str().map(str::to_string);
    Out {
        reasoning: s(&e["reasoning"]),
        content: s(&e["content"]),
        calls: e["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                // vLLM's hermes ids are random (`chatcmpl-tool-…`); the plugin leaves them to the host.
                let id = c["id"].as_str().unwrap();
                let id = if id.starts_with("chatcmpl-tool-") { String::new() } else { id.to_string() };
                (id, c["name"].as_str().unwrap().to_string(), c["arguments"].as_str().unwrap().to_string())
            })
            .collect(),
    }
}

/// Streaming cannot tell `""` reasoning from none (DeepSeek-R1's `<think></think>`): compare
/// the way a streaming client sees it.
fn as_streamed(mut o: Out) -> Out {
    o.reasoning = o.reasoning.filter(|r| !r.is_empty());
    o
}

#[test]
fn parsers_match_vllm_whole_and_streamed_at_every_split() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/reference/parsers/vllm_expected.json");
    let data: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let markers = [
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        wasmserve_parsers::kimi_k2::SECTION_BEGIN,
        wasmserve_parsers::kimi_k2::SECTION_END,
        wasmserve_parsers::kimi_k2::CALL_BEGIN,
        wasmserve_parsers::kimi_k2::ARG_BEGIN,
        wasmserve_parsers::kimi_k2::CALL_END,
        "<|open|>",
        "<|close|>",
        "<|sep|>",
    ];
    let (mut cases, mut streams) = (0, 0);
    let mut failures = Vec::new();
    for case in data["cases"].as_array().unwrap() {
        let r = match case["reasoning_parser"].as_str() {
            None => R::None,
            Some("deepseek_r1") => R::Think(think::Flavor::DeepSeekR1),
            Some("qwen3") => R::Think(think::Flavor::Qwen3),
            Some("kimi_k2") => R::Think(think::Flavor::KimiK2),
            Some("kimi_k3") => R::KimiK3,
            Some(o) => panic!("unknown reasoning parser {o}"),
        };
        // The `qwen3` tool parser answers vLLM's `hermes` on JSON calls and `qwen3_coder` on XML ones.
        let ts: &[T] = match case["tool_parser"].as_str() {
            None => &[T::None],
            Some("hermes") => &[T::Hermes, T::Qwen3],
            Some("kimi_k2") => &[T::Kimi],
            Some("kimi_k3") => &[T::KimiK3],
            Some("qwen3_coder") => &[T::Qwen3],
            Some(o) => panic!("unknown tool parser {o}"),
        };
        let truncated = case.get("truncated_call").and_then(Value::as_bool) == Some(true);
        for &t in ts {
            let ctx = RequestContext {
                tools: case["tools"].to_string(),
                template_kwargs: case.get("chat_template_kwargs").map_or("{}".into(), |k| k.to_string()),
                history_tool_calls: 0,
            };
            let text = case["text"].as_str().unwrap();
            let want = expected(&case["expected"]);
            let label = format!("{}/{} as {t:?} {:?}", case["reasoning_parser"], case["tool_parser"], text);
            let got = whole(&r, &t, text, &ctx);
            if got != want {
                failures.push(format!("whole {label}:\n  got  {got:?}\n  want {want:?}"));
            }
            cases += 1;
            let want = as_streamed(want);
            let tokens = token_like_chunks(text, &markers);
            let mut splits: Vec<Vec<&str>> = boundaries(text).into_iter().map(|b| split_at(text, b)).collect();
            splits.push(tokens);
            for chunks in &splits {
                let mut got = streamed(&r, &t, chunks, &ctx);
                streams += 1;
                if truncated {
                    // A call still open at the end was streamed already (vLLM's whole parse drops it).
                    assert!(got.calls.len() == want.calls.len() + 1, "{label}: the open call was not streamed");
                    got.calls.pop();
                }
                if got != want {
                    failures.push(format!("stream {label} chunks {chunks:?}:\n  got  {got:?}\n  want {want:?}"));
                    break;
                }
            }
        }
    }
    eprintln!("{cases} cases, {streams} streamed splits");
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}
