// Backward causal conv1d, two launches:
//
// 1. cconv_bwd_kernel (fused): each thread streams its chunk's x and dy rows through a private
//    cp.async ring, recomputes the pre-activation in registers (no forward re-run through HBM),
//    forms g = dy * act'(pre), and writes
//        dx[i] = sum_k weight[k] * g[i + W-1-k]  (+ d final_state where i is one of the last W)
//    as soon as g[i + W-1] is known. It accumulates dw[k] += g[i] * x~[i-W+1+k] and db += g[i]
//    for the tokens it owns, reduces them over the CTA in a fixed order and stores one fp32
//    partial per CTA row: workspace [rows, D, W] then [rows, D].
// 2. cconv_bwd_finish_kernel: sums the partials over rows in a fixed order (dw, db in the
//    parameters' dtypes) and computes d initial_state, which needs g at the first W-1 tokens of
//    each sequence only (recomputed from x, initial_state and dy: a few rows per sequence).
// No atomics anywhere: dx, dw, db and d initial_state are bitwise reproducible.
#include "cconv/cconv.h"
#include "cconv/cconv_device.cuh"
#include "cconv/cconv_dispatch.h"
#include "cconv/cconv_plan.h"

#include <type_traits>

namespace kernel_fun::cconv {
namespace {

using namespace dev;

// Tuning constants (compile-time; -D overrides exist only for the standalone tuning harness).
#ifndef KF_CCONV_BWD_CHANNELS
#define KF_CCONV_BWD_CHANNELS 4
#endif
#ifndef KF_CCONV_BWD_STAGES
#define KF_CCONV_BWD_STAGES 8
#endif
#ifndef KF_CCONV_BWD_UNROLL
#define KF_CCONV_BWD_UNROLL 4
#endif
// Channels per thread: 4 keeps the ~30 live fp32 values per channel (taps, x~ and g halos, dw
// and db partials) within ~120 registers, so 4 CTAs fit per SM.
constexpr int kC = KF_CCONV_BWD_CHANNELS;
constexpr int kUnroll = KF_CCONV_BWD_UNROLL;  // steps per unrolled group (halos stay in registers)

// kFlags (a kernel template argument): 0 = activation decided at run time. KF_CCONV_STATIC_FLAGS=1
// (the default) launches vector kernels specialised on it: bit 0 = static, bit 1 = silu. Measured
// on the H200 (B16 T8192 D2048 bf16 W4 silu): backward 0.465 ms specialised vs 0.531 ms with the
// run-time branch per row. The plan (and so the workspace) always comes from the kFlags = 0
// kernel's occupancy.
#ifndef KF_CCONV_STATIC_FLAGS
#define KF_CCONV_STATIC_FLAGS 1
#endif
[[maybe_unused]] constexpr int kStatic = 1, kSiluBit = 2;

template <typename T>
constexpr int stages() { return KF_CCONV_BWD_STAGES; }  // (stages - 1) rows in flight per thread

struct BwdGrid {
  int tx;
  int64_t rows;
  int64_t chunk;
};

struct Lane {
  int64_t d0;
  int nvalid;
};

template <int W>
struct Grads {
  float dw[W][kC];
  float db[kC];
};

template <int K>
using Kind = std::integral_constant<int, K>;
constexpr int kHalo = 0, kMain = 1, kTail = 2;  // step kinds of the walk, see bwd_segment

// One thread, one segment [s, e) of sequence n ([bos, eos)), channels ln.d0 + [0, kC).
template <typename T, int W, bool kVec, int kFlags>
__device__ __forceinline__ void bwd_segment(const BwdParams& p, const Lane& ln, char* smem, int64_t n,
                                            int64_t bos, int64_t eos, int64_t s, int64_t e,
                                            const float (&w)[W][kC], const float (&b)[kC], Grads<W>& acc) {
  constexpr int S = stages<T>();
  constexpr int H = W > 1 ? W - 1 : 1;
  const Ring<T, kC, S, 2> ring(smem, threadIdx.x);
  const bool silu_on = kFlags ? (kFlags & kSiluBit) != 0 : p.act == Activation::kSilu;

  // Steps r = 0, 1, ... walk positions ps + r. Rows [0, nload) are loaded (dy only from nhalo
  // on); steps run to nsteps = e + W - 1 - ps, with g = 0 past the sequence end, so every dx of
  // [s, e) is emitted (dx at q needs g up to q + W - 1). A segment is within one chunk (< 2^31).
  const int64_t ps = s - (W - 1) > bos ? s - (W - 1) : bos;
  const int64_t tend = e + (W - 1) < eos ? e + (W - 1) : eos;
  const int nload = static_cast<int>(tend - ps), nsteps = static_cast<int>(e + (W - 1) - ps);
  const int nhalo = static_cast<int>(s - ps), nown = static_cast<int>(e - ps);
  const int64_t dht_from = eos - W;  // dx of tokens >= this one also gets d final_state
  const bool has_dht = p.dht.ptr != nullptr;
  // Halo steps [0, nhalo), main steps [nhalo, main_end) (loaded, owned, no d final_state), then
  // the general tail (at most 2W - 1 steps).
  int main_end = nown;
  if (has_dht) {
    const int first_dht_step = static_cast<int>(dht_from - ps) + (W - 1);
    main_end = min(main_end, max(nhalo, first_dht_step));
  }

  float xw[H][kC], gw[H][kC];  // x~ and g at the W-1 positions before the current step
#pragma unroll
  for (int k = 0; k < H; ++k) {
    const int64_t rel = ps - (W - 1) + k - bos;
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      float v = 0.f;
      if (W > 1 && rel < 0 && p.h0.ptr != nullptr && c < ln.nvalid)
        v = load_any(p.h0.ptr, p.h0.dtype, n * p.h0.s0 + (ln.d0 + c) * p.h0.s1 + (W + rel) * p.h0.s2);
      xw[k][c] = v;
      gw[k][c] = 0.f;
    }
  }

