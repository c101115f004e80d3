//! QuantTrio's Cubic format (`cubic-pack-quantized`, QuantTrio/vllm-cubic
//! `vllm/model_executor/layers/quantization/cubic.py`), A16: weights decoded exactly in f32.
//!
//! Per row, a little-endian bit stream of `bits`-bit codes (`ceil(cols·bits/8)` bytes). For
//! `bits >= 2` a code is two's complement in `[-M, M]`, `M = 2^(bits-1) - 1`, the raw value
//! `-2^(bits-1)` reserved and read as 0; for 1 bit, bit 1 is +1 and bit 0 is -1. A group of
//! `group_out` rows × `group_in` columns shares an f32 scale and f16 `a`, `b`:
//!
//! ```text
//! t = |c| / M,   L(t) = t·(a + t·(b + t·(1 - a - b))),   w = sign(c)·(scale·L(t))   (bits ≥ 2)
//! w = c·scale                                                                        (1 bit)
//! ```
//!
//! in f32, in that order (the authors' `dequantize_cubic`; fixtures from it are compared bit for
//! bit in `host/../tests/reference_cubic_pack.rs`). Each group's `2M + 1` values are computed once
//! into a table, so a row decodes by lookup.
//!
//! Dynamic A8 (their `VLLM_CUBIC_DYNAMIC_A8=1`, here `--cpu-activations int8`): each weight as
//! its int8 carrier `clamp(round_half_even(sign(c)·L(t)·127), ±127)` (±127 for 1 bit), each input
//! row quantised to int8 by its absmax (`x_q = round(x·127/amax)`, ties away from zero as their
//! kernel's `libdevice.round`), integer dot products per input group, then
//! `y += acc · ((x_scale · scale) / 127)` group by group, as their reference
//! `_reference_dynamic_a8_linear` orders it.
//!
//! Hand-written rather than dequantised at load because the point of the format is the 2-3 bits
//! per weight in memory; these are the plain (scalar, rayon over rows) kernels, not yet SIMD.

use rayon::prelude::*;

/// One packed Cubic matrix `[rows, cols]` (`y = x·Wᵀ`).
pub struct CubicPackMatrix {
    bits: u32,
    rows: usize,
    cols: usize,
    group_out: usize,
    group_in: usize,
    /// `rows` × `row_bytes` code bytes.
    packed: Vec<u8>,
    /// Per group (`[ceil(rows/group_out), ceil(cols/group_in)]` row-major): scale, a, b (a, b
    /// already widened from f16).
    scale: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    /// Multiply with int8 activations and the weights' int8 carriers (dynamic A8).
    a8: bool,
}

/// Bytes of one packed row.
pub fn row_bytes(cols: usize, bits: u32) -> usize {
    (cols * bits as usize).div_ceil(8)
}

/// The signed code of element `i` of a packed row.
#[inline]
pub fn code(row: &[u8], i: usize, bits: u32) -> i32 {
    let bit = i * bits as usize;
    let (byte, shift) = (bit / 8, bit % 8);
    // A code spans at most two bytes (bits ≤ 8).
    let lo = row[byte] as u32;
    let hi = row.get(byte + 1).copied().unwrap_or(0) as u32;
    let raw = ((lo | (hi << 8)) >> shift) & ((1u32 << bits) - 1);
    if bits == 1 {
        return raw as i32 * 2 - 1;
    }
    let sign_bit = 1u32 << (bits - 1);
    if raw == sign_bit {
        0 // the reserved code
    } else if raw > sign_bit {
        raw as i32 - (1i32 << bits)
    } else {
        raw as i32
    }
}

/// The signed level of code `c` in a group with `a`, `b`: `sign(c)·L(|c|/M)` in the reference's
/// f32 order (`c` itself for 1 bit). Multiplying by the sign (±1 or 0) is exact, so the
/// reference's `sign·(scale·L)` equals `scale·level` bit for bit.
#[inline]
fn level(c: i32, bits: u32, a: f32, b: f32) -> f32 {
    let cf = c as f32;
    if bits == 1 {
        return cf;
    }
    let m = ((1u32 << (bits - 1)) - 1) as f32;
    let t = cf.abs() / m;
    let normalized = t * (a + t * (b + t * (1.0 - a - b)));
    // torch.sign(0) is 0.
    let sign = if cf > 0.0 {
        1.0
    } else if cf < 0.0 {
        -1.0
    } else {
        0.0
    };
    sign * normalized
}

/// The weight a code stands for in a group with `scale`, `a`, `b`.
#[inline]
pub fn value(c: i32, bits: u32, scale: f32, a: f32, b: f32) -> f32 {
    scale * level(c, bits, a, b)
}

