// kda_bwd_grads: every per-chunk gradient of the KDA backward (stage B4 of
// src/kernel_fun/ref/kda_bwd.py and the preprocessing backward), one CTA per (chunk, value head),
// 512 threads (16 warps), ~210 KB of smem at K = 128 (one CTA per SM, 16 warps to hide latency).
//
// Inputs per chunk: q, k, g, beta (raw; the gate, the cumsum, l2norm and beta's sigmoid are
// recomputed exactly as the forward intra does), v, do, Aqk, Akk and M (the forward's saved factors),
// w and kg (the training forward's own, else rebuilt: kda_bwd_prep, or the intra without factors) and
// the two checkpoints h_c (kda_fwd_scan) and dh_{c+1} (kda_bwd_dh_scan).
//
// Phases ("|" = barrier), each a device function below; warp w: row block rb = w & 3 (rows 16 rb ..),
// column quarter cq = w >> 2:
//   P   q, k, Aqk, Akk, w, kg and the first V-slice -> smem (cp.async); gate + block-local cumsum,
//       beta; block offsets; l2norm factors                                                   |
//   V   per 32-wide V-slice (double-buffered h_c, dh_{c+1}, do, v slices):
//       V1  v' = Akk v - w h^T  /  dv' = Aqk^T do + kg dh^T, [64 x 32] each (on warpgroups 0-1, or
//           16 columns on each of the four: grads_contract's NV): the K-wide part on wgmma with A
//           and B from smem, the triangular part on mma.sync into the same registers -> smem    |
//       V2  dqg += do h, dkg += v' dh, dw += dv' h   ([16 x K/4] per warp: wgmma per warpgroup =
//           column quarter, B = the h / dh tiles from smem);
//           dAqk += do v'^T, dAkk += dv' v^T         ([16 x 16] per warp, lower blocks only);
//           sum_v h * dh per state row (the decay's gradient) from ldmatrix fragments of h / dh |
//       Before wgmma (2026-12-03, seventeenth session) every warp re-read its operand fragments by
//       ldmatrix and the shared-memory pipe was the busiest unit (~78% at prod8192); with B (and
//       V1's A) read once per warpgroup the V phase went 29.4k -> 26.8k cycles per CTA at prod8192
//       (docs/notes/2026-12-03-grads-wgmma.md).
//   E   dA1 = scale dAqk (i >= j), dAkk, dw, kexp -> smem; dq^ = scale exp2(g2) dqg,
//       dkB = exp2(G - g2) dkg (column-side k terms), dG += sum_i kg dkg                     |
//       dAkk += dw kexp^T; dkA = exp2(g2) Akk^T dw (row-side k terms)                        |
//       dbeta_j = sum_i dAkk_ij M_ij;  dM = dAkk diag(beta) -> bf16                           |
//       Z = dM M^T  |  dL = -(M^T Z) (i > j)                                                   |
//   I   the intra-chunk products of dA1 and dL with the gated q / k rows: the blocks below the
//       diagonal on tf32 tensor cores (row side through the first row f of the row's block, column
//       side through the last row e of the column's block: every factor exp2 of a difference
//       <= 0) into the C-layout accumulators  |  those -> smem; the 16 x 16 diagonal blocks: with a
//       bounded gate (lower_bound >= -5) on tensor cores through the block midpoint, added in place;
//       else  |  in SIMT, one thread per (column, block), e_ij as telescoping products of per-row factors <= 1  |
//   F   dG at the last valid row, reverse cumsum (per (column, block), carries through smem)    |
//       gate backward (dg; ddt_bias / dA_log partials)  |  beta's sigmoid backward; l2norm backward
//       in one pass per (row, 8 lanes) (or, with GVA, dq^ / dk^ per value head to the workspace
//       for kda_bwd_finish)
//
// CODE SIZE: every CTA runs each phase once, top to bottom, one CTA per SM, so the phases' straight-
// line code is fetched again for each chunk. At ~11k SASS instructions a third of the stall samples
// were instruction fetch (ncu, docs/notes/2026-12-01-kda-backward.md). Loops that run once per CTA
// are rolled, or have fixed trip counts (dev::strided), and cold paths are rolled. Check the
// instruction count (readelf on an nvcc -cubin, docs/gpu-workflow.md) when adding code here: about 8.3k
// instructions at bf16 / K = 128.
//
// THE NUMERICS RULES (docs/numerics.md): every exp2 argument is a difference g2[r] - g2[s]
// with r >= s, built from the block-local cumsums and block totals (device/gate.cuh) as a sum of
// terms <= 0; masks are selects; dA, dL, dg, h dh and every accumulator are fp32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/dispatch_tags.h"
#include "kda/bwd/kda_bwd_launch.h"
#include "kda/device/gate.cuh"
#include "kda/device/primitives.cuh"
#include "kda/device/sequence.cuh"

namespace kernel_fun::kda {

constexpr int kGradsThreads = 512;
constexpr int kVS = 32;  // V-slice width of the contraction loop

// Shared memory plan, a view of the dynamic shared memory (nothing is constructed; every member's
// size is a multiple of 16 bytes, so each starts 16-byte aligned and nothing is padded). The base
// lives for the whole kernel. Then a union of the phases: the V phase's operands and slices; after
// the V loop the E phase's matrices (Akk stays in place), overlaid later by the I / F phases' [64][K]
// results, which overwrite all of E but dA1 and dL (E writes them, I reads them).
template <typename WT, int K>
struct GradsSmem {
  static constexpr int KQ = K + 8;     // WT row stride of [64][K] tiles (16-byte rows, distinct banks)
  static constexpr int KP = K + 8;     // fp32 row stride of the g2 tile
  static constexpr int AP = 72;        // WT row stride of [64][64] tiles
  static constexpr int AF = 68;        // fp32 row stride of [64][64] tiles
  static constexpr int VSP = kVS + 8;  // WT row stride of [64][32] slices
  static constexpr int NPART = 2;  // partial sums of sum_v h dh per state row (one per 16-row half of a slice)
  // One stage of the V loop's double buffer: this slice of h_c and dh_{c+1}, and of do and v.
  // h and dh are [kVS][K] tiles in the 128-byte swizzle (dev::sw128_index<kVS>): the B operands of
  // the V phase's wgmma products (K-major in V1, MN-major in V2), read through descriptors; every
  // swizzled tile starts on a 1024-byte boundary (asserted below).
  struct VStage {
    WT h[kVS * K];
    WT dh[kVS * K];
    WT do_[kChunk][VSP];  // [64 tok][VSP]
    WT v[kChunk][VSP];
  };
  struct VPhase {
    WT aqk[kChunk][AP];
    WT akk[kChunk][AP];
    WT kg[kChunk * K];  // [64][K] in the 128-byte swizzle (sw128_index<kChunk>): A of V1's wgmma
    WT w[kChunk * K];
    VStage stage[2];
    WT vn[kChunk][VSP];
    WT dvn[kChunk][VSP];
    // The last chunk of a sequence with a final-state gradient (the kernel's dht_last, bf16 only):
    // the low halves v' - bf16(v') and dht - bf16(dht) of the current slice, so that the V2 products
    // that feed dg's last row (kg dkg with dh = dht) see v' and dht unrounded. Fits beside the V
    // tiles without growing the phase union (the E / I phases are larger).
    WT vnlo[kChunk][VSP];
    WT dhlo[kVS * K];  // swizzled as stage.dh
  };
  struct EPhase {
    WT m[kChunk][AP];      // over V's aqk
    WT akk[kChunk][AP];    // V's akk, in place
    WT dw[kChunk][KQ];     // over V's kg
    WT kexp[kChunk][KQ];   // over V's w
    float dakk[kChunk][AF];
    WT dm[kChunk][AP];
    WT z[kChunk][AP];
  };
  struct IPhase {
    float xq[kChunk][K];
    float xk[kChunk][K];
    float xg[kChunk][K];
  };
  struct EIPhases {
    union {
      EPhase e;
      IPhase i;
    };
    float rowd[16][16];    // [16 warps][16] diagonal row sums
    float carry[4][K];     // per-block column sums
    float a1[kChunk][AF];  // dA1, then (F) the gate partials
    float dl[kChunk][AF];  // dL
  };
  // base
  WT q[kChunk][KQ];
  WT k[kChunk][KQ];
  float g[kChunk][KP];
  dev::GateStorage<K> gate;
  float dec[NPART][K];     // partial sums of h * dh
  float dgp[8][K];         // [4][K] per row block sums of kg * dkg, then partials
  float rowa[4][kChunk];   // per column quarter row sums
  float dbc[8][kChunk];    // dbeta from Akk's columns (partials)
  float bslope[kChunk];    // d beta / d raw beta per row (dev::GatePass::load_beta in P), for F
  // I1's column-side pair (row block 3 -> rows of block 0), computed by the row-block-3 warps and
  // added by the row-block-0 warps after the barrier (grads_offdiag): per column quarter, per lane,
  // its C fragment (K / 32 tiles x 4 floats). Live from I1 to the start of I2 only.
  float colpart[4][32][K / 8];
  alignas(1024) union {
    VPhase v;
    EIPhases ei;
  } u;
};

// Profiling (scripts/kda_phases.py): thread 0 of every CTA stamps its phase boundaries into
// p.dbg_clock[cta][16] when it is set (dev::stamp_clock).
#define KF_GRADS_PHASE(i)                                                   \
  do {                                                                      \
    if (threadIdx.x == 0) dev::stamp_clock(dev::cta_clock_row(c.p.dbg_clock), (i)); \
  } while (0)

// Everything a phase needs: the params, this CTA's chunk, the thread's place, the smem buffers.
template <typename WT, int K>
struct GradsCtx : dev::ChunkPlace {
  using S = GradsSmem<WT, K>;
  using E = dev::Elem<WT>;
  static constexpr int NTH = kGradsThreads;
  static_assert(sizeof(S) <= 227 * 1024, "grads shared memory exceeds the sm_90 per-CTA limit");
  static_assert(offsetof(S, u) % 1024 == 0 && offsetof(typename S::VPhase, kg) % 1024 == 0 &&
                    offsetof(typename S::VPhase, w) % 1024 == 0 && offsetof(typename S::VPhase, stage) % 1024 == 0 &&
                    sizeof(typename S::VStage) % 1024 == 0 && offsetof(typename S::VStage, dh) % 1024 == 0 &&
                    offsetof(typename S::VPhase, dhlo) % 1024 == 0,
                "the swizzled tiles start on 1024-byte boundaries");
  static_assert(offsetof(typename S::EPhase, akk) == offsetof(typename S::VPhase, akk), "the E phase keeps Akk in place");
  static_assert((kGradsThreads / (K / 8)) * K <= kChunk * S::AF, "F's gate partials fit in dA1's place");
  static constexpr int KQ = S::KQ, KP = S::KP, AP = S::AP, AF = S::AF, VSP = S::VSP;
  static constexpr int KW = K / 4;     // columns of K per warp (column quarter)
  static constexpr int NTK = KW / 8;   // n-tiles of 8 columns in a warp's quarter of K

  const KdaBwdParams& p;
  S* st;
  int g, t, rb, cq, cb;
  int V;

