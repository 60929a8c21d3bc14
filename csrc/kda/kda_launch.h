// The KDA launchers csrc/api calls: each enqueues on `stream` and throws std::runtime_error on a
// launch failure. Kernels never validate: csrc/api checks every argument before a launch.
//
// Stage table (docs/kda.md maps each to its math, its fp64 reference and its tests):
//   forward   kda_chunk_map -> kda_fwd_intra -> kda_fwd_scan (or kda_fwd_fused: opt-in, for timing;
//             or split, few long chains: kda_split_map -> kda_fwd_scan_local (pass 1) ->
//             kda_split_chain -> kda_fwd_scan (pass 2, over the pieces) -> kda_split_final; the
//             backward's scans likewise, the dh scan through kda_bwd_dh_scan_local;
//             or streamed, few chains (kda_policy.h): kda_fwd_scan pass 1 with kda_fwd_intra beside
//             it, then kda_fwd_scan pass 2 for any chain pass 1 stopped)
//   backward  kda_chunk_map -> kda_bwd_prep (from the forward's saved Aqk, Akk, M; without them
//             kda_fwd_intra recomputes everything, + M) -> kda_fwd_scan (re-scan, states only)
//             -> kda_bwd_dh_scan (or both scans in one launch: kda_bwd_scans) -> kda_bwd_grads
//             (GVA: summing each group along a chain of its CTAs, its flags zeroed first by
//             kda_bwd_gva_clear), per batch slice
//             (bwd/kda_bwd_slice.h); then kda_bwd_gate_params (bwd/kda_bwd_finish.cuh)
//   every sequence in one chunk (p.recurrent): kda_chunk_map -> kda_recur_fwd; backward
//             kda_chunk_map -> kda_recur_bwd (the slices, then their shares' sum) -> group sums
//             -> kda_bwd_gate_params (recur/kda_recur.cuh)
#pragma once

#include <cuda_runtime.h>

#include "kda/kda_problem.h"