  const T* xg = static_cast<const T*>(p.x.ptr) + token_offset(p.seq, p.x, n, ps) + ln.d0 * p.x.s2;
  const T* dyg = static_cast<const T*>(p.dy.ptr) + token_offset(p.seq, p.dy, n, ps) + ln.d0 * p.dy.s2;
  T* dxg = static_cast<T*>(p.dx) + ps * p.D + ln.d0;
  const bool dxvec = kVec && ln.nvalid == kC;

  auto issue = [&](int r) {  // row r into the ring (one commit group per row, even if empty)
    if (r < nload) {
      ring.issue(r, 0, xg + r * p.x.s1);
      if (r >= nhalo) ring.issue(r, 1, dyg + r * p.dy.s1);
      if (KF_CCONV_PREFETCH > 0 && r + KF_CCONV_PREFETCH < nload) {
        prefetch_l2(xg + (r + KF_CCONV_PREFETCH) * p.x.s1);
        prefetch_l2(dyg + (r + KF_CCONV_PREFETCH) * p.dy.s1);
      }
    }
    cp_async_commit();
  };
  if constexpr (kVec) {
#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue(j);
  }

  auto step = [&](int r, auto kind) {
    constexpr int K = decltype(kind)::value;
    const bool loaded = K != kTail || r < nload;
    float xv[kC], g[kC];
    if constexpr (kVec) {
      issue(r + S - 1);
      if (loaded) {
        cp_async_wait<S - 1>();
        ring.read(r, 0, xv);
      }
    } else {
      if (loaded) load_row_scalar<T, kC>(xg + r * p.x.s1, p.x.s2, ln.nvalid, xv);
    }
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      if (!loaded) xv[c] = 0.f;
      g[c] = 0.f;
    }
    if constexpr (K != kHalo) {
      if (loaded) {
        float dyv[kC];
        if constexpr (kVec) ring.read(r, 1, dyv);
        else load_row_scalar<T, kC>(dyg + r * p.dy.s1, p.dy.s2, ln.nvalid, dyv);
#pragma unroll
        for (int c = 0; c < kC; ++c) {
          if (silu_on) {  // recompute the pre-activation from the register halo
            float pre = b[c];
#pragma unroll
            for (int k = 0; k < W - 1; ++k) pre = fmaf(w[k][c], xw[k][c], pre);
            pre = fmaf(w[W - 1][c], xv[c], pre);
            g[c] = dyv[c] * silu_grad(pre);
          } else {
            g[c] = dyv[c];
          }
        }
      }
      if (K == kMain || r < nown) {
#pragma unroll
        for (int c = 0; c < kC; ++c) {
#pragma unroll
          for (int k = 0; k < W - 1; ++k) acc.dw[k][c] = fmaf(g[c], xw[k][c], acc.dw[k][c]);
          acc.dw[W - 1][c] = fmaf(g[c], xv[c], acc.dw[W - 1][c]);
          acc.db[c] += g[c];
        }
      }
      // dx at q = r - (W-1): sum_k w[k] * g[q + W-1-k]; g[q + W-1] is this step's.
      const int q = r - (W - 1);
      if (q >= nhalo) {
        float dxv[kC];
#pragma unroll
        for (int c = 0; c < kC; ++c) {
          float a = w[0][c] * g[c];
#pragma unroll
          for (int k = 1; k < W; ++k) a = fmaf(w[k][c], gw[H - k][c], a);
          dxv[c] = a;
        }
        if constexpr (K == kTail) {
          const int64_t qpos = ps + q;
          if (has_dht && qpos >= dht_from) {
#pragma unroll
            for (int c = 0; c < kC; ++c)
              if (c < ln.nvalid)
                dxv[c] += load_any(p.dht.ptr, p.dht.dtype,
                                   n * p.dht.s0 + (ln.d0 + c) * p.dht.s1 + (qpos - dht_from) * p.dht.s2);
          }
        }
        store_row<T, kC>(dxg + static_cast<int64_t>(q) * p.D, dxvec, ln.nvalid, dxv);
      }
    }
#pragma unroll
    for (int c = 0; c < kC; ++c) {
#pragma unroll
      for (int k = 0; k + 1 < W - 1; ++k) {
        xw[k][c] = xw[k + 1][c];
        gw[k][c] = gw[k + 1][c];
      }
      if (W > 1) {
        xw[H - 1][c] = xv[c];
        gw[H - 1][c] = g[c];
      }
    }
  };

