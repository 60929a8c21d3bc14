// kda_fwd_intra: the token-parallel part of the KDA forward, one CTA per (chunk, value head),
// 256 threads and ~109 KB of smem at K=128, so TWO CTAs share an SM (one CTA's loads and barriers
// overlap the other's compute).
//
// Stages (docs/kda-forward.md), in execution order, "|" = barrier:
//   P0  raw q / k (input dtype, exact) -> smem by 16-byte cp.async, issued right behind P1's gate
//       row loads and in flight while P1 runs
//   P1  gate activation + block-local (16-row) inclusive cumsum, times 1/ln2 -> g2 (fp32, smem);
//       beta (sigmoid) -> smem; per-row l2norm rstd of q / k (1 when off), each thread on the
//       q / k vectors its own cp.async brought                                              |
//       block sums                                                                          |
//   P2  Aqk[i,j] = scale rq_i rk_j sum_d q_id k_jd exp2(g2_id - g2_jd)   (j <= i)
//       L[i,j]   = beta_i rk_i rk_j sum_d k_id k_jd exp2(g2_id - g2_jd)  (j <  i)
//       (the l2norm rstd is a per-row fp32 factor on the products; a raw bf16 row outside
//       [2^-6, 2^14) is first rescaled in place by a power of two, exactly, its factor by the inverse:
//       dev::row_rstd_fp16_operands);
//       each warp then takes units of qg = scale q exp2(g2), kg = k exp2(G - g2) -> workspace
//       from a shared queue (P4a first part: the warps with less P2 work do more of it)     |
//   P3 diagonal (warps 0-1): forward substitution on the four 16x16 diagonal blocks of
//       X = (I + L)^-1, fp32, into the dead q region; beside it (warps 2-7) P4a second part:
//       kexp = k exp2(g2) in place of g2, Aqk -> workspace, exp2(G) -> gdecay               |
//   P3 merge step bi = 1..3: X_ij = -X_ii sum_{m=j}^{i-1} L_im X_mj (warps < bi), while warps 4-7
//       produce row block bi-1 of P4b w = Akk @ kexp (tf32 tensor cores) and of Akk = X diag(beta)
//       -> workspace                                                                         | x3
//   P4b row block 3 (all warps)
// In the backward (p.M set) the same kernel also stores M = (I + L)^-1 beside Akk.
// Each phase is a device function over IntraCtx (intra_load_gate, intra_block_offsets,
// intra_p2_*, intra_store_gated, intra_diag_inverse, intra_kexp_aqk_gdecay, intra_merge_step,
// intra_w_tile, intra_store_akk_rows); the kernel at the end of this file is their sequence, so a
// fused forward can call the same phases.
//
// P2 split (every decay factor is exp2 of a difference <= 0, a decay between j and i, never exp2
// of a positive number: rule 1 of docs/numerics.md holds at any gate magnitude;
// underflow to 0 is the correct limit):
//   * warps 0-1: the 16 4x4 tiles ON the diagonal in SIMT with telescoping products,
//     exp2(g_i - g_j) = prod_{t=j+1..i} a_t, a_t = exp2(g_t - g_{t-1}) <= 1;
//   * warps 2-4: the blocks below the diagonal on fp16 tensor cores, one warp per 16-row block,
//     through the boundary row f = first row of the block: exp2(g_i - g_f) * exp2(g_f - g_j);
//   * warps 4-7: the rest of each diagonal 16-block on fp16 tensor cores, through the last row e of
//     the column tile: exp2(g_i - g_e) * exp2(g_e - g_j).
//   The tensor-core operands are a raw entry times one factor <= 1, rounded to fp16 (m16n8k16): the
//   11 significant bits of tf32 at twice its rate per instruction and one conversion per PAIR of
//   entries. fp16's narrower range costs nothing: the raw rows are scaled into it (above), and what
//   a factor pushes below fp16's normal range is below 2^-19 of the row's largest entry
//   (docs/notes/2026-12-02-fused-forward-groundwork.md, "Which 16-bit type").
// With a bounded gate (dev::block_midpoint_ok; the kMid kernel) the first and third kinds are replaced
// by whole 16 x 16 diagonal blocks on tf32 tensor cores through each block's middle row
// (intra_p2_diag_mid: rule 2 of docs/numerics.md, factors within 2^+-57.7).
//
// Shared memory: IntraSmem below, each region with its lifetime (~109 KB at K = 128).
// g2 is kept BLOCK-LOCAL (the inclusive cumsum restarts at every 16-row block, times 1/ln2): every
// exponent is either a difference inside one block or such a difference plus whole-block totals,
// all terms <= 0, so a large cumsum never cancels across blocks (e.g. one -1000 step in block 0
// costs blocks 1-3 nothing; with a chunk-global cumsum it costs ulp(1442) in every later exponent).
// Rows past the end of the sequence are zero (gate 0, q = k = 0, beta = 0): they contribute
// nothing, keep g2 of the last valid row, and are never written to the workspace.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kda/device/gate.cuh"
#include "kda/device/primitives.cuh"
#include "kda/device/scan.cuh"
#include "kda/device/sequence.cuh"
#include "kda/fwd/kda_fwd_launch.h"

namespace kernel_fun::kda {

constexpr int kIntraThreads = 256;

// The shared memory plan above as one typed struct (nothing in it is constructed: it is a view of
// the dynamic shared memory). Every member's size is a multiple of 16 bytes, so each starts 16-byte
// aligned and the layout has no padding. C: the tokens per chunk (kChunk; 32 for the
// short-chunk kernel, docs/notes/2026-12-05-chunk-size.md), C / 16 row blocks.
template <typename WT, int K, int C = kChunk>
struct IntraSmem {
  // Row strides: KP = K + 8 floats is 8 banks per row, so the 8-byte (float2) loads of P2 (rows g
  // of a fragment, columns 2t, 2t+1) and P4b's column reads hit distinct banks per half-warp; AP =
  // C + 4 shifts each row of the C-wide matrices by 4 banks.
  static constexpr int KP = K + 8;
  static constexpr int KQ = K + 8;
  static constexpr int AP = C + 4;
  float g[C][KP];    // block-local g2 (P1 .. kexp), then kexp = k rk exp2(g2) as tf32 (.. P4b)
  union {
    WT q[C][KQ];     // raw q (P0 .. qg)
    float x[C][AP];  // X = (I + L)^-1 (P3 .. P4b): q is dead once qg is written
  } qx;
  WT k[C][KQ];       // raw k (P0 .. kexp)
  float a[C][AP];    // Aqk (P2 .. its store), then the merge scratch Y [C - 16][AP] (P3 merge)
  float l[C][AP];    // L (P2 .. P3); zero-filled with a[] as one range, so it must follow a[]
  dev::GateStorage<K, C / 16> gate;
  int work[4];       // [0]: the next unit of the shared qg / kg work queue (P2 .. P4a)
};

// 3xTF32 m16n8k8: D += A B with A, B split into tf32 hi + lo parts (hi*hi + hi*lo + lo*hi), about
// fp32 accuracy on tensor cores. a: {(g, t), (g+8, t), (g, t+4), (g+8, t+4)}; b0 = B(t, g), b1 = B(t+4, g).
// hi*hi goes to `big`, the two corrections to `small` (the caller adds them at the end): two
// dependency chains instead of one (merge step 3 on warp 0: 6 + 12 dependent MMAs instead of 18).
__device__ __forceinline__ void intra_mma_3xtf32(float (&big)[4], float (&small)[4], const float (&a)[4], float b0,
                                                 float b1) {
  uint32_t ah[4], al[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    ah[i] = dev::to_tf32(a[i]);
    al[i] = dev::to_tf32(a[i] - __uint_as_float(ah[i]));
  }
  const uint32_t bh0 = dev::to_tf32(b0), bh1 = dev::to_tf32(b1);
  const uint32_t bl0 = dev::to_tf32(b0 - __uint_as_float(bh0)), bl1 = dev::to_tf32(b1 - __uint_as_float(bh1));
  dev::mma_1688_tf32(small, ah, bl0, bl1);
  dev::mma_1688_tf32(big, ah, bh0, bh1);
  dev::mma_1688_tf32(small, al, bh0, bh1);
}

// Everything the phases of one CTA share: the params, its chunk (sequence, first token, length),
// the thread's place and the typed views of the shared memory plan above.
template <typename WT, int K, int C = kChunk>
struct IntraCtx : dev::ChunkPlace {
  using S = IntraSmem<WT, K, C>;
  using E = dev::Elem<WT>;
  // four threads per token: 256 for the 64-token chunk (kIntraThreads), 128 for a 32-token one
  static constexpr int KP = S::KP, KQ = S::KQ, AP = S::AP, NTH = 4 * C, NB = C / 16;
  static_assert(C != kChunk || NTH == kIntraThreads, "the 64-token kernel's block size");
  static_assert(sizeof(S) <= 113 * 1024, "two CTAs per SM");
  static_assert(offsetof(S, l) == offsetof(S, a) + sizeof(S::a), "a[] and l[] are zero-filled as one range");

