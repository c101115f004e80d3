//! Running one forward pass on every rank of a simulated group: rank 0 on the caller's thread,
//! the others on scoped threads, each with its own handle on a fresh `LocalCollective`. A rank
//! that fails or panics aborts the group so the others return instead of waiting for it.

use crate::parallel::collective::{Collective, CollectiveError};
use crate::parallel::local::LocalCollective;

/// Aborts the group when its rank unwinds, so the other ranks stop waiting for it.
struct AbortOnPanic<'a>(&'a LocalCollective);

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abort("rank panicked");
        }
    }
}

/// Runs `step(rank's model, rank's communicator)` on every rank and returns rank 0's result
/// (callers arrange for all ranks to return the same). `what` names the group in thread names
/// and in the panic raised when the step fails (the engine's forward contract is infallible).
pub(crate) fn run_on_ranks<M: Sync>(
    ranks: &[M],
    what: &str,
    step: impl Fn(&M, &LocalCollective) -> Result<Vec<f32>, CollectiveError> + Sync,
) -> Vec<f32> {
    let comms = LocalCollective::group(ranks.len());
    let run = |model: &M, comm: &LocalCollective| -> Result<Vec<f32>, CollectiveError> {
        let _guard = AbortOnPanic(comm);
        let out = step(model, comm);
        if let Err(e) = &out {
            comm.abort(&e.to_string());
        }
        out
    };
    std::thread::scope(|s| {
        let peers: Vec<_> = ranks[1..]
            .iter()
            .zip(&comms[1..])
            .enumerate()
            .map(|(i, (model, comm))| {
                let run = &run;
                std::thread::Builder::new()
                    .name(format!("{what}-rank-{}", i + 1))
                    .spawn_scoped(s, move || run(model, comm))
                    .expect("spawning a rank thread")
            })
            .collect();
        let mine = run(&ranks[0], &comms[0]);
        for p in peers {
            if let Err(panic) = p.join() {
                std::panic::resume_unwind(panic);
            }
        }
        mine.unwrap_or_else(|e| panic!("{what} forward failed: {e}"))
    })
}
