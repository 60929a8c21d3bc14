// KDA forward: dispatch over (dtype, K, V-slice), the varlen chunk map, and the forward's stage
// sequence.
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/warp/warp_scan.cuh>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/device_info.h"
#include "common/env.h"
#include "kda/device/sequence.cuh"
#include "kda/fwd/kda_fwd_launch.h"
#include "kda/fwd/kda_fwd_split.cuh"
#include "kda/kda_dispatch.h"
#include "kda/kda_launch.h"
#include "kda/kda_policy.h"
#include "kda/kda_sequence.h"

namespace kernel_fun::kda {

namespace {

constexpr int kMapThreads = 1024;
// The map orders up to kMaxOrderedSequences in its one CTA, kOrderItems per thread; past that many
// the order is the identity (thousands of sequences make thousands of short scan chains per head,
// where the order hardly moves the makespan).
constexpr int kOrderItems = kMaxOrderedSequences / kMapThreads;
static_assert(kOrderItems * kMapThreads == kMaxOrderedSequences, "whole items per thread");

template <int C>
__device__ __forceinline__ int seq_len_chunks(const KdaProblem& p, int n) {
  return static_cast<int>((dev::load_cu(p, n + 1) - dev::load_cu(p, n) + C - 1) / C);
}

// The varlen chunk map, one CTA, so no host round trip is ever needed (cu_seqlens stays on the
// device, int32 or int64). C: tokens per chunk (64; 32 for the 32-token forward).
// chunk_offsets holds 2N + 1 ints:
//   [0, N]      chunk_offsets[n] = sum_{m < n} ceil(len_m / C): the first global chunk of sequence n;
//   [N+1, 2N]   the sequences by chunk count, longest first (ties in index order), for the scans'
//               grid (dev::scan_sequence): a schedule only, no result depends on it.
//
// Up to 32 sequences (a packed batch of a few documents, the common case) one warp does it all with
// shuffles (cub's warp scan, and a rank found by counting), in a fraction of the CTA-wide scan's
// and radix sort's time (which serve the rest); the map sits on the forward's and the backward's
// critical path, ahead of everything.
template <int C>
__global__ void __launch_bounds__(kMapThreads) kda_chunk_map_kernel(const KdaProblem p) {
  if (p.N <= 32) {
    if (threadIdx.x >= 32) return;
    const int n = threadIdx.x;
    const int nc = n < p.N ? seq_len_chunks<C>(p, n) : 0;
    __shared__ typename cub::WarpScan<int>::TempStorage warp_scan;  // shuffles only on sm_90
    int excl, total;
    cub::WarpScan<int>(warp_scan).ExclusiveSum(nc, excl, total);  // the padding lanes add 0
    if (n < p.N) p.chunk_offsets[n] = excl;
    if (n == 0) p.chunk_offsets[p.N] = total;
    // rank n among the sequences: longer first, ties in index order (the radix sort's order below)
    int rank = 0;
#pragma unroll
    for (int m = 0; m < 32; ++m) {
      const int other = __shfl_sync(~0u, nc, m);
      rank += m < p.N && (other > nc || (other == nc && m < n));
    }
    if (n < p.N) p.chunk_offsets[p.N + 1 + rank] = n;
    return;
  }
  using Scan = cub::BlockScan<int, kMapThreads>;
  using Sort = cub::BlockRadixSort<unsigned, kMapThreads, kOrderItems, int>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Sort::TempStorage sort;
  } tmp;
  __shared__ int carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < p.N; base += kMapThreads) {
    const int n = base + threadIdx.x;
    const int nc = n < p.N ? seq_len_chunks<C>(p, n) : 0;
    int excl, total;
    Scan(tmp.scan).ExclusiveSum(nc, excl, total);
    const int c0 = carry;
    if (n < p.N) p.chunk_offsets[n] = c0 + excl;
    __syncthreads();
    if (threadIdx.x == 0) carry = c0 + total;
    __syncthreads();
  }
  if (threadIdx.x == 0) p.chunk_offsets[p.N] = carry;
  int* order = p.chunk_offsets + p.N + 1;
  if (p.N > kMaxOrderedSequences) {
    for (int n = threadIdx.x; n < p.N; n += kMapThreads) order[n] = n;
    return;
  }
  // Blocked arrangement: thread t holds sequences [t * kOrderItems, (t + 1) * kOrderItems), keyed by
  // chunk count + 1, the padding by 0 (sorted behind every real sequence); the radix sort keeps
  // equal keys in arrangement order, so ties stay in index order. It sorts only the bits a key can
  // have (no count exceeds the total, `carry`): 2 passes of 4 bits for the bench's varlen case
  // instead of 8.
  unsigned key[kOrderItems];
  int val[kOrderItems];
  for (int i = 0; i < kOrderItems; ++i) {
    const int n = threadIdx.x * kOrderItems + i;
    key[i] = n < p.N ? static_cast<unsigned>(seq_len_chunks<C>(p, n)) + 1u : 0u;
    val[i] = n;
  }
  const int end_bit = 32 - __clz(static_cast<unsigned>(carry) + 1u);
  __syncthreads();  // tmp's scan storage is reused by the sort
  Sort(tmp.sort).SortDescending(key, val, 0, end_bit);
  for (int i = 0; i < kOrderItems; ++i) {
    const int r = threadIdx.x * kOrderItems + i;
    if (r < p.N) order[r] = val[i];
  }
}

}  // namespace

