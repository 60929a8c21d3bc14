# CPU emulation of kda_fwd_intra's P3 (forward substitution + one-warp-per-block merge on
# m16n8k8 fragments), the Akk store and the P4b w fragments in the kernel's order (row block bi-1
# by warps 4-7, a quarter of K each, during merge step bi; row block 3 by all 8 warps), against
# numpy's inverse (fp64). Asserts every Akk / w element is written exactly once.
# Run: python3 scripts/dev/kda_intra_emu_p3.py [K] (numpy only, seconds; K defaults to 128, or give 64).
import sys

import numpy as np
from kda_emu_common import mma
rng = np.random.default_rng(1)
AP = 68; K = int(sys.argv[1]) if len(sys.argv) > 1 else 128; KP = K + 8
L = np.tril(rng.standard_normal((64, 64)) * 0.3, -1)
beta = rng.random(64)
sL = np.zeros(64 * AP); sX = np.zeros(64 * AP); sY = np.zeros(64 * AP)
for r in range(64):
    sL[r*AP:r*AP+64] = L[r]
# FS
for blk in range(4):
    o = 16 * blk
    for j in range(16):
        xv = np.zeros(16)
        for i in range(16):
            acc = sum(sL[(o+i)*AP + o + m] * xv[m] for m in range(i))
            xv[i] = 0 if i < j else (1 if i == j else -acc)
        for i in range(16): sX[(o+i)*AP + o + j] = xv[i]
for bi in range(1, 4):
    for warp in range(bi):
        j = warp
        cy = [np.zeros((32, 4)) for _ in range(2)]
        for m in range(j, bi):
            for ks in range(2):
                a = []; b = {0: ([], []), 1: ([], [])}
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    ra = 16*bi + g; ca = 16*m + 8*ks + t
                    a.append([sL[ra*AP+ca], sL[(ra+8)*AP+ca], sL[ra*AP+ca+4], sL[(ra+8)*AP+ca+4]])
                    for nt in range(2):
                        kb = 16*m + 8*ks + t; col = 16*j + 8*nt + g
                        b[nt][0].append(sX[kb*AP+col]); b[nt][1].append(sX[(kb+4)*AP+col])
                for nt in range(2): mma(cy[nt], a, b[nt][0], b[nt][1])
        y0 = 16 * j * AP
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for nt in range(2):
                sY[y0 + g*AP + 8*nt + 2*t] = cy[nt][lane][0]; sY[y0 + g*AP + 8*nt + 2*t + 1] = cy[nt][lane][1]
                sY[y0 + (g+8)*AP + 8*nt + 2*t] = cy[nt][lane][2]; sY[y0 + (g+8)*AP + 8*nt + 2*t + 1] = cy[nt][lane][3]
        cx = [np.zeros((32, 4)) for _ in range(2)]
        for ks in range(2):
            a = []; b = {0: ([], []), 1: ([], [])}
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                ra = 16*bi + g; ca = 16*bi + 8*ks + t
                a.append([sX[ra*AP+ca], sX[(ra+8)*AP+ca], sX[ra*AP+ca+4], sX[(ra+8)*AP+ca+4]])
                for nt in range(2):
                    kb = 8*ks + t; col = 8*nt + g
                    b[nt][0].append(sY[y0 + kb*AP+col]); b[nt][1].append(sY[y0 + (kb+4)*AP+col])
            for nt in range(2): mma(cx[nt], a, b[nt][0], b[nt][1])
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for nt in range(2):
                ra = 16*bi + g; col = 16*j + 8*nt + 2*t
                sX[ra*AP+col] = -cx[nt][lane][0]; sX[ra*AP+col+1] = -cx[nt][lane][1]
                sX[(ra+8)*AP+col] = -cx[nt][lane][2]; sX[(ra+8)*AP+col+1] = -cx[nt][lane][3]
# Akk store and P4b with kexp, per row block, in the kernel's order (after the merge above, which
# only ever writes row blocks > the one being stored, so the emulation can run them afterwards)
kexp = rng.standard_normal((64, K)); sK = np.zeros(64 * KP)
for r in range(64): sK[r*KP:r*KP+K] = kexp[r]
w = np.zeros((64, K)); cw = np.zeros((64, K), int)
Akk = np.zeros((64, 64)); ca_ = np.zeros((64, 64), int)


def store_akk_rows(blk, threads):
    for i in threads:
        r, s0 = 16*blk + i // 8, (i % 8) * 8
        for e in range(8):
            Akk[r, s0+e] = 0 if (s0 >> 4) > blk else sX[r*AP + s0 + e] * beta[s0+e]
            ca_[r, s0+e] += 1


def w_tile(mt, col0, ntc):
    acc = [np.zeros((32, 4)) for _ in range(ntc)]
    for kk in range(2 * (mt + 1)):
        a = []; bs = [([], []) for _ in range(ntc)]
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            ra = 16*mt + g; rb = ra + 8; ca = 8*kk + t; cb = ca + 4
            a.append([sX[ra*AP+ca]*beta[ca], sX[rb*AP+ca]*beta[ca], sX[ra*AP+cb]*beta[cb], sX[rb*AP+cb]*beta[cb]])
            for nt in range(ntc):
                col = col0 + 8*nt + g
                bs[nt][0].append(sK[ca*KP+col]); bs[nt][1].append(sK[cb*KP+col])
        for nt in range(ntc): mma(acc[nt], a, bs[nt][0], bs[nt][1])
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        ra = 16*mt + g; rb = ra + 8
        for nt in range(ntc):
            col = col0 + 8*nt + 2*t
            w[ra, col], w[ra, col+1], w[rb, col], w[rb, col+1] = acc[nt][lane]
            cw[ra, col] += 1; cw[ra, col+1] += 1; cw[rb, col] += 1; cw[rb, col+1] += 1


for bi in range(1, 4):
    for warp in range(4, 8):
        w_tile(bi - 1, (warp - 4) * (K // 4), K // 32)
    store_akk_rows(bi - 1, range(0, 128))  # threads 128..255 -> items 0..127
for warp in range(8):
    w_tile(3, warp * (K // 8), K // 64)
store_akk_rows(3, range(0, 128))           # threads 0..127 of 256
assert (ca_ == 1).all() and (cw == 1).all(), "Akk / w coverage"
ref = np.linalg.inv(np.eye(64) + L) * beta[None, :]
print("Akk max err", np.abs(Akk - ref).max())
print("w max err", np.abs(w - ref @ kexp).max())
