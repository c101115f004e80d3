//! Kimi Delta Attention (KDA): the linear-attention layer of Kimi-Linear and Kimi K3.
//!
//! ```text
//! q,k,v = SiLU(ShortConv(q_proj x)), …            depthwise causal conv, kernel 4, state = last 3 inputs
//! g     = gate(f_b(f_a x), A_log, dt_bias)         per-channel log decay (softplus or lower-bound form)
//! β     = sigmoid(b_proj x)
//! o     = gated delta rule(l2norm(q)/√d, l2norm(k), v, g, β)   fp32 state [heads, d, d] per sequence
//! out   = o_proj(RMSNorm(o)·w·sigmoid(G))          G = g_b(g_a x) (Kimi-Linear) or g_proj x (K3)
//! ```
//! Batched over `BatchRow`s of many sequences: the rows of one sequence must be consecutive
//! positions continuing its state; sequences run in parallel, and so do the heads of each.

pub mod math;
pub mod plan;
pub mod state;

use rayon::prelude::*;
use serde_json::Value;
use std::path::Path;

use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::kv::BatchRow;
use crate::model::layers::linear::Linear;
use crate::model::shard::Split;
use crate::model::tensor::Tensor;
use state::KdaState;

/// Shape and variant of a model's KDA layers (`linear_attn_config` of a Kimi-Linear config).
#[derive(Clone, Debug, PartialEq)]
pub struct KdaConfig {
    pub hidden_size: usize,
    pub num_heads: usize,
    /// Key and value head dimension (equal in Kimi-Linear and K3).
    pub head_dim: usize,
    pub conv_kernel: usize,
    pub rms_norm_eps: f32,
    /// K3's "safe gate": `g = lb·sigmoid(exp(A_log)·(f + dt_bias))` instead of the softplus form.
    pub gate_lower_bound: Option<f32>,
    /// K3: output gate `g_proj x` (full rank) instead of Kimi-Linear's `g_b_proj(g_a_proj x)`.
    pub full_rank_gate: bool,
}

impl KdaConfig {
    /// `H · head_dim`: the width of the q, k, v, forget-gate and output-gate projections.
    pub fn proj_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Reads the KDA fields of a Kimi-Linear `config.json`: `linear_attn_config` as Moonshot's
    /// checkpoints write it, or transformers' flattened `linear_num_heads`/`linear_head_dim`/
    /// `linear_conv_kernel_dim`.
    pub fn from_hf_config(file: &Path, raw: &Value) -> Result<Self, LoadError> {
        let err = |detail: String| LoadError::Config { file: file.to_path_buf(), detail };
        let lac = raw.get("linear_attn_config").filter(|v| !v.is_null());
        let pick = |nested: &str, flat: &str| {
            lac.and_then(|l| l.get(nested)).or_else(|| raw.get(flat)).filter(|v| !v.is_null())
        };
        let uint = |nested: &str, flat: &str, default: Option<u64>| -> Result<usize, LoadError> {
            match pick(nested, flat) {
                Some(v) => v
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| err(format!("linear_attn_config.{nested} must be a positive integer, got {v}"))),
                None => {
                    default.map(|d| d as usize).ok_or_else(|| err(format!("linear_attn_config.{nested} is missing")))
                }
            }
        };
        let hidden_size =
            raw.get("hidden_size").and_then(Value::as_u64).ok_or_else(|| err("hidden_size is missing".into()))?
                as usize;
        let num_heads = uint("num_heads", "linear_num_heads", None)?;
        let head_dim = uint("head_dim", "linear_head_dim", None)?;
        let conv_kernel = uint("short_conv_kernel_size", "linear_conv_kernel_dim", Some(4))?;
        if conv_kernel < 2 {
            return Err(err(format!("short_conv_kernel_size must be at least 2, got {conv_kernel}")));
        }
        if let Some(v) = pick("num_v_heads", "linear_num_v_heads") {
            if v.as_u64() != Some(num_heads as u64) {
                return Err(err(format!(
                    "KDA with num_v_heads {v} != num_heads {num_heads} (grouped value heads) is not supported"
                )));
            }
        }
        for (nested, what) in [("head_k_dim", "head_k_dim"), ("head_v_dim", "head_v_dim")] {
            if let Some(v) = pick(nested, nested) {
                if v.as_u64() != Some(head_dim as u64) {
                    return Err(err(format!(
                        "KDA {what} {v} differs from head_dim {head_dim}, which is not supported"
                    )));
                }
            }
        }
        let gate_lower_bound = match pick("gate_lower_bound", "linear_lower_bound") {
            None => None,
            Some(v) => {
                let lb = v.as_f64().ok_or_else(|| err(format!("gate_lower_bound must be a number, got {v}")))?;
                if !(lb < 0.0 && lb.is_finite()) {
                    return Err(err(format!("gate_lower_bound must be negative, got {lb}")));
                }
                Some(lb as f32)
            }
        };
        let full_rank_gate = pick("use_full_rank_gate", "use_full_rank_gate").and_then(Value::as_bool).unwrap_or(false);
        let rms_norm_eps = raw.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32;
        Ok(Self { hidden_size, num_heads, head_dim, conv_kernel, rms_norm_eps, gate_lower_bound, full_rank_gate })
    }
}

