//! `wasmserve quantize`: data-free conversion of a BF16/F16/F32 (or compressed-tensors MXFP4,
//! see `source`) Hugging Face checkpoint into
//! compressed-tensors INT (`pack-quantized`) or Cubic (docs/cubic-format.md), with a per-layer
//! policy. Streams tensor by tensor (memory: the mapped input plus one tensor and its quantized
//! form), never overwrites, and reports per storage configuration the scale-free NRMSE of the
//! groupwise reconstruction, the clipped share and the effective bits per weight.

pub mod cubic_fit;
pub mod int_rtn;
pub mod policy;
pub mod source;
pub mod stats;
pub mod writer;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::model::format::hf_source::SafetensorsSource;
use policy::{Format, LayerPlan, Policy};
use source::Stored;
use stats::Report;
use writer::{Planned, StreamWriter};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum FormatArg {
    /// compressed-tensors pack-quantized (round-to-nearest, min/max scales; default 4 bits, group 128).
    Int,
    /// Cubic non-uniform levels (default 3 bits, group 512).
    Cubic,
}

#[derive(Args)]
pub struct QuantizeArgs {
    /// Hugging Face model directory (config.json + BF16/F16/F32 or mxfp4-pack-quantized safetensors + tokenizer files).
    #[arg(long)]
    pub input: PathBuf,
    /// Output directory; must not exist.
    #[arg(long)]
    pub output: PathBuf,
    #[arg(long, value_enum)]
    pub format: Option<FormatArg>,
    /// Bits per weight code (1..=8).
    #[arg(long)]
    pub bits: Option<u32>,
    /// Input features per group (multiple of 16, 32..=1024).
    #[arg(long)]
    pub group_size: Option<usize>,
    /// JSON policy with per-layer rules (see host/src/quantize/policy.rs).
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// No progress bar (logs and tests).
    #[arg(long)]
    pub quiet: bool,
}

/// Names that are 2-D `.weight` tensors but not Linear layers.
fn is_embedding(module: &str) -> bool {
    ["embed_tokens", "embed_positions", "wte", "wpe", "word_embeddings"].iter().any(|e| module.ends_with(e))
}

enum Job {
    Copy {
        name: String,
    },
    Quantize {
        module: String,
        rows: usize,
        cols: usize,
        plan: LayerPlan,
        stored: Stored,
    },
    /// An MXFP4 source weight the policy keeps unquantized: written as BF16 `<m>.weight`
    /// (exact: an E2M1 value times a power of two has 3 significant bits).
    Decode {
        module: String,
        rows: usize,
        cols: usize,
    },
}

fn plan_tensors(src: &SafetensorsSource, policy: &Policy) -> Result<(Vec<Job>, Vec<Planned>, Vec<String>)> {
    let mut jobs = Vec::new();
    let mut planned = Vec::new();
    let mut notes = Vec::new();
    for name in src.names() {
        if source::is_mxfp4_scale(src, name) {
            continue;
        }
        let t = src.raw(name)?;
        let float = matches!(t.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16);
        let (module, stored, rows, cols) = match source::mxfp4_module(src, name) {
            Some(m) => (Some(m), Stored::Mxfp4, t.shape[0], t.shape[1] * 2),
            None => (
                name.strip_suffix(".weight").filter(|_| float && t.shape.len() == 2),
                Stored::Float,
                t.shape.first().copied().unwrap_or(0),
                t.shape.get(1).copied().unwrap_or(0),
            ),
        };
        let plan = match module {
            Some(m) if !is_embedding(m) => policy.plan_for(m),
            _ => None,
        };
        // compressed-tensors needs the columns to divide into whole groups: use the largest
        // group size (a multiple of 16, not above the requested one) that does.
        let plan = match plan {
            Some(p) if p.format == Format::Int && cols % p.group_size != 0 => {
                match (16..=p.group_size).rev().step_by(16).find(|g| g % 16 == 0 && cols % g == 0) {
                    Some(g) => {
                        notes.push(format!(
                            "{cols} columns do not divide into groups of {}; using groups of {g}",
                            p.group_size
                        ));
                        Some(LayerPlan { group_size: g, ..p })
                    }
                    None => {
                        notes.push(format!("{cols} columns have no group size dividing them; kept dense"));
                        None
                    }
                }
            }
            p => p,
        };
        match plan {
            None if stored == Stored::Mxfp4 => {
                let m = module.unwrap().to_string();
                planned.push(Planned { name: format!("{m}.weight"), dtype: "BF16".into(), shape: vec![rows, cols] });
                jobs.push(Job::Decode { module: m, rows, cols });
            }
            None => {
                let dtype = serde_json::to_value(t.dtype)?.as_str().context("dtype name")?.to_string();
                planned.push(Planned { name: name.to_string(), dtype, shape: t.shape.to_vec() });
                jobs.push(Job::Copy { name: name.to_string() });
            }
            Some(plan) => {
                let m = module.unwrap().to_string();
                let groups = cols.div_ceil(plan.group_size);
                let b = plan.bits as usize;
                match plan.format {
                    Format::Cubic => {
                        planned.push(Planned {
                            name: format!("{m}.cubic_codes"),
                            dtype: "U8".into(),
                            shape: vec![rows, (cols * b).div_ceil(8)],
                        });
                        planned.push(Planned {
                            name: format!("{m}.cubic_scale"),
                            dtype: "F16".into(),
                            shape: vec![rows, groups],
                        });
                        planned.push(Planned {
                            name: format!("{m}.cubic_shape"),
                            dtype: "F16".into(),
                            shape: vec![rows, groups],
                        });
                    }
                    Format::Int => {
                        planned.push(Planned {
                            name: format!("{m}.weight_packed"),
                            dtype: "I32".into(),
                            shape: vec![rows, (cols * b).div_ceil(32)],
                        });
                        planned.push(Planned {
                            name: format!("{m}.weight_scale"),
                            dtype: "BF16".into(),
                            shape: vec![rows, groups],
                        });
                        planned.push(Planned {
                            name: format!("{m}.weight_shape"),
                            dtype: "I64".into(),
                            shape: vec![2],
                        });
                        if !plan.symmetric {
                            planned.push(Planned {
                                name: format!("{m}.weight_zero_point"),
                                dtype: "I32".into(),
                                shape: vec![(rows * b).div_ceil(32), groups],
                            });
                        }
                    }
                }
                jobs.push(Job::Quantize { module: m, rows, cols, plan, stored });
            }
        }
    }
    Ok((jobs, planned, notes))
}

