// kernel_fun::op_calls(probe) -> str: "cconv_fwd=3;cconv_bwd=1;..." - how often each kernel op
// has run in this process (see op_calls.h). Relaxed atomics: the counts are statistics, ordered
// with nothing else; ops may run from several threads (one per device).
#include "api/op_calls.h"

#include <atomic>
#include <string>

#include "api/stable_utils.h"

namespace kernel_fun::api {
namespace {

constexpr int kOps = static_cast<int>(OpId::kCount);
constexpr const char* kNames[kOps] = {"cconv_fwd", "cconv_bwd", "cconv_update", "kda_fwd", "kda_bwd", "kda_fwd_c32",
                                      "kda_fwd_streamed", "kda_bwd_streamed", "kda_fwd_split"};
std::atomic<long long> g_calls[kOps];

std::string op_calls(Tensor probe) {
  (void)probe;  // the library has no tensorless op (see build_info.cpp)
  std::string s;
  for (int i = 0; i < kOps; ++i)
    s += std::string(i ? ";" : "") + kNames[i] + "=" + std::to_string(g_calls[i].load(std::memory_order_relaxed));
  return s;
}

}  // namespace

void count_call(OpId id) { g_calls[static_cast<int>(id)].fetch_add(1, std::memory_order_relaxed); }

}  // namespace kernel_fun::api

STABLE_TORCH_LIBRARY_FRAGMENT(kernel_fun, m) { m.def("op_calls(Tensor probe) -> str"); }

STABLE_TORCH_LIBRARY_IMPL(kernel_fun, CompositeExplicitAutograd, m) {
  m.impl("op_calls", TORCH_BOX(&kernel_fun::api::op_calls));
}
