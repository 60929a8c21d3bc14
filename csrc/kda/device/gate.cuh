// The per-chunk preprocessing every KDA kernel that starts from the raw inputs shares (forward
// intra, backward grads): the gate activation and its derivative, the block-local cumsum (base 2),
// beta's sigmoid, the block offsets, and the q/k l2norm row factors.
//
// g2 is kept BLOCK-LOCAL: the inclusive cumsum restarts at every 16-row block (times 1/ln2); the
// block totals T_b, the sums of the totals before (O_b) and after (S_b) each block reconstruct any
// exponent as a sum of terms that are all <= 0, so a large cumsum never cancels across blocks
// (one -1000 step in block 0 costs blocks 1-3 nothing; a chunk-global cumsum would cost ulp(1442)
// in every later exponent). Rows past the end of the sequence are zero (gate 0, beta 0): they
// contribute nothing and keep the g2 of the last valid row.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kda/device/primitives.cuh"

namespace kernel_fun::kda::dev {

constexpr float kRcpLn2 = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// block_midpoint_ok (whether a 16-row block's decays may be factorised through its midpoint row):
// kda_problem.h, beside the options it reads, so that the launch policy can name the kernel form.

// Gate activations without libm's log1pf / expf / IEEE division (a libm softplus is ~70
// instructions per element, which made the gate the costliest part of the forward intra), both on
// one FFMA of the raw input (gate_activation8's GateCoef) and the SFU:
//   softplus(x) / ln2 = log2(1 + 2^y), y = x / ln2: one ex2 and one lg2. The base-2 form is what the
//   cumsum wants (g2 = gate / ln2), so the ln2 never comes in. ex2.approx's relative error ~2^-22
//   costs log2(1 + 2^-22) ~ 3.4e-7 in y's units, lg2.approx's error is ~2^-22 absolute on [1, 2] and
//   relative above: the result is within ~4e-7 absolute or ~2^-22 relative of softplus (a few ulp of
//   fp32's own rounding of it), the relative error growing only where softplus(x) < ~1e-6 (x < -14,
//   where 2^y vanishes beside 1 and the step adds ~0 to the cumsum; lg2(1) itself is within 2^-22 of
//   0, as in the max(x, 0) + ln2 log2(1 + exp(-|x|)) form it replaces). Above torch's threshold
//   (x > 20) softplus is x itself: y, by a select that also keeps 2^y's overflow (y >= 128) out.
//   sigmoid(z) = 1 / (1 + exp2(-z / ln2)) with ex2.approx and rcp.approx (~2 ulp; the reciprocal of
//   inf is 0, the correct limit).
__device__ __forceinline__ float softplus_base2(float y) {
  const float r = fast_lg2(1.f + fast_exp2(y));
  return y > 20.f * kRcpLn2 ? y : r;  // torch / fla: threshold 20 returns x itself (a select, no branch)
}
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

// sigmoid'(z) = s (1 - s) as u / (1 + u)^2, u = exp(-|z|) (symmetric in z): s (1 - s) in fp32 loses
// its relative accuracy where s is near 1 (1 - s is formed from s's rounding: ~1e-3 relative at
// z = 10, 20% at z = 15, exactly 0 from z ~ 17), while the true slope ~exp(-z) stays normal down to
// z ~ 87. dA_log sums slope * z * dgate over every token, so a saturated bounded gate (steps near
// lower_bound) lost up to 1e-2 of dA_log on the H200 (strong_bounded_T200, fla 6e-4).
__device__ __forceinline__ float sigmoid_slope(float z) {
  const float u = expf(-fabsf(z)), w = 1.f + u;
  return u / (w * w);
}

// exp(A_log[hv]) where the in-kernel gate uses A_log, else 1. (GatePass and kda_bwd_grads' epilogue
// form it inline: through this function ptxas schedules the grads kernel's epilogue differently.)
__device__ __forceinline__ float gate_a_exp(const KdaProblem& p, int hv) {
  return (p.opt.gate_mode != GateMode::kPrecomputed && p.A_log) ? expf(p.A_log[hv]) : 1.f;
}

// The natural-log per-step gate of one element (x = g + dt_bias; g itself for kPrecomputed) in fp32
// through expf / log1pf (under the build's --use_fast_math expf is the ex2-based form, a few ulp), not
// the SFU forms of gate_activation8 (softplus_base2, ~4e-7 absolute or ~2^-22 relative): for code that runs once per
// element and wants accuracy (the token recurrence of recur/kda_recur.cuh). softplus is x itself
// above the threshold 20 (torch's rule). gate_derivatives' d/dA_log of the unbounded gate is the same
// expression, inlined there for the same scheduling reason as gate_a_exp.
__device__ __forceinline__ float gate_value(GateMode mode, float x, float a_exp, float lower_bound) {
  switch (mode) {
    case GateMode::kPrecomputed: return x;
    case GateMode::kUnbounded: return -a_exp * (x > 20.f ? x : log1pf(expf(x)));
    case GateMode::kBounded: return lower_bound * sigmoid_f(a_exp * x);
    case GateMode::kBoundedNoALog: return lower_bound * sigmoid_f(x);
  }
  return x;
}

// d(gate)/dx (x = g + dt_bias; for kPrecomputed d(gate)/dg = 1) and d(gate)/d(A_log), in fp32 with
// libm exp: the backward's epilogue runs once per element, so accuracy wins over the SFU here.
// softplus' derivative is sigmoid(x) below the threshold 20 and exactly 1 above it (torch's rule).
__device__ __forceinline__ void gate_derivatives(GateMode mode, float x, float a_exp, float lower_bound,
                                                 float& dgate_dx, float& dgate_dA) {
  switch (mode) {
    case GateMode::kPrecomputed:
      dgate_dx = 1.f;
      dgate_dA = 0.f;
      return;
    case GateMode::kUnbounded: {
      const float sp = x > 20.f ? x : log1pf(expf(x));
      dgate_dx = x > 20.f ? -a_exp : -a_exp * sigmoid_f(x);
      dgate_dA = -a_exp * sp;  // d/dA_log of -exp(A_log) * softplus = the gate itself
      return;
    }
    case GateMode::kBounded: {
      const float z = a_exp * x;
      const float dz = lower_bound * sigmoid_slope(z);
      dgate_dx = dz * a_exp;
      dgate_dA = dz * z;
      return;
    }
    case GateMode::kBoundedNoALog: {
      dgate_dx = lower_bound * sigmoid_slope(x);
      dgate_dA = 0.f;
      return;
    }
  }
}

// The per-step gate of 8 elements WITHOUT its per-head factor (x: the raw g in, the gate over that
// factor out, in the units g2_factor says), the mode switch outside the element loop: the compiler
// did not unswitch a per-element switch (intra 6,296 -> 5,920 SASS instructions with it outside).
// The factor (-exp(A_log), or lower_bound) multiplies the block-local cumsum once per element at its
// end (GatePass::finish_row, folded into the 1/ln2 there) instead of every element before it: a sum
// of factor * a_i and factor * sum(a_i) differ by rounding alone. Every form's argument is one FFMA,
// x * c1 + c0 per column (GateCoef): for the bounded forms c1 = -exp(A_log) / ln2 (-1 / ln2 without
// A_log) into ex2, sigmoid(z) = 1 / (1 + exp2(-z / ln2)); for the unbounded one c1 = 1 / ln2 into
// softplus_base2. Per element, with the running sum, 10 -> 6 instructions for the bounded gate,
// 11 -> 7 for the unbounded one.
struct GateCoef {
  float c1;     // the raw input's factor inside the SFU forms (unused for a precomputed gate)
  float c0[8];  // per column: c1 * dt_bias (0 without dt_bias or for a precomputed gate)
};
__device__ __forceinline__ void gate_activation8(GateMode mode, float (&x)[8], const GateCoef& gc) {
  switch (mode) {
    case GateMode::kPrecomputed: return;
    case GateMode::kUnbounded:
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = softplus_base2(fmaf(x[e], gc.c1, gc.c0[e]));
      return;
    case GateMode::kBounded:
    case GateMode::kBoundedNoALog:
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = fast_rcp(1.f + fast_exp2(fmaf(x[e], gc.c1, gc.c0[e])));
      return;
  }
}
// gate_activation8's coefficients: c1 (GateCoef) and the factor c0 is c1 times.
__device__ __forceinline__ float gate_c1(GateMode mode, float a_exp) {
  return mode == GateMode::kUnbounded ? kRcpLn2 : -kRcpLn2 * a_exp;
}
// What turns a sum of gate_activation8's values into g2 (the cumsum of the gate over ln2): the
// per-head factor it leaves out (-exp(A_log), or lower_bound), over ln2 where the values are in
// natural units (bounded, precomputed), itself where they are already over ln2 (unbounded).
__device__ __forceinline__ float g2_factor(GateMode mode, float a_exp, float lower_bound) {
  switch (mode) {
    case GateMode::kPrecomputed: return kRcpLn2;
    case GateMode::kUnbounded: return -a_exp;
    case GateMode::kBounded:
    case GateMode::kBoundedNoALog: return kRcpLn2 * lower_bound;
  }
  return kRcpLn2;
}

// gate_derivatives on 8 elements (x = g + dt_bias), the mode switch outside the element loop.
__device__ __forceinline__ void gate_derivatives8(GateMode mode, const float (&x)[8], float a_exp, float lower_bound,
                                                  float (&dgate_dx)[8], float (&dgate_dA)[8]) {
  switch (mode) {
#define KF_GATE_DERIV8(M)                                                          \
  case M:                                                                          \
    _Pragma("unroll") for (int e = 0; e < 8; ++e)                                  \
        gate_derivatives(M, x[e], a_exp, lower_bound, dgate_dx[e], dgate_dA[e]);   \
    return;
    KF_GATE_DERIV8(GateMode::kPrecomputed)
    KF_GATE_DERIV8(GateMode::kUnbounded)
    KF_GATE_DERIV8(GateMode::kBounded)
    KF_GATE_DERIV8(GateMode::kBoundedNoALog)
#undef KF_GATE_DERIV8
  }
}

// 8 consecutive floats (16-byte aligned) between smem and registers.
__device__ __forceinline__ void ld8(float (&v)[8], const float* p) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void st8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
// The same in "slot order": slot e holds column e ^ (4 sw), i.e. with sw = 1 the 16-byte halves are
// swapped. Why: when the lanes of a warp each take 8 consecutive floats (32 bytes) and consecutive
// lanes consecutive 32-byte chunks, a 128-bit access phase (8 lanes) touches only every other group
// of 4 banks, twice: a 2-way conflict on every LDS.128 / STS.128. With sw = bit 2 of the chunk index
// ((d0 >> 5) & 1 for column d0), lanes 4-7 of a phase take the other half first and the phase is
// conflict-free. Callers keep every 8-vector of one item in the same slot order (dev::half_swap).
__device__ __forceinline__ void ld8_slots(float (&v)[8], const float* p, int sw) {
  const float4 a = *reinterpret_cast<const float4*>(p + 4 * sw), b = *reinterpret_cast<const float4*>(p + 4 - 4 * sw);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void st8_slots(float* p, const float (&v)[8], int sw) {
  *reinterpret_cast<float4*>(p + 4 * sw) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(p + 4 - 4 * sw) = make_float4(v[4], v[5], v[6], v[7]);
}
// 8 floats in natural order, stored / loaded with the halves' instruction order swapped when ph = 1
// (the memory and the registers are as st8 / ld8 leave them; only which half each of the two 16-byte
// accesses carries changes, by selects). For the gate pass, whose sub-groups of one column group
// must keep one element order for their shuffles (slot order is not possible there) and whose rows
// 4 (or 2) apart land on the same banks: ph = bit 1 of the sub-group halves the conflict.
__device__ __forceinline__ void st8_phased(float* p, const float (&v)[8], int ph) {
  const bool s = ph != 0;
  *reinterpret_cast<float4*>(p + 4 * ph) =
      make_float4(s ? v[4] : v[0], s ? v[5] : v[1], s ? v[6] : v[2], s ? v[7] : v[3]);
  *reinterpret_cast<float4*>(p + 4 - 4 * ph) =
      make_float4(s ? v[0] : v[4], s ? v[1] : v[5], s ? v[2] : v[6], s ? v[3] : v[7]);
}
__device__ __forceinline__ void ld8_phased(float (&v)[8], const float* p, int ph) {
  const float4 a = *reinterpret_cast<const float4*>(p + 4 * ph), b = *reinterpret_cast<const float4*>(p + 4 - 4 * ph);
  const bool s = ph != 0;
  v[0] = s ? b.x : a.x; v[1] = s ? b.y : a.y; v[2] = s ? b.z : a.z; v[3] = s ? b.w : a.w;
  v[4] = s ? a.x : b.x; v[5] = s ? a.y : b.y; v[6] = s ? a.z : b.z; v[7] = s ? a.w : b.w;
}
// The slot order's swap bit of an 8-vector at column d0 (a multiple of 8).
__device__ __forceinline__ int half_swap(int d0) { return (d0 >> 5) & 1; }
// Four packed words w[0..3] (pairs of columns) between natural and slot order: words 0-1 and 2-3
// swapped when sw (an involution, so the same call converts either way).
__device__ __forceinline__ void words_slots(uint32_t* w, int sw) {
  const uint32_t w0 = w[0], w1 = w[1];
  w[0] = sw ? w[2] : w0;
  w[1] = sw ? w[3] : w1;
  w[2] = sw ? w0 : w[2];
  w[3] = sw ? w1 : w[3];
}

// The raw gate input g at token tok0 + r, value head hv, columns d0 .. d0 + 7 (8-aligned), as loaded
// (dev::Raw8: convert with gate8_to_float where the values are needed, so that the loads of several
// rows are in flight at once); zeros unless valid (rows past the chunk, or no gate to read).
template <int K>
__device__ __forceinline__ Raw8 raw_gate8(const KdaProblem& p, int64_t tok0, int r, int hv, int d0, bool valid) {
  Raw8 x = raw8_zero();
  if (valid) load8_raw(x, p.g, p.g_dtype, ((tok0 + r) * p.HV + hv) * K + d0);
  return x;
}
__device__ __forceinline__ void gate8_to_float(float (&v)[8], const Raw8& x, const KdaProblem& p) {
  raw8_to_float(v, x, p.g, p.g_dtype);
}

// The thread map of the gate's per-chunk pass (gate_cumsum_beta, gate_rows): thread = (16-row block
// blk, group of 8 columns cg, sub-group sub of RPT rows) owns rows row0 .. row0 + RPT - 1 at columns
// d0 .. d0 + 7. The SUBS sub-groups of one block are adjacent lanes (the block prefix is a shuffle).
// NB: the chunk's 16-row blocks (4 for the 64-token chunk every kernel runs; 2 for a 32-token one).
template <int K, int NTH, int NB = 4>
struct GateMap {
  static constexpr int CG = K / 8;
  static constexpr int SUBS = NTH / (NB * CG);  // 4 at K = 128, 8 at K = 64 (NTH = 256, NB = 4)
  static constexpr int RPT = 16 / SUBS;        // rows per thread
  static_assert(SUBS * RPT == 16 && 32 % SUBS == 0, "sub-groups of one block are adjacent lanes");
  int sub, cg, blk, d0, row0;
  __device__ __forceinline__ GateMap()
      : sub(threadIdx.x % SUBS), cg((threadIdx.x / SUBS) % CG), blk(threadIdx.x / (SUBS * CG)), d0(8 * cg),
        row0(16 * blk + RPT * sub) {}
  // The half order of this thread's 16-byte smem accesses of a row (st8_phased): the sub-groups of one
  // column group sit RPT rows apart, on the same banks at the fp32 row strides used (K + 8); with
  // bit 1 of sub choosing the half, a 128-bit phase's 8 lanes are 2-way conflicted instead of 4-way.
  __device__ __forceinline__ int phase() const { return (sub >> 1) & 1; }
};

// The pieces of the gate pass, on one thread's GateMap share: the row loads, the activation with a
// running (inclusive, thread-local) sum, the block prefix over the sub-groups, beta.
template <int K, int NTH, int NB = 4>
struct GatePass {
  using Map = GateMap<K, NTH, NB>;
  static constexpr int SUBS = Map::SUBS, RPT = Map::RPT;
  const KdaProblem& p;
  const int64_t tok0;
  const int len, hv;
  const Map m;
  const GateMode mode;
  // the element index of this thread's first row (row0, column d0) in g, and the stride between rows:
  // each row's load is then one multiply-add, not the full (token, head) index in 64 bits
  const int64_t g0, gstride;
  GateCoef gc;   // gate_activation8's coefficients for this thread's 8 columns (c0: dt_bias until coefs())
  float fin;     // finish_row's factor (g2_factor), from coefs()
  float a_log;   // A_log[hv] as loaded (0 where the gate does not read it), for coefs()
  bool a_used;
  float run[8], excl[8];
  __device__ __forceinline__ GatePass(const KdaProblem& p_, int64_t tok0_, int len_, int hv_)
      : p(p_), tok0(tok0_), len(len_), hv(hv_), m(), mode(p_.opt.gate_mode),
        g0(((tok0_ + m.row0) * p_.HV + hv_) * K + m.d0), gstride(static_cast<int64_t>(p_.HV) * K) {
#pragma unroll
    for (int e = 0; e < 8; ++e) gc.c0[e] = run[e] = 0.f;
    a_used = mode != GateMode::kPrecomputed && mode != GateMode::kBoundedNoALog && p.A_log;
    a_log = a_used ? p.A_log[hv] : 0.f;
    if (mode != GateMode::kPrecomputed && p.dt_bias) {
#pragma unroll
      for (int e = 0; e < 8; ++e) gc.c0[e] = p.dt_bias[hv * K + m.d0 + e];
    }
  }
  // gc and fin from the A_log / dt_bias the constructor loaded. Called after the first gate row's load,
  // the bulk copies and beta's load are issued: a warp issues in order and waits at the first use of
  // a loaded value, so computing them in the constructor (as its expf(A_log) once did) put a full
  // global-load wait in front of every later load of the CTA's first phase (kda_bwd_grads runs one CTA
  // per SM, with nothing to hide that wait behind).
  __device__ __forceinline__ void coefs() {
    const float a_exp = a_used ? expf(a_log) : 1.f;
    gc.c1 = gate_c1(mode, a_exp);
#pragma unroll
    for (int e = 0; e < 8; ++e) gc.c0[e] *= gc.c1;  // dt_bias times c1
    fin = g2_factor(mode, a_exp, p.opt.lower_bound);
  }
  // Row j of the thread's rows, as loaded; zeros past the end of the sequence (gate 0).
  __device__ __forceinline__ Raw8 load_row(int j) const {
    Raw8 x = raw8_zero();
    if (j < RPT && m.row0 + j < len) load8_raw(x, p.g, p.g_dtype, g0 + j * gstride);
    return x;
  }
  // Every row at once (the unrolled pass), the dtype's load form chosen once for all rows instead of
  // per row (load8_raw's three forms; the generic one is the cold path).
  __device__ __forceinline__ void load_rows(Raw8 (&raw)[RPT]) const {
    if (aligned_f32(p.g, p.g_dtype)) {
      const float* b = reinterpret_cast<const float*>(p.g) + g0;
#pragma unroll
      for (int j = 0; j < RPT; ++j) {
        raw[j] = raw8_zero();
        if (m.row0 + j < len) load8_f32(raw[j], b + j * gstride);
      }
    } else if (packed16(p.g, p.g_dtype)) {
      const uint16_t* b = reinterpret_cast<const uint16_t*>(p.g) + g0;
#pragma unroll
      for (int j = 0; j < RPT; ++j) {
        raw[j] = raw8_zero();
        if (m.row0 + j < len) load8_packed16(raw[j], b + j * gstride);
      }
    } else {
#pragma unroll
      for (int j = 0; j < RPT; ++j) raw[j] = load_row(j);
    }
  }
  // beta (after the gate rows' loads are issued: its sigmoid waits on its own load). Threads < 64.
  // sSlope (the backward's): also d beta / d raw beta = scale s (1 - s) in its stable form
  // (sigmoid_slope: 0 from raw beta ~17, where 1 - s rounds away), from the same load; 1 without the
  // sigmoid, 0 past the end.
  __device__ __forceinline__ void load_beta(float* sBeta, float* sSlope = nullptr) const {
    const int tid = threadIdx.x;
    if (tid < 16 * NB) {
      float b = 0.f, sl = 0.f;
      if (tid < len) {
        const float z = load_any(p.beta, p.beta_dtype, (tok0 + tid) * p.HV + hv);
        b = z;
        sl = 1.f;
        if (p.opt.beta_sigmoid_scale != 0.f) {
          b = p.opt.beta_sigmoid_scale * sigmoid_f(z);
          if (sSlope) sl = p.opt.beta_sigmoid_scale * sigmoid_slope(z);
        }
      }
      sBeta[tid] = b;
      if (sSlope) sSlope[tid] = sl;
    }
  }
  // x = the running sum of the gates (over their per-head factor, gate_activation8) up to row j (rows
  // past the end add 0).
  // first: row j is the thread's first row and the sum starts here (the unrolled pass knows it at
  // compile time; an FTZ add of 0 is an instruction the compiler keeps), else the sum goes on.
  // After coefs() (gc holds the raw dt_bias and no c1 before it; gate_rows and gate_cumsum_beta, the
  // only callers, call it once the first phase's loads are issued).
  __device__ __forceinline__ void activate_row(float (&x)[8], const Raw8& raw, int j, bool first = false) {
    const bool ok = m.row0 + j < len;
    gate8_to_float(x, raw, p);
    gate_activation8(mode, x, gc);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float v = ok ? x[e] : 0.f;
      run[e] = first ? v : run[e] + v;
      x[e] = run[e];
    }
  }
  // The exclusive prefix of the sub-groups before this one in the block (shuffles within the
  // block's SUBS lanes). After every row is activated.
  __device__ __forceinline__ void block_prefix() {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float incl = run[e];  // inclusive prefix of the sub-group totals
#pragma unroll
      for (int o = 1; o < SUBS; o <<= 1) {
        const float v = __shfl_up_sync(0xffffffffu, incl, o, SUBS);
        if (m.sub >= o) incl += v;
      }
      excl[e] = __shfl_up_sync(0xffffffffu, incl, 1, SUBS);  // the sub-groups before this one
    }
  }
  // Row j's block-local g2 (the prefix added, times the per-head factor over ln2); the block total into
  // sBT, bit-identical to g2 of the block's last row (so T_b - loc_15 is exactly 0).
  __device__ __forceinline__ void finish_row(float (&x)[8], int j, float* sBT) const {
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = (m.sub == 0 ? x[e] : excl[e] + x[e]) * fin;
    if (m.sub == SUBS - 1 && j == RPT - 1) st8(sBT + m.blk * K + m.d0, x);  // one sub-group: no conflict
  }
};

