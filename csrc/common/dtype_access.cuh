// Device loads and stores of one element whose dtype is known only at run time (DType), for every
// kernel family: the tensors that may come in any float dtype (KDA's g and beta, cconv's weight,
// bias, states, residual). A uniform switch; keep it off hot loops.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/cuda_check.h"

namespace kernel_fun {

__device__ __forceinline__ float load_any(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<float>(static_cast<const double*>(p)[i]);  // kFloat64
  }
}

__device__ __forceinline__ void store_any(void* p, DType dt, int64_t i, float v) {
  switch (dt) {
    case DType::kFloat32: static_cast<float*>(p)[i] = v; break;
    case DType::kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case DType::kBFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<double*>(p)[i] = static_cast<double>(v); break;  // kFloat64
  }
}

}  // namespace kernel_fun
