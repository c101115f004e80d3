//! Named plugin deployments and which requests they serve. A deployment is swapped by
//! replacing its `Arc` under a short write lock: requests that already hold the old one
//! (including running streams with leased instances) finish on it, new ones get the new one.
//! A deployment that fails validation is never inserted, so a bad upload changes nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};

use super::metrics::PluginMetrics;
use super::parsers::{ReasoningPool, ToolPool};
use super::policy::PolicyPool;
use super::runtime::{PluginLimits, Runtime};
use super::template::TemplatePool;
use super::PluginInfo;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    ChatTemplate,
    ReasoningParser,
    ToolParser,
    RequestPolicy,
}

/// One entry of the plugin config file / of `POST /admin/plugins`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeploymentSpec {
    pub name: String,
    pub kind: Kind,
    /// Path of the component (config file only; uploads carry the bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub component: Option<PathBuf>,
    /// Served model names this deployment applies to; empty or `"*"` = all.
    #[serde(default)]
    pub models: Vec<String>,
    /// Tenants this deployment applies to; empty or `"*"` = all.
    #[serde(default)]
    pub tenants: Vec<String>,
    /// Passed to the plugin's `configure`.
    #[serde(default = "empty_object")]
    pub config: serde_json::Value,
    #[serde(default)]
    pub limits: PluginLimits,
}

fn empty_object() -> serde_json::Value {
    serde_json::json!({})
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    plugins: Vec<DeploymentSpec>,
}

#[derive(Clone)]
pub enum Pools {
    Template(Arc<TemplatePool>),
    Reasoning(Arc<ReasoningPool>),
    Tool(Arc<ToolPool>),
    Policy(Arc<PolicyPool>),
}

pub struct Deployment {
    pub spec: DeploymentSpec,
    pub pools: Pools,
    /// Version counter of this name (1 for the first deployment, +1 per swap).
    pub version: u64,
    pub sha: String,
    pub metrics: Arc<PluginMetrics>,
}

impl Deployment {
    pub fn info(&self) -> &PluginInfo {
        match &self.pools {
            Pools::Template(p) => &p.info,
            Pools::Reasoning(p) => &p.info,
            Pools::Tool(p) => &p.info,
            Pools::Policy(p) => &p.info,
        }
    }

    fn matches(&self, model: &str, tenant: &str) -> bool {
        let ok = |list: &[String], v: &str| list.is_empty() || list.iter().any(|x| x == "*" || x == v);
        ok(&self.spec.models, model) && ok(&self.spec.tenants, tenant)
    }

    pub fn to_json(&self) -> serde_json::Value {
        let (idle, live) = match &self.pools {
            Pools::Template(p) => (p.idle_instances(), p.live_instances()),
            Pools::Reasoning(p) => (p.idle_instances(), p.live_instances()),
            Pools::Tool(p) => (p.idle_instances(), p.live_instances()),
            Pools::Policy(p) => (p.idle_instances(), p.live_instances()),
        };
        serde_json::json!({
            "name": self.spec.name,
            "kind": self.spec.kind,
            "plugin": self.info(),
            "version": self.version,
            "sha": self.sha,
            "models": self.spec.models,
            "tenants": self.spec.tenants,
            "config": self.spec.config,
            "limits": self.spec.limits,
            "instances": {"idle": idle, "live": live},
            "metrics": self.metrics.to_json(),
        })
    }
}

pub struct Registry {
    pub runtime: Arc<Runtime>,
    deployments: RwLock<BTreeMap<String, Arc<Deployment>>>,
    admin_key: RwLock<Option<String>>,
    /// The served model's template/bos/eos, given to chat-template plugins whose config names
    /// no `template` (so the model's own template is what runs).
    model_template: RwLock<Option<serde_json::Value>>,
}

impl Registry {
    pub fn new(runtime: Arc<Runtime>) -> Self {
        Self {
            runtime,
            deployments: RwLock::new(BTreeMap::new()),
            admin_key: RwLock::new(None),
            model_template: RwLock::new(None),
        }
    }

    /// The key `/admin/plugins` requires (none: the admin API answers 403).
    pub fn set_admin_key(&self, key: Option<String>) {
        *self.admin_key.write().unwrap() = key.filter(|k| !k.is_empty());
    }

    pub fn set_model_template(&self, template: &str, bos: Option<&str>, eos: Option<&str>) {
        *self.model_template.write().unwrap() = Some(
            serde_json::json!({"template": template, "bos_token": bos.unwrap_or(""), "eos_token": eos.unwrap_or("")}),
        );
    }

    /// The chat-template deployment serving `model`, if any.
    pub fn template_for(&self, model: &str) -> Option<String> {
        self.select(Kind::ChatTemplate, model, "").map(|d| d.spec.name.clone())
    }

    pub fn admin_key(&self) -> Option<String> {
        self.admin_key.read().unwrap().clone()
    }

