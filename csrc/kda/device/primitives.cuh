// Device primitives shared by every KDA kernel (forward and backward): warp-level MMA (mma.sync),
// ldmatrix, cp.async, dtype conversion, the SFU exp2/lg2. Fragment layouts follow the PTX ISA
// ("Matrix fragments for mma.m16n8k16 / m16n8k8"): g = lane / 4 is the row group, t = lane % 4
// the thread in the group.
// Under KF_EMU (the host emulator, tests/emu/) every inline-PTX body is replaced by its emulation in
// kf_emu.h; the GPU build sees exactly the asm below.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/dtype_access.cuh"
#include "common/dyn_smem.h"
#include "kda/kda_problem.h"

namespace kernel_fun::kda::dev {

// ---------------------------------------------------------------- profiling (scripts/kda_phases.py)
// A kernel launched with a clock buffer ([grid.x * grid.y][16] int64) stamps clock64() at its phase
// boundaries into its CTA's row; null in production (one uniform branch per stamp). Grids of at
// most two dimensions (the per-chunk kernels). The host emulator has no cycles: no-op there.
__device__ __forceinline__ long long* cta_clock_row(long long* buf) {
  return buf ? buf + (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * 16 : nullptr;
}
__device__ __forceinline__ void stamp_clock(long long* row, int slot) {
#ifndef KF_EMU
  if (row) row[slot] = clock64();
#else
  (void)row;
  (void)slot;
#endif
}

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

// for (i = tid; i < N; i += NTH) with N, NTH compile-time and tid < NTH (the block size): a fixed
// trip count that unrolls fully, instead of the generic strided loop (unrolled by 4, plus remainder
// code) the compiler must emit when it cannot bound tid. Once-per-CTA loops of the big kernels are
// instruction-fetch bound, so their code size is time.
template <int N, int NTH, typename F>
__device__ __forceinline__ void strided(int tid, F&& f) {
#pragma unroll
  for (int it = 0; it < (N + NTH - 1) / NTH; ++it) {
    const int i = tid + it * NTH;
    if (N % NTH == 0 || i < N) f(i);
  }
}

// 8 consecutive elements of a runtime dtype at element i (i a multiple of 8) -> 8 floats, in two
// steps so that a caller can have several rows' loads in flight before it waits on any: load8_raw
// issues the load and keeps the bits as loaded; raw8_to_float converts them, and its first read of
// the registers is where the warp waits. (A conversion right behind each load, inside the dtype
// branch, serialises the loads of an unrolled row loop: one global latency per row.)
// fp32 and the 16-bit types take one or two 16-byte accesses when the base pointer is 16-byte
// aligned (i % 8 == 0 keeps the element aligned too); anything else goes through a rolled scalar
// loop that converts at once (it is the cold path) and keeps fp32 bits. The rolled loop works on its
// own small local array, so the raw registers stay registers on the fast paths: these run in the
// once-per-chunk prologue / epilogue of the biggest kernels, where straight-line code size (the
// instruction cache) matters more than the cold path's speed.
struct Raw8 {
  uint4 lo, hi;  // fp32 bits: lo = elements 0..3, hi = 4..7; a packed 16-bit dtype: lo only
};
__device__ __forceinline__ bool packed16(const void* p, DType t) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0 && (t == DType::kBFloat16 || t == DType::kFloat16);
}
// The two fast forms from the row's first element (16-byte aligned), for callers that pick the form
// once for many rows (GatePass::load_rows) as well as for load8_raw.
__device__ __forceinline__ void load8_f32(Raw8& r, const float* q) {
  const uint4* v = reinterpret_cast<const uint4*>(q);
  r.lo = v[0];
  r.hi = v[1];
}
__device__ __forceinline__ void load8_packed16(Raw8& r, const uint16_t* q) { r.lo = *reinterpret_cast<const uint4*>(q); }
__device__ __forceinline__ bool aligned_f32(const void* p, DType t) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0 && t == DType::kFloat32;
}
__device__ __forceinline__ void load8_raw(Raw8& r, const void* p, DType t, int64_t i) {
  if (aligned_f32(p, t)) {
    load8_f32(r, reinterpret_cast<const float*>(p) + i);
  } else if (packed16(p, t)) {
    load8_packed16(r, reinterpret_cast<const uint16_t*>(p) + i);
  } else {
    float tmp[8];
#pragma unroll 1
    for (int e = 0; e < 8; ++e) tmp[e] = load_any(p, t, i + e);
    r.lo = make_uint4(__float_as_uint(tmp[0]), __float_as_uint(tmp[1]), __float_as_uint(tmp[2]), __float_as_uint(tmp[3]));
    r.hi = make_uint4(__float_as_uint(tmp[4]), __float_as_uint(tmp[5]), __float_as_uint(tmp[6]), __float_as_uint(tmp[7]));
  }
}
// All-zero bits are 0.0 in every dtype: the value of a row that is not loaded.
__device__ __forceinline__ Raw8 raw8_zero() { return Raw8{make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)}; }
// p and t as given to load8_raw (they say which form the bits are in).
__device__ __forceinline__ void raw8_to_float(float (&v)[8], const Raw8& r, const void* p, DType t) {
  if (packed16(p, t)) {
    const uint32_t w4[4] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f2 = t == DType::kBFloat16 ? Elem<__nv_bfloat16>::to_float2(w4[e]) : Elem<__half>::to_float2(w4[e]);
      v[2 * e] = f2.x;
      v[2 * e + 1] = f2.y;
    }
  } else {
    v[0] = __uint_as_float(r.lo.x); v[1] = __uint_as_float(r.lo.y); v[2] = __uint_as_float(r.lo.z); v[3] = __uint_as_float(r.lo.w);
    v[4] = __uint_as_float(r.hi.x); v[5] = __uint_as_float(r.hi.y); v[6] = __uint_as_float(r.hi.z); v[7] = __uint_as_float(r.hi.w);
  }
}
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
  return make_uint4(Elem<T>::pack2(v[0], v[1]), Elem<T>::pack2(v[2], v[3]), Elem<T>::pack2(v[4], v[5]),
                    Elem<T>::pack2(v[6], v[7]));
}
// One 16-byte global store. nvcc splits `*reinterpret_cast<uint4*>(p) = v` into four 4-byte stores
// in the per-chunk kernels (the PTX has st.global.u32 x 4: 4x the LSU instructions and, as each
// lane's four stores land in different requests, ~4x the L2 sectors of the workspace writes; ncu,
// 2026-12-03; __builtin_assume_aligned does not change it); the vector store says what is meant. p must
// be 16-byte aligned. No "memory" clobber: for outputs the kernel never reads back (the compiler may
// move other memory accesses across it).
__device__ __forceinline__ void stg16(void* p, const uint4& v) {
#ifdef KF_EMU
  *reinterpret_cast<uint4*>(p) = v;
#else
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
#endif
}
// One 16-byte global load through L2 only (ld.global.cg): for data another CTA of the same grid
// wrote and released after this kernel started (an L1 line of it would be stale). "memory" clobber:
// it must stay after the acquire that orders it.
__device__ __forceinline__ float4 ldg_cg16(const float* p) {
#ifdef KF_EMU
  return *reinterpret_cast<const float4*>(p);
#else
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p)
               : "memory");
  return v;
