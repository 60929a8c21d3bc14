// The parts the two chunk scans share: kda_fwd_scan (the state h, chunk 0 to last) and
// kda_bwd_dh_scan (its gradient dh, last chunk to 0). Both run one CTA per (V-slice of BV columns,
// value head, sequence) with BV / 16 warps; warp w owns value columns [16 w, 16 w + 16) of the
// slice and keeps its state TRANSPOSED in fp32 registers, sT[j][e] = state row k = 8 j + 2 t +
// (e & 1), value column col0 + 8 (e >> 1) with col0 = v0 + 16 w + g (C fragments over K: the warp's
// 16 rows of the warpgroup's wgmma products, or mma.sync tiles).
// Both read the forward intra's workspace (w, qg, kg, Aqk, Akk, exp2(G)) and one [64][BV] value
// tile per chunk (v forward, do backward) through a double-buffered shared-memory stage.
#pragma once

#include <cstddef>
#include <type_traits>

#include "kda/device/primitives.cuh"
#include "kda/device/sequence.cuh"

namespace kernel_fun::kda::dev {

// One stage of the scans' shared memory (offsets in WT elements). The K-wide tiles sW, sQg, sKg
// [64 tokens][K] come first, each as K / 64 blocks of [64][64] in the 128-byte swizzle
// (dev::sw128_offset): they are the B operands of the wgmma products, read through descriptors.
// sAqk, sAkk [64][72] (16x16 blocks above the diagonal are never loaded or read) and sVal [64][BV+8]
// are padded rows for ldmatrix (mma.sync products); sDec [K] fp32 = exp2(G). Stages are 1024-byte
// multiples from a 1024-byte aligned base (the swizzle atoms' alignment). Two stages: chunk c+1 is
// filled by cp.async while chunk c computes; the one CTA-wide barrier per chunk hands it over.
// C: tokens per chunk (kChunk; 32 for the short-chunk forward, whose tiles are [32][K],
// still whole 1024-byte swizzle atoms).
template <typename WT, int K, int BV, int C = kChunk>
struct ScanStage {
  static_assert(sizeof(WT) == 2 && K % 64 == 0, "16-bit operands, K a multiple of 64 (swizzle blocks)");
  static_assert(C % 16 == 0 && (C * 128) % 1024 == 0, "whole 16-token blocks and swizzle atoms");
  static constexpr int AP = C + 8;
  static constexpr int VP = BV + 8;
  static constexpr int kTile = C * K;  // one swizzled [C][K] tile
  // The stage as a type (a view of the dynamic shared memory; nothing is constructed). alignas(1024)
  // pads its size to a multiple of 1024 bytes, so the second stage starts swizzle-aligned as well.
  struct alignas(1024) Layout {
    WT w[kTile];
    WT qg[kTile];
    WT kg[kTile];
    WT aqk[C][AP];
    WT akk[C][AP];
    WT val[C][VP];
    float dec[K];
    // the streamed forward's copy of the aligned flag group of the chunk this stage will hold
    // (fwd_scan_cta, dev::prefetch_flag); in the padding the 1024-byte alignment leaves anyway
    alignas(16) int flag_group[4];
  };
  // Element offsets of the members (in WT units), for the code that addresses a stage by offset.
  static constexpr int kW = offsetof(Layout, w) / sizeof(WT);
  static constexpr int kQg = offsetof(Layout, qg) / sizeof(WT);
  static constexpr int kKg = offsetof(Layout, kg) / sizeof(WT);
  static constexpr int kAqk = offsetof(Layout, aqk) / sizeof(WT);
  static constexpr int kAkk = offsetof(Layout, akk) / sizeof(WT);
  static constexpr int kVal = offsetof(Layout, val) / sizeof(WT);
  static constexpr int kDec = offsetof(Layout, dec) / sizeof(WT);  // fp32 [K]
  static constexpr int kFlags = offsetof(Layout, flag_group) / sizeof(WT);  // int [4]
  static constexpr int kStageElems = sizeof(Layout) / sizeof(WT);
  static_assert(offsetof(Layout, w) % 1024 == 0 && offsetof(Layout, qg) % 1024 == 0 && offsetof(Layout, kg) % 1024 == 0,
                "the swizzled tiles start on 1024-byte boundaries");
  static constexpr size_t kBytes = sizeof(WT) * 2 * kStageElems + 1024;  // + the base's alignment slack
  // Element index of (row r, column c) in one swizzled [64][K] tile (w, qg, kg): K / 64 blocks of
  // [64 rows][64 columns] with 128-byte rows (sw128_offset).
  static __device__ __forceinline__ int tile_index(int r, int c) { return sw128_index<C>(r, c); }
  static_assert(kBytes <= 227 * 1024, "scan shared memory exceeds the sm_90 per-CTA limit");
};

// The scans' dynamic shared memory from its first 1024-byte aligned byte.
template <typename WT>
__device__ __forceinline__ WT* scan_smem_base(void* raw) {
  const uint32_t a = smem_u32(raw);
  return reinterpret_cast<WT*>(static_cast<char*>(raw) + (((a + 1023u) & ~1023u) - a));
}

// wgmma B descriptors of a swizzled [64 tokens][K] tile. K-major (the A products, B[k][n = token]
// = tile[token][k]) for k-step kk: 16 columns = 32 bytes into a 64-column block; 8-token groups
// 1024 bytes apart. MN-major (the state updates, B[k = token][n = state row] = tile[token][row])
// for token step jj: 16 rows = 2048 bytes; 8-token groups 1024 bytes apart, 64-row blocks of the
// state 8192 bytes apart.
template <int C = kChunk, typename WT>
__device__ __forceinline__ uint64_t tile_desc_k(const WT* tile, int kk) {
  return sw128_desc_k<C>(tile, kk);
}
template <int C = kChunk, typename WT>
__device__ __forceinline__ uint64_t tile_desc_mn(const WT* tile, int jj) {
  return sw128_desc_mn<C>(tile, 16 * jj, 0);
}

// acc (+)= the warpgroup's state rows times tile^T over K ([16 v] x [64 tokens] per warp): a[kk] is
// the state packed as A fragments (pack_a of n-tiles 2 kk, 2 kk + 1). Issue only: the caller
// fences, commits and waits (several products share one wait).
template <typename WT, int K, int C = kChunk>
__device__ __forceinline__ void wgmma_state_tile_t(float (&acc)[C / 8][4], const uint32_t (&a)[K / 16][4],
                                                   const WT* tile, bool accumulate) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) wgmma_rs<WT, C, 0>(acc, a[kk], tile_desc_k<C>(tile, kk), accumulate || kk > 0);
}
// sT += a[jj] @ tile[16 jj .. 16 jj + 15][:] over the chunk's four token blocks ([16 v] x [K] per
// warp): a[jj] are [16 v] x [16 tokens] A fragments. Issue only, as above.
template <typename WT, int K, int C = kChunk>
__device__ __forceinline__ void wgmma_tokens_tile(float (&sT)[K / 8][4], const uint32_t (&a)[C / 16][4],
                                                  const WT* tile) {
#pragma unroll
  for (int jj = 0; jj < C / 16; ++jj) wgmma_rs<WT, K, 1>(sT, a[jj], tile_desc_mn<C>(tile, jj), true);
}

