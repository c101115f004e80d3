// Paged attention for decode (one query token per sequence) over the engine's block pool
// (host/src/engine/block_pool.rs). Sequence s reads its positions through
// block_tables[s * max_blocks + pos / block_size]: pool row = block * block_size + pos % block_size.
// Two families share `attend` and differ only in how a position's key and value are read:
// * paged_attention_*: GQA heads. K and V of one layer are [pool row][kv_heads * head_dim], FP8
//   scales [pool row][kv_heads] (one per head); query head h reads kv head h / (heads / kv_heads).
//   head_dim <= 256. CPU reference: kernels/src/cpu/attention.rs.
// * mla_attention_*: DeepSeek MLA over the latent cache, absorbed form. Each pool row holds the
//   latent c [lora] (the pool's K) and the rotary key kr [rope] (its V), FP8 with one scale per
//   row of each; the query is q_lat [lora] ‖ q_rope [rope], the key c ‖ kr and the value c, so the
//   output is the latent context [lora]. lora <= 1024, rope <= 256. CPU reference:
//   kernels/src/cpu/mla.rs.
//
// paged_attention_*: one block per (query row, query head), one warp per position in a strided
// loop: each warp computes its score, keeps a running softmax (max, sum) and the weighted value row
// in shared memory; the warps' partial softmaxes are merged at the end.
// mla_attention_*: one block per (query row, group of up to MLA_HEADS heads), one warp per head
// (see latent_heads below). paged_prefill_*: a prompt chunk's rows share their K/V reads (see
// prefill_tile below).
#define WARPS 4
#define MAX_D 256
#define MLA_MAX_LORA 1024
#define MLA_MAX_ROPE 256

// Attention of the block's query over positions 0..len of one sequence (`table`: its block
// table row). Query = qa[0..da] followed by qb[0..db]; key element i of pool row r is
// load.key(r, i) (i < da + db), value element i is load.value(r, i) (i < dv); out[0..dv].
// Empty sequences give zeros.
template <int MAX_K, int MAX_V, typename Load>
__device__ void attend(const float* __restrict__ qa, int da, const float* __restrict__ qb, int db, int dv,
                       const int* __restrict__ table, int len, int block_size, float softmax_scale,
                       float* __restrict__ out, Load load) {
    __shared__ float qs[MAX_K];
    __shared__ float acc[WARPS][MAX_V];
    __shared__ float wmax[WARPS], wsum[WARPS];
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    int dk = da + db;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) qs[i] = (i < da ? qa[i] : qb[i - da]) * softmax_scale;
    for (int i = lane; i < dv; i += WARP) acc[w][i] = 0.0f;
    __syncthreads();
    // Per-warp online softmax over the positions this warp owns.
    float m = __int_as_float(0xff800000), l = 0.0f;
    for (int pos = w; pos < len; pos += WARPS) {
        long row = (long)table[pos / block_size] * block_size + pos % block_size;
        float dot = 0.0f;
        for (int i = lane; i < dk; i += WARP) dot += qs[i] * load.key(row, i);
        dot = warp_sum(dot);
        float m2 = fmaxf(m, dot);
        float corr = expf(m - m2), p = expf(dot - m2);
        l = l * corr + p;
        for (int i = lane; i < dv; i += WARP) acc[w][i] = acc[w][i] * corr + p * load.value(row, i);
        m = m2;
    }
    if (lane == 0) { wmax[w] = m; wsum[w] = l; }
    __syncthreads();
    // Merge the warps' partial softmaxes.
    float M = __int_as_float(0xff800000);
    for (int i = 0; i < WARPS; i++) M = fmaxf(M, wmax[i]);
    float L = 0.0f;
    for (int i = 0; i < WARPS; i++) L += wsum[i] * (wmax[i] == M ? 1.0f : expf(wmax[i] - M));
    for (int i = threadIdx.x; i < dv; i += blockDim.x) {
        float v = 0.0f;
        for (int k = 0; k < WARPS; k++)
            if (wsum[k] > 0.0f) v += acc[k][i] * expf(wmax[k] - M);
        out[i] = len > 0 ? v / L : 0.0f;
    }
}