#endif
}
// One 8-byte global store (the same splitting: two 4-byte stores). p must be 8-byte aligned.
__device__ __forceinline__ void stg8(void* p, const uint2& v) {
#ifdef KF_EMU
  *reinterpret_cast<uint2*>(p) = v;
#else
  asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(v.x), "r"(v.y));
#endif
}
// stg16 under a predicate, as one predicated instruction rather than a branch: between a wgmma's
// commit and its wait, a branch makes ptxas wait for the wgmma there (the scans' checkpoint stores
// run in that window).
__device__ __forceinline__ void stg16_if(void* p, const uint4& v, bool pred) {
#ifdef KF_EMU
  if (pred) *reinterpret_cast<uint4*>(p) = v;
#else
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n @q st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}\n" ::"l"(p),
      "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(static_cast<int>(pred)));
#endif
}
__device__ __forceinline__ void stg16(void* p, float a, float b, float c, float d) {
  stg16(p, make_uint4(__float_as_uint(a), __float_as_uint(b), __float_as_uint(c), __float_as_uint(d)));
}

// 8 values to global memory in dtype t at element i (p global).
__device__ __forceinline__ void store8_any(void* p, DType t, int64_t i, const float (&v)[8]) {
  const bool al16 = (reinterpret_cast<uintptr_t>(p) & 15) == 0;
  if (al16 && t == DType::kFloat32) {
    float* q = reinterpret_cast<float*>(p) + i;
    stg16(q, v[0], v[1], v[2], v[3]);
    stg16(q + 4, v[4], v[5], v[6], v[7]);
  } else if (packed16(p, t)) {
    stg16(reinterpret_cast<uint16_t*>(p) + i, t == DType::kBFloat16 ? pack8<__nv_bfloat16>(v) : pack8<__half>(v));
  } else {
    float tmp[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) tmp[e] = v[e];
#pragma unroll 1
    for (int e = 0; e < 8; ++e) store_any(p, t, i + e, tmp[e]);
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  // ex2.approx: ~2 ulp, exp2(-inf) = 0. The kernels' decays pass arguments <= 0 (or -inf); the gate's
  // sigmoid and softplus any sign (exp2 overflows to inf there: fast_rcp's limit 0, or softplus_base2's
  // select).
#ifdef KF_EMU
  return kf_emu::ex2_approx_ftz(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

__device__ __forceinline__ float fast_rcp(float x) {
  // rcp.approx: ~1 ulp, rcp(inf) = 0. __fdividef(1, x) computes the same reciprocal and then
  // multiplies it by 1 (one more instruction per call, kept for the FTZ flush of that product).
#ifdef KF_EMU
  return kf_emu::ftz(1.f / kf_emu::ftz(x));
#else
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

__device__ __forceinline__ float fast_lg2(float x) {
  // lg2.approx: absolute error ~2^-22 on [1, 2], relative ~2^-22 above (the gate's softplus calls
  // it on [1, 2^29]).
#ifdef KF_EMU
  return kf_emu::lg2_approx_ftz(x);
#else
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// ---------------------------------------------------------------- MMA
// D += A B, m16n8k16, fp32 accumulators; T = bf16 or fp16 operands.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
#ifdef KF_EMU
#define KF_KDA_MMA_16816(T, PTXT)                                                                    \
  template <>                                                                                        \
  __device__ __forceinline__ void mma_16816<T>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,   \
                                               uint32_t b1) {                                        \
    kf_emu::mma_m16n8k16<T>(c, a, b0, b1);                                                           \
  }
#else
#define KF_KDA_MMA_16816(T, PTXT)                                                                    \
  template <>                                                                                        \
  __device__ __forceinline__ void mma_16816<T>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,   \
                                               uint32_t b1) {                                        \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTXT "." PTXT ".f32 {%0,%1,%2,%3}, "       \
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                          \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                    \
  }
#endif
KF_KDA_MMA_16816(__nv_bfloat16, "bf16")
KF_KDA_MMA_16816(__half, "f16")
#undef KF_KDA_MMA_16816

// A 16 x 16 output tile: the two m16n8k16 MMAs of one ldmatrix.x4 B fragment (b[0..1]: n-tile c0,
// b[2..3]: n-tile c1).
template <typename T>
__device__ __forceinline__ void mma_16x16(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[4]) {
  mma_16816<T>(c0, a, b[0], b[1]);
  mma_16816<T>(c1, a, b[2], b[3]);
}

// The fp32 C fragments of n-tiles 2i and 2i+1 are, packed to T, the A fragment of k-step i (the
// same rows and 16 consecutive columns): a result feeds the next product from registers.
// kNeg packs the negated values.
template <typename T, bool kNeg = false>
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  const float s = kNeg ? -1.f : 1.f;
  a[0] = Elem<T>::pack2(s * c0[0], s * c0[1]);
  a[1] = Elem<T>::pack2(s * c0[2], s * c0[3]);
  a[2] = Elem<T>::pack2(s * c1[0], s * c1[1]);
  a[3] = Elem<T>::pack2(s * c1[2], s * c1[3]);
}

// 4 x 4 transpose of 32-bit words across the lanes of a quad (t = lane & 3): word i of lane t
// becomes word t of lane i. Two butterfly stages (lane distance 1, then 2), two shuffles each.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int t) {
#pragma unroll
  for (int d = 1; d <= 2; d <<= 1) {
    const bool hi = t & d;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i & d) continue;  // pairs (i, i + d): the lane keeps the word whose d-bit matches its own
      const uint32_t recv = __shfl_xor_sync(0xffffffffu, hi ? w[i] : w[i + d], d);
      if (hi) w[i] = recv;
      else w[i + d] = recv;
    }
  }
}

