// kda_fwd_scan: the serial chunk recurrence of the KDA forward, one CTA per
// (V-slice of BV columns, value head, sequence), 8 warps, mma.sync m16n8k16 with fp32 accumulation.
//
// Per chunk c (64 rows; rows past the sequence end are zero-filled on load and never stored):
//   A   WH = w @ h,  O = qg @ h            (h: bf16/fp16 copy of the fp32 state, in smem)
//   B   U  = Akk @ v (Akk lower-triangular) ; v' = U - WH  -> smem (overwrites v of this stage)
//   C   O += Aqk @ v'                       -> o
//   D   h  = exp2(G)[:, None] * h + kg^T @ v'   (fp32 accumulators, registers), bf16 copy -> smem
// scale lives inside qg and Aqk (kda_fwd_intra), so it is never applied twice.
//
// Shared memory plan (WT elements; rows padded by 8 so ldmatrix rows hit distinct banks):
//   stage s in {0,1}: sW, sQg, sKg [64][K+8]; sAqk, sAkk [64][72]; sV [64][BV+8]; sDec [K] fp32
//     stage (c+1)&1 is filled by cp.async while chunk c computes on stage c&1 (double buffer);
//     sV of the current stage is rewritten with v' in phase B (v is dead by then).
//   sH [K][BV+8]: the state copy that phases A of the next chunk read.
// Warp roles: phases A-C: warp = (m-tile of 16 rows = warp & 3, column half = warp >> 2).
//             phase D:   warp = (m-tile of 16 state rows, column part): the warp owns those h rows
//             as fp32 accumulators for the whole sequence.
#pragma once

#include "kda/sm90/kda_device.cuh"