  // Unrolling by kUnroll lets the halo rotation live in renamed registers within a group.
  int r = 0;
#pragma unroll 1
  for (; r < nhalo; ++r) step(r, Kind<kHalo>{});
#pragma unroll 1
  for (; r + kUnroll <= main_end; r += kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) step(r + u, Kind<kMain>{});
  }
#pragma unroll 1
  for (; r < main_end; ++r) step(r, Kind<kMain>{});
#pragma unroll 1
  for (; r < nsteps; ++r) step(r, Kind<kTail>{});
}

// kVec: every streamed row is kCopy-aligned with contiguous channels (cp.async ring); else
// strided scalar loads. Separate kernels so the slow path costs the fast one no registers.
template <typename T, int W, bool kVec, int kFlags = 0>
__global__ void __launch_bounds__(kThreads) cconv_bwd_kernel(const BwdParams p, const BwdGrid g) {
  extern __shared__ __align__(16) char smem[];
  const int tx = threadIdx.x % g.tx, ty = threadIdx.x / g.tx;
  const int TY = kThreads / g.tx;
  Lane ln;
  ln.d0 = (static_cast<int64_t>(blockIdx.x) * g.tx + tx) * kC;
  ln.nvalid = p.D - ln.d0 < kC ? static_cast<int>(p.D - ln.d0) : kC;

  Grads<W> acc;
#pragma unroll
  for (int c = 0; c < kC; ++c) {
#pragma unroll
    for (int k = 0; k < W; ++k) acc.dw[k][c] = 0.f;
    acc.db[c] = 0.f;
  }

  if (ln.nvalid > 0) {  // no early return: every thread joins the CTA reduction below
    float w[W][kC], b[kC];
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const bool ok = c < ln.nvalid;
#pragma unroll
      for (int k = 0; k < W; ++k)
        w[k][c] = ok ? load_any(p.weight.ptr, p.weight.dtype, (ln.d0 + c) * p.weight.s0 + k * p.weight.s1) : 0.f;
      b[c] = ok && p.bias.ptr ? load_any(p.bias.ptr, p.bias.dtype, (ln.d0 + c) * p.bias.s0) : 0.f;
    }
    // Chunks row*TY + ty, then + rows*TY, ...: one pass with the default plan.
    for (int64_t ci = static_cast<int64_t>(blockIdx.y) * TY + ty; ci * g.chunk < p.seq.total;
         ci += g.rows * TY) {
      const int64_t c0 = ci * g.chunk;
      const int64_t c1 = c0 + g.chunk < p.seq.total ? c0 + g.chunk : p.seq.total;
      int64_t s = c0;
      while (s < c1) {
        const int64_t n = seq_of(p.seq, s);
        const int64_t bos = seq_begin(p.seq, n), eos = seq_end(p.seq, n);
        const int64_t e = eos < c1 ? eos : c1;
        if (e <= s) break;  // only a malformed cu_seqlens gets here
        bwd_segment<T, W, kVec, kFlags>(p, ln, smem, n, bos, eos, s, e, w, b, acc);
        s = e;
      }
      if (KF_CCONV_CHUNK == 0) break;  // the default plan's chunk covers everything: no loop
    }
  }

  // CTA reduction over the TY chunks in a fixed order; the ring's shared memory is reused.
  cp_async_wait_all();
  __syncthreads();
  constexpr int kPer = kC * (W + 1);  // dw taps then db, per channel
  float* red = reinterpret_cast<float*>(smem);  // [TY][TX][kC][W+1]
  {
    float* mine = red + (static_cast<int64_t>(ty) * g.tx + tx) * kPer;
#pragma unroll
    for (int c = 0; c < kC; ++c) {
#pragma unroll
      for (int k = 0; k < W; ++k) mine[c * (W + 1) + k] = acc.dw[k][c];
      mine[c * (W + 1) + W] = acc.db[c];
    }
  }
  __syncthreads();
  const bool has_db = p.bias.ptr != nullptr;
  float* ws_w = p.workspace;                      // [rows, D, W]
  float* ws_b = p.workspace + g.rows * p.D * W;   // [rows, D]
  for (int idx = threadIdx.x; idx < g.tx * kPer; idx += kThreads) {
    const int t = idx / kPer, rem = idx % kPer, c = rem / (W + 1), k = rem % (W + 1);
    const int64_t d = (static_cast<int64_t>(blockIdx.x) * g.tx + t) * kC + c;
    if (d >= p.D || (k == W && !has_db)) continue;
    float sum = 0.f;
    for (int y = 0; y < TY; ++y) sum += red[(static_cast<int64_t>(y) * g.tx + t) * kPer + rem];
    if (k < W) ws_w[(blockIdx.y * p.D + d) * W + k] = sum;
    else ws_b[blockIdx.y * p.D + d] = sum;
  }
}

