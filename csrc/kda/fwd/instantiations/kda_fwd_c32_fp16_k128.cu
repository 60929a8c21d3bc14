// The 32-token forward (kda_fwd_intra_c32.cuh) for fp16, K=128: its intra in both P2 forms and its
// scan at V-slice 64 and 128. Where kda_fwd_chunk_choice takes it (kda_policy.h's fwd_short_chunks_pay).
#include "kda/fwd/kda_fwd_intra_c32.cuh"

namespace kernel_fun::kda {
template void launch_intra_c32<__half, 128>(const KdaFwdParams& p, cudaStream_t stream);
template void launch_scan_c32<__half, 128, 64>(const KdaFwdParams& p, cudaStream_t stream);
template void launch_scan_c32<__half, 128, 128>(const KdaFwdParams& p, cudaStream_t stream);
}
