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

#include "kda/device/primitives.cuh"
#include "kda/device/sequence.cuh"
#include "kda/fwd/kda_fwd_split.h"
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

// The chain, one CTA per (32 value columns, value head, sequence), 2 K threads: thread (k, half) owns
// row k of the state, columns 16 half .. 16 half + 15 of the block. Per piece: the map [K][K]
// staged in shared memory (row pitch K + 1: a warp's 32 rows k read one column j conflict-free) and
// the incoming state [K][32] (row pitch 36: 16-byte rows, so a thread reads its 16 columns of row j
// as four broadcast float4), then next = map x state + local, the sum over j in index order: per j
// one map load and four state loads for 16 FMAs. Every piece's incoming state goes to split_state's
// `init` in h0's layout.
//   forward (kReverse = false): the pieces in order, h_in(0) = h0, h_in(1) = E_0 (the first piece
//     ran from h0), h_in(s + 1) = Phi_s h_in(s) + E_s;
//   reverse (the dh scan's, p = split_dh_chain's view: h0 = dht): the pieces from the last,
//     dh_in(S - 1) = dht, dh_in(S - 2) = F_{S-1} (the last piece ran from dht),
//     dh_in(s - 1) = Psi_s dh_in(s) + F_s.
constexpr int kSplitChainCols = 32;
constexpr int kSplitChainPitch = kSplitChainCols + 4;
template <bool kReverse>
__global__ void __launch_bounds__(256) kda_split_chain_kernel(const KdaFwdParams p) {
  KF_DYN_SMEM(float4, smem4);  // 16-byte aligned: sH's rows are read as float4
  float* smem = reinterpret_cast<float*>(smem4);
  const int K = p.K, V = p.V, HV = p.HV, W = V + K;
  const int hv = blockIdx.y, n = blockIdx.z;
  const int k = threadIdx.x % K, half = threadIdx.x / K;
  const int col = blockIdx.x * kSplitChainCols + 16 * half;  // this thread's first column
  const SplitLayout l = split_layout(p);
  const int* m = p.split_map;
  const int p0 = m[l.seq_piece0 + n], np = m[l.seq_piece0 + n + 1] - p0;
  float* sH = smem;                            // [K][36], 16-byte aligned rows
  float* sPhi = smem + K * kSplitChainPitch;   // [K][K + 1]
  // element (k, v) of a [K, V] state in h0's layout (dev::state_offset, for a run-time K)
  auto at = [&](int kk, int v) { return p.opt.state_v_first ? int64_t{v} * K + kk : int64_t{kk} * V + v; };
  const int64_t size = int64_t{K} * V;
  // the i-th piece of the chain: first to last, or last to first
  auto piece = [&](int i) { return kReverse ? p0 + np - 1 - i : p0 + i; };
  float h[16];
  const float* h0 = p.h0 ? p.h0 + (static_cast<int64_t>(n) * HV + hv) * size : nullptr;
#pragma unroll
  for (int c = 0; c < 16; ++c) h[c] = h0 ? h0[at(k, col + c)] : 0.f;
  auto store_init = [&](int pc) {
    float* dst = p.split_state + l.init + (static_cast<int64_t>(pc) * HV + hv) * size;
#pragma unroll
    for (int c = 0; c < 16; ++c) dst[at(k, col + c)] = h[c];
  };
  store_init(piece(0));
  if (np < 2) return;
  // piece i's step needs piece i - 1's map and local state. Both are loaded into registers one step
  // ahead (issued before the current step's products, in flight during them) instead of by a
  // load-store loop that waited for each of its 16 loads in turn. On the H200 (2026-12-05) that took
  // the chain 0.270 -> 0.243 ms at B1 T32768 H8 with 16 pieces: it still takes ~16 us per piece, so
  // the loads were not its main wait (docs/notes/2026-12-05-cp-copies-split-chain.md).
  constexpr int kMapVecs = 16;  // float4s of the map per thread: K * K / 4 / (2 K) = K / 8 <= 16
  float4 map[kMapVecs];
  float lc[16];
  // a piece's pass-1 result [E | Phi], [K][V + K]
  auto piece_state = [&](int pc) { return p.split_state + (static_cast<int64_t>(pc) * HV + hv) * K * W; };
  auto load_piece = [&](int pc) {
    const float* loc = piece_state(pc);
#pragma unroll
    for (int u = 0; u < kMapVecs; ++u) {
      const int x = 4 * (threadIdx.x + u * blockDim.x);
      if (x < K * K) map[u] = *reinterpret_cast<const float4*>(loc + int64_t{x / K} * W + V + x % K);
    }
#pragma unroll
    for (int c = 0; c < 16; ++c) lc[c] = loc[int64_t{k} * W + col + c];
  };
  // the chain's first piece ran from h0 (dht): its local state is the next one's
#pragma unroll
  for (int c = 0; c < 16; ++c) h[c] = piece_state(piece(0))[int64_t{k} * W + col + c];
  store_init(piece(1));
  if (np > 2) load_piece(piece(1));
  for (int i = 2; i < np; ++i) {
    __syncthreads();  // everyone is done with the previous piece's sPhi / sH
    // the map: scalar stores at pitch K + 1; the state as 16-byte rows
#pragma unroll
    for (int u = 0; u < kMapVecs; ++u) {
      const int x = 4 * (threadIdx.x + u * blockDim.x);
      if (x < K * K) {
        float* d = sPhi + (x / K) * (K + 1) + x % K;
        d[0] = map[u].x;
        d[1] = map[u].y;
        d[2] = map[u].z;
        d[3] = map[u].w;
      }
    }
#pragma unroll
    for (int c = 0; c < 16; c += 4)
      *reinterpret_cast<float4*>(sH + k * kSplitChainPitch + 16 * half + c) = make_float4(h[c], h[c + 1], h[c + 2], h[c + 3]);
    __syncthreads();
#pragma unroll
    for (int c = 0; c < 16; ++c) h[c] = lc[c];  // + the local state
    if (i + 1 < np) load_piece(piece(i));       // the next step's, in flight during the products
    for (int j = 0; j < K; ++j) {
      const float phi = sPhi[k * (K + 1) + j];
      const float4* row = reinterpret_cast<const float4*>(sH + j * kSplitChainPitch + 16 * half);
#pragma unroll
      for (int c4 = 0; c4 < 4; ++c4) {
        const float4 x = row[c4];
        h[4 * c4] = fmaf(phi, x.x, h[4 * c4]);
        h[4 * c4 + 1] = fmaf(phi, x.y, h[4 * c4 + 1]);
        h[4 * c4 + 2] = fmaf(phi, x.z, h[4 * c4 + 2]);
        h[4 * c4 + 3] = fmaf(phi, x.w, h[4 * c4 + 3]);
      }
    }
    store_init(piece(i));
  }
}

inline LaunchShape split_chain_launch(const KdaProblem& p) {
  const size_t smem = sizeof(float) * (static_cast<size_t>(p.K) * (p.K + 1) + static_cast<size_t>(p.K) * kSplitChainPitch);
  return {dim3(static_cast<unsigned>(p.V / kSplitChainCols), static_cast<unsigned>(p.HV), static_cast<unsigned>(p.N)),
          2 * p.K, smem};
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
