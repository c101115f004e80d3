//! The shared Wasm engine: compiler settings, the epoch ticker that enforces call deadlines,
//! the compiled-component cache, and the per-store state (limits, logging).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use anyhow::{Context, Result};
use wasmtime::component::Component;
use wasmtime::{Config, Engine, ResourceLimiter};

/// Epoch tick: deadlines are counted in ticks, so a timeout is enforced to within one tick.
pub const TICK: Duration = Duration::from_millis(1);

/// What one plugin instance may use. Applied per store (= per instance).
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct PluginLimits {
    /// Linear memory, bytes, summed over the instance's memories.
    pub memory_bytes: usize,
    /// Wall-clock deadline of one call, ms (epoch interruption: CPU-bound guests cannot exceed it).
    pub call_timeout_ms: u64,
    /// Largest string/list a call may return, bytes.
    pub max_output_bytes: usize,
    /// Instances alive at once (idle + in use); a call beyond it gets `Busy`.
    pub max_instances: usize,
    /// Idle instances kept warm.
    pub pool_size: usize,
    pub table_elements: usize,
}

impl Default for PluginLimits {
    fn default() -> Self {
        Self {
            memory_bytes: 64 << 20,
            call_timeout_ms: 100,
            max_output_bytes: 1 << 20,
            max_instances: 256,
            pool_size: 8,
            table_elements: 10_000,
        }
    }
}

/// The most a deployment may ask for (config file or admin API): one plugin cannot take the
/// machine's memory, hold a call for minutes or keep thousands of instances.
pub const MAX_LIMITS: PluginLimits = PluginLimits {
    memory_bytes: 4 << 30,
    call_timeout_ms: 60_000,
    max_output_bytes: 64 << 20,
    max_instances: 1024,
    pool_size: 256,
    table_elements: 1_000_000,
};

impl PluginLimits {
    /// Refuses limits that are zero where zero means nothing can run, or over [`MAX_LIMITS`],
    /// naming the field.
    pub fn validate(&self) -> Result<(), String> {
        let m = &MAX_LIMITS;
        let fields: [(&str, u64, u64); 6] = [
            ("memory_bytes", self.memory_bytes as u64, m.memory_bytes as u64),
            ("call_timeout_ms", self.call_timeout_ms, m.call_timeout_ms),
            ("max_output_bytes", self.max_output_bytes as u64, m.max_output_bytes as u64),
            ("max_instances", self.max_instances as u64, m.max_instances as u64),
            ("pool_size", self.pool_size as u64, m.pool_size as u64),
            ("table_elements", self.table_elements as u64, m.table_elements as u64),
        ];
        for (name, value, max) in fields {
            if value > max {
                return Err(format!("limits.{name} is {value}; at most {max}"));
            }
            if value == 0 && name != "pool_size" {
                return Err(format!("limits.{name} must be at least 1"));
            }
        }
        if self.pool_size > self.max_instances {
            return Err(format!(
                "limits.pool_size ({}) exceeds limits.max_instances ({})",
                self.pool_size, self.max_instances
            ));
        }
        Ok(())
    }
}

/// Per-store host data.
pub struct HostState {
    pub plugin: Arc<str>,
    limits: StoreLimiter,
    log_lines: u32,
}

/// `StoreLimits` plus a record of whether a limit was hit, so a trap that follows a refused
/// `memory.grow` (Rust aborts on allocation failure) is reported as out-of-memory.
struct StoreLimiter {
    memory_bytes: usize,
    table_elements: usize,
    hit: bool,
}

impl ResourceLimiter for StoreLimiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        let ok = desired <= self.memory_bytes;
        self.hit |= !ok;
        Ok(ok)
    }
    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        let ok = desired <= self.table_elements;
        self.hit |= !ok;
        Ok(ok)
    }
    fn instances(&self) -> usize {
        // Components built by wit-bindgen + wasm-tools hold a handful of core instances.
        16
    }
    fn tables(&self) -> usize {
        16
    }
    fn memories(&self) -> usize {
        4
    }
}

/// Lines one instance may log before the host drops the rest (a chatty plugin cannot flood the log).
const MAX_LOG_LINES: u32 = 1000;
const MAX_LOG_LINE: usize = 2000;

impl HostState {
    pub fn new(plugin: Arc<str>, limits: &PluginLimits) -> Self {
        Self {
            plugin,
            limits: StoreLimiter {
                memory_bytes: limits.memory_bytes,
                table_elements: limits.table_elements,
                hit: false,
            },
            log_lines: 0,
        }
    }

    pub fn limiter(&mut self) -> &mut dyn ResourceLimiter {
        &mut self.limits
    }

    pub fn limit_hit(&self) -> bool {
        self.limits.hit
    }

