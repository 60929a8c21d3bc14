// Small kernels that check the emulator itself (tests/test_emu_kda_fwd.py): mma.sync / ldmatrix
// fragment layouts against a plain matmul, the deferral of cp.async and of wgmma, and the failure reports
// (divergent collectives, deadlock, smem overflow). They call the same helpers as the KDA kernels
// (kda_device.cuh), so these checks cover the KF_EMU branches of that header.
#include "kf_emu.h"

#include <exception>
#include <string>

#include "common/pipeline.cuh"
#include "common/tma_desc.h"
#include "kda/device/primitives.cuh"

namespace {
namespace dev = kernel_fun::kda::dev;
namespace pipe = kernel_fun::dev;  // common/pipeline.cuh
thread_local std::string g_err;

template <typename F>
int guarded(F&& f) {
  g_err.clear();
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_err = e.what();
    return 1;
  }
}

constexpr int kP = 24;  // padded smem row (elements)

// D1 = A @ B + C with B read by ldmatrix.trans from a [k][n] tile; D2 = the same with B read by
// ldmatrix (non-transposed) from its [n][k] transpose. A, B: 16x16 raw 16-bit; C, D: 16x16 fp32.
template <typename T>
__global__ void mma16816_kernel(const uint16_t* A, const uint16_t* B, const float* C, float* D1, float* D2) {
  KF_DYN_SMEM(float4, smem_f4);
  uint16_t* sA = reinterpret_cast<uint16_t*>(smem_f4);
  uint16_t* sBkn = sA + 16 * kP;
  uint16_t* sBnk = sBkn + 16 * kP;
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3, lrow = lane & 7, lmat = lane >> 3;
  for (int i = lane; i < 256; i += 32) {
    const int r = i / 16, c = i % 16;
    sA[r * kP + c] = A[i];
    sBkn[r * kP + c] = B[i];
    sBnk[c * kP + r] = B[i];
  }
  __syncwarp();
  uint32_t a[4], bt[4], bn[4];
  dev::ldsm_x4(a, sA + ((lmat & 1) * 8 + lrow) * kP + (lmat >> 1) * 8);
  dev::ldsm_x4_t(bt, sBkn + ((lmat & 1) * 8 + lrow) * kP + (lmat >> 1) * 8);
  dev::ldsm_x4(bn, sBnk + ((lmat >> 1) * 8 + lrow) * kP + (lmat & 1) * 8);
  for (int nt = 0; nt < 2; ++nt) {
    float c1[4], c2[4];
    for (int e = 0; e < 4; ++e) c1[e] = c2[e] = C[(g + 8 * (e >> 1)) * 16 + 8 * nt + 2 * t + (e & 1)];
    dev::mma_16816<T>(c1, a, bt[2 * nt], bt[2 * nt + 1]);
    dev::mma_16816<T>(c2, a, bn[2 * nt], bn[2 * nt + 1]);
    for (int e = 0; e < 4; ++e) {
      const int idx = (g + 8 * (e >> 1)) * 16 + 8 * nt + 2 * t + (e & 1);
      D1[idx] = c1[e];
      D2[idx] = c2[e];
    }
  }
}

// D = tf32(A) @ tf32(B) + C, A 16x8, B 8x8 ([k][n]), C / D 16x8, all fp32 row-major.
__global__ void mma1688_kernel(const float* A, const float* B, const float* C, float* D) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const uint32_t a[4] = {dev::to_tf32(A[g * 8 + t]), dev::to_tf32(A[(g + 8) * 8 + t]), dev::to_tf32(A[g * 8 + t + 4]),
                         dev::to_tf32(A[(g + 8) * 8 + t + 4])};
  float c[4];
  for (int e = 0; e < 4; ++e) c[e] = C[(g + 8 * (e >> 1)) * 8 + 2 * t + (e & 1)];
  dev::mma_1688_tf32(c, a, dev::to_tf32(B[t * 8 + g]), dev::to_tf32(B[(t + 4) * 8 + g]));
  for (int e = 0; e < 4; ++e) D[(g + 8 * (e >> 1)) * 8 + 2 * t + (e & 1)] = c[e];
}

