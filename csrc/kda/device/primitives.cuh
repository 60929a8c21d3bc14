// Device helpers shared by the KDA forward kernels: warp-level MMA (mma.sync), ldmatrix,
// cp.async, dtype conversion and the sequence/chunk lookup. Fragment layouts follow the PTX ISA
// ("Matrix fragments for mma.m16n8k16 / m16n8k8"): g = lane / 4 is the row group, t = lane % 4
// the thread in the group.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kda/sm90/kda_fwd.h"

namespace kernel_fun::kda::dev {

// ---------------------------------------------------------------- element types
template <typename T> struct Elem;
template <> struct Elem<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ uint32_t pack2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  // Two packed elements (low half = the lower address) -> floats. bf16 is the top half of an fp32,
  // so this is two integer ops, not two conversions.
  static __device__ __forceinline__ float2 to_float2(uint32_t u) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
  }
};
template <> struct Elem<__half> {
  using T2 = __half2;
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ uint32_t pack2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ float2 to_float2(uint32_t u) {
    return __half22float2(*reinterpret_cast<const __half2*>(&u));
  }
};

// A scalar of a runtime dtype (g and beta may come in any float dtype).
__device__ __forceinline__ float load_any(const void* p, int64_t i, DType t) {
  switch (t) {
    case DType::kFloat32: return reinterpret_cast<const float*>(p)[i];
    case DType::kFloat16: return __half2float(reinterpret_cast<const __half*>(p)[i]);
    case DType::kBFloat16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<float>(reinterpret_cast<const double*>(p)[i]);
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  // ex2.approx: ~2 ulp, exp2(-inf) = 0, and every argument the kernels pass is <= 0 (or -inf).
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_lg2(float x) {
  // lg2.approx: absolute error ~2^-22 near 1 (the gate's softplus only calls it on [1, 2]).
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------- MMA
// D += A B, m16n8k16, fp32 accumulators; T = bf16 or fp16 operands.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
#define KF_KDA_MMA_16816(T, PTXT)                                                                    \
  template <>                                                                                        \
  __device__ __forceinline__ void mma_16816<T>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,   \
                                               uint32_t b1) {                                        \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTXT "." PTXT ".f32 {%0,%1,%2,%3}, "       \
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                          \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                    \
  }
KF_KDA_MMA_16816(__nv_bfloat16, "bf16")
KF_KDA_MMA_16816(__half, "f16")
#undef KF_KDA_MMA_16816

// tf32 m16n8k8 (fp32 range, 10-bit mantissa): the intra kernel's products of gate-scaled operands.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void mma_1688_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------- ldmatrix / cp.async
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
// 16-byte async copy; src_bytes == 0 zero-fills the destination (rows past a sequence's end).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---------------------------------------------------------------- sequences
__device__ __forceinline__ int64_t load_cu(const KdaFwdParams& p, int i) {
  return p.cu_int64 ? reinterpret_cast<const int64_t*>(p.cu_seqlens)[i]
                    : static_cast<int64_t>(reinterpret_cast<const int*>(p.cu_seqlens)[i]);
}

// Token range [bos, bos + len) of sequence n in the flattened [B*T] token axis, and its first
// global chunk index (the row of gdecay / h_states).
struct SeqInfo {
  int64_t bos;
  int len;
  int chunk0;
};
__device__ __forceinline__ SeqInfo seq_info(const KdaFwdParams& p, int n) {
  SeqInfo s;
  if (p.cu_seqlens) {
    s.bos = load_cu(p, n);
    s.len = static_cast<int>(load_cu(p, n + 1) - s.bos);
    s.chunk0 = p.chunk_offsets[n];
  } else {
    s.bos = static_cast<int64_t>(n) * p.T;
    s.len = p.T;
    s.chunk0 = n * ((p.T + kChunk - 1) / kChunk);
  }
  return s;
}

}  // namespace kernel_fun::kda::dev
