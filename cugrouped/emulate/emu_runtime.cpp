// cugrouped/emulate/emu_runtime.cpp -- fiber scheduler and launcher of the CUDA emulator.
//
// Not compiled on its own: the generated wrapper is `#include <kernel source>` followed by
// `#include "emu_runtime.cpp"` and one entry point per exposed kernel, all in one translation unit
// (with cuda_emu.h force-included, so every system header is already there).
//
// A launch: `cg_emu_launch` starts `workers` OS threads; each takes blocks from a shared counter
// (in forward, reverse or a seeded affine-shuffled order) and runs each block's threads as fibers.
// A fiber is created once per launch (makecontext) and reused for every block the worker runs;
// switches are _setjmp/_longjmp. The scheduler resumes READY fibers in the block's fiber order
// until every fiber has returned; a pass that finds none READY while some still wait is a
// deadlock, reported with the source lines involved. The "warps" orders instead run one warp at a
// time as far as it can go (through its warp collectives, up to a block barrier or its end)
// before the next warp starts: a warp running ahead of the others, which the one-step-per-pass
// orders never produce. An error abandons the launch: the workers
// stop taking blocks, and the fibers (which own nothing) are dropped with their stacks.

namespace emu {

enum State : int { READY, AT_BARRIER, AT_WARP, DONE };

struct Fiber {
    jmp_buf ctx;
    ucontext_t uc;          // used once, to enter the fiber for the first time
    bool started = false;
    char* stack = nullptr;  // lowest usable address
    size_t stack_size = 0;
    uint3 tid{};
    int lin = 0;            // linear thread index in the block
    State state = READY;
    const char* file = "";  // where it waits (barrier or warp collective)
    int line = 0;
    int op = 0;             // BarrierKind or WarpOp
    unsigned mask = 0;
    unsigned long long value = 0, result = 0;
    int param = 0, width = 32;
    void* fake_stack = nullptr;   // ASan bookkeeping
};

struct Launch {
    dim3 grid, block;
    size_t smem = 0;
    int order = 0;                // 0 forward, 1 reverse, 2 shuffle(seed), 3 warps, 4 warps reversed
    unsigned long long seed = 0;
    int ftz = 1;
    void (*thunk)(void*) = nullptr;
    void* ctx = nullptr;
    unsigned long long nblocks = 0, perm_a = 1, perm_c = 0;
    std::atomic<unsigned long long> next{0};
    std::atomic<bool> abort{false};
    std::mutex err_mutex;
    std::string error;
    void fail(const std::string& msg) {
        std::lock_guard<std::mutex> lock(err_mutex);
        if (error.empty()) error = msg;
        abort.store(true);
    }
};

struct Worker {
    jmp_buf sched;
    Launch* L = nullptr;
    std::vector<Fiber> fibers;
    std::vector<int> order;
    char* map = nullptr;
    size_t map_size = 0;
    int nthreads = 0, live = 0, at_barrier = 0;
    unsigned long long releases = 0;   // block barriers released so far (the "warps" orders)
    bool failed = false;
    std::string error;
    unsigned long long rng = 0;
    uint3 block{};
    const void* sched_stack_bottom = nullptr;   // ASan bookkeeping
    size_t sched_stack_size = 0;
    void* sched_fake_stack = nullptr;
};

static thread_local Worker* t_worker;
static thread_local Fiber* t_fiber;
// Memory access tracing (trace builds: emu_trace.cpp): t_tracing is 1 while kernel code runs on
// this worker's current fiber; t_tls_lo/size: this thread's block of the library's TLS.
static thread_local int t_tracing;
static thread_local void* t_tls_lo;
static thread_local size_t t_tls_size;
#if defined(CUGROUPED_EMULATE_TRACE)
#define EMU_TRACING(on) (t_tracing = (on))
#else
#define EMU_TRACING(on) ((void)0)
#endif

// Fiber stack size: options=("-DCG_EMU_STACK_SIZE=262144",) for deep or -O0 kernels.
#if defined(CG_EMU_STACK_SIZE)
static const size_t kStackSize = CG_EMU_STACK_SIZE;
#elif defined(__SANITIZE_ADDRESS__)
static const size_t kStackSize = 512 * 1024;   // ASan frames are large
#else
static const size_t kStackSize = 64 * 1024;
#endif

static unsigned long long splitmix(unsigned long long& s) {
    unsigned long long z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
static std::string fmt(const char* f, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

static std::string where(const Worker* w, const Fiber* f) {
    return fmt("thread (%u,%u,%u) of block (%u,%u,%u)", f->tid.x, f->tid.y, f->tid.z, w->block.x,
               w->block.y, w->block.z);
}
static const char* barrier_name(int kind) {
    static const char* names[] = {"__syncthreads()", "__syncthreads_count()", "__syncthreads_and()",
                                  "__syncthreads_or()"};
    return names[kind];
}
static const char* warp_name(int op) {
    static const char* names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                  "__ballot_sync", "__any_sync", "__all_sync", "__syncwarp",
                                  "__reduce_add_sync", "__reduce_min_sync", "__reduce_max_sync",
                                  "__reduce_min_sync", "__reduce_max_sync", "__reduce_and_sync",
                                  "__reduce_or_sync", "__reduce_xor_sync"};
    return names[op];
}
static std::string waits(const Fiber* f) {
    if (f->state == AT_BARRIER) return fmt("%s at %s:%d", barrier_name(f->op), f->file, f->line);
    if (f->state == AT_WARP)
        return fmt("%s(mask 0x%08x) at %s:%d", warp_name(f->op), f->mask, f->file, f->line);
    return f->state == DONE ? "has returned" : "is running";
}

// ---- switching -------------------------------------------------------------------------------------
static void fiber_main();

// Scheduler -> fiber. Returns when the fiber yields, returns from the kernel or fails.
static __attribute__((noinline)) void resume(Worker* w, Fiber* f) {
    t_fiber = f;
    t_threadIdx = f->tid;
    if (_setjmp(w->sched) == 0) {
#if defined(__SANITIZE_ADDRESS__)
        __sanitizer_start_switch_fiber(&w->sched_fake_stack, f->stack, f->stack_size);
#endif
        if (!f->started) {
            f->started = true;
            setcontext(&f->uc);
        }
        _longjmp(f->ctx, 1);
    }
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(w->sched_fake_stack, nullptr, nullptr);
#endif
}

// Fiber -> scheduler; returns when the scheduler resumes this fiber.
static __attribute__((noinline)) void yield(Worker* w, Fiber* f) {
    if (_setjmp(f->ctx) == 0) {
#if defined(__SANITIZE_ADDRESS__)
        __sanitizer_start_switch_fiber(&f->fake_stack, w->sched_stack_bottom, w->sched_stack_size);
#endif
        _longjmp(w->sched, 1);
    }
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(f->fake_stack, nullptr, nullptr);
#endif
}

// Fail from inside a fiber: record the error and leave the fiber for good.
[[noreturn]] static void fiber_fail(const std::string& msg) {
    Worker* w = t_worker;
    EMU_TRACING(0);
    w->failed = true;
    w->error = msg;
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(nullptr, w->sched_stack_bottom, w->sched_stack_size);
#endif
    _longjmp(w->sched, 1);
}

[[noreturn]] void trap(const char* what, const char* file, int line) {
    fiber_fail(fmt("%s called at %s:%d by %s", what, file, line, where(t_worker, t_fiber).c_str()));
}

// ---- barriers ----------------------------------------------------------------------------------------
// Every thread that has not returned is at a barrier: release them, or fail if they are at
// different ones (called from a fiber).
static void release_barrier(Worker* w) {
    Fiber* first = nullptr;
    int count = 0, arrived = 0;
    for (Fiber& f : w->fibers) {
        if (f.state != AT_BARRIER) continue;
        if (!first) {
            first = &f;
        } else if (f.line != first->line || strcmp(f.file, first->file) != 0 || f.op != first->op) {
            fiber_fail(fmt("divergent barrier: %s waits at %s while %s waits at %s",
                           where(w, first).c_str(), waits(first).c_str(), where(w, &f).c_str(),
                           waits(&f).c_str()));
        }
        count += f.value != 0;
        ++arrived;
    }
    const int kind = first->op;
    const int result = kind == BAR_AND ? count == arrived : kind == BAR_OR ? count != 0 : count;
    for (Fiber& f : w->fibers) {
        if (f.state != AT_BARRIER) continue;
        f.result = (unsigned long long)result;
        f.state = READY;
    }
    w->at_barrier = 0;
    ++w->releases;
}

int barrier(BarrierKind kind, int pred, const char* file, int line) {
    Worker* w = t_worker;
    Fiber* f = t_fiber;
    if (!w) {
        fprintf(stderr, "cuda_emu: %s called outside an emulated launch\n", barrier_name(kind));
        abort();
    }
    EMU_TRACING(0);
    f->state = AT_BARRIER;
    f->op = kind;
    f->file = file;
    f->line = line;
    f->value = pred != 0;
    if (++w->at_barrier == w->live) release_barrier(w);
    yield(w, f);
    const int result = (int)f->result;
    EMU_TRACING(1);
    return result;
}

// ---- warp collectives ---------------------------------------------------------------------------------
static const unsigned long long kUndefined = ~0ull;   // value read from a lane outside the mask

static void resolve_warp(Worker* w, Fiber* lanes, int nlanes, unsigned mask) {
    const Fiber& a = lanes[__builtin_ctz(mask)];
    const int op = a.op;
    unsigned long long acc = 0;
    if (op == RED_AND || op == RED_MIN_U) acc = 0xffffffffull;
    if (op == RED_MIN_S) acc = 0x7fffffffull;
    if (op == RED_MAX_S) acc = 0x80000000ull;
    for (int l = 0; l < nlanes; ++l) {
        if (!((mask >> l) & 1u)) continue;
        const unsigned v = (unsigned)lanes[l].value;
        switch (op) {
            case BALLOT: case ANY: case ALL: acc |= (unsigned long long)(v != 0) << l; break;
            case RED_ADD: acc = (unsigned)(acc + v); break;
            case RED_MIN_U: acc = std::min<unsigned>((unsigned)acc, v); break;
            case RED_MAX_U: acc = std::max<unsigned>((unsigned)acc, v); break;
            case RED_MIN_S: acc = (unsigned)std::min<int>((int)(unsigned)acc, (int)v); break;
            case RED_MAX_S: acc = (unsigned)std::max<int>((int)(unsigned)acc, (int)v); break;
            case RED_AND: acc &= v; break;
            case RED_OR: acc |= v; break;
            case RED_XOR: acc ^= v; break;
            default: break;
        }
    }
    for (int l = 0; l < nlanes; ++l) {
        if (!((mask >> l) & 1u)) continue;
        Fiber& f = lanes[l];
        unsigned long long r = acc;
        if (op <= SHFL_XOR) {
            // PTX shfl.sync: c = ((32 - width) << 8) | clamp, clamp = 0 for .up and 31 otherwise.
            const int segmask = (32 - f.width) & 31;
            const int clamp = op == SHFL_UP ? 0 : 31;
            const int min_lane = l & segmask;
            const int max_lane = min_lane | (clamp & ~segmask);
            const int b = f.param;
            int j;
            bool ok;
            switch (op) {
                case SHFL_UP: j = l - b; ok = j >= max_lane; break;
                case SHFL_DOWN: j = l + b; ok = j <= max_lane; break;
                case SHFL_XOR: j = l ^ (b & 31); ok = j <= max_lane; break;
                default: j = min_lane | (b & 31 & ~segmask); ok = j <= max_lane; break;
            }
            if (!ok) j = l;
            r = ((mask >> j) & 1u) ? lanes[j].value : kUndefined;
        } else if (op == ANY) {
            r = acc != 0;
        } else if (op == ALL) {
            r = acc == (mask & (nlanes == 32 ? 0xffffffffu : ((1u << nlanes) - 1)));
        }
        f.result = r;
        f.state = READY;
    }
    (void)w;
}

unsigned long long warp_collective(WarpOp op, unsigned mask, unsigned long long value, int param,
                                   int width, const char* file, int line) {
    Worker* w = t_worker;
    Fiber* f = t_fiber;
    if (!w) {
        fprintf(stderr, "cuda_emu: %s called outside an emulated launch\n", warp_name(op));
        abort();
    }
    EMU_TRACING(0);
    const int lane = f->lin & 31;
    const int base = f->lin - lane;
    const int nlanes = std::min(32, w->nthreads - base);
    Fiber* lanes = &w->fibers[base];
    f->state = AT_WARP;
    f->op = op;
    f->mask = mask;
    f->value = value;
    f->param = param;
    f->width = width;
    f->file = file;
    f->line = line;
    if (!((mask >> lane) & 1u))
        fiber_fail(fmt("%s: %s calls it with mask 0x%08x, which does not include its own lane %d",
                       waits(f).c_str(), where(w, f).c_str(), mask, lane));
    if (nlanes < 32 && (mask >> nlanes) != 0)
        fiber_fail(fmt("%s: mask 0x%08x of %s names lanes that do not exist (this warp has %d lanes)",
                       waits(f).c_str(), mask, where(w, f).c_str(), nlanes));
    if (op <= SHFL_XOR && (width < 1 || width > 32 || (width & (width - 1)) != 0))
        fiber_fail(fmt("%s: width %d is not a power of two in [1, 32] (%s)", waits(f).c_str(), width,
                       where(w, f).c_str()));
    bool complete = true;
    for (int l = 0; l < nlanes; ++l) {
        if (!((mask >> l) & 1u) || l == lane) continue;
        Fiber& g = lanes[l];
        if (g.state == DONE)
            fiber_fail(fmt("%s, %s: lane %d, named in the mask, has already returned",
                           waits(f).c_str(), where(w, f).c_str(), l));
        if (g.state != AT_WARP) {
            complete = false;
            continue;
        }
        const bool same = g.op == op && g.mask == mask &&
                          (op == SYNCWARP || (g.line == line && strcmp(g.file, file) == 0));
        if (!same)
            fiber_fail(fmt("mismatched warp collective: %s waits at %s while %s waits at %s",
                           where(w, &g).c_str(), waits(&g).c_str(), where(w, f).c_str(), waits(f).c_str()));
    }
    if (complete) resolve_warp(w, lanes, nlanes, mask);
    yield(w, f);
    const unsigned long long result = f->result;
    EMU_TRACING(1);
    return result;
}

// A fiber returned from the kernel (called on the fiber).
static void thread_exit(Worker* w, Fiber* f) {
    f->state = DONE;
    --w->live;
    const int lane = f->lin & 31;
    const int base = f->lin - lane;
    const int nlanes = std::min(32, w->nthreads - base);
    for (int l = 0; l < nlanes; ++l) {
        Fiber& g = w->fibers[base + l];
        if (g.state == AT_WARP && ((g.mask >> lane) & 1u))
            fiber_fail(fmt("%s waits at %s, but lane %d (%s), named in the mask, returned",
                           where(w, &g).c_str(), waits(&g).c_str(), lane, where(w, f).c_str()));
    }
    if (w->at_barrier > 0 && w->at_barrier == w->live) release_barrier(w);
}

static void fiber_main() {
    Worker* w = t_worker;
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(nullptr, &w->sched_stack_bottom, &w->sched_stack_size);
#endif
    for (;;) {
        Fiber* f = t_fiber;
        EMU_TRACING(1);
        w->L->thunk(w->L->ctx);
        EMU_TRACING(0);
        thread_exit(w, f);
        yield(w, f);   // resumed again for the next block
    }
}

// ---- blocks ----------------------------------------------------------------------------------------------
// Nothing is READY but threads still wait: describe the deadlock with the lines involved.
static std::string describe_stall(Worker* w) {
    Fiber* bar = nullptr;
    for (Fiber& f : w->fibers)
        if (f.state == AT_BARRIER) { bar = &f; break; }
    for (Fiber& f : w->fibers) {
        if (f.state != AT_WARP) continue;
        const int lane = f.lin & 31, base = f.lin - lane;
        const int nlanes = std::min(32, w->nthreads - base);
        for (int l = 0; l < nlanes; ++l) {
            Fiber& g = w->fibers[base + l];
            if (((f.mask >> l) & 1u) && g.state != AT_WARP)
                return fmt("deadlock: %s waits at %s for lane %d, while %s %s", where(w, &f).c_str(),
                           waits(&f).c_str(), l, where(w, &g).c_str(),
                           g.state == AT_BARRIER ? ("waits at " + waits(&g)).c_str() : waits(&g).c_str());
        }
        if (bar)
            return fmt("deadlock: %s waits at %s while %s waits at %s", where(w, bar).c_str(),
                       waits(bar).c_str(), where(w, &f).c_str(), waits(&f).c_str());
    }
    return bar ? fmt("deadlock: %s waits at %s", where(w, bar).c_str(), waits(bar).c_str())
               : std::string("deadlock in the emulator (no thread can run)");
}

static void shuffle_order(Worker* w) {
    for (int i = w->nthreads - 1; i > 0; --i) std::swap(w->order[i], w->order[splitmix(w->rng) % (i + 1)]);
}

// One scheduling pass of the forward / reverse / shuffle orders: every READY fiber, in the block's
// order, runs to its next barrier or collective. Returns whether any ran (stops at a failure).
static bool pass_in_order(Worker* w) {
    bool progressed = false;
    for (int k = 0; k < w->nthreads && !w->failed; ++k) {
        Fiber* f = &w->fibers[w->order[k]];
        if (f->state != READY) continue;
        resume(w, f);
        progressed = true;
    }
    return progressed;
}

// One pass of the "warps" orders: warp 0 (the last warp, reversed) runs until none of its threads
// can go on (all wait at a block barrier or have returned), then the next warp; a released block
// barrier ends the pass, so that the next one starts from the first warp again.
static bool pass_by_warps(Worker* w) {
    const int nwarps = (w->nthreads + 31) / 32;
    const unsigned long long releases = w->releases;
    bool progressed = false;
    for (int i = 0; i < nwarps && w->releases == releases; ++i) {
        const int warp = w->L->order == 4 ? nwarps - 1 - i : i;
        const int end = std::min(w->nthreads, 32 * warp + 32);
        for (bool again = true; again && w->releases == releases;) {
            again = false;
            for (int t = 32 * warp; t < end && !w->failed; ++t) {
                Fiber* f = &w->fibers[t];
                if (f->state != READY) continue;
                resume(w, f);
                progressed = again = true;
            }
            if (w->failed) return progressed;
        }
    }
    return progressed;
}

static bool run_block(Worker* w, unsigned long long b) {
    Launch* L = w->L;
    const unsigned long long gx = L->grid.x, gy = L->grid.y;
    w->block = uint3{(unsigned)(b % gx), (unsigned)((b / gx) % gy), (unsigned)(b / (gx * gy))};
    t_blockIdx = w->block;
    for (Fiber& f : w->fibers) f.state = READY;
    w->live = w->nthreads;
    w->at_barrier = 0;
    for (int i = 0; i < w->nthreads; ++i) w->order[i] = L->order == 1 ? w->nthreads - 1 - i : i;
    if (L->order == 2) {
        w->rng = L->seed ^ (b * 0xd1b54a32d192ed03ull);
        shuffle_order(w);
    }
    for (;;) {
        const bool progressed = L->order >= 3 ? pass_by_warps(w) : pass_in_order(w);
        if (w->failed) return false;
        if (w->live == 0) return true;
        if (!progressed) {   // fibers wait, and none can go on
            w->failed = true;
            w->error = describe_stall(w);
            return false;
        }
        if (L->abort.load(std::memory_order_relaxed)) return false;
        if (L->order == 2) shuffle_order(w);
    }
}

static void set_ftz(bool on) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned csr = __builtin_ia32_stmxcsr();
    csr = on ? (csr | 0x8040u) : (csr & ~0x8040u);
    __builtin_ia32_ldmxcsr(csr);
#else
    (void)on;
#endif
}

// A GPU block's shared memory starts with whatever was there; here static __shared__ arrays are
// this library's thread_local storage, which a fresh worker thread would see zeroed, so a kernel
// that reads shared memory it never wrote would pass by luck. Fill the calling thread's block of
// this library's thread-local storage (every static __shared__ array, and the emulator's own
// thread_locals, which are all set afterwards and have no initializers) with all-ones bytes: NaN
// floats, -1 integers, as dynamic shared memory gets.
struct TlsBlock {
    uintptr_t inside;   // an address of this library's code
    void* data = nullptr;
    size_t size = 0;
    uintptr_t base = 0;  // the library's load address
};

static int find_own_tls(struct dl_phdr_info* info, size_t, void* arg) {
    TlsBlock* tls = static_cast<TlsBlock*>(arg);
    bool own = false;
    size_t tls_size = 0;
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        const uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
        if (ph.p_type == PT_LOAD && tls->inside >= lo && tls->inside < lo + ph.p_memsz) own = true;
        if (ph.p_type == PT_TLS) tls_size = ph.p_memsz;
    }
    if (!own) return 0;
    tls->data = info->dlpi_tls_data;
    tls->size = tls_size;
    tls->base = info->dlpi_addr;
    return 1;
}

