//! Routed Mixture-of-Experts: token → expert routing (shared by the host's MoE layer and the
//! device), and the CPU references for `kernels/cuda/moe.cu` and the MoE variants of the GEMV
//! kernels: grouping of assignments (`tokens × k` router choices) by expert in a stable order (so
//! results do not depend on scheduling), tiles of grouped slots, the expert GEMV, the weighted
//! combine.
//!
//! Routing (transformers' DeepseekV3TopkRouter, vLLM's grouped_topk): scores from the router
//! logits (sigmoid or softmax); selection on `score + e_score_correction_bias` when a bias is given
//! (noaux_tc); group limiting (DeepSeek-V2 ranks groups by their best score, noaux_tc by the sum of
//! their two best biased scores; the `topk_group` best groups stay, the others are masked to −∞);
//! top-k; the weights are the *unbiased* scores of the chosen experts, optionally renormalised to
//! sum to 1, then scaled by `routed_scaling_factor`.

use std::ops::Range;

use super::dequant::DequantizeRows;

/// How router logits become per-expert scores.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RouterScoring {
    Softmax,
    Sigmoid,
}

/// How the top-k experts are chosen from the scores.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RouterTopk {
    /// Plain top-k over all experts.
    Greedy,
    /// DeepSeek-V2: keep the `topk_group` groups with the highest max score, top-k inside them.
    GroupLimitedGreedy,
    /// DeepSeek-V3 / Kimi: groups ranked by the sum of their two best biased scores.
    NoauxTc,
}

/// One MoE router's hyper-parameters (the host's `MoeConfig` fields that routing reads).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterSpec {
    pub scoring: RouterScoring,
    pub method: RouterTopk,
    pub num_experts: usize,
    /// Groups of `num_experts / n_group` consecutive experts (group limiting only).
    pub n_group: usize,
    pub topk_group: usize,
    pub top_k: usize,
    /// Renormalise the chosen weights to sum to 1 (`norm_topk_prob`).
    pub normalize: bool,
    /// `routed_scaling_factor`.
    pub scale: f32,
}

/// One token's choice: (expert ids, weights), largest first. `logits` has `num_experts` values;
/// `bias` (noaux_tc's `e_score_correction_bias`), when given, only decides which experts are
/// chosen. NaN scores are never chosen over real ones.
pub fn route_token(spec: &RouterSpec, logits: &[f32], bias: Option<&[f32]>) -> (Vec<u32>, Vec<f32>) {
    let scores: Vec<f32> = match spec.scoring {
        RouterScoring::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
        RouterScoring::Softmax => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
            // A serial sum in index order: the device kernel sums in the same order.
            let sum: f32 = exp.iter().sum();
            exp.into_iter().map(|v| v / sum).collect()
        }
    };
    let mut choice: Vec<f32> = match bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => scores.clone(),
    };
    if spec.method != RouterTopk::Greedy && spec.topk_group < spec.n_group {
        let per = choice.len() / spec.n_group;
        let group_score: Vec<f32> = choice
            .chunks_exact(per)
            .map(|g| match spec.method {
                RouterTopk::NoauxTc => top_indices(g, 2).iter().map(|&i| g[i]).sum(),
                _ => g.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            })
            .collect();
        let keep = top_indices(&group_score, spec.topk_group);
        for (gi, g) in choice.chunks_exact_mut(per).enumerate() {
            if !keep.contains(&gi) {
                g.fill(f32::NEG_INFINITY);
            }
        }
    }
    let ids = top_indices(&choice, spec.top_k);
    let mut ws: Vec<f32> = ids.iter().map(|&i| scores[i]).collect();
    if spec.normalize {
        // transformers adds 1e-20 so an all-zero choice cannot divide by zero.
        let denom = ws.iter().sum::<f32>() + 1e-20;
        ws.iter_mut().for_each(|w| *w /= denom);
    }
    ws.iter_mut().for_each(|w| *w *= spec.scale);
    (ids.into_iter().map(|i| i as u32).collect(), ws)
}

