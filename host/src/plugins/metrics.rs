//! Per-deployment counters, read by `GET /admin/plugins` and `/metrics`.

use std::sync::atomic::{AtomicU64, Ordering};

use super::error::FailureKind;

#[derive(Default)]
pub struct PluginMetrics {
    pub calls: AtomicU64,
    pub errors: AtomicU64,
    pub traps: AtomicU64,
    pub timeouts: AtomicU64,
    pub out_of_memory: AtomicU64,
    pub invalid_output: AtomicU64,
    pub busy: AtomicU64,
    /// Total time inside guest calls, in nanoseconds.
    pub call_nanos: AtomicU64,
    pub instances_created: AtomicU64,
    pub instances_discarded: AtomicU64,
}

impl PluginMetrics {
    pub fn record_call(&self, nanos: u64) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.call_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    pub fn record_failure(&self, kind: FailureKind) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let c = match kind {
            FailureKind::Trap => &self.traps,
            FailureKind::Timeout => &self.timeouts,
            FailureKind::OutOfMemory => &self.out_of_memory,
            FailureKind::InvalidOutput => &self.invalid_output,
            FailureKind::Busy => &self.busy,
            FailureKind::PluginError => return,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn to_json(&self) -> serde_json::Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "calls": g(&self.calls),
            "errors": g(&self.errors),
            "traps": g(&self.traps),
            "timeouts": g(&self.timeouts),
            "out_of_memory": g(&self.out_of_memory),
            "invalid_output": g(&self.invalid_output),
            "busy": g(&self.busy),
            "call_seconds_total": g(&self.call_nanos) as f64 / 1e9,
            "instances_created": g(&self.instances_created),
            "instances_discarded": g(&self.instances_discarded),
        })
    }
}
