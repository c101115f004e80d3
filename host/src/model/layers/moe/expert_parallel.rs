//! Expert parallelism for one MoE block: the routed experts are placed across the ranks of an
//! expert-parallel group in contiguous ranges (`even_range`, so counts may differ by one), and
//! token rows travel to the experts instead of experts to the tokens.
//!
//! Each rank holds a slice of the step's tokens (as with data-parallel attention in front of an
//! EP MoE, DeepSeek-V3's layout). For its tokens a rank:
//! 1. routes them (the router is replicated: every rank has the whole gate);
//! 2. sends each token row once to every rank owning at least one of its chosen experts, with the
//!    token's expert ids and weights (`all_to_all_v`, per-peer counts), so a token whose experts
//!    sit on one rank crosses the link once, not `top_k` times;
//! 3. the receiving rank runs its experts over what it received (`MoeLayer::forward_experts`,
//!    grouped per expert) and returns per row the weighted sum over its experts (a second
//!    `all_to_all_v`, the counts reversed);
//! 4. the sender adds the partial sums in rank order, finishes them (`finish_routed`: latent
//!    up-projection and norm need the complete sum) and adds the shared experts, which it
//!    computes itself for its tokens (they are replicated; nothing about them crosses a link).

use std::ops::Range;

use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::layers::moe::{MoeConfig, MoeLayer, Routing};

use crate::model::shard::even_range;
use crate::parallel::collective::{Collective, CollectiveError};

/// What crossed the links in one [`ExpertParallelMoe::forward_tokens`] call, for tests and logs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DispatchStats {
    /// Token rows this rank sent out (one per token per destination rank, itself included).
    pub sent_rows: usize,
    /// Token rows this rank received and ran through its experts.
    pub received_rows: usize,
    /// Rows received from each peer.
    pub received_from: Vec<usize>,
}

/// One expert-parallel rank's part of an MoE block.
pub struct ExpertParallelMoe {
    layer: MoeLayer,
    rank: usize,
    size: usize,
    top_k: usize,
}

/// The experts rank `rank` of `size` holds out of `num_experts`.
pub fn experts_of(num_experts: usize, size: usize, rank: usize) -> Range<usize> {
    even_range(num_experts, size, rank)
}

impl ExpertParallelMoe {
    /// Loads rank `rank`'s share of the block under `prefix`: its experts only, plus the router,
    /// latent projections and shared experts. Refuses more ranks than experts (a rank without
    /// experts would only forward traffic).
    pub fn load(
        cfg: &MoeConfig,
        src: &dyn WeightSource,
        prefix: &str,
        rank: usize,
        size: usize,
    ) -> Result<Self, LoadError> {
        let file = || src.file_of(&format!("{prefix}.gate.weight"));
        if size == 0 || rank >= size {
            return Err(LoadError::Config { file: file(), detail: format!("expert-parallel rank {rank} of {size}") });
        }
        if size > cfg.num_experts {
            return Err(LoadError::Config {
                file: file(),
                detail: format!("expert parallel size {size} exceeds the {} routed experts", cfg.num_experts),
            });
        }
        let held = experts_of(cfg.num_experts, size, rank);
        tracing::debug!(prefix, rank, size, experts = ?held, "loading expert-parallel MoE rank");
        let layer = MoeLayer::load_experts(cfg, src, prefix, held)?;
        Ok(Self { layer, rank, size, top_k: cfg.top_k })
    }

    pub fn layer(&self) -> &MoeLayer {
        &self.layer
    }

    pub fn held(&self) -> Range<usize> {
        self.layer.experts().held()
    }

    /// The rank holding expert `e`.
    fn owner(&self, e: usize) -> usize {
        let n = self.layer.num_experts();
        (0..self.size).find(|&r| experts_of(n, self.size, r).contains(&e)).expect("routing picks experts of the layer")
    }

