// kf_emu runtime: fibers, the block scheduler, barriers, warp rendezvous and the emulations of the
// warp-collective PTX instructions (mma.sync, ldmatrix) and of cp.async. See kf_emu.h.
#include "kf_emu.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__x86_64__) && !defined(KF_EMU_FORCE_UCONTEXT)
#include <xmmintrin.h>
#else
#include <ucontext.h>
#define KF_EMU_UCONTEXT 1  // portable fallback (slower: swapcontext saves the signal mask); no FTZ
#endif

#if !defined(KF_EMU_UCONTEXT)
// ---------------------------------------------------------------------------------------------------
// Context switch (System V x86-64): save the callee-saved registers, MXCSR and the x87 control word on
// the current stack, store the stack pointer to *save_sp, load load_sp and restore the same from it.
// A new fiber's stack is laid out so that the first switch "returns" into kf_emu_fiber_trampoline
// with r12 = the fiber and r13 = its entry function.
extern "C" void kf_emu_swap_ctx(void** save_sp, void* load_sp);
extern "C" void kf_emu_fiber_trampoline();
asm(R"(
    .text
    .p2align 4
    .globl kf_emu_swap_ctx
    .hidden kf_emu_swap_ctx
    .type kf_emu_swap_ctx,@function
kf_emu_swap_ctx:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kf_emu_swap_ctx, .-kf_emu_swap_ctx

    .p2align 4
    .globl kf_emu_fiber_trampoline
    .hidden kf_emu_fiber_trampoline
    .type kf_emu_fiber_trampoline,@function
kf_emu_fiber_trampoline:
    movq %r12, %rdi
    call *%r13
    ud2
    .size kf_emu_fiber_trampoline, .-kf_emu_fiber_trampoline
)");
#endif

namespace kf_emu {

namespace {
Config config_from_env() {
  Config c;
  auto env = [](const char* name) -> const char* {
    const char* v = std::getenv(name);
    return v && *v ? v : nullptr;
  };
  if (const char* v = env("KF_EMU_THREADS")) c.workers = std::atoi(v);
  if (const char* v = env("KF_EMU_STACK_KB")) {
    if (std::atol(v) > 0) c.stack_bytes = static_cast<size_t>(std::atol(v)) * 1024;
  }
  if (const char* v = env("KF_EMU_FTZ")) c.ftz = std::atoi(v) != 0;
  if (const char* v = env("KF_EMU_SCHEDULE")) {  // forward | reverse | random[:seed], optionally +greedy
    const std::string s = v;
    c.schedule = s.rfind("reverse", 0) == 0 ? 1 : (s.rfind("random", 0) == 0 ? 2 : 0);
    const size_t colon = s.find(':');
    if (colon != std::string::npos) c.seed = std::strtoull(s.c_str() + colon + 1, nullptr, 10);
    c.warp_greedy = s.find("greedy") != std::string::npos;
  }
  return c;
}
}  // namespace

Config& config() {
  static Config c = config_from_env();
  return c;
}

namespace detail {

thread_local Cur t_cur;

namespace {

enum State : int { kReady = 0, kWaitBar, kWaitWarp, kWaitMbar, kWaitNamed, kWaitCluster, kDone };

const char* op_name(int op) {
  switch (op) {
    case kOpSyncwarp: return "__syncwarp";
    case kOpShfl: return "shfl.sync";
    case kOpVote: return "vote.sync";
    case kOpMmaBf16: return "mma.sync.m16n8k16.bf16";
    case kOpMmaF16: return "mma.sync.m16n8k16.f16";
    case kOpMmaTf32: return "mma.sync.m16n8k8.tf32";
    case kOpLdsmX4: return "ldmatrix.x4";
    case kOpLdsmX4T: return "ldmatrix.x4.trans";
  }
  return "?";
}

struct Copy {
  char* dst;
  const char* src;
  int size;
  int src_size;
};

// One bulk asynchronous copy (cp.async.bulk, 1-D, or cp.async.bulk.tensor through a tensor map) in
// flight on an mbarrier: performed when a thread waits on that barrier (kf_emu.h).
struct AsyncCopy {
  char* smem;                  // the issuing CTA's shared memory (the destination's base)
  char* dst;
  uint32_t bytes;
  const char* src;             // 1-D copies
  bool tensor;
  kf_emu::TensorMapDesc desc;  // tensor copies: the map (a copy) and the box's first coordinates
  int32_t coords[5];
};

// An mbarrier's state, kept beside its 8 bytes of shared memory (keyed by the smem offset).
struct Mbar {
  int count = 0;         // arrivals per phase (mbarrier.init)
  int pending = 0;       // arrivals still missing in the current phase
  int64_t tx = 0;        // transaction bytes still expected in the current phase
  uint32_t phase = 0;    // completed phases
  std::vector<AsyncCopy> copies;  // in flight, completing tx on this barrier
};

struct NamedBar {  // bar.sync / bar.arrive id, count
  int count = 0, arrived = 0;
};

// One wgmma.mma_async in flight (kf_emu.h, wgmma_rs_m64k16): performed at the wgmma.wait_group
// that completes its commit group.
struct Wgmma {
  int op;                 // kOpMmaBf16 / kOpMmaF16
  float* d;               // the accumulator registers (N / 2 floats of the calling thread)
  int N;
  const uint32_t* a_src;  // the A registers, checked unchanged at the wait
  uint32_t a[4];          // their values at the issue (what is multiplied)
  uint64_t desc;
  uint64_t desc_a;        // ss: A's descriptor (A from shared memory, read at the wait)
  bool ss;
  bool trans_b, acc;
  bool chained;           // an earlier operation in flight owns d: C is that operation's result
  float c[128];           // d at the issue (acc, not chained): C
};

struct Worker;

struct Fiber {
#ifdef KF_EMU_UCONTEXT
  ucontext_t ctx;
#else
  void* sp = nullptr;
#endif
  int state = kDone;
  uint3 tid{};
  int lane = 0, warp = 0;
  int cta = 0;                            // its CTA's index in the cluster (Worker::ctas)
  std::vector<Copy> open;                 // issued cp.async not yet committed
  std::deque<std::vector<Copy>> groups;   // committed groups, oldest first
  std::vector<Wgmma> wg_open;             // issued wgmma not yet committed
  std::deque<std::vector<Wgmma>> wg_groups;  // committed wgmma groups, oldest first
  bool wg_fenced = false;                 // a wgmma.fence since the last wgmma.wait_group
  const void* wait_obj = nullptr;         // kWaitMbar: the mbarrier; kWaitNamed: unused
  int wait_arg = 0;                       // kWaitMbar: the phase parity; kWaitNamed: the barrier id
  uint32_t cl_arrived = 0;                // barrier.cluster: the phase this thread last arrived in, + 1
  char* stack_lo = nullptr;
  Worker* worker = nullptr;
};

struct Warp {
  uint32_t live = 0;     // lanes that have not exited
  uint32_t arrived = 0;  // lanes waiting in the pending collective
  uint32_t mask = 0;     // its member mask
  int op = -1;
  Slot slot[32];
};

constexpr size_t kGuard = 256;  // canary bytes on each side of the dynamic smem
constexpr unsigned char kCanaryByte = 0xA5;

void fiber_main(Fiber* f);

// One CTA's state: its shared memory (with canaries), __syncthreads count, mbarriers, named
// barriers and warps. A launch without clusters has one per worker; a cluster launch has one per
// CTA of the cluster, all scheduled together (their threads interleave, as on neighbouring SMs).
struct Cta {
  uint3 bid{};
  int rank = 0;               // %cluster_ctarank (x fastest)
  int f0 = 0;                 // its first fiber in Worker::fibers
  unsigned char* smem_buf = nullptr;
  char* smem = nullptr;
  int live = 0, bar_arrived = 0;
  bool exited = false;        // every thread has exited: its shared memory is gone (poisoned)
  std::unordered_map<uint32_t, Mbar> mbars;  // by smem offset; cleared at every block start
  NamedBar named[16];
  std::vector<Warp> warps;
};

struct Worker {
  size_t stack_bytes = 0, page = 0;
  char* stacks = nullptr;
  size_t stacks_len = 0;
  std::vector<Fiber> fibers;  // ctas.size() x nthreads, CTA after CTA
  std::vector<Cta> ctas;
  int nthreads = 0;           // per CTA
  int live = 0;               // over the cluster
  dim3 bdim, gdim, cdim{1, 1, 1};
  size_t smem_bytes = 0;      // per CTA
  uint32_t cl_phase = 0;      // barrier.cluster: completed phases
  int cl_arrived = 0;         // arrivals in the current phase
  Fiber* cur = nullptr;
  bool in_fiber = false;
#ifdef KF_EMU_UCONTEXT
  ucontext_t sched;
#else
  void* sched_sp = nullptr;
  uint32_t csr = 0;  // MXCSR | x87 control word << 32 for new fibers
  uint32_t fpucw = 0;
#endif
  const KernelRef* kernel = nullptr;
  std::string error;

