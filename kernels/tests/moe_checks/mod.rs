//! The routed-MoE kernels (`kernels/src/gpu/moe.rs`) against `kernels::cpu::moe`, written once
//! over any runtime and run by `cuda_vs_cpu.rs` on the simulator and on a CUDA device: routing bit
//! for bit against `route_token`, grouping and tiles exactly, the expert GEMV of every weight
//! format within the GEMV tolerance, the combine exactly, and one whole layer (router → route →
//! group → tiles → gate_up → silu_mul → down → combine) against a plain per-token computation,
//! also split over two expert-parallel ranges.

use std::ops::Range;

use kernels::cpu;
use kernels::cpu::bitpack::PackedRows;
use kernels::cpu::moe::{ExpertRows, RouterScoring, RouterSpec, RouterTopk};
use kernels::gpu::kernels::{GEMM_MIN_TOKENS, TOK};
use kernels::gpu::{DevGrouped, DevMxfp4, ExpertWeight, Kernels, MoeTiles, QuantWeight, Routed, Runtime};

use super::test_data::{codes, lcg, uniform};
use super::{assert_close, Tol};

fn routed<R: Runtime>(g: &Kernels<R>, assignments: usize) -> Routed<R> {
    Routed {
        experts: g.zeros(assignments).unwrap(),
        weights: g.zeros(assignments).unwrap(),
        local: g.zeros(assignments).unwrap(),
    }
}

/// Routing weights go through `expf`: the simulator calls the reference's libm, so they must be
/// bit-identical there (`t.rope == 0`); CUDA's `expf` differs in the last ulps, so on a device
/// they are held to the rope (libm-ulp) tolerance. NaN matches NaN (payloads are the hardware's).
fn assert_weights(what: &str, got: &[f32], want: &[f32], t: &Tol) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0.0f32;
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        if a.is_nan() && b.is_nan() {
            continue;
        }
        if t.rope == 0.0 {
            assert_eq!(a.to_bits(), b.to_bits(), "{what}: weight {i} is {a:e}, want {b:e}");
        } else {
            let rel = (a - b).abs() / b.abs().max(1e-30);
            worst = worst.max(rel);
            assert!(rel <= t.rope, "{what}: weight {i} is {a:e}, want {b:e}");
        }
    }
    eprintln!(
        "{what}: weights {}",
        if t.rope == 0.0 { "bit-identical".to_string() } else { format!("max relative error {worst:.1e}") }
    );
}

struct RouteCase {
    name: &'static str,
    spec: RouterSpec,
    n: usize,
    held: Range<usize>,
    bias: bool,
    /// Logits on a 0.25 grid: many exact ties (the lower index must win).
    ties: bool,
    /// Tokens t % 4 == 1 get a NaN logit (softmax: the whole token's scores are NaN).
    nan: bool,
}

#[allow(clippy::too_many_arguments)]
fn spec(
    scoring: RouterScoring,
    method: RouterTopk,
    num_experts: usize,
    n_group: usize,
    topk_group: usize,
    top_k: usize,
    normalize: bool,
    scale: f32,
) -> RouterSpec {
    RouterSpec { scoring, method, num_experts, n_group, topk_group, top_k, normalize, scale }
}

