// kda_bwd_finish's two kernels: the fixed-order reductions of the per-chunk gate partials into
// dA_log / ddt_bias, and (GVA) the sum of d(normalised q / k) over each q/k head's value heads
// followed by the l2norm backward. Launched by kda_bwd_finish (kda_bwd.cu).
#pragma once

#include <cstdint>

#include "kda/device/gate.cuh"
#include "kda/device/primitives.cuh"
#include "kda/device/sequence.cuh"
#include "kda/kda_launch_shape.h"

namespace kernel_fun::kda {

constexpr int kGateParamsThreads = 256;
constexpr int kGateSegChunks = 64;  // chunks per segment of the first reduction pass
constexpr int kGroupSumThreads = 256;  // one warp per (token, q/k head) item

// The sum of v over the CTA, in a fixed order (a butterfly inside each warp, then the warps in index
// order by thread 0): the same bits on every run. Valid on thread 0; red holds one double per warp.
// Ends with a barrier, so red can be reused right after.
__device__ __forceinline__ double block_sum_fixed(double v, double* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  double s = 0.0;
  if (threadIdx.x == 0)
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) s += red[w];
  __syncthreads();
  return s;
}

// Rows first, first + stride, ... (< end) of column col of a row-major fp32 matrix, summed in
// double in a fixed order. Four independent accumulators keep four loads in flight per thread:
// the reduction is bound by load latency, not by the adds.
__device__ __forceinline__ double strided_column_sum(const float* m, int64_t ld, int col, int first, int end,
                                                     int stride) {
  double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
  int r = first;
  for (; r + 3 * stride < end; r += 4 * stride) {
    a0 += m[r * ld + col];
    a1 += m[(r + stride) * ld + col];
    a2 += m[(r + 2 * stride) * ld + col];
    a3 += m[(r + 3 * stride) * ld + col];
  }
  for (; r < end; r += stride) a0 += m[r * ld + col];
  return (a0 + a1) + (a2 + a3);
}

// Value head hv's sums over rows first_row + i row_step (i < nrows) of the gate partials: pbias's
// K columns into bias_out[0 .. K) and pA into *A_out (either may be null), in double and in a fixed
// order. Threads (d, grp) = (tid % K, tid / K) sum column d over every groups-th row, then the groups
// are added in order; pA's rows go round-robin over the threads, then block_sum_fixed. Every read
// happens before block_sum_fixed's barriers, every write after them, so the outputs may overwrite
// the first row (the segment pass works in place).
__device__ __forceinline__ void gate_rows_sum(const KdaBwdParams& p, int hv, int first_row, int nrows,
                                              int row_step, float* bias_out, float* A_out) {
  __shared__ double red[kGateParamsThreads / 32];
  __shared__ double col[kGateParamsThreads];
  const int HV = p.HV, K = p.K;
  const int groups = blockDim.x / K;  // K in {64, 128} divides the block
  const int d = threadIdx.x % K, grp = threadIdx.x / K;
  const int64_t ld = static_cast<int64_t>(HV) * K;
  col[threadIdx.x] = strided_column_sum(p.pbias + first_row * ld + hv * K, ld * row_step, d, grp, nrows, groups);
  double a = 0.0;
  for (int i = threadIdx.x; i < nrows; i += blockDim.x)
    a += p.pA[static_cast<int64_t>(first_row + i * row_step) * HV + hv];
  const double sa = block_sum_fixed(a, red);  // its barriers also order col[] and every read above
  if (grp == 0 && bias_out) {
    double s = 0.0;
    for (int gi = 0; gi < groups; ++gi) s += col[gi * K + d];
    bias_out[d] = static_cast<float>(s);
  }
  if (threadIdx.x == 0 && A_out) *A_out = static_cast<float>(sa);
}

// dA_log[hv] and ddt_bias[hv, :] from the per-chunk partials of kda_bwd_grads, in two fixed-order
// passes (deterministic, no atomics): this one sums each segment of kGateSegChunks chunks, the
// next (kda_bwd_gate_params_kernel) the segments. One pass of one thread per output took 0.2 ms
// at B16 T8192 H16 (2048 chunks of dependent loads on 16 CTAs); the sums run in double, so the
// order adds no error that shows beside the partials' own (dA_log cancels: its terms are ~1e3x
// the result on strong decays).
// In place: segment s's sums overwrite the partials of its first chunk (row s * kGateSegChunks of
// pbias / pA), which only this CTA reads (gate_rows_sum writes after all its reads). Grid
// (segment, value head); segments past the last chunk (varlen: max_chunks bounds the device-side
// total) do nothing.
__global__ void __launch_bounds__(kGateParamsThreads) kda_bwd_gate_segments_kernel(const KdaBwdParams p) {
  const int seg = blockIdx.x, hv = blockIdx.y;
  const int nc = dev::total_chunks(p);
  const int c0 = seg * kGateSegChunks;
  if (c0 >= nc) return;
  gate_rows_sum(p, hv, c0, min(nc - c0, kGateSegChunks), 1, p.pbias + (static_cast<int64_t>(c0) * p.HV + hv) * p.K,
                p.pA + static_cast<int64_t>(c0) * p.HV + hv);
}

