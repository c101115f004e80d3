//! The DeepSeek-V3 and Kimi-Linear forwards on a device ([`Runtime`]: CUDA, or the simulator in
//! tests): MLA attention in the absorbed form over a compressed latent paged cache (Kimi's NoPE
//! variant too), Kimi Delta Attention layers with per-sequence recurrent state in a device slot
//! pool (`kda`), dense SwiGLU layers, and MoE layers routed, grouped and run on the device
//! (router, top-k, grouping into per-expert tiles, expert GEMVs in the checkpoint's own format,
//! weighted combine, shared experts).
//!
//! Multi-device: built from the ranks of `arch::deepseek_v3::parallel::ExpertParallelDeepseek`, one device per rank.
//! Every rank holds the non-expert weights and its contiguous range of each MoE layer's routed
//! experts; it runs the whole batch, adds the weighted outputs of only the experts it holds (the
//! shared experts on rank 0), and an all-reduce ([`DeviceCollective`], NCCL on CUDA) sums the
//! ranks' partial MoE outputs (Kimi-Linear the same: `arch::kimi_linear::parallel::ExpertParallelKimiLinear`, each
//! device advancing its own KDA state slots). Ranks loaded with the attention heads split too
//! (`--tensor-parallel-size`) also all-reduce their partial `o_proj` outputs. Only rank 0 computes
//! logits (the others would compute the same).
//!
//! Numerics follow `DeviceLlama`: dense weights bf16 (exact for bf16 checkpoints), activations
//! rounded to bf16 entering dense GEMMs, the absorbed `kv_b_proj` halves in bf16; norms, RoPE,
//! attention, routing (f32 router weights) and residuals in f32. Tested against
//! `DeepseekV3Model::forward` and transformers.

mod kda;
#[cfg(test)]
mod tests;
mod upload;

use kernels::gpu::kernels::GemmScratch;
use kernels::gpu::kv_pool::KvStorage;
use kernels::gpu::latent_pool::DeviceLatentPool;
use kernels::gpu::mla::mla_flash_rows_per_tile;
use kernels::gpu::recurrent_pool::DeviceRecurrentPool;
use kernels::gpu::{Kernels, Runtime};

use crate::model::arch::deepseek_v3::DeepseekV3Model;
use crate::model::arch::kimi_linear::KimiLinearModel;
use crate::model::config::ModelConfig;
use crate::model::device::attention_split::AttentionSplit;
use crate::model::device::model::{check_ranks, DeviceModel, DeviceRank, Logits};
use crate::model::device::step::StepInputs;
use crate::model::device::weights::DenseWeights;
use crate::model::kv::{BlockCopy, CacheLayout, LayerKvShape, SlotOp};
use crate::model::ForwardError;
use crate::parallel::device_collective::{DeviceCollective, DeviceGroup, SoleRank};
use kda::SeqRows;
use upload::{DevFfn, DevLayer, DevMixer, DevMla, DevMoe, DevQ, Embedding};

fn invalid(msg: String) -> ForwardError {
    ForwardError::Invalid(msg)
}

/// Everything one device holds of a DeepSeek-V3 or Kimi-Linear decoder (one expert-parallel
/// rank, or the whole model).
pub struct DecoderRank<R: Runtime> {
    gpu: Kernels<R>,
    rank: usize,
    /// The MLA heads are split over the ranks: `o_proj` outputs are partial sums.
    split_heads: bool,
    /// `[vocab, hidden]`: the embedding gather's table and, when tied in bf16, the output weight.
    embed: Embedding<R>,
    layers: Vec<DevLayer<R>>,
    norm: R::Buf<f32>,
    lm_head: Option<crate::model::device::weights::DevLinear<R>>,
    pool: Option<DeviceLatentPool<R>>,
    /// Dequantisation buffer for the prefill GEMM path (sized once for the largest packed dense
    /// weight) and the bf16 activations (sized per step).
    scratch: GemmScratch<R>,
    /// The widest input any dense projection takes (sizes `scratch.x`).
    max_in: usize,
    /// (kv_lora_rank, qk_rope_head_dim): what each MLA layer caches per token, and how many
    /// MLA layers there are (every layer for DeepSeek, Kimi's full-attention layers).
    latent: (usize, usize),
    latent_layers: usize,
    /// Kimi's KDA layers: their shape (layers, heads, head_dim, conv kernel), and the slot pool of
    /// their states once the engine allocated it.
    kda: Option<(usize, usize, usize, usize)>,
    recurrent: Option<DeviceRecurrentPool<R>>,
    /// Kimi K3's Block Attention Residuals in place of the residual add.
    attn_res: Option<upload::DevAttnRes<R>>,
}

