// The one switch from the run-time problem to the compile-time variants of the KDA kernels: the
// 16-bit element type WT (q, k, v, o and the 16-bit workspace), the key dimension K and the scans'
// value slice BV. The launchers (kda_fwd.cu, kda_bwd.cu) and the host emulator (tests/emu) call
// their templates through it, so a variant added or removed here is added or removed everywhere,
// and an unsupported value throws naming the stage. Host code; no CUDA runtime calls.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "common/cuda_check.h"  // DType
#include "common/dispatch_tags.h"

namespace kernel_fun::kda {

// f(TypeTag<WT>{}) for dtype in {bf16, fp16}.
template <typename F>
void dispatch_wt(DType dtype, const char* stage, F&& f) {
  switch (dtype) {
    case DType::kBFloat16: return f(TypeTag<__nv_bfloat16>{});
    case DType::kFloat16: return f(TypeTag<__half>{});
    default: throw std::invalid_argument(std::string(stage) + ": dtype must be bfloat16 or float16");
  }
}

// f(IntTag<K>{}) for K in {64, 128} (kernels that read their element types at run time).
template <typename F>
void dispatch_k(int K, const char* stage, F&& f) {
  if (K != 64 && K != 128) throw std::invalid_argument(std::string(stage) + ": K must be 64 or 128, got " + std::to_string(K));
  if (K == 128) return f(IntTag<128>{});
  return f(IntTag<64>{});
}

// f(TypeTag<WT>{}, IntTag<K>{}) for (dtype, K) in {bf16, fp16} x {64, 128}.
template <typename F>
void dispatch_wt_k(DType dtype, int K, const char* stage, F&& f) {
  dispatch_k(K, stage, [&](auto k) { dispatch_wt(dtype, stage, [&](auto wt) { return f(wt, k); }); });
}

// f(TypeTag<WT>{}, IntTag<K>{}, IntTag<BV>{}) for the scans, BV in {64, 128}.
template <typename F>
void dispatch_wt_k_bv(DType dtype, int K, int bv, const char* stage, F&& f) {
  if (bv != 64 && bv != 128)
    throw std::invalid_argument(std::string(stage) + ": the value slice must be 64 or 128, got " + std::to_string(bv));
  dispatch_wt_k(dtype, K, stage, [&](auto wt, auto k) {
    if (bv == 128) return f(wt, k, IntTag<128>{});
    return f(wt, k, IntTag<64>{});
  });
}

}  // namespace kernel_fun::kda
