// The experimental 32-token forward intra (csrc/kda/fwd/kda_fwd_intra_c32.cuh) beside the 64-token
// kernel on the GPU, without torch: both on the same random inputs (the bench cases' gates: bounded,
// or unbounded for prod8192 and k3_h32), each timed by CUDA
// events (the median of 7 rounds of 20 launches). Also a check that the two agree where they must:
// the first 32 rows of a 64-token chunk are a 32-token chunk of their own (the same chunk-local
// cumsum, diagonal blocks, first merge step and first two row blocks of w), so qg, w and the first
// 32 columns of Aqk and Akk must be bitwise equal on those rows (kg and exp2(G) depend on where the
// chunk ends, so they differ).
//
//   bash scripts/dev/intra_c32_bench.sh            (builds with setup.py's flags, runs; GPU only)
//
// Then the whole forward (no streaming, no split): the 64-token intra and scan against the 32-token
// intra and scan (kda_fwd_scan_c32_kernel), each scan at BV 64 and 128, and the rel-RMS difference of
// the two o (both bf16 roundings of the same function: ~1e-3 expected).
// Prints one line per case: ms of each kernel, their ratio, and the mismatch counts (0 expected); then
// each kernel's phases in cycles per CTA (means of the clock64() stamps of one more launch with
// KdaFwdParams::dbg_intra_clock set: P0 + P1, offsets, P2 + queue, P3, merges, P4b; the 32-token
// kernel's CTA holds half the tokens and shares its SM with three others, the 64-token one's with one).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kda/fwd/kda_fwd_intra_c32.cuh"

using namespace kernel_fun;
using namespace kernel_fun::kda;
using WT = __nv_bfloat16;
constexpr int K = 128;

#define CK(x) KF_CUDA_CHECK(x)

// Deterministic pseudo-random fill: an integer hash per element, a sum of four uniforms (~normal).
__device__ inline float hash_normal(uint64_t i, uint32_t seed) {
  float s = 0.f;
  for (int r = 0; r < 4; ++r) {
    uint64_t x = (i * 4 + r) * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
    x ^= x >> 31;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 29;
    s += static_cast<float>(x >> 40) * (1.f / 16777216.f);
  }
  return (s - 2.f) * 1.7320508f;  // mean 0, variance 1
}
template <typename T>
__global__ void fill(T* x, size_t n, uint32_t seed, float scale, float shift) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float v = shift + scale * hash_normal(i, seed);
    if constexpr (sizeof(T) == 2) x[i] = __float2bfloat16(v);
    else x[i] = v;
  }
}
template <typename T>
T* alloc_fill(size_t n, uint32_t seed, float scale, float shift = 0.f) {
  T* p = nullptr;
  CK(cudaMalloc(&p, n * sizeof(T)));
  fill<T><<<1024, 256>>>(p, n, seed, scale, shift);
  CK(cudaGetLastError());
  return p;
}
template <typename T>
T* alloc(size_t n) {
  T* p = nullptr;
  CK(cudaMalloc(&p, n * sizeof(T)));
  CK(cudaMemset(p, 0xff, n * sizeof(T)));
  return p;
}

// Rows r of each 64-token chunk with r % 64 < 32: count the elements in columns [0, cols) whose bits
// differ between a (row stride sa) and b (row stride sb), over rows x heads.
__global__ void count_diff(const uint16_t* a, const uint16_t* b, int64_t rows, int heads, int sa, int sb, int cols,
                           unsigned long long* out) {
  unsigned long long n = 0;
  const int64_t total = rows * heads * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t rh = i / cols, col = i % cols, row = rh / heads;
    if (row % 64 >= 32) continue;
    n += a[rh * sa + col] != b[rh * sb + col];
  }
  atomicAdd(out, n);
}

struct Case {
  const char* name;
  int B, T, H, V;
  bool bounded;  // lower_bound -5 sigmoid gate (the midpoint P2), else -exp(A_log) softplus (one-sided P2)
};

// sums of (a - b)^2 and of a^2 over n bf16 elements
__global__ void diff_sums(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, double* out) {
  double d = 0.0, r = 0.0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    d += (x - y) * (x - y);
    r += x * x;
  }
  atomicAdd(out, d);
  atomicAdd(out + 1, r);
}

