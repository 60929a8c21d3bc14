// What the launchers ask of the current device (host code; cached per device, the attribute never
// changes while the process lives).
#pragma once

#include <cuda_runtime.h>

#include "common/cuda_check.h"

namespace kernel_fun {

// The current device's SM count (cudaDevAttrMultiProcessorCount).
inline int num_sms() {
  int dev = 0;
  KF_CUDA_CHECK(cudaGetDevice(&dev));
  static int cached[64] = {0};
  int n = dev >= 0 && dev < 64 ? cached[dev] : 0;
  if (n == 0) {
    KF_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    if (dev >= 0 && dev < 64) cached[dev] = n;
  }
  return n;
}

}  // namespace kernel_fun
