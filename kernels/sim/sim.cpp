// The simulator's scheduler: one cooperative fiber per CUDA thread of a block, blocks of a grid
// one after another on the calling OS thread. A fiber runs until it reaches a barrier or a warp
// collective it cannot pass yet, then switches straight to the next runnable fiber of the block.
// A barrier that can never complete (lanes exited before a collective, threads at different
// barriers) ends the launch with an error message instead of hanging. So does a memory fault in a
// kernel: simulated device memory lies between inaccessible pages (wsim_map), and a fault handler
// turns an access that reaches one into the launch's error.
#include "cuda_sim.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <string>
#include <mutex>
#include <unordered_map>
#include <vector>

#if !defined(__x86_64__) || defined(WSIM_UCONTEXT)
#include <ucontext.h>
#endif

extern "C" const cuda_sim::Entry* const wsim_tables[];

namespace cuda_sim {

thread_local Current cur __attribute__((tls_model("initial-exec")));

namespace {

constexpr std::size_t kStack = 64 * 1024;  // per simulated thread; the kernels use a few hundred bytes
constexpr std::size_t kGuard = 4096;       // an overflow faults instead of corrupting a neighbour

enum State : uint8_t { Ready, AtBlockBarrier, AtWarpCollective, Exited };

// Context switch: hand-written on x86-64; elsewhere (or with -DWSIM_UCONTEXT, which the tests were
// also run with) the portable but ~5x slower ucontext.

#if defined(__x86_64__) && !defined(WSIM_UCONTEXT)
// Saves the callee-saved registers on the current stack, stores its pointer in *save and resumes
// the fiber whose stack pointer is `to` (swapcontext would also make a signal-mask system call
// per switch, which dominates a simulated GEMV).
extern "C" void wsim_switch(void** save, void* to);
asm(R"(
    .text
    .p2align 4
    .hidden wsim_switch
    .globl wsim_switch
    .type wsim_switch,@function
wsim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size wsim_switch,.-wsim_switch
)");
struct Context {
    void* sp = nullptr;
};
#else
struct Context {
    ucontext_t uc;
};
#endif

struct Fiber {
    Context ctx;
    char* stack;
    std::size_t color;  // bytes left unused at the top of the stack
    uint3_ tid;
    State state;
};

struct Warp {
    uint32_t expected;  // lanes that exist
    uint32_t arrived;
    uint32_t exited;
    uint32_t gen;  // completed collectives: slots alternate so a fast lane cannot overwrite a value still to be read
    const char* what;
    const char* file;
    int line;
    uint32_t slots[2][32];
};

struct Launch {
    Context main;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    std::vector<char*> stacks;  // reused across blocks and launches on this OS thread
    void (*kernel)(void**) = nullptr;
    void** args = nullptr;
    unsigned n = 0, current = 0, at_barrier = 0, exited = 0;
    // Run the threads between barriers from the last to the first (see wsim_launch's `reverse`).
    bool reverse = false;
    const char* bfile = nullptr;
    int bline = 0;
    bool failed = false;
    std::string error;

