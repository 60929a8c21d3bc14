// kda_fwd_fused, version 0: the whole KDA forward of one (V-slice, value head, sequence) in one CTA
// of 256 threads, chunk after chunk, without the workspace: the intra phases (kda_fwd_intra.cuh,
// all 8 warps) write chunk c's factors straight into a scan stage (IntraToStage), the value slice
// lands beside them, then the state warps (the first BV / 16) advance the state through
// fwd_scan_step (kda_fwd_scan.cuh). The same device functions as the two-kernel path, so o and the
// final state are bit for bit that path's (the host emulator's test).
//
// What version 0 is NOT yet (issue 20; docs/notes/2026-12-02-fused-forward-groundwork.md): the intra
// of chunk c + 1 does not overlap the state update of chunk c (warp specialisation, a TMA ring of
// the inputs and mbarriers, common/pipeline.cuh), and with V / BV > 1 slices every slice repeats
// the intra. It is not the default: the launch policy keeps the two-kernel path until a fused
// version measures faster on the H200 (KERNEL_FUN_KDA_FWD_FUSED=1 opts in, for timing: the fused
// stage of kda_sequence.h's forward_sequence, kda_fwd.cu's kda_fwd_fused_wanted).
//
// Shared memory: FusedSmem (the intra scratch, then one ScanStage 1024-byte aligned, as the swizzled
// tiles need), placed at the first 1024-byte aligned byte of the dynamic shared memory.
#pragma once

#include "kda/fwd/kda_fwd_intra.cuh"
#include "kda/fwd/kda_fwd_scan.cuh"

namespace kernel_fun::kda {

template <typename WT, int K, int BV>
struct FusedSmem {
  IntraSmem<WT, K> intra;
  alignas(1024) WT stage[dev::ScanStage<WT, K, BV>::kStageElems];
};
// The dynamic shared memory a fused CTA asks for: the struct and the slack that aligning its base
// to 1024 bytes may cost (dev::scan_smem_base).
template <typename WT, int K, int BV>
constexpr size_t fused_smem_bytes() {
  static_assert(sizeof(FusedSmem<WT, K, BV>) + 1024 <= 227 * 1024,
                "fused forward shared memory exceeds the sm_90 per-CTA limit");
  static_assert(dev::scan_threads<BV>() <= kIntraThreads, "the state warps are a subset of the CTA");
  return sizeof(FusedSmem<WT, K, BV>) + 1024;
}

template <typename WT, int K, int BV>
__global__ void __launch_bounds__(kIntraThreads, 1) kda_fwd_fused_kernel(const KdaFwdParams p) {
  KF_DYN_SMEM(float4, smem_f4);
  auto* sm = reinterpret_cast<FusedSmem<WT, K, BV>*>(dev::scan_smem_base<WT>(smem_f4));
  WT* stage = sm->stage;
  const dev::ScanPlace<K, BV> pl(p, dev::scan_block(p));
  const bool state_warp = threadIdx.x < dev::scan_threads<BV>();
  const bool with_o = p.o != nullptr;
  float hT[K / 8][4];
  if (state_warp) dev::load_state<K>(hT, p.h0, pl.sbase, p, pl.col0, pl.t);
  for (int c = 0; c < pl.nchunks; ++c) {
    // the intra phases' first barrier also orders this chunk's stage writes after the state warps'
    // reads of the previous chunk's stage
    const IntraCtx<WT, K> ic(p, reinterpret_cast<char*>(&sm->intra), pl.seq, c, pl.hv);
    intra_chunk_any(ic, IntraToStage<WT, K, BV>{stage});
    dev::scan_load_values<WT, K, BV, kIntraThreads>(stage, reinterpret_cast<const WT*>(p.v), p, pl.seq, c, pl.hv,
                                                    pl.v0);
    dev::cp_async_commit();
    dev::cp_async_wait<0>();
    __syncthreads();
    if (state_warp && with_o) fwd_scan_step<WT, K, BV, true, false>(p, pl, dev::ScanOperands<WT, K, BV>(stage), c, hT, [] {});
    if (state_warp && !with_o) fwd_scan_step<WT, K, BV, false, true>(p, pl, dev::ScanOperands<WT, K, BV>(stage), c, hT, [] {});
  }
  if (state_warp && p.ht) dev::store_state<WT, K>(p.ht, pl.sbase, hT, p, pl.col0, pl.t);
}

// The launch (kda_launch_shape.h): the scans' grid (V / BV slices, value heads, sequences).
template <typename WT, int K, int BV>
inline LaunchShape fwd_fused_launch(const KdaProblem& p) {
  return scan_grid(p, p.V / BV, kIntraThreads, fused_smem_bytes<WT, K, BV>());
}

#ifndef KF_EMU
template <typename WT, int K, int BV>
void launch_fused(const KdaFwdParams& p, cudaStream_t stream) {
  dev::launch(kda_fwd_fused_kernel<WT, K, BV>, fwd_fused_launch<WT, K, BV>(p), p, stream);
}
#endif

}  // namespace kernel_fun::kda