// No bulk copies to issue (the default of gate_rows / gate_cumsum_beta's issue_bulk).
struct NoBulk {
  __device__ __forceinline__ void operator()() const {}
};

// Gate activation + block-local inclusive cumsum (times 1/ln2) of one chunk, left in REGISTERS: the
// thread's GateMap rows in g2 (row m.row0 + j in g2[j]); the block totals into sBT [4][K] and beta
// (after the optional sigmoid) into sBeta [64] (and its slope into sSlope, when given: load_beta).
// Every row's load is in flight at once. Rows >= len: gate 0, beta 0. For kernels whose later
// per-element work maps onto the same thread share.
// issue_bulk() runs right after the gate rows' loads are issued: the caller's bulk copies of the
// chunk (cp.async) then queue BEHIND the loads the activation waits on, not ahead of them (ncu on
// grads: the top stall of its load phase was the wait for the gate row).
template <int K, int NTH, int NB = 4, typename Bulk = NoBulk>
__device__ __forceinline__ void gate_rows(GatePass<K, NTH, NB>& gp, float (&g2)[GateMap<K, NTH, NB>::RPT][8],
                                          float* sBT, float* sBeta, Bulk issue_bulk = {}, float* sSlope = nullptr) {
  constexpr int RPT = GateMap<K, NTH, NB>::RPT;
  Raw8 raw[RPT];
  gp.load_rows(raw);
  issue_bulk();
  gp.load_beta(sBeta, sSlope);
  gp.coefs();
#pragma unroll
  for (int j = 0; j < RPT; ++j) gp.activate_row(g2[j], raw[j], j, j == 0);
  gp.block_prefix();
#pragma unroll
  for (int j = 0; j < RPT; ++j) gp.finish_row(g2[j], j, sBT);
}

