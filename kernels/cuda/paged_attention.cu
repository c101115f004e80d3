// Paged attention for decode (one query token per sequence) over the engine's block pool
// (host/src/engine/block_pool.rs): K and V of one layer are [block][slot][kv_heads * head_dim],
// FP8 scales [block][slot][kv_heads] (one per head). Sequence s reads its positions through
// block_tables[s * max_blocks + pos / block_size]. CPU reference: kernels/src/cpu/attention.rs.
//
// One block per (sequence, query head), one warp per position in a strided loop: each warp
// computes its score, the block keeps a running softmax (max, sum) and the weighted V row in
// shared memory. head_dim <= 256. GQA: query head h reads kv head h / (heads / kv_heads).
#define MAX_D 256
#define WARPS 4

template <typename Load>
__device__ void attend(const float* __restrict__ q, const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                       float* __restrict__ out, int heads, int kv_heads, int head_dim, int block_size, int max_blocks,
                       float softmax_scale, Load load) {
    __shared__ float qs[MAX_D];
    __shared__ float acc[WARPS][MAX_D];
    __shared__ float wmax[WARPS], wsum[WARPS];
    int s = blockIdx.x, h = blockIdx.y;
    int kvh = h / (heads / kv_heads);
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    int len = seq_lens[s];
    const float* qr = q + ((long)s * heads + h) * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) qs[i] = qr[i] * softmax_scale;
    for (int i = lane; i < head_dim; i += WARP) acc[w][i] = 0.0f;
    __syncthreads();
    // Per-warp online softmax over the positions this warp owns.
    float m = __int_as_float(0xff800000), l = 0.0f;
    for (int pos = w; pos < len; pos += WARPS) {
        int blk = block_tables[(long)s * max_blocks + pos / block_size];
        long row = (long)blk * block_size + pos % block_size;
        float dot = 0.0f;
        for (int i = lane; i < head_dim; i += WARP) dot += qs[i] * load(0, row, kvh, i);
        dot = warp_sum(dot);
        float m2 = fmaxf(m, dot);
        float corr = expf(m - m2), p = expf(dot - m2);
        l = l * corr + p;
        for (int i = lane; i < head_dim; i += WARP) acc[w][i] = acc[w][i] * corr + p * load(1, row, kvh, i);
        m = m2;
    }
    if (lane == 0) { wmax[w] = m; wsum[w] = l; }
    __syncthreads();
    // Merge the warps' partial softmaxes.
    float M = __int_as_float(0xff800000);
    for (int i = 0; i < WARPS; i++) M = fmaxf(M, wmax[i]);
    float L = 0.0f;
    for (int i = 0; i < WARPS; i++) L += wsum[i] * (wmax[i] == M ? 1.0f : expf(wmax[i] - M));
    float* o = out + ((long)s * heads + h) * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        float v = 0.0f;
        for (int k = 0; k < WARPS; k++)
            if (wsum[k] > 0.0f) v += acc[k][i] * expf(wmax[k] - M);
        o[i] = len > 0 ? v / L : 0.0f;
    }
}

struct LoadF32 {
    const float* k; const float* v; int width, head_dim;
    __device__ float operator()(int which, long row, int kvh, int i) const {
        return (which ? v : k)[row * width + kvh * head_dim + i];
    }
};
struct LoadBf16 {
    const u16* k; const u16* v; int width, head_dim;
    __device__ float operator()(int which, long row, int kvh, int i) const {
        return bf16_to_f32((which ? v : k)[row * width + kvh * head_dim + i]);
    }
};
struct LoadFp8 {
    const u8* k; const u8* v; const float* ks; const float* vs; int width, head_dim, kv_heads;
    __device__ float operator()(int which, long row, int kvh, int i) const {
        float sc = (which ? vs : ks)[row * kv_heads + kvh];
        return e4m3_to_f32((which ? v : k)[row * width + kvh * head_dim + i]) * sc;
    }
};

extern "C" __global__ void paged_attention_f32(const float* q, const float* k, const float* v, const int* block_tables,
                                               const int* seq_lens, float* out, int heads, int kv_heads, int head_dim,
                                               int block_size, int max_blocks, float softmax_scale) {
    LoadF32 ld{k, v, kv_heads * head_dim, head_dim};
    attend(q, block_tables, seq_lens, out, heads, kv_heads, head_dim, block_size, max_blocks, softmax_scale, ld);
}
extern "C" __global__ void paged_attention_bf16(const float* q, const u16* k, const u16* v, const int* block_tables,
                                                const int* seq_lens, float* out, int heads, int kv_heads, int head_dim,
                                                int block_size, int max_blocks, float softmax_scale) {
    LoadBf16 ld{k, v, kv_heads * head_dim, head_dim};
    attend(q, block_tables, seq_lens, out, heads, kv_heads, head_dim, block_size, max_blocks, softmax_scale, ld);
}
extern "C" __global__ void paged_attention_fp8(const float* q, const u8* k, const u8* v, const float* k_scales,
                                               const float* v_scales, const int* block_tables, const int* seq_lens,
                                               float* out, int heads, int kv_heads, int head_dim, int block_size,
                                               int max_blocks, float softmax_scale) {
    LoadFp8 ld{k, v, k_scales, v_scales, kv_heads * head_dim, head_dim, kv_heads};
    attend(q, block_tables, seq_lens, out, heads, kv_heads, head_dim, block_size, max_blocks, softmax_scale, ld);
}
