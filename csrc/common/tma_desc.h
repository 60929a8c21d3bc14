// Tensor maps for TMA loads (dev::tma_load_2d / _3d in common/pipeline.cuh), built on the host.
// The GPU build has the driver encode them (cuTensorMapEncodeTiled, reached through the runtime's
// entry-point query, so the extension needs no libcuda link); a KF_EMU build writes the host
// emulator's description (kf_emu::TensorMapDesc) into the same 128 bytes. Torch-free.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/cuda_check.h"

namespace kernel_fun {

// A tiled map over a rank-`rank` tensor (1..5): dims[i] elements, dims[0] innermost and contiguous,
// strides[i] bytes between consecutive indices of dim i >= 1 (multiples of 16; strides[0] unused),
// box[i] elements per copy (1..256; with swizzle_bytes 128 the inner box is exactly 128 bytes and
// the destination 1024-byte aligned). Out-of-bounds box elements land as zeros.
inline CUtensorMap make_tma_desc(const void* base, int rank, DType dtype, const uint64_t* dims,
                                 const uint64_t* strides, const uint32_t* box, int swizzle_bytes) {
  const auto fail = [](const std::string& m) { throw std::invalid_argument("make_tma_desc: " + m); };
  if (rank < 1 || rank > 5) fail("rank " + std::to_string(rank) + " outside [1, 5]");
  if (reinterpret_cast<uintptr_t>(base) % 16) fail("the base address is not 16-byte aligned");
  if (swizzle_bytes != 0 && swizzle_bytes != 128) fail("swizzle must be 0 or 128 bytes");
  const int elem = dtype == DType::kFloat32 ? 4 : dtype == DType::kFloat64 ? 8 : 2;
  for (int i = 0; i < rank; ++i) {
    if (box[i] < 1 || box[i] > 256) fail("box[" + std::to_string(i) + "] outside [1, 256]");
    if (i > 0 && strides[i] % 16) fail("strides[" + std::to_string(i) + "] is not a multiple of 16 bytes");
  }
  if (swizzle_bytes == 128 && box[0] * static_cast<uint32_t>(elem) != 128)
    fail("the 128-byte swizzle needs a 128-byte inner box");
  CUtensorMap m;
  std::memset(&m, 0, sizeof m);
#ifdef KF_EMU
  kf_emu::TensorMapDesc d{};
  d.magic = kf_emu::TensorMapDesc::kMagic;
  d.rank = rank;
  d.elem_bytes = elem;
  d.swizzle_bytes = swizzle_bytes;
  d.base = base;
  for (int i = 0; i < rank; ++i) {
    d.dims[i] = dims[i];
    d.strides[i] = i ? strides[i] : static_cast<uint64_t>(elem);
    d.box[i] = box[i];
  }
  std::memcpy(&m, &d, sizeof d);
#else
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    KF_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !fn) throw std::runtime_error("make_tma_desc: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<Encode>(fn);
  }();
  const CUtensorMapDataType t = dtype == DType::kBFloat16  ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                : dtype == DType::kFloat16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                : dtype == DType::kFloat32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                                           : CU_TENSOR_MAP_DATA_TYPE_FLOAT64;
  cuuint64_t gdim[5], gstride[5];
  cuuint32_t bdim[5], estride[5];
  for (int i = 0; i < rank; ++i) {
    gdim[i] = dims[i];
    bdim[i] = box[i];
    estride[i] = 1;
    if (i) gstride[i - 1] = strides[i];
  }
  const CUresult r = encode(&m, t, static_cast<cuuint32_t>(rank), const_cast<void*>(base), gdim, gstride, bdim, estride,
                            CU_TENSOR_MAP_INTERLEAVE_NONE,
                            swizzle_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw std::runtime_error("make_tma_desc: cuTensorMapEncodeTiled failed (" + std::to_string(r) + ")");
#endif
  return m;
}

}  // namespace kernel_fun
