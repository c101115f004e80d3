//! A loaded `DeepseekV3Model` (rank) in device form: each projection in its checkpoint format
//! (`DevLinear`), gate and up fused, every routed expert a layer's rank holds stacked into one
//! weight per projection (so one grouped GEMV runs them all), the absorbed `kv_b_proj` halves
//! as bf16 per-head matrices, RoPE's inverse frequencies. What the device forward cannot run
//! (SiTU experts, latent MoE, experts in mixed formats) is refused with the reason, and the
//! caller keeps the CPU forward.

use std::ops::Range;

use kernels::cpu::gather::narrow_bf16;
use kernels::cpu::moe::RouterSpec;
use kernels::gpu::kernels::GemmScratch;
use kernels::gpu::moe::ExpertWeight;
use kernels::gpu::{Kernels, Runtime};

use crate::model::arch::deepseek_v3::DeepseekV3Model;
use crate::model::arch::kimi_linear::{KimiLinearModel, Mixer};
use crate::model::device::decoder::kda::DevKda;
use crate::model::device::decoder::{invalid, DecoderRank};
use crate::model::device::weights::{DenseWeights, DevLinear};
use crate::model::layers::linear::Linear;
use crate::model::layers::mla::layer::QPath;
use crate::model::layers::mla::MlaLayer;
use crate::model::layers::moe::ffn::Ffn;
use crate::model::layers::moe::mlp::{Activation, GatedMlp};
use crate::model::layers::moe::MoeLayer;
use crate::model::tensor::Tensor;
use crate::model::ForwardError;

/// A layer's token mixer: MLA attention over the latent pool (`latent`: its layer there), or a
/// KDA layer over the recurrent state pool.
pub(super) enum DevMixer<R: Runtime> {
    Mla { attn: DevMla<R>, latent: usize },
    Kda(DevKda<R>),
}

pub(super) struct DevLayer<R: Runtime> {
    pub attn_norm: R::Buf<f32>,
    pub mixer: DevMixer<R>,
    pub ffn_norm: R::Buf<f32>,
    pub ffn: DevFfn<R>,
}

pub(super) enum DevQ<R: Runtime> {
    Plain(DevLinear<R>),
    LowRank { a: DevLinear<R>, norm: R::Buf<f32>, b: DevLinear<R> },
}

pub(super) struct DevRotary<R: Runtime> {
    pub inv_freq: R::Buf<f32>,
    pub interleave: bool,
    pub attention_factor: f32,
}

pub(super) struct DevMla<R: Runtime> {
    pub q: DevQ<R>,
    /// `[kv_lora + rope, hidden]`: the latent and the shared rotary key.
    pub kv_a: DevLinear<R>,
    pub kv_a_norm: R::Buf<f32>,
    /// `[heads][lora][nope]`: `W_uk` per head, transposed so the query absorption is a per-head
    /// matrix-vector product.
    pub w_uk_t: HeadWeights<R>,
    /// `[heads][v][lora]`.
    pub w_uv: HeadWeights<R>,
    pub gate: Option<DevLinear<R>>,
    pub o: DevLinear<R>,
    pub rotary: Option<DevRotary<R>>,
    /// This rank's heads.
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    pub lora: usize,
    pub scale: f32,
    /// The latent norms' epsilon (`MlaConfig::lora_norm_eps`).
    pub eps: f32,
}

/// Per-head matrices (MLA's absorbed `kv_b_proj` halves): bf16, or f32 under `--dtype float32`.
pub(super) enum HeadWeights<R: Runtime> {
    Bf16(R::Buf<u16>),
    F32(R::Buf<f32>),
}

impl<R: Runtime> HeadWeights<R> {
    fn upload(gpu: &Kernels<R>, w: &[f32], dense: DenseWeights) -> Result<Self, ForwardError> {
        Ok(match dense {
            DenseWeights::Bf16 => HeadWeights::Bf16(gpu.upload(&narrow_bf16(w))?),
            DenseWeights::F32 => HeadWeights::F32(gpu.upload(w)?),
        })
    }

    /// `out[t, h, :] = W[h] · x[t, h, :]` for `[heads][rows][cols]` matrices.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &self,
        gpu: &Kernels<R>,
        x: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        tokens: usize,
        heads: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(), ForwardError> {
        match self {
            HeadWeights::Bf16(w) => gpu.head_matvec_bf16(w, x, out, tokens, heads, rows, cols)?,
            HeadWeights::F32(w) => gpu.head_matvec_f32(w, x, out, tokens, heads, rows, cols)?,
        }
        Ok(())
    }
}

