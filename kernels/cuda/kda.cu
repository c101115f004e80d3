// Kimi Delta Attention (KDA): the short convolution and the gated delta rule recurrence of a batch
// of sequences, plus the slot reset of its state pool. CPU references: kernels/src/cpu/kda.rs
// (conv_silu_batch, recurrent_batch), built from the per-token functions the host runs; the
// arithmetic below follows them operation for operation.
//
// Batch rows are grouped by sequence (CSR): sequence s's rows are seq_rows[seq_start[s] ..
// seq_start[s + 1]] in position order, and its state is slot seq_slot[s]. A sequence's rows must
// run in order (each continues the state the previous one left), so one thread (conv) or one
// block (recurrence) walks them serially; sequences run in parallel. Offsets are clamped to the
// row list, and rows >= n or slots >= slots are skipped, so a malformed grouping stays in bounds.

#define KDA_MAX_KERNEL 8    // convolution taps (Kimi-Linear: 4); kernels/src/gpu/kda.rs checks it
#define KDA_MAX_HEAD_DIM 256 // threads of a recurrence block (Kimi-Linear: 128)
#define KDA_L2_EPS 1e-6f     // FLA's l2norm: x / sqrt(sum x^2 + eps)

__device__ __forceinline__ float kda_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float kda_silu(float x) { return x / (1.0f + expf(-x)); }
// transformers' softplus: x itself above 20.
__device__ __forceinline__ float kda_softplus(float x) { return x > 20.0f ? x : logf(1.0f + expf(x)); }

// Sequence s's span of seq_rows, clamped to the list's rows_len entries.
__device__ __forceinline__ void kda_seq_span(const int* seq_start, int s, int rows_len, int* begin, int* end) {
    int b = max(0, min(seq_start[s], rows_len));
    *begin = b;
    *end = max(b, min(seq_start[s + 1], rows_len));
}

// Depthwise causal conv + SiLU: out[r, c] = silu(sum_t w[c, t] * window[t]), window = the last
// kernel - 1 inputs of channel c (conv_state[slot, c, :], oldest first) then mixed[r, c].
// One thread per (sequence, channel); sequences stride over gridDim.y. The window lives in
// registers: every index below is a compile-time constant once the KDA_MAX_KERNEL loops unroll,
// and the sum runs in tap order as the reference's does.
extern "C" __global__ void kda_conv_silu(const float* __restrict__ mixed, const float* __restrict__ weight, float* __restrict__ conv_state,
                                         const int* __restrict__ seq_rows, const int* __restrict__ seq_start, const int* __restrict__ seq_slot,
                                         int seqs, int rows_len, int n, int slots, int channels, int kernel, float* __restrict__ out) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    int h = kernel - 1;
    float w[KDA_MAX_KERNEL - 1], win[KDA_MAX_KERNEL - 1];
#pragma unroll
    for (int t = 0; t < KDA_MAX_KERNEL - 1; t++) w[t] = t < h ? weight[(long)c * kernel + t] : 0.0f;
    float w_last = weight[(long)c * kernel + h]; // the tap of the newest input
    for (int s = blockIdx.y; s < seqs; s += gridDim.y) {
        int slot = seq_slot[s];
        if (slot < 0 || slot >= slots) continue;
        float* hist = conv_state + ((long)slot * channels + c) * h;
#pragma unroll
        for (int t = 0; t < KDA_MAX_KERNEL - 1; t++) win[t] = t < h ? hist[t] : 0.0f;
        int begin, end;
        kda_seq_span(seq_start, s, rows_len, &begin, &end);
        for (int i = begin; i < end; i++) {
            int r = seq_rows[i];
            if (r < 0 || r >= n) continue;
            float x = mixed[(long)r * channels + c];
            float y = 0.0f;
#pragma unroll
            for (int t = 0; t < KDA_MAX_KERNEL - 1; t++)
                if (t < h) y += w[t] * win[t];
            y += w_last * x;
            out[(long)r * channels + c] = kda_silu(y);
#pragma unroll
            for (int t = 0; t < KDA_MAX_KERNEL - 1; t++)
                if (t < h) win[t] = t + 1 < h ? win[t + 1] : x;
        }
#pragma unroll
        for (int t = 0; t < KDA_MAX_KERNEL - 1; t++)
            if (t < h) hist[t] = win[t];
    }
}

