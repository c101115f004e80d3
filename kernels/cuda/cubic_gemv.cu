// Cubic codebook weights (docs/cubic-format.md; CPU reference kernels/src/cpu/cubic.rs): level of
// code i is s * fma(a*t, t*t, t), t = (i - h)/h, h = 2^(b-1), per (row, group) parameters [s, a].
//
// One warp per output row. For each group the warp first writes the group's 2^b levels into its
// slice of shared memory (lanes compute them in parallel), then every lane looks its codes up
// there: the cubic is evaluated 2^b times per group instead of once per weight.
#define TOK 8
#define WARPS 4

extern "C" __global__ void cubic_gemv(const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                      const float* __restrict__ shape, const float* __restrict__ x, float* __restrict__ out,
                                      int rows, int cols, int bits, int group_size, int n) {
    __shared__ float levels[WARPS][256];
    int wi = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int row = blockIdx.x * WARPS + wi;
    int t0 = blockIdx.y * TOK;
    bool live = row < rows; // whole warps exit together; no block-wide barrier is used
    if (!live) return;
    int groups = (cols + group_size - 1) / group_size;
    int nlev = 1 << bits;
    float h = (float)(1 << (bits - 1));
    const u8* r = packed + (long)row * stride;
    float acc[TOK];
    for (int t = 0; t < TOK; t++) acc[t] = 0.0f;
    for (int g = 0; g < groups; g++) {
        float s = scale[(long)row * groups + g], a = shape[(long)row * groups + g];
        __syncwarp();
        for (int i = lane; i < nlev; i += WARP) {
            float t = ((float)i - h) / h;
            levels[wi][i] = s * fmaf(a * t, t * t, t);
        }
        __syncwarp();
        int end = min(cols, (g + 1) * group_size);
        for (int j = g * group_size + lane; j < end; j += WARP) {
            float w = levels[wi][code_at(r, bits, j)];
            for (int t = 0; t < TOK; t++)
                if (t0 + t < n) acc[t] += w * x[(long)(t0 + t) * cols + j];
        }
    }
    // t0 + t < n is the same for the whole warp, so stopping there keeps every lane in the
    // shuffles, and a decode step (n = 1) reduces one accumulator instead of TOK.
    for (int t = 0; t < TOK && t0 + t < n; t++) {
        float v = warp_sum(acc[t]);
        if (lane == 0) out[(long)(t0 + t) * rows + row] = v;
    }
}