// The same into sG [64][KP] (fp32), for kernels that read g2 across threads; issue_bulk as in gate_rows.
// kRollRows: the row loops rolled (one copy of the load and of the 8 activations, the next row's
// load in flight while this one is activated) for kda_bwd_grads, whose once-per-CTA code was
// instruction-fetch bound (2 rows per thread there). Unrolled (every row's load in flight at once)
// for kda_fwd_intra (4 rows per thread). Measured on the H200 (notes, fourth session): their
// 3c4cfc3 slowdown (3.37 -> 3.86, 1.77 -> 2.39 ms at prod8192) came from the loads being converted
// right behind each load, not from rolling; the unrolled form alone did not bring it back,
// load8_raw did. The rolled form has not been measured in them since.
template <int K, int NTH, int KP, bool kRollRows = false, int NB = 4, typename Bulk = NoBulk>
__device__ __forceinline__ void gate_cumsum_beta(const KdaProblem& p, int64_t tok0, int len, int hv, float* sG,
                                                 float* sBT, float* sBeta, Bulk issue_bulk = {},
                                                 float* sSlope = nullptr) {
  using Map = GateMap<K, NTH, NB>;
  constexpr int RPT = Map::RPT;
  GatePass<K, NTH, NB> gp(p, tok0, len, hv);
  const int row0 = gp.m.row0, d0 = gp.m.d0, ph = gp.m.phase();
  if constexpr (kRollRows) {  // the running sums wait in sG for the block prefix
    Raw8 raw = gp.load_row(0);
    issue_bulk();
    gp.load_beta(sBeta, sSlope);
    gp.coefs();
    float x[8];
#pragma unroll 1
    for (int j = 0; j < RPT; ++j) {
      const Raw8 next = gp.load_row(j + 1);
      gp.activate_row(x, raw, j);
      st8_phased(sG + (row0 + j) * KP + d0, x, ph);
      raw = next;
    }
    gp.block_prefix();
#pragma unroll 1
    for (int j = 0; j < RPT; ++j) {
      ld8_phased(x, sG + (row0 + j) * KP + d0, ph);
      gp.finish_row(x, j, sBT);
      st8_phased(sG + (row0 + j) * KP + d0, x, ph);
    }
  } else {  // every row in registers from its load to its one store
    float xr[RPT][8];
    gate_rows<K, NTH, NB>(gp, xr, sBT, sBeta, issue_bulk, sSlope);
#pragma unroll
    for (int j = 0; j < RPT; ++j) st8_phased(sG + (row0 + j) * KP + d0, xr[j], ph);
  }
}