pub(crate) enum OutputGate {
    LowRank { a: Linear, b: Linear },
    FullRank(Linear),
}

// Crate-visible fields: the device forward (model/device/decoder) uploads them.
pub struct KdaLayer {
    pub(crate) cfg: KdaConfig,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    /// q, k, v convolution taps, `[3P][kernel]` (the three checkpoint tensors stacked).
    pub(crate) conv: Vec<f32>,
    pub(crate) f_a: Linear,
    pub(crate) f_b: Linear,
    pub(crate) dt_bias: Tensor,
    /// `exp(A_log)` per head.
    pub(crate) decay_rate: Vec<f32>,
    pub(crate) b: Linear,
    pub(crate) out_gate: OutputGate,
    pub(crate) o_norm: Tensor,
    pub(crate) o: Linear,
}

impl KdaLayer {
    /// Loads the layer under `prefix` (e.g. `model.layers.0.self_attn`). Accepts Moonshot's
    /// checkpoint names and the ones transformers uses in memory (`forget_gate.*`, one stacked
    /// `conv1d`), since both appear in saved checkpoints.
    pub fn load(cfg: KdaConfig, src: &dyn WeightSource, prefix: &str) -> Result<Self, LoadError> {
        Self::load_heads(cfg, src, prefix, 0, 1)
    }

    /// Tensor-parallel rank `rank` of `size`: its contiguous `num_heads / size` heads, i.e. their
    /// rows of the q/k/v, forget-gate (`f_b`), beta and output-gate (`g_b` / `g_proj`)
    /// projections, their convolution channels, `dt_bias` and `A_log`, and their columns of
    /// `o_proj` (row-parallel: the ranks' outputs are partial sums). The low-rank `f_a` / `g_a`
    /// inputs and the per-head-dim `o_norm` are whole on every rank. `size == 1` is the layer.
    pub fn load_heads(
        full: KdaConfig,
        src: &dyn WeightSource,
        prefix: &str,
        rank: usize,
        size: usize,
    ) -> Result<Self, LoadError> {
        if size == 0 || rank >= size || !full.num_heads.is_multiple_of(size) {
            return Err(LoadError::Config {
                file: src.file_of(&format!("{prefix}.q_proj.weight")),
                detail: format!(
                    "tensor-parallel rank {rank} of {size} over {} KDA heads (the size must divide the heads)",
                    full.num_heads
                ),
            });
        }
        let cfg = KdaConfig { num_heads: full.num_heads / size, ..full.clone() };
        let (d, hd, h, kk) = (cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.conv_kernel);
        let fp = full.proj_dim();
        let heads = rank * h..(rank + 1) * h;
        // This rank's features of a per-head tensor with `per_head` features per head.
        let part = |per_head: usize| heads.start * per_head..heads.end * per_head;
        let rows = |per_head: usize| if size == 1 { Split::Full } else { Split::Rows(part(per_head)) };
        let lin = |name: &str, rows_split: &Split, full_rows, cols| {
            src.linear_split(&format!("{prefix}.{name}"), full_rows, cols, rows_split)
        };
        // Forget-gate tensors: at the attention module (checkpoints) or under `forget_gate.`.
        let fg = |name: &str| {
            let direct = format!("{prefix}.{name}");
            let nested = format!("{prefix}.forget_gate.{name}");
            if !src.contains(&direct)
                && !src.contains(&format!("{direct}.weight"))
                && (src.contains(&nested) || src.contains(&format!("{nested}.weight")))
            {
                nested
            } else {
                direct
            }
        };
        // Convolution taps `[channels][kernel]`: this rank's channels of q, then k, then v.
        let channels = part(hd);
        let mut conv = Vec::with_capacity(3 * cfg.proj_dim() * kk);
        if src.contains(&format!("{prefix}.q_conv1d.weight")) || !src.contains(&format!("{prefix}.conv1d.weight")) {
            for which in ["q", "k", "v"] {
                let taps = src.load(&format!("{prefix}.{which}_conv1d.weight"), &[fp, 1, kk])?;
                conv.extend_from_slice(&taps.as_slice()[channels.start * kk..channels.end * kk]);
            }
        } else {
            let taps = src.load(&format!("{prefix}.conv1d.weight"), &[3 * fp, 1, kk])?;
            for which in 0..3 {
                conv.extend_from_slice(
                    &taps.as_slice()[(which * fp + channels.start) * kk..(which * fp + channels.end) * kk],
                );
            }
        }
        let a_log = load_a_log(src, &fg("A_log"), full.num_heads)?;
        let out_gate = if cfg.full_rank_gate {
            OutputGate::FullRank(lin("g_proj", &rows(hd), fp, d)?)
        } else {
            OutputGate::LowRank {
                a: src.linear(&format!("{prefix}.g_a_proj"), hd, d)?,
                b: lin("g_b_proj", &rows(hd), fp, hd)?,
            }
        };
        Ok(Self {
            q: lin("q_proj", &rows(hd), fp, d)?,
            k: lin("k_proj", &rows(hd), fp, d)?,
            v: lin("v_proj", &rows(hd), fp, d)?,
            conv,
            f_a: src.linear(&fg("f_a_proj"), hd, d)?,
            f_b: src.linear_split(&fg("f_b_proj"), fp, hd, &rows(hd))?,
            dt_bias: src.load_split(&fg("dt_bias"), &[fp], &rows(hd))?,
            decay_rate: a_log[part(1)].iter().map(|a| a.exp()).collect(),
            b: lin("b_proj", &rows(1), full.num_heads, d)?,
            out_gate,
            o_norm: src.load(&format!("{prefix}.o_norm.weight"), &[hd])?,
            o: src.linear_split(
                &format!("{prefix}.o_proj"),
                d,
                fp,
                &if size == 1 { Split::Full } else { Split::Cols(part(hd)) },
            )?,
            cfg,
        })
    }

