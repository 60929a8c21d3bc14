// The Hopper asynchronous pipeline, one thin wrapper per PTX instruction: mbarriers, bulk copies
// (TMA, 1-D and through a tensor map) and named barriers, for warp-specialised kernels whose
// producer warp loads stages that consumer warps wait for and release. Under KF_EMU each wrapper
// calls the host emulator (tests/emu/kf_emu.h), which defers the copies to the consumers' waits
// and poisons what a thread reads too early; csrc/common/tma_desc.h builds the tensor maps.
//
// The protocol these serve (per stage s of a ring, a "full" and an "empty" mbarrier):
//   producer: wait empty[s] (parity starting at 1, so the first pass does not block), arrive on
//             full[s] announcing the stage's bytes, issue the copies completing on full[s];
//   consumers: wait full[s] (parity starting at 0), read the stage, arrive on empty[s].
// The parity flips every time the ring wraps.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cstdint>

namespace kernel_fun::dev {

__device__ __forceinline__ uint32_t smem_u32addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// mbarrier.init: `count` arrivals complete a phase (with the transaction bytes announced for it).
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#ifdef KF_EMU
  kf_emu::mbar_init(bar, count);
#else
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32addr(bar)), "r"(count) : "memory");
#endif
}

// After the inits and before the __syncthreads that publishes them: makes them visible to the
// asynchronous proxy (the copy engine completes transactions on them).
__device__ __forceinline__ void mbar_init_fence() {
#ifndef KF_EMU
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#ifdef KF_EMU
  kf_emu::mbar_arrive(bar);
#else
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared::cta.b64 st, [%0];\n\t}" ::"r"(smem_u32addr(bar))
               : "memory");
#endif
}

// Arrive and announce `bytes` of copies that will complete on this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef KF_EMU
  kf_emu::mbar_arrive_expect_tx(bar, bytes);
#else
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}" ::"r"(
                   smem_u32addr(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// Until the phase of this parity has completed (try_wait may give up after a time limit: loop).
// kCluster: a phase completed by arrivals from other CTAs (mbar_arrive_remote): acquire at cluster
// scope, so their writes into this CTA's shared memory are visible after it.
template <bool kCluster = false>
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
#ifdef KF_EMU
  kf_emu::mbar_try_wait(bar, parity);
#else
  uint32_t done;
  do {
    if constexpr (kCluster) {
      asm volatile(
          "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
          "selp.u32 %0, 1, 0, p;\n\t}"
          : "=r"(done)
          : "r"(smem_u32addr(bar)), "r"(parity)
          : "memory");
    } else {
      asm volatile(
          "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
          : "=r"(done)
          : "r"(smem_u32addr(bar)), "r"(parity)
          : "memory");
    }
  } while (!done);
#endif
}

// 1-D bulk copy global -> shared (16-byte aligned, a multiple of 16 bytes), completing on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#ifdef KF_EMU
  kf_emu::bulk_g2s(dst, src, bytes, bar);
#else
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32addr(bar))
               : "memory");
#endif
}

// One box of a tiled tensor map (coordinates in elements, innermost first), completing on `bar`.
// `map` is a __grid_constant__ kernel parameter (or lives in global memory).
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
#ifdef KF_EMU
  const int32_t c[2] = {c0, c1};
  kf_emu::tma_load(dst, map, c, bar);
#else
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(smem_u32addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32addr(bar))
      : "memory");
#endif
}
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint64_t* bar) {
#ifdef KF_EMU
  const int32_t c[3] = {c0, c1, c2};
  kf_emu::tma_load(dst, map, c, bar);
#else
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(smem_u32addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32addr(bar))
      : "memory");
#endif
}

// Named barriers (ids 1..15; 0 is __syncthreads'): `nthreads` (a multiple of 32) threads meet;
// arrive signals without waiting (a producer handing a stage to waiting consumers).
__device__ __forceinline__ void named_sync(int id, int nthreads) {
#ifdef KF_EMU
  kf_emu::named_barrier_sync(id, nthreads);
#else
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
#endif
}
__device__ __forceinline__ void named_arrive(int id, int nthreads) {
#ifdef KF_EMU
  kf_emu::named_barrier_arrive(id, nthreads);
#else
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
#endif
}


// ---- Thread block clusters (a launch with cudaLaunchAttributeClusterDimension): the CTAs of a
// cluster run on neighbouring SMs and reach each other's shared memory (distributed shared memory).
// The handoff these serve: a producer CTA writes a stage into a consumer CTA's shared memory
// through map_shared_rank, then arrives on the consumer's "full" mbarrier (mbar_arrive_remote);
// the consumer waits on it locally (mbar_wait<true>) and releases the stage by arriving on the
// producer's "empty" barrier the same way. cluster_sync after the mbarrier inits (so no CTA arrives on a peer's
// barrier before it exists) and before any CTA exits (so none writes into a peer that is gone).
__device__ __forceinline__ uint32_t cluster_ctarank() {
#ifdef KF_EMU
  return kf_emu::cluster_ctarank();
#else
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
#endif
}
__device__ __forceinline__ uint32_t cluster_nctarank() {
#ifdef KF_EMU
  return kf_emu::cluster_nctarank();
#else
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
#endif
}

// The same shared-memory object in the CTA of cluster rank `rank` (a generic address: plain loads
// and stores reach it).
template <typename T>
__device__ __forceinline__ T* map_shared_rank(T* p, uint32_t rank) {
#ifdef KF_EMU
  return static_cast<T*>(kf_emu::map_shared_rank(p, rank));
#else
  uint64_t r;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(r) : "l"(reinterpret_cast<uint64_t>(p)), "r"(rank));
  return reinterpret_cast<T*>(r);
#endif
}

// barrier.cluster: every thread of every CTA of the cluster arrives, then waits (release /
// acquire: the shared-memory writes before the arrive are visible after the wait, cluster-wide).
__device__ __forceinline__ void cluster_arrive() {
#ifdef KF_EMU
  kf_emu::cluster_arrive();
#else
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#ifdef KF_EMU
  kf_emu::cluster_wait();
#else
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// Arrive on the mbarrier at `bar` (an address in this CTA's shared memory) of the CTA of cluster
// rank `rank`, with release semantics at cluster scope: the writes this thread made into that CTA's
// shared memory before are visible to whoever waits on the barrier's phase.
__device__ __forceinline__ void mbar_arrive_remote(uint64_t* bar, uint32_t rank) {
#ifdef KF_EMU
  kf_emu::mbar_arrive_cluster(kf_emu::map_shared_rank(bar, rank));
#else
  asm volatile(
      "{\n\t.reg .b32 ra;\n\tmapa.shared::cluster.u32 ra, %0, %1;\n\t"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n\t}" ::"r"(smem_u32addr(bar)),
      "r"(rank)
      : "memory");
#endif
}


}  // namespace kernel_fun::dev