// The two rows of a warp's fp32 C tile (acc[j][0..1]: row g, acc[j][2..3]: row g + 8; columns
// 8 j + 2 t, + 1) packed to T into rows row_a / row_b of a row-major global tile (pointers at the
// tile's column 0), skipping a row whose ok_ flag is false. Pair-wise stores would write every
// 32-byte sector in two halves from two instructions; a quad transpose over four n-tiles gives each
// lane 8 consecutive columns instead, so a warp's 16-byte stores cover 64 contiguous bytes per row.
template <typename T, int NT>
__device__ __forceinline__ void store_c_rows16(T* row_a, T* row_b, bool ok_a, bool ok_b, const float (&acc)[NT][4],
                                               int t) {
  static_assert(NT % 4 == 0, "the quad transpose covers four n-tiles");
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
#pragma unroll
    for (int m = 0; m < NT / 4; ++m) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = Elem<T>::pack2(acc[4 * m + i][2 * hh], acc[4 * m + i][2 * hh + 1]);
      quad_transpose(w, t);  // lane t: columns 8 (4 m + t) .. + 7
      stg16_if((hh == 0 ? row_a : row_b) + 8 * (4 * m + t), make_uint4(w[0], w[1], w[2], w[3]), hh == 0 ? ok_a : ok_b);
    }
}

