// Rotary embedding, rotate-half layout (CPU reference kernels/src/cpu/rope.rs): dimension i pairs
// with i + rotary_dim/2. x is [tokens, heads, head_dim]; token t rotates by positions[t]. One
// thread per (token, head, pair); sin/cos are computed from inv_freq like the CPU (f32 angle).
extern "C" __global__ void rope_neox(float* __restrict__ x, const int* __restrict__ positions, const float* __restrict__ inv_freq,
                                     int tokens, int heads, int head_dim, int rotary_dim) {
    int half = rotary_dim / 2;
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long total = (long)tokens * heads * half;
    if (idx >= total) return;
    int i = idx % half;
    long th = idx / half; // token * heads + head
    int t = th / heads;
    float ang = (float)positions[t] * inv_freq[i];
    float s, c;
    sincosf(ang, &s, &c);
    float* h = x + th * head_dim;
    float a = h[i], b = h[i + half];
    h[i] = a * c - b * s;
    h[i + half] = b * c + a * s;
}