  __device__ __forceinline__ GradsCtx(const KdaBwdParams& p_, char* sm_, const dev::SeqInfo& seq, int c, int hv_)
      : dev::ChunkPlace(p_, seq, c, hv_), p(p_), st(reinterpret_cast<S*>(sm_)) {
    g = lane >> 2;
    t = lane & 3;
    rb = warp & 3;
    cq = warp >> 2;
    cb = cq * KW;
    V = p.V;
  }
  __device__ __forceinline__ WT* sQ() const { return &st->q[0][0]; }
  __device__ __forceinline__ WT* sK() const { return &st->k[0][0]; }
  __device__ __forceinline__ float* sG() const { return &st->g[0][0]; }
  __device__ __forceinline__ float* sBT() const { return &st->gate.BT[0][0]; }
  __device__ __forceinline__ float* sBO() const { return &st->gate.BO[0][0]; }
  __device__ __forceinline__ float* sBS() const { return &st->gate.BS[0][0]; }
  __device__ __forceinline__ float* sGt() const { return st->gate.Gt; }
  __device__ __forceinline__ float* sBeta() const { return st->gate.beta; }
  __device__ __forceinline__ float* sRq() const { return st->gate.rq; }
  __device__ __forceinline__ float* sRk() const { return st->gate.rk; }
  __device__ __forceinline__ float* sA1() const { return &st->u.ei.a1[0][0]; }
  __device__ __forceinline__ float* sDL() const { return &st->u.ei.dl[0][0]; }
  __device__ __forceinline__ typename S::VPhase& vph() const { return st->u.v; }
  __device__ __forceinline__ typename S::EPhase& eph() const { return st->u.ei.e; }
  __device__ __forceinline__ typename S::IPhase& iph() const { return st->u.ei.i; }
  __device__ __forceinline__ float qhat(int r, int d) const { return E::to_float(sQ()[r * KQ + d]) * sRq()[r]; }
  __device__ __forceinline__ float khat(int r, int d) const { return E::to_float(sK()[r * KQ + d]) * sRk()[r]; }
  // exponents of element (r, d), r in this warp's row block: g2 = O_b + loc, G - g2 = (T_b - loc) + S_b
  __device__ __forceinline__ float e_g2(int r, int d) const {
    return dev::fast_exp2(sBO()[rb * K + d] + sG()[r * KP + d]);
  }
  __device__ __forceinline__ float e_Gg2(int r, int d) const {
    return dev::fast_exp2((sBT()[rb * K + d] - sG()[r * KP + d]) + sBS()[rb * K + d]);
  }
  // Index of (row r, column d) in the [64][K] fp32 X arrays of the I / F phases: 8-float groups XOR-
  // swizzled by r & 7. The C-fragment stores (8 rows x 4 column pairs per warp instruction) would hit
  // one bank 8 times with a plain r * K + d; swizzled they take the 2 wavefronts a 64-bit store needs.
  // Rows read along d (I3, the cumsum, the dots, dq / dk) stay conflict-free, and 8-aligned groups
  // of 8 stay contiguous (ld8).
  static __device__ __forceinline__ int xs(int r, int d) { return r * K + (d ^ ((r & 7) << 3)); }
  __device__ __forceinline__ int r0() const { return 16 * rb + g; }  // this thread's rows in a C fragment
  __device__ __forceinline__ int r1() const { return 16 * rb + g + 8; }
  // tf32 A fragments (m16n8k8) of dA1 and dL for the intra products, I1's and the midpoint I3's.
  // Row side: rows r0 / r1 (this thread's C rows), k = columns sa, sa + 4 of dA1 / dL.
  __device__ __forceinline__ void a_row_side(int sa, uint32_t (&a1)[4], uint32_t (&al)[4]) const {
    const float* A1 = sA1();
    const float* L = sDL();
    const int o0 = r0() * S::AF, o1 = r1() * S::AF;
    a1[0] = dev::to_tf32(A1[o0 + sa]); a1[1] = dev::to_tf32(A1[o1 + sa]);
    a1[2] = dev::to_tf32(A1[o0 + sa + 4]); a1[3] = dev::to_tf32(A1[o1 + sa + 4]);
    al[0] = dev::to_tf32(L[o0 + sa]); al[1] = dev::to_tf32(L[o1 + sa]);
    al[2] = dev::to_tf32(L[o0 + sa + 4]); al[3] = dev::to_tf32(L[o1 + sa + 4]);
  }
  // Column side: A[m = s][k = r] = dA1[r][s] and dL[r][s], s = r0 / r1, r = ra, ra + 4 (beta_r goes
  // onto the B operand: the A elements are rounded to tf32 exactly as the row side rounds them).
  // (columns s of block jb: this warp's own rows, or the block it sums for another warp, I1)
  __device__ __forceinline__ void a_col_side(int ra, int jb, uint32_t (&a1)[4], uint32_t (&al)[4]) const {
    const float* A1 = sA1();
    const float* L = sDL();
    const int s0 = 16 * jb + g, s1 = s0 + 8, oa = ra * S::AF, oc = (ra + 4) * S::AF;
    a1[0] = dev::to_tf32(A1[oa + s0]); a1[1] = dev::to_tf32(A1[oa + s1]);
    a1[2] = dev::to_tf32(A1[oc + s0]); a1[3] = dev::to_tf32(A1[oc + s1]);
    al[0] = dev::to_tf32(L[oa + s0]); al[1] = dev::to_tf32(L[oa + s1]);
    al[2] = dev::to_tf32(L[oc + s0]); al[3] = dev::to_tf32(L[oc + s1]);
  }
};

// [16 rows x K/4 columns] per warp in the C layout of m16n8k{16,8}: acc[j][e] is row r0 (e < 2) or
// r1, column cb + 8 j + 2 t + (e & 1).
template <int NTK>
using Tile = float[NTK][4];

// ---------------------------------------------------------------- P
template <typename WT, int K>
__device__ __forceinline__ void grads_load_slice(const GradsCtx<WT, K>& c, int s, int st) {
  using S = GradsSmem<WT, K>;
  constexpr int VSP = S::VSP, NTH = kGradsThreads;
  const KdaBwdParams& p = c.p;
  typename S::VStage& stage = c.vph().stage[st];
  WT* bH = stage.h;
  WT* bDH = stage.dh;
  WT* bDo = &stage.do_[0][0];
  WT* bV = &stage.v[0][0];
  const int64_t sb = (static_cast<int64_t>(c.gchunk) * c.HV + c.hv) * c.V * K;
  const WT* gh = reinterpret_cast<const WT*>(p.h_ckpt) + sb;
  const WT* gdh = reinterpret_cast<const WT*>(p.dh_ckpt) + sb;
  const WT* gdo = reinterpret_cast<const WT*>(p.dout);
  const WT* gv = reinterpret_cast<const WT*>(p.v);
  const int v0 = s * kVS;
  constexpr int VPR = K / 8;
  dev::strided<kVS * VPR, NTH>(c.tid, [&](int i) {
    const int r = i / VPR, c8 = (i % VPR) * 8;
    const int so = dev::sw128_index<kVS>(r, c8);
    dev::cp_async16(bH + so, gh + static_cast<int64_t>(v0 + r) * K + c8, 16);
    dev::cp_async16(bDH + so, gdh + static_cast<int64_t>(v0 + r) * K + c8, 16);
  });
  dev::strided<kChunk * (kVS / 8), NTH>(c.tid, [&](int i) {
    const int r = i / (kVS / 8), c8 = (i % (kVS / 8)) * 8;
    const bool ok = r < c.len;
    const int64_t off = ((c.tok0 + (ok ? r : 0)) * c.HV + c.hv) * c.V + v0 + c8;
    dev::cp_async16(bDo + r * VSP + c8, gdo + off, ok ? 16 : 0);
    dev::cp_async16(bV + r * VSP + c8, gv + off, ok ? 16 : 0);
  });
}

// q, k (head h), w, kg, Aqk, Akk (full rows: the blocks above the diagonal are zeros) -> smem;
// rows past the end zero-filled, sources never read. One commit group.
template <typename WT, int K>
__device__ __forceinline__ void grads_load_chunk(const GradsCtx<WT, K>& c) {
  using S = GradsSmem<WT, K>;
  constexpr int KQ = S::KQ, AP = S::AP, NTH = kGradsThreads;
  const KdaBwdParams& p = c.p;
  const WT* q = reinterpret_cast<const WT*>(p.q);
  const WT* k = reinterpret_cast<const WT*>(p.k);
  const WT* gw = reinterpret_cast<const WT*>(p.w);
  const WT* gkg = reinterpret_cast<const WT*>(p.kg);
  WT* sW = c.vph().w;
  WT* sKg = c.vph().kg;
  constexpr int VPR = K / 8;
  dev::strided<kChunk * VPR, NTH>(c.tid, [&](int i) {
    const int r = i / VPR, c8 = (i % VPR) * 8;
    const bool ok = r < c.len;
    const int rr = ok ? r : 0;
    const int nb = ok ? 16 : 0;
    const int so = dev::sw128_index<kChunk>(r, c8);
    dev::cp_async16(c.sQ() + r * KQ + c8, q + ((c.tok0 + rr) * p.H + c.h) * K + c8, nb);
    dev::cp_async16(c.sK() + r * KQ + c8, k + ((c.tok0 + rr) * p.H + c.h) * K + c8, nb);
    dev::cp_async16(sW + so, gw + ((c.tok0 + rr) * c.HV + c.hv) * K + c8, nb);
    dev::cp_async16(sKg + so, gkg + ((c.tok0 + rr) * c.HV + c.hv) * K + c8, nb);
  });
  const WT* gAqk = reinterpret_cast<const WT*>(p.Aqk);
  const WT* gAkk = reinterpret_cast<const WT*>(p.Akk);
  WT* sAqk = &c.vph().aqk[0][0];
  WT* sAkk = &c.vph().akk[0][0];
  dev::strided<kChunk * 8, NTH>(c.tid, [&](int i) {
    const int r = i / 8, c8 = (i % 8) * 8;
    const bool ok = r < c.len;
    const int64_t off = ((c.tok0 + (ok ? r : 0)) * c.HV + c.hv) * kChunk + c8;
    dev::cp_async16(sAqk + r * AP + c8, gAqk + off, ok ? 16 : 0);
    dev::cp_async16(sAkk + r * AP + c8, gAkk + off, ok ? 16 : 0);
  });
}

// ---------------------------------------------------------------- V
// The low half of dht for value slice s: dhlo[v][k] = dht[v0 + v][k] - dh_ckpt's bf16 copy of it (the
// dh scan stores dh_{last} = dht rounded to nearest, which is what stage.dh holds). Only the last
// chunk of a sequence with dht (the kernel's dht_last) runs it; plain loads (the fp32 source is read
// once).
template <typename WT, int K>
__device__ __forceinline__ void grads_dht_lo(const GradsCtx<WT, K>& c, const float* dht, int s,
                                             const WT* bDH) {
  using S = GradsSmem<WT, K>;
  using E = dev::Elem<WT>;
  WT* lo = c.vph().dhlo;
  const int v0 = s * kVS;
  dev::strided<kVS * K / 2, kGradsThreads>(c.tid, [&](int i) {
    const int r = i / (K / 2), k2 = 2 * (i % (K / 2));
    const float d0 = dht[dev::state_offset<K>(c.p, k2, v0 + r)];
    const float d1 = dht[dev::state_offset<K>(c.p, k2 + 1, v0 + r)];
    const int so = dev::sw128_index<kVS>(r, k2);
    const float2 h = E::to_float2(*reinterpret_cast<const uint32_t*>(bDH + so));
    *reinterpret_cast<uint32_t*>(lo + so) = E::pack2(d0 - h.x, d1 - h.y);
  });
  dev::fence_proxy_async();  // V2's wgmma reads dhlo (async proxy) after the next barrier
}

// sum_v h dh (the decay's gradient) rides on V2's B fragments: warp rb of each column quarter owns
// k-step kv and n-pair np of every slice (two owners per column, one per 16-row half kv of a slice:
// the NPART partial sums). At K = 64 (one n-pair) warps rb >= 2 own none.
template <int K>
__device__ __forceinline__ bool grads_dec_owner(int rb, int& kv, int& np) {
  constexpr int NP = K / 64;  // n-pairs per column quarter (NTK / 2)
  kv = rb / NP;
  np = rb % NP;
  return kv < 2;
}

// The contraction loop: results in the warp's register tiles (dqg, dkg, dw: [16 x K/4]; dAq, dAk:
// [16 x 16] at columns 16 cq) and the thread's share of sum_v h dh (dec2, see grads_dec_owner).
// The K-wide products run on wgmma with their K-wide operands read from shared memory once per
// warpgroup (warpgroup = column quarter cq, its warps the four row blocks): V1 with A (w / kg) and B
// (h / dh) through descriptors, V2 with A (do, v', dv' rows) from registers and B (h / dh) through
// descriptors. The accumulators are in the mma.sync C layout, so the [16 x 16] triangular products
// (Akk v, Aqk^T do, dAq, dAk) stay on mma.sync beside them.
// NV: V1's tile width per warpgroup. 32: warpgroup 0 forms v', warpgroup 1 dv' (w / kg and h / dh
// read once each), warpgroups 2-3 wait; 16: all four warpgroups, each 16 columns of v' or dv' (w /
// kg read twice). Measured on the H200 (2026-12-03, seventeenth session; the two kernels allocate
// registers differently): the unbounded-gate kernel is faster with 32 (prod8192 grads 10.73 against
// 10.98 ms), the bounded-gate kernel with 16 (bounded_b16 7.65 against 7.78).
// kTriShadow: V1's triangular part on mma.sync while its wgmma chain is in flight (over all four
// token blocks, into registers of its own) instead of after the wait.
template <typename WT, int K, bool kLo, int NV, bool kTriShadow>
__device__ __forceinline__ void grads_contract(const GradsCtx<WT, K>& c, const float* dht_last,
                                               float (&dqg)[K / 32][4],
                                               float (&dkg)[K / 32][4], float (&dwc)[K / 32][4], float (&dAq)[2][4],
                                               float (&dAk)[2][4], float (&dec2)[2]) {
  using S = GradsSmem<WT, K>;
  using Ctx = GradsCtx<WT, K>;
  using E = dev::Elem<WT>;
  constexpr int AP = S::AP, VSP = S::VSP;
  constexpr int NQ = K / 4;  // V2's wgmma N: the warpgroup's quarter of the state columns
  const int rb = c.rb, cq = c.cq, g = c.g, t = c.t;
  const WT* sAqk = &c.vph().aqk[0][0];
  const WT* sAkk = &c.vph().akk[0][0];
  const WT* sKg = c.vph().kg;
  const WT* sW = c.vph().w;
  WT* sVN = &c.vph().vn[0][0];
  WT* sDVN = &c.vph().dvn[0][0];
  // V1 roles: warpgroup cq < 2 kVS / NV the [64 x NV] tile (slice columns NV vg) of v' or dv' (warp
  // rb: rows 16 rb)
  static_assert(NV == 16 || NV == 32, "V1's tile width");
  constexpr int kGroupsPerTile = kVS / NV;
  const bool v1_wg = kGroupsPerTile == 2 || cq < 2;  // (cq < 4 always: the compiler cannot know)
  const int vg = cq & (kGroupsPerTile - 1);
  const bool is_dv = (cq / kGroupsPerTile) & 1;
  // sum_v h dh from V2's h / dh B fragments: one (k-step, n-pair) of them per warp (rb), loaded by
  // ldmatrix from the swizzled tiles (the wgmma products read them through descriptors)
  int dec_kv, dec_np;
  const bool dec_owner = grads_dec_owner<K>(rb, dec_kv, dec_np);
  const int nvs = c.V / kVS;
  for (int s = 0; s < nvs; ++s) {
    const int st = s & 1;
    dev::cp_async_wait<0>();
    dev::fence_proxy_async();  // this thread's copies before the wgmma reads (async proxy)
    __syncthreads();  // slice s landed; everyone is done with slice s - 1 (its stage, sVN / sDVN)
    if (s + 1 < nvs) grads_load_slice(c, s + 1, st ^ 1);
    dev::cp_async_commit();
    // (opaque: addresses in this stage are computed here, not hoisted for both stages and kept)
    const typename S::VStage& stage = c.vph().stage[dev::opaque(st)];
    const WT* bH = stage.h;
    const WT* bDH = stage.dh;
    const WT* bDo = &stage.do_[0][0];
    const WT* bV = &stage.v[0][0];
    // kLo: a separate copy of the loop for the last chunk, so the other chunks' registers stay as they were
    if (kLo) grads_dht_lo(c, dht_last, s, bDH);  // read in V2, behind V1's barrier

    // ---- V1: v' = Akk v - w h^T  or  dv' = Aqk^T do + kg dh^T ([64 x NV] per warpgroup)
    // The K-wide part on wgmma (A = kg / w rows [64][K], K-major; B[k][n = v] = dh / h [NV vg + n][k],
    // K-major, rows NV vg .. (128-byte rows)); per-slice k-step 0 descriptors, advanced by k-step
    // (dev::opaque: the A side is the same every slice, and hoisted out of the loop its eight
    // descriptors spilled).
    auto v1_issue = [&](float (&acc)[NV / 8][4], bool dv) {
      const uint64_t da = dev::opaque(dev::sw128_desc_k<kChunk>(dv ? sKg : sW, 0));
      const uint64_t db = dev::sw128_desc_k<kVS>((dv ? bDH : bH) + NV * vg * 64, 0);
      dev::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk)
        dev::wgmma_ss<WT, NV, 0>(acc, dev::sw128_desc_plus(da, dev::sw128_k_bytes<kChunk>(kk)),
                                 dev::sw128_desc_plus(db, dev::sw128_k_bytes<kVS>(kk)), kk > 0);
      dev::wgmma_commit();
    };
    // The triangular part on mma.sync: u = Akk v (Akk[row][token'], nonzero for token' block <= row
    // block) or Aqk^T do (A[m = row][k = token'] = Aqk[token'][row], token' >= row); B[k = token']
    // [n = v] by transposed loads. all = true: every token block (those beyond the triangle are zeros
    // in shared memory), so that no branch separates the MMAs.
    auto v1_tri = [&](float (&acc)[NV / 8][4], bool dv, bool all) {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        if (!all && (dv ? jj < rb : jj > rb)) continue;
        uint32_t a[4];
        if (dv) dev::ldsm_a_t(a, sAqk, AP, 16 * jj, 16 * rb);
        else dev::ldsm_a(a, sAkk, AP, 16 * rb, 16 * jj);
#pragma unroll
        for (int jn = 0; jn < NV / 16; ++jn) {
          uint32_t b[4];
          dev::ldsm_b_t(b, (dv ? bDo : bV), VSP, 16 * jj, NV * vg + 16 * jn);
          dev::mma_16x16<WT>(acc[2 * jn], acc[2 * jn + 1], a, b);
        }
      }
    };
    auto v1_store = [&](const float (&acc)[NV / 8][4], bool dv) {
      WT* out = dv ? sDVN : sVN;
#pragma unroll
      for (int j = 0; j < NV / 8; ++j) {
        const int col = NV * vg + 8 * j + 2 * t;
        const uint32_t h0 = E::pack2(acc[j][0], acc[j][1]), h1 = E::pack2(acc[j][2], acc[j][3]);
        *reinterpret_cast<uint32_t*>(out + (16 * rb + g) * VSP + col) = h0;
        *reinterpret_cast<uint32_t*>(out + (16 * rb + g + 8) * VSP + col) = h1;
        if (kLo && !dv) {  // v' - bf16(v'): exact in fp32, rounded once more to bf16
          const float2 f0 = E::to_float2(h0), f1 = E::to_float2(h1);
          WT* lo = &c.vph().vnlo[0][0];
          *reinterpret_cast<uint32_t*>(lo + (16 * rb + g) * VSP + col) =
              E::pack2(acc[j][0] - f0.x, acc[j][1] - f0.y);
          *reinterpret_cast<uint32_t*>(lo + (16 * rb + g + 8) * VSP + col) =
              E::pack2(acc[j][2] - f1.x, acc[j][3] - f1.y);
        }
      }
    };
    if constexpr (kTriShadow) {
      // The triangular part while the wgmma chain is in flight, into registers of its own: one copy
      // per product (dv a constant), chosen outside the window (a branch inside it makes ptxas wait
      // for the wgmma).
      auto shadowed = [&](auto dv_tag) {
        constexpr bool kDv = decltype(dv_tag)::value;
        float acc[NV / 8][4], tri[NV / 8][4];
#pragma unroll
        for (int j = 0; j < NV / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) tri[j][e] = 0.f;
        v1_issue(acc, kDv);
        v1_tri(tri, kDv, true);
        dev::wgmma_wait<0>();
        dev::fence_regs(acc);
#pragma unroll
        for (int j = 0; j < NV / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] = kDv ? acc[j][e] + tri[j][e] : tri[j][e] - acc[j][e];
        v1_store(acc, kDv);
      };
      if (v1_wg) {
        if (is_dv) shadowed(std::true_type{});
        else shadowed(std::false_type{});
      }
    } else if (v1_wg) {
      float acc[NV / 8][4];
      v1_issue(acc, is_dv);
      dev::wgmma_wait<0>();
      dev::fence_regs(acc);
      if (!is_dv) {
#pragma unroll
        for (int j = 0; j < NV / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] = -acc[j][e];
      }
      v1_tri(acc, is_dv, false);
      v1_store(acc, is_dv);
    }
    __syncthreads();  // sVN / sDVN complete

