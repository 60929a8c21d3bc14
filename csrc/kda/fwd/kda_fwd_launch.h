// Launchers of the KDA forward kernels, defined next to their kernels (kda_fwd_intra.cuh,
// kda_fwd_scan.cuh) and explicitly instantiated one variant per file under instantiations/, so the
// variants compile in parallel. Only kda_fwd.cu calls these (the public entry points are in
// kda/kda_launch.h).
#pragma once

#include "kda/kda_launch_shape.h"
#include "kda/kda_problem.h"

namespace kernel_fun::kda {

template <typename WT, int K>
void launch_intra(const KdaFwdParams& p, cudaStream_t stream);

template <typename WT, int K, int BV>  // BV in {64, 128}
void launch_scan(const KdaFwdParams& p, cudaStream_t stream);

template <typename WT, int K, int BV>  // the split forward's pass 1 (kda_fwd_scan_local_kernel)
void launch_scan_local(const KdaFwdParams& p, cudaStream_t stream);

template <typename WT, int K, int BV>  // kda_fwd_fused.cuh, version 0; BV = 128 only is instantiated
void launch_fused(const KdaFwdParams& p, cudaStream_t stream);

// The 32-token forward (kda_fwd_intra_c32.cuh; kC32 in kda_problem.h): bf16 and fp16 at K = 128 are
// instantiated.
template <typename WT, int K>
void launch_intra_c32(const KdaFwdParams& p, cudaStream_t stream);
template <typename WT, int K, int BV>
void launch_scan_c32(const KdaFwdParams& p, cudaStream_t stream);

}  // namespace kernel_fun::kda
