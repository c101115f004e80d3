// MXFP4 (CPU reference kernels/src/cpu/mxfp4.rs): E2M1 codes two per byte (element 2k in the low
// nibble of byte k), one E8M0 scale per 32 inputs (e8m0_to_f32 is in the prelude). One warp per
// row, up to TOK tokens per row tile (prelude: RowTile): lane l reads byte l of each 16-byte
// block, so a warp covers two whole blocks per step with coalesced loads. The row body serves the
// plain and the MoE GEMV.

__constant__ float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// `cols` is a multiple of 32; rows are cols/2 bytes; scales [rows, cols/32].
__device__ __forceinline__ void mxfp4_row(const RowTile& t, const u8* __restrict__ packed, const u8* __restrict__ scales, int cols) {
    int lane = threadIdx.x % WARP;
    const u8* r = packed + t.row * (cols / 2);
    const u8* sc = scales + t.row * (cols / 32);
    float acc[TOK];
    for (int i = 0; i < TOK; i++) acc[i] = 0.0f;
    for (int b = lane; b < cols / 2; b += WARP) {
        u8 byte = r[b];
        int j = 2 * b;
        float s = e8m0_to_f32(sc[j / 32]);
        float w0 = E2M1[byte & 15] * s, w1 = E2M1[byte >> 4] * s;
        for (int i = 0; i < TOK; i++)
            if (i < t.n) {
                const float* xr = t.x[i] + j;
                acc[i] += w0 * xr[0] + w1 * xr[1];
            }
    }
    store_tile(t, acc);
}

extern "C" __global__ void mxfp4_gemv(const u8* __restrict__ packed, const u8* __restrict__ scales,
                                      const float* __restrict__ x, float* __restrict__ out, int rows, int cols, int n) {
    dense_row_tile(x, out, rows, cols, n, [&](const RowTile& t) { mxfp4_row(t, packed, scales, cols); });
}

// MoE expert GEMV over experts stacked by rows (see moe_row_tiles in the prelude).
extern "C" __global__ void moe_mxfp4_gemv(const u8* __restrict__ packed, const u8* __restrict__ scales, MOE_TILE_PARAMS, int cols) {
    moe_row_tiles(MOE_TILE_ARGS, cols, [&](const RowTile& t) { mxfp4_row(t, packed, scales, cols); });
}