    // ---- V2: contractions over the slice's 32 value columns (two k-steps of 16). One wgmma window
    // per k-step: the A fragments of both in registers at once spilled (128 registers at 512 threads).
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      uint32_t ado[1][4], avn[1][4], adv[1][4], avl[1][4];
      dev::ldsm_a(ado[0], bDo, VSP, 16 * rb, 16 * kv);
      dev::ldsm_a(avn[0], sVN, VSP, 16 * rb, 16 * kv);
      dev::ldsm_a(adv[0], sDVN, VSP, 16 * rb, 16 * kv);
      if (kLo) dev::ldsm_a(avl[0], &c.vph().vnlo[0][0], VSP, 16 * rb, 16 * kv);
      // The [16 x 16] products and sum_v h dh first: their branches would make ptxas wait for the
      // wgmma products if they sat between the issue and the wait.
      if (dec_owner && kv == dec_kv) {
        // bh / bd [i]: value rows 16 kv + 2t, 2t + 1 (+8 for odd i), state column cb + 16 np + g
        // (+8 for i >= 2): the same places in both, so h * dh is elementwise
        uint32_t bh[4], bd[4];
        dev::ldsm_b_t_sw<kVS>(bh, bH, 16 * kv, c.cb + 16 * dec_np);
        dev::ldsm_b_t_sw<kVS>(bd, bDH, 16 * kv, c.cb + 16 * dec_np);
        auto add_h_dh = [&](const uint32_t (&b)[4]) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 hh = E::to_float2(bh[i]), dd = E::to_float2(b[i]);
            dec2[i >> 1] = fmaf(hh.x, dd.x, fmaf(hh.y, dd.y, dec2[i >> 1]));
          }
        };
        if (kLo) {  // h dht.lo (lo x lo: below either's rounding)
          uint32_t bdl[4];
          dev::ldsm_b_t_sw<kVS>(bdl, c.vph().dhlo, 16 * kv, c.cb + 16 * dec_np);
          add_h_dh(bdl);
        }
        add_h_dh(bd);
      }
      if (cq <= rb) {  // column block above the diagonal: never needed
        // B[k = v][n = token'] = v' / v [token'][v]: rows token' of the slice, non-transposed
        uint32_t bn[4], bv[4];
        dev::ldsm_b(bn, sVN, VSP, 16 * cq, 16 * kv);
        dev::ldsm_b(bv, bV, VSP, 16 * cq, 16 * kv);
        dev::mma_16x16<WT>(dAq[0], dAq[1], ado[0], bn);
        dev::mma_16x16<WT>(dAk[0], dAk[1], adv[0], bv);
        if (kLo) {  // dAqk += do v'.lo^T
          uint32_t bnl[4];
          dev::ldsm_b(bnl, &c.vph().vnlo[0][0], VSP, 16 * cq, 16 * kv);
          dev::mma_16x16<WT>(dAq[0], dAq[1], ado[0], bnl);
        }
      }
      // dqg += do h, dkg += v' dh, dw += dv' h over the warpgroup's NQ state columns: B[k = v][n =
      // state column] = h / dh [v][cb + n], MN-major
      const uint64_t dH = dev::sw128_desc_mn<kVS>(bH, 16 * kv, c.cb);
      const uint64_t dDH = dev::sw128_desc_mn<kVS>(bDH, 16 * kv, c.cb);
      dev::fence_regs(dqg);
      dev::fence_regs(dkg);
      dev::fence_regs(dwc);
      dev::fence_regs(ado);
      dev::fence_regs(avn);
      dev::fence_regs(adv);
      if (kLo) dev::fence_regs(avl);
      dev::wgmma_fence();
      dev::wgmma_rs<WT, NQ, 1>(dqg, ado[0], dH, true);
      dev::wgmma_rs<WT, NQ, 1>(dkg, avn[0], dDH, true);
      if (kLo) {  // dkg += v'.lo dh + v' dht.lo
        dev::wgmma_rs<WT, NQ, 1>(dkg, avl[0], dDH, true);
        dev::wgmma_rs<WT, NQ, 1>(dkg, avn[0], dev::sw128_desc_mn<kVS>(c.vph().dhlo, 16 * kv, c.cb), true);
      }
      dev::wgmma_rs<WT, NQ, 1>(dwc, adv[0], dH, true);
      dev::wgmma_commit();
      dev::wgmma_wait<0>();  // (also: before the next slice's barrier, whose copies overwrite this stage)
      dev::fence_regs(dqg);
      dev::fence_regs(dkg);
      dev::fence_regs(dwc);
    }
  }
  dev::cp_async_wait<0>();
}

// ---------------------------------------------------------------- E
// The WY backward. In: the V loop's tiles. Out: dq^ (in dqg), dkB = exp2(G - g2) dkg (in dkg),
// dkA = exp2(g2) Akk^T dw, dA1 and dL in smem, dbeta's column side in sDbc, dG's kg dkg part in sDGp.
template <typename WT, int K>
__device__ __forceinline__ void grads_wy(const GradsCtx<WT, K>& c, float (&dqg)[K / 32][4], float (&dkg)[K / 32][4],
                                         float (&dwc)[K / 32][4], float (&dAq)[2][4], float (&dAk)[2][4],
                                         float (&dkA)[K / 32][4], float (&dec2)[2]) {
  using S = GradsSmem<WT, K>;
  using Ctx = GradsCtx<WT, K>;
  using E = dev::Elem<WT>;
  constexpr int KQ = S::KQ, AP = S::AP, AF = S::AF, NTK = Ctx::NTK, NTH = kGradsThreads;
  const KdaBwdParams& p = c.p;
  const int rb = c.rb, cq = c.cq, g = c.g, t = c.t, cb = c.cb, tid = c.tid;
  const int r0 = c.r0(), r1 = c.r1();
  WT* sM = &c.eph().m[0][0];
  WT* sAkk = &c.vph().akk[0][0];
  WT* sDW = &c.eph().dw[0][0];
  WT* sKexp = &c.eph().kexp[0][0];
  float* sDAkk = &c.eph().dakk[0][0];
  WT* sDM = &c.eph().dm[0][0];
  WT* sZ = &c.eph().z[0][0];
  float* sA1 = c.sA1();
  float* sDL = c.sDL();
  float* sDec = &c.st->dec[0][0];
  float* sDGp = &c.st->dgp[0][0];
  float* sDbc = &c.st->dbc[0][0];
  {
    const WT* gM = reinterpret_cast<const WT*>(p.M);
    dev::strided<kChunk * 8, NTH>(tid, [&](int i) {
      const int r = i / 8, c8 = (i % 8) * 8;
      const bool ok = r < c.len;
      dev::cp_async16(sM + r * AP + c8, gM + ((c.tok0 + (ok ? r : 0)) * c.HV + c.hv) * kChunk + c8, ok ? 16 : 0);
    });
    dev::cp_async_commit();
  }
  {  // the owners' sums of h dh over their lanes t (the value rows), then per column and half kv
    int kv, np;
    if (grads_dec_owner<K>(rb, kv, np)) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        dec2[i] += __shfl_xor_sync(0xffffffffu, dec2[i], 1);
        dec2[i] += __shfl_xor_sync(0xffffffffu, dec2[i], 2);
      }
      if (t == 0) {
        sDec[kv * K + cb + 16 * np + g] = dec2[0];
        sDec[kv * K + cb + 16 * np + 8 + g] = dec2[1];
      }
    }
  }
  const float scale = p.opt.scale;
  // dA1 = scale dAqk (i >= j, 0 above), dAkk (the V part; blocks above the diagonal 0)
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int col = 16 * cq + 8 * j + 2 * t;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e < 2 ? r0 : r1, s = col + (e & 1);
      const bool lower = cq <= rb;  // tile computed
      sA1[r * AF + s] = (lower && s <= r) ? scale * dAq[j][e] : 0.f;
      sDAkk[r * AF + s] = lower ? dAk[j][e] : 0.f;
    }
  }
  // dw = -(dv' h^T) -> bf16 operand; kexp = k^ exp2(g2) -> bf16 operand; dq^ = scale exp2(g2) dqg and
  // dkB = exp2(G - g2) dkg in place; sum_r kg dkg per column (the decay gradient's second part)
