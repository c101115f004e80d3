//! Kimi Delta Attention's device kernels against their CPU references (`kernels::cpu::kda`),
//! written once over any runtime and run by `cuda_vs_cpu.rs` on the simulator and on a CUDA
//! device:
//!
//! * the short convolution and the recurrence over a batch of sequences of 1, 2, 5 and 0 rows
//!   whose rows are interleaved in batch order and whose slots are out of sequence order, from
//!   random states (every slot compared, so the untouched ones too);
//! * each sequence's rows split over two launches give exactly what one launch gives (the state
//!   carries the sequence across calls);
//! * both forget-gate forms (softplus, lower bound) and head dims 16, 40 (a partial warp) and 128;
//! * the slot copy and reset, and the recurrent pool's fork and reset of every layer;
//! * the wrappers' size errors.

use kernels::cpu::kda::{self, KdaGeometry};
use kernels::gpu::{DeviceRecurrentPool, Kernels, Runtime};

use super::test_data::uniform;
use super::{assert_close, Tol};

/// Rows per sequence and the slot of each (a pool of `SLOTS`: slots 2 and 4 stay unused).
const LENS: [usize; 4] = [1, 2, 5, 0];
const SEQ_SLOTS: [i32; 4] = [3, 0, 5, 1];
const SLOTS: usize = 6;

/// A batch grouped by sequence: `seq_rows[seq_start[s]..seq_start[s + 1]]` are sequence s's rows.
struct Csr {
    seq_rows: Vec<i32>,
    seq_start: Vec<i32>,
    seq_slot: Vec<i32>,
}

/// The sequences' rows handed out round robin (step t gives each sequence with a t-th position its
/// next batch row), so rows of different sequences interleave; returns the grouping of the rows
/// `keep(s, position)` selects, over all `LENS.iter().sum()` batch rows.
fn interleaved(keep: impl Fn(usize, usize) -> bool) -> Csr {
    let mut rows: Vec<Vec<i32>> = vec![Vec::new(); LENS.len()];
    let mut next = 0;
    for t in 0..*LENS.iter().max().unwrap() {
        for (s, &len) in LENS.iter().enumerate() {
            if t < len {
                if keep(s, t) {
                    rows[s].push(next);
                }
                next += 1;
            }
        }
    }
    let mut seq_start = vec![0i32];
    for r in &rows {
        seq_start.push(seq_start.last().unwrap() + r.len() as i32);
    }
    Csr { seq_rows: rows.concat(), seq_start, seq_slot: SEQ_SLOTS.to_vec() }
}

/// The whole batch, and the same rows as two batches: each sequence's first half (rounded down),
/// then the rest.
fn whole_and_halves() -> (Csr, [Csr; 2]) {
    let first = |s: usize, t: usize| t < LENS[s] / 2;
    (interleaved(|_, _| true), [interleaved(first), interleaved(|s, t| !first(s, t))])
}

/// A grouping uploaded to the device.
struct DevCsr<R: Runtime> {
    seq_rows: R::Buf<i32>,
    seq_start: R::Buf<i32>,
    seq_slot: R::Buf<i32>,
}

fn upload_csr<R: Runtime>(g: &Kernels<R>, c: &Csr) -> DevCsr<R> {
    DevCsr {
        seq_rows: g.upload(&c.seq_rows).unwrap(),
        seq_start: g.upload(&c.seq_start).unwrap(),
        seq_slot: g.upload(&c.seq_slot).unwrap(),
    }
}

