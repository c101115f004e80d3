//! Deterministic test data shared by the kernel comparisons (a fixed LCG: the same inputs on
//! every runtime and every run).

pub fn lcg(seed: u64) -> impl FnMut() -> u32 {
    let mut s = seed;
    move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 33) as u32
    }
}

/// `n` values in `[lo, hi)` on a 1e-5 grid.
pub fn uniform(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut r = lcg(seed);
    (0..n).map(|_| lo + (hi - lo) * (r() % 100_000) as f32 / 100_000.0).collect()
}

/// `n` random `bits`-wide codes, one per byte.
pub fn codes(n: usize, bits: u32, seed: u64) -> Vec<u8> {
    let mut r = lcg(seed);
    (0..n).map(|_| (r() % (1 << bits)) as u8).collect()
}