namespace kernel_fun::kda {

constexpr int kScanThreads = 256;

template <typename WT, int K, int BV>
struct ScanSmem {
  static constexpr int KP = K + 8;
  static constexpr int AP = kChunk + 8;
  static constexpr int VP = BV + 8;
  // element offsets (WT) within one stage
  static constexpr int kW = 0;
  static constexpr int kQg = kW + kChunk * KP;
  static constexpr int kKg = kQg + kChunk * KP;
  static constexpr int kAqk = kKg + kChunk * KP;
  static constexpr int kAkk = kAqk + kChunk * AP;
  static constexpr int kV = kAkk + kChunk * AP;
  static constexpr int kDec = kV + kChunk * VP;  // fp32 [K] follows (offset in WT units)
  static constexpr int kStageElems = kDec + 2 * K;
  static constexpr int kH = 2 * kStageElems;
  static constexpr int kElems = kH + K * VP;
  static constexpr size_t kBytes = sizeof(WT) * kElems;
  static_assert((kStageElems * sizeof(WT)) % 16 == 0, "stages must stay 16-byte aligned");
  static_assert(kBytes <= 227 * 1024, "scan shared memory exceeds the sm_90 per-CTA limit");
};

template <typename WT, int K, int BV>
__global__ void __launch_bounds__(kScanThreads, 1) kda_fwd_scan_kernel(const KdaFwdParams p) {
  using S = ScanSmem<WT, K, BV>;
  using E = dev::Elem<WT>;
  constexpr int KP = S::KP, AP = S::AP, VP = S::VP;
  // phase A-C tiling: 4 m-tiles x 2 column halves
  constexpr int NA = BV / 2 / 8;  // n-tiles of 8 per warp in phases A-C
  static_assert(NA % 2 == 0, "ldmatrix.x4.trans loads two n-tiles at a time");
  // phase D tiling: K/16 m-tiles, WPM warps per m-tile
  constexpr int MTD = K / 16;
  constexpr int WPM = 8 / MTD;
  constexpr int ND = BV / WPM / 8;  // n-tiles of 8 per warp in phase D
  static_assert(MTD * WPM == 8, "8 warps must tile the state rows");

  extern __shared__ float4 smem_f4[];
  WT* sm = reinterpret_cast<WT*>(smem_f4);
  WT* sH = sm + S::kH;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int vs = blockIdx.x, hv = blockIdx.y, n = blockIdx.z;
  const int HV = p.HV, V = p.V;
  const int v0 = vs * BV;
  const dev::SeqInfo seq = dev::seq_info(p, n);
  const int nchunks = (seq.len + kChunk - 1) / kChunk;

  // ---- state: rows [16*mD, 16*mD + 16) x columns [cD, cD + 8*ND) of this V-slice, fp32
  const int mD = warp / WPM;
  const int cD = (warp % WPM) * (BV / WPM);
  float hacc[ND][4];
  {
    const int64_t hbase = (static_cast<int64_t>(n) * HV + hv) * K * V;
#pragma unroll
    for (int j = 0; j < ND; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * mD + g + (e >> 1) * 8;
        const int col = v0 + cD + 8 * j + 2 * t + (e & 1);
        float val = 0.f;
        if (p.h0) val = p.state_v_first ? p.h0[hbase + static_cast<int64_t>(col) * K + row]
                                        : p.h0[hbase + static_cast<int64_t>(row) * V + col];
        hacc[j][e] = val;
      }
  }
  auto store_h_copy = [&]() {
#pragma unroll
    for (int j = 0; j < ND; ++j) {
      const int row = 16 * mD + g, col = cD + 8 * j + 2 * t;
      *reinterpret_cast<uint32_t*>(sH + row * VP + col) = E::pack2(hacc[j][0], hacc[j][1]);
      *reinterpret_cast<uint32_t*>(sH + (row + 8) * VP + col) = E::pack2(hacc[j][2], hacc[j][3]);
    }
  };
  store_h_copy();

  const WT* gw = reinterpret_cast<const WT*>(p.w);
  const WT* gqg = reinterpret_cast<const WT*>(p.qg);
  const WT* gkg = reinterpret_cast<const WT*>(p.kg);
  const WT* gAqk = reinterpret_cast<const WT*>(p.Aqk);
  const WT* gAkk = reinterpret_cast<const WT*>(p.Akk);
  const WT* gv = reinterpret_cast<const WT*>(p.v);

  // ---- async load of chunk cc into stage st (rows >= the chunk's length are zero-filled)
  auto load_chunk = [&](int cc, int st) {
    WT* base = sm + st * S::kStageElems;
    const int64_t tok0 = seq.bos + static_cast<int64_t>(cc) * kChunk;
    const int rows = min(kChunk, seq.len - cc * kChunk);
    constexpr int KV8 = K / 8;  // 16-byte vectors per K-row
    for (int i = tid; i < kChunk * KV8; i += kScanThreads) {
      const int r = i / KV8, c8 = (i % KV8) * 8;
      const bool ok = r < rows;
      const int64_t off = ((tok0 + (ok ? r : 0)) * HV + hv) * K + c8;
      const int nb = ok ? 16 : 0;
      dev::cp_async16(base + S::kW + r * KP + c8, gw + off, nb);
      dev::cp_async16(base + S::kQg + r * KP + c8, gqg + off, nb);
      dev::cp_async16(base + S::kKg + r * KP + c8, gkg + off, nb);
    }
    for (int i = tid; i < kChunk * 8; i += kScanThreads) {
      const int r = i / 8, c8 = (i % 8) * 8;
      const bool ok = r < rows;
      const int64_t off = ((tok0 + (ok ? r : 0)) * HV + hv) * kChunk + c8;
      const int nb = ok ? 16 : 0;
      dev::cp_async16(base + S::kAqk + r * AP + c8, gAqk + off, nb);
      dev::cp_async16(base + S::kAkk + r * AP + c8, gAkk + off, nb);
    }
    constexpr int BV8 = BV / 8;
    for (int i = tid; i < kChunk * BV8; i += kScanThreads) {
      const int r = i / BV8, c8 = (i % BV8) * 8;
      const bool ok = r < rows;
      const int64_t off = ((tok0 + (ok ? r : 0)) * HV + hv) * V + v0 + c8;
      dev::cp_async16(base + S::kV + r * VP + c8, gv + off, ok ? 16 : 0);
    }
    float* dec = reinterpret_cast<float*>(base + S::kDec);
    const float* gdec = p.gdecay + (static_cast<int64_t>(seq.chunk0 + cc) * HV + hv) * K;
    for (int i = tid; i < K / 4; i += kScanThreads) dev::cp_async16(dec + 4 * i, gdec + 4 * i, 16);
  };

  if (nchunks > 0) load_chunk(0, 0);
  dev::cp_async_commit();

  const int mA = warp & 3;               // phases A-C: rows [16 mA, 16 mA + 16)
  const int cA = (warp >> 2) * (BV / 2);  // phases A-C: columns [cA, cA + BV/2)
  WT* o = reinterpret_cast<WT*>(p.o);
  WT* hst = reinterpret_cast<WT*>(p.h_states);

  for (int c = 0; c < nchunks; ++c) {
    const int st = c & 1;
    if (c + 1 < nchunks) load_chunk(c + 1, st ^ 1);
    dev::cp_async_commit();
    dev::cp_async_wait<1>();
    __syncthreads();  // stage st landed for everyone; sH holds the state before chunk c

    WT* base = sm + st * S::kStageElems;
    const WT* sW = base + S::kW;
    const WT* sQg = base + S::kQg;
    const WT* sKg = base + S::kKg;
    const WT* sAqk = base + S::kAqk;
    const WT* sAkk = base + S::kAkk;
    WT* sV = base + S::kV;
    const float* sDec = reinterpret_cast<const float*>(base + S::kDec);

    if (hst) {
      // the state read by chunk c (fla's h), in the output dtype
      const int64_t hb = (static_cast<int64_t>(seq.chunk0 + c) * HV + hv) * K * V;
#pragma unroll
      for (int j = 0; j < ND; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * mD + g + (e >> 1) * 8;
          const int col = v0 + cD + 8 * j + 2 * t + (e & 1);
          hst[p.state_v_first ? hb + static_cast<int64_t>(col) * K + row : hb + static_cast<int64_t>(row) * V + col] =
              E::from_float(hacc[j][e]);
        }
    }

    // ---------------- phase A: WH = w @ h, O = qg @ h
    float wh[NA][4], oo[NA][4];
#pragma unroll
    for (int j = 0; j < NA; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) wh[j][e] = oo[j][e] = 0.f;
    const int lrow = lane & 7, lmat = lane >> 3;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t aw[4], aq[4];
      // A (row-major [row][k]): matrix j = rows +(j&1)*8, k +(j>>1)*8
      const int ar = 16 * mA + (lmat & 1) * 8 + lrow, ac = 16 * kk + (lmat >> 1) * 8;
      dev::ldsm_x4(aw, sW + ar * KP + ac);
      dev::ldsm_x4(aq, sQg + ar * KP + ac);
#pragma unroll
      for (int j = 0; j < NA; j += 2) {
        // B = h [k][n] row-major: transposed 8x8 loads; matrix j = k +(j&1)*8, n +(j>>1)*8
        uint32_t b[4];
        dev::ldsm_x4_t(b, sH + (16 * kk + (lmat & 1) * 8 + lrow) * VP + cA + 8 * j + (lmat >> 1) * 8);
        dev::mma_16816<WT>(wh[j], aw, b[0], b[1]);
        dev::mma_16816<WT>(wh[j + 1], aw, b[2], b[3]);
        dev::mma_16816<WT>(oo[j], aq, b[0], b[1]);
        dev::mma_16816<WT>(oo[j + 1], aq, b[2], b[3]);
      }
    }
    // ---------------- phase B: v' = Akk @ v - WH   (Akk lower-triangular: k < 16 (mA + 1))
#pragma unroll
    for (int j = 0; j < NA; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) wh[j][e] = -wh[j][e];
    for (int kk = 0; kk <= mA; ++kk) {
      uint32_t a[4];
      dev::ldsm_x4(a, sAkk + (16 * mA + (lmat & 1) * 8 + lrow) * AP + 16 * kk + (lmat >> 1) * 8);
#pragma unroll
      for (int j = 0; j < NA; j += 2) {
        uint32_t b[4];
        dev::ldsm_x4_t(b, sV + (16 * kk + (lmat & 1) * 8 + lrow) * VP + cA + 8 * j + (lmat >> 1) * 8);
        dev::mma_16816<WT>(wh[j], a, b[0], b[1]);
        dev::mma_16816<WT>(wh[j + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done reading v (and h) of this chunk
#pragma unroll
    for (int j = 0; j < NA; ++j) {
      const int row = 16 * mA + g, col = cA + 8 * j + 2 * t;
      *reinterpret_cast<uint32_t*>(sV + row * VP + col) = E::pack2(wh[j][0], wh[j][1]);
      *reinterpret_cast<uint32_t*>(sV + (row + 8) * VP + col) = E::pack2(wh[j][2], wh[j][3]);
    }
    __syncthreads();  // v' complete

    // ---------------- phase C: O += Aqk @ v'  -> o
    for (int kk = 0; kk <= mA; ++kk) {
      uint32_t a[4];
      dev::ldsm_x4(a, sAqk + (16 * mA + (lmat & 1) * 8 + lrow) * AP + 16 * kk + (lmat >> 1) * 8);
#pragma unroll
      for (int j = 0; j < NA; j += 2) {
        uint32_t b[4];
        dev::ldsm_x4_t(b, sV + (16 * kk + (lmat & 1) * 8 + lrow) * VP + cA + 8 * j + (lmat >> 1) * 8);
        dev::mma_16816<WT>(oo[j], a, b[0], b[1]);
        dev::mma_16816<WT>(oo[j + 1], a, b[2], b[3]);
      }
    }
    {
      const int rows = min(kChunk, seq.len - c * kChunk);
      const int64_t tok0 = seq.bos + static_cast<int64_t>(c) * kChunk;
      const int ra = 16 * mA + g, rb = ra + 8;
#pragma unroll
      for (int j = 0; j < NA; ++j) {
        const int col = v0 + cA + 8 * j + 2 * t;
        if (ra < rows)
          *reinterpret_cast<uint32_t*>(o + ((tok0 + ra) * HV + hv) * V + col) = E::pack2(oo[j][0], oo[j][1]);
        if (rb < rows)
          *reinterpret_cast<uint32_t*>(o + ((tok0 + rb) * HV + hv) * V + col) = E::pack2(oo[j][2], oo[j][3]);
      }
    }

    // ---------------- phase D: h = exp2(G) h + kg^T @ v'
    {
      const float da = sDec[16 * mD + g], db = sDec[16 * mD + g + 8];
#pragma unroll
      for (int j = 0; j < ND; ++j) {
        hacc[j][0] *= da;
        hacc[j][1] *= da;
        hacc[j][2] *= db;
        hacc[j][3] *= db;
      }
#pragma unroll
      for (int kk = 0; kk < kChunk / 16; ++kk) {
        // A = kg^T: A[m = d][k = token] = kg[token][d]; transposed loads of the [token][d] tile:
        // matrix j covers A rows +(j&1)*8, A cols (tokens) +(j>>1)*8.
        uint32_t a[4];
        dev::ldsm_x4_t(a, sKg + (16 * kk + (lmat >> 1) * 8 + lrow) * KP + 16 * mD + (lmat & 1) * 8);
#pragma unroll
        for (int j = 0; j < ND; j += 2) {
          uint32_t b[4];
          dev::ldsm_x4_t(b, sV + (16 * kk + (lmat & 1) * 8 + lrow) * VP + cD + 8 * j + (lmat >> 1) * 8);
          dev::mma_16816<WT>(hacc[j], a, b[0], b[1]);
          dev::mma_16816<WT>(hacc[j + 1], a, b[2], b[3]);
        }
      }
    }
    // sH is not read again in this chunk (phase A ended before the barrier above)
    store_h_copy();
    __syncthreads();  // sH complete; stage st free for the prefetch of chunk c + 2
  }
  dev::cp_async_wait<0>();

  if (p.ht) {
    const int64_t hb = (static_cast<int64_t>(n) * HV + hv) * K * V;
#pragma unroll
    for (int j = 0; j < ND; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * mD + g + (e >> 1) * 8;
        const int col = v0 + cD + 8 * j + 2 * t + (e & 1);
        p.ht[p.state_v_first ? hb + static_cast<int64_t>(col) * K + row : hb + static_cast<int64_t>(row) * V + col] =
            hacc[j][e];
      }
  }
}



// ================================================================================================
// kda_fwd_scan2 (default; KERNEL_FUN_KDA_SCAN=v1 selects the kernel above): the same recurrence with
// the state kept TRANSPOSED, hT [BV, K], so that every warp owns 16 value columns and runs the
// whole chunk for them from its own registers -- no barrier inside a chunk, no smem copy of h, no
// smem round trip of v'. One CTA per (V-slice, value head, sequence), BV / 16 warps.
//
// Warp w owns value columns [16 w, 16 w + 16) of the slice; its state hT rows are mma.sync C
// fragments over K (n-tiles of 8 state rows k). Per chunk (tokens i, j of the chunk):
//   A   WHT = hT @ w^T, OT = hT @ qg^T       A = hT (fp32 accumulators packed to WT: the C layout of
//                                            n-tiles 2kk, 2kk+1 is the A layout of k-step kk),
//                                            B = w / qg rows from smem (ldmatrix, non-transposed)
//   B   v'T = vT @ Akk^T - WHT                A = vT (ldmatrix.trans of the [token][v] tile),
//                                            B = Akk rows (lower-triangular: blocks j <= i only)
//   C   OT += v'T @ Aqk^T -> o                A = v'T from registers (packed to WT, as v1 rounds it)
//   D   hT = hT * exp2(G)[k] + v'T @ kg       B = kg [token][k] (ldmatrix.trans)
// The only CTA-wide barrier per chunk hands the double-buffered cp.async stage over. Numerics are
// v1's: h and v' are rounded to WT exactly where v1 rounds them; fp32 accumulation everywhere.
// ================================================================================================

template <typename WT, int K, int BV>
struct Scan2Smem {
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
  static_assert(kBytes <= 227 * 1024, "scan2 shared memory exceeds the sm_90 per-CTA limit");
};

template <int BV>
constexpr int scan2_threads() {
  return BV / 16 * 32;
}

// kWg (v3, KERNEL_FUN_KDA_SCAN=v3, BV in {64, 128}): phase A on wgmma instead -- each warpgroup
// (4 warps = 64 value columns = M of wgmma.m64n64k16) issues hT (registers, the A layout above) x
// w^T / qg^T with B read from smem through a descriptor, once per warpgroup instead of once per warp
// (w and qg are then stored in the no-swizzle core-matrix layout: 8 tokens x 8 k = 128 contiguous
// bytes, LBO 128 B along k, SBO 16 K bytes along tokens).
// kWg == 2 (v4, KERNEL_FUN_KDA_SCAN=v4): phase D on wgmma as well -- hT (accumulators, m64nKk16) +=
// v'T (registers) x kg, kg N-major in smem (core matrices 8 k-columns x 8 tokens, LBO 128 B between
// 8-token groups, SBO 1 KB between 8-column groups).
// kWg == 3 (v5, KERNEL_FUN_KDA_SCAN=v5): phases B and C on wgmma as well (A = vT from ldmatrix.trans,
// resp. v'T; B = Akk / Aqk as K-major core matrices, full 64 x 64 tiles with the blocks above the
// diagonal zero-filled on load).
template <typename WT, int K, int BV, int kWg = 0>
__global__ void __launch_bounds__(scan2_threads<BV>(), 1) kda_fwd_scan2_kernel(const KdaFwdParams p) {
  using S = Scan2Smem<WT, K, BV>;
  using E = dev::Elem<WT>;
  constexpr int NT = scan2_threads<BV>();
  constexpr int KP = S::KP, AP = S::AP, VP = S::VP;
  constexpr int NK = K / 8;  // n-tiles of the state (8 state rows k each)
  static_assert(BV % 32 == 0 && BV <= 128, "BV in {32, 64, 128}");
  static_assert(!kWg || BV % 64 == 0, "wgmma needs whole warpgroups (64 value columns)");

  extern __shared__ float4 smem_f4[];
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
    return p.state_v_first ? static_cast<int64_t>(col) * K + k : static_cast<int64_t>(k) * V + col;
  };
#pragma unroll
  for (int j = 0; j < NK; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) hT[j][e] = p.h0 ? p.h0[sbase + state_index(j, e)] : 0.f;

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
      // wgmma: core matrices [token / 8][k / 8][token % 8][k % 8]
      const int wq = kWg ? (r >> 3) * (K * 8) + c8 * 8 + (r & 7) * 8 : r * KP + c8;
      dev::cp_async16(base + S::kW + wq, gw + off, nb);
      dev::cp_async16(base + S::kQg + wq, gqg + off, nb);
      const int kq = kWg >= 2 ? (c8 >> 3) * 512 + (r >> 3) * 64 + (r & 7) * 8 : r * KP + c8;
      dev::cp_async16(base + S::kKg + kq, gkg + off, nb);
    }
    for (int i = tid; i < kChunk * 8; i += NT) {
      const int r = i / 8, c8 = (i % 8) * 8;
      const bool upper = (c8 >> 4) > (r >> 4);  // never read by mma.sync; zeros for wgmma
      if (kWg != 3 && upper) continue;
      const bool ok = r < rows && !upper;
      const int64_t off = ((tok0 + (r < rows ? r : 0)) * HV + hv) * kChunk + c8;
      const int nb = ok ? 16 : 0;
      const int aq = kWg == 3 ? (r >> 3) * 512 + c8 * 8 + (r & 7) * 8 : r * AP + c8;
      dev::cp_async16(base + S::kAqk + aq, gAqk + off, nb);
      dev::cp_async16(base + S::kAkk + aq, gAkk + off, nb);
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
    if constexpr (kWg != 0) dev::fence_proxy_async_smem();  // cp.async writes -> wgmma reads
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
    if constexpr (kWg != 0) {
      uint32_t ha[K / 16][4];
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) {
        ha[kk][0] = E::pack2(hT[2 * kk][0], hT[2 * kk][1]);
        ha[kk][1] = E::pack2(hT[2 * kk][2], hT[2 * kk][3]);
        ha[kk][2] = E::pack2(hT[2 * kk + 1][0], hT[2 * kk + 1][1]);
        ha[kk][3] = E::pack2(hT[2 * kk + 1][2], hT[2 * kk + 1][3]);
      }
      dev::wg_fence_acc(whT);
      dev::wg_fence_acc(oT);
      dev::wg_arrive();
      const uint32_t aw = dev::smem_u32(sW), aq = dev::smem_u32(sQg);
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) {
        // k-step kk = core-matrix columns 2 kk, 2 kk + 1 (LBO 128 B); 8-token groups SBO 16 K B apart
        dev::wgmma_m64n64k16_rs<WT>(whT, ha[kk], dev::gmma_desc_nosw(aw + kk * 256, 128, K * 16));
        dev::wgmma_m64n64k16_rs<WT>(oT, ha[kk], dev::gmma_desc_nosw(aq + kk * 256, 128, K * 16));
      }
      dev::wg_commit();
      dev::wg_wait<0>();
      dev::wg_fence_acc(whT);
      dev::wg_fence_acc(oT);
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) dev::wg_fence_reg(ha[kk][e]);
    } else {
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
          uint32_t bw[4], bq[4];
          dev::ldsm_x4(bw, sW + off);
          dev::ldsm_x4(bq, sQg + off);
          dev::mma_16816<WT>(whT[2 * pp], a, bw[0], bw[1]);
          dev::mma_16816<WT>(whT[2 * pp + 1], a, bw[2], bw[3]);
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
    if constexpr (kWg == 3) {
      uint32_t vtA[4][4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
        dev::ldsm_x4_t(vtA[jj], sV + (16 * jj + (lmat >> 1) * 8 + lrow) * VP + vw + (lmat & 1) * 8);
      dev::wg_fence_acc(whT);
      dev::wg_arrive();
      const uint32_t ab = dev::smem_u32(sAkk);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)  // B[k = j][n = i] = Akk[i][j]: K-major, 8-row groups 1 KB apart
        dev::wgmma_m64n64k16_rs<WT>(whT, vtA[jj], dev::gmma_desc_nosw(ab + jj * 256, 128, 1024));
      dev::wg_commit();
      dev::wg_wait<0>();
      dev::wg_fence_acc(whT);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) dev::wg_fence_reg(vtA[jj][e]);
    } else {
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
    }
    // v'T as A fragments over the token dimension (rounded to WT, as v1 stores v')
    uint32_t va[4][4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      va[jj][0] = E::pack2(whT[2 * jj][0], whT[2 * jj][1]);
      va[jj][1] = E::pack2(whT[2 * jj][2], whT[2 * jj][3]);
      va[jj][2] = E::pack2(whT[2 * jj + 1][0], whT[2 * jj + 1][1]);
      va[jj][3] = E::pack2(whT[2 * jj + 1][2], whT[2 * jj + 1][3]);
    }