/// The two halves of a decoder layer.
#[derive(Clone, Copy)]
enum Part {
    Mixer,
    Ffn,
}

/// A DeepSeek-V3 on one device, or its expert-parallel ranks on one device each; rank 0
/// returns the logits.
pub type DeviceDeepseek<R> = DeviceModel<DecoderRank<R>>;

impl<R: Runtime> DeviceModel<DecoderRank<R>> {
    /// Uploads rank `r` (`ranks[r]`, from `ExpertParallelDeepseek`) to `gpus[r]`; the ranks sum
    /// their partial outputs through `group`. Dense weights in bf16 (serving).
    pub fn from_ranks(
        ranks: &[DeepseekV3Model],
        gpus: Vec<Kernels<R>>,
        group: Box<dyn DeviceGroup<R>>,
    ) -> Result<Self, ForwardError> {
        Self::from_ranks_with(ranks, gpus, group, DenseWeights::Bf16)
    }

    /// As [`Self::from_ranks`] with dense weights held as `dense` says.
    pub fn from_ranks_with(
        ranks: &[DeepseekV3Model],
        gpus: Vec<Kernels<R>>,
        group: Box<dyn DeviceGroup<R>>,
        dense: DenseWeights,
    ) -> Result<Self, ForwardError> {
        let positions: Vec<(usize, usize)> = ranks.iter().map(|m| (m.ep.rank, m.ep.size)).collect();
        check_ranks("expert-parallel", &positions, gpus.len())?;
        let size = ranks.len();
        let first = ranks[0].layers.first().ok_or_else(|| invalid("a DeepSeek model without layers".into()))?;
        // One latent layer per (layer, rank): each device keeps its own copy of the latent rows,
        // as the CPU expert-parallel model does, and the engine sizes its block budget from it.
        let shape = LayerKvShape {
            key_width: first.attn.cfg.kv_lora_rank,
            value_width: first.attn.cfg.qk_rope_head_dim,
            groups: 1,
        };
        let cfg = ranks[0].cfg.clone();
        let layout = CacheLayout::uniform(cfg.num_layers() * size, shape);
        let states =
            ranks.iter().zip(gpus).map(|(m, gpu)| DecoderRank::upload(m, gpu, dense)).collect::<Result<Vec<_>, _>>()?;
        DeviceModel::new("DeviceDeepseek", cfg, states, group, layout, Logits::FirstRank)
    }
}

/// A Kimi-Linear on one device (KDA states in the device slot pool, the engine lending slot ids),
/// or its expert- or tensor-parallel ranks on one device each.
pub type DeviceKimiLinear<R> = DeviceModel<DecoderRank<R>>;

impl<R: Runtime> DeviceModel<DecoderRank<R>> {
    /// Uploads a whole Kimi-Linear model to `gpu`; its cache layout is the CPU model's (latent
    /// rows for the MLA layers, nothing per token for KDA layers, recurrent bytes per sequence).
    pub fn from_kimi_linear(m: &KimiLinearModel, gpu: Kernels<R>, dense: DenseWeights) -> Result<Self, ForwardError> {
        Self::from_kimi_ranks(std::slice::from_ref(m), vec![gpu], Box::new(SoleRank), dense)
    }

