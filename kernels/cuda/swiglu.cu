// SwiGLU (CPU reference kernels/src/cpu/activation.rs): out = silu(gate) * up. `gate_up` is the
// fused [tokens, 2*d] output of one gate+up projection (gate first), the layout that lets one
// GEMM produce both halves, so no separate gate/up buffers are needed.
extern "C" __global__ void silu_mul(const float* __restrict__ gate_up, float* __restrict__ out, int tokens, int d) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)tokens * d) return;
    long t = idx / d, i = idx % d;
    float g = gate_up[t * 2 * d + i], u = gate_up[t * 2 * d + d + i];
    out[idx] = g / (1.0f + expf(-g)) * u;
}

// Kimi K3's SiTU (CPU reference kernels/src/cpu/activation.rs `situ_mul`): out = beta*tanh(g/beta)
// * sigmoid(g) * lin(u), lin(u) = linear_beta*tanh(u/linear_beta), or u when linear_beta <= 0.
// Same fused [tokens, 2*d] gate|up layout as silu_mul.
extern "C" __global__ void situ_mul(const float* __restrict__ gate_up, float* __restrict__ out, int tokens, int d,
                                    float beta, float linear_beta) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)tokens * d) return;
    long t = idx / d, i = idx % d;
    float g = gate_up[t * 2 * d + i], u = gate_up[t * 2 * d + d + i];
    float gated = beta * tanhf(g / beta) / (1.0f + expf(-g));
    float lin = linear_beta > 0.0f ? linear_beta * tanhf(u / linear_beta) : u;
    out[idx] = gated * lin;
}
