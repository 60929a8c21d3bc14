// Launchers of the KDA backward kernels, defined next to their kernels and explicitly instantiated
// one variant per file under instantiations/. Only kda_bwd.cu calls these (the public entry points
// are in kda/kda_launch.h).
#pragma once

#include "kda/kda_launch_shape.h"
#include "kda/kda_problem.h"

namespace kernel_fun::kda {

template <typename WT, int K, int BV>  // BV in {64, 128}
void launch_dh_scan(const KdaBwdParams& p, cudaStream_t stream);

template <typename WT, int K, int BV>  // the split backward's pass 1 (kda_bwd_dh_scan_local_kernel)
void launch_dh_scan_local(const KdaBwdParams& p, cudaStream_t stream);

template <typename WT, int K, int BV>  // both scans in one launch (kda_bwd_scans.cuh)
void launch_scans(const KdaBwdParams& p, cudaStream_t stream);

template <typename WT, int K>
void launch_grads(const KdaBwdParams& p, cudaStream_t stream);

template <typename WT, int K>
void launch_prep(const KdaBwdParams& p, cudaStream_t stream);

}  // namespace kernel_fun::kda
