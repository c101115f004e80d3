// CPU simulator for the CUDA C sources in kernels/cuda: lets g++ compile them unmodified (after
// prelude.cuh) with `-x c++`. Every CUDA thread of a block is a cooperative fiber (sim.cpp);
// barriers and warp collectives switch to the next runnable fiber, blocks run one after another on
// one OS thread (the runtime may hand ranges of blocks to several threads). Nothing preempts a
// fiber, so `__shared__` is a `static thread_local`: blocks on different OS threads share nothing,
// and each block finds its shared variables poisoned (`fresh_shared`). Dynamic (`extern __shared__`) shared memory is not supported.
#pragma once
#include <math.h>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static thread_local
#define __constant__ static const

namespace cuda_sim {

struct uint3_ {
    unsigned x, y, z;
};

// The state of the fiber now running on this OS thread (set by the scheduler in sim.cpp).
struct Current {
    uint3_ tid, bid, bdim, gdim;
    unsigned lane;
};
extern thread_local Current cur __attribute__((tls_model("initial-exec")));

// Block-wide barrier; `file`/`line` identify the call site so threads waiting at different
// __syncthreads are reported instead of silently meeting.
void sync_block(const char* file, int line);
// Warp collective: this lane contributes `v`, waits for every lane of its warp, and gets the whole
// warp's contributions (32 slots, lanes that do not exist read 0). `mask` must cover every lane
// that exists (partial-warp masks are not simulated and are reported as errors).
const uint32_t* warp_exchange(uint32_t mask, uint32_t v, const char* what, const char* file, int line);
void sync_warp(uint32_t mask, const char* file, int line);
// On a GPU a block's shared memory starts undefined; here a `__shared__` variable is a static that
// outlives the block, so a read of an element the block never wrote would see what the previous
// block left, plausible numbers that hide the bug. build.rs appends a call of this to every
// `__shared__` declaration: the first thread of a block to pass it fills the variable with 0xFF
// bytes (a NaN as a float, -1 as an int), which the comparisons with the reference catch.
void fresh_shared(void* p, std::size_t bytes);
inline unsigned lane_id() { return cur.lane; }

template <class T>
__forceinline__ uint32_t to_bits(T v) {
    static_assert(sizeof(T) == 4, "the simulator shuffles 32-bit values only");
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
}
template <class T>
__forceinline__ T from_bits(uint32_t u) {
    T v;
    std::memcpy(&v, &u, 4);
    return v;
}

// Unpacks a cuLaunchKernel-style argument array into the kernel's parameters.
template <class... P, std::size_t... I>
void call_impl(void (*k)(P...), void** a, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<P>*>(a[I])...);
}
template <class... P>
void call(void (*k)(P...), void** a) {
    call_impl(k, a, std::index_sequence_for<P...>{});
}
template <auto K>
void invoke(void** a) {
    call(K, a);
}
// One parameter's kind as the Rust side names its arguments: p pointer, i 32-bit int, l 64-bit
// int, f float.
template <class P>
constexpr char kind() {
    if constexpr (std::is_pointer_v<P>) return 'p';
    else if constexpr (std::is_floating_point_v<P> && sizeof(P) == 4) return 'f';
    else if constexpr (std::is_integral_v<P> && sizeof(P) == 4) return 'i';
    else if constexpr (std::is_integral_v<P> && sizeof(P) == 8) return 'l';
    else return '?';
}
template <class... P>
struct Sig {
    static constexpr char s[sizeof...(P) + 1] = {kind<P>()..., '\0'};
};
template <class... P>
constexpr const char* signature(void (*)(P...)) {
    return Sig<std::remove_cv_t<P>...>::s;
}

// One kernel in the registry that build.rs generates (one table per source file).
struct Entry {
    const char* name;
    void (*invoke)(void**);
    const char* signature;
};

}  // namespace cuda_sim

#define threadIdx (::cuda_sim::cur.tid)
#define blockIdx (::cuda_sim::cur.bid)
#define blockDim (::cuda_sim::cur.bdim)
#define gridDim (::cuda_sim::cur.gdim)
#define warpSize 32

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) { cuda_sim::sync_block(file, line); }
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    cuda_sim::sync_warp(mask, file, line);
}