// tf32 m16n8k8 (fp32 range, 10-bit mantissa): the intra kernel's products of gate-scaled operands.
__device__ __forceinline__ uint32_t to_tf32(float x) {
#ifdef KF_EMU
  return kf_emu::cvt_rna_tf32(x);
#else
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
#endif
}
__device__ __forceinline__ void mma_1688_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef KF_EMU
  kf_emu::mma_m16n8k8_tf32(c, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// The value a tf32 operand carries into the tensor core: x rounded as to_tf32 rounds it, low 13 bits
// cleared (mma ignores them; clearing them makes the float exact whatever cvt leaves there).
__device__ __forceinline__ float tf32_value(float x) { return __uint_as_float(to_tf32(x) & 0xffffe000u); }

// An fp32 operand carried to ~2^-21 through the tf32 tensor cores: x = hi + lo. Where two products of
// the same pair of values, formed from differently factorised operands, must cancel (kda_bwd_grads,
// I1). hi is x truncated to tf32 (the low 13 bits cleared: exact, one logic op); lo = x - hi is exact
// in fp32 and |lo| < 2^-10 |x|; the mma reads lo's top 11 bits (it ignores the low 13), so the pair
// carries x to ~2^-21. No cvt: with the rounding split (cvt.rna for hi and again for lo) I1's column
// side took 9.98k cycles per CTA against 6.36k with single tf32 B operands, and halving the lo mma
// saved only 0.3k of that: the conversions were the cost, not the tensor core. By truncation: 7.25k,
// kda_bwd_grads 11.18 -> 10.84 ms at prod8192 (H200, 2026-12-02, docs/notes/2026-12-01-kda-backward.md).
struct Tf32Pair {
  uint32_t hi, lo;
};
__device__ __forceinline__ Tf32Pair split_tf32(float x) {
  const uint32_t hi = __float_as_uint(x) & 0xffffe000u;
  return {hi, __float_as_uint(x - __uint_as_float(hi))};
}
// c += A (B.hi + B.lo): A rounded once (its rounding is the same wherever the same A element is used).
__device__ __forceinline__ void mma_1688_tf32_x2(float (&c)[4], const uint32_t (&a)[4], const Tf32Pair& b0,
                                                 const Tf32Pair& b1) {
  mma_1688_tf32(c, a, b0.hi, b1.hi);
  mma_1688_tf32(c, a, b0.lo, b1.lo);
}

// ---------------------------------------------------------------- ldmatrix / cp.async
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
#ifdef KF_EMU
  kf_emu::ldmatrix_x4(r, p);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
#endif
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
#ifdef KF_EMU
  kf_emu::ldmatrix_x4_trans(r, p);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
#endif
}

