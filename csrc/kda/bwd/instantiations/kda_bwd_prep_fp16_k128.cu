// kda_bwd_prep for fp16, K=128.
#include "kda/bwd/kda_bwd_prep.cuh"

namespace kernel_fun::kda {
template void launch_prep<__half, 128>(const KdaBwdParams& p, cudaStream_t stream);
}
