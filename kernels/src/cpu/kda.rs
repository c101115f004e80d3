//! Kimi Delta Attention (KDA), the linear-attention layer of Kimi-Linear and Kimi K3: the
//! per-token arithmetic (written against plain slices so each piece can be read next to its
//! formula, docs/formats.md §3.1-3.2, transformers `modeling_kimi_linear.py`), which the host's CPU
//! layer runs, and the batch-level references of `kernels/cuda/kda.cu` built from the same pieces,
//! so the host, the references and the kernels agree by construction.
//!
//! A batch's rows are grouped by sequence as a CSR: sequence `s`'s rows are
//! `seq_rows[seq_start[s]..seq_start[s + 1]]` (batch row indices, in position order) and its state
//! lives in slot `seq_slot[s]` of a pool of per-slot states. Different sequences must use
//! different slots.

/// FLA's l2norm epsilon (added to the sum of squares, not clamped).
pub const L2_NORM_EPS: f32 = 1e-6;

/// Depthwise causal convolution followed by SiLU over the tokens of one sequence, in order.
///
/// `x` holds `t` rows of `channels` values (the projection outputs of consecutive positions);
/// `history` the last `kernel - 1` inputs of every channel before them (`[channels][kernel - 1]`,
/// oldest first) and is advanced past these rows; `weight` is `[channels][kernel]`, whose first
/// tap multiplies the oldest input (PyTorch `conv1d` with `kernel - 1` left padding).
pub fn short_conv_silu(
    x: &[f32],
    channels: usize,
    history: &mut [f32],
    weight: &[f32],
    kernel: usize,
    out: &mut [f32],
) {
    let t = x.len() / channels;
    let h = kernel - 1;
    debug_assert_eq!(history.len(), channels * h);
    debug_assert_eq!(weight.len(), channels * kernel);
    let mut window = vec![0.0f32; kernel];
    for c in 0..channels {
        let hist = &mut history[c * h..(c + 1) * h];
        let w = &weight[c * kernel..(c + 1) * kernel];
        window[..h].copy_from_slice(hist);
        for r in 0..t {
            window[h] = x[r * channels + c];
            let y: f32 = w.iter().zip(&window).map(|(a, b)| a * b).sum();
            out[r * channels + c] = silu(y);
            window.copy_within(1.., 0);
        }
        hist.copy_from_slice(&window[..h]);
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Softplus as transformers computes it for KDA: `x` itself above 20 (where they agree in f32).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

/// Per-channel log-decay `g` (≤ 0) of one head from the forget-gate projection `f`.
///
/// Kimi-Linear: `g = −exp(A_log)·softplus(f + dt_bias)`; with a lower bound `lb` (K3's
/// `gate_lower_bound`, the "safe gate"): `g = lb·sigmoid(exp(A_log)·(f + dt_bias))`, so g ∈ (lb, 0).
pub fn forget_gate(f: &[f32], dt_bias: &[f32], decay_rate: f32, lower_bound: Option<f32>, g: &mut [f32]) {
    for ((g, &f), &b) in g.iter_mut().zip(f).zip(dt_bias) {
        let x = f + b;
        *g = match lower_bound {
            Some(lb) => lb * sigmoid(decay_rate * x),
            None => -decay_rate * softplus(x),
        };
    }
}

/// `x / sqrt(Σx² + eps)` in place (FLA's l2norm: eps added, not clamped; eps = 1e-6).
pub fn l2_normalize(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + L2_NORM_EPS).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// One token of the gated delta rule for one head, state `s` as `[dk][dv]` rows:
/// ```text
/// S ← diag(exp(g))·S ;  S ← S + k ⊗ β(v − Sᵀk) ;  o = Sᵀq
/// ```
/// Two passes over the state: decay while accumulating `Sᵀk`, then the rank-1 update while
/// accumulating `Sᵀq`. `q` is already l2-normalised and scaled, `k` l2-normalised.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    scratch: &mut [f32],
    o: &mut [f32],
) {
    let dv = v.len();
    let kv_mem = scratch;
    kv_mem.fill(0.0);
    for (kk, row) in s.chunks_exact_mut(dv).enumerate() {
        let decay = g[kk].exp();
        let kc = k[kk];
        for (sv, m) in row.iter_mut().zip(kv_mem.iter_mut()) {
            *sv *= decay;
            *m += *sv * kc;
        }
    }
    // delta = β(v − Sᵀk), kept in the scratch row.
    for (m, &vv) in kv_mem.iter_mut().zip(v) {
        *m = (vv - *m) * beta;
    }
    o.fill(0.0);
    for (kk, row) in s.chunks_exact_mut(dv).enumerate() {
        let (kc, qc) = (k[kk], q[kk]);
        for ((sv, &d), out) in row.iter_mut().zip(kv_mem.iter()).zip(o.iter_mut()) {
            *sv += kc * d;
            *out += *sv * qc;
        }
    }
}

/// Gated RMSNorm of one head's output: `rmsnorm(o)·weight·sigmoid(gate)`, in place.
pub fn gated_rms_norm(o: &mut [f32], weight: &[f32], gate: &[f32], eps: f32) {
    let mean_sq = o.iter().map(|v| v * v).sum::<f32>() / o.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for ((x, &w), &gt) in o.iter_mut().zip(weight).zip(gate) {
        *x = *x * inv * w * sigmoid(gt);
    }
}

/// Shape of one batch of the KDA recurrence ([`recurrent_batch`], `Kernels::kda_recurrent`):
/// `seqs` sequences over `n` batch rows, `heads` heads of `head_dim` (key = value width), a state
/// pool of `slots` slots, the gated RMSNorm's `eps` and the forget gate's form (`lower_bound`:
/// K3's safe gate, else Kimi-Linear's softplus form; see [`forget_gate`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KdaGeometry {
    pub seqs: usize,
    pub n: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub slots: usize,
    pub eps: f32,
    pub lower_bound: Option<f32>,
}

