// kda_fwd_scan: the serial chunk recurrence of the KDA forward, one CTA per (V-slice of BV
// columns, value head, sequence), BV / 16 warps (BV / 64 warpgroups), fp32 accumulation.
//
// The state is kept TRANSPOSED, hT [BV, K], in fp32 registers: warp w owns value columns
// [16 w, 16 w + 16) of the slice and runs the whole chunk for them from its own registers -- no
// barrier inside a chunk, no smem copy of h, no smem round trip of v'. Its hT rows are C fragments
// over K (n-tiles of 8 state rows k), the same layout for mma.sync and for wgmma. Per chunk
// (tokens i, j of the chunk; rows past the sequence end are zero-filled on load and never stored):
//   A   WHT = hT @ w^T, OT = hT @ qg^T       wgmma m64n64k16: A = hT packed to WT from registers
//                                            (the C layout of n-tiles 2kk, 2kk+1 is the A layout of
//                                            k-step kk), B = the swizzled w / qg tiles (K-major)
//   B   v'T = vT @ Akk^T - WHT                mma.sync: A = vT (ldmatrix.trans of the [token][v]
//                                            tile), B = Akk rows (lower-triangular: blocks j <= i)
//   D   hT = hT * exp2(G)[k] + v'T @ kg       wgmma m64nKk16: A = v'T from registers, B = the
//                                            swizzled kg tile (MN-major); in flight during C
//   C   OT += v'T @ Aqk^T -> o                mma.sync: A = v'T from registers
// wgmma reads the K-wide tiles once per warpgroup (per warp with mma.sync + ldmatrix: 1.3x faster
// scans at prod8192, docs/notes/2026-12-01-kda-backward.md).
// scale lives inside qg and Aqk (kda_fwd_intra), so it is never applied twice. h and v' are rounded
// to WT as MMA operands; accumulation is fp32 everywhere.
// The backward's re-scan runs this kernel with o = null (no qg loads, no OT products, no o stores)
// and h_ckpt set: the state before every chunk, [chunk][HV][V][K] in WT, for kda_bwd_grads. A
// training forward that saves its states for the backward (kda_policy.h's save_states_pays) runs
// it with both o and h_ckpt set.
//
// Shared memory: dev::ScanStage (csrc/kda/device/scan.cuh), with sVal = v.
#pragma once

#include "kda/device/primitives.cuh"
#include "kda/device/scan.cuh"
#include "kda/device/sequence.cuh"
#include "kda/fwd/kda_fwd_launch.h"