pub fn moe_routing_matches_route_token_bit_for_bit<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    use RouterScoring::*;
    use RouterTopk::*;
    let cases = [
        RouteCase {
            name: "softmax greedy",
            spec: spec(Softmax, Greedy, 64, 1, 1, 6, false, 1.0),
            n: 37,
            held: 0..64,
            bias: false,
            ties: false,
            nan: true,
        },
        RouteCase {
            name: "sigmoid greedy, renormalised, ties",
            spec: spec(Sigmoid, Greedy, 64, 1, 1, 8, true, 2.5),
            n: 37,
            held: 16..40,
            bias: false,
            ties: true,
            nan: true,
        },
        RouteCase {
            name: "softmax group-limited (DeepSeek-V2)",
            spec: spec(Softmax, GroupLimitedGreedy, 160, 8, 3, 6, false, 16.0),
            n: 29,
            held: 0..160,
            bias: false,
            ties: false,
            nan: false,
        },
        RouteCase {
            name: "softmax group-limited, ties",
            spec: spec(Softmax, GroupLimitedGreedy, 64, 8, 2, 5, true, 1.0),
            n: 29,
            held: 8..16,
            bias: false,
            ties: true,
            nan: false,
        },
        RouteCase {
            name: "sigmoid noaux_tc (DeepSeek-V3)",
            spec: spec(Sigmoid, NoauxTc, 256, 8, 4, 8, true, 2.5),
            n: 33,
            held: 64..128,
            bias: true,
            ties: false,
            nan: true,
        },
        RouteCase {
            name: "sigmoid noaux_tc, one expert per group, ties",
            spec: spec(Sigmoid, NoauxTc, 16, 16, 5, 4, true, 1.0),
            n: 21,
            held: 0..16,
            bias: true,
            ties: true,
            nan: false,
        },
        RouteCase {
            name: "sigmoid noaux_tc ungrouped, 1024 experts, top-32 (Kimi)",
            spec: spec(Sigmoid, NoauxTc, 1024, 1, 1, 32, true, 1.7),
            n: 5,
            held: 1000..1024,
            bias: true,
            ties: false,
            nan: true,
        },
        RouteCase {
            name: "softmax noaux_tc, not renormalised, nothing held",
            spec: spec(Softmax, NoauxTc, 32, 4, 2, 3, false, 1.0),
            n: 9,
            held: 7..7,
            bias: true,
            ties: false,
            nan: false,
        },
    ];
    for (ci, c) in cases.iter().enumerate() {
        let e = c.spec.num_experts;
        let mut logits = uniform(c.n * e, 100 + ci as u64, -4.0, 4.0);
        if c.ties {
            logits.iter_mut().for_each(|l| *l = (*l * 4.0).round() / 4.0);
        }
        if c.nan {
            for tok in (1..c.n).step_by(4) {
                logits[tok * e + (tok * 7) % e] = f32::NAN;
            }
        }
        let bias = c.bias.then(|| uniform(e, 200 + ci as u64, -0.3, 0.3));
        let want = cpu::moe::route(&c.spec, &logits, bias.as_deref(), c.n, c.held.clone());
        let dl = g.upload(&logits).unwrap();
        let db = bias.as_ref().map(|b| g.upload(b).unwrap());
        let mut out = routed(g, c.n * c.spec.top_k);
        g.moe_route(&dl, db.as_ref(), &c.spec, c.n, c.held.clone(), &mut out).unwrap();
        assert_eq!(g.download(&out.experts).unwrap(), want.experts, "{}: experts", c.name);
        assert_eq!(g.download(&out.local).unwrap(), want.local, "{}: local ids", c.name);
        assert_weights(c.name, &g.download(&out.weights).unwrap(), &want.weights, t);
    }

    // Sizes the kernel cannot route are errors before any launch.
    let logits = g.upload(&vec![0.0f32; 2048]).unwrap();
    let mut out = routed(g, 64);
    let ok = spec(Sigmoid, Greedy, 64, 1, 1, 4, false, 1.0);
    for (bad, held, what) in [
        (RouterSpec { num_experts: 1025, ..ok }, 0..0, "1025 experts"),
        (RouterSpec { top_k: 33, ..ok }, 0..64, "top-33"),
        (RouterSpec { top_k: 0, ..ok }, 0..64, "top-0"),
        (RouterSpec { n_group: 3, method: NoauxTc, ..ok }, 0..64, "3 groups of 64"),
        (ok, 0..65, "held past the experts"),
    ] {
        assert!(g.moe_route(&logits, None, &bad, 1, held, &mut out).is_err(), "{what} must be refused");
    }
    assert!(g.moe_route(&logits, None, &ok, 33, 0..64, &mut out).is_err(), "logits for 32 tokens, not 33");
}

/// Downloads `count[0]` tiles as `cpu::moe::Tile`s.
fn download_tiles<R: Runtime>(g: &Kernels<R>, t: &MoeTiles<R>) -> Vec<cpu::moe::Tile> {
    let count = g.download(&t.count).unwrap()[0] as usize;
    let raw = g.download(&t.tiles).unwrap();
    raw[..3 * count]
        .chunks(3)
        .map(|c| cpu::moe::Tile { first: c[0] as usize, slots: c[1] as usize, expert: c[2] as usize })
        .collect()
}

