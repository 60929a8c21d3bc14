// kf_emu: a host (CPU) emulation of the CUDA execution model, enough to run this project's CUDA C++
// kernels UNMODIFIED under g++ so that indexing, fragment-layout, synchronisation and cp.async
// bugs show up without a GPU. tests/emu/README.md has the overview.
//
// Model
//   * every CUDA thread of a block is a cooperative fiber (own stack, hand-rolled context switch on
//     x86-64, ucontext elsewhere), scheduled round-robin; a fiber runs until it blocks in
//     __syncthreads or a warp collective, or returns from the kernel;
//   * the blocks of a grid run one after another on a worker OS thread; several workers (one block
//     each at a time) may run in parallel (config().workers, env KF_EMU_THREADS);
//   * __syncthreads is a barrier over the block's LIVE fibers (a fiber that returned no longer
//     counts); warp collectives (shfl, vote, __syncwarp, mma.sync, ldmatrix) are a rendezvous of
//     the warp's live lanes named in the mask: every such lane must reach the SAME collective,
//     otherwise the launch fails with a diagnostic ("divergent warp collectives"); a state where no
//     fiber can run is reported as a deadlock;
//   * dynamic shared memory (KF_DYN_SMEM, csrc/common/dyn_smem.h) is a per-block host buffer,
//     poisoned with 0xFF bytes (NaN in fp32 / bf16 / fp16) at every block start and guarded by
//     canaries checked when the block ends; static `__shared__` variables become
//     `static thread_local` (one instance per worker; not poisoned);
//   * cp.async copies are DEFERRED: recorded per thread, grouped by commit_group, performed by
//     wait_group (all but the N most recent groups) or when the thread exits, so a missing wait
//     reads poison;
//   * wgmma.mma_async is DEFERRED the same way: its accumulator registers hold poison until the
//     wgmma.wait_group that completes its group (see wgmma_rs_m64k16);
//   * mbarriers, bulk copies (TMA) and named barriers: see "The Hopper asynchronous pipeline" below;
//   * "global" memory is plain host memory.
//
// Use: compile with -DKF_EMU, include this header BEFORE any kernel source, then
//   kf_emu::launch(grid, block, dyn_smem_bytes, kernel, args...);   // throws std::runtime_error
#pragma once

#ifndef KF_EMU
#error "tests/emu/kf_emu.h is the host emulator of the CUDA execution model: compile with -DKF_EMU"
#endif

// The CUDA headers first (host mode under g++: vector types, dim3, fp16 / bf16 host conversions),
// so that the macros below never rewrite them.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#define KF_EMU_H 1