    pub fn config(&self) -> &KdaConfig {
        &self.cfg
    }

    /// Runs `x` (`rows.len()` rows of `hidden_size`) through the layer, advancing the state of
    /// each row's sequence (`states[row.seq]`); returns `rows.len()` rows of `hidden_size`.
    ///
    /// The rows of each sequence must be in increasing, consecutive positions starting at the
    /// number of tokens its state already holds (callers keep this; a violation is a bug).
    pub fn forward(&self, x: &[f32], rows: &[BatchRow], states: &mut [&mut KdaState]) -> Vec<f32> {
        let cfg = &self.cfg;
        let (n, p, h) = (rows.len(), cfg.proj_dim(), cfg.num_heads);
        assert_eq!(x.len(), n * cfg.hidden_size, "kda: one input row per BatchRow");
        let q = self.q.forward(x, n);
        let k = self.k.forward(x, n);
        let v = self.v.forward(x, n);
        let f = self.f_b.forward(&self.f_a.forward(x, n), n);
        let beta = self.b.forward(x, n);
        let gate = match &self.out_gate {
            OutputGate::LowRank { a, b } => b.forward(&a.forward(x, n), n),
            OutputGate::FullRank(g) => g.forward(x, n),
        };
        let mut by_seq: Vec<Vec<usize>> = vec![Vec::new(); states.len()];
        for (i, r) in rows.iter().enumerate() {
            by_seq[r.seq].push(i);
        }
        let inputs = StepInputs { q: &q, k: &k, v: &v, f: &f, beta: &beta, gate: &gate };
        let outputs: Vec<Vec<f32>> = states
            .par_iter_mut()
            .zip(by_seq.par_iter())
            .map(|(state, idx)| self.run_sequence(state, idx, rows, &inputs))
            .collect();
        let mut normed = vec![0.0f32; n * p];
        for (idx, out) in by_seq.iter().zip(&outputs) {
            for (j, &i) in idx.iter().enumerate() {
                normed[i * p..(i + 1) * p].copy_from_slice(&out[j * p..(j + 1) * p]);
            }
        }
        debug_assert_eq!(beta.len(), n * h);
        self.o.forward(&normed, n)
    }

