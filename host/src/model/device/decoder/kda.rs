//! A Kimi Delta Attention layer (Kimi-Linear) on the device: the q/k/v projections fused into one
//! `[3P, hidden]` weight (the convolution's channel order), the forget-gate, beta and output-gate
//! projections, and the two recurrent kernels: the causal short convolution (+ SiLU) and the gated
//! delta rule with the gated RMSNorm, each advancing the batch sequences' states in the model's
//! `DeviceRecurrentPool`. Numerics as `model::kda` (the kernels' CPU references are its math).

use kernels::gpu::kda::KdaGeometry;
use kernels::gpu::kernels::GemmScratch;
use kernels::gpu::recurrent_pool::DeviceRecurrentPool;
use kernels::gpu::{Kernels, Runtime};

use crate::model::device::weights::{DenseWeights, DevLinear};
use crate::model::layers::kda::{KdaLayer, OutputGate};
use crate::model::ForwardError;

enum DevGate<R: Runtime> {
    LowRank { a: DevLinear<R>, b: DevLinear<R> },
    FullRank(DevLinear<R>),
}

pub(super) struct DevKda<R: Runtime> {
    /// q, k, v stacked by rows: one GEMM gives the `[n, 3P]` the convolution reads.
    qkv: DevLinear<R>,
    /// Convolution taps `[3P, kernel]`.
    conv: R::Buf<f32>,
    f_a: DevLinear<R>,
    f_b: DevLinear<R>,
    dt_bias: R::Buf<f32>,
    /// `exp(A_log)` per head.
    decay_rate: R::Buf<f32>,
    b: DevLinear<R>,
    gate: DevGate<R>,
    o_norm: R::Buf<f32>,
    o: DevLinear<R>,
    heads: usize,
    head_dim: usize,
    kernel: usize,
    eps: f32,
    lower_bound: Option<f32>,
    /// This layer's index among the model's KDA layers: where its state lives in the pool.
    pub ordinal: usize,
}

/// One step's rows grouped by sequence (`device::step::RecurrentRows`), on the device.
pub(super) struct SeqRows<R: Runtime> {
    pub rows: R::Buf<i32>,
    pub start: R::Buf<i32>,
    pub slot: R::Buf<i32>,
    pub seqs: usize,
}

impl<R: Runtime> DevKda<R> {
    pub fn upload(
        gpu: &Kernels<R>,
        name: &str,
        l: &KdaLayer,
        ordinal: usize,
        dense: DenseWeights,
    ) -> Result<Self, ForwardError> {
        let cfg = &l.cfg;
        let lin = |leaf: &str, w: &crate::model::layers::linear::Linear| {
            DevLinear::upload_as(gpu, &format!("{name}.{leaf}"), w, dense)
        };
        let gate = match &l.out_gate {
            OutputGate::LowRank { a, b } => DevGate::LowRank { a: lin("g_a_proj", a)?, b: lin("g_b_proj", b)? },
            OutputGate::FullRank(g) => DevGate::FullRank(lin("g_proj", g)?),
        };
        Ok(Self {
            qkv: DevLinear::upload_rows(gpu, &format!("{name}.q_proj+k_proj+v_proj"), &[&l.q, &l.k, &l.v], dense)?,
            conv: gpu.upload(&l.conv)?,
            f_a: lin("f_a_proj", &l.f_a)?,
            f_b: lin("f_b_proj", &l.f_b)?,
            dt_bias: gpu.upload(l.dt_bias.as_slice())?,
            decay_rate: gpu.upload(&l.decay_rate)?,
            b: lin("b_proj", &l.b)?,
            gate,
            o_norm: gpu.upload(l.o_norm.as_slice())?,
            o: lin("o_proj", &l.o)?,
            heads: cfg.num_heads,
            head_dim: cfg.head_dim,
            kernel: cfg.conv_kernel,
            eps: cfg.rms_norm_eps,
            lower_bound: cfg.gate_lower_bound,
            ordinal,
        })
    }

    pub fn linears(&self) -> Vec<&DevLinear<R>> {
        let mut all = vec![&self.qkv, &self.f_a, &self.f_b, &self.b, &self.o];
        match &self.gate {
            DevGate::LowRank { a, b } => all.extend([a, b]),
            DevGate::FullRank(g) => all.push(g),
        }
        all
    }

    /// `x` normed hidden states `[n, hidden]` in, the `o_proj` output `[n, hidden]` out; the
    /// sequences of `seqs` advance their states in `pool`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        gpu: &Kernels<R>,
        pool: &mut DeviceRecurrentPool<R>,
        x: &R::Buf<f32>,
        n: usize,
        seqs: &SeqRows<R>,
        scratch: &mut GemmScratch<R>,
        out: &mut R::Buf<f32>,
    ) -> Result<(), ForwardError> {
        let (h, hd) = (self.heads, self.head_dim);
        let p = h * hd;
        let mut mixed = gpu.zeros::<f32>(n * 3 * p)?;
        self.qkv.forward(gpu, x, scratch, &mut mixed, n)?;
        let mut conv = gpu.zeros::<f32>(n * 3 * p)?;
        gpu.kda_conv_silu(
            &mixed,
            &self.conv,
            pool.conv_state(self.ordinal),
            &seqs.rows,
            &seqs.start,
            &seqs.slot,
            seqs.seqs,
            n,
            3 * p,
            self.kernel,
            &mut conv,
        )?;
        let rank = self.f_a.shape().0;
        let (mut fa, mut f) = (gpu.zeros::<f32>(n * rank)?, gpu.zeros::<f32>(n * p)?);
        self.f_a.forward(gpu, x, scratch, &mut fa, n)?;
        self.f_b.forward(gpu, &fa, scratch, &mut f, n)?;
        let mut beta = gpu.zeros::<f32>(n * h)?;
        self.b.forward(gpu, x, scratch, &mut beta, n)?;
        let mut gate = gpu.zeros::<f32>(n * p)?;
        match &self.gate {
            DevGate::LowRank { a, b } => {
                let mut ga = gpu.zeros::<f32>(n * a.shape().0)?;
                a.forward(gpu, x, scratch, &mut ga, n)?;
                b.forward(gpu, &ga, scratch, &mut gate, n)?;
            }
            DevGate::FullRank(g) => g.forward(gpu, x, scratch, &mut gate, n)?,
        }
        let geometry = KdaGeometry {
            seqs: seqs.seqs,
            n,
            heads: h,
            head_dim: hd,
            slots: pool.slots,
            eps: self.eps,
            lower_bound: self.lower_bound,
        };
        let mut heads_out = gpu.zeros::<f32>(n * p)?;
        gpu.kda_recurrent(
            &conv,
            &f,
            &beta,
            &gate,
            &self.dt_bias,
            &self.decay_rate,
            &self.o_norm,
            pool.recurrent_state(self.ordinal),
            &seqs.rows,
            &seqs.start,
            &seqs.slot,
            &geometry,
            &mut heads_out,
        )?;
        self.o.forward(gpu, &heads_out, scratch, out, n)
    }
}
