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
constexpr int kPolicySMs = 132;  // the H100 / H200 SM count the models assume
// KB of one scan stage: w, qg, kg + Aqk, Akk + the value tile, padded
inline double scan_fill_kb(int K, int bv) { return 52.0 * (K / 128.0) + 18.0 + bv / 8.0; }
// scan CTAs one SM holds (double-buffered stages)
inline int scan_ctas_per_sm(int K, int bv) { return 2 * scan_fill_kb(K, bv) <= 110 ? 2 : 1; }
inline ScanChoice scan_choice(const KdaProblem& p) {
  constexpr int kSMs = kPolicySMs;
  const long rows = static_cast<long>(p.HV) * p.N;
  const double kw = p.K / 128.0;
  ScanChoice best{64, 0.0};
  for (int bv : {128, 64}) {
    if (p.V % bv != 0) continue;
    const int warps = bv / 16;
    const double fill_kb = scan_fill_kb(p.K, bv);
    const double warp_kb = 48.0 * kw + 12.0;  // ldmatrix bytes one warp reads
    const int per_sm = scan_ctas_per_sm(p.K, bv);
    const double chunk = std::max(per_sm * (fill_kb + warps * warp_kb), 190.0 * kw + 60.0);
    const long ctas = rows * (p.V / bv);
    const long waves = (ctas + static_cast<long>(kSMs) * per_sm - 1) / (static_cast<long>(kSMs) * per_sm);
    const double cost = waves * chunk;
    if (best.cost == 0 || cost < best.cost) best = {bv, cost};
  }
  return best;
}

// Whether the backward runs its re-scan and its dh scan as ONE launch (bwd/kda_bwd_scans.cuh):
// when the CTAs of both fit in one wave, the launch takes the longer scan's time instead of the sum
// of both (B = 1 and few heads: long_b1_t32k pairs 64 + 64 CTAs on 132 SMs). With more CTAs than
// one wave the waves add up either way, and the separate launches are kept. p: one batch slice.
inline bool bwd_pair_scans(const KdaProblem& p, int bv) {
  const long ctas = static_cast<long>(p.HV) * p.N * (p.V / bv);
  return ctas > 0 && 2 * ctas <= static_cast<long>(kPolicySMs) * scan_ctas_per_sm(p.K, bv);
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
