// Device-side pieces shared by the causal conv1d kernels: element conversions, channel row
// loads/stores of a thread's channels, the per-thread cp.async row ring and the token -> sequence lookup.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cconv/cconv.h"
#include "common/dtype_access.cuh"

namespace kernel_fun::cconv::dev {

// Every conv CTA has kThreads threads: TX channel groups x TY token chunks.
#ifndef KF_CCONV_THREADS
#define KF_CCONV_THREADS 128  // -D override (256): tuning harness only, with KF_CCONV_CTA_CHANNELS
#endif
constexpr int kThreads = KF_CCONV_THREADS;

// ---- conversions -------------------------------------------------------------------------------
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::kFloat32; };
template <> struct DTypeOf<__half> { static constexpr DType value = DType::kFloat16; };
template <> struct DTypeOf<__nv_bfloat16> { static constexpr DType value = DType::kBFloat16; };

// ---- rows of C channels ------------------------------------------------------------------------
// A thread's row is C contiguous channels of T, moved as kPieces vector accesses of kCopy bytes
// (8 or 16). Vector forms need kCopy-byte alignment, checked on the host for every row.
template <typename T, int C>
struct Row {
  static constexpr int kBytes = C * static_cast<int>(sizeof(T));
  static constexpr int kCopy = kBytes < 16 ? kBytes : 16;
  static constexpr int kPieces = kBytes / kCopy;
  static constexpr int kPerPiece = kCopy / static_cast<int>(sizeof(T));  // elements per access
  static_assert(kCopy == 8 || kCopy == 16, "rows move as 8- or 16-byte accesses");
  static_assert(kBytes % kCopy == 0, "a row must be whole accesses");
};

// 32-bit words -> fp32. bf16 -> fp32 is exact: the bf16 bits are the fp32's high half.
__device__ __forceinline__ void unpack_word(uint32_t u, __nv_bfloat16, float* f) {
  f[0] = __uint_as_float(u << 16);
  f[1] = __uint_as_float(u & 0xffff0000u);
}
__device__ __forceinline__ void unpack_word(uint32_t u, __half, float* f) {
  const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&u));
  f[0] = v.x;
  f[1] = v.y;
}
__device__ __forceinline__ void unpack_word(uint32_t u, float, float* f) { f[0] = __uint_as_float(u); }

__device__ __forceinline__ uint32_t pack_word(const float* f, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(f[0], f[1]);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_word(const float* f, __half) {
  __half2 h = __floats2half2_rn(f[0], f[1]);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_word(const float* f, float) { return __float_as_uint(f[0]); }

template <typename T>
constexpr int per_word() { return 4 / static_cast<int>(sizeof(T)); }

// One kCopy-byte access at p (global or shared) -> kPerPiece floats.
template <typename T, int kCopy>
__device__ __forceinline__ void load_piece(const void* p, float* f) {
  constexpr int E = per_word<T>();
  if constexpr (kCopy == 16) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    unpack_word(u.x, T{}, f);
    unpack_word(u.y, T{}, f + E);
    unpack_word(u.z, T{}, f + 2 * E);
    unpack_word(u.w, T{}, f + 3 * E);
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    unpack_word(u.x, T{}, f);
    unpack_word(u.y, T{}, f + E);
  }
}

// Row of T at any stride, nvalid <= C channels (the rest read as 0).
template <typename T, int C>
__device__ __forceinline__ void load_row_scalar(const T* p, int64_t sd, int nvalid, float* f) {
#pragma unroll
  for (int c = 0; c < C; ++c) f[c] = c < nvalid ? to_f(p[c * sd]) : 0.f;
}

// Row store to a contiguous row; vec: whole row, kCopy-aligned. kStream: st.global.cs (the row
// is not read again soon, so it should not push other lines out of L2).
template <typename T, int C, bool kStream = false>
__device__ __forceinline__ void store_row(T* p, bool vec, int nvalid, const float* f) {
  using R = Row<T, C>;
  constexpr int E = per_word<T>();
  if (vec) {
#pragma unroll
    for (int i = 0; i < R::kPieces; ++i) {
      const float* g = f + i * R::kPerPiece;
      char* q = reinterpret_cast<char*>(p) + i * R::kCopy;
      if constexpr (R::kCopy == 16) {
        const uint4 v = make_uint4(pack_word(g, T{}), pack_word(g + E, T{}), pack_word(g + 2 * E, T{}),
                                   pack_word(g + 3 * E, T{}));
        if constexpr (kStream) __stcs(reinterpret_cast<uint4*>(q), v);
        else *reinterpret_cast<uint4*>(q) = v;
      } else {
        const uint2 v = make_uint2(pack_word(g, T{}), pack_word(g + E, T{}));
        if constexpr (kStream) __stcs(reinterpret_cast<uint2*>(q), v);
        else *reinterpret_cast<uint2*>(q) = v;
      }
    }
  } else {
#pragma unroll
    for (int c = 0; c < C; ++c)
      if (c < nvalid) p[c] = from_f<T>(f[c]);
  }
}

// ---- cp.async ring -----------------------------------------------------------------------------
// Each thread streams its own rows global -> shared with cp.async and reads back only what it
// wrote itself, so no CTA barrier is needed: cp.async.wait_group makes a thread's own copies
// visible to it. kStages-1 rows are in flight per thread, independent of register pressure.
// kStream: the row is read with an L2 evict_first policy, so a stream that is read once does not
// push other lines out of L2. Measured on the H200 (B16 T8192 D2048 bf16 W4 silu): the forward
// with streaming loads and .cs stores 0.321 ms vs 0.346 ms without; the backward, which re-reads
// halo rows, was 1.5% slower with them, so it streams without hints.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
template <int kBytes, bool kStream = false>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  static_assert(kBytes == 16 || kBytes == 8, "cp.async moves 8 or 16 bytes here");
  if constexpr (kStream) {
    const uint64_t pol = evict_first_policy();
    if constexpr (kBytes == 16) {
      asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "l"(pol)
                   : "memory");
    } else {
      asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 8, %2;\n" ::"r"(s), "l"(gmem), "l"(pol)
                   : "memory");
    }
  } else {
    if constexpr (kBytes == 16) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem) : "memory");
    }
  }
}
// KF_CCONV_PREFETCH=P > 0 (tuning harness only): when row r enters the ring, row r + P is also
// prefetched into L2, so P more rows per thread are in flight at no shared-memory cost.
#ifndef KF_CCONV_PREFETCH
#define KF_CCONV_PREFETCH 0
#endif
__device__ __forceinline__ void prefetch_l2(const void* gmem) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Shared layout: [stream][stage][piece][thread] cells of kCopy bytes, so a warp's accesses to one
// (stream, stage, piece) are consecutive (conflict-free), and a launch that never uses stream 1
// needs only the first kBytes / kStreams. Stages are indexed at run time (row number mod
// kStages): the walk loops need not be unrolled by kStages.
template <typename T, int C, int kStages, int kStreams, bool kStream = false>
struct Ring {
  using R = Row<T, C>;
  static_assert((kStages & (kStages - 1)) == 0, "stage = row & (kStages - 1)");
  static constexpr int kBytes = kStages * kStreams * R::kPieces * kThreads * R::kCopy;
  char* base;  // this thread's cell of (stage 0, stream 0, piece 0)
  __device__ __forceinline__ Ring(char* smem, int tid) : base(smem + tid * R::kCopy) {}
  __device__ __forceinline__ char* cell(int row, int stream, int piece) const {
    const int stage = row & (kStages - 1);
    return base + ((stream * kStages + stage) * R::kPieces + piece) * (kThreads * R::kCopy);
  }
  __device__ __forceinline__ void issue(int row, int stream, const T* g) const {
#pragma unroll
    for (int i = 0; i < R::kPieces; ++i)
      cp_async<R::kCopy, kStream>(cell(row, stream, i), reinterpret_cast<const char*>(g) + R::kCopy * i);
  }
  __device__ __forceinline__ void read(int row, int stream, float* f) const {
#pragma unroll
    for (int i = 0; i < R::kPieces; ++i) load_piece<T, R::kCopy>(cell(row, stream, i), f + i * R::kPerPiece);
  }
};

