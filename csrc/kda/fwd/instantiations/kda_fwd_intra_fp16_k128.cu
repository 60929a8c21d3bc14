// kda_fwd_intra for fp16, K=128.
#include "kda/fwd/kda_fwd_intra.cuh"

namespace kernel_fun::kda {
template void launch_intra<__half, 128>(const KdaFwdParams& p, cudaStream_t stream);
}