/// The convolution on 3·2·50 = 300 channels (a partial block) for kernels 4 and 2.
pub fn kda_conv_matches_cpu<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    let (whole, halves) = whole_and_halves();
    let n: usize = LENS.iter().sum();
    let channels = 300;
    for kernel in [4usize, 2] {
        let seed = 100 * kernel as u64;
        let mixed = uniform(n * channels, seed, -2.0, 2.0);
        let weight = uniform(channels * kernel, seed + 1, -0.6, 0.6);
        let state0 = uniform(SLOTS * channels * (kernel - 1), seed + 2, -2.0, 2.0);
        let (mut want_out, mut want_state) = (vec![0.0f32; n * channels], state0.clone());
        kda::conv_silu_batch(
            &mixed,
            &weight,
            &mut want_state,
            &whole.seq_rows,
            &whole.seq_start,
            &whole.seq_slot,
            channels,
            kernel,
            &mut want_out,
        );

        let (dm, dw) = (g.upload(&mixed).unwrap(), g.upload(&weight).unwrap());
        let run = |batches: &[&Csr]| {
            let (mut state, mut out) = (g.upload(&state0).unwrap(), g.zeros::<f32>(n * channels).unwrap());
            for c in batches {
                let d = upload_csr(g, c);
                g.kda_conv_silu(
                    &dm,
                    &dw,
                    &mut state,
                    &d.seq_rows,
                    &d.seq_start,
                    &d.seq_slot,
                    LENS.len(),
                    n,
                    channels,
                    kernel,
                    &mut out,
                )
                .unwrap();
            }
            (g.download(&out).unwrap(), g.download(&state).unwrap())
        };
        let (out, state) = run(&[&whole]);
        assert_close(&format!("kda_conv_silu kernel={kernel} out"), &out, &want_out, t.rope);
        assert_eq!(state, want_state, "kda_conv_silu kernel={kernel}: the histories are the last inputs");
        assert_eq!(run(&[&halves[0], &halves[1]]), (out, state), "kda_conv_silu kernel={kernel}: two launches = one");
    }

    // Size errors, each against an otherwise valid call.
    let (kernel, d) = (4, upload_csr(g, &whole));
    let (dm, dw) = (g.zeros::<f32>(n * channels).unwrap(), g.zeros::<f32>(channels * kernel).unwrap());
    let (mut state, mut out) = (g.zeros::<f32>(SLOTS * channels * 3).unwrap(), g.zeros::<f32>(n * channels).unwrap());
    let seqs = LENS.len();
    g.kda_conv_silu(&dm, &dw, &mut state, &d.seq_rows, &d.seq_start, &d.seq_slot, seqs, n, channels, kernel, &mut out)
        .unwrap();
    assert!(
        g.kda_conv_silu(
            &dm,
            &dw,
            &mut state,
            &d.seq_rows,
            &d.seq_start,
            &d.seq_slot,
            seqs,
            n + 1,
            channels,
            kernel,
            &mut out
        )
        .is_err(),
        "more rows than mixed holds"
    );
    assert!(
        g.kda_conv_silu(&dm, &dw, &mut state, &d.seq_rows, &d.seq_start, &d.seq_slot, seqs, n, channels, 5, &mut out)
            .is_err(),
        "more taps than weight holds"
    );
    assert!(
        g.kda_conv_silu(
            &dm,
            &g.zeros(channels * 9).unwrap(),
            &mut state,
            &d.seq_rows,
            &d.seq_start,
            &d.seq_slot,
            seqs,
            n,
            channels,
            9,
            &mut out
        )
        .is_err(),
        "kernel above KDA_MAX_KERNEL"
    );
    assert!(
        g.kda_conv_silu(&dm, &dw, &mut state, &d.seq_rows, &d.seq_start, &d.seq_slot, seqs, n, channels, 1, &mut out)
            .is_err(),
        "kernel 1 (no history)"
    );
    assert!(
        g.kda_conv_silu(
            &dm,
            &dw,
            &mut state,
            &d.seq_rows,
            &d.seq_start,
            &d.seq_slot,
            seqs + 1,
            n,
            channels,
            kernel,
            &mut out
        )
        .is_err(),
        "more sequences than seq_start / seq_slot hold"
    );
    assert!(
        g.kda_conv_silu(
            &dm,
            &dw,
            &mut g.zeros(channels * 3 - 1).unwrap(),
            &d.seq_rows,
            &d.seq_start,
            &d.seq_slot,
            seqs,
            n,
            channels,
            kernel,
            &mut out
        )
        .is_err(),
        "conv_state without a whole slot"
    );
}

