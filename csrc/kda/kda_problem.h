// KDA (Kimi Delta Attention) on sm_90a: the problem description every KDA kernel reads, the one
// options object, and the forward / backward parameter structs built on them (as FA3's
// Flash_bwd_params extends Flash_fwd_params). Torch-free: csrc/api fills these from tensors.
//
// docs/kda.md has the stage table: which kernel computes which stage of the math, its fp64
// reference (src/kernel_fun/ref/) and its tests.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/cuda_check.h"

namespace kernel_fun::kda {

constexpr int kChunk = 64;  // BT: tokens per chunk (fla's default chunk_size)
constexpr int kC32 = 32;    // the short-chunk forward's (fwd/kda_fwd_intra_c32.cuh; KdaProblem::fwd_chunk)
// The varlen chunk map orders up to this many sequences longest first for the scans' grid
// (kda_chunk_map, dev::scan_sequence); past it the order is the identity.
constexpr int kMaxOrderedSequences = 4096;
// The fp32 token recurrence (recur/kda_recur.cuh): value columns per slice, and its backward's
// workspace per (sequence, value head, slice): the state before each of up to 64 tokens
// ([64][K][32]), the slice's shares of dq^ / dk^ / dgate ([3][64][K]) and of dbeta ([64]).
constexpr int kRecurCols = 32;
__host__ __device__ inline int64_t recur_slice_floats(int K) {
  return int64_t{kChunk} * K * kRecurCols + 3 * int64_t{kChunk} * K + kChunk;
}

// How the per-step log-decay is obtained from g (docs/contract.md, "The gate").
enum class GateMode : int {
  kPrecomputed = 0,      // g is already the natural-log gate (<= 0)
  kUnbounded = 1,        // -exp(A_log[h]) * softplus(g + dt_bias[h, :])
  kBounded = 2,          // lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, :]))
  kBoundedNoALog = 3,    // lower_bound * sigmoid(g + dt_bias[h, :])
};

// The options of one chunk_kda call. Built once in Python (kernel_fun.kda._options.KdaOptions),
// passed to every op as one string and parsed here; nothing else restates the list.
struct KdaOptions {
  float scale = 1.f;
  GateMode gate_mode = GateMode::kPrecomputed;
  float lower_bound = 0.f;
  bool l2norm = false;
  float beta_sigmoid_scale = 0.f;  // 0: beta used as given; 1, or 2 with allow_neg_eigval: s * sigmoid(beta)
  bool state_v_first = false;      // states (h0, ht, dh0, dht, h_states) are [.., V, K]
  // fla's chunk_size (32 or 64). Our kernels choose their own chunking (the result differs only by
  // rounding), so it matters only where it shapes an output: the per-chunk states h
  // (return_intermediate_states) are one per chunk_size tokens, and ours are per 64.
  int chunk_size = kChunk;
  bool intermediate_states = false;  // return_intermediate_states: the call asks for h
  // With cu_seqlens: the longest sequence's tokens, from the front's host copy of cu_seqlens (eager
  // calls validate one anyway), for the launch model (kda_policy.h's longest_chunks); 0 where the
  // front read none (torch.compile, use_graph). Unused without cu_seqlens.
  int max_seq_len = 0;
  // The launch switches that decide what a training forward leaves its backward, set by the front
  // (KERNEL_FUN_KDA_SPLIT, _SPLIT_CHUNKS, KERNEL_FUN_KDA_RECURRENT) so that a backward, which gets its
  // forward's options, decides as its forward did. The split scans (kda_split_choose): 0 never, 1
  // wherever fwd_split_possible, 2 where fwd_split_choice says it pays; split_chunks the piece
  // length (0: the model's). The token recurrence (kda_recurrent_choice): -1 the policy
  // (recurrent_default), 0 never, 1 wherever recurrent_possible.
  int split = 0;
  int split_chunks = 0;
  int recurrent = -1;
};

// Parses KdaOptions.encode()'s "key=value;..." text. Returns "" on success, else a message naming
// the offending key. Every key must be present exactly once; unknown keys are errors.
std::string parse_options(const std::string& text, KdaOptions& out);

namespace dev {
// Whether the decays inside one 16-row block may be factorised through a row m of the block,
// exp2(g_r - g_s) = exp2(g_r - g_m) exp2(g_m - g_s), with one factor of the pair > 1: only for the
// bounded gate lower_bound * sigmoid(..) with lower_bound >= -5 (fla's safe_gate range,
// docs/contract.md). Every per-step log2 decay then lies in (-5 / ln2, 0], so a factor over at most
// 8 steps stays within 2^+-57.7, far inside fp32's (and tf32's) exponent range. Every other gate
// is unbounded per step (exp(A_log) = 16, steps at -1000): one-sided only (docs/numerics.md). Used by
// kda_bwd_grads (its diagonal blocks) and kda_fwd_intra (P2's diagonal blocks): each has a kernel per form;
// and by the launch policy, which streams the bounded form's backward with fewer chains (bwd_stream_wanted).
__host__ __device__ inline bool block_midpoint_ok(const KdaOptions& o) {
  return (o.gate_mode == GateMode::kBounded || o.gate_mode == GateMode::kBoundedNoALog) && o.lower_bound >= -5.f &&
         o.lower_bound < 0.f;
}
}  // namespace dev

// Shapes, dtypes, the sequence map and the inputs: what the forward and the backward share.
// Layouts (all contiguous): q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV];
// A_log [HV] fp32; dt_bias [HV * K] fp32; h0 [N, HV, K, V] ([N, HV, V, K] with state_v_first) fp32.
struct KdaProblem {
  int B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  int N = 0;           // sequences: B, or len(cu_seqlens) - 1
  int max_chunks = 0;  // grid bound of the per-chunk kernels: B * ceil(T / 64), or T / 64 + N with varlen