void kda_chunk_map(const KdaProblem& p, cudaStream_t stream) {
  if (!p.cu_seqlens) return;
  if (p.fwd_chunk == kC32) kda_chunk_map_kernel<kC32><<<1, kMapThreads, 0, stream>>>(p);
  else kda_chunk_map_kernel<kChunk><<<1, kMapThreads, 0, stream>>>(p);
  KF_CHECK_LAUNCH();
}

void kda_fwd_intra(const KdaFwdParams& p, cudaStream_t stream) {
  dispatch_wt_k(p.dtype, p.K, "kda_fwd_intra", [&](auto wt, auto k) {
    launch_intra<typename decltype(wt)::type, decltype(k)::value>(p, stream);
  });
}

int kda_scan_bv_override(const KdaProblem& p) {
  const int forced = env_int("KERNEL_FUN_KDA_SCAN_BV", 0);  // benchmarking override: 64 or 128
  return (forced == 64 || forced == 128) && p.V % forced == 0 && p.id_cols % forced == 0 ? forced : 0;
}

int kda_fwd_scan_bv(const KdaFwdParams& p) {
  if (p.chunk_ready) return p.stream_bv;  // the streamed forward's width (kda_forward decided it once)
  if (p.split_bv) return p.split_bv;      // the split forward's (likewise)
  const int forced = kda_scan_bv_override(p);
  return forced ? forced : fwd_scan_bv_alone(p);
}

namespace {

// The streamed forward's width for p's shape, whether or not its buffers are there (kda_fwd_stream_bv
// checks them; kda_fwd_chunk_choice asks before they are allocated).
// KERNEL_FUN_KDA_FWD_STREAMED: unset or 2 the model decides (kda_policy.h's fwd_stream_choice); 0
// never streams; 1 streams wherever the overlap is possible (the width KERNEL_FUN_KDA_SCAN_BV if set
// and possible, else the model's, else the widest): A/B timing and tests. The default since the
// H200 timed it (2026-12-03, twelfth session: docs/notes/2026-12-03-streamed-forward.md).
int stream_bv_for(const KdaFwdParams& p) {
  const int mode = env_int("KERNEL_FUN_KDA_FWD_STREAMED", 2);
  if (mode <= 0 || mode > 2) return 0;
  const int sms = num_sms();
  const int model = fwd_stream_choice(p, sms).bv;
  if (mode == 2) return model;
  const int forced = env_int("KERNEL_FUN_KDA_SCAN_BV", 0);
  if (fwd_stream_safe(p, forced, sms)) return forced;
  if (model) return model;
  for (int bv : {128, 64})
    if (fwd_stream_safe(p, bv, sms)) return bv;
  return 0;
}

}  // namespace

