//! Routed Mixture-of-Experts launch wrappers (kernels in `cuda/moe.cu` and the MoE variants beside
//! each quantized GEMV; CPU references in [`crate::cpu::moe`]). A layer runs
//!
//! `matmul_f32` (router logits) → [`Kernels::moe_route`] → [`Kernels::moe_group`] (of the local
//! ids, `held + 1` buckets) → [`Kernels::moe_plan`] → [`Kernels::moe_matmul`] (gate+up, `x_div =
//! k`) → `silu_mul` → [`Kernels::moe_matmul`] (down, `x_div = 1`) → [`Kernels::moe_combine`].
//!
//! In decode all of it stays on the device (no host round trip between routing and the GEMVs);
//! a prefill reads the group offsets back once per layer to send crowded experts to a
//! dequantising bf16 GEMM. Under expert parallelism a device holds the experts `held` (a range of global
//! ids): assignments routed elsewhere land in the bucket `held.len()`, get no tile, and are
//! skipped by the combine.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use super::kernels::{check, GemmScratch, Kernels, QuantWeight, GEMM_MIN_TOKENS, GEMV_WARPS, TOK};
use super::runtime::{DevBuf, Dims, KArg, Runtime};
use crate::cpu::moe::{RouterScoring, RouterSpec, RouterTopk};
use crate::cuda::CudaError;

type A<'a, R> = KArg<'a, R>;

/// Most routed experts [`Kernels::moe_route`] takes (`MAX_EXPERTS` in moe.cu).
pub const MAX_ROUTED_EXPERTS: usize = 1024;
/// Most experts per token [`Kernels::moe_route`] takes (one lane of its warp each).
pub const MAX_TOP_K: usize = 32;

/// `(offsets [num_experts + 1], order [assignments])` of [`Kernels::moe_group`], on the device.
pub type ExpertGroups<R> = (<R as Runtime>::Buf<i32>, <R as Runtime>::Buf<i32>);

/// [`Kernels::moe_route`]'s output, each `[n * top_k]`: global expert ids (largest weight first
/// per token), weights, and local ids (`held.len()` for experts held elsewhere).
pub struct Routed<R: Runtime> {
    pub experts: R::Buf<i32>,
    pub weights: R::Buf<f32>,
    pub local: R::Buf<i32>,
}

/// [`Kernels::moe_tiles`]'s output: `tiles` holds `(first grouped slot, slots <= TOK, local
/// expert)` triples, `count[0]` how many.
pub struct MoeTiles<R: Runtime> {
    pub tiles: R::Buf<i32>,
    pub count: R::Buf<i32>,
}

/// One expert's grouped slots `first..first + slots` (a [`MoePlan`] GEMM expert).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertSlots {
    pub expert: usize,
    pub first: usize,
    pub slots: usize,
}

/// [`Kernels::moe_plan`]'s output: GEMV tiles for the experts with few slots, the crowded experts
/// (more than [`GEMM_MIN_TOKENS`] slots) for the dequantise + GEMM path, in expert order.
pub struct MoePlan<R: Runtime> {
    pub tiles: MoeTiles<R>,
    pub gemm: Vec<ExpertSlots>,
}