template <int BV>
constexpr int scan_threads() {
  return BV / 16 * 32;
}

// Where a chunk's operands come from: the forward intra's workspace ([B*T, HV, K] and
// [B*T, HV, 64] in WT; exp2(G) [chunks, HV, K] fp32) and the value tile ([B*T, HV, V]: v or do).
template <typename WT>
struct ScanSources {
  const WT* w;
  const WT* qg;
  const WT* kg;
  const WT* Aqk;
  const WT* Akk;
  const WT* val;
  const float* gdecay;
};

// What both scans read from params: the workspace and the value tile (v, or do for the dh scan).
template <typename WT>
__device__ __forceinline__ ScanSources<WT> scan_sources(const KdaFwdParams& p, const void* val) {
  return {reinterpret_cast<const WT*>(p.w),   reinterpret_cast<const WT*>(p.qg),  reinterpret_cast<const WT*>(p.kg),
          reinterpret_cast<const WT*>(p.Aqk), reinterpret_cast<const WT*>(p.Akk), reinterpret_cast<const WT*>(val),
          p.gdecay};
}

// A scan CTA's work item: (V-slice, value head, sequence). A plain launch takes it from blockIdx
// (x, y, z), z through the longest-first sequence order (scan_sequence); kda_bwd_scans' paired
// launch maps its doubled x range onto two scans' items.
struct ScanBlock {
  int vs, hv, n;
};
__device__ __forceinline__ ScanBlock scan_block(const KdaProblem& p) {
  return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), scan_sequence(p, static_cast<int>(blockIdx.z))};
}

