// MXFP4 (CPU reference kernels/src/cpu/mxfp4.rs): E2M1 codes two per byte (element 2k in the low
// nibble of byte k), one E8M0 scale per 32 inputs. One warp per row: lane l reads byte l of each
// 16-byte block, so a warp covers two whole blocks per step with coalesced loads.
#define TOK 8

__constant__ float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

__device__ __forceinline__ float e8m0_to_f32(u8 e) {
    if (e == 255) return __int_as_float(0x7fc00000);
    if (e == 0) return __uint_as_float(1u << 22);
    return __uint_as_float(((u32)e) << 23);
}

// `cols` is a multiple of 32; rows are cols/2 bytes; scales [rows, cols/32].
extern "C" __global__ void mxfp4_gemv(const u8* __restrict__ packed, const u8* __restrict__ scales,
                                      const float* __restrict__ x, float* __restrict__ out, int rows, int cols, int n) {
    int warps = blockDim.x / WARP;
    int row = blockIdx.x * warps + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int t0 = blockIdx.y * TOK;
    if (row >= rows) return;
    const u8* r = packed + (long)row * (cols / 2);
    const u8* sc = scales + (long)row * (cols / 32);
    float acc[TOK];
    for (int t = 0; t < TOK; t++) acc[t] = 0.0f;
    for (int b = lane; b < cols / 2; b += WARP) {
        u8 byte = r[b];
        int j = 2 * b;
        float s = e8m0_to_f32(sc[j / 32]);
        float w0 = E2M1[byte & 15] * s, w1 = E2M1[byte >> 4] * s;
        for (int t = 0; t < TOK; t++)
            if (t0 + t < n) {
                const float* xr = x + (long)(t0 + t) * cols + j;
                acc[t] += w0 * xr[0] + w1 * xr[1];
            }
    }
    // t0 + t < n is the same for the whole warp, so stopping there keeps every lane in the
    // shuffles, and a decode step (n = 1) reduces one accumulator instead of TOK.
    for (int t = 0; t < TOK && t0 + t < n; t++) {
        float v = warp_sum(acc[t]);
        if (lane == 0) out[(long)(t0 + t) * rows + row] = v;
    }
}