  Worker(dim3 block, dim3 cluster, size_t smem_size, const KernelRef* k) : bdim(block), cdim(cluster), kernel(k) {
    nthreads = static_cast<int>(block.x * block.y * block.z);
    const int ncta = static_cast<int>(cluster.x * cluster.y * cluster.z);
    page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    stack_bytes = (std::max<size_t>(config().stack_bytes, 64 * 1024) + page - 1) / page * page;
    const int nfib = ncta * nthreads;
    stacks_len = static_cast<size_t>(nfib) * (stack_bytes + page);
    void* m = mmap(nullptr, stacks_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("kf_emu: cannot map fiber stacks");
    stacks = static_cast<char*>(m);
    fibers.resize(nfib);
    for (int i = 0; i < nfib; ++i) {
      char* region = stacks + static_cast<size_t>(i) * (stack_bytes + page);
      mprotect(region, page, PROT_NONE);  // guard page below the stack: an overflow faults
      fibers[i].stack_lo = region + page;
      fibers[i].worker = this;
      fibers[i].cta = i / nthreads;
    }
    smem_bytes = smem_size;
    const size_t total = (kGuard * 2 + smem_bytes + 255) / 256 * 256;
    ctas.resize(ncta);
    for (int r = 0; r < ncta; ++r) {
      Cta& c = ctas[r];
      c.rank = r;
      c.f0 = r * nthreads;
      c.warps.resize((nthreads + 31) / 32);
      c.smem_buf = static_cast<unsigned char*>(std::aligned_alloc(256, total));
      if (!c.smem_buf) throw std::runtime_error("kf_emu: cannot allocate shared memory");
      c.smem = reinterpret_cast<char*>(c.smem_buf + kGuard);
    }
#ifndef KF_EMU_UCONTEXT
    csr = _mm_getcsr();
    if (config().ftz) csr |= 0x8040u;  // FTZ | DAZ
    uint16_t cw;
    asm volatile("fnstcw %0" : "=m"(cw));
    fpucw = cw;
#endif
  }
  ~Worker() {
    if (stacks) munmap(stacks, stacks_len);
    for (Cta& c : ctas) std::free(c.smem_buf);
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  Cta& cta_of(const Fiber& f) { return ctas[f.cta]; }
  const Cta& cta_of(const Fiber& f) const { return ctas[f.cta]; }
  Fiber& fiber(const Cta& c, int i) { return fibers[c.f0 + i]; }

  void init_fiber(Fiber& f) {
#ifdef KF_EMU_UCONTEXT
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack_lo;
    f.ctx.uc_stack.ss_size = stack_bytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, reinterpret_cast<void (*)()>(&fiber_entry_uc), 2,
                static_cast<unsigned>(reinterpret_cast<uintptr_t>(&f) & 0xffffffffu),
                static_cast<unsigned>(reinterpret_cast<uintptr_t>(&f) >> 32));
#else
    char* top = f.stack_lo + stack_bytes;
    top = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15));
    uint64_t* sp = reinterpret_cast<uint64_t*>(top - 80);  // after the final `ret`, rsp = top - 16
    sp[0] = static_cast<uint64_t>(csr) | (static_cast<uint64_t>(fpucw) << 32);
    sp[1] = 0;                                                  // r15
    sp[2] = 0;                                                  // r14
    sp[3] = reinterpret_cast<uint64_t>(&fiber_main);            // r13: entry
    sp[4] = reinterpret_cast<uint64_t>(&f);                     // r12: argument
    sp[5] = 0;                                                  // rbx
    sp[6] = 0;                                                  // rbp
    sp[7] = reinterpret_cast<uint64_t>(&kf_emu_fiber_trampoline);  // return address
    f.sp = sp;
#endif
  }
#ifdef KF_EMU_UCONTEXT
  static void fiber_entry_uc(unsigned lo, unsigned hi) {
    fiber_main(reinterpret_cast<Fiber*>((static_cast<uintptr_t>(hi) << 32) | lo));
  }
#endif

  void resume(Fiber& f) {
    cur = &f;
    t_cur.tid = f.tid;
    t_cur.bid = cta_of(f).bid;
    in_fiber = true;
#ifdef KF_EMU_UCONTEXT
    swapcontext(&sched, &f.ctx);
#else
    kf_emu_swap_ctx(&sched_sp, f.sp);
#endif
    in_fiber = false;
    cur = nullptr;
  }
  void yield(Fiber& f) {
#ifdef KF_EMU_UCONTEXT
    swapcontext(&f.ctx, &sched);
#else
    kf_emu_swap_ctx(&f.sp, sched_sp);
#endif
  }

  std::string where(const Fiber* f, const Cta* c = nullptr) const {
    char buf[200];
    if (f) c = &cta_of(*f);
    if (!c) c = &ctas[0];
    const int n = std::snprintf(buf, sizeof buf, "block (%u,%u,%u)", c->bid.x, c->bid.y, c->bid.z);
    if (ctas.size() > 1) std::snprintf(buf + n, sizeof buf - n, " [cluster rank %d]", c->rank);
    std::string s = buf;
    if (f) {
      std::snprintf(buf, sizeof buf, " thread (%u,%u,%u) [warp %d lane %d]", f->tid.x, f->tid.y, f->tid.z, f->warp,
                    f->lane);
      s += buf;
    }
    return s;
  }

