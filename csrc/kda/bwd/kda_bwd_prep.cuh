// kda_bwd_prep: the backward's recompute of the forward's per-chunk workspace from the raw inputs
// and the factors the forward saved (Aqk, Akk, M: the costly part of the forward intra, the
// products and the inverse, is NOT redone). One CTA per (chunk, value head), 256 threads. Writes
// what the re-scan and the dh scan read:
//   qg = scale q^ exp2(g2), kg = k^ exp2(G - g2), gdecay = exp2(G), w = Akk (k^ exp2(g2))
// with the forward intra's own device functions for the gate, the block-local cumsum, the l2norm
// factors and the gated rows (device/gate.cuh), so the exponents are built the same way.
// w is a bf16 / fp16 tensor-core product of the saved Akk and kexp rounded to WT (the forward's own
// w comes out of the intra's tf32 product of the unrounded factors: they differ at WT rounding).
//
// The kernel is latency bound (loads, then a little math, then stores): it keeps g2 in registers
// (dev::gate_rows; each thread later gates the very rows and columns whose cumsum it holds) and
// writes kexp over the raw q in place, so a CTA needs ~51 KB of smem at K = 128 instead of ~104 KB
// and FOUR CTAs share an SM instead of two (more chunks' loads in flight at once).
#pragma once

#include <cstdint>

#include "kda/bwd/kda_bwd_launch.h"
#include "kda/device/gate.cuh"
#include "kda/device/primitives.cuh"
#include "kda/device/sequence.cuh"

namespace kernel_fun::kda {

constexpr int kPrepThreads = 256;

constexpr int kPrepCtasPerSm = 4;

// Shared memory (a view of the dynamic shared memory; every member a multiple of 16 bytes).
template <typename WT, int K>
struct PrepSmem {
  static constexpr int KQ = K + 8;  // WT row stride of q (then kexp) and k
  static constexpr int AP = kChunk + 8;
  WT q[kChunk][KQ];  // raw q, then kexp (each element overwritten by the thread that read it)
  WT k[kChunk][KQ];
  WT akk[kChunk][AP];
  dev::GateStorage<K> gate;
};
template <typename WT, int K>
__global__ void __launch_bounds__(kPrepThreads, kPrepCtasPerSm) kda_bwd_prep_kernel(const KdaBwdParams p) {
  using S = PrepSmem<WT, K>;
  using Map = dev::GateMap<K, kPrepThreads>;
  constexpr int NTH = kPrepThreads, KQ = S::KQ, AP = S::AP, RPT = Map::RPT;
  KF_DYN_SMEM(float4, smem_f4);
  S* sm = reinterpret_cast<S*>(smem_f4);
  WT* sQ = &sm->q[0][0];
  WT* sK = &sm->k[0][0];
  WT* sKexp = sQ;
  WT* sAkk = &sm->akk[0][0];
  const dev::GateScratch<K> gs(sm->gate);
  float *sBT = gs.BT, *sBO = gs.BO, *sBS = gs.BS, *sGt = gs.Gt, *sBeta = gs.beta, *sRq = gs.rq, *sRk = gs.rk;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hv = blockIdx.y, HV = p.HV;
  const int h = hv / (HV / p.H);
  int n, c;
  if (!dev::chunk_of(p, blockIdx.x, n, c)) return;
  const dev::SeqInfo seq = dev::seq_info(p, n);
  const int64_t tok0 = seq.bos + static_cast<int64_t>(c) * kChunk;
  const int len = min(kChunk, seq.len - c * kChunk);
  const int gchunk = seq.chunk0 + c;

  // q, k rows and Akk rows -> smem (rows past the end zero-filled), in flight during the gate;
  // issued by gate_rows right behind the gate rows' loads
  auto issue_bulk = [&]() {
    const WT* q = reinterpret_cast<const WT*>(p.q);
    const WT* k = reinterpret_cast<const WT*>(p.k);
    constexpr int VPR = K / 8;
    for (int i = tid; i < kChunk * VPR; i += NTH) {
      const int r = i / VPR, c8 = (i % VPR) * 8;
      const bool ok = r < len;
      const int rr = ok ? r : 0;
      dev::cp_async16(sQ + r * KQ + c8, q + ((tok0 + rr) * p.H + h) * K + c8, ok ? 16 : 0);
      dev::cp_async16(sK + r * KQ + c8, k + ((tok0 + rr) * p.H + h) * K + c8, ok ? 16 : 0);
    }
    const WT* gAkk = reinterpret_cast<const WT*>(p.Akk);
    for (int i = tid; i < kChunk * 8; i += NTH) {
      const int r = i / 8, c8 = (i % 8) * 8;
      const bool ok = r < len;
      dev::cp_async16(sAkk + r * AP + c8, gAkk + ((tok0 + (ok ? r : 0)) * HV + hv) * kChunk + c8, ok ? 16 : 0);
    }
    dev::cp_async_commit();
  };
  dev::GatePass<K, NTH> gp(p, tok0, len, hv);
  float g2[RPT][8];  // this thread's GateMap rows, block-local
  dev::gate_rows<K, NTH>(gp, g2, sBT, sBeta, issue_bulk);
  dev::cp_async_wait<0>();
  __syncthreads();
  dev::block_offsets<K>(sBT, sBO, sBS, sGt);
  dev::row_rstd<WT, K, NTH, KQ>(sQ, sK, p.opt.l2norm, sRq, sRk);
  __syncthreads();

  // qg, kg -> workspace, kexp -> smem over q; exp2(G) -> gdecay. The thread's own GateMap rows: per
  // row, a warp covers 64 contiguous columns of 4 rows (128-byte segments).
  {
    WT* qg = reinterpret_cast<WT*>(p.qg);
    WT* kg = reinterpret_cast<WT*>(p.kg);
    const int d0 = gp.m.d0;
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const int r = gp.m.row0 + j;
      uint32_t pq[4], pk[4], px[4];
      dev::gated_vec8_loc<WT, K, KQ>(g2[j], sBO, sBT, sBS, sQ, sK, p.opt.scale * sRq[r], sRk[r], r, d0, pq, pk, px);
      // kexp over q at (r, d0 .. d0 + 7): only this thread read those q elements since the barrier
      *reinterpret_cast<uint4*>(sKexp + r * KQ + d0) = make_uint4(px[0], px[1], px[2], px[3]);
      if (r < len) {  // rows past the end are never written
        const int64_t off = ((tok0 + r) * HV + hv) * K + d0;
        dev::stg16(qg + off, make_uint4(pq[0], pq[1], pq[2], pq[3]));
        dev::stg16(kg + off, make_uint4(pk[0], pk[1], pk[2], pk[3]));
      }
    }
    if (tid < K) p.gdecay[(static_cast<int64_t>(gchunk) * HV + hv) * K + tid] = dev::fast_exp2(sGt[tid]);
  }
  __syncthreads();