// Where a scan thread works: its CTA's item (V-slice b.vs, value head b.hv, sequence b.n), its
// warp's 16 value columns (vw within the slice) and its fragment coordinates. A state fragment
// sT[j][e] holds value column col0 + 8 (e >> 1), state row 8 j + 2 t + (e & 1).
// C: tokens per chunk (seq.chunk0 counts chunks of C tokens).
template <int K, int BV, int C = kChunk>
struct ScanPlace {
  int lane, warp, g, t;
  int hv, v0, vw, col0;
  SeqInfo seq;
  int nchunks;
  int64_t sbase;  // the sequence's [K, V] state in h0 / ht / dht / dh0
  __device__ __forceinline__ ScanPlace(const KdaProblem& p, const ScanBlock& b)
      : lane(threadIdx.x & 31), warp(threadIdx.x >> 5), g(lane >> 2), t(lane & 3),
        hv(b.hv), v0(b.vs * BV), vw(16 * warp), col0(v0 + vw + g), seq(seq_info<C>(p, b.n)),
        nchunks((seq.len + C - 1) / C),
        sbase(state_base<K>(p, b.n, b.hv)) {}
};

// The operands of one landed stage (base = the stage's first element).
template <typename WT, int K, int BV, int C = kChunk>
struct ScanOperands {
  using S = ScanStage<WT, K, BV, C>;
  const WT *w, *qg, *kg, *Aqk, *Akk, *val;
  const float* dec;  // exp2(G) [K]
  __device__ __forceinline__ explicit ScanOperands(const WT* base)
      : w(base + S::kW), qg(base + S::kQg), kg(base + S::kKg), Aqk(base + S::kAqk), Akk(base + S::kAkk),
        val(base + S::kVal), dec(reinterpret_cast<const float*>(base + S::kDec)) {}
};

// Async load of chunk cc's value slice [64 tokens][v0, v0 + BV) of val ([B*T, HV, V]: v, or do
// for the dh scan) into the stage at base (rows past the sequence end zero-filled); nothing when
// go is false. Branch-free (fixed trip counts, predicated copies): the scans issue it while a
// wgmma is in flight, and a branch there makes ptxas wait for the wgmma first.
// kIdCols: val's rows hold only the V - id_cols real columns (KdaProblem::id_cols; compiled apart,
// so the other scans' code is unchanged).
template <typename WT, int K, int BV, int NT, int C = kChunk, bool kIdCols = false>
__device__ __forceinline__ void scan_load_values(WT* base, const WT* val, const KdaProblem& p, const SeqInfo& seq,
                                                 int cc, int hv, int v0, bool go = true) {
  using S = ScanStage<WT, K, BV, C>;
  const int64_t tok0 = seq.bos + static_cast<int64_t>(cc) * C;
  const int rows = min(C, seq.len - cc * C);
  const int vrow = kIdCols ? p.V - p.id_cols : p.V;
  constexpr int BV8 = BV / 8, N = C * BV8;
#pragma unroll
  for (int it = 0; it < (N + NT - 1) / NT; ++it) {
    const int i = static_cast<int>(threadIdx.x) + it * NT;
    const int r = i / BV8, c8 = (i % BV8) * 8;
    const bool ok = r < rows;
    const int64_t off = ((tok0 + (ok ? r : 0)) * p.HV + hv) * vrow + v0 + c8;
    cp_async16_if(base + S::kVal + r * S::VP + c8, val + off, ok ? 16 : 0, go && (N % NT == 0 || i < N));
  }
}

