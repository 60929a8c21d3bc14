// The one place that turns torch (stable-ABI) tensors into torch-free kernel arguments.
// Only csrc/api/ includes torch headers.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <cuda_runtime.h>

#include <optional>
#include <cstdio>
#include <stdexcept>
#include <type_traits>
#include <string>

#include "common/cuda_check.h"

namespace kernel_fun::api {

using torch::headeronly::ScalarType;
using Tensor = torch::stable::Tensor;

// Message building without iostreams: a crash on the H200 image was first blamed on
// std::ostringstream (the extension there is compiled by /opt/gcc's g++); plain std::string
// appends need nothing from the runtime's locale machinery either way.
// `Msg() << "x must be " << 3` reads like a stream.
class Msg {
 public:
  Msg& operator<<(const char* s) { s_ += s ? s : "(null)"; return *this; }
  Msg& operator<<(const std::string& s) { s_ += s; return *this; }
  Msg& operator<<(char c) { s_ += c; return *this; }
  Msg& operator<<(bool b) { s_ += b ? "true" : "false"; return *this; }
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
  Msg& operator<<(T v) {
    if constexpr (std::is_floating_point_v<T>) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
      s_ += buf;
    } else {
      s_ += std::to_string(v);
    }
    return *this;
  }
  const std::string& str() const { return s_; }

 private:
  std::string s_;
};

// Every argument error names the argument: "weight must be [D, W] ..., got ...". Thrown as
// std::invalid_argument, which torch surfaces in Python as ValueError.
#define KF_ARG_CHECK(cond, ...)                                                      \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      throw std::invalid_argument((::kernel_fun::api::Msg() << __VA_ARGS__).str());  \
    }                                                                                \
  } while (0)

inline const char* scalar_type_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "float32";
    case ScalarType::Half: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Double: return "float64";
    case ScalarType::Int: return "int32";
    case ScalarType::Long: return "int64";
    case ScalarType::Bool: return "bool";
    default: return "other";
  }
}

inline std::optional<DType> to_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return DType::kFloat32;
    case ScalarType::Half: return DType::kFloat16;
    case ScalarType::BFloat16: return DType::kBFloat16;
    case ScalarType::Double: return DType::kFloat64;
    default: return std::nullopt;
  }
}

inline std::string shape_str(const Tensor& t) {
  std::string o = "[";
  for (int64_t i = 0; i < t.dim(); ++i) o += (i ? ", " : "") + std::to_string(t.size(i));
  return o + "]";
}

inline void check_cuda(const Tensor& t, const char* name) {
  KF_ARG_CHECK(t.is_cuda(), name << " must be a CUDA tensor");
}

inline void check_same_device(const Tensor& t, const Tensor& ref, const char* name, const char* ref_name) {
  KF_ARG_CHECK(t.is_cuda() && t.get_device_index() == ref.get_device_index(),
               name << " must be on the same CUDA device as " << ref_name);
}

// The current stream of t's device: every launch goes there (never the legacy default stream).
inline cudaStream_t current_stream(const Tensor& t) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream));
  return reinterpret_cast<cudaStream_t>(stream);
}

inline const void* cptr(const std::optional<Tensor>& t) { return t ? t->data_ptr() : nullptr; }
inline void* mptr(const std::optional<Tensor>& t) { return t ? t->data_ptr() : nullptr; }

}  // namespace kernel_fun::api
