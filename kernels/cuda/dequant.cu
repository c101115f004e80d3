// Prefill-size matmuls over packed weights: these kernels expand a packed weight into a bf16
// scratch matrix (reading the packed codes once) and narrow f32 activations to bf16, so that the
// dense tensor-core GEMM (cuBLAS, `Runtime::gemm_bf16`) does the multiply. This is what several
// engines do for large batches when they lack a mixed-precision tensor-core kernel; a fused
// kernel that dequantises tiles in shared memory (Marlin-style) would save the scratch round trip
// and is future work. Decode-size batches keep the GEMV kernels (kernels/src/gpu/kernels.rs picks).
//
// The dequant kernels run one block per weight row (gridDim.x = rows, so any row count fits) and
// stride its threads over the columns: writes are coalesced and no thread divides a 64-bit flat
// index (emulated and slow on the GPU). They expand source rows row0..row0+rows into out rows
// 0..rows: a dense prefill expands the whole weight (row0 = 0), a routed-MoE prefill one expert's
// rows of the stacked expert weight (row0 = expert * rows per expert). CPU references:
// kernels/src/cpu/dequant.rs over cpu::{quant_int, cubic, mxfp4}.

// Pack-quantized INT, the layout int_gemv reads: w = (u - z) * s per (row, group), any width 1..8.
extern "C" __global__ void dequant_int_bf16(const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                            const float* __restrict__ zero, u16* __restrict__ out, int row0, int rows,
                                            int cols, int bits, int group_size) {
    int i = blockIdx.x;
    if (i >= rows) return;
    long row = (long)row0 + i;
    int groups = (cols + group_size - 1) / group_size;
    const u8* r = packed + row * stride;
    const float *s = scale + row * groups, *z = zero + row * groups;
    u16* o = out + (long)i * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        int g = j / group_size;
        o[j] = f32_to_bf16(((float)code_at(r, bits, j) - z[g]) * s[g]);
    }
}

// Cubic codebook, cubic_gemv's level formula: s * fma(a*t, t*t, t), t = (i - h)/h, h = 2^(b-1).
// Evaluated per element (no shared-memory table): the kernel is bound by its bf16 writes.
extern "C" __global__ void dequant_cubic_bf16(const u8* __restrict__ packed, long stride, const float* __restrict__ scale,
                                              const float* __restrict__ shape, u16* __restrict__ out, int row0, int rows,
                                              int cols, int bits, int group_size) {
    int i = blockIdx.x;
    if (i >= rows) return;
    long row = (long)row0 + i;
    int groups = (cols + group_size - 1) / group_size;
    float h = (float)(1 << (bits - 1));
    const u8* r = packed + row * stride;
    const float *s = scale + row * groups, *a = shape + row * groups;
    u16* o = out + (long)i * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        int g = j / group_size;
        float t = ((float)code_at(r, bits, j) - h) / h;
        o[j] = f32_to_bf16(s[g] * fmaf(a[g] * t, t * t, t));
    }
}

// MXFP4, mxfp4_gemv's layout: element 2k in the low nibble of byte k of a cols/2-byte row, one
// E8M0 scale per 32 inputs ([rows, cols/32]); cols is a multiple of 32.
extern "C" __global__ void dequant_mxfp4_bf16(const u8* __restrict__ packed, const u8* __restrict__ scales,
                                              u16* __restrict__ out, int row0, int rows, int cols) {
    int i = blockIdx.x;
    if (i >= rows) return;
    long row = (long)row0 + i;
    const u8* r = packed + row * (cols / 2);
    const u8* sc = scales + row * (cols / 32);
    u16* o = out + (long)i * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        u8 byte = r[j >> 1];
        u32 code = (j & 1) ? (u32)(byte >> 4) : (u32)(byte & 15u);
        o[j] = f32_to_bf16(e2m1_to_f32(code) * e8m0_to_f32(sc[j / 32]));
    }
}

// Activations for the bf16 GEMM: x rounded to nearest even, like every other bf16 narrowing here.
// One thread per element over a flat index (no division needed).
extern "C" __global__ void f32_to_bf16_rows(const float* __restrict__ x, u16* __restrict__ out, long count) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) out[i] = f32_to_bf16(x[i]);
}
