//! The prefill GEMM path (`kernels/cuda/dequant.cu` + the bf16 GEMM, chosen by
//! `Kernels::matmul_quant`) against the CPU references, written once over any runtime and run by
//! `cuda_vs_cpu.rs` on the simulator and on a CUDA device.
//!
//! * Dequantisation must equal `cpu::dequant` bit for bit (both round the format's exact f32
//!   weight to nearest even).
//! * `matmul_quant` must match the CPU quantized matmul (f32 weights, f32 activations): within
//!   the runtime's GEMV tolerance of the largest output on the GEMV side; on the GEMM side within the error the bf16
//!   narrowing of weights and activations can cause, bounded per output (see [`gemm_bound`]).

use super::test_data::{codes, uniform};
use kernels::cpu;
use kernels::cpu::bitpack::PackedRows;
use kernels::cpu::dequant::DequantizeRows;
use kernels::gpu::{DevGrouped, Kernels, MatmulPath, QuantWeight, Runtime, GEMM_MIN_TOKENS};

/// Shapes with rows not a multiple of the GEMV's 4-row blocks and, for the group formats, cols
/// not a multiple of the group (a partial last group): (bits, rows, cols, group size).
const GROUPED: &[(u32, usize, usize, usize)] =
    &[(4, 37, 200, 64), (4, 64, 384, 128), (8, 33, 256, 64), (3, 17, 200, 32), (2, 9, 96, 32)];
/// MXFP4 (rows, cols): cols is a multiple of the 32-input block by definition.
const MXFP4: &[(usize, usize)] = &[(70, 640), (3, 32)];

/// A group-quantised matrix on both sides; rows padded to int32 words as compressed-tensors
/// stores them (the INT4 GEMV's word fast path then applies where the group allows).
struct Grouped<R: Runtime, C> {
    dev: DevGrouped<R>,
    cpu: C,
}

fn packed<R: Runtime>(
    k: &Kernels<R>,
    bits: u32,
    rows: usize,
    cols: usize,
    seed: u64,
) -> (kernels::gpu::DevPacked<R>, PackedRows) {
    let c = codes(rows * cols, bits, seed);
    let dense = cpu::bitpack::row_bytes(cols, bits);
    let stride = dense.div_ceil(4) * 4;
    let mut bytes = vec![0u8; rows * stride];
    for r in 0..rows {
        bytes[r * stride..r * stride + dense]
            .copy_from_slice(&cpu::bitpack::pack_row(&c[r * cols..(r + 1) * cols], bits));
    }
    (k.upload_packed(bits, rows, cols, stride, &bytes).unwrap(), PackedRows::new(bits, rows, cols, stride, &bytes))
}

fn int_matrix<R: Runtime>(
    k: &Kernels<R>,
    bits: u32,
    rows: usize,
    cols: usize,
    gs: usize,
) -> Grouped<R, cpu::quant_int::IntMatrix> {
    let groups = rows * cols.div_ceil(gs);
    // bf16 scales and integer zero points, as checkpoints store them.
    let scale: Vec<f32> =
        uniform(groups, 5 + bits as u64, 1e-3, 2e-2).into_iter().map(|s| half::bf16::from_f32(s).to_f32()).collect();
    let zero: Vec<f32> = codes(groups, bits, 6).into_iter().map(f32::from).collect();
    let (dev, rows_cpu) = packed(k, bits, rows, cols, bits as u64 * 31 + cols as u64);
    Grouped {
        dev: k.upload_grouped(dev, gs, &scale, &zero).unwrap(),
        cpu: cpu::quant_int::IntMatrix::new(rows_cpu, gs, &scale, &zero),
    }
}

fn cubic_matrix<R: Runtime>(
    k: &Kernels<R>,
    bits: u32,
    rows: usize,
    cols: usize,
    gs: usize,
) -> Grouped<R, cpu::cubic::AnyCubic> {
    let groups = rows * cols.div_ceil(gs);
    let s = uniform(groups, 7 + bits as u64, -0.02, 0.02);
    let a = uniform(groups, 8, 0.0, 1.0);
    let (dev, rows_cpu) = packed(k, bits, rows, cols, bits as u64 * 17 + rows as u64);
    Grouped { dev: k.upload_grouped(dev, gs, &s, &a).unwrap(), cpu: cpu::cubic::AnyCubic::new(rows_cpu, gs, &s, &a) }
}