namespace kernel_fun::kda {

// One chunk of the recurrence for this warp's 16 value columns (the CTA's warps < BV / 16): A-D of
// the header on the landed stage `op`, o for the chunk's tokens, hT advanced past chunk c, and the
// checkpoints of the state it reads (backward re-scan, h_states). The body of fwd_scan_cta's chunk
// loop and of a fused forward's state warps.
// `beside_a()` runs while product A is in flight (between its commit and its wait), as do the
// checkpoint stores: work that neither reads A's operands nor its results (the next chunk's loads)
// is then issued in the tensor cores' shadow instead of ahead of the chain h -> A -> v' -> h.
// kWithO: the forward (o wanted) or the backward's re-scan (states only), compiled apart: with a
// runtime flag both paths carried the other's loads and branches. kCkpt: the checkpoints of the
// state (h_ckpt) are written, in A's shadow: the re-scan always, the forward when it saves its
// states for the backward (a third instantiation, so the plain forward carries no store code; the
// same stores ahead of A, behind a runtime branch, cost the training forward's scan +15% per step
// at B1 T32768 H32, 2026-12-04). kStates = false: no per-chunk states (h_states) whatever p says (the
// split forward's pass 1, where that dead store's address registers spilled the loop).
// C: tokens per chunk (kChunk; 32 for the short-chunk forward): the tokens are the N of
// product A and the K of product D, the blocks of B and C.
// kIdCols: the call has identity columns (KdaProblem::id_cols): a CTA at the virtual columns writes
// its outputs to o_id, the real ones to o, each at its own row width (compiled apart: the other
// scans keep their code).
template <typename WT, int K, int BV, bool kWithO, bool kCkpt, bool kStates = true, int C = kChunk,
          bool kIdCols = false, typename BesideA>
__device__ __forceinline__ void fwd_scan_step(const KdaFwdParams& p, const dev::ScanPlace<K, BV, C>& pl,
                                              const dev::ScanOperands<WT, K, BV, C>& op, int c, float (&hT)[K / 8][4],
                                              BesideA&& beside_a) {
  using S = dev::ScanStage<WT, K, BV, C>;
  constexpr int NJ = C / 8, NB = C / 16;  // 8-token n-tiles, 16-token blocks
  constexpr int AP = S::AP, VP = S::VP;
  const int g = pl.g, t = pl.t, hv = pl.hv, v0 = pl.v0, vw = pl.vw, col0 = pl.col0;
  const int HV = p.HV, V = p.V;
  const dev::SeqInfo& seq = pl.seq;
  WT* o = reinterpret_cast<WT*>(p.o);  // set iff kWithO: the re-scan wants only states
  WT* hst = reinterpret_cast<WT*>(p.h_states);
  const WT *sW = op.w, *sQg = op.qg, *sKg = op.kg, *sAqk = op.Aqk, *sAkk = op.Akk, *sV = op.val;
  const float* sDec = op.dec;

  // ---------------- A: WHT = hT @ w^T, OT = hT @ qg^T   ([16 v] x [64 tokens] per warp; wgmma, the
  // warpgroup's 64 value rows at once, B = the swizzled w / qg tiles, K-major)
  if (kStates && hst)  // the state read by chunk c (fla's h), in the output dtype
    dev::store_state<WT, K>(hst, (static_cast<int64_t>(seq.chunk0 + c) * HV + hv) * K * V, hT, p, col0, t);
  float whT[NJ][4], oT[NJ][4];
  {
    uint32_t ha[K / 16][4];  // hT packed to WT: live until the wait (wgmma reads A asynchronously)
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) dev::pack_a<WT>(ha[kk], hT[2 * kk], hT[2 * kk + 1]);
    dev::fence_regs(ha);
    // The backward's checkpoint of the state read by chunk c ([chunk][hv][v][k]), in A's shadow
    // below (kCkpt).
    auto store_ckpt = [&](bool go) {
      dev::store_state_ckpt<WT, K>(
          reinterpret_cast<WT*>(p.h_ckpt) + (static_cast<int64_t>(seq.chunk0 + c) * HV + hv) * V * K, hT, col0, t, go);
    };
    // One commit group for WHT and OT (OT in a second group, waited for only before C, measured
    // slower: B's mma.sync then shares the tensor cores with OT on the chain). In A's shadow (hT
    // itself is no operand of A, its packed copy ha is): the re-scan's checkpoint, then the caller's
    // work. Branch-free (predicated stores): a branch here makes ptxas wait for A at the branch.
    dev::wgmma_fence();
    dev::wgmma_state_tile_t<WT, K, C>(whT, ha, sW, false);
    if constexpr (kWithO) dev::wgmma_state_tile_t<WT, K, C>(oT, ha, sQg, false);
    dev::wgmma_commit();
    if constexpr (kCkpt) store_ckpt(p.h_ckpt != nullptr);
    beside_a();
    dev::wgmma_wait<0>();
    dev::fence_regs(ha);
    dev::fence_regs(whT);
    dev::fence_regs(oT);
  }

  // ---------------- B: v'T = vT @ Akk^T - WHT   (Akk[i][j] = 0 for j > i: blocks jj <= pp)
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) whT[j][e] = -whT[j][e];
#pragma unroll
  for (int jj = 0; jj < NB; ++jj) {
    // A[m = v][k = token j]: transposed loads of the [token][v] tile; matrix m = tokens
    // 16 jj + (m >> 1) 8, values vw + (m & 1) 8
    uint32_t a[4];
    dev::ldsm_a_t(a, sV, VP, 16 * jj, vw);
#pragma unroll
    for (int pp = jj; pp < NB; ++pp) {
      uint32_t b[4];
      dev::ldsm_b(b, sAkk, AP, 16 * pp, 16 * jj);
      dev::mma_16x16<WT>(whT[2 * pp], whT[2 * pp + 1], a, b);
    }
  }
  // v'T as A fragments over the token dimension (rounded to WT)
  uint32_t va[NB][4];
