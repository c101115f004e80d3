//! The Llama forward on a device ([`Runtime`]: the CUDA driver, or the CPU simulator in tests):
//! weights uploaded once at start-up, activations resident on the device for the whole pass,
//! K/V in a device paged pool addressed by the engine's own block tables (so prefix-cached
//! blocks work unchanged: both pools use the same block ids). Per step only token ids,
//! positions, slot mappings and block tables go up and only the logit rows come back.
//!
//! Built from a loaded [`LlamaModel`], or from the ranks of a tensor-parallel one
//! (`arch::llama::parallel::TensorParallel`): then each rank is its own device holding its shard (its heads, its
//! part of the MLP and of the vocabulary), the ranks run concurrently, one thread each, and meet
//! in a device all-reduce ([`DeviceCollective`]: NCCL on CUDA) after the embedding and after
//! every row-parallel projection, as the CPU `forward_rank` does. Each rank downloads its own
//! vocabulary columns of the logits and the host stitches them (no gather between devices).
//! Numerically it is the CPU model with dense weights in bf16 (see `weights`), so it is tested
//! against it and against transformers.

#[cfg(test)]
mod tests;

use std::ops::Range;

use kernels::gpu::kernels::GemmScratch;
use kernels::gpu::kv_pool::{DeviceKvPool, KvStorage};
use kernels::gpu::{Kernels, Runtime};

use crate::model::arch::llama::parallel::TensorParallel;
use crate::model::arch::llama::LlamaModel;
use crate::model::config::ModelConfig;
use crate::model::device::attention_split::AttentionSplit;
use crate::model::device::model::{check_ranks, DeviceModel, DeviceRank, Logits};
use crate::model::device::placement::DeviceForward;
use crate::model::device::step::StepInputs;
use crate::model::device::weights::{DenseWeights, DevLinear};
use crate::model::kv::{BlockCopy, CacheLayout, LayerKvShape};
use crate::model::{ForwardError, LanguageModel, LoadedModel};
use crate::parallel::device_collective::{DeviceCollective, DeviceGroup, SoleRank};

struct DevLayer<R: Runtime> {
    attn_norm: R::Buf<f32>,
    q: DevLinear<R>,
    k: DevLinear<R>,
    v: DevLinear<R>,
    o: DevLinear<R>,
    ffn_norm: R::Buf<f32>,
    /// gate and up stacked by rows: one GEMM produces the `[tokens, 2 · inter]` `silu_mul` reads.
    gate_up: DevLinear<R>,
    down: DevLinear<R>,
}

/// Which part of the model one device holds (all of it for a single device).
#[derive(Clone, Debug)]
struct Shard {
    heads: usize,
    kv_heads: usize,
    inter: usize,
    vocab: Range<usize>,
}

/// Everything that lives on one device (one tensor-parallel rank, or the whole model): launches
/// go to one stream in order.
pub struct LlamaRank<R: Runtime> {
    gpu: Kernels<R>,
    shard: Shard,
    /// bf16 `[vocab rows, hidden]`: the embedding gather's table and, when tied, the output
    /// weight. A tensor-parallel rank holds its vocabulary rows plus one zero row, which the
    /// tokens other ranks hold gather, so the all-reduced sum is every token's embedding.
    embed: R::Buf<u16>,
    layers: Vec<DevLayer<R>>,
    norm: R::Buf<f32>,
    lm_head: Option<DevLinear<R>>,
    inv_freq: R::Buf<f32>,
    pool: Option<DeviceKvPool<R>>,
    /// The GEMMs' scratch: `weight` is the prefill path's bf16 copy of one quantized weight, sized
    /// for the largest (one element for a dense model) and allocated once; `x`, the bf16
    /// activations, is sized per step.
    scratch: GemmScratch<R>,
}

/// A Llama on one device, or split over several (one tensor-parallel rank per device): each
/// rank returns its vocabulary columns of the logits, stitched on the host.
pub type DeviceLlama<R> = DeviceModel<LlamaRank<R>>;

fn invalid(msg: String) -> ForwardError {
    ForwardError::Invalid(msg)
}

impl<R: Runtime> DeviceModel<LlamaRank<R>> {
    /// Uploads a whole (single-device) Llama's weights to `gpu`.
    pub fn from_llama(m: &LlamaModel, gpu: Kernels<R>) -> Result<Self, ForwardError> {
        Self::from_ranks(std::slice::from_ref(m), vec![gpu], Box::new(SoleRank))
    }

