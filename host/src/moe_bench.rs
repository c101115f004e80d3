//! `wasmserve bench moe`: the cost of an MoE decode step against the bytes of expert weights it
//! reads. A synthetic block (router + routed experts, no shared experts) is timed per step over
//! fresh random inputs, next to a dense gated MLP holding the same active bytes
//! (`intermediate = top_k × moe_intermediate`, same storage format), measured in the same run,
//! rounds interleaved, each side's fastest round kept (the machine may be shared).
//!
//! Weights are random bit patterns in the real storage formats (dense f32, INT pack-quantized
//! codes with group scales, Cubic codes with group scale/shape): the multiply kernels' cost does
//! not depend on the values, and every expert gets its own memory so nothing is served from cache
//! that a real checkpoint would have to stream. The dense side rotates over copies holding as many
//! bytes as all the experts, so both sides have the same working set. Accuracy of these formats is proven elsewhere
//! (tests/reference_moe.rs, docs/quantization.md).

use std::hint::black_box;
use std::time::Instant;

use anyhow::{bail, ensure, Result};
use kernels::cpu::bitpack::{row_bytes, PackedRows};
use kernels::cpu::cubic::AnyCubic;
use kernels::cpu::quant_int::IntMatrix;

use crate::model::format::quant::IntLinear;
use crate::model::layers::linear::Linear;
use crate::model::layers::moe::config::MoeConfig;
use crate::model::layers::moe::experts::Experts;
use crate::model::layers::moe::mlp::{Activation, GatedMlp};
use crate::model::layers::moe::router::Router;
use crate::model::tensor::Tensor;

#[derive(clap::Args)]
pub struct MoeBenchArgs {
    #[arg(long, default_value_t = 2048)]
    pub hidden: usize,
    /// Routed experts in the block.
    #[arg(long, default_value_t = 64)]
    pub experts: usize,
    /// Each expert's intermediate size.
    #[arg(long, default_value_t = 1024)]
    pub intermediate: usize,
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    pub top_k: Vec<usize>,
    /// Expert storage: f32, int<bits> (group --int-group), cubic<bits> (group --cubic-group).
    #[arg(long, value_delimiter = ',', default_value = "f32,int4,cubic3")]
    pub formats: Vec<String>,
    #[arg(long, default_value_t = 128)]
    pub int_group: usize,
    #[arg(long, default_value_t = 512)]
    pub cubic_group: usize,
    /// Tokens per step (1 = single-stream decode; more = a batch, where grouping by expert lets
    /// tokens that share an expert share its weight reads).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub tokens: Vec<usize>,
    /// Steps timed per round, each on fresh random inputs.
    #[arg(long, default_value_t = 24)]
    pub steps: usize,
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
}

#[derive(Clone, Copy, Debug)]
enum Format {
    F32,
    Int { bits: u32, group: usize },
    Cubic { bits: u32, group: usize },
}

impl Format {
    fn parse(s: &str, int_group: usize, cubic_group: usize) -> Result<Self> {
        let bits = |rest: &str| -> Result<u32> {
            match rest.parse::<u32>() {
                Ok(b) if (1..=8).contains(&b) => Ok(b),
                _ => bail!("format '{s}': bits must be 1..=8"),
            }
        };
        Ok(match s {
            "f32" => Format::F32,
            _ if s.starts_with("int") => Format::Int { bits: bits(&s[3..])?, group: int_group },
            _ if s.starts_with("cubic") => Format::Cubic { bits: bits(&s[5..])?, group: cubic_group },
            _ => bail!("unknown format '{s}' (f32, int<bits>, cubic<bits>)"),
        })
    }

    fn name(self) -> String {
        match self {
            Format::F32 => "f32".into(),
            Format::Int { bits, group } => format!("int{bits} g{group}"),
            Format::Cubic { bits, group } => format!("cubic{bits} g{group}"),
        }
    }
}

/// SplitMix64: fast enough to fill gigabytes of weights.
struct Fill(u64);

impl Fill {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-amp, amp).
    fn f32s(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n).map(|_| ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp).collect()
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn linear(fmt: Format, rows: usize, cols: usize, fill: &mut Fill) -> Linear {
    let packed = |bits: u32, fill: &mut Fill| {
        let stride = row_bytes(cols, bits);
        PackedRows::new(bits, rows, cols, stride, &fill.bytes(rows * stride))
    };
    match fmt {
        Format::F32 => Linear::Dense(Tensor::owned(vec![rows, cols], fill.f32s(rows * cols, 0.03))),
        Format::Int { bits, group } => {
            let groups = rows * cols.div_ceil(group);
            let zero = vec![(1u32 << (bits - 1)) as f32; groups];
            Linear::Int(IntLinear::new(
                IntMatrix::new(packed(bits, fill), group, &fill.f32s(groups, 0.01), &zero),
                None,
            ))
        }
        Format::Cubic { bits, group } => {
            let groups = rows * cols.div_ceil(group);
            let shape: Vec<f32> = fill.f32s(groups, 0.3).into_iter().map(f32::abs).collect();
            Linear::Cubic(AnyCubic::new(packed(bits, fill), group, &fill.f32s(groups, 0.03), &shape))
        }
    }
}

fn mlp(fmt: Format, hidden: usize, inter: usize, fill: &mut Fill) -> GatedMlp {
    GatedMlp {
        gate: linear(fmt, inter, hidden, fill),
        up: linear(fmt, inter, hidden, fill),
        down: linear(fmt, hidden, inter, fill),
        activation: Activation::Silu,
    }
}

fn config(a: &MoeBenchArgs, top_k: usize) -> MoeConfig {
    MoeConfig { norm_topk_prob: true, ..MoeConfig::plain(a.hidden, a.experts, top_k, a.intermediate) }
}

