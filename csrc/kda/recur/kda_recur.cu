// The fp32 token recurrence's launchers (recur/kda_recur.cuh) and the per-call choice.
#include "kda/device/sequence.cuh"
#include "kda/kda_dispatch.h"
#include "kda/kda_launch.h"
#include "kda/kda_policy.h"
#include "kda/recur/kda_recur.cuh"

namespace kernel_fun::kda {

bool kda_recurrent_choice(const KdaProblem& p) {
  // the front's switch, in the options (tests / timing: 0 or 1), so the backward decides alike: a
  // recurrent forward writes none of the chunk factors a chunk-kernel backward would read
  const int forced = p.opt.recurrent;
  if (forced == 0) return false;
  if (forced == 1) return recurrent_possible(p);
  return recurrent_default(p);
}

// K is the one compile-time parameter (the smem layout and the thread count); the element types
// are read at run time (load_any): the recurrence is bound by its serial steps, not by its loads.
void kda_recur_fwd(const KdaFwdParams& p, cudaStream_t stream) {
  dispatch_k(p.K, "kda_recur_fwd", [&](auto k) {
    constexpr int K = decltype(k)::value;
    dev::launch(kda_recur_fwd_kernel<K>, recur_fwd_launch<K>(p), p, stream);
  });
}

void kda_recur_bwd(const KdaBwdParams& p, cudaStream_t stream) {
  dispatch_k(p.K, "kda_recur_bwd", [&](auto k) {
    constexpr int K = decltype(k)::value;
    for_each_recur_bwd_pass<K>(p, [&](auto kern, const LaunchShape& sh) { dev::launch(kern, sh, p, stream); });
  });
}

}  // namespace kernel_fun::kda
