// The KDA kernels (csrc/kda/fwd, csrc/kda/bwd), compiled UNMODIFIED for the host emulator
// (kf_emu.h) and exposed as two C functions for ctypes (tests/emu/kda_emu.py): the forward and the
// backward stage sequences of kda_forward / kda_backward (csrc/kda/{fwd,bwd}/*.cu), each kernel
// launched from its launcher's own launch description (grid, block and shared-memory size:
// csrc/kda/kda_launch_shape.h), never a copy of it. The varlen chunk map (a cub kernel on
// the GPU) is computed here on the host; the scans' V-slice width is the caller's (`bv`) or, with 0, kda_policy.h's choice.
#include "kf_emu.h"  // first: the CUDA surface the kernels compile against

#include <algorithm>
#include <cstdio>
#include <exception>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/bwd/kda_bwd_dh_scan.cuh"
#include "kda/bwd/kda_bwd_finish.cuh"
#include "kda/bwd/kda_bwd_grads.cuh"
#include "kda/bwd/kda_bwd_prep.cuh"
#include "kda/bwd/kda_bwd_scans.cuh"
#include "kda/bwd/kda_bwd_slice.h"
#include "kda/kda_dispatch.h"
#include "kda/kda_policy.h"
#include "kda/kda_sequence.h"
#include "kda/fwd/kda_fwd_fused.cuh"
#include "kda/fwd/kda_fwd_intra.cuh"
#include "kda/fwd/kda_fwd_intra_c32.cuh"
#include "kda/fwd/kda_fwd_scan.cuh"
#include "kda/fwd/kda_fwd_split.cuh"
#include "kda/recur/kda_recur.cuh"

namespace {
namespace kda = kernel_fun::kda;
using kernel_fun::DType;

thread_local std::string g_last_error;

template <typename F>
int guarded(F&& f) {
  g_last_error.clear();
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return 1;
  }
}

}  // namespace

extern "C" {

// Every field is 8 bytes (pointer or int64) so the ctypes mirror has no padding questions. dtypes as
// in common/cuda_check.h (0 f32, 1 f16, 2 bf16, 3 f64). Null pointers mean "absent", as in the
// params structs.
struct KdaEmuArgs {
  // inputs
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  const void* beta;
  const float* A_log;
  const float* dt_bias;
  const float* h0;
  const void* cu_seqlens;  // int32 or int64 [N+1], host memory, or null
  const char* options;     // KdaOptions.encode()
  // forward outputs
  void* o;
  float* ht;
  void* h_states;
  // workspace
  void* w;
  void* qg;
  void* kg;
  void* Aqk;
  void* Akk;
  void* M;
  float* gdecay;
  int32_t* chunk_offsets;  // [2N+1], filled here
  void* h_ckpt;
  void* dh_ckpt;
  float* dqhat;
  float* dkhat;
  float* pbias;
  float* pA;
  // backward inputs / outputs
  const void* dout;
  const float* dht;
  void* dq;
  void* dk;
  void* dv;
  void* dg;
  void* dbeta;
  float* dh0;
  float* dA_log;
  float* ddt_bias;
  float* dbg_dA;
  float* dbg_dL;
  int32_t* chunk_ready;  // the streamed forward's flags (zeroed here), or null: the two-kernel forward
  float* scan_save;       // the streamed forward's saved chain states
  float* recur_state;     // the token recurrence's backward workspace (p.recurrent), or null
  int64_t cu_int64;
  int64_t B, T, H, HV, K, V, N, max_chunks;
  int64_t dtype, g_dtype, beta_dtype;
  int64_t bv;  // the scans' V-slice width (64 or 128), or 0: the launcher's choice (kda_policy.h)
  int64_t saved_factors;  // backward: Aqk / Akk / M are the forward's (kda_bwd_prep instead of the intra)
  int64_t slice_b;        // backward: batches per slice (bwd/kda_bwd_slice.h); 0 = one pass
  int64_t pair_scans;     // backward: 0 = the launcher's choice (kda_policy.h), 1 = both scans in one
                          // launch (bwd/kda_bwd_scans.cuh), 2 = two launches
  int64_t balance;        // backward: kda_bwd_grads' load-balancing bits (KdaBwdParams::balance), or
                          // -1 for the default (KERNEL_FUN_KDA_BWD_BALANCE on the GPU)
  int64_t stream_stop;    // streamed forward: -1 the intra before the scan's pass 1 (every chain runs
                          // through); 0 pass 1 before the intra (as under a serialising tool: every
                          // chain stops at chunk 0); m > 0 pass 1 sees only chunks < m published
  int64_t recurrent;      // 1: the fp32 token recurrence (recur/kda_recur.cuh) where recurrent_possible
  int64_t saved_states;   // backward: h_ckpt is the training forward's states (no re-scan)
  int64_t saved_workspace;  // backward: w, qg, kg, gdecay are the training forward's (no prep)
  int64_t split_chunks;   // forward: the split forward's piece length in chunks (fwd/kda_fwd_split.cuh), or 0
  int32_t* split_map;     // the split forward's buffers (kda_problem.h's SplitLayout), or null
  float* split_state;
  int64_t fwd_chunk;      // forward: 32 runs the experimental 32-token forward (KdaProblem::fwd_chunk;
                          // csrc/api's kda_fwd_chunk_choice on the GPU), else the 64-token chunks
  int64_t chain_cols;     // the split chain's column block (8, 16 or 32), or 0: kda_fwd_split.cuh's
                          // split_chain_cols for kPolicySMs SMs (the width changes no result bit)
  int64_t id_cols;        // forward: the identity columns (KdaProblem::id_cols; V counts them), or 0
  void* o_id;             // their outputs [B, T, HV, id_cols], with id_cols
  int32_t* dh_ready;      // backward: the streamed backward's counters (kda_problem.h's bwd_stream_ints,
                          // zeroed here), or null; needs saved_states, as kda_bwd_streams
  int32_t* gva_flags;     // backward, GVA: the grads kernel's chain flags (KdaBwdParams::gva_flags, zeroed
                          // per pass by the gva_clear stage), or null: kda_bwd_group_sum sums the group
};

int kda_emu_args_size() { return static_cast<int>(sizeof(KdaEmuArgs)); }
const char* kda_emu_last_error() { return g_last_error.c_str(); }

// threads: worker OS threads (0 = default); stack_kib: per-fiber stack (0 = default); ftz: 0 / 1, or -1
// to keep the current setting.
void kf_emu_configure(int threads, int stack_kib, int ftz) {
  kf_emu::config().workers = threads;
  if (stack_kib > 0) kf_emu::config().stack_bytes = static_cast<size_t>(stack_kib) * 1024;
  if (ftz >= 0) kf_emu::config().ftz = ftz != 0;
}

// schedule: 0 thread order, 1 reverse, 2 random permutation per pass (seeded); warp_greedy: 0 / 1
// (see kf_emu::Config).
void kf_emu_set_schedule(int schedule, int warp_greedy, uint64_t seed) {
  kf_emu::config().schedule = schedule;
  kf_emu::config().warp_greedy = warp_greedy != 0;
  kf_emu::config().seed = seed;
}

}  // extern "C"

