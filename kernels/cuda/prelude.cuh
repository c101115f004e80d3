// Shared by every kernel source: the loader (kernels/src/cuda/compile.rs) prepends this file, so
// the sources need no include path and no CUDA toolkit headers (NVRTC alone compiles them).
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#define WARP 32

// bf16 is the upper half of an f32: widening is a shift, narrowing rounds to nearest even.
__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40); // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// FP8 E4M3 ("FN": no infinities, 0x7F/0xFF NaN), as kernels/src/cpu/fp8.rs decodes it.
__device__ __forceinline__ float e4m3_to_f32(u8 c) {
    u32 e = (c >> 3) & 0xF, m = c & 7;
    float mag;
    if (e == 0xF && m == 7) return __int_as_float(0x7fc00000);
    if (e == 0) mag = (float)m * (1.0f / 512.0f);          // subnormal: 2^-6 * m/8
    else mag = __uint_as_float(((e + 120u) << 23) | (m << 20)); // (1 + m/8) * 2^(e-7)
    return (c & 0x80) ? -mag : mag;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Tensor cores: d (16x8 f32) += a (16x16 bf16, row-major) * b (16x8 bf16, column-major), one warp,
// every lane taking part; fragments in the PTX ISA's m16n8k16 layout (the simulator's
// cuda_sim::mma_bf16_16816 spells it out). sm_80 and later. Inline PTX rather than <mma.h>'s wmma:
// NVRTC needs no header for it, and wmma's fragment layout is opaque, while the attention kernels
// reuse a score fragment as the next product's A operand, which needs the documented layout.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) { return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16); }
#ifdef CUDA_SIM_MMA
__device__ __forceinline__ void mma_bf16_16816(float* d, const u32* a, const u32* b) {
    cuda_sim::mma_bf16_16816(d, a, b, __FILE__, __LINE__);
}
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// No bf16 MMA before Ampere; the host never launches a kernel that uses it there (Runtime::bf16_mma).
__device__ __forceinline__ void mma_bf16_16816(float* d, const u32* a, const u32* b) { __trap(); }
#else
__device__ __forceinline__ void mma_bf16_16816(float* d, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// Block-wide sum; every thread gets the total. `scratch` holds one float per warp.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = (blockDim.x + WARP - 1) / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[w] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < nw; i++) t += scratch[i];
    return t;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP, nw = (blockDim.x + WARP - 1) / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[w] = v;
    __syncthreads();
    float t = __int_as_float(0xff800000);
    for (int i = 0; i < nw; i++) t = fmaxf(t, scratch[i]);
    return t;
}

// Code `j` of a dense LSB-first `bits`-bit row (kernels/src/cpu/bitpack.rs); rows carry one
// readable byte after them (the loader pads the buffer).
__device__ __forceinline__ u32 code_at(const u8* row, int bits, long j) {
    long p = j * bits;
    u32 pair = (u32)row[p >> 3] | ((u32)row[(p >> 3) + 1] << 8);
    return (pair >> (p & 7)) & ((1u << bits) - 1u);
}

// MX formats (OCP microscaling; CPU reference kernels/src/cpu/mxfp4.rs). E8M0 scale 2^(e-127),
// 0xFF is NaN; 2^-127 is an f32 subnormal (mantissa bit 22).
__device__ __forceinline__ float e8m0_to_f32(u8 e) {
    if (e == 255) return __int_as_float(0x7fc00000);
    if (e == 0) return __uint_as_float(1u << 22);
    return __uint_as_float(((u32)e) << 23);
}
// FP4 E2M1 code (bit 3 sign, 2 exponent bits, 1 mantissa bit) built from its bits, so no table
// lookup (constant memory serialises when a warp reads different entries).
__device__ __forceinline__ float e2m1_to_f32(u32 c) {
    u32 e = (c >> 1) & 3u, m = c & 1u;
    float mag = e == 0 ? 0.5f * (float)m : __uint_as_float(((e + 126u) << 23) | (m << 22)); // (1 + m/2) * 2^(e-1)
    return (c & 8u) ? -mag : mag;
}

// GEMV row tiles (int_gemv.cu, cubic_gemv.cu, mxfp4_gemv.cu, moe.cu). One warp per weight row
// multiplies it with up to TOK activation rows, so the row is read once from DRAM per TOK tokens
// (decode is bandwidth bound on the weight). A plain GEMV's tile is TOK consecutive tokens
// (blockIdx.y); an MoE tile is up to TOK grouped assignments of one expert (moe.cu's moe_tiles).
// Each weight format has one row body taking a RowTile, which both launch kinds call.
#define TOK 8
struct RowTile {
    long row;            // weight row
    int n;               // activation rows in use, 1..TOK (the same for the whole warp)
    const float* x[TOK]; // activation rows (`cols` wide)
    float* out[TOK];     // the output element of each
};

// Lane 0 stores the warp's sums. t.n is the same for the whole warp, so every lane takes part in
// the shuffles, and a decode step (n = 1) reduces one accumulator instead of TOK.
__device__ __forceinline__ void store_tile(const RowTile& t, const float* acc) {
    for (int i = 0; i < TOK && i < t.n; i++) {
        float s = warp_sum(acc[i]);
        if (threadIdx.x % WARP == 0) *t.out[i] = s;
    }
}

// A plain GEMV launch: out[n, rows] = x[n, cols] . W^T, warp -> row, blockIdx.y -> token tile.
template <typename Body>
__device__ __forceinline__ void dense_row_tile(const float* x, float* out, int rows, int cols, int n, Body body) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (row >= rows) return; // whole warps leave together
    RowTile t;
    int t0 = blockIdx.y * TOK;
    t.row = row;
    t.n = min(TOK, n - t0);
    for (int i = 0; i < TOK; i++) {
        long tok = t0 + max(0, min(i, t.n - 1)); // unused slots repeat the last row: valid pointers
        t.x[i] = x + tok * cols;
        t.out[i] = out + tok * rows + row;
    }
    body(t);
}

