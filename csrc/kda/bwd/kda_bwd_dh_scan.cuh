// kda_bwd_dh_scan: the reverse chunk recurrence of the KDA backward (stage B3 of
// src/kernel_fun/ref/kda_bwd.py), one CTA per (V-slice of BV columns, value head, sequence),
// BV / 16 warps, mma.sync m16n8k16 with fp32 accumulation. The mirror image of kda_fwd_scan: the
// state gradient dh [K, BV] lives TRANSPOSED in fp32 registers, warp w owning value columns
// [16 w, 16 w + 16) for the whole chunk (no barrier inside a chunk). Per chunk c, last to first:
//   0   dh_ckpt[c] = dhT                       (dh_{c+1}: what kda_bwd_grads reads for chunk c)
//   A   dv'T = dhT @ kg^T + doT @ Aqk          A = dhT packed / doT (ldmatrix.trans of do),
//                                              B = kg rows / Aqk (ldmatrix.trans; blocks jj >= pp)
//   B   dvT  = dv'T @ Akk -> dv                (v enters the forward only through u = Akk v)
//   C   dhT  = dhT * exp2(G)[k] + doT @ qg - dv'T @ w
// after chunk 0: dh0 = dhT. scale lives inside qg (the forward intra's workspace), never applied
// twice. Operands are rounded to WT, accumulation is fp32, as in the forward scan.
//
// Shared memory per stage (double-buffered, cp.async; rows past the sequence end zero-filled):
//   sW, sQg, sKg [64][K+8]; sAqk, sAkk [64][72] (blocks above the diagonal never loaded or read);
//   sDo [64][BV+8]; sDec [K] fp32 = exp2(G).
#pragma once

#include "kda/bwd/kda_bwd_launch.h"
#include "kda/device/primitives.cuh"
#include "kda/device/sequence.cuh"

namespace kernel_fun::kda {

template <typename WT, int K, int BV>
struct DhScanSmem {
  static constexpr int KP = K + 8;
  static constexpr int AP = kChunk + 8;
  static constexpr int VP = BV + 8;
  static constexpr int kW = 0;
  static constexpr int kQg = kW + kChunk * KP;
  static constexpr int kKg = kQg + kChunk * KP;
  static constexpr int kAqk = kKg + kChunk * KP;
  static constexpr int kAkk = kAqk + kChunk * AP;
  static constexpr int kDo = kAkk + kChunk * AP;
  static constexpr int kDec = kDo + kChunk * VP;  // fp32 [K] (offset in WT units)
  static constexpr int kStageElems = kDec + 2 * K;
  static constexpr size_t kBytes = sizeof(WT) * 2 * kStageElems;
  static_assert((kStageElems * sizeof(WT)) % 16 == 0, "stages must stay 16-byte aligned");
  static_assert(kBytes <= 227 * 1024, "dh scan shared memory exceeds the sm_90 per-CTA limit");
};

template <int BV>
constexpr int dh_scan_threads() {
  return BV / 16 * 32;
}

template <typename WT, int K, int BV>
__global__ void __launch_bounds__(dh_scan_threads<BV>(), 1) kda_bwd_dh_scan_kernel(const KdaBwdParams p) {
  using S = DhScanSmem<WT, K, BV>;
  using E = dev::Elem<WT>;
  constexpr int NT = dh_scan_threads<BV>();
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

  // dhT[j][e]: value column v0 + vw + g + 8 (e >> 1), state row k = 8 j + 2 t + (e & 1)
  float dhT[NK][4];
  const int64_t sbase = (static_cast<int64_t>(n) * HV + hv) * K * V;
  auto state_index = [&](int j, int e) -> int64_t {
    const int k = 8 * j + 2 * t + (e & 1);
    const int col = v0 + vw + g + 8 * (e >> 1);
    return p.opt.state_v_first ? static_cast<int64_t>(col) * K + k : static_cast<int64_t>(k) * V + col;
  };
#pragma unroll
  for (int j = 0; j < NK; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dhT[j][e] = p.dht ? p.dht[sbase + state_index(j, e)] : 0.f;

  const WT* gw = reinterpret_cast<const WT*>(p.w);
  const WT* gqg = reinterpret_cast<const WT*>(p.qg);
  const WT* gkg = reinterpret_cast<const WT*>(p.kg);
  const WT* gAqk = reinterpret_cast<const WT*>(p.Aqk);
  const WT* gAkk = reinterpret_cast<const WT*>(p.Akk);
  const WT* gdo = reinterpret_cast<const WT*>(p.dout);

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
      dev::cp_async16(base + S::kQg + so, gqg + off, nb);
      dev::cp_async16(base + S::kKg + so, gkg + off, nb);
    }
    for (int i = tid; i < kChunk * 8; i += NT) {
      const int r = i / 8, c8 = (i % 8) * 8;
      if ((c8 >> 4) > (r >> 4)) continue;  // above the diagonal: never read
      const bool ok = r < rows;
      const int64_t off = ((tok0 + (ok ? r : 0)) * HV + hv) * kChunk + c8;
      const int nb = ok ? 16 : 0;
      const int so = r * AP + c8;
      dev::cp_async16(base + S::kAqk + so, gAqk + off, nb);
      dev::cp_async16(base + S::kAkk + so, gAkk + off, nb);
    }
    constexpr int BV8 = BV / 8;
    for (int i = tid; i < kChunk * BV8; i += NT) {
      const int r = i / BV8, c8 = (i % BV8) * 8;
      const bool ok = r < rows;
      const int64_t off = ((tok0 + (ok ? r : 0)) * HV + hv) * V + v0 + c8;
      dev::cp_async16(base + S::kDo + r * VP + c8, gdo + off, ok ? 16 : 0);
    }
    float* dec = reinterpret_cast<float*>(base + S::kDec);
    const float* gdec = p.gdecay + (static_cast<int64_t>(seq.chunk0 + cc) * HV + hv) * K;
    for (int i = tid; i < K / 4; i += NT) dev::cp_async16(dec + 4 * i, gdec + 4 * i, 16);
  };

