//! Token → expert routing: scores from the router Linear (`gate.weight`, always f32 math), then
//! top-k selection — plain, group-limited (DeepSeek-V2: groups ranked by their best score) or
//! `noaux_tc` (DeepSeek-V3 / Kimi: selection on `score + e_score_correction_bias`, groups ranked
//! by the sum of their two best biased scores). The bias only decides *which* experts are chosen;
//! their weights are the unbiased scores, optionally renormalised to sum to 1, then scaled by
//! `routed_scaling_factor` (transformers' DeepseekV3TopkRouter, vLLM's grouped_topk).

use kernels::cpu::matmul::matmul_t;

use kernels::cpu::moe::{route_token, RouterSpec};

use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::layers::moe::config::MoeConfig;
use crate::model::tensor::Tensor;

/// The experts chosen for a batch of tokens: for token `t`, `experts[t*k..(t+1)*k]` with the
/// matching `weights`. The order inside a token's k is unspecified (like torch.topk unsorted).
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

/// Tokens grouped by expert (compressed rows): expert `e`'s tokens are
/// `tokens[offsets[e]..offsets[e+1]]`, each with its routing weight.
pub struct ExpertGroups {
    pub offsets: Vec<usize>,
    pub tokens: Vec<u32>,
    pub weights: Vec<f32>,
}

impl ExpertGroups {
    /// (token ids, weights) routed to expert `e`.
    pub fn of(&self, e: usize) -> (&[u32], &[f32]) {
        let r = self.offsets[e]..self.offsets[e + 1];
        (&self.tokens[r.clone()], &self.weights[r])
    }
}

impl Routing {
    pub fn tokens(&self) -> usize {
        self.experts.len().checked_div(self.top_k).unwrap_or(0)
    }

    /// The experts and weights of token `t`.
    pub fn token(&self, t: usize) -> (&[u32], &[f32]) {
        let r = t * self.top_k..(t + 1) * self.top_k;
        (&self.experts[r.clone()], &self.weights[r])
    }

    /// Counting sort by expert, tokens in ascending order inside each expert.
    pub fn by_expert(&self, num_experts: usize) -> ExpertGroups {
        let mut offsets = vec![0usize; num_experts + 1];
        for &e in &self.experts {
            offsets[e as usize + 1] += 1;
        }
        for e in 0..num_experts {
            offsets[e + 1] += offsets[e];
        }
        let mut fill = offsets.clone();
        let mut tokens = vec![0u32; self.experts.len()];
        let mut weights = vec![0f32; self.experts.len()];
        for (i, (&e, &w)) in self.experts.iter().zip(&self.weights).enumerate() {
            let slot = &mut fill[e as usize];
            tokens[*slot] = (i / self.top_k) as u32;
            weights[*slot] = w;
            *slot += 1;
        }
        ExpertGroups { offsets, tokens, weights }
    }
}

pub struct Router {
    /// `[num_experts, hidden]`.
    pub(crate) weight: Tensor,
    /// `e_score_correction_bias`, present iff the method is noaux_tc.
    pub(crate) bias: Option<Vec<f32>>,
    pub(crate) spec: RouterSpec,
}

impl Router {
    pub fn load(cfg: &MoeConfig, src: &dyn WeightSource, prefix: &str) -> Result<Self, LoadError> {
        let weight = src.load(&format!("{prefix}.gate.weight"), &[cfg.num_experts, cfg.hidden_size])?;
        let bias = if cfg.uses_bias() {
            let name = format!("{prefix}.gate.e_score_correction_bias");
            if !src.contains(&name) {
                return Err(LoadError::MissingTensor {
                    file: src.file_of(&name),
                    tensor: format!("{name} (topk_method noaux_tc needs it)"),
                });
            }
            Some(src.load(&name, &[cfg.num_experts])?.as_slice().to_vec())
        } else {
            None
        };
        Ok(Self::new(cfg, weight, bias))
    }

    /// A router from in-memory weights (tests, benchmarks); `bias` is used iff noaux_tc.
    pub fn new(cfg: &MoeConfig, weight: Tensor, bias: Option<Vec<f32>>) -> Self {
        assert_eq!(weight.shape, [cfg.num_experts, cfg.hidden_size], "router weight shape");
        let bias = if cfg.uses_bias() { Some(bias.unwrap_or_else(|| vec![0.0; cfg.num_experts])) } else { None };
        let spec = RouterSpec {
            scoring: cfg.scoring,
            method: cfg.topk_method,
            num_experts: cfg.num_experts,
            n_group: cfg.n_group,
            topk_group: cfg.topk_group,
            top_k: cfg.top_k,
            normalize: cfg.norm_topk_prob,
            scale: cfg.routed_scaling_factor,
        };
        Self { weight, bias, spec }
    }

    pub fn num_experts(&self) -> usize {
        self.weight.shape[0]
    }

    pub fn weight_bytes(&self) -> usize {
        self.weight.len() * 4
    }

    /// Router logits `x · gateᵀ` for `n` rows.
    pub fn logits(&self, x: &[f32], n: usize) -> Vec<f32> {
        let (e, d) = (self.weight.shape[0], self.weight.shape[1]);
        let mut out = vec![0.0; n * e];
        matmul_t(x, self.weight.as_slice(), &mut out, n, d, e);
        out
    }

