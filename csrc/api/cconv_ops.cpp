// Binding of the causal conv1d family: schemas, input validation and the support decision.
//
//   cconv_support(...) -> str          "" when our kernels take the call, else "invalid: <why>"
//                                      (the Python front raises ValueError) or
//                                      "unsupported: <why>" (it falls back to fla). Works on any
//                                      device, so CPU inputs get the same validation.
//   cconv_update_support(...) -> str   the same for the decode step.
//   cconv_fwd / cconv_bwd / cconv_update write into outputs allocated by the caller and return
//   nothing (their fakes are no-ops); each re-validates and throws naming the argument.
// The kernels take their stream from torch's current stream on x's device.
#include <algorithm>
#include <functional>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/csrc/stable/ops.h>

#include "api/op_calls.h"
#include "api/stable_utils.h"
#include "cconv/cconv.h"

namespace kernel_fun::api {
namespace {

using cconv::Activation;
using cconv::View3;
using OptT = std::optional<Tensor>;

constexpr const char* kFam = "kernel_fun.cconv: ";

bool is_float(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16 || t == ScalarType::Double;
}
bool is_kernel_float(ScalarType t) {  // element types the streaming kernels are built for
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}

std::string shape_of(std::initializer_list<int64_t> dims) {
  std::string o = "[";
  bool first = true;
  for (int64_t d : dims) {
    o += (first ? "" : ", ") + std::to_string(d);
    first = false;
  }
  return o + "]";
}

bool has_shape(const Tensor& t, std::initializer_list<int64_t> dims) {
  if (t.dim() != static_cast<int64_t>(dims.size())) return false;
  int64_t i = 0;
  for (int64_t d : dims)
    if (t.size(i++) != d) return false;
  return true;
}

// No two index tuples share an element (safe to update in place from one thread per element).
bool non_overlapping(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (int64_t i = 0; i < t.dim(); ++i)
    if (t.size(i) > 1) dims.emplace_back(t.stride(i), t.size(i));
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;
  for (auto& [stride, size] : dims) {
    if (stride < span) return false;
    span = stride * size;
  }
  return true;
}

void same_device(const Tensor& t, const Tensor& x, const char* name) {
  // Any device type compares: the Python front checks meta stand-ins at torch.compile trace time.
  const bool ok = t.device() == x.device();
  KF_ARG_CHECK(ok, name << " must be on x's device (" << (x.is_cuda() ? "cuda:" : "cpu")
                        << (x.is_cuda() ? std::to_string(x.get_device_index()) : std::string()) << ")");
}

// t holds floats and lives on x's device: what every tensor beside x must (names it otherwise).
void floating_beside_x(const Tensor& t, const Tensor& x, const char* name) {
  KF_ARG_CHECK(is_float(t.scalar_type()), name << " must be a floating tensor, got " << scalar_type_name(t.scalar_type()));
  same_device(t, x, name);
}

// weight [D, W] with 1 <= W <= kMaxWidth, floating, on x's device; returns W. d_is: where D comes
// from, for the message.
int64_t check_weight(const Tensor& w, int64_t D, const Tensor& x, const char* d_is) {
  KF_ARG_CHECK(w.dim() == 2 && w.size(0) == D, "weight must be [D, W] = [" << D << ", W]" << d_is << ", got " << shape_str(w));
  const int64_t W = w.size(1);
  KF_ARG_CHECK(W >= 1 && W <= cconv::kMaxWidth,
               "weight has W=" << W << " taps; kernel_fun.cconv supports kernel widths 1.." << cconv::kMaxWidth);
  floating_beside_x(w, x, "weight");
  return W;
}

// bias [D], floating, on x's device.
void check_bias(const Tensor& bias, int64_t D, const Tensor& x) {
  KF_ARG_CHECK(has_shape(bias, {D}), "bias must be [D] = " << shape_of({D}) << ", got " << shape_str(bias));
  floating_beside_x(bias, x, "bias");
}

Activation parse_activation(const std::optional<std::string>& a) {
  if (!a.has_value()) return Activation::kNone;
  if (*a == "silu" || *a == "swish") return Activation::kSilu;
  KF_ARG_CHECK(false, "activation must be None, 'silu' or 'swish', got '" << *a << "'");
  return Activation::kNone;
}

// Thrown for arguments our kernels do not cover but fla does (the caller falls back).
struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct FwdShape {
  int64_t B, T, D, W, N;
};

// Everything the forward needs to be valid; throws std::invalid_argument or Unsupported.
FwdShape check_forward(const Tensor& x, const OptT& weight, const OptT& bias, const OptT& residual,
                       const OptT& initial_state, const OptT& cu_seqlens, const OptT& cu_seqlens_cpu) {
  KF_ARG_CHECK(x.dim() == 3, "x must be [B, T, D] (trailing dims flattened into D), got " << shape_str(x));
  KF_ARG_CHECK(is_float(x.scalar_type()),
               "x must be a floating tensor (bfloat16, float16 or float32), got " << scalar_type_name(x.scalar_type()));
  if (!weight.has_value()) throw Unsupported("weight=None (no convolution weights)");
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  const int64_t W = check_weight(*weight, D, x, " (D = x.shape[-1])");
  if (bias) check_bias(*bias, D, x);
  if (residual) {
    KF_ARG_CHECK(has_shape(*residual, {B, T, D}),
                 "residual must have x's shape " << shape_of({B, T, D}) << ", got " << shape_str(*residual));
    floating_beside_x(*residual, x, "residual");
  }
  int64_t N = B;
  if (cu_seqlens) {
    const Tensor& cu = *cu_seqlens;
    KF_ARG_CHECK(B == 1, "cu_seqlens requires B == 1 (documents packed along T), got B=" << B);
    KF_ARG_CHECK(cu.dim() == 1 && cu.size(0) >= 2,
                 "cu_seqlens must be 1-D [N+1] with N >= 1, got " << shape_str(cu));
    KF_ARG_CHECK(cu.scalar_type() == ScalarType::Int || cu.scalar_type() == ScalarType::Long,
                 "cu_seqlens must be int32 or int64, got " << scalar_type_name(cu.scalar_type()));
    same_device(cu, x, "cu_seqlens");
    N = cu.size(0) - 1;
  }
  if (cu_seqlens_cpu) {
    const Tensor& cc = *cu_seqlens_cpu;
    KF_ARG_CHECK(cu_seqlens.has_value(), "cu_seqlens_cpu was given without cu_seqlens");
    KF_ARG_CHECK(cc.is_cpu(), "cu_seqlens_cpu must be a CPU tensor (a host copy of cu_seqlens)");
    KF_ARG_CHECK(cc.dim() == 1 && cc.size(0) == N + 1,
                 "cu_seqlens_cpu must be [N+1] = " << shape_of({N + 1}) << " like cu_seqlens, got " << shape_str(cc));
    KF_ARG_CHECK(cc.scalar_type() == ScalarType::Int || cc.scalar_type() == ScalarType::Long,
                 "cu_seqlens_cpu must be int32 or int64, got " << scalar_type_name(cc.scalar_type()));
    const bool i64 = cc.scalar_type() == ScalarType::Long;
    const int64_t st = cc.stride(0);
    auto at = [&](int64_t i) {
      return i64 ? static_cast<const int64_t*>(cc.data_ptr())[i * st]
                 : static_cast<int64_t>(static_cast<const int32_t*>(cc.data_ptr())[i * st]);
    };
    KF_ARG_CHECK(at(0) == 0, "cu_seqlens must start at 0, got " << at(0));
    for (int64_t i = 0; i < N; ++i)
      KF_ARG_CHECK(at(i + 1) >= at(i), "cu_seqlens must be non-decreasing, got cu_seqlens[" << i << "]=" << at(i)
                                           << " > cu_seqlens[" << i + 1 << "]=" << at(i + 1));
    KF_ARG_CHECK(at(N) == T, "cu_seqlens must end at T=" << T << " (x.shape[1]), got " << at(N));
  }
  if (initial_state) {
    KF_ARG_CHECK(has_shape(*initial_state, {N, D, W}),
                 "initial_state must be [N, D, W] = " << shape_of({N, D, W}) << " (N = "
                     << (cu_seqlens ? "len(cu_seqlens) - 1" : "B") << "), got " << shape_str(*initial_state));
    floating_beside_x(*initial_state, x, "initial_state");
  }
  if (!is_kernel_float(x.scalar_type()))
    throw Unsupported(std::string("x dtype ") + scalar_type_name(x.scalar_type()) + " (kernels cover bfloat16, float16, float32)");
  // B * T >= 2^31, without forming the product (an empty x may have huge B and T). Keeps every
  // per-thread chunk (and so the kernels' int row counters) far below 2^31.
  if (T > 0 && B > ((int64_t{1} << 31) - 1) / T) throw Unsupported("2^31 or more tokens");
  if (D == 0) throw Unsupported("D == 0");
  return {B, T, D, W, N};
}

// The update's x is [N, D], [N, 1, D] or [1, N, D]; returns (N, n stride, d stride).
struct TokView {
  int64_t N, D, sn, sd;
};
TokView token_view(const Tensor& t, const char* name) {
  if (t.dim() == 2) return {t.size(0), t.size(1), t.stride(0), t.stride(1)};
  if (t.dim() == 3 && t.size(1) == 1) return {t.size(0), t.size(2), t.stride(0), t.stride(2)};
  if (t.dim() == 3 && t.size(0) == 1) return {t.size(1), t.size(2), t.stride(1), t.stride(2)};
  KF_ARG_CHECK(false, name << " must be [N, D], [N, 1, D] or [1, N, D], got " << shape_str(t));
  return {};
}

TokView check_update(const Tensor& x, const OptT& cache, const OptT& residual, const OptT& weight, const OptT& bias) {
  const TokView v = token_view(x, "x");
  KF_ARG_CHECK(is_float(x.scalar_type()), "x must be a floating tensor, got " << scalar_type_name(x.scalar_type()));
  if (!weight.has_value()) throw Unsupported("weight=None (no convolution weights)");
  if (!cache.has_value()) throw Unsupported("cache=None");
  const int64_t W = check_weight(*weight, v.D, x, "");
  KF_ARG_CHECK(has_shape(*cache, {v.N, v.D, W}),
               "cache must be [N, D, W] = " << shape_of({v.N, v.D, W}) << ", got " << shape_str(*cache));
  floating_beside_x(*cache, x, "cache");
  KF_ARG_CHECK(non_overlapping(*cache), "cache must not have overlapping elements (it is updated in place)");
  if (bias) check_bias(*bias, v.D, x);
  if (residual) {
    bool same = residual->dim() == x.dim();
    for (int64_t i = 0; same && i < x.dim(); ++i) same = residual->size(i) == x.size(i);
    KF_ARG_CHECK(same, "residual must have x's shape " << shape_str(x) << ", got " << shape_str(*residual));
    floating_beside_x(*residual, x, "residual");
  }
  if (!is_kernel_float(x.scalar_type()))
    throw Unsupported(std::string("x dtype ") + scalar_type_name(x.scalar_type()) + " (kernels cover bfloat16, float16, float32)");
  if (!is_kernel_float(cache->scalar_type()))
    throw Unsupported(std::string("cache dtype ") + scalar_type_name(cache->scalar_type()) +
                      " (the in-place shift keeps values exact only for bfloat16, float16, float32)");
  return v;
}

std::string verdict(const std::function<void()>& check) {
  try {
    check();
  } catch (const Unsupported& e) {
    return std::string("unsupported: ") + e.what();
  } catch (const std::invalid_argument& e) {
    return std::string("invalid: ") + e.what();
  }
  return std::string();
}

std::string cconv_support(Tensor x, OptT weight, OptT bias, OptT residual, OptT initial_state,
                          bool output_final_state, std::optional<std::string> activation, OptT cu_seqlens,
                          OptT cu_seqlens_cpu) {
  (void)output_final_state;  // any value is fine; kept so the schema mirrors fla's arguments
  return verdict([&] {
    parse_activation(activation);
    check_forward(x, weight, bias, residual, initial_state, cu_seqlens, cu_seqlens_cpu);
  });
}

std::string cconv_update_support(Tensor x, OptT cache, OptT residual, OptT weight, OptT bias,
                                 std::optional<std::string> activation) {
  return verdict([&] {
    parse_activation(activation);
    check_update(x, cache, residual, weight, bias);
  });
}

// ---- kernel ops ---------------------------------------------------------------------------------

DType dtype_of(const Tensor& t) {
  auto d = to_dtype(t.scalar_type());
  KF_ARG_CHECK(d.has_value(), "unsupported dtype " << scalar_type_name(t.scalar_type()));
  return *d;
}

View3 view3(const Tensor& t) {
  View3 v;
  v.ptr = t.data_ptr();
  v.dtype = dtype_of(t);
  v.s0 = t.dim() > 0 ? t.stride(0) : 0;
  v.s1 = t.dim() > 1 ? t.stride(1) : 0;
  v.s2 = t.dim() > 2 ? t.stride(2) : 0;
  return v;
}
View3 view3(const OptT& t) { return t ? view3(*t) : View3{}; }

Activation activation_code(int64_t a) {
  KF_ARG_CHECK(a == 0 || a == 1, "activation code must be 0 (none) or 1 (silu), got " << a);
  return static_cast<Activation>(a);
}

void check_out(const Tensor& t, const Tensor& x, std::initializer_list<int64_t> dims, ScalarType dt, const char* name) {
  KF_ARG_CHECK(has_shape(t, dims), name << " must be " << shape_of(dims) << ", got " << shape_str(t));
  KF_ARG_CHECK(t.scalar_type() == dt, name << " must be " << scalar_type_name(dt) << ", got " << scalar_type_name(t.scalar_type()));
  KF_ARG_CHECK(t.is_contiguous(), name << " must be contiguous");
  check_cuda(t, name);
  same_device(t, x, name);
}

cconv::Sequences sequences(const FwdShape& s, const OptT& cu_seqlens) {
  cconv::Sequences q;
  q.cu_seqlens = cu_seqlens ? cu_seqlens->data_ptr() : nullptr;
  q.cu_int64 = cu_seqlens && cu_seqlens->scalar_type() == ScalarType::Long;
  q.num_seqs = s.N;
  q.seq_len = s.T;
  q.total = s.B * s.T;
  return q;
}

FwdShape check_kernel_forward(const Tensor& x, const Tensor& weight, const OptT& bias, const OptT& residual,
                              const OptT& initial_state, const OptT& cu_seqlens) {
  check_cuda(x, "x");
  try {
    return check_forward(x, weight, bias, residual, initial_state, cu_seqlens, std::nullopt);
  } catch (const Unsupported& e) {
    throw std::invalid_argument(std::string(kFam) + "unsupported input: " + e.what());
  }
}

void cconv_fwd(Tensor x, Tensor weight, OptT bias, OptT residual, OptT initial_state, OptT cu_seqlens,
               int64_t activation, Tensor y, OptT final_state) {
  const FwdShape s = check_kernel_forward(x, weight, bias, residual, initial_state, cu_seqlens);
  check_out(y, x, {s.B, s.T, s.D}, x.scalar_type(), "y");
  if (cu_seqlens) KF_ARG_CHECK(cu_seqlens->is_contiguous(), "cu_seqlens must be contiguous");
  if (final_state) check_out(*final_state, x, {s.N, s.D, s.W}, x.scalar_type(), "final_state");
  torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  cconv::FwdParams p;
  p.x = view3(x);
  p.y = y.data_ptr();
  p.weight = view3(weight);
  p.bias = view3(bias);
  p.residual = view3(residual);
  p.h0 = view3(initial_state);
  p.ht = final_state ? final_state->data_ptr() : nullptr;
  p.seq = sequences(s, cu_seqlens);
  p.B = s.B;
  p.D = s.D;
  p.W = static_cast<int>(s.W);
  p.act = activation_code(activation);
  count_call(OpId::kCconvFwd);
  cconv::launch_fwd(p, current_stream(x));
}

void cconv_bwd(Tensor x, Tensor weight, OptT bias, OptT initial_state, OptT cu_seqlens, Tensor dy, OptT dht,
               int64_t activation, Tensor dx, Tensor dw, OptT db, OptT dh0) {
  const FwdShape s = check_kernel_forward(x, weight, bias, std::nullopt, initial_state, cu_seqlens);
  if (cu_seqlens) KF_ARG_CHECK(cu_seqlens->is_contiguous(), "cu_seqlens must be contiguous");
  KF_ARG_CHECK(has_shape(dy, {s.B, s.T, s.D}), "dy must have x's shape " << shape_of({s.B, s.T, s.D}) << ", got " << shape_str(dy));
  KF_ARG_CHECK(dy.scalar_type() == x.scalar_type(),
               "dy must have x's dtype " << scalar_type_name(x.scalar_type()) << ", got " << scalar_type_name(dy.scalar_type()));
  same_device(dy, x, "dy");
  if (dht) {
    KF_ARG_CHECK(has_shape(*dht, {s.N, s.D, s.W}),
                 "dht (d final_state) must be " << shape_of({s.N, s.D, s.W}) << ", got " << shape_str(*dht));
    KF_ARG_CHECK(is_float(dht->scalar_type()), "dht must be a floating tensor");
    same_device(*dht, x, "dht");
  }
  check_out(dx, x, {s.B, s.T, s.D}, x.scalar_type(), "dx");
  check_out(dw, x, {s.D, s.W}, dw.scalar_type(), "dw");
  KF_ARG_CHECK(is_float(dw.scalar_type()), "dw must be a floating tensor");
  KF_ARG_CHECK(db.has_value() == bias.has_value(), "db must be given exactly when bias is");
  if (db) {
    check_out(*db, x, {s.D}, db->scalar_type(), "db");
    KF_ARG_CHECK(is_float(db->scalar_type()), "db must be a floating tensor");
  }
  KF_ARG_CHECK(!dh0.has_value() || initial_state.has_value(), "dh0 needs initial_state");
  if (dh0) {
    check_out(*dh0, x, {s.N, s.D, s.W}, dh0->scalar_type(), "dh0");
    KF_ARG_CHECK(is_float(dh0->scalar_type()), "dh0 must be a floating tensor");
  }
  torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  cconv::BwdParams p;
  p.x = view3(x);
  p.weight = view3(weight);
  p.bias = view3(bias);
  p.h0 = view3(initial_state);
  p.dy = view3(dy);
  p.dht = view3(dht);
  p.dx = dx.data_ptr();
  p.dw = dw.data_ptr();
  p.dw_dtype = dtype_of(dw);
  p.db = db ? db->data_ptr() : nullptr;
  p.db_dtype = db ? dtype_of(*db) : DType::kFloat32;
  p.dh0 = dh0 ? dh0->data_ptr() : nullptr;
  p.dh0_dtype = dh0 ? dtype_of(*dh0) : DType::kFloat32;
  p.seq = sequences(s, cu_seqlens);
  p.B = s.B;
  p.D = s.D;
  p.W = static_cast<int>(s.W);
  p.act = activation_code(activation);
  // fp32 partials of dw/db, one row per CTA row of the backward grid (from the caching allocator).
  const int64_t ws_floats = cconv::bwd_workspace_floats(p.seq.total, s.D, p.W, bias.has_value(), p.x.dtype);
  const std::vector<int64_t> ws_shape{std::max<int64_t>(ws_floats, 1)};
  Tensor ws = torch::stable::new_empty(x, ws_shape, ScalarType::Float);
  p.workspace = static_cast<float*>(ws.data_ptr());
  count_call(OpId::kCconvBwd);
  cconv::launch_bwd(p, current_stream(x));
}

void cconv_update(Tensor x, Tensor cache, OptT residual, Tensor weight, OptT bias, int64_t activation, Tensor y) {
  check_cuda(x, "x");
  TokView v;
  try {
    v = check_update(x, cache, residual, weight, bias);
  } catch (const Unsupported& e) {
    throw std::invalid_argument(std::string(kFam) + "unsupported input: " + e.what());
  }
  bool same = y.dim() == x.dim();
  for (int64_t i = 0; same && i < x.dim(); ++i) same = y.size(i) == x.size(i);
  KF_ARG_CHECK(same && y.is_contiguous() && y.scalar_type() == x.scalar_type(),
               "y must be a contiguous tensor of x's shape and dtype");
  same_device(y, x, "y");
  torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  cconv::UpdateParams p;
  p.x.ptr = x.data_ptr();
  p.x.dtype = dtype_of(x);
  p.x.s0 = v.sn;
  p.x.s2 = v.sd;
  p.y = y.data_ptr();
  p.cache = view3(cache);
  p.weight = view3(weight);
  p.bias = view3(bias);
  if (residual) {
    const TokView r = token_view(*residual, "residual");
    p.residual.ptr = residual->data_ptr();
    p.residual.dtype = dtype_of(*residual);
    p.residual.s0 = r.sn;
    p.residual.s2 = r.sd;
  }
  p.N = v.N;
  p.D = v.D;
  p.W = static_cast<int>(weight.size(1));
  p.act = activation_code(activation);
  count_call(OpId::kCconvUpdate);
  cconv::launch_update(p, current_stream(x));
}

}  // namespace
}  // namespace kernel_fun::api