  const KdaFwdParams& p;
  S* st;
  long long* clk;  // this CTA's row of phase clocks (kda_phases.py), or null (production, fused kernel)

  __device__ __forceinline__ IntraCtx(const KdaFwdParams& p_, char* sm_, const dev::SeqInfo& seq, int c, int hv_,
                                      long long* clk_ = nullptr)
      : dev::ChunkPlace(p_, seq, c, hv_, C), p(p_), st(reinterpret_cast<S*>(sm_)), clk(clk_) {}
  // Phase boundary `slot` as thread 0 sees it (after the phase's barrier); slots 8 + warp: when each
  // warp finishes its own P2 tiles (before the shared qg / kg queue).
  __device__ __forceinline__ void stamp(int slot) const {
    if (tid == 0) dev::stamp_clock(clk, slot);
  }
  __device__ __forceinline__ void stamp_warp_p2(int who) const {
    if (lane == 0) dev::stamp_clock(clk, 8 + who);
  }
  // P2's role of this warp (the functions below name roles as "warps": 0-1 the SIMT diagonal, 2-4
  // the block rows 3 / 2 / 1, 4-7 the diagonal tile pairs). Warps w and w + 4 share a scheduler;
  // the roles are placed so that each scheduler's two P2 loads sum to about the same (the heaviest,
  // role 4's row 1 and tile pair, beside the lightest tile pair; the two SIMT roles together):
  // physical warp -> role 0->0, 1->4, 2->2, 3->3, 4->1, 5->6, 6->5, 7->7.
  __device__ __forceinline__ int p2_role() const { return (0x75613240u >> (4 * warp)) & 7; }
  __device__ __forceinline__ float* sG() const { return &st->g[0][0]; }
  __device__ __forceinline__ WT* sQ() const { return &st->qx.q[0][0]; }
  __device__ __forceinline__ WT* sK() const { return &st->k[0][0]; }
  __device__ __forceinline__ float* sA() const { return &st->a[0][0]; }
  __device__ __forceinline__ float* sL() const { return &st->l[0][0]; }
  __device__ __forceinline__ dev::GateScratch<K> gs() const { return dev::GateScratch<K>(st->gate); }
  __device__ __forceinline__ int* sWork() const { return st->work; }
  __device__ __forceinline__ float* sX() const { return &st->qx.x[0][0]; }  // from P3
  __device__ __forceinline__ float* sY() const { return sA(); }             // P3 merge (Aqk is stored by then)
  __device__ __forceinline__ float* sKexp() const { return sG(); }          // from P4a's second part