impl KdaGeometry {
    /// `P = heads · head_dim`: the width of q, k, v, the gate projections and the output.
    pub fn proj_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Floats of recurrent state per slot: `[heads][head_dim (key)][head_dim (value)]`.
    pub fn state_len(&self) -> usize {
        self.heads * self.head_dim * self.head_dim
    }
}

/// The scale of the l2-normalised query, `head_dim^-0.5`.
pub fn query_scale(head_dim: usize) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}

/// The batch rows of sequence `s`, in position order.
fn rows_of<'a>(seq_rows: &'a [i32], seq_start: &[i32], s: usize) -> impl Iterator<Item = usize> + 'a {
    seq_rows[seq_start[s] as usize..seq_start[s + 1] as usize].iter().map(|&r| r as usize)
}

/// [`short_conv_silu`] of every sequence (`seq_slot.len()` of them) of a batch: `mixed` and `out`
/// are `[n][channels]` in batch order, `conv_state` `[slots][channels][kernel - 1]`, each
/// sequence's history read from and advanced in its slot.
#[allow(clippy::too_many_arguments)]
pub fn conv_silu_batch(
    mixed: &[f32],
    weight: &[f32],
    conv_state: &mut [f32],
    seq_rows: &[i32],
    seq_start: &[i32],
    seq_slot: &[i32],
    channels: usize,
    kernel: usize,
    out: &mut [f32],
) {
    let hist = channels * (kernel - 1);
    for (s, &slot) in seq_slot.iter().enumerate() {
        let rows: Vec<usize> = rows_of(seq_rows, seq_start, s).collect();
        let x: Vec<f32> = rows.iter().flat_map(|&r| &mixed[r * channels..(r + 1) * channels]).copied().collect();
        let mut y = vec![0.0f32; x.len()];
        short_conv_silu(&x, channels, &mut conv_state[slot as usize * hist..][..hist], weight, kernel, &mut y);
        for (j, &r) in rows.iter().enumerate() {
            out[r * channels..(r + 1) * channels].copy_from_slice(&y[j * channels..(j + 1) * channels]);
        }
    }
}