  // One cluster (one CTA without clusters) whose first CTA is `origin`: its CTAs are origin +
  // (x, y, z) for (x, y, z) < cdim, rank x + cdim.x (y + cdim.y z).
  void run_cluster(uint3 origin) {
    t_cur.bdim = bdim;
    t_cur.gdim = gdim;
    live = 0;
    cl_phase = 0;
    cl_arrived = 0;
    for (Cta& c : ctas) {
      const unsigned r = static_cast<unsigned>(c.rank);
      c.bid = uint3{origin.x + r % cdim.x, origin.y + (r / cdim.x) % cdim.y, origin.z + r / (cdim.x * cdim.y)};
      std::memset(c.smem_buf, kCanaryByte, kGuard);
      std::memset(c.smem + smem_bytes, kCanaryByte, kGuard);
      std::memset(c.smem, config().poison_smem ? 0xFF : 0x00, smem_bytes);
      c.live = nthreads;
      c.bar_arrived = 0;
      c.exited = false;
      c.mbars.clear();
      for (NamedBar& nb : c.named) nb = NamedBar{};
      for (size_t w = 0; w < c.warps.size(); ++w) {
        const int n = std::min(32, nthreads - static_cast<int>(w) * 32);
        c.warps[w].live = n == 32 ? 0xffffffffu : ((1u << n) - 1u);
        c.warps[w].arrived = 0;
        c.warps[w].mask = 0;
        c.warps[w].op = -1;
      }
      for (int i = 0; i < nthreads; ++i) {
        Fiber& f = fiber(c, i);
        f.tid = uint3{static_cast<unsigned>(i) % bdim.x, (static_cast<unsigned>(i) / bdim.x) % bdim.y,
                      static_cast<unsigned>(i) / (bdim.x * bdim.y)};
        f.warp = i / 32;
        f.lane = i % 32;
        f.state = kReady;
        f.open.clear();
        f.groups.clear();
        f.wg_open.clear();
        f.wg_groups.clear();
        f.wg_fenced = false;
        f.cl_arrived = 0;
        init_fiber(f);
      }
      live += nthreads;
    }
    // Scheduling (config().schedule, config().warp_greedy). Each pass resumes every ready fiber in
    // thread order, in reverse, or in a fresh random permutation; with warp_greedy a warp's lanes
    // are resumed again and again until none of them can run (all at a barrier or done) before the
    // next warp starts, so a warp races ahead of the others as far as the barriers allow. A kernel
    // whose threads only communicate through barriers, warp collectives and waited cp.async gives
    // bitwise the same result under every schedule; one that reads another warp's smem writes
    // without a barrier in between reads poison or stale data under some greedy order. In a
    // cluster the order runs over the threads (warps) of all its CTAs, CTA after CTA.
    const int mode = config().schedule;
    const bool greedy = config().warp_greedy;
    const int nfib = static_cast<int>(fibers.size());
    const int wpc = static_cast<int>(ctas[0].warps.size());  // warps per CTA
    const int nwarps = wpc * static_cast<int>(ctas.size());
    std::vector<int> order(greedy ? nwarps : nfib), lanes(32);
    for (size_t i = 0; i < order.size(); ++i) order[i] = mode == 1 ? static_cast<int>(order.size() - 1 - i) : static_cast<int>(i);
    for (int i = 0; i < 32; ++i) lanes[i] = mode == 1 ? 31 - i : i;
    uint64_t rng = config().seed * 0x9E3779B97F4A7C15ull + (static_cast<uint64_t>(origin.x) << 40) +
                   (static_cast<uint64_t>(origin.y) << 20) + origin.z + 1;
    auto shuffle = [&](std::vector<int>& v) {  // Fisher-Yates with xorshift64
      for (int i = static_cast<int>(v.size()) - 1; i > 0; --i) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::swap(v[i], v[static_cast<int>(rng % static_cast<uint64_t>(i + 1))]);
      }
    };
    while (live > 0) {
      if (mode == 2) {
        shuffle(order);
        if (greedy) shuffle(lanes);
      }
      bool ran = false;
      if (!greedy) {
        for (int i : order) {
          if (fibers[i].state != kReady) continue;
          ran = true;
          resume(fibers[i]);
          if (!error.empty()) return;
        }
      } else {
        for (int gw : order) {
          const int c = gw / wpc, w = gw % wpc;
          for (bool progress = true; progress;) {
            progress = false;
            for (int l : lanes) {
              const int i = 32 * w + l;
              if (i >= nthreads) continue;
              Fiber& f = fibers[c * nthreads + i];
              if (f.state != kReady) continue;
              progress = ran = true;
              resume(f);
              if (!error.empty()) return;
            }
          }
        }
      }
      if (!ran) {
        error = deadlock_report();
        return;
      }
    }
    for (Cta& c : ctas) {
      if (!check_canaries(c)) return;
    }
  }

  bool check_canaries(Cta& c) {
    for (size_t i = 0; i < kGuard; ++i) {
      if (c.smem_buf[i] != kCanaryByte || static_cast<unsigned char>(c.smem[smem_bytes + i]) != kCanaryByte) {
        char buf[240];
        std::snprintf(buf, sizeof buf,
                      "kf_emu: %s: dynamic shared memory written out of bounds (%zu bytes allocated; a guard "
                      "byte %s the buffer changed)",
                      where(nullptr, &c).c_str(), smem_bytes, c.smem_buf[i] != kCanaryByte ? "before" : "after");
        error = buf;
        return false;
      }
    }
    return true;
  }

  std::string deadlock_report() const {
    std::string s = "kf_emu: " + where(nullptr) + (ctas.size() > 1 ? "'s cluster" : "") +
                    ": deadlock, no thread can proceed (";
    int at_bar = 0, at_mbar = 0, at_named = 0, at_cluster = 0;
    for (const Fiber& f : fibers) {
      at_bar += f.state == kWaitBar;
      at_mbar += f.state == kWaitMbar;
      at_named += f.state == kWaitNamed;
      at_cluster += f.state == kWaitCluster;
    }
    s += std::to_string(at_bar) + " of " + std::to_string(live) + " live threads wait in __syncthreads";
    if (at_mbar) s += ", " + std::to_string(at_mbar) + " on an mbarrier phase that no arrival completes";
    if (at_named) s += ", " + std::to_string(at_named) + " in a named barrier (bar.sync) that never fills";
    if (at_cluster)
      s += ", " + std::to_string(at_cluster) + " in barrier.cluster.wait (" + std::to_string(cl_arrived) + " of " +
           std::to_string(live) + " arrived)";
    for (const Cta& c : ctas) {
      for (size_t w = 0; w < c.warps.size(); ++w) {
        const Warp& wp = c.warps[w];
        if (!wp.arrived) continue;
        char buf[240];
        std::snprintf(buf, sizeof buf,
                      "; %swarp %zu: lanes 0x%08x wait in %s (mask 0x%08x), lanes 0x%08x never arrive",
                      ctas.size() > 1 ? ("rank " + std::to_string(c.rank) + " ").c_str() : "", w, wp.arrived,
                      op_name(wp.op), wp.mask, (wp.mask & wp.live) & ~wp.arrived);
        s += buf;
      }
    }
    return s + ")";
  }

  void release_barrier(Cta& c) {
    c.bar_arrived = 0;
    for (int i = 0; i < nthreads; ++i) {
      Fiber& f = fiber(c, i);
      if (f.state == kWaitBar) f.state = kReady;
    }
  }

  // barrier.cluster: the phase completes when every live thread of the cluster has arrived.
  void cluster_try_complete() {
    if (cl_arrived == 0 || cl_arrived < live) return;
    cl_arrived = 0;
    ++cl_phase;
    for (Fiber& f : fibers)
      if (f.state == kWaitCluster) f.state = kReady;
  }

  void perform(const std::vector<Copy>& g) {
    for (const Copy& c : g) {
      if (c.src_size > 0) std::memcpy(c.dst, c.src, static_cast<size_t>(c.src_size));
      if (c.size > c.src_size) std::memset(c.dst + c.src_size, 0, static_cast<size_t>(c.size - c.src_size));
    }
  }

  void thread_exit(Fiber& f) {
    // A wgmma in flight at exit writes registers that no longer exist: its wait_group is missing.
    size_t wg = f.wg_open.size();
    for (const auto& g : f.wg_groups) wg += g.size();
    if (wg)
      failf("the thread exits with %zu wgmma.mma_async in flight (%zu of them not committed): a wgmma.wait_group "
            "is missing",
            wg, f.wg_open.size());
    // outstanding cp.async still land (as on the hardware), committed or not
    while (!f.groups.empty()) {
      perform(f.groups.front());
      f.groups.pop_front();
    }
    perform(f.open);
    f.open.clear();
    f.state = kDone;
    --live;
    Cta& c = cta_of(f);
    --c.live;
    Warp& wp = c.warps[f.warp];
    wp.live &= ~(1u << f.lane);
    if (wp.arrived && ((wp.mask & wp.live) & ~wp.arrived) == 0) finish_warp(c, f.warp);
    if (c.bar_arrived > 0 && c.bar_arrived == c.live) release_barrier(c);
    if (c.live == 0 && ctas.size() > 1) {
      // The CTA is gone: on the GPU its shared memory may now belong to another CTA, so what a peer
      // still reads there is garbage (here: poison) and a later mapa of it is reported.
      if (!check_canaries(c)) return;
      c.exited = true;
      std::memset(c.smem, 0xFF, smem_bytes);
    }
    cluster_try_complete();
  }

