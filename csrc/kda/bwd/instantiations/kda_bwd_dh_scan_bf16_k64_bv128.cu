// kda_bwd_dh_scan and kda_bwd_scans (both scans in one launch) for bf16, K=64, V-slice 128.
#include "kda/bwd/kda_bwd_scans.cuh"

namespace kernel_fun::kda {
template void launch_dh_scan<__nv_bfloat16, 64, 128>(const KdaBwdParams& p, cudaStream_t stream);
template void launch_dh_scan_local<__nv_bfloat16, 64, 128>(const KdaBwdParams& p, cudaStream_t stream);
template void launch_scans<__nv_bfloat16, 64, 128>(const KdaBwdParams& p, cudaStream_t stream);
}