static void poison_static_shared() {
    // touch this library's thread-local storage first, so that the thread's block of it exists
    *static_cast<Fiber* volatile*>(&t_fiber) = nullptr;
    TlsBlock tls{reinterpret_cast<uintptr_t>(&find_own_tls)};
    dl_iterate_phdr(find_own_tls, &tls);
    if (tls.data && tls.size) memset(tls.data, 0xff, tls.size);
    t_fiber = nullptr;
    t_tracing = 0;
    t_tls_lo = tls.data;
    t_tls_size = tls.data ? tls.size : 0;
}

static void worker_main(Launch* L) {
    set_ftz(L->ftz != 0);
    poison_static_shared();
    Worker w;
    w.L = L;
    w.nthreads = (int)(L->block.x * L->block.y * L->block.z);
    w.fibers.resize(w.nthreads);
    w.order.resize(w.nthreads);
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t slot = kStackSize + page;
    w.map_size = slot * w.nthreads;
    void* map = mmap(nullptr, w.map_size, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (map == MAP_FAILED) {
        L->fail("cuda_emu: cannot allocate fiber stacks");
        return;
    }
    w.map = static_cast<char*>(map);
    std::vector<unsigned char> dyn(L->smem ? L->smem : 1, 0xff);   // uninitialised: all-ones bits
    t_worker = &w;
    t_dyn_smem = dyn.data();
    t_blockDim = L->block;
    t_gridDim = L->grid;
    for (int i = 0; i < w.nthreads; ++i) {
        Fiber& f = w.fibers[i];
        char* lo = w.map + slot * i;
        mprotect(lo, page, PROT_NONE);   // guard page below the stack
        f.stack = lo + page;
        f.stack_size = kStackSize;
        f.lin = i;
        f.tid = uint3{(unsigned)(i % L->block.x), (unsigned)((i / L->block.x) % L->block.y),
                      (unsigned)(i / (L->block.x * L->block.y))};
        getcontext(&f.uc);
        f.uc.uc_stack.ss_sp = f.stack;
        f.uc.uc_stack.ss_size = f.stack_size;
        f.uc.uc_link = nullptr;
        makecontext(&f.uc, fiber_main, 0);
    }
    while (!L->abort.load(std::memory_order_relaxed)) {
        const unsigned long long k = L->next.fetch_add(1);
        if (k >= L->nblocks) break;
        unsigned long long b = k;
        if (L->order == 1 || L->order == 4) b = L->nblocks - 1 - k;
        if (L->order == 2) b = (unsigned long long)(((unsigned __int128)L->perm_a * k + L->perm_c) % L->nblocks);
        if (!run_block(&w, b)) {
            if (w.failed) L->fail(w.error);
            break;
        }
    }
#if defined(__SANITIZE_ADDRESS__)
    ASAN_UNPOISON_MEMORY_REGION(w.map, w.map_size);
#endif
    munmap(w.map, w.map_size);
    t_worker = nullptr;
    t_fiber = nullptr;
    t_dyn_smem = nullptr;
}

static unsigned long long gcd(unsigned long long a, unsigned long long b) {
    while (b) { unsigned long long t = a % b; a = b; b = t; }
    return a;
}

static int run_grid(const unsigned* grid, const unsigned* block, size_t smem, int order,
                    unsigned long long seed, int workers, int ftz, void (*thunk)(void*), void* ctx,
                    char* err, size_t errlen) {
    Launch L;
    L.grid = dim3(grid[0], grid[1], grid[2]);
    L.block = dim3(block[0], block[1], block[2]);
    L.smem = smem;
    L.order = order;
    L.seed = seed;
    L.ftz = ftz;
    L.thunk = thunk;
    L.ctx = ctx;
    L.nblocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    if (order == 2 && L.nblocks > 1) {   // block order: k -> (a k + c) mod n with gcd(a, n) = 1
        unsigned long long s = seed ^ 0x5bd1e995ull;
        do { L.perm_a = 1 + splitmix(s) % (L.nblocks - 1); } while (gcd(L.perm_a, L.nblocks) != 1);
        L.perm_c = splitmix(s) % L.nblocks;
    }
    const int n = (int)std::max<unsigned long long>(1, std::min<unsigned long long>((unsigned long long)workers, L.nblocks));
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i) threads.emplace_back(worker_main, &L);
    for (auto& t : threads) t.join();
    fflush(stdout);   // kernel printf output appears when the launch ends, as after a CUDA sync
    if (L.error.empty()) return 0;
    snprintf(err, errlen, "%s", L.error.c_str());
    return 1;
}