// Element `at` of a pool buffer in one storage type; `scale_at` indexes the FP8 scales.
struct F32Rows {
    const float* p;
    __device__ float at(long at, long scale_at) const { return p[at]; }
};
struct Bf16Rows {
    const u16* p;
    __device__ float at(long at, long scale_at) const { return bf16_to_f32(p[at]); }
};
struct Fp8Rows {
    const u8* p; const float* scales;
    __device__ float at(long at, long scale_at) const { return e4m3_to_f32(p[at]) * scales[scale_at]; }
};

// GQA: kv head `kvh` of K/V rows [kv_heads * head_dim], one scale per (row, kv head).
template <typename S>
struct HeadRows {
    S k, v; int kv_heads, head_dim, kvh;
    __device__ float key(long row, int i) const { return k.at((row * kv_heads + kvh) * head_dim + i, row * kv_heads + kvh); }
    __device__ float value(long row, int i) const { return v.at((row * kv_heads + kvh) * head_dim + i, row * kv_heads + kvh); }
};

template <typename S>
__device__ void paged_head(const float* q, S k, S v, const int* block_tables, const int* seq_lens, float* out, int heads,
                           int kv_heads, int head_dim, int block_size, int max_blocks, float softmax_scale) {
    int s = blockIdx.x, h = blockIdx.y;
    HeadRows<S> ld{k, v, kv_heads, head_dim, h / (heads / kv_heads)};
    long qh = ((long)s * heads + h) * head_dim;
    attend<MAX_D, MAX_D>(q + qh, head_dim, q, 0, head_dim, block_tables + (long)s * max_blocks, seq_lens[s], block_size,
                         softmax_scale, out + qh, ld);
}

extern "C" __global__ void paged_attention_f32(const float* q, const float* k, const float* v, const int* block_tables,
                                               const int* seq_lens, float* out, int heads, int kv_heads, int head_dim,
                                               int block_size, int max_blocks, float softmax_scale) {
    paged_head(q, F32Rows{k}, F32Rows{v}, block_tables, seq_lens, out, heads, kv_heads, head_dim, block_size, max_blocks, softmax_scale);
}
extern "C" __global__ void paged_attention_bf16(const float* q, const u16* k, const u16* v, const int* block_tables,
                                                const int* seq_lens, float* out, int heads, int kv_heads, int head_dim,
                                                int block_size, int max_blocks, float softmax_scale) {
    paged_head(q, Bf16Rows{k}, Bf16Rows{v}, block_tables, seq_lens, out, heads, kv_heads, head_dim, block_size, max_blocks, softmax_scale);
}
extern "C" __global__ void paged_attention_fp8(const float* q, const u8* k, const u8* v, const float* k_scales,
                                               const float* v_scales, const int* block_tables, const int* seq_lens,
                                               float* out, int heads, int kv_heads, int head_dim, int block_size,
                                               int max_blocks, float softmax_scale) {
    paged_head(q, Fp8Rows{k, k_scales}, Fp8Rows{v, v_scales}, block_tables, seq_lens, out, heads, kv_heads, head_dim, block_size,
               max_blocks, softmax_scale);
}

