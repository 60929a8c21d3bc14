// kda_bwd_grads for fp16, K=64.
#include "kda/bwd/kda_bwd_grads.cuh"

namespace kernel_fun::kda {
template void launch_grads<__half, 64>(const KdaBwdParams& p, cudaStream_t stream);
}
