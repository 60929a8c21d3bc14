"""How much do the forward intra's off-diagonal block products (P2: Aqk and L below the diagonal
blocks) lose when their gated operands are rounded to tf32 (today), fp16 or bf16? One chunk in fp64
with an initial state, the diagonal blocks exact; o's rel-RMS against the exact chunk, mean of 6 seeds,
for three gate families (docs/notes/2026-12-02-fused-forward-groundwork.md, third session).

"mid-bf16" / "mid-fp16" (2026-12-03): FlashKDA's form for bounded gates, every block (the diagonal too)
from per-block operand tiles anchored at the block's midpoint row m (q exp2(g - g_m), k exp2(g_m - g):
two-sided, up to 2^58 at lower_bound -5, so fp16 overflows where bf16 does not), the blocks below the
diagonal with the factor exp2(g_mi - g_mj) (<= 1) multiplied into the k tile in the same 16-bit type.
"+store" rounds Aqk and Akk to bf16 as the workspace stores them, which every variant pays anyway.

    python3 scripts/dev/p2_operand_rounding.py      (CPU, seconds)
"""
import torch, math
torch.manual_seed(0)
dt = torch.float64
def rnd(x, kind):
    if kind == "exact": return x
    if kind == "tf32":  # round-to-nearest-away on the top 19 bits
        xf = x.float(); u = xf.view(torch.int32)
        u = ((u + 0x1000) & ~0x1FFF)
        return u.view(torch.float32).double()
    if kind == "fp16": return x.half().double()
    if kind == "bf16": return x.bfloat16().double()
def chunk(q, k, v, beta, G, h0, scale, kind, store=False):
    T, K = q.shape
    Aqk = torch.zeros(T, T, dtype=dt); Kt = torch.zeros(T, T, dtype=dt)
    if kind.startswith("mid-"):  # every block from midpoint-anchored tiles (bounded gates only)
        t16 = kind[4:]
        m = [16 * b + 8 for b in range(4)]
        Qm = [rnd(q[16*b:16*b+16] * torch.exp(G[16*b:16*b+16] - G[m[b]]), t16) for b in range(4)]
        Km = [rnd(k[16*b:16*b+16] * torch.exp(G[16*b:16*b+16] - G[m[b]]), t16) for b in range(4)]
        Kb = [rnd(k[16*b:16*b+16] * torch.exp(G[m[b]] - G[16*b:16*b+16]), t16) for b in range(4)]
        for bi in range(4):
            for bj in range(bi + 1):
                ri = slice(16*bi, 16*bi+16); rj = slice(16*bj, 16*bj+16)
                kb = Kb[bj] if bi == bj else rnd(Kb[bj] * rnd(torch.exp(G[m[bi]] - G[m[bj]]), t16), t16)
                Aqk[ri, rj] = Qm[bi] @ kb.T
                Kt[ri, rj] = Km[bi] @ kb.T
    for bi in range(0 if kind.startswith("mid-") else 4):
        for bj in range(bi + 1):
            ri = slice(16*bi, 16*bi+16); rj = slice(16*bj, 16*bj+16)
            if bi == bj:  # diagonal blocks: exact here (SIMT / midpoint in the kernel)
                E = torch.exp(G[ri, None, :] - G[None, rj, :])
                Aqk[ri, rj] = torch.einsum("id,jd,ijd->ij", q[ri], k[rj], E)
                Kt[ri, rj] = torch.einsum("id,jd,ijd->ij", k[ri], k[rj], E)
            else:  # anchor f = first row of block bi: both factors <= 1
                f = 16 * bi
                qa = rnd(q[ri] * torch.exp(G[ri] - G[f]), kind)
                ka = rnd(k[ri] * torch.exp(G[ri] - G[f]), kind)
                kb = rnd(k[rj] * torch.exp(G[f] - G[rj]), kind)
                Aqk[ri, rj] = qa @ kb.T
                Kt[ri, rj] = ka @ kb.T
    Aqk = scale * torch.tril(Aqk); L = beta[:, None] * torch.tril(Kt, -1)
    M = torch.linalg.inv(torch.eye(T, dtype=dt) + L); Akk = M * beta[None, :]
    if store:
        Aqk, Akk = Aqk.bfloat16().double(), Akk.bfloat16().double()
    u = Akk @ v; w = Akk @ (k * torch.exp(G))
    vn = u - w @ h0
    return scale * (q * torch.exp(G)) @ h0 + Aqk @ vn
def rel(a, b): return ((a-b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()
K = V = 128; T = 64
for gate in ["unbounded", "bounded-5", "bounded-weak", "weak"]:
    kinds = ["tf32", "fp16", "bf16"] + (["mid-bf16", "mid-fp16"] if gate.startswith("bounded") else [])
    res = {k: [] for k in kinds + [k + "+store" for k in ["tf32"] + kinds[3:]]}
    for s in range(6):
        g0 = torch.Generator().manual_seed(s)
        q = torch.nn.functional.normalize(torch.randn(T, K, generator=g0, dtype=dt), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(T, K, generator=g0, dtype=dt), dim=-1)
        v = torch.randn(T, V, generator=g0, dtype=dt); beta = torch.sigmoid(torch.randn(T, generator=g0, dtype=dt))
        x = torch.randn(T, K, generator=g0, dtype=dt)
        if gate == "unbounded": A = torch.empty(1).uniform_(1, 16, generator=g0).item(); gt = -A * torch.nn.functional.softplus(x)
        elif gate == "bounded-5": A = torch.empty(1).uniform_(1, 16, generator=g0).item(); gt = -5 * torch.sigmoid(A * x)
        elif gate == "bounded-weak": A = torch.empty(1).uniform_(1, 16, generator=g0).item(); gt = -0.05 * torch.sigmoid(A * x)
        else: gt = torch.nn.functional.logsigmoid(x + 6)
        G = torch.cumsum(gt, 0); h0 = 0.1 * torch.randn(K, V, generator=g0, dtype=dt)
        ex = chunk(q, k, v, beta, G, h0, K ** -0.5, "exact")
        for kind in res:
            base = kind.removesuffix("+store")
            with torch.no_grad():
                res[kind].append(rel(chunk(q, k, v, beta, G, h0, K ** -0.5, base, base != kind), ex))
    print(gate, {k: f"{sum(v)/len(v):.2e}" for k, v in res.items()})
