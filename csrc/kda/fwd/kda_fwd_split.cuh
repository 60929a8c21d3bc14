// The split scans' small kernels (kda_policy.h's fwd_split_choice; issue 21 item 1): with few, long
// chains, each sequence's chunks are cut into pieces of L = p.split_chunks chunks that run in
// parallel. The forward's stages (kda_sequence.h's split_map, then split_scan_passes):
//   kda_split_map_kernel        the pieces (kda_problem.h's SplitLayout): a varlen problem whose
//                               sequences are the pieces (fwd/kda_fwd_split.h), on the device, so a
//                               varlen batch needs no host sync
//   kda_fwd_scan_local_kernel   pass 1 (kda_fwd_scan.cuh): every piece but a sequence's last from a
//                               zero state, its E (the real columns) and Phi (K virtual columns
//                               from the identity)
//   kda_split_chain_kernel<0>   h_in(0) = h0, h_in(1) = E_0 (the first piece ran from h0),
//                               h_in(s + 1) = Phi_s h_in(s) + E_s: each piece's true initial state, in
//                               fp32, the pieces in order (deterministic)
//   kda_fwd_scan_kernel         pass 2: the ordinary scan over the pieces from h_in (o, the
//                               per-chunk states, each piece's final state)
//   kda_split_final_kernel<0>   the last piece's final state -> ht
// The backward's dh scan mirrors it (kda_sequence.h's split_dh_passes): kda_bwd_dh_scan_local_kernel
// (pass 1: every piece but a sequence's first, from a zero gradient at its end, F and Psi),
// kda_split_chain_kernel<1> (the pieces from the last), kda_bwd_dh_scan_kernel over the pieces
// (pass 2: dv, the checkpoints), kda_split_final_kernel<1> (the first piece's gradient -> dh0). Where
// the backward re-runs the forward scan (no saved states) that is split as the forward's.
// Rounding: pass 2 computes each piece from its h_in exactly as the unsplit scan would from the same
// state; h_in differs from the unsplit chain's state by the rounding of Phi's product and of the
// chain (Phi's columns advance through the same bf16 / fp16 operands as the state), so the results
// match the unsplit forward to the inputs' precision, not bit for bit.
#pragma once

#include <stdexcept>
#include <string>

#include "kda/device/primitives.cuh"
#include "kda/device/sequence.cuh"
#include "kda/fwd/kda_fwd_split.h"
#include "kda/kda_dispatch.h"
#include "kda/kda_launch_shape.h"