    /// Compiles, validates (world, `info`, `configure` on a fresh instance) and warms a
    /// deployment, then swaps it in under its name. Errors leave the registry unchanged.
    pub fn deploy(&self, spec: DeploymentSpec, bytes: &[u8]) -> Result<Arc<Deployment>, String> {
        if spec.name.is_empty()
            || spec.name.len() > 64
            || !spec.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err("'name' must be 1-64 characters of [A-Za-z0-9._-]".into());
        }
        spec.limits.validate()?;
        let component = self.runtime.compile(bytes).map_err(|e| format!("not a valid Wasm component: {e:#}"))?;
        let metrics = Arc::new(PluginMetrics::default());
        let mut config = spec.config.clone();
        if spec.kind == Kind::ChatTemplate {
            if let (Some(obj), Some(serde_json::Value::Object(def))) =
                (config.as_object_mut(), self.model_template.read().unwrap().clone())
            {
                if !obj.contains_key("template") {
                    for (k, v) in def {
                        obj.entry(k).or_insert(v);
                    }
                }
            }
        }
        let config = config.to_string();
        let rt = &self.runtime;
        let name = spec.name.as_str();
        let l = spec.limits.clone();
        let pools = match spec.kind {
            Kind::ChatTemplate => {
                Pools::Template(TemplatePool::new(rt, name, &component, &config, l, metrics.clone())?)
            }
            Kind::ReasoningParser => {
                Pools::Reasoning(ReasoningPool::new(rt, name, &component, &config, l, metrics.clone())?)
            }
            Kind::ToolParser => Pools::Tool(ToolPool::new(rt, name, &component, &config, l, metrics.clone())?),
            Kind::RequestPolicy => Pools::Policy(PolicyPool::new(rt, name, &component, &config, l, metrics.clone())?),
        };
        match &pools {
            Pools::Template(p) => p.warm_up(),
            Pools::Reasoning(p) => p.warm_up(),
            Pools::Tool(p) => p.warm_up(),
            Pools::Policy(p) => p.warm_up(),
        }
        let mut map = self.deployments.write().unwrap();
        let version = map.get(&spec.name).map_or(1, |d| d.version + 1);
        let d = Arc::new(Deployment { sha: format!("{:016x}", fingerprint(bytes)), spec, pools, version, metrics });
        map.insert(d.spec.name.clone(), d.clone());
        Ok(d)
    }

    pub fn remove(&self, name: &str) -> bool {
        self.deployments.write().unwrap().remove(name).is_some()
    }

    pub fn get(&self, name: &str) -> Option<Arc<Deployment>> {
        self.deployments.read().unwrap().get(name).cloned()
    }

    pub fn list(&self) -> Vec<Arc<Deployment>> {
        self.deployments.read().unwrap().values().cloned().collect()
    }

    /// The deployment of `kind` serving (model, tenant): the first by name that matches.
    pub fn select(&self, kind: Kind, model: &str, tenant: &str) -> Option<Arc<Deployment>> {
        self.deployments.read().unwrap().values().find(|d| d.spec.kind == kind && d.matches(model, tenant)).cloned()
    }

    /// Every policy serving (model, tenant), in name order.
    pub fn policies(&self, model: &str, tenant: &str) -> Vec<Arc<Deployment>> {
        self.deployments
            .read()
            .unwrap()
            .values()
            .filter(|d| d.spec.kind == Kind::RequestPolicy && d.matches(model, tenant))
            .cloned()
            .collect()
    }

    /// Per-deployment counters in the Prometheus text format (appended to `/metrics`).
    pub fn prometheus(&self) -> String {
        use std::fmt::Write;
        const COUNTERS: &[(&str, &str, &str)] = &[
            ("calls", "wasmserve_plugin_calls_total", "Guest calls"),
            ("errors", "wasmserve_plugin_errors_total", "Failed guest calls"),
            ("traps", "wasmserve_plugin_traps_total", "Guest calls that trapped"),
            ("timeouts", "wasmserve_plugin_timeouts_total", "Guest calls past their deadline"),
            ("out_of_memory", "wasmserve_plugin_out_of_memory_total", "Guest calls past the memory limit"),
            ("invalid_output", "wasmserve_plugin_invalid_output_total", "Guest results the host refused"),
            ("call_seconds_total", "wasmserve_plugin_call_seconds_total", "Time inside guest calls"),
            ("instances_discarded", "wasmserve_plugin_instances_discarded_total", "Instances dropped after a failure"),
        ];
        let list = self.list();
        let mut out = String::new();
        for (key, name, help) in COUNTERS {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for d in &list {
                let _ = writeln!(
                    out,
                    "{name}{{plugin=\"{}\",kind=\"{}\"}} {}",
                    d.spec.name,
                    kind_name(d.spec.kind),
                    d.metrics.to_json()[*key]
                );
            }
        }
        out
    }

    /// Loads a JSON config file: `{"plugins": [DeploymentSpec, ...]}`; component paths are
    /// relative to the file. Any failure fails the whole load (the server does not start).
    pub fn load_config(&self, path: &Path) -> Result<usize, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        let cfg: ConfigFile = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        let n = cfg.plugins.len();
        for spec in cfg.plugins {
            let file = spec
                .component
                .clone()
                .ok_or_else(|| format!("plugin '{}': 'component' (a path) is required", spec.name))?;
            let file = if file.is_absolute() { file } else { base.join(file) };
            let bytes =
                std::fs::read(&file).map_err(|e| format!("plugin '{}': reading {}: {e}", spec.name, file.display()))?;
            let name = spec.name.clone();
            self.deploy(spec, &bytes).map_err(|e| format!("plugin '{name}': {e}"))?;
        }
        Ok(n)
    }
}

fn fingerprint(bytes: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::ChatTemplate => "chat-template",
        Kind::ReasoningParser => "reasoning-parser",
        Kind::ToolParser => "tool-parser",
        Kind::RequestPolicy => "request-policy",
    }
}
