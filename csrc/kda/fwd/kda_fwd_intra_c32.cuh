// kda_fwd_intra_c32: the short-chunk forward, for forwards that save nothing for a backward, where
// kda_policy.h's fwd_short_chunks_pay says it pays (kda_fwd.cu's kda_fwd_chunk_choice;
// KERNEL_FUN_KDA_FWD_CHUNK=64 / 32 forces it off / on where allowed). The forward intra's phases
// (kda_fwd_intra.cuh) on 32-token chunks instead of 64, in both of its P2 forms (kMid: bounded gates,
// the midpoint diagonal blocks; else the one-sided SIMT tiles and fp16 tile pairs of any gate), to
// save what the chunk size costs per token (docs/notes/2026-12-05-chunk-size.md). The backward
// still runs 64-token chunks. The emulator checks it against the fp64 reference at chunk_size = 32
// (tests/test_emu_kda_fwd.py); scripts/dev/intra_c32_bench.cu times it beside the 64-token kernel.
//
// One CTA of 128 threads (four per token, as the 64-token kernel's 256) per (32-token chunk, value
// head), ~47 KB of shared memory at K = 128: four CTAs per SM. Per chunk, "|" = barrier:
//   P0 + P1  q / k copies, gate + block-local cumsum, beta, row factors            |  block offsets |
//   P2       kMid: warps 0-1 the two diagonal 16 x 16 blocks at their midpoints, warp 2 the one
//            block below the diagonal (row block 1, column block 0); otherwise warp 0 the SIMT 4 x 4
//            tiles on the diagonal, warps 1-2 one fp16 tile pair per diagonal block, warp 3 the
//            block below the diagonal; then every warp the qg / kg queue                         |
//   P3       warp 0: the two diagonal inverses || warps 1-3: kexp, Aqk -> workspace, exp2(G)     |
//   merge    warp 0: X_10 = -X_11 L_10 X_00 (the one merge step) || warps 1-3: w and Akk of row
//            block 0                                                                           |
//   P4b      w and Akk of row block 1 (all warps)
// Against the 64-token chunk, per 64 tokens: the below-diagonal block pairs fall from 6 to 2, the
// merge steps from three growing ones to two of the smallest, w's k-steps from 20 to 12; the gate
// pass, the diagonal blocks and the qg / kg / kexp work stay as they are per token.
// Varlen through the chunk map built at 32 tokens (kda_chunk_map with KdaProblem::fwd_chunk = 32).
//
// Beside it, kda_fwd_scan_c32_kernel: the forward scan (kda_fwd_scan.cuh's fwd_scan_cta at C = 32:
// product A's N and product D's K are the chunk's 32 tokens, B and C two 16-token blocks) over that
// workspace. No split, no saved states. Streamed where kda_fwd_chunk_choice takes the short chunks for a
// forward that streams (kda_fwd.cu's kda_fwd_streamed: the scan's pass 1, this intra beside it at
// 32-token chunk rows, pass 2), as the 64-token forward.
#pragma once

#include "kda/fwd/kda_fwd_intra.cuh"
#include "kda/fwd/kda_fwd_scan.cuh"