/// Scales 2^-6 .. 2^1; with `extremes` the first blocks get E8M0 0 (2^-127: subnormal weights),
/// 254 (6·2^127 overflows to infinity) and 255 (NaN), which only the dequant test can use.
fn mxfp4_matrix<R: Runtime>(
    k: &Kernels<R>,
    rows: usize,
    cols: usize,
    extremes: bool,
) -> (kernels::gpu::DevMxfp4<R>, cpu::mxfp4::Mxfp4Matrix) {
    let codes = codes(rows * cols / 2, 8, 3 + rows as u64);
    let mut scales: Vec<u8> = self::codes(rows * cols / 32, 3, 4).into_iter().map(|e| 121 + e).collect();
    if extremes {
        for (s, e) in scales.iter_mut().zip([0u8, 254, 255]) {
            *s = e;
        }
    }
    (k.upload_mxfp4(rows, cols, &codes, &scales).unwrap(), cpu::mxfp4::Mxfp4Matrix::new(rows, cols, &codes, &scales))
}

fn assert_dequant<R: Runtime>(k: &Kernels<R>, what: &str, w: QuantWeight<'_, R>, want: &[u16]) {
    // A scratch larger than the matrix: the kernel must write exactly rows × cols elements.
    let mut out = k.upload(&vec![0xdeadu16; want.len() + 7]).unwrap();
    k.dequant_bf16(w, &mut out).unwrap();
    let got = k.download(&out).unwrap();
    // NaN payloads are the hardware's (CUDA arithmetic returns its canonical NaN, x86 keeps the
    // operand's): any NaN matches any NaN, everything else bit for bit.
    let is_nan = |b: u16| b & 0x7f80 == 0x7f80 && b & 0x7f != 0;
    let bad = got.iter().zip(want).position(|(&a, &b)| a != b && !(is_nan(a) && is_nan(b)));
    assert!(
        bad.is_none(),
        "{what}: element {} is {:#06x}, want {:#06x}",
        bad.unwrap(),
        got[bad.unwrap()],
        want[bad.unwrap()]
    );
    assert!(got[want.len()..].iter().all(|&v| v == 0xdead), "{what}: wrote past rows × cols");
    eprintln!("{what}: {} bf16 weights bit-exact", want.len());
}

/// Every dequant kernel and the activation narrowing, bit for bit against `cpu::dequant`.
pub fn dequant_matches_cpu_bit_for_bit<R: Runtime>(k: &Kernels<R>) {
    for &(bits, rows, cols, gs) in GROUPED {
        let w = int_matrix(k, bits, rows, cols, gs);
        assert_dequant(
            k,
            &format!("dequant int{bits} {rows}x{cols} g{gs}"),
            QuantWeight::Int(&w.dev),
            &cpu::dequant::dequantize_bf16(&w.cpu),
        );
        let w = cubic_matrix(k, bits, rows, cols, gs);
        assert_dequant(
            k,
            &format!("dequant cubic{bits} {rows}x{cols} g{gs}"),
            QuantWeight::Cubic(&w.dev),
            &cpu::dequant::dequantize_bf16(&w.cpu),
        );
    }
    for &(rows, cols) in MXFP4 {
        let (dev, host) = mxfp4_matrix(k, rows, cols, true);
        assert_dequant(
            k,
            &format!("dequant mxfp4 {rows}x{cols}"),
            QuantWeight::Mxfp4(&dev),
            &cpu::dequant::dequantize_bf16(&host),
        );
    }
    // Ties to even both ways, a value just under a tie, infinities, NaN, subnormals, -0.
    let mut x = vec![
        1.0f32,
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x3f80_7fff),
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(1),
        -0.0,
        f32::MAX,
    ];
    x.extend(uniform(1000, 9, -3.0, 3.0));
    let want = cpu::dequant::f32_to_bf16_rows(&x);
    let mut out = k.zeros::<u16>(x.len()).unwrap();
    k.f32_to_bf16_rows(&k.upload(&x).unwrap(), &mut out, x.len()).unwrap();
    assert_eq!(k.download(&out).unwrap(), want, "f32_to_bf16_rows");
}

/// Per-output bound on |bf16-path result − f32 reference| for out_i = Σ_j w_ij·x_j over `k`
/// inputs: narrowing w and x to bf16 (unit roundoff u = 2^-9 each) perturbs each product by at
/// most (2u + u²)|w_ij x_j|, and each side's f32 accumulation adds at most about
/// k·2^-24·Σ|w_ij x_j| whatever the summation order. Hence (2^-8 + 2^-18 + 2k·2^-24)·S_i with
/// S_i = Σ_j |w_ij x_j| (computed from the CPU's dequantised weights), plus 1e-30 for S_i = 0.
pub fn gemm_bound(s_i: f64, k: usize) -> f64 {
    ((2f64.powi(-8) + 2f64.powi(-18) + 2.0 * k as f64 * 2f64.powi(-24)) * s_i) * 1.001 + 1e-30
}