  const void* cu_seqlens = nullptr;  // [N + 1] int32 or int64 on the device, or null (fixed length)
  bool cu_int64 = false;
  int* chunk_offsets = nullptr;      // [2N + 1]: first global chunk of each sequence, then the sequences
                                     // longest first (built on the device, kda_chunk_map)

  DType dtype = DType::kBFloat16;  // q, k, v, o and the 16-bit workspace (WT)
  DType g_dtype = DType::kFloat32;
  DType beta_dtype = DType::kFloat32;
  KdaOptions opt;

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* g = nullptr;
  const void* beta = nullptr;
  const float* A_log = nullptr;    // null unless the in-kernel gate uses it
  const float* dt_bias = nullptr;  // null when absent
  const float* h0 = nullptr;

  // Every sequence fits in one chunk and the call runs the fp32 token recurrence instead of the
  // chunk kernels (kda_policy.h's recurrent_possible; decided once per call by the launcher side,
  // kda_recurrent_choice, and never for the stage ops, which read the chunk kernels' workspace).
  bool recurrent = false;
  // The scans (the forward's, the backward's re-scan and dh scan) split into pieces of this many chunks
  // that run in parallel (fwd/kda_fwd_split.cuh; kda_policy.h's fwd_split_choice), or 0: one chain per
  // sequence. Decided once per call by csrc/api (kda_split_choose, with KdaFwdParams::split_bv), before
  // the workspace is sized (kda::workspace holds the pieces' states).
  int split_chunks = 0;
  // The forward's tokens per chunk: kChunk, or 32 for the short-chunk forward (fwd/kda_fwd_intra_c32.cuh;
  // where the forward saves nothing for a backward and kda_policy.h's fwd_short_chunks_pay says it
  // pays: kda_fwd_chunk_choice). Decided once per call by csrc/api, before the workspace is sized
  // (gdecay holds one row per chunk of this size).
  int fwd_chunk = kChunk;
  // The split forward's derived problem (fwd/kda_fwd_split.h's split_pieces): the sequences' count,
  // whose pieces are this problem's N sequences; 0 in every other problem.
  int split_seqs = 0;
  // Identity columns (the context-parallel call of a document that began on an earlier rank,
  // kernel_fun/kda/_cp.py): the last id_cols (= K) of the V state columns are virtual. Their value
  // tile is zero and their initial state the identity (column V - id_cols + j = e_j), so their
  // outputs are Q (o_t(0)'s share of the unknown incoming state: o = o(0) + Q S_in) and their final
  // state the map Phi; v and o hold only the V - id_cols real columns (their row width), Q goes to
  // KdaFwdParams::o_id. The forward's plain two-kernel path only (csrc/api's run_fwd; no h0, no
  // per-chunk states, no streaming, split, recurrence or short chunks: kda_fwd_scan_id_kernel).
  int id_cols = 0;
};

// The per-chunk grids' bound on a problem's chunks at C tokens per chunk: B * ceil(T / C), or T / C + N
// with cu_seqlens (each sequence adds at most one partial chunk). KdaProblem::max_chunks is this at
// kChunk (csrc/api); the 32-token forward sizes its grid and gdecay by it at 32.
__host__ __device__ inline int64_t chunk_bound(const KdaProblem& p, int C) {
  return p.cu_seqlens ? int64_t{p.T} / C + p.N : int64_t{p.B} * ((p.T + C - 1) / C);
}

// Forward: the two kernels' outputs and the workspace between them (dtype WT unless noted;
// token-indexed rows, so sequences never mix).
struct KdaFwdParams : KdaProblem {
  void* o = nullptr;         // [B, T, HV, V]; null in the backward's re-scan (only states wanted);
                             // [B, T, HV, V - id_cols] with identity columns
  void* o_id = nullptr;      // [B, T, HV, id_cols]: the identity columns' outputs Q, or null
  float* ht = nullptr;       // final state, layout of h0, or null
  void* h_states = nullptr;  // [chunks, HV, K, V] ([.., V, K] if state_v_first), or null

