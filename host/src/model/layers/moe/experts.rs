//! The routed experts and their batched execution: a step's tokens are grouped by expert, each
//! expert runs once over its gathered rows (one matrix-matrix product per projection, so its
//! weights are read once per step however many tokens chose it), and the outputs are
//! scatter-added with the routing weights. Experts run in parallel (rayon); the scatter is done
//! in expert order afterwards so results do not depend on thread timing.

use rayon::prelude::*;

use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::layers::moe::config::MoeConfig;
use crate::model::layers::moe::mlp::GatedMlp;
use crate::model::layers::moe::router::Routing;

pub struct Experts {
    /// The experts this instance holds: `held.start + i` is `list[i]` (all of them, except on an
    /// expert-parallel rank, which holds one contiguous range).
    list: Vec<GatedMlp>,
    held: std::ops::Range<usize>,
    /// Routed experts of the layer, held or not (what routing indexes).
    total: usize,
    /// Width the experts read and write (hidden size, or the latent size for latent MoE).
    dim: usize,
}

impl Experts {
    /// Loads `{prefix}.experts.{e}.*` for every routed expert.
    pub fn load(cfg: &MoeConfig, src: &dyn WeightSource, prefix: &str) -> Result<Self, LoadError> {
        Self::load_range(cfg, src, prefix, 0..cfg.num_experts)
    }