// Mean cycles between consecutive phase stamps 0..6 over n CTAs' rows of 16 (kda_phases.py's slots).
void phase_means(const long long* d_clk, int64_t n, double (&out)[6]) {
  std::vector<long long> h(static_cast<size_t>(n) * 16);
  CK(cudaMemcpy(h.data(), d_clk, h.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  for (double& x : out) x = 0.0;
  for (int64_t i = 0; i < n; ++i)
    for (int s = 0; s < 6; ++s) out[s] += static_cast<double>(h[i * 16 + s + 1] - h[i * 16 + s]);
  for (double& x : out) x /= static_cast<double>(n);
}

template <typename F>
float median_ms(F&& launch, int reps = 20, int rounds = 7) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> ms;
  for (int r = 0; r < rounds; ++r) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; ++i) launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t = 0.f;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t / reps);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms[ms.size() / 2];
}

int main() {
  const Case cases[] = {{"bounded_b16", 16, 8192, 16, 128, true},  {"bounded_b8_h32", 8, 8192, 32, 128, true},
                        {"long_b1_t32k", 1, 32768, 32, 128, true}, {"bounded_b1", 1, 8192, 16, 128, true},
                        {"prod8192", 16, 8192, 16, 256, false},    {"k3_h32", 8, 8192, 32, 128, false}};
  std::printf("%-16s %10s %10s %7s   mismatches qg / w / Aqk / Akk (first 32 rows of each 64-chunk)\n", "case",
              "C=64 ms", "C=32 ms", "32/64");
  for (const Case& cs : cases) {
    const int64_t BT = static_cast<int64_t>(cs.B) * cs.T;
    const int H = cs.H;
    KdaFwdParams p;
    p.B = p.N = cs.B;
    p.T = cs.T;
    p.H = p.HV = H;
    p.K = K;
    p.V = cs.V;
    p.dtype = DType::kBFloat16;
    p.g_dtype = DType::kFloat32;
    p.beta_dtype = DType::kBFloat16;
    p.opt.scale = 1.f / std::sqrt(static_cast<float>(K));
    p.opt.gate_mode = cs.bounded ? GateMode::kBounded : GateMode::kUnbounded;
    p.opt.lower_bound = cs.bounded ? -5.f : 0.f;
    p.opt.l2norm = true;
    p.opt.beta_sigmoid_scale = 1.f;
    p.q = alloc_fill<WT>(BT * H * K, 1, 1.f);
    p.k = alloc_fill<WT>(BT * H * K, 2, 1.f);
    p.v = alloc_fill<WT>(BT * H * cs.V, 7, 1.f);
    p.g = alloc_fill<float>(BT * H * K, 3, 1.f);
    p.beta = alloc_fill<WT>(BT * H, 4, 1.f);
    p.A_log = alloc_fill<float>(H, 5, 0.5f, 1.f);
    p.dt_bias = alloc_fill<float>(static_cast<size_t>(H) * K, 6, 0.5f);
    KdaFwdParams p64 = p, p32 = p;
    p64.max_chunks = cs.B * ((cs.T + 63) / 64);
    p32.max_chunks = static_cast<int>(chunk_bound(p, kC32));
    for (KdaFwdParams* q : {&p64, &p32}) {
      const int C = q == &p64 ? 64 : 32;
      q->w = alloc<WT>(BT * H * K);
      q->qg = alloc<WT>(BT * H * K);
      q->kg = alloc<WT>(BT * H * K);
      q->Aqk = alloc<WT>(BT * H * C);
      q->Akk = alloc<WT>(BT * H * C);
      q->gdecay = alloc<float>(static_cast<size_t>(q->max_chunks) * H * K);
      q->o = alloc<WT>(BT * H * cs.V);
    }
    CK(cudaDeviceSynchronize());
    const auto k64 = intra_kernel_for<WT, K>(p64);
    const LaunchShape s64 = intra_launch<WT, K>(p64), s32 = intra_c32_launch<WT, K>(p32);
    const float t64 = median_ms([&] { dev::launch_chunk_kernel(k64, s64, p64, 0); });
    const auto k32 = intra_c32_kernel_for<WT, K>(p32);
    const float t32 = median_ms([&] { dev::launch_chunk_kernel(k32, s32, p32, 0); });
    unsigned long long* cnt = nullptr;
    CK(cudaMalloc(&cnt, 4 * sizeof(unsigned long long)));
    CK(cudaMemset(cnt, 0, 4 * sizeof(unsigned long long)));
    auto u16 = [](void* x) { return static_cast<const uint16_t*>(x); };
    count_diff<<<1024, 256>>>(u16(p64.qg), u16(p32.qg), BT, H, K, K, K, cnt + 0);
    count_diff<<<1024, 256>>>(u16(p64.w), u16(p32.w), BT, H, K, K, K, cnt + 1);
    count_diff<<<1024, 256>>>(u16(p64.Aqk), u16(p32.Aqk), BT, H, 64, 32, 32, cnt + 2);
    count_diff<<<1024, 256>>>(u16(p64.Akk), u16(p32.Akk), BT, H, 64, 32, 32, cnt + 3);
    unsigned long long c[4];
    CK(cudaMemcpy(c, cnt, sizeof(c), cudaMemcpyDeviceToHost));
    std::printf("%-16s %10.3f %10.3f %7.3f   %llu / %llu / %llu / %llu\n", cs.name, t64, t32, t32 / t64, c[0], c[1],
                c[2], c[3]);
    // one launch of each with the phase clocks
    for (KdaFwdParams* q : {&p64, &p32}) {
      const LaunchShape& s = q == &p64 ? s64 : s32;
      const int64_t ctas = static_cast<int64_t>(s.grid.x) * s.grid.y;
      CK(cudaMalloc(&q->dbg_intra_clock, ctas * 16 * sizeof(long long)));
      CK(cudaMemset(q->dbg_intra_clock, 0, ctas * 16 * sizeof(long long)));
      if (q == &p64) dev::launch_chunk_kernel(k64, s64, p64, 0);
      else dev::launch_chunk_kernel(k32, s32, p32, 0);
      CK(cudaDeviceSynchronize());
      double m[6];
      phase_means(q->dbg_intra_clock, ctas, m);
      std::printf("    C=%d cycles per CTA: P0+P1 %.0f | offsets %.0f | P2+queue %.0f | P3 %.0f | merges %.0f | "
                  "P4b %.0f | CTA %.0f\n", q == &p64 ? 64 : 32, m[0], m[1], m[2], m[3], m[4], m[5],
                  m[0] + m[1] + m[2] + m[3] + m[4] + m[5]);
      CK(cudaFree(q->dbg_intra_clock));
      q->dbg_intra_clock = nullptr;
    }
    // the whole forward, intra then scan, at each chunk size and slice width
    float fwd[2][2];
    for (int bi = 0; bi < 2; ++bi) {
      fwd[0][bi] = median_ms([&] {
        dev::launch_chunk_kernel(k64, s64, p64, 0);
        if (bi == 0) dev::launch(kda_fwd_scan_kernel<WT, K, 64>, fwd_scan_launch<WT, K, 64>(p64), p64, 0);
        else dev::launch(kda_fwd_scan_kernel<WT, K, 128>, fwd_scan_launch<WT, K, 128>(p64), p64, 0);
      });
      fwd[1][bi] = median_ms([&] {
        dev::launch_chunk_kernel(k32, s32, p32, 0);
        if (bi == 0) dev::launch(kda_fwd_scan_c32_kernel<WT, K, 64>, scan_c32_launch<WT, K, 64>(p32), p32, 0);
        else dev::launch(kda_fwd_scan_c32_kernel<WT, K, 128>, scan_c32_launch<WT, K, 128>(p32), p32, 0);
      });
    }
    double* sums = nullptr;
    CK(cudaMalloc(&sums, 2 * sizeof(double)));
    CK(cudaMemset(sums, 0, 2 * sizeof(double)));
    diff_sums<<<1024, 256>>>(static_cast<const WT*>(p64.o), static_cast<const WT*>(p32.o), BT * H * cs.V, sums);
    double hs[2];
    CK(cudaMemcpy(hs, sums, sizeof(hs), cudaMemcpyDeviceToHost));
    CK(cudaFree(sums));
    std::printf("    forward (intra + scan) ms: C=64 BV64 %.3f BV128 %.3f | C=32 BV64 %.3f BV128 %.3f | best 32/64 %.3f | "
                "o rel-RMS between them %.2e\n", fwd[0][0], fwd[0][1], fwd[1][0], fwd[1][1],
                std::min(fwd[1][0], fwd[1][1]) / std::min(fwd[0][0], fwd[0][1]), std::sqrt(hs[0] / hs[1]));
    for (const void* x : {p.q, p.k, p.v, p.g, p.beta, static_cast<const void*>(p.A_log),
                          static_cast<const void*>(p.dt_bias)})
      CK(cudaFree(const_cast<void*>(x)));
    for (KdaFwdParams* q : {&p64, &p32})
      for (void* x : {q->w, q->qg, q->kg, q->Aqk, q->Akk, static_cast<void*>(q->gdecay), q->o}) CK(cudaFree(x));
    CK(cudaFree(cnt));
  }
  return 0;
}
