// The KDA forward and backward as an fp32 token recurrence, for problems whose every sequence fits
// in one chunk (kda_policy.h's recurrent_possible; csrc/api decides once per call, KdaProblem::
// recurrent). The chunk kernels store their intermediates (w, qg, kg, Aqk, Akk, M, v', the states)
// in the input dtype and multiply them on 16-bit tensor cores; on one chunk that rounding is most
// of the error, and a gradient summed over every token (dA_log, ddt_bias) shows it
// (docs/notes/2026-12-02-dalog-floor.md). Here nothing is rounded to 16 bits but the outputs
// themselves: the state, the gate, the normalised q / k and every gradient stay fp32.
//
//   S~_t = exp(gate_t) . S_{t-1}   (rows scaled)      u_t = v_t - S~_t^T k_t
//   S_t  = S~_t + beta_t k_t u_t^T                     o_t = scale S_t^T q_t
//
// One CTA per (sequence, value head, 32-column value slice); thread d owns row d of the state (K
// threads), its 32 columns in registers. Sums over the columns (dq, dk, the gate gradient) are
// thread-local; sums over the rows (u, o, dv) go through column_sums.
//
// The backward replays the recurrence for its slice, storing the state before every token in a
// global fp32 workspace (recur_state: one row of 32 floats per thread and token, written and read
// back by the same thread), then runs it in reverse:
//   dS_t += scale q_t do_t^T;  dq_t = scale S_t do_t;  du = beta k_t^T dS_t;  dv_t = du
//   dbeta_t = u_t . (k_t^T dS_t);  dk_t = beta dS_t u_t - S~_t du
//   dS~ = dS_t - k_t du^T;  dgate_t = rowsum(dS~ . S~_t);  dS_{t-1} = exp(gate_t) . dS~
// Each slice writes its shares of dq / dk / dgate / dbeta once; a second launch adds them in slice
// order (deterministic) and finishes as the chunk path does: dq^ / dk^ into dqhat / dkhat for
// kda_bwd_group_sum (the l2norm backward and, with GVA, the sum over the group), the gate's
// derivative with the per-sequence partials of dA_log / ddt_bias for kda_bwd_gate_params.
#pragma once

#include <cstdint>

#include "common/dtype_access.cuh"
#include "kda/device/gate.cuh"
#include "kda/device/sequence.cuh"
#include "kda/kda_launch_shape.h"

namespace kernel_fun::kda {

// Shared memory. RecurCore: what both kernels read per token: q / k normalised (fp32, scale not
// folded), a = exp(gate) per step, beta after its sigmoid, q.k, and the scratch of NR column sums.
template <int K, int NR>
struct RecurCore {
  float q[kChunk][K];
  float k[kChunk][K];
  float a[kChunk][K];
  float beta[kChunk];
  float qk[kChunk];
  float red[NR][K][kRecurCols + 1];  // column_sums: one row per thread (+1: thread d's row starts on bank d)
  float part[NR][K / 32][kRecurCols];
  float tot[NR][kRecurCols];
  float v[kChunk][kRecurCols];  // the value slice
};
// The forward sums k S~ and q S~ at once.
template <int K>
struct RecurFwdSmem : RecurCore<K, 2> {};
// The backward also keeps do's slice and u (from the replay, for the reverse). Its shares of the sums
// over slices go to global memory (recur_state), each written once.
template <int K>
struct RecurBwdSmem : RecurCore<K, 1> {
  float dout[kChunk][kRecurCols];
  float u[kChunk][kRecurCols];
};

namespace dev {

// out[r][c] = sum over the CTA's K threads d of x_d[r][c] (r < NR), in a fixed order: each thread's
// row into red, then thread j sums column j % 32 over rows 32 (j / 32) .. + 31, then threads 0..31
// add the K / 32 parts in order. Three barriers; every thread may read s.tot afterwards.
template <int K, int NR>
__device__ __forceinline__ void column_sums(RecurCore<K, NR>& s, const float (&x)[NR][kRecurCols]) {
  const int d = threadIdx.x;
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int c = 0; c < kRecurCols; ++c) s.red[r][d][c] = x[r][c];
  __syncthreads();
  const int col = d & 31, prt = d >> 5;
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    float acc = 0.f;
#pragma unroll 8
    for (int i = 0; i < 32; ++i) acc += s.red[r][32 * prt + i][col];
    s.part[r][prt][col] = acc;
  }
  __syncthreads();
  if (d < kRecurCols) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < K / 32; ++i) acc += s.part[r][i][d];
      s.tot[r][d] = acc;
    }
  }
  __syncthreads();
}