// Per thread i (32 threads): group 0 copies src[4i .. 4i+3] to sA, group 1 zero-fills sB
// (src-size 0). out[k * 32 + i] (raw fp32 bits), k = 0: sA before any wait; 1: sB before any wait;
// 2: sA after wait_group 1; 3: sB after wait_group 1; 4: sB after wait_group 0.
__global__ void cp_async_kernel(const float* src, uint32_t* out) {
  KF_DYN_SMEM(float4, smem_f4);
  float* sA = reinterpret_cast<float*>(smem_f4);
  float* sB = sA + 128;
  const int i = threadIdx.x;
  dev::cp_async16(sA + 4 * i, src + 4 * i, 16);
  dev::cp_async_commit();
  dev::cp_async16(sB + 4 * i, src + 4 * i, 0);
  dev::cp_async_commit();
  out[0 * 32 + i] = __float_as_uint(sA[4 * i]);
  out[1 * 32 + i] = __float_as_uint(sB[4 * i]);
  dev::cp_async_wait<1>();
  out[2 * 32 + i] = __float_as_uint(sA[4 * i]);
  out[3 * 32 + i] = __float_as_uint(sB[4 * i]);
  dev::cp_async_wait<0>();
  out[4 * 32 + i] = __float_as_uint(sB[4 * i]);
}