/// A weight of experts stacked by rows, in any stored format, for [`Kernels::moe_gemv`].
pub enum ExpertWeight<'a, R: Runtime> {
    /// bf16 bit patterns `[rows, cols]` (all experts' rows).
    Bf16 { w: &'a R::Buf<u16>, rows: usize, cols: usize },
    /// f32 `[rows, cols]`: exact checks of f32 checkpoints (`--dtype float32`).
    F32 { w: &'a R::Buf<f32>, rows: usize, cols: usize },
    /// A packed format, as the plain GEMVs take it.
    Quant(QuantWeight<'a, R>),
}

// By hand: a derive would demand `R: Clone`, but only references are copied.
impl<R: Runtime> Clone for ExpertWeight<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<R: Runtime> Copy for ExpertWeight<'_, R> {}

impl<R: Runtime> ExpertWeight<'_, R> {
    /// Rows of all experts together.
    pub fn rows(&self) -> usize {
        match self {
            ExpertWeight::Bf16 { rows, .. } | ExpertWeight::F32 { rows, .. } => *rows,
            ExpertWeight::Quant(q) => q.rows(),
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            ExpertWeight::Bf16 { cols, .. } | ExpertWeight::F32 { cols, .. } => *cols,
            ExpertWeight::Quant(q) => q.cols(),
        }
    }
}

/// Experts every [`Kernels::moe_plan`] in this process has sent to the GEMM path: lets a test of
/// a whole model see that its prefill took that path (the plan is made deep inside a forward).
static GEMM_EXPERTS_PLANNED: AtomicU64 = AtomicU64::new(0);

/// The running total of experts planned for the GEMM path in this process.
pub fn gemm_experts_planned() -> u64 {
    GEMM_EXPERTS_PLANNED.load(Ordering::Relaxed)
}

fn fits_i32(v: usize) -> bool {
    v <= i32::MAX as usize
}

impl<R: Runtime> Kernels<R> {
    /// `out[n, rows] = x[n, cols] · Wᵀ`, f32 weights (the router: its choice must not depend on
    /// bf16 rounding). The GEMV kernel shape: one warp per row, `TOK` tokens per grid row.
    pub fn matmul_f32(
        &self,
        x: &R::Buf<f32>,
        w: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        n: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        Self::check_gemv(rows, cols, x, out, n)?;
        check(w.len() >= rows * cols && fits_i32(rows) && fits_i32(cols), || {
            format!("matmul_f32: {} weights for {rows}x{cols}", w.len())
        })?;
        check(n.div_ceil(TOK) <= 65535, || format!("matmul_f32: {n} tokens exceed 65535 grid rows of {TOK}"))?;
        let args = [A::F32s(w), A::F32s(x), A::F32s(out), A::I32(rows as i32), A::I32(cols as i32), A::I32(n as i32)];
        self.go("matmul_f32", Self::gemv_dims(rows, n), &args)
    }

    /// Routes `n` tokens from router logits `[n, num_experts]`; `bias` `[num_experts]` (noaux_tc's
    /// `e_score_correction_bias`, applied to the selection when given) or None. `experts` are
    /// global ids and `weights` those of [`crate::cpu::moe::route_token`], bit for bit; `local[a]
    /// = experts[a] - held.start` when `held` contains it, else `held.len()`. One block (one warp)
    /// per token. Errors: more than 1024 experts, `top_k` outside `1..=min(32, num_experts)`,
    /// `n_group` not dividing `num_experts`, `held` not inside `0..num_experts`, short buffers.
    pub fn moe_route(
        &self,
        logits: &R::Buf<f32>,
        bias: Option<&R::Buf<f32>>,
        spec: &RouterSpec,
        n: usize,
        held: Range<usize>,
        out: &mut Routed<R>,
    ) -> Result<(), CudaError> {
        let (e, k) = (spec.num_experts, spec.top_k);
        check((1..=MAX_ROUTED_EXPERTS).contains(&e), || format!("moe_route: {e} experts (1..={MAX_ROUTED_EXPERTS})"))?;
        check((1..=MAX_TOP_K.min(e)).contains(&k), || {
            format!("moe_route: top-{k} of {e} experts (at most {MAX_TOP_K})")
        })?;
        check(spec.n_group > 0 && e.is_multiple_of(spec.n_group), || {
            format!("moe_route: {e} experts do not split into {} groups", spec.n_group)
        })?;
        check(held.start <= held.end && held.end <= e, || format!("moe_route: held experts {held:?} outside 0..{e}"))?;
        check(logits.len() >= n * e && bias.is_none_or(|b| b.len() >= e), || {
            format!("moe_route: {} logits for {n} x {e}, bias {:?}", logits.len(), bias.map(|b| b.len()))
        })?;
        let (ex, w, l) = (&out.experts, &out.weights, &out.local);
        check(ex.len() >= n * k && w.len() >= n * k && l.len() >= n * k, || {
            format!("moe_route: outputs {} / {} / {} for {n} x {k}", ex.len(), w.len(), l.len())
        })?;
        check(fits_i32(n), || format!("moe_route: {n} tokens in one launch"))?;
        if n == 0 {
            return Ok(()); // CUDA refuses an empty grid
        }
        let scoring = match spec.scoring {
            RouterScoring::Softmax => 0,
            RouterScoring::Sigmoid => 1,
        };
        let method = match spec.method {
            RouterTopk::Greedy => 0,
            RouterTopk::GroupLimitedGreedy => 1,
            RouterTopk::NoauxTc => 2,
        };
        // topk_group >= n_group keeps every group, as in route_token.
        let topk_group = spec.topk_group.min(spec.n_group);
        let args = [
            A::F32s(logits),
            A::F32s(bias.unwrap_or(logits)), // not read without a bias
            A::I32(bias.is_some() as i32),
            A::I32(e as i32),
            A::I32(scoring),
            A::I32(method),
            A::I32(spec.n_group as i32),
            A::I32(topk_group as i32),
            A::I32(k as i32),
            A::I32(spec.normalize as i32),
            A::F32(spec.scale),
            A::I32(held.start as i32),
            A::I32(held.len() as i32),
            A::I32s(&out.experts),
            A::F32s(&out.weights),
            A::I32s(&out.local),
        ];
        self.go("moe_route", Dims::new((n as u32, 1, 1), 32), &args)
    }

    /// Groups `experts` (assignment → expert id, all in `0..num_experts`: the router guarantees
    /// it) by expert, stable; returns `(offsets [num_experts + 1], order [assignments])` on the
    /// device. For a layer, group the local ids into `held + 1` buckets.
    pub fn moe_group(&self, experts: &R::Buf<i32>, num_experts: usize) -> Result<ExpertGroups<R>, CudaError> {
        let a = experts.len();
        let counts = self.zeros::<i32>(num_experts)?;
        let offsets = self.zeros::<i32>(num_experts + 1)?;
        let order = self.zeros::<i32>(a)?;
        self.go("moe_count", Self::flat_dims(a), &[A::I32s(experts), A::I32(a as i32), A::I32s(&counts)])?;
        self.go(
            "moe_offsets",
            Dims::new((1, 1, 1), 32),
            &[A::I32s(&counts), A::I32(num_experts as i32), A::I32s(&offsets)],
        )?;
        self.go(
            "moe_scatter",
            Dims::new((num_experts as u32, 1, 1), 256),
            &[A::I32s(experts), A::I32(a as i32), A::I32s(&offsets), A::I32s(&order)],
        )?;
        Ok((offsets, order))
    }

    /// Tiles of `<= TOK` consecutive grouped slots sharing one expert, for experts `0..held` (the
    /// bucket `held` is skipped), from the offsets of `moe_group(local, held + 1)`; built on the
    /// device. At most `assignments` tiles (each holds at least one slot).
    pub fn moe_tiles(&self, offsets: &R::Buf<i32>, held: usize, assignments: usize) -> Result<MoeTiles<R>, CudaError> {
        self.moe_tiles_up_to(offsets, held, assignments, assignments)
    }

    /// As [`Self::moe_tiles`], leaving out the experts with more than `max_slots` slots (those
    /// [`Self::moe_plan`] gives to the GEMM).
    pub fn moe_tiles_up_to(
        &self,
        offsets: &R::Buf<i32>,
        held: usize,
        assignments: usize,
        max_slots: usize,
    ) -> Result<MoeTiles<R>, CudaError> {
        check(offsets.len() > held, || format!("moe_tiles: {} offsets for {held} experts", offsets.len()))?;
        check(fits_i32(held) && fits_i32(3 * assignments), || {
            format!("moe_tiles: {held} experts, {assignments} assignments")
        })?;
        let tiles = self.zeros::<i32>(3 * assignments)?;
        let count = self.zeros::<i32>(1)?;
        let max_slots = A::I32(max_slots.min(i32::MAX as usize) as i32);
        self.go(
            "moe_tiles",
            Dims::new((1, 1, 1), 32),
            &[
                A::I32s(offsets),
                A::I32(held as i32),
                A::I32(assignments as i32),
                max_slots,
                A::I32s(&tiles),
                A::I32s(&count),
            ],
        )?;
        Ok(MoeTiles { tiles, count })
    }

    /// Decides how a layer's grouped assignments are multiplied. Experts with more than
    /// [`GEMM_MIN_TOKENS`] slots go to the dequantise + bf16 GEMM path of
    /// [`Self::moe_matmul`] (as [`Self::matmul_quant`] does for a dense prefill: the GEMV would
    /// re-read the expert's packed weight once per 8 of its tokens), the rest to GEMV tiles.
    ///
    /// `tokens` is the batch's token count: a token picks distinct experts, so no expert has more
    /// slots than that, and at `tokens <= GEMM_MIN_TOKENS` (decode) the plan is all tiles, built
    /// on the device with no host round trip. Above it the offsets are read back (one
    /// synchronisation per layer, small next to a prefill's GEMMs) to size the GEMMs. `gemm`
    /// false (f32 experts, the exact checks whose GEMV keeps f32 activations) always plans tiles
    /// only.
    pub fn moe_plan(
        &self,
        offsets: &R::Buf<i32>,
        held: usize,
        assignments: usize,
        tokens: usize,
        gemm: bool,
    ) -> Result<MoePlan<R>, CudaError> {
        if !gemm || tokens <= GEMM_MIN_TOKENS {
            return Ok(MoePlan { tiles: self.moe_tiles(offsets, held, assignments)?, gemm: Vec::new() });
        }
        check(offsets.len() > held, || format!("moe_plan: {} offsets for {held} experts", offsets.len()))?;
        let host = self.download(offsets)?;
        let spans: Vec<ExpertSlots> = (0..held)
            .map(|e| ExpertSlots { expert: e, first: host[e] as usize, slots: (host[e + 1] - host[e]) as usize })
            .filter(|s| s.slots > GEMM_MIN_TOKENS)
            .collect();
        GEMM_EXPERTS_PLANNED.fetch_add(spans.len() as u64, Ordering::Relaxed);
        Ok(MoePlan { tiles: self.moe_tiles_up_to(offsets, held, assignments, GEMM_MIN_TOKENS)?, gemm: spans })
    }

    /// [`Self::moe_gemv`] over the plan's tiles, then for each of its GEMM experts `e`: gather
    /// the expert's activation rows as bf16 into `scratch.x`, run the bf16 GEMM (f32
    /// accumulation) on its rows of `w` (packed weights dequantised into `scratch.weight` first,
    /// bf16 ones in place) and scatter the rows to their assignments. Same result as
    /// [`Self::moe_gemv`] over every expert's tiles, up to the bf16 rounding of the GEMM experts'
    /// activations. A plan with GEMM experts needs a packed or bf16 `w` (f32 experts are exact
    /// checks: [`Self::moe_plan`] gives them none) and scratch for `slots × cols` activations
    /// (and, packed, `rows_per_expert × cols` weights).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_matmul(
        &self,
        w: ExpertWeight<'_, R>,
        rows_per_expert: usize,
        x: &R::Buf<f32>,
        x_div: usize,
        order: &R::Buf<i32>,
        plan: &MoePlan<R>,
        out: &mut R::Buf<f32>,
        assignments: usize,
        scratch: &mut GemmScratch<R>,
    ) -> Result<(), CudaError> {
        // The GEMM experts' checks first, so a call that fails launches nothing; moe_gemv then
        // checks the weight's format and the buffers the gather reads (their slots are
        // assignments) before its own launch.
        let widest = plan.gemm.iter().map(|s| s.slots).max();
        let cols = w.cols();
        if let Some(widest) = widest {
            let weights = match w {
                ExpertWeight::Quant(_) => rows_per_expert * cols,
                ExpertWeight::Bf16 { .. } => 0,
                ExpertWeight::F32 { .. } => {
                    return Err(CudaError::BadArgs(
                        "moe_matmul: the GEMM path takes packed or bf16 expert weights, not f32".into(),
                    ))
                }
            };
            let experts = w.rows() / rows_per_expert.max(1);
            check(plan.gemm.iter().all(|s| s.expert < experts && s.first + s.slots <= assignments), || {
                format!("moe_matmul: a GEMM expert outside {experts} experts / {assignments} assignments")
            })?;
            check(scratch.x.len() >= widest * cols && scratch.weight.len() >= weights, || {
                format!(
                    "moe_matmul: scratch holds {} activations / {} weights, need {widest} x {cols} / {weights}",
                    scratch.x.len(),
                    scratch.weight.len()
                )
            })?;
            check(fits_i32(cols) && fits_i32(rows_per_expert) && fits_i32(x_div), || {
                format!("moe_matmul: {rows_per_expert}x{cols} exceeds 32-bit sizes")
            })?;
        }
        self.moe_gemv(w, rows_per_expert, x, x_div, order, &plan.tiles, out, assignments)?;
        let Some(widest) = widest else { return Ok(()) };
        let mut y = self.zeros::<f32>(widest * rows_per_expert)?;
        for s in &plan.gemm {
            let (first, slots) = (s.first as i32, s.slots as i32);
            let gather = [
                A::F32s(x),
                A::I32(x_div as i32),
                A::I32s(order),
                A::I32(first),
                A::I32(slots),
                A::I32(cols as i32),
                A::U16s(&scratch.x),
            ];
            self.go("moe_gather_bf16", Self::row_dims(s.slots), &gather)?;
            let rows = s.expert * rows_per_expert..(s.expert + 1) * rows_per_expert;
            match w {
                ExpertWeight::Quant(q) => {
                    self.dequant_rows_bf16(q, rows, &mut scratch.weight)?;
                    self.gemm_bf16(&scratch.x, &scratch.weight, &mut y, s.slots, cols, rows_per_expert)?;
                }
                ExpertWeight::Bf16 { w, .. } => self.gemm_bf16_rows(&scratch.x, w, rows, &mut y, s.slots, cols)?,
                ExpertWeight::F32 { .. } => unreachable!("refused above"),
            }
            let scatter = [
                A::F32s(&y),
                A::I32s(order),
                A::I32(first),
                A::I32(slots),
                A::I32(rows_per_expert as i32),
                A::F32s(out),
            ];
            self.go("moe_scatter_rows", Self::row_dims(s.slots), &scatter)?;
        }
        Ok(())
    }

    /// For every tile slot `g` with `a = order[g]` and the tile's expert `e`:
    /// `out[a, r] = W_e[r, :] · x[a / x_div, :]`, where `W_e` is rows
    /// `e * rows_per_expert..(e + 1) * rows_per_expert` of the stacked weight (e.g. gate then up per
    /// expert for the fused gate_up). Rows of `out` whose assignment is in no tile are left
    /// untouched. `x_div` is `k` for a first projection (token rows) and 1 after it (assignment
    /// rows). INT weights take the 4-bit word kernel under the same condition as `int_gemv`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gemv(
        &self,
        w: ExpertWeight<'_, R>,
        rows_per_expert: usize,
        x: &R::Buf<f32>,
        x_div: usize,
        order: &R::Buf<i32>,
        tiles: &MoeTiles<R>,
        out: &mut R::Buf<f32>,
        assignments: usize,
    ) -> Result<(), CudaError> {
        let (rows, cols) = (w.rows(), w.cols());
        check(rows_per_expert > 0 && rows.is_multiple_of(rows_per_expert) && x_div > 0, || {
            format!("moe_gemv: {rows} rows in experts of {rows_per_expert}, x_div {x_div}")
        })?;
        check(fits_i32(rows) && fits_i32(cols) && fits_i32(3 * assignments) && fits_i32(x_div), || {
            format!("moe_gemv: {rows}x{cols}, {assignments} assignments exceed 32-bit sizes")
        })?;
        if assignments == 0 {
            return Ok(()); // no tiles; CUDA refuses an empty grid
        }
        let x_rows = (assignments - 1) / x_div + 1;
        check(
            order.len() >= assignments && x.len() >= x_rows * cols && out.len() >= assignments * rows_per_expert,
            || {
                format!("moe_gemv: order {} / x {} / out {} for {assignments} assignments of {rows_per_expert}x{cols}, x_div {x_div}", order.len(), x.len(), out.len())
            },
        )?;
        // The kernel reads at most min(count[0], assignments) tiles.
        check(tiles.tiles.len() >= 3 * assignments && !tiles.count.is_empty(), || {
            format!("moe_gemv: {} tile entries for {assignments} assignments", tiles.tiles.len())
        })?;
        let tail = [
            A::F32s(x),
            A::I32(x_div as i32),
            A::I32s(order),
            A::I32s(&tiles.tiles),
            A::I32s(&tiles.count),
            A::F32s(out),
            A::I32(rows_per_expert as i32),
            A::I32((rows / rows_per_expert) as i32),
            A::I32(assignments as i32),
            A::I32(cols as i32),
        ];
        // Each kernel takes its weight's buffers, then the tile arguments, then its own sizes.
        let (name, head, extra): (&'static str, Vec<A<'_, R>>, Vec<A<'_, R>>) = match w {
            ExpertWeight::Bf16 { w, .. } => {
                check(w.len() >= rows * cols, || format!("moe_gemv bf16: {} weights for {rows}x{cols}", w.len()))?;
                ("moe_gemv_bf16", vec![A::U16s(w)], vec![])
            }
            ExpertWeight::F32 { w, .. } => {
                check(w.len() >= rows * cols, || format!("moe_gemv f32: {} weights for {rows}x{cols}", w.len()))?;
                ("moe_gemv_f32", vec![A::F32s(w)], vec![])
            }
            ExpertWeight::Quant(QuantWeight::Int(g) | QuantWeight::Cubic(g)) => {
                let int = matches!(w, ExpertWeight::Quant(QuantWeight::Int(_)));
                Self::check_grouped(if int { "moe_gemv INT" } else { "moe_gemv Cubic" }, g)?;
                let p = &g.packed;
                let head = vec![A::U8s(&p.data), A::I64(p.stride as i64), A::F32s(&g.p0), A::F32s(&g.p1)];
                let (bits, group) = (A::I32(p.bits as i32), A::I32(g.group_size as i32));
                match (int, Self::int4_fast_path(g)) {
                    (true, true) => ("moe_int4_gemv", head, vec![group]),
                    (true, false) => ("moe_int_gemv", head, vec![bits, group]),
                    (false, _) => ("moe_cubic_gemv", head, vec![bits, group]),
                }
            }
            ExpertWeight::Quant(QuantWeight::Mxfp4(m)) => {
                check(
                    cols.is_multiple_of(32) && m.packed.len() >= rows * cols / 2 && m.scales.len() >= rows * cols / 32,
                    || {
                        format!(
                            "moe_gemv MXFP4 {rows}x{cols}: {} code bytes, {} scales",
                            m.packed.len(),
                            m.scales.len()
                        )
                    },
                )?;
                ("moe_mxfp4_gemv", vec![A::U8s(&m.packed), A::U8s(&m.scales)], vec![])
            }
        };
        let args: Vec<A<'_, R>> = head.into_iter().chain(tail).chain(extra).collect();
        self.go(name, Self::moe_gemv_dims(rows_per_expert, assignments), &args)
    }

    /// One warp per expert row (gridDim.x); tiles grid-strided over gridDim.y (at most
    /// `assignments` of them, CUDA caps gridDim.y at 65535).
    fn moe_gemv_dims(rows_per_expert: usize, assignments: usize) -> Dims {
        Dims::new(
            (rows_per_expert.div_ceil(GEMV_WARPS) as u32, assignments.clamp(1, 65535) as u32, 1),
            (GEMV_WARPS * 32) as u32,
        )
    }

    /// `out[t, :] += Σ_j weights[a] · y[a, :]` over the `k` assignments `a = t*k + j` with
    /// `local[a] < held` (`y` `[n*k, d]`), accumulated in increasing `j` with fused multiply-adds.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        y: &R::Buf<f32>,
        weights: &R::Buf<f32>,
        local: &R::Buf<i32>,
        held: usize,
        n: usize,
        k: usize,
        d: usize,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        check(
            k > 0 && y.len() >= n * k * d && weights.len() >= n * k && local.len() >= n * k && out.len() >= n * d,
            || {
                format!(
                    "moe_combine: y {} / weights {} / local {} / out {} for {n} tokens x {k} of {d}",
                    y.len(),
                    weights.len(),
                    local.len(),
                    out.len()
                )
            },
        )?;
        check(fits_i32(held) && fits_i32(n) && fits_i32(k) && fits_i32(d), || {
            format!("moe_combine: {n} x {k} x {d} exceed 32-bit sizes")
        })?;
        if n * d == 0 {
            return Ok(());
        }
        let dims = Self::elementwise_dims("moe_combine", n * d)?;
        let args = [
            A::F32s(y),
            A::F32s(weights),
            A::I32s(local),
            A::I32(held as i32),
            A::I32(n as i32),
            A::I32(k as i32),
            A::I32(d as i32),
            A::F32s(out),
        ];
        self.go("moe_combine", dims, &args)
    }
}