// The gate's per-chunk scratch in shared memory, one block that every kernel recomputing the gate
// keeps (kda_fwd_intra, kda_bwd_prep, kda_bwd_grads): the block totals T_b and the sums of the
// totals before (O_b) and after (S_b) each block ([NB][K] fp32 each, block_offsets), g2 at the last
// valid row ([K]), beta and the l2norm row factors of q and k ([16 NB] fp32 each). Every member is a
// multiple of 16 bytes, so the block keeps each piece 16-byte aligned where it starts aligned.
template <int K, int NB = 4>
struct GateStorage {
  float BT[NB][K];
  float BO[NB][K];
  float BS[NB][K];
  float Gt[K];
  float beta[16 * NB];
  float rq[16 * NB];
  float rk[16 * NB];
};

// Pointers into a GateStorage, for the phases that pass the gate scratch around as one value.
template <int K>
struct GateScratch {
  float *BT, *BO, *BS, *Gt, *beta, *rq, *rk;
  template <int NB>
  __device__ __forceinline__ explicit GateScratch(GateStorage<K, NB>& s)
      : BT(&s.BT[0][0]), BO(&s.BO[0][0]), BS(&s.BS[0][0]), Gt(s.Gt), beta(s.beta), rq(s.rq), rk(s.rk) {}
};