// The raw gate input x = g (+ dt_bias) of token tok, value head hv, column d.
__device__ __forceinline__ float gate_input(const KdaProblem& p, int64_t tok, int hv, int d) {
  const float g = load_any(p.g, p.g_dtype, (tok * p.HV + hv) * p.K + d);
  const bool in_kernel = p.opt.gate_mode != GateMode::kPrecomputed;
  return g + ((in_kernel && p.dt_bias) ? p.dt_bias[hv * p.K + d] : 0.f);
}

// Sequence n's tokens into s (rows t < len; len <= 64): q / k (l2-normalised when asked), exp(gate),
// beta (after its sigmoid), q.k. Thread d loads column d of every row; warp w normalises rows
// w, w + K/32, ... (lane sums over 32-strided columns, then a butterfly: a fixed order). Ends with a
// barrier.
template <int K, int NR>
__device__ __forceinline__ void recur_stage_tokens(const KdaProblem& p, RecurCore<K, NR>& s, int64_t bos, int len,
                                                   int hv) {
  const int d = threadIdx.x, lane = d & 31, warp = d >> 5;
  const int h = hv / (p.HV / p.H);
  const float a_exp = gate_a_exp(p, hv);
  for (int t = 0; t < len; ++t) {
    const int64_t tok = bos + t;
    s.q[t][d] = load_any(p.q, p.dtype, (tok * p.H + h) * K + d);
    s.k[t][d] = load_any(p.k, p.dtype, (tok * p.H + h) * K + d);
    s.a[t][d] = expf(gate_value(p.opt.gate_mode, gate_input(p, tok, hv, d), a_exp, p.opt.lower_bound));
  }
  if (d < len) {
    const float b = load_any(p.beta, p.beta_dtype, (bos + d) * p.HV + hv);
    s.beta[d] = p.opt.beta_sigmoid_scale != 0.f ? p.opt.beta_sigmoid_scale * sigmoid_f(b) : b;
  }
  __syncthreads();
  for (int t = warp; t < len; t += K / 32) {
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int i = 0; i < K / 32; ++i) {
      sq = fmaf(s.q[t][lane + 32 * i], s.q[t][lane + 32 * i], sq);
      sk = fmaf(s.k[t][lane + 32 * i], s.k[t][lane + 32 * i], sk);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    const float rq = p.opt.l2norm ? l2norm_rstd(sq) : 1.f;
    const float rk = p.opt.l2norm ? l2norm_rstd(sk) : 1.f;
    float qk = 0.f;
#pragma unroll
    for (int i = 0; i < K / 32; ++i) {
      const int c = lane + 32 * i;
      const float qn = s.q[t][c] * rq, kn = s.k[t][c] * rk;
      s.q[t][c] = qn;
      s.k[t][c] = kn;
      qk = fmaf(qn, kn, qk);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) qk += __shfl_xor_sync(0xffffffffu, qk, o);
    if (lane == 0) s.qk[t] = qk;
  }
  __syncthreads();
}

// Columns c0 .. c0 + 31 of rows t < len of a [tokens, HV, V] tensor (v or do, the input dtype) into dst.
template <int K>
__device__ __forceinline__ void recur_stage_cols(const KdaProblem& p, const void* src, float (*dst)[kRecurCols],
                                                 int64_t bos, int len, int hv, int c0) {
  for (int i = threadIdx.x; i < len * kRecurCols; i += K) {
    const int t = i / kRecurCols, c = i % kRecurCols;
    dst[t][c] = load_any(src, p.dtype, ((bos + t) * p.HV + hv) * p.V + c0 + c);
  }
}

// Row d, columns c0 .. c0 + 31 of sequence n's fp32 state (h0 / ht / dht / dh0 layout), or zeros.
template <int K>
__device__ __forceinline__ void load_state_row(const KdaProblem& p, const float* st, int n, int hv, int d, int c0,
                                               float (&x)[kRecurCols]) {
#pragma unroll
  for (int c = 0; c < kRecurCols; ++c)
    x[c] = st ? st[state_base<K>(p, n, hv) + state_offset<K>(p, d, c0 + c)] : 0.f;
}
template <int K>
__device__ __forceinline__ void store_state_row(const KdaProblem& p, float* st, int n, int hv, int d, int c0,
                                                const float (&x)[kRecurCols]) {
#pragma unroll
  for (int c = 0; c < kRecurCols; ++c) st[state_base<K>(p, n, hv) + state_offset<K>(p, d, c0 + c)] = x[c];
}

