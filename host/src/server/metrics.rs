//! Prometheus metrics, written in the text exposition format by hand (it is a few lines per
//! metric, and the engine's own counters are read from `EngineStats` at scrape time).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::engine::EngineStats;

pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistInner>,
}

#[derive(Default)]
struct HistInner {
    /// Non-cumulative counts per bucket; the last one is +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, inner: Mutex::new(HistInner { counts: vec![0; bounds.len() + 1], ..Default::default() }) }
    }

    pub fn observe(&self, v: f64) {
        let i = self.bounds.iter().position(|&b| v <= b).unwrap_or(self.bounds.len());
        let mut h = self.inner.lock().unwrap();
        h.counts[i] += 1;
        h.sum += v;
        h.count += 1;
    }

    pub fn observe_duration(&self, d: Duration) {
        self.observe(d.as_secs_f64());
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let h = self.inner.lock().unwrap();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut acc = 0;
        for (i, &b) in self.bounds.iter().enumerate() {
            acc += h.counts[i];
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {acc}");
        }
        acc += h.counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {acc}\n{name}_sum {}\n{name}_count {}", h.sum, h.count);
    }
}

const TTFT_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0,
];

pub struct Metrics {
    /// (route, status) → count.
    http_requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Finished generation requests by outcome (stop, length, abort, error).
    finished: Mutex<BTreeMap<&'static str, u64>>,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Streams aborted because the client stopped reading (`--stream-stall-timeout`).
    pub stalled_streams: AtomicU64,
    /// Connections closed at accept: over --max-connections or --max-connections-per-client.
    pub refused_connections: AtomicU64,
    /// Request bodies not received within --body-read-timeout.
    pub body_timeouts: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            http_requests: Mutex::default(),
            finished: Mutex::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            stalled_streams: AtomicU64::new(0),
            refused_connections: AtomicU64::new(0),
            body_timeouts: AtomicU64::new(0),
        }
    }
}

