// The one description of each KDA kernel's launch: its grid, threads per CTA and dynamic shared
// memory, computed from the params. Every kernel header defines a `<kernel>_launch(p)` built from
// the helpers here; its launcher (launch_* next to the kernel, kda_fwd.cu, kda_bwd.cu) and the host
// emulator (tests/emu/kda_emu.cpp) both launch from that function, so the two cannot drift: a wrong
// grid is wrong in the emulator too, where the CPU tests see it. Host code only, no CUDA runtime
// calls (the emulator builds it under g++).
#pragma once

#include <cuda_runtime.h>  // dim3

#include <cstddef>

#include "kda/kda_problem.h"

namespace kernel_fun::kda {

struct LaunchShape {
  dim3 grid;
  int threads;  // per CTA (x only)
  size_t smem;  // dynamic shared memory, bytes
  dim3 cluster = dim3(1, 1, 1);  // thread block cluster (CTAs per cluster in each dimension; divides grid)
  // Programmatic dependent launch: this kernel may start while the previous kernel on the stream is
  // still running, once every CTA of that one has called dev::launch_dependents (it must not read what
  // the previous kernel writes; the stream's next kernel still waits for both).
  bool overlap_previous = false;
  // An empty grid launches nothing (an empty problem: no chunks, no heads, no sequences).
  bool empty() const { return grid.x == 0 || grid.y == 0 || grid.z == 0; }
};

// The per-chunk grid of kda_fwd_intra, kda_bwd_prep and kda_bwd_grads: one CTA per global chunk
// (dev::chunk_of maps blockIdx.x; with cu_seqlens max_chunks is an upper bound and the tail CTAs
// find nothing to do) x value head.
inline LaunchShape chunk_grid(const KdaProblem& p, int threads, size_t smem) {
  return {dim3(static_cast<unsigned>(p.max_chunks), static_cast<unsigned>(p.HV)), threads, smem};
}

// The forward intra's grid at either chunk size: `rows` chunk rows x value heads, one CTA each; in the
// streamed forward (p.chunk_ready set) transposed to (value head, chunk row), every head of a chunk row
// before the next (dev::intra_cell reads it back), and launched beside the scan's pass 1
// (programmatic dependent launch: the scan's CTAs trigger it at their start).
inline LaunchShape intra_grid(const KdaFwdParams& p, int64_t rows, int threads, size_t smem) {
  const unsigned r = static_cast<unsigned>(rows), h = static_cast<unsigned>(p.HV);
  LaunchShape s{dim3(r, h), threads, smem};
  if (p.chunk_ready) {
    s.grid = dim3(h, r);
    s.overlap_previous = true;
  }
  return s;
}

// The scans' grid (dev::scan_launch): x_items work items per (value head, sequence) row -- V / BV
// for one scan, twice that for kda_bwd_scans -- with blockIdx (x, y, z) = (item, value head,
// sequence).
inline LaunchShape scan_grid(const KdaProblem& p, int x_items, int threads, size_t smem) {
  return {dim3(static_cast<unsigned>(x_items), static_cast<unsigned>(p.HV), static_cast<unsigned>(p.N)), threads,
          smem};
}

}  // namespace kernel_fun::kda
