//! Giving memory back after a large request. glibc's malloc raises its mmap threshold after large
//! blocks are freed, so the buffers of one multi-megabyte body (the raw bytes, the parsed JSON,
//! the rendered prompt) are then carved from the heap and kept by the process when freed: six
//! 7.8 MB chat bodies left ~370 MB resident for good. After a request whose body was large, the
//! server asks malloc to return its free pages (`malloc_trim`, off the async workers, once for
//! every large request that ends within 100 ms of another), which brings that back down (docs/hardening.md has the figures). Small
//! requests, the common case, pay nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;

/// Bodies at least this large trigger a trim once their request is answered.
const LARGE_BODY: u64 = 1 << 20;
/// How long after a large request its trim runs, ms (requests ending meanwhile share it).
const DELAY_MS: u64 = 100;

/// Whether a trim is scheduled: requests ending meanwhile are covered by it.
static PENDING: AtomicBool = AtomicBool::new(false);

pub async fn return_memory_after_large_bodies(req: Request, next: Next) -> Response {
    let declared = super::extract::declared_length(req.headers()).unwrap_or(0);
    let resp = next.run(req).await;
    if declared >= LARGE_BODY && !PENDING.swap(true, Ordering::AcqRel) {
        // One trim a little later serves every large request that ends before it runs.
        tokio::spawn(async {
            tokio::time::sleep(Duration::from_millis(DELAY_MS)).await;
            PENDING.store(false, Ordering::Release);
            let _ = tokio::task::spawn_blocking(trim).await;
        });
    }
    resp
}

/// Allocations at least this large are mapped on their own and unmapped when freed (glibc's
/// default threshold floats up to 32 MiB after large frees, which is what kept them resident).
const MMAP_THRESHOLD: i32 = 1 << 20;

/// Fixes malloc's mmap threshold for the server process (see the module comment).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn configure_allocator() {
    // SAFETY: mallopt only sets an allocator parameter; called once at start-up.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn configure_allocator() {}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() {
    // SAFETY: malloc_trim only walks and releases the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}
