// The one switch from a conv call's run-time element type and kernel width to the compile-time
// variants of the conv kernels, shared by the forward and backward launchers: a variant added or
// removed here (KF_CCONV_ONLY_BF16_W4 builds bf16 W = 4 alone) is added or removed for both, and an
// unsupported value throws the same message. Host code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>

#include "cconv/cconv_plan.h"  // KF_CCONV_ONLY_BF16_W4
#include "common/cuda_check.h"  // DType
#include "common/dispatch_tags.h"

namespace kernel_fun::cconv {

// f(TypeTag<T>{}) for x's dtype in {bf16, fp16, fp32}.
template <typename F>
decltype(auto) dispatch_x(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBFloat16: return f(TypeTag<__nv_bfloat16>{});
#if !KF_CCONV_ONLY_BF16_W4
    case DType::kFloat16: return f(TypeTag<__half>{});
    case DType::kFloat32: return f(TypeTag<float>{});
#endif
    default: break;
  }
  throw std::invalid_argument("kernel_fun.cconv: x must be bfloat16, float16 or float32");
}

// f(IntTag<W>{}) for the kernel width W in 1..4.
template <typename F>
decltype(auto) dispatch_w(int W, F&& f) {
  switch (W) {
#if !KF_CCONV_ONLY_BF16_W4
    case 1: return f(IntTag<1>{});
    case 2: return f(IntTag<2>{});
    case 3: return f(IntTag<3>{});
#endif
    case 4: return f(IntTag<4>{});
    default: break;
  }
  throw std::invalid_argument("kernel_fun.cconv: W must be in 1..4");
}

// f(TypeTag<T>{}, IntTag<W>{}).
template <typename F>
decltype(auto) dispatch_x_w(DType dtype, int W, F&& f) {
  return dispatch_x(dtype, [&](auto t) -> decltype(auto) {
    return dispatch_w(W, [&](auto w) -> decltype(auto) { return f(t, w); });
  });
}

}  // namespace kernel_fun::cconv
