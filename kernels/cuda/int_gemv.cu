// Uniform integer weights (compressed-tensors pack-quantized; CPU reference
// kernels/src/cpu/quant_int.rs): w = (u - z) * s per (row, group). out[n, rows] = x[n, cols] . W^T.
//
// One warp per output row and up to TOK tokens per row tile (prelude: RowTile), so the packed
// row is read once from DRAM for TOK tokens: decode is bandwidth bound on the packed bytes. Each
// row body serves the plain GEMV (dense_row_tile) and the MoE expert GEMV (moe_row_tiles).

// Any width 1..8, any group size.
__device__ __forceinline__ void int_row(const RowTile& t, const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                        const float* __restrict__ zero, int cols, int bits, int group_size) {
    int lane = threadIdx.x % WARP;
    int groups = (cols + group_size - 1) / group_size;
    const u8* r = packed + t.row * stride;
    const float* s = scale + t.row * groups;
    const float* z = zero + t.row * groups;
    float acc[TOK];
    for (int i = 0; i < TOK; i++) acc[i] = 0.0f;
    for (int j = lane; j < cols; j += WARP) {
        int g = j / group_size;
        float w = ((float)code_at(r, bits, j) - z[g]) * s[g];
        for (int i = 0; i < TOK; i++)
            if (i < t.n) acc[i] += w * t.x[i][j];
    }
    store_tile(t, acc);
}

// 4-bit fast path: each lane reads whole 32-bit words (8 codes). Needs stride % 4 == 0 and
// group_size % 8 == 0 (the wrappers check; compressed-tensors rows are padded to int32 words).
__device__ __forceinline__ void int4_row(const RowTile& t, const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                         const float* __restrict__ zero, int cols, int group_size) {
    int lane = threadIdx.x % WARP;
    int groups = (cols + group_size - 1) / group_size;
    const u32* r = (const u32*)(packed + t.row * stride);
    const float* sc = scale + t.row * groups;
    const float* zr = zero + t.row * groups;
    int words = (cols + 7) / 8;
    float acc[TOK];
    for (int i = 0; i < TOK; i++) acc[i] = 0.0f;
    for (int wi = lane; wi < words; wi += WARP) {
        u32 word = __ldg(r + wi);
        int j0 = wi * 8, g = j0 / group_size;
        float s = sc[g], z = zr[g];
        float w[8];
        for (int k = 0; k < 8; k++) w[k] = ((float)((word >> (4 * k)) & 15u) - z) * s;
        for (int i = 0; i < TOK; i++) {
            if (i >= t.n) break;
            const float* xr = t.x[i] + j0;
            float a = 0.0f;
            for (int k = 0; k < 8; k++)
                if (j0 + k < cols) a += w[k] * xr[k];
            acc[i] += a;
        }
    }
    store_tile(t, acc);
}

extern "C" __global__ void int_gemv(const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                    const float* __restrict__ zero, const float* __restrict__ x, float* __restrict__ out,
                                    int rows, int cols, int bits, int group_size, int n) {
    dense_row_tile(x, out, rows, cols, n, [&](const RowTile& t) { int_row(t, packed, stride, scale, zero, cols, bits, group_size); });
}

extern "C" __global__ void int4_gemv(const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                     const float* __restrict__ zero, const float* __restrict__ x, float* __restrict__ out,
                                     int rows, int cols, int group_size, int n) {
    dense_row_tile(x, out, rows, cols, n, [&](const RowTile& t) { int4_row(t, packed, stride, scale, zero, cols, group_size); });
}

// MoE expert GEMVs over experts stacked by rows (see moe_row_tiles in the prelude).
extern "C" __global__ void moe_int_gemv(const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                        const float* __restrict__ zero, MOE_TILE_PARAMS, int cols, int bits, int group_size) {
    moe_row_tiles(MOE_TILE_ARGS, cols, [&](const RowTile& t) { int_row(t, packed, stride, scale, zero, cols, bits, group_size); });
}

extern "C" __global__ void moe_int4_gemv(const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                         const float* __restrict__ zero, MOE_TILE_PARAMS, int cols, int group_size) {
    moe_row_tiles(MOE_TILE_ARGS, cols, [&](const RowTile& t) { int4_row(t, packed, stride, scale, zero, cols, group_size); });
}