  void* w = nullptr;         // [B*T, HV, K]   Akk @ (exp2(g2) * k)
  void* qg = nullptr;        // [B*T, HV, K]   scale * q * exp2(g2)
  void* kg = nullptr;        // [B*T, HV, K]   k * exp2(G - g2)
  void* Aqk = nullptr;       // [B*T, HV, 64]  scale * q_i k_j exp2(g2_i - g2_j), j <= i (row i's chunk)
  void* Akk = nullptr;       // [B*T, HV, 64]  (I + L)^-1 diag(beta)
  void* M = nullptr;         // [B*T, HV, 64]  (I + L)^-1 (backward only), or null
  float* gdecay = nullptr;   // [max_chunks, HV, K]  exp2(G) per chunk (G = g2 of its last valid row)
  void* h_ckpt = nullptr;    // [max_chunks, HV, V, K] state before each chunk, or null: written by the
                             // backward's re-scan, or by a training forward's scan (saved_states)
  int* chunk_ready = nullptr;  // the streamed forward only (kda_policy.h's fwd_stream_choice), else null:
                               // [stream_chunks * HV] flags (chunks at the call's size), 1 once the intra
                               // CTA of (chunk, hv) has written its rows; the intra CTAs' done counter
                               // (stream_done_offset); then one resume chunk per scan CTA (from
                               // stream_progress_offset); zeroed before each streamed forward
  float* scan_save = nullptr;  // the streamed forward: [N, HV, K, V] fp32, the state of each scan chain that
                               // stopped early (its first pass waited too long), for the resume pass
  int scan_pass = 0;           // kda_fwd_scan: 0 ordinary; 1 the streamed first pass (waits for chunk
                               // flags, may stop early); 2 the resume pass (from scan_save, no waits)
  int stream_bv = 0;           // the streamed forward's V-slice width, decided once per call (kda_forward)
  int split_bv = 0;            // the split scans' V-slice width (kda_split_choose, with split_chunks)
  int* split_map = nullptr;    // the split forward (p.split_chunks > 0): the pieces' map (SplitLayout), int32
  float* split_state = nullptr;  // the split forward: the pieces' local states, initial and final states, fp32
  long long* dbg_intra_clock = nullptr;  // optional [max_chunks * HV][16] phase clocks of kda_fwd_intra
                                         // (profiling, the forward stages op only)
};

// Backward: gradients, the reverse scan's checkpoints and the per-chunk partial sums.
struct KdaBwdParams : KdaFwdParams {
  // Aqk, Akk and M come from the forward (saved for the backward): kda_bwd_prep rebuilds only w, qg,
  // kg and gdecay; otherwise kda_fwd_intra recomputes all of them.
  bool saved_factors = false;
  // h_ckpt is the training forward's whole-batch buffer ([max_chunks, HV, V, K]; a batch slice uses
  // its part of it), and saved_states: the forward's scan wrote the state before every chunk into
  // it (kda_policy.h's save_states_pays), so the backward runs no re-scan; otherwise the re-scan
  // writes it.
  bool h_ckpt_given = false;
  bool saved_states = false;
  // w, qg, kg and gdecay are the training forward's (its intra wrote them, whole batch; a batch slice
  // uses its part): the backward runs no kda_bwd_prep.
  bool saved_workspace = false;
  const void* dout = nullptr;  // do [B, T, HV, V], dtype WT
  const float* dht = nullptr;  // gradient of the final state (layout of h0), or null

