// kda_fwd_scan: the serial chunk recurrence of the KDA forward, one CTA per (V-slice of BV
// columns, value head, sequence), BV / 16 warps, mma.sync m16n8k16 with fp32 accumulation.
//
// The state is kept TRANSPOSED, hT [BV, K], in fp32 registers: warp w owns value columns
// [16 w, 16 w + 16) of the slice and runs the whole chunk for them from its own registers -- no
// barrier inside a chunk, no smem copy of h, no smem round trip of v'. Its hT rows are mma.sync C
// fragments over K (n-tiles of 8 state rows k). Per chunk (tokens i, j of the chunk; rows past the
// sequence end are zero-filled on load and never stored):
//   A   WHT = hT @ w^T, OT = hT @ qg^T       A = hT (fp32 accumulators packed to WT: the C layout of
//                                            n-tiles 2kk, 2kk+1 is the A layout of k-step kk),
//                                            B = w / qg rows from smem (ldmatrix, non-transposed)
//   B   v'T = vT @ Akk^T - WHT                A = vT (ldmatrix.trans of the [token][v] tile),
//                                            B = Akk rows (lower-triangular: blocks j <= i only)
//   C   OT += v'T @ Aqk^T -> o                A = v'T from registers (packed to WT)
//   D   hT = hT * exp2(G)[k] + v'T @ kg       B = kg [token][k] (ldmatrix.trans)
// scale lives inside qg and Aqk (kda_fwd_intra), so it is never applied twice. h and v' are rounded
// to WT as MMA operands; accumulation is fp32 everywhere.
// The backward's re-scan runs this kernel with o = null (no qg loads, no OT products, no o stores)
// and h_ckpt set: the state before every chunk, [chunk][HV][V][K] in WT, for kda_bwd_grads.
//
// Shared memory plan (WT elements; rows padded by 8 so ldmatrix rows hit distinct banks):
//   stage s in {0,1}: sW, sQg, sKg [64][K+8]; sAqk, sAkk [64][72] (16x16 blocks above the diagonal
//   are never loaded); sV [64][BV+8]; sDec [K] fp32 = exp2(G).
//   Stage (c+1)&1 is filled by cp.async while chunk c computes on stage c&1; the only CTA-wide
//   barrier per chunk hands the stage over.
#pragma once

#include "kda/device/primitives.cuh"
#include "kda/device/sequence.cuh"
#include "kda/fwd/kda_fwd_launch.h"