// Blocks [0, reduce_blocks): dw/db as fixed-order sums of the partials (32 outputs x 8 row
// slices per block, slices combined in order). Blocks after that: d initial_state, one thread per
// (sequence, channel).
constexpr int kFinishCols = 32, kFinishSlices = 8;

template <typename T, int W>
__global__ void __launch_bounds__(kFinishCols * kFinishSlices)
    cconv_bwd_finish_kernel(const BwdParams p, int64_t rows, int64_t reduce_blocks) {
  if (blockIdx.x < reduce_blocks) {
    __shared__ float part[kFinishSlices][kFinishCols];
    const int64_t nw = p.D * W;
    const int64_t total = nw + (p.db ? p.D : 0);
    const int col = threadIdx.x % kFinishCols, slice = threadIdx.x / kFinishCols;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * kFinishCols + col;
    float sum = 0.f;
    if (idx < total) {
      const float* src = idx < nw ? p.workspace + idx : p.workspace + rows * nw + (idx - nw);
      const int64_t stride = idx < nw ? nw : p.D;
      for (int64_t r = slice; r < rows; r += kFinishSlices) sum += src[r * stride];
    }
    part[slice][col] = sum;
    __syncthreads();
    if (slice == 0 && idx < total) {
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < kFinishSlices; ++k) s += part[k][col];
      if (idx < nw) store_any(p.dw, p.dw_dtype, idx, s);
      else store_any(p.db, p.db_dtype, idx - nw, s);
    }
    return;
  }

  // d initial_state[n, d, j] (position j - W before the sequence start) =
  //   sum_{k} weight[d, k] * g[j - 1 - k] over outputs 0 <= j-1-k < len  (j >= 1)
  //   + d final_state[n, d, j - len]                                       (j >= len)
  const int64_t id = (static_cast<int64_t>(blockIdx.x) - reduce_blocks) * blockDim.x + threadIdx.x;
  if (p.dh0 == nullptr || id >= p.seq.num_seqs * p.D) return;
  const int64_t n = id / p.D, d = id % p.D;
  const int64_t bos = seq_begin(p.seq, n), len = seq_end(p.seq, n) - bos;
  float w[W];
