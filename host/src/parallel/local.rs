//! `LocalCollective`: the communicator for N simulated devices that are N threads of one
//! process. Each rank posts its own buffer into its slot of a shared table, waits at a barrier,
//! reads what it needs from the other slots into its own buffers, and waits again before the
//! slots may be reused. Sums run in rank order, so every rank gets bit-identical results and
//! a rerun reproduces them exactly.

use std::any::Any;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};

use crate::parallel::collective::{Collective, CollectiveError, Element, ReduceElement};
use crate::parallel::layout::DeviceMesh;

/// What one rank posts for a collective: its data and, for all-to-all, its per-peer counts.
struct Post<T> {
    data: Vec<T>,
    counts: Vec<usize>,
}

struct BarrierState {
    arrived: usize,
    generation: u64,
    aborted: Option<String>,
}

struct Shared {
    world: usize,
    state: Mutex<BarrierState>,
    cv: Condvar,
    slots: Vec<RwLock<Option<Box<dyn Any + Send + Sync>>>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, BarrierState> {
        // A rank that panicked while holding the lock left consistent counters (it only ever
        // increments under the lock), so recovering the guard is sound.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A reusable barrier that any rank can abort.
    fn wait(&self) -> Result<(), CollectiveError> {
        let mut s = self.lock();
        if let Some(reason) = &s.aborted {
            return Err(CollectiveError::Aborted { reason: reason.clone() });
        }
        let gen = s.generation;
        s.arrived += 1;
        if s.arrived == self.world {
            s.arrived = 0;
            s.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while s.generation == gen && s.aborted.is_none() {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        match (&s.aborted, s.generation != gen) {
            (_, true) => Ok(()),
            (Some(reason), false) => Err(CollectiveError::Aborted { reason: reason.clone() }),
            (None, false) => unreachable!("woken without a new generation or an abort"),
        }
    }
}

/// One rank's handle; `Clone` gives another handle on the same rank (not a new rank).
#[derive(Clone)]
pub struct LocalCollective {
    rank: usize,
    shared: Arc<Shared>,
}

/// One rank's communicators for the two axes of a [`DeviceMesh`] (NCCL: `ncclCommSplit` of the
/// world communicator by `ep_rank` and by `tp_rank`).
pub struct MeshComms {
    pub tp: LocalCollective,
    pub ep: LocalCollective,
}

impl LocalCollective {
    /// A group of `world` ranks; element `r` is rank `r`'s handle, to be moved to its thread.
    pub fn group(world: usize) -> Vec<LocalCollective> {
        assert!(world >= 1, "a communicator needs at least one rank");
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(BarrierState { arrived: 0, generation: 0, aborted: None }),
            cv: Condvar::new(),
            slots: (0..world).map(|_| RwLock::new(None)).collect(),
        });
        (0..world).map(|rank| LocalCollective { rank, shared: shared.clone() }).collect()
    }

    /// The TP and EP communicators of every global rank of `mesh`, indexed by global rank.
    pub fn for_mesh(mesh: &DeviceMesh) -> Vec<MeshComms> {
        let mut tp: Vec<Option<LocalCollective>> = (0..mesh.world_size()).map(|_| None).collect();
        let mut ep: Vec<Option<LocalCollective>> = (0..mesh.world_size()).map(|_| None).collect();
        for e in 0..mesh.ep_size() {
            for (rank, comm) in mesh.tp_group(e).into_iter().zip(Self::group(mesh.tp_size())) {
                tp[rank] = Some(comm);
            }
        }
        for t in 0..mesh.tp_size() {
            for (rank, comm) in mesh.ep_group(t).into_iter().zip(Self::group(mesh.ep_size())) {
                ep[rank] = Some(comm);
            }
        }
        tp.into_iter()
            .zip(ep)
            .map(|(tp, ep)| MeshComms {
                tp: tp.expect("every rank in one TP group"),
                ep: ep.expect("every rank in one EP group"),
            })
            .collect()
    }

    fn post<T: Element>(&self, data: Vec<T>, counts: Vec<usize>) {
        let mut slot = self.shared.slots[self.rank].write().unwrap_or_else(|e| e.into_inner());
        *slot = Some(Box::new(Post { data, counts }));
    }

    /// Runs `read` over every rank's post (in rank order) between the two barriers.
    fn exchange<T: Element, R>(
        &self,
        op: &'static str,
        data: Vec<T>,
        counts: Vec<usize>,
        read: impl FnOnce(&[&Post<T>]) -> Result<R, CollectiveError>,
    ) -> Result<R, CollectiveError> {
        self.post(data, counts);
        self.shared.wait()?;
        let result = {
            let guards: Vec<_> =
                self.shared.slots.iter().map(|s| s.read().unwrap_or_else(|e| e.into_inner())).collect();
            let mut posts = Vec::with_capacity(guards.len());
            let mut typed = Ok(());
            for (rank, g) in guards.iter().enumerate() {
                match g.as_ref().and_then(|b| b.downcast_ref::<Post<T>>()) {
                    Some(p) => posts.push(p),
                    None => {
                        typed = Err(CollectiveError::TypeMismatch { op, rank, want: T::NCCL_NAME });
                        break;
                    }
                }
            }
            typed.and_then(|()| read(&posts))
        };
        // A bad argument seen by only some ranks fails the whole group, so no rank carries on
        // believing a collective succeeded that its peers abandoned.
        if let Err(e) = &result {
            self.abort(&e.to_string());
        }
        // Nobody may post the next collective's data until everyone has read this one's.
        let done = self.shared.wait();
        let r = result?;
        done.map(|()| r)
    }
}

fn same_lengths<T>(op: &'static str, posts: &[&Post<T>]) -> Result<usize, CollectiveError> {
    let want = posts[0].data.len();
    match posts.iter().position(|p| p.data.len() != want) {
        Some(rank) => Err(CollectiveError::LengthMismatch { op, rank, got: posts[rank].data.len(), want }),
        None => Ok(want),
    }
}

impl Collective for LocalCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum<T: ReduceElement>(&self, buf: &mut [T]) -> Result<(), CollectiveError> {
        if self.shared.world == 1 {
            return Ok(());
        }
        self.exchange("all_reduce_sum", buf.to_vec(), Vec::new(), |posts| {
            same_lengths("all_reduce_sum", posts)?;
            // Rank order for every element: the same rounding on every rank and every run.
            buf.copy_from_slice(&posts[0].data);
            for p in &posts[1..] {
                for (b, &x) in buf.iter_mut().zip(&p.data) {
                    *b += x;
                }
            }
            Ok(())
        })
    }

    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), CollectiveError> {
        let world = self.shared.world;
        let want_recv = send.len() * world;
        self.exchange("all_gather", send.to_vec(), Vec::new(), |posts| {
            let n = same_lengths("all_gather", posts)?;
            if recv.len() != want_recv {
                return Err(CollectiveError::BadArgument {
                    op: "all_gather",
                    detail: format!("recv holds {} elements, need {world} × {n}", recv.len()),
                });
            }
            for (chunk, p) in recv.chunks_exact_mut(n.max(1)).zip(posts) {
                chunk.copy_from_slice(&p.data);
            }
            Ok(())
        })
    }

    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<(), CollectiveError> {
        let world = self.shared.world;
        if root >= world {
            self.abort(&format!("broadcast root {root} out of range"));
            return Err(CollectiveError::BadArgument {
                op: "broadcast",
                detail: format!("root {root} is not a rank of a world of {world}"),
            });
        }
        let mine = if self.rank == root { buf.to_vec() } else { Vec::new() };
        let rank = self.rank;
        self.exchange("broadcast", mine, vec![buf.len()], |posts| {
            let want = posts[root].data.len();
            if let Some(r) = posts.iter().position(|p| p.counts[0] != want) {
                return Err(CollectiveError::LengthMismatch {
                    op: "broadcast",
                    rank: r,
                    got: posts[r].counts[0],
                    want,
                });
            }
            if rank != root {
                buf.copy_from_slice(&posts[root].data);
            }
            Ok(())
        })
    }

    fn exchange_counts(&self, send_counts: &[usize]) -> Result<Vec<usize>, CollectiveError> {
        let (world, rank) = (self.shared.world, self.rank);
        self.exchange::<u64, _>("exchange_counts", Vec::new(), send_counts.to_vec(), |posts| {
            if let Some(r) = posts.iter().position(|p| p.counts.len() != world) {
                return Err(CollectiveError::BadArgument {
                    op: "exchange_counts",
                    detail: format!("rank {r} passed {} counts for {world} peers", posts[r].counts.len()),
                });
            }
            Ok(posts.iter().map(|p| p.counts[rank]).collect())
        })
    }

    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<(), CollectiveError> {
        let (world, rank) = (self.shared.world, self.rank);
        const OP: &str = "all_to_all_v";
        self.exchange(OP, send.to_vec(), send_counts.to_vec(), |posts| {
            for (r, p) in posts.iter().enumerate() {
                if p.counts.len() != world || p.counts.iter().sum::<usize>() != p.data.len() {
                    return Err(CollectiveError::BadArgument {
                        op: OP,
                        detail: format!(
                            "rank {r}: {} send counts summing to {} for {world} peers and {} elements",
                            p.counts.len(),
                            p.counts.iter().sum::<usize>(),
                            p.data.len()
                        ),
                    });
                }
            }
            if recv_counts.len() != world || recv_counts.iter().sum::<usize>() != recv.len() {
                return Err(CollectiveError::BadArgument {
                    op: OP,
                    detail: format!(
                        "rank {rank}: recv counts {recv_counts:?} do not match a recv buffer of {}",
                        recv.len()
                    ),
                });
            }
            let mut at = 0;
            for (peer, p) in posts.iter().enumerate() {
                let off: usize = p.counts[..rank].iter().sum();
                let n = p.counts[rank];
                if n != recv_counts[peer] {
                    return Err(CollectiveError::BadArgument {
                        op: OP,
                        detail: format!(
                            "rank {rank} expects {} elements from rank {peer}, which sends {n}",
                            recv_counts[peer]
                        ),
                    });
                }
                recv[at..at + n].copy_from_slice(&p.data[off..off + n]);
                at += n;
            }
            Ok(())
        })
    }

    fn barrier(&self) -> Result<(), CollectiveError> {
        self.shared.wait()
    }

    fn abort(&self, reason: &str) {
        let mut s = self.shared.lock();
        if s.aborted.is_none() {
            s.aborted = Some(format!("rank {}: {reason}", self.rank));
        }
        self.shared.cv.notify_all();
    }
}
