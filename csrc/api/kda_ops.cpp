// Torch binding of the KDA kernels (csrc/kda/). Validation and the support decision live here; the
// kernels see plain pointers and sizes (kda_problem.h). Every op takes the call's options as ONE
// string (kernel_fun.kda._options.KdaOptions.encode(), parsed by kda::parse_options).
//
//   kda_support(...) -> str       "" when our kernels serve the call, else the reason (metadata only:
//                                 any device, meta tensors included)
//   kda_fwd(...) -> ()            writes o (+ final_state, h_states, and for training the factors the
//                                 backward reads: Aqk, Akk, M, and optionally the states h_ckpt; with
//                                 o_id the context-parallel call's identity columns, id_cols_check);
//                                 allocates the rest of its workspace
//   kda_bwd(...) -> ()            writes dq, dk, dv, dg, dbeta (+ dA_log, ddt_bias, dh0); with the
//                                 forward's Aqk / Akk / M it skips recomputing them, with its h_ckpt
//                                 the re-scan
//   kda_fwd_stages / kda_bwd_stages(...) -> Tensor[]   the same launches, returning the outputs AND
//                                 the workspace, for the per-stage tests
// The launch ops validate everything they read or write and throw std::invalid_argument (Python
// ValueError) naming the argument; the Python front validates the contract first, so they only
// throw for direct calls of the raw ops. Launches go to torch's current stream on q's device.
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/csrc/stable/ops.h>

#include "api/op_calls.h"
#include "api/stable_utils.h"
#include "kda/kda_launch.h"
#include "kda/kda_policy.h"
#include "kda/kda_problem.h"

