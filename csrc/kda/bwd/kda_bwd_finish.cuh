// kda_bwd_finish's two kernels: the fixed-order reductions of the per-chunk gate partials into
// dA_log / ddt_bias, and (GVA) the sum of d(normalised q / k) over each q/k head's value heads
// followed by the l2norm backward. Launched by kda_bwd_finish (kda_bwd.cu).
#pragma once

#include <cstdint>

#include "kda/device/primitives.cuh"
#include "kda/device/sequence.cuh"
#include "kda/kda_launch_shape.h"

namespace kernel_fun::kda {

constexpr int kGateParamsThreads = 128;
constexpr int kGroupSumThreads = 256;  // one warp per (token, q/k head) item

// dA_log[hv] and ddt_bias[hv, :] from the per-chunk partials of kda_bwd_grads, summed over the
// chunks in index order by one thread per output: deterministic, no atomics. One CTA per value head.
__global__ void __launch_bounds__(kGateParamsThreads) kda_bwd_gate_params_kernel(const KdaBwdParams p) {
  const int hv = blockIdx.x, HV = p.HV, K = p.K;
  const int nc = dev::total_chunks(p);
  for (int d = threadIdx.x; d < K; d += blockDim.x) {
    float acc = 0.f;
    for (int c = 0; c < nc; ++c) acc += p.pbias[(static_cast<int64_t>(c) * HV + hv) * K + d];
    if (p.ddt_bias) p.ddt_bias[hv * K + d] = acc;
  }
  if (threadIdx.x == 0 && p.dA_log) {
    float acc = 0.f;
    for (int c = 0; c < nc; ++c) acc += p.pA[static_cast<int64_t>(c) * HV + hv];
    p.dA_log[hv] = acc;
  }
}

// GVA: dq[t, h] = l2norm_backward(q[t, h], sum over the group's value heads of dq^[t, hv]), and the
// same for dk. One warp per (token, q/k head); the group is summed in head order (deterministic).
template <typename WT>
__global__ void __launch_bounds__(kGroupSumThreads) kda_bwd_group_sum_kernel(const KdaBwdParams p) {
  using E = dev::Elem<WT>;
  const int lane = threadIdx.x & 31;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  const int64_t rows = static_cast<int64_t>(p.B) * p.T;
  if (item >= rows * p.H) return;
  const int64_t tok = item / p.H;
  const int h = static_cast<int>(item % p.H);
  const int K = p.K, G = p.HV / p.H;
  for (int which = 0; which < 2; ++which) {
    const WT* x = reinterpret_cast<const WT*>(which ? p.k : p.q);
    const float* dhat = which ? p.dkhat : p.dqhat;
    WT* out = reinterpret_cast<WT*>(which ? p.dk : p.dq);
    float xs[4], ds[4];  // K <= 128: at most 4 elements per lane
    float ss = 0.f, dot = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int d = lane + 32 * i;
      xs[i] = ds[i] = 0.f;
      if (d < K) {
        xs[i] = E::to_float(x[(tok * p.H + h) * K + d]);
        float acc = 0.f;
        for (int gi = 0; gi < G; ++gi) acc += dhat[(tok * p.HV + h * G + gi) * K + d];
        ds[i] = acc;
        ss = fmaf(xs[i], xs[i], ss);
      }
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float r = p.opt.l2norm ? 1.f / sqrtf(ss + 1e-6f) : 1.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) dot = fmaf(xs[i] * r, ds[i], dot);
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int d = lane + 32 * i;
      if (d < K) {
        const float v = p.opt.l2norm ? r * (ds[i] - xs[i] * r * dot) : ds[i];
        out[(tok * p.H + h) * K + d] = E::from_float(v);
      }
    }
  }
}

// The launches (kda_launch_shape.h), kda_bwd.cu's and the emulator's. gate_params: once, one CTA
// per value head, only when the gate has parameters and their gradients are asked for (pbias holds
// the per-chunk partials then).
inline LaunchShape gate_params_launch(const KdaBwdParams& p) {
  const bool run = p.pbias && p.HV > 0 && (p.dA_log || p.ddt_bias);
  return {dim3(run ? static_cast<unsigned>(p.HV) : 0u), kGateParamsThreads, 0};
}
// group_sum: per batch slice, GVA only (HV != H), one warp per (token, q/k head) item.
inline LaunchShape group_sum_launch(const KdaBwdParams& p) {
  constexpr int kItemsPerCta = kGroupSumThreads / 32;
  const int64_t items = p.HV != p.H ? static_cast<int64_t>(p.B) * p.T * p.H : 0;
  return {dim3(static_cast<unsigned>((items + kItemsPerCta - 1) / kItemsPerCta)), kGroupSumThreads, 0};
}

}  // namespace kernel_fun::kda