// One forward step of row d: S <- exp(gate) . S, then (after the column sums of k S~ and, with
// with_o, q S~) u = v - k^T S~ and S <- S~ + beta k u^T. Returns with s.tot[0] = k^T S~ and
// s.tot[1] = q^T S~ (with_o). S~ is left in St when asked (the backward's reverse step).
template <int K, bool kWithO>
__device__ __forceinline__ void recur_step(RecurCore<K, kWithO ? 2 : 1>& s, int t, float (&S)[kRecurCols]) {
  const int d = threadIdx.x;
  const float a = s.a[t][d], kd = s.k[t][d], qd = s.q[t][d];
  float x[kWithO ? 2 : 1][kRecurCols];
#pragma unroll
  for (int c = 0; c < kRecurCols; ++c) {
    S[c] *= a;
    x[0][c] = kd * S[c];
    if constexpr (kWithO) x[kWithO ? 1 : 0][c] = qd * S[c];
  }
  column_sums<K, kWithO ? 2 : 1>(s, x);
  const float bk = s.beta[t] * kd;
#pragma unroll
  for (int c = 0; c < kRecurCols; ++c) S[c] = fmaf(bk, s.v[t][c] - s.tot[0][c], S[c]);
}

}  // namespace dev

// ---------------------------------------------------------------- forward
// Grid (V / 32, HV, N), K threads. o (and the final state, and h_states' one state per sequence:
// the state before its only chunk) for value columns [32 x, 32 x + 32) of value head y, sequence z.
template <int K>
__global__ void __launch_bounds__(K) kda_recur_fwd_kernel(const KdaFwdParams p) {
  KF_DYN_SMEM(float4, smem_f4);
  RecurFwdSmem<K>& s = *reinterpret_cast<RecurFwdSmem<K>*>(smem_f4);
  const int c0 = blockIdx.x * kRecurCols, hv = blockIdx.y, n = blockIdx.z, d = threadIdx.x;
  const dev::SeqInfo seq = dev::seq_info(p, n);
  const int len = seq.len;  // <= kChunk (recurrent_possible)
  dev::recur_stage_tokens<K>(p, s, seq.bos, len, hv);
  dev::recur_stage_cols<K>(p, p.v, s.v, seq.bos, len, hv, c0);
  float S[kRecurCols];
  dev::load_state_row<K>(p, p.h0, n, hv, d, c0, S);
  if (p.h_states && len > 0) {  // fla's h: the state each chunk starts from, in the output dtype
#pragma unroll
    for (int c = 0; c < kRecurCols; ++c)
      store_any(p.h_states, p.dtype, (static_cast<int64_t>(seq.chunk0) * p.HV + hv) * K * p.V +
                                         dev::state_offset<K>(p, d, c0 + c), S[c]);
  }
  __syncthreads();  // s.v
  for (int t = 0; t < len; ++t) {
    dev::recur_step<K, true>(s, t, S);
    if (d < kRecurCols) {
      // o_t = scale q^T S_t = scale (q^T S~ + beta (q . k) u), u = v - k^T S~
      const float u = s.v[t][d] - s.tot[0][d];
      const float o = p.opt.scale * fmaf(s.beta[t] * s.qk[t], u, s.tot[1][d]);
      store_any(p.o, p.dtype, ((seq.bos + t) * p.HV + hv) * p.V + c0 + d, o);
    }
  }
  if (p.ht) dev::store_state_row<K>(p, p.ht, n, hv, d, c0, S);
}

template <int K>
inline LaunchShape recur_fwd_launch(const KdaFwdParams& p) {
  return {dim3(static_cast<unsigned>(p.V / kRecurCols), static_cast<unsigned>(p.HV), static_cast<unsigned>(p.N)), K,
          sizeof(RecurFwdSmem<K>)};
}

// ---------------------------------------------------------------- backward
// Two launches (for_each_recur_bwd_pass): the value slices in parallel, each writing its share of the
// sums over slices to recur_state; then one CTA per (sequence, value head) adds the shares in slice
// order and finishes. recur_state per (sequence, value head) and slice (kda_problem.h,
// recur_slice_floats): the state before each token [64][K][32], then this slice's shares of
// dq^ / dk^ / dgate [3][64][K] and of dbeta [64].
struct RecurSlice {
  float* state;  // [64][K][32]
  float* dq;     // [64][K]
  float* dk;
  float* dgate;
  float* dbeta;  // [64]
};
template <int K>
__device__ __forceinline__ RecurSlice recur_slice(const KdaBwdParams& p, int n, int hv, int slice) {
  float* base = p.recur_state + ((static_cast<int64_t>(n) * p.HV + hv) * (p.V / kRecurCols) + slice) *
                                    recur_slice_floats(K);
  float* parts = base + int64_t{kChunk} * K * kRecurCols;
  return {base, parts, parts + kChunk * K, parts + 2 * kChunk * K, parts + 3 * kChunk * K};
}

