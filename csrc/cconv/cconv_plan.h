// How the conv kernels split work (host side, shared by the forward and backward launchers).
//
// A CTA of `threads` threads covers TX channel groups (C channels each) x TY token chunks. Each
// thread walks ONE contiguous chunk of L tokens of the flat token space, cut at sequence
// boundaries, keeping the W-1 token halo in registers. The grid is sized to what fits on the GPU
// at once (CTAs per SM from the occupancy calculator), so every thread walks a long run: the halo
// re-read is ~W/L of the traffic and the backward keeps only one dw/db partial per CTA row.
// The plan depends only on shapes and the device, so repeated runs are bitwise identical.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cconv/cconv.h"
#include "common/device_info.h"

#ifndef KF_CCONV_WAVES
#define KF_CCONV_WAVES 1  // grid = this many GPU-fulls of CTAs (-D override: tuning harness only)
#endif
#ifndef KF_CCONV_ONLY_BF16_W4
#define KF_CCONV_ONLY_BF16_W4 0  // 1: dispatch only bf16 W=4 (tuning harness builds, fast to compile)
#endif
#ifndef KF_CCONV_CHUNK
// 0: each thread walks one chunk of ~total / (rows * TY) tokens. N > 0 (tuning harness only):
// chunks of N tokens, taken grid-stride, so all CTAs sweep one narrow window of the token space
// together (fewer DRAM pages / TLB entries live at once; costs W-1 halo rows per N).
#define KF_CCONV_CHUNK 0
#endif
#ifndef KF_CCONV_CTA_CHANNELS
#define KF_CCONV_CTA_CHANNELS 256  // channels one CTA spans at most (-D override: tuning harness only)
#endif

namespace kernel_fun::cconv {

struct Plan {
  int tx = 32;               // channel groups per CTA (power of two); TY = threads / tx
  int64_t dtiles = 1;        // gridDim.x: CTAs across channels
  int64_t rows = 1;          // CTAs along tokens (gridDim.y used by the token walk)
  int64_t chunk = 0;         // L: tokens per chunk; thread (row, ty) walks chunks row*TY + ty + k*rows*TY
};

// blocks_per_sm: from cudaOccupancyMaxActiveBlocksPerMultiprocessor for the kernel that will run.
// min_chunk keeps tiny problems from being cut into chunks shorter than the halo is worth.
// A CTA spans at most KF_CCONV_CTA_CHANNELS channels (tx <= that / C).
inline Plan make_plan(int64_t total, int64_t D, int C, int threads, int blocks_per_sm, int64_t min_chunk = 16) {
  Plan p;
  const int64_t groups = (D + C - 1) / C;
  int tx = 1;
  while (tx < KF_CCONV_CTA_CHANNELS / C && tx < threads && tx < groups) tx *= 2;
  p.tx = tx;
  const int64_t ty = threads / tx;
  p.dtiles = (groups + tx - 1) / tx;
  const int64_t capacity = static_cast<int64_t>(num_sms()) * std::max(blocks_per_sm, 1) * KF_CCONV_WAVES;
  // Rounded down: rounding up would leave a few CTAs for a second wave (as long as the first)
  // whenever the capacity is not a multiple of dtiles (D = 2560, 5120, 3 CTAs per SM, ...).
  int64_t rows = std::max<int64_t>(1, capacity / p.dtiles);
  rows = std::min<int64_t>(rows, std::max<int64_t>(1, (total + ty * min_chunk - 1) / (ty * min_chunk)));
  rows = std::min<int64_t>(rows, 65535 / 2);
  p.chunk = total > 0 ? (total + rows * ty - 1) / (rows * ty) : 0;
  if (KF_CCONV_CHUNK > 0 && total > 0) {
    p.chunk = KF_CCONV_CHUNK;
    rows = std::min<int64_t>(rows, (total + ty * p.chunk - 1) / (ty * p.chunk));
  }
  p.rows = rows;
  return p;
}

// Rows of v (channels contiguous) all start on `align`-byte boundaries, so they can be moved as
// vectors. Batch stride only matters with more than one batch row.
inline bool rows_aligned(const View3& v, int64_t B, int64_t elem, int align) {
  return v.s2 == 1 && reinterpret_cast<uintptr_t>(v.ptr) % align == 0 && (v.s1 * elem) % align == 0 &&
         (B <= 1 || (v.s0 * elem) % align == 0);
}

}  // namespace kernel_fun::cconv