  void finish_warp(Cta& c, int wi);
};

thread_local Worker* t_worker = nullptr;

void fiber_main(Fiber* f) {
  Worker& w = *f->worker;
  w.kernel->call(w.kernel->obj);
  w.thread_exit(*f);
  w.yield(*f);  // never resumed: its state is kDone
  std::abort();
}

Worker& need_fiber(const char* what) {
  Worker* w = t_worker;
  if (!w || !w->in_fiber || !w->cur) failf("%s called outside a kernel launched by kf_emu::launch", what);
  return *w;
}

// The calling thread's CTA.
Cta& cur_cta(Worker& w) { return w.cta_of(*w.cur); }

// ---------------------------------------------------------------------------------------------------
// warp collectives
inline float dec_bf16(uint32_t h) { return u2f((h & 0xffffu) << 16); }
inline float dec_f16(uint32_t h) {
  __half_raw r;
  r.x = static_cast<unsigned short>(h & 0xffffu);
  return __half2float(__half(r));
}
inline float dec_tf32(uint32_t u) { return u2f(u & 0xffffe000u); }

template <float (*Dec)(uint32_t)>
void mma_16816(Warp& wp) {
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    const uint32_t* in = wp.slot[l].in;
    for (int e = 0; e < 2; ++e) {
      A[g][2 * t + e] = Dec(in[0] >> (16 * e));
      A[g + 8][2 * t + e] = Dec(in[1] >> (16 * e));
      A[g][2 * t + 8 + e] = Dec(in[2] >> (16 * e));
      A[g + 8][2 * t + 8 + e] = Dec(in[3] >> (16 * e));
      B[2 * t + e][g] = Dec(in[4] >> (16 * e));
      B[2 * t + 8 + e][g] = Dec(in[5] >> (16 * e));
      C[g][2 * t + e] = u2f(in[6 + e]);
      C[g + 8][2 * t + e] = u2f(in[8 + e]);
    }
  }
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int e = 0; e < 4; ++e) {
      const int m = g + 8 * (e >> 1), n = 2 * t + (e & 1);
      float s = 0.f;  // products of 16-bit operands are exact in fp32; fp32 sum in k order
      for (int k = 0; k < 16; ++k) s += A[m][k] * B[k][n];
      wp.slot[l].out[e] = f2u(C[m][n] + s);
    }
  }
}

void mma_1688_tf32(Warp& wp) {
  float A[16][8], B[8][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    const uint32_t* in = wp.slot[l].in;
    A[g][t] = dec_tf32(in[0]);
    A[g + 8][t] = dec_tf32(in[1]);
    A[g][t + 4] = dec_tf32(in[2]);
    A[g + 8][t + 4] = dec_tf32(in[3]);
    B[t][g] = dec_tf32(in[4]);
    B[t + 4][g] = dec_tf32(in[5]);
    for (int e = 0; e < 2; ++e) {
      C[g][2 * t + e] = u2f(in[6 + e]);
      C[g + 8][2 * t + e] = u2f(in[8 + e]);
    }
  }
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int e = 0; e < 4; ++e) {
      const int m = g + 8 * (e >> 1), n = 2 * t + (e & 1);
      float s = 0.f;  // tf32 x tf32 (11-bit significands) is exact in fp32
      for (int k = 0; k < 8; ++k) s += A[m][k] * B[k][n];
      wp.slot[l].out[e] = f2u(C[m][n] + s);
    }
  }
}

void Worker::finish_warp(Cta& cta, int wi) {
  Warp& wp = cta.warps[wi];
  const uint32_t who = wp.arrived;
  const int op = wp.op;
  auto need_full = [&]() {
    if (who != 0xffffffffu)
      failf("%s in warp %d with lanes 0x%08x only: the .aligned instruction needs all 32 lanes (some exited?)",
            op_name(op), wi, who);
  };
  switch (op) {
    case kOpSyncwarp: break;
    case kOpShfl:
      for (int l = 0; l < 32; ++l) {
        if (!(who >> l & 1u)) continue;
        const uint32_t* in = wp.slot[l].in;
        const int mode = static_cast<int>(in[1]), b = static_cast<int>(in[2]), c = static_cast<int>(in[3]);
        const int segmask = (c >> 8) & 31;
        const int min_lane = l & segmask;
        const int max_lane = min_lane | ((c & 31) & ~segmask);
        int j = l;
        bool pval = false;
        switch (mode) {
          case 0: j = min_lane | (b & 31 & ~segmask); pval = j <= max_lane; break;
          case 1: j = l - b; pval = j >= max_lane; break;
          case 2: j = l + b; pval = j <= max_lane; break;
          default: j = l ^ b; pval = j <= max_lane; break;
        }
        if (!pval) j = l;
        // a source lane outside the collective: undefined on the GPU, poison here
        wp.slot[l].out[0] = (j >= 0 && j < 32 && (who >> j & 1u)) ? wp.slot[j].in[0] : 0xffffffffu;
      }
      break;
    case kOpVote: {
      uint32_t ballot = 0;
      for (int l = 0; l < 32; ++l)
        if ((who >> l & 1u) && wp.slot[l].in[0]) ballot |= 1u << l;
      for (int l = 0; l < 32; ++l) {
        wp.slot[l].out[0] = ballot;
        wp.slot[l].out[1] = who;
      }
      break;
    }
    case kOpMmaBf16: need_full(); mma_16816<dec_bf16>(wp); break;
    case kOpMmaF16: need_full(); mma_16816<dec_f16>(wp); break;
    case kOpMmaTf32: need_full(); mma_1688_tf32(wp); break;
    case kOpLdsmX4:
    case kOpLdsmX4T: {
      need_full();
      const char* row[32];
      for (int l = 0; l < 32; ++l) {
        const char* p = static_cast<const char*>(wp.slot[l].ptr);
        if (p < cta.smem || p + 16 > cta.smem + smem_bytes)
          failf("%s in warp %d: lane %d's row address %p is outside the CTA's dynamic shared memory [%p, +%zu)",
                op_name(op), wi, l, static_cast<const void*>(p), static_cast<void*>(cta.smem), smem_bytes);
        if ((p - cta.smem) % 16)
          failf("%s in warp %d: lane %d's row address (smem offset %td) is not 16-byte aligned", op_name(op), wi, l,
                p - cta.smem);
        row[l] = p;
      }
      for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; ++i) {
          uint32_t v;
          if (op == kOpLdsmX4) {  // row g of matrix i, columns 2t, 2t+1
            std::memcpy(&v, row[8 * i + g] + 4 * t, 4);
          } else {  // transposed: rows 2t, 2t+1 of matrix i, column g
            uint16_t lo, hi;
            std::memcpy(&lo, row[8 * i + 2 * t] + 2 * g, 2);
            std::memcpy(&hi, row[8 * i + 2 * t + 1] + 2 * g, 2);
            v = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
          }
          wp.slot[l].out[i] = v;
        }
      }
      break;
    }
    default: failf("unknown warp collective %d", op);
  }
  wp.arrived = 0;
  wp.mask = 0;
  wp.op = -1;
  for (int l = 0; l < 32; ++l) {
    if (!(who >> l & 1u)) continue;
    Fiber& f = fiber(cta, wi * 32 + l);
    if (f.state == kWaitWarp) f.state = kReady;
  }
}

}  // namespace

[[noreturn]] void failf(const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  Worker* w = t_worker;
  if (w && w->in_fiber && w->cur) {
    Fiber* f = w->cur;
    w->error = "kf_emu: " + w->where(f) + ": " + msg;
    f->state = kDone;  // abandoned: the scheduler stops the launch
    w->yield(*f);
    std::abort();
  }
  throw std::runtime_error(std::string("kf_emu: ") + msg);
}