  __device__ __forceinline__ float Qf(int r, int d) const { return E::to_float(sQ()[r * KQ + d]); }
  __device__ __forceinline__ float Kf(int r, int d) const { return E::to_float(sK()[r * KQ + d]); }
  // Columns d, d+1 (d even) of a 16-bit row / of an fp32 row in one 4- / 8-byte load.
  __device__ __forceinline__ float2 X2(const WT* row, int d) const {
    return E::to_float2(*reinterpret_cast<const uint32_t*>(row + d));
  }
  __device__ __forceinline__ float2 G2(int r, int d) const { return *reinterpret_cast<const float2*>(sG() + r * KP + d); }
  // One entry of Aqk (q row) or L (k row) from an un-normalised, un-scaled dot product.
  __device__ __forceinline__ void put(bool is_k, int r, int s, float v) const {
    const dev::GateScratch<K> g = gs();
    if (is_k) sL()[r * AP + s] = g.beta[r] * g.rk[r] * g.rk[s] * v;
    else sA()[r * AP + s] = p.opt.scale * g.rq[r] * g.rk[s] * v;
  }
};

// Where the phases put their outputs (qg, kg, Aqk, exp2(G), w, Akk and, for the backward, M): the
// workspace of the two-kernel path (IntraToWorkspace, rows past the sequence end never written: they
// belong to the next sequence), or one stage of the scan's shared memory in the layout
// dev::scan_load_chunk gives it (IntraToStage: every row, those past the end +0, as the scan's
// zero-filled loads; M is not wanted there). Stores of 8 elements (uint4) at row r,
// columns c0 .. c0 + 7, or of 2 (w, one uint32).
template <typename WT, int K, int C = kChunk>
struct IntraToWorkspace {
  __device__ __forceinline__ bool wants_row(const IntraCtx<WT, K, C>& c, int r) const { return r < c.len; }
  __device__ __forceinline__ int64_t row(const IntraCtx<WT, K, C>& c, int r) const {
    return (c.tok0 + r) * c.HV + c.hv;
  }
  __device__ __forceinline__ void qg_kg(const IntraCtx<WT, K, C>& c, int r, int c0, const uint4& q,
                                        const uint4& k) const {
    const int64_t off = row(c, r) * K + c0;
    dev::stg16(reinterpret_cast<WT*>(c.p.qg) + off, q);
    dev::stg16(reinterpret_cast<WT*>(c.p.kg) + off, k);
  }
  __device__ __forceinline__ void aqk(const IntraCtx<WT, K, C>& c, int r, int c0, const uint4& a) const {
    dev::stg16(reinterpret_cast<WT*>(c.p.Aqk) + row(c, r) * C + c0, a);
  }
  __device__ __forceinline__ void gdecay(const IntraCtx<WT, K, C>& c, int k, float v) const {
    c.p.gdecay[(static_cast<int64_t>(c.gchunk) * c.HV + c.hv) * K + k] = v;
  }
  __device__ __forceinline__ void w2(const IntraCtx<WT, K, C>& c, int r, int col, uint32_t v) const {
    *reinterpret_cast<uint32_t*>(reinterpret_cast<WT*>(c.p.w) + row(c, r) * K + col) = v;
  }
  __device__ __forceinline__ void akk(const IntraCtx<WT, K, C>& c, int r, int c0, const uint4& a,
                                      const uint4& m) const {
    const int64_t off = row(c, r) * C + c0;
    dev::stg16(reinterpret_cast<WT*>(c.p.Akk) + off, a);
    if (c.p.M) dev::stg16(reinterpret_cast<WT*>(c.p.M) + off, m);
  }
};

template <typename WT, int K, int BV>
struct IntraToStage {
  using St = dev::ScanStage<WT, K, BV>;
  WT* base;  // the stage's first element (1024-byte aligned)
  // Rows past the sequence end are stored as +0 (what the phases compute there is zero up to its
  // sign: x * beta with beta = 0 gives -0 for x < 0), as the scan's zero-filled loads leave them.
  static __device__ __forceinline__ uint4 live(const IntraCtx<WT, K>& c, int r, const uint4& v) {
    return r < c.len ? v : make_uint4(0u, 0u, 0u, 0u);
  }
  __device__ __forceinline__ bool wants_row(const IntraCtx<WT, K>&, int) const { return true; }
  __device__ __forceinline__ void qg_kg(const IntraCtx<WT, K>& c, int r, int c0, const uint4& q, const uint4& k) const {
    *reinterpret_cast<uint4*>(base + St::kQg + St::tile_index(r, c0)) = live(c, r, q);
    *reinterpret_cast<uint4*>(base + St::kKg + St::tile_index(r, c0)) = live(c, r, k);
  }
  __device__ __forceinline__ void aqk(const IntraCtx<WT, K>& c, int r, int c0, const uint4& a) const {
    *reinterpret_cast<uint4*>(base + St::kAqk + r * St::AP + c0) = live(c, r, a);
  }
  __device__ __forceinline__ void gdecay(const IntraCtx<WT, K>&, int k, float v) const {
    reinterpret_cast<float*>(base + St::kDec)[k] = v;
  }
  __device__ __forceinline__ void w2(const IntraCtx<WT, K>& c, int r, int col, uint32_t v) const {
    *reinterpret_cast<uint32_t*>(base + St::kW + St::tile_index(r, col)) = r < c.len ? v : 0u;
  }
  __device__ __forceinline__ void akk(const IntraCtx<WT, K>& c, int r, int c0, const uint4& a, const uint4&) const {
    *reinterpret_cast<uint4*>(base + St::kAkk + r * St::AP + c0) = live(c, r, a);
  }
};

// ---------------------------------------------------------------- P0 + P1
// P0: raw q / k -> smem (async), issued by P1's gate_cumsum_beta right behind the gate rows' loads;
// P1: gate + cumsum, beta; Aqk / L zeroed, the work queue reset. Ends with a barrier.
template <typename WT, int K, int C>
__device__ __forceinline__ void intra_load_gate(const IntraCtx<WT, K, C>& c) {
  using Ctx = IntraCtx<WT, K, C>;
  using E = typename Ctx::E;
  constexpr int KP = Ctx::KP, KQ = Ctx::KQ, AP = Ctx::AP, NTH = Ctx::NTH;
  const KdaFwdParams& p = c.p;
  const int tid = c.tid, len = c.len, h = c.h;
  const int64_t tok0 = c.tok0;
  WT* sQ = c.sQ();
  WT* sK = c.sK();
  const dev::GateScratch<K> gs = c.gs();
  const WT* q = reinterpret_cast<const WT*>(p.q);
  const WT* k = reinterpret_cast<const WT*>(p.k);
  const bool al16 = ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k)) & 15) == 0;
  constexpr int VPR = K / 8;  // 16-byte vectors per row
  auto issue_bulk = [&]() {
    if (al16) {
      // thread tid: vector v of rows r0 + RPI j, of q and of k (copy indices tid + NTH j' of the q
      // range, then of the k range: the map row_rstd_fp16_operands relies on, below). The row offsets
      // from one 64-bit base per tensor: no division, no 64-bit multiply per copy.
      constexpr int RPI = NTH / VPR;  // rows per pass of the CTA
      static_assert(NTH % VPR == 0 && C % RPI == 0, "whole rows per pass");
      const int v = tid % VPR, r0 = tid / VPR;
      const int64_t rstride = static_cast<int64_t>(p.H) * K;
      const WT* qb = q + (tok0 * p.H + h) * K + 8 * v;
      const WT* kb = k + (tok0 * p.H + h) * K + 8 * v;
#pragma unroll
      for (int j = 0; j < C / RPI; ++j) {
        const int r = r0 + RPI * j;
        const int64_t off = (r < len ? r : 0) * rstride;  // rows past the end: zero-filled, source never read
        dev::cp_async16(sQ + r * KQ + 8 * v, qb + off, r < len ? 16 : 0);
        dev::cp_async16(sK + r * KQ + 8 * v, kb + off, r < len ? 16 : 0);
      }
      dev::cp_async_commit();
    } else {
      for (int i = tid; i < C * K; i += NTH) {
        const int r = i / K, d = i % K;
        const int64_t off = ((tok0 + r) * p.H + h) * K + d;
        sQ[r * KQ + d] = r < len ? q[off] : E::from_float(0.f);
        sK[r * KQ + d] = r < len ? k[off] : E::from_float(0.f);
      }
    }
  };
  dev::gate_cumsum_beta<K, NTH, KP, false, Ctx::NB>(p, tok0, len, c.hv, c.sG(), gs.BT, gs.beta, issue_bulk);
  float* sA = c.sA();
  for (int i = tid; i < 2 * C * AP / 4; i += NTH)  // sA and sL are adjacent
    reinterpret_cast<float4*>(sA)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (tid == 0) *c.sWork() = 0;
  dev::cp_async_wait<0>();
  // The l2norm row factors (and the fp16 operands' row scaling) before the barrier: with the 16-byte
  // copies, row_rstd_fp16_operands' vector i (q and k) is the one this thread's own cp.async brought
  // (copy index i and C VPR + i, both = tid mod NTH), complete for it after its wait; a row's
  // lanes are one warp's (its shuffles). Every other reader of sQ / sK, sRq, sRk comes after the
  // barrier. The element-wise fallback copy maps threads differently: the barrier first.
  static_assert((C * VPR) % NTH == 0, "the row factors' vectors are the thread's own copies");
  if (!al16) __syncthreads();
  dev::row_rstd_fp16_operands<WT, K, NTH, KQ, C>(sQ, sK, p.opt.l2norm, gs.rq, gs.rk);
  __syncthreads();
}

// ---- block offsets (sums of whole-block totals: all terms <= 0, so no cancellation), G. Ends with a
// barrier.
template <typename WT, int K, int C>
__device__ __forceinline__ void intra_block_offsets(const IntraCtx<WT, K, C>& c) {
  const dev::GateScratch<K> gs = c.gs();
  dev::block_offsets<K, IntraCtx<WT, K, C>::NB>(gs.BT, gs.BO, gs.BS, gs.Gt);
  __syncthreads();
}

// ---------------------------------------------------------------- P2: Aqk and L
// Warps 0-1, SIMT: the 16 4x4 tiles ON the diagonal (4 per 16-block) x 4 d-slices (d = ds mod 4);
// lanes 4m..4m+3 share a tile. Inside the tile exp2(g_i - g_j) = a_{j+1} ... a_i with
// a_t = exp2(g_t - g_{t-1}) <= 1: 3 exp2 per tile and d instead of 10.
// w: this warp's place among the SIMT warps (C / 32 of them: roles 0-1 of the 64-token kernel).
template <typename WT, int K, int C>
__device__ __forceinline__ void intra_p2_diag_simt(const IntraCtx<WT, K, C>& c, int w) {
  constexpr int KP = IntraCtx<WT, K, C>::KP;
  const float* sG = c.sG();
  const int tid = 32 * w + c.lane;
  const int ds = tid & 3, slot = tid >> 2;  // slot 0..15
  const int r0 = 16 * (slot >> 2) + 4 * (slot & 3);
  float aq[4][4], ak[4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) aq[a][b] = ak[a][b] = 0.f;
  // Each tile starts its walk over d at a different offset (4 * slot within the warp): the
  // eight tiles of a warp sit on only two bank bases (row stride = 4 banks, tiles 4 rows apart),
  // so without the rotation every load would be a 4-way bank conflict; with it the warp's 32
  // lanes hit 32 distinct banks. The sum over d is the same, in a fixed per-tile order.
  const int rot = slot & 7;
#pragma unroll 2
  for (int j = 0; j < K / 4; ++j) {
    const int d = ds + 4 * ((j + rot) & (K / 4 - 1));
    float qr[4], kr[4], gr[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      qr[a] = c.Qf(r0 + a, d);
      kr[a] = c.Kf(r0 + a, d);
      gr[a] = sG[(r0 + a) * KP + d];
    }
    const float a1 = dev::fast_exp2(gr[1] - gr[0]);
    const float a2 = dev::fast_exp2(gr[2] - gr[1]);
    const float a3 = dev::fast_exp2(gr[3] - gr[2]);
    const float z20 = a1 * a2, z31 = a2 * a3, z30 = z20 * a3;
    float e;
    // column 0
    aq[0][0] = fmaf(qr[0], kr[0], aq[0][0]);
    e = a1 * kr[0];
    aq[1][0] = fmaf(qr[1], e, aq[1][0]);
    ak[1][0] = fmaf(kr[1], e, ak[1][0]);
    e = z20 * kr[0];
    aq[2][0] = fmaf(qr[2], e, aq[2][0]);
    ak[2][0] = fmaf(kr[2], e, ak[2][0]);
    e = z30 * kr[0];
    aq[3][0] = fmaf(qr[3], e, aq[3][0]);
    ak[3][0] = fmaf(kr[3], e, ak[3][0]);
    // column 1
    aq[1][1] = fmaf(qr[1], kr[1], aq[1][1]);
    e = a2 * kr[1];
    aq[2][1] = fmaf(qr[2], e, aq[2][1]);
    ak[2][1] = fmaf(kr[2], e, ak[2][1]);
    e = z31 * kr[1];
    aq[3][1] = fmaf(qr[3], e, aq[3][1]);
    ak[3][1] = fmaf(kr[3], e, ak[3][1]);
    // column 2
    aq[2][2] = fmaf(qr[2], kr[2], aq[2][2]);
    e = a3 * kr[2];
    aq[3][2] = fmaf(qr[3], e, aq[3][2]);
    ak[3][2] = fmaf(kr[3], e, ak[3][2]);
    // column 3
    aq[3][3] = fmaf(qr[3], kr[3], aq[3][3]);
  }
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b <= a; ++b) {
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        aq[a][b] += __shfl_xor_sync(0xffffffffu, aq[a][b], o);
        ak[a][b] += __shfl_xor_sync(0xffffffffu, ak[a][b], o);
      }
    }
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    if (a != ds) continue;
#pragma unroll
    for (int b = 0; b <= a; ++b) {
      c.put(false, r0 + a, r0 + b, aq[a][b]);
      if (b < a) c.put(true, r0 + a, r0 + b, ak[a][b]);
    }
  }
}

