// Torch-free helpers shared by every kernel family: error checks and small math.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace kernel_fun {

// Launchers report CUDA failures by throwing; the binding layer turns that into a Python
// RuntimeError. Kernels themselves never trap: bad input is rejected before launch.
inline void cuda_check(cudaError_t err, const char* what, const char* file, int line) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("kernel-fun: CUDA error in ") + what + " (" + file + ":" +
                             std::to_string(line) + "): " + cudaGetErrorString(err));
  }
}

#define KF_CUDA_CHECK(expr) ::kernel_fun::cuda_check((expr), #expr, __FILE__, __LINE__)
// After a launch: catches bad launch configurations (not asynchronous faults).
#define KF_CHECK_LAUNCH() ::kernel_fun::cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// Element types the kernels are instantiated for; the binding layer maps torch dtypes onto these.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
  }
  return "?";
}

}  // namespace kernel_fun