// From the block totals sBT [NB][K]: sBO[b] = sum of the totals before block b, sBS[b] = after it,
// sGt = G (the chunk total). Sums of terms <= 0: no cancellation. Threads < K. The sums run left to
// right for O and right to left for S. (NB = 4, every kernel's chunk, is written out: the generic
// loop gives the same values with another register allocation in the intra's SASS.)
template <int K, int NB = 4>
__device__ __forceinline__ void block_offsets(const float* sBT, float* sBO, float* sBS, float* sGt) {
  static_assert(NB >= 2, "at least two 16-row blocks");
  const int tid = threadIdx.x;
  if (tid >= K) return;
  if constexpr (NB == 4) {
    const float b0 = sBT[tid], b1 = sBT[K + tid], b2 = sBT[2 * K + tid], b3 = sBT[3 * K + tid];
    const float o2 = b0 + b1, o3 = o2 + b2;
    const float s2 = b3, s1 = b2 + s2, s0 = b1 + s1;
    sBO[tid] = 0.f;
    sBO[K + tid] = b0;
    sBO[2 * K + tid] = o2;
    sBO[3 * K + tid] = o3;
    sBS[tid] = s0;
    sBS[K + tid] = s1;
    sBS[2 * K + tid] = s2;
    sBS[3 * K + tid] = 0.f;
    if (sGt) sGt[tid] = o3 + b3;  // G
  } else {
    float b[NB];
#pragma unroll
    for (int i = 0; i < NB; ++i) b[i] = sBT[i * K + tid];
    float o = b[0], s = b[NB - 1];
    sBO[tid] = 0.f;
    sBO[K + tid] = o;
    sBS[(NB - 1) * K + tid] = 0.f;
    sBS[(NB - 2) * K + tid] = s;
#pragma unroll
    for (int i = 2; i < NB; ++i) {
      o = o + b[i - 1];
      sBO[i * K + tid] = o;
      s = b[NB - i] + s;
      sBS[(NB - 1 - i) * K + tid] = s;
    }
    if (sGt) sGt[tid] = o + b[NB - 1];  // G
  }
}

