// kda_bwd_dh_scan for bf16, K=128, V-slice 128.
#include "kda/bwd/kda_bwd_dh_scan.cuh"

namespace kernel_fun::kda {
template void launch_dh_scan<__nv_bfloat16, 128, 128>(const KdaBwdParams& p, cudaStream_t stream);
}
