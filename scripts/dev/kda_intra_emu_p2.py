# CPU emulation of kda_fwd_intra's P1 (block-local cumsum: per-thread row sub-groups + shuffle
# prefix, in the kernel's fp32 order), P2 lane mapping (warps 0-1 SIMT diagonal 4x4 tiles, warps
# 2-4 cross-block MMAs per block row, warps 4-7 stacked q/k MMAs; MMA k-slots t / t+4 = adjacent
# columns 2t / 2t+1) and the qg/kg work-queue coverage, mma.m16n8k8 fragments emulated per lane,
# tf32 rounding ignored. Asserts that every Aqk / L lower-triangle entry and every qg/kg vector is
# written exactly once and prints rel-RMS vs an fp64 reference.
# Run: python3 scripts/dev/kda_intra_emu_p2.py [K] (numpy only, seconds; K defaults to 128, or give 64).
import sys

import numpy as np
from kda_emu_common import mma
rng = np.random.default_rng(0)
K = int(sys.argv[1]) if len(sys.argv) > 1 else 128; BT = 64; NTH = 256; f32 = np.float32
ex = lambda x: np.exp2(np.asarray(x, dtype=f32)).astype(f32)


def p1_cumsum(gate):
    # thread = (block blk, column group cg, sub-group sub of RPT rows); running sum over its rows,
    # then an inclusive Hillis-Steele prefix of the sub-group totals over SUBS adjacent lanes
    CG = K // 8; SUBS = NTH // (4 * CG); RPT = 16 // SUBS
    rc = f32(1.4426950408889634)
    g2 = np.zeros_like(gate)
    for blk in range(4):
        for cg in range(CG):
            cols = slice(8*cg, 8*cg+8)
            loc = []
            for sub in range(SUBS):
                x = gate[16*blk + RPT*sub: 16*blk + RPT*sub + RPT, cols].astype(f32).copy()
                for j in range(1, RPT): x[j] = (x[j] + x[j-1]).astype(f32)
                loc.append(x)
            incl = [loc[s][RPT-1].copy() for s in range(SUBS)]
            o = 1
            while o < SUBS:
                prev = [v.copy() for v in incl]
                for s in range(o, SUBS): incl[s] = (prev[s] + prev[s-o]).astype(f32)
                o <<= 1
            for sub in range(SUBS):
                x = loc[sub] if sub == 0 else (incl[sub-1] + loc[sub]).astype(f32)
                g2[16*blk + RPT*sub: 16*blk + RPT*sub + RPT, cols] = (x * rc).astype(f32)
    return g2