#pragma unroll
  for (int j = 0; j < NTK; ++j) {
    const int col = cb + 8 * j + 2 * t;
    float e2[4], eG[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e < 2 ? r0 : r1, d = col + (e & 1);
      e2[e] = c.e_g2(r, d);
      eG[e] = c.e_Gg2(r, d);
    }
    *reinterpret_cast<uint32_t*>(sDW + r0 * KQ + col) = E::pack2(-dwc[j][0], -dwc[j][1]);
    *reinterpret_cast<uint32_t*>(sDW + r1 * KQ + col) = E::pack2(-dwc[j][2], -dwc[j][3]);
    *reinterpret_cast<uint32_t*>(sKexp + r0 * KQ + col) =
        E::pack2(c.khat(r0, col) * e2[0], c.khat(r0, col + 1) * e2[1]);
    *reinterpret_cast<uint32_t*>(sKexp + r1 * KQ + col) =
        E::pack2(c.khat(r1, col) * e2[2], c.khat(r1, col + 1) * e2[3]);
    float cs[2];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dqg[j][e] *= scale * e2[e];
      dkg[j][e] *= eG[e];
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) cs[e] = c.khat(r0, col + e) * dkg[j][e] + c.khat(r1, col + e) * dkg[j][2 + e];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) cs[e] += __shfl_xor_sync(0xffffffffu, cs[e], o);
    }
    if (g == 0) {
      sDGp[rb * K + col] = cs[0];
      sDGp[rb * K + col + 1] = cs[1];
    }
  }
  dev::cp_async_wait<0>();
  __syncthreads();

  // ---- E1: dAkk += dw kexp^T (one [16 x 16] tile (tr, tc), tc <= tr, per warp that has one); dkA =
  // exp2(g2) (Akk^T dw) ([16 x K/4]: warp rb sums 4 - rb row blocks, so rb = 0 has 4x rb = 3's work).
  // The 10 dAkk tiles are in smem, so any warp can take any: with bit 2 of p.balance they go to the
  // warps of row blocks 3 and 2 and to two of row block 1 (the least dkA work), not to warp (rb, cq)
  // for tile (rb, cq), which gave warp (0, 0) the most of both (E1's longest path ~60 -> ~53 units).
  int tr = rb, tc = cq;
  bool has_tile = cq <= rb;
  if (p.balance & 2) {
    // warps (3, x) -> tiles 0..3, (2, x) -> 4..7, (1, 0), (1, 1) -> 8, 9; tiles in row-major order
    // of the lower triangle: (0,0) (1,0) (1,1) (2,0) (2,1) (2,2) (3,0) (3,1) (3,2) (3,3)
    const int slot = rb == 3 ? cq : (rb == 2 ? 4 + cq : (rb == 1 && cq < 2 ? 8 + cq : -1));
    has_tile = slot >= 0;
    tr = slot < 1 ? 0 : (slot < 3 ? 1 : (slot < 6 ? 2 : 3));
    tc = slot - tr * (tr + 1) / 2;
  }
  if (has_tile) {
    const int tr0 = 16 * tr + g, tr1 = tr0 + 8;  // this thread's rows of the tile
    float acc[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = 16 * tc + 8 * j + 2 * t;
      acc[j][0] = sDAkk[tr0 * AF + col];
      acc[j][1] = sDAkk[tr0 * AF + col + 1];
      acc[j][2] = sDAkk[tr1 * AF + col];
      acc[j][3] = sDAkk[tr1 * AF + col + 1];
    }
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t a[4], b[4];
      dev::ldsm_a(a, sDW, KQ, 16 * tr, 16 * kk);
      // B[k][n = token'] = kexp[token'][k]: rows token', non-transposed
      dev::ldsm_b(b, sKexp, KQ, 16 * tc, 16 * kk);
      dev::mma_16x16<WT>(acc[0], acc[1], a, b);
    }
    // every (row, column) of dAkk is owned by exactly one thread: write back in place
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = 16 * tc + 8 * j + 2 * t;
      sDAkk[tr0 * AF + col] = acc[j][0];
      sDAkk[tr0 * AF + col + 1] = acc[j][1];
      sDAkk[tr1 * AF + col] = acc[j][2];
      sDAkk[tr1 * AF + col + 1] = acc[j][3];
    }
  }
#pragma unroll
  for (int j = 0; j < NTK; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dkA[j][e] = 0.f;
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    if (jj < rb) continue;  // Akk^T[row][token'] = Akk[token'][row], token' >= row
    uint32_t a[4];
    dev::ldsm_a_t(a, sAkk, AP, 16 * jj, 16 * rb);
#pragma unroll
    for (int np = 0; np < NTK / 2; ++np) {
      // B[k = token'][n = column] = dw[token'][column]: transposed loads
      uint32_t b[4];
      dev::ldsm_b_t(b, sDW, KQ, 16 * jj, cb + 16 * np);
      dev::mma_16x16<WT>(dkA[2 * np], dkA[2 * np + 1], a, b);
    }
  }
#pragma unroll
  for (int j = 0; j < NTK; ++j) {
    const int col = cb + 8 * j + 2 * t;
#pragma unroll
    for (int e = 0; e < 4; ++e) dkA[j][e] *= c.e_g2(e < 2 ? r0 : r1, col + (e & 1));
  }
  __syncthreads();

  // ---- E2: dbeta_j = sum_i dAkk_ij M_ij (i >= j; 8 row groups, summed in order below);
  // dM = dAkk diag(beta) -> bf16
  {
    const int j = tid & 63, part = tid >> 6;  // 8 parts of 8 rows
    float acc = 0.f;
#pragma unroll
    for (int ii = 0; ii < 8; ++ii) {
      const int i = 8 * part + ii;
      if (i >= j) acc = fmaf(sDAkk[i * AF + j], E::to_float(sM[i * AP + j]), acc);
    }
    sDbc[part * kChunk + j] = acc;
  }
  dev::strided<kChunk * 32, NTH>(tid, [&](int i) {
    const int r = i / 32, s2 = (i % 32) * 2;
    *reinterpret_cast<uint32_t*>(sDM + r * AP + s2) =
        E::pack2(sDAkk[r * AF + s2] * c.sBeta()[s2], sDAkk[r * AF + s2 + 1] * c.sBeta()[s2 + 1]);
  });
  __syncthreads();

  // ---- E3: Z = dM M^T ([16 x 16] per warp): B[k = b][n = j] = M[j][b], rows j non-transposed
  {
    float acc[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t a[4], b[4];
      dev::ldsm_a(a, sDM, AP, 16 * rb, 16 * kk);
      dev::ldsm_b(b, sM, AP, 16 * cq, 16 * kk);
      dev::mma_16x16<WT>(acc[0], acc[1], a, b);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = 16 * cq + 8 * j + 2 * t;
      *reinterpret_cast<uint32_t*>(sZ + r0 * AP + col) = E::pack2(acc[j][0], acc[j][1]);
      *reinterpret_cast<uint32_t*>(sZ + r1 * AP + col) = E::pack2(acc[j][2], acc[j][3]);
    }
  }
  __syncthreads();

  // ---- E4: dL = -(M^T Z), strictly lower: A[m = i][k = a] = M[a][i] (a >= i), B = Z [a][j]
  {
    float acc[2][4] = {};
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      if (jj < rb) continue;
      uint32_t a[4], b[4];
      dev::ldsm_a_t(a, sM, AP, 16 * jj, 16 * rb);
      dev::ldsm_b_t(b, sZ, AP, 16 * jj, 16 * cq);
      dev::mma_16x16<WT>(acc[0], acc[1], a, b);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = 16 * cq + 8 * j + 2 * t;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e < 2 ? r0 : r1, s = col + (e & 1);
        sDL[r * AF + s] = s < r ? -acc[j][e] : 0.f;
      }
    }
  }
  __syncthreads();
  if (p.dbg_dA) {  // stage dumps for the tests (rows of the chunk that exist)
    for (int i = tid; i < c.len * kChunk; i += NTH) {
      const int r = i / kChunk, s = i % kChunk;
      const int64_t off = ((c.tok0 + r) * c.HV + c.hv) * kChunk + s;
      p.dbg_dA[off] = sA1[r * AF + s];
      p.dbg_dL[off] = sDL[r * AF + s];
    }
  }
}

// ---------------------------------------------------------------- I1: below the diagonal blocks
// Row side, blocks bj < rb, through f = 16 rb: rowQ = exp2(g_r - g_f) sum_s dA1[r][s] (k^_s exp2(g_f - g_s)),
// rowK the same with dL; g_f - g_s = (T_bj - loc_s) + sum_{bj < m < rb} T_m + loc_f (all <= 0).
// Column side, blocks bi > rb, through e = 16 rb + 15: colS = exp2(g_e - g_s) sum_r
// (dA1[r][s] q^_r + beta_r dL[r][s] k^_r) exp2(g_r - g_e); g_r - g_e = loc_r + sum_{rb < m < bi} T_m.
// THE CANCELLATION: each pair's product P_rs enters dg at row r (+, row side) and at row s (-, column
// side), and the reverse cumsum leaves only the pairs that cross a row, so the two must be the same
// number. The sides factor P_rs through different anchors (f, e), so a tf32 rounding of their B
// operands (2^-11 each, independent) would leave a residue ~2^-11 |P_rs| per pair, summed by the
// cumsum over the chunk and by dA_log / ddt_bias over all tokens (ddt_bias lost 10x its accuracy,
// docs/notes/2026-12-02-gate-gradients.md). So B is carried as tf32 hi + lo (dev::split_tf32, two
// mma): products good to ~2^-21; the A elements (dA1, dL; beta on the column side's B) are rounded
// once, identically on both sides.
template <typename WT, int K>
__device__ __forceinline__ void grads_offdiag(const GradsCtx<WT, K>& c, float (&dqh)[K / 32][4],
                                              float (&dkA)[K / 32][4], float (&dkB)[K / 32][4], float (&rowsumK)[2]) {
  using S = GradsSmem<WT, K>;
  using Ctx = GradsCtx<WT, K>;
  constexpr int KP = S::KP, NTK = Ctx::NTK;
  const int rb = c.rb, g = c.g, t = c.t, cb = c.cb;
  const int r0 = c.r0(), r1 = c.r1();
  const float* sG = c.sG();
  const float* sBT = c.sBT();
  const float* sBeta = c.sBeta();
  if (rb > 0) {
    float rq[NTK][4], rk[NTK][4];
#pragma unroll
    for (int j = 0; j < NTK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) rq[j][e] = rk[j][e] = 0.f;
    const int f = 16 * rb;
    float mid[NTK];  // loc_f + the totals of the blocks strictly between bj and rb (grows as bj falls)
#pragma unroll
    for (int j = 0; j < NTK; ++j) mid[j] = sG[f * KP + cb + 8 * j + g];
    for (int bj = rb - 1; bj >= 0; --bj) {
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const int sa = 16 * bj + 8 * ks + t, sb = sa + 4;
        uint32_t a1[4], al[4];
        c.a_row_side(sa, a1, al);
#pragma unroll
        for (int j = 0; j < NTK; ++j) {
          const int d = cb + 8 * j + g;
          const float tb = sBT[bj * K + d];
          const dev::Tf32Pair b0 = dev::split_tf32(c.khat(sa, d) * dev::fast_exp2((tb - sG[sa * KP + d]) + mid[j]));
          const dev::Tf32Pair b1 = dev::split_tf32(c.khat(sb, d) * dev::fast_exp2((tb - sG[sb * KP + d]) + mid[j]));
          dev::mma_1688_tf32_x2(rq[j], a1, b0, b1);
          dev::mma_1688_tf32_x2(rk[j], al, b0, b1);
        }
      }
#pragma unroll
      for (int j = 0; j < NTK; ++j) mid[j] += sBT[bj * K + cb + 8 * j + g];
    }
#pragma unroll
    for (int j = 0; j < NTK; ++j) {
      const int col = cb + 8 * j + 2 * t;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e < 2 ? r0 : r1, d = col + (e & 1);
        const float fa = dev::fast_exp2(sG[r * KP + d] - sG[f * KP + d]);
        const float vq = rq[j][e] * fa, vk = rk[j][e] * fa;
        dqh[j][e] += vq;
        dkA[j][e] += sBeta[r] * vk;
        rowsumK[e >> 1] += c.khat(r, d) * vk;
      }
    }
  }
  KF_GRADS_PHASE(4);
  // The column side, balanced over the row-block warps: a column pair costs twice a row pair (two B
  // operands, each split), so the plain assignment (warp rb: its rb row pairs and 3 - rb column
  // pairs) gave warp 0 six units of work and warp 3 three, and the barrier after I1 waits for warp 0
  // (9.4k of 59k cycles per CTA at bounded_b16, 2026-12-02). Here warp 3 takes the pair of row block
  // 3 with the rows of block 0 (max 5 units): it leaves that C fragment in colpart, and warp 0
  // adds it (grads_offdiag_take) after the barrier.
  // (Without bit 1 of p.balance, for A/B timing: the plain assignment, warp 3 idle here.)
  const bool bal = (c.p.balance & 1) != 0;          // kernel-uniform
  const int jb = rb < 3 ? rb : 0;                   // the block whose rows (columns s) this warp sums
  const int bi0 = rb < 3 ? rb + 1 : (bal ? 3 : 4);  // its first row block i > jb
  const int bi1 = rb == 0 && bal ? 3 : 4;           // one past its last (warp 0 leaves block 3 to warp 3)
  {
    float cs[NTK][4];
#pragma unroll
    for (int j = 0; j < NTK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) cs[j][e] = 0.f;
    float mid[NTK];  // the totals of the blocks strictly between jb and bi (grows as bi rises)
#pragma unroll
    for (int j = 0; j < NTK; ++j)  // warp 3 starts at bi = 3: T_1 + T_2, the bits warp 0 reached there
      mid[j] = rb == 3 ? sBT[K + cb + 8 * j + g] + sBT[2 * K + cb + 8 * j + g] : 0.f;
    for (int bi = bi0; bi < bi1; ++bi) {
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const int ra = 16 * bi + 8 * ks + t, rc = ra + 4;
        uint32_t a1[4], al[4];  // A[m = s][k = r] = dA1[r][s] / beta_r dL[r][s]
        c.a_col_side(ra, jb, a1, al);
#pragma unroll
        for (int j = 0; j < NTK; ++j) {
          const int d = cb + 8 * j + g;
          const float ea = dev::fast_exp2(sG[ra * KP + d] + mid[j]), ec = dev::fast_exp2(sG[rc * KP + d] + mid[j]);
          dev::mma_1688_tf32_x2(cs[j], a1, dev::split_tf32(c.qhat(ra, d) * ea), dev::split_tf32(c.qhat(rc, d) * ec));
          dev::mma_1688_tf32_x2(cs[j], al, dev::split_tf32(sBeta[ra] * c.khat(ra, d) * ea),
                                dev::split_tf32(sBeta[rc] * c.khat(rc, d) * ec));
        }
      }
#pragma unroll
      for (int j = 0; j < NTK; ++j) mid[j] += sBT[bi * K + cb + 8 * j + g];
    }