    ~Launch() {
        for (char* s : stacks) munmap(s, kStack + kGuard);
    }
};

thread_local Launch launch_state;
thread_local Launch* L __attribute__((tls_model("initial-exec"))) = nullptr;
// True while a fiber (a simulated thread) runs on this OS thread, false in the launch's own code
// between blocks: only a fault in a fiber can be turned into a launch error.
thread_local bool in_fiber __attribute__((tls_model("initial-exec"))) = false;

void fiber_main();

void prepare(Fiber& f) {
#if defined(__x86_64__) && !defined(WSIM_UCONTEXT)
    // Frame popped by wsim_switch: six callee-saved registers, then fiber_main as return address;
    // fiber_main starts with rsp = top - 8 (as after a call) and a null return address above it.
    // Stack tops are staggered by a few cache lines: at the same page offset every fiber's frame
    // would map to the same L1 sets, and each switch would miss.
    auto* top = reinterpret_cast<void**>(f.stack + kGuard + kStack - f.color);
    top[-1] = nullptr;
    top[-2] = reinterpret_cast<void*>(&fiber_main);
    for (int i = 3; i <= 8; i++) top[-i] = nullptr;
    f.ctx.sp = &top[-8];
#else
    getcontext(&f.ctx.uc);
    f.ctx.uc.uc_stack.ss_sp = f.stack + kGuard;
    f.ctx.uc.uc_stack.ss_size = kStack;
    f.ctx.uc.uc_link = nullptr;
    makecontext(&f.ctx.uc, fiber_main, 0);
#endif
}

inline void switch_ctx(Context& from, Context& to) {
#if defined(__x86_64__) && !defined(WSIM_UCONTEXT)
    wsim_switch(&from.sp, to.sp);
#else
    swapcontext(&from.uc, &to.uc);
#endif
}

inline void resume(unsigned from, unsigned to) {
    L->current = to;
    cur.tid = L->fibers[to].tid;
    cur.lane = to % 32;
    switch_ctx(L->fibers[from].ctx, L->fibers[to].ctx);
}

[[noreturn]] void back_to_main() {
    switch_ctx(L->fibers[L->current].ctx, L->main);
    __builtin_unreachable();
}

std::string where(const char* what, const char* file, int line) {
    char b[256];
    snprintf(b, sizeof b, "%s at %s:%d", what, file, line);
    return b;
}

[[noreturn]] __attribute__((cold, noinline)) void fail(const char* fmt, ...) {
    char b[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b, sizeof b, fmt, ap);
    va_end(ap);
    L->failed = true;
    L->error = b;
    back_to_main();
}

[[noreturn]] __attribute__((cold, noinline)) void deadlock() {
    unsigned block = 0, warp = 0;
    const char *wf = "?", *ww = "?";
    int wl = 0;
    for (unsigned i = 0; i < L->n; i++) {
        if (L->fibers[i].state == AtBlockBarrier) block++;
        if (L->fibers[i].state == AtWarpCollective) {
            const Warp& w = L->warps[i / 32];
            warp++, wf = w.file, ww = w.what, wl = w.line;
        }
    }
    std::string b = L->bfile ? where("__syncthreads", L->bfile, L->bline) : std::string("__syncthreads");
    fail("deadlock: %u threads wait at %s, %u at %s, %u exited: no barrier can complete", block, b.c_str(), warp,
         where(ww, wf, wl).c_str(), L->exited);
}

// Switches to the next runnable fiber after `self` (round robin, downwards in reverse order), or
// reports a deadlock.
inline __attribute__((always_inline)) void schedule_from(unsigned self) {
    unsigned n = L->n;
    bool reverse = L->reverse;
    if (!reverse && self + 1 < n && L->fibers[self + 1].state == Ready) {  // the usual case: the next lane
        resume(self, self + 1);
        return;
    }
    for (unsigned k = 1; k < n; k++) {
        unsigned i = reverse ? (self >= k ? self - k : self + n - k) : (self + k < n ? self + k : self + k - n);
        if (L->fibers[i].state == Ready) {
            resume(self, i);
            return;
        }
    }
    deadlock();
}

void release_block_barrier() {
    for (Fiber& f : L->fibers)
        if (f.state == AtBlockBarrier) f.state = Ready;
    L->at_barrier = 0;
    L->bfile = nullptr;
}

[[noreturn]] void thread_exit() {
    unsigned self = L->current;
    L->fibers[self].state = Exited;
    L->exited++;
    Warp& w = L->warps[self / 32];
    w.exited++;
    if (w.arrived > 0)
        fail("lane %u of warp %u exited while other lanes wait at %s: the collective can never complete", self % 32, self / 32,
             where(w.what, w.file, w.line).c_str());
    // Threads that returned count as arrived at __syncthreads (what the hardware does in practice).
    if (L->at_barrier > 0 && L->at_barrier + L->exited == L->n) release_block_barrier();
    if (L->exited == L->n) back_to_main();
    schedule_from(self);
    __builtin_unreachable();
}

void fiber_main() {
    L->kernel(L->args);
    thread_exit();
}

const char* kernel_site_mismatch = "lanes of warp %u wait at different collectives: %s and %s";

}  // namespace

namespace {
// Why this collective cannot proceed (kept out of line: the hot path only tests conditions).
[[noreturn]] __attribute__((cold, noinline)) void collective_error(uint32_t mask, const char* what, const char* file, int line) {
    unsigned self = L->current;
    Warp& w = L->warps[self / 32];
    uint32_t exist = w.expected == 32 ? 0xffffffffu : ((1u << w.expected) - 1u);
    if ((mask & exist) != exist)
        fail("%s with mask 0x%08x: partial-warp masks are not simulated (warp %u has lanes 0x%08x)", where(what, file, line).c_str(),
             mask, self / 32, exist);
    if (w.exited > 0)
        fail("%s: %u lane(s) of warp %u exited before it, so it can never complete", where(what, file, line).c_str(), w.exited,
             self / 32);
    fail(kernel_site_mismatch, self / 32, where(w.what, w.file, w.line).c_str(), where(what, file, line).c_str());
}
}  // namespace

const uint32_t* warp_exchange(uint32_t mask, uint32_t v, const char* what, const char* file, int line) {
    unsigned self = L->current;
    Warp& w = L->warps[self / 32];
    uint32_t exist = w.expected == 32 ? 0xffffffffu : ((1u << w.expected) - 1u);
    if (__builtin_expect((mask & exist) != exist || w.exited > 0, 0)) collective_error(mask, what, file, line);
    if (w.arrived == 0) {
        w.what = what, w.file = file, w.line = line;
    } else if (__builtin_expect(w.line != line || w.what != what || (w.file != file && strcmp(w.file, file) != 0), 0)) {
        collective_error(mask, what, file, line);
    }
    uint32_t* slots = w.slots[w.gen & 1];
    slots[self % 32] = v;
    if (++w.arrived == w.expected) {
        w.arrived = 0;
        w.gen++;
        unsigned first = self / 32 * 32;
        for (unsigned i = first; i < first + w.expected; i++)
            if (L->fibers[i].state == AtWarpCollective) L->fibers[i].state = Ready;
        return slots;
    }
    L->fibers[self].state = AtWarpCollective;
    schedule_from(self);
    return slots;
}

// Counts the blocks run on this OS thread, so a shared variable knows whether this block has
// poisoned it yet (threads of one block pass its declaration at different times, some after
// others wrote it).
thread_local uint64_t block_serial = 0;

void fresh_shared(void* p, std::size_t bytes) {
    thread_local std::unordered_map<void*, uint64_t> poisoned_in;
    uint64_t& last = poisoned_in[p];
    if (last == block_serial) return;
    last = block_serial;
    memset(p, 0xFF, bytes);
}

void sync_warp(uint32_t mask, const char* file, int line) { warp_exchange(mask, 0, "__syncwarp", file, line); }

void sync_block(const char* file, int line) {
    unsigned self = L->current;
    if (L->at_barrier == 0) {
        L->bfile = file, L->bline = line;
    } else if (L->bline != line || (L->bfile != file && strcmp(L->bfile, file) != 0)) {
        fail("threads wait at different barriers: %s and %s", where("__syncthreads", L->bfile, L->bline).c_str(),
             where("__syncthreads", file, line).c_str());
    }
    if (++L->at_barrier + L->exited == L->n) {
        release_block_barrier();
        return;
    }
    L->fibers[self].state = AtBlockBarrier;
    schedule_from(self);
}

}  // namespace cuda_sim

