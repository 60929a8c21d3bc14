// The sequence map every KDA kernel shares: where sequence n lives in the flattened token axis,
// and which (sequence, chunk) a per-chunk CTA owns. With cu_seqlens the chunk map
// (chunk_offsets, built on the device by kda_chunk_map) replaces any host round trip.
#pragma once

#include <cstdint>
#ifdef KF_EMU
#include <chrono>
#include <thread>
#endif

#include "kda/device/primitives.cuh"
#include "kda/kda_launch_shape.h"
#include "kda/kda_problem.h"

namespace kernel_fun::kda::dev {

__device__ __forceinline__ int64_t load_cu(const KdaProblem& p, int i) {
  return p.cu_int64 ? reinterpret_cast<const int64_t*>(p.cu_seqlens)[i]
                    : static_cast<int64_t>(reinterpret_cast<const int*>(p.cu_seqlens)[i]);
}

// Token range [bos, bos + len) of sequence n in the flattened [B*T] token axis, and its first
// global chunk index (the row of gdecay and of the per-chunk checkpoints) at C tokens per chunk (with
// cu_seqlens the chunk map was built at the call's size: kda_chunk_map).
struct SeqInfo {
  int64_t bos;
  int len;
  int chunk0;
};
template <int C = kChunk>
__device__ __forceinline__ SeqInfo seq_info(const KdaProblem& p, int n) {
  SeqInfo s;
  if (p.cu_seqlens) {
    s.bos = load_cu(p, n);
    s.len = static_cast<int>(load_cu(p, n + 1) - s.bos);
    s.chunk0 = p.chunk_offsets[n];
  } else {
    s.bos = static_cast<int64_t>(n) * p.T;
    s.len = p.T;
    s.chunk0 = n * ((p.T + C - 1) / C);
  }
  return s;
}

// The fp32 states h0 / ht / dht / dh0: [N, HV, K, V], or [N, HV, V, K] with state_v_first.
// state_base: the first element of sequence n's, value head hv's state; state_offset: element (k, v)
// within it.
template <int K>
__device__ __forceinline__ int64_t state_base(const KdaProblem& p, int n, int hv) {
  return (static_cast<int64_t>(n) * p.HV + hv) * K * p.V;
}
template <int K>
__device__ __forceinline__ int64_t state_offset(const KdaProblem& p, int k, int v) {
  return p.opt.state_v_first ? static_cast<int64_t>(v) * K + k : static_cast<int64_t>(k) * p.V + v;
}

// The sequence a serial scan CTA (one per V-slice, value head and sequence) works on: the z-th
// longest. With cu_seqlens the chunk map lists the sequences by chunk count, longest first, after
// the offsets (chunk_offsets[N + 1 + z], see kda_chunk_map), so the longest documents' chains are
// in the grid's first wave instead of wherever the packing put them: the scan's time is the
// makespan of chains of unequal length, and the block scheduler starts CTAs in grid order (the
// bench's varlen case, 6 documents on 132 SMs: 89 -> 67 chunk steps in a list-schedule model). Only
// the schedule changes: every CTA's result is the same whichever blockIdx runs it.
__device__ __forceinline__ int scan_sequence(const KdaProblem& p, int z) {
  return p.cu_seqlens ? p.chunk_offsets[p.N + 1 + z] : z;
}

// The number of chunks of sequence n (from the chunk map: no sequence lengths read).
__device__ __forceinline__ int seq_chunks(const KdaProblem& p, int n) {
  return p.cu_seqlens ? p.chunk_offsets[n + 1] - p.chunk_offsets[n] : (p.T + kChunk - 1) / kChunk;
}

// The (sequence n, chunk c within it) of global chunk x; false when x is past the last chunk (the
// varlen grid is sized by an upper bound, T / C + N (chunk_bound), so its tail CTAs have nothing to do). C: tokens
// per chunk (the varlen map, chunk_offsets, is built at the call's size: kda_chunk_map).
template <int C = kChunk>
__device__ __forceinline__ bool chunk_of(const KdaProblem& p, int x, int& n, int& c) {
  if (p.cu_seqlens) {
    if (x >= p.chunk_offsets[p.N]) return false;
    int lo = 0, hi = p.N - 1;  // the largest n with chunk_offsets[n] <= x (empty sequences share offsets)
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (p.chunk_offsets[mid] <= x) lo = mid; else hi = mid - 1;
    }
    n = lo;
    c = x - p.chunk_offsets[n];
  } else {
    const int nts = (p.T + C - 1) / C;
    n = x / nts;
    c = x % nts;
  }
  return true;
}

