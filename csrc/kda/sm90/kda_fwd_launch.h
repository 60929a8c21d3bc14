// Per-variant launchers of the KDA forward kernels (one explicit instantiation per file under
// instantiations/, so the variants compile in parallel). Only kda_fwd.cu calls these.
#pragma once

#include "kda/sm90/kda_fwd.h"

namespace kernel_fun::kda {

template <typename WT, int K>
void launch_intra(const KdaFwdParams& p, cudaStream_t stream);

template <typename WT, int K, int BV>
void launch_scan(const KdaFwdParams& p, cudaStream_t stream);

}  // namespace kernel_fun::kda

// Defines launch_intra<WT, K> / launch_scan<WT, K, BV> in an instantiation file.
#define KF_KDA_DEFINE_INTRA(WT, K)                                                              \
  namespace kernel_fun::kda {                                                                   \
  template <>                                                                                   \
  void launch_intra<WT, K>(const KdaFwdParams& p, cudaStream_t stream) {                        \
    constexpr size_t smem = IntraSmem<K>::kBytes;                                               \
    auto kern = kda_fwd_intra_kernel<WT, K>;                                                    \
    KF_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); \
    if (p.max_chunks == 0 || p.HV == 0) return;                                                 \
    kern<<<dim3(p.max_chunks, p.HV), kIntraThreads, smem, stream>>>(p);                         \
    KF_CHECK_LAUNCH();                                                                          \
  }                                                                                             \
  }

#define KF_KDA_DEFINE_SCAN(WT, K, BV)                                                           \
  namespace kernel_fun::kda {                                                                   \
  template <>                                                                                   \
  void launch_scan<WT, K, BV>(const KdaFwdParams& p, cudaStream_t stream) {                     \
    constexpr size_t smem = ScanSmem<WT, K, BV>::kBytes;                                        \
    auto kern = kda_fwd_scan_kernel<WT, K, BV>;                                                 \
    KF_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); \
    if (p.N == 0 || p.HV == 0) return;                                                          \
    kern<<<dim3(p.V / BV, p.HV, p.N), kScanThreads, smem, stream>>>(p);                         \
    KF_CHECK_LAUNCH();                                                                          \
  }                                                                                             \
  }