/// The recurrence of every (sequence, head) of a batch, rows of a sequence in order:
/// l2-normalised and scaled q, l2-normalised k, [`forget_gate`], `β = sigmoid(beta)`,
/// [`delta_rule_step`] on the sequence's slot of `state` (`[slots][heads][head_dim][head_dim]`),
/// then [`gated_rms_norm`]. `conv` is `[n][3P]` (q | k | v after the convolution), `f` and
/// `gate` `[n][P]` (before dt_bias / sigmoid), `beta` `[n][heads]` (logits), `dt_bias` `[P]`,
/// `decay_rate` `[heads]` (`exp(A_log)`), `o_norm` `[head_dim]`; `out` `[n][P]`.
#[allow(clippy::too_many_arguments)]
pub fn recurrent_batch(
    conv: &[f32],
    f: &[f32],
    beta: &[f32],
    gate: &[f32],
    dt_bias: &[f32],
    decay_rate: &[f32],
    o_norm: &[f32],
    state: &mut [f32],
    seq_rows: &[i32],
    seq_start: &[i32],
    seq_slot: &[i32],
    g: &KdaGeometry,
    out: &mut [f32],
) {
    let (p, hd, nh, len) = (g.proj_dim(), g.head_dim, g.heads, g.state_len());
    let scale = query_scale(hd);
    let (mut q, mut k, mut log_decay, mut scratch) =
        (vec![0.0f32; hd], vec![0.0f32; hd], vec![0.0f32; hd], vec![0.0f32; hd]);
    for (s, &slot) in seq_slot[..g.seqs].iter().enumerate() {
        let st = &mut state[slot as usize * len..][..len];
        for r in rows_of(seq_rows, seq_start, s) {
            let row = &conv[r * 3 * p..(r + 1) * 3 * p];
            for (head, sh) in st.chunks_exact_mut(hd * hd).enumerate() {
                let c = r * p + head * hd..r * p + (head + 1) * hd;
                let h = head * hd..(head + 1) * hd;
                q.copy_from_slice(&row[h.clone()]);
                k.copy_from_slice(&row[p + h.start..p + h.end]);
                let v = &row[2 * p + h.start..2 * p + h.end];
                l2_normalize(&mut q);
                q.iter_mut().for_each(|x| *x *= scale);
                l2_normalize(&mut k);
                forget_gate(&f[c.clone()], &dt_bias[h], decay_rate[head], g.lower_bound, &mut log_decay);
                let o = &mut out[c.clone()];
                delta_rule_step(sh, &q, &k, v, &log_decay, sigmoid(beta[r * nh + head]), &mut scratch, o);
                gated_rms_norm(o, o_norm, &gate[c], g.eps);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_continues_across_calls() {
        // One channel, kernel 3: splitting the rows across two calls must equal one call.
        let w = [0.5, -1.0, 2.0];
        let x = [1.0, 2.0, 3.0, -1.0, 0.5];
        let mut h1 = [0.0; 2];
        let mut whole = [0.0; 5];
        short_conv_silu(&x, 1, &mut h1, &w, 3, &mut whole);
        let mut h2 = [0.0; 2];
        let mut split = [0.0; 5];
        short_conv_silu(&x[..2], 1, &mut h2, &w, 3, &mut split[..2]);
        short_conv_silu(&x[2..], 1, &mut h2, &w, 3, &mut split[2..]);
        assert_eq!(whole, split);
        assert_eq!(h1, [-1.0, 0.5]);
        // First output sees only x0 (zero padding): silu(2·1).
        assert!((whole[0] - silu(2.0)).abs() < 1e-6);
    }

    #[test]
    fn delta_rule_writes_value_at_key() {
        // With no decay (g = 0) and β = 1 from a zero state, querying with the key returns v.
        let k = [1.0, 0.0];
        let v = [3.0, -2.0];
        let mut s = [0.0; 4];
        let mut scratch = [0.0; 2];
        let mut o = [0.0; 2];
        delta_rule_step(&mut s, &k, &k, &v, &[0.0, 0.0], 1.0, &mut scratch, &mut o);
        assert_eq!(o, v);
        // Writing a new value at the same key replaces the old one (the delta rule).
        delta_rule_step(&mut s, &k, &k, &[1.0, 1.0], &[0.0, 0.0], 1.0, &mut scratch, &mut o);
        assert_eq!(o, [1.0, 1.0]);
    }
}