    /// Uploads tensor-parallel rank `r`'s weights (`ranks[r]`, loaded with
    /// `LlamaModel::load_rank`) to `gpus[r]`; the ranks exchange partial sums through `group`.
    /// Dense weights in bf16 (serving).
    pub fn from_ranks(
        ranks: &[LlamaModel],
        gpus: Vec<Kernels<R>>,
        group: Box<dyn DeviceGroup<R>>,
    ) -> Result<Self, ForwardError> {
        Self::from_ranks_with(ranks, gpus, group, DenseWeights::Bf16)
    }

    /// As [`Self::from_ranks`] with dense weights held as `dense` says.
    pub fn from_ranks_with(
        ranks: &[LlamaModel],
        gpus: Vec<Kernels<R>>,
        group: Box<dyn DeviceGroup<R>>,
        dense: DenseWeights,
    ) -> Result<Self, ForwardError> {
        let positions: Vec<(usize, usize)> = ranks.iter().map(|m| (m.tp.rank, m.tp.size)).collect();
        check_ranks("tensor-parallel", &positions, gpus.len())?;
        let size = ranks.len();
        let states =
            ranks.iter().zip(gpus).map(|(m, gpu)| LlamaRank::upload(m, gpu, dense)).collect::<Result<Vec<_>, _>>()?;
        // One layer per (layer, rank) of the rank's KV width, as the CPU tensor-parallel model
        // has: the engine sizes its block budget from it, and each rank's pool holds its part.
        let cfg = ranks[0].cfg.clone();
        let layout =
            CacheLayout::uniform(cfg.num_layers() * size, LayerKvShape::heads(ranks[0].kv_heads, cfg.head_dim));
        DeviceModel::new("DeviceLlama", cfg, states, group, layout, Logits::VocabColumns)
    }
}

impl<R: Runtime> LlamaRank<R> {
    /// Uploads one rank's weights (all of them for a single device).
    fn upload(m: &LlamaModel, gpu: Kernels<R>, dense: DenseWeights) -> Result<Self, ForwardError> {
        let cfg = &m.cfg;
        let d = cfg.hidden_size;
        let up = |t: &crate::model::tensor::Tensor| gpu.upload(t.as_slice());
        let mut layers = Vec::with_capacity(m.layers.len());
        for (i, l) in m.layers.iter().enumerate() {
            let name = |w: &str| format!("model.layers.{i}.{w}");
            layers.push(DevLayer {
                attn_norm: up(&l.attn_norm)?,
                q: DevLinear::upload_as(&gpu, &name("self_attn.q_proj"), &l.q, dense)?,
                k: DevLinear::upload_as(&gpu, &name("self_attn.k_proj"), &l.k, dense)?,
                v: DevLinear::upload_as(&gpu, &name("self_attn.v_proj"), &l.v, dense)?,
                o: DevLinear::upload_as(&gpu, &name("self_attn.o_proj"), &l.o, dense)?,
                ffn_norm: up(&l.ffn_norm)?,
                gate_up: DevLinear::upload_rows(&gpu, &name("mlp.gate_proj+up_proj"), &[&l.gate, &l.up], dense)?,
                down: DevLinear::upload_as(&gpu, &name("mlp.down_proj"), &l.down, dense)?,
            });
        }
        debug_assert_eq!(m.embed.len(), m.vocab.len() * d);
        let mut table = kernels::cpu::gather::narrow_bf16(m.embed.as_slice());
        if m.tp.size > 1 {
            table.resize(table.len() + d, 0);
        }
        let embed = gpu.upload(&table)?;
        let lm_head = DevLinear::output_head(&gpu, &m.embed, m.lm_head.as_ref(), dense)?;
        let (norm, inv_freq) = (up(&m.norm)?, gpu.upload(m.rope.inv_freq())?);
        gpu.synchronize()?;
        let inter = m.layers.first().map_or(0, |l| l.gate.out_features());
        tracing::info!(device = %gpu.describe(), tp_rank = m.tp.rank, tp_size = m.tp.size, layers = layers.len(), tied = lm_head.is_none(), "Llama weights uploaded to the device");
        let largest = layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate_up, &l.down])
            .chain(lm_head.as_ref())
            .map(DevLinear::dequant_elements)
            .max()
            .unwrap_or(0);
        let scratch = gpu.gemm_scratch(largest, 1)?;
        let shard = Shard { heads: m.heads, kv_heads: m.kv_heads, inter, vocab: m.vocab.clone() };
        Ok(LlamaRank { gpu, shard, embed, layers, norm, lm_head, inv_freq, pool: None, scratch })
    }
}

impl<R: Runtime> DeviceRank for LlamaRank<R> {
    type Rt = R;

    fn describe(&self) -> String {
        self.gpu.describe()
    }

