//! Which reasoning and tool-call parsers a model gets without a plugin config, and the
//! vLLM-style `--reasoning-parser` / `--tool-call-parser` choice.
//!
//! vLLM users name a parser per model family (`--reasoning-parser qwen3 --tool-call-parser
//! hermes`); `auto` picks the one those users would pick, from the served model's name and
//! then from the markers its chat template writes (a template that emits `<tool_call>` is
//! answered in that format). The chosen parsers are the shipped components in the plugin
//! directory, deployed for every model and tenant under fixed names; a `--plugins` config that
//! deploys a parser of a kind wins over `auto` for that kind.

use std::path::{Path, PathBuf};

use super::registry::{DeploymentSpec, Kind, Registry};

/// One CLI choice: `auto` (the default), `none`, or a parser name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    Auto,
    Off,
    Named(String),
}

impl Choice {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "" | "auto" => Ok(Choice::Auto),
            "none" | "off" => Ok(Choice::Off),
            name => Ok(Choice::Named(name.to_string())),
        }
    }
}

/// The parsers `auto` picks: vLLM parser names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Detected {
    pub reasoning: Option<&'static str>,
    pub tool: Option<&'static str>,
}

const fn pick(reasoning: Option<&'static str>, tool: Option<&'static str>) -> Detected {
    Detected { reasoning, tool }
}

/// The parsers a vLLM user would start `model_name` with. The name decides first (it is what
/// users go by, and it tells e.g. DeepSeek-R1 from V3); then the chat template's own markers.
pub fn detect(model_name: &str, template: Option<&str>) -> Detected {
    let n = model_name.to_ascii_lowercase().replace('_', "-");
    let t = template.unwrap_or("");
    let has = |m: &str| t.contains(m);
    let thinks = has("<think>");
    if n.contains("kimi-k3") || (has("<|open|>") && has("<|end_of_msg|>")) {
        return pick(Some("kimi_k3"), Some("kimi_k3"));
    }
    if n.contains("kimi-k2") || has("<|tool_calls_section_begin|>") {
        // K2 Instruct does not think; K2 Thinking writes <think> (vLLM: kimi_k2 for both).
        let reasoning = (thinks || n.contains("thinking")).then_some("kimi_k2");
        return pick(reasoning, Some("kimi_k2"));
    }
    if n.contains("deepseek-r1") {
        return pick(Some("deepseek_r1"), None);
    }
    if n.contains("qwen3-coder") {
        return pick(None, Some("qwen3_coder"));
    }
    if n.contains("qwen3") || n.contains("qwq") {
        return pick(Some("qwen3"), Some(if has("<function=") { "qwen3_coder" } else { "hermes" }));
    }
    // Template markers only: Qwen3-Coder-style XML calls, then Hermes-style JSON calls.
    let reasoning = (thinks && has("</think>") && has("enable_thinking") && has("<tool_call>")).then_some("qwen3");
    if has("<tool_call>") && has("<function=") {
        return pick(reasoning, Some("qwen3_coder"));
    }
    if has("<tool_call>") {
        return pick(reasoning, Some("hermes"));
    }
    Detected::default()
}

/// The shipped component (file stem in the plugin directory) for a vLLM reasoning parser name.
pub fn reasoning_component(name: &str) -> Result<&'static str, String> {
    Ok(match name {
        "deepseek_r1" => "reasoning-deepseek-r1",
        "qwen3" => "reasoning-qwen3",
        "kimi_k2" => "reasoning-kimi-k2",
        "kimi_k3" => "reasoning-kimi-k3",
        other => {
            return Err(format!(
                "unknown reasoning parser '{other}' (shipped: deepseek_r1, qwen3, kimi_k2, kimi_k3; or auto, none)"
            ))
        }
    })
}

/// The shipped component for a vLLM tool-call parser name (`tool-qwen3` reads both Qwen3's
/// JSON calls, vLLM's `hermes`, and Qwen3-Coder's XML calls, vLLM's `qwen3_coder`/`qwen3_xml`).
pub fn tool_component(name: &str) -> Result<&'static str, String> {
    Ok(match name {
        "hermes" => "tool-hermes",
        "kimi_k2" => "tool-kimi-k2",
        "kimi_k3" => "tool-kimi-k3",
        "qwen3" | "qwen3_coder" | "qwen3_xml" => "tool-qwen3",
        other => return Err(format!("unknown tool-call parser '{other}' (shipped: hermes, kimi_k2, kimi_k3, qwen3_coder, qwen3_xml; or auto, none)")),
    })
}