    pub fn log(&mut self, level: u8, message: &str) {
        self.log_lines += 1;
        if self.log_lines > MAX_LOG_LINES {
            return;
        }
        let mut end = message.len().min(MAX_LOG_LINE);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        let m = &message[..end];
        let p = &*self.plugin;
        match level {
            0 => tracing::trace!(plugin = p, "{m}"),
            1 => tracing::debug!(plugin = p, "{m}"),
            2 => tracing::info!(plugin = p, "{m}"),
            3 => tracing::warn!(plugin = p, "{m}"),
            _ => tracing::error!(plugin = p, "{m}"),
        }
    }
}

macro_rules! logging_host {
    ($($module:ident),*) => {$(
        impl super::bindings::$module::inference::plugins::logging::Host for HostState {
            fn log(&mut self, level: super::bindings::$module::inference::plugins::logging::Level, message: String) {
                self.log(level as u8, &message)
            }
        }
    )*};
}
logging_host!(chat_template, reasoning, tool, policy);

pub struct Runtime {
    pub engine: Engine,
    /// Compiled components by content hash: re-deploying the same bytes costs nothing.
    compiled: Mutex<HashMap<u128, Component>>,
    /// Serialized compiled code on disk (`--plugin-cache-dir`), so a restart skips Cranelift.
    cache_dir: Option<PathBuf>,
}

impl Runtime {
    pub fn new(cache_dir: Option<PathBuf>) -> Result<Arc<Self>> {
        let mut cfg = Config::new();
        cfg.wasm_component_model(true);
        // Deadlines: the ticker below advances the epoch; a store past its deadline traps.
        cfg.epoch_interruption(true);
        cfg.cranelift_opt_level(wasmtime::OptLevel::Speed);
        // Guests are sandboxed by limits, not by the host's stack: keep their stack small.
        cfg.max_wasm_stack(1 << 20);
        let engine = Engine::new(&cfg).map_err(anyhow::Error::from).context("creating the Wasm engine")?;
        if let Some(d) = &cache_dir {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        let rt = Arc::new(Self { engine, compiled: Mutex::new(HashMap::new()), cache_dir });
        spawn_ticker(Arc::downgrade(&rt));
        Ok(rt)
    }

    /// Compiles (or finds in the cache) a component from its bytes.
    pub fn compile(&self, bytes: &[u8]) -> Result<Component> {
        let key = content_hash(bytes, &self.engine);
        if let Some(c) = self.compiled.lock().unwrap().get(&key) {
            return Ok(c.clone());
        }
        let path = self.cache_dir.as_ref().map(|d| d.join(format!("{key:032x}.cwasm")));
        if let Some(p) = path.as_ref().filter(|p| p.exists()) {
            // SAFETY: the file was written by `Component::serialize` of this same engine
            // configuration (the key includes the engine's compatibility hash) into a directory
            // only this server writes; wasmtime additionally checks version and settings.
            match unsafe { Component::deserialize_file(&self.engine, p) } {
                Ok(c) => {
                    self.compiled.lock().unwrap().insert(key, c.clone());
                    return Ok(c);
                }
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %e, "ignoring unusable compiled plugin cache entry")
                }
            }
        }
        let c = Component::new(&self.engine, bytes).map_err(anyhow::Error::from)?;
        if let Some(p) = &path {
            if let Ok(data) = c.serialize() {
                let tmp = p.with_extension("tmp");
                if std::fs::write(&tmp, data).and_then(|_| std::fs::rename(&tmp, p)).is_err() {
                    tracing::warn!(path = %p.display(), "could not write the compiled plugin cache");
                }
            }
        }
        self.compiled.lock().unwrap().insert(key, c.clone());
        Ok(c)
    }
}

/// 128-bit content key (two SipHash passes with different prefixes) mixed with the engine's
/// compatibility hash; collisions would need a crafted component, and only admins upload.
fn content_hash(bytes: &[u8], engine: &Engine) -> u128 {
    let h = |salt: u64| {
        let mut s = std::collections::hash_map::DefaultHasher::new();
        salt.hash(&mut s);
        engine.precompile_compatibility_hash().hash(&mut s);
        bytes.hash(&mut s);
        s.finish()
    };
    ((h(1) as u128) << 64) | h(2) as u128
}

fn spawn_ticker(rt: Weak<Runtime>) {
    std::thread::Builder::new()
        .name("wasm-epoch".into())
        .spawn(move || loop {
            std::thread::sleep(TICK);
            match rt.upgrade() {
                Some(rt) => rt.engine.increment_epoch(),
                None => return,
            }
        })
        .expect("spawning the epoch ticker");
}

// `parse-types` only declares records: nothing to implement, but the linker wants the trait.
impl super::bindings::reasoning::inference::plugins::parse_types::Host for HostState {}
impl super::bindings::tool::inference::plugins::parse_types::Host for HostState {}