    fn pool(&self) -> Option<(usize, usize, KvStorage)> {
        self.pool.as_ref().map(|p| (p.num_blocks, p.block_size, p.storage))
    }

    /// This rank's KV heads of every layer.
    fn allocate(
        &mut self,
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
        storage: KvStorage,
    ) -> Result<(), ForwardError> {
        let pool = DeviceKvPool::new(
            &self.gpu,
            cfg.num_layers(),
            num_blocks,
            block_size,
            self.shard.kv_heads,
            cfg.head_dim,
            storage,
        )?;
        self.gpu.synchronize()?;
        self.pool = Some(pool);
        Ok(())
    }

    /// This device's part of one step: the whole forward on a single device; on a
    /// tensor-parallel rank its heads and MLP slice, with `comm` summing the partial results, and
    /// its vocabulary columns of the logits (`[logit rows, |vocab slice|]`).
    ///
    /// `inp` and `copies` were checked against the pool by `step::checked_step`, so on a
    /// tensor-parallel rank an error here is a device's failure, never one rank disagreeing
    /// with its peers about the batch.
    fn forward(
        &mut self,
        cfg: &ModelConfig,
        copies: &[BlockCopy],
        inp: &StepInputs,
        comm: &dyn DeviceCollective<R>,
    ) -> Result<Vec<f32>, ForwardError> {
        let Self { gpu, shard, embed, layers, norm, lm_head, inv_freq, pool, scratch } = self;
        let (heads, kv_heads) = (shard.heads, shard.kv_heads);
        let pool =
            pool.as_mut().ok_or_else(|| invalid("the device KV pool is not allocated (DeviceKv::allocate)".into()))?;
        for c in copies {
            pool.copy_block(gpu, c.src as usize, c.dst as usize, c.slots)?;
        }
        let n = inp.ids.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let (d, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps);
        let (qw, kw, inter) = (heads * hd, kv_heads * hd, shard.inter);
        let (ids, positions, slots) =
            (gpu.upload(&shard.embedding_rows(&inp.ids))?, gpu.upload(&inp.positions)?, gpu.upload(&inp.slots)?);
        let (tables, lens) = (gpu.upload(&inp.tables)?, gpu.upload(&inp.lens)?);
        let split = AttentionSplit::new(gpu, inp, pool.prefill_kernel(gpu).rows_per_tile(heads / kv_heads))?;
        // Activations for the whole pass, allocated once per step.
        let mut hidden = gpu.zeros::<f32>(n * d)?;
        let mut normed = gpu.zeros::<f32>(n * d)?;
        let (mut q, mut k, mut v) = (gpu.zeros::<f32>(n * qw)?, gpu.zeros::<f32>(n * kw)?, gpu.zeros::<f32>(n * kw)?);
        let mut attn = gpu.zeros::<f32>(n * qw)?;
        let mut delta = gpu.zeros::<f32>(n * d)?;
        let mut gate_up = gpu.zeros::<f32>(n * 2 * inter)?;
        let mut act = gpu.zeros::<f32>(n * inter)?;
        scratch.x = gpu.zeros::<u16>(n * d.max(qw).max(inter))?;
        let scale = 1.0 / (hd as f32).sqrt();

        gpu.gather_rows_bf16(embed, &ids, &mut hidden, n, d)?;
        comm.all_reduce_sum(gpu, &mut hidden, n * d)?;
        let first = layers.first().ok_or_else(|| invalid("a model without layers".into()))?;
        gpu.rms_norm(&hidden, &first.attn_norm, &mut normed, n, eps)?;
        let last = layers.len() - 1;
        for (li, l) in layers.iter().enumerate() {
            l.q.forward(gpu, &normed, scratch, &mut q, n)?;
            l.k.forward(gpu, &normed, scratch, &mut k, n)?;
            l.v.forward(gpu, &normed, scratch, &mut v, n)?;
            gpu.rope(&mut q, &positions, inv_freq, n, heads, hd)?;
            gpu.rope(&mut k, &positions, inv_freq, n, kv_heads, hd)?;
            // Every row's K/V first, then attention: a prefill row reads the rows before it
            // in this same batch.
            pool.write_rows(gpu, li, &k, &v, &slots, n)?;
            // Decode rows by the decode kernel, prompt chunks by the prefill kernel.
            if split.decode_rows {
                pool.attention(
                    gpu,
                    li,
                    heads,
                    inp.max_blocks,
                    &q,
                    &tables,
                    split.decode_lens.as_ref().unwrap_or(&lens),
                    scale,
                    &mut attn,
                )?;
            }
            pool.prefill_attention(
                gpu,
                li,
                heads,
                inp.max_blocks,
                &q,
                &tables,
                &lens,
                &split.tiles,
                split.num_tiles,
                scale,
                &mut attn,
            )?;
            l.o.forward(gpu, &attn, scratch, &mut delta, n)?;
            // Row-parallel projections: each rank's partial sum over its heads (its MLP slice
            // below), then the sum over ranks.
            comm.all_reduce_sum(gpu, &mut delta, n * d)?;
            gpu.add_rms_norm(&mut hidden, &delta, &l.ffn_norm, &mut normed, n, eps)?;
            l.gate_up.forward(gpu, &normed, scratch, &mut gate_up, n)?;
            gpu.silu_mul(&gate_up, &mut act, n, inter)?;
            l.down.forward(gpu, &act, scratch, &mut delta, n)?;
            comm.all_reduce_sum(gpu, &mut delta, n * d)?;
            if li < last {
                gpu.add_rms_norm(&mut hidden, &delta, &layers[li + 1].attn_norm, &mut normed, n, eps)?;
            }
        }
        // Only the rows that need logits take the last residual add, the final norm and the
        // (large) vocabulary projection.
        let m = inp.logit_rows.len();
        if m == 0 {
            gpu.synchronize()?;
            return Ok(Vec::new());
        }
        let picked = gpu.upload(&inp.logit_rows)?;
        let (mut hm, mut dm, mut ym) = (gpu.zeros::<f32>(m * d)?, gpu.zeros::<f32>(m * d)?, gpu.zeros::<f32>(m * d)?);
        gpu.gather_rows_f32(&hidden, &picked, &mut hm, m, d)?;
        gpu.gather_rows_f32(&delta, &picked, &mut dm, m, d)?;
        gpu.add_rms_norm(&mut hm, &dm, norm, &mut ym, m, eps)?;
        let vocab = shard.vocab.len();
        let mut logits = gpu.zeros::<f32>(m * vocab)?;
        match lm_head {
            Some(h) => h.forward(gpu, &ym, scratch, &mut logits, m)?,
            None => {
                gpu.narrow_bf16(&ym, &mut scratch.x, m * d)?;
                gpu.gemm_bf16(&scratch.x, embed, &mut logits, m, d, vocab)?;
            }
        }
        let mut out = gpu.download(&logits)?;
        out.truncate(m * vocab);
        Ok(out)
    }
}