Slot& lane_slot() {
  Worker& w = need_fiber("a warp collective");
  return cur_cta(w).warps[w.cur->warp].slot[w.cur->lane];
}

void warp_collective(int op, unsigned mask) {
  Worker& w = need_fiber(op_name(op));
  Fiber& f = *w.cur;
  Cta& cta = cur_cta(w);
  Warp& wp = cta.warps[f.warp];
  const uint32_t bit = 1u << f.lane;
  if (!(mask & bit)) failf("%s with member mask 0x%08x that excludes the calling lane %d", op_name(op), mask, f.lane);
  if (wp.arrived == 0) {
    wp.op = op;
    wp.mask = mask;
  } else if (wp.op != op || wp.mask != mask) {
    failf("divergent warp collectives in warp %d: lane %d reached %s (mask 0x%08x) while lanes 0x%08x wait in %s "
          "(mask 0x%08x)",
          f.warp, f.lane, op_name(op), mask, wp.arrived, op_name(wp.op), wp.mask);
  }
  wp.arrived |= bit;
  if (((wp.mask & wp.live) & ~wp.arrived) == 0) {
    w.finish_warp(cta, f.warp);
    return;
  }
  f.state = kWaitWarp;
  w.yield(f);
}

void launch_impl(dim3 grid, dim3 block, size_t smem_bytes, const KernelRef& k, dim3 cluster) {
  if (t_worker && t_worker->in_fiber) failf("kernel launch from inside a kernel is not supported");
  const long long nthreads = static_cast<long long>(block.x) * block.y * block.z;
  if (nthreads < 1 || nthreads > 1024)
    throw std::runtime_error("kf_emu: invalid block size " + std::to_string(nthreads) + " (1..1024 threads)");
  if (grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.y > 65535 || grid.z > 65535)
    throw std::runtime_error("kf_emu: invalid grid (" + std::to_string(grid.x) + "," + std::to_string(grid.y) + "," +
                             std::to_string(grid.z) + ")");
  if (smem_bytes > config().max_dyn_smem)
    throw std::runtime_error("kf_emu: " + std::to_string(smem_bytes) + " bytes of dynamic smem exceed the limit " +
                             std::to_string(config().max_dyn_smem));
  const long long csize = static_cast<long long>(cluster.x) * cluster.y * cluster.z;
  if (csize < 1 || csize > 16 || grid.x % cluster.x || grid.y % cluster.y || grid.z % cluster.z)
    throw std::runtime_error("kf_emu: cluster (" + std::to_string(cluster.x) + "," + std::to_string(cluster.y) + "," +
                             std::to_string(cluster.z) + ") must divide the grid and hold 1..16 CTAs");
  const dim3 cgrid(grid.x / cluster.x, grid.y / cluster.y, grid.z / cluster.z);  // clusters per dimension
  const long long nclusters = static_cast<long long>(cgrid.x) * cgrid.y * cgrid.z;
  int nw = config().workers;
  if (nw <= 0) nw = std::min(8, static_cast<int>(std::thread::hardware_concurrency()));
  nw = static_cast<int>(std::max(1LL, std::min<long long>(nw, nclusters)));

  std::atomic<long long> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::string first_error;
  auto body = [&]() {
    try {
      Worker w(block, cluster, smem_bytes, &k);
      w.gdim = grid;
      Worker* saved = t_worker;
      t_worker = &w;
      for (;;) {
        if (failed.load()) break;
        const long long b = next.fetch_add(1);
        if (b >= nclusters) break;
        const uint3 origin{static_cast<unsigned>(b % cgrid.x) * cluster.x,
                           static_cast<unsigned>((b / cgrid.x) % cgrid.y) * cluster.y,
                           static_cast<unsigned>(b / (static_cast<long long>(cgrid.x) * cgrid.y)) * cluster.z};
        w.run_cluster(origin);
        if (!w.error.empty()) {
          std::lock_guard<std::mutex> lock(mu);
          if (!failed.exchange(true)) first_error = w.error;
          break;
        }
      }
      t_worker = saved;
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu);
      if (!failed.exchange(true)) first_error = e.what();
    }
  };
  if (nw == 1) {
    body();
  } else {
    std::vector<std::thread> ts;
    for (int i = 0; i < nw; ++i) ts.emplace_back(body);
    for (auto& t : ts) t.join();
  }
  if (failed.load()) throw std::runtime_error(first_error);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------------
using detail::failf;
using detail::need_fiber;

void* dyn_smem() {
  detail::Worker& w = need_fiber("dynamic shared memory");
  return detail::cur_cta(w).smem;
}
size_t dyn_smem_bytes() { return need_fiber("dynamic shared memory").smem_bytes; }

unsigned shared_offset(const void* p) {
  detail::Worker& w = need_fiber("__cvta_generic_to_shared");
  const char* sm = detail::cur_cta(w).smem;
  const char* c = static_cast<const char*>(p);
  if (c < sm || c > sm + w.smem_bytes)
    failf("__cvta_generic_to_shared(%p): not in the CTA's dynamic shared memory [%p, +%zu)", p,
          static_cast<const void*>(sm), w.smem_bytes);
  return static_cast<unsigned>(c - sm);
}

void syncthreads() {
  detail::Worker& w = need_fiber("__syncthreads");
  detail::Fiber& f = *w.cur;
  detail::Cta& c = detail::cur_cta(w);
  if (++c.bar_arrived == c.live) {
    w.release_barrier(c);
    return;
  }
  f.state = detail::kWaitBar;
  w.yield(f);
}

void cp_async(void* dst, const void* src, int cp_size, int src_size) {
  detail::Worker& w = need_fiber("cp.async");
  if (cp_size != 4 && cp_size != 8 && cp_size != 16) failf("cp.async: cp-size %d is not 4, 8 or 16", cp_size);
  if (src_size < 0 || src_size > cp_size) failf("cp.async: src-size %d outside [0, %d]", src_size, cp_size);
  char* d = static_cast<char*>(dst);
  char* sm = detail::cur_cta(w).smem;
  if (d < sm || d + cp_size > sm + w.smem_bytes)
    failf("cp.async: destination %p is outside the CTA's dynamic shared memory [%p, +%zu)", dst,
          static_cast<void*>(sm), w.smem_bytes);
  if ((d - sm) % cp_size) failf("cp.async: destination smem offset %td is not %d-byte aligned", d - sm, cp_size);
  if (src_size > 0) {
    if (!src) failf("cp.async: null source with src-size %d", src_size);
    if (reinterpret_cast<uintptr_t>(src) % static_cast<uintptr_t>(cp_size))
      failf("cp.async: global source %p is not %d-byte aligned", src, cp_size);
  }
  w.cur->open.push_back({d, static_cast<const char*>(src), cp_size, src_size});
}

void cp_async_commit() {
  detail::Worker& w = need_fiber("cp.async.commit_group");
  detail::Fiber& f = *w.cur;
  f.groups.emplace_back(std::move(f.open));
  f.open.clear();
}

void cp_async_wait(int n) {
  detail::Worker& w = need_fiber("cp.async.wait_group");
  detail::Fiber& f = *w.cur;
  while (static_cast<int>(f.groups.size()) > n) {
    w.perform(f.groups.front());
    f.groups.pop_front();
  }
}

