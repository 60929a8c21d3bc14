// Forward causal conv1d: y = act(conv(x~) + bias) + residual, and the final state.
//
// Grid (dtiles, rows + state_rows): CTA (i, j < rows) owns channels [i*TX*8, (i+1)*TX*8) and TY
// token chunks; each thread streams its chunk's x (and residual) rows through a private cp.async
// ring (kStages-1 rows in flight) and slides a W-1 row halo in registers, so x is read once plus
// W-1 rows per chunk. CTAs j >= rows write final_state (x~ at the last W positions of each
// sequence), so one launch does the whole forward.
#include "cconv/cconv.h"
#include "cconv/cconv_device.cuh"
#include "cconv/cconv_dispatch.h"
#include "cconv/cconv_plan.h"

namespace kernel_fun::cconv {
namespace {

using namespace dev;

// Tuning constants (compile-time; -D overrides exist only for the standalone tuning harness).
#ifndef KF_CCONV_FWD_CHANNELS
#define KF_CCONV_FWD_CHANNELS 8
#endif
#ifndef KF_CCONV_FWD_STAGES
#define KF_CCONV_FWD_STAGES 8
#endif
#ifndef KF_CCONV_FWD_UNROLL
#define KF_CCONV_FWD_UNROLL 4
#endif
constexpr int kC = KF_CCONV_FWD_CHANNELS;  // channels per thread: 8 = one 16-byte bf16/fp16 access
constexpr int kUnroll = KF_CCONV_FWD_UNROLL;  // steps per unrolled group (halo stays in registers)

// kFlags (a kernel template argument): 0 = activation and residual decided at run time (one
// kernel for all). KF_CCONV_STATIC_FLAGS=1 (the default) launches vector kernels specialised on
// them: bit 0 set = static, bit 1 = silu, bit 2 = residual (no branches per row). The forward is
// memory-bound either way (measured neutral on the H200); the backward gains (below).
#ifndef KF_CCONV_STATIC_FLAGS
#define KF_CCONV_STATIC_FLAGS 1
#endif
[[maybe_unused]] constexpr int kStatic = 1, kSiluBit = 2, kResBit = 4;

// Ring stages: (stages - 1) rows in flight per thread; fp32 rows are twice as wide, so half as many.
template <typename T>
constexpr int stages() { return sizeof(T) == 2 ? KF_CCONV_FWD_STAGES : KF_CCONV_FWD_STAGES / 2; }

struct FwdGrid {
  int tx;
  int64_t rows;     // CTAs along the token walk; blockIdx.y >= rows writes final_state
  int64_t chunk;    // tokens per thread
};

// Thread's view of its channels.
struct Lane {
  int64_t d0;
  int nvalid;
};

// One thread, one segment [s, e) of sequence n (starting at bos), channels ln.d0 + [0, kC).
template <typename T, int W, bool kVec, int kFlags>
__device__ __forceinline__ void fwd_segment(const FwdParams& p, const Lane& ln, char* smem, int64_t n,
                                            int64_t bos, int64_t s, int64_t e, const float (&w)[W][kC],
                                            const float (&b)[kC]) {
  constexpr int S = stages<T>();
  constexpr int H = W > 1 ? W - 1 : 1;  // halo rows held in registers
  const Ring<T, kC, S, 2, /*kStream=*/true> ring(smem, threadIdx.x);
  const bool has_res = kFlags ? (kFlags & kResBit) != 0 : p.residual.ptr != nullptr;
  const bool silu_on = kFlags ? (kFlags & kSiluBit) != 0 : p.act == Activation::kSilu;

  // Stream rows [ps, e): the first nhalo are halo inside the sequence; positions before the
  // sequence start come from initial_state (or are zero) and seed the register halo.
  // A segment is within one chunk (< 2^31 tokens), so row numbers are ints.
  const int64_t ps = s - (W - 1) > bos ? s - (W - 1) : bos;
  const int nrows = static_cast<int>(e - ps), nhalo = static_cast<int>(s - ps);
  float xw[H][kC];
#pragma unroll
  for (int k = 0; k < H; ++k) {
    const int64_t rel = ps - (W - 1) + k - bos;  // position relative to the sequence start
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      float v = 0.f;
      if (W > 1 && rel < 0 && p.h0.ptr != nullptr && c < ln.nvalid)
        v = load_any(p.h0.ptr, p.h0.dtype, n * p.h0.s0 + (ln.d0 + c) * p.h0.s1 + (W + rel) * p.h0.s2);
      xw[k][c] = v;
    }
  }

  const T* xg = static_cast<const T*>(p.x.ptr) + token_offset(p.seq, p.x, n, ps) + ln.d0 * p.x.s2;
  const int64_t roff = has_res ? token_offset(p.seq, p.residual, n, ps) + ln.d0 * p.residual.s2 : 0;
  const T* rg = static_cast<const T*>(p.residual.ptr) + roff;  // used on the vector path only
  T* yg = static_cast<T*>(p.y) + ps * p.D + ln.d0;
  const bool yvec = kVec && ln.nvalid == kC;

