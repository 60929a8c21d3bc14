// The backward in batch slices: run the stages (prep -> re-scan -> dh scan -> grads, and the GVA
// group sums) on batches [b0, b0 + nb) at a time, so that the per-chunk workspace (w, qg, kg,
// exp2(G), the two checkpoints h_c and dh_{c+1}: 5.5 GiB at B16 T8192 H16 K128 V256) is sized for
// one slice and reused. Fixed-length batches only (a varlen batch is one row: B = 1).
//
// Why it costs (almost) no time: the scans are serial over chunks with one CTA per (sequence, head,
// V-slice) and one CTA per SM, so their time is set by waves of CTAs; kda_bwd_slice_batches picks
// the smallest slice whose scans need no more waves in total than the whole batch's (e.g. 512
// scan CTAs = 4 waves of 132 -> 4 slices of 128 CTAs = 4 waves). The per-chunk kernels keep
// thousands of CTAs per slice.
//
// Invariants: every kernel indexes tokens as n * T + t and sequences by n < N, so a slice is the
// same problem with B = N = nb and every per-token / per-sequence pointer advanced by b0 rows;
// the per-chunk gate partials (pbias, pA) stay full-size (kda_bwd_gate_params sums all of them
// once, after the last slice) and are advanced by the slice's first chunk. Each CTA computes the
// same values whatever the slicing: results are bitwise identical for every slice size. The
// streamed backward (kda_bwd.cu's kda_bwd_streams) runs slice by slice: the counters (dh_ready) are
// sized for one slice and zeroed before each slice's dh scan.
#pragma once

#include <cstdint>

#include "kda/kda_problem.h"

namespace kernel_fun::kda {

inline int64_t dtype_bytes(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat64: return 8;
  }
  return 4;
}

// The params of batches [b0, b0 + nb) of `full` (a fixed-length problem). The workspace pointers
// of `full` (w, qg, kg, gdecay, h_ckpt unless the forward gave it, dh_ckpt, dqhat, dkhat) must
// already be sized for nb batches: they are used as they are, from row 0.
inline KdaBwdParams kda_bwd_batch_slice(const KdaBwdParams& full, int b0, int nb) {
  KdaBwdParams s = full;
  keep_batches(s, nb);
  const int64_t nts = (full.T + kChunk - 1) / kChunk;
  const int64_t tok = static_cast<int64_t>(b0) * full.T;  // first token row of the slice
  const int64_t wt = dtype_bytes(full.dtype);
  auto adv = [](const void* p, int64_t bytes) -> const char* {
    return p ? static_cast<const char*>(p) + bytes : nullptr;
  };
  auto adv_mut = [](void* p, int64_t bytes) -> void* { return p ? static_cast<char*>(p) + bytes : nullptr; };
  const int64_t qk_row = static_cast<int64_t>(full.H) * full.K;    // q, k, dq, dk
  const int64_t v_row = static_cast<int64_t>(full.HV) * full.V;    // v, do, dv
  const int64_t g_row = static_cast<int64_t>(full.HV) * full.K;    // g, dg
  const int64_t a_row = static_cast<int64_t>(full.HV) * kChunk;    // Aqk, Akk, M (saved factors)
  const int64_t state = static_cast<int64_t>(full.HV) * full.K * full.V;  // h0, dht, dh0 (fp32)
  s.q = adv(full.q, tok * qk_row * wt);
  s.k = adv(full.k, tok * qk_row * wt);
  s.v = adv(full.v, tok * v_row * wt);
  s.g = adv(full.g, tok * g_row * dtype_bytes(full.g_dtype));
  s.beta = adv(full.beta, tok * full.HV * dtype_bytes(full.beta_dtype));
  s.h0 = reinterpret_cast<const float*>(adv(full.h0, b0 * state * 4));
  s.dout = adv(full.dout, tok * v_row * wt);
  s.dht = reinterpret_cast<const float*>(adv(full.dht, b0 * state * 4));
  s.dq = adv_mut(full.dq, tok * qk_row * wt);
  s.dk = adv_mut(full.dk, tok * qk_row * wt);
  s.dv = adv_mut(full.dv, tok * v_row * wt);
  s.dg = adv_mut(full.dg, tok * g_row * dtype_bytes(full.g_dtype));
  s.dbeta = adv_mut(full.dbeta, tok * full.HV * dtype_bytes(full.beta_dtype));
  s.dh0 = static_cast<float*>(adv_mut(full.dh0, b0 * state * 4));
  if (full.saved_factors) {  // the forward's [B*T, HV, 64]; otherwise per-slice workspace
    s.Aqk = adv_mut(full.Aqk, tok * a_row * wt);
    s.Akk = adv_mut(full.Akk, tok * a_row * wt);
    s.M = adv_mut(full.M, tok * a_row * wt);
  }
  s.dbg_dA = static_cast<float*>(adv_mut(full.dbg_dA, tok * a_row * 4));
  s.dbg_dL = static_cast<float*>(adv_mut(full.dbg_dL, tok * a_row * 4));
  const int64_t chunk0 = b0 * nts;
  // the forward's whole-batch buffer (h_ckpt_given); otherwise h_ckpt is per-slice workspace
  if (full.h_ckpt_given) s.h_ckpt = adv_mut(full.h_ckpt, chunk0 * full.HV * full.V * full.K * wt);
  if (full.saved_workspace) {  // the forward's whole-batch w, qg, kg, gdecay
    s.w = adv_mut(full.w, tok * g_row * wt);
    s.qg = adv_mut(full.qg, tok * g_row * wt);
    s.kg = adv_mut(full.kg, tok * g_row * wt);
    s.gdecay = static_cast<float*>(adv_mut(full.gdecay, chunk0 * full.HV * full.K * 4));
  }
  s.dbg_clock = static_cast<long long*>(adv_mut(full.dbg_clock, chunk0 * full.HV * 16 * 8));
  s.pbias = static_cast<float*>(adv_mut(full.pbias, chunk0 * full.HV * full.K * 4));
  s.pA = static_cast<float*>(adv_mut(full.pA, chunk0 * full.HV * 4));
  return s;
}

// Runs pass(params) on each slice of p.slice_B batches in order, or once on p itself (varlen, or
// p.slice_B unset or >= B). The one place the slice loop is written (the launcher and the emulator).
template <typename Pass>
void for_each_batch_slice(const KdaBwdParams& p, Pass&& pass) {
  if (!sliced_backward(p, p.slice_B)) {
    pass(p);
    return;
  }
  const int nb = p.slice_B;
  for (int b0 = 0; b0 < p.B; b0 += nb) pass(kda_bwd_batch_slice(p, b0, nb < p.B - b0 ? nb : p.B - b0));
}

}  // namespace kernel_fun::kda