// wgmma m64n64k16 (bf16, A from registers) by one warpgroup, deferred to its wait_group (kf_emu.h).
// A [64][16] and B [16][64] raw bf16, C [64][64] fp32; out: 6 x [64][64] words (raw fp32 bits).
// which 0, correct use: out[0] the accumulator after the issue, before its wait (poison);
// out[1] = A B + C (B K-major, acc); out[2] = 2 A B (two chained products into one accumulator in one
// group, B MN-major); two groups, then wait_group 1: out[3] the first group's A B, out[4] the
// second's accumulator (still poison); wait_group 0: out[5] the second's A B. N = 32 (columns 0-31 of
// the slot): out[6] = A B[:, 0:32] with A from shared memory too (wgmma_ss, A K-major swizzled);
// out[7] = A B[:, 32:64] through an MN-major descriptor that starts inside the 64-column swizzle
// block (+64 bytes: the grads kernel's column quarters).
// Misuse the emulator must report: 1 no wait_group before the thread exits, 2 the accumulator
// written before its wait, 3 no wgmma.fence before an issue that follows a wait, 4 the A registers
// changed before the wait.
__global__ void wgmma_kernel(int which, const uint16_t* A, const uint16_t* B, const float* C, uint32_t* out) {
  KF_DYN_SMEM(float4, smem_f4);
  uint16_t* tK = reinterpret_cast<uint16_t*>(smem_f4);  // K-major B: row n = B[:, n], [64][64] swizzled
  uint16_t* tMN = tK + 64 * 64;                          // MN-major B: row k = B[k, :], [16][64] swizzled
  uint16_t* tA = tMN + 16 * 64;                          // K-major A: row m = A[m, :], [64][64] swizzled
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  for (int i = tid; i < 64 * 64; i += 128) {
    const int r = i / 64, c = i % 64;
    tK[dev::sw128_offset(r, c) / 2] = c < 16 ? B[c * 64 + r] : uint16_t{0};
    tA[dev::sw128_offset(r, c) / 2] = c < 16 ? A[r * 16 + c] : uint16_t{0};
    if (r < 16) tMN[dev::sw128_offset(r, c) / 2] = B[r * 64 + c];
  }
  __syncthreads();
  const uint64_t dK = dev::sw128_desc(dev::smem_u32(tK), 16, 1024);
  const uint64_t dMN = dev::sw128_desc(dev::smem_u32(tMN), 8192, 1024);
  const int r0 = 16 * warp + g;
  auto pk = [&](int r, int c) { return static_cast<uint32_t>(A[r * 16 + c]) | (static_cast<uint32_t>(A[r * 16 + c + 1]) << 16); };
  uint32_t a[4] = {pk(r0, 2 * t), pk(r0 + 8, 2 * t), pk(r0, 2 * t + 8), pk(r0 + 8, 2 * t + 8)};
  auto put = [&](int slot, const float (&d)[8][4]) {
    for (int j = 0; j < 8; ++j)
      for (int e = 0; e < 4; ++e)
        out[(slot * 64 + r0 + 8 * (e >> 1)) * 64 + 8 * j + 2 * t + (e & 1)] = __float_as_uint(d[j][e]);
  };
  float d1[8][4], d2[8][4], d3[8][4], d4[8][4];
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e) d1[j][e] = C[(r0 + 8 * (e >> 1)) * 64 + 8 * j + 2 * t + (e & 1)];
  dev::wgmma_fence();
  dev::wgmma_rs<__nv_bfloat16, 64, 0>(d1, a, dK, true);
  if (which == 2) d1[0][0] = 1.f;
  if (which == 4) a[0] ^= 1u;
  put(0, d1);
  dev::wgmma_commit();
  if (which == 1) return;
  dev::wgmma_wait<0>();
  put(1, d1);
  if (which != 3) dev::wgmma_fence();
  dev::wgmma_rs<__nv_bfloat16, 64, 1>(d2, a, dMN, false);
  dev::wgmma_rs<__nv_bfloat16, 64, 1>(d2, a, dMN, true);
  dev::wgmma_commit();
  dev::wgmma_wait<0>();
  put(2, d2);
  dev::wgmma_fence();
  dev::wgmma_rs<__nv_bfloat16, 64, 1>(d3, a, dMN, false);
  dev::wgmma_commit();
  dev::wgmma_rs<__nv_bfloat16, 64, 0>(d4, a, dK, false);
  dev::wgmma_commit();
  dev::wgmma_wait<1>();
  put(3, d3);
  put(4, d4);
  dev::wgmma_wait<0>();
  put(5, d4);
  float d5[4][4], d6[4][4];
  auto put32 = [&](int slot, const float (&d)[4][4]) {
    for (int j = 0; j < 4; ++j)
      for (int e = 0; e < 4; ++e)
        out[(slot * 64 + r0 + 8 * (e >> 1)) * 64 + 8 * j + 2 * t + (e & 1)] = __float_as_uint(d[j][e]);
  };
  dev::wgmma_fence();
  dev::wgmma_ss<__nv_bfloat16, 32, 0>(d5, dev::sw128_desc(dev::smem_u32(tA), 16, 1024), dK, false);
  dev::wgmma_rs<__nv_bfloat16, 32, 1>(d6, a, dev::sw128_desc(dev::smem_u32(tMN) + 64, 8192, 1024), false);
  dev::wgmma_commit();
  dev::wgmma_wait<0>();
  put32(6, d5);
  put32(7, d6);
}

