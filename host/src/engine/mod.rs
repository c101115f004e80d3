//! The serving engine: a paged KV cache with prefix caching, a continuous-batching scheduler with
//! chunked prefill and preemption, and a handle the server submits requests through.

pub mod api;
pub mod block_pool;
pub mod core;
mod fair_share;
pub(crate) mod paged_kv;
pub mod recurrent_slots;
mod sequence;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

pub use self::api::{EngineEvent, EngineRequest, EngineStats, FinishReason, RequestId, SubmitError, TokenLogprob};
pub use self::core::{EngineConfig, EngineCore};
use crate::model::LoadedModel;

enum Command {
    Submit(RequestId, Box<EngineRequest>, tokio::sync::mpsc::UnboundedSender<EngineEvent>),
    Abort(RequestId),
    Stop,
}

struct Shared {
    commands: Mutex<mpsc::Sender<Command>>,
    stats: Mutex<EngineStats>,
    /// Submitted requests the engine thread has not read yet.
    unread: AtomicUsize,
    /// New (never admitted) sequences waiting in the core, as of its last step.
    waiting_new: AtomicUsize,
    next_id: AtomicU64,
    shutting_down: AtomicBool,
    max_waiting: usize,
    max_model_len: usize,
    cfg: EngineConfig,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct Engine {
    shared: Arc<Shared>,
    model: Arc<LoadedModel>,
}

/// Events of one request. Dropping it aborts the request (client disconnect).
pub struct RequestStream {
    pub id: RequestId,
    rx: UnboundedReceiver<EngineEvent>,
    engine: Engine,
}

impl RequestStream {
    pub async fn next(&mut self) -> Option<EngineEvent> {
        self.rx.recv().await
    }

    /// Blocking receive for non-async callers (CLI, tests).
    pub fn blocking_next(&mut self) -> Option<EngineEvent> {
        self.rx.blocking_recv()
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.engine.abort(self.id);
    }
}

impl Engine {
    /// Starts the engine thread. The KV pool is allocated here, before the first request.
    /// Panics if a device model's pool cannot be allocated; servers use [`Engine::try_start`].
    pub fn start(model: Arc<LoadedModel>, cfg: EngineConfig) -> Engine {
        Self::try_start(model, cfg).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Engine::start`], with a device KV pool that cannot be allocated as an error.
    pub fn try_start(model: Arc<LoadedModel>, cfg: EngineConfig) -> Result<Engine, String> {
        let max_waiting = cfg.max_waiting;
        let mut core = EngineCore::try_new(model.clone(), cfg.clone())?;
        let (tx, rx) = mpsc::channel::<Command>();
        let shared = Arc::new(Shared {
            commands: Mutex::new(tx),
            stats: Mutex::new(core.stats()),
            unread: AtomicUsize::new(0),
            waiting_new: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            max_waiting,
            max_model_len: core.max_model_len(),
            cfg,
            thread: Mutex::new(None),
        });
        let sh = shared.clone();
        let handle = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || run_loop(&mut core, rx, &sh))
            .expect("spawning the engine thread");
        *shared.thread.lock().unwrap() = Some(handle);
        Ok(Engine { shared, model })
    }

    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.model
    }

    pub fn max_model_len(&self) -> usize {
        self.shared.max_model_len
    }

    /// The checks `submit` makes of a request before queueing it, for callers that must refuse a
    /// bad request before anything else (a tenant's rate limits count only valid requests).
    pub fn validate(&self, req: &EngineRequest) -> Result<(), SubmitError> {
        self::core::validate_request(&self.model, self.shared.max_model_len, &self.shared.cfg, req)
    }

    pub fn submit(&self, req: EngineRequest) -> Result<RequestStream, SubmitError> {
        if self.shared.shutting_down.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        self::core::validate_request(&self.model, self.shared.max_model_len, &self.shared.cfg, &req)?;
        // Reserve a queue slot atomically so concurrent submits cannot overshoot the bound.
        let queued = self.shared.unread.fetch_add(1, Ordering::SeqCst) + self.shared.waiting_new.load(Ordering::SeqCst);
        if queued >= self.shared.max_waiting {
            self.shared.unread.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(queued));
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = unbounded_channel();
        let sent = self.shared.commands.lock().unwrap().send(Command::Submit(id, Box::new(req), tx));
        if sent.is_err() {
            self.shared.unread.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::ShuttingDown);
        }
        Ok(RequestStream { id, rx, engine: self.clone() })
    }

    pub fn abort(&self, id: RequestId) {
        let _ = self.shared.commands.lock().unwrap().send(Command::Abort(id));
    }

    pub fn stats(&self) -> EngineStats {
        self.shared.stats.lock().unwrap().clone()
    }

    /// Stops accepting requests; in-flight ones run to completion.
    pub fn begin_shutdown(&self) {
        self.shared.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shared.shutting_down.load(Ordering::SeqCst)
    }

    /// Stops the engine thread after the work it has (used at process exit).
    pub fn stop(&self) {
        self.begin_shutdown();
        let _ = self.shared.commands.lock().unwrap().send(Command::Stop);
        if let Some(h) = self.shared.thread.lock().unwrap().take() {
            let _ = h.join();
        }
    }
}

fn run_loop(core: &mut EngineCore, rx: mpsc::Receiver<Command>, shared: &Shared) {
    let mut stopping = false;
    loop {
        let handle = |cmd: Command, core: &mut EngineCore, stopping: &mut bool| match cmd {
            Command::Submit(id, req, tx) => {
                if let Err(e) = core.add_request(id, *req, tx.clone()) {
                    let _ = tx.send(EngineEvent::Error(e.to_string()));
                }
                // Count it as waiting before it stops counting as unread, so concurrent submits
                // never see it in neither (the queue bound may only err on the safe side).
                shared.waiting_new.store(core.num_waiting_new(), Ordering::SeqCst);
                shared.unread.fetch_sub(1, Ordering::SeqCst);
            }
            Command::Abort(id) => core.abort(id),
            Command::Stop => *stopping = true,
        };
        if !core.has_work() {
            if stopping {
                break;
            }
            match rx.recv() {
                Ok(cmd) => handle(cmd, core, &mut stopping),
                Err(_) => break,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            handle(cmd, core, &mut stopping);
        }
        core.step_guarded();
        let stats = core.stats();
        shared.waiting_new.store(core.num_waiting_new(), Ordering::SeqCst);
        *shared.stats.lock().unwrap() = stats;
    }
}
