// kda_bwd_prep for fp16, K=64.
#include "kda/bwd/kda_bwd_prep.cuh"

namespace kernel_fun::kda {
template void launch_prep<__half, 64>(const KdaBwdParams& p, cudaStream_t stream);
}