/// Seconds per call of `f` over every input, best of the rounds handled by the caller.
fn per_step(inputs: &[Vec<f32>], mut f: impl FnMut(usize, &[f32]) -> Vec<f32>) -> f64 {
    let started = Instant::now();
    for (i, x) in inputs.iter().enumerate() {
        black_box(f(i, x));
    }
    started.elapsed().as_secs_f64() / inputs.len() as f64
}

struct Row {
    format: String,
    tokens: usize,
    top_k: usize,
    /// Mean bytes of weights read per step: router + every distinct expert chosen that step.
    moe_bytes: f64,
    moe_s: f64,
    dense_bytes: f64,
    dense_s: f64,
    per_token_s: Option<f64>,
}

pub fn run(a: MoeBenchArgs) -> Result<()> {
    ensure!(
        a.steps > 0 && a.rounds > 0 && a.hidden > 0 && a.intermediate > 0,
        "--steps, --rounds and sizes must be positive"
    );
    ensure!(a.top_k.iter().all(|&k| (1..=a.experts).contains(&k)), "--top-k values must be in 1..={}", a.experts);
    ensure!(a.tokens.iter().all(|&n| n > 0), "--tokens values must be positive");
    let formats = a.formats.iter().map(|f| Format::parse(f, a.int_group, a.cubic_group)).collect::<Result<Vec<_>>>()?;
    eprintln!(
        "bench moe: hidden {}, {} experts x intermediate {}, {} threads",
        a.hidden,
        a.experts,
        a.intermediate,
        rayon::current_num_threads()
    );
    let mut fill = Fill(0x5EED);
    let mut rows = Vec::new();
    for fmt in formats {
        let built = Instant::now();
        let experts = Experts::new((0..a.experts).map(|_| mlp(fmt, a.hidden, a.intermediate, &mut fill)).collect());
        let router_w = fill.f32s(a.experts * a.hidden, 0.05);
        eprintln!(
            "{}: {} experts of {:.1} MB built in {:.1}s",
            fmt.name(),
            a.experts,
            experts.expert_bytes(0) as f64 / 1e6,
            built.elapsed().as_secs_f64()
        );
        for &k in &a.top_k {
            let router = Router::new(&config(&a, k), Tensor::owned(vec![a.experts, a.hidden], router_w.clone()), None);
            // As many dense copies as together hold all experts' bytes, used in turn: both sides
            // then have the same working set, and a small dense layer cannot sit in the last-level
            // cache while the experts stream from memory.
            let dense: Vec<GatedMlp> =
                (0..a.experts.div_ceil(k)).map(|_| mlp(fmt, a.hidden, k * a.intermediate, &mut fill)).collect();
            for &n in &a.tokens {
                let inputs: Vec<Vec<f32>> = (0..a.steps).map(|_| fill.f32s(n * a.hidden, 1.0)).collect();
                let moe_bytes = inputs
                    .iter()
                    .map(|x| {
                        let g = router.route(x, n).by_expert(a.experts);
                        let used: usize = (0..a.experts)
                            .filter(|&e| g.offsets[e + 1] > g.offsets[e])
                            .map(|e| experts.expert_bytes(e))
                            .sum();
                        (used + router.weight_bytes()) as f64
                    })
                    .sum::<f64>()
                    / a.steps as f64;
                let (mut moe_s, mut dense_s, mut tok_s) = (f64::MAX, f64::MAX, f64::MAX);
                // One untimed step each warms the thread pool and page tables.
                black_box(experts.forward(&inputs[0], n, &router.route(&inputs[0], n), &|_| true));
                black_box(dense[0].forward(&inputs[0], n));
                for round in 0..a.rounds {
                    let offset = round * a.steps;
                    moe_s = moe_s.min(per_step(&inputs, |_, x| experts.forward(x, n, &router.route(x, n), &|_| true)));
                    dense_s = dense_s.min(per_step(&inputs, |i, x| dense[(i + offset) % dense.len()].forward(x, n)));
                    if n > 1 {
                        tok_s =
                            tok_s.min(per_step(&inputs, |_, x| experts.forward_per_token(x, n, &router.route(x, n))));
                    }
                }
                eprintln!("{} k={k} tokens={n}: moe {:.0} us, dense {:.0} us", fmt.name(), moe_s * 1e6, dense_s * 1e6);
                rows.push(Row {
                    format: fmt.name(),
                    tokens: n,
                    top_k: k,
                    moe_bytes,
                    moe_s,
                    dense_bytes: dense[0].weight_bytes() as f64,
                    dense_s,
                    per_token_s: (n > 1).then_some(tok_s),
                });
            }
        }
    }
    println!(
        "{:<14} {:>6} {:>5} {:>14} {:>10} {:>8} {:>14} {:>10} {:>8} {:>10} {:>12}",
        "experts",
        "tokens",
        "top-k",
        "MoE MB/step",
        "MoE us",
        "GB/s",
        "dense MB/step",
        "dense us",
        "GB/s",
        "MoE/dense",
        "per-token us"
    );
    for r in rows {
        println!(
            "{:<14} {:>6} {:>5} {:>14.2} {:>10.0} {:>8.2} {:>14.2} {:>10.0} {:>8.2} {:>9.2}x {:>12}",
            r.format,
            r.tokens,
            r.top_k,
            r.moe_bytes / 1e6,
            r.moe_s * 1e6,
            r.moe_bytes / r.moe_s / 1e9,
            r.dense_bytes / 1e6,
            r.dense_s * 1e6,
            r.dense_bytes / r.dense_s / 1e9,
            r.moe_s / r.dense_s,
            r.per_token_s.map_or("-".into(), |s| format!("{:.0}", s * 1e6)),
        );
    }
    Ok(())
}