/// The embedding table the token gather reads: bf16 (also the tied output weight in serving
/// precision), or f32 under `--dtype float32`.
pub(super) enum Embedding<R: Runtime> {
    Bf16(R::Buf<u16>),
    F32(R::Buf<f32>),
}

impl<R: Runtime> Embedding<R> {
    pub fn upload(gpu: &Kernels<R>, table: &[f32], dense: DenseWeights) -> Result<Self, ForwardError> {
        Ok(match dense {
            DenseWeights::Bf16 => Embedding::Bf16(gpu.upload(&narrow_bf16(table))?),
            DenseWeights::F32 => Embedding::F32(gpu.upload(table)?),
        })
    }

    /// `out[i] = table[ids[i]]` for `n` rows of `d`.
    pub fn gather(
        &self,
        gpu: &Kernels<R>,
        ids: &R::Buf<i32>,
        out: &mut R::Buf<f32>,
        n: usize,
        d: usize,
    ) -> Result<(), ForwardError> {
        match self {
            Embedding::Bf16(t) => gpu.gather_rows_bf16(t, ids, out, n, d)?,
            Embedding::F32(t) => gpu.gather_rows_f32(t, ids, out, n, d)?,
        }
        Ok(())
    }
}

/// A gated MLP (SwiGLU, or K3's SiTU): the dense layers and the shared experts.
pub(super) struct DevMlp<R: Runtime> {
    pub gate_up: DevLinear<R>,
    pub down: DevLinear<R>,
    pub inter: usize,
    pub activation: Activation,
}

/// `out[n, inter] = act(gate_up[n, :inter], gate_up[n, inter:])`.
pub(super) fn gated_activation<R: Runtime>(
    gpu: &Kernels<R>,
    activation: Activation,
    gate_up: &R::Buf<f32>,
    out: &mut R::Buf<f32>,
    n: usize,
    inter: usize,
) -> Result<(), ForwardError> {
    match activation {
        Activation::Silu => gpu.silu_mul(gate_up, out, n, inter)?,
        Activation::Situ { beta, linear_beta } => gpu.situ_mul(gate_up, out, n, inter, beta, linear_beta)?,
    }
    Ok(())
}

/// K3's latent MoE around the routed experts: `down` (hidden → latent) before them, the RMSNorm
/// (`norm`, optional) and `up` (latent → hidden) after their weighted sum.
pub(super) struct DevLatent<R: Runtime> {
    pub down: DevLinear<R>,
    pub norm: Option<R::Buf<f32>>,
    pub up: DevLinear<R>,
    pub width: usize,
    pub eps: f32,
}

/// Block Attention Residuals (K3): each layer's two score weights (norm weight × projection) and
/// the final one; snapshots every `block_size` layers, `slots` of the stream in all (the
/// snapshots and the partial sum).
pub(super) struct DevAttnRes<R: Runtime> {
    pub block_size: usize,
    pub layers: Vec<(R::Buf<f32>, R::Buf<f32>)>,
    pub output: R::Buf<f32>,
    pub slots: usize,
}

/// One layer's routed experts this rank holds, one projection stacked by rows, in their
/// checkpoint format (dense ones bf16, or f32 under `--dtype float32`; the expert GEMV
/// multiplies f32 activations either way).
pub(super) struct ExpertStack<R: Runtime>(DevLinear<R>);

pub(super) struct DevMoe<R: Runtime> {
    /// f32 `[experts, hidden]`: the choice of experts must not depend on bf16 rounding.
    pub router: R::Buf<f32>,
    pub bias: Option<R::Buf<f32>>,
    pub spec: RouterSpec,
    pub held: Range<usize>,
    pub hidden: usize,
    pub inter: usize,
    /// Expert `e - held.start`'s gate rows then up rows.
    pub gate_up: ExpertStack<R>,
    pub down: ExpertStack<R>,
    pub shared: Option<DevMlp<R>>,
    /// The experts' gated activation.
    pub activation: Activation,
    /// Latent MoE: the experts read and write this narrower width.
    pub latent: Option<DevLatent<R>>,
}

// One per layer, built once: boxing the larger variant would save nothing that matters.
#[allow(clippy::large_enum_variant)]
pub(super) enum DevFfn<R: Runtime> {
    Dense(DevMlp<R>),
    Moe(DevMoe<R>),
}