// Prefill: runs of consecutive batch rows of one sequence at consecutive positions (a prompt
// chunk) attend over the same cache rows, so they share the reads. A tile is (first row, rows) of
// one run; the tile's query vectors are its (row, head) pairs for one kv head (GQA group
// heads / kv_heads), PF_VECS per block (gridDim.z covers more): block (tile, kv head, z). The
// block stages PF_KEYS cache positions' K and V for its kv head in shared memory at a time, and
// each warp runs the online softmax of two query vectors over them, state in registers. Row i of
// the tile attends positions 0..lens[i]; the tile's last row is the longest, so its block table
// (tables[last row]) covers them all. K/V are read once per tile and kv head instead of once per
// (row, head): PF_VECS times less. Rows outside the tiles are left untouched (decode rows take
// paged_attention_*).
#define PF_VECS 16
#define PF_KEYS 16
#define PF_DJ (MAX_D / WARP)
template <typename S>
__device__ void prefill_tile(const float* q, S k, S v, const int* block_tables, const int* lens, const int* tiles, float* out,
                             int heads, int kv_heads, int head_dim, int block_size, int max_blocks, float softmax_scale) {
    __shared__ float ks[PF_KEYS][MAX_D], vs[PF_KEYS][MAX_D];
    int first = tiles[2 * blockIdx.x], rows = tiles[2 * blockIdx.x + 1];
    int kvh = blockIdx.y, group = heads / kv_heads, lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    int v0 = blockIdx.z * PF_VECS;
    if (v0 >= rows * group) return; // the whole block: no barrier is missed
    int last = first + rows - 1, max_len = lens[last];
    const int* table = block_tables + (long)last * max_blocks;
    float qv[2][PF_DJ], acc[2][PF_DJ], m[2], l[2];
    int len[2];
    long qh[2];
#pragma unroll
    for (int s = 0; s < 2; s++) {
        int vec = v0 + 2 * w + s;
        bool act = vec < rows * group && vec < v0 + PF_VECS;
        int row = first + (act ? vec / group : 0), h = kvh * group + (act ? vec % group : 0);
        qh[s] = ((long)row * heads + h) * head_dim;
        len[s] = act ? lens[row] : 0; // an inactive vector attends nothing and writes nothing
        m[s] = __int_as_float(0xff800000);
        l[s] = 0.0f;
#pragma unroll
        for (int j = 0; j < PF_DJ; j++) {
            int i = lane + j * WARP;
            qv[s][j] = len[s] > 0 && i < head_dim ? q[qh[s] + i] * softmax_scale : 0.0f;
            acc[s][j] = 0.0f;
        }
    }
    for (int p0 = 0; p0 < max_len; p0 += PF_KEYS) {
        int count = min(PF_KEYS, max_len - p0);
        for (int e = threadIdx.x; e < count * head_dim; e += blockDim.x) {
            int r = e / head_dim, i = e % head_dim, pos = p0 + r;
            long row = (long)table[pos / block_size] * block_size + pos % block_size;
            long at = (row * kv_heads + kvh) * head_dim + i, sc = row * kv_heads + kvh;
            ks[r][i] = k.at(at, sc);
            vs[r][i] = v.at(at, sc);
        }
        __syncthreads();
#pragma unroll
        for (int s = 0; s < 2; s++) {
            int n = min(count, len[s] - p0); // causal: this vector's positions in the tile (warp-uniform)
            for (int r = 0; r < n; r++) {
                float dot = 0.0f;
#pragma unroll
                for (int j = 0; j < PF_DJ; j++)
                    if (lane + j * WARP < head_dim) dot += qv[s][j] * ks[r][lane + j * WARP];
                dot = warp_sum(dot);
                float m2 = fmaxf(m[s], dot);
                float corr = expf(m[s] - m2), p = expf(dot - m2);
                l[s] = l[s] * corr + p;
#pragma unroll
                for (int j = 0; j < PF_DJ; j++)
                    if (lane + j * WARP < head_dim) acc[s][j] = acc[s][j] * corr + p * vs[r][lane + j * WARP];
                m[s] = m2;
            }
        }
        __syncthreads(); // the staged rows are overwritten next
    }
#pragma unroll
    for (int s = 0; s < 2; s++) {
        if (len[s] <= 0) continue;
#pragma unroll
        for (int j = 0; j < PF_DJ; j++) {
            int i = lane + j * WARP;
            if (i < head_dim) out[qh[s] + i] = acc[s][j] / l[s];
        }
    }
}