namespace kf_emu {

// ------------------------------------------------------------------------------------ configuration
struct Config {  // defaults; the environment variables named below override them at first use
  size_t stack_bytes = 256 * 1024;  // per fiber (KF_EMU_STACK_KB); a guard page below each stack
                                    // turns an overflow into a SIGSEGV
  int workers = 0;                  // OS threads running blocks in parallel (KF_EMU_THREADS); 0: the
                                    // hardware concurrency, capped at 8
  bool ftz = true;                  // flush fp32 denormals (MXCSR FTZ|DAZ) inside kernels, as the
                                    // project's --use_fast_math GPU build does (KF_EMU_FTZ=0/1)
  bool poison_smem = true;          // 0xFF-fill dynamic smem at every block start
  size_t max_dyn_smem = 227 * 1024; // sm_90's per-block limit
  // Fiber schedule (KF_EMU_SCHEDULE = forward | reverse | random[:seed], "+greedy" appended for
  // warp_greedy): every scheduling pass resumes each ready fiber once, in thread order (0), in
  // reverse (1) or in a fresh random permutation (2, seeded by `seed` and the block index). With
  // warp_greedy a warp runs as far as the barriers allow before the next warp starts, which turns a
  // missing __syncthreads between one warp's smem writes and another's reads into poison / stale
  // reads; the KDA kernels give bitwise the same results under every schedule.
  int schedule = 0;
  bool warp_greedy = false;
  uint64_t seed = 0;
};
Config& config();

namespace detail {
struct Cur {  // what the CUDA built-in variables read; updated by the scheduler at every switch
  uint3 tid;
  uint3 bid;
  dim3 bdim;
  dim3 gdim;
};
extern thread_local Cur t_cur;

struct KernelRef {
  void* obj;
  void (*call)(void*);
};
void launch_impl(dim3 grid, dim3 block, size_t smem_bytes, const KernelRef& k, dim3 cluster = dim3(1, 1, 1));

// One lane's operands / results of a warp collective.
struct Slot {
  uint32_t in[12];
  const void* ptr;
  uint32_t out[4];
};
enum Op : int {
  kOpSyncwarp = 0,
  kOpShfl,
  kOpVote,
  kOpMmaBf16,   // mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32
  kOpMmaF16,    // mma.sync.m16n8k16.row.col.f32.f16.f16.f32
  kOpMmaTf32,   // mma.sync.m16n8k8.row.col.f32.tf32.tf32.f32
  kOpLdsmX4,    // ldmatrix.sync.aligned.m8n8.x4.shared.b16
  kOpLdsmX4T,   // ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16
  kOpCount
};
Slot& lane_slot();                          // the calling lane's slot
void warp_collective(int op, unsigned mask);  // rendezvous; on return lane_slot().out holds the result
[[noreturn]] void failf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

inline uint32_t f2u(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
}  // namespace detail

// ------------------------------------------------------------------------------------ launch
// launch_cluster: a launch with thread block clusters (cudaLaunchKernelEx with
// cudaLaunchAttributeClusterDimension): `cluster` must divide the grid; the CTAs of a cluster run
// together in one scheduler (their threads interleave), each with its own dynamic shared memory.
// Static __shared__ variables are per OS thread here, so a cluster's CTAs would share them: kernels
// launched with clusters must keep their shared state in dynamic shared memory.
template <typename... P, typename... A>
void launch_cluster(dim3 grid, dim3 cluster, dim3 block, size_t dyn_smem_bytes, void (*kernel)(P...), A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "kf_emu::launch: argument count differs from the kernel's");
  using Params = std::tuple<std::decay_t<P>...>;
  Params params(std::forward<A>(args)...);  // by value, like a CUDA launch
  struct Ctx {
    void (*k)(P...);
    Params* params;
  } ctx{kernel, &params};
  detail::KernelRef ref{&ctx, [](void* c) {
                          auto* x = static_cast<Ctx*>(c);
                          std::apply(x->k, *x->params);  // every thread gets its own copies
                        }};
  detail::launch_impl(grid, block, dyn_smem_bytes, ref, cluster);
}
template <typename... P, typename... A>
void launch(dim3 grid, dim3 block, size_t dyn_smem_bytes, void (*kernel)(P...), A&&... args) {
  launch_cluster(grid, dim3(1, 1, 1), block, dyn_smem_bytes, kernel, std::forward<A>(args)...);
}

// ------------------------------------------------------------------------------------ block-level
void* dyn_smem();             // the current block's dynamic shared buffer
size_t dyn_smem_bytes();
void syncthreads();
unsigned shared_offset(const void* p);  // __cvta_generic_to_shared: offset into dynamic smem (checked)

// ------------------------------------------------------------------------------------ PTX emulations
// ex2.approx.ftz.f32 / lg2.approx.ftz.f32: denormal inputs and outputs flushed to (signed) zero.
inline float ftz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x; }
inline float ex2_approx_ftz(float x) { return ftz(std::exp2(ftz(x))); }
inline float lg2_approx_ftz(float x) { return std::log2(ftz(x)); }

// cvt.rna.tf32.f32: round to nearest, ties away from zero, to 10 mantissa bits (low 13 bits zero).
inline uint32_t cvt_rna_tf32(float x) {
  uint32_t u = detail::f2u(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0x007fffffu) ? 0x7fffffffu : u;  // NaN / inf
  return (u + 0x1000u) & 0xffffe000u;
}