/// Indices of the `k` largest values, largest first; ties go to the lower index. NaN counts as
/// smallest (−∞), so a NaN can never be chosen over a real value; otherwise the order is
/// `f32::total_cmp`'s (−0 below +0).
pub fn top_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    let key = |i: usize| if v[i].is_nan() { f32::NEG_INFINITY } else { v[i] };
    let k = k.min(v.len());
    if k < idx.len() {
        idx.select_nth_unstable_by(k, |&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
        idx.truncate(k);
    }
    idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    idx
}

/// Index of global expert `e` among the experts held here (expert parallelism), or `held.len()`
/// (the "not held here" bucket).
pub fn local_expert(e: usize, held: &Range<usize>) -> i32 {
    (if held.contains(&e) { e - held.start } else { held.len() }) as i32
}

/// Routed assignments of a batch, each `[n * top_k]`: global expert ids, weights, local ids.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub experts: Vec<i32>,
    pub weights: Vec<f32>,
    pub local: Vec<i32>,
}

/// [`route_token`] for each of the `n` rows of `logits` (`[n, num_experts]`), with local ids for
/// the experts in `held` (the reference for `Kernels::moe_route`).
pub fn route(spec: &RouterSpec, logits: &[f32], bias: Option<&[f32]>, n: usize, held: Range<usize>) -> Routing {
    let mut r = Routing {
        experts: Vec::with_capacity(n * spec.top_k),
        weights: Vec::with_capacity(n * spec.top_k),
        local: Vec::with_capacity(n * spec.top_k),
    };
    for row in logits.chunks_exact(spec.num_experts).take(n) {
        let (ids, ws) = route_token(spec, row, bias);
        r.local.extend(ids.iter().map(|&e| local_expert(e as usize, &held)));
        r.experts.extend(ids.iter().map(|&e| e as i32));
        r.weights.extend(ws);
    }
    r
}

/// `(offsets, order)`: expert `e`'s assignments are `order[offsets[e]..offsets[e + 1]]`, in
/// increasing assignment index. Experts outside `0..num_experts` are an error.
pub fn group_by_expert(experts: &[i32], num_experts: usize) -> Result<(Vec<usize>, Vec<usize>), String> {
    let mut counts = vec![0usize; num_experts];
    for (i, &e) in experts.iter().enumerate() {
        let e = usize::try_from(e)
            .ok()
            .filter(|&e| e < num_experts)
            .ok_or_else(|| format!("assignment {i}: expert {e} outside 0..{num_experts}"))?;
        counts[e] += 1;
    }
    let mut offsets = Vec::with_capacity(num_experts + 1);
    let mut run = 0;
    for c in &counts {
        offsets.push(run);
        run += c;
    }
    offsets.push(run);
    let mut next = offsets.clone();
    let mut order = vec![0; experts.len()];
    for (i, &e) in experts.iter().enumerate() {
        order[next[e as usize]] = i;
        next[e as usize] += 1;
    }
    Ok((offsets, order))
}

/// One GEMV tile: `slots` (1..=`tok`) consecutive grouped slots from `first`, all of `expert`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    pub first: usize,
    pub slots: usize,
    pub expert: usize,
}

/// Tiles of at most `tok` grouped slots for experts `0..held` from [`group_by_expert`]'s offsets
/// (experts in increasing order, slots in order); the bucket `held` and beyond get none.
pub fn tiles(offsets: &[usize], held: usize, tok: usize) -> Vec<Tile> {
    let mut out = Vec::new();
    for e in 0..held {
        for first in (offsets[e]..offsets[e + 1]).step_by(tok) {
            out.push(Tile { first, slots: tok.min(offsets[e + 1] - first), expert: e });
        }
    }
    out
}

/// An expert-stacked weight for [`moe_gemv`]: experts stacked by rows, decoded one row at a time
/// by the format's own decoder.
pub enum ExpertRows<'a> {
    /// bf16 bit patterns, `[rows, cols]`.
    Bf16 {
        w: &'a [u16],
        rows: usize,
        cols: usize,
    },
    F32 {
        w: &'a [f32],
        rows: usize,
        cols: usize,
    },
    /// INT, Cubic or MXFP4 (`cpu::quant_int::IntMatrix`, `cpu::cubic::AnyCubic`, `cpu::mxfp4::Mxfp4Matrix`).
    Packed(&'a dyn DequantizeRows),
}