#pragma unroll
  for (int jj = 0; jj < NB; ++jj) dev::pack_a<WT>(va[jj], whT[2 * jj], whT[2 * jj + 1]);

  // ---------------- D: hT = hT * exp2(G)[k] + v'T @ kg   (wgmma, B = the swizzled kg tile, MN-major),
  // in flight while C runs: hT and va belong to it until the wait
  dev::decay_state<K>(hT, sDec, t);
  dev::fence_regs(hT);
  dev::fence_regs(va);
  dev::wgmma_fence();
  dev::wgmma_tokens_tile<WT, K, C>(hT, va, sKg);
  dev::wgmma_commit();

  // ---------------- C: OT += v'T @ Aqk^T -> o   (v'T packed again from whT: the same values as va)
  if constexpr (kWithO) {
#pragma unroll
    for (int jj = 0; jj < NB; ++jj) {
      uint32_t a[4];
      dev::pack_a<WT>(a, whT[2 * jj], whT[2 * jj + 1]);
#pragma unroll
      for (int pp = jj; pp < NB; ++pp) {
        uint32_t b[4];
        dev::ldsm_b(b, sAqk, AP, 16 * pp, 16 * jj);
        dev::mma_16x16<WT>(oT[2 * pp], oT[2 * pp + 1], a, b);
      }
    }
    if constexpr (kIdCols) {  // [o | o_id], split at the real width vr (whole slices on each side)
      const int vr = V - p.id_cols;
      const bool virt = v0 >= vr;
      dev::store_token_tile<WT, NJ>(virt ? reinterpret_cast<WT*>(p.o_id) : o, oT,
                                    seq.bos + static_cast<int64_t>(c) * C, min(C, seq.len - c * C), HV, hv,
                                    virt ? p.id_cols : vr, v0 + vw - (virt ? vr : 0), g, t);
    } else {
      dev::store_token_tile<WT, NJ>(o, oT, seq.bos + static_cast<int64_t>(c) * C, min(C, seq.len - c * C), HV, hv,
                                    V, v0 + vw, g, t);
    }
  }

  dev::wgmma_wait<0>();
  dev::fence_regs(hT);
  dev::fence_regs(va);
}

