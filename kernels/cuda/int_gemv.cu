// Uniform integer weights (compressed-tensors pack-quantized; CPU reference
// kernels/src/cpu/quant_int.rs): w = (u - z) * s per (row, group). out[n, rows] = x[n, cols] . W^T.
//
// One warp per output row and up to TOK tokens per launch row-tile (blockIdx.y), so the packed
// row is read once from DRAM for TOK tokens: decode is bandwidth bound on the packed bytes.
#define TOK 8

// Any width 1..8, any group size.
extern "C" __global__ void int_gemv(const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                    const float* __restrict__ zero, const float* __restrict__ x, float* __restrict__ out,
                                    int rows, int cols, int bits, int group_size, int n) {
    int warps = blockDim.x / WARP;
    int row = blockIdx.x * warps + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int t0 = blockIdx.y * TOK;
    if (row >= rows) return;
    int groups = (cols + group_size - 1) / group_size;
    const u8* r = packed + (long)row * stride;
    float acc[TOK];
    for (int t = 0; t < TOK; t++) acc[t] = 0.0f;
    for (int j = lane; j < cols; j += WARP) {
        int g = j / group_size;
        float w = ((float)code_at(r, bits, j) - zero[(long)row * groups + g]) * scale[(long)row * groups + g];
        for (int t = 0; t < TOK; t++)
            if (t0 + t < n) acc[t] += w * x[(long)(t0 + t) * cols + j];
    }
    // t0 + t < n is the same for the whole warp, so stopping there keeps every lane in the
    // shuffles, and a decode step (n = 1) reduces one accumulator instead of TOK.
    for (int t = 0; t < TOK && t0 + t < n; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0) out[(long)(t0 + t) * rows + row] = s;
    }
}

// 4-bit fast path: each lane reads whole 32-bit words (8 codes). Needs stride % 4 == 0 and
// group_size % 8 == 0 (the loader checks; compressed-tensors rows are padded to int32 words).
extern "C" __global__ void int4_gemv(const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                     const float* __restrict__ zero, const float* __restrict__ x, float* __restrict__ out,
                                     int rows, int cols, int group_size, int n) {
    int warps = blockDim.x / WARP;
    int row = blockIdx.x * warps + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int t0 = blockIdx.y * TOK;
    if (row >= rows) return;
    int groups = (cols + group_size - 1) / group_size;
    const u32* r = (const u32*)(packed + (long)row * stride);
    int words = (cols + 7) / 8;
    float acc[TOK];
    for (int t = 0; t < TOK; t++) acc[t] = 0.0f;
    for (int wi = lane; wi < words; wi += WARP) {
        u32 word = __ldg(r + wi);
        int j0 = wi * 8, g = j0 / group_size;
        float s = scale[(long)row * groups + g], z = zero[(long)row * groups + g];
        float w[8];
        for (int k = 0; k < 8; k++) w[k] = ((float)((word >> (4 * k)) & 15u) - z) * s;
        for (int t = 0; t < TOK; t++) {
            if (t0 + t >= n) break;
            const float* xr = x + (long)(t0 + t) * cols + j0;
            float a = 0.0f;
            for (int k = 0; k < 8; k++)
                if (j0 + k < cols) a += w[k] * xr[k];
            acc[t] += a;
        }
    }
    // t0 + t < n is the same for the whole warp, so stopping there keeps every lane in the
    // shuffles, and a decode step (n = 1) reduces one accumulator instead of TOK.
    for (int t = 0; t < TOK && t0 + t < n; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0) out[(long)(t0 + t) * rows + row] = s;
    }
}
