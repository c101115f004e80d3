//! ggml tensor types found in GGUF files and their dequantisation to f32.
//!
//! Block layouts follow ggml's `ggml-common.h`; arithmetic is done in f32 in the same order as
//! gguf-py's reference `dequantize` so results are bit-identical to it.

use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    /// Known to ggml but not decodable here; loading a tensor of this type is a clear error.
    Unsupported(u32, &'static str, u64, usize),
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            8 => Q8_0,
            30 => BF16,
            // (name, block size, bytes per block) so sizes can still be checked.
            6 => Unsupported(id, "Q5_0", 32, 22),
            7 => Unsupported(id, "Q5_1", 32, 24),
            9 => Unsupported(id, "Q8_1", 32, 36),
            10 => Unsupported(id, "Q2_K", 256, 84),
            11 => Unsupported(id, "Q3_K", 256, 110),
            12 => Unsupported(id, "Q4_K", 256, 144),
            13 => Unsupported(id, "Q5_K", 256, 176),
            14 => Unsupported(id, "Q6_K", 256, 210),
            15 => Unsupported(id, "Q8_K", 256, 292),
            24 => Unsupported(id, "I8", 1, 1),
            25 => Unsupported(id, "I16", 1, 2),
            26 => Unsupported(id, "I32", 1, 4),
            27 => Unsupported(id, "I64", 1, 8),
            28 => Unsupported(id, "F64", 1, 8),
            _ => return None,
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Unsupported(_, n, _, _) => n,
        }
    }

    /// (elements per block, bytes per block)
    pub fn block(&self) -> (u64, usize) {
        match *self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Unsupported(_, _, b, s) => (b, s),
        }
    }

    /// Bytes occupied by a tensor whose rows have `row_len` elements and `n_elements` in total.
    pub fn bytes_for(&self, row_len: u64, n_elements: u64) -> Result<usize, String> {
        let (bs, bb) = self.block();
        if !row_len.is_multiple_of(bs) {
            return Err(format!("row length {row_len} is not a multiple of the {} block size {bs}", self.name()));
        }
        usize::try_from(n_elements / bs * bb as u64).map_err(|_| "tensor too large".into())
    }
}

/// Dequantises `bytes` (a whole tensor of `ty`) into `out`. `out.len()` is the element count.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    let (bs, bb) = ty.block();
    let n_blocks = out.len() / bs as usize;
    if !out.len().is_multiple_of(bs as usize) || bytes.len() != n_blocks * bb {
        return Err(format!(
            "{} data is {} bytes, expected {} for {} elements",
            ty.name(),
            bytes.len(),
            n_blocks * bb,
            out.len()
        ));
    }
    let h = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = h(c);
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q4_0 => {
            for (o, blk) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(18)) {
                let d = h(&blk[0..2]);
                for j in 0..16 {
                    let q = blk[2 + j];
                    o[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                    o[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, blk) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(20)) {
                let d = h(&blk[0..2]);
                let m = h(&blk[2..4]);
                for j in 0..16 {
                    let q = blk[4 + j];
                    o[j] = (q & 0xF) as f32 * d + m;
                    o[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (o, blk) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(34)) {
                let d = h(&blk[0..2]);
                for j in 0..32 {
                    o[j] = (blk[2 + j] as i8) as f32 * d;
                }
            }
        }
        GgmlType::Unsupported(_, name, _, _) => {
            return Err(format!("ggml type {name} is not supported yet (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)"))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_0_block() {
        let mut blk = vec![0u8; 18];
        blk[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        blk[2] = 0x1F; // low nibble 15 -> +7*0.5, high nibble 1 -> -7*0.5
        let mut out = vec![0.0; 32];
        dequantize(GgmlType::Q4_0, &blk, &mut out).unwrap();
        assert_eq!(out[0], 3.5);
        assert_eq!(out[16], -3.5);
        assert_eq!(out[1], -4.0);
    }

    #[test]
    fn q4_1_and_q8_0_blocks() {
        let mut blk = vec![0u8; 20];
        blk[0..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        blk[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        blk[4] = 0x30;
        let mut out = vec![0.0; 32];
        dequantize(GgmlType::Q4_1, &blk, &mut out).unwrap();
        assert_eq!((out[0], out[16], out[5]), (-1.0, 5.0, -1.0));

        let mut blk = vec![0u8; 34];
        blk[0..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        blk[2] = (-4i8) as u8;
        blk[33] = 8;
        dequantize(GgmlType::Q8_0, &blk, &mut out).unwrap();
        assert_eq!((out[0], out[31], out[1]), (-1.0, 2.0, 0.0));
    }

    #[test]
    fn size_mismatch_is_an_error() {
        let mut out = vec![0.0; 32];
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33], &mut out).is_err());
    }
}
