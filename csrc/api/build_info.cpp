// The kernel_fun op namespace is opened here; each family adds its schemas with a
// STABLE_TORCH_LIBRARY_FRAGMENT in its own csrc/api/<family>_ops.cpp (each schema declared once).
// kernel_fun::build_info reports how this library was built (kernel_fun.versions()). It takes a
// (dummy, empty) tensor: the op without tensor arguments segfaulted when called on the H200 image,
// while every op with tensor arguments dispatched fine, so the library has no tensorless op.
#include <cutlass/version.h>

#include "api/stable_utils.h"

namespace kernel_fun::api {

std::string build_info(Tensor probe) {
  (void)probe;
  Msg o;
  o << "cuda=" << (CUDART_VERSION / 1000) << "." << (CUDART_VERSION % 1000) / 10;
  o << ";cutlass=" << CUTLASS_MAJOR << "." << CUTLASS_MINOR << "." << CUTLASS_PATCH;
#ifdef KF_CUDA_ARCHS
  o << ";archs=" << KF_CUDA_ARCHS;
#endif
  return o.str();
}

}  // namespace kernel_fun::api

STABLE_TORCH_LIBRARY(kernel_fun, m) { m.def("build_info(Tensor probe) -> str"); }

STABLE_TORCH_LIBRARY_IMPL(kernel_fun, CompositeExplicitAutograd, m) {
  m.impl("build_info", TORCH_BOX(&kernel_fun::api::build_info));
}
