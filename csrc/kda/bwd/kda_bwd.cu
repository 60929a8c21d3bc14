// KDA backward: dispatch over (dtype, K, V-slice), the two small finishing kernels, and the
// backward's stage sequence (kda_launch.h).
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kda/bwd/kda_bwd_finish.cuh"
#include "kda/bwd/kda_bwd_launch.h"
#include "kda/bwd/kda_bwd_slice.h"
#include "kda/device/primitives.cuh"
#include "kda/device/sequence.cuh"
#include "kda/kda_launch.h"
#include "kda/kda_policy.h"

namespace kernel_fun::kda {

namespace {

template <typename WT>
void dh_scan_k(const KdaBwdParams& p, cudaStream_t s, int bv) {
  switch (p.K) {
    case 64: return bv == 128 ? launch_dh_scan<WT, 64, 128>(p, s) : launch_dh_scan<WT, 64, 64>(p, s);
    case 128: return bv == 128 ? launch_dh_scan<WT, 128, 128>(p, s) : launch_dh_scan<WT, 128, 64>(p, s);
    default: throw std::invalid_argument("kda_bwd_dh_scan: K must be 64 or 128, got " + std::to_string(p.K));
  }
}

template <typename WT>
void scans_k(const KdaBwdParams& p, cudaStream_t s, int bv) {
  switch (p.K) {
    case 64: return bv == 128 ? launch_scans<WT, 64, 128>(p, s) : launch_scans<WT, 64, 64>(p, s);
    case 128: return bv == 128 ? launch_scans<WT, 128, 128>(p, s) : launch_scans<WT, 128, 64>(p, s);
    default: throw std::invalid_argument("kda_bwd_scans: K must be 64 or 128, got " + std::to_string(p.K));
  }
}

template <typename WT>
void prep_k(const KdaBwdParams& p, cudaStream_t s) {
  switch (p.K) {
    case 64: return launch_prep<WT, 64>(p, s);
    case 128: return launch_prep<WT, 128>(p, s);
    default: throw std::invalid_argument("kda_bwd_prep: K must be 64 or 128, got " + std::to_string(p.K));
  }
}

template <typename WT>
void grads_k(const KdaBwdParams& p, cudaStream_t s) {
  switch (p.K) {
    case 64: return launch_grads<WT, 64>(p, s);
    case 128: return launch_grads<WT, 128>(p, s);
    default: throw std::invalid_argument("kda_bwd_grads: K must be 64 or 128, got " + std::to_string(p.K));
  }
}

}  // namespace

void kda_bwd_dh_scan(const KdaBwdParams& p, cudaStream_t stream) {
  if (p.V % 64 != 0) throw std::invalid_argument("kda_bwd_dh_scan: V must be a multiple of 64");
  // Same shape of work as the forward scan (one warp per 16 value columns, serial over chunks):
  // the same V-slice choice.
  const int bv = kda_fwd_scan_bv(p);
  switch (p.dtype) {
    case DType::kBFloat16: return dh_scan_k<__nv_bfloat16>(p, stream, bv);
    case DType::kFloat16: return dh_scan_k<__half>(p, stream, bv);
    default: throw std::invalid_argument("kda_bwd_dh_scan: dtype must be bfloat16 or float16");
  }
}

void kda_bwd_scans(const KdaBwdParams& p, cudaStream_t stream) {
  if (p.V % 64 != 0) throw std::invalid_argument("kda_bwd_scans: V must be a multiple of 64");
  const int bv = kda_fwd_scan_bv(p);  // both scans' width, as when launched apart
  switch (p.dtype) {
    case DType::kBFloat16: return scans_k<__nv_bfloat16>(p, stream, bv);
    case DType::kFloat16: return scans_k<__half>(p, stream, bv);
    default: throw std::invalid_argument("kda_bwd_scans: dtype must be bfloat16 or float16");
  }
}

bool kda_bwd_pair_scans(const KdaBwdParams& p) {
  const char* env = std::getenv("KERNEL_FUN_KDA_BWD_PAIR_SCANS");  // tests / benchmarking: 0 or 1
  if (env && (env[0] == '0' || env[0] == '1') && env[1] == '\0') return env[0] == '1';
  return bwd_pair_scans(p, kda_fwd_scan_bv(p));
}

void kda_bwd_prep(const KdaBwdParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kBFloat16: return prep_k<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return prep_k<__half>(p, stream);
    default: throw std::invalid_argument("kda_bwd_prep: dtype must be bfloat16 or float16");
  }
}

void kda_bwd_grads(const KdaBwdParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kBFloat16: return grads_k<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return grads_k<__half>(p, stream);
    default: throw std::invalid_argument("kda_bwd_grads: dtype must be bfloat16 or float16");
  }
}

namespace {

void gate_params(const KdaBwdParams& p, cudaStream_t stream) {
  dev::launch(kda_bwd_gate_params_kernel, gate_params_launch(p), p, stream);
}

void group_sums(const KdaBwdParams& p, cudaStream_t stream) {
  if (p.dtype == DType::kBFloat16) dev::launch(kda_bwd_group_sum_kernel<__nv_bfloat16>, group_sum_launch(p), p, stream);
  else dev::launch(kda_bwd_group_sum_kernel<__half>, group_sum_launch(p), p, stream);
}

// Rebuild the forward's workspace (from its saved Aqk / Akk / M, or all of it with M) and the state
// before every chunk, then the reverse scan, the per-chunk gradients and (GVA) the group sums.
void backward_pass(const KdaBwdParams& p, cudaStream_t stream) {
  if (p.saved_factors) kda_bwd_prep(p, stream);
  else kda_fwd_intra(p, stream);
  if (kda_bwd_pair_scans(p)) {
    kda_bwd_scans(p, stream);
  } else {
    kda_fwd_scan(p, stream);
    kda_bwd_dh_scan(p, stream);
  }
  kda_bwd_grads(p, stream);
  group_sums(p, stream);
}

}  // namespace

int kda_bwd_slice_batches(const KdaProblem& p) {
  const char* env = std::getenv("KERNEL_FUN_KDA_BWD_SLICE");  // tests / benchmarking
  const int forced = env && !p.cu_seqlens ? std::atoi(env) : 0;
  if (forced >= 1) return forced < p.B ? forced : p.B;
  return bwd_slice_batches(p);
}

void kda_backward(const KdaBwdParams& p, cudaStream_t stream) {
  // p.o / p.ht / p.h_states are null here.
  kda_chunk_map(p, stream);
  for_each_batch_slice(p, [stream](const KdaBwdParams& s) { backward_pass(s, stream); });
  gate_params(p, stream);
}

}  // namespace kernel_fun::kda
