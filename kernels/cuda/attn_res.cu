// Kimi K3's Block Attention Residuals (CPU reference kernels/src/cpu/attn_res.rs `mix_row`).
// `stream` holds the residual stream's slots one after the other (`stream + c*slot_stride`, each
// [rows, d]): `num_blocks` snapshots, then the partial sum. One block per row: each candidate
// scores sum(rmsnorm(v) * w) (w = norm weight x projection), and the row's output is the
// softmax-weighted sum of the raw candidates. K3 has at most 9 candidates.
#define ATTN_RES_MAX 64
extern "C" __global__ void attn_res_mix(const float* __restrict__ stream, int num_blocks, long slot_stride,
                                        const float* __restrict__ w, float* __restrict__ out, int d, float eps) {
    __shared__ float scratch[32];
    __shared__ float weight[ATTN_RES_MAX];
    long row = (long)blockIdx.x * d;
    int n = num_blocks + 1;
    for (int c = 0; c < n; c++) {
        const float* v = stream + c * slot_stride + row;
        float ss = 0.0f, dot = 0.0f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            ss += v[i] * v[i];
            dot += v[i] * w[i];
        }
        ss = block_sum(ss, scratch);
        dot = block_sum(dot, scratch);
        if (threadIdx.x == 0) weight[c] = dot / sqrtf(ss / (float)d + eps);
    }
    __syncthreads();
    float top = weight[0];
    for (int c = 1; c < n; c++) top = fmaxf(top, weight[c]);
    float total = 0.0f;
    for (int c = 0; c < n; c++) total += expf(weight[c] - top);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float acc = 0.0f;
        for (int c = 0; c < n; c++) {
            const float* v = stream + c * slot_stride + row;
            acc += expf(weight[c] - top) / total * v[i];
        }
        out[row + i] = acc;
    }
}

// x[offset + i] += delta[i] for i < n (adding a layer's output to the AttnRes partial sum's slot).
extern "C" __global__ void add_f32(float* __restrict__ x, long offset, const float* __restrict__ delta, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[offset + i] += delta[i];
}