template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    const uint32_t* s = cuda_sim::warp_exchange(mask, cuda_sim::to_bits(v), "__shfl_xor_sync", file, line);
    unsigned l = cuda_sim::lane_id();
    unsigned src = l ^ (unsigned)lane_mask;
    if ((src & ~(unsigned)(width - 1)) != (l & ~(unsigned)(width - 1))) src = l;  // outside the segment: own value
    return cuda_sim::from_bits<T>(s[src & 31]);
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    const uint32_t* s = cuda_sim::warp_exchange(mask, cuda_sim::to_bits(v), "__shfl_sync", file, line);
    unsigned l = cuda_sim::lane_id();
    unsigned base = l & ~(unsigned)(width - 1);
    return cuda_sim::from_bits<T>(s[(base + ((unsigned)src_lane & (unsigned)(width - 1))) & 31]);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    const uint32_t* s = cuda_sim::warp_exchange(mask, cuda_sim::to_bits(v), "__shfl_down_sync", file, line);
    unsigned l = cuda_sim::lane_id();
    unsigned seg = l & ~(unsigned)(width - 1), src = (l & (unsigned)(width - 1)) + delta;
    return cuda_sim::from_bits<T>(src < (unsigned)width ? s[(seg + src) & 31] : s[l]);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    const uint32_t* s = cuda_sim::warp_exchange(mask, cuda_sim::to_bits(v), "__shfl_up_sync", file, line);
    unsigned l = cuda_sim::lane_id();
    unsigned in_seg = l & (unsigned)(width - 1);
    return cuda_sim::from_bits<T>(in_seg >= delta ? s[l - delta] : s[l]);
}
inline unsigned __ballot_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    const uint32_t* s = cuda_sim::warp_exchange(mask, pred ? 1u : 0u, "__ballot_sync", file, line);
    unsigned b = 0;
    for (int i = 0; i < 32; i++) b |= (s[i] & 1u) << i;
    return b & mask;
}
inline int __any_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return __ballot_sync(mask, pred, file, line) != 0;
}
inline int __all_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return __ballot_sync(mask, !pred, file, line) == 0;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (prelude.cuh's mma_bf16_16816), d += a * b,
// with the fragment layout the PTX ISA documents ("Matrix Fragments for mma.m16n8k16 with floating
// point type"): lane = 4 * group + t; A (16x16, two bf16 per register, the lower column in the low
// half) a[0] = row group, cols 2t..2t+1; a[1] = row group + 8, same cols; a[2], a[3] = the same
// rows, cols + 8. B (16x8) b[0] = rows 2t..2t+1 of col group, b[1] = rows + 8. C/D (16x8 f32)
// d[0], d[1] = row group, cols 2t..2t+1; d[2], d[3] = row group + 8. Every lane of the warp must
// take part (the instruction is warp-synchronous), which the exchanges check. Products of bf16
// values are exact in f32; the sum runs in k order (the tensor core's order is unspecified).
namespace cuda_sim {
inline float bf16_bits_to_f32(uint32_t half) { return from_bits<float>(half << 16); }
inline void mma_bf16_16816(float* d, const uint32_t* a, const uint32_t* b, const char* file, int line) {
    float A[16][16], B[16][8];
    for (int r = 0; r < 4; r++) {
        const uint32_t* s = warp_exchange(0xffffffffu, a[r], "mma.sync (A)", file, line);
        for (int lane = 0; lane < 32; lane++) {
            int row = lane / 4 + (r & 1) * 8, col = (lane % 4) * 2 + (r >> 1) * 8;
            A[row][col] = bf16_bits_to_f32(s[lane] & 0xffffu);
            A[row][col + 1] = bf16_bits_to_f32(s[lane] >> 16);
        }
    }
    for (int r = 0; r < 2; r++) {
        const uint32_t* s = warp_exchange(0xffffffffu, b[r], "mma.sync (B)", file, line);
        for (int lane = 0; lane < 32; lane++) {
            int row = (lane % 4) * 2 + r * 8, col = lane / 4;
            B[row][col] = bf16_bits_to_f32(s[lane] & 0xffffu);
            B[row + 1][col] = bf16_bits_to_f32(s[lane] >> 16);
        }
    }
    unsigned lane = lane_id();
    for (int i = 0; i < 4; i++) {
        int row = lane / 4 + (i >> 1) * 8, col = (lane % 4) * 2 + (i & 1);
        float acc = d[i];
        for (int k = 0; k < 16; k++) acc += A[row][k] * B[k][col];
        d[i] = acc;
    }
}
}  // namespace cuda_sim
#define CUDA_SIM_MMA 1

inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
template <class T>
inline T __ldg(const T* p) { return *p; }

inline float __uint_as_float(unsigned u) { return cuda_sim::from_bits<float>(u); }
inline float __int_as_float(int i) { return cuda_sim::from_bits<float>((uint32_t)i); }
inline unsigned __float_as_uint(float f) { return cuda_sim::to_bits(f); }
inline int __float_as_int(float f) { return (int)cuda_sim::to_bits(f); }

// Within a block nothing preempts a fiber, but the runtime may run blocks of one grid on several
// OS threads at once, so atomics are real (relaxed, like CUDA's) atomic read-modify-writes.
namespace cuda_sim {
template <class T, class F>
inline T atomic_rmw(T* p, F f) {
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(p, &old, f(old), true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
template <class T>
inline float atomic_rmw_float(float* p, T f) {
    uint32_t* u = reinterpret_cast<uint32_t*>(p);
    uint32_t old = __atomic_load_n(u, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(u, &old, to_bits(f(from_bits<float>(old))), true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return from_bits<float>(old);
}
}  // namespace cuda_sim
template <class T>
inline T atomicAdd(T* p, T v) { return cuda_sim::atomic_rmw(p, [v](T o) { return o + v; }); }
inline float atomicAdd(float* p, float v) { return cuda_sim::atomic_rmw_float(p, [v](float o) { return o + v; }); }
template <class T>
inline T atomicSub(T* p, T v) { return cuda_sim::atomic_rmw(p, [v](T o) { return o - v; }); }
template <class T>
inline T atomicMax(T* p, T v) { return cuda_sim::atomic_rmw(p, [v](T o) { return o < v ? v : o; }); }
template <class T>
inline T atomicMin(T* p, T v) { return cuda_sim::atomic_rmw(p, [v](T o) { return v < o ? v : o; }); }
template <class T>
inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
template <class T>
inline T atomicCAS(T* p, T cmp, T v) {
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return cmp;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
// Fast-math intrinsics: computed at full precision (the device's are approximations).
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