  if (nchunks > 0) load_chunk(nchunks - 1, 0);
  dev::cp_async_commit();

  WT* dv = reinterpret_cast<WT*>(p.dv);
  WT* dhc = reinterpret_cast<WT*>(p.dh_ckpt);

  for (int i = 0; i < nchunks; ++i) {
    const int c = nchunks - 1 - i;
    const int st = i & 1;
    dev::cp_async_wait<0>();
    // stage st landed for everyone; everyone is done with stage st ^ 1 (chunk c + 1)
    __syncthreads();
    if (c > 0) load_chunk(c - 1, st ^ 1);
    dev::cp_async_commit();

    const WT* base = sm + st * S::kStageElems;
    const WT* sW = base + S::kW;
    const WT* sQg = base + S::kQg;
    const WT* sKg = base + S::kKg;
    const WT* sAqk = base + S::kAqk;
    const WT* sAkk = base + S::kAkk;
    const WT* sDo = base + S::kDo;
    const float* sDec = reinterpret_cast<const float*>(base + S::kDec);

    // ---------------- 0: the checkpoint dh_{c+1} for chunk c, [chunk][hv][v][k] (k pairs adjacent)
    {
      WT* hc = dhc + (static_cast<int64_t>(seq.chunk0 + c) * HV + hv) * V * K;
#pragma unroll
      for (int j = 0; j < NK; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int col = v0 + vw + g + 8 * hh;
          *reinterpret_cast<uint32_t*>(hc + static_cast<int64_t>(col) * K + 8 * j + 2 * t) =
              E::pack2(dhT[j][2 * hh], dhT[j][2 * hh + 1]);
        }
    }

    // ---------------- A: dv'T = dhT @ kg^T + doT @ Aqk   ([16 v] x [64 tokens], n-tiles of 8 tokens)
    float dvT[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dvT[j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t a[4];
      a[0] = E::pack2(dhT[2 * kk][0], dhT[2 * kk][1]);
      a[1] = E::pack2(dhT[2 * kk][2], dhT[2 * kk][3]);
      a[2] = E::pack2(dhT[2 * kk + 1][0], dhT[2 * kk + 1][1]);
      a[3] = E::pack2(dhT[2 * kk + 1][2], dhT[2 * kk + 1][3]);
#pragma unroll
      for (int pp = 0; pp < 4; ++pp) {
        // B[k][n = token] = kg[token][k]: matrix m = tokens 16 pp + (m >> 1) 8, k 16 kk + (m & 1) 8
        uint32_t b[4];
        dev::ldsm_x4(b, sKg + (16 * pp + (lmat >> 1) * 8 + lrow) * KP + 16 * kk + (lmat & 1) * 8);
        dev::mma_16816<WT>(dvT[2 * pp], a, b[0], b[1]);
        dev::mma_16816<WT>(dvT[2 * pp + 1], a, b[2], b[3]);
      }
    }
    // doT as A fragments per 16-token block jj (transposed loads of the [token][v] tile), kept for C
    uint32_t adoT[4][4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      dev::ldsm_x4_t(adoT[jj], sDo + (16 * jj + (lmat >> 1) * 8 + lrow) * VP + vw + (lmat & 1) * 8);
#pragma unroll
      for (int pp = 0; pp <= jj; ++pp) {
        // B[k = token][n = token'] = Aqk[token][token'] (nonzero for token >= token': pp <= jj)
        uint32_t b[4];
        dev::ldsm_x4_t(b, sAqk + (16 * jj + (lmat & 1) * 8 + lrow) * AP + 16 * pp + (lmat >> 1) * 8);
        dev::mma_16816<WT>(dvT[2 * pp], adoT[jj], b[0], b[1]);
        dev::mma_16816<WT>(dvT[2 * pp + 1], adoT[jj], b[2], b[3]);
      }
    }
    // dv'T as A fragments over the token dimension (rounded to WT), and its negation for C
    uint32_t va[4][4], vn[4][4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      va[jj][0] = E::pack2(dvT[2 * jj][0], dvT[2 * jj][1]);
      va[jj][1] = E::pack2(dvT[2 * jj][2], dvT[2 * jj][3]);
      va[jj][2] = E::pack2(dvT[2 * jj + 1][0], dvT[2 * jj + 1][1]);
      va[jj][3] = E::pack2(dvT[2 * jj + 1][2], dvT[2 * jj + 1][3]);
      vn[jj][0] = E::pack2(-dvT[2 * jj][0], -dvT[2 * jj][1]);
      vn[jj][1] = E::pack2(-dvT[2 * jj][2], -dvT[2 * jj][3]);
      vn[jj][2] = E::pack2(-dvT[2 * jj + 1][0], -dvT[2 * jj + 1][1]);
      vn[jj][3] = E::pack2(-dvT[2 * jj + 1][2], -dvT[2 * jj + 1][3]);
    }

    // ---------------- B: dvT = dv'T @ Akk -> dv   (B[k = token][n = token'] = Akk[token][token'])
    {
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
          dev::ldsm_x4_t(b, sAkk + (16 * jj + (lmat & 1) * 8 + lrow) * AP + 16 * pp + (lmat >> 1) * 8);
          dev::mma_16816<WT>(acc[2 * pp], va[jj], b[0], b[1]);
          dev::mma_16816<WT>(acc[2 * pp + 1], va[jj], b[2], b[3]);
        }
      }
      // acc[j][e] = dv[token 8 j + 2 t + (e & 1)][value g + 8 (e >> 1)]: swap with the lane of the
      // neighbouring value (g ^ 1) so each lane stores two adjacent values of one token.
      const int rows = min(kChunk, seq.len - c * kChunk);
      const int64_t tok0 = seq.bos + static_cast<int64_t>(c) * kChunk;
      const bool odd = g & 1;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float x0 = acc[j][2 * hh], x1 = acc[j][2 * hh + 1];
          const float recv = __shfl_xor_sync(0xffffffffu, odd ? x0 : x1, 4);
          const int tok = 8 * j + 2 * t + (odd ? 1 : 0);
          const int col = v0 + vw + 8 * hh + (g & ~1);
          const uint32_t pk = odd ? E::pack2(recv, x1) : E::pack2(x0, recv);
          if (tok < rows) *reinterpret_cast<uint32_t*>(dv + ((tok0 + tok) * HV + hv) * V + col) = pk;
        }
    }

    // ---------------- C: dhT = dhT * exp2(G)[k] + doT @ qg - dv'T @ w
