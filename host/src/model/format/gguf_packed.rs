//! GGUF's Q4_0, Q4_1 and Q8_0 weight blocks as packed integer matrices ([`IntMatrix`]), so a
//! GGUF checkpoint's Linear layers are multiplied from their 4- and 8-bit codes, as llama.cpp
//! does, instead of being expanded to f32 at load time (which reads 5x the bytes per token for
//! Q4_1: 4 bytes a weight against 4 bits plus 8 bytes of group parameters per 32).
//!
//! A block is 32 consecutive weights of one row with an f16 scale `d`, i.e. an [`IntMatrix`]
//! group of 32 with scale `d` and a zero point:
//! - Q4_0 `w = (q − 8)·d`: code `q`, zero 8 — the same f32 operations as ggml's dequantisation,
//!   so the same weights bit for bit;
//! - Q8_0 `w = q·d` with `q` signed: code `q + 128`, zero 128 — exact too;
//! - Q4_1 `w = q·d + m`: zero `−m/d`, so `(q − z)·d` differs from ggml's `q·d + m` by the f32
//!   rounding of `z` (a few ulp of `|m|`, far below the 4-bit step). A block with `d = 0` but
//!   `m ≠ 0` has no such zero; the tensor then stays dense.
//!
//! The nibbles of a 4-bit block are not in weight order (byte `j` holds weights `j` and
//! `j + 16`), so the codes are repacked row by row into [`PackedRows`]' LSB-first order.

use half::f16;
use kernels::cpu::bitpack::PackedRows;
use kernels::cpu::quant_int::IntMatrix;

use crate::model::format::ggml::GgmlType;

const BLOCK: usize = 32;

