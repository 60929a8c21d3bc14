// Torch binding of the KDA forward kernels (csrc/kda/sm90/). Validation and the support decision
// live here; the kernels see plain pointers and sizes (KdaFwdParams).
//
//   kda_fwd_support(...) -> str   "" when our kernels serve the call, else the reason
//   kda_fwd_check(...)  -> str    "" when kda_fwd's arguments are valid, else the message
//   kda_fwd(...)        -> ()     writes o, final_state, h_states and the workspace tensors
#include <stdexcept>
#include <string>
#include <type_traits>

#include "api/stable_utils.h"
#include "kda/sm90/kda_fwd.h"

namespace kernel_fun::api {

namespace {

using kda::GateMode;
using kda::KdaFwdParams;
using kda::kChunk;

constexpr const char* kOp = "kernel_fun.kda_fwd: ";

bool is_half_like(ScalarType t) { return t == ScalarType::BFloat16 || t == ScalarType::Half; }
bool is_float_like(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16 || t == ScalarType::Double;
}

// Why the kernels cannot run this configuration ("" = they can). Shapes are the contract's.
std::string support_reason(const Tensor& q, const Tensor& v, const Tensor& g, const Tensor& beta,
                           const std::optional<Tensor>& cu_seqlens, int64_t chunk_size) {
  const ScalarType dt = q.scalar_type();
  if (!is_half_like(dt)) return std::string("q dtype ") + scalar_type_name(dt) + " (kernels take bfloat16 or float16)";
  if (v.scalar_type() != dt) return "v dtype differs from q's";
  if (!is_float_like(g.scalar_type())) return "g dtype is not a float type";
  if (!is_float_like(beta.scalar_type())) return "beta dtype is not a float type";
  const int64_t K = q.size(3), V = v.size(3);
  if (K != 64 && K != 128) return "K=" + std::to_string(K) + " (kernels support K in {64, 128})";
  if (V % 64 != 0 || V > 512 || V == 0)
    return "V=" + std::to_string(V) + " (kernels support V a multiple of 64 up to 512)";
  if (chunk_size != kChunk)
    return "chunk_size=" + std::to_string(chunk_size) + " (kernels use 64-token chunks; 32 is not implemented)";
  if (v.size(2) > 65535) return "HV > 65535";
  if (cu_seqlens) {
    const int64_t N = cu_seqlens->numel() - 1;
    if (N > 65535) return "more than 65535 varlen sequences";
    const ScalarType ct = cu_seqlens->scalar_type();
    if (ct != ScalarType::Int && ct != ScalarType::Long) return "cu_seqlens must be int32 or int64";
  } else if (q.size(0) > 65535) {
    // The scan's grid is (V / BV, HV, N) and gridDim.z <= 65535; without cu_seqlens N = B (also
    // when T == 0: the scan still runs to carry initial_state to final_state).
    return "B=" + std::to_string(q.size(0)) + " > 65535 sequences (the scan grid's z dimension)";
  }
  // B * T > 2^30, without forming the product (an empty q may have huge B and T).
  const int64_t B = q.size(0), T = q.size(1);
  if (T > 0 && B > (int64_t{1} << 30) / T) return "more than 2^30 tokens";
  return "";
}

std::string kda_fwd_support(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta,
                            std::optional<Tensor> cu_seqlens, int64_t chunk_size) {
  (void)k;
  return support_reason(q, v, g, beta, cu_seqlens, chunk_size);
}

// Messages are built by plain std::string concatenation and RETURNED, never thrown from the
// validation: on the H200 box (torch 2.11 + the extension's toolchain) both a std::ostringstream
// in this library and an exception thrown through a stable-ABI kernel crashed the interpreter
// (2026-11-29), so the check path uses neither.
inline void app(std::string& s, const std::string& x) { s += x; }
inline void app(std::string& s, const char* x) { s += x; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void app(std::string& s, T x) { s += std::to_string(static_cast<long long>(x)); }
template <typename... A>
std::string cat(const A&... a) {
  std::string s = kOp;
  (app(s, a), ...);
  return s;
}
std::string dims(const Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(static_cast<long long>(t.size(i)));
  return s + "]";
}
std::string dims(std::initializer_list<int64_t> shape) {
  std::string s = "[";
  int i = 0;
  for (int64_t d : shape) s += (i++ ? ", " : "") + std::to_string(static_cast<long long>(d));
  return s + "]";
}
// Returns the message from the enclosing function when cond fails.
#define KDA_REQUIRE(cond, ...) \
  do {                         \
    if (!(cond)) return cat(__VA_ARGS__); \
  } while (0)
#define KDA_TRY(expr)                      \
  do {                                     \
    std::string kda_err_ = (expr);         \
    if (!kda_err_.empty()) return kda_err_; \
  } while (0)

std::string check_tensor(const Tensor& t, const Tensor& ref, const char* name, std::initializer_list<int64_t> shape) {
  KDA_REQUIRE(t.is_cuda(), name, " must be a CUDA tensor");
  KDA_REQUIRE(t.get_device_index() == ref.get_device_index(), name, " must be on q's CUDA device");
  KDA_REQUIRE(t.is_contiguous(), name, " must be contiguous");
  bool ok = t.dim() == static_cast<int64_t>(shape.size());
  if (ok) {
    int i = 0;
    for (int64_t s : shape) ok = ok && t.size(i++) == s;
  }
  KDA_REQUIRE(ok, name, " must have shape ", dims(shape), ", got ", dims(t));
  return "";
}

std::string check_dtype(const Tensor& t, ScalarType want, const char* name) {
  KDA_REQUIRE(t.scalar_type() == want, name, " must be ", scalar_type_name(want), ", got ",
              scalar_type_name(t.scalar_type()));
  return "";
}

#define KF_KDA_FWD_ARGS                                                                                    \
  Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, std::optional<Tensor> A_log,                       \
      std::optional<Tensor> dt_bias, std::optional<Tensor> initial_state, std::optional<Tensor> cu_seqlens, \
      double scale, bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, \
      bool allow_neg_eigval, std::optional<double> lower_bound, bool state_v_first, Tensor o,              \
      std::optional<Tensor> final_state, std::optional<Tensor> h_states, Tensor w, Tensor qg, Tensor kg,    \
      Tensor Aqk, Tensor Akk, Tensor gdecay, Tensor chunk_offsets
#define KF_KDA_FWD_NAMES                                                                                  \
  q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel,          \
      use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, o,   \
      final_state, h_states, w, qg, kg, Aqk, Akk, gdecay, chunk_offsets

// Validates every argument and fills the params; returns "" or a message naming the argument.
std::string prepare(KdaFwdParams& p, bool with_pointers, KF_KDA_FWD_ARGS) {
  KDA_REQUIRE(q.dim() == 4, "q must be [B, T, H, K], got ", dims(q));
  KDA_REQUIRE(v.dim() == 4, "v must be [B, T, HV, V], got ", dims(v));
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  const int64_t HV = v.size(2), V = v.size(3);
  KDA_REQUIRE(H > 0 && HV % H == 0, "v's head count HV=", HV, " must be a multiple of q's H=", H);
  const std::string why = support_reason(q, v, g, beta, cu_seqlens, kChunk);
  KDA_REQUIRE(why.empty(), "unsupported configuration: ", why);
  KDA_TRY(check_tensor(q, q, "q", {B, T, H, K}));
  KDA_TRY(check_tensor(k, q, "k", {B, T, H, K}));
  KDA_TRY(check_dtype(k, q.scalar_type(), "k"));
  KDA_TRY(check_tensor(v, q, "v", {B, T, HV, V}));
  KDA_TRY(check_tensor(g, q, "g", {B, T, HV, K}));
  KDA_TRY(check_tensor(beta, q, "beta", {B, T, HV}));
  KDA_REQUIRE(!allow_neg_eigval || use_beta_sigmoid_in_kernel,
               "allow_neg_eigval requires use_beta_sigmoid_in_kernel");

  int64_t N = B;
  if (cu_seqlens) {
    KDA_REQUIRE(B == 1, "cu_seqlens requires B == 1, got B=", B);
    KDA_REQUIRE(cu_seqlens->dim() == 1 && cu_seqlens->numel() >= 2,
                 "cu_seqlens must be 1-D with N+1 >= 2 entries, got ", dims(*cu_seqlens));
    KDA_TRY(check_tensor(*cu_seqlens, q, "cu_seqlens", {cu_seqlens->numel()}));
    N = cu_seqlens->numel() - 1;
  }
  const int64_t nts = (T + kChunk - 1) / kChunk;
  const int64_t max_chunks = cu_seqlens ? T / kChunk + N : B * nts;

  if (use_gate_in_kernel) {
    KDA_REQUIRE(A_log || lower_bound, "use_gate_in_kernel needs A_log (or lower_bound)");
    if (A_log) {
      KDA_TRY(check_tensor(*A_log, q, "A_log", {HV}));
      KDA_TRY(check_dtype(*A_log, ScalarType::Float, "A_log"));
    }
    if (dt_bias) {
      KDA_TRY(check_tensor(*dt_bias, q, "dt_bias", {HV * K}));
      KDA_TRY(check_dtype(*dt_bias, ScalarType::Float, "dt_bias"));
    }
  }
  if (initial_state) {
    if (state_v_first) KDA_TRY(check_tensor(*initial_state, q, "initial_state", {N, HV, V, K}));
    else KDA_TRY(check_tensor(*initial_state, q, "initial_state", {N, HV, K, V}));
    KDA_TRY(check_dtype(*initial_state, ScalarType::Float, "initial_state"));
  }
  KDA_TRY(check_tensor(o, q, "o", {B, T, HV, V}));
  KDA_TRY(check_dtype(o, q.scalar_type(), "o"));
  if (final_state) {
    if (state_v_first) KDA_TRY(check_tensor(*final_state, q, "final_state", {N, HV, V, K}));
    else KDA_TRY(check_tensor(*final_state, q, "final_state", {N, HV, K, V}));
    KDA_TRY(check_dtype(*final_state, ScalarType::Float, "final_state"));
  }
  if (h_states) {
    KDA_REQUIRE(h_states->dim() == 5 && h_states->size(2) == HV &&
                     h_states->size(3) == (state_v_first ? V : K) && h_states->size(4) == (state_v_first ? K : V),
                 "h_states must be [B, NT, HV, ", (state_v_first ? "V, K" : "K, V"), "], got "
                    , dims(*h_states));
    const int64_t have = h_states->size(0) * h_states->size(1);
    KDA_REQUIRE(cu_seqlens ? have >= 0 : have == B * nts,
                 "h_states must hold one state per chunk, got ", dims(*h_states));
    KDA_TRY(check_tensor(*h_states, q, "h_states", {h_states->size(0), h_states->size(1), HV, h_states->size(3),
                                             h_states->size(4)}));
    KDA_TRY(check_dtype(*h_states, q.scalar_type(), "h_states"));
  }
  for (auto [t, name, inner] : {std::tuple<Tensor*, const char*, int64_t>{&w, "w", K}, {&qg, "qg", K}, {&kg, "kg", K},
                                {&Aqk, "Aqk", kChunk}, {&Akk, "Akk", kChunk}}) {
    KDA_TRY(check_tensor(*t, q, name, {B * T, HV, inner}));
    KDA_TRY(check_dtype(*t, q.scalar_type(), name));
  }
  KDA_TRY(check_tensor(gdecay, q, "gdecay", {max_chunks, HV, K}));
  KDA_TRY(check_dtype(gdecay, ScalarType::Float, "gdecay"));
  KDA_TRY(check_tensor(chunk_offsets, q, "chunk_offsets", {N + 1}));
  KDA_TRY(check_dtype(chunk_offsets, ScalarType::Int, "chunk_offsets"));

  // (no data pointers during validation alone: it also runs on fake tensors under torch.compile)
  if (with_pointers) {
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.g = g.data_ptr();
    p.beta = beta.data_ptr();
    p.A_log = use_gate_in_kernel && A_log ? static_cast<const float*>(A_log->data_ptr()) : nullptr;
    p.dt_bias = use_gate_in_kernel && dt_bias ? static_cast<const float*>(dt_bias->data_ptr()) : nullptr;
    p.h0 = initial_state ? static_cast<const float*>(initial_state->data_ptr()) : nullptr;
    p.cu_seqlens = cptr(cu_seqlens);
    p.cu_int64 = cu_seqlens && cu_seqlens->scalar_type() == ScalarType::Long;
    p.o = o.data_ptr();
    p.ht = final_state ? static_cast<float*>(final_state->data_ptr()) : nullptr;
    p.h_states = mptr(h_states);
    p.w = w.data_ptr();
    p.qg = qg.data_ptr();
    p.kg = kg.data_ptr();
    p.Aqk = Aqk.data_ptr();
    p.Akk = Akk.data_ptr();
    p.gdecay = static_cast<float*>(gdecay.data_ptr());
    p.chunk_offsets = static_cast<int*>(chunk_offsets.data_ptr());
  }
  p.B = static_cast<int>(B);
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.HV = static_cast<int>(HV);
  p.K = static_cast<int>(K);
  p.V = static_cast<int>(V);
  p.N = static_cast<int>(N);
  p.max_chunks = static_cast<int>(max_chunks);
  p.scale = static_cast<float>(scale);
  if (!use_gate_in_kernel) p.gate_mode = GateMode::kPrecomputed;
  else if (!lower_bound) p.gate_mode = GateMode::kUnbounded;
  else p.gate_mode = A_log ? GateMode::kBounded : GateMode::kBoundedNoALog;
  p.lower_bound = lower_bound ? static_cast<float>(*lower_bound) : 0.f;
  p.l2norm = use_qk_l2norm_in_kernel;
  p.beta_sigmoid_scale = use_beta_sigmoid_in_kernel ? (allow_neg_eigval ? 2.f : 1.f) : 0.f;
  p.state_v_first = state_v_first;
  p.dtype = *to_dtype(q.scalar_type());
  p.g_dtype = *to_dtype(g.scalar_type());
  p.beta_dtype = *to_dtype(beta.scalar_type());
  return "";
}

// The validation alone, as a message ("" = valid). The Python entry calls this first and raises
// ValueError itself (see the note on the helpers above).
std::string kda_fwd_check(KF_KDA_FWD_ARGS) {
  KdaFwdParams p;
  return prepare(p, false, KF_KDA_FWD_NAMES);
}

void kda_fwd(KF_KDA_FWD_ARGS) {
  KdaFwdParams p;
  const std::string err = prepare(p, true, KF_KDA_FWD_NAMES);
  // Only reached with bad arguments when kda_fwd_check was skipped (the Python entry never does).
  if (!err.empty()) throw std::invalid_argument(err);
  const cudaStream_t stream = current_stream(q);
  kda::kda_fwd_chunk_map(p, stream);
  kda::kda_fwd_intra(p, stream);
  kda::kda_fwd_scan(p, stream);
}

}  // namespace

}  // namespace kernel_fun::api

STABLE_TORCH_LIBRARY_FRAGMENT(kernel_fun, m) {
  m.def(
      "kda_fwd_support(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? cu_seqlens, "
      "int chunk_size) -> str");
  m.def(
      "kda_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? initial_state, Tensor? cu_seqlens, float scale, bool use_qk_l2norm_in_kernel, "
      "bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, float? lower_bound, "
      "bool state_v_first, Tensor(a!) o, Tensor(b!)? final_state, Tensor(c!)? h_states, Tensor(d!) w, "
      "Tensor(e!) qg, Tensor(f!) kg, Tensor(g!) Aqk, Tensor(h!) Akk, Tensor(i!) gdecay, "
      "Tensor(j!) chunk_offsets) -> ()");
  m.def(
      "kda_fwd_check(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? initial_state, Tensor? cu_seqlens, float scale, bool use_qk_l2norm_in_kernel, "
      "bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, bool allow_neg_eigval, float? lower_bound, "
      "bool state_v_first, Tensor o, Tensor? final_state, Tensor? h_states, Tensor w, "
      "Tensor qg, Tensor kg, Tensor Aqk, Tensor Akk, Tensor gdecay, Tensor chunk_offsets) -> str");
}

STABLE_TORCH_LIBRARY_IMPL(kernel_fun, CUDA, m) {
  m.impl("kda_fwd", TORCH_BOX(&kernel_fun::api::kda_fwd));
}

STABLE_TORCH_LIBRARY_IMPL(kernel_fun, CompositeExplicitAutograd, m) {
  m.impl("kda_fwd_support", TORCH_BOX(&kernel_fun::api::kda_fwd_support));
  m.impl("kda_fwd_check", TORCH_BOX(&kernel_fun::api::kda_fwd_check));
}