// ---- kernel entry points ----------------------------------------------------------------------------------
struct KernelInfo {
    int nparams;
    const size_t* sizes;
    int (*launch)(const void* fn, void** args, const unsigned* grid, const unsigned* block, size_t smem,
                  int order, unsigned long long seed, int workers, int ftz, char* err, size_t errlen);
    const void* fn;
};

template <class T> static T load_arg(void* p) {
    static_assert(std::is_trivially_copyable<T>::value, "kernel parameters must be trivially copyable");
    alignas(T) unsigned char buf[sizeof(T)];
    memcpy(buf, p, sizeof(T));
    return *reinterpret_cast<T*>(buf);
}

template <class... A> struct Call {
    void (*fn)(A...);
    std::tuple<A...> args;
    static void run(void* p) {
        Call* c = static_cast<Call*>(p);
        std::apply(c->fn, c->args);
    }
};

template <class... A, size_t... I>
static std::tuple<A...> load_args(void** args, std::index_sequence<I...>) {
    return std::tuple<A...>(load_arg<A>(args[I])...);
}

template <class... A>
static int launch_impl(const void* fn, void** args, const unsigned* grid, const unsigned* block, size_t smem,
                       int order, unsigned long long seed, int workers, int ftz, char* err, size_t errlen) {
    Call<A...> call{reinterpret_cast<void (*)(A...)>(const_cast<void*>(fn)),
                    load_args<A...>(args, std::index_sequence_for<A...>{})};
    return run_grid(grid, block, smem, order, seed, workers, ftz, &Call<A...>::run, &call, err, errlen);
}

template <class... A> static KernelInfo make_kernel_info(void (*fn)(A...)) {
    static const size_t sizes[] = {sizeof(A)..., 0};
    return KernelInfo{(int)sizeof...(A), sizes, &launch_impl<A...>, reinterpret_cast<const void*>(fn)};
}

}  // namespace emu

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))
EMU_EXPORT int cg_emu_abi_version() { return 1; }
EMU_EXPORT int cg_emu_nparams(const emu::KernelInfo* k) { return k->nparams; }
EMU_EXPORT size_t cg_emu_param_size(const emu::KernelInfo* k, int i) { return k->sizes[i]; }
EMU_EXPORT int cg_emu_launch(const emu::KernelInfo* k, void** args, const unsigned* grid, const unsigned* block,
                             size_t smem, int order, unsigned long long seed, int workers, int ftz,
                             char* err, size_t errlen) {
    return k->launch(k->fn, args, grid, block, smem, order, seed, workers, ftz, err, errlen);
}

#if defined(CUGROUPED_EMULATE_TRACE)
#include "emu_trace.cpp"
#endif