namespace detail {
inline void mma_call(int op, float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Slot& s = lane_slot();
  for (int i = 0; i < 4; ++i) s.in[i] = a[i];
  s.in[4] = b0;
  s.in[5] = b1;
  for (int i = 0; i < 4; ++i) s.in[6 + i] = f2u(c[i]);
  warp_collective(op, 0xffffffffu);
  for (int i = 0; i < 4; ++i) c[i] = u2f(lane_slot().out[i]);
}
template <typename T> struct MmaOp;
template <> struct MmaOp<__nv_bfloat16> { static constexpr int op = kOpMmaBf16; };
template <> struct MmaOp<__half> { static constexpr int op = kOpMmaF16; };
}  // namespace detail

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 {c} = {a} x {b0,b1} + {c}
template <typename T>
inline void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  detail::mma_call(detail::MmaOp<T>::op, c, a, b0, b1);
}
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (the low 13 bits of each operand are ignored)
inline void mma_m16n8k8_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  detail::mma_call(detail::kOpMmaTf32, c, a, b0, b1);
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i..8i+7 give the row addresses of matrix i.
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr, bool trans = false) {
  detail::Slot& s = detail::lane_slot();
  s.ptr = row_addr;
  detail::warp_collective(trans ? detail::kOpLdsmX4T : detail::kOpLdsmX4, 0xffffffffu);
  for (int i = 0; i < 4; ++i) r[i] = detail::lane_slot().out[i];
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_addr) { ldmatrix_x4(r, row_addr, true); }

// wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16} with A from registers and B through a shared-
// memory descriptor (128-byte swizzle only), for the calling warp's 16 rows of the warpgroup's 64
// (each warp's A and D rows are its own; B is common): N / 8 mma.sync m16n8k16 whose B fragments
// are read from shared memory at the canonical-layout addresses of the PTX ISA ("Shared memory
// matrix layout" / "Matrix descriptor"), written here from the spec, not from the kernels' code:
//   K-major B (trans_b false), element (k, n): start + (n / 8) SBO + (n % 8) 128 + 2 k
//   MN-major B (trans_b true),  element (k, n): start + (n / 64) LBO + 2 (n % 64) + (k / 8) SBO + (k % 8) 128
// then the 128-byte swizzle of the address: bits [4, 7) ^= bits [7, 10). acc false: D = A B.
//
// ASYNCHRONOUS, as on the GPU: the issue records the operation (A's values, the descriptor, the
// accumulator's address and, for the first operation in flight on it, the accumulator's values)
// and overwrites the accumulator registers with a signalling-NaN poison (kWgmmaPoison); the product
// lands in them only at the wgmma.wait_group that completes its commit group (B is read from shared
// memory then). So a read of the accumulator before its wait sees NaN, and a removed wait_group
// leaves NaN (or, when the thread exits with operations in flight, a reported error). Also reported:
// an issue without a wgmma.fence since the last wait_group, an accumulator written while in flight
// (the poison's bits changed: arithmetic on a signalling NaN quiets it), A registers changed
// before the wait. Operations on the same accumulator chain in issue order, as the hardware orders
// them.
constexpr uint32_t kWgmmaPoison = 0x7f80deadu;  // a signalling NaN
void wgmma_issue(int op, float* d, int N, const uint32_t (&a)[4], uint64_t desc, bool trans_b, bool acc);
template <typename T>
inline void wgmma_rs_m64k16(float* d, int N, const uint32_t (&a)[4], uint64_t desc, bool trans_b, bool acc) {
  wgmma_issue(detail::MmaOp<T>::op, d, N, a, desc, trans_b, acc);
}
// The same with A from shared memory too (wgmma.mma_async ... d, desc_a, desc_b): A K-major,
// element (m, k) of the warpgroup's 64 rows at start + (m / 8) SBO + (m % 8) 128 + 2 k, swizzled as B.
void wgmma_issue_ss(int op, float* d, int N, uint64_t desc_a, uint64_t desc_b, bool trans_b, bool acc);
template <typename T>
inline void wgmma_ss_m64k16(float* d, int N, uint64_t desc_a, uint64_t desc_b, bool trans_b, bool acc) {
  wgmma_issue_ss(detail::MmaOp<T>::op, d, N, desc_a, desc_b, trans_b, acc);
}
void wgmma_fence();     // wgmma.fence.sync.aligned
void wgmma_commit();    // wgmma.commit_group.sync.aligned
void wgmma_wait(int n);  // wgmma.wait_group.sync.aligned n: all but the n most recent groups land