// Async load of chunk cc of sequence seq into the stage at base (rows past the sequence end are
// zero-filled); nothing when go is false. with_q = false skips qg and Aqk (the backward's re-scan
// computes no output); values = false the value tile (the split forward's virtual columns, whose
// tile stays zero). Branch-free, as scan_load_values. kIdCols: as scan_load_values.
template <typename WT, int K, int BV, int NT, int C = kChunk, bool kIdCols = false>
__device__ __forceinline__ void scan_load_chunk(WT* base, const ScanSources<WT>& src, const KdaProblem& p,
                                                const SeqInfo& seq, int cc, int hv, int v0, bool with_q,
                                                bool go = true, bool values = true) {
  using S = ScanStage<WT, K, BV, C>;
  const int tid = threadIdx.x, HV = p.HV;
  const int64_t tok0 = seq.bos + static_cast<int64_t>(cc) * C;
  const int rows = min(C, seq.len - cc * C);
  constexpr int KV8 = K / 8, NK = C * KV8, NA = C * (C / 8);
#pragma unroll
  for (int it = 0; it < (NK + NT - 1) / NT; ++it) {
    const int i = tid + it * NT;
    const bool in = go && (NK % NT == 0 || i < NK);
    const int r = i / KV8, q = i % KV8;
    const bool ok = r < rows;
    const int64_t off = ((tok0 + (ok ? r : 0)) * HV + hv) * K + 8 * q;
    const int nb = ok ? 16 : 0;
    const int so = S::tile_index(r, 8 * q);  // swizzled
    cp_async16_if(base + S::kW + so, src.w + off, nb, in);
    cp_async16_if(base + S::kQg + so, src.qg + off, nb, in && with_q);
    cp_async16_if(base + S::kKg + so, src.kg + off, nb, in);
  }
#pragma unroll
  for (int it = 0; it < (NA + NT - 1) / NT; ++it) {
    const int i = tid + it * NT;
    const int r = i / (C / 8), c8 = (i % (C / 8)) * 8;
    // above the diagonal: never read
    const bool in = go && (NA % NT == 0 || i < NA) && (c8 >> 4) <= (r >> 4);
    const bool ok = r < rows;
    const int64_t off = ((tok0 + (ok ? r : 0)) * HV + hv) * C + c8;
    const int nb = ok ? 16 : 0;
    const int so = r * S::AP + c8;
    cp_async16_if(base + S::kAqk + so, src.Aqk + off, nb, in && with_q);
    cp_async16_if(base + S::kAkk + so, src.Akk + off, nb, in);
  }
  scan_load_values<WT, K, BV, NT, C, kIdCols>(base, src.val, p, seq, cc, hv, v0, go && values);
  float* dec = reinterpret_cast<float*>(base + S::kDec);
  const float* gdec = src.gdecay + (static_cast<int64_t>(seq.chunk0 + cc) * HV + hv) * K;
  static_assert(K / 4 <= NT, "one exp2(G) piece per thread");
  cp_async16_if(dec + 4 * tid, gdec + 4 * tid, 16, go && tid < K / 4);
}

// Offset of state element (j, e) of this lane in a [K, V] (or, state_v_first, [V, K]) state.
template <int K>
__device__ __forceinline__ int64_t state_index(const KdaProblem& p, int col0, int t, int j, int e) {
  return state_offset<K>(p, 8 * j + 2 * t + (e & 1), col0 + 8 * (e >> 1));
}

// sT from an fp32 state (initial_state, dht) at src + base, or zeros when src is null.
template <int K>
__device__ __forceinline__ void load_state(float (&sT)[K / 8][4], const float* src, int64_t base,
                                           const KdaProblem& p, int col0, int t) {
#pragma unroll
  for (int j = 0; j < K / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) sT[j][e] = src ? src[base + state_index<K>(p, col0, t, j, e)] : 0.f;
}

// sT into a state at dst + base, in dst's type (fp32 final states, WT intermediate states).
template <typename WT, int K, typename OT>
__device__ __forceinline__ void store_state(OT* dst, int64_t base, const float (&sT)[K / 8][4],
                                            const KdaProblem& p, int col0, int t) {
#pragma unroll
  for (int j = 0; j < K / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (std::is_same_v<OT, float>) {
        dst[base + state_index<K>(p, col0, t, j, e)] = sT[j][e];
      } else {
        dst[base + state_index<K>(p, col0, t, j, e)] = Elem<WT>::from_float(sT[j][e]);
      }
    }
}

// sT into one chunk's checkpoint hc ([V][K] in WT: kda_bwd_grads' layout): the state's C tile
// has value columns col0, col0 + 8 as rows and k as columns. Whole-sector stores matter here: the
// pair-wise stores they replaced cost the re-scan and the dh scan ~0.6 ms each at prod8192
// (docs/notes/2026-12-01-kda-backward.md, fifth session).
// go = false stores nothing (predicated, no branch: it runs while a wgmma is in flight).
template <typename WT, int K>
__device__ __forceinline__ void store_state_ckpt(WT* hc, const float (&sT)[K / 8][4], int col0, int t, bool go = true) {
  store_c_rows16<WT, K / 8>(hc + static_cast<int64_t>(col0) * K, hc + static_cast<int64_t>(col0 + 8) * K, go, go, sT,
                            t);
}

// ---- the split scans' pass 1 (kda_fwd_scan_local_kernel, kda_bwd_dh_scan_local_kernel)

