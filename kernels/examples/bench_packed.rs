//! Throughput of the packed low-bit matmul against the dense f32 kernel, per instruction set.
//! `cargo run --release -p kernels --example bench_packed`

use std::time::Instant;

use kernels::cpu::bitpack::PackedRows;
use kernels::cpu::cubic::AnyCubic;
use kernels::cpu::int8_matmul::{int8_matmul_t_path, Int8Path};
use kernels::cpu::matmul::matmul_t;
use kernels::cpu::mxfp4::Mxfp4Matrix;
use kernels::cpu::packed_matmul::{packed_matmul_t_isa, Isa};
use kernels::cpu::quant_int::IntMatrix;

/// Fastest single call over about a second: the machine may be shared, and the minimum is the
/// run that was not preempted.
fn time<F: FnMut()>(mut f: F) -> f64 {
    f();
    let mut best = f64::MAX;
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < 1.0 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    if std::env::var("DECODE_ONLY").is_ok() {
        return decode_only();
    }
    println!("threads {}", rayon::current_num_threads());
    // Optional arguments `M K N` restrict the run to one shape (for profiling).
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let shapes = if args.len() == 3 { vec![(args[0], args[1])] } else { vec![(1536usize, 576usize), (4096, 4096)] };
    let batches = if args.len() == 3 { vec![args[2]] } else { vec![1usize, 8, 64] };
    for &(m, k) in &shapes {
        let codes: Vec<u8> = (0..m * k).map(|i| (i * 7 % 16) as u8).collect();
        let groups = m * k.div_ceil(128);
        let w = IntMatrix::new(PackedRows::from_codes(4, m, k, &codes), 128, &vec![0.01; groups], &vec![8.0; groups]);
        let mx = Mxfp4Matrix::new(
            m,
            k,
            &codes.chunks(2).map(|p| p[0] | p[1] << 4).collect::<Vec<u8>>(),
            &vec![120u8; m * k / 32],
        );
        let cubic: Vec<AnyCubic> = [3u32, 4]
            .iter()
            .map(|&b| {
                let c: Vec<u8> = codes.iter().map(|&v| v % (1 << b)).collect();
                let g = m * k.div_ceil(512);
                AnyCubic::new(PackedRows::from_codes(b, m, k, &c), 512, &vec![0.01; g], &vec![0.3; g])
            })
            .collect();
        // GGUF-like 4- and 8-bit matrices (groups of 32, f16-exact parameters) for the 8-bit
        // activation kernel (`--cpu-activations int8`).
        let i8act: Vec<IntMatrix> = [4u32, 8]
            .iter()
            .map(|&b| {
                let c: Vec<u8> = (0..m * k).map(|i| (i * 7 % (1 << b)) as u8).collect();
                let g = m * k / 32;
                IntMatrix::new(
                    PackedRows::from_codes(b, m, k, &c),
                    32,
                    &vec![0.0125; g],
                    &vec![(1 << (b - 1)) as f32; g],
                )
                .with_int8_activations()
                .unwrap()
            })
            .collect();
        let dense: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.01).collect();
        for &n in &batches {
            let x: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 * 0.1).collect();
            let mut out = vec![0.0; n * m];
            let t = time(|| matmul_t(&x, &dense, &mut out, n, k, m));
            println!(
                "{m}x{k} n={n:<3} dense f32        {:8.1} us  {:6.2} GB/s weights  {:6.1} GFLOP/s",
                t * 1e6,
                (m * k * 4) as f64 / t / 1e9,
                2.0 * (n * m * k) as f64 / t / 1e9
            );
            for isa in Isa::available() {
                if isa == Isa::Scalar && m * k > 1 << 20 {
                    continue;
                }
                let t = time(|| packed_matmul_t_isa(isa, &w, &x, &mut out, n));
                println!(
                    "{m}x{k} n={n:<3} int4 g128 {:<10} {:8.1} us  {:6.2} GB/s packed   {:6.1} GFLOP/s",
                    isa.name(),
                    t * 1e6,
                    w.bytes() as f64 / t / 1e9,
                    2.0 * (n * m * k) as f64 / t / 1e9
                );
            }
            for wq in &i8act {
                for path in Int8Path::available() {
                    if path == Int8Path::Scalar {
                        continue;
                    }
                    let t = time(|| int8_matmul_t_path(path, wq, &x, &mut out, n));
                    println!(
                        "{m}x{k} n={n:<3} int{} g32 i8act {:<10} {:5.1} us  {:6.2} GB/s packed   {:6.1} GFLOP/s",
                        wq.bits(),
                        path.name(),
                        t * 1e6,
                        wq.bytes() as f64 / t / 1e9,
                        2.0 * (n * m * k) as f64 / t / 1e9
                    );
                }
            }
            let isa = Isa::detect();
            let t = time(|| packed_matmul_t_isa(isa, &mx, &x, &mut out, n));
            println!(
                "{m}x{k} n={n:<3} mxfp4      {:<10} {:8.1} us  {:6.2} GB/s packed   {:6.1} GFLOP/s",
                isa.name(),
                t * 1e6,
                mx.bytes() as f64 / t / 1e9,
                2.0 * (n * m * k) as f64 / t / 1e9
            );
            for c in &cubic {
                let t = time(|| c.matmul_t_isa(isa, &x, &mut out, n));
                let bytes = (m * k * c.bits() as usize).div_ceil(8) + m * k.div_ceil(512) * 4;
                println!(
                    "{m}x{k} n={n:<3} cubic{} g512 {:<10} {:8.1} us  {:6.2} GB/s packed   {:6.1} GFLOP/s",
                    c.bits(),
                    isa.name(),
                    t * 1e6,
                    bytes as f64 / t / 1e9,
                    2.0 * (n * m * k) as f64 / t / 1e9
                );
            }
        }
    }
}

#[allow(dead_code)]
pub fn decode_only() {
    use kernels::cpu::packed_matmul::decode_row;
    let (m, k) = (64usize, 4096usize);
    let codes: Vec<u8> = (0..m * k).map(|i| (i * 7 % 16) as u8).collect();
    let w = IntMatrix::new(PackedRows::from_codes(4, m, k, &codes), 128, &vec![0.01; m * 32], &vec![8.0; m * 32]);
    let mut dst = vec![0.0f32; k];
    for isa in Isa::available() {
        let t = time(|| {
            for r in 0..m {
                decode_row(isa, &w, r, &mut dst);
            }
            std::hint::black_box(&dst);
        });
        println!("decode {:<10} {:.2} ns/16 weights", isa.name(), t * 1e9 / (m * k / 16) as f64);
    }
}