namespace kernel_fun::kda {

// The piece map: one thread's loop over the sequences (fwd_split_possible: at most kSplitMaxSeqs of
// them, and at most kSplitMaxExtraPieces pieces beyond one each). Pieces past the count are empty,
// at the end of the token axis, and flagged last (pass 1 skips them; pass 2 finds nothing to do).
__global__ void __launch_bounds__(32) kda_split_map_kernel(const KdaFwdParams p) {
  const SplitLayout l = split_layout(p);
  int* m = p.split_map;
  for (int z = threadIdx.x; z < l.NP; z += 32) m[l.NP + 1 + z] = z;  // the order: the identity
  if (threadIdx.x != 0) return;
  int64_t* cu = reinterpret_cast<int64_t*>(m + l.cu);
  const int L = p.split_chunks;
  int piece = 0, end_chunk = 0;
  int64_t end = 0;
  for (int n = 0; n < p.N; ++n) {
    const dev::SeqInfo s = dev::seq_info(p, n);
    const int nc = (s.len + kChunk - 1) / kChunk;
    const int np = nc > 0 ? (nc + L - 1) / L : 1;  // an empty sequence is one empty piece: ht = h0
    m[l.seq_piece0 + n] = piece;
    for (int i = 0; i < np; ++i, ++piece) {
      cu[piece] = s.bos + static_cast<int64_t>(i) * L * kChunk;
      m[piece] = s.chunk0 + i * L;
      m[l.piece_seq + piece] = n;
      m[l.piece_flags + piece] = (i == 0 ? 1 : 0) | (i == np - 1 ? 2 : 0);
    }
    end = s.bos + s.len;
    end_chunk = s.chunk0 + nc;
  }
  m[l.seq_piece0 + p.N] = piece;
  for (int z = piece; z <= l.NP; ++z) {
    cu[z] = end;
    m[z] = end_chunk;
    if (z < l.NP) {
      m[l.piece_seq + z] = 0;
      m[l.piece_flags + z] = 2;
    }
  }
}

inline LaunchShape split_map_launch(const KdaProblem& p) {
  return {dim3(p.N > 0 ? 1u : 0u), 32, 0};
}

// The chain, one CTA per (kCols value columns, value head, sequence), 2 K threads: thread t owns
// row k = t / 2 of the state and the kCols / 2 columns from (t % 2) kCols / 2 of the block. Per
// piece: the map [K][K] staged in shared memory (16-byte rows) and the incoming state [K][kCols]
// (16-byte rows, read as float4 broadcasts), then next = local + map x state, the sum over j in index
// order (so every column width gives the same bits). Every piece's incoming state goes to
// split_state's `init` in h0's layout.
//   forward (kReverse = false): the pieces in order, h_in(0) = h0, h_in(1) = E_0 (the first piece
//     ran from h0), h_in(s + 1) = Phi_s h_in(s) + E_s;
//   reverse (the dh scan's, p = split_dh_chain's view: h0 = dht): the pieces from the last,
//     dh_in(S - 1) = dht, dh_in(S - 2) = F_{S-1} (the last piece ran from dht),
//     dh_in(s - 1) = Psi_s dh_in(s) + F_s.
// Why this shape (the first form, 32 columns with thread t on row t % K, took ~16 us per piece on the
// H200 at B1 T32768 H8, 32 CTAs): a piece costs K x K x kCols FMAs and the staging of a 64 KB map, so
// split_chain_cols takes the narrowest block whose grid still fits the SMs (8 columns there: 128 CTAs,
// a quarter of the products each). Global traffic is row-contiguous: two threads of a row hold its
// kCols columns (whole 32-byte sectors of E and of `init`), and the map is read and staged with the
// 32 lanes along a row (one 128-byte line per load; conflict-free shared stores).
template <int K, int kCols>
struct SplitChainShape {
  static_assert(kCols == 8 || kCols == 16 || kCols == 32, "the chain's column block");
  static constexpr int kThreads = 2 * K;
  static constexpr int kPer = kCols / 2;      // columns per thread
  static constexpr int kPitch = kCols + 4;    // the incoming state's row pitch (floats): 16-byte rows
  static constexpr int kMapPitch = K + 4;     // the map's: 16-byte rows, read 4 columns at a time
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kMapRows = K / kWarps;  // map rows per thread (16), K / 32 columns of each
  static constexpr int kMapCols = K / 32;
};
// The chain's shared memory: the incoming state and the map, both with 16-byte rows.
template <int K, int kCols>
struct SplitChainSmem {
  alignas(16) float h[K][SplitChainShape<K, kCols>::kPitch];
  alignas(16) float map[K][SplitChainShape<K, kCols>::kMapPitch];
};
template <bool kReverse, int K, int kCols>
__global__ void __launch_bounds__(SplitChainShape<K, kCols>::kThreads) kda_split_chain_kernel(const KdaFwdParams p) {
  using S = SplitChainShape<K, kCols>;
  KF_DYN_SMEM(float4, smem4);  // 16-byte aligned: the rows are read as float4
  auto& sm = *reinterpret_cast<SplitChainSmem<K, kCols>*>(smem4);
  const int V = p.V, HV = p.HV, W = V + K;
  const int hv = blockIdx.y, n = blockIdx.z;
  const int k = threadIdx.x / 2, c0 = S::kPer * (threadIdx.x % 2);  // row, first column in the block
  const int col = blockIdx.x * kCols + c0;                             // ... in the state
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const SplitLayout l = split_layout(p);
  const int* m = p.split_map;
  const int p0 = m[l.seq_piece0 + n], np = m[l.seq_piece0 + n + 1] - p0;
  float* sH = &sm.h[0][0];
  float* sPhi = &sm.map[0][0];
  // the i-th piece of the chain: first to last, or last to first
  auto piece = [&](int i) { return kReverse ? p0 + np - 1 - i : p0 + i; };
  float h[S::kPer];
  const float* h0 = p.h0 ? p.h0 + dev::state_base<K>(p, n, hv) : nullptr;
#pragma unroll
  for (int c = 0; c < S::kPer; ++c)  // scalar: the caller's h0 (dht) may be 4-byte aligned only
    h[c] = h0 ? h0[dev::state_offset<K>(p, k, col + c)] : 0.f;
  // `init` is ours (16-byte aligned, V and col multiples of 4): a row's columns as float4 in the
  // [K, V] layout; in the [V, K] one (state_v_first) the lanes' consecutive rows are the contiguous axis
  auto store_init = [&](int pc) {
    float* dst = p.split_state + l.init + dev::state_base<K>(p, pc, hv);  // [pieces, HV] states
    if (p.opt.state_v_first) {
#pragma unroll
      for (int c = 0; c < S::kPer; ++c) dst[dev::state_offset<K>(p, k, col + c)] = h[c];
    } else {
#pragma unroll
      for (int c = 0; c < S::kPer; c += 4)
        *reinterpret_cast<float4*>(dst + dev::state_offset<K>(p, k, col + c)) = make_float4(h[c], h[c + 1], h[c + 2], h[c + 3]);
    }
  };
  store_init(piece(0));
  if (np < 2) return;
  // piece i's step needs piece i - 1's map and local state. Both are loaded into registers one step
  // ahead (issued before the current step's products, in flight during them): the H200 measured the
  // first form's load-store loop, which waited for each load in turn, at 0.270 against 0.243 ms.
  float map[S::kMapRows][S::kMapCols];
  float lc[S::kPer];
  // a piece's pass-1 result [E | Phi], [K][V + K]
  auto piece_state = [&](int pc) { return p.split_state + (static_cast<int64_t>(pc) * HV + hv) * K * W; };
  auto load_local = [&](int pc) {  // E (F): 16-byte aligned, as `init`
    const float* loc = piece_state(pc) + int64_t{k} * W + col;
#pragma unroll
    for (int c = 0; c < S::kPer; c += 4) {
      const float4 x = *reinterpret_cast<const float4*>(loc + c);
      lc[c] = x.x, lc[c + 1] = x.y, lc[c + 2] = x.z, lc[c + 3] = x.w;
    }
  };
  // the map: warp w holds rows w, w + kWarps, ..., its 32 lanes 32 consecutive columns of each (one
  // 128-byte line per load; shared banks 4 r + lane on the store: no conflict)
  auto load_piece = [&](int pc) {
    const float* loc = piece_state(pc) + int64_t{warp} * W + V + lane;
#pragma unroll
    for (int r = 0; r < S::kMapRows; ++r)
#pragma unroll
      for (int e = 0; e < S::kMapCols; ++e) map[r][e] = loc[int64_t{S::kWarps * r} * W + 32 * e];
    load_local(pc);
  };
  // the chain's first piece ran from h0 (dht): its local state is the next one's
  load_local(piece(0));
#pragma unroll
  for (int c = 0; c < S::kPer; ++c) h[c] = lc[c];
  store_init(piece(1));
  if (np > 2) load_piece(piece(1));
  float* sPhi_mine = sPhi + warp * S::kMapPitch + lane;
  for (int i = 2; i < np; ++i) {
    __syncthreads();  // everyone is done with the previous piece's sPhi / sH
#pragma unroll
    for (int r = 0; r < S::kMapRows; ++r)
#pragma unroll
      for (int e = 0; e < S::kMapCols; ++e) sPhi_mine[S::kWarps * r * S::kMapPitch + 32 * e] = map[r][e];
#pragma unroll
    for (int c = 0; c < S::kPer; c += 4)
      *reinterpret_cast<float4*>(sH + k * S::kPitch + c0 + c) = make_float4(h[c], h[c + 1], h[c + 2], h[c + 3]);
    __syncthreads();
#pragma unroll
    for (int c = 0; c < S::kPer; ++c) h[c] = lc[c];  // + the local state
    if (i + 1 < np) load_piece(piece(i));            // the next step's, in flight during the products
    // four j at a time: a warp reads 16 rows' map entries as float4 (two wavefronts) and two float4
    // of each state row (broadcasts); the FMAs still run over j in index order
#pragma unroll 2
    for (int j = 0; j < K; j += 4) {
      const float4 ph = *reinterpret_cast<const float4*>(sPhi + k * S::kMapPitch + j);
      const float phis[4] = {ph.x, ph.y, ph.z, ph.w};
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const float4* row = reinterpret_cast<const float4*>(sH + (j + jj) * S::kPitch + c0);
#pragma unroll
        for (int c4 = 0; c4 < S::kPer / 4; ++c4) {
          const float4 x = row[c4];
          h[4 * c4] = fmaf(phis[jj], x.x, h[4 * c4]);
          h[4 * c4 + 1] = fmaf(phis[jj], x.y, h[4 * c4 + 1]);
          h[4 * c4 + 2] = fmaf(phis[jj], x.z, h[4 * c4 + 2]);
          h[4 * c4 + 3] = fmaf(phis[jj], x.w, h[4 * c4 + 3]);
        }
      }
    }
    store_init(piece(i));
  }
}