/// The recurrence's inputs for `n` rows of `heads` x `hd`, at the magnitudes of a real layer
/// (q, k and v after SiLU, gate logits that both saturate and not), and a random state pool.
struct RecInputs {
    conv: Vec<f32>,
    f: Vec<f32>,
    beta: Vec<f32>,
    gate: Vec<f32>,
    dt_bias: Vec<f32>,
    decay_rate: Vec<f32>,
    o_norm: Vec<f32>,
    state: Vec<f32>,
}

fn rec_inputs(n: usize, heads: usize, hd: usize, seed: u64) -> RecInputs {
    let p = heads * hd;
    RecInputs {
        conv: uniform(n * 3 * p, seed, -2.0, 2.0).into_iter().map(kda::silu).collect(),
        f: uniform(n * p, seed + 1, -4.0, 4.0),
        beta: uniform(n * heads, seed + 2, -3.0, 3.0),
        gate: uniform(n * p, seed + 3, -4.0, 4.0),
        dt_bias: uniform(p, seed + 4, -1.0, 1.0),
        decay_rate: uniform(heads, seed + 5, 0.2, 3.0),
        o_norm: uniform(hd, seed + 6, 0.5, 1.5),
        state: uniform(SLOTS * heads * hd * hd, seed + 7, -0.3, 0.3),
    }
}

