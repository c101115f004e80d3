//! One device per rank: each rank's state behind its own lock, and one forward step run on every
//! rank concurrently (rank 0 on the caller's thread, the others on scoped threads) meeting in the
//! step's collectives. A rank that fails or panics aborts the step's group, so its peers return
//! from a collective instead of waiting for it forever; the first rank's own error is reported
//! rather than a peer's "aborted" echo of it.

use std::sync::{Arc, Mutex, MutexGuard};

use kernels::gpu::Runtime;

use crate::model::ForwardError;
use crate::parallel::device_collective::{DeviceCollective, SoleRank};

/// One device's state. Its buffers and runtime are only touched with the lock held, so one
/// thread at a time drives that device.
pub struct RankState<S>(Mutex<S>);

// SAFETY: the lock serialises every use of a device's runtime and buffers, and nothing
// device-side is reachable except through it. (CUDA contexts may be driven from any thread;
// cudarc binds the context before each call.)
unsafe impl<S> Send for RankState<S> {}
unsafe impl<S> Sync for RankState<S> {}

impl<S> RankState<S> {
    pub fn new(state: S) -> Self {
        Self(Mutex::new(state))
    }

    pub fn lock(&self) -> MutexGuard<'_, S> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Aborts a step's group when its rank's thread unwinds, so the others stop waiting for it.
struct AbortOnPanic<'a, R: Runtime>(&'a dyn DeviceCollective<R>);

impl<R: Runtime> Drop for AbortOnPanic<'_, R> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abort("rank panicked");
        }
    }
}

/// Runs `step` on every rank with its collective handle (`comms[r]` for rank `r`; ignored for a
/// single rank, which gets [`SoleRank`]) and returns every rank's result in rank order.
pub fn run_step<S, T, R>(
    ranks: &[RankState<S>],
    comms: &[Arc<dyn DeviceCollective<R>>],
    step: impl Fn(&mut S, &dyn DeviceCollective<R>) -> Result<T, ForwardError> + Sync,
) -> Result<Vec<T>, ForwardError>
where
    T: Send,
    R: Runtime,
{
    if let [only] = ranks {
        return Ok(vec![step(&mut only.lock(), &SoleRank)?]);
    }
    if comms.len() != ranks.len() {
        return Err(ForwardError::Invalid(format!("{} ranks but {} collective handles", ranks.len(), comms.len())));
    }
    let run = |state: &RankState<S>, comm: &Arc<dyn DeviceCollective<R>>| {
        let _guard = AbortOnPanic(comm.as_ref());
        let out = step(&mut state.lock(), comm.as_ref());
        if let Err(e) = &out {
            comm.abort(&e.to_string());
        }
        out
    };
    let parts: Vec<Result<T, ForwardError>> = std::thread::scope(|s| {
        let peers: Vec<_> = ranks[1..]
            .iter()
            .zip(&comms[1..])
            .enumerate()
            .map(|(i, (state, comm))| {
                let run = &run;
                let spawned = std::thread::Builder::new()
                    .name(format!("device-rank-{}", i + 1))
                    .spawn_scoped(s, move || run(state, comm));
                if let Err(e) = &spawned {
                    // Its peers must not wait for a rank that never starts.
                    comm.abort(&format!("rank thread not started: {e}"));
                }
                spawned
            })
            .collect();
        let mut parts = vec![run(&ranks[0], &comms[0])];
        for (i, p) in peers.into_iter().enumerate() {
            parts.push(match p {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(ForwardError::Invalid(format!("device rank {} panicked in the forward pass", i + 1)))
                }),
                Err(e) => Err(ForwardError::Invalid(format!("cannot start the thread of device rank {}: {e}", i + 1))),
            });
        }
        parts
    });
    // A rank's own failure, not the peers' "aborted" echo of it.
    let aborted = |e: &ForwardError| e.to_string().contains("collective aborted");
    if let Some(first) = parts.iter().position(|p| p.as_ref().is_err_and(|e| !aborted(e))) {
        return Err(parts.into_iter().nth(first).and_then(Result::err).expect("an error at this rank"));
    }
    parts.into_iter().collect()
}
