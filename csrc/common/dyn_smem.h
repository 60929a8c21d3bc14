// The block's dynamic shared memory, declared so that one kernel source builds both for the GPU
// (nvcc) and for the host emulator (g++ -DKF_EMU, tests/emu/kf_emu.h):
//   KF_DYN_SMEM(float4, smem_f4);   // GPU: extern __shared__ float4 smem_f4[];
//                                   // emulator: float4* const smem_f4 = the block's buffer
//   KF_DYN_SMEM_1024(float4, smem_a): the same, 1024-byte aligned (the 128-byte swizzle's atoms): the
//   linker places the array at an aligned shared-window address, so smem addresses stay link-time
//   constants (an alignment at run time puts a base register under every smem access). The
//   emulator's shared-memory offsets start at 0.
#pragma once

#ifdef KF_EMU
#ifndef KF_EMU_H
#error "KF_EMU builds include tests/emu/kf_emu.h before any kernel source"
#endif
#define KF_DYN_SMEM(T, name) T* const name = reinterpret_cast<T*>(::kf_emu::dyn_smem())
#define KF_DYN_SMEM_1024(T, name) KF_DYN_SMEM(T, name)
#else
#define KF_DYN_SMEM(T, name) extern __shared__ T name[]
#define KF_DYN_SMEM_1024(T, name) extern __shared__ __align__(1024) T name[]
#endif