    /// Uploads rank `r` (`ranks[r]`, from `ExpertParallelKimiLinear`) to `gpus[r]`: each device
    /// holds the mixers (whole, or its share of the heads when they are split), its own latent
    /// pool and KDA state slots (of its heads), and its experts; the ranks sum their partial MoE
    /// (and split mixer) outputs through `group`. The engine sizes its budgets from the CPU
    /// group's layout (every rank's part counted, as for DeepSeek).
    pub fn from_kimi_ranks(
        ranks: &[KimiLinearModel],
        gpus: Vec<Kernels<R>>,
        group: Box<dyn DeviceGroup<R>>,
        dense: DenseWeights,
    ) -> Result<Self, ForwardError> {
        let positions: Vec<(usize, usize)> = ranks.iter().map(|m| (m.ep.rank, m.ep.size)).collect();
        check_ranks("expert-parallel", &positions, gpus.len())?;
        let layout = ranks[0].ep_cache_layout();
        let states = ranks
            .iter()
            .zip(gpus)
            .map(|(m, gpu)| DecoderRank::upload_kimi(m, gpu, dense))
            .collect::<Result<Vec<_>, _>>()?;
        DeviceModel::new("DeviceKimiLinear", ranks[0].cfg.clone(), states, group, layout, Logits::FirstRank)
    }
}

impl<R: Runtime> DeviceRank for DecoderRank<R> {
    type Rt = R;

    fn describe(&self) -> String {
        self.gpu.describe()
    }

    fn pool(&self) -> Option<(usize, usize, KvStorage)> {
        self.pool.as_ref().map(|p| (p.num_blocks, p.block_size, p.storage))
    }

    /// The full latent rows of every MLA layer (attention is replicated or head-split, and every
    /// head reads the same latent).
    fn allocate(
        &mut self,
        _cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
        storage: KvStorage,
    ) -> Result<(), ForwardError> {
        let pool = DeviceLatentPool::new(
            &self.gpu,
            self.latent_layers,
            num_blocks,
            block_size,
            self.latent.0,
            self.latent.1,
            storage,
        )?;
        self.gpu.synchronize()?;
        self.pool = Some(pool);
        Ok(())
    }

    fn recurrent_slots(&self) -> Option<usize> {
        self.recurrent.as_ref().map(|p| p.slots)
    }

    /// The KDA layers' states (`slots` of them, zeroed); nothing for a model without KDA layers.
    fn allocate_recurrent(&mut self, slots: usize) -> Result<(), ForwardError> {
        if let Some((layers, heads, head_dim, kernel)) = self.kda {
            let pool = DeviceRecurrentPool::new(&self.gpu, layers, slots, heads, head_dim, kernel)?;
            self.gpu.synchronize()?;
            self.recurrent = Some(pool);
        }
        Ok(())
    }

