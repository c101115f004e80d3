// Routed MoE (CPU reference kernels/src/cpu/moe.rs): router logits (matmul_f32), routing
// (moe_route), grouping of the assignments by expert (moe_count/offsets/scatter), tiles of grouped
// slots (moe_tiles), the prefill path's gather/scatter around a per-expert GEMM (moe_gather_bf16,
// moe_scatter_rows), the bf16 expert GEMV (moe_gemv_bf16; the quantized formats' MoE GEMVs sit
// beside their plain GEMVs) and the weighted combine (moe_combine).
//
// Grouping: the router's top-k choices `experts` [assignments = tokens * k] are grouped by expert
// with a stable order (assignment index order inside each expert), the order the CPU path uses,
// so outputs are reproducible. moe_count -> moe_offsets (exclusive scan) -> moe_scatter (one block
// per expert computes each assignment's rank with warp ballots: O(experts * assignments)).
extern "C" __global__ void moe_count(const int* __restrict__ experts, int assignments, int* __restrict__ counts) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < assignments) atomicAdd(&counts[experts[i]], 1);
}

extern "C" __global__ void moe_offsets(const int* __restrict__ counts, int num_experts, int* __restrict__ offsets) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        int run = 0;
        for (int e = 0; e < num_experts; e++) { offsets[e] = run; run += counts[e]; }
        offsets[num_experts] = run;
    }
}

// blockDim.x must be a multiple of 32 and <= 1024.
extern "C" __global__ void moe_scatter(const int* __restrict__ experts, int assignments, const int* __restrict__ offsets,
                                       int* __restrict__ order) {
    __shared__ int warp_tot[32];
    __shared__ int base;
    int e = blockIdx.x, lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = blockDim.x / WARP;
    if (threadIdx.x == 0) base = offsets[e];
    __syncthreads();
    for (int start = 0; start < assignments; start += blockDim.x) {
        int i = start + threadIdx.x;
        bool hit = i < assignments && experts[i] == e;
        u32 ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_tot[w] = __popc(ballot);
        __syncthreads();
        int before = 0, tile = 0;
        for (int k = 0; k < nw; k++) { if (k < w) before += warp_tot[k]; tile += warp_tot[k]; }
        if (hit) order[base + before + __popc(ballot & ((1u << lane) - 1u))] = i;
        __syncthreads();
        if (threadIdx.x == 0) base += tile;
        __syncthreads();
    }
}


// Tiles of up to TOK consecutive grouped slots of one expert, for experts 0..held (the bucket
// `held` of experts held elsewhere gets none), from moe_offsets' offsets [held + 2]: (first slot,
// slots, expert) triples in tiles[3 * max_tiles], their number in count[0]. Experts with more than
// max_slots slots get no tiles either: the prefill path multiplies those with a dequantised GEMM.
// Serial on one thread: a loop over the experts is short next to the GEMVs it feeds, and keeps the
// list on the device.
extern "C" __global__ void moe_tiles(const int* __restrict__ offsets, int held, int max_tiles, int max_slots,
                                     int* __restrict__ tiles, int* __restrict__ count) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int n = 0;
    for (int e = 0; e < held; e++) {
        int end = offsets[e + 1];
        if (end - offsets[e] > max_slots) continue;
        for (int s = offsets[e]; s < end && n < max_tiles; s += TOK, n++) {
            tiles[3 * n] = s;
            tiles[3 * n + 1] = min(TOK, end - s);
            tiles[3 * n + 2] = e;
        }
    }
    count[0] = n;
}

// The prefill path's gather: the activations of one expert's grouped slots first..first+count as
// bf16 rows for the GEMM, out[i, :] = bf16(x[order[first + i] / x_div, :]) (x_div = k for the
// token rows the first projection reads, 1 for the assignment rows of the down projection). One
// block per slot, threads over the columns.
extern "C" __global__ void moe_gather_bf16(const float* __restrict__ x, int x_div, const int* __restrict__ order, int first,
                                           int count, int cols, u16* __restrict__ out) {
    int i = blockIdx.x;
    if (i >= count) return;
    const float* src = x + (long)(order[first + i] / x_div) * cols;
    u16* dst = out + (long)i * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) dst[j] = f32_to_bf16(src[j]);
}

