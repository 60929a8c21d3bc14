// KDA (Kimi Delta Attention) forward on sm_90a: torch-free parameters and launchers.
//
// Two kernels (docs/kda-forward.md has the stage table, the workspace layout and the smem plan):
//   kda_fwd_intra  one CTA per (chunk of 64 tokens, value head): gate + chunk-local cumsum (base 2),
//                  q/k l2norm, beta sigmoid, Aqk, Akk = (I + L)^-1 diag(beta), w, qg, kg, exp2(G).
//   kda_fwd_scan   one CTA per (V-slice, value head, sequence): the serial chunk recurrence with the
//                  state h [K, BV] in fp32 registers (transposed: each warp owns 16 value columns);
//                  u = Akk v, v' = u - w h, o = qg h + Aqk v', h <- exp2(G) h + kg^T v'.
// A third, tiny kernel builds the varlen chunk map (chunk offsets per sequence) on the device, so no
// call ever synchronises with the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_check.h"

namespace kernel_fun::kda {

constexpr int kChunk = 64;  // BT: tokens per chunk (fla's default chunk_size)

// How the per-step log-decay is obtained from g (fla-contract.md, "Gate").
enum class GateMode : int {
  kPrecomputed = 0,      // g is already the natural-log gate (<= 0)
  kUnbounded = 1,        // -exp(A_log[h]) * softplus(g + dt_bias[h, :])
  kBounded = 2,          // lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, :]))
  kBoundedNoALog = 3,    // lower_bound * sigmoid(g + dt_bias[h, :])
};

struct KdaFwdParams {
  // ---- inputs (all contiguous; q/k [B,T,H,K], v [B,T,HV,V], g [B,T,HV,K], beta [B,T,HV]) ----
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* g = nullptr;
  const void* beta = nullptr;
  const float* A_log = nullptr;    // [HV] fp32 (converted by the caller), or null
  const float* dt_bias = nullptr;  // [HV*K] fp32, or null
  const float* h0 = nullptr;       // [N,HV,K,V] ([N,HV,V,K] if state_v_first) fp32, or null
  const void* cu_seqlens = nullptr;  // [N+1] int32 or int64, or null (fixed length)
  bool cu_int64 = false;

  // ---- outputs ----
  void* o = nullptr;         // [B,T,HV,V], dtype of q
  float* ht = nullptr;       // final state, layout of h0, or null
  void* h_states = nullptr;  // [total chunks, HV, K, V] ([.., V, K] if state_v_first), dtype of q, or null

  // ---- workspace (dtype WT = the input dtype; token-indexed rows, so sequences never mix) ----
  void* w = nullptr;         // [B*T, HV, K]   Akk @ (exp2(g2) * k)
  void* qg = nullptr;        // [B*T, HV, K]   scale * q * exp2(g2)
  void* kg = nullptr;        // [B*T, HV, K]   k * exp2(G - g2)
  void* Aqk = nullptr;       // [B*T, HV, 64]  scale * q_i k_j exp2(g2_i - g2_j), j <= i (row i's chunk)
  void* Akk = nullptr;       // [B*T, HV, 64]  (I + L)^-1 diag(beta)
  float* gdecay = nullptr;   // [max_chunks, HV, K]  exp2(G) per chunk (G = g2 of its last valid row)
  int* chunk_offsets = nullptr;  // [N+1] first global chunk of each sequence (varlen only)

  // ---- sizes ----
  int B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  int N = 0;           // sequences: B, or len(cu_seqlens) - 1
  int max_chunks = 0;  // grid bound of the intra kernel: B*ceil(T/64), or T/64 + N with varlen

  // ---- options ----
  float scale = 1.f;
  GateMode gate_mode = GateMode::kPrecomputed;
  float lower_bound = 0.f;
  bool l2norm = false;
  float beta_sigmoid_scale = 0.f;  // 0: beta used as given; 1 or 2: beta = s * sigmoid(beta)
  bool state_v_first = false;

  DType dtype = DType::kBFloat16;       // q, k, v, o and the workspace
  DType g_dtype = DType::kFloat32;
  DType beta_dtype = DType::kFloat32;
};

// Launchers: enqueue on `stream`, throw std::runtime_error on launch failure.
void kda_fwd_chunk_map(const KdaFwdParams& p, cudaStream_t stream);  // varlen only
void kda_fwd_intra(const KdaFwdParams& p, cudaStream_t stream);
void kda_fwd_scan(const KdaFwdParams& p, cudaStream_t stream);

// The V-slice width the scan uses for this problem (64 or 128): wider slices re-read the shared
// per-chunk tiles fewer times; narrower ones give more CTAs when B*HV is small.
int kda_fwd_scan_bv(const KdaFwdParams& p);

}  // namespace kernel_fun::kda