fn u16s(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn quantization_config(jobs: &[Job]) -> Value {
    let quantized: Vec<(&String, &LayerPlan)> = jobs
        .iter()
        .filter_map(|j| match j {
            Job::Quantize { module, plan, .. } => Some((module, plan)),
            Job::Copy { .. } | Job::Decode { .. } => None,
        })
        .collect();
    let format = quantized.first().map(|(_, p)| p.format).unwrap_or(Format::Cubic);
    match format {
        Format::Cubic => {
            let modules: serde_json::Map<String, Value> = quantized
                .iter()
                .map(|(m, p)| (m.to_string(), json!({"bits": p.bits, "group_size": p.group_size})))
                .collect();
            json!({"quant_method": "cubic", "version": 1, "modules": modules})
        }
        Format::Int => {
            // One compressed-tensors config group per distinct scheme, targeting modules by name.
            let mut groups: BTreeMap<(u32, usize, bool), Vec<String>> = BTreeMap::new();
            for (m, p) in &quantized {
                groups.entry((p.bits, p.group_size, p.symmetric)).or_default().push(m.to_string());
            }
            let config_groups: serde_json::Map<String, Value> = groups
                .into_iter()
                .enumerate()
                .map(|(i, ((bits, gs, sym), targets))| {
                    (format!("group_{i}"), json!({
                        "targets": targets, "format": "pack-quantized", "input_activations": null, "output_activations": null,
                        "weights": {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group", "group_size": gs,
                                    "dynamic": false, "observer": "minmax"}}))
                })
                .collect();
            json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                   "config_groups": config_groups, "ignore": [], "kv_cache_scheme": null})
        }
    }
}

/// Runs the conversion; returns the statistics report.
pub fn quantize(a: &QuantizeArgs) -> Result<Report> {
    if a.output.exists() {
        bail!("{} already exists; refusing to overwrite", a.output.display());
    }
    let cfg_path = a.input.join("config.json");
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?,
    )
    .with_context(|| format!("{}: invalid JSON", cfg_path.display()))?;
    source::check_source_config(&a.input, &cfg)?;
    let policy_text = match &a.policy {
        Some(p) => Some(std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?),
        None => None,
    };
    let format = a.format.map(|f| match f {
        FormatArg::Int => Format::Int,
        FormatArg::Cubic => Format::Cubic,
    });
    let policy = Policy::new(policy_text.as_deref(), format, a.bits, a.group_size).map_err(anyhow::Error::msg)?;
    let src = SafetensorsSource::open(&a.input)?;
    let (jobs, planned, notes) = plan_tensors(&src, &policy)?;
    let mut counted: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &notes {
        *counted.entry(n.as_str()).or_default() += 1;
    }
    for (n, count) in counted {
        tracing::warn!("{count} weight tensors: {n}");
    }

    std::fs::create_dir(&a.output).with_context(|| format!("creating {}", a.output.display()))?;
    // Leave nothing half-written behind: a failed run removes the directory it created.
    let result = write_output(a, &src, &jobs, planned, cfg).and_then(|report| {
        copy_side_files(&a.input, &a.output)?;
        Ok(report)
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&a.output);
    }
    result
}

