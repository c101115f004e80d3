//! Work that must not run on the HTTP server's async workers, on tokio's blocking threads under
//! bounds of its own:
//!
//! - [`PluginCalls`]: every Wasm plugin call (request policies, reasoning and tool parsers) runs
//!   on at most `--plugin-threads` blocking threads at once. A guest looping to its deadline then
//!   holds one of those, never an async worker, so `/health` and other tenants' requests keep
//!   being served; calls beyond the bound wait (asynchronously) for a thread.
//! - [`PromptWork`]: rendering and tokenizing prompts, weighted by the prompt's bytes: at most
//!   `--max-pending-prompt-bytes` of prompt text is being rendered or tokenized at once, so
//!   large bodies queue instead of multiplying the server's memory.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::{ApiError, ApiResult};

/// The bounded pool plugin calls run on.
pub struct PluginCalls {
    permits: Arc<Semaphore>,
}

impl PluginCalls {
    pub fn new(threads: usize) -> Self {
        Self { permits: Arc::new(Semaphore::new(threads.max(1))) }
    }

    /// Runs `call` on a blocking thread once one of the pool's threads is free.
    pub async fn run<T: Send + 'static>(&self, call: impl FnOnce() -> T + Send + 'static) -> ApiResult<T> {
        let permit =
            self.permits.clone().acquire_owned().await.map_err(|_| ApiError::internal("plugin pool closed"))?;
        holding(permit, call).await.map_err(|e| ApiError::internal(format!("a plugin call failed: {e}")))
    }

    /// Runs `call` on the pool without waiting for it (a policy told a request's outcome).
    /// Outside a runtime (a test dropping a request) it runs on the caller's thread.
    pub fn spawn(&self, call: impl FnOnce() + Send + 'static) {
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let permits = self.permits.clone();
                rt.spawn(async move {
                    if let Ok(permit) = permits.acquire_owned().await {
                        let _ = holding(permit, call).await;
                    }
                });
            }
            Err(_) => call(),
        }
    }
}

/// The bound on prompt text being rendered or tokenized at once, in bytes.
pub struct PromptWork {
    /// Permits are KiB of prompt text.
    kib: Arc<Semaphore>,
    max_kib: u32,
}

impl PromptWork {
    pub fn new(max_bytes: usize) -> Self {
        let max_kib = (max_bytes / 1024).clamp(1, u32::MAX as usize) as u32;
        Self { kib: Arc::new(Semaphore::new(max_kib as usize)), max_kib }
    }

    /// Runs `work` (rendering / tokenizing `bytes` of prompt text) on a blocking thread once that
    /// many bytes fit under the bound (a prompt larger than the whole bound waits for all of it).
    pub async fn run<T: Send + 'static>(
        &self,
        bytes: usize,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> ApiResult<T> {
        let kib = (bytes.div_ceil(1024)).clamp(1, self.max_kib as usize) as u32;
        let permit =
            self.kib.clone().acquire_many_owned(kib).await.map_err(|_| ApiError::internal("prompt pool closed"))?;
        holding(permit, work).await.map_err(|e| ApiError::internal(format!("a blocking task failed: {e}")))
    }
}

/// Runs `work` on a blocking thread, giving `permit` back when it returns.
async fn holding<T: Send + 'static>(
    permit: OwnedSemaphorePermit,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    tokio::task::spawn_blocking(move || {
        let _held = permit;
        work()
    })
    .await
}

/// The bytes of text in a JSON value (its strings, keys included), without serializing it: the
/// size of the prompt a chat request will render to, to weigh its work before rendering.
pub fn text_bytes(v: &serde_json::Value) -> usize {
    use serde_json::Value;
    match v {
        Value::String(s) => s.len(),
        Value::Array(a) => a.iter().map(text_bytes).sum(),
        Value::Object(o) => o.iter().map(|(k, v)| k.len() + text_bytes(v)).sum(),
        _ => 8,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn plugin_calls_never_exceed_the_pool_and_leave_the_workers_free() {
        let pool = Arc::new(PluginCalls::new(2));
        let (running, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let calls: Vec<_> = (0..6)
            .map(|_| {
                let (pool, running, peak) = (pool.clone(), running.clone(), peak.clone());
                tokio::spawn(async move {
                    pool.run(move || {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        peak.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(100));
                        running.fetch_sub(1, Ordering::SeqCst);
                    })
                    .await
                })
            })
            .collect();
        // While six blocking calls hold the pool, an async task still runs at once.
        let t = std::time::Instant::now();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(t.elapsed() < Duration::from_millis(80));
        for c in calls {
            c.await.unwrap().unwrap();
        }
        assert_eq!(peak.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn prompt_work_is_weighed_by_bytes() {
        let work = Arc::new(PromptWork::new(4 << 10));
        let held = work.kib.clone().acquire_many_owned(3).await.unwrap();
        // 2 KiB do not fit beside the 3 held: it waits until they are given back.
        let w = work.clone();
        let waiting = tokio::spawn(async move { w.run(2048, || 7).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished());
        drop(held);
        assert_eq!(waiting.await.unwrap().unwrap(), 7);
        // Larger than the whole bound: runs alone instead of never.
        assert_eq!(work.run(1 << 30, || 8).await.unwrap(), 8);
    }

    #[test]
    fn text_bytes_counts_strings_and_keys() {
        let v = serde_json::json!([{"role": "user", "content": "hello"}]);
        assert_eq!(text_bytes(&v), 4 + 4 + 7 + 5);
    }
}