// Bugs the emulator must report: 0 a shuffle in divergent code (half the warp at another
// collective), 1 a barrier that only half the block reaches while the rest waits in a shuffle
// (deadlock), 2 a write past the end of the dynamic shared memory, 3 ldmatrix from a misaligned row.
__global__ void bug_kernel(int which, float* out) {
  KF_DYN_SMEM(float4, smem_f4);
  float* s = reinterpret_cast<float*>(smem_f4);
  const int tid = threadIdx.x;
  if (which == 0) {
    float v = 1.f;
    if (tid < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
    else __syncwarp();
    out[tid] = v;
  } else if (which == 1) {
    if (tid < 48) __syncthreads();
    else out[tid] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
  } else if (which == 2) {
    s[tid + 1] = 0.f;  // 64 threads, 64 floats of smem: thread 63 writes one past the end
  } else {
    uint32_t r[4];
    s[tid] = 0.f;
    __syncthreads();
    dev::ldsm_x4(r, s + (tid & 31) * 1 + 2);
    out[tid] = __uint_as_float(r[0]);
  }
}

// Shuffles (every mode, with widths), votes and an 8-byte shuffle: 64 threads, out[k * 64 + tid].
__global__ void warp_ops_kernel(int* out) {
  const int t = threadIdx.x;
  const unsigned full = 0xffffffffu;
  out[0 * 64 + t] = __shfl_sync(full, 10 * t, (t + 3) & 31);
  out[1 * 64 + t] = __shfl_up_sync(full, t, 3, 8);
  out[2 * 64 + t] = __shfl_down_sync(full, t, 2, 16);
  out[3 * 64 + t] = __shfl_xor_sync(full, t, 5);
  out[4 * 64 + t] = __shfl_xor_sync(full, t, 4, 4);
  out[5 * 64 + t] = __shfl_sync(full, t, 9, 8);
  out[6 * 64 + t] = static_cast<int>(__ballot_sync(full, t % 3 == 0));
  out[7 * 64 + t] = __any_sync(full, t == 40);
  out[8 * 64 + t] = __all_sync(full, t < 63);
  out[9 * 64 + t] = static_cast<int>(2.0 * __shfl_xor_sync(full, t + 0.5, 1));
  out[10 * 64 + t] = static_cast<int>(blockDim.x * 1000 + gridDim.x * 100 + blockIdx.x);
}

// A static __shared__ variable, atomics on it, and barriers after some threads exited: threads >= 40
// return at once; the other 40 count themselves. out[blockIdx.x] = 40.
__global__ void static_smem_kernel(int* out) {
  __shared__ int count;
  if (threadIdx.x >= 40) return;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  atomicAdd(&count, 1);
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = count;
}


// A warp-specialised TMA pipeline through common/pipeline.cuh: thread 0 (the producer) loads the
// 16 x 64 bf16 tiles of a [16 ntiles, 64] matrix into a 2-stage ring; threads 32..95 (one per
// column) add every tile's rows and release the stage. out[c] = the column sum. Misuse: 1 the
// consumers skip the full-barrier wait (they read poison), 2 the producer skips the empty-barrier
// wait (it refills a stage still being read), 3 there is no producer (the consumers' wait deadlocks).
constexpr int kTileRows = 16, kTileCols = 64, kStageBytes = kTileRows * kTileCols * 2;
__global__ void tma_pipeline_kernel(const __grid_constant__ CUtensorMap map, int ntiles, int which, float* out) {
  KF_DYN_SMEM(float4, smem_f4);
  char* sm = reinterpret_cast<char*>(smem_f4);
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + 2 * kStageBytes);
  uint64_t* empty = full + 2;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < 2; ++s) {
      pipe::mbar_init(&full[s], 1);
      pipe::mbar_init(&empty[s], 64);
    }
    pipe::mbar_init_fence();
  }
  __syncthreads();
  if (tid < 32) {
    if (tid == 0 && which != 3) {
      for (int t = 0; t < ntiles; ++t) {
        const int s = t & 1, ph = (t >> 1) & 1;
        if (which != 2) pipe::mbar_wait(&empty[s], ph ^ 1);
        pipe::mbar_arrive_expect_tx(&full[s], kStageBytes);
        pipe::tma_load_2d(sm + s * kStageBytes, &map, 0, kTileRows * t, &full[s]);
      }
    }
    return;
  }
  const int col = tid - 32;
  float acc = 0.f;
  for (int t = 0; t < ntiles; ++t) {
    const int s = t & 1, ph = (t >> 1) & 1;
    if (which != 1) pipe::mbar_wait(&full[s], ph);
    const uint16_t* st = reinterpret_cast<const uint16_t*>(sm + s * kStageBytes);
    for (int r = 0; r < kTileRows; ++r) acc += __uint_as_float(static_cast<uint32_t>(st[r * kTileCols + col]) << 16);
    pipe::mbar_arrive(&empty[s]);
  }
  out[col] = acc;
}