/// Label values may hold anything a client put in a path; escape per the exposition format.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Metrics {
    pub fn count_http(&self, route: &str, status: u16) {
        *self.http_requests.lock().unwrap().entry((route.to_string(), status)).or_default() += 1;
    }

    pub fn count_finished(&self, outcome: &'static str) {
        *self.finished.lock().unwrap().entry(outcome).or_default() += 1;
    }

    pub fn render(&self, e: &EngineStats, in_flight: usize) -> String {
        let mut out = String::new();
        let mut simple = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        simple(
            "wasmserve_num_requests_running",
            "gauge",
            "Sequences in the engine's running batch.",
            e.running.to_string(),
        );
        simple(
            "wasmserve_num_requests_waiting",
            "gauge",
            "Sequences waiting for admission (the queue length).",
            e.waiting.to_string(),
        );
        simple(
            "wasmserve_http_requests_in_flight",
            "gauge",
            "Generation requests the HTTP server is serving.",
            in_flight.to_string(),
        );
        simple(
            "wasmserve_kv_cache_blocks_total",
            "gauge",
            "KV cache blocks in the pool.",
            e.kv_blocks_total.to_string(),
        );
        simple(
            "wasmserve_kv_cache_blocks_free",
            "gauge",
            "KV cache blocks no sequence holds (free or evictable prefix-cache blocks).",
            e.kv_blocks_free.to_string(),
        );
        simple("wasmserve_kv_cache_block_size", "gauge", "Tokens per KV cache block.", e.kv_block_size.to_string());
        let usage = if e.kv_blocks_total == 0 { 0.0 } else { 1.0 - e.kv_blocks_free as f64 / e.kv_blocks_total as f64 };
        simple(
            "wasmserve_kv_cache_usage_ratio",
            "gauge",
            "Fraction of KV cache blocks in use (0 to 1).",
            usage.to_string(),
        );
        simple(
            "wasmserve_prefix_cache_queries_total",
            "counter",
            "Prefix-cache block lookups.",
            e.prefix_cache_queries.to_string(),
        );
        simple(
            "wasmserve_prefix_cache_hits_total",
            "counter",
            "Prefix-cache block lookups that hit.",
            e.prefix_cache_hits.to_string(),
        );
        let rate =
            if e.prefix_cache_queries == 0 { 0.0 } else { e.prefix_cache_hits as f64 / e.prefix_cache_queries as f64 };
        simple(
            "wasmserve_prefix_cache_hit_rate",
            "gauge",
            "Prefix-cache hits over lookups since start (0 to 1).",
            rate.to_string(),
        );
        simple(
            "wasmserve_num_preemptions_total",
            "counter",
            "Sequences preempted for lack of KV blocks.",
            e.preemptions_total.to_string(),
        );
        simple(
            "wasmserve_forward_errors_total",
            "counter",
            "Forward passes that failed (device errors); their requests got an error.",
            e.forward_errors_total.to_string(),
        );
        simple(
            "wasmserve_engine_step_panics_total",
            "counter",
            "Engine steps that panicked (a bug); the requests in flight got an error and the engine went on.",
            e.step_panics_total.to_string(),
        );
        simple(
            "wasmserve_engine_steps_total",
            "counter",
            "Engine scheduling steps (batched forward passes).",
            e.steps_total.to_string(),
        );
        simple(
            "wasmserve_engine_prompt_tokens_total",
            "counter",
            "Prompt tokens computed by the engine (recomputation included, cache hits excluded).",
            e.prompt_tokens_total.to_string(),
        );
        simple(
            "wasmserve_engine_generation_tokens_total",
            "counter",
            "Tokens sampled by the engine.",
            e.generation_tokens_total.to_string(),
        );
        simple(
            "wasmserve_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests (usage.prompt_tokens).",
            self.prompt_tokens.load(Ordering::Relaxed).to_string(),
        );
        simple(
            "wasmserve_generation_tokens_total",
            "counter",
            "Completion tokens of finished requests (usage.completion_tokens).",
            self.generation_tokens.load(Ordering::Relaxed).to_string(),
        );
        simple(
            "wasmserve_stream_stalled_total",
            "counter",
            "Streams aborted because the client stopped reading for --stream-stall-timeout.",
            self.stalled_streams.load(Ordering::Relaxed).to_string(),
        );
        simple(
            "wasmserve_connections_refused_total",
            "counter",
            "Connections closed at accept: over --max-connections or --max-connections-per-client.",
            self.refused_connections.load(Ordering::Relaxed).to_string(),
        );
        simple(
            "wasmserve_body_read_timeouts_total",
            "counter",
            "Requests whose body did not arrive within --body-read-timeout (408).",
            self.body_timeouts.load(Ordering::Relaxed).to_string(),
        );

        let _ = writeln!(
            out,
            "# HELP wasmserve_http_requests_total HTTP requests by route and status.\n# TYPE wasmserve_http_requests_total counter"
        );
        for ((route, status), n) in self.http_requests.lock().unwrap().iter() {
            let _ =
                writeln!(out, "wasmserve_http_requests_total{{route=\"{}\",status=\"{status}\"}} {n}", escape(route));
        }
        let _ = writeln!(
            out,
            "# HELP wasmserve_request_finished_total Generation requests by outcome.\n# TYPE wasmserve_request_finished_total counter"
        );
        for (outcome, n) in self.finished.lock().unwrap().iter() {
            let _ = writeln!(out, "wasmserve_request_finished_total{{outcome=\"{outcome}\"}} {n}");
        }
        self.ttft.render(
            &mut out,
            "wasmserve_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
        );
        self.itl.render(
            &mut out,
            "wasmserve_inter_token_latency_seconds",
            "Time between consecutive tokens of one choice.",
        );
        self.e2e.render(
            &mut out,
            "wasmserve_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        let mut s = String::new();
        h.render(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"0.1\"} 1\n"));
        assert!(s.contains("x_bucket{le=\"1\"} 2\n"));
        assert!(s.contains("x_bucket{le=\"+Inf\"} 3\n"));
        assert!(s.contains("x_count 3\n"));
    }
}