impl<R: Runtime> ExpertStack<R> {
    fn upload(
        gpu: &Kernels<R>,
        name: &str,
        list: &[&crate::model::layers::linear::Linear],
        dense: DenseWeights,
    ) -> Result<Self, ForwardError> {
        Ok(Self(DevLinear::upload_rows(gpu, name, list, dense)?))
    }

    pub fn expert_weight(&self) -> ExpertWeight<'_, R> {
        match &self.0 {
            DevLinear::Bf16 { w, rows, cols } => ExpertWeight::Bf16 { w, rows: *rows, cols: *cols },
            DevLinear::F32 { w, rows, cols } => ExpertWeight::F32 { w, rows: *rows, cols: *cols },
            packed => ExpertWeight::Quant(packed.quant().expect("a packed weight")),
        }
    }

    /// Whether crowded experts of a prefill can take the bf16 GEMM (`Kernels::moe_plan`): packed
    /// (dequantised first) and bf16 experts; f32 ones (`--dtype float32`, exact checks) keep the
    /// GEMV and its f32 activations.
    fn takes_gemm(&self) -> bool {
        !matches!(self.0, DevLinear::F32 { .. })
    }
}

impl<R: Runtime> DevMoe<R> {
    /// The width the routed experts read and write: the latent width for latent MoE.
    pub fn expert_width(&self) -> usize {
        self.latent.as_ref().map_or(self.hidden, |l| l.width)
    }

    /// Whether crowded experts take the GEMM path: both projections able to.
    pub fn gemm_path(&self) -> bool {
        self.gate_up.takes_gemm() && self.down.takes_gemm()
    }

    /// `(dequantised elements, widest input)` of one expert on the GEMM path (0 when none), for
    /// the rank's scratch.
    fn expert_scratch(&self) -> (usize, usize) {
        if !self.gemm_path() {
            return (0, 0);
        }
        // gate_up (2·inter × hidden) is the larger expert; bf16 experts multiply in place.
        let packed = self.gate_up.0.quant().is_some() || self.down.0.quant().is_some();
        let width = self.expert_width();
        (if packed { 2 * self.inter * width } else { 0 }, self.inter.max(width))
    }
}

impl<R: Runtime> DevMlp<R> {
    fn upload(gpu: &Kernels<R>, name: &str, m: &GatedMlp, dense: DenseWeights) -> Result<Self, ForwardError> {
        Ok(Self {
            gate_up: DevLinear::upload_rows(gpu, &format!("{name}.gate_proj+up_proj"), &[&m.gate, &m.up], dense)?,
            down: DevLinear::upload_as(gpu, &format!("{name}.down_proj"), &m.down, dense)?,
            inter: m.gate.out_features(),
            activation: m.activation,
        })
    }

    /// `out[n, hidden] = down(act(gate x, up x))`.
    pub fn forward(
        &self,
        gpu: &Kernels<R>,
        x: &R::Buf<f32>,
        n: usize,
        scratch: &mut GemmScratch<R>,
        out: &mut R::Buf<f32>,
    ) -> Result<(), ForwardError> {
        let mut gate_up = gpu.zeros::<f32>(n * 2 * self.inter)?;
        self.gate_up.forward(gpu, x, scratch, &mut gate_up, n)?;
        let mut act = gpu.zeros::<f32>(n * self.inter)?;
        gated_activation(gpu, self.activation, &gate_up, &mut act, n, self.inter)?;
        self.down.forward(gpu, &act, scratch, out, n)
    }

    fn linears(&self) -> [&DevLinear<R>; 2] {
        [&self.gate_up, &self.down]
    }
}