// The l2norm's row factor from a row's sum of squares, 1 / sqrt(sum x^2 + 1e-6) (fla's epsilon): the
// one definition every kernel uses (the chunk kernels, the GVA group sums, the token recurrence).
__device__ __forceinline__ float l2norm_rstd(float sum_sq) { return 1.f / sqrtf(sum_sq + 1e-6f); }

// One lane's parts of a q row's and a k row's sums of squares: 8 elements of each (one 16-byte
// vector), in the one order every row factor of the project sums them (row_rstd and
// row_rstd_fp16_operands: their factors must be bitwise equal, the backward's prep recomputes the
// forward intra's).
template <typename WT>
__device__ __forceinline__ void sum_sq8(const uint4& uq, const uint4& uk, float& sq, float& sk) {
  const uint32_t wq[4] = {uq.x, uq.y, uq.z, uq.w}, wk[4] = {uk.x, uk.y, uk.z, uk.w};
  sq = sk = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 a = Elem<WT>::to_float2(wq[e]), b = Elem<WT>::to_float2(wk[e]);
    sq = fmaf(a.x, a.x, fmaf(a.y, a.y, sq));
    sk = fmaf(b.x, b.x, fmaf(b.y, b.y, sk));
  }
}

// The l2norm row factors rq = 1 / sqrt(sum q^2 + 1e-6) (1 when l2norm is off) of the raw q / k
// rows sQ, sK [64][KQ]: K/8 lanes per row, 8 elements each (16-byte loads), a shuffle tree over
// the row's lanes (aligned groups of K/8 lanes of one warp; uniform trip count).
template <typename WT, int K, int NTH, int KQ, int C = kChunk>
__device__ __forceinline__ void row_rstd(const WT* sQ, const WT* sK, bool l2norm, float* sRq, float* sRk) {
  constexpr int VPR = K / 8;
  static_assert((C * VPR) % NTH == 0 && 32 % VPR == 0, "rows map onto aligned lane groups");
  if (!l2norm) {  // uniform branch: no loads or shuffles when the factors are all 1
    strided<C, NTH>(threadIdx.x, [&](int r) { sRq[r] = sRk[r] = 1.f; });
    return;
  }
  strided<C * VPR, NTH>(threadIdx.x, [&](int i) {
    const int r = i / VPR, d0 = (i % VPR) * 8;
    float sq, sk;
    sum_sq8<WT>(*reinterpret_cast<const uint4*>(sQ + r * KQ + d0), *reinterpret_cast<const uint4*>(sK + r * KQ + d0),
                sq, sk);
#pragma unroll
    for (int o = VPR / 2; o > 0; o >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    if (i % VPR == 0) {
      sRq[r] = l2norm_rstd(sq);
      sRk[r] = l2norm_rstd(sk);
    }
  });
}

// 2^n as a float, n in [-126, 127] (normal range: the bits are the biased exponent alone).
__device__ __forceinline__ float exp2_int(int n) { return __int_as_float((n + 127) << 23); }

// The power of two 2^n by which the forward intra scales a raw bf16 row down (row_rstd_fp16_operands),
// from the row's largest magnitude m: n = 0 where m is in [2^-6, 2^14) (its gated fp16 operands can
// neither overflow nor lose more than 2^-19 of m below fp16's normal range), else the exponent of m
// (2^n <= m < 2^(n+1)) clamped to [-126, 126] so that 2^n and 2^-n are normal; 0 for a zero row.
__device__ __forceinline__ int row_exponent(float m) {
  const int n = static_cast<int>((__float_as_uint(m) >> 23) & 0xffu) - 127;
  return (m == 0.f || (n >= -6 && n < 14)) ? 0 : max(-126, min(126, n));
}

// row_rstd for the forward intra, whose P2 products take fp16 operands (a raw entry times a decay
// factor <= 1, rounded to fp16). With bf16 inputs a raw q / k row whose largest magnitude lies
// outside [2^-6, 2^14) is rescaled IN PLACE in sQ / sK by 2^-n (row_exponent), so that no fp16
// operand overflows and a row of small entries does not sink into fp16's subnormal range; its factor
// becomes rq 2^n. The scaling is exact (a power of two on a bf16, barring entries 2^-126 below the
// row's largest), so every product of the scaled row with its factor rounds exactly as the unscaled
// one: qg, kg, kexp and the fp32 products are bitwise what row_rstd's factors give (the backward's
// prep recomputes qg / kg from the raw rows with row_rstd). The sums of squares run in row_rstd's
// order. fp16 inputs are in fp16's range already, and a gated operand loses no more than the input's
// own storage did (the same absolute spacing below fp16's normal range): row_rstd as it is.
template <typename WT, int K, int NTH, int KQ, int C = kChunk>
__device__ __forceinline__ void row_rstd_fp16_operands(WT* sQ, WT* sK, bool l2norm, float* sRq, float* sRk) {
  if constexpr (!std::is_same<WT, __nv_bfloat16>::value) {
    row_rstd<WT, K, NTH, KQ, C>(sQ, sK, l2norm, sRq, sRk);
  } else {
    constexpr int VPR = K / 8, IT = C * VPR / NTH;  // each thread: IT vectors of q and of k
    static_assert((C * VPR) % NTH == 0 && 32 % VPR == 0, "rows map onto aligned lane groups");
    // All IT vectors' loads and reductions side by side, without a branch between them: the shuffle
    // trees are latency chains, and one vector at a time behind a branch (the first form) cost the
    // phase ~1.9k cycles per CTA on the H200.
    uint4 uq[IT], uk[IT];
    float sq[IT], sk[IT];
    uint32_t m2[IT];  // the largest magnitudes of the q and the k row as one bf16x2 (max is exact)
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const int i = threadIdx.x + it * NTH, r = i / VPR, d0 = (i % VPR) * 8;
      uq[it] = *reinterpret_cast<const uint4*>(sQ + r * KQ + d0);
      uk[it] = *reinterpret_cast<const uint4*>(sK + r * KQ + d0);
      const __nv_bfloat162* hq = reinterpret_cast<const __nv_bfloat162*>(&uq[it]);
      const __nv_bfloat162* hk = reinterpret_cast<const __nv_bfloat162*>(&uk[it]);
      sum_sq8<WT>(uq[it], uk[it], sq[it], sk[it]);  // (formed whether or not l2norm is on)
      __nv_bfloat162 mq2 = __habs2(hq[0]), mk2 = __habs2(hk[0]);
#pragma unroll
      for (int e = 1; e < 4; ++e) mq2 = __hmax2(mq2, __habs2(hq[e])), mk2 = __hmax2(mk2, __habs2(hk[e]));
      const __nv_bfloat162 m = __hmax2(__lows2bfloat162(mq2, mk2), __highs2bfloat162(mq2, mk2));
      m2[it] = *reinterpret_cast<const uint32_t*>(&m);
    }
#pragma unroll
    for (int o = VPR / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int it = 0; it < IT; ++it) {
        sq[it] += __shfl_xor_sync(0xffffffffu, sq[it], o);
        sk[it] += __shfl_xor_sync(0xffffffffu, sk[it], o);
        const uint32_t other = __shfl_xor_sync(0xffffffffu, m2[it], o);
        const __nv_bfloat162 m = __hmax2(*reinterpret_cast<const __nv_bfloat162*>(&m2[it]),
                                         *reinterpret_cast<const __nv_bfloat162*>(&other));
        m2[it] = *reinterpret_cast<const uint32_t*>(&m);
      }
    }
    int nq[IT], nk[IT];
    bool any = false;
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const __nv_bfloat162 m = *reinterpret_cast<const __nv_bfloat162*>(&m2[it]);
      nq[it] = row_exponent(__low2float(m));
      nk[it] = row_exponent(__high2float(m));
      any |= (nq[it] | nk[it]) != 0;
    }
    if (any) {  // rows already in [2^-6, 2^14) stay as they are (the usual case: no store)
#pragma unroll
      for (int it = 0; it < IT; ++it) {
        const int i = threadIdx.x + it * NTH, r = i / VPR, d0 = (i % VPR) * 8;
        // 2^-n is a bf16 (8 exponent bits, like fp32): the bf16x2 products are exact
        const __nv_bfloat162 dq = __float2bfloat162_rn(exp2_int(-nq[it]));
        const __nv_bfloat162 dk = __float2bfloat162_rn(exp2_int(-nk[it]));
        __nv_bfloat162* hq = reinterpret_cast<__nv_bfloat162*>(&uq[it]);
        __nv_bfloat162* hk = reinterpret_cast<__nv_bfloat162*>(&uk[it]);
#pragma unroll
        for (int e = 0; e < 4; ++e) hq[e] = __hmul2(hq[e], dq), hk[e] = __hmul2(hk[e], dk);
        *reinterpret_cast<uint4*>(sQ + r * KQ + d0) = uq[it];
        *reinterpret_cast<uint4*>(sK + r * KQ + d0) = uk[it];
      }
    }
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const int i = threadIdx.x + it * NTH, r = i / VPR;
      if (i % VPR == 0) {
        sRq[r] = (l2norm ? l2norm_rstd(sq[it]) : 1.f) * exp2_int(nq[it]);
        sRk[r] = (l2norm ? l2norm_rstd(sk[it]) : 1.f) * exp2_int(nk[it]);
      }
    }
  }
}