#pragma unroll
    for (int j = 0; j < NTK; ++j) {
      const int col = cb + 8 * j + 2 * t;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int s = 16 * jb + g + 8 * (e >> 1), d = col + (e & 1);
        cs[j][e] *= dev::fast_exp2(sBT[jb * K + d] - sG[s * KP + d]);
      }
    }
    if (rb < 3) {
#pragma unroll
      for (int j = 0; j < NTK; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dkB[j][e] += cs[j][e];
    } else if (bal) {
      float4* part = reinterpret_cast<float4*>(c.st->colpart[c.cq][c.lane]);
#pragma unroll
      for (int j = 0; j < NTK; ++j) part[j] = make_float4(cs[j][0], cs[j][1], cs[j][2], cs[j][3]);
    }
  }
}

// After the barrier that follows I1: the row-block-0 warps add the column-side fragment the
// row-block-3 warps left for them (grads_offdiag's balance).
template <typename WT, int K>
__device__ __forceinline__ void grads_offdiag_take(const GradsCtx<WT, K>& c, float (&dkB)[K / 32][4]) {
  if (c.rb != 0 || !(c.p.balance & 1)) return;
  const float4* part = reinterpret_cast<const float4*>(c.st->colpart[c.cq][c.lane]);
#pragma unroll
  for (int j = 0; j < K / 32; ++j) {
    const float4 v = part[j];
    dkB[j][0] += v.x;
    dkB[j][1] += v.y;
    dkB[j][2] += v.z;
    dkB[j][3] += v.w;
  }
}

// ---------------------------------------------------------------- I3 on tensor cores (bounded gates)
// With dev::block_midpoint_ok (lower_bound >= -5: every factor below is within 2^+-57.7), the 16 x 16
// diagonal blocks on tf32 tensor cores like I1's, through the block's row m = 16 rb + 8:
//   rowQ_r = exp2(g_r - g_m) sum_{s <= r} dA1[r][s] (k^_s exp2(g_m - g_s))   (rowK: dL, s < r)
//   colS_s = exp2(g_m - g_s) sum_{r >= s} (dA1[r][s] q^_r + beta_r dL[r][s] k^_r) exp2(g_r - g_m)
// dA1 and dL hold zeros above their diagonals (E), so the blocks need no mask; every exponent is a
// difference of block-local cumsums of one block. Runs after I2 has stored dq^ / dk^ / dg^ to the X
// arrays and adds into them at the C-fragment places this thread stored (no barrier, and dq^ / dkA /
// dkB are dead: holding them beside these accumulators spilled ~200 bytes at K = 128). The row side
// of dbeta goes to rowsumK, as I1's does; the SIMT I3 then does not run.
template <typename WT, int K>
__device__ __forceinline__ void grads_diag_mid(const GradsCtx<WT, K>& c, float (&rowsumK)[2]) {
  using S = GradsSmem<WT, K>;
  using Ctx = GradsCtx<WT, K>;
  constexpr int KP = S::KP, NTK = Ctx::NTK;
  const int rb = c.rb, g = c.g, t = c.t, cb = c.cb;
  const int r0 = c.r0(), r1 = c.r1(), m = 16 * rb + 8;
  const float* sG = c.sG();
  const float* sBeta = c.sBeta();
  float* Xq = &c.iph().xq[0][0];
  float* Xk = &c.iph().xk[0][0];
  float* Xg = &c.iph().xg[0][0];
  float lm[NTK];  // g_m (block-local) at this lane's B columns d = cb + 8 j + g
#pragma unroll
  for (int j = 0; j < NTK; ++j) lm[j] = sG[m * KP + cb + 8 * j + g];
  float rq[NTK][4], rk[NTK][4], cs[NTK][4];
#pragma unroll
  for (int j = 0; j < NTK; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) rq[j][e] = rk[j][e] = cs[j][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    {  // row side: A = dA1 / dL rows r0, r1 at columns s
      const int sa = 16 * rb + 8 * ks + t, sb = sa + 4;
      uint32_t a1[4], al[4];
      c.a_row_side(sa, a1, al);
#pragma unroll
      for (int j = 0; j < NTK; ++j) {
        const int d = cb + 8 * j + g;
        const uint32_t b0 = dev::to_tf32(c.khat(sa, d) * dev::fast_exp2(lm[j] - sG[sa * KP + d]));
        const uint32_t b1 = dev::to_tf32(c.khat(sb, d) * dev::fast_exp2(lm[j] - sG[sb * KP + d]));
        dev::mma_1688_tf32(rq[j], a1, b0, b1);
        dev::mma_1688_tf32(rk[j], al, b0, b1);
      }
    }
    {  // column side: A[row = s][k = r] = dA1[r][s] / beta_r dL[r][s]
      const int ra = 16 * rb + 8 * ks + t, rc = ra + 4;
      uint32_t a1[4], al[4];
      c.a_col_side(ra, c.rb, a1, al);
#pragma unroll
      for (int j = 0; j < NTK; ++j) {
        const int d = cb + 8 * j + g;
        const float ea = dev::fast_exp2(sG[ra * KP + d] - lm[j]), ec = dev::fast_exp2(sG[rc * KP + d] - lm[j]);
        dev::mma_1688_tf32(cs[j], a1, dev::to_tf32(c.qhat(ra, d) * ea), dev::to_tf32(c.qhat(rc, d) * ec));
        dev::mma_1688_tf32(cs[j], al, dev::to_tf32(sBeta[ra] * c.khat(ra, d) * ea),
                           dev::to_tf32(sBeta[rc] * c.khat(rc, d) * ec));
      }
    }
  }
  // into X at this thread's C-fragment places: X_q += rowQ, X_k += beta rowK + colS,
  // X_g += q^ rowQ + k^ (beta rowK - colS) (I2's dg^ = q^ dq^ + k^ (dkA - dkB))
#pragma unroll
  for (int j = 0; j < NTK; ++j) {
    const int col = cb + 8 * j + 2 * t;
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int r = h2 ? r1 : r0, x = Ctx::xs(r, col);
      const float br = sBeta[r];
      float2 xq = *reinterpret_cast<float2*>(Xq + x), xk = *reinterpret_cast<float2*>(Xk + x);
      float2 xg = *reinterpret_cast<float2*>(Xg + x);
      float vq[2], vk[2], vs[2];
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        const int e = 2 * h2 + e1, d = col + e1;
        const float fa = dev::fast_exp2(sG[r * KP + d] - sG[m * KP + d]);
        const float es = dev::fast_exp2(sG[m * KP + d] - sG[r * KP + d]);
        vq[e1] = rq[j][e] * fa;
        vk[e1] = rk[j][e] * fa;
        vs[e1] = cs[j][e] * es;
        const float qh = c.qhat(r, d), kh = c.khat(r, d);
        rowsumK[h2] += kh * vk[e1];
        // dg: each side's sums times the other side's tf32-rounded operands (Y_r, W_r: the column
        // side's B; X_r: the row side's B). Both sides go through the one anchor m here, so a pair's
        // two products are then the same number up to fp32 summation order and cancel in the reverse
        // cumsum (I1's two anchors need the hi / lo split instead; this costs no extra mma)
        const float y = dev::tf32_value(qh * fa), w = dev::tf32_value(br * kh * fa);
        const float xv = dev::tf32_value(kh * es);
        (e1 ? xg.y : xg.x) += y * rq[j][e] + w * rk[j][e] - xv * cs[j][e];
      }
      xq.x += vq[0];
      xq.y += vq[1];
      xk.x += br * vk[0] + vs[0];
      xk.y += br * vk[1] + vs[1];
      *reinterpret_cast<float2*>(Xq + x) = xq;
      *reinterpret_cast<float2*>(Xk + x) = xk;
      *reinterpret_cast<float2*>(Xg + x) = xg;
    }
  }
}

// ---------------------------------------------------------------- I2 + I3: the diagonal blocks
// The C-layout results -> smem (X_q = dq^, X_k = dk^ = dkA + dkB, X_g = dg^ so far = q^ dq^ +
// k^ (dkA - dkB)), then the 16 x 16 diagonal blocks: on tensor cores through the block midpoint when
// the gate is bounded (grads_diag_mid, kMid), else in SIMT, one thread per (column d, block): the
// block's 16 rows of g2 / q^ / k^ at column d in registers, every pair (i >= j) once, e_ij a
// telescoping product of the per-row factors exp2(g2_i - g2_{i-1}) <= 1 (nothing inside a diagonal
// block is factorised through another row), shared by the row side (dq^, dk^ rows) and the column
// side (dk^ columns, dg^); the pair i = j goes to dq^ / dk^ only (its two dg products cancel exactly):
//   rowQ_i = sum_{j <= i} dA1_ij k^_j e_ij,  rowK_i = sum_{j < i} dL_ij k^_j e_ij,
//   colS_j = sum_{i >= j} (dA1_ij q^_i + beta_i dL_ij k^_i) e_ij,  e_ij = exp2(g2_i - g2_j).
// dA1 / dL reads are warp-uniform (broadcast); the row side of dbeta is summed over d by shuffles.
template <typename WT, int K, bool kMid>
__device__ __forceinline__ void grads_diag(const GradsCtx<WT, K>& c, float (&dqh)[K / 32][4], float (&dkA)[K / 32][4],
                                           float (&dkB)[K / 32][4], float (&rowsumK)[2]) {
  using S = GradsSmem<WT, K>;
  using Ctx = GradsCtx<WT, K>;
  constexpr int KP = S::KP, AF = S::AF, NTK = Ctx::NTK;
  const int t = c.t, cb = c.cb, tid = c.tid, lane = c.lane, warp = c.warp;
  const int r0 = c.r0(), r1 = c.r1();
  float* Xq = &c.iph().xq[0][0];
  float* Xk = &c.iph().xk[0][0];
  float* Xg = &c.iph().xg[0][0];
  float* sRowA = &c.st->rowa[0][0];
  float* sRowD = &c.st->u.ei.rowd[0][0];
#pragma unroll
  for (int j = 0; j < NTK; ++j) {
    const int col = cb + 8 * j + 2 * t;
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {  // (e = 2 h2, 2 h2 + 1): row r0 / r1, columns col, col + 1
      const int r = h2 ? r1 : r0, x = Ctx::xs(r, col);
      float xg[2];
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        const int e = 2 * h2 + e1;
        xg[e1] = c.qhat(r, col + e1) * dqh[j][e] + c.khat(r, col + e1) * (dkA[j][e] - dkB[j][e]);
      }
      *reinterpret_cast<float2*>(Xq + x) = make_float2(dqh[j][2 * h2], dqh[j][2 * h2 + 1]);
      *reinterpret_cast<float2*>(Xk + x) =
          make_float2(dkA[j][2 * h2] + dkB[j][2 * h2], dkA[j][2 * h2 + 1] + dkB[j][2 * h2 + 1]);
      *reinterpret_cast<float2*>(Xg + x) = make_float2(xg[0], xg[1]);
    }
  }
  if constexpr (kMid) grads_diag_mid(c, rowsumK);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    rowsumK[hf] += __shfl_xor_sync(0xffffffffu, rowsumK[hf], 1);
    rowsumK[hf] += __shfl_xor_sync(0xffffffffu, rowsumK[hf], 2);
  }
  if (t == 0) {
    sRowA[c.cq * kChunk + r0] = rowsumK[0];
    sRowA[c.cq * kChunk + r1] = rowsumK[1];
  }
  if constexpr (kMid) {  // grads_diag_mid did the diagonal blocks: no diagonal row sums of dbeta here
    if (tid < 16 * 16) sRowD[tid] = 0.f;
    return;
  }
  __syncthreads();
  if (tid < 4 * K) {  // K = 64: half the threads idle here
    const int d = tid % K, blk = tid / K, o = 16 * blk;
    const float* sG = c.sG();
    const float* sA1 = c.sA1();
    const float* sDL = c.sDL();
    const float* sBeta = c.sBeta();
    // (q^ is read per row i, not held: fewer registers at 128 per thread)
    float gl[16], kv[16], rq[16], rk[16], cs[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      gl[i] = sG[(o + i) * KP + d];
      kv[i] = c.khat(o + i, d);
      rq[i] = rk[i] = cs[i] = 0.f;
    }
    // e_ij = exp2(g2_i - g2_j) by telescoping products along i: e_ij = e_{i-1,j} a_i with
    // a_i = exp2(g2_i - g2_{i-1}) <= 1 (one exp2 per row instead of one per pair; every factor <= 1,
    // as in the forward intra's diagonal tiles, so products only shrink and underflow to 0 is exact)
    float ecol[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float qi = c.qhat(o + i, d), bki = sBeta[o + i] * kv[i];
      const float ai = i > 0 ? dev::fast_exp2(gl[i] - gl[i > 0 ? i - 1 : 0]) : 1.f;
#pragma unroll
      for (int j = 0; j < i; ++j) ecol[j] *= ai;
      ecol[i] = 1.f;
      // row i of the block's dA1 / dL in 16-byte (warp-uniform, broadcast) loads
      float a1r[16], dlr[16];
#pragma unroll
      for (int j4 = 0; j4 <= i / 4; ++j4) {
        const float4 x = *reinterpret_cast<const float4*>(sA1 + (o + i) * AF + o + 4 * j4);
        const float4 y = *reinterpret_cast<const float4*>(sDL + (o + i) * AF + o + 4 * j4);
        a1r[4 * j4] = x.x; a1r[4 * j4 + 1] = x.y; a1r[4 * j4 + 2] = x.z; a1r[4 * j4 + 3] = x.w;
        dlr[4 * j4] = y.x; dlr[4 * j4 + 1] = y.y; dlr[4 * j4 + 2] = y.z; dlr[4 * j4 + 3] = y.w;
      }
#pragma unroll
      for (int j = 0; j < i; ++j) {  // the diagonal pair j = i is added below, to dq^ / dk^ only
        const float e = ecol[j];
        const float a1 = a1r[j], dl = dlr[j];
        const float ek = kv[j] * e;
        rq[i] = fmaf(a1, ek, rq[i]);
        rk[i] = fmaf(dl, ek, rk[i]);
        cs[j] = fmaf(fmaf(a1, qi, dl * bki), e, cs[j]);
      }
    }
    float rs[8];  // the row side of dbeta of 8 rows, summed over the warp's 32 columns below
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float bi = sBeta[o + i], qh = c.qhat(o + i, d);
      const float a1d = sA1[(o + i) * AF + o + i];  // dA1_ii (dL_ii = 0, e_ii = 1)
      const int x = Ctx::xs(o + i, d);
      Xq[x] += fmaf(a1d, kv[i], rq[i]);
      Xk[x] += bi * rk[i] + fmaf(a1d, qh, cs[i]);
      // dg^ without the diagonal pair: its row-side and column-side products are the same number
      // (dA1_ii q^_i k^_i) and cancel exactly; formed on each side they would leave a rounding residue
      // where the true dg is 0 (a lone token without an initial state).
      Xg[x] += qh * rq[i] + kv[i] * (bi * rk[i] - cs[i]);
      rs[i & 7] = kv[i] * rk[i];
      if ((i & 7) == 7) {  // 8 rows' sums over the warp in one reduce-scatter: 9 shuffles, not 40
        const float r = dev::warp_sum_scatter<8>(rs, lane);
        if ((lane & 3) == 0) sRowD[warp * 16 + (i & 8) + ((lane >> 2) & 7)] = r;
      }
    }
  }
}

