// cugrouped/emulate/emu_trace.cpp -- memory access tracing of emulated kernels (trace builds).
//
// Included at the end of emu_runtime.cpp when CUGROUPED_EMULATE_TRACE is defined. Such a library
// is compiled with `-fsanitize=thread`, but linked without ThreadSanitizer's runtime: the
// compiler's instrumentation calls __tsan_read4(addr), __tsan_write16(addr), __tsan_atomic32_...
// before every load, store and atomic, and this file defines those functions. While kernel code
// runs on a fiber (t_tracing == 1, kept by emu_runtime.cpp), each access to global or shared
// memory is appended to a buffer the caller owns: the call site (a return address), the address,
// the size, the block and the thread. Accesses to the fiber's own stack (what a GPU keeps in
// registers or local memory) and to the emulator's thread_locals (threadIdx, ...) are not
// recorded. cugrouped/emulate/access.py groups the records into warp requests and counts the
// 32-byte sectors (global) and bank wavefronts (shared) each one takes.
//
// The functions here must not be instrumented themselves (they would call themselves):
// no_sanitize_thread on each, and nothing from the C++ library that could be instrumented.

namespace emu {

struct TraceRecord {
    unsigned long long pc;     // return address of the instrumentation call (in the kernel's code)
    unsigned long long addr;
    unsigned block;            // linear block index (x fastest)
    unsigned short thread;     // linear thread index in the block
    unsigned short size;       // bytes
    unsigned char kind;        // 0 load, 1 store, 2 atomic
    unsigned char space;       // 0 global, 1 shared
    unsigned char pad[6];
};
static_assert(sizeof(TraceRecord) == 32, "TraceRecord must match access.py's RECORD dtype");

static TraceRecord* g_trace_buf;          // owned by the caller (cg_emu_trace_begin)
static unsigned long long g_trace_cap, g_trace_len, g_trace_lost;

#define EMU_UNTRACED __attribute__((no_sanitize_thread, noinline))

// The emulator's own thread_locals: kernel code reads threadIdx & co. through them, and they live
// in the same TLS block as static __shared__ arrays, so they are told apart by address.
static __attribute__((always_inline, no_sanitize_thread)) inline bool emulator_tls(uintptr_t a) {
    const void* own[] = {&t_threadIdx, &t_blockIdx, &t_blockDim, &t_gridDim, &t_dyn_smem, &t_worker,
                         &t_fiber, &t_tracing, &t_tls_lo, &t_tls_size};
    const size_t sizes[] = {sizeof t_threadIdx, sizeof t_blockIdx, sizeof t_blockDim, sizeof t_gridDim,
                            sizeof t_dyn_smem, sizeof t_worker, sizeof t_fiber, sizeof t_tracing,
                            sizeof t_tls_lo, sizeof t_tls_size};
    for (int i = 0; i < 10; ++i)
        if (a - reinterpret_cast<uintptr_t>(own[i]) < sizes[i]) return true;
    return false;
}

static __attribute__((always_inline, no_sanitize_thread)) inline void trace(void* pc, const volatile void* p,
                                                                            size_t size, int kind) {
    if (t_tracing != 1) return;
    const Fiber* f = t_fiber;
    const Worker* w = t_worker;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (a - reinterpret_cast<uintptr_t>(f->stack) < f->stack_size) return;   // a local
    int space = 0;
    if (a - reinterpret_cast<uintptr_t>(t_dyn_smem) < w->L->smem) {
        space = 1;
    } else if (a - reinterpret_cast<uintptr_t>(t_tls_lo) < t_tls_size) {
        if (emulator_tls(a)) return;
        space = 1;                                                               // static __shared__
    }
    if (g_trace_len >= g_trace_cap) {
        ++g_trace_lost;
        return;
    }
    TraceRecord& r = g_trace_buf[g_trace_len++];
    r.pc = reinterpret_cast<uintptr_t>(pc);
    r.addr = a;
    r.block = (unsigned)(w->block.x + w->L->grid.x * (w->block.y + w->L->grid.y * w->block.z));
    r.thread = (unsigned short)f->lin;
    r.size = (unsigned short)(size < 0xffff ? size : 0xffff);
    r.kind = (unsigned char)kind;
    r.space = (unsigned char)space;
}

}  // namespace emu