// ---------------------------------------------------------------------------------------------------
// wgmma.mma_async, deferred to its wait_group (kf_emu.h)
namespace {
void wgmma_poison(float* d, int nreg) {
  for (int i = 0; i < nreg; ++i) std::memcpy(d + i, &kWgmmaPoison, 4);
}

// B element (k, n) of a 128-byte-swizzled operand, at the canonical-layout address (kf_emu.h).
uint32_t wgmma_b_elem(const detail::Worker& w, const char* sm, uint64_t desc, bool trans_b, int k, int n) {
  const uint32_t start = static_cast<uint32_t>(desc & 0x3FFF) << 4;
  const uint32_t lbo = static_cast<uint32_t>((desc >> 16) & 0x3FFF) << 4;
  const uint32_t sbo = static_cast<uint32_t>((desc >> 32) & 0x3FFF) << 4;
  uint32_t addr = trans_b ? start + (n / 64) * lbo + 2 * (n % 64) + (k / 8) * sbo + (k % 8) * 128
                          : start + (n / 8) * sbo + (n % 8) * 128 + 2 * k;
  addr ^= ((addr >> 7) & 7) << 4;
  if (addr + 2 > w.smem_bytes)
    failf("wgmma: operand element (%d, %d) at smem offset %u is outside the dynamic shared memory (%zu bytes)", k, n,
          addr, w.smem_bytes);
  uint16_t v;
  std::memcpy(&v, sm + addr, 2);
  return v;
}

// The product lands: D = A B (+ C), B read from shared memory now, as N / 8 warp-collective mma.sync.
void wgmma_perform(detail::Worker& w, const detail::Wgmma& x) {
  float* d = x.d;
  const int nreg = x.N / 2;
  if (!x.chained) {
    for (int i = 0; i < nreg; ++i) {
      if (detail::f2u(d[i]) != kWgmmaPoison)
        failf("wgmma: accumulator register %d of %d was written while its wgmma.mma_async was in flight (before "
              "the wgmma.wait_group that completes it)",
              i, nreg);
    }
  }
  if (!x.ss && std::memcmp(x.a_src, x.a, sizeof x.a) != 0)
    failf("wgmma: the A operand registers of a wgmma.mma_async changed (or went out of scope) before the "
          "wgmma.wait_group that completes it");
  const int lane = w.cur->lane, g = lane >> 2, t = lane & 3;
  const char* sm = detail::cur_cta(w).smem;  // wgmma reads its own CTA's shared memory
  uint32_t a[4];
  std::memcpy(a, x.a, sizeof a);
  if (x.ss) {  // A K-major: element (m, k) is B's K-major element (k, n = m); this warp's 16 rows
    const int m0 = 16 * (w.cur->warp % 4) + g;
    auto ae = [&](int m, int k) { return wgmma_b_elem(w, sm, x.desc_a, false, k, m); };
    a[0] = ae(m0, 2 * t) | (ae(m0, 2 * t + 1) << 16);
    a[1] = ae(m0 + 8, 2 * t) | (ae(m0 + 8, 2 * t + 1) << 16);
    a[2] = ae(m0, 2 * t + 8) | (ae(m0, 2 * t + 9) << 16);
    a[3] = ae(m0 + 8, 2 * t + 8) | (ae(m0 + 8, 2 * t + 9) << 16);
  }
  for (int j = 0; j < x.N / 8; ++j) {
    const int n = 8 * j + g;
    const uint32_t b0 = wgmma_b_elem(w, sm, x.desc, x.trans_b, 2 * t, n) | (wgmma_b_elem(w, sm, x.desc, x.trans_b, 2 * t + 1, n) << 16);
    const uint32_t b1 =
        wgmma_b_elem(w, sm, x.desc, x.trans_b, 2 * t + 8, n) | (wgmma_b_elem(w, sm, x.desc, x.trans_b, 2 * t + 9, n) << 16);
    float c[4];
    for (int e = 0; e < 4; ++e) c[e] = !x.acc ? 0.f : (x.chained ? d[4 * j + e] : x.c[4 * j + e]);
    detail::mma_call(x.op, c, a, b0, b1);
    for (int e = 0; e < 4; ++e) d[4 * j + e] = c[e];
  }
}
}  // namespace

namespace {
void wgmma_issue_any(int op, float* d, int N, const uint32_t* a, uint64_t desc_a, bool ss, uint64_t desc,
                     bool trans_b, bool acc) {
  detail::Worker& w = need_fiber("wgmma.mma_async");
  detail::Fiber& f = *w.cur;
  if (N < 8 || N > 256 || N % 8) failf("wgmma: N=%d is not a multiple of 8 in [8, 256]", N);
  for (uint64_t dd : {desc, ss ? desc_a : desc}) {
    if ((dd >> 62) != 1 || ((dd >> 49) & 7) != 0)
      failf("wgmma: descriptor %#llx: only the 128-byte swizzle with base offset 0 is emulated",
            static_cast<unsigned long long>(dd));
  }
  if (!f.wg_fenced)
    failf("wgmma.mma_async without a wgmma.fence since the last wgmma.wait_group (the fence orders the earlier "
          "register accesses before the asynchronous reads and writes)");
  detail::Wgmma x;
  x.op = op;
  x.d = d;
  x.N = N;
  x.a_src = a;
  if (ss) std::memset(x.a, 0, sizeof x.a);
  else std::memcpy(x.a, a, sizeof x.a);
  x.desc = desc;
  x.desc_a = desc_a;
  x.ss = ss;
  x.trans_b = trans_b;
  x.acc = acc;
  x.chained = false;
  const int nreg = N / 2;
  auto owner = [&](const detail::Wgmma& q) {
    if (q.d == d && q.N == N) {
      x.chained = true;
    } else if (q.d < d + nreg && d < q.d + q.N / 2) {
      failf("wgmma: accumulators of two wgmma.mma_async in flight overlap partially");
    }
  };
  for (const auto& grp : f.wg_groups)
    for (const auto& q : grp) owner(q);
  for (const auto& q : f.wg_open) owner(q);
  if (!x.chained) {
    if (acc) std::memcpy(x.c, d, sizeof(float) * static_cast<size_t>(nreg));
    wgmma_poison(d, nreg);
  }
  f.wg_open.push_back(x);
}
}  // namespace

void wgmma_issue(int op, float* d, int N, const uint32_t (&a)[4], uint64_t desc, bool trans_b, bool acc) {
  wgmma_issue_any(op, d, N, a, 0, false, desc, trans_b, acc);
}
void wgmma_issue_ss(int op, float* d, int N, uint64_t desc_a, uint64_t desc_b, bool trans_b, bool acc) {
  wgmma_issue_any(op, d, N, nullptr, desc_a, true, desc_b, trans_b, acc);
}

void wgmma_fence() { need_fiber("wgmma.fence").cur->wg_fenced = true; }

void wgmma_commit() {
  detail::Worker& w = need_fiber("wgmma.commit_group");
  detail::Fiber& f = *w.cur;
  f.wg_groups.emplace_back(std::move(f.wg_open));
  f.wg_open.clear();
}

void wgmma_wait(int n) {
  detail::Worker& w = need_fiber("wgmma.wait_group");
  detail::Fiber& f = *w.cur;
  while (static_cast<int>(f.wg_groups.size()) > n) {
    const std::vector<detail::Wgmma> grp = std::move(f.wg_groups.front());
    f.wg_groups.pop_front();
    for (const detail::Wgmma& x : grp) wgmma_perform(w, x);
  }
  // An operation still in flight whose predecessor on the same accumulator just landed owns the
  // registers now: its C is the value that landed, and they hold poison again until it lands.
  std::vector<const float*> owned;
  auto rebase = [&](detail::Wgmma& x) {
    if (std::find(owned.begin(), owned.end(), x.d) != owned.end()) return;
    owned.push_back(x.d);
    if (!x.chained) return;
    x.chained = false;
    if (x.acc) std::memcpy(x.c, x.d, sizeof(float) * static_cast<size_t>(x.N / 2));
    wgmma_poison(x.d, x.N / 2);
  };
  for (auto& grp : f.wg_groups)
    for (auto& x : grp) rebase(x);
  for (auto& x : f.wg_open) rebase(x);
  f.wg_fenced = false;
}