/// The recurrence for head dims 16, 40 and 128, softplus and lower-bound gates.
pub fn kda_recurrent_matches_cpu_for_both_gates_and_head_dims<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    let (whole, halves) = whole_and_halves();
    let n: usize = LENS.iter().sum();
    for (heads, hd) in [(3usize, 16usize), (1, 40), (2, 128)] {
        for lower_bound in [None, Some(-5.0f32)] {
            let geo = KdaGeometry { seqs: LENS.len(), n, heads, head_dim: hd, slots: SLOTS, eps: 1e-5, lower_bound };
            let what = format!("kda_recurrent {heads}x{hd} lower_bound={lower_bound:?}");
            let x = rec_inputs(n, heads, hd, (hd * 10 + lower_bound.is_some() as usize) as u64);
            let (mut want_out, mut want_state) = (vec![0.0f32; n * heads * hd], x.state.clone());
            kda::recurrent_batch(
                &x.conv,
                &x.f,
                &x.beta,
                &x.gate,
                &x.dt_bias,
                &x.decay_rate,
                &x.o_norm,
                &mut want_state,
                &whole.seq_rows,
                &whole.seq_start,
                &whole.seq_slot,
                &geo,
                &mut want_out,
            );

            let up = |v: &[f32]| g.upload(v).unwrap();
            let (conv, f, beta, gate) = (up(&x.conv), up(&x.f), up(&x.beta), up(&x.gate));
            let (dt_bias, decay_rate, o_norm) = (up(&x.dt_bias), up(&x.decay_rate), up(&x.o_norm));
            let run = |batches: &[&Csr]| {
                let (mut state, mut out) = (up(&x.state), g.zeros::<f32>(n * heads * hd).unwrap());
                for c in batches {
                    let d = upload_csr(g, c);
                    g.kda_recurrent(
                        &conv,
                        &f,
                        &beta,
                        &gate,
                        &dt_bias,
                        &decay_rate,
                        &o_norm,
                        &mut state,
                        &d.seq_rows,
                        &d.seq_start,
                        &d.seq_slot,
                        &geo,
                        &mut out,
                    )
                    .unwrap();
                }
                (g.download(&out).unwrap(), g.download(&state).unwrap())
            };
            let (out, state) = run(&[&whole]);
            assert_close(&format!("{what} out"), &out, &want_out, t.gemv);
            assert_close(&format!("{what} state"), &state, &want_state, t.gemv);
            assert_eq!(run(&[&halves[0], &halves[1]]), (out, state), "{what}: two launches = one");
        }
    }

    // Size errors, each against an otherwise valid call.
    let (heads, hd) = (2, 16);
    let geo = KdaGeometry { seqs: LENS.len(), n, heads, head_dim: hd, slots: SLOTS, eps: 1e-5, lower_bound: None };
    let x = rec_inputs(n, heads, hd, 7);
    let up = |v: &[f32]| g.upload(v).unwrap();
    let (conv, f, beta, gate) = (up(&x.conv), up(&x.f), up(&x.beta), up(&x.gate));
    let (dt_bias, decay_rate, o_norm) = (up(&x.dt_bias), up(&x.decay_rate), up(&x.o_norm));
    let (mut state, mut out) = (up(&x.state), g.zeros::<f32>(n * heads * hd).unwrap());
    let d = upload_csr(g, &whole);
    let mut call = |geo: &KdaGeometry, state: &mut R::Buf<f32>| {
        g.kda_recurrent(
            &conv,
            &f,
            &beta,
            &gate,
            &dt_bias,
            &decay_rate,
            &o_norm,
            state,
            &d.seq_rows,
            &d.seq_start,
            &d.seq_slot,
            geo,
            &mut out,
        )
    };
    call(&geo, &mut state).unwrap();
    assert!(call(&KdaGeometry { n: n + 1, ..geo }, &mut state).is_err(), "more rows than the inputs hold");
    assert!(call(&KdaGeometry { slots: SLOTS + 1, ..geo }, &mut state).is_err(), "more slots than the state holds");
    assert!(
        call(&KdaGeometry { seqs: LENS.len() + 1, ..geo }, &mut state).is_err(),
        "more sequences than seq_start / seq_slot hold"
    );
    assert!(call(&KdaGeometry { heads: 3, ..geo }, &mut state).is_err(), "more heads than the inputs hold");
    assert!(call(&KdaGeometry { heads: 0, ..geo }, &mut state).is_err(), "no heads");
    let big = |len: usize| g.zeros::<f32>(len).unwrap();
    let mut big_state = big(SLOTS * 257 * 257);
    let big_geo = KdaGeometry { n: 1, heads: 1, head_dim: 257, ..geo };
    assert!(
        g.kda_recurrent(
            &big(3 * 257),
            &big(257),
            &big(1),
            &big(257),
            &big(257),
            &big(1),
            &big(257),
            &mut big_state,
            &d.seq_rows,
            &d.seq_start,
            &d.seq_slot,
            &big_geo,
            &mut big(257)
        )
        .is_err(),
        "head_dim above KDA_MAX_HEAD_DIM"
    );
}