def queue_coverage():
    # qg/kg queue: units of 64 vectors (two per lane), taken in any order by any warp
    VPR = K // 8; units = BT * VPR // 64
    cnt = np.zeros((BT, VPR), int)
    for unit in rng.permutation(units):
        for half in range(2):
            for lane in range(32):
                i = unit * 64 + half * 32 + lane
                cnt[i // VPR, i % VPR] += 1
    assert (cnt == 1).all(), "qg/kg queue coverage"


def stacked_rows(o, sub4, g):
    # A-fragment rows r0 (MMA row g) / r1 (g+8), q or k, their boundaries e0 / e1, B column row sb, eb
    if not sub4:
        return o+8+g, o+8+g, False, True, o+7, o+7, o+g, o+7
    return (o+4+(g&3), o+12+(g&3), (g >> 2) != 0, (g >> 2) != 0, o+3, o+11,
            o+(g&3)+8*(g>>2), o+3+8*(g>>2))

def run(len_, gate_scale=1.0, extreme=0.0):
    q = rng.standard_normal((BT, K)).astype(f32); k = rng.standard_normal((BT, K)).astype(f32)
    gate = (-np.abs(rng.standard_normal((BT, K))) * gate_scale).astype(f32)
    if extreme: gate = np.where(rng.random((BT, K)) < extreme, f32(-1000), gate).astype(f32)
    beta = rng.random(BT).astype(f32)
    q[len_:] = 0; k[len_:] = 0; gate[len_:] = 0; beta[len_:] = 0
    scale = K ** -0.5
    g2 = p1_cumsum(gate)
    T = g2[15::16].copy()  # block totals: the kernel stores the last row's g2 bit for bit
    rq = (1/np.sqrt((q.astype(np.float64)**2).sum(1) + 1e-6)).astype(f32)
    rk = (1/np.sqrt((k.astype(np.float64)**2).sum(1) + 1e-6)).astype(f32)
    sA = np.zeros((BT, BT)); sL = np.zeros((BT, BT)); cntA = np.zeros((BT, BT), int); cntL = np.zeros((BT, BT), int)
    def put(is_k, r, s, v):
        if is_k: sL[r, s] = beta[r]*rk[r]*rk[s]*v; cntL[r, s] += 1
        else: sA[r, s] = scale*rq[r]*rk[s]*v; cntA[r, s] += 1
    # SIMT warps 0-1: all d at once per slot
    for tid in range(64):
        ds, slot = tid & 3, tid >> 2
        if ds: continue
        r0 = 16*(slot >> 2) + 4*(slot & 3)
        qr, kr, gr = q[r0:r0+4], k[r0:r0+4], g2[r0:r0+4]
        a1, a2, a3 = ex(gr[1]-gr[0]), ex(gr[2]-gr[1]), ex(gr[3]-gr[2])
        z = {(1,0): a1, (2,1): a2, (3,2): a3, (2,0): a1*a2, (3,1): a2*a3, (3,0): a1*a2*a3}
        for a in range(4):
            for b in range(a+1):
                e = kr[b] * (z[(a,b)] if a != b else 1)
                put(False, r0+a, r0+b, (qr[a]*e).sum())
                if b < a: put(True, r0+a, r0+b, (kr[a]*e).sum())
    for warp in range(2, 8):
        if warp < 5:
            bi = 5 - warp; f = 16*bi
            cq = {(bj, nt): np.zeros((32, 4)) for bj in range(3) for nt in range(2)}
            ck = {(bj, nt): np.zeros((32, 4)) for bj in range(3) for nt in range(2)}
            for kk in range(K // 8):
                aq = []; ak = []; B = {}
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    ra, rb = f+g, f+g+8; ca, cb = 8*kk+2*t, 8*kk+2*t+1
                    e00, e10, e01, e11 = ex(g2[ra,ca]-g2[f,ca]), ex(g2[rb,ca]-g2[f,ca]), ex(g2[ra,cb]-g2[f,cb]), ex(g2[rb,cb]-g2[f,cb])
                    aq.append([q[ra,ca]*e00, q[rb,ca]*e10, q[ra,cb]*e01, q[rb,cb]*e11])
                    ak.append([k[ra,ca]*e00, k[rb,ca]*e10, k[ra,cb]*e01, k[rb,cb]*e11])
                    ma, mb = g2[f,ca], g2[f,cb]
                    for bj in (2, 1, 0):
                        if not bj < bi: continue
                        ta, tb = T[bj,ca], T[bj,cb]
                        for nt in range(2):
                            s = 16*bj + 8*nt + g
                            B.setdefault((bj, nt), ([], []))
                            B[(bj, nt)][0].append(k[s,ca]*ex((ta-g2[s,ca])+ma)); B[(bj, nt)][1].append(k[s,cb]*ex((tb-g2[s,cb])+mb))
                        ma = f32(ma + ta); mb = f32(mb + tb)
                for (bj, nt), (b0, b1) in B.items():
                    mma(cq[(bj, nt)], aq, b0, b1); mma(ck[(bj, nt)], ak, b0, b1)
            for lane in range(32):
                g, t = lane >> 2, lane & 3; ra, rb = f+g, f+g+8
                for bj in range(bi):
                    for nt in range(2):
                        s = 16*bj + 8*nt + 2*t; c1, c2 = cq[(bj, nt)][lane], ck[(bj, nt)][lane]
                        put(False, ra, s, c1[0]); put(False, ra, s+1, c1[1]); put(False, rb, s, c1[2]); put(False, rb, s+1, c1[3])
                        put(True, ra, s, c2[0]); put(True, ra, s+1, c2[1]); put(True, rb, s, c2[2]); put(True, rb, s+1, c2[3])
        w4 = warp - 4
        tb = 0 if w4 <= 0 else (1 if w4 == 1 else (3 if w4 == 2 else 6))
        te = (1 if warp == 4 else 0) if w4 <= 0 else (3 if w4 == 1 else (6 if w4 == 2 else 8))
        for ti in range(tb, te):
            o = 16*(ti >> 1); sub4 = ti & 1
            c = [np.zeros((32, 4)), np.zeros((32, 4))]  # even / odd kk accumulators
            for kk in range(K // 8):
                A = []; b0 = []; b1 = []
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    r0, r1, k0, k1, e0, e1, sb, eb = stacked_rows(o, sub4, g)
                    x0 = k if k0 else q; x1 = k if k1 else q
                    ca, cb = 8*kk+2*t, 8*kk+2*t+1
                    assert r0 > e0 and r1 > e1 and eb >= sb
                    A.append([x0[r0,ca]*ex(g2[r0,ca]-g2[e0,ca]), x1[r1,ca]*ex(g2[r1,ca]-g2[e1,ca]),
                              x0[r0,cb]*ex(g2[r0,cb]-g2[e0,cb]), x1[r1,cb]*ex(g2[r1,cb]-g2[e1,cb])])
                    b0.append(k[sb,ca]*ex(g2[eb,ca]-g2[sb,ca])); b1.append(k[sb,cb]*ex(g2[eb,cb]-g2[sb,cb]))
                mma(c[kk & 1], A, b0, b1)
            c = c[0] + c[1]
            for lane in range(32):
                g, t = lane >> 2, lane & 3; r0, r1, k0, k1 = stacked_rows(o, sub4, g)[:4]; cc = c[lane]
                if not sub4:
                    put(False, r0, o+2*t, cc[0]); put(False, r0, o+2*t+1, cc[1]); put(True, r1, o+2*t, cc[2]); put(True, r1, o+2*t+1, cc[3])
                elif t < 2:
                    put(k0, r0, o+2*t, cc[0]); put(k0, r0, o+2*t+1, cc[1])
                else:
                    put(k1, r1, o+4+2*t, cc[2]); put(k1, r1, o+4+2*t+1, cc[3])
    low = np.tril(np.ones((BT, BT), int))
    assert (cntA == low).all(), ("coverage A", np.argwhere(cntA != low)[:5])
    assert (cntL == np.tril(low, -1)).all(), ("coverage L", np.argwhere(cntL != np.tril(low, -1))[:5])
    qd, kd = q.astype(np.float64), k.astype(np.float64)
    gd = np.cumsum(gate.astype(np.float64), 0) / np.log(2)
    qd = qd / np.sqrt((qd**2).sum(1, keepdims=True) + 1e-6); kd = kd / np.sqrt((kd**2).sum(1, keepdims=True) + 1e-6)
    E = np.exp2(np.where(np.tril(np.ones((BT, BT), bool))[:, :, None], gd[:, None, :] - gd[None, :, :], -np.inf))
    Aref = scale * np.einsum('rd,sd,rsd->rs', qd, kd, E)
    Lref = np.tril(beta[:, None] * np.einsum('rd,sd,rsd->rs', kd, kd, E), -1)
    rel = lambda a, b: np.sqrt(((a - b)**2).sum() / ((b)**2).sum())
    return rel(sA, Aref), rel(sL, Lref)

queue_coverage()
for args in [(64,), (37,), (64, 16.0), (64, 1.0, 0.5)]:
    print(args, run(*args))