  // w = Akk @ kexp on tensor cores: warp (rb = warp & 3, half = warp >> 2) takes rows 16 rb and
  // columns [half K/2, (half + 1) K/2); Akk is lower triangular (token blocks jj <= rb).
  {
    const int g = lane >> 2, t = lane & 3;
    const int rb = warp & 3, cb = (warp >> 2) * (K / 2);
    constexpr int NT = K / 16;  // n-tiles of 8 in the warp's K/2 columns
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      if (jj > rb) continue;
      uint32_t a[4];
      dev::ldsm_a(a, sAkk, AP, 16 * rb, 16 * jj);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        // B[k = token][n = column] = kexp[token][column]: transposed loads
        uint32_t b[4];
        dev::ldsm_b_t(b, sKexp, KQ, 16 * jj, cb + 16 * np);
        dev::mma_16x16<WT>(acc[2 * np], acc[2 * np + 1], a, b);
      }
    }
    WT* w = reinterpret_cast<WT*>(p.w);
    const int ra = 16 * rb + g, rc = ra + 8;
    dev::store_c_rows16<WT, NT>(w + ((tok0 + ra) * HV + hv) * K + cb, w + ((tok0 + rc) * HV + hv) * K + cb, ra < len,
                                rc < len, acc, t);
  }
}

// The launch (kda_launch_shape.h): launch_prep's and the emulator's.
template <typename WT, int K>
inline LaunchShape prep_launch(const KdaProblem& p) {
  static_assert(kPrepCtasPerSm * (sizeof(PrepSmem<WT, K>) + 1024) <= 228 * 1024, "kPrepCtasPerSm CTAs per SM");
  return chunk_grid(p, kPrepThreads, sizeof(PrepSmem<WT, K>));
}

#ifndef KF_EMU
template <typename WT, int K>
void launch_prep(const KdaBwdParams& p, cudaStream_t stream) {
  dev::launch_chunk_kernel(kda_bwd_prep_kernel<WT, K>, prep_launch<WT, K>(p), p, stream);
}
#endif

}  // namespace kernel_fun::kda
