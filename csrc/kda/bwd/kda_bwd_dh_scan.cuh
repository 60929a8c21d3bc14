// kda_bwd_dh_scan: the reverse chunk recurrence of the KDA backward (stage B3 of
// src/kernel_fun/ref/kda_bwd.py), one CTA per (V-slice of BV columns, value head, sequence),
// BV / 16 warps (BV / 64 warpgroups), fp32 accumulation. The mirror image of kda_fwd_scan: the
// state gradient dh [K, BV] lives TRANSPOSED in fp32 registers, warp w owning value columns
// [16 w, 16 w + 16) for the whole chunk (no barrier inside a chunk). Per chunk c, last to first:
//   0   dh_ckpt[c] = dhT                       (dh_{c+1}: what kda_bwd_grads reads for chunk c)
//   A   dv'T = dhT @ kg^T + doT @ Aqk          wgmma m64n64k16 (A = dhT packed, B = the swizzled kg
//                                              tile, K-major), with doT @ Aqk on mma.sync (ldmatrix.trans
//                                              of do and Aqk; blocks jj >= pp) while it is in flight
//   C   dhT  = dhT * exp2(G)[k] + doT @ qg - dv'T @ w   wgmma m64nKk16 (B = the swizzled qg / w
//                                              tiles, MN-major), in flight during B
//   B   dvT  = dv'T @ Akk -> dv                mma.sync (v enters the forward only through u = Akk v)
// after chunk 0: dh0 = dhT. scale lives inside qg (the forward intra's workspace), never applied
// twice. Operands are rounded to WT, accumulation is fp32, as in the forward scan.
//
// Shared memory: dev::ScanStage (csrc/kda/device/scan.cuh), with sVal = do.
#pragma once

#include "kda/bwd/kda_bwd_launch.h"
#include "kda/device/primitives.cuh"
#include "kda/device/scan.cuh"
#include "kda/device/sequence.cuh"

