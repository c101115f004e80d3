//! Warm instance pools. A component is instantiated and configured ahead of need; a call (or a
//! streamed choice) leases an instance exclusively, and gives it back when done. An instance
//! whose call failed in any way is dropped, never reused: after a trap its memory may be in
//! any state. Instances are never shared between requests while leased, so one request's
//! plugin failure cannot corrupt another's parser state.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use wasmtime::component::{Component, InstancePre, Linker};
use wasmtime::{Engine, Store, Trap};

use super::error::{FailureKind, PluginError};
use super::metrics::PluginMetrics;
use super::runtime::{HostState, PluginLimits, Runtime, TICK};
use super::PluginInfo;

/// One of the generated world bindings (see `worlds.rs`).
pub trait World: Sized + Send + 'static {
    /// The WIT world name, for messages.
    const WORLD: &'static str;
    type Pre: Send + Sync + 'static;
    fn link(linker: &mut Linker<HostState>) -> wasmtime::Result<()>;
    fn pre(ip: InstancePre<HostState>) -> wasmtime::Result<Self::Pre>;
    fn instantiate(pre: &Self::Pre, store: &mut Store<HostState>) -> wasmtime::Result<Self>;
    fn info(&self, store: &mut Store<HostState>) -> wasmtime::Result<PluginInfo>;
    fn configure(&self, store: &mut Store<HostState>, config: &str) -> wasmtime::Result<Result<(), String>>;
}

pub struct Instance<W> {
    pub store: Store<HostState>,
    pub world: W,
    _live: LiveGuard,
}