// Grid (V / 32, HV, N), K threads: value columns [32 x, 32 x + 32) of value head y, sequence z. The
// forward replayed with the state before each token stored (this thread's row: written and read back
// by this thread only), then the reverse recurrence.
template <int K>
__global__ void __launch_bounds__(K) kda_recur_bwd_kernel(const KdaBwdParams p) {
  KF_DYN_SMEM(float4, smem_f4);
  RecurBwdSmem<K>& s = *reinterpret_cast<RecurBwdSmem<K>*>(smem_f4);
  const int slice = blockIdx.x, c0 = slice * kRecurCols, hv = blockIdx.y, n = blockIdx.z, d = threadIdx.x;
  const int HV = p.HV;
  const dev::SeqInfo seq = dev::seq_info(p, n);
  const int len = seq.len;
  const float scale = p.opt.scale;
  const RecurSlice out = recur_slice<K>(p, n, hv, slice);
  float4* hist = reinterpret_cast<float4*>(out.state) + d * (kRecurCols / 4);  // row d of token 0's state
  dev::recur_stage_tokens<K>(p, s, seq.bos, len, hv);
  dev::recur_stage_cols<K>(p, p.v, s.v, seq.bos, len, hv, c0);
  dev::recur_stage_cols<K>(p, p.dout, s.dout, seq.bos, len, hv, c0);
  float S[kRecurCols], dS[kRecurCols];
  dev::load_state_row<K>(p, p.h0, n, hv, d, c0, S);
  __syncthreads();
  for (int t = 0; t < len; ++t) {
    float4* row = hist + static_cast<int64_t>(t) * K * (kRecurCols / 4);
#pragma unroll
    for (int c = 0; c < kRecurCols / 4; ++c) row[c] = make_float4(S[4 * c], S[4 * c + 1], S[4 * c + 2], S[4 * c + 3]);
    dev::recur_step<K, false>(s, t, S);
    if (d < kRecurCols) s.u[t][d] = s.v[t][d] - s.tot[0][d];
  }
  dev::load_state_row<K>(p, p.dht, n, hv, d, c0, dS);
  __syncthreads();  // s.u
  // the row of token t - 1 is loaded a step ahead: off the serial chain
  float4 nxt[kRecurCols / 4];
  const auto load_row = [&](int t) {
    const float4* row = hist + static_cast<int64_t>(t) * K * (kRecurCols / 4);
#pragma unroll
    for (int c = 0; c < kRecurCols / 4; ++c) nxt[c] = row[c];
  };
  if (len > 0) load_row(len - 1);
  for (int t = len - 1; t >= 0; --t) {
    const float a = s.a[t][d], kd = s.k[t][d], qd = s.q[t][d], bt = s.beta[t];
    float St[kRecurCols];  // S~_t = exp(gate_t) . S_{t-1}
#pragma unroll
    for (int c = 0; c < kRecurCols / 4; ++c) {
      St[4 * c] = a * nxt[c].x;
      St[4 * c + 1] = a * nxt[c].y;
      St[4 * c + 2] = a * nxt[c].z;
      St[4 * c + 3] = a * nxt[c].w;
    }
    if (t > 0) load_row(t - 1);
    float dq = 0.f, x[1][kRecurCols];
    const float bk = bt * kd, sq = scale * qd;
#pragma unroll
    for (int c = 0; c < kRecurCols; ++c) {
      const float dout = s.dout[t][c];
      dS[c] = fmaf(sq, dout, dS[c]);                    // o_t = scale S_t^T q_t
      dq = fmaf(fmaf(bk, s.u[t][c], St[c]), dout, dq);  // (S_t row d) . do_t, S_t = S~ + beta k u^T
      x[0][c] = kd * dS[c];
    }
    dev::column_sums<K, 1>(s, x);  // s.tot[0] = k^T dS_t
    float dk = 0.f, dg = 0.f;
#pragma unroll
    for (int c = 0; c < kRecurCols; ++c) {
      const float du = bt * s.tot[0][c], uc = s.u[t][c];
      dk = fmaf(bt * dS[c], uc, dk);  // from S_t = S~ + beta k u^T
      dk = fmaf(-St[c], du, dk);      // from u = v - S~^T k
      const float dSt = fmaf(-kd, du, dS[c]);
      dg = fmaf(dSt, St[c], dg);      // S~ = exp(gate) . S_{t-1}
      dS[c] = a * dSt;
    }
    out.dq[t * K + d] = scale * dq;
    out.dk[t * K + d] = dk;
    out.dgate[t * K + d] = dg;
    if (d < kRecurCols) store_any(p.dv, p.dtype, ((seq.bos + t) * HV + hv) * p.V + c0 + d, bt * s.tot[0][d]);
    if (d == 0) {
      float db = 0.f;
      for (int c = 0; c < kRecurCols; ++c) db = fmaf(s.u[t][c], s.tot[0][c], db);
      out.dbeta[t] = db;
    }
  }
  if (p.dh0) dev::store_state_row<K>(p, p.dh0, n, hv, d, c0, dS);
}