// The m16n8k16 operand fragments by ldmatrix.x4 from a row-major smem tile (leading dimension ld
// elements, rows r0.., columns c0..). Lane l gives the address of row l & 7 of 8 x 8 matrix l >> 3;
// the four matrices are the fragment's quarters in the order the MMA wants them:
//   ldsm_a   A [m = tile rows r0 + 0..15][k = columns c0 + 0..15]   (tile [m][k])
//   ldsm_a_t A [m = columns c0 + 0..15][k = tile rows r0 + 0..15]   (tile [k][m], transposed load)
//   ldsm_b   B [k = columns c0 + 0..15][n = tile rows r0 + 0..15]   (tile [n][k]; n-tiles n, n + 8)
//   ldsm_b_t B [k = tile rows r0 + 0..15][n = columns c0 + 0..15]   (tile [k][n], transposed load)
template <typename T>
__device__ __forceinline__ void ldsm_a(uint32_t (&r)[4], const T* tile, int ld, int r0, int c0) {
  const int l = threadIdx.x & 31;
  ldsm_x4(r, tile + (r0 + ((l >> 3) & 1) * 8 + (l & 7)) * ld + c0 + (l >> 4) * 8);
}
template <typename T>
__device__ __forceinline__ void ldsm_a_t(uint32_t (&r)[4], const T* tile, int ld, int r0, int c0) {
  const int l = threadIdx.x & 31;
  ldsm_x4_t(r, tile + (r0 + (l >> 4) * 8 + (l & 7)) * ld + c0 + ((l >> 3) & 1) * 8);
}
template <typename T>
__device__ __forceinline__ void ldsm_b(uint32_t (&r)[4], const T* tile, int ld, int r0, int c0) {
  const int l = threadIdx.x & 31;
  ldsm_x4(r, tile + (r0 + (l >> 4) * 8 + (l & 7)) * ld + c0 + ((l >> 3) & 1) * 8);
}
template <typename T>
__device__ __forceinline__ void ldsm_b_t(uint32_t (&r)[4], const T* tile, int ld, int r0, int c0) {
  const int l = threadIdx.x & 31;
  ldsm_x4_t(r, tile + (r0 + ((l >> 3) & 1) * 8 + (l & 7)) * ld + c0 + (l >> 4) * 8);
}
// 16-byte async copy; src_bytes == 0 zero-fills the destination (rows past a sequence's end).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
#ifdef KF_EMU
  kf_emu::cp_async_cg16(dst, src, src_bytes);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(src_bytes));
#endif
}
// cp_async16 under a predicate (no copy, no zero fill when false), one predicated instruction rather
// than a branch (see stg16_if: the scans issue their loads while a wgmma is in flight).
__device__ __forceinline__ void cp_async16_if(void* dst, const void* src, int src_bytes, bool pred) {
#ifdef KF_EMU
  if (pred) kf_emu::cp_async_cg16(dst, src, src_bytes);
#else
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n @q cp.async.cg.shared.global [%0], [%1], 16, %2;\n}\n" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(src_bytes), "r"(static_cast<int>(pred)));
#endif
}
#ifdef KF_EMU
__device__ __forceinline__ void cp_async_commit() { kf_emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { kf_emu::cp_async_wait(N); }
#else
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
#endif


// ---------------------------------------------------------------- sm_90a wgmma (A from registers)
// wgmma.mma_async m64nNk16 with A in registers and B from shared memory through a descriptor: the
// four warps of a warpgroup each give 16 rows of A in the mma.sync A-fragment layout (pack_a) and
// get 16 rows of D in the mma.sync C layout, n-tile j = d[j][0..3]: so a warp's register tiles are
// the same whether mma.sync or wgmma produced them. B is read once per warpgroup by the hardware
// (mma.sync has every warp load its own B fragments with ldmatrix).
// Shared-memory operands use the 128-byte swizzle: [rows][64 elements] atoms of 8 rows x 128 bytes,
// 1024-byte aligned, 16-byte chunk c of row r stored at chunk c ^ (r & 7) (sw128_offset).

// Byte offset of element (r, c) (c < 64) in a 128-byte-swizzled [rows][64] 16-bit tile.
__host__ __device__ __forceinline__ uint32_t sw128_offset(int r, int c) {
  return static_cast<uint32_t>(r * 128 + ((((c >> 3) ^ r) & 7) << 4) + (c & 7) * 2);
}

// Descriptor of a 128-byte-swizzled operand at shared address addr: sbo = bytes between 8-row groups
// of the strided dimension, lbo = bytes between 64-element blocks of the leading (contiguous)
// dimension (used by MN-major operands only). Fields (PTX "matrix descriptor"): address, LBO, SBO
// in 16-byte units at bits 0, 16, 32; base offset 0 (1024-byte aligned atoms); swizzle mode 1
// (128 B) at bit 62.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFF) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

#ifdef KF_EMU
// Emulated asynchronously, as the hardware runs them: the accumulators hold poison until the wait
// (tests/emu/kf_emu.h), so a missing or misplaced wgmma_wait fails the emulator tests.
__device__ __forceinline__ void wgmma_fence() { kf_emu::wgmma_fence(); }
__device__ __forceinline__ void wgmma_commit() { kf_emu::wgmma_commit(); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { kf_emu::wgmma_wait(N); }
template <typename T, int N, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc, bool acc) {
  kf_emu::wgmma_rs_m64k16<T>(&d[0][0], N, a, desc, kTransB != 0, acc);
}
template <typename T, int N, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, bool acc) {
  kf_emu::wgmma_ss_m64k16<T>(&d[0][0], N, desc_a, desc_b, kTransB != 0, acc);
}
__device__ __forceinline__ void fence_proxy_async() {}
#else
// Orders this thread's generic-proxy shared-memory writes (st.shared) before later async-proxy reads
// of them (wgmma's operands from shared memory), once a barrier has handed them over.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

