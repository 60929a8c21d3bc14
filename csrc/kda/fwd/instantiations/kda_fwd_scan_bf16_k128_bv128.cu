// kda_fwd_scan (and the split forward's pass 1, kda_fwd_scan_local) for bf16, K=128, V-slice 128.
#include "kda/fwd/kda_fwd_scan.cuh"

namespace kernel_fun::kda {
template void launch_scan<__nv_bfloat16, 128, 128>(const KdaFwdParams& p, cudaStream_t stream);
template void launch_scan_local<__nv_bfloat16, 128, 128>(const KdaFwdParams& p, cudaStream_t stream);
}