// P2's fp16 m16n8k16 steps (below the diagonal and the diagonal tiles) take the same columns for A and
// B, so each dot product is the same sum: in step kk, lane t's k-slots 2t, 2t+1 (half hf = 0) and
// 2t+8, 2t+9 (hf = 1) are the ADJACENT columns p2_col(kk, hf, t) and + 1, one 8-byte g load and one
// 4-byte q / k load per pair.
__device__ __forceinline__ int p2_col(int kk, int hf, int t) { return 16 * kk + 8 * hf + 2 * t; }

// Warps 2-4: the blocks below the diagonal, (bi, bj) with bi > bj, on fp16 tensor cores: one warp
// per block row bi (warp 2: bi = 3, 3: 2, 4: 1), so the A operands are gated once for all bj < bi.
// Reference row f = 16*bi: A-side factor exp2(g_i - g_f) (i >= f), B-side exp2(g_f - g_j) (f > j).
// The block row BI is a template parameter, so the bj loop below has no branches: with bi known only
// at run time each bj block sat behind its own branch, a serial chain of shared loads -> exp2 ->
// multiply -> tf32 -> mma (tf32 then) that ptxas could not overlap with the next block's (P2 is
// latency-bound: four warps per scheduler). Measured on the H200 (2026-12-02, seventh session): warp
// 2's P2 20.6k -> 15.2k cycles, warp 3's 18.3k -> 12.4k, kda_fwd_intra 3.190 -> 3.152 ms at prod8192.
// BJ_LO .. BJ_HI: the column blocks this warp takes (the bounded-gate kernel splits row 3 over two warps);
// the blocks between BJ_HI and bi still add their totals to m, in the same order as the whole row, so
// each product is bitwise the unsplit row's.
template <typename WT, int K, int BI, int BJ_LO = 0, int BJ_HI = BI - 1, int C = kChunk>
__device__ __forceinline__ void intra_p2_below_diag_row(const IntraCtx<WT, K, C>& c) {
  constexpr int KQ = IntraCtx<WT, K, C>::KQ;
  using H = dev::Elem<__half>;
  const WT* sQ = c.sQ();
  const WT* sK = c.sK();
  const float* sBT = c.gs().BT;
  const int g = c.lane >> 2, t = c.lane & 3;
  constexpr int bi = BI;
  constexpr int f = 16 * bi;
  float cq[3][2][4] = {}, ck[3][2][4] = {};
  const int ra = f + g, rb = f + g + 8;
  // One m16n8k16 step per 16 columns (p2_col)
#pragma unroll 1
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t aq_[4], ak_[4];
    float2 m[2];  // per half: loc_f + the block totals between bj and bi (the B side's offset)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int c0 = p2_col(kk, hf, t);
      const float2 gf = c.G2(f, c0), ga = c.G2(ra, c0), gb = c.G2(rb, c0);
      const float e00 = dev::fast_exp2(ga.x - gf.x), e01 = dev::fast_exp2(ga.y - gf.y);
      const float e10 = dev::fast_exp2(gb.x - gf.x), e11 = dev::fast_exp2(gb.y - gf.y);
      const float2 qa = c.X2(sQ + ra * KQ, c0), qb = c.X2(sQ + rb * KQ, c0);
      const float2 ka = c.X2(sK + ra * KQ, c0), kb = c.X2(sK + rb * KQ, c0);
      aq_[2 * hf] = H::pack2(qa.x * e00, qa.y * e01);
      aq_[2 * hf + 1] = H::pack2(qb.x * e10, qb.y * e11);
      ak_[2 * hf] = H::pack2(ka.x * e00, ka.y * e01);
      ak_[2 * hf + 1] = H::pack2(kb.x * e10, kb.y * e11);
      m[hf] = gf;
    }
    // B side: g_f - g_j = (T_bj - loc_j) + sum_{bj < m < bi} T_m + loc_f, every term <= 0
    // (block-local cumsums loc, block totals T); m carries loc_f + the totals in between.
#pragma unroll
    for (int bj = 2; bj >= BJ_LO; --bj) {
      if (bj < bi) {
        float2 tt[2];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
          tt[hf] = *reinterpret_cast<const float2*>(sBT + bj * K + p2_col(kk, hf, t));
#pragma unroll
        for (int nt = 0; nt < 2 && bj <= BJ_HI; ++nt) {  // past BJ_HI: another warp's block, its total only
          const int s = 16 * bj + 8 * nt + g;
          uint32_t b[2];
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int c0 = p2_col(kk, hf, t);
            const float2 gs = c.G2(s, c0), ks = c.X2(sK + s * KQ, c0);
            b[hf] = H::pack2(ks.x * dev::fast_exp2((tt[hf].x - gs.x) + m[hf].x),
                             ks.y * dev::fast_exp2((tt[hf].y - gs.y) + m[hf].y));
          }
          dev::mma_16816<__half>(cq[bj][nt], aq_, b[0], b[1]);
          dev::mma_16816<__half>(ck[bj][nt], ak_, b[0], b[1]);
        }
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) m[hf].x += tt[hf].x, m[hf].y += tt[hf].y;
      }
    }
  }
#pragma unroll
  for (int bj = BJ_LO; bj <= BJ_HI; ++bj) {
    if (bj < bi) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int s = 16 * bj + 8 * nt + 2 * t;
        c.put(false, ra, s, cq[bj][nt][0]);
        c.put(false, ra, s + 1, cq[bj][nt][1]);
        c.put(false, rb, s, cq[bj][nt][2]);
        c.put(false, rb, s + 1, cq[bj][nt][3]);
        c.put(true, ra, s, ck[bj][nt][0]);
        c.put(true, ra, s + 1, ck[bj][nt][1]);
        c.put(true, rb, s, ck[bj][nt][2]);
        c.put(true, rb, s + 1, ck[bj][nt][3]);
      }
    }
  }
}

template <typename WT, int K>
__device__ __forceinline__ void intra_p2_below_diag(const IntraCtx<WT, K>& c) {
  const int role = c.p2_role();
  if (role == 2) intra_p2_below_diag_row<WT, K, 3>(c);
  else if (role == 3) intra_p2_below_diag_row<WT, K, 2>(c);
  else intra_p2_below_diag_row<WT, K, 1>(c);
}