    if constexpr (kWg >= 2) {
      // D on wgmma, asynchronous: hT = hT * exp2(G)[k] + v'T @ kg runs while C below works on oT
#pragma unroll
      for (int j = 0; j < NK; ++j) {
        const float2 d = *reinterpret_cast<const float2*>(sDec + 8 * j + 2 * t);
        hT[j][0] *= d.x;
        hT[j][1] *= d.y;
        hT[j][2] *= d.x;
        hT[j][3] *= d.y;
      }
      dev::wg_fence_acc(hT);
      dev::wg_arrive();
      const uint32_t ak = dev::smem_u32(sKg);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)  // tokens 16 jj.. = 8-token groups 2 jj, 2 jj + 1
        dev::wgmma_rs<WT, K, 1>(hT, va[jj], dev::gmma_desc_nosw(ak + jj * 256, 128, 1024));
      if constexpr (kWg == 3) {  // C in the same group: OT += v'T @ Aqk^T
        dev::wg_fence_acc(oT);
        const uint32_t ac = dev::smem_u32(sAqk);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj)
          dev::wgmma_m64n64k16_rs<WT>(oT, va[jj], dev::gmma_desc_nosw(ac + jj * 256, 128, 1024));
      }
      dev::wg_commit();
    }
    if constexpr (kWg == 3) {
      dev::wg_wait<0>();
      dev::wg_fence_acc(oT);
      dev::wg_fence_acc(hT);
    }

    // ---------------- C: OT += v'T @ Aqk^T -> o
    if constexpr (kWg != 3) {
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

    // ---------------- D: hT = hT * exp2(G)[k] + v'T @ kg   (v4/v5: issued before C, completed here)
    if constexpr (kWg >= 2) {
      dev::wg_wait<0>();
      dev::wg_fence_acc(hT);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) dev::wg_fence_reg(va[jj][e]);
    } else {
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
  }
  dev::cp_async_wait<0>();

  if (p.ht) {
#pragma unroll
    for (int j = 0; j < NK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) p.ht[sbase + state_index(j, e)] = hT[j][e];
  }
}
}  // namespace kernel_fun::kda
