//! Writing a batch's keys and values into the paged pool by slot mapping: the CPU reference for
//! `kernels/cuda/kv_write.cu`. Layout as `super::attention` reads it: `[pool row][width]` with
//! pool row = block · block_size + slot; FP8 scales `[pool row][kv_heads]`.

use super::fp8::quantize_e4m3;

/// `kc[slots[t]] = k[t]`, `vc[slots[t]] = v[t]` for rows of `width`.
pub fn kv_write_f32(k: &[f32], v: &[f32], slots: &[i32], width: usize, kc: &mut [f32], vc: &mut [f32]) {
    kv_store_f32(k, slots, width, kc);
    kv_store_f32(v, slots, width, vc);
}

/// As [`kv_write_f32`] into bf16 (round to nearest even).
pub fn kv_write_bf16(k: &[f32], v: &[f32], slots: &[i32], width: usize, kc: &mut [u16], vc: &mut [u16]) {
    kv_store_bf16(k, slots, width, kc);
    kv_store_bf16(v, slots, width, vc);
}

/// E4M3 codes with one scale per (pool row, kv head), as the host block pool quantises.
#[allow(clippy::too_many_arguments)]
pub fn kv_write_fp8(
    k: &[f32],
    v: &[f32],
    slots: &[i32],
    kv_heads: usize,
    head_dim: usize,
    kc: &mut [u8],
    vc: &mut [u8],
    ks: &mut [f32],
    vs: &mut [f32],
) {
    store_fp8_groups(k, slots, kv_heads * head_dim, kv_heads, kc, ks);
    store_fp8_groups(v, slots, kv_heads * head_dim, kv_heads, vc, vs);
}

/// One tensor's rows: `cache[slots[t]] = x[t]` for rows of `width` (the stores of a pool whose
/// key and value rows differ in width, such as MLA's latent and rotary key).
pub fn kv_store_f32(x: &[f32], slots: &[i32], width: usize, cache: &mut [f32]) {
    for (t, &row) in slots.iter().enumerate() {
        let row = row as usize;
        cache[row * width..(row + 1) * width].copy_from_slice(&x[t * width..(t + 1) * width]);
    }
}

/// As [`kv_store_f32`] into bf16 (round to nearest even).
pub fn kv_store_bf16(x: &[f32], slots: &[i32], width: usize, cache: &mut [u16]) {
    for (t, &row) in slots.iter().enumerate() {
        let row = row as usize;
        for (c, &f) in cache[row * width..(row + 1) * width].iter_mut().zip(&x[t * width..(t + 1) * width]) {
            *c = half::bf16::from_f32(f).to_bits();
        }
    }
}

/// As [`kv_store_f32`] into E4M3 codes with one scale per pool row (`scales[slots[t]]`): the host
/// block pool's quantisation of a row with one scale group.
pub fn kv_store_fp8(x: &[f32], slots: &[i32], width: usize, codes: &mut [u8], scales: &mut [f32]) {
    store_fp8_groups(x, slots, width, 1, codes, scales);
}

/// Rows of `width` in `groups` equal groups, each quantised with its own scale
/// (`scales[row * groups + group]`).
fn store_fp8_groups(x: &[f32], slots: &[i32], width: usize, groups: usize, codes: &mut [u8], scales: &mut [f32]) {
    if width == 0 {
        return;
    }
    let g = width / groups;
    for (t, &row) in slots.iter().enumerate() {
        let row = row as usize;
        for h in 0..groups {
            let (src, dst) =
                (t * width + h * g..t * width + (h + 1) * g, row * width + h * g..row * width + (h + 1) * g);
            scales[row * groups + h] = quantize_e4m3(&x[src], &mut codes[dst]);
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

    #[test]
    fn single_tensor_stores_keep_one_scale_per_row() {
        let x = [1.0f32, -2.0, 0.5, 3.0, 0.0, 0.25];
        let mut c = vec![0.0f32; 12];
        kv_store_f32(&x, &[3, 0], 3, &mut c);
        assert_eq!((&c[9..], &c[..3]), (&x[..3], &x[3..]));
        let mut b = vec![0u16; 12];
        kv_store_bf16(&x, &[3, 0], 3, &mut b);
        assert_eq!(half::bf16::from_bits(b[10]).to_f32(), -2.0);
        let (mut codes, mut scales) = (vec![0u8; 12], vec![0.0f32; 4]);
        kv_store_fp8(&x, &[3, 0], 3, &mut codes, &mut scales);
        // amax / 448 per row: 2 for row 3, 3 for row 0; the amax element decodes exactly.
        assert_eq!((scales[3], scales[0]), (2.0 / 448.0, 3.0 / 448.0));
        assert_eq!(E4M3_TO_F32[codes[10] as usize] * scales[3], -2.0);
        assert_eq!(E4M3_TO_F32[codes[0] as usize] * scales[0], 3.0);
    }
}