// Warps 4-7: the rest of each diagonal 16-block, on fp16 tensor cores with q and k rows STACKED in
// the 16 rows of one m16n8k16 (8 columns): tile (blk, 0) is the 8x8 quadrant rows o+8.., columns
// o..o+7 through the boundary e = o+7; tile (blk, 1) the two 4x4 tiles rows o+4.., columns
// o.. (e = o+3) and rows o+12.., columns o+8.. (e = o+11), whose cross products are formed
// and discarded (finite: every factor is <= 1). Factors exp2(g_i - g_e) (i > e) and
// exp2(g_e - g_j) (e >= j): one-sided (docs/numerics.md). 8 tiles (ti = 2 blk + sub4), in pairs:
// intra_p2_diag_tc below.
//
// One tile's per-thread rows, boundaries and operand rows (SUB4: the tile of two 4x4 blocks) and its
// accumulator (the other tile of the pair runs between two of its MMAs).
template <typename WT, int K, bool SUB4, int C = kChunk>
struct DiagTile {
  using Ctx = IntraCtx<WT, K, C>;
  static constexpr int KQ = Ctx::KQ;
  int o, r0, r1, e0, e1, sb, eb;
  bool k0, k1;
  const WT* x0;
  const WT* x1;
  float cc[4] = {};
  __device__ __forceinline__ DiagTile(const Ctx& c, int ti) {
    const int g = c.lane >> 2;
    o = 16 * (ti >> 1);
    if (!SUB4) {
      r0 = r1 = o + 8 + g;
      k0 = false;
      k1 = true;
      e0 = e1 = eb = o + 7;
      sb = o + g;
    } else {
      k0 = k1 = (g >> 2) != 0;
      r0 = o + 4 + (g & 3);
      e0 = o + 3;
      r1 = o + 12 + (g & 3);
      e1 = o + 11;
      sb = o + (g & 3) + 8 * (g >> 2);
      eb = o + 3 + 8 * (g >> 2);
    }
    x0 = (k0 ? c.sK() : c.sQ()) + r0 * KQ;
    x1 = (k1 ? c.sK() : c.sQ()) + r1 * KQ;
  }
  // One m16n8k16 step over columns 16 kk .. 16 kk + 15 (p2_col).
  __device__ __forceinline__ void step(const Ctx& c, int kk) {
    using H = dev::Elem<__half>;
    const int t = c.lane & 3;
    uint32_t af[4], b[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int c0 = p2_col(kk, hf, t);
      const float2 g0 = c.G2(r0, c0), ge0 = c.G2(e0, c0);
      const float fa0 = dev::fast_exp2(g0.x - ge0.x);
      const float fb0 = dev::fast_exp2(g0.y - ge0.y);
      float fa1 = fa0, fb1 = fb0;  // quadrant: rows g and g+8 are q and k of the same row
      if (SUB4) {
        const float2 g1 = c.G2(r1, c0), ge1 = c.G2(e1, c0);
        fa1 = dev::fast_exp2(g1.x - ge1.x);
        fb1 = dev::fast_exp2(g1.y - ge1.y);
      }
      const float2 v0 = c.X2(x0, c0), v1 = c.X2(x1, c0);
      af[2 * hf] = H::pack2(v0.x * fa0, v0.y * fb0);
      af[2 * hf + 1] = H::pack2(v1.x * fa1, v1.y * fb1);
      const float2 gsb = c.G2(sb, c0), geb = c.G2(eb, c0), kb = c.X2(c.sK() + sb * KQ, c0);
      b[hf] = H::pack2(kb.x * dev::fast_exp2(geb.x - gsb.x), kb.y * dev::fast_exp2(geb.y - gsb.y));
    }
    dev::mma_16816<__half>(cc, af, b[0], b[1]);
  }
  __device__ __forceinline__ void put(const Ctx& c) {
    const int t = c.lane & 3;
    if (!SUB4) {
      c.put(false, r0, o + 2 * t, cc[0]);
      c.put(false, r0, o + 2 * t + 1, cc[1]);
      c.put(true, r1, o + 2 * t, cc[2]);
      c.put(true, r1, o + 2 * t + 1, cc[3]);
    } else if (t < 2) {  // row g x columns n = 2t, 2t+1 < 4: the upper 4x4 tile
      c.put(k0, r0, o + 2 * t, cc[0]);
      c.put(k0, r0, o + 2 * t + 1, cc[1]);
    } else {  // row g+8 x columns n = 2t, 2t+1 >= 4: the lower 4x4 tile
      c.put(k1, r1, o + 4 + 2 * t, cc[2]);
      c.put(k1, r1, o + 4 + 2 * t + 1, cc[3]);
    }
  }
};

// Two tiles in one k loop, a 4x4 pair (odd ti) beside a quadrant (even ti): their chains are
// independent, so each hides the other's latency. Each tile's sum runs in the same order as alone.
// One instantiation only: this kernel sits at an instruction-cache cliff (more code in P2 slows
// every other phase; docs/notes/2026-12-02-fused-forward-groundwork.md, seventh session).
template <typename WT, int K, int C>
__device__ __forceinline__ void intra_diag_tile_pair(const IntraCtx<WT, K, C>& c, int t4, int tq) {
  DiagTile<WT, K, true, C> a(c, t4);
  DiagTile<WT, K, false, C> b(c, tq);
  for (int kk = 0; kk < K / 16; ++kk) {
    a.step(c, kk);
    b.step(c, kk);
  }
  a.put(c);
  b.put(c);
}

// The 8 tiles as four pairs: warp 4 (after its block row below the diagonal) takes tiles 5 and 0,
// warps 5-7 the pairs (1, 2), (3, 4), (7, 6). On the H200 (2026-12-03) this took the diagonal warps'
// P2 from 11.9k / 18.8k / 13.7k cycles (warps 5-7, one to three tiles each in turn) to 8.6k / 9.0k /
// 10.4k, and kda_fwd_intra from 3.14 to 3.06 ms at prod8192; warps 2 and 4 (16.4k / 16.8k) are now
// P2's critical path.
template <typename WT, int K>
__device__ __forceinline__ void intra_p2_diag_tc(const IntraCtx<WT, K>& c) {
  if (c.p2_role() < 4) return;
  const int w = c.p2_role() - 4;
  intra_diag_tile_pair(c, w == 0 ? 5 : (w == 3 ? 7 : 2 * w - 1), 2 * w);
}

