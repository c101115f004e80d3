// Top-k / top-p sampling on device (CPU reference kernels/src/cpu/sample.rs, same algorithm).
// One block per sequence over its logits row:
//   1. p_i = softmax(logits / temperature) (unnormalised: exp(l_i - max));
//   2. top-k: keep p_i >= tau_k, tau_k the largest value with count(p >= tau_k) >= k, found by a
//      binary search over the f32 bit pattern (monotonic for non-negative floats): no sort;
//   3. top-p: among kept, keep p_i >= tau_p, tau_p the largest value whose kept mass >= top_p;
//   4. draw: the first index (in vocabulary order) where the running kept mass exceeds u * mass,
//      u in [0, 1) supplied by the host's seeded RNG (so CPU and GPU draws can be compared).
// Ties at a threshold keep every tied token (so top-k may keep more than k). k = 0: no top-k;
// top_p >= 1: no top-p.
#define THREADS 1024

__device__ u32 count_ge(const float* p, int n, float t, float* scratch) {
    float c = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) c += p[i] >= t ? 1.0f : 0.0f;
    return (u32)block_sum(c, scratch);
}
__device__ float mass_ge(const float* p, int n, float t, float* scratch) {
    float c = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) c += p[i] >= t ? p[i] : 0.0f;
    return block_sum(c, scratch);
}

// `probs` is scratch space [seqs, vocab]; `u` [seqs]; `out` [seqs] chosen token ids.
extern "C" __global__ void sample_top_k_top_p(const float* __restrict__ logits, float* __restrict__ probs,
                                              const float* __restrict__ u, int* __restrict__ out, int vocab,
                                              float temperature, int top_k, float top_p) {
    __shared__ float scratch[32];
    __shared__ float part[THREADS];
    const float* l = logits + (long)blockIdx.x * vocab;
    float* p = probs + (long)blockIdx.x * vocab;
    float m = __int_as_float(0xff800000);
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) m = fmaxf(m, l[i]);
    m = block_max(m, scratch);
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) p[i] = expf((l[i] - m) / temperature);
    __syncthreads();
    float tau = 0.0f;
    if (top_k > 0 && top_k < vocab) {
        // Largest bit pattern t with count(p >= t) >= k. p >= 0, so patterns order like values.
        u32 lo = 0, hi = 0x7f800000u;
        while (lo < hi) {
            u32 mid = lo + (hi - lo + 1) / 2;
            if (count_ge(p, vocab, __uint_as_float(mid), scratch) >= (u32)top_k) lo = mid; else hi = mid - 1;
        }
        tau = __uint_as_float(lo);
    }
    if (top_p < 1.0f) {
        float total = mass_ge(p, vocab, tau, scratch);
        u32 lo = __float_as_uint(tau), hi = 0x7f800000u;
        while (lo < hi) {
            u32 mid = lo + (hi - lo + 1) / 2;
            if (mass_ge(p, vocab, __uint_as_float(mid), scratch) >= top_p * total) lo = mid; else hi = mid - 1;
        }
        tau = __uint_as_float(lo);
    }
    // Draw: each thread owns a contiguous chunk; a block scan of chunk masses finds the chunk.
    int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    int b = threadIdx.x * chunk, e = min(vocab, b + chunk);
    float mine = 0.0f;
    for (int i = b; i < e; i++) mine += p[i] >= tau ? p[i] : 0.0f;
    part[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int i = 0; i < blockDim.x; i++) total += part[i];
        float target = u[blockIdx.x] * total, run = 0.0f;
        int choice = -1, last = -1;
        for (int t = 0; t < blockDim.x && choice < 0; t++) {
            if (run + part[t] <= target) { run += part[t]; if (part[t] > 0.0f) last = t; continue; }
            int cb = t * chunk, ce = min(vocab, cb + chunk);
            for (int i = cb; i < ce; i++) {
                if (p[i] < tau) continue;
                run += p[i];
                last = i;
                if (run > target) { choice = i; break; }
            }
            if (choice < 0) choice = last; // rounding: the target sat at the chunk's very end
        }
        if (choice < 0) { // u * total rounded up to total: the last kept token
            for (int i = vocab - 1; i >= 0; i--) if (p[i] >= tau) { choice = i; break; }
        }
        out[blockIdx.x] = choice;
    }
}