impl ExpertRows<'_> {
    pub fn cols(&self) -> usize {
        match self {
            ExpertRows::Bf16 { cols, .. } | ExpertRows::F32 { cols, .. } => *cols,
            ExpertRows::Packed(m) => m.cols(),
        }
    }
    pub fn row(&self, r: usize) -> Vec<f32> {
        match self {
            ExpertRows::Bf16 { w, cols, .. } => {
                w[r * cols..(r + 1) * cols].iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect()
            }
            ExpertRows::F32 { w, cols, .. } => w[r * cols..(r + 1) * cols].to_vec(),
            ExpertRows::Packed(m) => m.dequantize_row(r),
        }
    }
}

/// For every slot `g` of every tile, with `a = order[g]` and the tile's expert `e`:
/// `out[a, r] = W[e * rows_per_expert + r, :] · x[a / x_div, :]`. Other rows of `out` are left
/// untouched.
pub fn moe_gemv(
    w: &ExpertRows<'_>,
    rows_per_expert: usize,
    x: &[f32],
    x_div: usize,
    order: &[usize],
    tiles: &[Tile],
    out: &mut [f32],
) {
    let cols = w.cols();
    for t in tiles {
        for r in 0..rows_per_expert {
            let wr = w.row(t.expert * rows_per_expert + r);
            for &a in &order[t.first..t.first + t.slots] {
                let xr = &x[(a / x_div) * cols..][..cols];
                out[a * rows_per_expert + r] = wr.iter().zip(xr).map(|(w, v)| w * v).sum();
            }
        }
    }
}

