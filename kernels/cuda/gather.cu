// Row gathers for the device forward (CPU reference kernels/src/cpu/gather.rs): the embedding
// lookup (f32 or bf16 table -> f32 rows) and picking the rows that need logits; plus the f32 ->
// bf16 narrowing of activations that feed the bf16 GEMM. One thread per output element.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ src, const int* __restrict__ rows, float* __restrict__ out,
                                           int n, int d) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)n * d) return;
    long r = idx / d, i = idx % d;
    out[idx] = src[(long)rows[r] * d + i];
}

extern "C" __global__ void gather_rows_bf16(const u16* __restrict__ src, const int* __restrict__ rows, float* __restrict__ out,
                                            int n, int d) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)n * d) return;
    long r = idx / d, i = idx % d;
    out[idx] = bf16_to_f32(src[(long)rows[r] * d + i]);
}

extern "C" __global__ void narrow_bf16(const float* __restrict__ x, u16* __restrict__ out, int n) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    out[idx] = f32_to_bf16(x[idx]);
}