// Where one CTA of the per-chunk kernels (kda_fwd_intra, kda_bwd_grads) works: its thread's place in
// the CTA, its value head (and query head, GVA), and its chunk: first token, length, global index.
struct ChunkPlace {
  int tid, lane, warp;
  int hv, h, HV;
  int64_t tok0;
  int len, gchunk;
  // chunk: the tokens per chunk (kChunk; 32 for the short-chunk intra, whose seq.chunk0
  // then counts chunks of that size).
  __device__ __forceinline__ ChunkPlace(const KdaProblem& p, const SeqInfo& seq, int c, int hv_, int chunk = kChunk) {
    tid = threadIdx.x;
    lane = tid & 31;
    warp = tid >> 5;
    hv = hv_;
    HV = p.HV;
    h = hv / (HV / p.H);
    tok0 = seq.bos + static_cast<int64_t>(c) * chunk;
    len = min(chunk, seq.len - c * chunk);
    gchunk = seq.chunk0 + c;
  }
};

// The number of chunks that exist (the varlen grid's upper bound minus its idle tail).
__device__ __forceinline__ int total_chunks(const KdaProblem& p) {
  return p.cu_seqlens ? p.chunk_offsets[p.N] : p.N * ((p.T + kChunk - 1) / kChunk);
}