#pragma unroll
  for (int k = 0; k < W; ++k) w[k] = load_any(p.weight.ptr, p.weight.dtype, d * p.weight.s0 + k * p.weight.s1);
  const float b = p.bias.ptr ? load_any(p.bias.ptr, p.bias.dtype, d * p.bias.s0) : 0.f;
  // x~ at relative positions -(W-1) .. W-2, g at 0 .. W-2.
  float xt[2 * W - 1], g[W > 1 ? W - 1 : 1];
#pragma unroll
  for (int i = 0; i < 2 * W - 1; ++i) {
    const int64_t rel = i - (W - 1);
    float v = 0.f;
    if (rel < 0) {
      if (p.h0.ptr) v = load_any(p.h0.ptr, p.h0.dtype, n * p.h0.s0 + d * p.h0.s1 + (W + rel) * p.h0.s2);
    } else if (rel < len) {
      v = to_f(static_cast<const T*>(p.x.ptr)[token_offset(p.seq, p.x, n, bos + rel) + d * p.x.s2]);
    }
    xt[i] = v;
  }
#pragma unroll
  for (int t = 0; t < W - 1; ++t) {
    float gv = 0.f;
    if (t < len) {
      gv = to_f(static_cast<const T*>(p.dy.ptr)[token_offset(p.seq, p.dy, n, bos + t) + d * p.dy.s2]);
      if (p.act == Activation::kSilu) {
        float pre = b;
#pragma unroll
        for (int k = 0; k < W; ++k) pre = fmaf(w[k], xt[t + k], pre);  // x~[t - W + 1 + k]
        gv *= silu_grad(pre);
      }
    }
    g[t] = gv;
  }
#pragma unroll
  for (int j = 0; j < W; ++j) {
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const int t = j - 1 - k;
      if (t >= 0 && t < W - 1) v = fmaf(w[k], g[t], v);  // g[t] is 0 for t >= len
    }
    if (p.dht.ptr && j >= len)
      v += load_any(p.dht.ptr, p.dht.dtype, n * p.dht.s0 + d * p.dht.s1 + (j - len) * p.dht.s2);
    store_any(p.dh0, p.dh0_dtype, (n * p.D + d) * W + j, v);
  }
}

template <typename T, int W>
constexpr size_t bwd_smem() {
  constexpr size_t ring = static_cast<size_t>(stages<T>()) * 2 * Row<T, kC>::kBytes * kThreads;
  constexpr size_t red = static_cast<size_t>(kThreads) * kC * (W + 1) * sizeof(float);
  static_assert(red <= ring, "the dw/db reduction reuses the ring's shared memory");
  return ring;
}