/// Groups `local` (ids in `0..=held`) on both sides and builds the tiles on the device: returns the
/// device's order and tiles and the CPU's.
#[allow(clippy::type_complexity)]
fn group_and_tile<R: Runtime>(
    g: &Kernels<R>,
    local: &[i32],
    held: usize,
) -> ((R::Buf<i32>, MoeTiles<R>), (Vec<usize>, Vec<cpu::moe::Tile>)) {
    let (off, order) = cpu::moe::group_by_expert(local, held + 1).unwrap();
    let (doff, dorder) = g.moe_group(&g.upload(local).unwrap(), held + 1).unwrap();
    assert_eq!(g.download(&doff).unwrap(), off.iter().map(|&x| x as i32).collect::<Vec<_>>(), "offsets");
    assert_eq!(g.download(&dorder).unwrap(), order.iter().map(|&x| x as i32).collect::<Vec<_>>(), "order");
    let tiles = g.moe_tiles(&doff, held, local.len()).unwrap();
    let want = cpu::moe::tiles(&off, held, TOK);
    assert_eq!(download_tiles(g, &tiles), want, "tiles");
    ((dorder, tiles), (order, want))
}

pub fn moe_tiles_match_cpu_for_skewed_routing<R: Runtime>(g: &Kernels<R>, _t: &Tol) {
    // 160 assignments over 6 held experts: expert 2 takes 70% (14 tiles), experts 1, 3, 4 none,
    // 10% go to the not-held bucket (6), which must get no tile.
    let held = 6;
    let local: Vec<i32> = (0..160)
        .map(|a| match a % 10 {
            0..=6 => 2,
            7 => 0,
            8 => 5,
            _ => held as i32,
        })
        .collect();
    let (_, (_, tiles)) = group_and_tile(g, &local, held);
    assert_eq!(tiles.iter().filter(|t| t.expert == 2).count(), 14);
    assert!(tiles.iter().all(|t| t.expert < held && (1..=TOK).contains(&t.slots)));
    eprintln!("moe tiles: {} tiles for 160 assignments, expert 2 in 14", tiles.len());
    // Everything routed elsewhere: no tiles at all.
    let (_, (_, tiles)) = group_and_tile(g, &[held as i32; 12], held);
    assert!(tiles.is_empty());
}

/// A stacked expert weight in one format, on the device and on the CPU.
enum DevW<R: Runtime> {
    Bf16(R::Buf<u16>, usize, usize),
    F32(R::Buf<f32>, usize, usize),
    Int(DevGrouped<R>),
    Cubic(DevGrouped<R>),
    Mxfp4(DevMxfp4<R>),
}

enum CpuW {
    Bf16(Vec<u16>, usize, usize),
    F32(Vec<f32>, usize, usize),
    Int(cpu::quant_int::IntMatrix),
    Cubic(cpu::cubic::AnyCubic),
    Mxfp4(cpu::mxfp4::Mxfp4Matrix),
}

impl<R: Runtime> DevW<R> {
    fn view(&self) -> ExpertWeight<'_, R> {
        match self {
            DevW::Bf16(w, rows, cols) => ExpertWeight::Bf16 { w, rows: *rows, cols: *cols },
            DevW::F32(w, rows, cols) => ExpertWeight::F32 { w, rows: *rows, cols: *cols },
            DevW::Int(w) => ExpertWeight::Quant(QuantWeight::Int(w)),
            DevW::Cubic(w) => ExpertWeight::Quant(QuantWeight::Cubic(w)),
            DevW::Mxfp4(w) => ExpertWeight::Quant(QuantWeight::Mxfp4(w)),
        }
    }
}

