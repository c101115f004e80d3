//! The Llama forward on a device ([`Runtime`]: the CUDA driver, or the CPU simulator in tests):
//! weights uploaded once at start-up, activations resident on the device for the whole pass,
//! K/V in a device paged pool addressed by the engine's own block tables (so prefix-cached
//! blocks work unchanged: both pools use the same block ids). Per step only token ids,
//! positions, slot mappings and block tables go up and only the logit rows come back.
//!
//! Built from a loaded single-device [`LlamaModel`]; numerically it is that model with dense
//! weights in bf16 (see `weights`), so it is tested against it and against transformers.

mod weights;
#[cfg(test)]
mod ref_runtime;
#[cfg(test)]
mod tests;

use std::sync::Mutex;

use kernels::gpu::kernels::GemmScratch;
use kernels::gpu::kv_pool::{DeviceKvPool, KvStorage};
use kernels::gpu::{Kernels, Runtime};

use super::config::ModelConfig;
use super::kv::{BatchRow, CacheLayout, KvCache, LayerKvShape};
use super::llama::LlamaModel;
use super::{DeviceKv, ForwardError, LanguageModel, LoadedModel};
use weights::DevLinear;

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

/// Everything that lives on the device, behind one lock: launches go to one stream in order.
struct DeviceState<R: Runtime> {
    gpu: Kernels<R>,
    /// bf16 `[vocab, hidden]`: the embedding gather's table and, when tied, the output weight.
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

/// One whole model on one device (no tensor-parallel shard), so its heads are the config's.
pub struct DeviceLlama<R: Runtime> {
    cfg: ModelConfig,
    describe: String,
    state: Mutex<DeviceState<R>>,
}

// SAFETY: every device buffer and the runtime itself sit in `state` and are only touched with its
// lock held, so one thread at a time drives the device; nothing device-side is shared outside.
unsafe impl<R: Runtime> Send for DeviceLlama<R> {}
unsafe impl<R: Runtime> Sync for DeviceLlama<R> {}

fn invalid(msg: String) -> ForwardError {
    ForwardError::Invalid(msg)
}

impl<R: Runtime> DeviceLlama<R> {
    /// Uploads `m`'s weights to `gpu`. Refuses a tensor-parallel shard (the device forward runs
    /// one whole model on one device).
    pub fn from_llama(m: &LlamaModel, gpu: Kernels<R>) -> Result<Self, ForwardError> {
        if m.tp.size != 1 {
            return Err(invalid(format!("the device forward runs a whole model on one device; this Llama is tensor-parallel rank {} of {}", m.tp.rank, m.tp.size)));
        }
        let cfg = m.cfg.clone();
        let d = cfg.hidden_size;
        let up = |t: &super::tensor::Tensor| gpu.upload(t.as_slice());
        let mut layers = Vec::with_capacity(m.layers.len());
        for (i, l) in m.layers.iter().enumerate() {
            let name = |w: &str| format!("model.layers.{i}.{w}");
            layers.push(DevLayer {
                attn_norm: up(&l.attn_norm)?,
                q: DevLinear::upload(&gpu, &name("self_attn.q_proj"), &l.q)?,
                k: DevLinear::upload(&gpu, &name("self_attn.k_proj"), &l.k)?,
                v: DevLinear::upload(&gpu, &name("self_attn.v_proj"), &l.v)?,
                o: DevLinear::upload(&gpu, &name("self_attn.o_proj"), &l.o)?,
                ffn_norm: up(&l.ffn_norm)?,
                gate_up: DevLinear::upload_stacked(&gpu, &name("mlp.gate_proj+up_proj"), &l.gate, &l.up)?,
                down: DevLinear::upload(&gpu, &name("mlp.down_proj"), &l.down)?,
            });
        }
        debug_assert_eq!(m.embed.len(), cfg.vocab_size * d);
        let embed = gpu.upload(&kernels::cpu::gather::narrow_bf16(m.embed.as_slice()))?;
        let lm_head = m.lm_head.as_ref().map(|h| DevLinear::upload(&gpu, "lm_head", h)).transpose()?;
        let (norm, inv_freq) = (up(&m.norm)?, gpu.upload(m.rope.inv_freq())?);
        gpu.synchronize()?;
        let describe = gpu.describe();
        tracing::info!(device = %describe, layers = layers.len(), tied = lm_head.is_none(), "Llama weights uploaded to the device");
        let largest = layers.iter().flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate_up, &l.down]).chain(lm_head.as_ref()).map(DevLinear::dequant_elements).max().unwrap_or(0);
        let scratch = gpu.gemm_scratch(largest, 1)?;
        let state = DeviceState { gpu, embed, layers, norm, lm_head, inv_freq, pool: None, scratch };
        Ok(Self { cfg, describe, state: Mutex::new(state) })
    }

    /// The device, as the runtime names it.
    pub fn device(&self) -> &str {
        &self.describe
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, DeviceState<R>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What one step uploads: per token its id, position, pool row to write, and the block table
/// and length its attention reads.
#[derive(Debug)]
struct StepInputs {
    ids: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i32>,
    /// `[tokens, max_blocks]`: each token's sequence table (prefill reuses the decode kernel
    /// with one query row per token, len = pos + 1; a dedicated prefill kernel is future work).
    tables: Vec<i32>,
    lens: Vec<i32>,
    max_blocks: usize,
    logit_rows: Vec<i32>,
}

fn step_inputs(cfg: &ModelConfig, tokens: &[u32], rows: &[BatchRow], block_size: usize, tables: &[Vec<u32>], num_blocks: usize, logit_rows: &[usize]) -> Result<StepInputs, ForwardError> {
    let n = tokens.len();
    if rows.len() != n {
        return Err(invalid(format!("forward: {} batch rows for {n} tokens", rows.len())));
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(invalid(format!("token id {t} is outside the vocabulary (size {})", cfg.vocab_size)));
    }
    if let Some(&r) = logit_rows.iter().find(|&&r| r >= n) {
        return Err(invalid(format!("logit row {r} of a batch of {n} tokens")));
    }
    let mut slots = Vec::with_capacity(n);
    for r in rows {
        let table = tables.get(r.seq).ok_or_else(|| invalid(format!("batch sequence {} has no block table ({} given)", r.seq, tables.len())))?;
        let block = *table.get(r.pos / block_size).ok_or_else(|| invalid(format!("sequence {} position {} is past its {} blocks", r.seq, r.pos, table.len())))? as usize;
        if block >= num_blocks {
            return Err(invalid(format!("block {block} is outside the device pool of {num_blocks}")));
        }
        slots.push((block * block_size + r.pos % block_size) as i32);
    }
    let max_blocks = rows.iter().map(|r| r.pos / block_size + 1).max().unwrap_or(1);
    let mut flat = vec![0i32; n * max_blocks];
    for (i, r) in rows.iter().enumerate() {
        let need = r.pos / block_size + 1;
        // Attention reads every block up to the row's own: all must be inside the pool.
        for (dst, &b) in flat[i * max_blocks..i * max_blocks + need].iter_mut().zip(&tables[r.seq]) {
            if b as usize >= num_blocks {
                return Err(invalid(format!("block {b} is outside the device pool of {num_blocks}")));
            }
            *dst = b as i32;
        }
    }
    Ok(StepInputs {
        ids: tokens.iter().map(|&t| t as i32).collect(),
        positions: rows.iter().map(|r| r.pos as i32).collect(),
        slots,
        tables: flat,
        lens: rows.iter().map(|r| r.pos as i32 + 1).collect(),
        max_blocks,
        logit_rows: logit_rows.iter().map(|&r| r as i32).collect(),
    })
}

impl<R: Runtime> DeviceState<R> {
    fn forward(&mut self, cfg: &ModelConfig, tokens: &[u32], rows: &[BatchRow], kv: &dyn KvCache, logit_rows: &[usize]) -> Result<Vec<f32>, ForwardError> {
        let (heads, kv_heads) = (cfg.num_heads, cfg.num_kv_heads);
        let view = kv.paged_view().ok_or_else(|| invalid("the device forward needs the engine's paged KV cache (its K/V live in the device pool); contiguous caches are not supported".into()))?;
        let Self { gpu, embed, layers, norm, lm_head, inv_freq, pool, scratch } = self;
        let pool = pool.as_mut().ok_or_else(|| invalid("the device KV pool is not allocated (DeviceKv::allocate)".into()))?;
        if pool.block_size != view.block_size {
            return Err(invalid(format!("block size {} in the batch, {} in the device pool", view.block_size, pool.block_size)));
        }
        for c in view.copies {
            pool.copy_block(gpu, c.src as usize, c.dst as usize, c.slots)?;
        }
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let inp = step_inputs(cfg, tokens, rows, view.block_size, view.tables, pool.num_blocks, logit_rows)?;
        let (d, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps);
        let (qw, kw, inter) = (heads * hd, kv_heads * hd, cfg.intermediate_size);
        let (ids, positions, slots) = (gpu.upload(&inp.ids)?, gpu.upload(&inp.positions)?, gpu.upload(&inp.slots)?);
        let (tables, lens) = (gpu.upload(&inp.tables)?, gpu.upload(&inp.lens)?);
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
            pool.attention(gpu, li, heads, inp.max_blocks, &q, &tables, &lens, scale, &mut attn)?;
            l.o.forward(gpu, &attn, scratch, &mut delta, n)?;
            gpu.add_rms_norm(&mut hidden, &delta, &l.ffn_norm, &mut normed, n, eps)?;
            l.gate_up.forward(gpu, &normed, scratch, &mut gate_up, n)?;
            gpu.silu_mul(&gate_up, &mut act, n, inter)?;
            l.down.forward(gpu, &act, scratch, &mut delta, n)?;
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
        let vocab = cfg.vocab_size;
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

impl<R: Runtime> LanguageModel for DeviceLlama<R> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        CacheLayout::uniform(self.cfg.num_layers(), LayerKvShape::heads(self.cfg.num_kv_heads, self.cfg.head_dim))
    }

    /// The infallible entry point has no way to report a device error; the engine calls
    /// [`LanguageModel::try_forward`]. Reaching this with a failure is a caller bug (e.g. a
    /// contiguous cache), reported with the error's text.
    fn forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Vec<f32> {
        match self.try_forward(tokens, rows, kv, logit_rows) {
            Ok(l) => l,
            Err(e) => panic!("DeviceLlama::forward: {e} (callers that can see device errors use try_forward)"),
        }
    }

    fn try_forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Result<Vec<f32>, ForwardError> {
        self.lock().forward(&self.cfg, tokens, rows, kv, logit_rows)
    }

    fn device_kv(&self) -> Option<&dyn DeviceKv> {
        Some(self)
    }
}

impl<R: Runtime> DeviceKv for DeviceLlama<R> {
    fn allocate(&self, num_blocks: usize, block_size: usize, storage: KvStorage) -> Result<(), ForwardError> {
        let mut st = self.lock();
        if let Some(p) = &st.pool {
            if (p.num_blocks, p.block_size, p.storage) == (num_blocks, block_size, storage) {
                return Ok(());
            }
            return Err(invalid(format!("the device KV pool is already allocated ({} blocks of {}, {:?})", p.num_blocks, p.block_size, p.storage)));
        }
        let layers = self.cfg.num_layers();
        let pool = DeviceKvPool::new(&st.gpu, layers, num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim, storage)?;
        st.gpu.synchronize()?;
        st.pool = Some(pool);
        Ok(())
    }
}

/// The Llama `m` runs when it has a device forward: `Ok(None)` for architectures without one (they
/// keep the CPU forward), an error for a tensor-parallel Llama (one device runs one whole model).
/// Placement asks before opening a device; [`place_on_device`] asks again for its own callers.
pub fn single_device_llama(m: &LoadedModel) -> Result<Option<&LlamaModel>, ForwardError> {
    match m.model.as_llama() {
        Some(l) => Ok(Some(l)),
        None if m.model.config().architecture == super::config::Architecture::Llama => {
            Err(invalid("a tensor-parallel Llama cannot run on one device; drop --tensor-parallel-size (or use --device cpu)".into()))
        }
        None => Ok(None),
    }
}

/// Moves a loaded model onto `gpu` when it is a single-device Llama (the weights are uploaded,
/// the host copy is dropped); other architectures keep the CPU forward, and a tensor-parallel
/// load is refused (see [`single_device_llama`]).
pub fn place_on_device<R: Runtime + 'static>(m: LoadedModel, gpu: Kernels<R>) -> Result<LoadedModel, ForwardError> {
    let Some(llama) = single_device_llama(&m)? else {
        tracing::warn!(architecture = ?m.model.config().architecture, "no device forward for this architecture yet: its forward runs on the CPU");
        return Ok(m);
    };
    let dev = DeviceLlama::from_llama(llama, gpu)?;
    Ok(LoadedModel { model: Box::new(dev), ..m })
}