// Bounded gates (dev::block_midpoint_ok: lower_bound >= -5, docs/numerics.md rule 2): a whole 16 x 16
// diagonal block on tf32 tensor cores through its row m = o + 8, in place of the SIMT 4 x 4 tiles and
// the fp16 tile pairs above:
//   Aqk[i][j] = sum_d (q_id exp2(g_id - g_md)) (k_jd exp2(g_md - g_jd)), L the same with k_i.
// Every exponent spans at most 8 steps of one block, so each factor lies within 2^+-57.7 and each
// operand within 2^+-74 (the raw rows' largest entries are below 2^16): no overflow, and nothing a row
// needs sinks below fp32's (tf32's) normal range. The pairs above the diagonal (j > i) have a factor up
// to 2^115 and may overflow: they are never read (rule 3), each C entry is its own pair's sum.
// tf32 keeps fp16's 11 significant bits with fp32's range, which fp16 (2^16) does not have here.
// k-slot t of an m16n8k8 step is column 8 s + 2 t and slot t + 4 column 8 s + 2 t + 1 (each dot product
// is the same sum in another order): a lane's A rows (g, g + 8) and its B rows (n-tiles 0 / 1: rows
// g / g + 8 of the block) are then the same entries, one 8-byte g and one 4-byte q / k load per row.
template <typename WT, int K, int C>
__device__ __forceinline__ void intra_p2_diag_mid(const IntraCtx<WT, K, C>& c, int blk) {
  constexpr int KQ = IntraCtx<WT, K, C>::KQ;
  const WT* sQ = c.sQ();
  const WT* sK = c.sK();
  const int g = c.lane >> 2, t = c.lane & 3;
  const int o = 16 * blk, ra = o + g, rb = o + g + 8, m = o + 8;
  float cq[2][4] = {}, ck[2][4] = {};
#pragma unroll 2
  for (int s = 0; s < K / 8; ++s) {
    const int d = 8 * s + 2 * t;
    const float2 gm = c.G2(m, d), ga = c.G2(ra, d), gb = c.G2(rb, d);
    const float2 qa = c.X2(sQ + ra * KQ, d), qb = c.X2(sQ + rb * KQ, d);
    const float2 ka = c.X2(sK + ra * KQ, d), kb = c.X2(sK + rb * KQ, d);
    // A side exp2(g_r - g_m), B side exp2(g_m - g_r): two-sided (rule 2), each within 2^+-57.7
    const float ea0 = dev::fast_exp2(ga.x - gm.x), ea1 = dev::fast_exp2(ga.y - gm.y);
    const float eb0 = dev::fast_exp2(gb.x - gm.x), eb1 = dev::fast_exp2(gb.y - gm.y);
    const float ia0 = dev::fast_exp2(gm.x - ga.x), ia1 = dev::fast_exp2(gm.y - ga.y);
    const float ib0 = dev::fast_exp2(gm.x - gb.x), ib1 = dev::fast_exp2(gm.y - gb.y);
    const uint32_t aq[4] = {dev::to_tf32(qa.x * ea0), dev::to_tf32(qb.x * eb0), dev::to_tf32(qa.y * ea1),
                            dev::to_tf32(qb.y * eb1)};
    const uint32_t ak[4] = {dev::to_tf32(ka.x * ea0), dev::to_tf32(kb.x * eb0), dev::to_tf32(ka.y * ea1),
                            dev::to_tf32(kb.y * eb1)};
    const uint32_t b00 = dev::to_tf32(ka.x * ia0), b01 = dev::to_tf32(ka.y * ia1);
    const uint32_t b10 = dev::to_tf32(kb.x * ib0), b11 = dev::to_tf32(kb.y * ib1);
    dev::mma_1688_tf32(cq[0], aq, b00, b01);
    dev::mma_1688_tf32(cq[1], aq, b10, b11);
    dev::mma_1688_tf32(ck[0], ak, b00, b01);
    dev::mma_1688_tf32(ck[1], ak, b10, b11);
  }
  // C entry e of n-tile nt: row (e < 2 ? ra : rb), column o + 8 nt + 2 t + (e & 1); Aqk where j <= i,
  // L where j < i (the rest stays P1's zero)
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e < 2 ? ra : rb, j = o + 8 * nt + 2 * t + (e & 1);
      if (j <= r) c.put(false, r, j, cq[nt][e]);
      if (j < r) c.put(true, r, j, ck[nt][e]);
    }
}

// ---- P4a, first part: qg and kg -> workspace. It reads only what P1 wrote (sG, sQ, sK, the block
// sums, the row factors), so the warps that finish their P2 share early take it over from a
// queue instead of idling at the barrier (P2's three kinds of work are uneven). Units of 64
// vectors (two per lane); every vector is computed the same way whichever warp takes it, so the
// result is deterministic.
template <typename WT, int K, int C, typename Out>
__device__ __forceinline__ void intra_store_gated(const IntraCtx<WT, K, C>& c, const Out& out) {
  using Ctx = IntraCtx<WT, K, C>;
  const KdaFwdParams& p = c.p;
  const dev::GateScratch<K> gs = c.gs();
  const int lane = c.lane;
  constexpr int VPR = K / 8;                 // 8-element vectors per row
  constexpr int kUnits = C * VPR / 64;  // units of 64 vectors, two per lane
  constexpr int RS = 32 / VPR;                // rows between a lane's two vectors
  static_assert(VPR <= 32 && 32 % VPR == 0 && 16 % (64 / VPR) == 0, "a unit's rows lie in one row block");
  for (;;) {
    int unit = 0;
    if (lane == 0) unit = atomicAdd(c.sWork(), 1);
    unit = __shfl_sync(0xffffffffu, unit, 0);
    if (unit >= kUnits) break;
    // A lane's two vectors: rows r0 and r0 + RS at the same columns, in one row block (a unit starts
    // on a multiple of 64 / VPR rows, which divides 16), so their block sums are loaded once.
    const int r0 = (unit * 64 + lane) / VPR, d0 = (lane % VPR) * 8;
    const int sw = dev::half_swap(d0);  // conflict-free phases (ld8_slots)
    dev::BlockSums8 bs;
    bs.load<K>(gs.BO, gs.BT, gs.BS, r0 >> 4, d0, sw);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + half * RS;
      if (!out.wants_row(c, r)) continue;  // the workspace: rows past the end are never written
      float loc[8];
      dev::ld8_slots(loc, c.sG() + r * Ctx::KP + d0, sw);
      uint32_t pq[4], pk[4];
      dev::gated_vec8_sums<WT, Ctx::KQ>(loc, bs, c.sQ(), c.sK(), p.opt.scale * gs.rq[r], gs.rk[r], r, d0, pq, pk,
                                        nullptr, sw);
      out.qg_kg(c, r, d0, make_uint4(pq[0], pq[1], pq[2], pq[3]), make_uint4(pk[0], pk[1], pk[2], pk[3]));
    }
  }
}

// ---------------------------------------------------------------- P3 (diagonal) || P4a, second part
// Threads < intra_diag_threads (warps 0-1 of the 64-token kernel): the diagonal blocks of
// X = (I + L)^-1 (a serial, latency-bound substitution), into the dead q region: column j of the
// inverse of the unit lower-triangular 16x16 block by forward substitution in fp32 (never a
// low-precision Neumann series: near-collinear keys make it diverge).
template <int C>
constexpr int intra_diag_threads() {
  return C;  // one thread per column of each 16 x 16 diagonal block
}
template <typename WT, int K, int C>
__device__ __forceinline__ void intra_diag_inverse(const IntraCtx<WT, K, C>& c) {
  constexpr int AP = IntraCtx<WT, K, C>::AP;
  const float* sL = c.sL();
  float* sX = c.sX();
  const int blk = c.tid >> 4, j = c.tid & 15, o = 16 * blk;
  float xv[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float acc = 0.f;
#pragma unroll
    for (int m = 0; m < i; ++m) acc = fmaf(sL[(o + i) * AP + o + m], xv[m], acc);
    xv[i] = i < j ? 0.f : (i == j ? 1.f : -acc);
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) sX[(o + i) * AP + o + j] = xv[i];
}