// sT = the identity on the virtual columns: row k of virtual column c (c = col0 - V, the column's
// index past the real ones) is 1 where k = c. After a piece the columns hold the product of its
// chunks' transitions applied to the identity, i.e. the piece's map.
template <int K>
__device__ __forceinline__ void identity_state(float (&sT)[K / 8][4], int c0, int t) {
#pragma unroll
  for (int j = 0; j < K / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) sT[j][e] = (8 * j + 2 * t + (e & 1)) == c0 + 8 * (e >> 1) ? 1.f : 0.f;
}

// Zero the value tile of both stages (the virtual columns' v or do), once before the first load:
// their loads then skip the tile (scan_load_chunk's values = false), so it stays zero.
template <typename WT, int K, int BV, int NT>
__device__ __forceinline__ void zero_values(WT* sm) {
  using S = ScanStage<WT, K, BV>;
  constexpr int kTileElems = kChunk * S::VP;
  for (int i = threadIdx.x; i < 2 * kTileElems; i += NT)
    sm[(i / kTileElems) * S::kStageElems + S::kVal + i % kTileElems] = Elem<WT>::from_float(0.f);
}

// sT into one piece's [K][W] fp32 block of split_state's `local` (W = V + K columns: the real ones,
// then the virtual ones), at the thread's columns col0, col0 + 8.
template <int K>
__device__ __forceinline__ void store_split_local(float* dst, int W, const float (&sT)[K / 8][4], int col0, int t) {
#pragma unroll
  for (int j = 0; j < K / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[static_cast<int64_t>(8 * j + 2 * t + (e & 1)) * W + col0 + 8 * (e >> 1)] = sT[j][e];
}

// sT[:, k] *= exp2(G)[k]: the chunk's decay of every state row.
template <int K>
__device__ __forceinline__ void decay_state(float (&sT)[K / 8][4], const float* sDec, int t) {
#pragma unroll
  for (int j = 0; j < K / 8; ++j) {
    const float2 d = *reinterpret_cast<const float2*>(sDec + 8 * j + 2 * t);
    sT[j][0] *= d.x;
    sT[j][1] *= d.y;
    sT[j][2] *= d.x;
    sT[j][3] *= d.y;
  }
}

// A warp's [16 values] x [64 tokens] fp32 result (acc[j][e] = token 8 j + 2 t + (e & 1), value
// g + 8 (e >> 1)) into out ([B*T, HV, V] in WT). Two exchanges give each lane four adjacent values
// of one token: with the lane of the neighbouring value pair (g ^ 1, lane distance 4), then with
// the lane of the neighbouring pair of pairs (g ^ 2, lane distance 8), whose other 8-value half it
// takes. So a warp's store covers the 32 bytes of each of 8 tokens: whole sectors. Rows >= rows are
// past the sequence end and not stored.
template <typename WT, int NJ = kChunk / 8>
__device__ __forceinline__ void store_token_tile(WT* out, const float (&acc)[NJ][4], int64_t tok0, int rows,
                                                 int HV, int hv, int V, int cols0, int g, int t) {
  const bool odd = g & 1, hi = g & 2;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    uint32_t pk[2];  // values cols0 + 8 hh + (g & ~1) + {0, 1} of token tok
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float x0 = acc[j][2 * hh], x1 = acc[j][2 * hh + 1];
      const float recv = __shfl_xor_sync(0xffffffffu, odd ? x0 : x1, 4);
      pk[hh] = odd ? Elem<WT>::pack2(recv, x1) : Elem<WT>::pack2(x0, recv);
    }
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, hi ? pk[0] : pk[1], 8);
    const int tok = 8 * j + 2 * t + (odd ? 1 : 0);
    const int col = cols0 + (hi ? 8 : 0) + (g & ~3);
    const uint2 v = hi ? make_uint2(recv, pk[1]) : make_uint2(pk[0], recv);
    if (tok < rows) *reinterpret_cast<uint2*>(out + ((tok0 + tok) * HV + hv) * V + col) = v;
  }
}

// The scans' launch (kda_launch_shape.h's scan_grid) at V-slice width BV: x_items work items per
// (value head, sequence) row, BV / 16 warps, two ScanStage buffers of dynamic smem. Each scan
// kernel's *_launch (fwd_scan_launch, dh_scan_launch, scans_launch) passes its x_items.
template <typename WT, int K, int BV>
inline LaunchShape scan_launch(const KdaProblem& p, int x_items) {
  return scan_grid(p, x_items, scan_threads<BV>(), ScanStage<WT, K, BV>::kBytes);
}

}  // namespace kernel_fun::kda::dev