#[cfg(test)]
mod step_tests {
    use super::*;

    fn cfg() -> ModelConfig {
        let raw = serde_json::json!({
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": true
        });
        ModelConfig::from_hf_config(std::path::Path::new("config.json"), &raw).unwrap()
    }

    #[test]
    fn step_inputs_map_positions_to_pool_rows_and_per_token_tables() {
        let rows = [BatchRow { seq: 0, pos: 0 }, BatchRow { seq: 0, pos: 1 }, BatchRow { seq: 0, pos: 2 }, BatchRow { seq: 1, pos: 5 }];
        let tables = vec![vec![4, 2], vec![1, 3, 0]];
        let s = step_inputs(&cfg(), &[1, 2, 3, 4], &rows, 2, &tables, 5, &[2, 3]).unwrap();
        // seq 1 position 5: block index 2 of its table (block 0), slot 1.
        assert_eq!(s.slots, [8, 9, 4, 1]);
        assert_eq!(s.max_blocks, 3);
        assert_eq!(s.tables, [4, 0, 0, 4, 0, 0, 4, 2, 0, 1, 3, 0]);
        assert_eq!(s.lens, [1, 2, 3, 6]);
        assert_eq!(s.logit_rows, [2, 3]);
    }

    #[test]
    fn bad_batches_are_errors_not_panics() {
        let c = cfg();
        let t = vec![vec![0u32]];
        let row = [BatchRow { seq: 0, pos: 0 }];
        assert!(step_inputs(&c, &[10], &row, 2, &t, 1, &[0]).unwrap_err().to_string().contains("outside the vocabulary"));
        assert!(step_inputs(&c, &[1], &row, 2, &t, 1, &[1]).unwrap_err().to_string().contains("logit row"));
        assert!(step_inputs(&c, &[1], &[BatchRow { seq: 1, pos: 0 }], 2, &t, 1, &[0]).unwrap_err().to_string().contains("no block table"));
        assert!(step_inputs(&c, &[1], &[BatchRow { seq: 0, pos: 2 }], 2, &t, 1, &[0]).unwrap_err().to_string().contains("past its"));
        assert!(step_inputs(&c, &[1], &row, 2, &[vec![3]], 1, &[0]).unwrap_err().to_string().contains("outside the device pool"));
        // An earlier block of the table (read by attention, not written) is checked too.
        let late = [BatchRow { seq: 0, pos: 2 }];
        assert!(step_inputs(&c, &[1], &late, 2, &[vec![7, 0]], 1, &[0]).unwrap_err().to_string().contains("block 7 is outside"));
    }
}