  void* dq = nullptr;          // [B, T, H, K] WT
  void* dk = nullptr;          // [B, T, H, K] WT
  void* dv = nullptr;          // [B, T, HV, V] WT
  void* dg = nullptr;          // [B, T, HV, K] g_dtype
  void* dbeta = nullptr;       // [B, T, HV] beta_dtype
  float* dh0 = nullptr;        // layout of h0, or null

  void* dh_ckpt = nullptr;     // [max_chunks, HV, V, K] WT: dh_{c+1}, the state gradient chunk c reads
  int slice_B = 0;             // batches per backward slice (kda_bwd_slice.h; 0 or >= B: one pass),
                               // the size the per-slice workspace buffers were allocated for
  float* dqhat = nullptr;      // GVA or the recurrence, else null, fp32: d(normalised q) per value head,
  float* dkhat = nullptr;      //   [B*T, HV, K]; with gva_flags [B*T, HV - H, K] (gva_hat_row)
  float* pbias = nullptr;      // [max_chunks, HV, K] per-chunk sums of d(g + dt_bias), or null
  float* pA = nullptr;         // [max_chunks, HV] per-chunk sums of dgate * d(gate)/d(A_log), or null
  float* recur_state = nullptr;  // the recurrence's backward (p.recurrent): [N, HV, V / 32] x recur_slice_floats(K) fp32
  float* dA_log = nullptr;     // [HV] fp32, or null
  float* ddt_bias = nullptr;   // [HV * K] fp32, or null
  float* dbg_dA = nullptr;     // optional stage dumps for tests: [B*T, HV, 64] fp32 dAqk (scaled),
  float* dbg_dL = nullptr;     //   and dL = -(M^T dM M^T) (strictly lower)
  long long* dbg_clock = nullptr;  // optional [max_chunks * HV][16] phase clocks of kda_bwd_grads (profiling)
  // The streamed backward only (kda_policy.h's bwd_stream_wanted), else null: kda_bwd_grads runs beside
  // the dh scan, each grads CTA waiting until the dh scan has stored the checkpoint it reads. Layout
  // (bwd_stream_ints): per (sequence, value head, dh-scan V-slice) the chunks that slice has stored,
  // counted from the sequence's end ([N][HV][V / dh_bv]), then the done counters of the two grads
  // kernels (bwd_stream_done_offset); zeroed before each streamed dh scan.
  int* dh_ready = nullptr;
  int dh_bv = 0;               // the dh scan's V-slice width (the counters' slices), with dh_ready
  int balance = 0;             // kda_bwd_grads' load balancing, a bit mask (A/B timing with
                               // KERNEL_FUN_KDA_BWD_BALANCE=0..3): 1 = I1's column side over the
                               // warps, 2 = E1's dAkk tiles to the warps with the least dkA work.
                               // Off: on the H200 bit 1 made the kernel ~2% slower (its hand-over
                               // moves the cost past I1's barrier) and bit 2 changed nothing
                               // (docs/notes/2026-12-01-kda-backward.md, ninth session)
  // GVA (HV != H): one flag per (chunk, q/k head) [chunks of the pass, H], zeroed at the start of each
  // pass (kda_bwd_gva_clear): kda_bwd_grads sums dq^ / dk^ over the group along a chain of its CTAs (the
  // flag counts the value heads that have added theirs; grads_gva_chain), and kda_bwd_group_sum does
  // not run; dqhat / dkhat then hold the running sums of heads 0 .. G - 2 of each group (the last head
  // writes none, so it has no rows: gva_hat_row). Null: every head's dq^ / dk^ goes to dqhat / dkhat
  // ([B*T, HV, K]) and kda_bwd_group_sum finishes (the one-chunk recurrence, and the host emulator's
  // reference for the chain).
  // (Last in the struct: the fields before it keep their parameter offsets, and the kernels without
  // the chain their SASS.)
  int* gva_flags = nullptr;
};

// ---------------------------------------------------------------- workspace
// Every buffer the launches need beyond the op's own inputs and outputs, with its size: the one
// place the workspace is described (csrc/api allocates from this list).
struct WorkBuffer {
  enum Id : int { kW, kQg, kKg, kAqk, kAkk, kM, kGdecay, kChunkOffsets, kHCkpt, kDhCkpt, kDqhat, kDkhat,
                  kPbias, kPA, kChunkReady, kScanSave, kRecurState, kSplitMap, kSplitState, kDhReady, kGvaFlags,
                  kCount };
  Id id;
  const char* name;
  std::vector<int64_t> shape;
  DType dtype;       // kFloat32 for fp32 buffers, the problem's dtype for 16-bit ones
  bool is_int = false;  // chunk_offsets (int32)
};

// The GVA chain's row of value head hv (not its group's last) at token row `tok` in dqhat / dkhat
// ([rows, HV - H, K]: the G - 1 running sums of each q / k head's group, in head order; the group's
// last head holds the whole sum in registers and stores none), in floats. h is derived here, not
// passed in: passing the grads context's h moved ptxas' spills in the plain unbounded kGva kernel from
// 4 / 12 to 36 / 56 bytes (docs/notes/2026-12-06-gva-workspace.md).
__host__ __device__ inline int64_t gva_hat_row(int64_t tok, int H, int HV, int hv, int K) {
  const int G = HV / H, h = hv / G;
  return (tok * (HV - H) + hv - h) * K;  // hv - h = h (G - 1) + (hv - h G): slot rg of group h
}

// gva_flags' length for one backward pass (a batch slice's chunks, or all of them): a flag per (chunk,
// q/k head).
__host__ __device__ inline int64_t gva_flag_count(const KdaProblem& p) { return int64_t{p.max_chunks} * p.H; }

// The chunks the streamed forward publishes, one flag per chunk and value head: every chunk at the
// call's size (p.fwd_chunk: the 64-token or the 32-token forward streams alike).
__host__ __device__ inline int64_t stream_chunks(const KdaProblem& p) { return chunk_bound(p, p.fwd_chunk); }
// The streamed forward (kda_policy.h's fwd_stream_choice) needs few scan chains: at most 256 at the
// widest slice (no device has more SMs to spare), fixed length, and at most 65535 chunk rows (the
// intra's grid y, dev::streamed_chunk) at the call's chunk size.
inline bool fwd_stream_possible(const KdaProblem& p) {
  return !p.cu_seqlens && p.id_cols == 0 && p.N > 0 && p.HV > 0 && p.max_chunks > 0 &&
         stream_chunks(p) <= 65535 && static_cast<int64_t>(p.HV) * p.N * (p.V / 128) <= 256 && p.V % 64 == 0;
}
// chunk_ready's length: the flags, the intra's done counter, one resume chunk per scan CTA (BV = 64),
// and 3 ints of padding: the scan reads flags in aligned groups of four (dev::prefetch_flag)
inline int64_t stream_flag_count(const KdaProblem& p) {
  return stream_chunks(p) * p.HV + 1 + static_cast<int64_t>(p.HV) * p.N * (p.V / 64) + 3;
}
// Where the intra's done counter sits in chunk_ready (after the flags), and the resume chunks after it.
__host__ __device__ inline int64_t stream_done_offset(const KdaProblem& p) { return stream_chunks(p) * p.HV; }
__host__ __device__ inline int64_t stream_progress_offset(const KdaProblem& p) { return stream_done_offset(p) + 1; }

// The streamed backward (kda_policy.h's bwd_stream_wanted): fixed length, no split, the grads grid's
// chunk rows (its grid z: kda_bwd_grads.cuh's grads_cell) at most 65535, and few dh-scan chains (at
// most 256 at the narrowest slice, as the streamed forward).
inline bool bwd_stream_possible(const KdaProblem& p) {
  return !p.cu_seqlens && p.id_cols == 0 && p.split_chunks == 0 && p.N > 0 && p.HV > 0 && p.max_chunks > 0 &&
         p.max_chunks <= 65535 && static_cast<int64_t>(p.HV) * p.N * (p.V / 64) <= 256 && p.V % 64 == 0;
}
// dh_ready's length: a counter per (sequence, value head, 64-column slice) -- enough for either
// width -- then the done counters of kda_bwd_grads_last_kernel and kda_bwd_grads_kernel.
inline int64_t bwd_stream_ints(const KdaProblem& p) { return static_cast<int64_t>(p.N) * p.HV * (p.V / 64) + 2; }
__host__ __device__ inline int64_t bwd_stream_done_offset(const KdaProblem& p) {
  return static_cast<int64_t>(p.N) * p.HV * (p.V / 64);
}

// ---- the split forward (fwd/kda_fwd_split.cuh): each sequence's chunks cut into pieces of
// p.split_chunks chunks (at least one piece per sequence, empty ones included), run as a derived varlen
// problem whose sequences are the pieces.
// At most this many pieces beyond one per sequence: the piece length is at least
// ceil(max_chunks / kSplitMaxExtraPieces) (kda_policy.h's split_chunks_for), so the pieces' states
// stay a bounded multiple of the sequences' own.
constexpr int kSplitMaxExtraPieces = 32;
// The pieces a problem can have (the derived problem's N, its grids' bound): every sequence has
// max(1, ceil(chunks / L)) <= 1 + chunks / L pieces, and the chunks add up to at most max_chunks.
__host__ __device__ inline int split_piece_bound(const KdaProblem& p) {
  return p.split_chunks > 0 ? p.N + p.max_chunks / p.split_chunks : 0;
}
// Where the pieces live in the two split buffers (NP = split_piece_bound). split_map, int32:
//   [0, NP]          chunk offsets of the pieces, then [NP + 1, 2 NP + 1) their order (the identity):
//                    the derived problem's chunk_offsets (dev::seq_info, dev::scan_sequence)
//   cu  (int64)      [NP + 1] the pieces' first tokens, then the end: the derived problem's cu_seqlens
//   seq_piece0       [N + 1] the first piece of each sequence, then the piece count
//   piece_seq        [NP] the sequence of each piece
//   piece_flags      [NP] bit 0: the sequence's first piece, bit 1: its last (pieces past the count: 2)
// split_state, fp32:
//   local            [NP, HV, K, V + K] each piece's final state from zero (columns < V: E) and the
//                    product of its chunks' transitions (columns V + j: Phi e_j), pass 1
//   init             [NP, HV, K, V] (h0's layout) the true state entering each piece, from the chain
//   final            [NP, HV, K, V] (h0's layout) each piece's final state, pass 2 (the last -> ht)
struct SplitLayout {
  int N, NP;
  int64_t cu, seq_piece0, piece_seq, piece_flags, map_ints;  // split_map offsets (int32 units)
  int64_t init, final_, state_floats;                         // split_state offsets (floats); local at 0
  __host__ __device__ SplitLayout(int n, int np, int HV, int K, int V) : N(n), NP(np) {
    cu = (2 * int64_t{NP} + 2) & ~int64_t{1};  // past the chunk offsets and the order, 8-byte aligned
    seq_piece0 = cu + 2 * (int64_t{NP} + 1);
    piece_seq = seq_piece0 + N + 1;
    piece_flags = piece_seq + NP;
    map_ints = piece_flags + NP;
    const int64_t st = int64_t{HV} * K;
    init = int64_t{NP} * st * (V + K);
    final_ = init + int64_t{NP} * st * V;
    state_floats = final_ + int64_t{NP} * st * V;
  }
};
// The layout of a problem (split_chunks > 0) or of its derived problem (split_seqs > 0: N is the
// pieces' bound, split_seqs the sequences').
__host__ __device__ inline SplitLayout split_layout(const KdaProblem& p) {
  return p.split_seqs > 0 ? SplitLayout(p.split_seqs, p.N, p.HV, p.K, p.V)
                          : SplitLayout(p.N, split_piece_bound(p), p.HV, p.K, p.V);
}

// Whether a backward of p runs in slices of slice_B batches (bwd/kda_bwd_slice.h): fixed length only.
inline bool sliced_backward(const KdaProblem& p, int slice_B) {
  return !p.cu_seqlens && slice_B > 0 && slice_B < p.B;
}
// A fixed-length problem's shape cut to nb of its batches (a backward slice: bwd/kda_bwd_slice.h).
inline void keep_batches(KdaProblem& s, int nb) {
  s.B = s.N = nb;
  s.max_chunks = static_cast<int>(int64_t{nb} * ((int64_t{s.T} + kChunk - 1) / kChunk));
}
// The problem one pass of that backward runs: p itself, or its first (largest) batch slice -- the
// last may be smaller, and every per-pass choice (the streamed backward's) holds for a smaller one.
inline KdaProblem backward_pass_problem(const KdaProblem& p, int slice_B) {
  KdaProblem s = p;
  if (sliced_backward(p, slice_B)) keep_batches(s, slice_B);
  return s;
}

// The forward (backward == false) or the whole backward's workspace. Buffers not needed for this
// problem (GVA sums when HV == H, gate partials without an in-kernel gate, the factors the forward
// saved: saved_factors; h_ckpt where the forward passes its buffer: h_ckpt_given) are absent.
// slice_B > 0 (fixed-length backward, bwd/kda_bwd_slice.h): the per-token and per-chunk buffers
// hold slice_B batches, reused slice after slice; the gate partials pbias / pA stay full-size
// (summed once after the last slice).
inline std::vector<WorkBuffer> workspace(const KdaProblem& p, bool backward, bool saved_factors = false,
                                         int slice_B = 0, bool h_ckpt_given = false,
                                         bool workspace_given = false) {
  // p.recurrent (the fp32 token recurrence, recur/kda_recur.cuh) needs none of the chunk kernels'
  // buffers: the chunk map (a varlen sequence's row of the gate partials is its chunk), and in the
  // backward the replayed states, dq^ / dk^ (kda_bwd_group_sum finishes them, GVA or not) and the
  // gate partials. One pass, never sliced.
  const bool chunked = !p.recurrent;
  const bool sliced = backward && chunked && sliced_backward(p, slice_B);
  const int64_t rows = static_cast<int64_t>(sliced ? slice_B : p.B) * p.T;
  const int64_t HV = p.HV, K = p.K, V = p.V, Cfull = p.max_chunks;
  const int64_t C = sliced ? slice_B * ((int64_t{p.T} + kChunk - 1) / kChunk) : Cfull;
  const DType wt = p.dtype, f32 = DType::kFloat32;
  std::vector<WorkBuffer> b;
  // the split scans' pieces (kda_policy.h's fwd_split_choice), forward and backward alike; empty where
  // the call does not split, so the list keeps its order
  auto push_split = [&] {
    const SplitLayout sl = split_layout(p);
    b.push_back({WorkBuffer::kSplitMap, "split_map", {p.split_chunks > 0 ? sl.map_ints : 0}, f32, true});
    b.push_back({WorkBuffer::kSplitState, "split_state", {p.split_chunks > 0 ? sl.state_floats : 0}, f32});
  };
  if (chunked && !workspace_given) {  // else the caller's (a training forward's, kept for its backward)
    b.push_back({WorkBuffer::kW, "w", {rows, HV, K}, wt});
    b.push_back({WorkBuffer::kQg, "qg", {rows, HV, K}, wt});
    b.push_back({WorkBuffer::kKg, "kg", {rows, HV, K}, wt});
  }
  if (chunked) {
    // the short-chunk forward's factors are [rows, HV, 32] and its exp2(G) one row per 32-token chunk
    const int fc = backward ? kChunk : p.fwd_chunk;
    if (!saved_factors) {
      b.push_back({WorkBuffer::kAqk, "Aqk", {rows, HV, fc}, wt});
      b.push_back({WorkBuffer::kAkk, "Akk", {rows, HV, fc}, wt});
    }
    const int64_t Cg = fc == kChunk ? C : chunk_bound(p, fc);
    if (!workspace_given) b.push_back({WorkBuffer::kGdecay, "gdecay", {Cg, HV, K}, f32});
  }
  // the N + 1 chunk offsets, then the N sequences longest first (kda_chunk_map, dev::scan_sequence)
  b.push_back({WorkBuffer::kChunkOffsets, "chunk_offsets", {2 * int64_t{p.N} + 1}, f32, true});
  // the streamed forward's flags, counter and resume chunks (4 bytes per chunk and value head, and
  // per scan CTA), and where it can stream at all (kda_policy.h's fwd_stream_possible) the chains'
  // saved states; used only where the launcher streams (kda_fwd.cu)
  if (!backward) {
    if (chunked) {
      b.push_back({WorkBuffer::kChunkReady, "chunk_ready", {stream_flag_count(p)}, f32, true});
      push_split();
      if (fwd_stream_possible(p)) b.push_back({WorkBuffer::kScanSave, "scan_save", {p.N, HV, K, V}, f32});
    }
    return b;
  }
  if (chunked) {
    if (!saved_factors) b.push_back({WorkBuffer::kM, "M", {rows, HV, kChunk}, wt});
    if (!h_ckpt_given) b.push_back({WorkBuffer::kHCkpt, "h_ckpt", {C, HV, V, K}, wt});
    b.push_back({WorkBuffer::kDhCkpt, "dh_ckpt", {C, HV, V, K}, wt});
  } else {
    b.push_back({WorkBuffer::kRecurState, "recur_state", {p.N, HV, V / kRecurCols, recur_slice_floats(p.K)}, f32});
  }
  // GVA's running sums along the grads kernel's chain (gva_hat_row: none for a group's last head), or
  // the recurrence's dq^ / dk^ of every value head, which kda_bwd_group_sum finishes
  if (p.HV != p.H || !chunked) {
    const int64_t heads = chunked ? HV - p.H : HV;
    b.push_back({WorkBuffer::kDqhat, "dqhat", {rows, heads, K}, f32});
    b.push_back({WorkBuffer::kDkhat, "dkhat", {rows, heads, K}, f32});
  }
  // the GVA chain's flags (KdaBwdParams::gva_flags), one per (chunk of the pass, q/k head)
  if (p.HV != p.H && chunked) b.push_back({WorkBuffer::kGvaFlags, "gva_flags", {C, p.H}, f32, true});
  if (p.opt.gate_mode != GateMode::kPrecomputed) {
    b.push_back({WorkBuffer::kPbias, "pbias", {Cfull, HV, K}, f32});
    b.push_back({WorkBuffer::kPA, "pA", {Cfull, HV}, f32});
  }
  if (chunked) push_split();
  // the streamed backward's counters (bwd_stream_ints), where one pass (the whole batch or a slice,
  // which zeroes them before its dh scan) can stream at all; used only where the launcher streams
  // (kda_bwd.cu)
  const KdaProblem pass = backward_pass_problem(p, backward ? slice_B : 0);
  if (chunked && bwd_stream_possible(pass))
    b.push_back({WorkBuffer::kDhReady, "dh_ready", {bwd_stream_ints(pass)}, f32, true});
  return b;
}

}  // namespace kernel_fun::kda