// ---- sequences ---------------------------------------------------------------------------------
__device__ __forceinline__ int64_t cu_at(const Sequences& s, int64_t n) {
  // Clamped so that a malformed device-side cu_seqlens (never synced to check) cannot send a
  // kernel out of bounds; the host validates it whenever cu_seqlens_cpu is given.
  int64_t v = s.cu_int64 ? static_cast<const int64_t*>(s.cu_seqlens)[n]
                         : static_cast<int64_t>(static_cast<const int32_t*>(s.cu_seqlens)[n]);
  return v < 0 ? 0 : (v > s.total ? s.total : v);
}
__device__ __forceinline__ int64_t seq_begin(const Sequences& s, int64_t n) {
  return s.cu_seqlens ? cu_at(s, n) : n * s.seq_len;
}
__device__ __forceinline__ int64_t seq_end(const Sequences& s, int64_t n) {
  if (!s.cu_seqlens) return (n + 1) * s.seq_len;
  int64_t e = cu_at(s, n + 1);
  int64_t b = cu_at(s, n);
  return e < b ? b : e;
}
// The sequence holding token i (0 <= i < total): the last n with begin(n) <= i.
__device__ __forceinline__ int64_t seq_of(const Sequences& s, int64_t i) {
  if (!s.cu_seqlens) return i / s.seq_len;
  int64_t lo = 0, hi = s.num_seqs - 1;  // invariant: answer in [lo, hi]
  while (lo < hi) {
    int64_t mid = (lo + hi + 1) >> 1;
    if (cu_at(s, mid) <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}
// Offset (in elements) of token i of sequence n in a [B, T, D] view; i is a flat token index.
__device__ __forceinline__ int64_t token_offset(const Sequences& s, const View3& v, int64_t n, int64_t i) {
  if (s.cu_seqlens) return i * v.s1;  // B == 1: the flat index is the time index
  return n * v.s0 + (i - n * s.seq_len) * v.s1;
}

__device__ __forceinline__ float silu_grad(float pre) {
  // d/dp [p * sigmoid(p)] = s * (1 + p * (1 - s)).
  const float s = 1.f / (1.f + __expf(-pre));
  return s * (1.f + pre * (1.f - s));
}
__device__ __forceinline__ float silu(float pre) { return pre / (1.f + __expf(-pre)); }

}  // namespace kernel_fun::cconv::dev
