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

/// Stats keyed by a description of the storage (e.g. "cubic b3 g512").
#[derive(Default)]
pub struct Report {
    pub by_kind: BTreeMap<String, Stats>,
    pub dense_weights: u64,
}

impl Report {
    pub fn add(&mut self, kind: &str, s: &Stats) {
        self.by_kind.entry(kind.to_string()).or_default().add(s);
    }

    pub fn table(&self) -> String {
        let mut out = String::from("format            weights      NRMSE    clipped %  bits/weight\n");
        let mut total = Stats::default();
        for (k, s) in &self.by_kind {
            out += &format!("{k:<16} {:>9}  {:>9.5}  {:>9.4}  {:>11.4}\n", s.weights, s.nrmse(), s.clipped_pct(), s.bits_per_weight());
            total.add(s);
        }
        if self.by_kind.len() > 1 {
            out += &format!("{:<16} {:>9}  {:>9.5}  {:>9.4}  {:>11.4}\n", "all quantized", total.weights, total.nrmse(), total.clipped_pct(), total.bits_per_weight());
        }
        out += &format!("(kept dense: {} weights; NRMSE = sqrt(Σ(w−ŵ)²/Σw²); clipped = outside the group's level range)\n", self.dense_weights);
        out
    }
}