// One CTA's scan of work item b (sm: the 1024-byte aligned dynamic smem, dev::ScanStage x 2). The
// body of kda_fwd_scan_kernel and of the re-scan half of kda_bwd_scans_kernel. kWithO = (p.o set),
// kCkpt = (p.h_ckpt set). kIdCols = (p.id_cols > 0): kda_fwd_scan_id_kernel's; a CTA whose slice
// lies in the virtual columns starts from the identity with a zero value tile, as the split
// forward's pass 1 does (fwd_scan_local_cta), and loads no values.
template <typename WT, int K, int BV, bool kWithO, bool kCkpt, int C = kChunk, bool kIdCols = false>
__device__ __forceinline__ void fwd_scan_cta(const KdaFwdParams& p, const dev::ScanBlock& b, WT* sm) {
  using S = dev::ScanStage<WT, K, BV, C>;
  constexpr int NT = dev::scan_threads<BV>();
  constexpr int NK = K / 8;  // n-tiles of the state (8 state rows k each)
  static_assert(BV == 64 || BV == 128, "BV in {64, 128}");

  const dev::ScanPlace<K, BV, C> pl(p, b);
  const int t = pl.t, hv = pl.hv, v0 = pl.v0, col0 = pl.col0, nchunks = pl.nchunks;
  const dev::SeqInfo& seq = pl.seq;
  // the streamed forward's pass (below); identity columns never stream (kda_policy.h), so their
  // kernel carries none of its code (with the runtime test it spilled at BV = 64)
  const int pass = kIdCols ? 0 : p.scan_pass;

  // The streamed forward (kda_policy.h's fwd_stream_choice; p.scan_pass uniform): pass 1 is resident
  // first and lets kda_fwd_intra launch beside it at once; a chunk's rows are loaded only after its
  // intra CTA has published them (thread 0 waits, the next CTA barrier passes the acquire on). A
  // chain whose next chunk does not come (dev::wait_chunk_ready: the kernels do not run at once)
  // stops after its current chunk, saving its fp32 state exactly and the chunk it resumes at; pass 2,
  // launched after the intra, resumes it from there (and returns at once for a finished chain).
  // Registers: the scan runs at 252-255, so the streamed path keeps nothing live across the chunk
  // loop beyond one predicate: the pass, the flag and resume addresses are re-read from p (constant
  // bank) where used (held in registers, they spilled ~1 KB per thread).
  // one resume slot per (sequence, head, 64 value columns): sbase / (K * 64) = (n HV + hv) V / 64
  const int64_t resume_slot = stream_progress_offset(p) + pl.sbase / (K * 64) + v0 / 64;
  const int c_begin = pass == 2 ? p.chunk_ready[resume_slot] : 0;
  if (pass == 2 && c_begin >= nchunks) return;

  float hT[NK][4];  // the state, in ScanPlace's fragment layout
  // uniform: BV divides both the real and the virtual widths (kda_policy.h's scan_choice)
  const bool virt = kIdCols && v0 >= p.V - p.id_cols;
  if (virt) {  // the identity; the value tile of both stages zero once, never loaded
    dev::identity_state<K>(hT, col0 - (p.V - p.id_cols), t);
    dev::zero_values<WT, K, BV, NT>(sm);
  } else {
    dev::load_state<K>(hT, pass == 2 && c_begin > 0 ? p.scan_save : p.h0, pl.sbase, p, col0, t);
  }

  const dev::ScanSources<WT> src = dev::scan_sources<WT>(p, p.v);
  auto load_chunk = [&](int cc, int st, bool go) {
    dev::scan_load_chunk<WT, K, BV, NT, C, kIdCols>(sm + st * S::kStageElems, src, p, seq, cc, hv, v0, kWithO, go,
                                                    !virt);
  };
  // chunk cc's flag (pass 1): published by the intra CTA of (global chunk, value head)
  auto flag = [&](int cc) { return p.chunk_ready + static_cast<int64_t>(seq.chunk0 + cc) * p.HV + hv; };

  // thread 0's verdict on the next chunk, two slots: slot c & 1 is written before the barrier of
  // chunk c and read after it, and rewritten only after everyone has passed the next barrier
  __shared__ int next_ready[2];
  // thread 0's copy of chunk cc's flag group (dev::prefetch_flag), fetched while chunk cc - 2
  // computes, in stage cc & 1's flag_group: written (cp.async) in iteration cc - 2 after its barrier,
  // read by thread 0 in iteration cc - 1 before its barrier; chunk 1's starts at 0 (nothing fetched
  // it: the blocking wait)
  auto seen = [&](int st) { return reinterpret_cast<int*>(sm + st * S::kStageElems + S::kFlags); };
  if (pass == 1) {
    dev::launch_dependents();
    if (threadIdx.x == 0) *reinterpret_cast<int4*>(seen(1)) = make_int4(0, 0, 0, 0);
    if (threadIdx.x == 0) next_ready[1] = nchunks == 0 || dev::wait_chunk_ready(flag(0));
    __syncthreads();
    if (!next_ready[1]) {  // chunk 0 never came: everything to pass 2, from h0
      if (threadIdx.x == 0) p.chunk_ready[resume_slot] = 0;
      return;
    }
  }
  load_chunk(c_begin, c_begin & 1, c_begin < nchunks);
  dev::cp_async_commit();

  int c = c_begin;
  bool stopped = false;  // uniform
  for (; c < nchunks && !stopped; ++c) {  // a stopped chain leaves with c = its resume chunk
    const int st = c & 1;
    dev::cp_async_wait<0>();
    if (pass == 1 && threadIdx.x == 0)
      next_ready[st] = c + 1 >= nchunks || dev::flag_seen(seen(st ^ 1), flag(c + 1)) || dev::wait_chunk_ready(flag(c + 1));
    // stage st landed for everyone; everyone is done with stage st ^ 1 (chunk c - 1); in pass 1,
    // thread 0 has seen chunk c + 1 published, or given up on it
    __syncthreads();
    stopped = pass == 1 && !next_ready[st];
    if (pass == 1 && threadIdx.x == 0 && c + 2 < nchunks) dev::prefetch_flag(seen(st), flag(c + 2));
    // chunk c + 1 into stage st ^ 1 (free since the barrier), issued while product A of chunk c is in
    // flight (ahead of A, its address and copy instructions sat on every step's critical path)
    fwd_scan_step<WT, K, BV, kWithO, kCkpt, !kIdCols, C, kIdCols>(
        p, pl, dev::ScanOperands<WT, K, BV, C>(sm + st * S::kStageElems), c, hT, [&] {
      load_chunk(c + 1, st ^ 1, c + 1 < nchunks && !stopped);
      dev::cp_async_commit();
    });
  }
  dev::cp_async_wait<0>();
  // A stopped chain saves the state before chunk c + 1 and its resume chunk for pass 2 (one store
  // site for both states: a second copy of the store inside the loop spilled the scan's registers)
  if (pass == 1 && threadIdx.x == 0) p.chunk_ready[resume_slot] = stopped ? c : nchunks;
  float* dst = stopped ? p.scan_save : p.ht;
  if (dst) dev::store_state<WT, K>(dst, pl.sbase, hT, p, col0, t);
}

