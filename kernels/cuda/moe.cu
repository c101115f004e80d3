// MoE token grouping and expert GEMV (CPU reference kernels/src/cpu/moe.rs).
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

// Expert GEMV over bf16 weights [experts, rows, cols]: for grouped slot g (blockIdx.y), assignment
// a = order[g] reads token a / k's activation row and multiplies it by expert experts[a]'s matrix;
// out [assignments, rows] is in assignment order (the combine step weights and sums the k rows).
extern "C" __global__ void moe_expert_gemv_bf16(const u16* __restrict__ weights, const float* __restrict__ x,
                                                const int* __restrict__ experts, const int* __restrict__ order,
                                                float* __restrict__ out, int rows, int cols, int k) {
    int warps = blockDim.x / WARP;
    int row = blockIdx.x * warps + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (row >= rows) return;
    int a = order[blockIdx.y];
    const u16* wr = weights + ((long)experts[a] * rows + row) * cols;
    const float* xr = x + (long)(a / k) * cols;
    float acc = 0.0f;
    for (int j = lane; j < cols; j += WARP) acc += bf16_to_f32(wr[j]) * xr[j];
    acc = warp_sum(acc);
    if (lane == 0) out[(long)a * rows + row] = acc;
}
