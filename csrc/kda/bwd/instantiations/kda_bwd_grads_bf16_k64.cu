// kda_bwd_grads for bf16, K=64.
#include "kda/bwd/kda_bwd_grads.cuh"

namespace kernel_fun::kda {
template void launch_grads<__nv_bfloat16, 64>(const KdaBwdParams& p, cudaStream_t stream);
}