// cp.async.{ca,cg}.shared.global [dst], [src], cp_size, src_size: DEFERRED (see the header comment).
void cp_async(void* dst_smem, const void* src_global, int cp_size, int src_size);
inline void cp_async_cg16(void* dst_smem, const void* src_global, int src_size) {
  cp_async(dst_smem, src_global, 16, src_size);
}
void cp_async_commit();     // cp.async.commit_group
void cp_async_wait(int n);  // cp.async.wait_group n
inline void cp_async_wait_all() { cp_async_commit(), cp_async_wait(0); }  // cp.async.wait_all

// ---- The Hopper asynchronous pipeline: mbarrier, bulk copies (TMA), named barriers.
// An mbarrier is 8 bytes of dynamic shared memory; the emulator keeps its state (arrivals per phase,
// arrivals and transaction bytes still missing, completed phases) beside it, from mbarrier.init to
// the end of the block. Bulk copies are DEFERRED like cp.async: the issue poisons the destination
// (0xFF bytes) and records the copy on its mbarrier; the copies land (and complete their
// transaction bytes) when a thread waits on that barrier. So a consumer that reads a stage without
// waiting on its "full" barrier reads poison, and a producer that refills a stage before the
// consumers released it poisons what they still read. mbar_try_wait blocks the calling thread
// until the phase of that parity has completed (the hardware's try_wait may return false; callers
// loop); a wait that no arrival can complete is reported as a deadlock.
void mbar_init(void* bar, int count);                      // mbarrier.init.shared::cta.b64
void mbar_arrive(void* bar);                               // mbarrier.arrive.shared::cta.b64
void mbar_expect_tx(void* bar, uint32_t bytes);            // mbarrier.expect_tx
void mbar_arrive_expect_tx(void* bar, uint32_t bytes);     // mbarrier.arrive.expect_tx
bool mbar_try_wait(void* bar, int parity);                 // mbarrier.try_wait.parity (blocking here)
// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], bytes, [bar]
void bulk_g2s(void* dst, const void* src, uint32_t bytes, void* bar);
// What a CUtensorMap holds for the emulator (csrc/common/tma_desc.h writes it into the map's 128
// bytes in KF_EMU builds; the GPU build has the driver encode the real one): a tiled map, box
// element (i0, i1, ..) at global address base + (c0 + i0) elem_bytes + sum_{d >= 1} (c_d + i_d)
// strides[d], zeros outside dims; the box lands densely (i0 fastest) in shared memory, then the
// 128-byte swizzle (swizzle_bytes 128: 16-byte chunk ^= (smem offset / 128) % 8; needs a 1024-byte
// aligned destination and a 128-byte inner box) as the hardware applies it.
struct TensorMapDesc {
  static constexpr uint32_t kMagic = 0x4b46544du;  // "KFTM"
  uint32_t magic;
  int rank;
  int elem_bytes;
  int swizzle_bytes;  // 0 or 128
  const void* base;
  uint64_t dims[5];
  uint64_t strides[5];  // bytes; strides[0] unused (elem_bytes)
  uint32_t box[5];
};
static_assert(sizeof(TensorMapDesc) <= 128, "a TensorMapDesc must fit a CUtensorMap");
// cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes [dst], [map, {coords}], [bar]
void tma_load(void* dst, const void* tmap, const int32_t* coords, void* bar);
void named_barrier_sync(int id, int nthreads);    // bar.sync id, nthreads (ids 1..15)
void named_barrier_arrive(int id, int nthreads);  // bar.arrive id, nthreads

