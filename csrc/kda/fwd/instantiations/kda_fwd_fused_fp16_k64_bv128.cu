// kda_fwd_fused (version 0) for fp16, K=64, V-slice 128.
#include "kda/fwd/kda_fwd_fused.cuh"

namespace kernel_fun::kda {
template void launch_fused<__half, 64, 128>(const KdaFwdParams& p, cudaStream_t stream);
}
