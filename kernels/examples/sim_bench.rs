//! Speed of the CPU simulator on the decode GEMV shapes of SmolLM2-135M (n = 1 token): the INT4
//! fast path and the bf16 MoE expert GEMV (a dense bf16 layer run as one expert's one-token tile), as
//! time per launch and simulated blocks (of 128 threads) per second.
//!
//!     cargo run --release -p kernels --example sim_bench

use std::time::Instant;

use kernels::gpu::{ExpertWeight, Kernels};
use kernels::sim::{SimGpu, SimRuntime};

fn main() {
    let (parallel, serial) = match (SimGpu::sim(), SimRuntime::serial()) {
        (Ok(p), Ok(s)) => (p, Kernels::new(s)),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("simulator unavailable: {e}");
            return;
        }
    };
    println!("one thread:");
    bench(&serial);
    println!("{} rayon threads:", rayon::current_num_threads());
    bench(&parallel);
}

fn bench(g: &SimGpu) {
    for &(rows, cols) in &[(576usize, 1536usize), (1536, 576), (49152, 576)] {
        let gs = 32;
        let stride = cols / 2;
        let bytes: Vec<u8> = (0..rows * stride).map(|i| (i * 37 % 251) as u8).collect();
        let groups = rows * cols / gs;
        let w = g
            .upload_grouped(
                g.upload_packed(4, rows, cols, stride, &bytes).unwrap(),
                gs,
                &vec![0.01; groups],
                &vec![8.0; groups],
            )
            .unwrap();
        let x = g.upload(&vec![0.5f32; cols]).unwrap();
        let mut out = g.zeros::<f32>(rows).unwrap();
        let blocks = rows.div_ceil(4);
        let reps = (200_000 / blocks).clamp(3, 200);
        g.int_gemv(&w, &x, &mut out, 1).unwrap();
        let t = Instant::now();
        for _ in 0..reps {
            g.int_gemv(&w, &x, &mut out, 1).unwrap();
        }
        let dt = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "int4_gemv {rows:>6}x{cols:<5} n=1: {:>8.2} ms/launch, {blocks:>6} blocks, {:>7.0} blocks/s",
            dt * 1e3,
            blocks as f64 / dt
        );

        // One expert, one assignment: the MoE GEMV's one tile of one token.
        let wb = g.upload(&vec![0x3f80u16; rows * cols]).unwrap();
        let (offsets, order) = g.moe_group(&g.upload(&[0i32]).unwrap(), 1).unwrap();
        let tiles = g.moe_tiles(&offsets, 1, 1).unwrap();
        let w = ExpertWeight::Bf16 { w: &wb, rows, cols };
        g.moe_gemv(w, rows, &x, 1, &order, &tiles, &mut out, 1).unwrap();
        let t = Instant::now();
        for _ in 0..reps {
            g.moe_gemv(w, rows, &x, 1, &order, &tiles, &mut out, 1).unwrap();
        }
        let dt = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "bf16 gemv {rows:>6}x{cols:<5} n=1: {:>8.2} ms/launch, {blocks:>6} blocks, {:>7.0} blocks/s",
            dt * 1e3,
            blocks as f64 / dt
        );
    }
}