impl CpuW {
    fn view(&self) -> ExpertRows<'_> {
        match self {
            CpuW::Bf16(w, rows, cols) => ExpertRows::Bf16 { w, rows: *rows, cols: *cols },
            CpuW::F32(w, rows, cols) => ExpertRows::F32 { w, rows: *rows, cols: *cols },
            CpuW::Int(m) => ExpertRows::Packed(m),
            CpuW::Cubic(m) => ExpertRows::Packed(m),
            CpuW::Mxfp4(m) => ExpertRows::Packed(m),
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Fmt {
    Bf16,
    F32,
    /// (bits, group size)
    Int(u32, usize),
    Cubic(u32, usize),
    Mxfp4,
}

/// Rows `keep` of a deterministic `rows × cols` weight of format `f` (the same values whatever
/// rows are kept, so expert sub-ranges slice one model). INT/Cubic rows are padded to int32
/// words, as compressed-tensors stores them (the INT4 word fast path applies when the group
/// allows).
fn weight<R: Runtime>(
    g: &Kernels<R>,
    f: Fmt,
    rows: usize,
    cols: usize,
    seed: u64,
    keep: Range<usize>,
) -> (DevW<R>, CpuW) {
    let kr = keep.len();
    match f {
        Fmt::Bf16 => {
            let all: Vec<u16> =
                uniform(rows * cols, seed, -0.2, 0.2).iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
            let w = all[keep.start * cols..keep.end * cols].to_vec();
            (DevW::Bf16(g.upload(&w).unwrap(), kr, cols), CpuW::Bf16(w, kr, cols))
        }
        Fmt::F32 => {
            let w = uniform(rows * cols, seed, -0.2, 0.2)[keep.start * cols..keep.end * cols].to_vec();
            (DevW::F32(g.upload(&w).unwrap(), kr, cols), CpuW::F32(w, kr, cols))
        }
        Fmt::Int(bits, gs) | Fmt::Cubic(bits, gs) => {
            let c = codes(rows * cols, bits, seed);
            let groups = cols.div_ceil(gs);
            let (p0, p1): (Vec<f32>, Vec<f32>) = match f {
                // bf16 scales and integer zero points, as checkpoints store them.
                Fmt::Int(..) => (
                    uniform(rows * groups, seed + 1, 1e-3, 2e-2)
                        .into_iter()
                        .map(|s| half::bf16::from_f32(s).to_f32())
                        .collect(),
                    codes(rows * groups, bits, seed + 2).into_iter().map(f32::from).collect(),
                ),
                _ => (uniform(rows * groups, seed + 1, -0.02, 0.02), uniform(rows * groups, seed + 2, 0.0, 1.0)),
            };
            let (p0, p1) = (&p0[keep.start * groups..keep.end * groups], &p1[keep.start * groups..keep.end * groups]);
            let dense = cpu::bitpack::row_bytes(cols, bits);
            let stride = dense.div_ceil(4) * 4;
            let mut bytes = vec![0u8; kr * stride];
            for (i, r) in keep.enumerate() {
                bytes[i * stride..i * stride + dense]
                    .copy_from_slice(&cpu::bitpack::pack_row(&c[r * cols..(r + 1) * cols], bits));
            }
            let dev = g.upload_grouped(g.upload_packed(bits, kr, cols, stride, &bytes).unwrap(), gs, p0, p1).unwrap();
            let packed = PackedRows::new(bits, kr, cols, stride, &bytes);
            match f {
                Fmt::Int(..) => (DevW::Int(dev), CpuW::Int(cpu::quant_int::IntMatrix::new(packed, gs, p0, p1))),
                _ => (DevW::Cubic(dev), CpuW::Cubic(cpu::cubic::AnyCubic::new(packed, gs, p0, p1))),
            }
        }
        Fmt::Mxfp4 => {
            let bytes = codes(rows * cols / 2, 8, seed);
            let scales: Vec<u8> = codes(rows * cols / 32, 3, seed + 1).into_iter().map(|e| 121 + e).collect();
            let (b, s) = (
                &bytes[keep.start * cols / 2..keep.end * cols / 2],
                &scales[keep.start * cols / 32..keep.end * cols / 32],
            );
            (
                DevW::Mxfp4(g.upload_mxfp4(kr, cols, b, s).unwrap()),
                CpuW::Mxfp4(cpu::mxfp4::Mxfp4Matrix::new(kr, cols, b, s)),
            )
        }
    }
}

const FORMATS: [Fmt; 6] = [Fmt::Int(4, 32), Fmt::Int(3, 40), Fmt::Cubic(3, 32), Fmt::Mxfp4, Fmt::Bf16, Fmt::F32];

pub fn moe_gemv_matches_cpu_for_every_format<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    // 19 tokens × top-3 over 5 held experts plus the bucket; expert 1 takes a third.
    let (n, k, held, rpe): (usize, usize, usize, usize) = (19, 3, 5, 38);
    let a = n * k;
    let mut r = lcg(91);
    let local: Vec<i32> = (0..a).map(|i| if i % 3 == 0 { 1 } else { (r() % (held as u32 + 1)) as i32 }).collect();
    let ((dorder, dtiles), (order, tiles)) = group_and_tile(g, &local, held);
    const UNTOUCHED: f32 = 1e-3;
    for (fi, f) in FORMATS.into_iter().enumerate() {
        // First projection (x_div = k: token rows) and down projection (x_div = 1: assignment rows).
        for (x_div, cols) in [(k, 256), (1, 96)] {
            let (dw, cw) = weight(g, f, held * rpe, cols, 40 + fi as u64, 0..held * rpe);
            let x = uniform(a.div_ceil(x_div) * cols, 7 + x_div as u64, -1.0, 1.0);
            let mut want = vec![UNTOUCHED; a * rpe];
            cpu::moe::moe_gemv(&cw.view(), rpe, &x, x_div, &order, &tiles, &mut want);
            let mut out = g.upload(&vec![UNTOUCHED; a * rpe]).unwrap();
            g.moe_gemv(dw.view(), rpe, &g.upload(&x).unwrap(), x_div, &dorder, &dtiles, &mut out, a).unwrap();
            let got = g.download(&out).unwrap();
            let what = format!("moe gemv {f:?} x_div={x_div} {rpe}x{cols}");
            for (ai, _) in local.iter().enumerate().filter(|(_, &l)| l as usize == held) {
                assert!(
                    got[ai * rpe..(ai + 1) * rpe].iter().all(|&v| v == UNTOUCHED),
                    "{what}: assignment {ai} (not held) was written"
                );
            }
            assert_close(&what, &got, &want, t.gemv);
        }
    }
    // Weight rows that do not split into experts, or a short output, are errors.
    let (dw, _) = weight(g, Fmt::Bf16, held * rpe, 96, 1, 0..held * rpe);
    let x = g.upload(&vec![0.0f32; a * 96]).unwrap();
    let mut out = g.zeros::<f32>(a * rpe).unwrap();
    assert!(g.moe_gemv(dw.view(), rpe + 1, &x, 1, &dorder, &dtiles, &mut out, a).is_err());
    assert!(g.moe_gemv(dw.view(), rpe, &x, 1, &dorder, &dtiles, &mut g.zeros::<f32>(a * rpe - 1).unwrap(), a).is_err());
}

/// The grouping and the bf16 expert GEMV at the sizes of a small model's layer (every expert
/// held: no bucket is routed to).
pub fn moe_grouping_and_expert_gemv_match_cpu<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    let (tokens, k, num_experts, rows, cols) = (37, 4, 16, 48, 256);
    let mut r = lcg(77);
    let experts: Vec<i32> = (0..tokens * k).map(|_| (r() % num_experts as u32) as i32).collect();
    let ((dorder, dtiles), (order, tiles)) = group_and_tile(g, &experts, num_experts);
    let (dw, cw) = weight(g, Fmt::Bf16, num_experts * rows, cols, 5, 0..num_experts * rows);
    let x = uniform(tokens * cols, 6, -1.0, 1.0);
    let mut want = vec![0.0; tokens * k * rows];
    cpu::moe::moe_gemv(&cw.view(), rows, &x, k, &order, &tiles, &mut want);
    let mut dout = g.zeros::<f32>(tokens * k * rows).unwrap();
    g.moe_gemv(dw.view(), rows, &g.upload(&x).unwrap(), k, &dorder, &dtiles, &mut dout, tokens * k).unwrap();
    assert_close("moe expert gemv bf16", &g.download(&dout).unwrap(), &want, t.gemv);
}