// ---- Thread block clusters (launch_cluster). Distributed shared memory: map_shared_rank (mapa)
// returns the address of the same offset in another CTA's dynamic shared memory, which the calling
// thread then reads and writes with plain loads and stores, as on the GPU. barrier.cluster blocks
// until every live thread of every CTA of the cluster has arrived (arrive, then wait; a second
// arrive before the wait, or a wait without an arrive, is reported). mbar_arrive_cluster arrives on
// an mbarrier in another CTA (its address from map_shared_rank). When every thread of a CTA has
// exited, its shared memory is poisoned (0xFF) and a later mapa of it or arrival on it is reported:
// on the GPU a CTA must not exit while its peers still use its shared memory.
unsigned cluster_ctarank();                       // %cluster_ctarank
unsigned cluster_nctarank();                      // %cluster_nctarank
void* map_shared_rank(const void* p, unsigned rank);  // mapa (generic address)
void cluster_arrive();                            // barrier.cluster.arrive.release.aligned
void cluster_wait();                              // barrier.cluster.wait.acquire.aligned
void mbar_arrive_cluster(void* bar);              // mbarrier.arrive.release.cluster.shared::cluster.b64

// Shuffle / vote on 32-bit words (mode as in PTX shfl: 0 idx, 1 up, 2 down, 3 bfly; c as in PTX).
uint32_t shfl32(int mode, unsigned mask, uint32_t v, int b, int c);
unsigned ballot(unsigned mask, bool pred, unsigned* participants = nullptr);
void syncwarp(unsigned mask);
unsigned activemask();

}  // namespace kf_emu

// ======================================================================================================
// The CUDA device-side surface kernels use, in the global namespace (as nvcc provides it).
// ======================================================================================================
#undef __shared__
#define __shared__ static thread_local
#define __launch_bounds__(...)
#undef __grid_constant__
#define __grid_constant__
#define threadIdx (static_cast<const uint3&>(::kf_emu::detail::t_cur.tid))
#define blockIdx (static_cast<const uint3&>(::kf_emu::detail::t_cur.bid))
#define blockDim (static_cast<const dim3&>(::kf_emu::detail::t_cur.bdim))
#define gridDim (static_cast<const dim3&>(::kf_emu::detail::t_cur.gdim))
#define warpSize 32