fn write_output(
    a: &QuantizeArgs,
    src: &SafetensorsSource,
    jobs: &[Job],
    planned: Vec<Planned>,
    mut cfg: Value,
) -> Result<Report> {
    let total: u64 = jobs
        .iter()
        .map(|j| match j {
            Job::Copy { name } => src.raw(name).map(|t| t.shape.iter().product::<usize>() as u64).unwrap_or(0),
            Job::Quantize { rows, cols, .. } | Job::Decode { rows, cols, .. } => (rows * cols) as u64,
        })
        .sum();
    // Checkpoint-wide effective bits per weight: every stored tensor's bits (codes, scales,
    // zero points, levels, norms, embeddings) over the source's parameter count.
    let mut report = Report {
        checkpoint_params: total,
        checkpoint_bits: planned.iter().map(Planned::bits).sum(),
        ..Report::default()
    };
    let bar = if a.quiet { ProgressBar::hidden() } else { ProgressBar::new(total) };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% {human_pos}/{human_len} weights, eta {eta} {msg}",
        )
        .unwrap(),
    );
    let mut w = StreamWriter::create(&a.output.join("model.safetensors"), planned)?;
    for job in jobs {
        match job {
            Job::Copy { name } => {
                let t = src.raw(name)?;
                w.write(name, t.bytes)?;
                let n = t.shape.iter().product::<usize>() as u64;
                if name.ends_with(".weight") && t.shape.len() == 2 {
                    report.dense_weights += n;
                }
                bar.inc(n);
            }
            Job::Decode { module, rows, cols } => {
                let x = source::load_f32(src, module, *rows, *cols, Stored::Mxfp4)?;
                let bits: Vec<u16> = x.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
                w.write(&format!("{module}.weight"), &u16s(&bits))?;
                report.dense_weights += (rows * cols) as u64;
                bar.inc((rows * cols) as u64);
            }
            Job::Quantize { module, rows, cols, plan, stored } => {
                bar.set_message(module.clone());
                let weight = source::load_f32(src, module, *rows, *cols, *stored)?;
                let x = weight.as_slice();
                let stats = match plan.format {
                    Format::Cubic => {
                        let t = cubic_fit::quantize_cubic(x, *rows, *cols, plan.bits, plan.group_size);
                        w.write(&format!("{module}.cubic_codes"), &t.codes)?;
                        w.write(&format!("{module}.cubic_scale"), &u16s(&t.scale))?;
                        w.write(&format!("{module}.cubic_shape"), &u16s(&t.shape))?;
                        t.stats
                    }
                    Format::Int => {
                        let t = int_rtn::quantize_int(x, *rows, *cols, plan.bits, plan.group_size, plan.symmetric);
                        w.write(&format!("{module}.weight_packed"), &t.packed)?;
                        w.write(&format!("{module}.weight_scale"), &u16s(&t.scale))?;
                        let shape: Vec<u8> =
                            [*rows as i64, *cols as i64].iter().flat_map(|v| v.to_le_bytes()).collect();
                        w.write(&format!("{module}.weight_shape"), &shape)?;
                        if let Some(zp) = &t.zero_point {
                            w.write(&format!("{module}.weight_zero_point"), zp)?;
                        }
                        t.stats
                    }
                };
                report.add(&plan.kind(), &stats);
                bar.inc((rows * cols) as u64);
            }
        }
    }
    w.finish()?;
    bar.finish_and_clear();

    cfg["quantization_config"] = quantization_config(jobs);
    std::fs::write(a.output.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
    Ok(report)
}
/// Tokenizer, chat template, generation config, …: every file that is not weights or config.
fn copy_side_files(from: &Path, to: &Path) -> Result<()> {
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let weights =
            name.ends_with(".safetensors") || name == "model.safetensors.index.json" || name.ends_with(".bin");
        if e.file_type()?.is_file() && !weights && name != "config.json" {
            std::fs::copy(e.path(), to.join(&name))?;
        }
    }
    Ok(())
}

/// The `wasmserve quantize` command.
pub fn run(a: QuantizeArgs) -> Result<()> {
    let started = std::time::Instant::now();
    let report = quantize(&a)?;
    println!("{}", report.table());
    eprintln!("wrote {} in {:.1}s", a.output.display(), started.elapsed().as_secs_f64());
    Ok(())
}