/// The prefill path: experts with more than `GEMM_MIN_TOKENS` slots are multiplied by gather →
/// (dequantise their rows) → bf16 GEMM → scatter, the rest by GEMV tiles; packed formats and bf16
/// experts (multiplied in place). Against the f32 CPU
/// reference over every expert's tiles: GEMV experts within the GEMV tolerance, GEMM experts
/// within the bf16 bound of the dense prefill GEMM, rows routed elsewhere untouched; the plan's
/// experts and tiles against the offsets.
pub fn moe_matmul_multiplies_crowded_experts_with_the_gemm<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    // 160 assignments (80 tokens × top-2) over 5 held experts and the bucket 5: expert 1 takes 45,
    // expert 3 34 (both GEMM), expert 2 exactly GEMM_MIN_TOKENS (tiles), 0 and 4 fewer.
    let (n, k, held, rpe) = (80usize, 2usize, 5usize, 38usize);
    let a = n * k;
    let counts = [(1, 45), (3, 34), (2, GEMM_MIN_TOKENS), (0, 20), (4, 9), (5, 20)];
    let mut local: Vec<i32> = counts.iter().flat_map(|&(e, c)| std::iter::repeat_n(e, c)).collect();
    assert_eq!(local.len(), a);
    let mut r = lcg(17);
    for i in (1..a).rev() {
        local.swap(i, r() as usize % (i + 1)); // interleave the experts' slots over the assignments
    }
    let (off, order) = cpu::moe::group_by_expert(&local, held + 1).unwrap();
    let (doff, dorder) = g.moe_group(&g.upload(&local).unwrap(), held + 1).unwrap();
    let all_tiles = cpu::moe::tiles(&off, held, TOK);

    // The plan: a decode-sized batch is all tiles; this one sends experts 1 and 3 to the GEMM.
    let decode = g.moe_plan(&doff, held, a, GEMM_MIN_TOKENS, true).unwrap();
    assert!(decode.gemm.is_empty());
    assert_eq!(download_tiles(g, &decode.tiles), all_tiles, "a decode-sized plan tiles every expert");
    let plan = g.moe_plan(&doff, held, a, n, true).unwrap();
    let gemm_experts: Vec<usize> = plan.gemm.iter().map(|s| s.expert).collect();
    assert_eq!(gemm_experts, [1, 3], "GEMM experts");
    for s in &plan.gemm {
        assert_eq!(
            (s.first, s.slots),
            (off[s.expert], off[s.expert + 1] - off[s.expert]),
            "expert {}'s slots",
            s.expert
        );
    }
    let tiled: Vec<cpu::moe::Tile> = all_tiles.iter().copied().filter(|t| !gemm_experts.contains(&t.expert)).collect();
    assert_eq!(download_tiles(g, &plan.tiles), tiled, "the plan's tiles leave the GEMM experts out");
    assert!(
        g.moe_plan(&doff, held, a, n, false).unwrap().gemm.is_empty(),
        "f32 experts are never planned for the GEMM"
    );

    const UNTOUCHED: f32 = 1e-3;
    let mut scratch = g.gemm_scratch(rpe * 256, 45 * 256).unwrap();
    for (fi, f) in [Fmt::Int(4, 32), Fmt::Int(3, 40), Fmt::Cubic(3, 32), Fmt::Mxfp4, Fmt::Bf16].into_iter().enumerate()
    {
        for (x_div, cols) in [(k, 256), (1, 96)] {
            let (dw, cw) = weight(g, f, held * rpe, cols, 60 + fi as u64, 0..held * rpe);
            let x = uniform(a.div_ceil(x_div) * cols, 3 + x_div as u64, -1.0, 1.0);
            let mut want = vec![UNTOUCHED; a * rpe];
            cpu::moe::moe_gemv(&cw.view(), rpe, &x, x_div, &order, &all_tiles, &mut want);
            let mut out = g.upload(&vec![UNTOUCHED; a * rpe]).unwrap();
            g.moe_matmul(dw.view(), rpe, &g.upload(&x).unwrap(), x_div, &dorder, &plan, &mut out, a, &mut scratch)
                .unwrap();
            let got = g.download(&out).unwrap();
            let what = format!("moe matmul {f:?} x_div={x_div} {rpe}x{cols}");
            let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            let (mut worst_gemv, mut worst_gemm) = (0.0f32, 0.0f64);
            for (ai, &e) in local.iter().enumerate() {
                let (gr, wr) = (&got[ai * rpe..(ai + 1) * rpe], &want[ai * rpe..(ai + 1) * rpe]);
                if e as usize == held {
                    assert!(gr.iter().all(|&v| v == UNTOUCHED), "{what}: assignment {ai} (not held) was written");
                } else if gemm_experts.contains(&(e as usize)) {
                    let xr = &x[(ai / x_div) * cols..][..cols];
                    for (r, (&gv, &wv)) in gr.iter().zip(wr).enumerate() {
                        let row = cw.view().row(e as usize * rpe + r);
                        let s: f64 = row.iter().zip(xr).map(|(&w, &v)| (w as f64 * v as f64).abs()).sum();
                        let frac = (gv as f64 - wv as f64).abs() / super::prefill_gemm::gemm_bound(s, cols);
                        assert!(
                            frac <= 1.0,
                            "{what}: assignment {ai} (expert {e}) row {r}: {gv} vs {wv} beyond the bf16 bound"
                        );
                        worst_gemm = worst_gemm.max(frac);
                    }
                } else {
                    worst_gemv = worst_gemv.max(kernels::compare::max_abs_error(gr, wr) / scale);
                }
            }
            eprintln!(
                "{what}: GEMV experts {worst_gemv:.2e} of max |ref|, GEMM experts {:.0}% of the bf16 bound",
                worst_gemm * 100.0
            );
            assert!(worst_gemv <= t.gemv, "{what}: GEMV experts' relative error {worst_gemv}");
        }
    }
    // A GEMM plan over f32 experts, or scratch too small for the widest expert, is an error.
    let (dw, _) = weight(g, Fmt::F32, held * rpe, 96, 1, 0..held * rpe);
    let (x, mut out) = (g.upload(&vec![0.0f32; a * 96]).unwrap(), g.zeros::<f32>(a * rpe).unwrap());
    assert!(g.moe_matmul(dw.view(), rpe, &x, 1, &dorder, &plan, &mut out, a, &mut scratch).is_err());
    let (qw, _) = weight(g, Fmt::Int(4, 32), held * rpe, 96, 1, 0..held * rpe);
    let mut short = g.gemm_scratch(rpe * 96, 44 * 96).unwrap();
    assert!(g.moe_matmul(qw.view(), rpe, &x, 1, &dorder, &plan, &mut out, a, &mut short).is_err());
}