template <typename WT, int K, int BV>
__global__ void __launch_bounds__(dev::scan_threads<BV>(), 1) kda_fwd_scan_kernel(const KdaFwdParams p) {
  KF_DYN_SMEM(float4, smem_f4);
  // the forward (o; a training forward also saving its states: o and h_ckpt) or the backward's
  // re-scan when not paired with the dh scan (states only)
  WT* sm = dev::scan_smem_base<WT>(smem_f4);
  if (p.o && p.h_ckpt) fwd_scan_cta<WT, K, BV, true, true>(p, dev::scan_block(p), sm);
  else if (p.o) fwd_scan_cta<WT, K, BV, true, false>(p, dev::scan_block(p), sm);
  else fwd_scan_cta<WT, K, BV, false, true>(p, dev::scan_block(p), sm);
}

// The forward with identity columns (KdaProblem::id_cols: o and o_id, no states saved), a kernel of
// its own so that kda_fwd_scan_kernel's code stays as it was.
template <typename WT, int K, int BV>
__global__ void __launch_bounds__(dev::scan_threads<BV>(), 1) kda_fwd_scan_id_kernel(const KdaFwdParams p) {
  KF_DYN_SMEM(float4, smem_f4);
  fwd_scan_cta<WT, K, BV, true, false, kChunk, true>(p, dev::scan_block(p), dev::scan_smem_base<WT>(smem_f4));
}

// The scan kernel a forward of p runs (launch_scan's and the emulator's).
template <typename WT, int K, int BV>
inline auto fwd_scan_kernel_for(const KdaProblem& p) {
  return p.id_cols ? kda_fwd_scan_id_kernel<WT, K, BV> : kda_fwd_scan_kernel<WT, K, BV>;
}

