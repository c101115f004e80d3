// Stores a batch's keys and values into the paged KV pool (like vLLM's reshape_and_cache; CPU
// reference kernels/src/cpu/kv_write.rs). The pool layout is the host block pool's
// (host/src/engine/block_pool.rs): per layer K and V are [pool row][kv_heads * head_dim] with
// pool row = block * block_size + slot; `slots[t]` is token t's pool row (its slot mapping).
// FP8 keeps one scale per (pool row, kv head), amax / 448, as kernels/src/cpu/fp8.rs.
extern "C" __global__ void kv_write_f32(const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ slots,
                                        float* __restrict__ kc, float* __restrict__ vc, int n, int width) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)n * width) return;
    long t = idx / width, i = idx % width;
    long at = (long)slots[t] * width + i;
    kc[at] = k[idx];
    vc[at] = v[idx];
}

extern "C" __global__ void kv_write_bf16(const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ slots,
                                         u16* __restrict__ kc, u16* __restrict__ vc, int n, int width) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)n * width) return;
    long t = idx / width, i = idx % width;
    long at = (long)slots[t] * width + i;
    kc[at] = f32_to_bf16(k[idx]);
    vc[at] = f32_to_bf16(v[idx]);
}

// Nearest E4M3 code, ties to the even code, saturating at 448: the CPU's binary search over the
// monotonic finite codes, so both sides pick the same code for every input.
__device__ __forceinline__ u8 f32_to_e4m3(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7F;
    u8 sign = (u >> 31) ? 0x80 : 0;
    float a = __uint_as_float(u & 0x7fffffffu);
    if (a > 448.0f) a = 448.0f;
    int lo = 0, hi = 0x7E;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (e4m3_to_f32((u8)mid) <= a) lo = mid; else hi = mid - 1;
    }
    int code = lo;
    if (lo < 0x7E) {
        float db = a - e4m3_to_f32((u8)lo), da = e4m3_to_f32((u8)(lo + 1)) - a;
        if (da < db || (da == db && lo % 2 == 1)) code = lo + 1;
    }
    return sign | (u8)code;
}

// One block per (token, kv head, K or V): the head's amax, then its codes.
extern "C" __global__ void kv_write_fp8(const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ slots,
                                        u8* __restrict__ kc, u8* __restrict__ vc, float* __restrict__ ks, float* __restrict__ vs,
                                        int n, int kv_heads, int head_dim) {
    __shared__ float scratch[32];
    int t = blockIdx.x, h = blockIdx.y, which = blockIdx.z;
    int width = kv_heads * head_dim;
    const float* x = (which ? v : k) + (long)t * width + (long)h * head_dim;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) amax = fmaxf(amax, __uint_as_float(__float_as_uint(x[i]) & 0x7fffffffu));
    amax = block_max(amax, scratch);
    float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    long row = slots[t];
    u8* codes = (which ? vc : kc) + row * width + (long)h * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) codes[i] = f32_to_e4m3(x[i] / scale);
    if (threadIdx.x == 0) (which ? vs : ks)[row * kv_heads + h] = scale;
}

// buf[dst .. dst + n] = buf[src .. src + n] for non-overlapping spans of one pool buffer: the
// copy-on-write of a shared partial block (host BlockPool::copy_block) done on the device.
extern "C" __global__ void copy_span_f32(float* buf, long src, long dst, long n) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) buf[dst + idx] = buf[src + idx];
}
extern "C" __global__ void copy_span_u16(u16* buf, long src, long dst, long n) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) buf[dst + idx] = buf[src + idx];
}
extern "C" __global__ void copy_span_u8(u8* buf, long src, long dst, long n) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) buf[dst + idx] = buf[src + idx];
}