pub fn moe_combine_matches_cpu<R: Runtime>(g: &Kernels<R>, _t: &Tol) {
    let (n, k, d, held) = (11, 4, 96, 5);
    let mut r = lcg(5);
    let local: Vec<i32> = (0..n * k).map(|_| (r() % (held as u32 + 1)) as i32).collect();
    let weights = uniform(n * k, 1, 0.0, 1.0);
    let y = uniform(n * k * d, 2, -3.0, 3.0);
    let out0 = uniform(n * d, 3, -1.0, 1.0);
    let mut want = out0.clone();
    cpu::moe::combine(&y, &weights, &local, held, n, k, d, &mut want);
    let mut out = g.upload(&out0).unwrap();
    g.moe_combine(
        &g.upload(&y).unwrap(),
        &g.upload(&weights).unwrap(),
        &g.upload(&local).unwrap(),
        held,
        n,
        k,
        d,
        &mut out,
    )
    .unwrap();
    // Fused multiply-adds in the same order are exact on every runtime.
    assert_eq!(g.download(&out).unwrap(), want, "moe_combine");
    eprintln!("moe combine: bit-identical");
}

/// One MoE layer's routed experts on the device, for the experts `held` (weights of those experts
/// only), added into `out`. Returns the routed assignments' global expert ids.
#[allow(clippy::too_many_arguments)]
fn device_layer<R: Runtime>(
    g: &Kernels<R>,
    logits: &R::Buf<f32>,
    bias: &R::Buf<f32>,
    spec: &RouterSpec,
    x: &R::Buf<f32>,
    n: usize,
    hidden: usize,
    inter: usize,
    held: Range<usize>,
    out: &mut R::Buf<f32>,
) -> Vec<i32> {
    let k = spec.top_k;
    let a = n * k;
    let h = held.len();
    let (gate_up, _) = weight(
        g,
        Fmt::Int(4, 32),
        spec.num_experts * 2 * inter,
        hidden,
        61,
        held.start * 2 * inter..held.end * 2 * inter,
    );
    let (down, _) = weight(g, Fmt::Mxfp4, spec.num_experts * hidden, inter, 62, held.start * hidden..held.end * hidden);
    let mut routed = routed(g, a);
    g.moe_route(logits, Some(bias), spec, n, held, &mut routed).unwrap();
    let (offsets, order) = g.moe_group(&routed.local, h + 1).unwrap();
    let tiles = g.moe_tiles(&offsets, h, a).unwrap();
    let mut gu = g.zeros::<f32>(a * 2 * inter).unwrap();
    g.moe_gemv(gate_up.view(), 2 * inter, x, k, &order, &tiles, &mut gu, a).unwrap();
    let mut act = g.zeros::<f32>(a * inter).unwrap();
    g.silu_mul(&gu, &mut act, a, inter).unwrap();
    let mut y = g.zeros::<f32>(a * hidden).unwrap();
    g.moe_gemv(down.view(), hidden, &act, 1, &order, &tiles, &mut y, a).unwrap();
    g.moe_combine(&y, &routed.weights, &routed.local, h, n, k, hidden, out).unwrap();
    g.download(&routed.experts).unwrap()
}

