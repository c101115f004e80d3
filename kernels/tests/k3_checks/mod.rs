//! Kimi K3's own device kernels against their CPU references, over any runtime (run by
//! `cuda_vs_cpu.rs` on the simulator and on a CUDA device): the Block Attention Residual mix with
//! 0, 1 and 8 snapshots (K3's most: 93 layers in blocks of 12) over rows of K3's width and a
//! partial warp's, the partial-sum add, and SiTU with and without its linear clip; the wrappers'
//! size errors.

use kernels::cpu;
use kernels::gpu::{Kernels, Runtime};

use super::test_data::uniform;
use super::{assert_close, Tol};

pub fn attn_res_mix_and_situ_match_cpu<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    for (rows, d) in [(3usize, 7168usize), (5, 40)] {
        for num_blocks in [0usize, 1, 8] {
            let seed = (rows * 31 + num_blocks) as u64;
            // Candidates of different scales, so the softmax is far from uniform.
            let mut blocks = uniform(num_blocks * rows * d, seed, -2.0, 2.0);
            for (b, chunk) in blocks.chunks_mut(rows * d).enumerate() {
                chunk.iter_mut().for_each(|v| *v *= 1.0 + b as f32 * 0.5);
            }
            let partial = uniform(rows * d, seed + 1, -3.0, 3.0);
            let w = uniform(d, seed + 2, -0.3, 0.3);
            let mut want = vec![0.0f32; rows * d];
            for r in 0..rows {
                let span = r * d..(r + 1) * d;
                let cands: Vec<&[f32]> = (0..num_blocks)
                    .map(|b| &blocks[b * rows * d + span.start..b * rows * d + span.end])
                    .chain(std::iter::once(&partial[span.clone()]))
                    .collect();
                cpu::attn_res::mix_row(&cands, &w, 1e-5, &mut want[span]);
            }
            let stream: Vec<f32> = blocks.iter().chain(&partial).copied().collect();
            let (ds, dw) = (g.upload(&stream).unwrap(), g.upload(&w).unwrap());
            let mut out = g.zeros::<f32>(rows * d).unwrap();
            g.attn_res_mix(&ds, num_blocks, &dw, &mut out, rows, 1e-5).unwrap();
            // A score is a d-term sum (|score| ≈ 15 here) whose rounding in another order moves
            // the softmax weights by ~1e-6 of the score: 6.6e-6 measured at d = 7168 (sim).
            let tol = t.gemv.max(2e-5);
            assert_close(&format!("attn_res_mix {num_blocks} blocks, d {d}"), &g.download(&out).unwrap(), &want, tol);
        }
    }

    // Into the second half of a buffer (a stream slot), the first half untouched.
    let (n, x, delta) = (1000, uniform(2000, 7, -1.0, 1.0), uniform(1000, 8, -1.0, 1.0));
    let (mut dx, dd) = (g.upload(&x).unwrap(), g.upload(&delta).unwrap());
    g.add_f32(&mut dx, n, &dd, n).unwrap();
    let want: Vec<f32> = x[..n].iter().copied().chain(x[n..].iter().zip(&delta).map(|(a, b)| a + b)).collect();
    assert_eq!(g.download(&dx).unwrap(), want, "add_f32");
    assert!(g.add_f32(&mut dx, n + 1, &dd, n).is_err());

    let (tokens, d) = (3, 1536);
    let gu = uniform(tokens * 2 * d, 9, -40.0, 40.0);
    for linear_beta in [Some(25.0f32), None] {
        let mut want = vec![0.0; tokens * d];
        for i in 0..tokens {
            let (gate, up) = gu[i * 2 * d..(i + 1) * 2 * d].split_at(d);
            cpu::activation::situ_mul(gate, up, 4.0, linear_beta, &mut want[i * d..(i + 1) * d]);
        }
        let (dgu, mut dout) = (g.upload(&gu).unwrap(), g.zeros::<f32>(tokens * d).unwrap());
        g.situ_mul(&dgu, &mut dout, tokens, d, 4.0, linear_beta).unwrap();
        // tanhf / expf of the simulator's libm against the reference's; CUDA's within ulps.
        assert_close(&format!("situ_mul linear_beta {linear_beta:?}"), &g.download(&dout).unwrap(), &want, 1e-6);
    }

    // Size errors, not out-of-bounds launches.
    let small = g.zeros::<f32>(4).unwrap();
    let mut out = g.zeros::<f32>(4).unwrap();
    assert!(g.attn_res_mix(&small, 2, &g.zeros::<f32>(4).unwrap(), &mut out, 1, 1e-5).is_err());
    assert!(g.situ_mul(&small, &mut out, 4, 1, 4.0, None).is_err());
    assert!(g.situ_mul(&small, &mut out, 1, 2, 0.0, None).is_err());
}