// ... and its scatter: the GEMM's rows y[count, rows] back to their assignments,
// out[order[first + i], :] = y[i, :].
extern "C" __global__ void moe_scatter_rows(const float* __restrict__ y, const int* __restrict__ order, int first, int count,
                                            int rows, float* __restrict__ out) {
    int i = blockIdx.x;
    if (i >= count) return;
    const float* src = y + (long)i * rows;
    float* dst = out + (long)order[first + i] * rows;
    for (int j = threadIdx.x; j < rows; j += blockDim.x) dst[j] = src[j];
}

// Dense row bodies (bf16 expert weights, the f32 router weight): one weight row times a RowTile.
__device__ __forceinline__ float widen(u16 w) { return bf16_to_f32(w); }
__device__ __forceinline__ float widen(float w) { return w; }
template <typename W>
__device__ __forceinline__ void dense_row(const RowTile& t, const W* __restrict__ w, int cols) {
    int lane = threadIdx.x % WARP;
    const W* wr = w + t.row * cols;
    float acc[TOK];
    for (int i = 0; i < TOK; i++) acc[i] = 0.0f;
    for (int j = lane; j < cols; j += WARP) {
        float wv = widen(wr[j]);
        for (int i = 0; i < TOK; i++)
            if (i < t.n) acc[i] += wv * t.x[i][j];
    }
    store_tile(t, acc);
}

// MoE expert GEMV over bf16 (or, for exact checks of f32 checkpoints, f32) weights stacked by
// rows (see moe_row_tiles in the prelude).
extern "C" __global__ void moe_gemv_bf16(const u16* __restrict__ w, MOE_TILE_PARAMS, int cols) {
    moe_row_tiles(MOE_TILE_ARGS, cols, [&](const RowTile& t) { dense_row(t, w, cols); });
}
extern "C" __global__ void moe_gemv_f32(const float* __restrict__ w, MOE_TILE_PARAMS, int cols) {
    moe_row_tiles(MOE_TILE_ARGS, cols, [&](const RowTile& t) { dense_row(t, w, cols); });
}

// Router logits out[n, rows] = x[n, cols] . W^T with f32 weights, so the routing choice does not
// depend on a bf16 rounding of the router.
extern "C" __global__ void matmul_f32(const float* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, int rows,
                                      int cols, int n) {
    dense_row_tile(x, out, rows, cols, n, [&](const RowTile& t) { dense_row(t, w, cols); });
}

// ---- Routing: one block of one warp per token, bit-identical to cpu::moe::route_token ----
#define MAX_EXPERTS 1024 // 32 per lane: a lane's taken-set fits one u32

// Sort key of a score: NaN counts as -inf, then f32::total_cmp's order (-0 below +0) as an int.
__device__ __forceinline__ int route_key(float v) {
    if (v != v) v = __int_as_float(0xff800000);
    int i = __float_as_int(v);
    return i ^ (int)((u32)(i >> 31) >> 1);
}
// (key a, index ia) ranks above (key b, index ib): larger key, ties to the lower index.
__device__ __forceinline__ bool route_above(int a, int ia, int b, int ib) { return a > b || (a == b && ia < ib); }

// Indices of the k largest of v[0..len) (len <= MAX_EXPERTS), largest first, into out[0..min(k,
// len)): k passes of a warp argmax; lane l owns v[l + 32 i] and remembers which it gave away.
__device__ void warp_top_indices(const float* v, int len, int k, int* out) {
    int lane = threadIdx.x % WARP;
    u32 taken = 0;
    k = min(k, len);
    for (int p = 0; p < k; p++) {
        int key = (int)0x80000000, idx = 0x7fffffff; // below every real key
        for (int i = 0, e = lane; e < len; i++, e += WARP) {
            int ke = route_key(v[e]);
            if (!(taken >> i & 1u) && route_above(ke, e, key, idx)) { key = ke; idx = e; }
        }
        for (int o = WARP / 2; o > 0; o >>= 1) {
            int k2 = __shfl_xor_sync(0xffffffffu, key, o), i2 = __shfl_xor_sync(0xffffffffu, idx, o);
            if (route_above(k2, i2, key, idx)) { key = k2; idx = i2; }
        }
        if (idx % WARP == lane) taken |= 1u << (idx / WARP);
        if (lane == 0) out[p] = idx;
    }
    __syncwarp();
}

