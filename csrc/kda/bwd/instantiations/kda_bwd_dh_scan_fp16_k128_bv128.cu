// kda_bwd_dh_scan and kda_bwd_scans (both scans in one launch) for fp16, K=128, V-slice 128.
#include "kda/bwd/kda_bwd_scans.cuh"

namespace kernel_fun::kda {
template void launch_dh_scan<__half, 128, 128>(const KdaBwdParams& p, cudaStream_t stream);
template void launch_dh_scan_local<__half, 128, 128>(const KdaBwdParams& p, cudaStream_t stream);
template void launch_scans<__half, 128, 128>(const KdaBwdParams& p, cudaStream_t stream);
}