// Lets the next kernel on the stream, when launched with LaunchShape::overlap_previous, start before
// this one ends (griddepcontrol.launch_dependents; a no-op otherwise and in the emulator, which runs
// launches one after the other).
__device__ __forceinline__ void launch_dependents() {
#ifndef KF_EMU
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// In a kernel launched with LaunchShape::overlap_previous: waits until the previous kernel on the stream
// has completed and its writes are visible (griddepcontrol.wait). A kernel that reads nothing of the
// previous one calls it last, so that it never completes before that one (the stream's next kernel
// then sees both).
__device__ __forceinline__ void wait_previous() {
#ifndef KF_EMU
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ---- the streamed forward (kda_policy.h's fwd_stream_choice): kda_fwd_intra beside the waiting scan

// The global chunk that row y of the streamed intra grid computes: chunk c = y / N of sequence
// n = y % N (fixed length only), so that chunk c of every sequence is handed out before any chunk
// c + 1 and every chain the scan runs gets its next chunk at the same pace. C: tokens per chunk (the
// 64-token or the 32-token forward's intra).
template <int C = kChunk>
__device__ __forceinline__ int streamed_chunk(const KdaProblem& p, int y) {
  const int nts = (p.T + C - 1) / C;
  return (y % p.N) * nts + y / p.N;
}

// The (chunk row, value head) an intra CTA computes, at either chunk size C: the grid's (x, y); in
// the streamed forward (p.chunk_ready set) its transposed grid (intra_grid in kda_launch_shape.h),
// value head in x and the chunk row in streamed_chunk<C>'s order in y. A streamed CTA publishes its
// chunk when done (publish, below).
struct IntraCell {
  int x, hv;
  bool streamed;
};
template <int C = kChunk>
__device__ __forceinline__ IntraCell intra_cell(const KdaFwdParams& p) {
  const bool streamed = p.chunk_ready != nullptr;
  return {streamed ? streamed_chunk<C>(p, blockIdx.y) : static_cast<int>(blockIdx.x),
          static_cast<int>(streamed ? blockIdx.x : blockIdx.y), streamed};
}

// The scan side (thread 0): whether the intra CTA of (global chunk, value head) has published its
// workspace rows (its flag in p.chunk_ready is 1); the CTA barrier that follows the call carries
// the acquire to the threads that then load the rows. It gives up after kStreamWaitNs without the
// flag: when the two kernels cannot run at once (CUDA_LAUNCH_BLOCKING=1, a profiler or a sanitizer
// that serialises launches, SMs held by other work) the intra starts only after the scan ends, and
// a scan that waited for it would never end. The chain then stops and the resume pass, launched
// after the intra, finishes it (kda_fwd_scan.cuh): the same results, later. In the host emulator
// launches run one after another and the flag is read once (the test chooses the order).
constexpr long long kStreamWaitNs = 2000000;  // 2 ms without the next chunk: the intra is not running beside

// The cross-kernel signals of the streamed forward and the streamed backward: a counter another
// kernel's CTA raises with a release store after its stores are visible at GPU scope, and a waiter
// that polls it with acquire loads (its own later loads then see those stores). In the host emulator
// launches run one after another: the counter is read once.
__device__ __forceinline__ void store_release(int* p, int v) {
#ifdef KF_EMU
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#else
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}
// The counter's two reads at GPU scope: acquire (this thread's later loads see what the releasing
// writer stored before its release) and relaxed (the value alone, no ordering of its own).
template <bool kAcquire>
__device__ __forceinline__ int load_counter(const int* p) {
#ifdef KF_EMU
  return __atomic_load_n(p, kAcquire ? __ATOMIC_ACQUIRE : __ATOMIC_RELAXED);
#else
  int v;
  if constexpr (kAcquire) asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}
__device__ __forceinline__ int load_acquire(const int* p) { return load_counter<true>(p); }
__device__ __forceinline__ int load_relaxed(const int* p) { return load_counter<false>(p); }
// Whether *p reached `need` within timeout_ns (polled every ~sleep_ns); false on the timeout.
__device__ __forceinline__ bool wait_at_least(const int* p, int need, long long timeout_ns, unsigned sleep_ns) {
#ifdef KF_EMU
  (void)timeout_ns;
  (void)sleep_ns;
  return load_acquire(p) >= need;
#else
  long long t0 = -1;
  for (;;) {
    if (load_acquire(p) >= need) return true;
    long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (t0 < 0) t0 = now;
    else if (now - t0 > timeout_ns) return false;
    __nanosleep(sleep_ns);
  }
#endif
}
__device__ __forceinline__ bool wait_chunk_ready(const int* flag) { return wait_at_least(flag, 1, kStreamWaitNs, 100); }

// A wait on another CTA of the SAME grid (thread 0), one that comes earlier in the grid's order and so
// was handed out to an SM before this one (the hardware hands out CTAs in grid order, which the
// streamed kernels rely on too): it always runs to its release, whatever this CTA does, so the wait
// ends within that CTA's lifetime (tens of us). A wait past kEarlierCtaWaitNs can only be a broken
// assumption (a count never released, CTAs handed out out of order): it traps, a launch error the
// caller sees, rather than hang the device. In the host emulator the blocks start in grid order, one
// at a time per worker, so the earlier block has started too; it may still be running on another
// worker: spin, yielding, and fail past the same bound.
constexpr long long kEarlierCtaWaitNs = 4000000000LL;  // 4 s
__device__ __forceinline__ void wait_earlier_cta(const int* p, int need) {
#ifdef KF_EMU
  const auto t0 = std::chrono::steady_clock::now();
  while (load_acquire(p) < need) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::nanoseconds(kEarlierCtaWaitNs))
      kf_emu::detail::failf("wait_earlier_cta: the counter stayed at %d, below %d", load_acquire(p), need);
    std::this_thread::yield();
  }
#else
  if (!wait_at_least(p, need, kEarlierCtaWaitNs, 200)) __trap();
#endif
}

// The scan side, one chunk ahead (thread 0): a 16-byte cp.async.cg of the aligned group of four
// flags that holds chunk cc's, into `slot`, issued while the chunk before cc computes, so that when
// the intra is ahead the verdict on cc needs no round trip to L2 on the chain's critical path
// (measured on the H200: the streamed forwards 2 .. 2.6% faster than with an `ld.acquire` before
// every step's barrier). The copy reads L2, the coherence point, and the chunk's rows are loaded only
// after the copy has landed and a CTA barrier has passed; the intra CTA made its rows visible at GPU
// scope (publish_chunk's __threadfence) before its flag's store, so a flag seen as 1 here means the
// rows are in L2 (the writer-fence / reader-sees-flag pattern of the CUDA guide's __threadfence
// example, with L1 bypassed). A flag seen as 0 falls back to wait_chunk_ready. chunk_ready ends with
// padding (stream_flag_count), so the group of the last flag stays inside it.
__device__ __forceinline__ void prefetch_flag(int* slot, const int* flag) {
  cp_async16(slot, reinterpret_cast<const int*>(reinterpret_cast<uintptr_t>(flag) & ~uintptr_t{15}), 16);
}
__device__ __forceinline__ bool flag_seen(const int* slot, const int* flag) {
  return slot[(reinterpret_cast<uintptr_t>(flag) >> 2) & 3] == 1;
}

// The intra side, after the CTA's last workspace store (every thread calls it): each thread's
// stores are made visible at GPU scope before thread 0 sets the chunk's flag (release), and the CTA
// counts itself done (the counter after the flags, stream_done_offset). The CTA that finds itself last
// waits for the scan (griddepcontrol.wait: the scan is this launch's prerequisite grid), so this
// kernel never completes before the scan, and the stream's next operation sees both. Only the last
// CTA waits: the scan it waits for needs nothing more from the intra by then, whereas a wait in
// every CTA would hold SMs that unpublished intra CTAs need.
__device__ __forceinline__ void publish_chunk(const KdaFwdParams& p, int64_t flag_index) {
  __threadfence();
  const unsigned total = gridDim.x * gridDim.y * gridDim.z;
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    store_release(p.chunk_ready + flag_index, 1);
    int* done = p.chunk_ready + stream_done_offset(p);
    last = static_cast<unsigned>(atomicAdd(done, 1)) == total - 1;
  }
  __syncthreads();
  if (last) wait_previous();
}
// The intra CTA's end in the streamed forward: its chunk's flag (every thread calls it); nothing otherwise.
__device__ __forceinline__ void publish_cell(const KdaFwdParams& p, const IntraCell& cell) {
  if (cell.streamed) publish_chunk(p, static_cast<int64_t>(cell.x) * p.HV + cell.hv);
}