// Warps 2-7 meanwhile: kexp = k rk exp2(g2) in place of g2 (B operand of w), Aqk -> workspace,
// exp2(G) -> gdecay. Disjoint buffers from intra_diag_inverse's: sL / sX vs sG / sK / sA.
template <typename WT, int K, int C, typename Out>
__device__ __forceinline__ void intra_kexp_aqk_gdecay(const IntraCtx<WT, K, C>& c, const Out& out) {
  using Ctx = IntraCtx<WT, K, C>;
  using E = typename Ctx::E;
  constexpr int KP = Ctx::KP, KQ = Ctx::KQ, AP = Ctx::AP;
  constexpr int ND = intra_diag_threads<C>(), NT2 = Ctx::NTH - ND;
  const KdaFwdParams& p = c.p;
  const dev::GateScratch<K> gs = c.gs();
  const float* sG = c.sG();
  const WT* sK = c.sK();
  const float* sA = c.sA();
  float* sKexp = c.sKexp();
  const int t2 = c.tid - ND;
  constexpr int VPR = K / 8;
  for (int i = t2; i < C * VPR; i += NT2) {
    const int r = i / VPR, d0 = (i % VPR) * 8;
    const float fk = gs.rk[r];
    const int sw = dev::half_swap(d0);  // every 8-vector below in slot order: conflict-free phases
    float lv[8], ov[8], kx[8];
    dev::ld8_slots(lv, sG + r * KP + d0, sw);
    dev::ld8_slots(ov, gs.BO + (r >> 4) * K + d0, sw);
    const uint4 uk = *reinterpret_cast<const uint4*>(sK + r * KQ + d0);
    uint32_t wk[4] = {uk.x, uk.y, uk.z, uk.w};
    dev::words_slots(wk, sw);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 kv = E::to_float2(wk[e]);
      kx[2 * e] = fk * kv.x * dev::fast_exp2(ov[2 * e] + lv[2 * e]);
      kx[2 * e + 1] = fk * kv.y * dev::fast_exp2(ov[2 * e + 1] + lv[2 * e + 1]);
    }
    // stored rounded to tf32 (its only use is w's B operand): each element is rounded once here,
    // not once per m-tile and warp in intra_w_tile (the MMA sees the same 19 bits)
#pragma unroll
    for (int e = 0; e < 8; ++e) kx[e] = dev::tf32_value(kx[e]);
    // in place: this thread is the only reader of sG[r][d0 .. d0+7] in this phase
    dev::st8_slots(sKexp + r * KP + d0, kx, sw);
  }
  for (int i = t2; i < C * (C / 8); i += NT2) {
    const int r = i / (C / 8), s0 = (i % (C / 8)) * 8;
    if (out.wants_row(c, r)) {
      uint32_t pa[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) pa[e] = E::pack2(sA[r * AP + s0 + 2 * e], sA[r * AP + s0 + 2 * e + 1]);
      out.aqk(c, r, s0, make_uint4(pa[0], pa[1], pa[2], pa[3]));
    }
  }
  if constexpr (NT2 >= K) {
    if (t2 < K) out.gdecay(c, t2, dev::fast_exp2(gs.Gt[t2]));
  } else {
    for (int d = t2; d < K; d += NT2) out.gdecay(c, d, dev::fast_exp2(gs.Gt[d]));
  }
}

// Akk rows of 16-row block blk = X diag(beta) as full C-wide rows (zeros above the diagonal
// blocks), threads [t0, t0 + nthr) of the CTA (and, for the backward, M = X itself: the backward
// needs (I + L)^-1 without beta folded in).
template <typename WT, int K, int C, typename Out>
__device__ __forceinline__ void intra_store_akk_rows(const IntraCtx<WT, K, C>& c, const Out& out, int blk, int t0,
                                                     int nthr) {
  using Ctx = IntraCtx<WT, K, C>;
  using E = typename Ctx::E;
  constexpr int AP = Ctx::AP;
  const float* sX = c.sX();
  const float* sBeta = c.gs().beta;
  for (int i = c.tid - t0; i < 16 * (C / 8); i += nthr) {
    const int r = 16 * blk + i / (C / 8), s0 = (i % (C / 8)) * 8;
    if (out.wants_row(c, r)) {
      uint32_t pa[4], pm[4];
      if ((s0 >> 4) > blk) {
#pragma unroll
        for (int e = 0; e < 4; ++e) pa[e] = pm[e] = E::pack2(0.f, 0.f);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x0 = sX[r * AP + s0 + 2 * e], x1 = sX[r * AP + s0 + 2 * e + 1];
          pa[e] = E::pack2(x0 * sBeta[s0 + 2 * e], x1 * sBeta[s0 + 2 * e + 1]);
          pm[e] = E::pack2(x0, x1);
        }
      }
      out.akk(c, r, s0, make_uint4(pa[0], pa[1], pa[2], pa[3]), make_uint4(pm[0], pm[1], pm[2], pm[3]));
    }
  }
}

// P4b for one m-tile: w[16 mt .. 16 mt + 15][col0 .. col0 + 8 ntc) = Akk @ kexp (tf32 tensor cores).
// Akk is lower triangular: rows of m-tile mt only see columns < 16 (mt + 1). Needs only the rows of
// X in block mt, which are final once merge step mt is done.
template <typename WT, int K, int C, typename Out>
__device__ __forceinline__ void intra_w_tile(const IntraCtx<WT, K, C>& c, const Out& out, int mt, int col0, int ntc) {
  using Ctx = IntraCtx<WT, K, C>;
  using E = typename Ctx::E;
  constexpr int KP = Ctx::KP, AP = Ctx::AP;
  constexpr int kNtMax = K / 32;
  const float* sX = c.sX();
  const float* sKexp = c.sKexp();
  const float* sBeta = c.gs().beta;
  const int g = c.lane >> 2, t = c.lane & 3;
  float acc[kNtMax][4] = {};
  const int ra = 16 * mt + g, rb = ra + 8;
  for (int kk = 0; kk < 2 * (mt + 1); ++kk) {
    const int ca = 8 * kk + t, cb = ca + 4;
    const float bca = sBeta[ca], bcb = sBeta[cb];  // Akk = X diag(beta)
    const uint32_t a[4] = {dev::to_tf32(sX[ra * AP + ca] * bca), dev::to_tf32(sX[rb * AP + ca] * bca),
                           dev::to_tf32(sX[ra * AP + cb] * bcb), dev::to_tf32(sX[rb * AP + cb] * bcb)};
#pragma unroll
    for (int nt = 0; nt < kNtMax; ++nt) {
      if (nt < ntc) {
        const int col = col0 + 8 * nt + g;
        dev::mma_1688_tf32(acc[nt], a, __float_as_uint(sKexp[ca * KP + col]), __float_as_uint(sKexp[cb * KP + col]));
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < kNtMax; ++nt) {
    if (nt < ntc) {
      const int col = col0 + 8 * nt + 2 * t;
      if (out.wants_row(c, ra)) out.w2(c, ra, col, E::pack2(acc[nt][0], acc[nt][1]));
      if (out.wants_row(c, rb)) out.w2(c, rb, col, E::pack2(acc[nt][2], acc[nt][3]));
    }
  }
}

// P3 merge step bi: X_{bi,j} = -X_{bi,bi} sum_{m=j}^{bi-1} L_{bi,m} X_{m,j} for j = this warp (< bi),
// on tensor cores in 3xTF32 (hi*hi + hi*lo + lo*hi: ~fp32 accuracy). Y goes through the warp's own
// rows of the scratch sY. The blocks above the diagonal are never formed (the Akk store writes
// zeros there, w never reads them).
template <typename WT, int K, int C>
__device__ __forceinline__ void intra_merge_step(const IntraCtx<WT, K, C>& c, int bi) {
  constexpr int AP = IntraCtx<WT, K, C>::AP;
  const float* sL = c.sL();
  float* sX = c.sX();
  const int g = c.lane >> 2, t = c.lane & 3;
  const int j = c.warp;
  float cy[2][4] = {}, sy[2][4] = {};  // hi*hi and the corrections (intra_mma_3xtf32)
  for (int m = j; m < bi; ++m) {
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      const int ra = 16 * bi + g, ca = 16 * m + 8 * ks + t;
      const float a[4] = {sL[ra * AP + ca], sL[(ra + 8) * AP + ca], sL[ra * AP + ca + 4], sL[(ra + 8) * AP + ca + 4]};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int kb = 16 * m + 8 * ks + t, col = 16 * j + 8 * nt + g;
        intra_mma_3xtf32(cy[nt], sy[nt], a, sX[kb * AP + col], sX[(kb + 4) * AP + col]);
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) cy[nt][e] += sy[nt][e];
  float* y = c.sY() + 16 * j * AP;  // rows 16j .. 16j+15 of the scratch: this warp's own
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    y[g * AP + 8 * nt + 2 * t] = cy[nt][0];
    y[g * AP + 8 * nt + 2 * t + 1] = cy[nt][1];
    y[(g + 8) * AP + 8 * nt + 2 * t] = cy[nt][2];
    y[(g + 8) * AP + 8 * nt + 2 * t + 1] = cy[nt][3];
  }
  __syncwarp();
  float cx[2][4] = {}, sx[2][4] = {};
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    const int ra = 16 * bi + g, ca = 16 * bi + 8 * ks + t;
    const float a[4] = {sX[ra * AP + ca], sX[(ra + 8) * AP + ca], sX[ra * AP + ca + 4], sX[(ra + 8) * AP + ca + 4]};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int kb = 8 * ks + t, col = 8 * nt + g;
      intra_mma_3xtf32(cx[nt], sx[nt], a, y[kb * AP + col], y[(kb + 4) * AP + col]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) cx[nt][e] += sx[nt][e];
    const int ra = 16 * bi + g, col = 16 * j + 8 * nt + 2 * t;
    sX[ra * AP + col] = -cx[nt][0];
    sX[ra * AP + col + 1] = -cx[nt][1];
    sX[(ra + 8) * AP + col] = -cx[nt][2];
    sX[(ra + 8) * AP + col + 1] = -cx[nt][3];
  }
}