  auto issue = [&](int r) {  // row r into the ring (one commit group per row, even if empty)
    if (r < nrows) {
      ring.issue(r, 0, xg + r * p.x.s1);
      if (has_res && r >= nhalo) ring.issue(r, 1, rg + r * p.residual.s1);
      if (KF_CCONV_PREFETCH > 0 && r + KF_CCONV_PREFETCH < nrows) {
        prefetch_l2(xg + (r + KF_CCONV_PREFETCH) * p.x.s1);
        if (has_res) prefetch_l2(rg + (r + KF_CCONV_PREFETCH) * p.residual.s1);
      }
    }
    cp_async_commit();
  };
  if constexpr (kVec) {
#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue(j);
  }

  auto step = [&](int r, bool out_row) {
    float xv[kC];
    if constexpr (kVec) {
      issue(r + S - 1);
      cp_async_wait<S - 1>();
      ring.read(r, 0, xv);
    } else {
      load_row_scalar<T, kC>(xg + r * p.x.s1, p.x.s2, ln.nvalid, xv);
    }
    if (out_row) {
      float out[kC];
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        float acc = b[c];
#pragma unroll
        for (int k = 0; k < W - 1; ++k) acc = fmaf(w[k][c], xw[k][c], acc);
        acc = fmaf(w[W - 1][c], xv[c], acc);
        out[c] = silu_on ? silu(acc) : acc;
      }
      if (has_res) {
        float rv[kC];
        if constexpr (kVec) {
          ring.read(r, 1, rv);
        } else {
#pragma unroll
          for (int c = 0; c < kC; ++c)
            rv[c] = c < ln.nvalid ? load_any(p.residual.ptr, p.residual.dtype,
                                             roff + r * p.residual.s1 + c * p.residual.s2)
                                  : 0.f;
        }
#pragma unroll
        for (int c = 0; c < kC; ++c) out[c] += rv[c];
      }
      store_row<T, kC, /*kStream=*/true>(yg + static_cast<int64_t>(r) * p.D, yvec, ln.nvalid, out);
    }
#pragma unroll
    for (int c = 0; c < kC; ++c) {
#pragma unroll
      for (int k = 0; k + 1 < W - 1; ++k) xw[k][c] = xw[k + 1][c];
      if (W > 1) xw[H - 1][c] = xv[c];
    }
  };

  // Unrolling by kUnroll lets the halo rotation live in renamed registers within a group.
  int r = 0;
#pragma unroll 1
  for (; r < nhalo; ++r) step(r, false);
#pragma unroll 1
  for (; r + kUnroll <= nrows; r += kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) step(r + u, true);
  }
#pragma unroll 1
  for (; r < nrows; ++r) step(r, true);
}

// final_state[n, d, w] = x~[len_n - W + w], in x's dtype.
template <typename T, int W>
__device__ void fwd_final_state(const FwdParams& p, const Lane& ln, int64_t first_n, int64_t stride_n) {
  for (int64_t n = first_n; n < p.seq.num_seqs; n += stride_n) {
    const int64_t bos = seq_begin(p.seq, n), eos = seq_end(p.seq, n);
    const int64_t len = eos - bos;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const int64_t rel = len - W + k;
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        if (c >= ln.nvalid) continue;
        const int64_t d = ln.d0 + c;
        float v = 0.f;
        if (rel >= 0) {
          v = to_f(static_cast<const T*>(p.x.ptr)[token_offset(p.seq, p.x, n, bos + rel) + d * p.x.s2]);
        } else if (p.h0.ptr != nullptr) {
          v = load_any(p.h0.ptr, p.h0.dtype, n * p.h0.s0 + d * p.h0.s1 + (W + rel) * p.h0.s2);
        }
        static_cast<T*>(p.ht)[(n * p.D + d) * W + k] = from_f<T>(v);
      }
    }
  }
}

// kVec: every streamed row is kCopy-aligned with contiguous channels (cp.async ring); else
// strided scalar loads. Separate kernels so the slow path costs the fast one no registers.
template <typename T, int W, bool kVec, int kFlags = 0>
__global__ void __launch_bounds__(kThreads) cconv_fwd_kernel(const FwdParams p, const FwdGrid g) {
  extern __shared__ __align__(16) char smem[];
  const int tx = threadIdx.x % g.tx, ty = threadIdx.x / g.tx;
  const int TY = kThreads / g.tx;
  Lane ln;
  ln.d0 = (static_cast<int64_t>(blockIdx.x) * g.tx + tx) * kC;
  ln.nvalid = p.D - ln.d0 < kC ? static_cast<int>(p.D - ln.d0) : kC;
  if (ln.nvalid <= 0) return;

  if (blockIdx.y >= g.rows) {
    fwd_final_state<T, W>(p, ln, (blockIdx.y - g.rows) * TY + ty, (gridDim.y - g.rows) * TY);
    return;
  }

  float w[W][kC], b[kC];
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const bool ok = c < ln.nvalid;
#pragma unroll
    for (int k = 0; k < W; ++k)
      w[k][c] = ok ? load_any(p.weight.ptr, p.weight.dtype, (ln.d0 + c) * p.weight.s0 + k * p.weight.s1) : 0.f;
    b[c] = ok && p.bias.ptr ? load_any(p.bias.ptr, p.bias.dtype, (ln.d0 + c) * p.bias.s0) : 0.f;
  }

  // Chunks row*TY + ty, then + rows*TY, ...: one pass with the default plan (chunk covers it all).
  for (int64_t ci = static_cast<int64_t>(blockIdx.y) * TY + ty; ci * g.chunk < p.seq.total; ci += g.rows * TY) {
    const int64_t c0 = ci * g.chunk;
    const int64_t c1 = c0 + g.chunk < p.seq.total ? c0 + g.chunk : p.seq.total;
    int64_t s = c0;
    while (s < c1) {
      const int64_t n = seq_of(p.seq, s);
      const int64_t bos = seq_begin(p.seq, n), eos = seq_end(p.seq, n);
      const int64_t e = eos < c1 ? eos : c1;
      if (e <= s) break;  // only a malformed cu_seqlens gets here
      fwd_segment<T, W, kVec, kFlags>(p, ln, smem, n, bos, s, e, w, b);
      s = e;
    }
    if (KF_CCONV_CHUNK == 0) break;  // the default plan's chunk covers everything: no loop
  }
}