    /// One sequence's rows `idx` (in order): convolution, gates and the recurrence per head.
    /// Returns the gated-normed head outputs, `idx.len()` rows of `P`.
    fn run_sequence(&self, state: &mut KdaState, idx: &[usize], rows: &[BatchRow], inp: &StepInputs) -> Vec<f32> {
        let cfg = &self.cfg;
        let (p, hd, nh, t) = (cfg.proj_dim(), cfg.head_dim, cfg.num_heads, idx.len());
        if t == 0 {
            return Vec::new();
        }
        for (j, &i) in idx.iter().enumerate() {
            assert_eq!(rows[i].pos, state.tokens + j, "kda: rows of a sequence must continue its state in order");
        }
        // [q | k | v] per row, then the causal convolution over this sequence's rows.
        let mut mixed = vec![0.0f32; t * 3 * p];
        for (j, &i) in idx.iter().enumerate() {
            let m = &mut mixed[j * 3 * p..(j + 1) * 3 * p];
            m[..p].copy_from_slice(&inp.q[i * p..(i + 1) * p]);
            m[p..2 * p].copy_from_slice(&inp.k[i * p..(i + 1) * p]);
            m[2 * p..].copy_from_slice(&inp.v[i * p..(i + 1) * p]);
        }
        let mut conv = vec![0.0f32; mixed.len()];
        math::short_conv_silu(&mixed, 3 * p, &mut state.conv, &self.conv, cfg.conv_kernel, &mut conv);
        let scale = 1.0 / (hd as f32).sqrt();
        let dt_bias = self.dt_bias.as_slice();
        let o_norm = self.o_norm.as_slice();
        let per_head: Vec<Vec<f32>> = state
            .recurrent
            .par_chunks_mut(hd * hd)
            .enumerate()
            .map(|(head, s)| {
                let (mut qh, mut kh, mut g) = (vec![0.0f32; hd], vec![0.0f32; hd], vec![0.0f32; hd]);
                let mut scratch = vec![0.0f32; hd];
                let mut out = vec![0.0f32; t * hd];
                let c = head * hd..(head + 1) * hd;
                for (j, &i) in idx.iter().enumerate() {
                    let row = &conv[j * 3 * p..(j + 1) * 3 * p];
                    qh.copy_from_slice(&row[c.clone()]);
                    kh.copy_from_slice(&row[p + c.start..p + c.end]);
                    let vh = &row[2 * p + c.start..2 * p + c.end];
                    math::l2_normalize(&mut qh);
                    qh.iter_mut().for_each(|x| *x *= scale);
                    math::l2_normalize(&mut kh);
                    math::forget_gate(
                        &inp.f[i * p + c.start..i * p + c.end],
                        &dt_bias[c.clone()],
                        self.decay_rate[head],
                        cfg.gate_lower_bound,
                        &mut g,
                    );
                    let beta = math::sigmoid(inp.beta[i * nh + head]);
                    let o = &mut out[j * hd..(j + 1) * hd];
                    math::delta_rule_step(s, &qh, &kh, vh, &g, beta, &mut scratch, o);
                    math::gated_rms_norm(o, o_norm, &inp.gate[i * p + c.start..i * p + c.end], cfg.rms_norm_eps);
                }
                out
            })
            .collect();
        state.tokens += t;
        let mut out = vec![0.0f32; t * p];
        for (head, ho) in per_head.iter().enumerate() {
            for j in 0..t {
                out[j * p + head * hd..j * p + (head + 1) * hd].copy_from_slice(&ho[j * hd..(j + 1) * hd]);
            }
        }
        out
    }
}

/// The batch-wide projections one sequence's recurrence reads its rows from.
struct StepInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    f: &'a [f32],
    beta: &'a [f32],
    gate: &'a [f32],
}

/// `A_log` per head. Checkpoints disagree on its shape: transformers' Kimi-Linear `[1,1,H,1]`,
/// flat `[H]`, or K3's zero-padded `[head_dim]` whose first H entries are the heads' values.
fn load_a_log(src: &dyn WeightSource, name: &str, heads: usize) -> Result<Vec<f32>, LoadError> {
    let shape = src.shape_of(name).unwrap_or_else(|| vec![heads]);
    let len: usize = shape.iter().product();
    let ok = len == heads || (shape.len() == 1 && len > heads);
    if !ok {
        return Err(LoadError::BadTensor {
            file: src.file_of(name),
            tensor: name.to_string(),
            detail: format!("shape {shape:?}: expected {heads} per-head values ([{heads}], [1,1,{heads},1] or zero-padded [n > {heads}])"),
        });
    }
    let t = src.load(name, &shape)?;
    Ok(t.as_slice()[..heads].to_vec())
}