/// The int8 carrier of code `c` in a group with `a`, `b`: `round_half_even(sign·L(t)·127)`.
pub fn carrier(c: i32, bits: u32, a: f32, b: f32) -> i8 {
    (level(c, bits, a, b) * 127.0).round_ties_even().clamp(-127.0, 127.0) as i8
}

impl CubicPackMatrix {
    /// `packed` is `rows × row_bytes(cols, bits)`; `scale`, `a`, `b` are
    /// `[ceil(rows/group_out), ceil(cols/group_in)]`. Panics on inconsistent sizes (callers check
    /// the checkpoint's shapes first and report them).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        bits: u32,
        rows: usize,
        cols: usize,
        group_out: usize,
        group_in: usize,
        packed: Vec<u8>,
        scale: Vec<f32>,
        a: Vec<f32>,
        b: Vec<f32>,
    ) -> Self {
        assert!((1..=8).contains(&bits), "Cubic bits {bits} outside 1..=8");
        assert!(group_out > 0 && group_in > 0, "Cubic group sizes must be positive");
        assert_eq!(packed.len(), rows * row_bytes(cols, bits), "Cubic codes size");
        let groups = rows.div_ceil(group_out) * cols.div_ceil(group_in);
        assert!(scale.len() == groups && a.len() == groups && b.len() == groups, "Cubic metadata size");
        Self { bits, rows, cols, group_out, group_in, packed, scale, a, b, a8: false }
    }

    /// The same matrix multiplying in dynamic-A8 mode.
    pub fn with_a8(self) -> Self {
        Self { a8: true, ..self }
    }

    pub fn is_a8(&self) -> bool {
        self.a8
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// Bytes a forward pass reads: codes plus the groups' scale (f32), a and b (f16 stored).
    pub fn bytes(&self) -> usize {
        self.packed.len() + self.scale.len() * 8
    }

    /// The signed codes of row `r`.
    pub fn codes_row(&self, r: usize) -> Vec<i32> {
        let row = self.row(r);
        (0..self.cols).map(|i| code(row, i, self.bits)).collect()
    }

    fn row(&self, r: usize) -> &[u8] {
        let rb = row_bytes(self.cols, self.bits);
        &self.packed[r * rb..(r + 1) * rb]
    }

    /// `out[i] = entry(code i, its group's metadata index)` for row `r`, through a per-group
    /// table of what the `2M + 1` (or 2) codes a group can hold map to.
    fn map_row<T: Copy + Default>(&self, r: usize, out: &mut [T], entry: impl Fn(i32, usize) -> T) {
        let (bits, row) = (self.bits, self.row(r));
        let groups_per_row = self.cols.div_ceil(self.group_in);
        let m = if bits == 1 { 1 } else { (1i32 << (bits - 1)) - 1 };
        let mut table = vec![T::default(); (2 * m + 1) as usize];
        for g in 0..groups_per_row {
            let meta = (r / self.group_out) * groups_per_row + g;
            for (k, t) in table.iter_mut().enumerate() {
                *t = entry(k as i32 - m, meta);
            }
            for i in g * self.group_in..((g + 1) * self.group_in).min(self.cols) {
                out[i] = table[(code(row, i, bits) + m) as usize];
            }
        }
    }

    /// Row `r` decoded to f32 into `out` (`cols` long).
    pub fn decode_row_into(&self, r: usize, out: &mut [f32]) {
        self.map_row(r, out, |c, meta| value(c, self.bits, self.scale[meta], self.a[meta], self.b[meta]));
    }

    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let mut out = vec![0.0; self.cols];
        self.decode_row_into(r, &mut out);
        out
    }

    /// Row `r`'s int8 carriers (their `materialize_cubic_a8_carrier`).
    pub fn carrier_row(&self, r: usize) -> Vec<i8> {
        let mut out = vec![0i8; self.cols];
        self.map_row(r, &mut out, |c, meta| carrier(c, self.bits, self.a[meta], self.b[meta]));
        out
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ`: each output row decoded once and dotted with every
    /// input row (in dynamic-A8 mode when the matrix is set to it).
    pub fn matmul_t(&self, x: &[f32], out: &mut [f32], n: usize) {
        assert_eq!(x.len(), n * self.cols, "Cubic matmul input");
        assert_eq!(out.len(), n * self.rows, "Cubic matmul output");
        if self.a8 {
            return self.matmul_t_a8(x, out, n);
        }
        let cols = self.cols;
        let columns: Vec<Vec<f32>> = (0..self.rows)
            .into_par_iter()
            .map_init(
                || vec![0.0f32; cols],
                |w, r| {
                    self.decode_row_into(r, w);
                    x.chunks_exact(cols).map(|xr| crate::cpu::dot::dot(xr, w)).collect()
                },
            )
            .collect();
        scatter_columns(&columns, out, self.rows);
    }
}

/// `out[t, r] = columns[r][t]`: per-output-row results into the row-major `[n, rows]` output.
fn scatter_columns(columns: &[Vec<f32>], out: &mut [f32], rows: usize) {
    for (r, col) in columns.iter().enumerate() {
        for (t, v) in col.iter().enumerate() {
            out[t * rows + r] = *v;
        }
    }
}

impl CubicPackMatrix {
    /// Dynamic A8: see the module comment.
    fn matmul_t_a8(&self, x: &[f32], out: &mut [f32], n: usize) {
        let cols = self.cols;
        let quantised: Vec<(Vec<i8>, f32)> = x.chunks_exact(cols).map(quantize_row_int8).collect();
        debug_assert_eq!(quantised.len(), n);
        let groups_per_row = cols.div_ceil(self.group_in);
        let columns: Vec<Vec<f32>> = (0..self.rows)
            .into_par_iter()
            .map(|r| {
                let w = self.carrier_row(r);
                quantised
                    .iter()
                    .map(|(xq, x_scale)| {
                        let mut y = 0.0f32;
                        for g in 0..groups_per_row {
                            let span = g * self.group_in..((g + 1) * self.group_in).min(cols);
                            let acc: i32 =
                                xq[span.clone()].iter().zip(&w[span]).map(|(&a, &b)| a as i32 * b as i32).sum();
                            let s = self.scale[(r / self.group_out) * groups_per_row + g];
                            y += acc as f32 * ((x_scale * s) / 127.0);
                        }
                        y
                    })
                    .collect()
            })
            .collect();
        scatter_columns(&columns, out, self.rows);
    }
}

/// A row's int8 quantisation and scale (`per_token_quant_int8`): `amax = max(max|x|, 1e-10)`,
/// `x_q = round(x · (127 / amax))` with ties away from zero, scale `amax / 127`.
pub fn quantize_row_int8(x: &[f32]) -> (Vec<i8>, f32) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-10);
    let inv = 127.0 / amax;
    (x.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8).collect(), amax / 127.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_bit_stream_reads_as_the_authors_example() {
        // cubic-format notes §4: [-1, 1, -1, -1, 1, 1, -1, 1] packs to 0b10110010.
        let row = [0b1011_0010u8];
        let codes: Vec<i32> = (0..8).map(|i| code(&row, i, 1)).collect();
        assert_eq!(codes, vec![-1, 1, -1, -1, 1, 1, -1, 1]);
    }

    #[test]
    fn three_bit_codes_straddle_bytes_and_the_reserved_code_is_zero() {
        // Codes 3, -3, 0(reserved raw 100), 1, -1 at 3 bits: raw 011, 101, 100, 001, 111.
        let raws = [0b011u32, 0b101, 0b100, 0b001, 0b111];
        let mut bits = 0u64;
        for (i, r) in raws.iter().enumerate() {
            bits |= (*r as u64) << (3 * i);
        }
        let row = bits.to_le_bytes();
        let got: Vec<i32> = (0..5).map(|i| code(&row[..2], i, 3)).collect();
        assert_eq!(got, vec![3, -3, 0, 1, -1]);
    }

    #[test]
    fn levels_end_at_the_scale_and_matmul_uses_the_decoded_rows() {
        // 2 bits: codes ±1 map to ±scale whatever (a, b).
        assert_eq!(value(1, 2, 0.5, 0.3, 0.2), 0.5);
        assert_eq!(value(-1, 2, 0.5, 0.3, 0.2), -0.5);
        assert_eq!(value(0, 2, 0.5, 0.3, 0.2), 0.0);
        // A 2 × 4 matrix of 2-bit codes [1, -1, 0, 1] / [0, 0, 1, 1], one group per row.
        let enc = |c: [i32; 4]| -> u8 { c.iter().enumerate().map(|(i, v)| ((*v as u8) & 3) << (2 * i)).sum() };
        let m = CubicPackMatrix::new(
            2,
            2,
            4,
            1,
            4,
            vec![enc([1, -1, 0, 1]), enc([0, 0, 1, 1])],
            vec![2.0, 3.0],
            vec![0.5, 0.5],
            vec![0.0, 0.0],
        );
        assert_eq!(m.dequantize_row(0), vec![2.0, -2.0, 0.0, 2.0]);
        let mut out = vec![0.0; 2];
        m.matmul_t(&[1.0, 2.0, 3.0, 4.0], &mut out, 1);
        assert_eq!(out, vec![2.0 - 4.0 + 8.0, 9.0 + 12.0]);
    }
}
