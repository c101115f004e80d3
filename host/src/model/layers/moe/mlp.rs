//! The gated MLP every expert is made of: `down(act(gate(x), up(x)))`. Also serves as the shared
//! experts and as the dense MLP of a model's first (non-MoE) layers. Each projection is a
//! `Linear`, so an expert may be dense, INT, MXFP4 or Cubic, whatever the checkpoint stores.

use kernels::cpu::activation::{silu_mul, situ_mul};

use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::layers::linear::Linear;

/// The gated activation `act(gate, up)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) · up`.
    Silu,
    /// Kimi K3's SiTU (docs/formats.md §5.5):
    /// `β·tanh(gate/β)·sigmoid(gate) · β_lin·tanh(up/β_lin)`; without `linear_beta` the up half
    /// passes through unclipped. The sigmoid takes the unclipped gate.
    Situ { beta: f32, linear_beta: Option<f32> },
}

impl Activation {
    /// The activation `hidden_act` names in a (text) config: `silu`, or Kimi K3's `situ` with
    /// `activation_situ_beta` (default 4) and the optional `activation_situ_linear_beta`.
    pub fn from_hf_config(raw: &serde_json::Value) -> Result<Self, String> {
        let number = |key: &str| -> Result<Option<f32>, String> {
            match raw.get(key).filter(|v| !v.is_null()) {
                None => Ok(None),
                Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| format!("{key} must be a number, got {v}")),
            }
        };
        match raw.get("hidden_act").and_then(serde_json::Value::as_str).unwrap_or("silu") {
            "silu" | "swish" => Ok(Activation::Silu),
            "situ" => Ok(Activation::Situ {
                beta: number("activation_situ_beta")?.unwrap_or(4.0),
                linear_beta: number("activation_situ_linear_beta")?,
            }),
            other => Err(format!("hidden_act '{other}' is not supported for gated MLPs (silu, situ)")),
        }
    }

    /// `gate` becomes `act(gate, up)` in place.
    pub fn apply(self, gate: &mut [f32], up: &[f32]) {
        match self {
            Activation::Silu => {
                let g = gate.to_vec();
                silu_mul(&g, up, gate);
            }
            Activation::Situ { beta, linear_beta } => {
                let g = gate.to_vec();
                situ_mul(&g, up, beta, linear_beta, gate);
            }
        }
    }
}

pub struct GatedMlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub activation: Activation,
}

impl GatedMlp {
    /// Loads `{prefix}.{gate}`, `{prefix}.{up}`, `{prefix}.{down}` (leaf names in that order)
    /// for a `hidden → inter → hidden` MLP.
    pub fn load(
        src: &dyn WeightSource,
        prefix: &str,
        leaves: [&str; 3],
        hidden: usize,
        inter: usize,
        activation: Activation,
    ) -> Result<Self, LoadError> {
        Ok(Self {
            gate: src.linear(&format!("{prefix}.{}", leaves[0]), inter, hidden)?,
            up: src.linear(&format!("{prefix}.{}", leaves[1]), inter, hidden)?,
            down: src.linear(&format!("{prefix}.{}", leaves[2]), hidden, inter)?,
            activation,
        })
    }

    pub fn hidden_size(&self) -> usize {
        self.gate.in_features()
    }

    pub fn intermediate_size(&self) -> usize {
        self.gate.out_features()
    }

    /// `x` holds `n` rows of `hidden_size`; returns `n` rows of `hidden_size`.
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut h = self.gate.forward(x, n);
        let up = self.up.forward(x, n);
        self.activation.apply(&mut h, &up);
        self.down.forward(&h, n)
    }

    /// Bytes of weights one forward reads (the storage of all three projections).
    pub fn weight_bytes(&self) -> usize {
        [&self.gate, &self.up, &self.down].iter().map(|l| l.weight_bytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::Activation;

    #[test]
    fn situ_matches_its_formula() {
        let mut g = [-9.0f32, -0.5, 0.0, 0.7, 30.0];
        let u = [2.0f32, -1.0, 3.0, 40.0, 0.5];
        let want: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| {
                let (g, u) = (g as f64, u as f64);
                (4.0 * (g / 4.0).tanh() / (1.0 + (-g).exp()) * 25.0 * (u / 25.0).tanh()) as f32
            })
            .collect();
        Activation::Situ { beta: 4.0, linear_beta: Some(25.0) }.apply(&mut g, &u);
        for (a, b) in g.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    #[test]
    fn silu_is_swiglu() {
        let mut g = [1.0f32, -2.0];
        Activation::Silu.apply(&mut g, &[3.0, 0.5]);
        assert!((g[0] - 3.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
        assert!((g[1] - (-2.0 / (1.0 + 2.0f32.exp())) * 0.5).abs() < 1e-6);
    }
}