// The chain's column block: the narrowest of 8 / 16 / 32 whose grid (V / cols x HV x N CTAs, one
// per SM: ~66 KB of shared memory and ~64 registers of staged map per thread) still fits the device's
// `sms` SMs, else 32. The width changes no result bit (each sum runs over j in the same order).
inline int split_chain_cols(const KdaProblem& p, int sms) {
  int cols = 32;
  while (cols > 8 && static_cast<long>(p.V / (cols / 2)) * p.HV * p.N <= sms) cols /= 2;
  return cols;
}

// The chain's launch (the launcher's and the emulator's one description): the kernel of a direction,
// key size and column block, and its shape; throws naming the stage for an unsupported K or width.
struct SplitChainLaunch {
  void (*kernel)(KdaFwdParams);
  LaunchShape shape;
};
inline SplitChainLaunch split_chain_launch(const KdaProblem& p, bool reverse, int cols) {
  SplitChainLaunch out{nullptr, {}};
  dispatch_k(p.K, "kda_split_chain", [&](auto kt) {
    constexpr int K = decltype(kt)::value;
    auto set = [&](auto c) {
      constexpr int C = decltype(c)::value;
      out.kernel = reverse ? kda_split_chain_kernel<true, K, C> : kda_split_chain_kernel<false, K, C>;
      out.shape = {dim3(static_cast<unsigned>(p.V / C), static_cast<unsigned>(p.HV), static_cast<unsigned>(p.N)),
                   SplitChainShape<K, C>::kThreads, sizeof(SplitChainSmem<K, C>)};
    };
    if (cols == 8) set(IntTag<8>{});
    if (cols == 16) set(IntTag<16>{});
    if (cols == 32) set(IntTag<32>{});
  });
  if (!out.kernel)
    throw std::invalid_argument("kda_split_chain: the column block must be 8, 16 or 32, got " + std::to_string(cols));
  return out;
}