/// Counts instances alive for the `max_instances` cap.
struct LiveGuard(Arc<AtomicUsize>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

pub struct Pool<W: World> {
    pub name: Arc<str>,
    pub limits: PluginLimits,
    pub info: PluginInfo,
    pub config: String,
    pub metrics: Arc<PluginMetrics>,
    engine: Engine,
    pre: W::Pre,
    idle: Mutex<Vec<Instance<W>>>,
    live: Arc<AtomicUsize>,
}

impl<W: World> Pool<W> {
    /// Validates `component` against the world (imports linkable, exports of the right types),
    /// instantiates and configures one instance (kept warm): any failure is returned as text and
    /// nothing is created.
    pub fn new(
        rt: &Runtime,
        name: &str,
        component: &Component,
        config: &str,
        limits: PluginLimits,
        metrics: Arc<PluginMetrics>,
    ) -> Result<Arc<Self>, String> {
        let mut linker = Linker::new(&rt.engine);
        W::link(&mut linker).map_err(|e| format!("linking: {e:#}"))?;
        let ip = linker
            .instantiate_pre(component)
            .map_err(|e| format!("the component's imports are not what the {} world provides: {e:#}", W::WORLD))?;
        let pre = W::pre(ip).map_err(|e| format!("the component does not export the {} world: {e:#}", W::WORLD))?;
        let mut pool = Self {
            name: name.into(),
            limits,
            info: PluginInfo::default(),
            config: config.to_string(),
            metrics,
            engine: rt.engine.clone(),
            pre,
            idle: Mutex::new(Vec::new()),
            live: Arc::new(AtomicUsize::new(0)),
        };
        let mut first = pool.create().map_err(|e| e.message)?;
        pool.info = first.world.info(&mut first.store).map_err(|e| format!("info(): {e:#}"))?;
        pool.idle.lock().unwrap().push(first);
        Ok(Arc::new(pool))
    }

    fn fail(&self, kind: FailureKind, message: String) -> PluginError {
        self.metrics.record_failure(kind);
        PluginError { plugin: self.name.to_string(), kind, message }
    }

    fn deadline_ticks(&self) -> u64 {
        (self.limits.call_timeout_ms / TICK.as_millis() as u64).max(1) + 1
    }

    /// A fresh instance, configured.
    fn create(&self) -> Result<Instance<W>, PluginError> {
        if self.live.fetch_add(1, Ordering::SeqCst) >= self.limits.max_instances {
            self.live.fetch_sub(1, Ordering::SeqCst);
            return Err(self.fail(FailureKind::Busy, format!("all {} instances are in use", self.limits.max_instances)));
        }
        let live = LiveGuard(self.live.clone());
        let mut store = Store::new(&self.engine, HostState::new(self.name.clone(), &self.limits));
        store.limiter(|s| s.limiter());
        store.epoch_deadline_trap();
        store.set_epoch_deadline(self.deadline_ticks());
        let world = W::instantiate(&self.pre, &mut store).map_err(|e| {
            let kind = classify(&e, &store);
            self.fail(kind, format!("instantiation failed: {e:#}"))
        })?;
        store.set_epoch_deadline(self.deadline_ticks());
        match world.configure(&mut store, &self.config) {
            Ok(Ok(())) => {}
            Ok(Err(msg)) => {
                return Err(self.fail(FailureKind::PluginError, format!("configure() rejected the config: {msg}")))
            }
            Err(e) => {
                let kind = classify(&e, &store);
                return Err(self.fail(kind, format!("configure() failed: {e:#}")));
            }
        }
        self.metrics.instances_created.fetch_add(1, Ordering::Relaxed);
        Ok(Instance { store, world, _live: live })
    }

    /// Leases an instance: a warm one when there is one, else a new one (up to `max_instances`).
    pub fn lease(self: &Arc<Self>) -> Result<Lease<W>, PluginError> {
        let warm = self.idle.lock().unwrap().pop();
        let inst = match warm {
            Some(i) => i,
            None => self.create()?,
        };
        Ok(Lease { pool: self.clone(), inst: Some(inst) })
    }

    /// Fills the warm pool up to `pool_size` (deploy time, so first requests don't instantiate).
    pub fn warm_up(&self) {
        while self.idle.lock().unwrap().len() < self.limits.pool_size {
            match self.create() {
                Ok(i) => self.idle.lock().unwrap().push(i),
                Err(_) => return,
            }
        }
    }

    pub fn idle_instances(&self) -> usize {
        self.idle.lock().unwrap().len()
    }

    pub fn live_instances(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }
}

/// An exclusively held instance. Returned to the pool on drop unless a call on it failed.
pub struct Lease<W: World> {
    pool: Arc<Pool<W>>,
    inst: Option<Instance<W>>,
}

impl<W: World> Lease<W> {
    pub fn pool(&self) -> &Arc<Pool<W>> {
        &self.pool
    }

    /// Runs one guest call under the deadline, timing it. On any error the instance is
    /// discarded and the error names the plugin and what went wrong.
    pub fn call<R>(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut Store<HostState>, &W) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        let pool = self.pool.clone();
        let Some(inst) = self.inst.as_mut() else {
            return Err(
                pool.fail(FailureKind::Trap, format!("{what}: the instance was discarded after an earlier failure"))
            );
        };
        inst.store.set_epoch_deadline(pool.deadline_ticks());
        let t = Instant::now();
        let r = f(&mut inst.store, &inst.world);
        let elapsed = t.elapsed();
        pool.metrics.record_call(elapsed.as_nanos() as u64);
        match r {
            Ok(v) => Ok(v),
            Err(e) => {
                let kind = classify(&e, &inst.store);
                let root = e.root_cause().to_string();
                let detail = match kind {
                    FailureKind::Timeout => format!("{what} ran past its {} ms deadline", pool.limits.call_timeout_ms),
                    FailureKind::OutOfMemory => {
                        format!("{what} exceeded the {} byte memory limit ({root})", pool.limits.memory_bytes)
                    }
                    FailureKind::Trap => format!("{what} trapped: {root}"),
                    _ => format!("{what} returned an invalid result: {root}"),
                };
                self.discard();
                Err(pool.fail(kind, format!("{detail}; the instance was discarded")))
            }
        }
    }

    /// Drops the instance instead of returning it (a failure, or output the host rejected).
    pub fn discard(&mut self) {
        if self.inst.take().is_some() {
            self.pool.metrics.instances_discarded.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.inst.is_some()
    }

    /// Rejects a result the guest returned (too large, bad JSON...): the instance is discarded.
    pub fn reject_output(&mut self, what: &str, why: String) -> PluginError {
        self.discard();
        self.pool.fail(
            FailureKind::InvalidOutput,
            format!("{what} returned an invalid result: {why}; the instance was discarded"),
        )
    }
}

impl<W: World> Drop for Lease<W> {
    fn drop(&mut self) {
        if let Some(inst) = self.inst.take() {
            let mut idle = self.pool.idle.lock().unwrap();
            if idle.len() < self.pool.limits.pool_size.max(1) {
                idle.push(inst);
            }
        }
    }
}

fn classify(e: &wasmtime::Error, store: &Store<HostState>) -> FailureKind {
    match e.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => FailureKind::Timeout,
        Some(_) if store.data().limit_hit() => FailureKind::OutOfMemory,
        Some(_) => FailureKind::Trap,
        None if store.data().limit_hit() => FailureKind::OutOfMemory,
        // Errors that are not traps come from lifting the guest's results (invalid UTF-8,
        // out-of-bounds pointers, bad discriminants).
        None => FailureKind::InvalidOutput,
    }
}