impl Shard {
    /// Each token's row of this rank's embedding table: its own vocabulary rows first, then the
    /// zero row for tokens another rank holds (a single device holds every token).
    fn embedding_rows(&self, ids: &[i32]) -> Vec<i32> {
        let zero_row = self.vocab.len() as i32;
        ids.iter()
            .map(|&t| if self.vocab.contains(&(t as usize)) { t - self.vocab.start as i32 } else { zero_row })
            .collect()
    }
}

/// Moves a loaded model onto `gpu` when it is a whole Llama (the weights are uploaded, the host
/// copy is dropped); other architectures keep the CPU forward.
pub fn place_on_device<R: Runtime + 'static>(m: LoadedModel, gpu: Kernels<R>) -> Result<LoadedModel, ForwardError> {
    place_on_devices(m, vec![gpu], Box::new(SoleRank))
}

/// Moves a loaded model onto `gpus`, one tensor-parallel rank per device, dense weights in bf16
/// (`model::device::place_on_devices`).
pub fn place_on_devices<R: Runtime + 'static>(
    m: LoadedModel,
    gpus: Vec<Kernels<R>>,
    group: Box<dyn DeviceGroup<R>>,
) -> Result<LoadedModel, ForwardError> {
    crate::model::device::place_on_devices(m, gpus, group, DenseWeights::Bf16)
}

/// A whole Llama (or one tensor-parallel rank, run with its peers) moves to one device.
impl DeviceForward for LlamaModel {
    fn device_ranks(&self) -> usize {
        1
    }
    fn onto_devices<R: Runtime + 'static>(
        &self,
        gpus: Vec<Kernels<R>>,
        group: Box<dyn DeviceGroup<R>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError> {
        Ok(Box::new(DeviceLlama::from_ranks_with(std::slice::from_ref(self), gpus, group, dense)?))
    }
}

/// Tensor-parallel ranks, one device each.
impl DeviceForward for TensorParallel {
    fn device_ranks(&self) -> usize {
        self.ranks().len()
    }
    fn onto_devices<R: Runtime + 'static>(
        &self,
        gpus: Vec<Kernels<R>>,
        group: Box<dyn DeviceGroup<R>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError> {
        Ok(Box::new(DeviceLlama::from_ranks_with(self.ranks(), gpus, group, dense)?))
    }
}
