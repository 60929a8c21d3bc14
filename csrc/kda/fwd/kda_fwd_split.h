// The split scans' derived problems (host code, no CUDA calls; kda_sequence.h's split_scan_passes /
// split_dh_passes and the kernels of kda_fwd_split.cuh). With p.split_chunks = L > 0 every
// sequence's chunks are cut into pieces of L chunks (kda_problem.h's SplitLayout), and the pieces
// become the sequences of a varlen problem: their first tokens are its cu_seqlens, their first global
// chunks its chunk offsets. A piece's rows of the intra's workspace, its exp2(G) rows and its
// per-chunk states are then addressed exactly as the whole sequence's were (token-indexed rows,
// global chunk indices), so the ordinary scan kernel runs the pieces unchanged.
#pragma once

#include "kda/kda_problem.h"

namespace kernel_fun::kda {

// Pass 2's problem: the ordinary forward scan over the pieces, each from its true initial state (the
// chain's `init`), writing o, the per-chunk states and each piece's final state (`final`; the last
// piece's is copied into ht by kda_split_final_kernel).
inline KdaFwdParams split_pieces(const KdaFwdParams& p) {
  const SplitLayout l = split_layout(p);
  KdaFwdParams q = p;
  q.split_seqs = p.N;
  q.N = l.NP;
  q.cu_seqlens = p.split_map + l.cu;
  q.cu_int64 = true;
  q.chunk_offsets = p.split_map;
  q.h0 = p.split_state + l.init;
  q.ht = p.ht ? p.split_state + l.final_ : nullptr;
  q.chunk_ready = nullptr;  // never streamed
  q.scan_save = nullptr;
  q.scan_pass = 0;
  return q;
}

// Pass 1's problem (kda_fwd_scan_local_kernel): the pieces again, from zero (a sequence's first piece
// from h0, the original one), nothing written but the pieces' local states.
inline KdaFwdParams split_local(const KdaFwdParams& p) {
  KdaFwdParams q = split_pieces(p);
  q.h0 = p.h0;
  q.o = nullptr;
  q.ht = nullptr;
  q.h_states = nullptr;
  q.h_ckpt = nullptr;
  return q;
}

// ---- the split backward's dh scan (the mirror: pieces chained from the end)

// Pass 1 (kda_bwd_dh_scan_local_kernel): every piece but a sequence's first, from a zero gradient
// at its end (a sequence's last piece from dht, the original one), no dv, no checkpoints, no dh0.
inline KdaBwdParams split_dh_local(const KdaBwdParams& p) {
  KdaBwdParams q = p;
  static_cast<KdaFwdParams&>(q) = split_pieces(p);
  q.dv = nullptr;
  q.dh_ckpt = nullptr;
  q.dh0 = nullptr;
  return q;
}

// The reverse chain's and the final copy's view (kda_split_chain_kernel<true>,
// kda_split_final_kernel<true>): the state entering the chain is dht (h0's place), and the first
// piece's gradient goes to dh0 (ht's place).
inline KdaFwdParams split_dh_chain(const KdaBwdParams& p) {
  KdaFwdParams q = p;
  q.h0 = p.dht;
  q.ht = p.dh0;
  return q;
}

// Pass 2: the ordinary dh scan over the pieces, each from its true gradient at its end (the chain's
// `init`), writing dv, the checkpoints dh_{c+1} and each piece's gradient at its start (`final`;
// the first piece's is copied into dh0).
inline KdaBwdParams split_dh_pieces(const KdaBwdParams& p) {
  KdaBwdParams q = p;
  static_cast<KdaFwdParams&>(q) = split_pieces(p);
  const SplitLayout l = split_layout(p);
  q.dht = p.split_state + l.init;
  q.dh0 = p.dh0 ? p.split_state + l.final_ : nullptr;
  return q;
}

}  // namespace kernel_fun::kda
