// Cubic codebook weights (docs/cubic-format.md; CPU reference kernels/src/cpu/cubic.rs): level of
// code i is s * fma(a*t, t*t, t), t = (i - h)/h, h = 2^(b-1), per (row, group) parameters [s, a].
//
// One warp per output row, up to TOK tokens per row tile (prelude: RowTile). For each group the
// warp first writes the group's 2^b levels into its slice of shared memory (lanes compute them in
// parallel), then every lane looks its codes up there: the cubic is evaluated 2^b times per group
// instead of once per weight. The row body serves the plain and the MoE GEMV.
#define WARPS 4

// `levels`: this warp's 256 floats of shared memory. No block-wide barrier is used, so warps
// whose row is out of range may leave early.
__device__ __forceinline__ void cubic_row(const RowTile& t, const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                          const float* __restrict__ shape, int cols, int bits, int group_size, float* levels) {
    int lane = threadIdx.x % WARP;
    int groups = (cols + group_size - 1) / group_size;
    int nlev = 1 << bits;
    float h = (float)(1 << (bits - 1));
    const u8* r = packed + t.row * stride;
    float acc[TOK];
    for (int i = 0; i < TOK; i++) acc[i] = 0.0f;
    for (int g = 0; g < groups; g++) {
        float s = scale[t.row * groups + g], a = shape[t.row * groups + g];
        __syncwarp(); // the previous group's (or tile's) lookups are done
        for (int i = lane; i < nlev; i += WARP) {
            float u = ((float)i - h) / h;
            levels[i] = s * fmaf(a * u, u * u, u);
        }
        __syncwarp();
        int end = min(cols, (g + 1) * group_size);
        for (int j = g * group_size + lane; j < end; j += WARP) {
            float w = levels[code_at(r, bits, j)];
            for (int i = 0; i < TOK; i++)
                if (i < t.n) acc[i] += w * t.x[i][j];
        }
    }
    store_tile(t, acc);
}

extern "C" __global__ void cubic_gemv(const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                      const float* __restrict__ shape, const float* __restrict__ x, float* __restrict__ out,
                                      int rows, int cols, int bits, int group_size, int n) {
    __shared__ float levels[WARPS][256];
    float* lv = levels[threadIdx.x / WARP];
    dense_row_tile(x, out, rows, cols, n, [&](const RowTile& t) { cubic_row(t, packed, stride, scale, shape, cols, bits, group_size, lv); });
}

// MoE expert GEMV over experts stacked by rows (see moe_row_tiles in the prelude).
extern "C" __global__ void moe_cubic_gemv(const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                          const float* __restrict__ shape, MOE_TILE_PARAMS, int cols, int bits, int group_size) {
    __shared__ float levels[WARPS][256];
    float* lv = levels[threadIdx.x / WARP];
    moe_row_tiles(MOE_TILE_ARGS, cols, [&](const RowTile& t) { cubic_row(t, packed, stride, scale, shape, cols, bits, group_size, lv); });
}
