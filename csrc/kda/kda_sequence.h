// The KDA forward's and backward's stage sequences, written once (kda_launch.h has the stage
// table). `Stages` launches each stage: the GPU launchers (kda_fwd.cu, kda_bwd.cu) pass one that
// enqueues on a stream through the dispatch of kda_dispatch.h; the host emulator (tests/emu) one
// that runs the same kernels under kf_emu. A stage added, dropped or reordered here changes both,
// so the emulator cannot test a sequence the GPU does not run. Host code; no CUDA runtime calls.
//
// Stages provides: chunk_map, recurrent_forward, fused (bool) and fused_forward, intra_c32 and scan_c32,
// streamed_forward, intra, scan
// (Fwd / Bwd params), split_map, scan_local, dh_local, split_chain and split_final (with a reverse flag),
// recurrent_backward, prep, pair_scans (bool), scans, dh_scan, grads, group_sums, gate_params.
#pragma once

#include "kda/bwd/kda_bwd_slice.h"
#include "kda/fwd/kda_fwd_split.h"
#include "kda/kda_problem.h"

namespace kernel_fun::kda {

// The split scans (fwd/kda_fwd_split.cuh, kda_policy.h's fwd_split_choice), after the pieces' map
// (split_map). The forward scan: pass 1 (each piece's [E | Phi] from zero), the chain of the pieces'
// initial states, pass 2 (the ordinary scan over the pieces), the last pieces' final states into ht.
template <typename Stages>
void split_scan_passes(const KdaFwdParams& p, Stages& s) {
  s.scan_local(split_local(p));
  s.split_chain(p, false);
  s.scan(split_pieces(p));
  if (p.ht) s.split_final(p, false);
}
// The dh scan, the mirror: pass 1 (each piece's [F | Psi] from a zero gradient at its end), the
// chain from the last piece, pass 2 (the ordinary dh scan over the pieces), the first pieces'
// gradients into dh0.
template <typename Stages>
void split_dh_passes(const KdaBwdParams& p, Stages& s) {
  s.dh_local(split_dh_local(p));
  s.split_chain(split_dh_chain(p), true);
  s.dh_scan(split_dh_pieces(p));
  if (p.dh0) s.split_final(split_dh_chain(p), true);
}

template <typename Stages>
void forward_sequence(const KdaFwdParams& p, Stages& s) {
  s.chunk_map(p);
  if (p.recurrent) {  // every sequence in one chunk: the fp32 token recurrence (recur/kda_recur.cuh)
    s.recurrent_forward(p);
    return;
  }
  if (s.fused(p)) {  // intra and scan in one kernel (fwd/kda_fwd_fused.cuh), where it is chosen
    s.fused_forward(p);
    return;
  }
  if (p.chunk_ready) {  // streamed: the scan with the intra beside it, at either chunk size (the
    s.streamed_forward(p);  // launcher kept chunk_ready only where it streams, never with a split:
    return;                 // kda_fwd_stream_bv)
  }
  if (p.fwd_chunk != kChunk) {  // the 32-token forward, where csrc/api chose it
    s.intra_c32(p);
    s.scan_c32(p);
    return;
  }
  if (p.split_chunks > 0) {  // few long chains: the scan in pieces (csrc/api's decision, before the
    s.intra(p);              // workspace was sized)
    s.split_map(p);
    split_scan_passes(p, s);
    return;
  }
  s.intra(p);
  s.scan(p);
}

// One batch slice: rebuild the forward's workspace (unless the training forward kept its w, qg, kg
// and gdecay: from its saved Aqk / Akk / M, or all of it with M) and the state before every chunk
// (unless the forward saved the states), then the reverse scan and the per-chunk gradients, which
// with GVA sum each group along a chain of their CTAs (its flags zeroed first).
template <typename Stages>
void backward_pass_sequence(const KdaBwdParams& p, Stages& s) {
  if (p.gva_flags) s.gva_clear(p);  // the grads kernel's GVA chain counts up from zero in every pass
  if (!p.saved_workspace) {
    if (p.saved_factors) s.prep(p);
    else s.intra(p);
  }
  if (p.split_chunks > 0) {  // few long chains: both scans in pieces (the re-scan writes states only)
    s.split_map(p);
    if (!p.saved_states) split_scan_passes(p, s);
    split_dh_passes(p, s);
  } else if (p.saved_states) {  // the training forward's scan wrote h_ckpt: no re-scan
    s.dh_scan(p);
  } else if (s.pair_scans(p)) {
    s.scans(p);
  } else {
    s.scan(p);
    s.dh_scan(p);
  }
  s.grads(p);
  s.group_sums(p);
}

// The whole backward: every batch slice (bwd/kda_bwd_slice.h), then dA_log / ddt_bias from the
// per-chunk partials. The re-scan writes states only: o, ht and h_states are null in p.
template <typename Stages>
void backward_sequence(const KdaBwdParams& p, Stages& s) {
  s.chunk_map(p);
  if (p.recurrent) {  // the recurrence's backward writes dq^ / dk^ and the gate partials, as grads does
    s.recurrent_backward(p);
    s.group_sums(p);
    s.gate_params(p);
    return;
  }
  for_each_batch_slice(p, [&s](const KdaBwdParams& slice) { backward_pass_sequence(slice, s); });
  s.gate_params(p);
}

}  // namespace kernel_fun::kda