#pragma unroll
    for (int j = 0; j < NK; ++j) {
      const float2 d = *reinterpret_cast<const float2*>(sDec + 8 * j + 2 * t);
      dhT[j][0] *= d.x;
      dhT[j][1] *= d.y;
      dhT[j][2] *= d.x;
      dhT[j][3] *= d.y;
    }
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
      for (int q = 0; q < K / 16; ++q) {
        // B[k = token][n = state row] = qg / w [token][k]: transposed loads; matrix m = tokens
        // 16 jj + (m & 1) 8, state rows 16 q + (m >> 1) 8
        const int off = (16 * jj + (lmat & 1) * 8 + lrow) * KP + 16 * q + (lmat >> 1) * 8;
        uint32_t bq[4], bw[4];
        dev::ldsm_x4_t(bq, sQg + off);
        dev::ldsm_x4_t(bw, sW + off);
        dev::mma_16816<WT>(dhT[2 * q], adoT[jj], bq[0], bq[1]);
        dev::mma_16816<WT>(dhT[2 * q + 1], adoT[jj], bq[2], bq[3]);
        dev::mma_16816<WT>(dhT[2 * q], vn[jj], bw[0], bw[1]);
        dev::mma_16816<WT>(dhT[2 * q + 1], vn[jj], bw[2], bw[3]);
      }
    }
  }
  dev::cp_async_wait<0>();

  if (p.dh0) {
#pragma unroll
    for (int j = 0; j < NK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) p.dh0[sbase + state_index(j, e)] = dhT[j][e];
  }
}

#ifndef KF_EMU
template <typename WT, int K, int BV>
void launch_dh_scan(const KdaBwdParams& p, cudaStream_t stream) {
  constexpr size_t smem = DhScanSmem<WT, K, BV>::kBytes;
  auto kern = kda_bwd_dh_scan_kernel<WT, K, BV>;
  KF_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (p.N == 0 || p.HV == 0) return;
  kern<<<dim3(p.V / BV, p.HV, p.N), dh_scan_threads<BV>(), smem, stream>>>(p);
  KF_CHECK_LAUNCH();
}
#endif

}  // namespace kernel_fun::kda