    pub fn route(&self, x: &[f32], n: usize) -> Routing {
        let logits = self.logits(x, n);
        let e = self.num_experts();
        let k = self.spec.top_k;
        let mut experts = Vec::with_capacity(n * k);
        let mut weights = Vec::with_capacity(n * k);
        for row in logits.chunks_exact(e) {
            // One token: scores, group mask, top-k, weights (the device kernel's reference).
            let (ids, ws) = route_token(&self.spec, row, self.bias.as_deref());
            experts.extend(ids);
            weights.extend(ws);
        }
        Routing { top_k: k, experts, weights }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layers::moe::config::{Scoring, TopkMethod};
    use kernels::cpu::moe::top_indices;

    fn cfg(scoring: Scoring, method: TopkMethod, n_group: usize, topk_group: usize, top_k: usize) -> MoeConfig {
        MoeConfig { scoring, topk_method: method, n_group, topk_group, ..MoeConfig::plain(8, 8, top_k, 4) }
    }

    /// A router whose logits equal the one-hot input's column: x = e_0 gives logits = `logits`.
    fn router(c: &MoeConfig, logits: &[f32], bias: Option<Vec<f32>>) -> (Router, Vec<f32>) {
        let mut w = vec![0.0; 8 * 8];
        for (e, &l) in logits.iter().enumerate() {
            w[e * 8] = l;
        }
        let mut x = vec![0.0; 8];
        x[0] = 1.0;
        (Router::new(c, Tensor::owned(vec![8, 8], w), bias), x)
    }

    fn sorted(r: &Routing) -> Vec<(u32, f32)> {
        let mut v: Vec<(u32, f32)> = r.experts.iter().copied().zip(r.weights.iter().copied()).collect();
        v.sort_by_key(|p| p.0);
        v
    }

    const LOGITS: [f32; 8] = [0.1, 2.0, -1.0, 0.5, 1.5, 1.4, -0.3, 0.0];

    #[test]
    fn softmax_and_sigmoid_choose_alike_but_weigh_differently() {
        let (soft, x) = router(&cfg(Scoring::Softmax, TopkMethod::Greedy, 1, 1, 2), &LOGITS, None);
        let (sig, _) = router(&cfg(Scoring::Sigmoid, TopkMethod::Greedy, 1, 1, 2), &LOGITS, None);
        let z: f32 = LOGITS.iter().map(|l| l.exp()).sum();
        let s = sorted(&soft.route(&x, 1));
        assert_eq!(s.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 4]);
        assert!((s[0].1 - 2.0f32.exp() / z).abs() < 1e-6 && (s[1].1 - 1.5f32.exp() / z).abs() < 1e-6);
        let g = sorted(&sig.route(&x, 1));
        assert_eq!(g.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 4]);
        assert!((g[0].1 - 1.0 / (1.0 + (-2.0f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn groups_limit_the_choice() {
        // Groups of 2: {0,1} {2,3} {4,5} {6,7}. Max per group: 2.0, 0.5, 1.5, 0.0; two best
        // summed: 2.1, -0.5, 2.9, -0.3.
        let (v2, x) = router(&cfg(Scoring::Softmax, TopkMethod::GroupLimitedGreedy, 4, 1, 2), &LOGITS, None);
        assert_eq!(sorted(&v2.route(&x, 1)).iter().map(|p| p.0).collect::<Vec<_>>(), [0, 1]);
        // noaux_tc ranks by sum of the top two (of sigmoid scores here: group {4,5} wins).
        let (v3, _) = router(&cfg(Scoring::Sigmoid, TopkMethod::NoauxTc, 4, 1, 2), &LOGITS, None);
        assert_eq!(sorted(&v3.route(&x, 1)).iter().map(|p| p.0).collect::<Vec<_>>(), [4, 5]);
        // Unrestricted, the same scores would pick 1 and 4.
        let (all, _) = router(&cfg(Scoring::Sigmoid, TopkMethod::NoauxTc, 4, 4, 2), &LOGITS, None);
        assert_eq!(sorted(&all.route(&x, 1)).iter().map(|p| p.0).collect::<Vec<_>>(), [1, 4]);
    }

    #[test]
    fn bias_selects_but_does_not_weigh() {
        let mut c = cfg(Scoring::Sigmoid, TopkMethod::NoauxTc, 1, 1, 2);
        c.norm_topk_prob = true;
        c.routed_scaling_factor = 2.5;
        let mut bias = vec![0.0; 8];
        bias[7] = 3.0; // logit 0.0 -> score 0.5, biased 3.5: chosen
        let (r, x) = router(&c, &LOGITS, Some(bias));
        let got = sorted(&r.route(&x, 1));
        assert_eq!(got.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 7]);
        let (s1, s7) = (1.0 / (1.0 + (-2.0f32).exp()), 0.5f32);
        assert!((got[0].1 - 2.5 * s1 / (s1 + s7)).abs() < 1e-6, "{got:?}");
        assert!((got[1].1 - 2.5 * s7 / (s1 + s7)).abs() < 1e-6, "{got:?}");
    }

    #[test]
    fn nan_is_never_chosen_and_groups_cover_every_token() {
        let (r, _) = router(&cfg(Scoring::Sigmoid, TopkMethod::Greedy, 1, 1, 3), &LOGITS, None);
        let mut x = vec![0.0; 16];
        x[0] = 1.0;
        x[8] = f32::NAN;
        let routing = r.route(&x, 2);
        assert_eq!(routing.tokens(), 2);
        let g = routing.by_expert(8);
        assert_eq!(*g.offsets.last().unwrap(), 6);
        let (toks, _) = g.of(1);
        assert_eq!(toks[0], 0);
        assert!(top_indices(&[f32::NAN, 1.0, 0.5], 1) == [1]);
    }
}
