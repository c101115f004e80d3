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

// Element `at` of a pool buffer in one storage type; `scale_at` indexes the FP8 scales. `at` is
// the element's value, = code(at) * scale(scale_at): the tensor-core kernels stage the code (an
// E4M3 code is exactly a bf16 number, its product with an f32 scale is not) and apply the scale
// to the scores and softmax weights instead.
struct F32Rows {
    const float* p;
    __device__ float at(long at, long scale_at) const { return p[at]; }
};
struct Bf16Rows {
    const u16* p;
    __device__ float at(long at, long scale_at) const { return bf16_to_f32(p[at]); }
    __device__ float code(long at) const { return bf16_to_f32(p[at]); }
    __device__ float scale(long scale_at) const { return 1.0f; }
};
struct Fp8Rows {
    const u8* p; const float* scales;
    __device__ float at(long at, long scale_at) const { return e4m3_to_f32(p[at]) * scales[scale_at]; }
    __device__ float code(long at) const { return e4m3_to_f32(p[at]); }
    __device__ float scale(long scale_at) const { return scales[scale_at]; }
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

// Prefill on tensor cores (flash attention): the tiles and the result are paged_prefill_*'s, but
// each warp holds 16 query vectors as the rows of MMA tiles. Per stage of FL_KEYS positions staged
// in shared memory as bf16: S = Q·Kᵀ (m16n8k16 over head_dim), causal mask by each vector's
// length, online softmax on the score fragments (a row's four lanes share it through two xor
// shuffles), then O += P·V with P taken straight from the score fragments (their C layout is the A
// layout of the next product). Q and P are rounded to bf16 for the products, accumulation is f32;
// K and V are staged as bf16 exactly (an FP8 cache's E4M3 codes, its per-row scales applied to the
// scores and folded into P instead); head_dim a multiple of 16 up to FL_MAX_D (the host falls back to paged_prefill_* otherwise,
// and for f32 caches, whose precision this would not keep). A block of FL_WARPS warps shares each
// staged K/V row among FL_VECS query vectors: 4x paged_prefill_*'s sharing, and the dot products
// run on the tensor cores instead of the CUDA cores.
// Shared layouts: kp[r][i] packs dims 2i, 2i+1 of staged key r (the B operand of Q·Kᵀ reads one
// word per register), vp[j][d] packs dim d of staged values 2j, 2j+1 (the B operand of P·V, whose
// k runs over positions). Rows past the staged count are zeros: a masked score's P is 0, and 0
// times a stale (or, in the simulator, poisoned NaN) value would not be.
#define FL_WARPS 4
#define FL_VECS (16 * FL_WARPS)
#define FL_KEYS 32
#define FL_MAX_D 128
#define FL_KC (FL_MAX_D / 16) // 16-wide chunks of head_dim (Q·Kᵀ's k steps)
#define FL_DN (FL_MAX_D / 8)  // 8-wide chunks of head_dim (P·V's n tiles)
#define FL_SN (FL_KEYS / 8)   // 8-wide chunks of a stage (Q·Kᵀ's n tiles)
// One stage of the online softmax of a lane's two MMA rows (gid and gid + 8) in the tensor-core
// kernels: `sc` holds the stage's masked scores (-inf where masked) in the accumulator layout; the
// row max is shared by the row's four lanes through two xor shuffles, `m` and this lane's share of
// the row sum `l` are updated, `sc` becomes the unnormalised weights P and the context `o` is
// rescaled to the new max. Every lane of the warp must call it (the shuffles).
template <int SN, int ON>
__device__ __forceinline__ void online_softmax_stage(float (&sc)[SN][4], float (&o)[ON][4], float* m, float* l) {
    float mx[2] = {__int_as_float(0xff800000), __int_as_float(0xff800000)};
#pragma unroll
    for (int n = 0; n < SN; n++)
        for (int e = 0; e < 4; e++) mx[e >> 1] = fmaxf(mx[e >> 1], sc[n][e]);
    float corr[2], base[2];
    for (int s = 0; s < 2; s++) {
        mx[s] = fmaxf(mx[s], __shfl_xor_sync(0xffffffffu, mx[s], 1));
        mx[s] = fmaxf(mx[s], __shfl_xor_sync(0xffffffffu, mx[s], 2));
        float m2 = fmaxf(m[s], mx[s]);
        base[s] = m2 == __int_as_float(0xff800000) ? 0.0f : m2; // nothing seen yet: exp(-inf) = 0, not NaN
        corr[s] = expf(m[s] - base[s]);
        m[s] = m2;
        l[s] *= corr[s]; // this lane's share of the row sum; the shares are added at the end
    }
#pragma unroll
    for (int n = 0; n < SN; n++)
        for (int e = 0; e < 4; e++) {
            sc[n][e] = expf(sc[n][e] - base[e >> 1]);
            l[e >> 1] += sc[n][e];
        }
#pragma unroll
    for (int n = 0; n < ON; n++)
        for (int e = 0; e < 4; e++) o[n][e] *= corr[e >> 1];
}

template <typename S>
__device__ void flash_prefill_tile(const float* q, S k, S v, const int* block_tables, const int* lens, const int* tiles, float* out,
                                   int heads, int kv_heads, int head_dim, int block_size, int max_blocks, float softmax_scale) {
    __shared__ u32 kp[FL_KEYS][FL_MAX_D / 2 + 4];     // +4 words: lanes of a fragment load hit distinct banks
    __shared__ u32 vp[FL_KEYS / 2][FL_MAX_D + 8];
    __shared__ float ksc[FL_KEYS], vsc[FL_KEYS];       // the staged rows' scales (1 unless FP8)
    int first = tiles[2 * blockIdx.x], rows = tiles[2 * blockIdx.x + 1];
    int kvh = blockIdx.y, group = heads / kv_heads, lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    int gid = lane / 4, tig = lane % 4; // the fragment's row group and thread in group
    int v0 = blockIdx.z * FL_VECS;
    if (v0 >= rows * group) return; // the whole block: no barrier is missed
    int last = first + rows - 1, max_len = lens[last];
    const int* table = block_tables + (long)last * max_blocks;
    // This lane's two MMA rows (vectors gid and gid + 8 of the warp): their query offsets and
    // lengths; an inactive vector (past the tile) has length 0: it scores nothing, writes nothing.
    long qh[2];
    int len[2];
    for (int s = 0; s < 2; s++) {
        int vec = v0 + w * 16 + gid + 8 * s;
        bool act = vec < rows * group;
        int row = first + (act ? vec / group : 0), h = kvh * group + (act ? vec % group : 0);
        qh[s] = ((long)row * heads + h) * head_dim;
        len[s] = act ? lens[row] : 0;
    }
    int warp_len = (int)warp_max((float)max(len[0], len[1])); // lengths < 2^24: exact as floats
    u32 qa[FL_KC][4];
#pragma unroll
    for (int kc = 0; kc < FL_KC; kc++) {
        for (int r = 0; r < 4; r++) {
            int s = r & 1, c = kc * 16 + tig * 2 + (r >> 1) * 8;
            bool in = kc * 16 < head_dim && len[s] > 0;
            qa[kc][r] = in ? pack_bf16(q[qh[s] + c] * softmax_scale, q[qh[s] + c + 1] * softmax_scale) : 0u;
        }
    }
    float o[FL_DN][4], m[2], l[2];
#pragma unroll
    for (int n = 0; n < FL_DN; n++)
        for (int e = 0; e < 4; e++) o[n][e] = 0.0f;
    for (int s = 0; s < 2; s++) {
        m[s] = __int_as_float(0xff800000);
        l[s] = 0.0f;
    }
    int half = head_dim / 2;
    for (int p0 = 0; p0 < max_len; p0 += FL_KEYS) {
        int count = min(FL_KEYS, max_len - p0);
        for (int e = threadIdx.x; e < FL_KEYS * half; e += blockDim.x) {
            int r = e / half, i = e % half;
            u32 word = 0u;
            if (r < count) {
                int pos = p0 + r;
                long row = (long)table[pos / block_size] * block_size + pos % block_size;
                long at = (row * kv_heads + kvh) * head_dim + 2 * i, sc = row * kv_heads + kvh;
                word = pack_bf16(k.code(at), k.code(at + 1));
                if (i == 0) {
                    ksc[r] = k.scale(sc);
                    vsc[r] = v.scale(sc);
                }
            } else if (i == 0) {
                ksc[r] = vsc[r] = 0.0f; // past the stage: P is 0 there, and 0 x a stale scale may not be
            }
            kp[r][i] = word;
        }
        for (int e = threadIdx.x; e < FL_KEYS / 2 * head_dim; e += blockDim.x) {
            int j = e / head_dim, d = e % head_dim;
            float lo = 0.0f, hi = 0.0f;
            for (int b = 0; b < 2; b++) {
                int r = 2 * j + b;
                if (r >= count) continue;
                int pos = p0 + r;
                long row = (long)table[pos / block_size] * block_size + pos % block_size;
                float x = v.code((row * kv_heads + kvh) * head_dim + d);
                if (b == 0) lo = x; else hi = x;
            }
            vp[j][d] = pack_bf16(lo, hi);
        }
        __syncthreads();
        if (p0 < warp_len) { // warp-uniform: the mma needs every lane
            float sc[FL_SN][4];
#pragma unroll
            for (int n = 0; n < FL_SN; n++) {
                for (int e = 0; e < 4; e++) sc[n][e] = 0.0f;
#pragma unroll
                for (int kc = 0; kc < FL_KC; kc++) {
                    if (kc * 16 >= head_dim) break;
                    u32 b[2] = {kp[n * 8 + gid][kc * 8 + tig], kp[n * 8 + gid][kc * 8 + 4 + tig]};
                    mma_bf16_16816(sc[n], qa[kc], b);
                }
            }
            // Mask (causal and past the stage), then the online softmax of rows gid and gid + 8.
#pragma unroll
            for (int n = 0; n < FL_SN; n++)
                for (int e = 0; e < 4; e++) {
                    int s = e >> 1, key = n * 8 + tig * 2 + (e & 1);
                    sc[n][e] = p0 + key < len[s] ? sc[n][e] * ksc[key] : __int_as_float(0xff800000);
                }
            online_softmax_stage(sc, o, m, l);
            // P's A operand carries each key's value scale (the staged values are codes).
#pragma unroll
            for (int n = 0; n < FL_SN; n++)
                for (int e = 0; e < 4; e++) sc[n][e] *= vsc[n * 8 + tig * 2 + (e & 1)];
#pragma unroll
            for (int kc = 0; kc < FL_KEYS / 16; kc++) {
                u32 pa[4] = {pack_bf16(sc[2 * kc][0], sc[2 * kc][1]), pack_bf16(sc[2 * kc][2], sc[2 * kc][3]),
                             pack_bf16(sc[2 * kc + 1][0], sc[2 * kc + 1][1]), pack_bf16(sc[2 * kc + 1][2], sc[2 * kc + 1][3])};
#pragma unroll
                for (int n = 0; n < FL_DN; n++) {
                    if (n * 8 >= head_dim) break;
                    u32 b[2] = {vp[kc * 8 + tig][n * 8 + gid], vp[kc * 8 + 4 + tig][n * 8 + gid]};
                    mma_bf16_16816(o[n], pa, b);
                }
            }
        }
        __syncthreads(); // the staged rows are overwritten next
    }
    for (int s = 0; s < 2; s++) {
        l[s] += __shfl_xor_sync(0xffffffffu, l[s], 1);
        l[s] += __shfl_xor_sync(0xffffffffu, l[s], 2);
    }
#pragma unroll
    for (int n = 0; n < FL_DN; n++) {
        if (n * 8 >= head_dim) break;
        for (int e = 0; e < 4; e++) {
            int s = e >> 1;
            if (len[s] > 0) out[qh[s] + n * 8 + tig * 2 + (e & 1)] = o[n][e] / l[s];
        }
    }
}

extern "C" __global__ void paged_flash_prefill_bf16(const float* q, const u16* k, const u16* v, const int* block_tables,
                                                    const int* seq_lens, const int* tiles, float* out, int heads, int kv_heads,
                                                    int head_dim, int block_size, int max_blocks, float softmax_scale) {
    flash_prefill_tile(q, Bf16Rows{k}, Bf16Rows{v}, block_tables, seq_lens, tiles, out, heads, kv_heads, head_dim, block_size, max_blocks,
                       softmax_scale);
}
extern "C" __global__ void paged_flash_prefill_fp8(const float* q, const u8* k, const u8* v, const float* k_scales,
                                                   const float* v_scales, const int* block_tables, const int* seq_lens,
                                                   const int* tiles, float* out, int heads, int kv_heads, int head_dim,
                                                   int block_size, int max_blocks, float softmax_scale) {
    flash_prefill_tile(q, Fp8Rows{k, k_scales}, Fp8Rows{v, v_scales}, block_tables, seq_lens, tiles, out, heads, kv_heads, head_dim,
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

// MLA prefill on tensor cores: absorbed attention for the rows of prompt chunks (tiles as for
// paged_flash_prefill_*, with MLA's single latent "kv head": a tile's vectors are its (row, head)
// pairs). The key of a position is c ‖ kr (lora + rope wide) and its value c (lora), both far
// wider than one warp's registers hold for 16 query rows, so a block of 16 warps works on 32
// vectors as two row groups of 16, and the FM_SPLIT = 8 warps of a row group split the work: for
// S = Q·Kᵀ each takes every 8th 16-wide chunk of the key (its Q fragments in registers) and the
// partial scores are summed through shared memory; every warp of the group then runs the same
// online softmax on the full scores and multiplies P by its eighth of the latent (O's columns
// split 8 ways). Why 8 and not 4: a warp then holds 5 Q fragments and 8 O tiles for DeepSeek-V3's
// 576 / 512 (not 9 and 16), which keeps the kernel within 128 registers, so its 16 warps fit an
// SM's 64K registers: twice the warps per SM of 8 warps at 177 registers (one block per SM), with
// each warp's MMA chain per stage halved. Staged keys are bf16 pairs along the key width,
// zero-padded to whole chunks: the latent to a multiple of 64 (8 eighths of whole 8-wide MMA
// tiles), the rotary part to a multiple of 16; P·V reads a position pair of one latent column as
// two halves of those words. lora <= 512, rope <= 64 (DeepSeek-V3, Kimi); Q and P rounded to
// bf16, f32 accumulation; rows staged exactly (FP8: the codes; a warp keeps its latent and rotary
// partial scores apart, as they take different row scales, and P carries the latent's scale into
// P·V).
#define FM_SPLIT 8 // warps per row group
#define FM_WARPS (2 * FM_SPLIT)
#define FM_VECS 32 // 2 row groups of 16
#define FM_KEYS 16
#define FM_MAX_LORA 512
#define FM_MAX_ROPE 64
#define FM_MAX_W (FM_MAX_LORA + FM_MAX_ROPE)
#define FM_QC ((FM_MAX_W / 16 + FM_SPLIT - 1) / FM_SPLIT) // key chunks per warp
#define FM_ON (FM_MAX_LORA / FM_SPLIT / 8)                // 8-wide O tiles per warp
template <typename S>
__device__ void mla_flash_prefill_tile(const float* q_lat, const float* q_rope, S c, S kr, const int* block_tables, const int* lens,
                                       const int* tiles, float* ctx, int heads, int lora, int rope, int block_size, int max_blocks,
                                       float softmax_scale) {
    __shared__ u32 kp[FM_KEYS][FM_MAX_W / 2 + 4];
    __shared__ float part[FM_WARPS][2][4][WARP]; // each warp's partial score fragments
    __shared__ float csc[FM_KEYS], rsc[FM_KEYS]; // the staged rows' latent and rotary scales
    int first = tiles[2 * blockIdx.x], rows = tiles[2 * blockIdx.x + 1];
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, rg = w / FM_SPLIT, share = w % FM_SPLIT;
    int gid = lane / 4, tig = lane % 4;
    int v0 = blockIdx.z * FM_VECS;
    if (v0 >= rows * heads) return; // the whole block: no barrier is missed
    int lora_pad = (lora + 8 * FM_SPLIT - 1) / (8 * FM_SPLIT) * (8 * FM_SPLIT), rope_pad = (rope + 15) / 16 * 16;
    int width = lora_pad + rope_pad, chunks = width / 16, slice = lora_pad / FM_SPLIT; // slice: this warp's O columns, a multiple of 8
    int last = first + rows - 1, max_len = lens[last];
    const int* table = block_tables + (long)last * max_blocks;
    long th[2];
    int len[2];
    for (int s = 0; s < 2; s++) {
        int vec = v0 + rg * 16 + gid + 8 * s;
        bool act = vec < rows * heads;
        th[s] = act ? (long)(first + vec / heads) * heads + vec % heads : 0;
        len[s] = act ? lens[first + vec / heads] : 0;
    }
    int group_len = (int)warp_max((float)max(len[0], len[1])); // the same in the row group's warps
    // Element d of the padded query (scaled): q_lat below lora_pad, q_rope after it, zeros between.
    u32 qa[FM_QC][4];
#pragma unroll
    for (int j = 0; j < FM_QC; j++) {
        int ch = share + FM_SPLIT * j;
        for (int r = 0; r < 4; r++) {
            int s = r & 1;
            float x[2] = {0.0f, 0.0f};
            for (int b = 0; b < 2; b++) {
                int d = ch * 16 + tig * 2 + (r >> 1) * 8 + b;
                if (ch >= chunks || len[s] == 0) continue;
                if (d < lora) x[b] = q_lat[th[s] * lora + d];
                else if (d >= lora_pad && d - lora_pad < rope) x[b] = q_rope[th[s] * rope + d - lora_pad];
            }
            qa[j][r] = pack_bf16(x[0] * softmax_scale, x[1] * softmax_scale);
        }
    }
    float o[FM_ON][4], m[2], l[2];
#pragma unroll
    for (int n = 0; n < FM_ON; n++)
        for (int e = 0; e < 4; e++) o[n][e] = 0.0f;
    for (int s = 0; s < 2; s++) {
        m[s] = __int_as_float(0xff800000);
        l[s] = 0.0f;
    }
    int half = width / 2;
    for (int p0 = 0; p0 < max_len; p0 += FM_KEYS) {
        int count = min(FM_KEYS, max_len - p0);
        for (int e = threadIdx.x; e < FM_KEYS * half; e += blockDim.x) {
            int r = e / half, i = e % half;
            float x[2] = {0.0f, 0.0f};
            if (r < count) {
                int pos = p0 + r;
                long row = (long)table[pos / block_size] * block_size + pos % block_size;
                for (int b = 0; b < 2; b++) {
                    int d = 2 * i + b;
                    if (d < lora) x[b] = c.code(row * lora + d);
                    else if (d >= lora_pad && d - lora_pad < rope) x[b] = kr.code(row * rope + d - lora_pad);
                }
                if (i == 0) {
                    csc[r] = c.scale(row);
                    rsc[r] = rope > 0 ? kr.scale(row) : 0.0f;
                }
            } else if (i == 0) {
                csc[r] = rsc[r] = 0.0f; // past the stage: P is 0 there, and 0 x a stale scale may not be
            }
            kp[r][i] = pack_bf16(x[0], x[1]);
        }
        __syncthreads();
        bool live = p0 < group_len; // uniform over the row group: its warps skip together
        float sc[FM_KEYS / 8][4];
        if (live) {
#pragma unroll
            for (int n = 0; n < FM_KEYS / 8; n++) {
                float lat[4] = {0.0f, 0.0f, 0.0f, 0.0f}, rot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int j = 0; j < FM_QC; j++) {
                    int ch = share + FM_SPLIT * j;
                    if (ch >= chunks) break;
                    u32 b[2] = {kp[n * 8 + gid][ch * 8 + tig], kp[n * 8 + gid][ch * 8 + 4 + tig]};
                    if (ch * 16 < lora_pad) mma_bf16_16816(lat, qa[j], b); // warp-uniform
                    else mma_bf16_16816(rot, qa[j], b);
                }
                for (int e = 0; e < 4; e++) {
                    int key = n * 8 + tig * 2 + (e & 1);
                    part[w][n][e][lane] = lat[e] * csc[key] + rot[e] * rsc[key];
                }
            }
        }
        __syncthreads();
        if (live) {
            // The row group's full scores: the sum of its warps' partials (same fragment slots).
#pragma unroll
            for (int n = 0; n < FM_KEYS / 8; n++)
                for (int e = 0; e < 4; e++) {
                    float v = 0.0f;
                    for (int q = 0; q < FM_SPLIT; q++) v += part[rg * FM_SPLIT + q][n][e][lane];
                    int s = e >> 1, pos = p0 + n * 8 + tig * 2 + (e & 1);
                    sc[n][e] = pos < len[s] ? v : __int_as_float(0xff800000);
                }
            online_softmax_stage(sc, o, m, l);
            // P's A operand carries each key's latent scale (the staged latents are codes).
#pragma unroll
            for (int n = 0; n < FM_KEYS / 8; n++)
                for (int e = 0; e < 4; e++) sc[n][e] *= csc[n * 8 + tig * 2 + (e & 1)];
            // O[:, this eighth] += P · C[:, this eighth] (FM_KEYS = 16: one k step).
            u32 pa[4] = {pack_bf16(sc[0][0], sc[0][1]), pack_bf16(sc[0][2], sc[0][3]), pack_bf16(sc[1][0], sc[1][1]), pack_bf16(sc[1][2], sc[1][3])};
#pragma unroll
            for (int n = 0; n < FM_ON; n++) {
                if (n * 8 >= slice) break;
                int col = share * slice + n * 8 + gid, word = col / 2, shift = (col & 1) * 16;
                u32 b[2];
                for (int r = 0; r < 2; r++) {
                    int k0 = tig * 2 + r * 8; // positions k0, k0 + 1 of the stage
                    b[r] = ((kp[k0][word] >> shift) & 0xffffu) | (((kp[k0 + 1][word] >> shift) & 0xffffu) << 16);
                }
                mma_bf16_16816(o[n], pa, b);
            }
        }
        __syncthreads(); // the staged rows and partial scores are overwritten next
    }
    for (int s = 0; s < 2; s++) {
        l[s] += __shfl_xor_sync(0xffffffffu, l[s], 1);
        l[s] += __shfl_xor_sync(0xffffffffu, l[s], 2);
    }
#pragma unroll
    for (int n = 0; n < FM_ON; n++) {
        if (n * 8 >= slice) break;
        for (int e = 0; e < 4; e++) {
            int s = e >> 1, col = share * slice + n * 8 + tig * 2 + (e & 1);
            if (len[s] > 0 && col < lora) ctx[th[s] * lora + col] = o[n][e] / l[s];
        }
    }
}

extern "C" __launch_bounds__(FM_WARPS * WARP) __global__ void mla_flash_prefill_bf16(const float* q_lat, const float* q_rope, const u16* c, const u16* kr,
                                                  const int* block_tables, const int* lens, const int* tiles, float* ctx, int heads,
                                                  int lora, int rope, int block_size, int max_blocks, float softmax_scale) {
    mla_flash_prefill_tile(q_lat, q_rope, Bf16Rows{c}, Bf16Rows{kr}, block_tables, lens, tiles, ctx, heads, lora, rope, block_size,
                           max_blocks, softmax_scale);
}
extern "C" __launch_bounds__(FM_WARPS * WARP) __global__ void mla_flash_prefill_fp8(const float* q_lat, const float* q_rope, const u8* c, const u8* kr,
                                                 const float* c_scales, const float* kr_scales, const int* block_tables,
                                                 const int* lens, const int* tiles, float* ctx, int heads, int lora, int rope,
                                                 int block_size, int max_blocks, float softmax_scale) {
    mla_flash_prefill_tile(q_lat, q_rope, Fp8Rows{c, c_scales}, Fp8Rows{kr, kr_scales}, block_tables, lens, tiles, ctx, heads, lora,
                           rope, block_size, max_blocks, softmax_scale);
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