// Pass 1 of the split forward (kda_fwd_split.cuh; p = fwd/kda_fwd_split.h's split_local: the pieces
// as sequences), one CTA per (V-slice of the V + K columns, value head, piece): the piece's chunks
// from a zero state (a sequence's first piece from h0), no o, no states but the last. The slices at
// columns >= V are virtual: their value tile is zero and their state starts as the identity (column
// V + j = e_j), so after the piece they hold Phi = the product of its chunks' transitions
// (exp2(G) - kg^T w per chunk, as the real columns see them, bf16 operands included). The result
// [E | Phi] goes to split_state's `local` ([piece][hv][k][V + K], fp32). A sequence's last piece is
// left to pass 2, and its first needs no Phi (its E starts from h0): those CTAs return at once.
template <typename WT, int K, int BV>
__device__ __forceinline__ void fwd_scan_local_cta(const KdaFwdParams& p, const dev::ScanBlock& b, WT* sm) {
  using S = dev::ScanStage<WT, K, BV>;
  constexpr int NT = dev::scan_threads<BV>();
  constexpr int NK = K / 8;
  const SplitLayout l = split_layout(p);
  const int flags = p.split_map[l.piece_flags + b.n];
  const bool virt = b.vs * BV >= p.V;  // uniform: V and K are whole slices (fwd_split_possible)
  if ((flags & 2) || (virt && (flags & 1))) return;

  const dev::ScanPlace<K, BV> pl(p, b);
  const int t = pl.t, hv = pl.hv, col0 = pl.col0, nchunks = pl.nchunks;
  float hT[NK][4];
  if (virt) {  // the identity; the value tile of both stages zero once, never loaded
    dev::identity_state<K>(hT, col0 - p.V, t);
    dev::zero_values<WT, K, BV, NT>(sm);
  } else {
    const int n = p.split_map[l.piece_seq + b.n];
    dev::load_state<K>(hT, (flags & 1) ? p.h0 : nullptr, dev::state_base<K>(p, n, hv), p, col0, t);
  }

  const dev::ScanSources<WT> src = dev::scan_sources<WT>(p, p.v);
  auto load_chunk = [&](int cc, int st, bool go) {
    dev::scan_load_chunk<WT, K, BV, NT>(sm + st * S::kStageElems, src, p, pl.seq, cc, hv, virt ? 0 : pl.v0, false,
                                        go, !virt);
  };
  load_chunk(0, 0, nchunks > 0);
  dev::cp_async_commit();
  for (int c = 0; c < nchunks; ++c) {
    const int st = c & 1;
    dev::cp_async_wait<0>();
    __syncthreads();  // stage st landed for everyone; everyone is done with stage st ^ 1
    fwd_scan_step<WT, K, BV, false, false, false>(p, pl, dev::ScanOperands<WT, K, BV>(sm + st * S::kStageElems), c, hT,
                                                  [&] {
      load_chunk(c + 1, st ^ 1, c + 1 < nchunks);
      dev::cp_async_commit();
    });
  }
  dev::cp_async_wait<0>();
  dev::store_split_local<K>(p.split_state + (static_cast<int64_t>(b.n) * p.HV + hv) * K * (p.V + K), p.V + K, hT, col0,
                            t);
}

template <typename WT, int K, int BV>
__global__ void __launch_bounds__(dev::scan_threads<BV>(), 1) kda_fwd_scan_local_kernel(const KdaFwdParams p) {
  KF_DYN_SMEM(float4, smem_f4);
  fwd_scan_local_cta<WT, K, BV>(p, dev::scan_block(p), dev::scan_smem_base<WT>(smem_f4));
}

// Its launch: (V + K) / BV slices per (value head, piece).
template <typename WT, int K, int BV>
inline LaunchShape fwd_scan_local_launch(const KdaProblem& p) {
  return dev::scan_launch<WT, K, BV>(p, (p.V + K) / BV);
}

// The launch (kda_launch_shape.h): one CTA per (V-slice, value head, sequence); launch_scan's and
// the emulator's.
template <typename WT, int K, int BV>
inline LaunchShape fwd_scan_launch(const KdaProblem& p) {
  return dev::scan_launch<WT, K, BV>(p, p.V / BV);
}

#ifndef KF_EMU
template <typename WT, int K, int BV>
void launch_scan(const KdaFwdParams& p, cudaStream_t stream) {
  dev::launch(fwd_scan_kernel_for<WT, K, BV>(p), fwd_scan_launch<WT, K, BV>(p), p, stream);
}
template <typename WT, int K, int BV>
void launch_scan_local(const KdaFwdParams& p, cudaStream_t stream) {
  dev::launch(kda_fwd_scan_local_kernel<WT, K, BV>, fwd_scan_local_launch<WT, K, BV>(p), p, stream);
}
#endif

}  // namespace kernel_fun::kda