using FwdKernel = void (*)(const FwdParams, const FwdGrid);

// The vector kernel for this activation / residual combination (one kernel unless static flags).
template <typename T, int W>
FwdKernel vec_kernel(bool silu_on, bool has_res) {
#if KF_CCONV_STATIC_FLAGS
  if (silu_on)
    return has_res ? cconv_fwd_kernel<T, W, true, kStatic | kSiluBit | kResBit> : cconv_fwd_kernel<T, W, true, kStatic | kSiluBit>;
  return has_res ? cconv_fwd_kernel<T, W, true, kStatic | kResBit> : cconv_fwd_kernel<T, W, true, kStatic>;
#else
  (void)silu_on;
  (void)has_res;
  return cconv_fwd_kernel<T, W, true>;
#endif
}

template <typename T, int W>
void launch_typed(const FwdParams& p, cudaStream_t stream) {
  // Ring for x, and for the residual only when there is one (stream 1 is the ring's back half).
  constexpr size_t smem_x = static_cast<size_t>(stages<T>()) * Row<T, kC>::kBytes * kThreads;
  const bool has_res = p.residual.ptr != nullptr, silu_on = p.act == Activation::kSilu;
  const size_t smem = has_res ? 2 * smem_x : smem_x;
  const FwdKernel vk = vec_kernel<T, W>(silu_on, has_res);
  const int slot = (silu_on ? 2 : 0) + (has_res ? 1 : 0);
  static int blocks_per_sm[4] = {0, 0, 0, 0};  // pure functions of the kernel and smem: computed once
  if (blocks_per_sm[slot] == 0) {
    if (2 * smem_x > 48 * 1024) {  // deep rings (tuning) need the opt-in above 48 KB
      KF_CUDA_CHECK(cudaFuncSetAttribute(vk, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(2 * smem_x)));
      KF_CUDA_CHECK(cudaFuncSetAttribute(cconv_fwd_kernel<T, W, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(2 * smem_x)));
    }
    int nb = 0;
    KF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, vk, kThreads, smem));
    blocks_per_sm[slot] = nb > 0 ? nb : 1;
  }
  const Plan plan = make_plan(p.seq.total, p.D, kC, kThreads, blocks_per_sm[slot]);
  FwdGrid g;
  g.tx = plan.tx;
  g.rows = p.seq.total > 0 ? plan.rows : 0;
  g.chunk = plan.chunk;
  // Vector rows need whole channel groups (no access past D) and aligned rows everywhere.
  constexpr int A = Row<T, kC>::kCopy;
  bool vec = p.D % kC == 0 && rows_aligned(p.x, p.B, sizeof(T), A) && reinterpret_cast<uintptr_t>(p.y) % A == 0;
  if (p.residual.ptr)
    vec = vec && p.residual.dtype == DTypeOf<T>::value && rows_aligned(p.residual, p.B, sizeof(T), A);
  const int64_t ty = kThreads / plan.tx;
  int64_t state_rows = 0;
  if (p.ht) state_rows = std::min<int64_t>((p.seq.num_seqs + ty - 1) / ty, 4096);
  const int64_t gy = g.rows + state_rows;
  if (gy == 0 || p.D == 0) return;
  const dim3 grid(static_cast<unsigned>(plan.dtiles), static_cast<unsigned>(gy));
  if (vec) vk<<<grid, kThreads, smem, stream>>>(p, g);
  else cconv_fwd_kernel<T, W, false><<<grid, kThreads, smem, stream>>>(p, g);
  KF_CHECK_LAUNCH();
}

}  // namespace

void launch_fwd(const FwdParams& p, cudaStream_t stream) {
  dispatch_x_w(p.x.dtype, p.W, [&](auto t, auto w) {
    launch_typed<typename decltype(t)::type, decltype(w)::value>(p, stream);
  });
}

}  // namespace kernel_fun::cconv