impl<R: Runtime> DevMoe<R> {
    fn upload(gpu: &Kernels<R>, name: &str, moe: &MoeLayer, dense: DenseWeights) -> Result<Self, ForwardError> {
        let experts = &moe.experts;
        let held = experts.held();
        let list: Vec<&GatedMlp> = held.clone().map(|e| experts.get(e)).collect();
        let activation = list.first().map_or(Activation::Silu, |m| m.activation);
        if list.iter().any(|m| m.activation != activation) {
            return Err(invalid(format!("{name}: experts with different activations")));
        }
        let latent = match &moe.latent {
            None => None,
            Some(l) => Some(DevLatent {
                down: DevLinear::upload_as(gpu, &format!("{name}.routed_expert_down_proj"), &l.down, dense)?,
                norm: l.norm.as_ref().map(|w| gpu.upload(w)).transpose()?,
                up: DevLinear::upload_as(gpu, &format!("{name}.routed_expert_up_proj"), &l.up, dense)?,
                width: l.down.out_features(),
                eps: l.eps,
            }),
        };
        let inter = list.first().map_or(0, |m| m.gate.out_features());
        let gate_up: Vec<_> = list.iter().flat_map(|m| [&m.gate, &m.up]).collect();
        let down: Vec<_> = list.iter().map(|m| &m.down).collect();
        let weight = &moe.router.weight;
        Ok(Self {
            router: gpu.upload(weight.as_slice())?,
            bias: moe.router.bias.as_ref().map(|b| gpu.upload(b)).transpose()?,
            spec: moe.router.spec,
            hidden: moe.hidden_size(),
            inter,
            gate_up: ExpertStack::upload(gpu, &format!("{name}.experts[{held:?}].gate_proj+up_proj"), &gate_up, dense)?,
            down: ExpertStack::upload(gpu, &format!("{name}.experts[{held:?}].down_proj"), &down, dense)?,
            shared: moe
                .shared
                .as_ref()
                .map(|s| DevMlp::upload(gpu, &format!("{name}.shared_experts"), s, dense))
                .transpose()?,
            held,
            activation,
            latent,
        })
    }
}

impl<R: Runtime> DevMla<R> {
    fn upload(gpu: &Kernels<R>, name: &str, l: &MlaLayer, dense: DenseWeights) -> Result<Self, ForwardError> {
        let lin = |leaf: &str, w: &crate::model::layers::linear::Linear| {
            DevLinear::upload_as(gpu, &format!("{name}.{leaf}"), w, dense)
        };
        let cfg = &l.cfg;
        let (h, nope, rope, v, lora) =
            (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank);
        let q = match &l.q {
            QPath::Plain(p) => DevQ::Plain(lin("q_proj", p)?),
            QPath::LowRank { a, norm, b } => {
                DevQ::LowRank { a: lin("q_a_proj", a)?, norm: gpu.upload(norm.as_slice())?, b: lin("q_b_proj", b)? }
            }
        };
        // W_uk is [heads][nope][lora]; the device wants each head's transpose [lora][nope].
        let uk = &l.absorbed.w_uk;
        let mut uk_t = vec![0.0f32; uk.len()];
        for hh in 0..h {
            let (src, dst) =
                (&uk[hh * nope * lora..(hh + 1) * nope * lora], &mut uk_t[hh * nope * lora..(hh + 1) * nope * lora]);
            for i in 0..nope {
                for c in 0..lora {
                    dst[c * nope + i] = src[i * lora + c];
                }
            }
        }
        let rotary = l
            .rotary
            .as_ref()
            .map(|r| {
                Ok::<_, ForwardError>(DevRotary {
                    inv_freq: gpu.upload(r.rope.inv_freq())?,
                    interleave: r.interleave,
                    attention_factor: r.attention_factor,
                })
            })
            .transpose()?;
        Ok(Self {
            q,
            kv_a: lin("kv_a_proj_with_mqa", &l.kv_a)?,
            kv_a_norm: gpu.upload(l.kv_a_norm.as_slice())?,
            w_uk_t: HeadWeights::upload(gpu, &uk_t, dense)?,
            w_uv: HeadWeights::upload(gpu, &l.absorbed.w_uv, dense)?,
            gate: l.gate.as_ref().map(|g| lin("g_proj", g)).transpose()?,
            o: lin("o_proj", &l.o)?,
            rotary,
            heads: h,
            nope,
            rope,
            v,
            lora,
            scale: l.scale,
            eps: cfg.lora_norm_eps,
        })
    }

    fn linears(&self) -> Vec<&DevLinear<R>> {
        let mut all = match &self.q {
            DevQ::Plain(p) => vec![p],
            DevQ::LowRank { a, b, .. } => vec![a, b],
        };
        all.extend([&self.kv_a, &self.o]);
        all.extend(self.gate.as_ref());
        all
    }
}

/// The embedding table and the output weight (`DevLinear::output_head`).
fn output_weights<R: Runtime>(
    gpu: &Kernels<R>,
    embed: &Tensor,
    lm_head: Option<&Linear>,
    dense: DenseWeights,
) -> Result<(Embedding<R>, Option<DevLinear<R>>), ForwardError> {
    Ok((Embedding::upload(gpu, embed.as_slice(), dense)?, DevLinear::output_head(gpu, embed, lm_head, dense)?))
}