using namespace cuda_sim;

// Memory faults. A kernel that reads or writes past a buffer by more than its padding reaches an
// inaccessible page (wsim_map), and one that overflows a simulated thread's stack reaches that
// stack's guard page. Either would kill the process; instead the fault ends the launch with an
// error naming the block, the thread and the address, like CUDA's "illegal address". Faults
// outside a simulated thread go to the handler that was installed before (Rust's stack-overflow
// handler, or the default action).
namespace {
struct sigaction previous_segv;

void on_segv(int sig, siginfo_t* info, void* uctx) {
    if (L != nullptr && in_fiber) {
        auto* addr = static_cast<char*>(info->si_addr);
        for (char* s : L->stacks)
            if (addr >= s && addr < s + kGuard) fail("stack overflow (a simulated thread has %zu KiB of stack)", kStack / 1024);
        fail("memory fault at %p: an access outside every buffer (out of bounds by more than a buffer's padding, or a bad pointer)",
             info->si_addr);
    }
    if (previous_segv.sa_flags & SA_SIGINFO) {
        previous_segv.sa_sigaction(sig, info, uctx);
        return;
    }
    if (previous_segv.sa_handler != SIG_DFL && previous_segv.sa_handler != SIG_IGN) {
        previous_segv.sa_handler(sig);
        return;
    }
    // Default action: returning re-executes the faulting access, which now kills the process.
    signal(SIGSEGV, SIG_DFL);
}

// Runs on the stack Rust gives every thread for its own stack-overflow handler (SA_ONSTACK), so a
// fiber that overflowed can still be reported; SA_NODEFER because the handler never returns to the
// kernel it interrupted (fail() switches to the launch's context), which would leave SIGSEGV
// blocked for the rest of the thread's life.
void install_fault_handler() {
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction sa = {};
        sa.sa_sigaction = on_segv;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &previous_segv);
    });
}
}  // namespace

