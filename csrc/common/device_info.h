// Facts about the current device that launch policies use, cached per device.
#pragma once

#include <cuda_runtime.h>

#include "common/cuda_check.h"

namespace kernel_fun {

// Streaming multiprocessors of the current device (waves of a grid; how far ahead a CTA prefetches).
inline int num_sms() {
  int dev = 0;
  KF_CUDA_CHECK(cudaGetDevice(&dev));
  static int cached[64] = {0};
  if (dev < 0 || dev >= 64) {
    int n = 0;
    KF_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }
  if (cached[dev] == 0) {
    int n = 0;
    KF_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cached[dev] = n;
  }
  return cached[dev];
}

}  // namespace kernel_fun
