// Host-side launch policy of the KDA kernels: pure functions of the problem's shape (no CUDA, no
// environment), so the launchers (fwd/kda_fwd.cu, bwd/kda_bwd.cu, which add the environment
// overrides) and the host emulator (tests/emu) decide the same way.
#pragma once

#include <algorithm>

#include "kda/kda_problem.h"

namespace kernel_fun::kda {

// Every warp does the whole chunk for its 16 value columns, so a CTA's per-chunk time is set by
// what its warps share: shared-memory bandwidth (128 B/clk/SM) for the chunk's fill plus every
// warp's ldmatrix reads of the K-wide tiles (~60 KB per warp per chunk at K=128), with a floor of
// one warp's own serial chain. Modelled cost = waves x per-chunk time; the smallest wins.
// Since the fifth backward session the scans read the K-wide tiles once per warpgroup (wgmma), not
// per warp: this model, and its picks (compared with forced widths by scripts/bench_kda_scan.py),
// predate that and have not been re-measured.
// BV=32 is not supported: on the H200 it never won (B1 T32768 H32: 1.65 ms at 32 vs 1.53 at 64;
// B1 T8192 H16: 0.415 vs 0.400; K=V=64: 0.182 vs 0.152).
struct ScanChoice {
  int bv;       // V-slice width, 64 or 128
  double cost;  // modelled time: waves of CTAs x the per-chunk cost of one CTA step
};
inline ScanChoice scan_choice(const KdaProblem& p) {
  constexpr int kSMs = 132;
  const long rows = static_cast<long>(p.HV) * p.N;
  const double kw = p.K / 128.0;
  ScanChoice best{64, 0.0};
  for (int bv : {128, 64}) {
    if (p.V % bv != 0) continue;
    const int warps = bv / 16;
    const double fill_kb = 52.0 * kw + 18.0 + bv / 8.0;  // w, qg, kg + Aqk, Akk + v, padded
    const double warp_kb = 48.0 * kw + 12.0;             // ldmatrix bytes one warp reads
    const double smem_kb = 2 * fill_kb;                  // double-buffered stage
    const int per_sm = smem_kb <= 110 ? 2 : 1;
    const double chunk = std::max(per_sm * (fill_kb + warps * warp_kb), 190.0 * kw + 60.0);
    const long ctas = rows * (p.V / bv);
    const long waves = (ctas + static_cast<long>(kSMs) * per_sm - 1) / (static_cast<long>(kSMs) * per_sm);
    const double cost = waves * chunk;
    if (best.cost == 0 || cost < best.cost) best = {bv, cost};
  }
  return best;
}

// Batches per backward slice (bwd/kda_bwd_slice.h): B (one pass) for varlen or B = 1, else the
// smallest slice whose two scans model no more time than one pass over the whole batch (a serial
// scan at K = 128 runs one CTA per SM, so 512 scan CTAs cost 4 waves at once or as 4 slices of 128).
inline int bwd_slice_batches(const KdaProblem& p) {
  if (p.cu_seqlens || p.B <= 1) return p.B;
  KdaProblem s = p;
  const double whole = scan_choice(p).cost;
  for (int nb = 1; nb < p.B; ++nb) {
    s.B = s.N = nb;
    // the last slice may be smaller: its scan costs at most a full slice's
    if ((p.B + nb - 1) / nb * scan_choice(s).cost <= whole) return nb;
  }
  return p.B;
}

}  // namespace kernel_fun::kda