extern "C" __global__ void paged_prefill_f32(const float* q, const float* k, const float* v, const int* block_tables,
                                             const int* seq_lens, const int* tiles, float* out, int heads, int kv_heads,
                                             int head_dim, int block_size, int max_blocks, float softmax_scale) {
    prefill_tile(q, F32Rows{k}, F32Rows{v}, block_tables, seq_lens, tiles, out, heads, kv_heads, head_dim, block_size, max_blocks, softmax_scale);
}
extern "C" __global__ void paged_prefill_bf16(const float* q, const u16* k, const u16* v, const int* block_tables,
                                              const int* seq_lens, const int* tiles, float* out, int heads, int kv_heads,
                                              int head_dim, int block_size, int max_blocks, float softmax_scale) {
    prefill_tile(q, Bf16Rows{k}, Bf16Rows{v}, block_tables, seq_lens, tiles, out, heads, kv_heads, head_dim, block_size, max_blocks, softmax_scale);
}
extern "C" __global__ void paged_prefill_fp8(const float* q, const u8* k, const u8* v, const float* k_scales,
                                             const float* v_scales, const int* block_tables, const int* seq_lens,
                                             const int* tiles, float* out, int heads, int kv_heads, int head_dim,
                                             int block_size, int max_blocks, float softmax_scale) {
    prefill_tile(q, Fp8Rows{k, k_scales}, Fp8Rows{v, v_scales}, block_tables, seq_lens, tiles, out, heads, kv_heads, head_dim,
                 block_size, max_blocks, softmax_scale);
}

// MLA. The key of a position is its latent c ‖ rotary key kr and its value the latent, the same
// row for every head, so the heads of a token share one read of it: the block stages MLA_TILE
// positions at a time in shared memory (widened to f32 once, FP8 scales applied), then each warp
// scores them against its own head's query and updates that head's online softmax and latent
// context, both held in registers (lane l owns elements l, l + 32, ...). DeepSeek-V3 has 128
// heads over one 576-wide row per position: 8 heads per block read the cache 8x less often than
// one block per head would. ctx[t, h, 0..lora] over token t's lens[t] positions.
// With few tokens that is few blocks, so the positions are also split (flash-decoding): gridDim.z
// = splits > 1 blocks each take a contiguous share of a token's positions and write their
// unnormalised context and (max, sum) to part[t, h, z, 0..lora + 2]; mla_combine merges them.
#define MLA_HEADS 8
#define MLA_TILE 8
#define MLA_LJ (MLA_MAX_LORA / WARP)
#define MLA_RJ (MLA_MAX_ROPE / WARP)
template <typename S>
__device__ void latent_heads(const float* q_lat, const float* q_rope, S c, S kr, const int* block_tables, const int* lens,
                             float* ctx, float* part, int heads, int lora, int rope, int block_size, int max_blocks,
                             float softmax_scale) {
    __shared__ float rows[MLA_TILE][MLA_MAX_LORA + MLA_MAX_ROPE];
    int t = blockIdx.x, lane = threadIdx.x % WARP, group = blockDim.x / WARP;
    int h = blockIdx.y * group + threadIdx.x / WARP;
    bool active = h < heads; // warp-uniform: the last group may be partial
    int len = lens[t], width = lora + rope;
    const int* table = block_tables + (long)t * max_blocks;
    long th = (long)t * heads + h;
    float ql[MLA_LJ], qr[MLA_RJ], acc[MLA_LJ];
#pragma unroll
    for (int j = 0; j < MLA_LJ; j++) {
        int i = lane + j * WARP;
        ql[j] = active && i < lora ? q_lat[th * lora + i] * softmax_scale : 0.0f;
        acc[j] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < MLA_RJ; j++) {
        int i = lane + j * WARP;
        qr[j] = active && i < rope ? q_rope[th * rope + i] * softmax_scale : 0.0f;
    }
    float m = __int_as_float(0xff800000), l = 0.0f;
    int splits = gridDim.z, share = (len + splits - 1) / splits;
    int begin = blockIdx.z * share, end = min(len, begin + share);
    for (int p0 = begin; p0 < end; p0 += MLA_TILE) {
        int count = min(MLA_TILE, end - p0);
        for (int r = 0; r < count; r++) {
            int pos = p0 + r;
            long row = (long)table[pos / block_size] * block_size + pos % block_size;
            for (int i = threadIdx.x; i < width; i += blockDim.x)
                rows[r][i] = i < lora ? c.at(row * lora + i, row) : kr.at(row * rope + (i - lora), row);
        }
        __syncthreads();
        if (active) {
            for (int r = 0; r < count; r++) {
                const float* k = rows[r];
                float dot = 0.0f;
#pragma unroll
                for (int j = 0; j < MLA_LJ; j++)
                    if (lane + j * WARP < lora) dot += ql[j] * k[lane + j * WARP];
#pragma unroll
                for (int j = 0; j < MLA_RJ; j++)
                    if (lane + j * WARP < rope) dot += qr[j] * k[lora + lane + j * WARP];
                dot = warp_sum(dot);
                float m2 = fmaxf(m, dot);
                float corr = expf(m - m2), p = expf(dot - m2);
                l = l * corr + p;
#pragma unroll
                for (int j = 0; j < MLA_LJ; j++)
                    if (lane + j * WARP < lora) acc[j] = acc[j] * corr + p * k[lane + j * WARP];
                m = m2;
            }
        }
        __syncthreads(); // the tile is overwritten next
    }
    if (!active) return;
    if (splits == 1) {
#pragma unroll
        for (int j = 0; j < MLA_LJ; j++) {
            int i = lane + j * WARP;
            if (i < lora) ctx[th * lora + i] = len > 0 ? acc[j] / l : 0.0f;
        }
        return;
    }
    float* out = part + (th * splits + blockIdx.z) * (lora + 2);
#pragma unroll
    for (int j = 0; j < MLA_LJ; j++) {
        int i = lane + j * WARP;
        if (i < lora) out[i] = acc[j];
    }
    if (lane == 0) { out[lora] = m; out[lora + 1] = l; } // an empty share: (-inf, 0)
}