namespace {

kda::KdaBwdParams make_params(const KdaEmuArgs& a) {
  kda::KdaBwdParams p;
  const std::string err = kda::parse_options(a.options ? a.options : "", p.opt);
  if (!err.empty()) throw std::invalid_argument(err);
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.g = a.g;
  p.beta = a.beta;
  p.A_log = a.A_log;
  p.dt_bias = a.dt_bias;
  p.h0 = a.h0;
  p.cu_seqlens = a.cu_seqlens;
  p.cu_int64 = a.cu_int64 != 0;
  p.o = a.o;
  p.ht = a.ht;
  p.h_states = a.h_states;
  p.w = a.w;
  p.qg = a.qg;
  p.kg = a.kg;
  p.Aqk = a.Aqk;
  p.Akk = a.Akk;
  p.M = a.M;
  p.gdecay = a.gdecay;
  p.h_ckpt = a.h_ckpt;
  p.dh_ckpt = a.dh_ckpt;
  p.dqhat = a.dqhat;
  p.dkhat = a.dkhat;
  p.pbias = a.pbias;
  p.pA = a.pA;
  p.dout = a.dout;
  p.dht = a.dht;
  p.dq = a.dq;
  p.dk = a.dk;
  p.dv = a.dv;
  p.dg = a.dg;
  p.dbeta = a.dbeta;
  p.dh0 = a.dh0;
  p.dA_log = a.dA_log;
  p.ddt_bias = a.ddt_bias;
  p.dbg_dA = a.dbg_dA;
  p.dbg_dL = a.dbg_dL;
  p.chunk_ready = a.chunk_ready;
  p.scan_save = a.scan_save;
  p.dh_ready = a.dh_ready;
  p.gva_flags = a.gva_flags;
  p.B = static_cast<int>(a.B);
  p.T = static_cast<int>(a.T);
  p.H = static_cast<int>(a.H);
  p.HV = static_cast<int>(a.HV);
  p.K = static_cast<int>(a.K);
  p.V = static_cast<int>(a.V);
  p.N = static_cast<int>(a.N);
  p.max_chunks = static_cast<int>(a.max_chunks);
  p.dtype = static_cast<DType>(a.dtype);
  p.g_dtype = static_cast<DType>(a.g_dtype);
  p.beta_dtype = static_cast<DType>(a.beta_dtype);
  p.chunk_offsets = a.chunk_offsets;
  p.id_cols = static_cast<int>(a.id_cols);  // before the policies below ask (as csrc/api's id_cols_check)
  p.o_id = a.o_id;
  p.saved_factors = a.saved_factors != 0;
  p.slice_B = static_cast<int>(a.slice_b);
  p.recur_state = a.recur_state;
  p.recurrent = a.recurrent != 0 && kda::recurrent_possible(p);
  // the forward's states given and written (csrc/api's states_check where save_states_pays)
  p.h_ckpt_given = p.saved_states = a.saved_states != 0 && !p.recurrent;
  p.saved_workspace = a.saved_workspace != 0 && !p.recurrent;  // as csrc/api's workspace_check
  p.split_chunks = p.recurrent ? 0 : static_cast<int>(a.split_chunks);
  p.split_map = a.split_map;
  p.split_state = a.split_state;
  p.fwd_chunk = a.fwd_chunk == kda::kC32 ? kda::kC32 : kda::kChunk;
  if (p.fwd_chunk != kda::kChunk && (p.recurrent || p.split_chunks || p.h_states || p.h_ckpt))
    throw std::invalid_argument("kda_emu: the 32-token forward takes unsplit calls without states");
  // as csrc/api's id_cols_check and kda_policy.h: the identity columns take the plain two-kernel path
  if (p.id_cols && (p.h0 || p.h_states || p.h_ckpt || p.split_chunks || p.chunk_ready || p.fwd_chunk != kda::kChunk ||
                    !p.o_id))
    throw std::invalid_argument("kda_emu: identity columns take o_id and the plain forward (no h0, states, split, "
                                "streaming or short chunks)");
  // as kda_fwd_stream_bv: the split forward never streams (forward_sequence takes chunk_ready first)
  if (p.split_chunks && p.chunk_ready)
    throw std::invalid_argument("kda_emu: the split forward does not stream");
  // as kda_bwd_streams: the streamed backward reads the forward's states, where a pass (the whole
  // batch or each slice) can stream
  if (p.dh_ready && (!p.saved_states || !kda::bwd_stream_possible(kda::backward_pass_problem(p, p.slice_B))))
    throw std::invalid_argument("kda_emu: the streamed backward takes saved states and fixed length, within "
                                "bwd_stream_possible per pass");
  return p;
}

// ---- every kernel launched as its launcher does, from the kernel's one launch description
// (csrc/kda/kda_launch_shape.h; intra_launch, fwd_scan_launch, ...): nothing here restates a grid.
template <typename Params>
void launch(const kda::LaunchShape& s, void (*kernel)(Params), const Params& p) {
  if (s.empty()) return;  // as the launchers: nothing launched for an empty problem
  kf_emu::launch_cluster(s.grid, s.cluster, dim3(s.threads), s.smem, kernel, p);
}

template <typename WT, int K>
void intra(const kda::KdaFwdParams& p) {
  launch(kda::intra_launch<WT, K>(p), kda::intra_kernel_for<WT, K>(p), p);
}

template <typename WT, int K, int BV>
void scan(const kda::KdaFwdParams& p) {
  launch(kda::fwd_scan_launch<WT, K, BV>(p), kda::fwd_scan_kernel_for<WT, K, BV>(p), p);
}

template <typename WT, int K, int BV>
void dh_scan(const kda::KdaBwdParams& p) {
  launch(kda::dh_scan_launch<WT, K, BV>(p), kda::kda_bwd_dh_scan_kernel<WT, K, BV>, p);
}

template <typename WT, int K, int BV>
void scans(const kda::KdaBwdParams& p) {
  launch(kda::scans_launch<WT, K, BV>(p), kda::kda_bwd_scans_kernel<WT, K, BV>, p);
}

template <typename WT, int K>
void prep(const kda::KdaBwdParams& p) {
  launch(kda::prep_launch<WT, K>(p), kda::kda_bwd_prep_kernel<WT, K>, p);
}

template <typename WT, int K>
void grads(const kda::KdaBwdParams& p) {
  kda::for_each_grads_launch<WT, K>(p, [&](auto kern, const kda::LaunchShape& s) { launch(s, kern, p); });
}

template <typename WT>
void gate_params(const kda::KdaBwdParams& p) {
  kda::for_each_gate_params_pass(p, [&](auto kern, const kda::LaunchShape& s) { launch(s, kern, p); });
}

template <typename WT>
void group_sums(const kda::KdaBwdParams& p) {
  launch(kda::group_sum_launch(p), kda::kda_bwd_group_sum_kernel<WT>, p);
}

// kda_chunk_map on the host: offsets[n] = sum_{m<n} ceil(len_m / 64), then the sequences by chunk
// count, longest first, ties in index order (the GPU's are a cub scan and a stable radix sort; past
// kMaxOrderedSequences the order is the identity)
void chunk_map(const kda::KdaProblem& p, bool cu_int64) {
  if (!p.cu_seqlens) return;
  std::vector<int> nc(p.N);
  p.chunk_offsets[0] = 0;
  for (int n = 0; n < p.N; ++n) {
    const int64_t len = cu_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[n + 1] - static_cast<const int64_t*>(p.cu_seqlens)[n]
                                 : static_cast<const int32_t*>(p.cu_seqlens)[n + 1] - static_cast<const int32_t*>(p.cu_seqlens)[n];
    nc[n] = static_cast<int>((len + p.fwd_chunk - 1) / p.fwd_chunk);  // the call's chunk size (kda_chunk_map)
    p.chunk_offsets[n + 1] = p.chunk_offsets[n] + nc[n];
  }
  int* order = p.chunk_offsets + p.N + 1;
  std::iota(order, order + p.N, 0);
  if (p.N <= kda::kMaxOrderedSequences) std::stable_sort(order, order + p.N, [&](int a, int b) { return nc[a] > nc[b]; });
}

// The stages for kda_sequence.h's forward_sequence / backward_sequence: the GPU's sequence, each
// stage the same kernel under kf_emu. pair: 0 the policy's choice, 1 paired scans, 2 apart.
template <typename WT, int K, int BV>
struct EmuStages {
  bool cu_int64;
  int64_t pair;
  bool use_fused;  // the forward through kda_fwd_fused_kernel (the GPU's KERNEL_FUN_KDA_FWD_FUSED)
  void chunk_map(const kda::KdaProblem& p) { ::chunk_map(p, cu_int64); }
  void recurrent_forward(const kda::KdaFwdParams& p) {
    launch(kda::recur_fwd_launch<K>(p), kda::kda_recur_fwd_kernel<K>, p);
  }
  void recurrent_backward(const kda::KdaBwdParams& p) {
    kda::for_each_recur_bwd_pass<K>(p, [&](auto kern, const kda::LaunchShape& s) { launch(s, kern, p); });
  }
  bool fused(const kda::KdaFwdParams&) { return use_fused; }
  void intra_c32(const kda::KdaFwdParams& p) {
    launch(kda::intra_c32_launch<WT, K>(p), kda::intra_c32_kernel_for<WT, K>(p), p);
  }
  void scan_c32(const kda::KdaFwdParams& p) {
    launch(kda::scan_c32_launch<WT, K, BV>(p), kda::kda_fwd_scan_c32_kernel<WT, K, BV>, p);
  }
  void fused_forward(const kda::KdaFwdParams& p) {
    launch(kda::fwd_fused_launch<WT, K, BV>(p), kda::kda_fwd_fused_kernel<WT, K, BV>, p);
  }
  // The streamed forward: on the GPU the scan's pass 1 first, the intra beside it, then pass 2.
  // Launches here run one after another, so stop (KdaEmuArgs::stream_stop) picks which chunks pass
  // 1 finds published: all (the intra first), none (pass 1 first), or those before chunk m; pass 2
  // resumes whatever chain stopped. The intra's done counter must equal its CTA count.
  // At either chunk size (p.fwd_chunk), as kda_fwd_streamed; `stop` counts chunks of that size.
  int64_t stop = -1;
  void streamed_forward(const kda::KdaFwdParams& p) {
    const bool c32 = p.fwd_chunk == kda::kC32;
    const int64_t nflags = kda::stream_done_offset(p);
    std::fill(p.chunk_ready, p.chunk_ready + kda::stream_flag_count(p), 0);
    kda::KdaFwdParams pass = p;
    pass.scan_pass = 1;
    auto run_scan = [&] { c32 ? scan_c32(pass) : ::scan<WT, K, BV>(pass); };
    if (stop == 0) run_scan();
    c32 ? intra_c32(p) : ::intra<WT, K>(p);
    const kda::LaunchShape in = c32 ? kda::intra_c32_launch<WT, K>(p) : kda::intra_launch<WT, K>(p);
    if (p.chunk_ready[nflags] != static_cast<int64_t>(in.grid.x) * in.grid.y)
      throw std::runtime_error("streamed forward: the intra's done counter is not its CTA count");
    const int nts = (p.T + p.fwd_chunk - 1) / p.fwd_chunk;
    auto hide = [&](int v) {  // the flags of chunks >= stop within each sequence
      for (int64_t i = 0; i < nflags; ++i)
        if ((i / p.HV) % nts >= stop) p.chunk_ready[i] = v;
    };
    if (stop > 0) hide(0);
    if (stop != 0) run_scan();
    if (stop > 0) hide(1);
    pass.scan_pass = 2;
    run_scan();
  }
  // the split scans' stages (kda_sequence.h's split_scan_passes / split_dh_passes); pass 1 at the
  // emulator's one width, pass 2 as the scans without a split
  void split_map(const kda::KdaFwdParams& p) { launch(kda::split_map_launch(p), kda::kda_split_map_kernel, p); }
  void scan_local(const kda::KdaFwdParams& p) {
    launch(kda::fwd_scan_local_launch<WT, K, BV>(p), kda::kda_fwd_scan_local_kernel<WT, K, BV>, p);
  }
  void dh_local(const kda::KdaBwdParams& p) {
    launch(kda::dh_scan_local_launch<WT, K, BV>(p), kda::kda_bwd_dh_scan_local_kernel<WT, K, BV>, p);
  }
  int chain_cols = 0;  // the split chain's column block (KdaEmuArgs::chain_cols), 0: the launcher's rule
  void split_chain(const kda::KdaFwdParams& p, bool reverse) {
    const kda::SplitChainLaunch c =
        kda::split_chain_launch(p, reverse, chain_cols ? chain_cols : kda::split_chain_cols(p, kda::kPolicySMs));
    launch(c.shape, c.kernel, p);
  }
  void split_final(const kda::KdaFwdParams& p, bool reverse) {
    launch(kda::split_final_launch(p), reverse ? kda::kda_split_final_kernel<true> : kda::kda_split_final_kernel<false>,
           p);
  }
  void intra(const kda::KdaFwdParams& p) { ::intra<WT, K>(p); }
  void scan(const kda::KdaFwdParams& p) { ::scan<WT, K, BV>(p); }
  void prep(const kda::KdaBwdParams& p) { ::prep<WT, K>(p); }
  // the dh scan's width when it runs alone (pair_scans false): the caller's bv for both scans, else
  // kda_policy.h's dh_scan_bv (as kda_bwd.cu)
  int dh_bv = BV;
  bool pair_scans(const kda::KdaBwdParams& p) {
    return pair == 1 || (pair == 0 && kda::bwd_pair_scans(p, BV));
  }
  void scans(const kda::KdaBwdParams& p) { ::scans<WT, K, BV>(p); }
  // The streamed backward (p.dh_ready): on the GPU kda_bwd_grads runs beside the dh scan; here the dh
  // scan runs to its end first, so every grads CTA must find its checkpoint counted
  // (kda_bwd_grads' grads_wait_dh fails the launch otherwise), and each grads kernel's done counter
  // must equal its CTA count.
  void dh_scan(const kda::KdaBwdParams& p) {
    if (p.dh_ready) std::fill(p.dh_ready, p.dh_ready + kda::bwd_stream_ints(p), 0);
    kda::dispatch_wt_k_bv(p.dtype, p.K, dh_bv, "kda_emu dh_scan", [&](auto, auto, auto b) {
      ::dh_scan<WT, K, decltype(b)::value>(p);
    });
  }
  void grads(const kda::KdaBwdParams& p) {
    std::vector<int64_t> ctas;  // per launch: kda_bwd_grads_last_kernel's first where it runs, then the main one
    kda::for_each_grads_launch<WT, K>(p, [&](auto kern, const kda::LaunchShape& s) {
      launch(s, kern, p);
      ctas.push_back(static_cast<int64_t>(s.grid.x) * s.grid.y * s.grid.z);
    });
    if (!p.dh_ready) return;
    const int32_t* done = p.dh_ready + kda::bwd_stream_done_offset(p);
    if (done[0] != (ctas.size() == 2 ? ctas[0] : 0) || done[1] != ctas.back())
      throw std::runtime_error("streamed backward: a grads kernel's done counter is not its CTA count");
  }
  void group_sums(const kda::KdaBwdParams& p) { ::group_sums<WT>(p); }
  void gva_clear(const kda::KdaBwdParams& p) { std::fill(p.gva_flags, p.gva_flags + kda::gva_flag_count(p), 0); }
  void gate_params(const kda::KdaBwdParams& p) { ::gate_params<WT>(p); }
};

void run_any(const KdaEmuArgs& a, bool bwd, bool fused = false) {
  if (a.pair_scans < 0 || a.pair_scans > 2) throw std::invalid_argument("kda_emu: pair_scans must be 0, 1 or 2");
  if (a.balance < -1 || a.balance > 3) throw std::invalid_argument("kda_emu: balance must be -1 or 0..3");
  kda::KdaBwdParams p = make_params(a);
  if (bwd && a.balance >= 0) p.balance = static_cast<int>(a.balance);  // the forward's args leave it 0
  const int bv = a.bv ? static_cast<int>(a.bv) : kda::fwd_scan_bv_alone(p);  // 0: the launcher's choice
  if (bv > 0 && (p.V % bv != 0 || p.id_cols % bv != 0))
    throw std::invalid_argument("kda_emu: V (and the identity columns) must be multiples of bv");
  if (p.split_chunks > 0 && (p.K % bv != 0 || !p.split_map || !p.split_state))
    throw std::invalid_argument("kda_emu: the split forward needs bv dividing K and its two buffers");
  const int64_t pr = a.pair_scans;
  // the launchers' switch (kda_dispatch.h): the same variants, the same errors
  kda::dispatch_wt_k_bv(p.dtype, p.K, bv, "kda_emu", [&](auto wt, auto k, auto b) {
    using WT = typename decltype(wt)::type;
    constexpr int K = decltype(k)::value, BV = decltype(b)::value;
    EmuStages<WT, K, BV> stages{a.cu_int64 != 0, pr, fused, a.stream_stop};
    stages.dh_bv = a.bv ? BV : kda::dh_scan_bv(p, BV, p.dh_ready != nullptr);  // as kda_bwd_dh_scan_bv
    p.dh_bv = stages.dh_bv;  // the streamed backward's counters: the dh scan's slices (as kda_backward)
    stages.chain_cols = static_cast<int>(a.chain_cols);
    if (!bwd) return kda::forward_sequence(p, stages);
    kda::KdaBwdParams r = p;  // the re-scan writes states only
    r.o = nullptr;
    r.ht = nullptr;
    r.h_states = nullptr;
    kda::backward_sequence(r, stages);
  });
}

// ---- the intra phases into a scan stage (kda_fwd_intra.cuh's IntraToStage, for the fused forward)
// against the stage dev::scan_load_chunk fills from the workspace the two-kernel path wrote: each
// CTA (chunk, value head) copies its stage to out[(global chunk * HV + hv) * kStageElems ..].
template <typename WT, int K, int BV>
__device__ void copy_stage_out(const WT* stage, WT* out, int64_t gchunk, int HV, int hv) {
  using St = kda::dev::ScanStage<WT, K, BV>;
  __syncthreads();
  WT* dst = out + (gchunk * HV + hv) * St::kStageElems;
  for (int i = threadIdx.x; i < St::kStageElems; i += blockDim.x) dst[i] = stage[i];
}

template <typename WT, int K, int BV>
__global__ void intra_to_stage_kernel(const kda::KdaFwdParams p, WT* out) {
  KF_DYN_SMEM(float4, smem_f4);
  auto* sm = reinterpret_cast<kda::FusedSmem<WT, K, BV>*>(kda::dev::scan_smem_base<WT>(smem_f4));  // the fused kernel's plan
  const int hv = blockIdx.y;
  int n, ch;
  if (!kda::dev::chunk_of(p, blockIdx.x, n, ch)) return;
  const kda::IntraCtx<WT, K> c(p, reinterpret_cast<char*>(&sm->intra), kda::dev::seq_info(p, n), ch, hv);
  WT* stage = sm->stage;
  kda::intra_chunk_any(c, kda::IntraToStage<WT, K, BV>{stage});
  copy_stage_out<WT, K, BV>(stage, out, c.gchunk, p.HV, hv);
}

template <typename WT, int K, int BV>
__global__ void stage_from_workspace_kernel(const kda::KdaFwdParams p, WT* out) {
  KF_DYN_SMEM(float4, smem_f4);
  WT* stage = reinterpret_cast<WT*>(smem_f4);
  const int hv = blockIdx.y;
  int n, ch;
  if (!kda::dev::chunk_of(p, blockIdx.x, n, ch)) return;
  const kda::dev::SeqInfo seq = kda::dev::seq_info(p, n);
  kda::dev::scan_load_chunk<WT, K, BV, kda::kIntraThreads>(stage, kda::dev::scan_sources<WT>(p, p.v), p, seq, ch, hv,
                                                           0, true);
  kda::dev::cp_async_commit();
  kda::dev::cp_async_wait<0>();
  copy_stage_out<WT, K, BV>(stage, out, seq.chunk0 + ch, p.HV, hv);
}

// layout[0..6] = kStageElems, kW, kQg, kKg, kAqk, kAkk, kDec (elements), AP
void intra_stage_check(const KdaEmuArgs& a, void* from_intra, void* from_load, int64_t* layout) {
  const kda::KdaBwdParams p = make_params(a);
  chunk_map(p, a.cu_int64 != 0);
  kda::dispatch_wt_k(p.dtype, p.K, "kda_emu_intra_stage", [&](auto wt, auto k) {
    using WT = typename decltype(wt)::type;
    constexpr int K = decltype(k)::value, BV = 64;
    using St = kda::dev::ScanStage<WT, K, BV>;
    const int64_t l[8] = {St::kStageElems, St::kW, St::kQg, St::kKg, St::kAqk, St::kAkk, St::kDec, St::AP};
    for (int i = 0; i < 8; ++i) layout[i] = l[i];
    const kda::LaunchShape in = kda::intra_launch<WT, K>(p);
    if (in.empty()) return;
    const size_t smem1 = kda::fused_smem_bytes<WT, K, BV>();
    kf_emu::launch(in.grid, dim3(in.threads), smem1, intra_to_stage_kernel<WT, K, BV>,
                   static_cast<const kda::KdaFwdParams&>(p), static_cast<WT*>(from_intra));
    kf_emu::launch(in.grid, dim3(in.threads), sizeof(WT) * St::kStageElems, stage_from_workspace_kernel<WT, K, BV>,
                   static_cast<const kda::KdaFwdParams&>(p), static_cast<WT*>(from_load));
  });
}

// The experimental 32-token intra (fwd/kda_fwd_intra_c32.cuh) alone, into the args' workspace
// pointers (w, qg, kg, Aqk, Akk, M, gdecay at 32-token chunks; varlen: the chunk map at 32 first).
void intra_c32(const KdaEmuArgs& a) {
  KdaEmuArgs b = a;
  b.fwd_chunk = kda::kC32;  // the varlen chunk map at 32 tokens
  const kda::KdaBwdParams p = make_params(b);
  chunk_map(p, a.cu_int64 != 0);
  kda::dispatch_wt_k(p.dtype, p.K, "kda_emu_intra_c32", [&](auto wt, auto k) {
    using WT = typename decltype(wt)::type;
    constexpr int K = decltype(k)::value;
    launch(kda::intra_c32_launch<WT, K>(p), kda::intra_c32_kernel_for<WT, K>(p),
           static_cast<const kda::KdaFwdParams&>(p));
  });
}

// A fixed-length problem of these sizes, for the launch-policy queries below (shapes only).
kda::KdaProblem fixed_problem(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V) {
  kda::KdaProblem p;
  p.B = p.N = static_cast<int>(B);
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.HV = static_cast<int>(HV);
  p.K = static_cast<int>(K);
  p.V = static_cast<int>(V);
  p.max_chunks = static_cast<int>(B * ((T + kda::kChunk - 1) / kda::kChunk));
  return p;
}

}  // namespace