// ---------------------------------------------------------------- the phase sequence of one chunk
// The parts every chunk size runs alike (intra_chunk here, intra_chunk_c32 in kda_fwd_intra_c32.cuh),
// with the phase clocks at kda_phases.py's slots: P0 + P1 and the block offsets (slots 0-2); after
// P2, the qg / kg queue, then the diagonal inverses beside kexp / Aqk / exp2(G) (slots 3-4); the end.
template <typename WT, int K, int C>
__device__ __forceinline__ void intra_gate_phases(const IntraCtx<WT, K, C>& c) {
  c.stamp(0);
  intra_load_gate(c);      // P0 + P1                                      |
  c.stamp(1);
  intra_block_offsets(c);  // block offsets                                 |
  c.stamp(2);
}
template <typename WT, int K, int C, typename Out>
__device__ __forceinline__ void intra_queue_and_diagonal(const IntraCtx<WT, K, C>& c, const Out& out) {
  intra_store_gated(c, out);  // P4a, first part: qg, kg from a shared queue
  __syncthreads();
  c.stamp(3);
  if (c.tid < intra_diag_threads<C>()) intra_diag_inverse(c);  // P3 diagonal || P4a, second part
  else intra_kexp_aqk_gdecay(c, out);
  __syncthreads();
  c.stamp(4);
}
template <typename WT, int K, int C>
__device__ __forceinline__ void intra_stamp_end(const IntraCtx<WT, K, C>& c) {
  if (c.clk) {  // profiling only (clk is uniform over the CTA): the end of the slowest warp
    __syncthreads();
    c.stamp(6);
  }
}

// The 64-token chunk (the file's header has the phases and the smem plan; "|" there = __syncthreads
// here). All 256 threads of the CTA; the outputs go to `out` (the workspace, or a scan stage).
template <typename WT, int K, typename Out, bool kMid = false>
__device__ __forceinline__ void intra_chunk(const IntraCtx<WT, K>& c, const Out& out) {
  intra_gate_phases(c);
  if constexpr (kMid) {
    // P2 by physical warp (w and w + 4 share a scheduler): warps 0, 4, 1, 5 the diagonal blocks 0-3 at
    // their midpoints; warp 2 block row 3's column blocks 1-2, warp 7 its block 0; warp 3 block row 2,
    // warp 6 block row 1. Each warp then at most two block products (a diagonal block's tf32 product
    // is about two fp16 ones), each scheduler about the same work.
    switch (c.warp) {
      case 2: intra_p2_below_diag_row<WT, K, 3, 1, 2>(c); break;
      case 7: intra_p2_below_diag_row<WT, K, 3, 0, 0>(c); break;
      case 3: intra_p2_below_diag_row<WT, K, 2>(c); break;
      case 6: intra_p2_below_diag_row<WT, K, 1>(c); break;
      default: intra_p2_diag_mid(c, 2 * (c.warp & 1) + (c.warp >> 2));
    }
    c.stamp_warp_p2(c.warp);  // kda_phases.py: per physical warp here
  } else {
    if (c.p2_role() < 2) {  // P2, three kinds of tiles
      intra_p2_diag_simt(c, c.p2_role());
    } else {
      if (c.p2_role() < 5) intra_p2_below_diag(c);
      intra_p2_diag_tc(c);
    }
    c.stamp_warp_p2(c.p2_role());
  }
  intra_queue_and_diagonal(c, out);
  // P3 merge steps; while warps < bi merge row block bi, warps 4-7 already produce w and Akk for
  // row block bi - 1 (final since the previous step), a quarter of K each, instead of waiting at
  // the step's barrier.
  for (int bi = 1; bi < 4; ++bi) {
    if (c.warp < bi) {
      intra_merge_step(c, bi);
    } else if (c.warp >= 4) {
      intra_w_tile(c, out, bi - 1, (c.warp - 4) * (K / 4), K / 32);
      intra_store_akk_rows(c, out, bi - 1, 128, 128);
    }
    __syncthreads();
  }
  c.stamp(5);
  // P4b, last row block (all warps)
  intra_w_tile(c, out, 3, c.warp * (K / 8), K / 64);
  intra_store_akk_rows(c, out, 3, 0, kIntraThreads);
  intra_stamp_end(c);
}

// The chunk with the P2 form the options select (dev::block_midpoint_ok), decided at run time: for a
// kernel that carries both (the fused forward, opt-in), so that its chunks are bit for bit the
// two-kernel path's.
template <typename WT, int K, typename Out>
__device__ __forceinline__ void intra_chunk_any(const IntraCtx<WT, K>& c, const Out& out) {
  if (dev::block_midpoint_ok(c.p.opt)) intra_chunk<WT, K, Out, true>(c, out);
  else intra_chunk<WT, K, Out, false>(c, out);
}

// Grid: (global chunk, value head); in the streamed forward (p.chunk_ready set, kda_policy.h's
// fwd_stream_choice) (value head, chunk row), every head of a chunk row before the next row
// (dev::streamed_chunk), each CTA publishing its chunk to the scan that runs beside it.
// kMid: P2's diagonal blocks through their midpoint rows (bounded gates, dev::block_midpoint_ok). Two
// kernels, not one with a runtime branch, as kda_bwd_grads: each carries only its own P2 code (this
// kernel sits at an instruction-cache cliff, intra_diag_tile_pair).
template <typename WT, int K, bool kMid>
__global__ void __launch_bounds__(kIntraThreads, 2) kda_fwd_intra_kernel(const KdaFwdParams p) {
  KF_DYN_SMEM(float4, smem_f4);
  const dev::IntraCell cell = dev::intra_cell(p);
  int n, ch;
  // a varlen grid's idle tail; the streamed forward is fixed length only, so each of its CTAs has a
  // chunk to publish
  if (!dev::chunk_of(p, cell.x, n, ch)) return;
  const IntraCtx<WT, K> c(p, reinterpret_cast<char*>(smem_f4), dev::seq_info(p, n), ch, cell.hv,
                          dev::cta_clock_row(p.dbg_intra_clock));
  intra_chunk<WT, K, IntraToWorkspace<WT, K>, kMid>(c, IntraToWorkspace<WT, K>{});
  dev::publish_cell(p, cell);
}

// The launch (kda_launch_shape.h's intra_grid over the global chunks, chunk_grid's rows): launch_intra's
// and the emulator's.
template <typename WT, int K>
inline LaunchShape intra_launch(const KdaFwdParams& p) {
  return intra_grid(p, p.max_chunks, kIntraThreads, sizeof(IntraSmem<WT, K>));
}

// The kernel a problem runs (the launcher's and the emulator's one choice).
template <typename WT, int K>
auto intra_kernel_for(const KdaFwdParams& p) {
  return dev::block_midpoint_ok(p.opt) ? kda_fwd_intra_kernel<WT, K, true> : kda_fwd_intra_kernel<WT, K, false>;
}

#ifndef KF_EMU
template <typename WT, int K>
void launch_intra(const KdaFwdParams& p, cudaStream_t stream) {
  dev::launch_chunk_kernel(intra_kernel_for<WT, K>(p), intra_launch<WT, K>(p), p, stream);
}
#endif

}  // namespace kernel_fun::kda