// Merges the `splits` partial results of latent_heads per (token, head): with M the largest
// partial max, ctx = sum_z acc_z * e^(m_z - M) / sum_z l_z * e^(m_z - M); zeros for an empty
// token. One block per (token, head), threads over the latent.
extern "C" __global__ void mla_combine(const float* __restrict__ part, float* __restrict__ ctx, int heads, int lora, int splits) {
    long th = (long)blockIdx.x * heads + blockIdx.y;
    const float* p = part + th * splits * (lora + 2);
    float M = __int_as_float(0xff800000);
    for (int z = 0; z < splits; z++)
        if (p[z * (lora + 2) + lora + 1] > 0.0f) M = fmaxf(M, p[z * (lora + 2) + lora]);
    float L = 0.0f;
    for (int z = 0; z < splits; z++) {
        const float* q = p + z * (lora + 2);
        if (q[lora + 1] > 0.0f) L += q[lora + 1] * expf(q[lora] - M);
    }
    for (int i = threadIdx.x; i < lora; i += blockDim.x) {
        float v = 0.0f;
        for (int z = 0; z < splits; z++) {
            const float* q = p + z * (lora + 2);
            if (q[lora + 1] > 0.0f) v += q[i] * expf(q[lora] - M);
        }
        ctx[th * lora + i] = L > 0.0f ? v / L : 0.0f;
    }
}

extern "C" __global__ void mla_attention_f32(const float* q_lat, const float* q_rope, const float* c, const float* kr,
                                             const int* block_tables, const int* lens, float* ctx, float* part, int heads,
                                             int lora, int rope, int block_size, int max_blocks, float softmax_scale) {
    latent_heads(q_lat, q_rope, F32Rows{c}, F32Rows{kr}, block_tables, lens, ctx, part, heads, lora, rope, block_size, max_blocks,
                 softmax_scale);
}
extern "C" __global__ void mla_attention_bf16(const float* q_lat, const float* q_rope, const u16* c, const u16* kr,
                                              const int* block_tables, const int* lens, float* ctx, float* part, int heads,
                                              int lora, int rope, int block_size, int max_blocks, float softmax_scale) {
    latent_heads(q_lat, q_rope, Bf16Rows{c}, Bf16Rows{kr}, block_tables, lens, ctx, part, heads, lora, rope, block_size, max_blocks,
                 softmax_scale);
}
extern "C" __global__ void mla_attention_fp8(const float* q_lat, const float* q_rope, const u8* c, const u8* kr,
                                             const float* c_scales, const float* kr_scales, const int* block_tables,
                                             const int* lens, float* ctx, float* part, int heads, int lora, int rope,
                                             int block_size, int max_blocks, float softmax_scale) {
    latent_heads(q_lat, q_rope, Fp8Rows{c, c_scales}, Fp8Rows{kr, kr_scales}, block_tables, lens, ctx, part, heads, lora, rope,
                 block_size, max_blocks, softmax_scale);
}
