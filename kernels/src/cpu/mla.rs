//! DeepSeek-V3 multi-head latent attention (MLA) in its absorbed form: the CPU references for
//! `kernels/cuda/mla.cu` and the `mla_attention_*` kernels of `kernels/cuda/paged_attention.cu`.
//! The RoPE of MLA's rotary slices is [`super::rope::rope_rows`]; the cache stores are
//! [`super::kv_write::kv_store_f32`] and its siblings.
//!
//! The cache keeps per token the normed latent `c` (`lora` wide) as its key row and the rotated
//! shared `k_rope` (`rope` wide) as its value row. Per head, with `W_uk[h]` folded into the query
//! (`q_lat = W_uk[h]ᵀ q_nope`) and `W_uv[h]` applied after the weighted sum:
//!
//! ```text
//! score_p = scale · (q_lat · c_p + q_rope · kr_p)     ctx = Σ_p softmax(score)_p · c_p     out = W_uv[h] · ctx
//! ```

use super::attention::KvBlocks;
use super::softmax::softmax_in_place;

/// Shape of a latent-cache attention: query heads, latent and rotary widths, the pool's block size
/// and the block tables' row length.
#[derive(Clone, Copy, Debug)]
pub struct LatentGeometry {
    pub heads: usize,
    pub lora: usize,
    pub rope: usize,
    pub block_size: usize,
    pub max_blocks: usize,
}

/// `out[r, 0..count] = src[r, offset..offset + count]` for rows `width` wide (e.g. the latent and
/// rotary parts of `kv_a_proj`'s output, or the nope and rope parts of each query head).
pub fn copy_cols(src: &[f32], out: &mut [f32], rows: usize, width: usize, offset: usize, count: usize) {
    for r in 0..rows {
        out[r * count..(r + 1) * count].copy_from_slice(&src[r * width + offset..r * width + offset + count]);
    }
}

/// `out[t, h, r] = Σ_c W[h, r, c] · x[t, h, c]`: one matrix per head (bf16 bit patterns
/// `[heads, rows, cols]`) applied to that head's slice of every token (`x` `[tokens, heads, cols]`,
/// `out` `[tokens, heads, rows]`), summed in column order.
pub fn head_matvec_bf16(w: &[u16], x: &[f32], out: &mut [f32], tokens: usize, heads: usize, rows: usize, cols: usize) {
    let wf: Vec<f32> = w[..heads * rows * cols].iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
    head_matvec_f32(&wf, x, out, tokens, heads, rows, cols)
}

/// [`head_matvec_bf16`] with f32 weights.
pub fn head_matvec_f32(wf: &[f32], x: &[f32], out: &mut [f32], tokens: usize, heads: usize, rows: usize, cols: usize) {
    for t in 0..tokens {
        for h in 0..heads {
            let xs = &x[(t * heads + h) * cols..][..cols];
            for r in 0..rows {
                let wr = &wf[(h * rows + r) * cols..][..cols];
                out[(t * heads + h) * rows + r] = wr.iter().zip(xs).fold(0.0f32, |s, (a, b)| s + a * b);
            }
        }
    }
}

/// `x[i] *= sigmoid(g[i])`: MLA's optional output gate.
pub fn sigmoid_mul(x: &mut [f32], g: &[f32]) {
    for (a, &gi) in x.iter_mut().zip(g) {
        *a *= 1.0 / (1.0 + (-gi).exp());
    }
}