// One 8 x 64 bf16 box with the 128-byte swizzle, rows from `row0` of a [rows, 64] matrix (rows past
// the end land as zeros), copied out as the raw 1024 bytes of shared memory; also a 1-D bulk copy of
// 32 bytes after it. 32 threads; thread 0 issues, all wait.
__global__ void tma_swizzle_kernel(const __grid_constant__ CUtensorMap map, int row0, const uint16_t* src,
                                   uint16_t* out) {
  KF_DYN_SMEM(float4, smem_f4);
  char* sm = reinterpret_cast<char*>(smem_f4);
  uint64_t* bar = reinterpret_cast<uint64_t*>(sm + 1024 + 32);
  if (threadIdx.x == 0) {
    pipe::mbar_init(bar, 1);
    pipe::mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    pipe::mbar_arrive_expect_tx(bar, 1024 + 32);
    pipe::tma_load_2d(sm, &map, 0, row0, bar);
    pipe::bulk_load(sm + 1024, src, 32, bar);
  }
  pipe::mbar_wait(bar, 0);
  const uint16_t* s16 = reinterpret_cast<const uint16_t*>(sm);
  for (int i = threadIdx.x; i < 512 + 16; i += 32) out[i] = s16[i];
}


// A 2-CTA cluster handing tiles over through distributed shared memory: rank 0 (producer) writes
// each tile straight into rank 1's 2-stage ring (map_shared_rank) and arrives on rank 1's "full"
// barrier (mbar_arrive_remote); rank 1's threads wait on it, sum their column and release the stage
// by arriving on rank 0's "empty" barrier. 64 threads per CTA, one column each. out[c] = the column
// sums. `bug`: 1 no cluster_sync after the mbarrier inits (the producer may arrive on a barrier not
// yet initialised), 2 the producer exits without the final cluster_sync (the consumer's releases
// then arrive on a CTA that is gone), 3 rank 1 waits for one tile more than rank 0 sends (a
// deadlock: rank 0 in the final cluster barrier, rank 1 on its full barrier), 4 a mapa of an
// address outside the CTA's shared memory. (Threads that have exited count as arrived at
// barrier.cluster, as at __syncthreads here.)
__global__ void cluster_handoff_kernel(int ntiles, int bug, float* out) {
  KF_DYN_SMEM(float4, smem_f4);
  float* stage = reinterpret_cast<float*>(smem_f4);                 // [2][64], used on rank 1
  uint64_t* full = reinterpret_cast<uint64_t*>(stage + 2 * 64);     // rank 1's
  uint64_t* empty = full + 2;                                       // rank 0's
  const int tid = threadIdx.x;
  const uint32_t rank = pipe::cluster_ctarank();
  if (tid == 0) {
    for (int s = 0; s < 2; ++s) {
      pipe::mbar_init(&full[s], 64);   // one arrival per producer thread
      pipe::mbar_init(&empty[s], 64);  // one per consumer thread
    }
    pipe::mbar_init_fence();
  }
  __syncthreads();
  if (bug != 1) pipe::cluster_sync();
  if (bug == 4 && rank == 0 && tid == 0) pipe::map_shared_rank(out, 1);
  if (rank == 0) {
    float* peer = pipe::map_shared_rank(stage, 1);
    for (int t = 0; t < ntiles; ++t) {
      const int s = t & 1, ph = (t >> 1) & 1;
      pipe::mbar_wait<true>(&empty[s], ph ^ 1);
      peer[s * 64 + tid] = static_cast<float>(t * 100 + tid);
      pipe::mbar_arrive_remote(&full[s], 1);
    }
    if (bug == 2) return;
  } else {
    float acc = 0.f;
    for (int t = 0; t < ntiles + (bug == 3); ++t) {
      const int s = t & 1, ph = (t >> 1) & 1;
      pipe::mbar_wait<true>(&full[s], ph);
      acc += stage[s * 64 + tid];
      pipe::mbar_arrive_remote(&empty[s], 0);
    }
    out[tid] = acc;
  }
  pipe::cluster_sync();  // no CTA leaves while a peer may still arrive on its barriers
}

}  // namespace

