// KDA backward: dispatch over (dtype, K, V-slice), the two small finishing kernels, and the
// backward's stage sequence (kda_launch.h).
#include <stdexcept>
#include <string>

#include "common/env.h"
#include "kda/bwd/kda_bwd_finish.cuh"
#include "kda/bwd/kda_bwd_launch.h"
#include "kda/bwd/kda_bwd_slice.h"
#include "kda/device/primitives.cuh"
#include "kda/device/sequence.cuh"
#include "kda/kda_dispatch.h"
#include "kda/kda_launch.h"
#include "kda/kda_policy.h"
#include "kda/kda_sequence.h"

namespace kernel_fun::kda {

int kda_bwd_dh_scan_bv(const KdaBwdParams& p) {
  if (p.split_bv) return p.split_bv;  // the split scans' width (csrc/api decided it once)
  const int forced = kda_scan_bv_override(p);  // the override sets both scans
  // streamed: kda_backward keeps dh_ready only then
  return forced ? forced : dh_scan_bv(p, kda_fwd_scan_bv(p), p.dh_ready != nullptr);
}

void kda_bwd_dh_scan(const KdaBwdParams& p, cudaStream_t stream) {
  if (p.V % 64 != 0) throw std::invalid_argument("kda_bwd_dh_scan: V must be a multiple of 64");
  // the streamed backward's counters start at zero (kda_bwd_grads, launched next, reads them)
  if (p.dh_ready)
    KF_CUDA_CHECK(cudaMemsetAsync(p.dh_ready, 0, sizeof(int) * static_cast<size_t>(bwd_stream_ints(p)), stream));
  // Same shape of work as the forward scan (one warp per 16 value columns, serial over chunks);
  // its own width for varlen (kda_policy.h's dh_scan_bv).
  dispatch_wt_k_bv(p.dtype, p.K, kda_bwd_dh_scan_bv(p), "kda_bwd_dh_scan", [&](auto wt, auto k, auto bv) {
    launch_dh_scan<typename decltype(wt)::type, decltype(k)::value, decltype(bv)::value>(p, stream);
  });
}

void kda_bwd_dh_scan_local(const KdaBwdParams& p, cudaStream_t stream) {
  if (p.K % p.split_bv != 0 || p.V % p.split_bv != 0)  // the virtual columns are whole slices
    throw std::invalid_argument("kda_bwd_dh_scan_local: the value slice must divide V and K");
  dispatch_wt_k_bv(p.dtype, p.K, p.split_bv, "kda_bwd_dh_scan_local", [&](auto wt, auto k, auto bv) {
    launch_dh_scan_local<typename decltype(wt)::type, decltype(k)::value, decltype(bv)::value>(p, stream);
  });
}

void kda_bwd_scans(const KdaBwdParams& p, cudaStream_t stream) {
  if (p.V % 64 != 0) throw std::invalid_argument("kda_bwd_scans: V must be a multiple of 64");
  // both scans' width, as when launched apart
  dispatch_wt_k_bv(p.dtype, p.K, kda_fwd_scan_bv(p), "kda_bwd_scans", [&](auto wt, auto k, auto bv) {
    launch_scans<typename decltype(wt)::type, decltype(k)::value, decltype(bv)::value>(p, stream);
  });
}

bool kda_bwd_pair_scans(const KdaBwdParams& p) {
  const int forced = env_int("KERNEL_FUN_KDA_BWD_PAIR_SCANS", -1);  // tests / benchmarking: 0 or 1
  if (forced == 0 || forced == 1) return forced == 1;
  return bwd_pair_scans(p, kda_fwd_scan_bv(p));  // (paired: one launch, the forward scan's width)
}

void kda_bwd_prep(const KdaBwdParams& p, cudaStream_t stream) {
  dispatch_wt_k(p.dtype, p.K, "kda_bwd_prep", [&](auto wt, auto k) {
    launch_prep<typename decltype(wt)::type, decltype(k)::value>(p, stream);
  });
}

void kda_bwd_grads(const KdaBwdParams& p_in, cudaStream_t stream) {
  KdaBwdParams p = p_in;
  const int forced = env_int("KERNEL_FUN_KDA_BWD_BALANCE", -1);  // benchmarking: 0..3 (kda_problem.h)
  if (forced >= 0 && forced <= 3) p.balance = forced;
  dispatch_wt_k(p.dtype, p.K, "kda_bwd_grads", [&](auto wt, auto k) {
    launch_grads<typename decltype(wt)::type, decltype(k)::value>(p, stream);
  });
}

void kda_bwd_gva_clear(const KdaBwdParams& p, cudaStream_t stream) {
  KF_CUDA_CHECK(cudaMemsetAsync(p.gva_flags, 0, sizeof(int) * static_cast<size_t>(gva_flag_count(p)), stream));
}

void kda_bwd_gate_params(const KdaBwdParams& p, cudaStream_t stream) {
  for_each_gate_params_pass(p, [&](auto kern, const LaunchShape& s) { dev::launch(kern, s, p, stream); });
}

void kda_bwd_group_sums(const KdaBwdParams& p, cudaStream_t stream) {
  dispatch_wt(p.dtype, "kda_bwd_group_sum", [&](auto wt) {
    dev::launch(kda_bwd_group_sum_kernel<typename decltype(wt)::type>, group_sum_launch(p), p, stream);
  });
}

int kda_bwd_slice_batches(const KdaProblem& p) {
  const int forced = p.cu_seqlens ? 0 : env_int("KERNEL_FUN_KDA_BWD_SLICE", 0);  // tests / benchmarking
  if (forced >= 1) return forced < p.B ? forced : p.B;
  return bwd_slice_batches(p);
}

bool kda_bwd_streams(const KdaBwdParams& p) {
  // KERNEL_FUN_KDA_BWD_STREAMED: 0 never, 2 wherever a pass can (tests), else kda_policy.h's choice.
  // A sliced backward streams slice by slice (each dh scan zeroes the counters, and each grads
  // kernel ends after its dh scan): decided on a slice's shape.
  const int mode = env_int("KERNEL_FUN_KDA_BWD_STREAMED", 1);
  if (mode <= 0 || !p.dh_ready || !p.saved_states || p.recurrent) return false;
  return mode == 2 ? bwd_stream_possible(backward_pass_problem(p, p.slice_B)) : bwd_pass_streams(p, p.slice_B);
}

bool kda_backward(const KdaBwdParams& p_in, cudaStream_t stream) {
  // p.o / p.ht / p.h_states are null here.
  KdaBwdParams p = p_in;
  if (kda_bwd_streams(p)) {
    p.dh_bv = kda_bwd_dh_scan_bv(p);  // the counters' slices, the dh scan's width
    p.dbg_clock = nullptr;  // the phase clocks index a 2-D grid (dev::cta_clock_row); the streamed one is 3-D
  } else {
    p.dh_ready = nullptr;  // kept only where it streams
  }
  StreamStages stages{stream};
  backward_sequence(p, stages);
  return p.dh_ready != nullptr;
}

}  // namespace kernel_fun::kda