extern "C" {

int kda_emu_forward(const KdaEmuArgs* a) {
  return guarded([&] { run_any(*a, false); });
}

int kda_emu_backward(const KdaEmuArgs* a) {
  return guarded([&] { run_any(*a, true); });
}

// kda_policy.h's streamed-forward choice for a fixed-length problem on a device of `sms` SMs, the call
// chunked at fwd_chunk tokens (KdaProblem::fwd_chunk: the streamed grid's rows are counted at it): the
// slice width (0: no streaming), the modelled streamed and two-kernel times (us).
int kda_emu_stream_choice(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V, int64_t sms,
                          double* cost, int64_t fwd_chunk) {
  kda::KdaProblem p = fixed_problem(B, T, H, HV, K, V);
  p.fwd_chunk = fwd_chunk == kda::kC32 ? kda::kC32 : kda::kChunk;
  const kda::StreamChoice c = kda::fwd_stream_choice(p, static_cast<int>(sms));
  cost[0] = c.cost;
  cost[1] = c.cost_now;
  return c.bv;
}

// The split forward's buffer layout for a problem (kda_problem.h's SplitLayout): out = {NP, map ints,
// state floats, cu, seq_piece0, piece_seq, piece_flags, init, final}.
int kda_emu_split_layout(const KdaEmuArgs* a, int64_t* out) {
  return guarded([&] {
    const kda::KdaBwdParams p = make_params(*a);
    const kda::SplitLayout l = kda::split_layout(p);
    const int64_t v[9] = {l.NP, l.map_ints, l.state_floats, l.cu, l.seq_piece0, l.piece_seq, l.piece_flags, l.init,
                          l.final_};
    for (int i = 0; i < 9; ++i) out[i] = v[i];
  });
}

// kda_policy.h's split-forward choice for a fixed-length problem on a device of `sms` SMs: the piece
// length in chunks (0: no split); bv_cost = {the scans' width, the modelled split time, the modelled
// time of the forward it would replace (us)}.
int kda_emu_split_choice(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V, int64_t sms,
                         double* bv_cost) {
  const kda::KdaProblem p = fixed_problem(B, T, H, HV, K, V);
  const kda::SplitChoice c = kda::fwd_split_choice(p, static_cast<int>(sms));
  bv_cost[0] = c.bv;
  bv_cost[1] = c.cost;
  bv_cost[2] = c.cost_other;
  return c.chunks;
}

// The same for a varlen batch of N documents over T tokens whose longest has `longest` tokens (the
// front's KdaOptions::max_seq_len; 0: not known), with the launcher's chunk bound (csrc/api).
int kda_emu_split_choice_varlen(int64_t N, int64_t T, int64_t longest, int64_t H, int64_t HV, int64_t K, int64_t V,
                                int64_t sms, double* bv_cost) {
  static const int32_t device_offsets = 0;  // the policy asks only whether cu_seqlens is there
  kda::KdaProblem p = fixed_problem(1, T, H, HV, K, V);
  p.N = static_cast<int>(N);
  p.cu_seqlens = &device_offsets;
  p.max_chunks = static_cast<int>(T / kda::kChunk + N);
  p.opt.max_seq_len = static_cast<int>(longest);
  const kda::SplitChoice c = kda::fwd_split_choice(p, static_cast<int>(sms));
  bv_cost[0] = c.bv;
  bv_cost[1] = c.cost;
  bv_cost[2] = c.cost_other;
  return c.chunks;
}

// kda_policy.h's backward choices for a fixed-length problem chunked at 64 tokens, with the split of
// `split_chunks` chunks (0: none), the unbounded gate or (bounded != 0) the bounded one at lower_bound
// -5: bit 0 bwd_pass_streams for the policy's batch slices (as kda_bwd_streams), bit 1
// save_states_pays, bit 2 bwd_pair_scans at the scan's width (on the whole batch).
int kda_emu_bwd_policy(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V, int64_t split_chunks,
                       int64_t bounded) {
  kda::KdaProblem p = fixed_problem(B, T, H, HV, K, V);
  p.split_chunks = static_cast<int>(split_chunks);
  p.opt.gate_mode = bounded ? kda::GateMode::kBounded : kda::GateMode::kUnbounded;
  p.opt.lower_bound = bounded ? -5.f : 0.f;
  return (kda::bwd_pass_streams(p, kda::bwd_slice_batches(p)) ? 1 : 0) | (kda::save_states_pays(p) ? 2 : 0) |
         (kda::bwd_pair_scans(p, kda::scan_choice(p).bv) ? 4 : 0);
}

// kda_policy.h's short-chunk choice for a fixed-length problem, given the launcher's streaming
// decision (`streams`) and the split's piece length (`split_chunks`, 0: none): 1 where the 32-token
// forward pays.
int kda_emu_short_chunks(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V, int64_t streams,
                         int64_t split_chunks) {
  kda::KdaProblem p = fixed_problem(B, T, H, HV, K, V);
  p.split_chunks = static_cast<int>(split_chunks);
  return kda::fwd_short_chunks_pay(p, streams != 0) ? 1 : 0;
}

// kda_policy.h's fwd_scan_bv_alone for a fixed-length problem chunked at fwd_chunk tokens: the width
// of the forward's scan run on its own (neither streamed nor split).
int kda_emu_scan_bv(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V, int64_t fwd_chunk) {
  kda::KdaProblem p = fixed_problem(B, T, H, HV, K, V);
  p.fwd_chunk = fwd_chunk == kda::kC32 ? kda::kC32 : kda::kChunk;
  return kda::fwd_scan_bv_alone(p);
}

// fwd/kda_fwd_split.cuh's split_chain_cols for a fixed-length problem on a device of `sms` SMs: the
// chain kernel's column block.
int kda_emu_split_chain_cols(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V, int64_t sms) {
  return kda::split_chain_cols(fixed_problem(B, T, H, HV, K, V), static_cast<int>(sms));
}

// The 32-token forward: the intra above, then kda_fwd_scan_c32_kernel at a.bv (64 or 128; 0: the
// launcher's width, kda_policy.h's fwd_scan_bv_alone) into o and ht.
int kda_emu_forward_c32(const KdaEmuArgs* a) {
  return guarded([&] {
    intra_c32(*a);
    KdaEmuArgs b = *a;
    b.fwd_chunk = kda::kC32;
    const kda::KdaBwdParams p = make_params(b);
    kda::dispatch_wt_k(p.dtype, p.K, "kda_emu_forward_c32", [&](auto wt, auto k) {
      using WT = typename decltype(wt)::type;
      constexpr int K = decltype(k)::value;
      const auto& fp = static_cast<const kda::KdaFwdParams&>(p);
      if ((a->bv ? a->bv : kda::fwd_scan_bv_alone(p)) == 128)
        launch(kda::scan_c32_launch<WT, K, 128>(p), kda::kda_fwd_scan_c32_kernel<WT, K, 128>, fp);
      else launch(kda::scan_c32_launch<WT, K, 64>(p), kda::kda_fwd_scan_c32_kernel<WT, K, 64>, fp);
    });
  });
}

int kda_emu_intra_c32(const KdaEmuArgs* a) {
  return guarded([&] { intra_c32(*a); });
}

int kda_emu_fused_forward(const KdaEmuArgs* a) {
  return guarded([&] { run_any(*a, false, true); });  // the forward with the fused kernel chosen
}

// After kda_emu_forward on the same args (its workspace): the intra phases into a scan stage, and
// the stage scan_load_chunk fills from that workspace (intra_stage_check).
int kda_emu_intra_stage_check(const KdaEmuArgs* a, void* from_intra, void* from_load, int64_t* layout) {
  return guarded([&] { intra_stage_check(*a, from_intra, from_load, layout); });
}

// kda_bwd_finish's two gate-parameter passes alone, on given per-chunk partials pbias [max_chunks,
// HV, K] / pA [max_chunks, HV] (overwritten: the first pass works in place) with nc chunks written;
// varlen != 0 takes nc from a chunk map (as with cu_seqlens) instead of from B and T.
int kda_emu_gate_params(float* pbias, float* pA, float* dA_log, float* ddt_bias, int64_t HV, int64_t K, int64_t nc,
                        int64_t max_chunks, int64_t varlen) {
  return guarded([&] {
    kda::KdaBwdParams p;
    int offsets[3] = {0, static_cast<int>(nc), 0};  // the chunk map of one sequence: offsets, order
    const int64_t cu[2] = {0, nc * kda::kChunk};
    p.B = p.N = 1;
    p.H = p.HV = static_cast<int>(HV);
    p.K = static_cast<int>(K);
    p.T = static_cast<int>(nc * kda::kChunk);
    p.max_chunks = static_cast<int>(max_chunks);
    if (varlen) {
      p.cu_seqlens = cu;
      p.cu_int64 = true;
      p.chunk_offsets = offsets;
    }
    p.pbias = pbias;
    p.pA = pA;
    p.dA_log = dA_log;
    p.ddt_bias = ddt_bias;
    gate_params<void>(p);
  });
}

}  // extern "C"