#define KF_WGMMA_D8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define KF_WGMMA_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define KF_WGMMA_D32 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}"
#define KF_WGMMA_D64 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
  "}"
#define KF_WGMMA_OUT4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define KF_WGMMA_OUT8 KF_WGMMA_OUT4(0), KF_WGMMA_OUT4(1)
#define KF_WGMMA_OUT16 KF_WGMMA_OUT8, KF_WGMMA_OUT4(2), KF_WGMMA_OUT4(3)
#define KF_WGMMA_OUT32 \
  KF_WGMMA_OUT4(0), KF_WGMMA_OUT4(1), KF_WGMMA_OUT4(2), KF_WGMMA_OUT4(3), KF_WGMMA_OUT4(4), KF_WGMMA_OUT4(5), \
      KF_WGMMA_OUT4(6), KF_WGMMA_OUT4(7)
#define KF_WGMMA_OUT64 \
  KF_WGMMA_OUT32, KF_WGMMA_OUT4(8), KF_WGMMA_OUT4(9), KF_WGMMA_OUT4(10), KF_WGMMA_OUT4(11), KF_WGMMA_OUT4(12), \
      KF_WGMMA_OUT4(13), KF_WGMMA_OUT4(14), KF_WGMMA_OUT4(15)

template <typename T, int N>
struct WgmmaRs;
// D (N/2 registers), A (4), the descriptor, acc (0: D = A B), trans-b (1: B is MN-major)
#define KF_WGMMA_RS(T, PT, N, DREGS, OUTS, IA, IDESC, IACC, ITR)                                              \
  template <>                                                                                                 \
  struct WgmmaRs<T, N> {                                                                                      \
    template <int kTransB>                                                                                    \
    static __device__ __forceinline__ void run(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc,  \
                                               int acc) {                                                     \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IACC ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N         \
                   "k16.f32." PT "." PT " " DREGS ", {%" IA "}, %" IDESC ", p, 1, 1, %" ITR ";\n}\n"             \
                   : OUTS                                                                                     \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc), "n"(kTransB));          \
    }                                                                                                         \
  };
KF_WGMMA_RS(__nv_bfloat16, "bf16", 16, KF_WGMMA_D8, KF_WGMMA_OUT8, "8, %9, %10, %11", "12", "13", "14")
KF_WGMMA_RS(__half, "f16", 16, KF_WGMMA_D8, KF_WGMMA_OUT8, "8, %9, %10, %11", "12", "13", "14")
KF_WGMMA_RS(__nv_bfloat16, "bf16", 32, KF_WGMMA_D16, KF_WGMMA_OUT16, "16, %17, %18, %19", "20", "21", "22")
KF_WGMMA_RS(__half, "f16", 32, KF_WGMMA_D16, KF_WGMMA_OUT16, "16, %17, %18, %19", "20", "21", "22")
KF_WGMMA_RS(__nv_bfloat16, "bf16", 64, KF_WGMMA_D32, KF_WGMMA_OUT32, "32, %33, %34, %35", "36", "37", "38")
KF_WGMMA_RS(__half, "f16", 64, KF_WGMMA_D32, KF_WGMMA_OUT32, "32, %33, %34, %35", "36", "37", "38")
KF_WGMMA_RS(__nv_bfloat16, "bf16", 128, KF_WGMMA_D64, KF_WGMMA_OUT64, "64, %65, %66, %67", "68", "69", "70")
KF_WGMMA_RS(__half, "f16", 128, KF_WGMMA_D64, KF_WGMMA_OUT64, "64, %65, %66, %67", "68", "69", "70")
#undef KF_WGMMA_RS

