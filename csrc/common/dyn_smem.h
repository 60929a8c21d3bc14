// The block's dynamic shared memory, declared so that one kernel source builds both for the GPU
// (nvcc) and for the host emulator (g++ -DKF_EMU, tests/emu/kf_emu.h):
//   KF_DYN_SMEM(float4, smem_f4);   // GPU: extern __shared__ float4 smem_f4[];
//                                   // emulator: float4* const smem_f4 = the block's buffer
#pragma once

#ifdef KF_EMU
#ifndef KF_EMU_H
#error "KF_EMU builds include tests/emu/kf_emu.h before any kernel source"
#endif
#define KF_DYN_SMEM(T, name) T* const name = reinterpret_cast<T*>(::kf_emu::dyn_smem())
#else
#define KF_DYN_SMEM(T, name) extern __shared__ T name[]
#endif
