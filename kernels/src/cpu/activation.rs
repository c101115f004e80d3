//! Gated activations.

/// SwiGLU: `out[i] = silu(gate[i]) * up[i]`, with `silu(x) = x * sigmoid(x)`.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(gate.len(), up.len());
    assert_eq!(gate.len(), out.len());
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// Kimi K3's SiTU (TokenSpeed `kimi3_reference.py::situ_and_mul`):
/// `out = β·tanh(gate/β)·sigmoid(gate) · β_lin·tanh(up/β_lin)`, the sigmoid of the unclipped gate;
/// without `linear_beta` the up half passes unclipped.
pub fn situ_mul(gate: &[f32], up: &[f32], beta: f32, linear_beta: Option<f32>, out: &mut [f32]) {
    assert_eq!(gate.len(), up.len());
    assert_eq!(gate.len(), out.len());
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let gated = beta * (g / beta).tanh() / (1.0 + (-g).exp());
        let lin = match linear_beta {
            Some(b) => b * (u / b).tanh(),
            None => u,
        };
        *o = gated * lin;
    }
}
