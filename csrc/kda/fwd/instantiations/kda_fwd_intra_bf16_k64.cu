// kda_fwd_intra for bf16, K=64.
#include "kda/fwd/kda_fwd_intra.cuh"

namespace kernel_fun::kda {
template void launch_intra<__nv_bfloat16, 64>(const KdaFwdParams& p, cudaStream_t stream);
}