template <typename T, int N>
struct WgmmaSs;
// D (N/2 registers), the A and B descriptors, acc (0: D = A B), trans-b (1: B is MN-major); A K-major
#define KF_WGMMA_SS(T, PT, N, DREGS, OUTS, IDA, IDB, IACC, ITR)                                                \
  template <>                                                                                                 \
  struct WgmmaSs<T, N> {                                                                                      \
    template <int kTransB>                                                                                    \
    static __device__ __forceinline__ void run(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, int acc) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IACC ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N         \
                   "k16.f32." PT "." PT " " DREGS ", %" IDA ", %" IDB ", p, 1, 1, 0, %" ITR ";\n}\n"              \
                   : OUTS                                                                                     \
                   : "l"(desc_a), "l"(desc_b), "r"(acc), "n"(kTransB));                                       \
    }                                                                                                         \
  };
KF_WGMMA_SS(__nv_bfloat16, "bf16", 16, KF_WGMMA_D8, KF_WGMMA_OUT8, "8", "9", "10", "11")
KF_WGMMA_SS(__half, "f16", 16, KF_WGMMA_D8, KF_WGMMA_OUT8, "8", "9", "10", "11")
KF_WGMMA_SS(__nv_bfloat16, "bf16", 32, KF_WGMMA_D16, KF_WGMMA_OUT16, "16", "17", "18", "19")
KF_WGMMA_SS(__half, "f16", 32, KF_WGMMA_D16, KF_WGMMA_OUT16, "16", "17", "18", "19")
#undef KF_WGMMA_SS
#undef KF_WGMMA_OUT64
#undef KF_WGMMA_OUT32
#undef KF_WGMMA_OUT16
#undef KF_WGMMA_OUT8
#undef KF_WGMMA_OUT4
#undef KF_WGMMA_D64
#undef KF_WGMMA_D32
#undef KF_WGMMA_D16
#undef KF_WGMMA_D8

// d (+)= a @ B, one m64nNk16 step of the calling warp's warpgroup (every thread of its four warps
// calls it with the same descriptor). Between wgmma_fence() and wgmma_wait<0>() the compiler must
// not touch d or a: the kernels issue, commit and wait in one place.
template <typename T, int N, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc, bool acc) {
  WgmmaRs<T, N>::template run<kTransB>(d, a, desc, acc ? 1 : 0);
}
// d (+)= A @ B with A from shared memory too (K-major, desc_a: the warpgroup's 64 rows): no A
// registers, each operand read once per warpgroup.
template <typename T, int N, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, bool acc) {
  WgmmaSs<T, N>::template run<kTransB>(d, desc_a, desc_b, acc ? 1 : 0);
}
#endif

// Register fences for wgmma operands (as CUTLASS's warpgroup_fence_operand): the compiler may not
// move, copy or reuse these registers across the fence, so values in flight in an async wgmma stay
// where the hardware reads / writes them until wgmma_wait. T: float (accumulators) or uint32_t
// (packed A fragments).
template <typename T, int R>
__device__ __forceinline__ void fence_regs(T (&x)[R][4]) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint32_t>, "wgmma operand registers");
#ifndef KF_EMU
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (std::is_same_v<T, float>) asm volatile("" : "+f"(x[r][e])::"memory");
      else asm volatile("" : "+r"(x[r][e])::"memory");
    }
#endif
}

// The sums over the warp's 32 lanes of N values at once (N = 2, 4, 8 or 16), as a reduce-scatter:
// each step pairs lanes across one bit of the lane index, every lane keeps half of its values and
// adds its partner's copy of them, then plain butterfly steps finish. 8 values take 9 shuffles where
// 8 separate 5-step trees take 40. Returns the total of value (lane >> (5 - log2 N)) & (N - 1), which
// the 32 / N lanes of each group of that many consecutive lanes all hold. v is overwritten. The order
// of the additions is fixed (deterministic), but not the one-tree-per-value order.
template <int N>
__device__ __forceinline__ float warp_sum_scatter(float (&v)[N], int lane) {
  static_assert(N == 2 || N == 4 || N == 8 || N == 16, "N values, a power of two up to 16");
#pragma unroll
  for (int half = N / 2, m = 16; half >= 1; half >>= 1, m >>= 1) {
    const bool up = (lane & m) != 0;
#pragma unroll
    for (int j = 0; j < half; ++j) {
      const float keep = up ? v[half + j] : v[j];
      const float send = up ? v[j] : v[half + j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, m);
    }
  }
  float r = v[0];
#pragma unroll
  for (int m = 32 / (2 * N); m >= 1; m >>= 1) r += __shfl_xor_sync(0xffffffffu, r, m);
  return r;
}