namespace kernel_fun::kda {

template <typename WT, int K, int BV>
struct ScanSmem {
  static constexpr int KP = K + 8;
  static constexpr int AP = kChunk + 8;
  static constexpr int VP = BV + 8;
  static constexpr int kW = 0;
  static constexpr int kQg = kW + kChunk * KP;
  static constexpr int kKg = kQg + kChunk * KP;
  static constexpr int kAqk = kKg + kChunk * KP;
  static constexpr int kAkk = kAqk + kChunk * AP;
  static constexpr int kV = kAkk + kChunk * AP;
  static constexpr int kDec = kV + kChunk * VP;  // fp32 [K] (offset in WT units)
  static constexpr int kStageElems = kDec + 2 * K;
  static constexpr int kElems = 2 * kStageElems;
  static constexpr size_t kBytes = sizeof(WT) * kElems;
  static_assert((kStageElems * sizeof(WT)) % 16 == 0, "stages must stay 16-byte aligned");
  static_assert(kBytes <= 227 * 1024, "scan shared memory exceeds the sm_90 per-CTA limit");
};

template <int BV>
constexpr int scan_threads() {
  return BV / 16 * 32;
}

template <typename WT, int K, int BV>
__global__ void __launch_bounds__(scan_threads<BV>(), 1) kda_fwd_scan_kernel(const KdaFwdParams p) {
  using S = ScanSmem<WT, K, BV>;
  using E = dev::Elem<WT>;
  constexpr int NT = scan_threads<BV>();
  constexpr int KP = S::KP, AP = S::AP, VP = S::VP;
  constexpr int NK = K / 8;  // n-tiles of the state (8 state rows k each)
  static_assert(BV == 64 || BV == 128, "BV in {64, 128}");

  KF_DYN_SMEM(float4, smem_f4);
  WT* sm = reinterpret_cast<WT*>(smem_f4);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int lrow = lane & 7, lmat = lane >> 3;
  const int vs = blockIdx.x, hv = blockIdx.y, n = blockIdx.z;
  const int HV = p.HV, V = p.V;
  const int v0 = vs * BV;
  const int vw = 16 * warp;  // this warp's value columns within the slice
  const dev::SeqInfo seq = dev::seq_info(p, n);
  const int nchunks = (seq.len + kChunk - 1) / kChunk;

  // hT[j][e]: value column v0 + vw + g + 8 (e >> 1), state row k = 8 j + 2 t + (e & 1)
  float hT[NK][4];
  const int64_t sbase = (static_cast<int64_t>(n) * HV + hv) * K * V;
  auto state_index = [&](int j, int e) -> int64_t {
    const int k = 8 * j + 2 * t + (e & 1);
    const int col = v0 + vw + g + 8 * (e >> 1);
    return p.opt.state_v_first ? static_cast<int64_t>(col) * K + k : static_cast<int64_t>(k) * V + col;
  };
#pragma unroll
  for (int j = 0; j < NK; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) hT[j][e] = p.h0 ? p.h0[sbase + state_index(j, e)] : 0.f;

  const bool with_o = p.o != nullptr;  // uniform: the backward's re-scan wants only the states
  const WT* gw = reinterpret_cast<const WT*>(p.w);
  const WT* gqg = reinterpret_cast<const WT*>(p.qg);
  const WT* gkg = reinterpret_cast<const WT*>(p.kg);
  const WT* gAqk = reinterpret_cast<const WT*>(p.Aqk);
  const WT* gAkk = reinterpret_cast<const WT*>(p.Akk);
  const WT* gv = reinterpret_cast<const WT*>(p.v);

  // async load of chunk cc into stage st (rows >= the chunk's length are zero-filled). Aqk / Akk
  // blocks strictly above the diagonal (16-column block > 16-row block) are never read: not loaded.
  auto load_chunk = [&](int cc, int st) {
    WT* base = sm + st * S::kStageElems;
    const int64_t tok0 = seq.bos + static_cast<int64_t>(cc) * kChunk;
    const int rows = min(kChunk, seq.len - cc * kChunk);
    constexpr int KV8 = K / 8;
    for (int i = tid; i < kChunk * KV8; i += NT) {
      const int r = i / KV8, c8 = (i % KV8) * 8;
      const bool ok = r < rows;
      const int64_t off = ((tok0 + (ok ? r : 0)) * HV + hv) * K + c8;
      const int nb = ok ? 16 : 0;
      const int so = r * KP + c8;
      dev::cp_async16(base + S::kW + so, gw + off, nb);
      if (with_o) dev::cp_async16(base + S::kQg + so, gqg + off, nb);
      dev::cp_async16(base + S::kKg + so, gkg + off, nb);
    }
    for (int i = tid; i < kChunk * 8; i += NT) {
      const int r = i / 8, c8 = (i % 8) * 8;
      if ((c8 >> 4) > (r >> 4)) continue;  // above the diagonal: never read
      const bool ok = r < rows;
      const int64_t off = ((tok0 + (ok ? r : 0)) * HV + hv) * kChunk + c8;
      const int nb = ok ? 16 : 0;
      const int so = r * AP + c8;
      if (with_o) dev::cp_async16(base + S::kAqk + so, gAqk + off, nb);
      dev::cp_async16(base + S::kAkk + so, gAkk + off, nb);
    }
    constexpr int BV8 = BV / 8;
    for (int i = tid; i < kChunk * BV8; i += NT) {
      const int r = i / BV8, c8 = (i % BV8) * 8;
      const bool ok = r < rows;
      const int64_t off = ((tok0 + (ok ? r : 0)) * HV + hv) * V + v0 + c8;
      dev::cp_async16(base + S::kV + r * VP + c8, gv + off, ok ? 16 : 0);
    }
    float* dec = reinterpret_cast<float*>(base + S::kDec);
    const float* gdec = p.gdecay + (static_cast<int64_t>(seq.chunk0 + cc) * HV + hv) * K;
    for (int i = tid; i < K / 4; i += NT) dev::cp_async16(dec + 4 * i, gdec + 4 * i, 16);
  };

  if (nchunks > 0) load_chunk(0, 0);
  dev::cp_async_commit();

  WT* o = reinterpret_cast<WT*>(p.o);
  WT* hst = reinterpret_cast<WT*>(p.h_states);

  for (int c = 0; c < nchunks; ++c) {
    const int st = c & 1;
    dev::cp_async_wait<0>();
    // stage st landed for everyone; everyone is done with stage st ^ 1 (chunk c - 1)
    __syncthreads();
    if (c + 1 < nchunks) load_chunk(c + 1, st ^ 1);
    dev::cp_async_commit();

    const WT* base = sm + st * S::kStageElems;
    const WT* sW = base + S::kW;
    const WT* sQg = base + S::kQg;
    const WT* sKg = base + S::kKg;
    const WT* sAqk = base + S::kAqk;
    const WT* sAkk = base + S::kAkk;
    const WT* sV = base + S::kV;
    const float* sDec = reinterpret_cast<const float*>(base + S::kDec);

    if (p.h_ckpt) {  // the backward's checkpoint of the state read by chunk c: [chunk][hv][v][k], k pairs
      WT* hc = reinterpret_cast<WT*>(p.h_ckpt) + (static_cast<int64_t>(seq.chunk0 + c) * HV + hv) * V * K;
#pragma unroll
      for (int j = 0; j < NK; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int col = v0 + vw + g + 8 * hh;
          *reinterpret_cast<uint32_t*>(hc + static_cast<int64_t>(col) * K + 8 * j + 2 * t) =
              E::pack2(hT[j][2 * hh], hT[j][2 * hh + 1]);
        }
    }
    if (hst) {  // the state read by chunk c (fla's h), in the output dtype
      const int64_t hb = (static_cast<int64_t>(seq.chunk0 + c) * HV + hv) * K * V;
#pragma unroll
      for (int j = 0; j < NK; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) hst[hb + state_index(j, e)] = E::from_float(hT[j][e]);
    }

    // ---------------- A: WHT = hT @ w^T, OT = hT @ qg^T   ([16 v] x [64 tokens], n-tiles of 8 tokens)
    float whT[8][4], oT[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) whT[j][e] = oT[j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t a[4];
      a[0] = E::pack2(hT[2 * kk][0], hT[2 * kk][1]);
      a[1] = E::pack2(hT[2 * kk][2], hT[2 * kk][3]);
      a[2] = E::pack2(hT[2 * kk + 1][0], hT[2 * kk + 1][1]);
      a[3] = E::pack2(hT[2 * kk + 1][2], hT[2 * kk + 1][3]);
#pragma unroll
      for (int pp = 0; pp < 4; ++pp) {
        // B[k][n = token] = w[token][k]: matrix m = tokens 16 pp + (m >> 1) 8, k 16 kk + (m & 1) 8
        const int off = (16 * pp + (lmat >> 1) * 8 + lrow) * KP + 16 * kk + (lmat & 1) * 8;
        uint32_t bw[4];
        dev::ldsm_x4(bw, sW + off);
        dev::mma_16816<WT>(whT[2 * pp], a, bw[0], bw[1]);
        dev::mma_16816<WT>(whT[2 * pp + 1], a, bw[2], bw[3]);
        if (with_o) {
          uint32_t bq[4];
          dev::ldsm_x4(bq, sQg + off);
          dev::mma_16816<WT>(oT[2 * pp], a, bq[0], bq[1]);
          dev::mma_16816<WT>(oT[2 * pp + 1], a, bq[2], bq[3]);
        }
      }
    }

    // ---------------- B: v'T = vT @ Akk^T - WHT   (Akk[i][j] = 0 for j > i: blocks jj <= pp)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) whT[j][e] = -whT[j][e];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      // A[m = v][k = token j]: transposed loads of the [token][v] tile; matrix m = tokens
      // 16 jj + (m >> 1) 8, values vw + (m & 1) 8
      uint32_t a[4];
      dev::ldsm_x4_t(a, sV + (16 * jj + (lmat >> 1) * 8 + lrow) * VP + vw + (lmat & 1) * 8);
#pragma unroll
      for (int pp = jj; pp < 4; ++pp) {
        uint32_t b[4];
        dev::ldsm_x4(b, sAkk + (16 * pp + (lmat >> 1) * 8 + lrow) * AP + 16 * jj + (lmat & 1) * 8);
        dev::mma_16816<WT>(whT[2 * pp], a, b[0], b[1]);
        dev::mma_16816<WT>(whT[2 * pp + 1], a, b[2], b[3]);
      }
    }
    // v'T as A fragments over the token dimension (rounded to WT)
    uint32_t va[4][4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      va[jj][0] = E::pack2(whT[2 * jj][0], whT[2 * jj][1]);
      va[jj][1] = E::pack2(whT[2 * jj][2], whT[2 * jj][3]);
      va[jj][2] = E::pack2(whT[2 * jj + 1][0], whT[2 * jj + 1][1]);
      va[jj][3] = E::pack2(whT[2 * jj + 1][2], whT[2 * jj + 1][3]);
    }

    // ---------------- C: OT += v'T @ Aqk^T -> o
    if (with_o) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
      for (int pp = jj; pp < 4; ++pp) {
        uint32_t b[4];
        dev::ldsm_x4(b, sAqk + (16 * pp + (lmat >> 1) * 8 + lrow) * AP + 16 * jj + (lmat & 1) * 8);
        dev::mma_16816<WT>(oT[2 * pp], va[jj], b[0], b[1]);
        dev::mma_16816<WT>(oT[2 * pp + 1], va[jj], b[2], b[3]);
      }
    }
    {
      // oT[j][e] = o[token 8 j + 2 t + (e & 1)][value g + 8 (e >> 1)]: swap with the lane of the
      // neighbouring value (g ^ 1) so each lane stores two adjacent values of one token.
      const int rows = min(kChunk, seq.len - c * kChunk);
      const int64_t tok0 = seq.bos + static_cast<int64_t>(c) * kChunk;
      const bool odd = g & 1;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float x0 = oT[j][2 * hh], x1 = oT[j][2 * hh + 1];
          const float recv = __shfl_xor_sync(0xffffffffu, odd ? x0 : x1, 4);
          const int tok = 8 * j + 2 * t + (odd ? 1 : 0);
          const int col = v0 + vw + 8 * hh + (g & ~1);
          const uint32_t pk = odd ? E::pack2(recv, x1) : E::pack2(x0, recv);
          if (tok < rows) *reinterpret_cast<uint32_t*>(o + ((tok0 + tok) * HV + hv) * V + col) = pk;
        }
    }
    }  // with_o

    // ---------------- D: hT = hT * exp2(G)[k] + v'T @ kg
