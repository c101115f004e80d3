// The elementwise and per-head pieces of DeepSeek MLA around the latent-cache attention
// (mla_attention_* in paged_attention.cu). CPU references: kernels/src/cpu/mla.rs and, for
// rope_rows, kernels/src/cpu/rope.rs rope_rows.

// out[r, 0..count] = src[r, offset..offset + count] (src rows `width` wide).
extern "C" __global__ void copy_cols(const float* __restrict__ src, float* __restrict__ out, long rows, int width, int offset, int count) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * count) return;
    long r = idx / count;
    out[idx] = src[r * width + offset + idx % count];
}

// RoPE of dense rows 2 * half wide: row r rotates by positions[r / rows_per_token]. With
// `interleave` the row's pairs (x0,x1),(x2,x3).. are first reordered to (x0,x2,..,x1,x3,..)
// (DeepSeek), i.e. rotate-half pair i is (x[2i], x[2i+1]) instead of (x[i], x[i + half]); then
// every element is multiplied by attention_factor (YaRN) unless it is 1.
// One warp per row: the lanes read all their pairs before any lane writes, because with
// interleave a pair's inputs and outputs are different elements of the row.
#define ROPE_PAIRS 8 // pairs per lane: half <= 32 * ROPE_PAIRS
extern "C" __global__ void rope_rows(float* __restrict__ x, const int* __restrict__ positions, const float* __restrict__ inv_freq,
                                     long rows, int rows_per_token, int half, int interleave, float attention_factor) {
    long row = (long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (row >= rows) return; // the whole warp
    int lane = threadIdx.x % WARP;
    float* r = x + row * 2 * half;
    float pos = (float)positions[row / rows_per_token];
    float a[ROPE_PAIRS], b[ROPE_PAIRS];
    for (int k = 0; k < ROPE_PAIRS; k++) {
        int i = lane + k * WARP;
        if (i < half) {
            a[k] = interleave ? r[2 * i] : r[i];
            b[k] = interleave ? r[2 * i + 1] : r[i + half];
        }
    }
    __syncwarp();
    for (int k = 0; k < ROPE_PAIRS; k++) {
        int i = lane + k * WARP;
        if (i >= half) break;
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        float lo = a[k] * c - b[k] * s, hi = b[k] * c + a[k] * s;
        if (attention_factor != 1.0f) {
            lo *= attention_factor;
            hi *= attention_factor;
        }
        r[i] = lo;
        r[i + half] = hi;
    }
}

// out[t, h, r] = sum_c W[h, r, c] * x[t, h, c]: W bf16 (or f32) [heads, rows, cols], x [tokens,
// heads, cols], out [tokens, heads, rows]. One warp per (head, output row) over tiles of HM_TOK
// tokens (the weight row is read once per tile); tiles stride over gridDim.z, which CUDA caps at
// 65535.
#define HM_WARPS 4
#define HM_TOK 8
__device__ __forceinline__ float hm_widen(u16 w) { return bf16_to_f32(w); }
__device__ __forceinline__ float hm_widen(float w) { return w; }
template <typename W>
__device__ void head_matvec(const W* __restrict__ w, const float* __restrict__ x, float* __restrict__ out,
                            int tokens, int heads, int rows, int cols) {
    int r = blockIdx.x * HM_WARPS + threadIdx.x / WARP, h = blockIdx.y, lane = threadIdx.x % WARP;
    if (r >= rows) return; // the whole warp
    const W* wr = w + ((long)h * rows + r) * cols;
    for (long t0 = (long)blockIdx.z * HM_TOK; t0 < tokens; t0 += (long)gridDim.z * HM_TOK) {
        int nt = tokens - t0 < HM_TOK ? (int)(tokens - t0) : HM_TOK;
        float acc[HM_TOK];
        for (int j = 0; j < HM_TOK; j++) acc[j] = 0.0f;
        // Fixed trip counts with a guard (not `j < nt`) keep acc in registers once unrolled.
        for (int c = lane; c < cols; c += WARP) {
            float wv = hm_widen(wr[c]);
            for (int j = 0; j < HM_TOK; j++)
                if (j < nt) acc[j] += wv * x[((t0 + j) * heads + h) * cols + c];
        }
        for (int j = 0; j < HM_TOK; j++) {
            if (j >= nt) break; // nt is the same for the whole warp
            float s = warp_sum(acc[j]);
            if (lane == 0) out[((t0 + j) * heads + h) * rows + r] = s;
        }
    }
}

extern "C" __global__ void head_matvec_bf16(const u16* __restrict__ w, const float* __restrict__ x, float* __restrict__ out,
                                            int tokens, int heads, int rows, int cols) {
    head_matvec(w, x, out, tokens, heads, rows, cols);
}
extern "C" __global__ void head_matvec_f32(const float* __restrict__ w, const float* __restrict__ x, float* __restrict__ out,
                                           int tokens, int heads, int rows, int cols) {
    head_matvec(w, x, out, tokens, heads, rows, cols);
}

// x[i] *= sigmoid(g[i]) (MLA's output gate).
extern "C" __global__ void sigmoid_mul(float* __restrict__ x, const float* __restrict__ g, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 1.0f / (1.0f + expf(-g[i]));
}
