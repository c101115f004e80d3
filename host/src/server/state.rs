//! What every handler shares: the engine, the model's tokenizer and chat template, settings,
//! metrics, and the shutdown bookkeeping that lets in-flight streams drain.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

use super::error::ApiError;
use super::metrics::Metrics;
use crate::chat_template::ChatTemplate;
use crate::engine::Engine;
use crate::model::LoadedModel;

pub type AppState = Arc<ServerState>;

/// Plugin threads and prompt-work bytes of a state built without `serve`'s flags (tests; `serve`
/// uses one plugin thread per CPU and `--max-pending-prompt-bytes`).
pub const DEFAULT_PLUGIN_THREADS: usize = 4;
pub const DEFAULT_PROMPT_WORK_BYTES: usize = 64 << 20;

/// `--stream-stall-timeout`'s default, seconds.
pub const DEFAULT_STREAM_STALL_SECS: f64 = 60.0;

pub struct ServerState {
    pub engine: Engine,
    pub model: Arc<LoadedModel>,
    /// A trait object so a Wasm plugin can stand in for the built-in minijinja renderer.
    pub template: Option<Arc<dyn ChatTemplate>>,
    pub served_model_name: String,
    /// Further names requests may use for it (`--served-model-name a b ...`).
    pub model_aliases: Vec<String>,
    pub api_key: Option<String>,
    /// Tenants, keys, limits and usage (`serve --db`); replaces `api_key` when set.
    pub tenancy: Option<Arc<crate::tenancy::Tenancy>>,
    /// Wasm plugin deployments (`--plugins`, `/admin/plugins`); None in tests that build a bare state.
    pub plugins: Option<Arc<crate::plugins::registry::Registry>>,
    pub max_body_bytes: usize,
    /// How long a stream may wait for its client to read before it is aborted (None: forever).
    pub stream_stall_timeout: Option<std::time::Duration>,
    /// How long a request body may take to arrive (`--body-read-timeout`).
    pub body_read_timeout: std::time::Duration,
    /// Where Wasm plugin calls run (`--plugin-threads`), off the async workers.
    pub plugin_calls: super::blocking::PluginCalls,
    /// The bound on prompt text being rendered or tokenized at once (`--max-pending-prompt-bytes`).
    pub prompt_work: super::blocking::PromptWork,
    pub metrics: Metrics,
    /// Unix time the server started (the `created` of the model listing).
    pub started_at: u64,
    shutting_down: AtomicBool,
    in_flight: AtomicUsize,
    drained: Notify,
}

impl ServerState {
    pub fn new(
        engine: Engine,
        template: Option<Arc<dyn ChatTemplate>>,
        served_model_name: String,
        api_key: Option<String>,
        max_body_bytes: usize,
    ) -> Self {
        Self {
            model: engine.model().clone(),
            engine,
            template,
            served_model_name,
            model_aliases: Vec::new(),
            api_key,
            tenancy: None,
            plugins: None,
            max_body_bytes,
            stream_stall_timeout: Some(std::time::Duration::from_secs_f64(DEFAULT_STREAM_STALL_SECS)),
            body_read_timeout: std::time::Duration::from_secs(30),
            plugin_calls: super::blocking::PluginCalls::new(DEFAULT_PLUGIN_THREADS),
            prompt_work: super::blocking::PromptWork::new(DEFAULT_PROMPT_WORK_BYTES),
            metrics: Metrics::default(),
            started_at: unix_now(),
            shutting_down: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            drained: Notify::new(),
        }
    }

    /// 404 for a model we do not serve; a missing `model` means the served one.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            None | Some("") => Ok(()),
            Some(m) if self.serves(m) => Ok(()),
            Some(m) => Err(ApiError::model_not_found(m)),
        }
    }

    /// Whether `name` is the served model's name or one of its aliases.
    pub fn serves(&self, name: &str) -> bool {
        name == self.served_model_name || self.model_aliases.iter().any(|a| a == name)
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Refuses new generation work from now on; requests already running continue.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.engine.begin_shutdown();
        self.drained.notify_waiters();
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Marks a generation request as in flight until the guard drops (with its response stream).
    pub fn enter(self: &Arc<Self>) -> Result<InFlight, ApiError> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = InFlight { state: self.clone() };
        // Checked after counting in, so a request either sees the flag or is waited for.
        if self.is_shutting_down() {
            return Err(ApiError::shutting_down());
        }
        Ok(guard)
    }

    /// Resolves once no generation request is in flight.
    pub async fn wait_drained(&self) {
        loop {
            let notified = self.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }
}

pub struct InFlight {
    state: Arc<ServerState>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.state.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.state.drained.notify_waiters();
        }
    }
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
