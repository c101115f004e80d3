//! Writing a batch's keys and values into the paged pool by slot mapping: the CPU reference for
//! `kernels/cuda/kv_write.cu`. Layout as `super::attention` reads it: `[pool row][width]` with
//! pool row = block · block_size + slot; FP8 scales `[pool row][kv_heads]`.

use super::fp8::quantize_e4m3;

/// `kc[slots[t]] = k[t]`, `vc[slots[t]] = v[t]` for rows of `width`.
pub fn kv_write_f32(k: &[f32], v: &[f32], slots: &[i32], width: usize, kc: &mut [f32], vc: &mut [f32]) {
    for (t, &row) in slots.iter().enumerate() {
        let (src, dst) = (t * width..(t + 1) * width, row as usize * width..(row as usize + 1) * width);
        kc[dst.clone()].copy_from_slice(&k[src.clone()]);
        vc[dst].copy_from_slice(&v[src]);
    }
}

/// As [`kv_write_f32`] into bf16 (round to nearest even).
pub fn kv_write_bf16(k: &[f32], v: &[f32], slots: &[i32], width: usize, kc: &mut [u16], vc: &mut [u16]) {
    for (t, &row) in slots.iter().enumerate() {
        for i in 0..width {
            kc[row as usize * width + i] = half::bf16::from_f32(k[t * width + i]).to_bits();
            vc[row as usize * width + i] = half::bf16::from_f32(v[t * width + i]).to_bits();
        }
    }
}

/// E4M3 codes with one scale per (pool row, kv head), as the host block pool quantises.
#[allow(clippy::too_many_arguments)]
pub fn kv_write_fp8(k: &[f32], v: &[f32], slots: &[i32], kv_heads: usize, head_dim: usize, kc: &mut [u8], vc: &mut [u8], ks: &mut [f32], vs: &mut [f32]) {
    let width = kv_heads * head_dim;
    for (t, &row) in slots.iter().enumerate() {
        let row = row as usize;
        for h in 0..kv_heads {
            let (src, dst) = (t * width + h * head_dim..t * width + (h + 1) * head_dim, row * width + h * head_dim..row * width + (h + 1) * head_dim);
            ks[row * kv_heads + h] = quantize_e4m3(&k[src.clone()], &mut kc[dst.clone()]);
            vs[row * kv_heads + h] = quantize_e4m3(&v[src], &mut vc[dst]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::fp8::E4M3_TO_F32;

    #[test]
    fn rows_land_in_their_slots() {
        let (k, v): (Vec<f32>, Vec<f32>) = ((0..4).map(|i| i as f32).collect(), (0..4).map(|i| -(i as f32)).collect());
        let (mut kc, mut vc) = (vec![0.0; 8], vec![0.0; 8]);
        kv_write_f32(&k, &v, &[3, 1], 2, &mut kc, &mut vc);
        assert_eq!(kc, [0.0, 0.0, 2.0, 3.0, 0.0, 0.0, 0.0, 1.0]);
        assert_eq!(vc[6..], [0.0, -1.0]);
        let (mut kb, mut vb) = (vec![0u16; 8], vec![0u16; 8]);
        kv_write_bf16(&k, &v, &[3, 1], 2, &mut kb, &mut vb);
        assert_eq!(half::bf16::from_bits(kb[7]).to_f32(), 1.0);
        // One scale per (pool row, kv head): 4 rows x 2 heads.
        let (mut k8, mut v8, mut ks, mut vs) = (vec![0u8; 8], vec![0u8; 8], vec![0.0; 8], vec![0.0; 8]);
        kv_write_fp8(&k, &v, &[3, 1], 2, 1, &mut k8, &mut v8, &mut ks, &mut vs);
        assert_eq!(E4M3_TO_F32[k8[7] as usize] * ks[7], 1.0);
        assert_eq!(E4M3_TO_F32[k8[3] as usize] * ks[3], 3.0);
    }
}