extern "C" std::size_t wsim_page_size() { return (std::size_t)sysconf(_SC_PAGESIZE); }

// Simulated device memory: `bytes` (a multiple of the page size) readable and writable, between
// two inaccessible pages. Returns the first usable byte, or null when out of memory.
extern "C" char* wsim_map(std::size_t bytes) {
    std::size_t page = wsim_page_size();
    void* m = mmap(nullptr, bytes + 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return nullptr;
    char* usable = static_cast<char*>(m) + page;
    if (mprotect(usable, bytes, PROT_READ | PROT_WRITE) != 0) {
        munmap(m, bytes + 2 * page);
        return nullptr;
    }
    return usable;
}

// Frees what wsim_map(bytes) returned.
extern "C" void wsim_unmap(char* usable, std::size_t bytes) {
    std::size_t page = wsim_page_size();
    munmap(usable - page, bytes + 2 * page);
}

static const Entry* find(const char* name) {
    for (const Entry* const* t = wsim_tables; *t; t++)
        for (const Entry* e = *t; e->name; e++)
            if (strcmp(e->name, name) == 0) return e;
    return nullptr;
}

static int report(char* err, std::size_t errlen, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return 1;
}

// Returns the kernel's parameter kinds (see cuda_sim::kind), or null for an unknown kernel.
extern "C" const char* wsim_signature(const char* name) {
    const Entry* e = find(name);
    return e ? e->signature : nullptr;
}

// Launches `name` like cuLaunchKernel (args[i] points at parameter i) and runs blocks
// [first, first + count) of the grid (linear index, x fastest) to completion on this OS thread;
// other ranges may run on other threads at the same time. `kinds` names the arguments the caller
// packed; they must match the kernel's parameters. `reverse` runs a block's threads from the last
// to the first between barriers: a read of another thread's write that lacks a barrier between
// them sees the write in one order and not in the other, so running both orders exposes it.
// Returns 0, or 1 with a message in `err`.
extern "C" int wsim_launch(const char* name, const uint32_t* grid, const uint32_t* block, uint32_t shared_bytes, void** args,
                           const char* kinds, uint64_t first, uint64_t count, int reverse, char* err, std::size_t errlen) {
    const Entry* e = find(name);
    if (!e) return report(err, errlen, "no kernel %s in the simulator", name);
    if (strcmp(e->signature, kinds) != 0)
        return report(err, errlen, "%s takes parameters \"%s\" (p pointer, i int, l long, f float) but got \"%s\"", name, e->signature,
                      kinds);
    unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
    if (block[0] == 0 || block[1] == 0 || block[2] == 0 || block[0] > 1024 || block[1] > 1024 || block[2] > 64 || threads > 1024)
        return report(err, errlen, "%s: block (%u, %u, %u) is outside CUDA's limits (each > 0, x, y <= 1024, z <= 64, <= 1024 threads)",
                      name, block[0], block[1], block[2]);
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[0] > 0x7fffffffu || grid[1] > 65535 || grid[2] > 65535)
        return report(err, errlen, "%s: grid (%u, %u, %u) is outside CUDA's limits (each > 0, y, z <= 65535)", name, grid[0], grid[1],
                      grid[2]);
    if (shared_bytes != 0) return report(err, errlen, "%s: dynamic shared memory (%u bytes) is not simulated", name, shared_bytes);
    if (L != nullptr) return report(err, errlen, "%s launched from inside a simulated kernel", name);

    install_fault_handler();
    Launch& l = launch_state;
    unsigned n = (unsigned)threads;
    while (l.stacks.size() < n) {
        void* m = mmap(nullptr, kStack + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return report(err, errlen, "%s: out of memory for simulated thread stacks", name);
        mprotect(m, kGuard, PROT_NONE);
        l.stacks.push_back(static_cast<char*>(m));
    }
    l.fibers.resize(n);
    l.warps.assign((n + 31) / 32, Warp{});
    for (unsigned i = 0; i < n; i++) {
        l.fibers[i].stack = l.stacks[i];
        l.fibers[i].color = (i * 7 % 64) * 64;
        l.fibers[i].tid = {i % block[0], i / block[0] % block[1], i / (block[0] * block[1])};
    }
    l.kernel = e->invoke, l.args = args, l.n = n, l.failed = false, l.reverse = reverse != 0;
    Current saved = cur;
    L = &l;
    cur.bdim = {block[0], block[1], block[2]};
    cur.gdim = {grid[0], grid[1], grid[2]};
    int rc = 0;
    uint64_t total = (uint64_t)grid[0] * grid[1] * grid[2];
    uint64_t end = first + count < total ? first + count : total;
    for (uint64_t b = first; b < end && rc == 0; b++) {
        unsigned x = (unsigned)(b % grid[0]), y = (unsigned)(b / grid[0] % grid[1]), z = (unsigned)(b / ((uint64_t)grid[0] * grid[1]));
        cur.bid = {x, y, z};
        block_serial++;
        for (Fiber& f : l.fibers) {
            f.state = Ready;
            prepare(f);
        }
        for (unsigned w = 0; w < l.warps.size(); w++) {
            Warp& wp = l.warps[w];
            wp.arrived = wp.exited = wp.gen = 0;
            wp.expected = n - w * 32 < 32 ? n - w * 32 : 32;
        }
        unsigned start = l.reverse ? n - 1 : 0;
        l.current = start, l.at_barrier = 0, l.exited = 0, l.bfile = nullptr;
        cur.tid = l.fibers[start].tid;
        cur.lane = start % 32;
        in_fiber = true;
        switch_ctx(l.main, l.fibers[start].ctx);
        in_fiber = false;
        if (l.failed) {
            unsigned t = l.current;
            rc = report(err, errlen, "%s: block (%u, %u, %u), thread (%u, %u, %u): %s", name, x, y, z, l.fibers[t].tid.x, l.fibers[t].tid.y,
                        l.fibers[t].tid.z, l.error.c_str());
        }
    }
    L = nullptr;
    cur = saved;
    return rc;
}