int kda_fwd_stream_bv(const KdaFwdParams& p) {
  // its buffers given; never with the split scans (kda_split_choose)
  return p.chunk_ready && p.scan_save && p.split_chunks == 0 ? stream_bv_for(p) : 0;
}

void kda_fwd_scan(const KdaFwdParams& p, cudaStream_t stream) {
  if (p.V % 64 != 0) throw std::invalid_argument("kda_fwd_scan: V must be a multiple of 64");
  dispatch_wt_k_bv(p.dtype, p.K, kda_fwd_scan_bv(p), "kda_fwd_scan", [&](auto wt, auto k, auto bv) {
    launch_scan<typename decltype(wt)::type, decltype(k)::value, decltype(bv)::value>(p, stream);
  });
}

void kda_fwd_streamed(const KdaFwdParams& p, cudaStream_t stream) {
  // Order on the stream: the flags and resume chunks zeroed; the scan's pass 1 (its CTAs resident,
  // triggering the intra's launch at their start, waiting for flags); the intra beside it
  // (intra_launch: overlap_previous; its last CTA waits for pass 1, so the stream's next work sees
  // both); pass 2, which finishes any chain pass 1 stopped (none when the two ran at once).
  KF_CUDA_CHECK(cudaMemsetAsync(p.chunk_ready, 0, sizeof(int) * static_cast<size_t>(stream_flag_count(p)), stream));
  // At either chunk size (p.fwd_chunk: the 32-token forward streams the same way).
  auto* scan = p.fwd_chunk == kC32 ? kda_fwd_scan_c32 : kda_fwd_scan;
  auto* intra = p.fwd_chunk == kC32 ? kda_fwd_intra_c32 : kda_fwd_intra;
  KdaFwdParams pass = p;
  pass.scan_pass = 1;
  scan(pass, stream);
  intra(p, stream);
  pass.scan_pass = 2;
  scan(pass, stream);
}

void kda_split_choose(KdaFwdParams& p) {
  p.split_chunks = p.split_bv = 0;
  const int mode = p.opt.split;  // the front's switches, in the options: the backward decides alike
  if (p.recurrent || mode <= 0 || mode > 2 || !fwd_split_possible(p)) return;
  const SplitChoice c = fwd_split_choice(p, num_sms());
  int chunks = c.chunks;
  if (mode == 1) {
    const int forced = p.opt.split_chunks;
    chunks = split_chunks_for(p, forced > 0 ? forced : c.chunks > 0 ? c.chunks : (p.max_chunks + 7) / 8);
  }
  if (chunks == 0) return;
  const int forced_bv = kda_scan_bv_override(p);  // divides V; the virtual columns need K too
  p.split_bv = forced_bv && p.K % forced_bv == 0 ? forced_bv : (c.bv ? c.bv : 64);
  p.split_chunks = chunks;
}

void kda_split_map(const KdaFwdParams& p, cudaStream_t stream) {
  dev::launch(kda_split_map_kernel, split_map_launch(p), p, stream);
}

void kda_fwd_scan_local(const KdaFwdParams& p, cudaStream_t stream) {
  if (p.K % p.split_bv != 0 || p.V % p.split_bv != 0)  // the virtual columns are whole slices
    throw std::invalid_argument("kda_fwd_scan_local: the value slice must divide V and K");
  dispatch_wt_k_bv(p.dtype, p.K, p.split_bv, "kda_fwd_scan_local", [&](auto wt, auto k, auto bv) {
    launch_scan_local<typename decltype(wt)::type, decltype(k)::value, decltype(bv)::value>(p, stream);
  });
}

