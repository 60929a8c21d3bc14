// Launchers of the KDA forward scan kernels (kda_fwd_scan.cuh): v1 (kda_fwd_scan_kernel, launch_scan
// in kda_fwd_launch.h), v2 (kda_fwd_scan2_kernel, launch_scan2 here), v3, v4, v5 (kda_fwd_scan2_kernel
// with kWg = 1, 2, 3: launch_scan3, launch_scan4, launch_scan5). Only kda_fwd.cu calls them;
// each instantiation file under instantiations/ defines its variants with the macro below.
#pragma once

#include "kda/sm90/kda_fwd.h"

namespace kernel_fun::kda {

template <typename WT, int K, int BV>
void launch_scan2(const KdaFwdParams& p, cudaStream_t stream);

// v3 (opt-in, KERNEL_FUN_KDA_SCAN=v3): v2 with phase A on wgmma; BV in {64, 128}.
template <typename WT, int K, int BV>
void launch_scan3(const KdaFwdParams& p, cudaStream_t stream);

// v4 (opt-in, KERNEL_FUN_KDA_SCAN=v4): v3 with phase D (the state update) on wgmma too.
template <typename WT, int K, int BV>
void launch_scan4(const KdaFwdParams& p, cudaStream_t stream);

// v5 (opt-in, KERNEL_FUN_KDA_SCAN=v5): v4 with phases B and C on wgmma too.
template <typename WT, int K, int BV>
void launch_scan5(const KdaFwdParams& p, cudaStream_t stream);

}  // namespace kernel_fun::kda

#define KF_KDA_DEFINE_SCAN2(WT, K, BV)                                                          \
  namespace kernel_fun::kda {                                                                   \
  template <>                                                                                   \
  void launch_scan2<WT, K, BV>(const KdaFwdParams& p, cudaStream_t stream) {                    \
    constexpr size_t smem = Scan2Smem<WT, K, BV>::kBytes;                                       \
    auto kern = kda_fwd_scan2_kernel<WT, K, BV>;                                                \
    KF_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); \
    if (p.N == 0 || p.HV == 0) return;                                                          \
    kern<<<dim3(p.V / BV, p.HV, p.N), scan2_threads<BV>(), smem, stream>>>(p);                  \
    KF_CHECK_LAUNCH();                                                                          \
  }                                                                                             \
  }

#define KF_KDA_DEFINE_SCAN3(WT, K, BV)                                                          \
  namespace kernel_fun::kda {                                                                   \
  template <>                                                                                   \
  void launch_scan3<WT, K, BV>(const KdaFwdParams& p, cudaStream_t stream) {                    \
    constexpr size_t smem = Scan2Smem<WT, K, BV>::kBytes;                                       \
    auto kern = kda_fwd_scan2_kernel<WT, K, BV, 1>;                                             \
    KF_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); \
    if (p.N == 0 || p.HV == 0) return;                                                          \
    kern<<<dim3(p.V / BV, p.HV, p.N), scan2_threads<BV>(), smem, stream>>>(p);                  \
    KF_CHECK_LAUNCH();                                                                          \
  }                                                                                             \
  }

#define KF_KDA_DEFINE_SCAN4(WT, K, BV)                                                          \
  namespace kernel_fun::kda {                                                                   \
  template <>                                                                                   \
  void launch_scan4<WT, K, BV>(const KdaFwdParams& p, cudaStream_t stream) {                    \
    constexpr size_t smem = Scan2Smem<WT, K, BV>::kBytes;                                       \
    auto kern = kda_fwd_scan2_kernel<WT, K, BV, 2>;                                             \
    KF_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); \
    if (p.N == 0 || p.HV == 0) return;                                                          \
    kern<<<dim3(p.V / BV, p.HV, p.N), scan2_threads<BV>(), smem, stream>>>(p);                  \
    KF_CHECK_LAUNCH();                                                                          \
  }                                                                                             \
  }

#define KF_KDA_DEFINE_SCAN5(WT, K, BV)                                                          \
  namespace kernel_fun::kda {                                                                   \
  template <>                                                                                   \
  void launch_scan5<WT, K, BV>(const KdaFwdParams& p, cudaStream_t stream) {                    \
    constexpr size_t smem = Scan2Smem<WT, K, BV>::kBytes;                                       \
    auto kern = kda_fwd_scan2_kernel<WT, K, BV, 3>;                                             \
    KF_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); \
    if (p.N == 0 || p.HV == 0) return;                                                          \
    kern<<<dim3(p.V / BV, p.HV, p.N), scan2_threads<BV>(), smem, stream>>>(p);                  \
    KF_CHECK_LAUNCH();                                                                          \
  }                                                                                             \
  }
