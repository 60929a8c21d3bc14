// kda_bwd_grads for fp16, K=128.
#include "kda/bwd/kda_bwd_grads.cuh"

namespace kernel_fun::kda {
template void launch_grads<__half, 128>(const KdaBwdParams& p, cudaStream_t stream);
}