/// Absorbed MLA attention over the latent pool: for every token `t` (one per entry of `lens`) and
/// head `h`, `ctx[t, h, :] = Σ_p softmax_p(scale · (q_lat[t, h] · c_p + q_rope[t, h] · kr_p)) · c_p`
/// over positions `p < lens[t]`, position `p` at pool row `tables[t · max_blocks + p / block_size]
/// · block_size + p % block_size`. `cache` holds the latents as K (`lora` wide) and the rotary keys
/// as V (`rope` wide), FP8 with one scale per row of each. Tokens with no positions get zeros.
#[allow(clippy::too_many_arguments)]
pub fn mla_attention(
    q_lat: &[f32],
    q_rope: &[f32],
    cache: &KvBlocks,
    tables: &[i32],
    lens: &[i32],
    g: &LatentGeometry,
    scale: f32,
    ctx: &mut [f32],
) {
    let (lora, rope) = (g.lora, g.rope);
    for (t, &len) in lens.iter().enumerate() {
        let rows: Vec<usize> = (0..len as usize)
            .map(|p| tables[t * g.max_blocks + p / g.block_size] as usize * g.block_size + p % g.block_size)
            .collect();
        for h in 0..g.heads {
            let th = t * g.heads + h;
            let (ql, qr) = (&q_lat[th * lora..(th + 1) * lora], &q_rope[th * rope..(th + 1) * rope]);
            let mut w: Vec<f32> = rows
                .iter()
                .map(|&r| {
                    let lat: f32 = ql.iter().enumerate().map(|(i, q)| q * cache.element(false, r, lora, 1, i)).sum();
                    let rot: f32 = qr.iter().enumerate().map(|(i, q)| q * cache.element(true, r, rope, 1, i)).sum();
                    scale * (lat + rot)
                })
                .collect();
            softmax_in_place(&mut w);
            let o = &mut ctx[th * lora..(th + 1) * lora];
            o.fill(0.0);
            for (&r, &p) in rows.iter().zip(&w) {
                for (i, oi) in o.iter_mut().enumerate() {
                    *oi += p * cache.element(false, r, lora, 1, i);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_cols_and_head_matvec_on_small_cases() {
        let src = [0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0];
        let mut out = [0.0f32; 4];
        copy_cols(&src, &mut out, 2, 3, 1, 2);
        assert_eq!(out, [1.0, 2.0, 4.0, 5.0]);
        // Two heads, 1 row x 2 cols each: head 0 sums, head 1 takes the difference.
        let bf = |v: f32| half::bf16::from_f32(v).to_bits();
        let w = [bf(1.0), bf(1.0), bf(1.0), bf(-1.0)];
        let mut o = [0.0f32; 2];
        head_matvec_bf16(&w, &[2.0, 3.0, 5.0, 7.0], &mut o, 1, 2, 1, 2);
        assert_eq!(o, [5.0, -2.0]);
    }

    #[test]
    fn sigmoid_gate_halves_at_zero() {
        let mut x = [4.0f32, 4.0];
        sigmoid_mul(&mut x, &[0.0, 100.0]);
        assert_eq!(x, [2.0, 4.0]);
    }

    /// One position returns its latent whatever the scores; two weigh theirs by the softmax of
    /// `scale · (latent dot + rotary dot)`; an empty sequence gives zeros.
    #[test]
    fn attention_weighs_latents_by_latent_and_rotary_scores() {
        let g = LatentGeometry { heads: 2, lora: 2, rope: 1, block_size: 2, max_blocks: 1 };
        // Pool of 2 blocks; the positions used live in block 1 (rows 2 and 3).
        let mut c = [0.0f32; 8];
        c[4..].copy_from_slice(&[3.0, -1.0, 1.0, 2.0]);
        let kr = [0.0, 0.0, 0.5, -1.0];
        let q_lat = [1.0f32, 2.0, 0.0, 1.0, 7.0, 7.0, 7.0, 7.0];
        let q_rope = [1.0f32, 2.0, 7.0, 7.0];
        let cache = KvBlocks::F32 { k: &c, v: &kr };
        let mut ctx = [9.0f32; 8];
        mla_attention(&q_lat, &q_rope, &cache, &[1, 1], &[1, 0], &g, 0.5, &mut ctx);
        assert_eq!(ctx, [3.0, -1.0, 3.0, -1.0, 0.0, 0.0, 0.0, 0.0]);
        mla_attention(&q_lat, &q_rope, &cache, &[1, 1], &[2, 0], &g, 0.5, &mut ctx);
        for (h, (ql, qr)) in [([1.0f32, 2.0], 1.0f32), ([0.0, 1.0], 2.0)].into_iter().enumerate() {
            let s2 = 0.5 * (ql[0] * 3.0 - ql[1] + qr * 0.5);
            let s3 = 0.5 * (ql[0] + ql[1] * 2.0 - qr);
            let p3 = 1.0 / (1.0 + (s2 - s3).exp());
            let want = [3.0 * (1.0 - p3) + p3, -(1.0 - p3) + 2.0 * p3];
            assert!(
                (ctx[2 * h] - want[0]).abs() < 1e-6 && (ctx[2 * h + 1] - want[1]).abs() < 1e-6,
                "head {h}: {:?} vs {want:?}",
                &ctx[2 * h..2 * h + 2]
            );
        }
    }
}