inline void __syncthreads() { kf_emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { kf_emu::syncwarp(mask); }
inline unsigned __activemask() { return kf_emu::activemask(); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// ---- shuffles (any trivially copyable type of 4 or 8 bytes)
namespace kf_emu::detail {
template <typename T>
inline T shfl_any(int mode, unsigned mask, T v, int b, int width) {
  static_assert(std::is_trivially_copyable<T>::value && (sizeof(T) == 4 || sizeof(T) == 8),
                "kf_emu shuffles move 4- or 8-byte values");
  if (width < 1 || width > 32 || (width & (width - 1))) failf("shfl: width %d is not a power of 2 in [1, 32]", width);
  const int c = ((32 - width) << 8) | (mode == 1 ? 0 : 0x1f);
  uint32_t w[2] = {0, 0};
  std::memcpy(w, &v, sizeof(T));
  w[0] = shfl32(mode, mask, w[0], b, c);
  if (sizeof(T) == 8) w[1] = shfl32(mode, mask, w[1], b, c);
  T r;
  std::memcpy(&r, w, sizeof(T));
  return r;
}
}  // namespace kf_emu::detail
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return kf_emu::detail::shfl_any(0, mask, v, src_lane, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return kf_emu::detail::shfl_any(1, mask, v, static_cast<int>(delta), width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return kf_emu::detail::shfl_any(2, mask, v, static_cast<int>(delta), width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return kf_emu::detail::shfl_any(3, mask, v, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) { return kf_emu::ballot(mask, pred != 0); }
inline int __any_sync(unsigned mask, int pred) { return kf_emu::ballot(mask, pred != 0) != 0; }
inline int __all_sync(unsigned mask, int pred) {
  unsigned who = 0;
  const unsigned b = kf_emu::ballot(mask, pred != 0, &who);
  return b == who;
}

// ---- atomics (real host atomics: blocks may run on parallel workers)
template <typename T>
inline T kf_emu_atomic_rmw_float(T* p, T v, int kind) {  // kind 0 add, 1 max, 2 min
  T old;
  __atomic_load(p, &old, __ATOMIC_RELAXED);
  T want;
  do {
    want = kind == 0 ? old + v : (kind == 1 ? (old > v ? old : v) : (old < v ? old : v));
  } while (!__atomic_compare_exchange(p, &old, &want, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
  return old;
}
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline float atomicAdd(float* p, float v) { return kf_emu_atomic_rmw_float(p, v, 0); }
inline double atomicAdd(double* p, double v) { return kf_emu_atomic_rmw_float(p, v, 0); }
inline int atomicSub(int* p, int v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }
inline int atomicMax(int* p, int v) { return kf_emu_atomic_rmw_float(p, v, 1); }
inline int atomicMin(int* p, int v) { return kf_emu_atomic_rmw_float(p, v, 2); }
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline float atomicExch(float* p, float v) {
  float old;
  __atomic_exchange(p, &v, &old, __ATOMIC_SEQ_CST);
  return old;
}
inline int atomicCAS(int* p, int cmp, int v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAnd(unsigned* p, unsigned v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }

// ---- bit casts, intrinsics, math
inline float __uint_as_float(unsigned u) { return kf_emu::detail::u2f(u); }
inline unsigned __float_as_uint(float x) { return kf_emu::detail::f2u(x); }
inline float __int_as_float(int i) { return kf_emu::detail::u2f(static_cast<uint32_t>(i)); }
inline int __float_as_int(float x) { return static_cast<int>(kf_emu::detail::f2u(x)); }
inline double __longlong_as_double(long long i) {
  double d;
  std::memcpy(&d, &i, 8);
  return d;
}
inline long long __double_as_longlong(double d) {
  long long i;
  std::memcpy(&i, &d, 8);
  return i;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
template <typename T>
inline T __ldg(const T* p) { return *p; }

// SFU-style approximations: ex2.approx on x * log2(e), as nvcc compiles them.
inline float __expf(float x) { return kf_emu::ex2_approx_ftz(x * 1.4426950408889634f); }
inline float __exp10f(float x) { return kf_emu::ex2_approx_ftz(x * 3.3219280948873622f); }
inline float __logf(float x) { return kf_emu::lg2_approx_ftz(x) * 0.6931471805599453f; }
inline float __log2f(float x) { return kf_emu::lg2_approx_ftz(x); }
inline float __powf(float x, float y) { return kf_emu::ex2_approx_ftz(y * kf_emu::lg2_approx_ftz(x)); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanhf(float x) { return std::tanh(x); }
// __fdividef: x * rcp.approx(y); 0 for 2^126 < |y| < 2^128 (the reciprocal flushes), NaN for inf / inf.
inline float __fdividef(float x, float y) { return x * kf_emu::ftz(1.f / y); }
inline float __frcp_rn(float x) { return 1.f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.f / std::sqrt(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __saturatef(float x) { return std::isnan(x) ? 0.f : (x < 0.f ? 0.f : (x > 1.f ? 1.f : x)); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float exp10f(float x) { return std::pow(10.f, x); }

// CUDA's integer / float min and max overloads.
#define KF_EMU_MINMAX(T)                              \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
KF_EMU_MINMAX(int)
KF_EMU_MINMAX(unsigned)
KF_EMU_MINMAX(long)
KF_EMU_MINMAX(unsigned long)
KF_EMU_MINMAX(long long)
KF_EMU_MINMAX(unsigned long long)
#undef KF_EMU_MINMAX
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }

// Generic -> shared state space (what __cvta_generic_to_shared gives on the GPU: a 32-bit offset).
inline size_t __cvta_generic_to_shared(const void* p) { return kf_emu::shared_offset(p); }