void kda_split_chain(const KdaFwdParams& p, bool reverse, cudaStream_t stream) {
  const SplitChainLaunch c = split_chain_launch(p, reverse, split_chain_cols(p, num_sms()));
  dev::launch(c.kernel, c.shape, p, stream);
}

void kda_split_final(const KdaFwdParams& p, bool reverse, cudaStream_t stream) {
  dev::launch(reverse ? kda_split_final_kernel<true> : kda_split_final_kernel<false>, split_final_launch(p), p, stream);
}

bool kda_fwd_fused_wanted(const KdaFwdParams& p) {
  // KERNEL_FUN_KDA_FWD_FUSED=1 opts in (timing only). Version 0 writes o and the final state only:
  // not where the forward saves its factors for the backward (M set), nor the per-chunk states;
  // value slices of 128.
  return env_int("KERNEL_FUN_KDA_FWD_FUSED", 0) == 1 && !p.M && !p.h_states && !p.id_cols && p.V % 128 == 0;
}

void kda_fwd_fused(const KdaFwdParams& p, cudaStream_t stream) {
  dispatch_wt_k(p.dtype, p.K, "kda_fwd_fused", [&](auto wt, auto k) {
    launch_fused<typename decltype(wt)::type, decltype(k)::value, 128>(p, stream);
  });
}

int kda_fwd_chunk_choice(const KdaFwdParams& p) {
  // the fused forward (opt-in, KERNEL_FUN_KDA_FWD_FUSED=1) reads a chunk map of 64-token chunks
  const bool allowed = !p.M && !p.h_states && !p.h_ckpt && !p.recurrent && p.split_chunks == 0 && !p.id_cols &&
                       p.K == 128 && p.V % 64 == 0 && !kda_fwd_fused_wanted(p);
  if (!allowed) return kChunk;
  // KERNEL_FUN_KDA_FWD_CHUNK: 64 never takes the short chunks, 32 takes them wherever allowed (A/B
  // timing and tests; streamed where the call streams, kda_fwd_stream_bv); unset (or anything else) the
  // policy, kda_policy.h's fwd_short_chunks_pay.
  const int forced = env_int("KERNEL_FUN_KDA_FWD_CHUNK", 0);
  if (forced == kChunk || forced == kC32) return forced;
  return fwd_short_chunks_pay(p, stream_bv_for(p) != 0) ? kC32 : kChunk;
}

void kda_fwd_intra_c32(const KdaFwdParams& p, cudaStream_t stream) {
  if (p.K != 128) throw std::invalid_argument("kda_fwd_intra_c32: K = 128 only");
  dispatch_wt(p.dtype, "kda_fwd_intra_c32", [&](auto wt) { launch_intra_c32<typename decltype(wt)::type, 128>(p, stream); });
}

void kda_fwd_scan_c32(const KdaFwdParams& p, cudaStream_t stream) {
  if (p.K != 128) throw std::invalid_argument("kda_fwd_scan_c32: K = 128 only");
  const int bv = kda_fwd_scan_bv(p);
  dispatch_wt(p.dtype, "kda_fwd_scan_c32", [&](auto wt) {
    using WT = typename decltype(wt)::type;
    if (bv == 64) launch_scan_c32<WT, 128, 64>(p, stream);
    else launch_scan_c32<WT, 128, 128>(p, stream);
  });
}

int kda_forward(const KdaFwdParams& p, cudaStream_t stream) {
  KdaFwdParams f = p;
  f.stream_bv = kda_fwd_stream_bv(f);            // once: every launch of the call agrees
  if (f.stream_bv == 0) f.chunk_ready = nullptr;  // kept only where it streams
  StreamStages stages{stream};
  forward_sequence(f, stages);
  return f.stream_bv;
}

}  // namespace kernel_fun::kda