/// What an architecture's upload hands to [`DecoderRank::assemble`].
struct Uploaded<R: Runtime> {
    layers: Vec<DevLayer<R>>,
    embed: Embedding<R>,
    lm_head: Option<DevLinear<R>>,
    norm: R::Buf<f32>,
    /// (rank, split heads) of an expert-parallel rank; (0, false) for a whole model.
    rank: (usize, bool),
    latent: (usize, usize),
    kda: Option<(usize, usize, usize, usize)>,
    attn_res: Option<DevAttnRes<R>>,
}

fn ffn<R: Runtime>(gpu: &Kernels<R>, name: &str, block: &Ffn, dense: DenseWeights) -> Result<DevFfn<R>, ForwardError> {
    match block.parts() {
        (_, Some(m)) => Ok(DevFfn::Moe(DevMoe::upload(gpu, name, m, dense)?)),
        (Some(mlp), None) => Ok(DevFfn::Dense(DevMlp::upload(gpu, name, mlp, dense)?)),
        (None, None) => Err(invalid(format!("{name}: no feed-forward block"))),
    }
}

impl<R: Runtime> DecoderRank<R> {
    /// Uploads one DeepSeek-V3 rank's weights (all of them for a single device), dense
    /// projections as `dense` says.
    pub(super) fn upload(m: &DeepseekV3Model, gpu: Kernels<R>, dense: DenseWeights) -> Result<Self, ForwardError> {
        let mut layers = Vec::with_capacity(m.layers.len());
        for (i, l) in m.layers.iter().enumerate() {
            let name = format!("model.layers.{i}");
            layers.push(DevLayer {
                attn_norm: gpu.upload(l.attn_norm.as_slice())?,
                mixer: DevMixer::Mla {
                    attn: DevMla::upload(&gpu, &format!("{name}.self_attn"), &l.attn, dense)?,
                    latent: i,
                },
                ffn_norm: gpu.upload(l.ffn_norm.as_slice())?,
                ffn: ffn(&gpu, &format!("{name}.mlp"), &l.ffn, dense)?,
            });
            tracing::debug!(layer = i, of = m.layers.len(), "DeepSeek layer uploaded to the device");
        }
        let (embed, lm_head) = output_weights(&gpu, &m.embed, m.lm_head.as_ref(), dense)?;
        let latent = m.layers.first().map_or((0, 0), |l| (l.attn.cfg.kv_lora_rank, l.attn.cfg.qk_rope_head_dim));
        tracing::info!(device = %gpu.describe(), ep_rank = m.ep.rank, ep_size = m.ep.size, split_heads = m.split_heads, layers = layers.len(), "DeepSeek-V3 weights uploaded to the device");
        let norm = gpu.upload(m.norm.as_slice())?;
        Self::assemble(
            gpu,
            m.cfg.hidden_size,
            Uploaded {
                layers,
                embed,
                lm_head,
                norm,
                rank: (m.ep.rank, m.split_heads),
                latent,
                kda: None,
                attn_res: None,
            },
        )
    }