// The last piece's final state of each sequence into ht (kReverse: the first piece's gradient at
// its start into dh0, through split_dh_chain's view, whose ht is dh0); both in h0's layout, one
// contiguous [K, V] block per (sequence, value head).
constexpr int kSplitFinalBlocks = 8;
template <bool kReverse>
__global__ void __launch_bounds__(256) kda_split_final_kernel(const KdaFwdParams p) {
  const SplitLayout l = split_layout(p);
  const int hv = blockIdx.y, n = blockIdx.z;
  const int pc = kReverse ? p.split_map[l.seq_piece0 + n] : p.split_map[l.seq_piece0 + n + 1] - 1;
  const int64_t size = int64_t{p.K} * p.V;
  const float* src = p.split_state + l.final_ + (static_cast<int64_t>(pc) * p.HV + hv) * size;
  float* dst = p.ht + (static_cast<int64_t>(n) * p.HV + hv) * size;
  for (int64_t i = blockIdx.x * 256 + threadIdx.x; i < size; i += kSplitFinalBlocks * 256) dst[i] = src[i];
}

inline LaunchShape split_final_launch(const KdaProblem& p) {
  return {dim3(kSplitFinalBlocks, static_cast<unsigned>(p.HV), static_cast<unsigned>(p.N)), 256, 0};
}

}  // namespace kernel_fun::kda