namespace kernel_fun::kda {

// chunk_offsets[n] = first global chunk of sequence n (varlen only; a no-op without cu_seqlens).
void kda_chunk_map(const KdaProblem& p, cudaStream_t stream);

// Forward stages (fwd/).
void kda_fwd_intra(const KdaFwdParams& p, cudaStream_t stream);
void kda_fwd_scan(const KdaFwdParams& p, cudaStream_t stream);
// KERNEL_FUN_KDA_SCAN_BV (benchmarking) where it names a width p can use (64 or 128 dividing V), else 0.
int kda_scan_bv_override(const KdaProblem& p);
// The V-slice width the scan uses for this problem (64 or 128): the streamed or split forward's own,
// else kda_scan_bv_override, else kda_policy.h's fwd_scan_bv_alone (scan_choice at 64 tokens per chunk).
int kda_fwd_scan_bv(const KdaFwdParams& p);
// The streamed forward (kda_policy.h's fwd_stream_choice): the scan's pass 1, kda_fwd_intra beside
// it through p.chunk_ready's flags, the scan's pass 2, at p.fwd_chunk tokens per chunk.
// kda_fwd_stream_bv: its V-slice width for p, or 0 where the forward does not stream (its buffers
// missing, the split scans chosen, or KERNEL_FUN_KDA_FWD_STREAMED: unset or 2 where the model says it
// pays, 1 wherever the overlap is possible, 0 never). kda_forward's one decision (it keeps
// p.chunk_ready only where it streams); csrc/api counts the streamed calls by it (kda_fwd_streamed).
int kda_fwd_stream_bv(const KdaFwdParams& p);
void kda_fwd_streamed(const KdaFwdParams& p, cudaStream_t stream);
// The split scans (fwd/kda_fwd_split.cuh; kda_policy.h's fwd_split_choice): few long chains, each
// sequence's scans in pieces of p.split_chunks chunks at V-slices of p.split_bv (0 / 0: no split),
// both set here once per call by csrc/api before it sizes the workspace, the forward and the backward
// alike, from the options (KdaOptions::split / split_chunks: the front's KERNEL_FUN_KDA_SPLIT and
// _SPLIT_CHUNKS, which a backward receives in its forward's options): 0 never (the default until the
// split is timed on a GPU), 1 wherever fwd_split_possible (the piece length split_chunks if set, else
// the model's, else an eighth of the chunks), 2 where the model says it pays; the width
// KERNEL_FUN_KDA_SCAN_BV where it divides V and K, else the model's, else 64. Never for the token
// recurrence (p.recurrent, decided first).
void kda_split_choose(KdaFwdParams& p);
void kda_split_map(const KdaFwdParams& p, cudaStream_t stream);
void kda_fwd_scan_local(const KdaFwdParams& p, cudaStream_t stream);
void kda_bwd_dh_scan_local(const KdaBwdParams& p, cudaStream_t stream);
void kda_split_chain(const KdaFwdParams& p, bool reverse, cudaStream_t stream);
void kda_split_final(const KdaFwdParams& p, bool reverse, cudaStream_t stream);
// Version 0 of the fused forward (fwd/kda_fwd_fused.cuh): intra and scan in one kernel, no
// workspace. Not the default: forward_sequence (kda_sequence.h) takes it only with
// KERNEL_FUN_KDA_FWD_FUSED=1 (timing), where the factors are not saved and V is a multiple of 128.
bool kda_fwd_fused_wanted(const KdaFwdParams& p);
void kda_fwd_fused(const KdaFwdParams& p, cudaStream_t stream);

// The short-chunk forward (fwd/kda_fwd_intra_c32.cuh): the chunk size a call's forward runs
// (KdaProblem::fwd_chunk; csrc/api decides once, before sizing the workspace): 32 where the call
// allows it (a forward that saves nothing for a backward: no factors, no per-chunk states; not split,
// not the recurrence; K = 128, the instantiated width) and kda_policy.h's fwd_short_chunks_pay
// says it pays (KERNEL_FUN_KDA_FWD_CHUNK=64 / 32: never / wherever allowed), else kChunk. Its two
// stages: the 32-token intra, then the scan over it; or, where the call streams (kda_fwd_stream_bv),
// the streamed forward's three launches at 32-token chunks.
int kda_fwd_chunk_choice(const KdaFwdParams& p);
void kda_fwd_intra_c32(const KdaFwdParams& p, cudaStream_t stream);
void kda_fwd_scan_c32(const KdaFwdParams& p, cudaStream_t stream);

// The fp32 token recurrence (recur/). kda_recurrent_choice: whether a call of p runs it, decided once
// per call by csrc/api (KdaProblem::recurrent), the forward and its backward alike from the options
// (KdaOptions::recurrent, the front's KERNEL_FUN_KDA_RECURRENT): kda_policy.h's recurrent_default, or
// 0 never, 1 wherever recurrent_possible (tests, timing).
bool kda_recurrent_choice(const KdaProblem& p);
void kda_recur_fwd(const KdaFwdParams& p, cudaStream_t stream);
void kda_recur_bwd(const KdaBwdParams& p, cudaStream_t stream);

// Backward stages (bwd/).
void kda_bwd_prep(const KdaBwdParams& p, cudaStream_t stream);
void kda_bwd_dh_scan(const KdaBwdParams& p, cudaStream_t stream);
// The V-slice width of kda_bwd_dh_scan (the scans not paired): kda_policy.h's dh_scan_bv of the
// forward scan's, or KERNEL_FUN_KDA_SCAN_BV (both scans) when set.
int kda_bwd_dh_scan_bv(const KdaBwdParams& p);
// The re-scan (kda_fwd_scan with p.o null) and kda_bwd_dh_scan as one launch (bwd/kda_bwd_scans.cuh).
void kda_bwd_scans(const KdaBwdParams& p, cudaStream_t stream);
// Whether the backward pairs its two scans in one launch: kda_policy.h's bwd_pair_scans, or
// KERNEL_FUN_KDA_BWD_PAIR_SCANS=0|1 (tests, benchmarking).
bool kda_bwd_pair_scans(const KdaBwdParams& p);
void kda_bwd_grads(const KdaBwdParams& p, cudaStream_t stream);
// GVA: dq / dk summed over each query head's value heads (a no-op when HV == H).
void kda_bwd_group_sums(const KdaBwdParams& p, cudaStream_t stream);
// Zeroes the grads kernel's GVA chain flags (KdaBwdParams::gva_flags) for one pass.
void kda_bwd_gva_clear(const KdaBwdParams& p, cudaStream_t stream);
// dA_log / ddt_bias from the per-chunk partials (a no-op without them).
void kda_bwd_gate_params(const KdaBwdParams& p, cudaStream_t stream);

// Batches per backward slice (bwd/kda_bwd_slice.h): kda_policy.h's bwd_slice_batches, or
// KERNEL_FUN_KDA_BWD_SLICE=n (tests, benchmarking; fixed-length batches only). Decides the size of
// the backward's workspace (kda::workspace(..., slice_B)).
int kda_bwd_slice_batches(const KdaProblem& p);

// The stages on a stream, for kda_sequence.h's forward_sequence / backward_sequence (the host
// emulator passes its own).
struct StreamStages {
  cudaStream_t stream;
  void chunk_map(const KdaProblem& p) { kda_chunk_map(p, stream); }
  void recurrent_forward(const KdaFwdParams& p) { kda_recur_fwd(p, stream); }
  void recurrent_backward(const KdaBwdParams& p) { kda_recur_bwd(p, stream); }
  bool fused(const KdaFwdParams& p) { return kda_fwd_fused_wanted(p); }
  void intra_c32(const KdaFwdParams& p) { kda_fwd_intra_c32(p, stream); }
  void scan_c32(const KdaFwdParams& p) { kda_fwd_scan_c32(p, stream); }
  void fused_forward(const KdaFwdParams& p) { kda_fwd_fused(p, stream); }
  void streamed_forward(const KdaFwdParams& p) { kda_fwd_streamed(p, stream); }
  void split_map(const KdaFwdParams& p) { kda_split_map(p, stream); }
  void scan_local(const KdaFwdParams& p) { kda_fwd_scan_local(p, stream); }
  void dh_local(const KdaBwdParams& p) { kda_bwd_dh_scan_local(p, stream); }
  void split_chain(const KdaFwdParams& p, bool reverse) { kda_split_chain(p, reverse, stream); }
  void split_final(const KdaFwdParams& p, bool reverse) { kda_split_final(p, reverse, stream); }
  void intra(const KdaFwdParams& p) { kda_fwd_intra(p, stream); }
  void scan(const KdaFwdParams& p) { kda_fwd_scan(p, stream); }
  void prep(const KdaBwdParams& p) { kda_bwd_prep(p, stream); }
  bool pair_scans(const KdaBwdParams& p) { return kda_bwd_pair_scans(p); }
  void scans(const KdaBwdParams& p) { kda_bwd_scans(p, stream); }
  void dh_scan(const KdaBwdParams& p) { kda_bwd_dh_scan(p, stream); }
  void grads(const KdaBwdParams& p) { kda_bwd_grads(p, stream); }
  void gva_clear(const KdaBwdParams& p) { kda_bwd_gva_clear(p, stream); }
  void group_sums(const KdaBwdParams& p) { kda_bwd_group_sums(p, stream); }
  void gate_params(const KdaBwdParams& p) { kda_bwd_gate_params(p, stream); }
};

// The whole forward / backward, in stage order (kda_sequence.h). The backward runs its stages once per batch slice
// of p.slice_B batches (the size its workspace was allocated for), then kda_bwd_gate_params once.
// kda_forward returns the streamed forward's V-slice width, 0 where the call did not stream
// (kda_fwd_stream_bv, decided once inside it; csrc/api counts the streamed calls by it).
int kda_forward(const KdaFwdParams& p, cudaStream_t stream);
// Whether a backward streams (kda_bwd_grads beside its dh scan): p.dh_ready allocated, the forward's
// saved states, one pass, and kda_policy.h's bwd_stream_wanted (KERNEL_FUN_KDA_BWD_STREAMED: 0 never,
// 2 wherever bwd_stream_possible). kda_backward decides it once and returns it (csrc/api counts them).
bool kda_bwd_streams(const KdaBwdParams& p);
bool kda_backward(const KdaBwdParams& p, cudaStream_t stream);

}  // namespace kernel_fun::kda