// x, with the compiler unable to see where it came from: a loop-invariant value laundered per
// iteration is recomputed there instead of hoisted out of the loop and kept in a register (or
// spilled) for the whole loop. For the wgmma descriptors of the grads kernel's V loop.
__device__ __forceinline__ uint64_t opaque(uint64_t x) {
#ifndef KF_EMU
  asm volatile("mov.b64 %0, %0;" : "+l"(x));
#endif
  return x;
}
__device__ __forceinline__ int opaque(int x) {
#ifndef KF_EMU
  asm volatile("mov.b32 %0, %0;" : "+r"(x));
#endif
  return x;
}

// Element index of (r, c) in a 128-byte-swizzled 16-bit tile of kRows rows stored as blocks of
// [kRows][64 columns] (sw128_offset within a block; blocks kRows * 128 bytes apart). The wgmma
// descriptors below address such tiles; ldsm_*_sw read mma.sync fragments from them.
template <int kRows>
__host__ __device__ __forceinline__ int sw128_index(int r, int c) {
  return (c >> 6) * (kRows * 64) + static_cast<int>(sw128_offset(r, c & 63)) / 2;
}
// K-major operand of k-step kk (16 columns) over all kRows rows of such a tile (A: rows = m; B:
// rows = n): 16 columns = 32 bytes into a 64-column block, 8-row groups 1024 bytes apart.
// sw128_k_bytes: where k-step kk starts, in bytes from the tile; sw128_desc_plus moves a
// descriptor's start by that many bytes (its address field counts 16-byte units; tiles stay below
// 256 KB, so the field does not carry), for loops that build the k-step 0 descriptor once.
template <int kRows>
__host__ __device__ constexpr uint32_t sw128_k_bytes(int kk) {
  return static_cast<uint32_t>((kk >> 2) * (kRows * 128) + (kk & 3) * 32);
}
__device__ __forceinline__ uint64_t sw128_desc_plus(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }
template <int kRows, typename T>
__device__ __forceinline__ uint64_t sw128_desc_k(const T* tile, int kk) {
  return sw128_desc(smem_u32(tile) + sw128_k_bytes<kRows>(kk), 16, 1024);
}
// MN-major B of such a tile: B[k = tile row r0 + 0..15][n = column c0 + ..] (the n range must stay
// inside one 64-column block): 8-row groups 1024 bytes apart, 64-column blocks kRows * 128 bytes.
template <int kRows, typename T>
__device__ __forceinline__ uint64_t sw128_desc_mn(const T* tile, int r0, int c0) {
  return sw128_desc(smem_u32(tile) + (c0 >> 6) * (kRows * 128) + (c0 & 63) * 2 + r0 * 128, kRows * 128, 1024);
}
// ldsm_b / ldsm_b_t's fragments from a 128-byte-swizzled tile of kRows rows (sw128_index): every 8 x 8 matrix is
// 8 rows x 16 bytes at one column chunk, which the swizzle spreads over 8 bank groups.
template <int kRows, typename T>
__device__ __forceinline__ void ldsm_b_sw(uint32_t (&r)[4], const T* tile, int r0, int c0) {
  const int l = threadIdx.x & 31;
  ldsm_x4(r, tile + sw128_index<kRows>(r0 + (l >> 4) * 8 + (l & 7), c0 + ((l >> 3) & 1) * 8));
}
template <int kRows, typename T>
__device__ __forceinline__ void ldsm_b_t_sw(uint32_t (&r)[4], const T* tile, int r0, int c0) {
  const int l = threadIdx.x & 31;
  ldsm_x4_t(r, tile + sw128_index<kRows>(r0 + ((l >> 3) & 1) * 8 + (l & 7), c0 + (l >> 4) * 8));
}

}  // namespace kernel_fun::kda::dev