#define EMU_RA __builtin_return_address(0)
extern "C" {
EMU_UNTRACED void __tsan_init() {}
EMU_UNTRACED void __tsan_func_entry(void*) {}
EMU_UNTRACED void __tsan_func_exit() {}
EMU_UNTRACED void __tsan_vptr_update(void**, void*) {}
EMU_UNTRACED void __tsan_vptr_read(void**) {}
EMU_UNTRACED void __tsan_read_range(void* p, unsigned long n) { emu::trace(EMU_RA, p, n, 0); }
EMU_UNTRACED void __tsan_write_range(void* p, unsigned long n) { emu::trace(EMU_RA, p, n, 1); }
#define EMU_RW(N)                                                                                    \
    EMU_UNTRACED void __tsan_read##N(void* p) { emu::trace(EMU_RA, p, N, 0); }                      \
    EMU_UNTRACED void __tsan_write##N(void* p) { emu::trace(EMU_RA, p, N, 1); }                     \
    EMU_UNTRACED void __tsan_unaligned_read##N(void* p) { emu::trace(EMU_RA, p, N, 0); }            \
    EMU_UNTRACED void __tsan_unaligned_write##N(void* p) { emu::trace(EMU_RA, p, N, 1); }
EMU_RW(1) EMU_RW(2) EMU_RW(4) EMU_RW(8) EMU_RW(16)
#undef EMU_RW

// Atomics: the real operation (sequentially consistent, whatever order was asked for: stronger is
// always correct), recorded as one access of kind 2.
#define EMU_RMW(N, T, NAME, BUILTIN)                                                                 \
    EMU_UNTRACED T __tsan_atomic##N##_##NAME(volatile T* a, T v, int) {                            \
        emu::trace(EMU_RA, a, sizeof(T), 2);                                                         \
        return BUILTIN(a, v, __ATOMIC_SEQ_CST);                                                      \
    }
#define EMU_CAS(N, T, NAME)                                                                          \
    EMU_UNTRACED int __tsan_atomic##N##_compare_exchange_##NAME(volatile T* a, T* c, T v, int, int) { \
        emu::trace(EMU_RA, a, sizeof(T), 2);                                                         \
        return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);     \
    }
#define EMU_ATOMIC(N, T)                                                                             \
    EMU_UNTRACED T __tsan_atomic##N##_load(const volatile T* a, int) {                             \
        emu::trace(EMU_RA, a, sizeof(T), 2);                                                         \
        return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                 \
    }                                                                                                \
    EMU_UNTRACED void __tsan_atomic##N##_store(volatile T* a, T v, int) {                          \
        emu::trace(EMU_RA, a, sizeof(T), 2);                                                         \
        __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                    \
    }                                                                                                \
    EMU_RMW(N, T, exchange, __atomic_exchange_n) EMU_RMW(N, T, fetch_add, __atomic_fetch_add)        \
    EMU_RMW(N, T, fetch_sub, __atomic_fetch_sub) EMU_RMW(N, T, fetch_and, __atomic_fetch_and)        \
    EMU_RMW(N, T, fetch_or, __atomic_fetch_or) EMU_RMW(N, T, fetch_xor, __atomic_fetch_xor)          \
    EMU_RMW(N, T, fetch_nand, __atomic_fetch_nand)                                                   \
    EMU_CAS(N, T, strong) EMU_CAS(N, T, weak)                                                        \
    EMU_UNTRACED T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {    \
        emu::trace(EMU_RA, a, sizeof(T), 2);                                                         \
        __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);            \
        return c;                                                                                    \
    }
EMU_ATOMIC(8, char) EMU_ATOMIC(16, short) EMU_ATOMIC(32, int) EMU_ATOMIC(64, long long)
#undef EMU_ATOMIC
#undef EMU_CAS
#undef EMU_RMW
EMU_UNTRACED void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
EMU_UNTRACED void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
}  // extern "C"
#undef EMU_RA

EMU_EXPORT EMU_UNTRACED void cg_emu_trace_begin(emu::TraceRecord* buf, unsigned long long cap) {
    emu::g_trace_buf = buf;
    emu::g_trace_cap = cap;
    emu::g_trace_len = emu::g_trace_lost = 0;
}
// Records written since cg_emu_trace_begin; *lost: those that did not fit.
EMU_EXPORT EMU_UNTRACED unsigned long long cg_emu_trace_end(unsigned long long* lost) {
    *lost = emu::g_trace_lost;
    emu::g_trace_buf = nullptr;
    emu::g_trace_cap = 0;
    return emu::g_trace_len;
}
// The load address of this library (record pcs minus it: offsets for addr2line).
EMU_EXPORT EMU_UNTRACED unsigned long long cg_emu_trace_base() {
    emu::TlsBlock own{reinterpret_cast<uintptr_t>(&emu::find_own_tls)};
    dl_iterate_phdr(emu::find_own_tls, &own);
    return own.base;
}