// An MoE GEMV launch: warp -> row r of every expert's matrix; tiles (first grouped slot, slots,
// local expert e) as moe.cu's moe_tiles writes them, grid-strided over blockIdx.y. Slot g is
// assignment a = order[g]: out[a, r] = W[e * rows_per_expert + r, :] . x[a / x_div, :]. A tile
// outside the launch's sizes (experts, assignments) is skipped, so a stale list stays in bounds.
#define MOE_TILE_PARAMS                                                                              \
    const float *__restrict__ x, int x_div, const int *__restrict__ order, const int *__restrict__ tiles, \
        const int *__restrict__ tile_count, float *__restrict__ out, int rows_per_expert, int experts, int assignments
#define MOE_TILE_ARGS x, x_div, order, tiles, tile_count, out, rows_per_expert, experts, assignments
template <typename Body>
__device__ __forceinline__ void moe_row_tiles(MOE_TILE_PARAMS, int cols, Body body) {
    int r = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (r >= rows_per_expert) return; // whole warps leave together
    int count = min(tile_count[0], assignments);
    for (int ti = blockIdx.y; ti < count; ti += gridDim.y) {
        int first = tiles[3 * ti], slots = tiles[3 * ti + 1], e = tiles[3 * ti + 2];
        if (e < 0 || e >= experts || slots < 1 || slots > TOK || first < 0 || first > assignments - slots) continue;
        RowTile t;
        t.row = (long)e * rows_per_expert + r;
        t.n = slots;
        for (int i = 0; i < TOK; i++) {
            long a = order[first + min(i, slots - 1)];
            t.x[i] = x + a / x_div * cols;
            t.out[i] = out + a * rows_per_expert + r;
        }
        body(t);
    }
}