    /// This rank's part of one step. Returns the logits on rank 0 and nothing on the others.
    /// `inp` and `copies` were checked against the pool by `step::checked_step`, so an error
    /// here is this device's failure, never ranks disagreeing about the batch.
    fn forward(
        &mut self,
        cfg: &ModelConfig,
        copies: &[BlockCopy],
        inp: &StepInputs,
        comm: &dyn DeviceCollective<R>,
    ) -> Result<Vec<f32>, ForwardError> {
        let parallel = comm.world_size() > 1;
        let Self {
            gpu,
            rank,
            split_heads,
            embed,
            layers,
            norm,
            lm_head,
            pool,
            scratch,
            max_in,
            recurrent,
            attn_res,
            ..
        } = self;
        let pool =
            pool.as_mut().ok_or_else(|| invalid("the device KV pool is not allocated (DeviceKv::allocate)".into()))?;
        for c in copies {
            pool.copy_block(gpu, c.src as usize, c.dst as usize, c.slots)?;
        }
        // Recurrent-state slots lent to new sequences start empty; forked choices copy their parent.
        let seqs = match (recurrent.as_mut(), &inp.recurrent) {
            (Some(states), Some(grouped)) => {
                for op in &inp.slot_ops {
                    match *op {
                        SlotOp::Reset(s) => states.reset(gpu, s)?,
                        SlotOp::Fork { from, to } => states.fork(gpu, from, to)?,
                    }
                }
                Some(SeqRows {
                    rows: gpu.upload(&grouped.rows)?,
                    start: gpu.upload(&grouped.start)?,
                    slot: gpu.upload(&grouped.slot)?,
                    seqs: grouped.seqs(),
                })
            }
            _ => None,
        };
        let n = inp.ids.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let (d, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let step = Step {
            n,
            positions: gpu.upload(&inp.positions)?,
            slots: gpu.upload(&inp.slots)?,
            tables: gpu.upload(&inp.tables)?,
            lens: gpu.upload(&inp.lens)?,
            max_blocks: inp.max_blocks,
            prefill: mla_prefill_split(gpu, pool, layers, inp)?,
        };
        let ids = gpu.upload(&inp.ids)?;
        let mut hidden = gpu.zeros::<f32>(n * d)?;
        let mut normed = gpu.zeros::<f32>(n * d)?;
        let mut delta = gpu.zeros::<f32>(n * d)?;
        scratch.x = gpu.zeros::<u16>(n * *max_in)?;

        embed.gather(gpu, &ids, &mut hidden, n, d)?;
        if layers.is_empty() {
            return Err(invalid("a model without layers".into()));
        }
        // One sub-layer into `delta`: the token mixer (summed over the ranks when its heads are
        // split) or the FFN (an MoE block summed over the expert-parallel ranks).
        let mut sublayer = |part: Part, l: &DevLayer<R>, normed: &R::Buf<f32>, delta: &mut R::Buf<f32>| {
            match part {
                Part::Mixer => {
                    match &l.mixer {
                        DevMixer::Mla { attn, latent } => {
                            attn.forward(gpu, pool, *latent, normed, &step, scratch, delta)?
                        }
                        DevMixer::Kda(attn) => {
                            let (Some(states), Some(seqs)) = (recurrent.as_mut(), seqs.as_ref()) else {
                                return Err(invalid(
                                    "the device recurrent state is not allocated (DeviceKv::allocate_recurrent)".into(),
                                ));
                            };
                            attn.forward(gpu, states, normed, n, seqs, scratch, delta)?;
                        }
                    }
                    if *split_heads && parallel {
                        comm.all_reduce_sum(gpu, delta, n * d)?;
                    }
                }
                Part::Ffn => match &l.ffn {
                    DevFfn::Dense(mlp) => mlp.forward(gpu, normed, n, scratch, delta)?,
                    DevFfn::Moe(moe) => {
                        moe.forward(gpu, *rank, normed, n, scratch, delta, comm)?;
                        if parallel {
                            comm.all_reduce_sum(gpu, delta, n * d)?;
                        }
                    }
                },
            }
            Ok::<(), ForwardError>(())
        };
        // What enters the final norm: the residual stream and the last FFN output still to add
        // to it, or (Attention Residuals) the final mix itself.
        let (stream_out, last_delta) = match attn_res.as_ref() {
            None => {
                gpu.rms_norm(&hidden, &layers[0].attn_norm, &mut normed, n, eps)?;
                let last = layers.len() - 1;
                for (li, l) in layers.iter().enumerate() {
                    sublayer(Part::Mixer, l, &normed, &mut delta)?;
                    gpu.add_rms_norm(&mut hidden, &delta, &l.ffn_norm, &mut normed, n, eps)?;
                    sublayer(Part::Ffn, l, &normed, &mut delta)?;
                    if li < last {
                        gpu.add_rms_norm(&mut hidden, &delta, &layers[li + 1].attn_norm, &mut normed, n, eps)?;
                    }
                }
                (hidden, Some(delta))
            }
            Some(res) => {
                // The stream's slots: the snapshots taken so far, then the partial sum (slot
                // `stored`). A block's first layer turns the partial into a snapshot and starts
                // the next (zeroed) slot with its own output.
                let slot = n * d;
                let mut stream = gpu.zeros::<f32>(res.slots * slot)?;
                gpu.add_f32(&mut stream, 0, &hidden, slot)?;
                let mut stored = 0;
                let mut mixed = gpu.zeros::<f32>(slot)?;
                for (li, (l, (attn_w, mlp_w))) in layers.iter().zip(&res.layers).enumerate() {
                    gpu.attn_res_mix(&stream, stored, attn_w, &mut mixed, n, eps)?;
                    gpu.rms_norm(&mixed, &l.attn_norm, &mut normed, n, eps)?;
                    sublayer(Part::Mixer, l, &normed, &mut delta)?;
                    if li % res.block_size == 0 {
                        stored += 1;
                    }
                    gpu.add_f32(&mut stream, stored * slot, &delta, slot)?;
                    gpu.attn_res_mix(&stream, stored, mlp_w, &mut mixed, n, eps)?;
                    gpu.rms_norm(&mixed, &l.ffn_norm, &mut normed, n, eps)?;
                    sublayer(Part::Ffn, l, &normed, &mut delta)?;
                    gpu.add_f32(&mut stream, stored * slot, &delta, slot)?;
                }
                gpu.attn_res_mix(&stream, stored, &res.output, &mut mixed, n, eps)?;
                (mixed, None)
            }
        };
        let m = inp.logit_rows.len();
        if m == 0 || *rank != 0 {
            gpu.synchronize()?;
            return Ok(Vec::new());
        }
        // Only the rows that need logits take the last residual add, the final norm and the
        // vocabulary projection.
        let picked = gpu.upload(&inp.logit_rows)?;
        let (mut hm, mut ym) = (gpu.zeros::<f32>(m * d)?, gpu.zeros::<f32>(m * d)?);
        gpu.gather_rows_f32(&stream_out, &picked, &mut hm, m, d)?;
        match last_delta {
            Some(delta) => {
                let mut dm = gpu.zeros::<f32>(m * d)?;
                gpu.gather_rows_f32(&delta, &picked, &mut dm, m, d)?;
                gpu.add_rms_norm(&mut hm, &dm, norm, &mut ym, m, eps)?;
            }
            None => gpu.rms_norm(&hm, norm, &mut ym, m, eps)?,
        }
        let vocab = cfg.vocab_size;
        let mut logits = gpu.zeros::<f32>(m * vocab)?;
        match (lm_head, embed) {
            (Some(h), _) => h.forward(gpu, &ym, scratch, &mut logits, m)?,
            (None, Embedding::Bf16(table)) => {
                gpu.narrow_bf16(&ym, &mut scratch.x, m * d)?;
                gpu.gemm_bf16(&scratch.x, table, &mut logits, m, d, vocab)?;
            }
            (None, Embedding::F32(_)) => return Err(invalid("a tied f32 output weight is uploaded as lm_head".into())),
        }
        let mut out = gpu.download(&logits)?;
        out.truncate(m * vocab);
        Ok(out)
    }
}

/// One step's per-token device inputs, shared by every layer.
struct Step<R: Runtime> {
    n: usize,
    positions: R::Buf<i32>,
    slots: R::Buf<i32>,
    tables: R::Buf<i32>,
    lens: R::Buf<i32>,
    max_blocks: usize,
    /// Prompt chunks for the latent pool's tensor-core prefill kernel and the decode rows left
    /// to `mla_attention_*`; `None` when the pool has no prefill kernel (f32 rows, pre-sm_80) or
    /// the model no MLA layer: every row then takes the decode kernel.
    prefill: Option<AttentionSplit<R>>,
}

/// The step's [`AttentionSplit`] for the MLA layers, tiled for their head count (every MLA layer
/// of a rank has the same heads), when the latent pool can run the prefill kernel.
fn mla_prefill_split<R: Runtime>(
    gpu: &Kernels<R>,
    pool: &DeviceLatentPool<R>,
    layers: &[DevLayer<R>],
    inp: &StepInputs,
) -> Result<Option<AttentionSplit<R>>, ForwardError> {
    let heads = layers.iter().find_map(|l| match &l.mixer {
        DevMixer::Mla { attn, .. } => Some(attn.heads),
        DevMixer::Kda(_) => None,
    });
    match heads {
        Some(h) if pool.has_prefill_kernel(gpu) && !inp.prompt_runs.is_empty() => {
            Ok(Some(AttentionSplit::new(gpu, inp, mla_flash_rows_per_tile(h))?))
        }
        _ => Ok(None),
    }
}

impl<R: Runtime> DevMla<R> {
    /// `x` normed hidden states `[n, hidden]` in, this rank's `o_proj` output `[n, hidden]` out
    /// (a partial sum when the heads are split). Writes the step's latent rows into `pool`.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        gpu: &Kernels<R>,
        pool: &mut DeviceLatentPool<R>,
        layer: usize,
        x: &R::Buf<f32>,
        step: &Step<R>,
        scratch: &mut GemmScratch<R>,
        out: &mut R::Buf<f32>,
    ) -> Result<(), ForwardError> {
        let n = step.n;
        let (h, nope, rope, v, lora) = (self.heads, self.nope, self.rope, self.v, self.lora);
        let qk = nope + rope;
        let mut q = gpu.zeros::<f32>(n * h * qk)?;
        match &self.q {
            DevQ::Plain(p) => p.forward(gpu, x, scratch, &mut q, n)?,
            DevQ::LowRank { a, norm, b } => {
                let r = a.shape().0;
                let (mut qa, mut qn) = (gpu.zeros::<f32>(n * r)?, gpu.zeros::<f32>(n * r)?);
                a.forward(gpu, x, scratch, &mut qa, n)?;
                gpu.rms_norm(&qa, norm, &mut qn, n, self.eps)?;
                b.forward(gpu, &qn, scratch, &mut q, n)?;
            }
        }
        // The shared latent: [c_kv | k_rope] per token; c_kv normed into the cache's key row.
        let mut ckv = gpu.zeros::<f32>(n * (lora + rope))?;
        self.kv_a.forward(gpu, x, scratch, &mut ckv, n)?;
        let (mut raw, mut latent, mut k_rope) =
            (gpu.zeros::<f32>(n * lora)?, gpu.zeros::<f32>(n * lora)?, gpu.zeros::<f32>(n * rope)?);
        gpu.copy_cols(&ckv, &mut raw, n, lora + rope, 0, lora)?;
        gpu.rms_norm(&raw, &self.kv_a_norm, &mut latent, n, self.eps)?;
        let (mut q_nope, mut q_rope) = (gpu.zeros::<f32>(n * h * nope)?, gpu.zeros::<f32>(n * h * rope)?);
        gpu.copy_cols(&q, &mut q_nope, n * h, qk, 0, nope)?;
        if rope > 0 {
            gpu.copy_cols(&ckv, &mut k_rope, n, lora + rope, lora, rope)?;
            gpu.copy_cols(&q, &mut q_rope, n * h, qk, nope, rope)?;
            if let Some(r) = &self.rotary {
                gpu.rope_rows(&mut q_rope, &step.positions, &r.inv_freq, n, h, r.interleave, r.attention_factor)?;
                gpu.rope_rows(&mut k_rope, &step.positions, &r.inv_freq, n, 1, r.interleave, r.attention_factor)?;
            }
        }
        // Every row's latent first: a prefill row attends to the rows before it in this batch.
        pool.write_rows(gpu, layer, &latent, &k_rope, &step.slots, n)?;
        // Absorbed attention: the key up-projection folded into the query, the value
        // up-projection applied to the attention-weighted latent (docs/mla.md).
        let mut q_lat = gpu.zeros::<f32>(n * h * lora)?;
        self.w_uk_t.matvec(gpu, &q_nope, &mut q_lat, n, h, lora, nope)?;
        let mut ctx = gpu.zeros::<f32>(n * h * lora)?;
        match &step.prefill {
            // Decode rows by the decode kernel, prompt chunks on the tensor cores.
            Some(split) => {
                if split.decode_rows {
                    pool.attention(
                        gpu,
                        layer,
                        h,
                        step.max_blocks,
                        &q_lat,
                        &q_rope,
                        &step.tables,
                        split.decode_lens.as_ref().unwrap_or(&step.lens),
                        self.scale,
                        &mut ctx,
                    )?;
                }
                pool.prefill_attention(
                    gpu,
                    layer,
                    h,
                    step.max_blocks,
                    &q_lat,
                    &q_rope,
                    &step.tables,
                    &step.lens,
                    &split.tiles,
                    split.num_tiles,
                    self.scale,
                    &mut ctx,
                )?;
            }
            None => pool.attention(
                gpu,
                layer,
                h,
                step.max_blocks,
                &q_lat,
                &q_rope,
                &step.tables,
                &step.lens,
                self.scale,
                &mut ctx,
            )?,
        }
        let mut o = gpu.zeros::<f32>(n * h * v)?;
        self.w_uv.matvec(gpu, &ctx, &mut o, n, h, v, lora)?;
        if let Some(g) = &self.gate {
            let mut gv = gpu.zeros::<f32>(n * h * v)?;
            g.forward(gpu, x, scratch, &mut gv, n)?;
            gpu.sigmoid_mul(&mut o, &gv, n * h * v)?;
        }
        self.o.forward(gpu, &o, scratch, out, n)
    }
}