fn check_matmul<R: Runtime>(
    k: &Kernels<R>,
    what: &str,
    w: QuantWeight<'_, R>,
    host: &impl DequantizeRows,
    gemv_tol: f32,
    reference: impl Fn(&[f32], &mut [f32], usize),
) {
    let (rows, cols) = (host.rows(), host.cols());
    let dense: Vec<Vec<f32>> = (0..rows).map(|r| host.dequantize_row(r)).collect();
    let max_n = 77;
    let mut scratch = k.gemm_scratch(rows * cols, max_n * cols).unwrap();
    for n in [1, GEMM_MIN_TOKENS, GEMM_MIN_TOKENS + 1, max_n] {
        let x = uniform(n * cols, n as u64 + cols as u64, -1.0, 1.0);
        let mut want = vec![0.0; n * rows];
        reference(&x, &mut want, n);
        let dx = k.upload(&x).unwrap();
        let mut dout = k.zeros::<f32>(n * rows).unwrap();
        let path = k.matmul_quant(w, &dx, &mut dout, n, &mut scratch).unwrap();
        let got = k.download(&dout).unwrap();
        assert_eq!(path, if n <= GEMM_MIN_TOKENS { MatmulPath::Gemv } else { MatmulPath::DequantGemm }, "{what} n={n}");
        match path {
            MatmulPath::Gemv => {
                let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
                let worst = kernels::compare::max_abs_error(&got, &want) / scale;
                eprintln!("{what} n={n} (GEMV): max error {worst:.2e} of max |ref| {scale:.3}");
                assert!(worst <= gemv_tol, "{what} n={n}: GEMV relative error {worst} > {gemv_tol}");
            }
            MatmulPath::DequantGemm => {
                // The worst error as a fraction of its own bound (must stay <= 1).
                let mut worst = 0.0f64;
                for t in 0..n {
                    let xt = &x[t * cols..(t + 1) * cols];
                    for (r, wr) in dense.iter().enumerate() {
                        let s: f64 = wr.iter().zip(xt).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                        let err = (got[t * rows + r] as f64 - want[t * rows + r] as f64).abs();
                        let frac = err / gemm_bound(s, cols);
                        assert!(
                            frac <= 1.0,
                            "{what} n={n} token {t} row {r}: {} vs {} (error {err:.3e} > bound {:.3e})",
                            got[t * rows + r],
                            want[t * rows + r],
                            gemm_bound(s, cols)
                        );
                        worst = worst.max(frac);
                    }
                }
                eprintln!("{what} n={n} (dequant + bf16 GEMM): worst error {:.0}% of the bf16 bound", worst * 100.0);
            }
        }
    }
}

/// `matmul_quant` for INT (bits 2/3/4/8), Cubic (same widths) and MXFP4, odd shapes, batches on
/// both sides of `GEMM_MIN_TOKENS`.
pub fn matmul_quant_matches_cpu<R: Runtime>(k: &Kernels<R>, gemv_tol: f32) {
    for &(bits, rows, cols, gs) in GROUPED {
        let w = int_matrix(k, bits, rows, cols, gs);
        check_matmul(
            k,
            &format!("int{bits} {rows}x{cols} g{gs}"),
            QuantWeight::Int(&w.dev),
            &w.cpu,
            gemv_tol,
            |x, o, n| w.cpu.matmul_t(x, o, n),
        );
        let w = cubic_matrix(k, bits, rows, cols, gs);
        check_matmul(
            k,
            &format!("cubic{bits} {rows}x{cols} g{gs}"),
            QuantWeight::Cubic(&w.dev),
            &w.cpu,
            gemv_tol,
            |x, o, n| w.cpu.matmul_t(x, o, n),
        );
    }
    for &(rows, cols) in MXFP4 {
        let (dev, host) = mxfp4_matrix(k, rows, cols, false);
        check_matmul(k, &format!("mxfp4 {rows}x{cols}"), QuantWeight::Mxfp4(&dev), &host, gemv_tol, |x, o, n| {
            host.matmul_t(x, o, n)
        });
    }
}
