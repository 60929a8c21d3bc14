// Launchers of the KDA forward kernels, defined next to their kernels (kda_fwd_intra.cuh,
// kda_fwd_scan.cuh) and explicitly instantiated one variant per file under instantiations/, so the
// variants compile in parallel. Only kda_fwd.cu calls these.
#pragma once

#include "kda/sm90/kda_fwd.h"

namespace kernel_fun::kda {

template <typename WT, int K>
void launch_intra(const KdaFwdParams& p, cudaStream_t stream);

template <typename WT, int K, int BV>  // BV in {64, 128}
void launch_scan(const KdaFwdParams& p, cudaStream_t stream);

}  // namespace kernel_fun::kda
