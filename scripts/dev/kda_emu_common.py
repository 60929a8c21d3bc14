# Shared by the kda_intra_emu_* CPU emulations: one warp-wide mma.m16n8k8 (tf32 rounding ignored)
# on per-lane fragments, with the PTX ISA fragment layouts (g = lane / 4, t = lane % 4).
import numpy as np


def mma(c, a, b0, b1):
    """c[lane][4] += A @ B for a[lane] = (A[g,t], A[g+8,t], A[g,t+4], A[g+8,t+4]), b0/b1[lane] = B[t,g], B[t+4,g]."""
    A = np.zeros((16, 8)); B = np.zeros((8, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g, t], A[g+8, t], A[g, t+4], A[g+8, t+4] = a[lane]
        B[t, g], B[t+4, g] = b0[lane], b1[lane]
    C = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] += np.array([C[g, 2*t], C[g, 2*t+1], C[g+8, 2*t], C[g+8, 2*t+1]])