#ifndef KF_EMU
// Launches a kernel as its description says (kda_launch_shape.h; every KDA launcher goes through
// here): dynamic smem opted in, nothing launched for an empty problem.
template <typename Params>
void launch(void (*kern)(Params), const LaunchShape& s, const Params& p, cudaStream_t stream) {
  KF_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(s.smem)));
  if (s.empty()) return;
  const bool cluster = s.cluster.x * s.cluster.y * s.cluster.z != 1;
  if (!cluster && !s.overlap_previous) {
    kern<<<s.grid, s.threads, s.smem, stream>>>(p);
  } else {  // a cluster launch (distributed shared memory between the cluster's CTAs) and / or an overlap
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = s.grid;
    cfg.blockDim = dim3(s.threads);
    cfg.dynamicSmemBytes = s.smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[2];
    unsigned n = 0;
    if (cluster) {
      attr[n].id = cudaLaunchAttributeClusterDimension;
      attr[n].val.clusterDim.x = s.cluster.x;
      attr[n].val.clusterDim.y = s.cluster.y;
      attr[n].val.clusterDim.z = s.cluster.z;
      ++n;
    }
    if (s.overlap_previous) {
      attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    cfg.attrs = attr;
    cfg.numAttrs = n;
    KF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, p));
  }
  KF_CHECK_LAUNCH();
}

// The per-chunk kernels (kda_fwd_intra, kda_bwd_prep, kda_bwd_grads) also ask for the largest
// shared-memory carveout (they run one or two CTAs of ~100-210 KB per SM).
template <typename Params>
void launch_chunk_kernel(void (*kern)(Params), const LaunchShape& s, const Params& p, cudaStream_t stream) {
  KF_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     cudaSharedmemCarveoutMaxShared));
  launch(kern, s, p, stream);
}
#endif

}  // namespace kernel_fun::kda::dev
