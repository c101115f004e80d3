//! Reconstruction statistics of a quantization run, per storage configuration.

use std::collections::BTreeMap;

#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    /// Σ (w − ŵ)²
    pub err2: f64,
    /// Σ w²
    pub w2: f64,
    /// Weights outside [lowest level, highest level] of their group (saturated).
    pub clipped: u64,
    pub weights: u64,
    /// Bits stored for these weights: codes plus per-group parameters.
    pub bits: u64,
}

impl Stats {
    pub fn add(&mut self, o: &Stats) {
        self.err2 += o.err2;
        self.w2 += o.w2;
        self.clipped += o.clipped;
        self.weights += o.weights;
        self.bits += o.bits;
    }

    /// Scale-free normalised RMS error `sqrt(Σ(w − ŵ)² / Σw²)`.
    pub fn nrmse(&self) -> f64 {
        if self.w2 > 0.0 {
            (self.err2 / self.w2).sqrt()
        } else {
            0.0
        }
    }

    pub fn clipped_pct(&self) -> f64 {
        100.0 * self.clipped as f64 / self.weights.max(1) as f64
    }

    pub fn bits_per_weight(&self) -> f64 {
        self.bits as f64 / self.weights.max(1) as f64
    }
}

/// Stats keyed by a description of the storage (e.g. "cubic b3 g512"), plus checkpoint totals.
#[derive(Default)]
pub struct Report {
    pub by_kind: BTreeMap<String, Stats>,
    pub dense_weights: u64,
    /// Parameters of the source checkpoint (every tensor's element count, quantized or not).
    pub checkpoint_params: u64,
    /// Bits of every tensor written (codes, scales, zero points, Cubic shapes, dense tensors).
    pub checkpoint_bits: u64,
}

impl Report {
    pub fn add(&mut self, kind: &str, s: &Stats) {
        self.by_kind.entry(kind.to_string()).or_default().add(s);
    }

    /// Effective bits per weight of the whole output checkpoint.
    pub fn checkpoint_bits_per_weight(&self) -> f64 {
        self.checkpoint_bits as f64 / self.checkpoint_params.max(1) as f64
    }

    /// `format  loss  clipped %` per storage configuration (loss = scale-free NRMSE), then the
    /// checkpoint-wide effective bits per weight.
    pub fn table(&self) -> String {
        let mut out =
            format!("{:<16} {:>9}  {:>9}  {:>11}  {:>11}\n", "format", "loss", "clipped %", "weights", "bits/weight");
        let row = |k: &str, s: &Stats| {
            format!(
                "{k:<16} {:>9.5}  {:>9.4}  {:>11}  {:>11.4}\n",
                s.nrmse(),
                s.clipped_pct(),
                s.weights,
                s.bits_per_weight()
            )
        };
        let mut total = Stats::default();
        for (k, s) in &self.by_kind {
            out += &row(k, s);
            total.add(s);
        }
        if self.by_kind.len() > 1 {
            out += &row("all quantized", &total);
        }
        out += &format!(
            "checkpoint: {:.4} effective bits per weight ({} bits over {} parameters, {} weights kept dense)\n",
            self.checkpoint_bits_per_weight(),
            self.checkpoint_bits,
            self.checkpoint_params,
            self.dense_weights
        );
        out += "(loss = NRMSE = sqrt(Σ(w−ŵ)²/Σw²); clipped = outside the group's level range; bits/weight counts codes and group parameters)\n";
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_header_rows_and_checkpoint_line() {
        let mut r = Report { checkpoint_params: 1000, checkpoint_bits: 6000, dense_weights: 200, ..Report::default() };
        r.add("int4 g128", &Stats { err2: 1.0, w2: 100.0, clipped: 8, weights: 800, bits: 800 * 4 + 16 * 7 });
        let t = r.table();
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("format") && lines[0].contains("loss") && lines[0].contains("clipped %"), "{t}");
        assert!(
            lines[1].starts_with("int4 g128") && lines[1].contains("0.10000") && lines[1].contains("1.0000"),
            "{t}"
        );
        assert!(lines[2].starts_with("checkpoint: 6.0000 effective bits per weight"), "{t}");
    }
}