    /// Loads only experts `held` (an expert-parallel rank's share); the others are never read.
    pub fn load_range(
        cfg: &MoeConfig,
        src: &dyn WeightSource,
        prefix: &str,
        held: std::ops::Range<usize>,
    ) -> Result<Self, LoadError> {
        let dim = cfg.expert_hidden_size();
        if held.start > held.end || held.end > cfg.num_experts {
            return Err(LoadError::Config {
                file: src.file_of(&format!("{prefix}.gate.weight")),
                detail: format!("experts {held:?} out of the layer's {} routed experts", cfg.num_experts),
            });
        }
        let list = held
            .clone()
            .map(|e| {
                GatedMlp::load(
                    src,
                    &format!("{prefix}.experts.{e}"),
                    cfg.naming.leaves(),
                    dim,
                    cfg.moe_intermediate_size,
                    cfg.activation,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { list, held, total: cfg.num_experts, dim })
    }

    /// Experts built in memory (benchmarks, tests); all must share one width.
    pub fn new(list: Vec<GatedMlp>) -> Self {
        let dim = list.first().map_or(0, GatedMlp::hidden_size);
        assert!(list.iter().all(|m| m.hidden_size() == dim), "experts of different widths");
        let total = list.len();
        Self { list, held: 0..total, total, dim }
    }

    /// Routed experts of the layer (including any this instance does not hold).
    pub fn len(&self) -> usize {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The experts this instance holds (`0..len()` unless loaded with [`Self::load_range`]).
    pub fn held(&self) -> std::ops::Range<usize> {
        self.held.clone()
    }

    /// Expert `e`, which must be held.
    pub fn get(&self, e: usize) -> &GatedMlp {
        &self.list[e - self.held.start]
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The obvious per-token loop [`Self::forward`] avoids: each token runs each of its experts
    /// on its own row (all held experts). The reference the grouped path is tested against and
    /// the baseline the MoE benchmark reports it against.
    pub fn forward_per_token(&self, x: &[f32], n: usize, routing: &Routing) -> Vec<f32> {
        let d = self.dim;
        let mut out = vec![0.0; n * d];
        for t in 0..n {
            let (ids, ws) = routing.token(t);
            for (&e, &w) in ids.iter().zip(ws) {
                let y = self.get(e as usize).forward(&x[t * d..(t + 1) * d], 1);
                for (o, v) in out[t * d..(t + 1) * d].iter_mut().zip(y) {
                    *o += w * v;
                }
            }
        }
        out
    }

    /// `Σ_k w_k · expert_k(x)` per token over the experts `owns` accepts (others contribute
    /// nothing, so devices owning disjoint expert sets produce partial sums that add up to the
    /// full result). Experts not held count as not owned. `x`: `n × dim`; returns `n × dim`.
    pub fn forward(&self, x: &[f32], n: usize, routing: &Routing, owns: &(dyn Fn(usize) -> bool + Sync)) -> Vec<f32> {
        let d = self.dim;
        assert_eq!(x.len(), n * d, "experts: input is not {n} rows of {d}");
        assert_eq!(routing.tokens(), n, "experts: routing is for {} tokens, input has {n}", routing.tokens());
        let groups = routing.by_expert(self.total);
        let active: Vec<usize> =
            self.held.clone().filter(|&e| groups.offsets[e + 1] > groups.offsets[e] && owns(e)).collect();
        let outputs: Vec<Vec<f32>> = active
            .par_iter()
            .map(|&e| {
                let (tokens, _) = groups.of(e);
                let mut rows = Vec::with_capacity(tokens.len() * d);
                for &t in tokens {
                    rows.extend_from_slice(&x[t as usize * d..(t as usize + 1) * d]);
                }
                self.get(e).forward(&rows, tokens.len())
            })
            .collect();
        let mut out = vec![0.0f32; n * d];
        for (&e, y) in active.iter().zip(&outputs) {
            let (tokens, weights) = groups.of(e);
            for ((&t, &w), row) in tokens.iter().zip(weights).zip(y.chunks_exact(d)) {
                for (o, &v) in out[t as usize * d..(t as usize + 1) * d].iter_mut().zip(row) {
                    *o += w * v;
                }
            }
        }
        out
    }

    /// Bytes of one expert's weights (all experts of a layer have the same storage format only if
    /// the checkpoint says so; this is expert `e`'s).
    pub fn expert_bytes(&self, e: usize) -> usize {
        self.get(e).weight_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layers::linear::Linear;
    use crate::model::layers::moe::mlp::Activation;
    use crate::model::tensor::Tensor;
    use rand::{Rng, SeedableRng};

    fn random(rng: &mut rand_chacha::ChaCha8Rng, rows: usize, cols: usize) -> Linear {
        Linear::Dense(Tensor::owned(vec![rows, cols], (0..rows * cols).map(|_| rng.random_range(-0.5..0.5)).collect()))
    }

    #[test]
    fn grouped_equals_per_token_and_partials_add_up() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (d, inter, e, k, n) = (24, 16, 6, 2, 11);
        let list = (0..e)
            .map(|_| GatedMlp {
                gate: random(&mut rng, inter, d),
                up: random(&mut rng, inter, d),
                down: random(&mut rng, d, inter),
                activation: Activation::Silu,
            })
            .collect();
        let experts = Experts::new(list);
        let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-1.0..1.0)).collect();
        // Skewed routing: expert 0 is chosen by most tokens, expert 5 by none.
        let mut ids = Vec::new();
        for t in 0..n {
            ids.push(if t % 4 == 3 { 2 } else { 0 });
            ids.push(1 + (t % 4) as u32);
        }
        let routing =
            Routing { top_k: k, weights: (0..n * k).map(|_| rng.random_range(0.0..1.0)).collect(), experts: ids };
        let grouped = experts.forward(&x, n, &routing, &|_| true);
        let want = experts.forward_per_token(&x, n, &routing);
        for (a, b) in grouped.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
        let even = experts.forward(&x, n, &routing, &|e| e % 2 == 0);
        let odd = experts.forward(&x, n, &routing, &|e| e % 2 == 1);
        for ((a, b), w) in even.iter().zip(&odd).zip(&want) {
            assert!((a + b - w).abs() <= 1e-5 * w.abs().max(1.0));
        }
        assert!(even.iter().any(|&v| v != 0.0) && odd.iter().any(|&v| v != 0.0));
    }
}