/// A parser to deploy: its kind, the vLLM name, the component stem, whether the user named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    pub kind: Kind,
    pub parser: String,
    pub component: &'static str,
    pub explicit: bool,
}

/// What to deploy for the two choices. `configured(kind)` says whether the plugin config already
/// deploys that kind: `auto` then adds nothing, and a named parser is a conflict.
pub fn plan(
    reasoning: &Choice,
    tool: &Choice,
    detected: Detected,
    configured: impl Fn(Kind) -> bool,
) -> Result<Vec<Planned>, String> {
    let mut out = Vec::new();
    let kinds: [(Kind, &Choice, Option<&'static str>, fn(&str) -> Result<&'static str, String>, &str); 2] = [
        (Kind::ReasoningParser, reasoning, detected.reasoning, reasoning_component, "--reasoning-parser"),
        (Kind::ToolParser, tool, detected.tool, tool_component, "--tool-call-parser"),
    ];
    for (kind, choice, auto, component, flag) in kinds {
        let (parser, explicit) = match choice {
            Choice::Off => continue,
            Choice::Named(n) if configured(kind) => {
                return Err(format!(
                    "{flag} {n}: the --plugins config already deploys a {kind:?} (use one or the other)"
                ))
            }
            Choice::Named(n) => (n.clone(), true),
            Choice::Auto if configured(kind) => continue,
            Choice::Auto => match auto {
                Some(p) => (p.to_string(), false),
                None => continue,
            },
        };
        out.push(Planned { kind, component: component(&parser)?, parser, explicit });
    }
    Ok(out)
}

/// Where the built components are: `--plugin-dir`, else `target/plugins` next to the binary's
/// own directory (`target/release/wasmserve` -> `target/plugins`), else `./target/plugins`.
pub fn plugin_dir(explicit: Option<&Path>) -> PathBuf {
    if let Some(d) = explicit {
        return d.to_path_buf();
    }
    let beside_exe = std::env::current_exe().ok().and_then(|e| Some(e.parent()?.parent()?.join("plugins")));
    match beside_exe {
        Some(d) if d.is_dir() => d,
        _ => PathBuf::from("target/plugins"),
    }
}

/// Deploys the planned parsers from `dir`. A parser the user named must load (the server does
/// not start otherwise); an `auto` one whose component is not built is skipped with a warning.
pub fn deploy(reg: &Registry, planned: &[Planned], dir: &Path) -> Result<(), String> {
    for p in planned {
        let file = dir.join(format!("{}.wasm", p.component));
        let bytes = match std::fs::read(&file) {
            Ok(b) => b,
            Err(e) if p.explicit => {
                return Err(format!(
                    "{} parser '{}': reading {}: {e} (run scripts/build-plugins or pass --plugin-dir)",
                    kind_flag(p.kind),
                    p.parser,
                    file.display()
                ))
            }
            Err(e) => {
                tracing::warn!(parser = %p.parser, file = %file.display(), error = %e, "auto-selected parser not deployed: component missing (scripts/build-plugins)");
                continue;
            }
        };
        let name = match p.kind {
            Kind::ReasoningParser => "default-reasoning-parser",
            _ => "default-tool-parser",
        };
        let spec = DeploymentSpec {
            name: name.into(),
            kind: p.kind,
            component: Some(file.clone()),
            models: vec![],
            tenants: vec![],
            config: serde_json::json!({}),
            limits: Default::default(),
        };
        reg.deploy(spec, &bytes)
            .map_err(|e| format!("{} parser '{}' ({}): {e}", kind_flag(p.kind), p.parser, file.display()))?;
        tracing::info!(parser = %p.parser, component = p.component, auto = !p.explicit, "parser deployed");
    }
    Ok(())
}