// ---------------------------------------------------------------- F
// F's last steps for row r, lane s (8 lanes per row, 4 columns each per 32). grads_load_x: this
// head's dq^ / dk^ of the columns 4 s + 32 m from X (Xq, Xk in shared memory). grads_hat_dot: the
// normalised q^ / k^ of those columns (qh, kh) and their dots with dx^ (xq, xk: dq^ / dk^ of the
// q / k head, this CTA's own or its group's sum). grads_store_dqdk: dq / dk through the l2norm
// backward x' = r (dx^ - x^ (x^ . dx^)) where the forward normalised, stored in the input dtype. Rows
// past the sequence's end compute on stale values (every lane takes part in the row dots' shuffles)
// and store nothing.
template <typename WT, int K>
__device__ __forceinline__ void grads_load_x(const float* Xq, const float* Xk, int r, int s, int m, float (&xq)[4],
                                             float (&xk)[4]) {
  const int cc = 4 * s + 32 * m;
  const float4 a = *reinterpret_cast<const float4*>(Xq + GradsCtx<WT, K>::xs(r, cc));
  const float4 b = *reinterpret_cast<const float4*>(Xk + GradsCtx<WT, K>::xs(r, cc));
  xq[0] = a.x; xq[1] = a.y; xq[2] = a.z; xq[3] = a.w;
  xk[0] = b.x; xk[1] = b.y; xk[2] = b.z; xk[3] = b.w;
}
template <typename WT, int K>
__device__ __forceinline__ void grads_hat_dot(const GradsCtx<WT, K>& c, int r, int s, int m, float rq, float rk,
                                              const float (&xq)[4], const float (&xk)[4], float (&qh)[4],
                                              float (&kh)[4], float& dq_dot, float& dk_dot) {
  using S = GradsSmem<WT, K>;
  using E = dev::Elem<WT>;
  const int cc = 4 * s + 32 * m;
  const uint2 uq = *reinterpret_cast<const uint2*>(c.sQ() + r * S::KQ + cc);
  const uint2 uk = *reinterpret_cast<const uint2*>(c.sK() + r * S::KQ + cc);
  const float2 q01 = E::to_float2(uq.x), q23 = E::to_float2(uq.y);
  const float2 k01 = E::to_float2(uk.x), k23 = E::to_float2(uk.y);
  qh[0] = q01.x * rq; qh[1] = q01.y * rq; qh[2] = q23.x * rq; qh[3] = q23.y * rq;
  kh[0] = k01.x * rk; kh[1] = k01.y * rk; kh[2] = k23.x * rk; kh[3] = k23.y * rk;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    dq_dot = fmaf(qh[e], xq[e], dq_dot);
    dk_dot = fmaf(kh[e], xk[e], dk_dot);
  }
}
template <typename WT, int K>
__device__ __forceinline__ void grads_store_dqdk(const GradsCtx<WT, K>& c, const float (&xq)[K / 32][4],
                                                 const float (&xk)[K / 32][4], const float (&qh)[K / 32][4],
                                                 const float (&kh)[K / 32][4], float rq, float rk, float dq_dot,
                                                 float dk_dot, int r, int s) {
  using E = dev::Elem<WT>;
  constexpr int NM = K / 32;
  const KdaBwdParams& p = c.p;
  // the row's 8 lanes are adjacent and 8-aligned in the warp: xor 1, 2, 4 stays inside the row
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) {
    dq_dot += __shfl_xor_sync(0xffffffffu, dq_dot, o);
    dk_dot += __shfl_xor_sync(0xffffffffu, dk_dot, o);
  }
  const int64_t off = ((c.tok0 + r) * p.H + c.h) * K + 4 * s;
#pragma unroll
  for (int m = 0; m < NM && r < c.len; ++m) {
    float oq[4], ok[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      oq[e] = p.opt.l2norm ? rq * (xq[m][e] - qh[m][e] * dq_dot) : xq[m][e];
      ok[e] = p.opt.l2norm ? rk * (xk[m][e] - kh[m][e] * dk_dot) : xk[m][e];
    }
    dev::stg8(reinterpret_cast<WT*>(p.dq) + off + 32 * m, make_uint2(E::pack2(oq[0], oq[1]), E::pack2(oq[2], oq[3])));
    dev::stg8(reinterpret_cast<WT*>(p.dk) + off + 32 * m, make_uint2(E::pack2(ok[0], ok[1]), E::pack2(ok[2], ok[3])));
  }
}

// GVA (HV = G H) inside the grads kernel: the G CTAs of one chunk whose value heads share a q / k head
// sum their dq^ / dk^ (xq, xk; row r of this thread, `hat` its offset in dqhat / dkhat) along a chain
// in head order, through the workspace rows dqhat / dkhat and one flag per (chunk, q / k head)
// (p.gva_flags, zeroed before every pass: kda_sequence.h's backward_pass_sequence). Head rg > 0 of the
// group waits until the flag counts rg (head rg - 1 stored the running sum of heads 0 .. rg - 1) and
// adds that sum to its own; every head but the last stores its running sum and counts the flag up;
// the last one returns true: it holds the group's sum and finishes dq / dk. The adds are
// ((x_0 + x_1) + x_2) ..., the order kda_bwd_group_sum adds the workspace rows in, so the sums are
// bit for bit the same. The wait cannot deadlock: head rg - 1's CTA is earlier in grid order in both
// grids (chunk fastest, then value head; the streamed grid's rows hold every head of a chunk in head
// order), so the hardware handed it to an SM before this one, and it waits for nothing later than
// itself (dev::wait_earlier_cta traps only past a bound no working chain reaches). The running sums
// live in dqhat / dkhat rows of heads 0 .. G - 2 only (gva_hat_row), so head rg - 1's row is the K
// floats before head rg's slot. A compile-time variant (kda_bwd_grads_kernel's kGva): with the chain
// behind a runtime branch every grads kernel grew by ~200 instructions and ptxas moved its spills
// (the GVA training call gained 3.1% in one build, but only ~1.4% against the unbranched kernels;
// docs/notes/2026-12-06-tri-skip-and-suites.md).
template <typename WT, int K>
__device__ __forceinline__ bool grads_gva_chain(const GradsCtx<WT, K>& c, float (&xq)[K / 32][4], float (&xk)[K / 32][4],
                                                int64_t hat, int r) {
  constexpr int NM = K / 32;
  const KdaBwdParams& p = c.p;
  const int G = c.HV / p.H, rg = c.hv - c.h * G;  // rg: this value head's place in its group
  int* flag = p.gva_flags + static_cast<int64_t>(c.gchunk) * p.H + c.h;
  if (rg > 0) {
    if (c.tid == 0) dev::wait_earlier_cta(flag, rg);
    __syncthreads();  // carries thread 0's acquire to every thread's loads below
#pragma unroll
    for (int m = 0; m < NM && r < c.len; ++m) {
      const float4 a = dev::ldg_cg16(p.dqhat + hat - K + 32 * m);  // head rg - 1's row: K floats earlier (gva_hat_row)
      const float4 b = dev::ldg_cg16(p.dkhat + hat - K + 32 * m);
      xq[m][0] = a.x + xq[m][0]; xq[m][1] = a.y + xq[m][1]; xq[m][2] = a.z + xq[m][2]; xq[m][3] = a.w + xq[m][3];
      xk[m][0] = b.x + xk[m][0]; xk[m][1] = b.y + xk[m][1]; xk[m][2] = b.z + xk[m][2]; xk[m][3] = b.w + xk[m][3];
    }
  }
  if (rg == G - 1) return true;
#pragma unroll
  for (int m = 0; m < NM && r < c.len; ++m) {
    dev::stg16(p.dqhat + hat + 32 * m, xq[m][0], xq[m][1], xq[m][2], xq[m][3]);
    dev::stg16(p.dkhat + hat + 32 * m, xk[m][0], xk[m][1], xk[m][2], xk[m][3]);
  }
  // One release for the CTA: the barrier orders every thread's stores before thread 0's fence and
  // release (cumulative in the PTX model), so only thread 0 waits for the stores' acks, and the other
  // warps leave at once: gva 7.20 ms against 7.23 with every thread's own fence before the barrier
  // (H100, one process)
  __syncthreads();
  if (c.tid == 0) {
    __threadfence();
    dev::store_release(flag, rg + 1);
  }
  return false;
}

// kGva's dq / dk (grads_finish): this head's dq^ / dk^ rows from X (Xq, Xk in shared memory), the chain
// over the group (grads_gva_chain), and in the group's last head dq / dk from the group's sum.
template <typename WT, int K>
__device__ __forceinline__ void grads_dqdk_gva(const GradsCtx<WT, K>& c, const float* Xq, const float* Xk) {
  constexpr int NM = K / 32;
  const int r = c.tid >> 3, s = c.tid & 7;
  float xq[NM][4], xk[NM][4], qh[NM][4], kh[NM][4];
#pragma unroll
  for (int m = 0; m < NM; ++m) grads_load_x<WT, K>(Xq, Xk, r, s, m, xq[m], xk[m]);
  if (!grads_gva_chain(c, xq, xk, gva_hat_row(c.tok0 + r, c.p.H, c.HV, c.hv, K) + 4 * s, r)) return;
  const float rq = c.sRq()[r], rk = c.sRk()[r];
  float dq_dot = 0.f, dk_dot = 0.f;
#pragma unroll
  for (int m = 0; m < NM; ++m) grads_hat_dot(c, r, s, m, rq, rk, xq[m], xk[m], qh[m], kh[m], dq_dot, dk_dot);
  grads_store_dqdk(c, xq, xk, qh, kh, rq, rk, dq_dot, dk_dot, r, s);
}