STABLE_TORCH_LIBRARY_FRAGMENT(kernel_fun, m) {
  m.def("cconv_support(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, Tensor? initial_state, "
        "bool output_final_state, str? activation, Tensor? cu_seqlens, Tensor? cu_seqlens_cpu) -> str");
  m.def("cconv_update_support(Tensor x, Tensor? cache, Tensor? residual, Tensor? weight, Tensor? bias, "
        "str? activation) -> str");
  m.def("cconv_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, Tensor? initial_state, "
        "Tensor? cu_seqlens, int activation, Tensor(a!) y, Tensor(b!)? final_state) -> ()");
  m.def("cconv_bwd(Tensor x, Tensor weight, Tensor? bias, Tensor? initial_state, Tensor? cu_seqlens, "
        "Tensor dy, Tensor? dht, int activation, Tensor(a!) dx, Tensor(b!) dw, Tensor(c!)? db, "
        "Tensor(d!)? dh0) -> ()");
  m.def("cconv_update(Tensor x, Tensor(a!) cache, Tensor? residual, Tensor weight, Tensor? bias, "
        "int activation, Tensor(b!) y) -> ()");
}

// The support checks read only metadata (and cu_seqlens_cpu on the host): any device.
STABLE_TORCH_LIBRARY_IMPL(kernel_fun, CompositeExplicitAutograd, m) {
  m.impl("cconv_support", TORCH_BOX(&kernel_fun::api::cconv_support));
  m.impl("cconv_update_support", TORCH_BOX(&kernel_fun::api::cconv_update_support));
}

STABLE_TORCH_LIBRARY_IMPL(kernel_fun, CUDA, m) {
  m.impl("cconv_fwd", TORCH_BOX(&kernel_fun::api::cconv_fwd));
  m.impl("cconv_bwd", TORCH_BOX(&kernel_fun::api::cconv_bwd));
  m.impl("cconv_update", TORCH_BOX(&kernel_fun::api::cconv_update));
}
