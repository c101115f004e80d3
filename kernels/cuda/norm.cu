// RMSNorm (CPU reference kernels/src/cpu/norm.rs): y = w * (x / sqrt(mean(x^2) + eps)), f32
// accumulation. One block per row. `add_rms_norm` fuses the residual add that precedes every
// norm in a decoder layer (x += delta; y = norm(x)), saving one read and write of the stream.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                                    int d, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (long)blockIdx.x * d;
    float* yr = y + (long)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = w[i] * (xr[i] * inv);
}

extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ delta, const float* __restrict__ w,
                                        float* __restrict__ y, int d, float eps) {
    __shared__ float scratch[32];
    float* xr = x + (long)blockIdx.x * d;
    const float* dr = delta + (long)blockIdx.x * d;
    float* yr = y + (long)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = xr[i] + dr[i];
        xr[i] = v;
        ss += v * v;
    }
    float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = w[i] * (xr[i] * inv);
}