// dG at the last valid row, the reverse cumsum of dg^ (one thread per (column, block), the later
// blocks' sums as its carry), the gate backward elementwise (8 columns per item, 16-byte loads of
// g), dbeta, and dq / dk (l2norm backward, or dq^ / dk^ per value head with GVA).
template <typename WT, int K, bool kGva>
__device__ __forceinline__ void grads_finish(const GradsCtx<WT, K>& c) {
  using S = GradsSmem<WT, K>;
  using Ctx = GradsCtx<WT, K>;
  using E = dev::Elem<WT>;
  constexpr int NTH = kGradsThreads, NPART = S::NPART;
  const KdaBwdParams& p = c.p;
  const int tid = c.tid, lane = c.lane, warp = c.warp;
  const int HV = c.HV, hv = c.hv, len = c.len;
  const int64_t tok0 = c.tok0;
  float* Xq = &c.iph().xq[0][0];
  float* Xk = &c.iph().xk[0][0];
  float* Xg = &c.iph().xg[0][0];
  float* sGt = c.sGt();
  float* sDec = &c.st->dec[0][0];
  float* sDGp = &c.st->dgp[0][0];
  float* sCarry = &c.st->u.ei.carry[0][0];
  float* sPart = c.sA1();  // [NTH / (K / 8)][K] gate partials: dA1 is dead by now
  float* sRowA = &c.st->rowa[0][0];
  float* sRowD = &c.st->u.ei.rowd[0][0];
  float* sDbc = &c.st->dbc[0][0];
  // the gate backward's items: item = (row r_first + RSTEP it, 8 columns at d0). The first item's raw
  // gate input is loaded here, in flight across the cumsum below; the loop over items is rolled (one
  // copy of the gate derivatives' code: this epilogue runs once per CTA, so its size is instruction
  // fetch time) and prefetches the next item's input while it computes the current one.
  constexpr int CG = K / 8;             // column groups
  constexpr int RSTEP = NTH / CG;       // rows per pass (32 at K = 128)
  constexpr int NIT = kChunk / RSTEP;   // passes (2 at K = 128)
  const GateMode mode = p.opt.gate_mode;
  const bool gate_in_kernel = mode != GateMode::kPrecomputed;
  const int cg = tid % CG, r_first = tid / CG, d0 = 8 * cg;
  auto load_raw = [&](int r) { return dev::raw_gate8<K>(p, tok0, r, hv, d0, gate_in_kernel && r < len); };
  dev::Raw8 graw = load_raw(r_first);
  if (tid < K) {
    // the decay gradient dG = exp2(G) sum_v h dh + sum_r kg dkg (enters at the last valid row)
    float dec = 0.f;
#pragma unroll
    for (int pp = 0; pp < NPART; ++pp) dec += sDec[pp * K + tid];
    sGt[tid] = dev::fast_exp2(sGt[tid]) * dec + ((sDGp[tid] + sDGp[K + tid]) + (sDGp[2 * K + tid] + sDGp[3 * K + tid]));
  }
  // per (block, column) sums of dg^
  if (tid < 4 * K) {
    const int d = tid % K, blk = tid / K;
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) acc += Xg[Ctx::xs(16 * blk + i, d)];
    sCarry[blk * K + d] = acc;
  }
  __syncthreads();
  // reverse cumsum in place: dgate[r][d] = dG[d] + sum_{r' >= r} dg^[r'][d] (rows past the end are 0
  // and never stored, so starting the carry at row 63 is the same as at the last valid row)
  if (tid < 4 * K) {
    const int d = tid % K, blk = tid / K;
    float carry = sGt[d];
    for (int b = blk + 1; b < 4; ++b) carry += sCarry[b * K + d];
#pragma unroll
    for (int i = 15; i >= 0; --i) {
      const int x = Ctx::xs(16 * blk + i, d);
      carry += Xg[x];
      Xg[x] = carry;
    }
  }
  __syncthreads();
  KF_GRADS_PHASE(7);
  // the gate backward, elementwise: item = (row, 8 columns); thread partials of ddt_bias per column
  // group and of dA_log, summed in a fixed order below
  {
    const float a_exp = (gate_in_kernel && p.A_log) ? expf(p.A_log[hv]) : 1.f;
    float bias[8], pb[8], pa = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      bias[e] = (gate_in_kernel && p.dt_bias) ? p.dt_bias[hv * K + d0 + e] : 0.f;
      pb[e] = 0.f;
    }
#pragma unroll 1
    for (int it = 0; it < NIT; ++it) {
      const int r = r_first + RSTEP * it;
      const dev::Raw8 gnext = load_raw(r + RSTEP);  // zeros past the chunk (and past NIT)
      if (r < len) {
        float dgate[8];
        dev::ld8(dgate, Xg + Ctx::xs(r, d0));
        if (gate_in_kernel) {
          float gx[8], ddx[8], ddA[8];
          dev::gate8_to_float(gx, graw, p);
#pragma unroll
          for (int e = 0; e < 8; ++e) gx[e] += bias[e];
          dev::gate_derivatives8(mode, gx, a_exp, p.opt.lower_bound, ddx, ddA);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            pa = fmaf(dgate[e], ddA[e], pa);
            dgate[e] *= ddx[e];
            pb[e] += dgate[e];
          }
        }
        dev::store8_any(p.dg, p.g_dtype, ((tok0 + r) * HV + hv) * K + d0, dgate);
      }
      graw = gnext;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) sPart[r_first * K + d0 + e] = pb[e];  // [RSTEP][K]
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) pa += __shfl_xor_sync(0xffffffffu, pa, off);
    if (lane == 0) sDGp[warp] = pa;                                  // [NTH / 32]
  }
  __syncthreads();
  // (four interleaved partial sums, then their pairs: a chain a quarter as long as one running sum;
  // the order is fixed, so the partials stay deterministic)
  if (tid < K && p.pbias) {
    constexpr int RSTEP = NTH / (K / 8);
    static_assert(RSTEP % 4 == 0, "four interleaved sums");
    float pb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int rr = 0; rr < RSTEP; ++rr) pb[rr & 3] += sPart[rr * K + tid];
    p.pbias[(static_cast<int64_t>(c.gchunk) * HV + hv) * K + tid] = (pb[0] + pb[1]) + (pb[2] + pb[3]);
  }
  if (tid == K && p.pA) {
    static_assert((NTH / 32) % 4 == 0, "four interleaved sums");
    float pa[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < NTH / 32; ++i) pa[i & 3] += sDGp[i];
    p.pA[static_cast<int64_t>(c.gchunk) * HV + hv] = (pa[0] + pa[1]) + (pa[2] + pa[3]);
  }
  // dbeta = Akk's column side + L's row side (off-diagonal from I1, diagonal from I3), then the
  // sigmoid's backward. One thread per row.
  if (tid >= 256 && tid < 256 + kChunk) {
    const int r = tid - 256;
    if (r < len) {
      const int b = r >> 4, i = r & 15;
      float db = 0.f;
#pragma unroll
      for (int pp = 0; pp < 8; ++pp) db += sDbc[pp * kChunk + r];
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4) db += sRowA[q4 * kChunk + r];
      // the diagonal block's row side: the warps of block b (warp w holds block w / (K / 32))
#pragma unroll
      for (int w = 0; w < K / 32; ++w) db += sRowD[(b * (K / 32) + w) * 16 + i];
      const int64_t bi = (tok0 + r) * HV + hv;
      // the slope in its stable form (dev::sigmoid_slope: s (1 - s) is 0 from raw beta ~17), from P
      if (p.opt.beta_sigmoid_scale != 0.f) db *= c.st->bslope[r];
      store_any(p.dbeta, p.beta_dtype, bi, db);
    }
  }
  // dq / dk: x' = r (dx^ - x^ (x^ . dx^)) (l2norm; dx' = dx^ without). With GVA dx^ is the sum over
  // the q / k head's group: kGva sums it along a chain of this chunk's CTAs (grads_dqdk_gva); without
  // the chain (the host emulator's reference, gva_flags null) each value head's dq^ / dk^ goes to
  // the workspace and kda_bwd_group_sum finishes. One pass, one item per thread: 8 lanes per row, lane s holding
  // columns 4 s + 32 m (m < K / 32) in registers, so the row dots are a 3-step shuffle and nothing
  // goes back through smem. Each quarter-warp reads one row's 128 contiguous bytes of X per float4
  // load (the XOR swizzle keeps them on distinct banks).
  if constexpr (kGva) {
    grads_dqdk_gva(c, Xq, Xk);  // the group's sum along the chain, then dq / dk in its last head
  } else {
    constexpr int NM = K / 32;
    const int r = tid >> 3, s = tid & 7;
    static_assert(kChunk * 8 == NTH, "one (row, lane) item per thread");
    const bool gva = HV != p.H;
    // rows past the end compute on stale X and store nothing (the shuffles need all lanes)
    float xq[NM][4], xk[NM][4], qh[NM][4], kh[NM][4];
    const float rq = c.sRq()[r], rk = c.sRk()[r];
    float dq_dot = 0.f, dk_dot = 0.f;
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      grads_load_x<WT, K>(Xq, Xk, r, s, m, xq[m], xk[m]);
      grads_hat_dot(c, r, s, m, rq, rk, xq[m], xk[m], qh[m], kh[m], dq_dot, dk_dot);
    }
    if (gva) {
      const int64_t off = ((tok0 + r) * HV + hv) * K + 4 * s;
#pragma unroll
      for (int m = 0; m < NM && r < len; ++m) {
        dev::stg16(p.dqhat + off + 32 * m, xq[m][0], xq[m][1], xq[m][2], xq[m][3]);
        dev::stg16(p.dkhat + off + 32 * m, xk[m][0], xk[m][1], xk[m][2], xk[m][3]);
      }
    } else {
      grads_store_dqdk(c, xq, xk, qh, kh, rq, rk, dq_dot, dk_dot, r, s);
    }
  }
}

// ---------------------------------------------------------------- the streamed backward
// (kda_policy.h's bwd_stream_wanted; p.dh_ready set): the grads kernels run beside the dh scan.
// The (sequence, chunk) of this CTA; its value head is blockIdx.y in either grid. The chunk map's
// global chunk blockIdx.x (grid (max_chunks, HV, 1)), or in the streamed backward the chunk row
// blockIdx.z of the grid (1, HV, max_chunks), which the hardware hands out every head of a row before
// the next row, the rows in the order the dh scan stores them: the last chunk of every sequence,
// then the one before it, ... (The head stays a special register the compiler re-reads where it
// needs it: computed from either index, it held a register through the kernel and the bounded-gate
// kernel spilled 64 / 96 bytes instead of 12 / 20, reloads in the V loop among them.)
struct GradsCell {
  int n, ci;
  bool ok;
};
template <bool kStreamed>
__device__ __forceinline__ GradsCell grads_cell(const KdaBwdParams& p) {
  if constexpr (kStreamed) {  // fixed length (bwd_stream_possible): N sequences of nts chunks
    const int nts = (p.T + kChunk - 1) / kChunk, row = blockIdx.z;
    return {row % p.N, nts - 1 - row / p.N, true};
  }
  GradsCell cell{0, 0, false};
  cell.ok = dev::chunk_of(p, blockIdx.x, cell.n, cell.ci);
  return cell;
}
// Whether the counters p[0 .. n) (n <= 8) have all reached `need` now, read in one round trip: the
// counters past the first by relaxed loads issued ahead of the first one's acquire load, all in flight
// at once (wait_at_least on each in turn costs a round trip per counter: an acquire's L1 invalidate,
// CCTL.IVALL, waits for its own load, and the next load issues after it). The first counter is
// acquired; the others are seen in L2, the coherence point, where their writers' release (after every
// writing thread's __threadfence) put them after their data, and the caller issues its reads of that
// data only after this returns (the check depends on every value), through L2 (cp.async.cg): the
// forward's flag prefetch relies on the same (dev::prefetch_flag, device/sequence.cuh). false is no
// verdict: the caller then waits on each counter with wait_at_least. At prod8192 (two dh slices) the
// per-counter waits were 3.9% of the streamed kernel's stall samples (ncu; docs/notes/2026-12-06-grads-
// stream-waits.md).
__device__ __forceinline__ bool grads_counts_reached(const int* p, int n, int need) {
  int v[8];
#pragma unroll
  for (int i = 1; i < 8; ++i) {
    v[i] = need;
    if (i < n) v[i] = dev::load_relaxed(p + i);
  }
  v[0] = dev::load_acquire(p);
  bool ok = true;
#pragma unroll
  for (int i = 0; i < 8; ++i) ok = ok && v[i] >= need;
  return ok;
}
// Waits until every dh-scan slice of (sequence n, value head hv) has stored chunk ci's checkpoint
// dh_{ci+1} (stored at the reverse chain's step for chunk ci, so once nchunks - ci chunks are counted).
// Every thread reads all the counts itself, in one round trip (grads_counts_reached), so that its own
// copies of dh_ckpt issued after it see the stores (the dh scan fenced them before its release); a
// count short of `need` there, it waits on each slice's with acquire loads. The dh scan waits for nothing and all
// of its CTAs are resident before this kernel starts (or, where the launches are serialised, done),
// so the wait ends: a dh scan's whole chain takes ~2.5 us per chunk (5 ms for 131072 tokens). A wait
// past kDhWaitNs can only be a broken count, and it traps (a launch error the caller sees) rather
// than hang the device. In the emulator the dh scan has run to its end first: a count short of it is
// a publication error.
constexpr long long kDhWaitNs = 4000000000LL;  // 4 s
__device__ __forceinline__ void grads_wait_dh(const KdaBwdParams& p, int n, int hv, int ci, int nchunks) {
  const int slices = p.V / p.dh_bv, need = nchunks - ci;
  const int* cnt = p.dh_ready + (static_cast<int64_t>(n) * p.HV + hv) * slices;
  if (grads_counts_reached(cnt, slices, need)) return;  // (slices <= V / 64 <= 8)
  for (int s = 0; s < slices; ++s) {
    if (dev::wait_at_least(cnt + s, need, kDhWaitNs, 256)) continue;
#ifdef KF_EMU
    kf_emu::detail::failf("streamed backward: slice %d of (n %d, hv %d) counts %d chunks, chunk %d needs %d", s, n, hv,
                          cnt[s], ci, need);
#else
    __trap();
#endif
  }
}
// The end of every CTA of a grads kernel in the streamed backward: the kernel must not complete
// before the previous kernel on the stream (the stream's next kernel then sees both), so thread 0 of
// the CTAs the grid hands out last waits for it (griddepcontrol.wait): the last chunk row of the main
// kernel (the sequences' first chunks, which wait for the dh scan's last steps anyway), the last
// (sequence, head) of kda_bwd_grads_last_kernel. Any one waiting CTA keeps its grid from completing;
// every other thread exits at once. The waits end even where a whole row (HV CTAs, up to 256) waits:
// the previous grid called launch_dependents at the start of every one of its CTAs (the dh scan,
// kda_bwd_grads_last_kernel), so all of them had started before any CTA of this grid, and none
// needs an SM that a waiting CTA holds. Each CTA still counts itself done (`which`: its kernel's counter
// in p.dh_ready, bwd_stream_done_offset + 0 for kda_bwd_grads_last_kernel, + 1 for kda_bwd_grads_kernel;
// the emulator checks every CTA counted) without waiting for the count: the CTA that found itself last
// by a returning atomic, as before, kept all 16 warps at a barrier for that round trip (0.9% of the
// stall samples at prod8192) while its SM could not take the next CTA.
__device__ __forceinline__ void grads_stream_end(const KdaBwdParams& p, int which) {
  if (threadIdx.x != 0) return;
  atomicAdd(p.dh_ready + bwd_stream_done_offset(p) + which, 1);  // (result unused: a reduction)
  const bool last = blockIdx.x == gridDim.x - 1 && blockIdx.y == gridDim.y - 1 && blockIdx.z == gridDim.z - 1;
  const bool last_row = which == 1 ? blockIdx.z == gridDim.z - 1 : last;
  if (last_row) dev::wait_previous();
}