// Grid (HV, N), K threads: the slices' shares added in slice order (thread d: column d of every
// token), dq^ / dk^ to dqhat / dkhat (kda_bwd_group_sum: the group's sum and the l2norm backward),
// the gate backward (dg w.r.t. the raw g) with this sequence's partials of ddt_bias / dA_log, and
// dbeta through beta's sigmoid.
template <int K>
__global__ void __launch_bounds__(K) kda_recur_bwd_finish_kernel(const KdaBwdParams p) {
  __shared__ float pa_warp[K / 32];
  const int hv = blockIdx.x, n = blockIdx.y, d = threadIdx.x;
  const int HV = p.HV, slices = p.V / kRecurCols;
  const dev::SeqInfo seq = dev::seq_info(p, n);
  const int len = seq.len;
  const GateMode mode = p.opt.gate_mode;
  const float a_exp = dev::gate_a_exp(p, hv);
  float pb = 0.f, pa = 0.f;
  for (int t = 0; t < len; ++t) {
    float dq = 0.f, dk = 0.f, dgate = 0.f;
    for (int sl = 0; sl < slices; ++sl) {
      const RecurSlice in = recur_slice<K>(p, n, hv, sl);
      dq += in.dq[t * K + d];
      dk += in.dk[t * K + d];
      dgate += in.dgate[t * K + d];
    }
    const int64_t i = ((seq.bos + t) * HV + hv) * K + d;
    p.dqhat[i] = dq;
    p.dkhat[i] = dk;
    if (mode != GateMode::kPrecomputed) {
      float ddx, ddA;
      dev::gate_derivatives(mode, dev::gate_input(p, seq.bos + t, hv, d), a_exp, p.opt.lower_bound, ddx, ddA);
      pa = fmaf(dgate, ddA, pa);
      dgate *= ddx;
      pb += dgate;
    }
    store_any(p.dg, p.g_dtype, i, dgate);
  }
  if (d < len) {
    float db = 0.f;
    for (int sl = 0; sl < slices; ++sl) db += recur_slice<K>(p, n, hv, sl).dbeta[d];
    const int64_t bi = (seq.bos + d) * HV + hv;
    if (p.opt.beta_sigmoid_scale != 0.f)
      db *= p.opt.beta_sigmoid_scale * dev::sigmoid_slope(load_any(p.beta, p.beta_dtype, bi));
    store_any(p.dbeta, p.beta_dtype, bi, db);
  }
  if (p.pbias && len > 0) {  // one chunk per sequence: its partials' row is the sequence's chunk
    p.pbias[(static_cast<int64_t>(seq.chunk0) * HV + hv) * K + d] = pb;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) pa += __shfl_xor_sync(0xffffffffu, pa, o);
    if ((d & 31) == 0) pa_warp[d >> 5] = pa;
    __syncthreads();
    if (d == 0) {
      float acc = 0.f;
      for (int w = 0; w < K / 32; ++w) acc += pa_warp[w];
      p.pA[static_cast<int64_t>(seq.chunk0) * HV + hv] = acc;
    }
  }
}

template <int K>
inline LaunchShape recur_bwd_launch(const KdaBwdParams& p) {
  return {dim3(static_cast<unsigned>(p.V / kRecurCols), static_cast<unsigned>(p.HV), static_cast<unsigned>(p.N)), K,
          sizeof(RecurBwdSmem<K>)};
}
template <int K>
inline LaunchShape recur_bwd_finish_launch(const KdaBwdParams& p) {
  return {dim3(static_cast<unsigned>(p.HV), static_cast<unsigned>(p.N)), K, 0};
}
// Both passes in order, through launch(kernel, shape): the GPU launcher and the emulator call this.
template <int K, typename Launch>
void for_each_recur_bwd_pass(const KdaBwdParams& p, Launch&& launch) {
  launch(kda_recur_bwd_kernel<K>, recur_bwd_launch<K>(p));
  launch(kda_recur_bwd_finish_kernel<K>, recur_bwd_finish_launch<K>(p));
}

}  // namespace kernel_fun::kda
