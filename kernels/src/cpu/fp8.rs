//! FP8 E4M3 (OCP "E4M3FN": 4 exponent bits, bias 7, 3 mantissa bits, no infinities, max 448) used
//! for KV-cache storage with a separate f32 scale per head.

/// Decoding table for all 256 codes (0x7F / 0xFF are NaN).
pub static E4M3_TO_F32: [f32; 256] = build_table();

const fn decode(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((code >> 3) & 0xF) as i32;
    let man = (code & 0x7) as f32;
    if exp == 0xF && (code & 0x7) == 0x7 {
        return f32::NAN;
    }
    let mag = if exp == 0 {
        man / 8.0 * (1.0 / 64.0) // subnormal: 2^-6 * m/8
    } else {
        let mut p = 1.0f32;
        let mut e = exp - 7;
        while e > 0 {
            p *= 2.0;
            e -= 1;
        }
        while e < 0 {
            p /= 2.0;
            e += 1;
        }
        (1.0 + man / 8.0) * p
    };
    sign * mag
}

const fn build_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode(i as u8);
        i += 1;
    }
    t
}

pub const E4M3_MAX: f32 = 448.0;

/// Nearest E4M3 code for `x` (round to nearest, ties to even code), saturating at ±448.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    // Binary search over the 127 finite non-negative codes (monotonic in the code).
    let (mut lo, mut hi) = (0u8, 0x7Eu8);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if E4M3_TO_F32[mid as usize] <= a {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let below = lo;
    let code = if below < 0x7E {
        let (vb, va) = (E4M3_TO_F32[below as usize], E4M3_TO_F32[below as usize + 1]);
        let (db, da) = (a - vb, va - a);
        if da < db || (da == db && below % 2 == 1) {
            below + 1
        } else {
            below
        }
    } else {
        below
    };
    sign | code
}

/// Quantises `x` with one scale (`amax / 448`) into `codes`; returns the scale.
pub fn quantize_e4m3(x: &[f32], codes: &mut [u8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = f32_to_e4m3(v / scale);
    }
    scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_codes_and_round_trip() {
        assert_eq!(E4M3_TO_F32[0x38], 1.0);
        assert_eq!(E4M3_TO_F32[0x7E], 448.0);
        assert_eq!(E4M3_TO_F32[0x01], 1.0 / 512.0);
        assert!(E4M3_TO_F32[0x7F].is_nan());
        for code in 0..0x7Fu8 {
            assert_eq!(f32_to_e4m3(E4M3_TO_F32[code as usize]), code, "code {code:#x}");
            assert_eq!(f32_to_e4m3(-E4M3_TO_F32[code as usize]) & 0x7F, code);
        }
        assert_eq!(f32_to_e4m3(1000.0), 0x7E);
        // 1.0625 lies halfway between 1.0 (0x38, even) and 1.125 (0x39): ties to even.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
    }

    #[test]
    fn quantize_error_is_small() {
        let x: Vec<f32> = (0..128).map(|i| ((i * 37 % 61) as f32 - 30.0) / 7.0).collect();
        let mut c = vec![0u8; 128];
        let s = quantize_e4m3(&x, &mut c);
        for (v, &code) in x.iter().zip(&c) {
            let back = E4M3_TO_F32[code as usize] * s;
            assert!((back - v).abs() <= v.abs() / 16.0 + 1e-3, "{v} -> {back}");
        }
    }
}