namespace kernel_fun::kda {

// The streamed backward (kda_policy.h's bwd_stream_wanted): the dh scan publishes how many chunks of
// its slice it has stored, counted from the sequence's end, after 1, 2, 4 and 8 chunks, then every
// kDhPublishEvery chunks, and at the end. Each publication costs every thread a fence on the chain
// (it waits for the thread's outstanding stores). Once running, the grads CTAs consume far slower
// than the scan stores (~40 us per CTA on an SM against a step of ~2.5-3.8 us per chunk row), so
// every 16th chunk keeps them fed; but at the start no grads CTA can run before the first
// publication, and with the first at chunk 16 the SMs beside the dh scan idled for 16 of its steps
// (~60 us at BV = 128: ~1% of long_b1_t32k's backward, ~4% of bounded_b1's). The powers of two
// before it hand out the last chunk rows as soon as they are stored, for four more fences per chain.
// Thread 0 publishes with dev::store_release after a CTA barrier that follows every thread's
// __threadfence(); the grads CTAs wait with dev::wait_at_least.
constexpr int kDhPublishEvery = 16;
__host__ __device__ constexpr bool dh_publishes_at(int i) {
  return i > 0 && (i % kDhPublishEvery == 0 || (i < kDhPublishEvery && (i & (i - 1)) == 0));
}
static_assert(dh_publishes_at(1) && dh_publishes_at(2) && dh_publishes_at(8) && !dh_publishes_at(3) &&
                  !dh_publishes_at(24) && dh_publishes_at(32) && !dh_publishes_at(64 + 4),
              "the ramp, then every kDhPublishEvery chunks");

// The chunks of one reverse chain, last to first, for this warp's 16 value columns: A-C of the
// header per chunk on the landed stage, dhT carried from the state gradient at the sequence's end to
// the one at its start. load_chunk(cc, stage, go) issues chunk cc's copies (the caller's
// ScanSources and columns); chunk nchunks - 1 is loaded here first. kStores: the checkpoints
// dh_{c+1} (dh_ckpt) and dv are written (the ordinary dh scan), or not (the split backward's pass 1).
// progress: this slice's counter in p.dh_ready (the streamed backward), or null.
// The body of dh_scan_cta and of dh_scan_local_cta.
template <typename WT, int K, int BV, bool kStores, typename LoadChunk>
__device__ __forceinline__ void dh_scan_chunks(const KdaBwdParams& p, const dev::ScanPlace<K, BV>& pl, WT* sm,
                                               float (&dhT)[K / 8][4], LoadChunk&& load_chunk,
                                               int* progress = nullptr) {
  using S = dev::ScanStage<WT, K, BV>;
  constexpr int AP = S::AP, VP = S::VP;
  const int g = pl.g, t = pl.t, hv = pl.hv, v0 = pl.v0, vw = pl.vw, col0 = pl.col0;
  const int HV = p.HV, V = p.V, nchunks = pl.nchunks;
  const dev::SeqInfo& seq = pl.seq;

  load_chunk(nchunks - 1, 0, nchunks > 0);
  dev::cp_async_commit();

  WT* dv = reinterpret_cast<WT*>(p.dv);
  WT* dhc = reinterpret_cast<WT*>(p.dh_ckpt);

  for (int i = 0; i < nchunks; ++i) {
    const int c = nchunks - 1 - i;
    const int st = i & 1;
    dev::cp_async_wait<0>();
    // the streamed backward: the checkpoints of chunks c + 1 .. nchunks - 1 (stored by every thread in
    // the steps before) visible at GPU scope before thread 0 publishes them after the barrier
    const bool publish = kStores && progress != nullptr && dh_publishes_at(i);
    if (publish) __threadfence();
    // stage st landed for everyone; everyone is done with stage st ^ 1 (chunk c + 1)
    __syncthreads();
    if (publish && threadIdx.x == 0) dev::store_release(progress, i);

    const dev::ScanOperands<WT, K, BV> op(sm + st * S::kStageElems);
    const WT *sW = op.w, *sQg = op.qg, *sKg = op.kg, *sAqk = op.Aqk, *sAkk = op.Akk, *sDo = op.val;
    const float* sDec = op.dec;

    // ---------------- A: dv'T = dhT @ kg^T + doT @ Aqk   ([16 v] x [64 tokens], n-tiles of 8 tokens)
    // wgmma: the warpgroup's 64 value rows at once, B = the swizzled kg tile (K-major); in flight
    // while doT @ Aqk runs on mma.sync into its own accumulator
    float dvT[8][4], u[8][4];
    uint32_t adoT[4][4];  // doT as A fragments per 16-token block jj (transposed loads), kept for C
    {
      uint32_t ha[K / 16][4];  // dhT packed to WT: live until the wait (wgmma reads A asynchronously)
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) dev::pack_a<WT>(ha[kk], dhT[2 * kk], dhT[2 * kk + 1]);
      dev::fence_regs(ha);
      dev::wgmma_fence();
      dev::wgmma_state_tile_t<WT, K>(dvT, ha, sKg, false);
      dev::wgmma_commit();
      // In A's shadow (dhT itself is no operand of A, its packed copy ha is): chunk c - 1 into stage
      // st ^ 1 (free since the barrier), then step 0, the checkpoint dh_{c+1} for chunk c
      // ([chunk][hv][v][k]). Ahead of A, both sat on every step's critical path; branch-free, since a
      // branch here makes ptxas wait for A at the branch.
      load_chunk(c - 1, st ^ 1, c > 0);
      dev::cp_async_commit();
      if constexpr (kStores)
        dev::store_state_ckpt<WT, K>(dhc + (static_cast<int64_t>(seq.chunk0 + c) * HV + hv) * V * K, dhT, col0, t);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) u[j][e] = 0.f;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        dev::ldsm_a_t(adoT[jj], sDo, VP, 16 * jj, vw);
#pragma unroll
        for (int pp = 0; pp <= jj; ++pp) {
          // B[k = token][n = token'] = Aqk[token][token'] (nonzero for token >= token': pp <= jj)
          uint32_t b[4];
          dev::ldsm_b_t(b, sAqk, AP, 16 * jj, 16 * pp);
          dev::mma_16x16<WT>(u[2 * pp], u[2 * pp + 1], adoT[jj], b);
        }
      }
      dev::wgmma_wait<0>();
      dev::fence_regs(ha);
      dev::fence_regs(dvT);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dvT[j][e] += u[j][e];
    // dv'T as A fragments over the token dimension (rounded to WT), and its negation for C
    uint32_t va[4][4], vn[4][4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      dev::pack_a<WT>(va[jj], dvT[2 * jj], dvT[2 * jj + 1]);
      dev::pack_a<WT, true>(vn[jj], dvT[2 * jj], dvT[2 * jj + 1]);
    }

