// Per-op invocation counters of the kernel ops (csrc/api/op_calls.cpp). Tests and
// `python -m kernel_fun.check` read them to prove that our kernels ran - eagerly, inside a
// torch.compile'd graph (which calls the ops at run time, while Python code around them ran only
// once, at trace time) - rather than fla's. A counter counts op entries, after validation passed.
#pragma once

namespace kernel_fun::api {

// kKdaFwdC32: the forwards that ran the 32-token chunks (kda_fwd_chunk_choice), kKdaFwdStreamed those that
// streamed (kda_fwd_stream_bv, at either chunk size); both also counted as kKdaFwd. kKdaBwdStreamed: the
// backwards whose gradient kernel ran beside the dh scan (kda_bwd_streams), also counted as kKdaBwd.
// kKdaFwdSplit: the forwards whose scans ran in pieces (kda_split_choose), also counted as kKdaFwd.
enum class OpId : int {
  kCconvFwd, kCconvBwd, kCconvUpdate, kKdaFwd, kKdaBwd, kKdaFwdC32, kKdaFwdStreamed, kKdaBwdStreamed, kKdaFwdSplit,
  kCount
};

void count_call(OpId id);

}  // namespace kernel_fun::api