    /// The block's output for this rank's `n` token rows `x` (`n × hidden`, `n` may be 0 and may
    /// differ between ranks). Every rank of `comm` (the EP group, `comm.rank()` = this rank) must
    /// call it in the same step.
    pub fn forward_tokens<C: Collective>(
        &self,
        x: &[f32],
        n: usize,
        comm: &C,
    ) -> Result<(Vec<f32>, DispatchStats), CollectiveError> {
        let (h, k, size) = (self.layer.hidden_size(), self.top_k, self.size);
        if comm.world_size() != size || comm.rank() != self.rank {
            return Err(CollectiveError::BadArgument {
                op: "expert-parallel MoE",
                detail: format!(
                    "communicator is rank {} of {}, the layer rank {} of {size}",
                    comm.rank(),
                    comm.world_size(),
                    self.rank
                ),
            });
        }
        if x.len() != n * h {
            return Err(CollectiveError::BadArgument {
                op: "expert-parallel MoE",
                detail: format!("input has {} values, not {n} rows of {h}", x.len()),
            });
        }
        let dim = self.layer.experts().dim();
        let routing =
            if n == 0 { Routing { top_k: k, experts: vec![], weights: vec![] } } else { self.layer.route(x, n) };
        let latent = if n == 0 { None } else { self.layer.expert_input(x, n) };
        let xe: &[f32] = latent.as_deref().unwrap_or(x);

        // Which of this rank's tokens go to each destination, in token order.
        let mut to: Vec<Vec<usize>> = vec![Vec::new(); size];
        for t in 0..n {
            let (ids, _) = routing.token(t);
            let mut dests: Vec<usize> = ids.iter().map(|&e| self.owner(e as usize)).collect();
            dests.sort_unstable();
            dests.dedup();
            for p in dests {
                to[p].push(t);
            }
        }
        let send_tokens: Vec<usize> = to.iter().map(Vec::len).collect();
        let mut rows = Vec::with_capacity(send_tokens.iter().sum::<usize>() * dim);
        let mut ids = Vec::with_capacity(send_tokens.iter().sum::<usize>() * k);
        let mut weights = Vec::with_capacity(ids.capacity());
        for &t in to.iter().flatten() {
            rows.extend_from_slice(&xe[t * dim..(t + 1) * dim]);
            let (e, w) = routing.token(t);
            ids.extend_from_slice(e);
            weights.extend_from_slice(w);
        }
        let recv_tokens = comm.exchange_counts(&send_tokens)?;
        let scale = |c: &[usize], by: usize| c.iter().map(|&v| v * by).collect::<Vec<_>>();
        let m: usize = recv_tokens.iter().sum();
        let mut recv_rows = vec![0f32; m * dim];
        let mut recv_ids = vec![0u32; m * k];
        let mut recv_weights = vec![0f32; m * k];
        comm.all_to_all_v(&rows, &scale(&send_tokens, dim), &mut recv_rows, &scale(&recv_tokens, dim))?;
        comm.all_to_all_v(&ids, &scale(&send_tokens, k), &mut recv_ids, &scale(&recv_tokens, k))?;
        comm.all_to_all_v(&weights, &scale(&send_tokens, k), &mut recv_weights, &scale(&recv_tokens, k))?;

        // Received rows carry all k choices; experts held elsewhere are skipped (they were sent
        // to their own owners too), so each row comes back as this rank's partial sum.
        let partial = if m == 0 {
            Vec::new()
        } else {
            let held = self.held();
            let routing = Routing { top_k: k, experts: recv_ids, weights: recv_weights };
            self.layer.forward_experts(&recv_rows, m, &routing, &|e| held.contains(&e))
        };
        let mut back = vec![0f32; rows.len()];
        comm.all_to_all_v(&partial, &scale(&recv_tokens, dim), &mut back, &scale(&send_tokens, dim))?;

        // Partial sums added in rank order: deterministic, independent of thread timing.
        let mut sum = vec![0f32; n * dim];
        for (&t, part) in to.iter().flatten().zip(back.chunks_exact(dim.max(1))) {
            for (s, v) in sum[t * dim..(t + 1) * dim].iter_mut().zip(part) {
                *s += v;
            }
        }
        let stats = DispatchStats { sent_rows: send_tokens.iter().sum(), received_rows: m, received_from: recv_tokens };
        if n == 0 {
            return Ok((Vec::new(), stats));
        }
        let mut out = self.layer.finish_routed(&sum, n);
        if let Some(shared) = self.layer.forward_shared(x, n) {
            out.iter_mut().zip(shared).for_each(|(o, v)| *o += v);
        }
        Ok((out, stats))
    }

    /// The block's output for `n` rows held identically by every rank (tensor-parallel style
    /// callers): rank r takes token slice `even_range(n, size, r)`, runs [`Self::forward_tokens`],
    /// and the slices are all-gathered so every rank returns all `n` rows.
    pub fn forward_replicated<C: Collective>(
        &self,
        x: &[f32],
        n: usize,
        comm: &C,
    ) -> Result<Vec<f32>, CollectiveError> {
        let h = self.layer.hidden_size();
        if x.len() != n * h {
            return Err(CollectiveError::BadArgument {
                op: "expert-parallel MoE",
                detail: format!("input has {} values, not {n} rows of {h}", x.len()),
            });
        }
        let mine = even_range(n, self.size, self.rank);
        let (local, _) = self.forward_tokens(&x[mine.start * h..mine.end * h], mine.len(), comm)?;
        // Slices differ in length by at most one row; pad each to the widest for the all-gather.
        let widest = even_range(n, self.size, 0).len();
        let mut padded = vec![0f32; widest * h];
        padded[..local.len()].copy_from_slice(&local);
        let mut gathered = vec![0f32; self.size * widest * h];
        comm.all_gather(&padded, &mut gathered)?;
        let mut out = Vec::with_capacity(n * h);
        for r in 0..self.size {
            let len = even_range(n, self.size, r).len();
            out.extend_from_slice(&gathered[r * widest * h..(r * widest + len) * h]);
        }
        Ok(out)
    }
}