namespace kernel_fun::api {

namespace {

using kda::GateMode;
using kda::KdaBwdParams;
using kda::KdaFwdParams;
using kda::KdaOptions;
using kda::KdaProblem;
using kda::kChunk;
using kda::WorkBuffer;
using OptT = std::optional<Tensor>;

constexpr const char* kOp = "kernel_fun.kda: ";

bool is_half_like(ScalarType t) { return t == ScalarType::BFloat16 || t == ScalarType::Half; }
bool is_float_like(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16 || t == ScalarType::Double;
}

// Messages by plain std::string concatenation (no iostreams: see stable_utils.h).
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
std::string dims(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(static_cast<long long>(shape[i]));
  return s + "]";
}
#define KDA_REQUIRE(cond, ...)            \
  do {                                    \
    if (!(cond)) return cat(__VA_ARGS__); \
  } while (0)
#define KDA_TRY(expr)                       \
  do {                                      \
    std::string kda_err_ = (expr);          \
    if (!kda_err_.empty()) return kda_err_; \
  } while (0)

std::string check_tensor(const Tensor& t, const Tensor& ref, const char* name, const std::vector<int64_t>& shape) {
  KDA_REQUIRE(t.is_cuda(), name, " must be a CUDA tensor");
  KDA_REQUIRE(t.get_device_index() == ref.get_device_index(), name, " must be on q's CUDA device");
  bool ok = t.dim() == static_cast<int64_t>(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = t.size(static_cast<int64_t>(i)) == shape[i];
  KDA_REQUIRE(ok, name, " must have shape ", dims(shape), ", got ", dims(t));
  KDA_REQUIRE(t.is_contiguous(), name, " must be contiguous");
  return "";
}

std::string check_dtype(const Tensor& t, ScalarType want, const char* name) {
  KDA_REQUIRE(t.scalar_type() == want, name, " must be ", scalar_type_name(want), ", got ",
              scalar_type_name(t.scalar_type()));
  return "";
}

// The kernels read (cp.async) and write (vector stores) these tensors' rows in 8- or 16-byte pieces.
std::string check_aligned16(const void* ptr, const char* name) {
  KDA_REQUIRE(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, name, " must start 16-byte aligned");
  return "";
}

std::string state_check(const Tensor& t, const Tensor& q, const char* name, const KdaProblem& p) {
  const std::vector<int64_t> shape = p.opt.state_v_first
                                         ? std::vector<int64_t>{p.N, p.HV, p.V, p.K}
                                         : std::vector<int64_t>{p.N, p.HV, p.K, p.V};
  KDA_TRY(check_tensor(t, q, name, shape));
  KDA_TRY(check_dtype(t, ScalarType::Float, name));
  return "";
}

// The scans' grid is (V / BV, HV, N): HV and the sequence count N live in gridDim.y / .z (<= 65535).
constexpr int64_t kMaxGridYZ = 65535;
// Token rows are int-indexed in places (B * T * HV stays far below 2^31 for HV <= 2).
constexpr int64_t kMaxTokens = int64_t{1} << 30;
// The widest state our kernels take: V value columns (with identity columns, V + K: id_cols_check).
constexpr int64_t kMaxV = 512;

// Why the kernels cannot run this configuration ("" = they can). Shapes are the contract's.
std::string support_reason(const Tensor& q, const Tensor& v, const Tensor& g, const Tensor& beta,
                           const OptT& cu_seqlens, const KdaOptions& o) {
  const ScalarType dt = q.scalar_type();
  if (!is_half_like(dt)) return std::string("q dtype ") + scalar_type_name(dt) + " (kernels take bfloat16 or float16)";
  if (v.scalar_type() != dt) return "v dtype differs from q's";
  if (!is_float_like(g.scalar_type())) return "g dtype is not a float type";
  if (!is_float_like(beta.scalar_type())) return "beta dtype is not a float type";
  if (q.dim() != 4 || v.dim() != 4) return "q and v must be 4-D";
  const int64_t K = q.size(3), V = v.size(3);
  if (K != 64 && K != 128) return "K=" + std::to_string(K) + " (kernels support K in {64, 128})";
  if (V % 64 != 0 || V > kMaxV || V == 0)
    return "V=" + std::to_string(V) + " (kernels support V a multiple of 64 up to 512)";
  // chunk_size is fla's; our kernels chunk as they choose (docs/contract.md), except that the
  // per-chunk states they return are every 64 tokens, where a chunk_size=32 call wants one per 32.
  if (o.chunk_size != kChunk && o.intermediate_states)
    return "chunk_size=" + std::to_string(o.chunk_size) +
           " with return_intermediate_states (our kernels return a state every 64 tokens)";
  if (v.size(2) > kMaxGridYZ) return "HV > " + std::to_string(kMaxGridYZ);
  if (cu_seqlens) {
    const int64_t N = cu_seqlens->numel() - 1;
    if (N > kMaxGridYZ) return "more than " + std::to_string(kMaxGridYZ) + " varlen sequences";
    const ScalarType ct = cu_seqlens->scalar_type();
    if (ct != ScalarType::Int && ct != ScalarType::Long) return "cu_seqlens must be int32 or int64";
  } else if (q.size(0) > kMaxGridYZ) {
    // Without cu_seqlens N = B (also when T == 0: the scan still runs to carry initial_state to
    // final_state).
    return "B=" + std::to_string(q.size(0)) + " > " + std::to_string(kMaxGridYZ) +
           " sequences (the scan grid's z dimension)";
  }
  // B * T > 2^30, without forming the product (an empty q may have huge B and T).
  const int64_t B = q.size(0), T = q.size(1);
  if (T > 0 && B > kMaxTokens / T) return "more than 2^30 tokens";
  return "";
}

// Validates the inputs and fills the problem; "" or a message naming the argument.
std::string fill_problem(KdaProblem& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                         const Tensor& beta, const OptT& A_log, const OptT& dt_bias, const OptT& initial_state,
                         const OptT& cu_seqlens, const std::string& options) {
  {
    const std::string e = kda::parse_options(options, p.opt);
    KDA_REQUIRE(e.empty(), e);
  }
  KDA_REQUIRE(q.dim() == 4, "q must be [B, T, H, K], got ", dims(q));
  KDA_REQUIRE(v.dim() == 4, "v must be [B, T, HV, V], got ", dims(v));
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  const int64_t HV = v.size(2), V = v.size(3);
  KDA_REQUIRE(H > 0 && HV % H == 0, "v's head count HV=", HV, " must be a multiple of q's H=", H);
  const std::string why = support_reason(q, v, g, beta, cu_seqlens, p.opt);
  KDA_REQUIRE(why.empty(), "unsupported configuration: ", why);
  KDA_TRY(check_tensor(q, q, "q", {B, T, H, K}));
  KDA_TRY(check_tensor(k, q, "k", {B, T, H, K}));
  KDA_TRY(check_dtype(k, q.scalar_type(), "k"));
  KDA_TRY(check_tensor(v, q, "v", {B, T, HV, V}));
  KDA_TRY(check_tensor(g, q, "g", {B, T, HV, K}));
  KDA_TRY(check_tensor(beta, q, "beta", {B, T, HV}));
  // the scans and the backward copy rows of v (and q, k, do in the backward) with 16-byte cp.async
  KDA_TRY(check_aligned16(v.data_ptr(), "v"));
  int64_t N = B;
  if (cu_seqlens) {
    KDA_REQUIRE(B == 1, "cu_seqlens requires B == 1, got B=", B);
    KDA_REQUIRE(cu_seqlens->dim() == 1 && cu_seqlens->numel() >= 2,
                "cu_seqlens must be 1-D with N+1 >= 2 entries, got ", dims(*cu_seqlens));
    KDA_TRY(check_tensor(*cu_seqlens, q, "cu_seqlens", {cu_seqlens->numel()}));
    N = cu_seqlens->numel() - 1;
  }
  const GateMode mode = p.opt.gate_mode;
  if (mode == GateMode::kUnbounded || mode == GateMode::kBounded) {
    KDA_REQUIRE(A_log.has_value(), "A_log is required by the in-kernel gate");
  }
  if (mode != GateMode::kPrecomputed) {
    if (A_log && mode != GateMode::kBoundedNoALog) {
      KDA_TRY(check_tensor(*A_log, q, "A_log", {HV}));
      KDA_TRY(check_dtype(*A_log, ScalarType::Float, "A_log"));
    }
    if (dt_bias) {
      KDA_TRY(check_tensor(*dt_bias, q, "dt_bias", {HV * K}));
      KDA_TRY(check_dtype(*dt_bias, ScalarType::Float, "dt_bias"));
    }
  }
  p.B = static_cast<int>(B);
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.HV = static_cast<int>(HV);
  p.K = static_cast<int>(K);
  p.V = static_cast<int>(V);
  p.N = static_cast<int>(N);
  p.max_chunks = static_cast<int>(cu_seqlens ? T / kChunk + N : B * ((T + kChunk - 1) / kChunk));
  p.dtype = *to_dtype(q.scalar_type());
  p.g_dtype = *to_dtype(g.scalar_type());
  p.beta_dtype = *to_dtype(beta.scalar_type());
  if (initial_state) KDA_TRY(state_check(*initial_state, q, "initial_state", p));
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.g = g.data_ptr();
  p.beta = beta.data_ptr();
  const bool use_alog = mode == GateMode::kUnbounded || mode == GateMode::kBounded;
  p.A_log = use_alog ? static_cast<const float*>(A_log->data_ptr()) : nullptr;
  p.dt_bias = mode != GateMode::kPrecomputed && dt_bias ? static_cast<const float*>(dt_bias->data_ptr()) : nullptr;
  p.h0 = initial_state ? static_cast<const float*>(initial_state->data_ptr()) : nullptr;
  p.cu_seqlens = cptr(cu_seqlens);
  p.cu_int64 = cu_seqlens && cu_seqlens->scalar_type() == ScalarType::Long;
  return "";
}

// Allocates every workspace buffer of kda::workspace() on q's device and points p at them.
std::vector<Tensor> alloc_workspace(const Tensor& q, KdaBwdParams& p, bool backward) {
  std::vector<Tensor> out;
  for (const WorkBuffer& b : kda::workspace(p, backward, p.saved_factors, p.slice_B, p.h_ckpt_given,
                                            p.saved_workspace)) {
    const ScalarType st = b.is_int ? ScalarType::Int
                                   : (b.dtype == DType::kFloat32 ? ScalarType::Float : q.scalar_type());
    Tensor t = torch::stable::new_empty(q, b.shape, st);
    void* ptr = t.data_ptr();
    switch (b.id) {
      case WorkBuffer::kW: p.w = ptr; break;
      case WorkBuffer::kQg: p.qg = ptr; break;
      case WorkBuffer::kKg: p.kg = ptr; break;
      case WorkBuffer::kAqk: p.Aqk = ptr; break;
      case WorkBuffer::kAkk: p.Akk = ptr; break;
      case WorkBuffer::kM: p.M = ptr; break;
      case WorkBuffer::kGdecay: p.gdecay = static_cast<float*>(ptr); break;
      case WorkBuffer::kChunkOffsets: p.chunk_offsets = static_cast<int*>(ptr); break;
      case WorkBuffer::kHCkpt: p.h_ckpt = ptr; break;
      case WorkBuffer::kDhCkpt: p.dh_ckpt = ptr; break;
      case WorkBuffer::kDqhat: p.dqhat = static_cast<float*>(ptr); break;
      case WorkBuffer::kDkhat: p.dkhat = static_cast<float*>(ptr); break;
      case WorkBuffer::kPbias: p.pbias = static_cast<float*>(ptr); break;
      case WorkBuffer::kPA: p.pA = static_cast<float*>(ptr); break;
      case WorkBuffer::kChunkReady: p.chunk_ready = static_cast<int*>(ptr); break;
      case WorkBuffer::kScanSave: p.scan_save = static_cast<float*>(ptr); break;
      case WorkBuffer::kRecurState: p.recur_state = static_cast<float*>(ptr); break;
      case WorkBuffer::kSplitMap: p.split_map = static_cast<int*>(ptr); break;
      case WorkBuffer::kSplitState: p.split_state = static_cast<float*>(ptr); break;
      case WorkBuffer::kDhReady: p.dh_ready = static_cast<int*>(ptr); break;
      case WorkBuffer::kGvaFlags: p.gva_flags = static_cast<int*>(ptr); break;
      case WorkBuffer::kCount: break;
    }
    out.push_back(std::move(t));
  }
  return out;
}

// Tests: NaN in every floating-point buffer the stage ops allocate, so an element a kernel never
// writes shows up (workspace buffers included); -1 in the int32 ones.
void poison(std::vector<Tensor>& ts) {
  for (Tensor& t : ts) {
    if (t.numel() > 0 && (t.scalar_type() == ScalarType::Float || is_half_like(t.scalar_type())))
      torch::stable::fill_(t, std::numeric_limits<double>::quiet_NaN());
    else if (t.numel() > 0 && t.scalar_type() == ScalarType::Int)  // chunk_offsets, chunk_ready
      torch::stable::fill_(t, -1.0);
  }
}

void raise_if(const std::string& err) {
  if (!err.empty()) throw std::invalid_argument(err);
}

// One tensor a training forward passes on to its backward: shape and layout (check_tensor), its
// dtype (q's unless given), and 16-byte alignment (the kernels read and write it in 16-byte pieces).
std::string saved_check(const Tensor& t, const Tensor& q, const char* name, const std::vector<int64_t>& shape,
                        std::optional<ScalarType> dtype = std::nullopt) {
  KDA_TRY(check_tensor(t, q, name, shape));
  KDA_TRY(check_dtype(t, dtype.value_or(q.scalar_type()), name));
  return check_aligned16(t.data_ptr(), name);
}

// The forward's factors saved for the backward (Aqk, Akk, M: [B*T, HV, 64] in q's dtype): all
// three or none. Sets p.Aqk / p.Akk / p.M and p.saved_factors.
std::string factor_check(KdaBwdParams& p, const Tensor& q, const OptT& Aqk, const OptT& Akk, const OptT& M,
                         const char* role) {
  const int n = (Aqk ? 1 : 0) + (Akk ? 1 : 0) + (M ? 1 : 0);
  KDA_REQUIRE(n == 0 || n == 3, "Aqk, Akk and M ", role, " come together (all three or none)");
  if (n == 0) return "";
  const std::vector<int64_t> shape = {int64_t{p.B} * p.T, p.HV, kChunk};
  for (auto [t, name] : {std::pair<const OptT*, const char*>{&Aqk, "Aqk"}, {&Akk, "Akk"}, {&M, "M"}})
    KDA_TRY(saved_check(**t, q, name, shape));
  p.Aqk = Aqk->data_ptr();
  p.Akk = Akk->data_ptr();
  p.M = M->data_ptr();
  p.saved_factors = true;
  return "";
}

// The buffer for the state before every chunk ([max_chunks, HV, V, K] in q's dtype) that a training
// forward passes on to its backward, only beside the saved factors. Where kda_policy.h's
// save_states_pays says so the forward's scan writes it and the backward reads it instead of
// re-running the scan; elsewhere the forward leaves it and the backward's re-scan writes it. The
// token recurrence neither writes nor reads it.
std::string states_check(KdaBwdParams& p, const Tensor& q, const OptT& h_ckpt, bool backward) {
  if (!h_ckpt) return "";
  KDA_REQUIRE(p.saved_factors, "h_ckpt (the states saved for the backward) needs Aqk, Akk and M");
  KDA_TRY(saved_check(*h_ckpt, q, "h_ckpt", {p.max_chunks, p.HV, p.V, p.K}));
  if (p.recurrent) return "";
  const bool saved = kda::save_states_pays(p);
  if (backward) {
    p.h_ckpt = h_ckpt->data_ptr();
    p.h_ckpt_given = true;
    p.saved_states = saved;
  } else if (saved) {
    p.h_ckpt = h_ckpt->data_ptr();
  }
  return "";
}

// The forward's w, qg, kg ([B*T, HV, K] in q's dtype) and gdecay ([max_chunks, HV, K] fp32), kept for
// the backward, which then runs no kda_bwd_prep: all four or none, only beside the saved factors.
// The forward's intra writes them there instead of into its workspace. The token recurrence neither
// writes nor reads them.
std::string workspace_check(KdaBwdParams& p, const Tensor& q, const OptT& w, const OptT& qg, const OptT& kg,
                            const OptT& gdecay) {
  const int n = (w ? 1 : 0) + (qg ? 1 : 0) + (kg ? 1 : 0) + (gdecay ? 1 : 0);
  KDA_REQUIRE(n == 0 || n == 4, "w, qg, kg and gdecay (saved for the backward) come together (all four or none)");
  if (n == 0) return "";
  KDA_REQUIRE(p.saved_factors, "w, qg, kg and gdecay (saved for the backward) need Aqk, Akk and M");
  const std::vector<int64_t> rows = {int64_t{p.B} * p.T, p.HV, p.K};
  for (auto [t, name] : {std::pair<const OptT*, const char*>{&w, "w"}, {&qg, "qg"}, {&kg, "kg"}})
    KDA_TRY(saved_check(**t, q, name, rows));
  KDA_TRY(saved_check(*gdecay, q, "gdecay", {p.max_chunks, p.HV, p.K}, ScalarType::Float));
  if (p.recurrent) return "";
  p.w = w->data_ptr();
  p.qg = qg->data_ptr();
  p.kg = kg->data_ptr();
  p.gdecay = static_cast<float*>(gdecay->data_ptr());
  p.saved_workspace = true;
  return "";
}

// ---------------------------------------------------------------- forward
// The identity columns (KdaProblem::id_cols) of the context-parallel call of a document that began
// on an earlier rank (kernel_fun/kda/_cp.py): o_id ([B, T, HV, K] in q's dtype) receives their
// outputs Q, the state has V + K columns (final_state [N, HV, K, V + K]: [E | Phi]) and o the V real
// ones. Set before the policies ask anything of p: they see V + K columns and take none of the
// paths the identity columns do not serve (kda_policy.h's *_possible).
std::string id_cols_check(KdaFwdParams& p, const Tensor& q, const OptT& o_id, const OptT& initial_state,
                          const OptT& h_states, const OptT& h_ckpt) {
  if (!o_id) return "";
  KDA_REQUIRE(!initial_state, "o_id (the identity columns' outputs) needs initial_state None: the value "
              "columns start from zero, the identity columns from the identity");
  KDA_REQUIRE(!h_states && !h_ckpt, "o_id (the identity columns' outputs) takes no per-chunk states (h_states, "
              "h_ckpt)");
  KDA_REQUIRE(p.V + p.K <= kMaxV, "o_id needs V + K <= ", kMaxV, " state columns, got V + K = ", p.V + p.K);
  KDA_TRY(check_tensor(*o_id, q, "o_id", {p.B, p.T, p.HV, p.K}));
  KDA_TRY(check_dtype(*o_id, q.scalar_type(), "o_id"));
  p.id_cols = p.K;
  p.V += p.K;
  p.o_id = o_id->data_ptr();
  return "";
}

std::string fwd_outputs(KdaFwdParams& p, const Tensor& q, const Tensor& o, const OptT& final_state,
                        const OptT& h_states) {
  KDA_TRY(check_tensor(o, q, "o", {p.B, p.T, p.HV, p.V - p.id_cols}));
  KDA_TRY(check_dtype(o, q.scalar_type(), "o"));
  if (final_state) KDA_TRY(state_check(*final_state, q, "final_state", p));
  if (h_states) {
    KDA_REQUIRE(p.opt.chunk_size == kChunk, "h_states holds a state every 64 tokens; options ask for chunk_size=",
                p.opt.chunk_size);
    // One state per chunk: B * ceil(T / 64) without cu_seqlens; with it, at least as many as the
    // grid can address (the chunk map's total is only known on the device).
    const int64_t nts = (p.T + kChunk - 1) / kChunk;
    const int64_t want_lead = p.cu_seqlens ? 1 : p.B;
    KDA_REQUIRE(h_states->dim() == 5 && h_states->size(0) == want_lead && h_states->size(2) == p.HV &&
                    h_states->size(3) == (p.opt.state_v_first ? p.V : p.K) &&
                    h_states->size(4) == (p.opt.state_v_first ? p.K : p.V),
                "h_states must be [", want_lead, ", NT, HV, ", (p.opt.state_v_first ? "V, K" : "K, V"), "], got ",
                dims(*h_states));
    const int64_t have = h_states->size(1);
    KDA_REQUIRE(p.cu_seqlens ? have >= p.max_chunks : have == nts, "h_states must hold ",
                (p.cu_seqlens ? p.max_chunks : nts), (p.cu_seqlens ? " or more" : ""),
                " states per sequence row, got ", dims(*h_states));
    KDA_TRY(check_tensor(*h_states, q, "h_states",
                         {h_states->size(0), h_states->size(1), p.HV, h_states->size(3), h_states->size(4)}));
    KDA_TRY(check_dtype(*h_states, q.scalar_type(), "h_states"));
  }
  p.o = o.data_ptr();
  p.ht = final_state ? static_cast<float*>(final_state->data_ptr()) : nullptr;
  p.h_states = mptr(h_states);
  return "";
}

#define KF_KDA_IN                                                                                     \
  Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, OptT A_log, OptT dt_bias, OptT initial_state, \
      OptT cu_seqlens
#define KF_KDA_IN_NAMES q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens

std::vector<Tensor> run_fwd(KF_KDA_IN, const std::string& options, const Tensor& o, const OptT& final_state,
                            const OptT& h_states, const OptT& Aqk, const OptT& Akk, const OptT& M,
                            const OptT& h_ckpt, const OptT& w, const OptT& qg, const OptT& kg, const OptT& gdecay,
                            const OptT& o_id = std::nullopt, bool poison_ws = false, bool profile = false,
                            bool stages = false) {
  KdaBwdParams p;  // forward fields only; the rest stay null
  raise_if(fill_problem(p, KF_KDA_IN_NAMES, options));
  raise_if(id_cols_check(p, q, o_id, initial_state, h_states, h_ckpt));
  raise_if(fwd_outputs(p, q, o, final_state, h_states));
  raise_if(factor_check(p, q, Aqk, Akk, M, "(outputs saved for the backward)"));
  // one-chunk problems: the fp32 token recurrence; never for the stage op, which returns the chunk
  // kernels' workspace (a training forward's factors then stay unwritten: its backward, deciding the
  // same way, runs the recurrence too and never reads them)
  if (!stages) p.recurrent = kda::kda_recurrent_choice(p);
  // few long chains: the scan in pieces (decided here: the workspace holds the pieces' states)
  kda::kda_split_choose(p);
  raise_if(states_check(p, q, h_ckpt, false));
  raise_if(workspace_check(p, q, w, qg, kg, gdecay));
  // the 32-token forward where nothing is saved and the policy says it pays (decided here: it sizes
  // Aqk, Akk and gdecay), never for the stage op, which returns the 64-token kernels' workspace
  if (!stages) p.fwd_chunk = kda::kda_fwd_chunk_choice(p);
  if (p.fwd_chunk != kda::kChunk) count_call(OpId::kKdaFwdC32);
  std::vector<Tensor> ws = alloc_workspace(q, p, false);
  if (poison_ws) poison(ws);
  if (profile) {  // kda_fwd_intra's phase clocks, [max_chunks * HV][16] int64, appended last
    ws.push_back(torch::stable::new_zeros(q, {int64_t{p.max_chunks} * p.HV * 16}, ScalarType::Long));
    p.dbg_intra_clock = static_cast<long long*>(ws.back().data_ptr());
  }
  count_call(OpId::kKdaFwd);
  if (p.split_chunks > 0) count_call(OpId::kKdaFwdSplit);
  if (kda::kda_forward(p, current_stream(q)) != 0) count_call(OpId::kKdaFwdStreamed);
  return ws;
}

std::string kda_support(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, OptT cu_seqlens, std::string options) {
  (void)k;
  KdaOptions o;
  const std::string err = kda::parse_options(options, o);
  if (!err.empty()) return "invalid options: " + err;
  return support_reason(q, v, g, beta, cu_seqlens, o);
}

// support_reason's size limits [max HV and sequences, max tokens], for the Python front: under
// torch.compile sizes may be symbolic, and a trace-time constant (the support check on meta
// stand-ins) cannot see them, so the front applies the size rules itself with these limits (each
// comparison a guard, not a graph break); tests/test_kda_api.py checks it agrees with this file.
std::vector<int64_t> kda_limits(Tensor probe) {
  (void)probe;  // ops dispatch on a tensor; any will do
  return {kMaxGridYZ, kMaxTokens};
}

void kda_fwd(KF_KDA_IN, std::string options, Tensor o, OptT final_state, OptT h_states, OptT Aqk, OptT Akk,
             OptT M, OptT h_ckpt, OptT w, OptT qg, OptT kg, OptT gdecay, OptT o_id) {
  run_fwd(KF_KDA_IN_NAMES, options, o, final_state, h_states, Aqk, Akk, M, h_ckpt, w, qg, kg, gdecay, o_id);
}

// [o, final_state (or empty), Aqk, Akk, M, w, qg, kg, gdecay, chunk_offsets, chunk_ready, split_map, split_state,
//  scan_save where the forward can stream, then with profile
//  kda_fwd_intra's phase clocks ([max_chunks * HV][16] int64)]
std::vector<Tensor> kda_fwd_stages(KF_KDA_IN, std::string options, bool output_final_state, OptT h_states,
                                   bool poison_outputs, bool profile) {
  KdaOptions opt;
  {
    const std::string e = kda::parse_options(options, opt);
    if (!e.empty()) raise_if(cat(e));
  }
  const int64_t N = cu_seqlens ? cu_seqlens->numel() - 1 : q.size(0);
  Tensor o = torch::stable::new_empty(q, {q.size(0), q.size(1), v.size(2), v.size(3)});
  Tensor ht = output_final_state
                  ? torch::stable::new_empty(q, opt.state_v_first ? std::vector<int64_t>{N, v.size(2), v.size(3), q.size(3)}
                                                                  : std::vector<int64_t>{N, v.size(2), q.size(3), v.size(3)},
                                             ScalarType::Float)
                  : torch::stable::new_empty(q, {0}, ScalarType::Float);
  OptT ht_opt = output_final_state ? OptT(ht) : std::nullopt;
  const std::vector<int64_t> fshape = {q.size(0) * q.size(1), v.size(2), kChunk};
  Tensor Aqk = torch::stable::new_empty(q, fshape), Akk = torch::stable::new_empty(q, fshape),
         M = torch::stable::new_empty(q, fshape);
  if (poison_outputs) {
    std::vector<Tensor> outs = {o, ht, Aqk, Akk, M};
    if (h_states) outs.push_back(*h_states);
    poison(outs);
  }
  std::vector<Tensor> ws =
      run_fwd(KF_KDA_IN_NAMES, options, o, ht_opt, h_states, Aqk, Akk, M, std::nullopt, std::nullopt, std::nullopt,
              std::nullopt, std::nullopt, std::nullopt, poison_outputs, profile, /*stages=*/true);
  std::vector<Tensor> out = {o, ht, Aqk, Akk, M};
  for (auto& t : ws) out.push_back(t);
  return out;
}

// ---------------------------------------------------------------- backward
std::string bwd_outputs(KdaBwdParams& p, const Tensor& q, const Tensor& g, const Tensor& beta, const Tensor& dout,
                        const OptT& dht, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dg,
                        const Tensor& dbeta, const OptT& dA_log, const OptT& ddt_bias, const OptT& dh0) {
  KDA_TRY(check_tensor(dout, q, "do", {p.B, p.T, p.HV, p.V}));
  KDA_TRY(check_dtype(dout, q.scalar_type(), "do"));
  KDA_TRY(check_aligned16(q.data_ptr(), "q"));
  KDA_TRY(check_aligned16(dout.data_ptr(), "do"));
  KDA_TRY(check_aligned16(p.k, "k"));
  if (dht) KDA_TRY(state_check(*dht, q, "dht", p));
  KDA_TRY(check_tensor(dq, q, "dq", {p.B, p.T, p.H, p.K}));
  KDA_TRY(check_dtype(dq, q.scalar_type(), "dq"));
  KDA_TRY(check_tensor(dk, q, "dk", {p.B, p.T, p.H, p.K}));
  KDA_TRY(check_dtype(dk, q.scalar_type(), "dk"));
  KDA_TRY(check_aligned16(dq.data_ptr(), "dq"));  // kda_bwd_grads' and kda_bwd_group_sum's 8-byte stores
  KDA_TRY(check_aligned16(dk.data_ptr(), "dk"));
  KDA_TRY(check_tensor(dv, q, "dv", {p.B, p.T, p.HV, p.V}));
  KDA_TRY(check_dtype(dv, q.scalar_type(), "dv"));
  KDA_TRY(check_tensor(dg, q, "dg", {p.B, p.T, p.HV, p.K}));
  KDA_TRY(check_dtype(dg, g.scalar_type(), "dg"));
  KDA_TRY(check_tensor(dbeta, q, "dbeta", {p.B, p.T, p.HV}));
  KDA_TRY(check_dtype(dbeta, beta.scalar_type(), "dbeta"));
  if (dA_log) {
    KDA_REQUIRE(p.A_log != nullptr, "dA_log requested but the gate has no A_log");
    KDA_TRY(check_tensor(*dA_log, q, "dA_log", {p.HV}));
    KDA_TRY(check_dtype(*dA_log, ScalarType::Float, "dA_log"));
  }
  if (ddt_bias) {
    KDA_REQUIRE(p.dt_bias != nullptr, "ddt_bias requested but the gate has no dt_bias");
    KDA_TRY(check_tensor(*ddt_bias, q, "ddt_bias", {int64_t{p.HV} * p.K}));
    KDA_TRY(check_dtype(*ddt_bias, ScalarType::Float, "ddt_bias"));
  }
  if (dh0) {
    KDA_REQUIRE(p.h0 != nullptr, "dh0 requested without initial_state");
    KDA_TRY(state_check(*dh0, q, "dh0", p));
  }
  p.dout = dout.data_ptr();
  p.dht = dht ? static_cast<const float*>(dht->data_ptr()) : nullptr;
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dg = dg.data_ptr();
  p.dbeta = dbeta.data_ptr();
  p.dA_log = dA_log ? static_cast<float*>(dA_log->data_ptr()) : nullptr;
  p.ddt_bias = ddt_bias ? static_cast<float*>(ddt_bias->data_ptr()) : nullptr;
  p.dh0 = dh0 ? static_cast<float*>(dh0->data_ptr()) : nullptr;
  return "";
}

#define KF_KDA_GRADS                                                                                     \
  Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, OptT dA_log, OptT ddt_bias, OptT dh0
#define KF_KDA_GRAD_NAMES dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0

std::vector<Tensor> run_bwd(KF_KDA_IN, const Tensor& dout, const OptT& dht, const OptT& Aqk, const OptT& Akk,
                            const OptT& M, const OptT& h_ckpt, const OptT& w, const OptT& qg, const OptT& kg,
                            const OptT& gdecay, const std::string& options, KF_KDA_GRADS,
                            float* dbg_dA, float* dbg_dL,
                            bool poison_ws = false, bool profile = false, bool stages = false) {
  KdaBwdParams p;
  raise_if(fill_problem(p, KF_KDA_IN_NAMES, options));
  raise_if(bwd_outputs(p, q, g, beta, dout, dht, KF_KDA_GRAD_NAMES));
  raise_if(factor_check(p, q, Aqk, Akk, M, "(saved by the forward)"));
  if (!stages) p.recurrent = kda::kda_recurrent_choice(p);  // as the forward decided (run_fwd)
  kda::kda_split_choose(p);  // both scans in pieces (as run_fwd)
  raise_if(states_check(p, q, h_ckpt, true));
  raise_if(workspace_check(p, q, w, qg, kg, gdecay));
  // the workspace holds one batch slice, or (the stage op: the tests read it back) the whole batch
  p.slice_B = stages ? p.B : kda::kda_bwd_slice_batches(p);
  std::vector<Tensor> ws = alloc_workspace(q, p, true);
  if (poison_ws) poison(ws);
  if (profile) {  // kda_bwd_grads' phase clocks, [max_chunks * HV][16] int64, appended last
    ws.push_back(torch::stable::new_zeros(q, {int64_t{p.max_chunks} * p.HV * 16}, ScalarType::Long));
    p.dbg_clock = static_cast<long long*>(ws.back().data_ptr());
  }
  p.dbg_dA = dbg_dA;
  p.dbg_dL = dbg_dL;
  count_call(OpId::kKdaBwd);
  if (kda::kda_backward(p, current_stream(q))) count_call(OpId::kKdaBwdStreamed);
  return ws;
}

void kda_bwd(KF_KDA_IN, Tensor dout, OptT dht, OptT Aqk, OptT Akk, OptT M, OptT h_ckpt, OptT w, OptT qg, OptT kg,
             OptT gdecay, std::string options, KF_KDA_GRADS) {
  run_bwd(KF_KDA_IN_NAMES, dout, dht, Aqk, Akk, M, h_ckpt, w, qg, kg, gdecay, options, KF_KDA_GRAD_NAMES, nullptr,
          nullptr);
}

// [dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 (each empty when not applicable),
//  dA (scale * dAqk, [B*T, HV, 64] fp32), dL ([B*T, HV, 64] fp32), then the workspace in
//  kda::workspace() order (w, qg, kg, Aqk, Akk, gdecay, chunk_offsets, M, h_ckpt, dh_ckpt, ...),
//  then with profile kda_bwd_grads' phase clocks ([max_chunks * HV][16] int64)]
std::vector<Tensor> kda_bwd_stages(KF_KDA_IN, Tensor dout, OptT dht, OptT Aqk, OptT Akk, OptT M, std::string options,
                                   bool poison_outputs, bool profile) {
  KdaOptions opt;
  {
    const std::string e = kda::parse_options(options, opt);
    if (!e.empty()) raise_if(cat(e));
  }
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), HV = v.size(2), V = v.size(3);
  Tensor dq = torch::stable::new_empty(q, {B, T, H, K});
  Tensor dk = torch::stable::new_empty(q, {B, T, H, K});
  Tensor dv = torch::stable::new_empty(q, {B, T, HV, V});
  Tensor dg = torch::stable::new_empty(g, {B, T, HV, K});
  Tensor dbeta = torch::stable::new_empty(beta, {B, T, HV});
  const bool has_alog = A_log && (opt.gate_mode == GateMode::kUnbounded || opt.gate_mode == GateMode::kBounded);
  const bool has_bias = dt_bias && opt.gate_mode != GateMode::kPrecomputed;
  Tensor dA_log = torch::stable::new_empty(q, {has_alog ? HV : 0}, ScalarType::Float);
  Tensor ddt = torch::stable::new_empty(q, {has_bias ? HV * K : 0}, ScalarType::Float);
  Tensor dh0 = initial_state ? torch::stable::new_empty(*initial_state, {initial_state->size(0), initial_state->size(1),
                                                                         initial_state->size(2), initial_state->size(3)})
                             : torch::stable::new_empty(q, {0}, ScalarType::Float);
  Tensor dA = torch::stable::new_zeros(q, {B * T, HV, kChunk}, ScalarType::Float);
  Tensor dL = torch::stable::new_zeros(q, {B * T, HV, kChunk}, ScalarType::Float);
  if (poison_outputs) {
    std::vector<Tensor> outs = {dq, dk, dv, dg, dbeta, dA_log, ddt, dh0};
    poison(outs);
  }
  std::vector<Tensor> ws =
      run_bwd(KF_KDA_IN_NAMES, dout, dht, Aqk, Akk, M, std::nullopt, std::nullopt, std::nullopt, std::nullopt,
              std::nullopt, options, dq, dk, dv, dg, dbeta,
              has_alog ? OptT(dA_log) : std::nullopt,
              has_bias ? OptT(ddt) : std::nullopt, initial_state ? OptT(dh0) : std::nullopt,
              static_cast<float*>(dA.data_ptr()), static_cast<float*>(dL.data_ptr()), poison_outputs, profile,
              /*stages=*/true);
  std::vector<Tensor> out = {dq, dk, dv, dg, dbeta, dA_log, ddt, dh0, dA, dL};
  for (auto& t : ws) out.push_back(t);
  return out;
}

}  // namespace

}  // namespace kernel_fun::api