// ---------------------------------------------------------------------------------------------------
// mbarrier, bulk asynchronous copies (TMA) and named barriers (kf_emu.h)
namespace {
// The CTA of the cluster whose shared memory holds p (null: none).
detail::Cta* owner_cta(detail::Worker& w, const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (detail::Cta& cta : w.ctas)
    if (c >= cta.smem && c + bytes <= cta.smem + w.smem_bytes) return &cta;
  return nullptr;
}

// The mbarrier's offset in the calling thread's CTA (remote: in any CTA of the cluster, which
// *owner receives), checked.
uint32_t mbar_offset(detail::Worker& w, const void* bar, const char* what, bool remote = false,
                     detail::Cta** owner = nullptr) {
  detail::Cta& mine = detail::cur_cta(w);
  detail::Cta* cta = remote ? owner_cta(w, bar, 8) : &mine;
  const char* c = static_cast<const char*>(bar);
  if (!cta || c < cta->smem || c + 8 > cta->smem + w.smem_bytes)
    failf("%s: the mbarrier %p is not in the %s dynamic shared memory [%p, +%zu)", what, bar,
          remote ? "cluster's" : "CTA's", static_cast<void*>(mine.smem), w.smem_bytes);
  if (cta->exited) failf("%s: the mbarrier %p is in cluster rank %d, which has exited", what, bar, cta->rank);
  if ((c - cta->smem) % 8) failf("%s: the mbarrier at smem offset %td is not 8-byte aligned", what, c - cta->smem);
  if (owner) *owner = cta;
  return static_cast<uint32_t>(c - cta->smem);
}

detail::Mbar& mbar_state(detail::Worker& w, const void* bar, const char* what, bool remote = false) {
  detail::Cta* cta = nullptr;
  const uint32_t off = mbar_offset(w, bar, what, remote, &cta);
  auto it = cta->mbars.find(off);
  if (it == cta->mbars.end())
    failf("%s: the mbarrier at smem offset %u was never initialised (mbarrier.init)", what, off);
  return it->second;
}

// The threads blocked in mbar_try_wait on `bar` run again (they re-check the phase, or land copies).
void wake_mbar_waiters(detail::Worker& w, const void* bar) {
  for (detail::Fiber& f : w.fibers)
    if (f.state == detail::kWaitMbar && f.wait_obj == bar) f.state = detail::kReady;
}

// The phase completes when every arrival and every transaction byte of it is in; its waiters wake.
void mbar_try_complete(detail::Worker& w, const void* bar, detail::Mbar& m) {
  if (m.pending != 0 || m.tx != 0) return;
  ++m.phase;
  m.pending = m.count;
  wake_mbar_waiters(w, bar);
}

void perform_tensor(detail::Worker& w, const detail::AsyncCopy& c) {
  const TensorMapDesc& d = c.desc;
  uint64_t total = 1;
  for (int i = 0; i < d.rank; ++i) total *= d.box[i];
  const char* base = static_cast<const char*>(d.base);
  const uint32_t dst0 = static_cast<uint32_t>(c.dst - c.smem);
  for (uint64_t lin = 0; lin < total; ++lin) {
    uint64_t rest = lin, goff = 0;
    bool inside = true;
    for (int i = 0; i < d.rank; ++i) {
      const int64_t g = static_cast<int64_t>(c.coords[i]) + static_cast<int64_t>(rest % d.box[i]);
      rest /= d.box[i];
      if (g < 0 || static_cast<uint64_t>(g) >= d.dims[i]) inside = false;
      else goff += static_cast<uint64_t>(g) * (i == 0 ? static_cast<uint64_t>(d.elem_bytes) : d.strides[i]);
    }
    uint32_t sh = dst0 + static_cast<uint32_t>(lin) * static_cast<uint32_t>(d.elem_bytes);
    if (d.swizzle_bytes == 128) sh ^= ((sh >> 7) & 7) << 4;  // 16-byte chunk ^= 128-byte row % 8
    if (inside) std::memcpy(c.smem + sh, base + goff, static_cast<size_t>(d.elem_bytes));
    else std::memset(c.smem + sh, 0, static_cast<size_t>(d.elem_bytes));  // out of bounds: zeros
  }
}

void async_issue(detail::Worker& w, void* bar, detail::AsyncCopy&& c, const char* what) {
  char* sm = detail::cur_cta(w).smem;
  if (c.dst < sm || c.dst + c.bytes > sm + w.smem_bytes)
    failf("%s: destination [%p, +%u) is outside the CTA's dynamic shared memory [%p, +%zu)", what,
          static_cast<void*>(c.dst), c.bytes, static_cast<void*>(sm), w.smem_bytes);
  c.smem = sm;
  detail::Mbar& m = mbar_state(w, bar, what);
  std::memset(c.dst, 0xFF, c.bytes);  // poison until it lands: a read before the barrier's wait shows
  m.copies.push_back(std::move(c));
  wake_mbar_waiters(w, bar);  // a thread already waiting lands it: the copy engine needs no waiter
}
}  // namespace

void mbar_init(void* bar, int count) {
  detail::Worker& w = need_fiber("mbarrier.init");
  if (count < 1 || count >= (1 << 20)) failf("mbarrier.init: count %d outside [1, 2^20)", count);
  detail::Mbar m;
  m.count = m.pending = count;
  detail::cur_cta(w).mbars[mbar_offset(w, bar, "mbarrier.init")] = std::move(m);
}

namespace {
// The copies in flight on `bar` land now (their transaction bytes complete; so may the phase).
void mbar_land(detail::Worker& w, void* bar, detail::Mbar& m) {
  std::vector<detail::AsyncCopy> cs = std::move(m.copies);
  m.copies.clear();
  for (const detail::AsyncCopy& c : cs) {
    if (c.tensor) perform_tensor(w, c);
    else std::memcpy(c.dst, c.src, c.bytes);
    m.tx -= c.bytes;
  }
  mbar_try_complete(w, bar, m);
}

// Before an arrival: if every arrival of the phase is in and it waits for copies only, they land
// now (on the GPU they land on their own), so the arrival belongs to the next phase.
// (remote: the barrier may be in any CTA of the cluster, mbarrier.arrive.shared::cluster)
detail::Mbar& mbar_for_arrival(detail::Worker& w, void* bar, const char* what, bool remote = false) {
  detail::Mbar& m = mbar_state(w, bar, what, remote);
  if (m.pending == 0 && !m.copies.empty()) mbar_land(w, bar, m);
  return m;
}

void mbar_arrive_on(void* bar, const char* what, bool remote) {
  detail::Worker& w = need_fiber(what);
  detail::Mbar& m = mbar_for_arrival(w, bar, what, remote);
  if (--m.pending < 0) failf("%s: more arrivals than the barrier's count %d in one phase", what, m.count);
  mbar_try_complete(w, bar, m);
}
}  // namespace

void mbar_arrive(void* bar) { mbar_arrive_on(bar, "mbarrier.arrive", false); }

void mbar_expect_tx(void* bar, uint32_t bytes) {
  detail::Worker& w = need_fiber("mbarrier.expect_tx");
  mbar_state(w, bar, "mbarrier.expect_tx").tx += bytes;
}

void mbar_arrive_expect_tx(void* bar, uint32_t bytes) {
  detail::Worker& w = need_fiber("mbarrier.arrive.expect_tx");
  mbar_for_arrival(w, bar, "mbarrier.arrive.expect_tx").tx += bytes;  // the next phase's, as the arrival
  mbar_arrive(bar);
}

bool mbar_try_wait(void* bar, int parity) {
  detail::Worker& w = need_fiber("mbarrier.try_wait");
  detail::Fiber& f = *w.cur;
  for (;;) {
    detail::Mbar& m = mbar_state(w, bar, "mbarrier.try_wait");
    if ((m.phase & 1u) != static_cast<uint32_t>(parity & 1)) return true;  // that phase has completed
    if (!m.copies.empty()) {  // the copies in flight on it land now
      mbar_land(w, bar, m);
      continue;
    }
    f.state = detail::kWaitMbar;
    f.wait_obj = bar;
    f.wait_arg = parity;
    w.yield(f);
  }
}