namespace kernel_fun::kda {

constexpr int kIntraC32Threads = 4 * kC32;  // kC32: kda_problem.h

template <typename WT, int K, bool kMid, typename Out>
__device__ __forceinline__ void intra_chunk_c32(const IntraCtx<WT, K, kC32>& c, const Out& out) {
  static_assert(IntraCtx<WT, K, kC32>::NTH == kIntraC32Threads, "four threads per token");
  // phase clocks at the 64-token kernel's slots (intra_chunk; 5: after the merge)
  intra_gate_phases(c);
  // P2, about two fp16 products per warp: a diagonal block's tf32 product is about two, the block
  // below the diagonal two (its q and its k rows), a tile pair two, the SIMT tiles of two blocks what
  // one of the 64-token kernel's two SIMT warps does; with kMid warp 3 goes to the queue at once
  if constexpr (kMid) {
    if (c.warp < 2) intra_p2_diag_mid(c, c.warp);
    else if (c.warp == 2) intra_p2_below_diag_row<WT, K, 1>(c);
  } else {
    if (c.warp == 0) intra_p2_diag_simt(c, 0);
    else if (c.warp == 3) intra_p2_below_diag_row<WT, K, 1>(c);
    else intra_diag_tile_pair(c, 2 * c.warp - 1, 2 * c.warp - 2);  // block w - 1: tiles 2 blk + 1, 2 blk
  }
  c.stamp_warp_p2(c.warp);
  intra_queue_and_diagonal(c, out);
  // the one merge step (row block 1) on warp 0, while warps 1-3 produce w and Akk of row block 0
  // (final since the diagonal inverse): w by quarters of K (warp 3 takes two)
  if (c.warp == 0) {
    intra_merge_step(c, 1);
  } else {
    for (int qr = c.warp - 1; qr < 4; qr += 3) intra_w_tile(c, out, 0, qr * (K / 4), K / 32);
    intra_store_akk_rows(c, out, 0, 32, kIntraC32Threads - 32);
  }
  __syncthreads();
  c.stamp(5);
  // P4b, row block 1 (all warps)
  intra_w_tile(c, out, 1, c.warp * (K / 4), K / 32);
  intra_store_akk_rows(c, out, 1, 0, kIntraC32Threads);
  intra_stamp_end(c);
}

// Grid: (32-token chunk, value head), or the streamed forward's transposed one, as the 64-token
// kernel's (dev::intra_cell; each streamed CTA publishes its chunk to the scan beside it).
template <typename WT, int K, bool kMid>
__global__ void __launch_bounds__(kIntraC32Threads, 4) kda_fwd_intra_c32_kernel(const KdaFwdParams p) {
  KF_DYN_SMEM(float4, smem_f4);
  const dev::IntraCell cell = dev::intra_cell<kC32>(p);
  int n, ch;
  // a varlen grid's idle tail; the streamed forward is fixed length only, so each of its CTAs has a
  // chunk to publish
  if (!dev::chunk_of<kC32>(p, cell.x, n, ch)) return;
  const dev::SeqInfo seq = dev::seq_info<kC32>(p, n);
  const IntraCtx<WT, K, kC32> c(p, reinterpret_cast<char*>(smem_f4), seq, ch, cell.hv,
                                dev::cta_clock_row(p.dbg_intra_clock));
  intra_chunk_c32<WT, K, kMid>(c, IntraToWorkspace<WT, K, kC32>{});
  dev::publish_cell(p, cell);
}

// The kernel a problem runs (dev::block_midpoint_ok picks the P2 form, as intra_kernel_for).
template <typename WT, int K>
auto intra_c32_kernel_for(const KdaFwdParams& p) {
  return dev::block_midpoint_ok(p.opt) ? kda_fwd_intra_c32_kernel<WT, K, true> : kda_fwd_intra_c32_kernel<WT, K, false>;
}

// The launch: one CTA per (32-token chunk, value head); the workspace is [B*T, HV, 32] for Aqk and
// Akk (and M), [B*T, HV, K] for w, qg, kg, [chunk_bound(p, 32), HV, K] for gdecay (with cu_seqlens the
// grid's tail CTAs find nothing: dev::chunk_of).
// Streamed: transposed and launched beside the scan's pass 1 (kda_launch_shape.h's intra_grid).
template <typename WT, int K>
inline LaunchShape intra_c32_launch(const KdaFwdParams& p) {
  return intra_grid(p, chunk_bound(p, kC32), kIntraC32Threads, sizeof(IntraSmem<WT, K, kC32>));
}

// The scan over the 32-token workspace: one CTA per (V-slice, value head, sequence), o and the final
// state, no h_states / h_ckpt; streamed (p.scan_pass 1 and 2, the chunk flags) as the 64-token scan.
template <typename WT, int K, int BV>
__global__ void __launch_bounds__(dev::scan_threads<BV>(), 1) kda_fwd_scan_c32_kernel(const KdaFwdParams p) {
  KF_DYN_SMEM(float4, smem_f4);
  fwd_scan_cta<WT, K, BV, true, false, kC32>(p, dev::scan_block(p), dev::scan_smem_base<WT>(smem_f4));
}

template <typename WT, int K, int BV>
inline LaunchShape scan_c32_launch(const KdaProblem& p) {
  return scan_grid(p, p.V / BV, dev::scan_threads<BV>(), dev::ScanStage<WT, K, BV, kC32>::kBytes);
}

#ifndef KF_EMU
// The launchers (instantiated for bf16 and fp16 at K = 128: fwd/instantiations/kda_fwd_c32_*.cu).
template <typename WT, int K>
void launch_intra_c32(const KdaFwdParams& p, cudaStream_t stream) {
  dev::launch_chunk_kernel(intra_c32_kernel_for<WT, K>(p), intra_c32_launch<WT, K>(p), p, stream);
}
template <typename WT, int K, int BV>
void launch_scan_c32(const KdaFwdParams& p, cudaStream_t stream) {
  dev::launch(kda_fwd_scan_c32_kernel<WT, K, BV>, scan_c32_launch<WT, K, BV>(p), p, stream);
}
#endif

}  // namespace kernel_fun::kda