extern "C" {

// out: 11 * 64 ints (warp_ops_kernel), then 3 ints (static_smem_kernel over 3 blocks)
int kf_emu_selftest_warp_ops(int* out) {
  return guarded([&] {
    kf_emu::launch(dim3(1), dim3(64), 0, warp_ops_kernel, out);
    kf_emu::launch(dim3(3), dim3(64), 0, static_smem_kernel, out + 11 * 64);
  });
}

const char* kf_emu_selftest_last_error() { return g_err.c_str(); }

// dtype 1: fp16, 2: bf16 (raw 16-bit inputs)
int kf_emu_selftest_mma16816(int dtype, const uint16_t* A, const uint16_t* B, const float* C, float* D1,
                             float* D2) {
  return guarded([&] {
    const size_t smem = 3 * 16 * kP * sizeof(uint16_t);
    if (dtype == 1) kf_emu::launch(dim3(1), dim3(32), smem, mma16816_kernel<__half>, A, B, C, D1, D2);
    else kf_emu::launch(dim3(1), dim3(32), smem, mma16816_kernel<__nv_bfloat16>, A, B, C, D1, D2);
  });
}

int kf_emu_selftest_mma1688(const float* A, const float* B, const float* C, float* D) {
  return guarded([&] { kf_emu::launch(dim3(1), dim3(32), 0, mma1688_kernel, A, B, C, D); });
}

void kf_emu_selftest_tf32(const float* x, uint32_t* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = kf_emu::cvt_rna_tf32(x[i]);
}

int kf_emu_selftest_cp_async(const float* src, uint32_t* out) {
  return guarded([&] { kf_emu::launch(dim3(1), dim3(32), 2 * 128 * sizeof(float), cp_async_kernel, src, out); });
}

int kf_emu_selftest_wgmma(int which, const uint16_t* A, const uint16_t* B, const float* C, uint32_t* out) {
  return guarded([&] { kf_emu::launch(dim3(1), dim3(128), 2 * 64 * 64 * 2 + 16 * 64 * 2, wgmma_kernel, which, A, B, C, out); });
}

int kf_emu_selftest_bug(int which, float* out) {
  return guarded([&] { kf_emu::launch(dim3(1), dim3(64), 64 * sizeof(float), bug_kernel, which, out); });
}


// src: [16 ntiles, 64] bf16 (raw); out: 64 floats
int kf_emu_selftest_tma_pipeline(int which, const uint16_t* src, int ntiles, float* out) {
  return guarded([&] {
    const uint64_t dims[2] = {kTileCols, static_cast<uint64_t>(kTileRows) * ntiles}, strides[2] = {0, kTileCols * 2};
    const uint32_t box[2] = {kTileCols, kTileRows};
    const CUtensorMap map = kernel_fun::make_tma_desc(src, 2, kernel_fun::DType::kBFloat16, dims, strides, box, 0);
    kf_emu::launch(dim3(1), dim3(96), 2 * kStageBytes + 64, tma_pipeline_kernel, map, ntiles, which, out);
  });
}

// src: [rows, 64] bf16 (raw); out: 528 uint16 (the swizzled box, then the 16 elements of the 1-D copy)
int kf_emu_selftest_tma_swizzle(const uint16_t* src, int rows, int row0, uint16_t* out) {
  return guarded([&] {
    const uint64_t dims[2] = {64, static_cast<uint64_t>(rows)}, strides[2] = {0, 128};
    const uint32_t box[2] = {64, 8};
    const CUtensorMap map = kernel_fun::make_tma_desc(src, 2, kernel_fun::DType::kBFloat16, dims, strides, box, 128);
    kf_emu::launch(dim3(1), dim3(32), 1024 + 64, tma_swizzle_kernel, map, row0, src, out);
  });
}


// out: 64 floats (the consumer's column sums)
int kf_emu_selftest_cluster(int ntiles, int bug, float* out) {
  return guarded([&] {
    kf_emu::launch_cluster(dim3(2), dim3(2), dim3(64), 2 * 64 * 4 + 64, cluster_handoff_kernel, ntiles, bug, out);
  });
}

}  // extern "C"