void bulk_g2s(void* dst, const void* src, uint32_t bytes, void* bar) {
  detail::Worker& w = need_fiber("cp.async.bulk");
  if (bytes == 0 || bytes % 16) failf("cp.async.bulk: size %u is not a positive multiple of 16", bytes);
  if (reinterpret_cast<uintptr_t>(src) % 16) failf("cp.async.bulk: global source %p is not 16-byte aligned", src);
  char* d = static_cast<char*>(dst);
  const char* sm = detail::cur_cta(w).smem;
  if ((d - sm) % 16) failf("cp.async.bulk: destination smem offset %td is not 16-byte aligned", d - sm);
  detail::AsyncCopy c{};
  c.dst = d;
  c.bytes = bytes;
  c.src = static_cast<const char*>(src);
  async_issue(w, bar, std::move(c), "cp.async.bulk");
}

void tma_load(void* dst, const void* tmap, const int32_t* coords, void* bar) {
  detail::Worker& w = need_fiber("cp.async.bulk.tensor");
  TensorMapDesc d;
  std::memcpy(&d, tmap, sizeof d);
  if (d.magic != TensorMapDesc::kMagic) failf("cp.async.bulk.tensor: %p is not a tensor map built for the emulator", tmap);
  if (d.rank < 1 || d.rank > 5) failf("cp.async.bulk.tensor: rank %d outside [1, 5]", d.rank);
  uint64_t bytes = static_cast<uint64_t>(d.elem_bytes);
  for (int i = 0; i < d.rank; ++i) bytes *= d.box[i];
  char* dp = static_cast<char*>(dst);
  const char* sm = detail::cur_cta(w).smem;
  const int align = d.swizzle_bytes == 128 ? 1024 : 128;
  if ((dp - sm) % align)
    failf("cp.async.bulk.tensor: destination smem offset %td is not %d-byte aligned%s", dp - sm, align,
          d.swizzle_bytes == 128 ? " (128-byte swizzle)" : "");
  if (d.swizzle_bytes == 128 && d.box[0] * static_cast<uint32_t>(d.elem_bytes) != 128)
    failf("cp.async.bulk.tensor: the 128-byte swizzle needs a 128-byte inner box, got %u bytes",
          d.box[0] * static_cast<uint32_t>(d.elem_bytes));
  detail::AsyncCopy c{};
  c.dst = dp;
  c.bytes = static_cast<uint32_t>(bytes);
  c.tensor = true;
  c.desc = d;
  for (int i = 0; i < d.rank; ++i) c.coords[i] = coords[i];
  async_issue(w, bar, std::move(c), "cp.async.bulk.tensor");
}

namespace {
detail::NamedBar& named_bar(detail::Worker& w, int id, int nthreads, const char* what) {
  if (id < 1 || id > 15) failf("%s: barrier id %d outside [1, 15] (0 is __syncthreads')", what, id);
  if (nthreads < 32 || nthreads % 32 || nthreads > w.nthreads)
    failf("%s: thread count %d is not a multiple of 32 in [32, %d]", what, nthreads, w.nthreads);
  detail::NamedBar& b = detail::cur_cta(w).named[id];
  if (b.arrived == 0) b.count = nthreads;
  else if (b.count != nthreads)
    failf("%s %d: thread count %d while %d threads wait with count %d", what, id, nthreads, b.arrived, b.count);
  return b;
}
bool named_arrive(detail::Worker& w, detail::NamedBar& b, int id) {  // true: this arrival filled it
  if (++b.arrived < b.count) return false;
  b.arrived = 0;
  const detail::Cta& c = detail::cur_cta(w);
  for (int i = 0; i < w.nthreads; ++i) {
    detail::Fiber& f = w.fiber(c, i);
    if (f.state == detail::kWaitNamed && f.wait_arg == id) f.state = detail::kReady;
  }
  return true;
}
}  // namespace

void named_barrier_sync(int id, int nthreads) {
  detail::Worker& w = need_fiber("bar.sync");
  detail::NamedBar& b = named_bar(w, id, nthreads, "bar.sync");
  if (named_arrive(w, b, id)) return;
  detail::Fiber& f = *w.cur;
  f.state = detail::kWaitNamed;
  f.wait_arg = id;
  w.yield(f);
}

void named_barrier_arrive(int id, int nthreads) {
  detail::Worker& w = need_fiber("bar.arrive");
  named_arrive(w, named_bar(w, id, nthreads, "bar.arrive"), id);
}

uint32_t shfl32(int mode, unsigned mask, uint32_t v, int b, int c) {
  detail::Slot& s = detail::lane_slot();
  s.in[0] = v;
  s.in[1] = static_cast<uint32_t>(mode);
  s.in[2] = static_cast<uint32_t>(b);
  s.in[3] = static_cast<uint32_t>(c);
  detail::warp_collective(detail::kOpShfl, mask);
  return detail::lane_slot().out[0];
}

unsigned ballot(unsigned mask, bool pred, unsigned* participants) {
  detail::Slot& s = detail::lane_slot();
  s.in[0] = pred ? 1u : 0u;
  detail::warp_collective(detail::kOpVote, mask);
  if (participants) *participants = detail::lane_slot().out[1];
  return detail::lane_slot().out[0];
}

void syncwarp(unsigned mask) { detail::warp_collective(detail::kOpSyncwarp, mask); }

unsigned activemask() {
  detail::Worker& w = need_fiber("__activemask");
  return detail::cur_cta(w).warps[w.cur->warp].live;  // no divergence tracking: every live lane counts as active
}


// ---------------------------------------------------------------------------------------------------
// thread block clusters (kf_emu.h)
unsigned cluster_ctarank() {
  detail::Worker& w = need_fiber("%cluster_ctarank");
  return static_cast<unsigned>(detail::cur_cta(w).rank);
}

unsigned cluster_nctarank() { return static_cast<unsigned>(need_fiber("%cluster_nctarank").ctas.size()); }

void* map_shared_rank(const void* p, unsigned rank) {
  detail::Worker& w = need_fiber("mapa");
  const detail::Cta& mine = detail::cur_cta(w);
  const char* c = static_cast<const char*>(p);
  if (c < mine.smem || c > mine.smem + w.smem_bytes)
    failf("mapa(%p, %u): not in the calling CTA's dynamic shared memory [%p, +%zu)", p, rank,
          static_cast<void*>(mine.smem), w.smem_bytes);
  if (rank >= w.ctas.size()) failf("mapa(%p, %u): the cluster has %zu CTAs", p, rank, w.ctas.size());
  const detail::Cta& dst = w.ctas[rank];
  if (dst.exited) failf("mapa(%p, %u): cluster rank %u has exited (its shared memory is gone)", p, rank, rank);
  return dst.smem + (c - mine.smem);
}

void cluster_arrive() {
  detail::Worker& w = need_fiber("barrier.cluster.arrive");
  detail::Fiber& f = *w.cur;
  if (f.cl_arrived == w.cl_phase + 1)
    failf("barrier.cluster.arrive twice in one phase without barrier.cluster.wait in between");
  f.cl_arrived = w.cl_phase + 1;
  ++w.cl_arrived;
  w.cluster_try_complete();
}

void cluster_wait() {
  detail::Worker& w = need_fiber("barrier.cluster.wait");
  detail::Fiber& f = *w.cur;
  if (f.cl_arrived == 0) failf("barrier.cluster.wait without a barrier.cluster.arrive before it");
  while (f.cl_arrived == w.cl_phase + 1) {  // its phase has not completed
    f.state = detail::kWaitCluster;
    w.yield(f);
  }
  f.cl_arrived = 0;
}

void mbar_arrive_cluster(void* bar) { mbar_arrive_on(bar, "mbarrier.arrive.shared::cluster", true); }

}  // namespace kf_emu