template <typename T, int W>
int blocks_per_sm() {
  static int nb = 0;
  if (nb == 0) {
    constexpr size_t smem = bwd_smem<T, W>();
    if (smem > 48 * 1024) {  // deep rings (tuning) need the opt-in above 48 KB
      KF_CUDA_CHECK(cudaFuncSetAttribute(cconv_bwd_kernel<T, W, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
      KF_CUDA_CHECK(cudaFuncSetAttribute(cconv_bwd_kernel<T, W, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
    }
    int v = 0;
    KF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, cconv_bwd_kernel<T, W, true>, kThreads, smem));
    nb = v > 0 ? v : 1;
  }
  return nb;
}

template <typename T, int W>
Plan bwd_plan(int64_t total, int64_t D) {
  return make_plan(total, D, kC, kThreads, blocks_per_sm<T, W>());
}

template <typename T, int W>
void launch_typed(const BwdParams& p, cudaStream_t stream) {
  const Plan plan = bwd_plan<T, W>(p.seq.total, p.D);  // also does the > 48 KB opt-in, if needed
  if (p.D == 0) return;
  BwdGrid g;
  g.tx = plan.tx;
  g.rows = plan.rows;
  g.chunk = plan.chunk;
  constexpr int A = Row<T, kC>::kCopy;
  const bool vec = p.D % kC == 0 && rows_aligned(p.x, p.B, sizeof(T), A) &&
                   rows_aligned(p.dy, p.B, sizeof(T), A) && reinterpret_cast<uintptr_t>(p.dx) % A == 0;
  const dim3 grid(static_cast<unsigned>(plan.dtiles), static_cast<unsigned>(plan.rows));
#if KF_CCONV_STATIC_FLAGS
  void (*vk)(const BwdParams, const BwdGrid) = p.act == Activation::kSilu ? cconv_bwd_kernel<T, W, true, kStatic | kSiluBit>
                                                                           : cconv_bwd_kernel<T, W, true, kStatic>;
  if (bwd_smem<T, W>() > 48 * 1024)
    KF_CUDA_CHECK(cudaFuncSetAttribute(vk, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bwd_smem<T, W>())));
#else
  void (*vk)(const BwdParams, const BwdGrid) = cconv_bwd_kernel<T, W, true>;
#endif
  if (vec) vk<<<grid, kThreads, bwd_smem<T, W>(), stream>>>(p, g);
  else cconv_bwd_kernel<T, W, false><<<grid, kThreads, bwd_smem<T, W>(), stream>>>(p, g);
  KF_CHECK_LAUNCH();

  const int64_t outs = p.D * W + (p.db ? p.D : 0);
  const int64_t reduce_blocks = (outs + kFinishCols - 1) / kFinishCols;
  constexpr int fthreads = kFinishCols * kFinishSlices;
  const int64_t dh0_blocks = p.dh0 ? (p.seq.num_seqs * p.D + fthreads - 1) / fthreads : 0;
  cconv_bwd_finish_kernel<T, W><<<static_cast<unsigned>(reduce_blocks + dh0_blocks), fthreads, 0, stream>>>(
      p, plan.rows, reduce_blocks);
  KF_CHECK_LAUNCH();
}

}  // namespace

int64_t bwd_workspace_floats(int64_t total_tokens, int64_t D, int W, bool has_bias, DType x_dtype) {
  const Plan plan = dispatch_x_w(x_dtype, W, [&](auto t, auto w) {
    return bwd_plan<typename decltype(t)::type, decltype(w)::value>(total_tokens, D);
  });
  return plan.rows * D * (W + (has_bias ? 1 : 0));
}

void launch_bwd(const BwdParams& p, cudaStream_t stream) {
  dispatch_x_w(p.x.dtype, p.W, [&](auto t, auto w) {
    launch_typed<typename decltype(t)::type, decltype(w)::value>(p, stream);
  });
}

}  // namespace kernel_fun::cconv