pub fn moe_layer_end_to_end_matches_per_token_cpu<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    let (n, hidden, inter) = (13, 128, 32);
    let spec = spec(RouterScoring::Sigmoid, RouterTopk::NoauxTc, 16, 4, 2, 4, true, 2.5);
    let e = spec.num_experts;
    let x = uniform(n * hidden, 1, -1.0, 1.0);
    let router = uniform(e * hidden, 2, -0.2, 0.2);
    let bias = uniform(e, 3, -0.1, 0.1);
    let dx = g.upload(&x).unwrap();
    let mut dlogits = g.zeros::<f32>(n * e).unwrap();
    g.matmul_f32(&dx, &g.upload(&router).unwrap(), &mut dlogits, n, e, hidden).unwrap();
    let logits = g.download(&dlogits).unwrap();
    let mut want_logits = vec![0.0; n * e];
    cpu::matmul::matmul_t(&x, &router, &mut want_logits, n, hidden, e);
    assert_close("router matmul_f32", &logits, &want_logits, t.gemv);

    // The reference: each token on its own, from the device's logits (so the choice is the same).
    let (_, gate_up) = weight(g, Fmt::Int(4, 32), e * 2 * inter, hidden, 61, 0..e * 2 * inter);
    let (_, down) = weight(g, Fmt::Mxfp4, e * hidden, inter, 62, 0..e * hidden);
    let (gate_up, down) = (gate_up.view(), down.view());
    let dot = |w: &[f32], v: &[f32]| -> f32 { w.iter().zip(v).map(|(a, b)| a * b).sum() };
    let mut want = vec![0.0f32; n * hidden];
    let mut want_experts = Vec::new();
    for tok in 0..n {
        let xt = &x[tok * hidden..(tok + 1) * hidden];
        let (ids, ws) = cpu::moe::route_token(&spec, &logits[tok * e..(tok + 1) * e], Some(&bias));
        for (&ex, &w) in ids.iter().zip(&ws) {
            let ex = ex as usize;
            let gate: Vec<f32> = (0..inter).map(|i| dot(&gate_up.row(ex * 2 * inter + i), xt)).collect();
            let up: Vec<f32> = (0..inter).map(|i| dot(&gate_up.row(ex * 2 * inter + inter + i), xt)).collect();
            let mut act = vec![0.0; inter];
            cpu::activation::silu_mul(&gate, &up, &mut act);
            for (o, r) in want[tok * hidden..(tok + 1) * hidden].iter_mut().zip(0..hidden) {
                *o += w * dot(&down.row(ex * hidden + r), &act);
            }
            want_experts.push(ex as i32);
        }
    }

    let dbias = g.upload(&bias).unwrap();
    let mut whole = g.zeros::<f32>(n * hidden).unwrap();
    let experts = device_layer(g, &dlogits, &dbias, &spec, &dx, n, hidden, inter, 0..e, &mut whole);
    assert_eq!(experts, want_experts, "routing from the device's logits");
    let whole = g.download(&whole).unwrap();
    assert_close("moe layer (all experts held)", &whole, &want, t.gemv);

    // Expert parallelism: two devices' worth of experts, each adding its share.
    let mut split = g.zeros::<f32>(n * hidden).unwrap();
    for held in [0..6, 6..e] {
        device_layer(g, &dlogits, &dbias, &spec, &dx, n, hidden, inter, held, &mut split);
    }
    let split = g.download(&split).unwrap();
    assert_close("moe layer (experts 0..6 + 6..16)", &split, &want, t.gemv);
    assert_close("moe layer split vs whole", &split, &whole, t.gemv);
}