    // ---------------- C: dhT = dhT * exp2(G)[k] + doT @ qg - dv'T @ w   (wgmma, B = the swizzled
    // qg / w tiles, MN-major), in flight while B runs: dhT, adoT and vn belong to it until the wait
    dev::decay_state<K>(dhT, sDec, t);
    dev::fence_regs(dhT);
    dev::fence_regs(adoT);
    dev::fence_regs(vn);
    dev::wgmma_fence();
    dev::wgmma_tokens_tile<WT, K>(dhT, adoT, sQg);
    dev::wgmma_tokens_tile<WT, K>(dhT, vn, sW);
    dev::wgmma_commit();

    // ---------------- B: dvT = dv'T @ Akk -> dv   (B[k = token][n = token'] = Akk[token][token'])
    if constexpr (kStores) {
      float acc[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
        for (int pp = 0; pp <= jj; ++pp) {
          uint32_t b[4];
          dev::ldsm_b_t(b, sAkk, AP, 16 * jj, 16 * pp);
          dev::mma_16x16<WT>(acc[2 * pp], acc[2 * pp + 1], va[jj], b);
        }
      }
      dev::store_token_tile<WT>(dv, acc, seq.bos + static_cast<int64_t>(c) * kChunk,
                                min(kChunk, seq.len - c * kChunk), HV, hv, V, v0 + vw, g, t);
    }

    dev::wgmma_wait<0>();
    dev::fence_regs(dhT);
    dev::fence_regs(adoT);
    dev::fence_regs(vn);
  }
  dev::cp_async_wait<0>();
}

// One CTA's reverse scan of work item b (sm: the 1024-byte aligned dynamic smem): from dht, dv and the
// checkpoints on the way, dh0 at the end. The body of kda_bwd_dh_scan_kernel and of the dh half of
// kda_bwd_scans_kernel (kda_bwd_scans.cuh).
template <typename WT, int K, int BV>
__device__ __forceinline__ void dh_scan_cta(const KdaBwdParams& p, const dev::ScanBlock& b, WT* sm) {
  using S = dev::ScanStage<WT, K, BV>;
  constexpr int NT = dev::scan_threads<BV>();
  static_assert(BV == 64 || BV == 128, "BV in {64, 128}");
  const dev::ScanPlace<K, BV> pl(p, b);
  float dhT[K / 8][4];  // the state gradient, in ScanPlace's fragment layout
  dev::load_state<K>(dhT, p.dht, pl.sbase, p, pl.col0, pl.t);
  const dev::ScanSources<WT> src = dev::scan_sources<WT>(p, p.dout);
  // the streamed backward: this slice's counter ([sequence][value head][slice], bwd_stream_ints)
  int* progress = p.dh_ready ? p.dh_ready + (static_cast<int64_t>(b.n) * p.HV + b.hv) * (p.V / BV) + b.vs : nullptr;
  dh_scan_chunks<WT, K, BV, true>(p, pl, sm, dhT, [&](int cc, int st, bool go) {
    dev::scan_load_chunk<WT, K, BV, NT>(sm + st * S::kStageElems, src, p, pl.seq, cc, pl.hv, pl.v0, true, go);
  }, progress);
  if (progress) {  // every chunk stored
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) dev::store_release(progress, pl.nchunks);
  }
  if (p.dh0) dev::store_state<WT, K>(p.dh0, pl.sbase, dhT, p, pl.col0, pl.t);
}