// The second pass: the segments' sums (rows 0, kGateSegChunks, 2 kGateSegChunks, ... of pbias /
// pA after kda_bwd_gate_segments_kernel) in segment order. One CTA per value head.
__global__ void __launch_bounds__(kGateParamsThreads) kda_bwd_gate_params_kernel(const KdaBwdParams p) {
  const int hv = blockIdx.x;
  const int nseg = (dev::total_chunks(p) + kGateSegChunks - 1) / kGateSegChunks;
  gate_rows_sum(p, hv, 0, nseg, kGateSegChunks, p.ddt_bias ? p.ddt_bias + hv * p.K : nullptr,
                p.dA_log ? p.dA_log + hv : nullptr);
}

// GVA: dq[t, h] = l2norm_backward(q[t, h], sum over the group's value heads of dq^[t, hv]), and the
// same for dk. One warp per (token, q/k head); the group is summed in head order (deterministic).
// The kernel is a stream over dq^ / dk^ (fp32, G x the size of dq / dk), so it is written for bytes
// in flight: lane l owns elements 4 l .. 4 l + 3 (K = 128: the warp's 16-byte loads cover one row;
// K = 64: lanes 16-31 idle), and q's and k's loads are all issued before either is reduced. With one
// 4-byte element per lane and q before k it moved ~1.3 TB/s (GVA B8 T8192 H8 HV16: 1.06 ms of the 7.7
// ms training call, 2026-12-04).
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
  const bool on = 4 * lane < K;  // K in {64, 128}
  const int d0 = on ? 4 * lane : 0;
  const int64_t xo = (tok * p.H + h) * K + d0;           // this lane's 4 elements of q / k / dq / dk
  const int64_t ho = (tok * p.HV + h * G) * K + d0;      // of dq^ / dk^ at the group's first head
  float x[2][4], ds[2][4];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const uint2 raw = on ? *reinterpret_cast<const uint2*>(reinterpret_cast<const WT*>(w ? p.k : p.q) + xo)
                         : make_uint2(0u, 0u);
    const float2 a = E::to_float2(raw.x), b = E::to_float2(raw.y);
    x[w][0] = a.x; x[w][1] = a.y; x[w][2] = b.x; x[w][3] = b.y;
#pragma unroll
    for (int e = 0; e < 4; ++e) ds[w][e] = 0.f;
  }
  for (int gi = 0; gi < G; ++gi) {
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const float4 v = on ? *reinterpret_cast<const float4*>((w ? p.dkhat : p.dqhat) + ho + gi * K)
                          : make_float4(0.f, 0.f, 0.f, 0.f);
      ds[w][0] += v.x; ds[w][1] += v.y; ds[w][2] += v.z; ds[w][3] += v.w;
    }
  }
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    float ss = 0.f, dot = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) ss = fmaf(x[w][e], x[w][e], ss);
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float r = p.opt.l2norm ? dev::l2norm_rstd(ss) : 1.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) dot = fmaf(x[w][e] * r, ds[w][e], dot);
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    float o4[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) o4[e] = p.opt.l2norm ? r * (ds[w][e] - x[w][e] * r * dot) : ds[w][e];
    if (on)
      dev::stg8(reinterpret_cast<WT*>(w ? p.dk : p.dq) + xo, make_uint2(E::pack2(o4[0], o4[1]), E::pack2(o4[2], o4[3])));
  }
}

// The launches (kda_launch_shape.h), kda_bwd.cu's and the emulator's. The gate parameters' two
// passes run once, only when the gate has parameters and their gradients are asked for (pbias
// holds the per-chunk partials then): segments x value heads, then one CTA per value head.
inline bool gate_params_run(const KdaBwdParams& p) {
  return p.pbias && p.HV > 0 && p.max_chunks > 0 && (p.dA_log || p.ddt_bias);
}
inline LaunchShape gate_segments_launch(const KdaBwdParams& p) {
  const unsigned segs = gate_params_run(p) ? static_cast<unsigned>((p.max_chunks + kGateSegChunks - 1) / kGateSegChunks) : 0u;
  return {dim3(segs, static_cast<unsigned>(p.HV)), kGateParamsThreads, 0};
}
inline LaunchShape gate_params_launch(const KdaBwdParams& p) {
  return {dim3(gate_params_run(p) ? static_cast<unsigned>(p.HV) : 0u), kGateParamsThreads, 0};
}
// Both passes in order, through launch(kernel, shape): the GPU launcher and the emulator call this,
// so neither can run one pass without the other.
template <typename Launch>
void for_each_gate_params_pass(const KdaBwdParams& p, Launch&& launch) {
  launch(kda_bwd_gate_segments_kernel, gate_segments_launch(p));
  launch(kda_bwd_gate_params_kernel, gate_params_launch(p));
}
// group_sum: per batch slice, where dq^ / dk^ went to the workspace (GVA, HV != H, without the
// grads kernel's chain, KdaBwdParams::gva_flags; and every call of the token recurrence), one warp per
// (token, q/k head) item.
inline LaunchShape group_sum_launch(const KdaBwdParams& p) {
  constexpr int kItemsPerCta = kGroupSumThreads / 32;
  const int64_t items = p.dqhat && !p.gva_flags ? static_cast<int64_t>(p.B) * p.T * p.H : 0;
  return {dim3(static_cast<unsigned>((items + kItemsPerCta - 1) / kItemsPerCta)), kGroupSumThreads, 0};
}

}  // namespace kernel_fun::kda
