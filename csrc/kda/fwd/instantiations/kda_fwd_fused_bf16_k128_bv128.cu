// kda_fwd_fused (version 0) for bf16, K=128, V-slice 128.
#include "kda/fwd/kda_fwd_fused.cuh"

namespace kernel_fun::kda {
template void launch_fused<__nv_bfloat16, 128, 128>(const KdaFwdParams& p, cudaStream_t stream);
}
