// Stores a batch's keys and values into the paged KV pool (like vLLM's reshape_and_cache; CPU
// reference kernels/src/cpu/kv_write.rs). The pool layout is the host block pool's
// (host/src/engine/block_pool.rs): per layer K and V are [pool row][kv_heads * head_dim] with
// pool row = block * block_size + slot; `slots[t]` is token t's pool row (its slot mapping).
// FP8 keeps one scale per (pool row, kv head), amax / 448, as kernels/src/cpu/fp8.rs.
// The kv_store_* kernels store one tensor of rows `width` wide (FP8: one scale per pool row), for
// pools whose key and value rows differ in width (MLA: latent and rotary key).

// Where flat element idx of a batch of `width`-wide rows lands in the pool.
__device__ __forceinline__ long pool_at(const int* slots, long idx, int width) {
    return (long)slots[idx / width] * width + idx % width;
}

extern "C" __global__ void kv_write_f32(const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ slots,
                                        float* __restrict__ kc, float* __restrict__ vc, int n, int width) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)n * width) return;
    long at = pool_at(slots, idx, width);
    kc[at] = k[idx];
    vc[at] = v[idx];
}

extern "C" __global__ void kv_write_bf16(const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ slots,
                                         u16* __restrict__ kc, u16* __restrict__ vc, int n, int width) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)n * width) return;
    long at = pool_at(slots, idx, width);
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

// Block-wide: quantises x[0..len] with one scale (amax / 448, 1 for an all-zero group) into
// codes and *scale, as kernels/src/cpu/fp8.rs quantize_e4m3. Every thread of the block calls it.
__device__ void store_e4m3_group(const float* __restrict__ x, int len, u8* __restrict__ codes, float* __restrict__ scale_out, float* scratch) {
    float amax = 0.0f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) amax = fmaxf(amax, __uint_as_float(__float_as_uint(x[i]) & 0x7fffffffu));
    amax = block_max(amax, scratch);
    float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) codes[i] = f32_to_e4m3(x[i] / scale);
    if (threadIdx.x == 0) *scale_out = scale;
}

// One block per (token, kv head, K or V).
extern "C" __global__ void kv_write_fp8(const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ slots,
                                        u8* __restrict__ kc, u8* __restrict__ vc, float* __restrict__ ks, float* __restrict__ vs,
                                        int n, int kv_heads, int head_dim) {
    __shared__ float scratch[32];
    int t = blockIdx.x, h = blockIdx.y, which = blockIdx.z;
    int width = kv_heads * head_dim;
    long row = slots[t];
    store_e4m3_group((which ? v : k) + (long)t * width + (long)h * head_dim, head_dim, (which ? vc : kc) + row * width + (long)h * head_dim,
                     (which ? vs : ks) + row * kv_heads + h, scratch);
}

extern "C" __global__ void kv_store_f32(const float* __restrict__ x, const int* __restrict__ slots, float* __restrict__ cache, int n, int width) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < (long)n * width) cache[pool_at(slots, idx, width)] = x[idx];
}

extern "C" __global__ void kv_store_bf16(const float* __restrict__ x, const int* __restrict__ slots, u16* __restrict__ cache, int n, int width) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < (long)n * width) cache[pool_at(slots, idx, width)] = f32_to_bf16(x[idx]);
}

// One block per token: its row's codes and the row's one scale.
extern "C" __global__ void kv_store_fp8(const float* __restrict__ x, const int* __restrict__ slots, u8* __restrict__ codes,
                                        float* __restrict__ scales, int n, int width) {
    __shared__ float scratch[32];
    long row = slots[blockIdx.x];
    store_e4m3_group(x + (long)blockIdx.x * width, width, codes + row * width, scales + row, scratch);
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