/// Whether tensors of `ty` load as an [`IntMatrix`] here.
pub fn packable(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// The `rows × cols` matrix in `bytes` (row-major blocks of `ty`) as an [`IntMatrix`], its row
/// `r` being the file's row `source_row(r)` (llama.cpp's Q/K row permutation undone). `Ok(None)`
/// when `ty` is not packable or a Q4_1 block cannot be written with a zero point; `Err` when the
/// sizes disagree.
pub fn int_matrix(
    ty: GgmlType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
    source_row: impl Fn(usize) -> usize,
) -> Result<Option<IntMatrix>, String> {
    if !packable(ty) {
        return Ok(None);
    }
    let block_bytes = ty.block().1;
    if !cols.is_multiple_of(BLOCK) {
        return Err(format!("{} rows of {cols} weights are not whole {BLOCK}-weight blocks", ty.name()));
    }
    let blocks = cols / BLOCK;
    let row_bytes = blocks * block_bytes;
    if bytes.len() != rows * row_bytes {
        return Err(format!(
            "{} data is {} bytes, expected {} for {rows}x{cols}",
            ty.name(),
            bytes.len(),
            rows * row_bytes
        ));
    }
    let bits = if ty == GgmlType::Q8_0 { 8 } else { 4 };
    let mut codes = vec![0u8; rows * cols];
    let (mut scale, mut zero) = (Vec::with_capacity(rows * blocks), Vec::with_capacity(rows * blocks));
    for r in 0..rows {
        let src = source_row(r);
        let file_row = &bytes[src * row_bytes..(src + 1) * row_bytes];
        for (b, blk) in file_row.chunks_exact(block_bytes).enumerate() {
            let out = &mut codes[r * cols + b * BLOCK..r * cols + (b + 1) * BLOCK];
            let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            let z = match ty {
                GgmlType::Q4_0 => {
                    unpack_nibbles(&blk[2..18], out);
                    8.0
                }
                GgmlType::Q4_1 => {
                    unpack_nibbles(&blk[4..20], out);
                    let m = f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                    match (d == 0.0, m == 0.0) {
                        (true, true) => 0.0,
                        (true, false) => return Ok(None),
                        (false, _) => -m / d,
                    }
                }
                _ => {
                    for (o, &q) in out.iter_mut().zip(&blk[2..34]) {
                        *o = (q as i8 as i16 + 128) as u8;
                    }
                    128.0
                }
            };
            scale.push(d);
            zero.push(z);
        }
    }
    Ok(Some(IntMatrix::new(PackedRows::from_codes(bits, rows, cols, &codes), BLOCK, &scale, &zero)))
}

/// A 4-bit block's 16 bytes to its 32 codes in weight order (low nibbles first, then high).
fn unpack_nibbles(qs: &[u8], out: &mut [u8]) {
    for (j, &q) in qs.iter().enumerate() {
        out[j] = q & 0xF;
        out[j + 16] = q >> 4;
    }
}

#[cfg(test)]
mod tests {
    use super::super::ggml::dequantize;
    use super::*;

    /// Deterministic bytes (tests must not depend on a crate's RNG).
    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 33) as u8
            })
            .collect()
    }

    /// `rows × cols` blocks of `ty` with random codes and small, sane f16 parameters.
    fn blocks(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let (_, bb) = ty.block();
        let mut data = bytes(rows * cols / BLOCK * bb, seed);
        for (i, blk) in data.chunks_exact_mut(bb).enumerate() {
            let d = f16::from_f32(0.001 + (i % 7) as f32 * 0.0137);
            blk[0..2].copy_from_slice(&d.to_le_bytes());
            if ty == GgmlType::Q4_1 {
                let m = f16::from_f32(-0.05 - (i % 5) as f32 * 0.031);
                blk[2..4].copy_from_slice(&m.to_le_bytes());
            }
        }
        data
    }

    #[test]
    fn rows_match_ggml_dequantisation() {
        let (rows, cols) = (6, 96);
        for (ty, exact) in [(GgmlType::Q4_0, true), (GgmlType::Q8_0, true), (GgmlType::Q4_1, false)] {
            let data = blocks(ty, rows, cols, 7);
            let mut want = vec![0.0f32; rows * cols];
            dequantize(ty, &data, &mut want).unwrap();
            // Rows reversed: row r of the matrix is file row rows - 1 - r.
            let m = int_matrix(ty, &data, rows, cols, |r| rows - 1 - r).unwrap().expect("packable");
            assert_eq!((m.rows(), m.cols(), m.bits()), (rows, cols, if ty == GgmlType::Q8_0 { 8 } else { 4 }));
            for r in 0..rows {
                let got = m.dequantize_row(r);
                let want = &want[(rows - 1 - r) * cols..(rows - r) * cols];
                for (j, (&g, &w)) in got.iter().zip(want).enumerate() {
                    if exact {
                        assert_eq!(g.to_bits(), w.to_bits(), "{ty:?} row {r} col {j}: {g} vs {w}");
                    } else {
                        assert!((g - w).abs() <= 1e-6 * (1.0 + w.abs()), "{ty:?} row {r} col {j}: {g} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn zero_scale_blocks() {
        // Q4_1 with d = m = 0 is all zeros; with d = 0, m != 0 it cannot be a zero point.
        let mut data = blocks(GgmlType::Q4_1, 1, 32, 3);
        data[0..4].fill(0);
        let m = int_matrix(GgmlType::Q4_1, &data, 1, 32, |r| r).unwrap().unwrap();
        assert!(m.dequantize_row(0).iter().all(|&w| w == 0.0));
        data[2..4].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        assert!(int_matrix(GgmlType::Q4_1, &data, 1, 32, |r| r).unwrap().is_none());
    }

    #[test]
    fn other_types_and_bad_sizes() {
        assert!(int_matrix(GgmlType::F16, &[0; 128], 2, 32, |r| r).unwrap().is_none());
        assert!(int_matrix(GgmlType::Q4_0, &[0; 18], 1, 16, |r| r).err().unwrap().contains("blocks"));
        assert!(int_matrix(GgmlType::Q8_0, &[0; 33], 1, 32, |r| r).err().unwrap().contains("expected 34"));
    }
}
