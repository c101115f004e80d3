//! Round-to-nearest integer quantization into compressed-tensors `pack-quantized` tensors, with
//! compressed-tensors' min/max rule (`calculate_qparams`): range widened to include 0; symmetric
//! `scale = max|w| / ((2^b − 1)/2)`, asymmetric `scale = (max − min)/(2^b − 1)`,
//! `zp = clamp(round(q_min − min/scale))`; `q = clamp(round(w/scale + zp))`. Scales are stored
//! bf16 and quantization uses the stored (rounded) scale, so the checkpoint reproduces exactly
//! what is measured here.

use half::bf16;
use kernels::cpu::bitpack::pack_row;
use rayon::prelude::*;

use super::stats::Stats;

pub struct IntTensors {
    /// `weight_packed` bytes: `rows × words` little-endian int32 words of dense codes.
    pub packed: Vec<u8>,
    pub words: usize,
    /// `weight_scale` bf16 bits, `[rows, groups]`.
    pub scale: Vec<u16>,
    /// `weight_zero_point` bytes (int32 `[ceil(rows·b/32), groups]`, packed along dim 0).
    pub zero_point: Option<Vec<u8>>,
    pub stats: Stats,
}

struct Row {
    codes: Vec<u8>,
    scale: Vec<u16>,
    zero: Vec<u8>,
    stats: Stats,
}

fn quantize_row(w: &[f32], bits: u32, gs: usize, symmetric: bool) -> Row {
    let (qmin, qmax) = (-(1i32 << (bits - 1)) as f32, ((1i32 << (bits - 1)) - 1) as f32);
    let offset = (1i32 << (bits - 1)) as f32;
    let mut r =
        Row { codes: Vec::with_capacity(w.len()), scale: Vec::new(), zero: Vec::new(), stats: Stats::default() };
    for g in w.chunks(gs) {
        let lo = g.iter().copied().fold(0.0f32, f32::min);
        let hi = g.iter().copied().fold(0.0f32, f32::max);
        let (raw, zp) = if symmetric {
            (lo.abs().max(hi) / ((qmax - qmin) / 2.0), 0.0)
        } else {
            let s = (hi - lo) / (qmax - qmin);
            (s, if s > 0.0 { (qmin - lo / s).round_ties_even().clamp(qmin, qmax) } else { 0.0 })
        };
        // compressed-tensors replaces a zero scale with the dtype's eps.
        let s = bf16::from_f32(if raw > 0.0 { raw } else { bf16::EPSILON.to_f32() });
        let sf = s.to_f32();
        r.scale.push(s.to_bits());
        r.zero.push((zp + offset) as u8);
        for &x in g {
            let v = x / sf + zp;
            let q = v.round_ties_even().clamp(qmin, qmax);
            let back = (q - zp) * sf;
            r.stats.err2 += ((x - back) as f64).powi(2);
            r.stats.w2 += (x as f64).powi(2);
            if x < (qmin - zp) * sf || x > (qmax - zp) * sf {
                r.stats.clipped += 1;
            }
            r.codes.push((q + offset) as u8);
        }
        r.stats.weights += g.len() as u64;
        r.stats.bits += g.len() as u64 * bits as u64 + 16 + if symmetric { 0 } else { bits as u64 };
    }
    r
}

/// Quantizes `w` (`[rows, cols]`, row-major); `cols` must be a multiple of `gs`.
pub fn quantize_int(w: &[f32], rows: usize, cols: usize, bits: u32, gs: usize, symmetric: bool) -> IntTensors {
    assert_eq!(w.len(), rows * cols);
    assert_eq!(cols % gs, 0, "compressed-tensors group quantization needs the columns to divide into groups");
    let words = (cols * bits as usize).div_ceil(32);
    let out: Vec<Row> = w.par_chunks(cols).map(|row| quantize_row(row, bits, gs, symmetric)).collect();
    let mut t = IntTensors {
        packed: Vec::with_capacity(rows * words * 4),
        words,
        scale: Vec::new(),
        zero_point: None,
        stats: Stats::default(),
    };
    for r in &out {
        let mut p = pack_row(&r.codes, bits);
        p.resize(words * 4, 0);
        t.packed.extend_from_slice(&p);
        t.scale.extend_from_slice(&r.scale);
        t.stats.add(&r.stats);
    }
    if !symmetric {
        let groups = cols / gs;
        let zw = (rows * bits as usize).div_ceil(32);
        let mut zp = vec![0u8; zw * groups * 4];
        for g in 0..groups {
            let column: Vec<u8> = out.iter().map(|r| r.zero[g]).collect();
            let mut bytes = pack_row(&column, bits);
            bytes.resize(zw * 4, 0);
            for w in 0..zw {
                zp[(w * groups + g) * 4..(w * groups + g) * 4 + 4].copy_from_slice(&bytes[w * 4..w * 4 + 4]);
            }
        }
        t.zero_point = Some(zp);
    }
    t
}