// The gated delta rule of one (sequence, head) per block: blockIdx.x = head, sequences stride
// over gridDim.y; blockDim.x = head_dim rounded up to whole warps (the extra threads join the
// reductions with zeros). Thread j owns column j of the head's state S [head_dim (k)][head_dim (v)],
// S[kk][j] for every kk: a warp's accesses to one row are coalesced, and no other thread touches
// the column, so the two passes need no synchronisation between them. Per row:
//   q = l2norm(q) * scale, k = l2norm(k), g = forget gate, beta = sigmoid(logit)   (q, k, exp(g) shared)
//   pass 1: acc_j = sum_kk (S[kk][j] exp(g_kk)) k_kk;  delta_j = beta (v_j - acc_j)
//   pass 2: S[kk][j] = S[kk][j] exp(g_kk) + k_kk delta_j;  o_j = sum_kk S[kk][j] q_kk
//   out_j = o_j * rsqrt(mean(o^2) + eps) * o_norm_j * sigmoid(gate_j)
// Pass 2 recomputes the decayed value from the stored one rather than pass 1 writing it back:
// the same product, one store per element instead of two.
extern "C" __global__ void kda_recurrent(const float* __restrict__ conv, const float* __restrict__ f, const float* __restrict__ beta,
                                         const float* __restrict__ gate, const float* __restrict__ dt_bias, const float* __restrict__ decay_rate,
                                         const float* __restrict__ o_norm, float* __restrict__ state, const int* __restrict__ seq_rows,
                                         const int* __restrict__ seq_start, const int* __restrict__ seq_slot, int seqs, int rows_len, int n,
                                         int slots, int heads, int head_dim, float scale, float eps, int has_lower_bound, float lower_bound,
                                         float* __restrict__ out) {
    __shared__ float qs[KDA_MAX_HEAD_DIM], ks[KDA_MAX_HEAD_DIM], decay[KDA_MAX_HEAD_DIM];
    __shared__ float red[KDA_MAX_HEAD_DIM / WARP];
    int head = blockIdx.x, j = threadIdx.x, hd = head_dim;
    bool mine = j < hd; // false for the padding threads, which only join the reductions
    long P = (long)heads * hd, col = (long)head * hd + j;
    float bias = mine ? dt_bias[col] : 0.0f, norm_w = mine ? o_norm[j] : 0.0f, rate = decay_rate[head];
    for (int s = blockIdx.y; s < seqs; s += gridDim.y) {
        int slot = seq_slot[s];
        if (slot < 0 || slot >= slots) continue; // the whole block
        float* S = state + ((long)slot * heads + head) * hd * hd + j; // column j: S[kk * hd]
        int begin, end;
        kda_seq_span(seq_start, s, rows_len, &begin, &end);
        for (int i = begin; i < end; i++) {
            long r = seq_rows[i];
            if (r < 0 || r >= n) continue; // the whole block
            const float* row = conv + r * 3 * P;
            float q = mine ? row[col] : 0.0f, k = mine ? row[P + col] : 0.0f, v = mine ? row[2 * P + col] : 0.0f;
            float q_inv = 1.0f / sqrtf(block_sum(q * q, red) + KDA_L2_EPS);
            float k_inv = 1.0f / sqrtf(block_sum(k * k, red) + KDA_L2_EPS);
            if (mine) {
                float x = f[r * P + col] + bias;
                float g = has_lower_bound ? lower_bound * kda_sigmoid(rate * x) : -rate * kda_softplus(x);
                qs[j] = q * q_inv * scale;
                ks[j] = k * k_inv;
                decay[j] = expf(g);
            }
            __syncthreads();
            float b = kda_sigmoid(beta[r * heads + head]);
            float o = 0.0f;
            if (mine) {
                float acc = 0.0f;
                for (int kk = 0; kk < hd; kk++) acc += S[(long)kk * hd] * decay[kk] * ks[kk];
                float delta = (v - acc) * b;
                for (int kk = 0; kk < hd; kk++) {
                    float sv = S[(long)kk * hd] * decay[kk] + ks[kk] * delta;
                    S[(long)kk * hd] = sv;
                    o += sv * qs[kk];
                }
            }
            float inv = 1.0f / sqrtf(block_sum(o * o, red) / (float)hd + eps);
            if (mine) out[r * P + col] = o * inv * norm_w * kda_sigmoid(gate[r * P + col]);
            __syncthreads(); // qs, ks and decay are rewritten by the next row
        }
    }
}

// buf[start .. start + n] = 0: the reset of one slot of a state pool.
extern "C" __global__ void zero_span_f32(float* buf, long start, long n) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) buf[start + idx] = 0.0f;
}
