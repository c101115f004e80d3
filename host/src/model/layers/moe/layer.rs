//! A whole MoE feed-forward block: router, routed experts (optionally in a latent width) and
//! shared experts, `out = routed(x) + shared(x)`. The pieces are public so expert parallelism can
//! route once, have each device run only the experts it owns, add the partial sums and finish.

use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::layers::moe::config::MoeConfig;
use crate::model::layers::moe::experts::Experts;
use crate::model::layers::moe::latent::Latent;
use crate::model::layers::moe::mlp::GatedMlp;
use crate::model::layers::moe::router::{Router, Routing};

pub struct MoeLayer {
    hidden: usize,
    pub(crate) router: Router,
    pub(crate) experts: Experts,
    pub(crate) latent: Option<Latent>,
    pub(crate) shared: Option<GatedMlp>,
}

impl MoeLayer {
    /// Loads the block under `prefix` (e.g. `model.layers.3.mlp`, Kimi's
    /// `model.layers.3.block_sparse_moe`) with Hugging Face checkpoint names: `gate.weight`,
    /// `gate.e_score_correction_bias`, `experts.{e}.*`, `shared_experts.*`, and for latent MoE
    /// `routed_expert_{down_proj,norm,up_proj}`. Expert projections come from
    /// `WeightSource::linear`, so each may be stored in any quantized format (and width).
    pub fn load(cfg: &MoeConfig, src: &dyn WeightSource, prefix: &str) -> Result<Self, LoadError> {
        Self::load_experts(cfg, src, prefix, 0..cfg.num_experts)
    }

    /// As [`Self::load`] but holding only routed experts `held` (an expert-parallel rank): the
    /// router, latent projections and shared experts are loaded whole (every rank routes and
    /// finishes its own tokens).
    pub fn load_experts(
        cfg: &MoeConfig,
        src: &dyn WeightSource,
        prefix: &str,
        held: std::ops::Range<usize>,
    ) -> Result<Self, LoadError> {
        let router = Router::load(cfg, src, prefix)?;
        let experts = Experts::load_range(cfg, src, prefix, held)?;
        let latent = Latent::load(cfg, src, prefix)?;
        let shared = match cfg.num_shared_experts {
            0 => None,
            s => Some(GatedMlp::load(
                src,
                &format!("{prefix}.shared_experts"),
                ["gate_proj", "up_proj", "down_proj"],
                cfg.hidden_size,
                cfg.moe_intermediate_size * s,
                cfg.activation,
            )?),
        };
        tracing::debug!(
            prefix,
            experts = cfg.num_experts,
            top_k = cfg.top_k,
            latent = latent.is_some(),
            shared = cfg.num_shared_experts,
            "loaded MoE block"
        );
        Ok(Self { hidden: cfg.hidden_size, router, experts, latent, shared })
    }

    /// A block from in-memory parts (benchmarks, tests).
    pub fn from_parts(
        hidden: usize,
        router: Router,
        experts: Experts,
        latent: Option<Latent>,
        shared: Option<GatedMlp>,
    ) -> Self {
        Self { hidden, router, experts, latent, shared }
    }

    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    pub fn num_experts(&self) -> usize {
        self.experts.len()
    }

    pub fn experts(&self) -> &Experts {
        &self.experts
    }

    /// `n` rows of `hidden_size` in, `n` rows out.
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let routing = self.route(x, n);
        let xe = self.expert_input(x, n);
        let partial = self.forward_experts(xe.as_deref().unwrap_or(x), n, &routing, &|_| true);
        let mut out = self.finish_routed(&partial, n);
        if let Some(s) = self.forward_shared(x, n) {
            out.iter_mut().zip(s).for_each(|(o, v)| *o += v);
        }
        out
    }

    /// Which experts each token goes to, with what weight (computed on the hidden state).
    pub fn route(&self, x: &[f32], n: usize) -> Routing {
        assert_eq!(x.len(), n * self.hidden, "MoE: input is not {n} rows of {}", self.hidden);
        self.router.route(x, n)
    }

    /// What the routed experts read: the latent projection for latent MoE (`Some`), else the
    /// hidden state itself (`None`, no copy).
    pub fn expert_input(&self, x: &[f32], n: usize) -> Option<Vec<f32>> {
        self.latent.as_ref().map(|l| l.down(x, n))
    }

    /// Weighted sum over the experts `owns` accepts, in the experts' width; partial sums of
    /// disjoint expert sets add up to the full sum, which [`Self::finish_routed`] turns into the
    /// routed output.
    pub fn forward_experts(
        &self,
        expert_input: &[f32],
        n: usize,
        routing: &Routing,
        owns: &(dyn Fn(usize) -> bool + Sync),
    ) -> Vec<f32> {
        self.experts.forward(expert_input, n, routing, owns)
    }

    /// The complete expert sum → routed output in hidden width (identity unless latent).
    pub fn finish_routed(&self, expert_sum: &[f32], n: usize) -> Vec<f32> {
        match &self.latent {
            Some(l) => l.up(expert_sum, n),
            None => expert_sum.to_vec(),
        }
    }

    /// The shared experts' output, `None` when the block has none.
    pub fn forward_shared(&self, x: &[f32], n: usize) -> Option<Vec<f32>> {
        self.shared.as_ref().map(|s| s.forward(x, n))
    }

    /// Bytes of weights one token reads outside the routed experts: router, shared experts and
    /// latent projections.
    pub fn fixed_bytes(&self) -> usize {
        self.router.weight_bytes()
            + self.shared.as_ref().map_or(0, GatedMlp::weight_bytes)
            + self.latent.as_ref().map_or(0, Latent::weight_bytes)
    }
}