impl<R: Runtime> DevMoe<R> {
    /// The routed experts this rank holds (weighted) plus, on rank 0, the shared experts:
    /// `out[n, hidden]` is overwritten with this rank's partial sum. Latent MoE sums the ranks'
    /// expert outputs through `comm` first (its norm needs the whole sum), and rank 0 alone
    /// finishes it.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        gpu: &Kernels<R>,
        rank: usize,
        x: &R::Buf<f32>,
        n: usize,
        scratch: &mut GemmScratch<R>,
        out: &mut R::Buf<f32>,
        comm: &dyn DeviceCollective<R>,
    ) -> Result<(), ForwardError> {
        use kernels::gpu::moe::Routed;
        let (e, k, d, inter) = (self.spec.num_experts, self.spec.top_k, self.hidden, self.inter);
        let width = self.expert_width();
        let held = self.held.len();
        let a = n * k;
        let mut logits = gpu.zeros::<f32>(n * e)?;
        gpu.matmul_f32(x, &self.router, &mut logits, n, e, d)?;
        let mut routed = Routed { experts: gpu.zeros(a)?, weights: gpu.zeros(a)?, local: gpu.zeros(a)? };
        gpu.moe_route(&logits, self.bias.as_ref(), &self.spec, n, self.held.clone(), &mut routed)?;
        // Bucket `held` collects the assignments of experts other ranks hold.
        let (offsets, order) = gpu.moe_group(&routed.local, held + 1)?;
        // Decode: GEMV tiles for every expert. Prefill: experts with many tokens by dequantise +
        // bf16 GEMM (one read of their packed weights instead of one per 8 tokens).
        let plan = gpu.moe_plan(&offsets, held, a, n, self.gemm_path())?;
        if !plan.gemm.is_empty() {
            tracing::trace!(n, gemm_experts = plan.gemm.len(), "routed experts on the GEMM path");
        }
        let latent_in;
        let xe = match &self.latent {
            Some(l) => {
                let mut r = gpu.zeros::<f32>(n * width)?;
                l.down.forward(gpu, x, scratch, &mut r, n)?;
                latent_in = r;
                &latent_in
            }
            None => x,
        };
        let mut gate_up = gpu.zeros::<f32>(a * 2 * inter)?;
        gpu.moe_matmul(self.gate_up.expert_weight(), 2 * inter, xe, k, &order, &plan, &mut gate_up, a, scratch)?;
        let mut act = gpu.zeros::<f32>(a * inter)?;
        upload::gated_activation(gpu, self.activation, &gate_up, &mut act, a, inter)?;
        let mut y = gpu.zeros::<f32>(a * width)?;
        gpu.moe_matmul(self.down.expert_weight(), width, &act, 1, &order, &plan, &mut y, a, scratch)?;
        let Some(l) = &self.latent else {
            match (&self.shared, rank) {
                (Some(s), 0) => s.forward(gpu, x, n, scratch, out)?,
                _ => *out = gpu.zeros::<f32>(n * d)?,
            }
            gpu.moe_combine(&y, &routed.weights, &routed.local, held, n, k, d, out)?;
            return Ok(());
        };
        let mut sum = gpu.zeros::<f32>(n * width)?;
        gpu.moe_combine(&y, &routed.weights, &routed.local, held, n, k, width, &mut sum)?;
        if comm.world_size() > 1 {
            comm.all_reduce_sum(gpu, &mut sum, n * width)?;
        }
        if rank != 0 {
            *out = gpu.zeros::<f32>(n * d)?;
            return Ok(());
        }
        if let Some(w) = &l.norm {
            let mut normed = gpu.zeros::<f32>(n * width)?;
            gpu.rms_norm(&sum, w, &mut normed, n, l.eps)?;
            sum = normed;
        }
        l.up.forward(gpu, &sum, scratch, out, n)?;
        if let Some(s) = &self.shared {
            let mut shared = gpu.zeros::<f32>(n * d)?;
            s.forward(gpu, x, n, scratch, &mut shared)?;
            gpu.add_f32(out, 0, &shared, n * d)?;
        }
        Ok(())
    }
}
