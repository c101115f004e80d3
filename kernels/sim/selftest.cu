// Test-only kernels for the simulator's own semantics (kernels/tests/sim_semantics.rs): barriers,
// warp collectives, atomics, launch geometry, and the errors a barrier that can never complete
// must produce. Compiled like the real sources (after prelude.cuh), never shipped to NVRTC.

// out[i * 8 + k]: warp_sum, broadcast from lane 3, shfl_down by 1, shfl_up by 2, ballot of odd
// lanes, xor with width 8, block_sum, and the shared-memory reverse after __syncthreads.
extern "C" __global__ void simtest_collectives(float* out) {
    __shared__ float scratch[32];
    __shared__ int rev[1024];
    int i = threadIdx.x, lane = i % WARP;
    float v = (float)(i + 1);
    float* o = out + (long)(blockIdx.x * blockDim.x + i) * 8;
    o[0] = warp_sum(v);
    o[1] = __shfl_sync(0xffffffffu, v, 3);
    o[2] = __shfl_down_sync(0xffffffffu, v, 1);
    o[3] = __shfl_up_sync(0xffffffffu, v, 2);
    o[4] = (float)__ballot_sync(0xffffffffu, lane & 1);
    o[5] = __shfl_xor_sync(0xffffffffu, v, 4, 8);
    o[6] = block_sum(v, scratch);
    rev[i] = i;
    __syncthreads();
    o[7] = (float)rev[blockDim.x - 1 - i];
}

// Threads past `live` return before the barrier; the rest still pass it (exited threads count as
// arrived) and read what the live threads wrote.
extern "C" __global__ void simtest_early_exit(int* out, int live) {
    __shared__ int s[1024];
    int i = threadIdx.x;
    if (i >= live) return;
    s[i] = i * 10;
    __syncthreads();
    out[i] = s[live - 1 - i];
}

// Odd lanes return, even lanes shuffle: the collective can never complete.
extern "C" __global__ void simtest_exit_before_shuffle(float* out) {
    if (threadIdx.x % 2) return;
    out[threadIdx.x] = warp_sum(1.0f);
}

// Half the block waits at one __syncthreads, half at another.
extern "C" __global__ void simtest_divergent_barriers(int* out) {
    if (threadIdx.x < 16) {
        __syncthreads();
        out[threadIdx.x] = 1;
    } else {
        __syncthreads();
        out[threadIdx.x] = 2;
    }
}

// Lane 0 waits at __syncwarp while the rest of its warp waits at __syncthreads.
extern "C" __global__ void simtest_mixed_wait(int* out) {
    if (threadIdx.x == 0) __syncwarp();
    else __syncthreads();
    out[threadIdx.x] = 1;
}

// Every thread of the grid adds its linear index; out[0] ends as the sum.
extern "C" __global__ void simtest_atomic(int* out) {
    atomicAdd(out, (int)(blockIdx.x * blockDim.x + threadIdx.x));
}

// Launch geometry: each thread of a 3-D grid of 3-D blocks writes its coordinates.
extern "C" __global__ void simtest_geometry(int* out, long scale, float bias) {
    int bx = blockDim.x, by = blockDim.y, bz = blockDim.z;
    long block = blockIdx.x + (long)gridDim.x * (blockIdx.y + (long)gridDim.y * blockIdx.z);
    long t = threadIdx.x + bx * (threadIdx.y + by * threadIdx.z);
    int* o = out + (block * bx * by * bz + t) * 6;
    o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
    o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z + (int)scale + (int)bias;
}

// Writes one element past `n` (the runtime's guard check must catch it).
extern "C" __global__ void simtest_write_past_end(float* out, int n) {
    if (threadIdx.x == 0) out[n] = 1.0f;
}

// Thread 0 copies in[at]: `at` far enough past the end reaches the inaccessible page after the
// buffer's padding.
extern "C" __global__ void simtest_read_at(float* out, const float* in, int at) {
    if (threadIdx.x == 0) out[0] = in[at];
}

// Recursion a few hundred bytes a level deep: `depth` levels overflow a simulated thread's stack.
__device__ __noinline__ float simtest_deep(int n) {
    volatile float frame[128];
    frame[n % 128] = (float)n;
    return n == 0 ? frame[0] : simtest_deep(n - 1) + frame[n % 128];
}
extern "C" __global__ void simtest_stack_overflow(float* out, int depth) {
    out[threadIdx.x] = simtest_deep(depth);
}

// Thread i copies in[i + 1]: the last thread reads one element past the end of `in`.
extern "C" __global__ void simtest_read_past_end(float* out, const float* in) {
    out[threadIdx.x] = in[threadIdx.x + 1];
}

// Thread 0 writes a shared value that every thread reads with no barrier in between (a race on a
// GPU): the threads that run before thread 0 miss the write (the reverse thread order's point) and
// read the poison every block's shared variables start with (0xFF bytes: -1), not what the previous
// block on this OS thread left there.
extern "C" __global__ void simtest_missing_barrier(int* out, int tag) {
    __shared__ int v;
    if (threadIdx.x == 0) v = tag + blockIdx.x;
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}