STABLE_TORCH_LIBRARY_FRAGMENT(kernel_fun, m) {
  m.def("kda_support(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? cu_seqlens, str options) -> str");
  m.def("kda_limits(Tensor probe) -> int[]");
  m.def(
      "kda_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? initial_state, Tensor? cu_seqlens, str options, Tensor(a!) o, Tensor(b!)? final_state, "
      "Tensor(c!)? h_states, Tensor(d!)? Aqk, Tensor(e!)? Akk, Tensor(f!)? M, Tensor(g!)? h_ckpt, Tensor(h!)? w, "
      "Tensor(i!)? qg, Tensor(j!)? kg, Tensor(k!)? gdecay, Tensor(l!)? o_id=None) -> ()");
  m.def(
      "kda_fwd_stages(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? initial_state, Tensor? cu_seqlens, str options, bool output_final_state, Tensor(a!)? h_states, "
      "bool poison, bool profile) -> Tensor[]");
  m.def(
      "kda_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? initial_state, Tensor? cu_seqlens, Tensor do, Tensor? dht, Tensor? Aqk, Tensor? Akk, Tensor? M, "
      "Tensor? h_ckpt, Tensor? w, Tensor? qg, Tensor? kg, Tensor? gdecay, str options, Tensor(a!) dq, "
      "Tensor(b!) dk, Tensor(c!) dv, Tensor(d!) dg, Tensor(e!) dbeta, Tensor(f!)? dA_log, Tensor(g!)? ddt_bias, "
      "Tensor(h!)? dh0) -> ()");
  m.def(
      "kda_bwd_stages(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor? initial_state, Tensor? cu_seqlens, Tensor do, Tensor? dht, Tensor? Aqk, Tensor? Akk, Tensor? M, "
      "str options, bool poison, bool profile) -> Tensor[]");
}

STABLE_TORCH_LIBRARY_IMPL(kernel_fun, CUDA, m) {
  m.impl("kda_fwd", TORCH_BOX(&kernel_fun::api::kda_fwd));
  m.impl("kda_fwd_stages", TORCH_BOX(&kernel_fun::api::kda_fwd_stages));
  m.impl("kda_bwd", TORCH_BOX(&kernel_fun::api::kda_bwd));
  m.impl("kda_bwd_stages", TORCH_BOX(&kernel_fun::api::kda_bwd_stages));
}

STABLE_TORCH_LIBRARY_IMPL(kernel_fun, CompositeExplicitAutograd, m) {
  m.impl("kda_support", TORCH_BOX(&kernel_fun::api::kda_support));
  m.impl("kda_limits", TORCH_BOX(&kernel_fun::api::kda_limits));
}