// scoring: 0 softmax, 1 sigmoid. method: 0 greedy, 1 group-limited greedy, 2 noaux_tc. `bias`
// [num_experts] is read iff has_bias. Outputs [n * top_k]: global expert ids, weights, and local
// ids (expert - held_start inside the held range, else held_len).
extern "C" __global__ void moe_route(const float* __restrict__ logits, const float* __restrict__ bias, int has_bias, int num_experts,
                                     int scoring, int method, int n_group, int topk_group, int top_k, int normalize, float scale,
                                     int held_start, int held_len, int* __restrict__ experts, float* __restrict__ weights,
                                     int* __restrict__ local) {
    __shared__ float scores[MAX_EXPERTS], choice[MAX_EXPERTS], group_score[MAX_EXPERTS];
    __shared__ int chosen[MAX_EXPERTS]; // kept groups (up to n_group), then the top_k experts
    __shared__ u8 keep[MAX_EXPERTS];
    __shared__ float total;
    int lane = threadIdx.x % WARP;
    const float* l = logits + (long)blockIdx.x * num_experts;
    // Scores, each with the reference's formula.
    if (scoring == 1) {
        for (int e = lane; e < num_experts; e += WARP) scores[e] = 1.0f / (1.0f + expf(-l[e]));
    } else {
        float m = __int_as_float(0xff800000);
        for (int e = lane; e < num_experts; e += WARP) m = fmaxf(m, l[e]); // NaN ignored, as f32::max
        m = warp_max(m);
        for (int e = lane; e < num_experts; e += WARP) scores[e] = expf(l[e] - m);
        __syncwarp();
        if (lane == 0) { // serial, in index order: the reference's sum bit for bit
            float s = 0.0f;
            for (int e = 0; e < num_experts; e++) s += scores[e];
            total = s;
        }
        __syncwarp();
        float s = total;
        for (int e = lane; e < num_experts; e += WARP) scores[e] = scores[e] / s;
    }
    for (int e = lane; e < num_experts; e += WARP) choice[e] = has_bias ? scores[e] + bias[e] : scores[e];
    __syncwarp();
    // Group limiting: rank groups (lane-strided, each scanned serially), keep the topk_group best.
    if (method != 0 && topk_group < n_group) {
        int per = num_experts / n_group;
        for (int g = lane; g < n_group; g += WARP) {
            const float* c = choice + g * per;
            float gs;
            if (method == 2) { // sum of the two best (one when a group has one expert)
                int k0 = (int)0x80000000, i0 = 0x7fffffff, k1 = k0, i1 = i0;
                for (int i = 0; i < per; i++) {
                    int ki = route_key(c[i]);
                    if (route_above(ki, i, k0, i0)) { k1 = k0; i1 = i0; k0 = ki; i0 = i; }
                    else if (route_above(ki, i, k1, i1)) { k1 = ki; i1 = i; }
                }
                gs = per > 1 ? c[i0] + c[i1] : c[i0];
            } else {
                gs = __int_as_float(0xff800000);
                for (int i = 0; i < per; i++) gs = fmaxf(gs, c[i]);
            }
            group_score[g] = gs;
            keep[g] = 0;
        }
        __syncwarp();
        warp_top_indices(group_score, n_group, topk_group, chosen);
        if (lane == 0)
            for (int i = 0; i < min(topk_group, n_group); i++) keep[chosen[i]] = 1;
        __syncwarp();
        for (int e = lane; e < num_experts; e += WARP)
            if (!keep[e / per]) choice[e] = __int_as_float(0xff800000);
        __syncwarp();
    }
    warp_top_indices(choice, num_experts, top_k, chosen);
    // Weights: the unbiased scores, renormalised (serial sum, largest first) and scaled.
    int k = min(top_k, num_experts);
    float denom = 0.0f;
    if (normalize) {
        for (int j = 0; j < k; j++) denom += scores[chosen[j]];
        denom += 1e-20f;
    }
    if (lane < k) {
        int e = chosen[lane];
        float w = scores[e];
        if (normalize) w = w / denom;
        w = w * scale;
        long a = (long)blockIdx.x * top_k + lane;
        experts[a] = e;
        weights[a] = w;
        local[a] = e >= held_start && e < held_start + held_len ? e - held_start : held_len;
    }
}

// out[t, :] += sum over the k assignments a = t*k + j with 0 <= local[a] < held of
// weights[a] * y[a, :], accumulated in increasing j with fused multiply-adds from 0 (what the CPU
// reference does with mul_add), so both agree bit for bit.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weights, const int* __restrict__ local,
                                       int held, int n, int k, int d, float* __restrict__ out) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)n * d) return;
    long t = idx / d, i = idx % d;
    float acc = 0.0f;
    for (int j = 0; j < k; j++) {
        long a = t * k + j;
        int le = local[a];
        if (le >= 0 && le < held) acc = fmaf(weights[a], y[a * d + i], acc);
    }
    out[idx] += acc;
}
