// Short causal depthwise conv1d (fla's causal_conv1d): torch-free parameters and launchers.
//
//   y[i, d] = act(sum_{w<W} weight[d, w] * x~[i - W + 1 + w, d] + bias[d]) + residual[i, d]
//
// Tokens live in one flat index space [0, total): with cu_seqlens (B == 1) sequence n owns
// [cu[n], cu[n+1]); without, sequence n is batch row n and owns [n*T, (n+1)*T). x~ is x inside the
// sequence; at a position pos < 0 (relative to the sequence start) it reads
// initial_state[n, d, W + pos] (slot 0 is only reached by an empty sequence's final state), or 0
// without an initial state. final_state[n, d, w] = x~[len_n - W + w].
//
// Every reduction is in fp32 and in a fixed order: results are bitwise reproducible.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_check.h"

namespace kernel_fun::cconv {

constexpr int kMaxWidth = 4;  // W in 1..4: the taps live in registers

enum class Activation : int { kNone = 0, kSilu = 1 };

// A [rows, T, D]-like view: element (r, t, d) at ptr + r*s0 + t*s1 + d*s2 (strides in elements).
struct View3 {
  const void* ptr = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  DType dtype = DType::kFloat32;
};

// How the flat token index maps onto sequences (see the header comment).
struct Sequences {
  const void* cu_seqlens = nullptr;  // device, N+1 entries; null: fixed-length rows of T
  bool cu_int64 = false;
  int64_t num_seqs = 0;      // N
  int64_t seq_len = 0;       // T (also the per-row length when cu_seqlens is set: B == 1)
  int64_t total = 0;         // number of tokens = B*T
};

struct FwdParams {
  View3 x;                   // [B, T, D]; dtype bf16, fp16 or fp32 (the kernel's template type)
  void* y = nullptr;         // [B*T, D] contiguous, x's dtype
  View3 weight;              // [D, W] (s0 = d stride, s1 = w stride), any float dtype
  View3 bias;                // [D] (s0), optional (ptr null)
  View3 residual;            // [B, T, D], optional, any float dtype
  View3 h0;                  // initial_state [N, D, W], optional, any float dtype
  void* ht = nullptr;        // final_state [N, D, W] contiguous, x's dtype; optional
  Sequences seq;
  int64_t B = 0, D = 0;
  int W = 0;
  Activation act = Activation::kNone;
};

struct BwdParams {
  View3 x;                   // as in FwdParams
  View3 weight, bias, h0;    // bias only tells whether db is wanted; h0 optional
  View3 dy;                  // [B, T, D], x's dtype, any strides
  View3 dht;                 // d final_state [N, D, W], x's dtype, optional
  void* dx = nullptr;        // [B*T, D] contiguous, x's dtype
  void* dw = nullptr;        // [D, W] contiguous, weight's dtype
  void* db = nullptr;        // [D] contiguous, bias's dtype; optional
  void* dh0 = nullptr;       // [N, D, W] contiguous, initial_state's dtype; optional
  DType dw_dtype = DType::kFloat32, db_dtype = DType::kFloat32, dh0_dtype = DType::kFloat32;
  float* workspace = nullptr;  // bwd_workspace_floats(...) fp32 for the dw/db partials
  Sequences seq;
  int64_t B = 0, D = 0;
  int W = 0;
  Activation act = Activation::kNone;
};

// One decode step: cache [N, D, W] shifts left by one slot (in place), x enters slot W-1, and
// y = act(sum_w weight[d, w] * cache'[n, d, w] + bias[d]) + residual[n, d].
struct UpdateParams {
  View3 x;                   // [N, D] as (s0 = n stride, s2 = d stride)
  void* y = nullptr;         // [N, D] contiguous, x's dtype
  View3 cache;               // [N, D, W] (s0, s1, s2), updated in place
  View3 weight, bias;        // [D, W], [D] (optional)
  View3 residual;            // [N, D] (s0, s2), optional
  int64_t N = 0, D = 0;
  int W = 0;
  Activation act = Activation::kNone;
};

// Forward: one launch (final_state, if asked, is written by extra CTAs of the same grid).
void launch_fwd(const FwdParams& p, cudaStream_t stream);

// Backward: a fused dx/dw/db-partials kernel, then one kernel that reduces the partials in a
// fixed order and computes d initial_state. The fp32 workspace holds the partials.
int64_t bwd_workspace_floats(int64_t total_tokens, int64_t D, int W, bool has_bias, DType x_dtype);
void launch_bwd(const BwdParams& p, cudaStream_t stream);

void launch_update(const UpdateParams& p, cudaStream_t stream);

}  // namespace kernel_fun::cconv