// The block sums of one 8-column vector: O_b, T_b, S_b of row block b at columns d0 .. d0 + 7, in
// slot order sw. Shared by every row of the block at those columns (intra_store_gated's two vectors).
struct BlockSums8 {
  float o[8], t[8], s[8];
  template <int K>
  __device__ __forceinline__ void load(const float* sBO, const float* sBT, const float* sBS, int b, int d0, int sw) {
    ld8_slots(o, sBO + b * K + d0, sw);
    ld8_slots(t, sBT + b * K + d0, sw);
    ld8_slots(s, sBS + b * K + d0, sw);
  }
};

// The gated rows of one 8-column vector (row r, columns d0 .. d0 + 7), from its block-local g2 (loc) and
// the block sums: qg = fq q exp2(g2), kg = fk k exp2(G - g2) and, when wanted, kexp = fk k exp2(g2),
// packed to WT pairs. g2 = O_b + loc (blocks before + block-local), G - g2 = (T_b - loc) + S_b (blocks
// after): sums of terms <= 0, so every exponent is <= 0 and free of cancellation across blocks.
// sw: loc and bs are in slot order (ld8_slots); the packed outputs come back in natural order. sw = 0
// (a constant at the call) is the plain form.
template <typename WT, int KQ>
__device__ __forceinline__ void gated_vec8_sums(const float (&loc)[8], const BlockSums8& bs, const WT* sQ,
                                                const WT* sK, float fq, float fk, int r, int d0, uint32_t (&pq)[4],
                                                uint32_t (&pk)[4], uint32_t* pkexp, int sw) {
  using E = Elem<WT>;
  float g2v[8], Gv[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    Gv[e] = (bs.t[e] - loc[e]) + bs.s[e];  // G - g2
    g2v[e] = bs.o[e] + loc[e];             // g2
  }
  const uint4 uq = *reinterpret_cast<const uint4*>(sQ + r * KQ + d0);
  const uint4 uk = *reinterpret_cast<const uint4*>(sK + r * KQ + d0);
  uint32_t wq[4] = {uq.x, uq.y, uq.z, uq.w}, wk[4] = {uk.x, uk.y, uk.z, uk.w};
  words_slots(wq, sw);
  words_slots(wk, sw);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 qv = E::to_float2(wq[e]), kv = E::to_float2(wk[e]);
    const float x0 = fast_exp2(g2v[2 * e]), x1 = fast_exp2(g2v[2 * e + 1]);
    pq[e] = E::pack2(fq * qv.x * x0, fq * qv.y * x1);
    pk[e] = E::pack2(fk * kv.x * fast_exp2(Gv[2 * e]), fk * kv.y * fast_exp2(Gv[2 * e + 1]));
    if (pkexp) pkexp[e] = E::pack2(fk * kv.x * x0, fk * kv.y * x1);
  }
  words_slots(pq, sw);
  words_slots(pk, sw);
  if (pkexp) words_slots(pkexp, sw);
}

// The same with row r's block sums loaded here.
template <typename WT, int K, int KQ>
__device__ __forceinline__ void gated_vec8_loc(const float (&loc)[8], const float* sBO, const float* sBT,
                                               const float* sBS, const WT* sQ, const WT* sK, float fq, float fk,
                                               int r, int d0, uint32_t (&pq)[4], uint32_t (&pk)[4], uint32_t* pkexp,
                                               int sw = 0) {
  BlockSums8 bs;
  bs.load<K>(sBO, sBT, sBS, r >> 4, d0, sw);
  gated_vec8_sums<WT, KQ>(loc, bs, sQ, sK, fq, fk, r, d0, pq, pk, pkexp, sw);
}

}  // namespace kernel_fun::kda::dev