/// `out[t, :] += Σ_j weights[a] · y[a, :]` over the `k` assignments `a = t*k + j` with
/// `local[a] < held`, summed in increasing `j` with fused multiply-adds from 0, then added (the
/// device kernel's exact operations).
#[allow(clippy::too_many_arguments)]
pub fn combine(y: &[f32], weights: &[f32], local: &[i32], held: usize, n: usize, k: usize, d: usize, out: &mut [f32]) {
    for t in 0..n {
        for i in 0..d {
            let mut acc = 0.0f32;
            for a in t * k..(t + 1) * k {
                if (local[a] as usize) < held {
                    acc = weights[a].mul_add(y[a * d + i], acc);
                }
            }
            out[t * d + i] += acc;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(scoring: RouterScoring, method: RouterTopk, n_group: usize, topk_group: usize, top_k: usize) -> RouterSpec {
        RouterSpec { scoring, method, num_experts: 8, n_group, topk_group, top_k, normalize: false, scale: 1.0 }
    }

    fn sorted(ids: &[u32]) -> Vec<u32> {
        let mut v = ids.to_vec();
        v.sort();
        v
    }

    const LOGITS: [f32; 8] = [0.1, 2.0, -1.0, 0.5, 1.5, 1.4, -0.3, 0.0];

    #[test]
    fn softmax_and_sigmoid_choose_alike_but_weigh_differently() {
        let z: f32 = LOGITS.iter().map(|l| l.exp()).sum();
        let (ids, ws) = route_token(&spec(RouterScoring::Softmax, RouterTopk::Greedy, 1, 1, 2), &LOGITS, None);
        assert_eq!(ids, [1, 4], "largest first");
        assert!((ws[0] - 2.0f32.exp() / z).abs() < 1e-6 && (ws[1] - 1.5f32.exp() / z).abs() < 1e-6);
        let (ids, ws) = route_token(&spec(RouterScoring::Sigmoid, RouterTopk::Greedy, 1, 1, 2), &LOGITS, None);
        assert_eq!(ids, [1, 4]);
        assert!((ws[0] - 1.0 / (1.0 + (-2.0f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn groups_limit_the_choice() {
        // Groups of 2: {0,1} {2,3} {4,5} {6,7}. Max per group: 2.0, 0.5, 1.5, 0.0.
        let (ids, _) =
            route_token(&spec(RouterScoring::Softmax, RouterTopk::GroupLimitedGreedy, 4, 1, 2), &LOGITS, None);
        assert_eq!(sorted(&ids), [0, 1]);
        // noaux_tc ranks by the sum of the top two (of sigmoid scores: group {4,5} wins).
        let (ids, _) = route_token(&spec(RouterScoring::Sigmoid, RouterTopk::NoauxTc, 4, 1, 2), &LOGITS, None);
        assert_eq!(sorted(&ids), [4, 5]);
        let (ids, _) = route_token(&spec(RouterScoring::Sigmoid, RouterTopk::NoauxTc, 4, 4, 2), &LOGITS, None);
        assert_eq!(sorted(&ids), [1, 4]);
    }

    #[test]
    fn bias_selects_but_does_not_weigh() {
        let s =
            RouterSpec { normalize: true, scale: 2.5, ..spec(RouterScoring::Sigmoid, RouterTopk::NoauxTc, 1, 1, 2) };
        let mut bias = [0.0f32; 8];
        bias[7] = 3.0; // logit 0.0 -> score 0.5, biased 3.5: chosen first
        let (ids, ws) = route_token(&s, &LOGITS, Some(&bias));
        assert_eq!(ids, [7, 1]);
        let (s1, s7) = (1.0 / (1.0 + (-2.0f32).exp()), 0.5f32);
        assert!((ws[0] - 2.5 * s7 / (s1 + s7)).abs() < 1e-6 && (ws[1] - 2.5 * s1 / (s1 + s7)).abs() < 1e-6, "{ws:?}");
    }

    #[test]
    fn nan_is_never_chosen_and_ties_go_to_the_lower_index() {
        let mut l = LOGITS;
        l[1] = f32::NAN;
        let (ids, _) = route_token(&spec(RouterScoring::Sigmoid, RouterTopk::Greedy, 1, 1, 3), &l, None);
        assert_eq!(ids, [4, 5, 3]);
        assert_eq!(top_indices(&[f32::NAN, 1.0, 0.5], 1), [1]);
        assert_eq!(top_indices(&[1.0, 2.0, 2.0, 1.0], 4), [1, 2, 0, 3]);
    }

    #[test]
    fn routing_marks_experts_held_elsewhere() {
        let s = spec(RouterScoring::Sigmoid, RouterTopk::Greedy, 1, 1, 2);
        let r = route(&s, &LOGITS, None, 1, 2..5);
        assert_eq!((r.experts, r.local), (vec![1, 4], vec![3, 2]));
    }

    #[test]
    fn grouping_is_stable_and_checks_ids() {
        let (off, order) = group_by_expert(&[2, 0, 2, 1, 0, 2], 4).unwrap();
        assert_eq!(off, [0, 2, 3, 6, 6]);
        assert_eq!(order, [1, 4, 3, 0, 2, 5]);
        assert!(group_by_expert(&[4], 4).is_err());
        assert!(group_by_expert(&[-1], 4).is_err());
    }

    #[test]
    fn tiles_split_long_groups_and_skip_the_bucket() {
        // Expert 0: 5 slots, expert 1: none, expert 2: 2 slots, bucket (3): 4 slots.
        let t = tiles(&[0, 5, 5, 7, 11], 3, 2);
        let want =
            [(0, 2, 0), (2, 2, 0), (4, 1, 0), (5, 2, 2)].map(|(first, slots, expert)| Tile { first, slots, expert });
        assert_eq!(t, want);
    }

    #[test]
    fn combine_skips_assignments_held_elsewhere() {
        // 2 tokens, k = 2, d = 1; assignment 1 is not held here (local 2 = held).
        let mut out = [10.0f32, 20.0];
        combine(&[1.0, 100.0, 3.0, 4.0], &[0.5, 0.5, 2.0, 0.25], &[0, 2, 1, 0], 2, 2, 2, 1, &mut out);
        assert_eq!(out, [10.5, 27.0]);
    }
}