// The split backward's pass 1 (kda_bwd_dh_scan_local_kernel; p = fwd/kda_fwd_split.h's split_dh_local,
// the pieces as sequences), the mirror of fwd_scan_local_cta: every piece but a sequence's first, from
// a zero gradient at its end (a sequence's last piece from dht), no dv and no checkpoints, over V + K
// columns whose last K are virtual (do zero, dh the identity): at the piece's start they hold Psi,
// the product of its chunks' transposed transitions, beside the local gradient F, both into
// split_state's `local` ([piece][hv][k][V + K]).
template <typename WT, int K, int BV>
__device__ __forceinline__ void dh_scan_local_cta(const KdaBwdParams& p, const dev::ScanBlock& b, WT* sm) {
  using S = dev::ScanStage<WT, K, BV>;
  constexpr int NT = dev::scan_threads<BV>();
  const SplitLayout l = split_layout(p);
  const int flags = p.split_map[l.piece_flags + b.n];
  const bool virt = b.vs * BV >= p.V;  // uniform: V and K are whole slices
  // a sequence's first piece is left to pass 2; its last starts from dht and needs no Psi
  if ((flags & 1) || (virt && (flags & 2))) return;

  const dev::ScanPlace<K, BV> pl(p, b);
  float dhT[K / 8][4];
  if (virt) {  // the identity; the do tile of both stages zero once, never loaded
    dev::identity_state<K>(dhT, pl.col0 - p.V, pl.t);
    dev::zero_values<WT, K, BV, NT>(sm);
  } else {
    const int n = p.split_map[l.piece_seq + b.n];
    dev::load_state<K>(dhT, (flags & 2) ? p.dht : nullptr, dev::state_base<K>(p, n, pl.hv), p, pl.col0, pl.t);
  }
  const dev::ScanSources<WT> src = dev::scan_sources<WT>(p, p.dout);
  dh_scan_chunks<WT, K, BV, false>(p, pl, sm, dhT, [&](int cc, int st, bool go) {
    dev::scan_load_chunk<WT, K, BV, NT>(sm + st * S::kStageElems, src, p, pl.seq, cc, pl.hv, virt ? 0 : pl.v0, true,
                                        go, !virt);
  });
  dev::store_split_local<K>(p.split_state + (static_cast<int64_t>(b.n) * p.HV + pl.hv) * K * (p.V + K), p.V + K, dhT,
                            pl.col0, pl.t);
}

template <typename WT, int K, int BV>
__global__ void __launch_bounds__(dev::scan_threads<BV>(), 1) kda_bwd_dh_scan_kernel(const KdaBwdParams p) {
  // the streamed backward: kda_bwd_grads may start once every CTA here is resident (a no-op otherwise)
  if (p.dh_ready) dev::launch_dependents();
  KF_DYN_SMEM(float4, smem_f4);
  dh_scan_cta<WT, K, BV>(p, dev::scan_block(p), dev::scan_smem_base<WT>(smem_f4));
}

template <typename WT, int K, int BV>
__global__ void __launch_bounds__(dev::scan_threads<BV>(), 1) kda_bwd_dh_scan_local_kernel(const KdaBwdParams p) {
  KF_DYN_SMEM(float4, smem_f4);
  dh_scan_local_cta<WT, K, BV>(p, dev::scan_block(p), dev::scan_smem_base<WT>(smem_f4));
}

// Its launch: (V + K) / BV slices per (value head, piece).
template <typename WT, int K, int BV>
inline LaunchShape dh_scan_local_launch(const KdaProblem& p) {
  return dev::scan_launch<WT, K, BV>(p, (p.V + K) / BV);
}

// The launch (kda_launch_shape.h): one CTA per (V-slice, value head, sequence); launch_dh_scan's
// and the emulator's.
template <typename WT, int K, int BV>
inline LaunchShape dh_scan_launch(const KdaProblem& p) {
  return dev::scan_launch<WT, K, BV>(p, p.V / BV);
}

#ifndef KF_EMU
template <typename WT, int K, int BV>
void launch_dh_scan(const KdaBwdParams& p, cudaStream_t stream) {
  dev::launch(kda_bwd_dh_scan_kernel<WT, K, BV>, dh_scan_launch<WT, K, BV>(p), p, stream);
}
template <typename WT, int K, int BV>
void launch_dh_scan_local(const KdaBwdParams& p, cudaStream_t stream) {
  dev::launch(kda_bwd_dh_scan_local_kernel<WT, K, BV>, dh_scan_local_launch<WT, K, BV>(p), p, stream);
}
#endif

}  // namespace kernel_fun::kda