// ---------------------------------------------------------------- the kernel
// The V loop's copy a CTA runs: kLoNever (the plain loop), kLoLast (the second copy when this is the
// last chunk of a sequence with a final-state gradient, else the plain one: both copies in the kernel),
// kLoAlways (the second copy only: kda_bwd_grads_last_kernel).
enum GradsLo { kLoNever, kLoLast, kLoAlways };

// One CTA: chunk ci of sequence n, value head blockIdx.y. kStreamed: the streamed backward's
// (p.dh_ready), which waits for the dh scan's checkpoint.
template <typename WT, int K, bool kMid, GradsLo kLo, bool kStreamed, bool kGva>
__device__ __forceinline__ void grads_cta(const KdaBwdParams& p, char* smem, int n, int ci, const dev::SeqInfo& seq) {
  using S = GradsSmem<WT, K>;
  constexpr int NTH = kGradsThreads, NTK = K / 32;
  const GradsCtx<WT, K> c(p, smem, seq, ci, blockIdx.y);
  KF_GRADS_PHASE(0);

  // P: every load of the chunk in flight first (the gate's first rows, then the bulk copies), then
  // the gate and the factors. The streamed backward waits for dh_{c+1} between the forward's tiles
  // (stored before this kernel began) and the first V-slice's copies, which read it.
  auto issue_bulk = [&]() {
    grads_load_chunk(c);
    if constexpr (kStreamed) grads_wait_dh(p, n, blockIdx.y, ci, (seq.len + kChunk - 1) / kChunk);
    grads_load_slice(c, 0, 0);
    dev::cp_async_commit();
  };
  // (beta's sigmoid slope for F's dbeta from the same load: a global load of raw beta in F sat on the
  // critical path of the CTA's last warps, whose slowest ended ~0.7 us after warp 0 at the median)
  dev::gate_cumsum_beta<K, NTH, S::KP, /*kRollRows=*/true>(p, c.tok0, c.len, c.hv, c.sG(), c.sBT(), c.sBeta(),
                                                           issue_bulk, c.st->bslope);
  dev::cp_async_wait<0>();
  // The l2norm row factors before the barrier (as kda_fwd_intra's P1): row_rstd's vector i of q and
  // of k is the one this thread's own cp.async brought (grads_load_chunk: the same strided map), so
  // it is complete for this thread after its wait; a row's lanes are one warp's. sRq / sRk are read
  // after the barrier.
  dev::row_rstd<WT, K, NTH, S::KQ>(c.sQ(), c.sK(), p.opt.l2norm, c.sRq(), c.sRk());
  __syncthreads();
  dev::block_offsets<K>(c.sBT(), c.sBO(), c.sBS(), c.sGt());
  KF_GRADS_PHASE(1);

  // V
  float dqg[NTK][4], dkg[NTK][4], dwc[NTK][4], dAq[2][4], dAk[2][4], dkA[NTK][4];
#pragma unroll
  for (int j = 0; j < NTK; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dqg[j][e] = dkg[j][e] = dwc[j][e] = 0.f;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dAq[j][e] = dAk[j][e] = 0.f;
  float dec2[2] = {0.f, 0.f};
  constexpr int kV1Width = kMid ? 16 : 32;  // grads_contract's NV: measured per kernel
  // grads_contract's kTriShadow, measured per kernel (2026-12-04): V 26.97k -> 26.30k cycles per CTA
  // at prod8192 in the unbounded-gate kernel; the bounded-gate kernel's CTA 54.0k -> 55.0k
  constexpr bool kV1Shadow = !kMid;
  // The last chunk of a sequence with a final-state gradient (bf16) runs the V loop's second copy,
  // whose products see v' and dht unrounded (its argument: this sequence's fp32 dht).
  // dg at the sequence's last row is dG + dg^[last], which leaves sum_r kg_r dkg_r with
  // dkg_r = v'_r dht: one product of two rounded vectors carries most of dA_log's error on short
  // sequences with strong gates (docs/notes/2026-12-02-dalog-floor.md: on 17 inputs of
  // strong_bounded_T200, v' and dht exact in this chunk only take dA_log's median from 2.9e-3 to
  // 1.6e-3 and every input under the accuracy matrix's bound). fp16 keeps 8x more of each value and
  // has no range for the low halves.
  // kLoLast: the last chunk takes the second copy; kLoAlways: every CTA (kda_bwd_grads_last_kernel's
  // grid is those chunks); kLoNever: no second copy is compiled.
  if (kLo == kLoAlways || (kLo == kLoLast && p.dht != nullptr && (ci + 1) * kChunk >= seq.len)) {
    grads_contract<WT, K, kLo != kLoNever, kV1Width, kV1Shadow>(c, p.dht + dev::state_base<K>(p, n, c.hv), dqg, dkg,
                                                                dwc, dAq, dAk, dec2);
  } else {
    grads_contract<WT, K, false, kV1Width, kV1Shadow>(c, nullptr, dqg, dkg, dwc, dAq, dAk, dec2);
  }
  __syncthreads();  // the V phase's buffers are dead from here on (Akk stays)
  KF_GRADS_PHASE(2);

  // E
  grads_wy(c, dqg, dkg, dwc, dAq, dAk, dkA, dec2);
  KF_GRADS_PHASE(3);

  // I: dq^ in dqg, dkB in dkg
  float rowsumK[2] = {0.f, 0.f};
  grads_offdiag(c, dqg, dkA, dkg, rowsumK);
  KF_GRADS_PHASE(5);
  __syncthreads();  // E4's readers of sM / sZ are done: the X arrays may overwrite them
  grads_offdiag_take(c, dkg);
  grads_diag<WT, K, kMid>(c, dqg, dkA, dkg, rowsumK);
  KF_GRADS_PHASE(6);
  __syncthreads();

  // F
  grads_finish<WT, K, kGva>(c);
  KF_GRADS_PHASE(8);
}

// kMid: the diagonal blocks through their midpoint row on tensor cores (bounded gates,
// dev::block_midpoint_ok) instead of in SIMT. Two kernels, not one with a runtime branch: each
// launch then carries only its own I3 code (one kernel with both was 9,312 SASS instructions,
// against 8,360 / 6,744 apart), and the grads kernel has been instruction-fetch bound before.
//
// Where the last chunks of sequences with a final-state gradient run (bf16): inside the bounded-gate
// kernel (kMid), whose second copy of the V loop measured unchanged on the H200 (-0.6 .. +0.9% on
// the four bounded training cases); in a kernel of their own for unbounded gates, where the same copy
// inside the kernel made every chunk 8.5% slower (prod8192: P and F phases +5k and +1.8k cycles: that
// kernel is instruction-fetch bound). That one runs first, one CTA per (sequence, value head), and
// lets the main kernel start beside it (LaunchShape::overlap_previous), which skips those chunks.
//
// kStreamed: the streamed backward's copy (kda_policy.h's bwd_stream_wanted; p.dh_ready set): the
// grid (1, HV, chunk rows), the wait for the dh scan's checkpoint, and the last row's wait for the
// previous kernel (grads_stream_end). Its own instantiation, not a runtime branch: with the branch the
// plain kernels spilled more (bf16 K = 128: 32 / 52 -> 52 / 68 bytes unbounded, 12 / 20 -> 32 / 32
// bounded, reloads inside the V loop among them) and grew by ~330 instructions.
//
// kGva: GVA's group sum along a chain of this grid's CTAs (grads_gva_chain; p.gva_flags set), its own
// instantiation for the same reason: behind a runtime branch it grew every grads kernel.
template <typename WT, int K, bool kMid, bool kStreamed, bool kGva>
__global__ void __launch_bounds__(kGradsThreads, 1) kda_bwd_grads_kernel(const KdaBwdParams p) {
  KF_DYN_SMEM_1024(float4, smem_grads);  // 1024-aligned: the swizzled V-phase tiles
  const GradsCell cell = grads_cell<kStreamed>(p);
  const int n = cell.n, ci = cell.ci;
  // Where a previous kernel overlaps this one (kda_bwd_grads_last_kernel, the streamed backward's dh
  // scan), this kernel must not complete before it (the next kernel reads both): in the streamed
  // backward thread 0 of its last chunk row waits; otherwise every CTA that can overlap at all
  // (unbounded gates, bf16).
  constexpr bool kOverlapsLast = std::is_same_v<WT, __nv_bfloat16> && !kMid;
  auto finish = [&] {
    if constexpr (kStreamed) grads_stream_end(p, 1);
    else if constexpr (kOverlapsLast) dev::wait_previous();
  };
  if (!cell.ok) return;  // past the chunk map's end (varlen: max_chunks is a bound; never streamed)
  if constexpr (kOverlapsLast) {
    // the last chunk of a sequence with dht is kda_bwd_grads_last_kernel's (decided from the chunk
    // map alone, before anything else is live: a test on seq.len cost 12 bytes of spills here)
    const int nch = dev::seq_chunks(p, n);
    if (p.dht != nullptr && ci == nch - 1) {
      finish();
      return;
    }
  }
  const dev::SeqInfo seq = dev::seq_info(p, n);
  char* smem = reinterpret_cast<char*>(smem_grads);
  if constexpr (!std::is_same_v<WT, __nv_bfloat16>) {  // fp16 keeps 8x more of each value: no low halves
    grads_cta<WT, K, kMid, kLoNever, kStreamed, kGva>(p, smem, n, ci, seq);
  } else if constexpr (kMid) {
    grads_cta<WT, K, kMid, kLoLast, kStreamed, kGva>(p, smem, n, ci, seq);
  } else {
    grads_cta<WT, K, kMid, kLoNever, kStreamed, kGva>(p, smem, n, ci, seq);
  }
  finish();
}

// The last chunk of sequence blockIdx.x (unbounded gates, bf16, with dht), value head blockIdx.y.
// kStreamed: beside the dh scan too (its chunks are the first the dh scan stores); its last CTA in grid
// order waits for the dh scan (grads_stream_end).
template <typename WT, int K, bool kStreamed, bool kGva>
__global__ void __launch_bounds__(kGradsThreads, 1) kda_bwd_grads_last_kernel(const KdaBwdParams p) {
  dev::launch_dependents();  // the main kernel never reads what this one writes
  KF_DYN_SMEM_1024(float4, smem_grads);  // 1024-aligned: the swizzled V-phase tiles
  const int n = blockIdx.x;
  const dev::SeqInfo seq = dev::seq_info(p, n);
  // (the early return as it was: the plain kernel's SASS stays the same)
  if (seq.len == 0) {
    if constexpr (kStreamed) grads_stream_end(p, 0);
    return;
  }
  grads_cta<WT, K, false, kLoAlways, kStreamed, kGva>(p, reinterpret_cast<char*>(smem_grads), n, (seq.len - 1) / kChunk, seq);
  if constexpr (kStreamed) grads_stream_end(p, 0);
}

// The launch (kda_launch_shape.h): one CTA of kGradsThreads per (chunk, value head).
// In the streamed backward (p.dh_ready set) the chunk rows are the grid's z (grads_cell) and the kernel
// starts beside the dh scan (programmatic dependent launch: the dh scan's CTAs trigger it at their start).
template <typename WT, int K>
inline LaunchShape grads_launch(const KdaBwdParams& p) {
  LaunchShape s = chunk_grid(p, kGradsThreads, sizeof(GradsSmem<WT, K>));
  if (p.dh_ready) {
    s.grid = dim3(1, static_cast<unsigned>(p.HV), static_cast<unsigned>(p.max_chunks));
    s.overlap_previous = true;
  }
  return s;
}

// Every launch of the stage, in order, as f(kernel, shape): the launcher's and the emulator's one
// choice of kernels. With unbounded gates, bf16 and dht, first the last chunks (one CTA per sequence
// and value head), then the main kernel, allowed to start beside them. The variants: kMid (bounded
// gates, dev::block_midpoint_ok), kStreamed (p.dh_ready set), kGva (the GVA chain: p.gva_flags set).
template <typename WT, int K, typename F>
void for_each_grads_launch(const KdaBwdParams& p, F&& f) {
  LaunchShape shape = grads_launch<WT, K>(p);
  const bool streamed = p.dh_ready != nullptr, gva = p.gva_flags != nullptr;
  if constexpr (std::is_same_v<WT, __nv_bfloat16>) {
    if (!dev::block_midpoint_ok(p.opt) && p.dht != nullptr) {
      LaunchShape last{dim3(static_cast<unsigned>(p.N), static_cast<unsigned>(p.HV)), kGradsThreads, shape.smem};
      last.overlap_previous = streamed;  // beside the dh scan in the streamed backward
      dispatch_bool(streamed, [&](auto st) {
        dispatch_bool(gva, [&](auto gv) {
          f(kda_bwd_grads_last_kernel<WT, K, decltype(st)::value, decltype(gv)::value>, last);
        });
      });
      shape.overlap_previous = true;
    }
  }
  dispatch_bool(dev::block_midpoint_ok(p.opt), [&](auto mid) {
    dispatch_bool(streamed, [&](auto st) {
      dispatch_bool(gva, [&](auto gv) {
        f(kda_bwd_grads_kernel<WT, K, decltype(mid)::value, decltype(st)::value, decltype(gv)::value>, shape);
      });
    });
  });
}

#ifndef KF_EMU
template <typename WT, int K>
void launch_grads(const KdaBwdParams& p, cudaStream_t stream) {
  for_each_grads_launch<WT, K>(p, [&](auto kern, const LaunchShape& s) { dev::launch_chunk_kernel(kern, s, p, stream); });
}
#endif

}  // namespace kernel_fun::kda
