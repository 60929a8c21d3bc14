// kda_bwd_scans: the backward's two chunk scans in ONE launch -- the re-scan (kda_fwd_scan's body
// with o = null: the state checkpoints h_ckpt) and the reverse scan (kda_bwd_dh_scan's body: dh_ckpt,
// dv, dh0). Grid (2 V / BV, HV, N): x < V / BV runs re-scan item (x, y, z), the rest dh-scan item
// (x - V / BV, y, z), so the two kinds interleave in the CTA order.
//
// Why: the two recurrences are independent (the dh recursion reads do, qg, w, kg, Aqk, Akk and
// exp2(G), never h; their outputs are disjoint), and each is a serial chain over the chunks with one
// CTA per SM. When a problem has few (value head, sequence) rows -- B = 1, long sequences -- one
// scan's CTAs fill only part of the GPU (long_b1_t32k: 64 CTAs on 132 SMs), so two launches take
// the sum of both scans while one launch of both takes the longer one. kda_policy.h's
// bwd_pair_scans decides: only when both scans' CTAs fit in one wave (with more, the waves add up
// either way). Each CTA runs exactly the code its own kernel would, so the results are bitwise those
// of the two launches.
//
// Shared memory: dev::ScanStage x 2, as each scan alone (one CTA per SM at K = 128).
#pragma once

#include "kda/bwd/kda_bwd_dh_scan.cuh"
#include "kda/fwd/kda_fwd_scan.cuh"

namespace kernel_fun::kda {

template <typename WT, int K, int BV>
__global__ void __launch_bounds__(dev::scan_threads<BV>(), 1) kda_bwd_scans_kernel(const KdaBwdParams p) {
  KF_DYN_SMEM(float4, smem_f4);
  WT* sm = dev::scan_smem_base<WT>(smem_f4);
  const int nvs = p.V / BV;
  const dev::ScanBlock b = dev::scan_block(p);
  if (b.vs < nvs) fwd_scan_cta<WT, K, BV, false, true>(p, b, sm);  // the re-scan: states only (p.o is null)
  else dh_scan_cta<WT, K, BV>(p, dev::ScanBlock{b.vs - nvs, b.hv, b.n}, sm);
}

// The launch (kda_launch_shape.h): both scans' CTAs side by side, x in [0, V / BV) the re-scan's
// V-slices and x in [V / BV, 2 V / BV) the dh scan's; launch_scans' and the emulator's.
template <typename WT, int K, int BV>
inline LaunchShape scans_launch(const KdaProblem& p) {
  return dev::scan_launch<WT, K, BV>(p, 2 * (p.V / BV));
}

#ifndef KF_EMU
template <typename WT, int K, int BV>
void launch_scans(const KdaBwdParams& p, cudaStream_t stream) {
  dev::launch(kda_bwd_scans_kernel<WT, K, BV>, scans_launch<WT, K, BV>(p), p, stream);
}
#endif

}  // namespace kernel_fun::kda
