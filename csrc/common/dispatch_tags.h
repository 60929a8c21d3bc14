// Tags that carry a compile-time type or int through a generic lambda: the families' dispatch
// helpers (kda/kda_dispatch.h, cconv/cconv_dispatch.h) call f(TypeTag<T>{}, IntTag<N>{}, ...) once
// per run-time value, and f names its template as typename decltype(tag)::type / decltype(tag)::value.
#pragma once

#include <type_traits>

namespace kernel_fun {

template <typename T>
struct TypeTag {
  using type = T;
};
template <int N>
using IntTag = std::integral_constant<int, N>;

// f(std::true_type{}) or f(std::false_type{}): a run-time flag as a kernel's compile-time variant
// (f names it decltype(tag)::value); nested calls pick among the variants of several flags.
template <typename F>
decltype(auto) dispatch_bool(bool b, F&& f) {
  if (b) return f(std::true_type{});
  return f(std::false_type{});
}

}  // namespace kernel_fun