    /// Uploads a Kimi-Linear model (or one expert-parallel rank of it): KDA layers with their recurrent kernels, NoPE MLA
    /// layers over the latent pool (their own latent layer numbering), dense and MoE FFNs.
    pub(super) fn upload_kimi(m: &KimiLinearModel, gpu: Kernels<R>, dense: DenseWeights) -> Result<Self, ForwardError> {
        let mut layers = Vec::with_capacity(m.layers.len());
        let mut latent = (0, 0);
        let mut latent_layers = 0;
        for (i, l) in m.layers.iter().enumerate() {
            let name = format!("model.layers.{i}");
            let mixer = match &l.mixer {
                Mixer::Kda { layer, ordinal } => {
                    if layer.cfg.head_dim > kernels::gpu::kda::KDA_MAX_HEAD_DIM {
                        return Err(invalid(format!(
                            "{name}: KDA head_dim {} above the device kernels' {}",
                            layer.cfg.head_dim,
                            kernels::gpu::kda::KDA_MAX_HEAD_DIM
                        )));
                    }
                    DevMixer::Kda(DevKda::upload(&gpu, &format!("{name}.self_attn"), layer, *ordinal, dense)?)
                }
                Mixer::Latent(attn) => {
                    latent = (attn.cfg.kv_lora_rank, attn.cfg.qk_rope_head_dim);
                    latent_layers += 1;
                    DevMixer::Mla {
                        attn: DevMla::upload(&gpu, &format!("{name}.self_attn"), attn, dense)?,
                        latent: latent_layers - 1,
                    }
                }
            };
            let module = if l.ffn.is_moe() { "block_sparse_moe" } else { "mlp" };
            layers.push(DevLayer {
                attn_norm: gpu.upload(l.attn_norm.as_slice())?,
                mixer,
                ffn_norm: gpu.upload(l.ffn_norm.as_slice())?,
                ffn: ffn(&gpu, &format!("{name}.{module}"), &l.ffn, dense)?,
            });
        }
        let kda = m.kda.first().map(|c| (m.kda.len(), c.num_heads, c.head_dim, c.conv_kernel));
        if m.kda.iter().any(|c| Some((m.kda.len(), c.num_heads, c.head_dim, c.conv_kernel)) != kda) {
            return Err(invalid("KDA layers of different shapes: the device state pool holds one shape".into()));
        }
        let (embed, lm_head) = output_weights(&gpu, &m.embed, Some(&m.lm_head), dense)?;
        tracing::info!(device = %gpu.describe(), ep_rank = m.ep.rank, ep_size = m.ep.size, split_heads = m.split_heads, layers = layers.len(), kda_layers = m.kda.len(), latent_layers, "Kimi-Linear weights uploaded to the device");
        let norm = gpu.upload(m.norm.as_slice())?;
        let attn_res = match &m.attn_res {
            None => None,
            Some(r) => Some(DevAttnRes {
                block_size: r.block_size,
                layers: r
                    .layers
                    .iter()
                    .map(|l| Ok((gpu.upload(&l.attention.score_weight)?, gpu.upload(&l.mlp.score_weight)?)))
                    .collect::<Result<Vec<_>, ForwardError>>()?,
                output: gpu.upload(&r.output.score_weight)?,
                slots: m.layers.len().div_ceil(r.block_size) + 1,
            }),
        };
        Self::assemble(
            gpu,
            m.cfg.hidden_size,
            Uploaded { layers, embed, lm_head, norm, rank: (m.ep.rank, m.split_heads), latent, kda, attn_res },
        )
    }

    /// The scratch sized for every dense projection a step may run and every routed expert on the
    /// prefill GEMM path (the dequantisation buffer for the largest packed weight or expert, the
    /// bf16 activations for the widest input), and the rank.
    fn assemble(gpu: Kernels<R>, hidden: usize, u: Uploaded<R>) -> Result<Self, ForwardError> {
        gpu.synchronize()?;
        let dense: Vec<&DevLinear<R>> = u
            .layers
            .iter()
            .flat_map(|l| {
                let mut v = match &l.mixer {
                    DevMixer::Mla { attn, .. } => attn.linears(),
                    DevMixer::Kda(attn) => attn.linears(),
                };
                match &l.ffn {
                    DevFfn::Dense(mlp) => v.extend(mlp.linears()),
                    DevFfn::Moe(moe) => {
                        v.extend(moe.shared.iter().flat_map(DevMlp::linears));
                        v.extend(moe.latent.iter().flat_map(|l| [&l.down, &l.up]));
                    }
                }
                v
            })
            .chain(u.lm_head.as_ref())
            .collect();
        // Routed experts on the prefill GEMM path dequantise one expert at a time.
        let experts = u.layers.iter().filter_map(|l| match &l.ffn {
            DevFfn::Moe(moe) => Some(moe.expert_scratch()),
            DevFfn::Dense(_) => None,
        });
        let (expert_largest, expert_in) = experts.fold((0, 0), |(a, b), (c, d)| (a.max(c), b.max(d)));
        let largest = dense.iter().map(|l| l.dequant_elements()).chain([expert_largest]).max().unwrap_or(0);
        let max_in = dense.iter().map(|l| l.shape().1).chain([hidden, expert_in]).max().unwrap_or(hidden);
        let scratch = gpu.gemm_scratch(largest, 1)?;
        let latent_layers = u.layers.iter().filter(|l| matches!(l.mixer, DevMixer::Mla { .. })).count();
        Ok(DecoderRank {
            gpu,
            rank: u.rank.0,
            split_heads: u.rank.1,
            embed: u.embed,
            layers: u.layers,
            norm: u.norm,
            lm_head: u.lm_head,
            pool: None,
            scratch,
            max_in,
            latent: u.latent,
            latent_layers,
            kda: u.kda,
            recurrent: None,
            attn_res: u.attn_res,
        })
    }
}