#pragma unroll
    for (int j = 0; j < NK; ++j) {
      const float2 d = *reinterpret_cast<const float2*>(sDec + 8 * j + 2 * t);
      hT[j][0] *= d.x;
      hT[j][1] *= d.y;
      hT[j][2] *= d.x;
      hT[j][3] *= d.y;
    }
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
      for (int q = 0; q < K / 16; ++q) {
        // B[k = token][n = state row] = kg[token][k]: transposed loads; matrix m = tokens
        // 16 jj + (m & 1) 8, state rows 16 q + (m >> 1) 8
        uint32_t b[4];
        dev::ldsm_x4_t(b, sKg + (16 * jj + (lmat & 1) * 8 + lrow) * KP + 16 * q + (lmat >> 1) * 8);
        dev::mma_16816<WT>(hT[2 * q], va[jj], b[0], b[1]);
        dev::mma_16816<WT>(hT[2 * q + 1], va[jj], b[2], b[3]);
      }
    }
  }
  dev::cp_async_wait<0>();

  if (p.ht) {
#pragma unroll
    for (int j = 0; j < NK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) p.ht[sbase + state_index(j, e)] = hT[j][e];
  }
}

#ifndef KF_EMU
template <typename WT, int K, int BV>
void launch_scan(const KdaFwdParams& p, cudaStream_t stream) {
  constexpr size_t smem = ScanSmem<WT, K, BV>::kBytes;
  auto kern = kda_fwd_scan_kernel<WT, K, BV>;
  KF_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (p.N == 0 || p.HV == 0) return;
  kern<<<dim3(p.V / BV, p.HV, p.N), scan_threads<BV>(), smem, stream>>>(p);
  KF_CHECK_LAUNCH();
}
#endif

}  // namespace kernel_fun::kda