/// `copy_slot_f32` / `zero_slot_f32` against the same slice operations, and the recurrent pool's
/// fork and reset of every layer after a real step.
pub fn kda_slot_copy_zero_and_pool_work<R: Runtime>(g: &Kernels<R>, _t: &Tol) {
    let (len, slots) = (37, 4);
    let host = uniform(len * slots, 300, -1.0, 1.0);
    let mut want = host.clone();
    want.copy_within(len..2 * len, 3 * len);
    want[2 * len..3 * len].fill(0.0);
    let mut buf = g.upload(&host).unwrap();
    g.copy_slot_f32(&mut buf, len, 1, 3).unwrap();
    g.copy_slot_f32(&mut buf, len, 0, 0).unwrap();
    g.zero_slot_f32(&mut buf, len, 2).unwrap();
    assert_eq!(g.download(&buf).unwrap(), want, "copy_slot_f32 1 -> 3, 0 -> 0, zero_slot_f32 2");
    assert!(g.copy_slot_f32(&mut buf, len, 0, slots).is_err(), "copy to a slot past the buffer");
    assert!(g.copy_slot_f32(&mut buf, len, slots, 0).is_err(), "copy from a slot past the buffer");
    assert!(g.zero_slot_f32(&mut buf, len, slots).is_err(), "zero a slot past the buffer");
    assert!(g.zero_slot_f32(&mut buf, 0, 0).is_err(), "zero-length slots");
    assert!(g.copy_slot_f32(&mut buf, len + 1, 3, 0).is_err(), "slots of a wider state");

    // A pool of 2 layers x 3 slots: one row of one sequence (slot 2) through layer 1's kernels.
    let (heads, hd, kernel, pool_slots) = (2, 16, 4, 3);
    assert!(DeviceRecurrentPool::new(g, 2, pool_slots, heads, hd, 1).is_err(), "kernel 1 (no history)");
    let mut pool = DeviceRecurrentPool::new(g, 2, pool_slots, heads, hd, kernel).unwrap();
    let (p, channels) = (heads * hd, 3 * heads * hd);
    let (rows, start, slot) = (g.upload(&[0i32]).unwrap(), g.upload(&[0i32, 1]).unwrap(), g.upload(&[2i32]).unwrap());
    let mut conv = g.zeros::<f32>(channels).unwrap();
    let weight = g.upload(&uniform(channels * kernel, 301, -0.6, 0.6)).unwrap();
    g.kda_conv_silu(
        &g.upload(&uniform(channels, 302, -2.0, 2.0)).unwrap(),
        &weight,
        pool.conv_state(1),
        &rows,
        &start,
        &slot,
        1,
        1,
        channels,
        kernel,
        &mut conv,
    )
    .unwrap();
    let x = rec_inputs(1, heads, hd, 303);
    let geo = KdaGeometry { seqs: 1, n: 1, heads, head_dim: hd, slots: pool_slots, eps: 1e-5, lower_bound: None };
    let up = |v: &[f32]| g.upload(v).unwrap();
    let mut out = g.zeros::<f32>(p).unwrap();
    g.kda_recurrent(
        &conv,
        &up(&x.f),
        &up(&x.beta),
        &up(&x.gate),
        &up(&x.dt_bias),
        &up(&x.decay_rate),
        &up(&x.o_norm),
        pool.recurrent_state(1),
        &rows,
        &start,
        &slot,
        &geo,
        &mut out,
    )
    .unwrap();

    let (cl, rl) = (pool.conv_len(), pool.recurrent_len());
    assert_eq!((cl, rl), (channels * (kernel - 1), heads * hd * hd));
    let slot_of = |pool: &mut DeviceRecurrentPool<R>, layer: usize, s: usize| {
        let conv = g.download(pool.conv_state(layer)).unwrap()[s * cl..(s + 1) * cl].to_vec();
        let rec = g.download(pool.recurrent_state(layer)).unwrap()[s * rl..(s + 1) * rl].to_vec();
        (conv, rec)
    };
    let stepped = slot_of(&mut pool, 1, 2);
    assert!(stepped.0.iter().any(|&v| v != 0.0) && stepped.1.iter().any(|&v| v != 0.0), "the step wrote slot 2");
    let zero = (vec![0.0f32; cl], vec![0.0f32; rl]);
    pool.fork(g, 2, 0).unwrap();
    assert_eq!(slot_of(&mut pool, 1, 0), stepped, "fork 2 -> 0 copies layer 1");
    assert_eq!(slot_of(&mut pool, 0, 0), zero, "fork 2 -> 0 copies layer 0 (zero)");
    pool.reset(g, 2).unwrap();
    assert_eq!(slot_of(&mut pool, 1, 2), zero, "reset 2 zeroes layer 1");
    assert_eq!(slot_of(&mut pool, 1, 0), stepped, "reset 2 leaves the fork");
    assert!(pool.fork(g, 0, pool_slots).is_err() && pool.reset(g, pool_slots).is_err(), "slots past the pool");
}
