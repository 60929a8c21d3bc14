// Decode step of the causal conv1d (fla's causal_conv1d_update): for each (n, d)
//   cache[n, d, :] <- [cache[n, d, 1:], x[n, d]]                       (in place)
//   y[n, d] = act(sum_w weight[d, w] * cache[n, d, w] + bias[d]) + residual[n, d]
// One thread per (n, d). Decode moves a few KB per call: latency, not bandwidth, matters, so
// every dtype is resolved at run time (one kernel) and the window is W <= 4 registers.
// y uses the exact x and cache values (fp32 sums); only the stored cache is rounded to its dtype.
#include "cconv/cconv.h"
#include "cconv/cconv_device.cuh"

namespace kernel_fun::cconv {
namespace {

using namespace dev;

__global__ void __launch_bounds__(256) cconv_update_kernel(const UpdateParams p) {
  const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= p.N * p.D) return;
  const int64_t n = id / p.D, d = id % p.D;
  const int64_t cbase = n * p.cache.s0 + d * p.cache.s1;
  float win[kMaxWidth];
#pragma unroll
  for (int k = 0; k < kMaxWidth; ++k) {
    float v = 0.f;
    if (k + 1 < p.W) v = load_any(p.cache.ptr, p.cache.dtype, cbase + (k + 1) * p.cache.s2);
    else if (k + 1 == p.W) v = load_any(p.x.ptr, p.x.dtype, n * p.x.s0 + d * p.x.s2);
    win[k] = v;
  }
  float acc = p.bias.ptr ? load_any(p.bias.ptr, p.bias.dtype, d * p.bias.s0) : 0.f;
#pragma unroll
  for (int k = 0; k < kMaxWidth; ++k)
    if (k < p.W) acc = fmaf(load_any(p.weight.ptr, p.weight.dtype, d * p.weight.s0 + k * p.weight.s1), win[k], acc);
  if (p.act == Activation::kSilu) acc = silu(acc);
  if (p.residual.ptr) acc += load_any(p.residual.ptr, p.residual.dtype, n * p.residual.s0 + d * p.residual.s2);
  store_any(p.y, p.x.dtype, n * p.D + d, acc);
  void* cache = const_cast<void*>(p.cache.ptr);
#pragma unroll
  for (int k = 0; k < kMaxWidth; ++k)
    if (k < p.W) store_any(cache, p.cache.dtype, cbase + k * p.cache.s2, win[k]);
}

}  // namespace

void launch_update(const UpdateParams& p, cudaStream_t stream) {
  const int64_t n = p.N * p.D;
  if (n == 0) return;
  constexpr int kBlock = 256;
  cconv_update_kernel<<<static_cast<unsigned>((n + kBlock - 1) / kBlock), kBlock, 0, stream>>>(p);
  KF_CHECK_LAUNCH();
}

}  // namespace kernel_fun::cconv