fn kind_flag(k: Kind) -> &'static str {
    match k {
        Kind::ReasoningParser => "reasoning",
        _ => "tool-call",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(file: &str) -> String {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference");
        if file == "SmolLM2" {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("smollm2/fixtures.json")).unwrap()).unwrap();
            return v["chat_template"].as_str().unwrap().to_string();
        }
        std::fs::read_to_string(dir.join("templates").join(file)).unwrap()
    }

    /// The real templates, served under a neutral name (so only the markers decide) and under
    /// their model names, get the parsers vLLM's docs name for those models.
    #[test]
    fn auto_picks_what_vllm_users_pick() {
        let cases: &[(&str, &str, Option<&str>, Option<&str>)] = &[
            ("Kimi-K3.jinja", "moonshotai/Kimi-K3", Some("kimi_k3"), Some("kimi_k3")),
            ("Kimi-K2-Instruct.jinja", "Kimi-K2-Instruct", None, Some("kimi_k2")),
            ("moonshotai-Kimi-K2.jinja", "Kimi-K2", None, Some("kimi_k2")),
            ("Kimi-K2-Thinking.jinja", "Kimi-K2-Thinking", Some("kimi_k2"), Some("kimi_k2")),
            ("Qwen-Qwen3-0.6B.jinja", "Qwen3-0.6B", Some("qwen3"), Some("hermes")),
            ("Qwen3-Coder.jinja", "Qwen3-Coder-30B-A3B-Instruct", None, Some("qwen3_coder")),
            ("Qwen3.5-4B.jinja", "Qwen3.5-4B", Some("qwen3"), Some("qwen3_coder")),
            ("Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen2.5-7B-Instruct", None, Some("hermes")),
            ("SmolLM2", "SmolLM2-135M-Instruct.Q4_1", None, None),
        ];
        for (file, name, reasoning, tool) in cases {
            let t = template(file);
            let want = Detected { reasoning: *reasoning, tool: *tool };
            assert_eq!(detect(name, Some(&t)), want, "{name}");
            assert_eq!(detect("model", Some(&t)), want, "{file} by its markers");
        }
        // Names alone (a GGUF whose template is missing, or a name the template cannot tell).
        assert_eq!(
            detect("DeepSeek-R1-Distill-Qwen-7B", None),
            Detected { reasoning: Some("deepseek_r1"), tool: None }
        );
        assert_eq!(detect("kimi_k3_tiny", None), Detected { reasoning: Some("kimi_k3"), tool: Some("kimi_k3") });
        // DeepSeek-V3.x think only when asked: no deepseek_r1 by default (vLLM: deepseek_v3).
        assert_eq!(detect("DeepSeek-V3.1", Some(&template("deepseek-ai-DeepSeek-V3.1.jinja"))), Detected::default());
    }

    #[test]
    fn explicit_choice_overrides_and_conflicts_are_refused() {
        let k3 = detect("Kimi-K3", None);
        let none = |_: Kind| false;
        let p = plan(&Choice::Auto, &Choice::Auto, k3, none).unwrap();
        assert_eq!(
            p.iter().map(|p| (p.component, p.explicit)).collect::<Vec<_>>(),
            [("reasoning-kimi-k3", false), ("tool-kimi-k3", false)]
        );
        // vLLM-style names: qwen3_coder is served by the tool-qwen3 component.
        let p = plan(&Choice::parse("qwen3").unwrap(), &Choice::parse("qwen3_coder").unwrap(), k3, none).unwrap();
        assert_eq!(
            p.iter().map(|p| (p.component, p.explicit)).collect::<Vec<_>>(),
            [("reasoning-qwen3", true), ("tool-qwen3", true)]
        );
        assert!(plan(&Choice::Off, &Choice::parse("none").unwrap(), k3, none).unwrap().is_empty());
        // A config that deploys a tool parser wins over auto; naming one as well is refused.
        let cfg_tool = |k: Kind| k == Kind::ToolParser;
        let p = plan(&Choice::Auto, &Choice::Auto, k3, cfg_tool).unwrap();
        assert_eq!(p.iter().map(|p| p.component).collect::<Vec<_>>(), ["reasoning-kimi-k3"]);
        assert!(plan(&Choice::Auto, &Choice::Named("hermes".into()), k3, cfg_tool)
            .unwrap_err()
            .contains("already deploys"));
        assert!(plan(&Choice::Named("nope".into()), &Choice::Auto, k3, none)
            .unwrap_err()
            .contains("unknown reasoning parser 'nope'"));
    }

    #[test]
    fn a_named_parser_must_load_and_an_auto_one_may_be_missing() {
        let reg = Registry::new(crate::plugins::Runtime::new(None).unwrap());
        let dir = std::env::temp_dir().join(format!("wasmserve-no-plugins-{}", std::process::id()));
        let auto = plan(&Choice::Auto, &Choice::Auto, detect("Kimi-K3", None), |_| false).unwrap();
        deploy(&reg, &auto, &dir).unwrap();
        assert!(reg.list().is_empty());
        let named = plan(&Choice::Named("kimi_k3".into()), &Choice::Off, Detected::default(), |_| false).unwrap();
        assert!(deploy(&reg, &named, &dir).unwrap_err().contains("reasoning-kimi-k3.wasm"));
    }
}
