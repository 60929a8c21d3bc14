"""T1_h0's o error (the accuracy matrix's last case over the bound that is not dA_log): how much of it is
the bf16 rounding of the initial state as an MMA operand? One sequence of T tokens (K = V = 64,
unbounded gate, l2norm, fp32 h0 ~ randn as the matrix draws it), o through the chunk form in fp64 with
the kernels' roundings (w, qg, Aqk, Akk stored in bf16; h and v' as bf16 MMA operands; o written in
bf16) against the exact chunk form, over 40 seeds; once with h0 kept exact in the products.
(2026-12-03: docs/notes/2026-12-02-dalog-floor.md, eighth session.)

    python3 scripts/dev/t1_o_floor.py      (CPU, seconds)
"""
import torch, statistics
dt=torch.float64
def b(x): return x.to(torch.bfloat16).to(dt)
def run(seed, round_h, T=1, K=64, V=64):
    g=torch.Generator().manual_seed(seed)
    q=torch.nn.functional.normalize(b(torch.randn(T,K,generator=g,dtype=dt)),dim=-1)
    k=torch.nn.functional.normalize(b(torch.randn(T,K,generator=g,dtype=dt)),dim=-1)
    v=b(torch.randn(T,V,generator=g,dtype=dt)); beta=torch.sigmoid(b(torch.randn(T,generator=g,dtype=dt)))
    A=torch.empty(1).uniform_(1,16,generator=g).item()
    x=b(torch.randn(T,K,generator=g,dtype=dt)); bias=0.5*torch.randn(K,generator=g,dtype=dt)
    gt=-A*torch.nn.functional.softplus(x+bias); G=torch.cumsum(gt,0)
    h0=torch.randn(K,V,generator=g,dtype=dt)   # fp32 initial state (randn as the matrix)
    h0=h0.float().double()
    scale=K**-0.5
    # exact
    Aqk=scale*torch.tril((q*torch.exp(G))@(k*torch.exp(-G)).T)
    L=beta[:,None]*torch.tril((k*torch.exp(G))@(k*torch.exp(-G)).T,-1)
    M=torch.linalg.inv(torch.eye(T,dtype=dt)+L); Akk=M*beta[None,:]
    w=Akk@(k*torch.exp(G)); qg=scale*q*torch.exp(G)
    vn=Akk@v - w@h0; o_ex=qg@h0+Aqk@vn
    # ours: stored bf16 w, qg, Aqk, Akk; h operand bf16 (or exact); v' bf16 operand; o bf16
    hh=b(h0) if round_h else h0
    vn2=b(Akk)@v - b(w)@hh
    o=b(b(qg)@hh + b(Aqk)@b(vn2))
    return ((o-o_ex).pow(2).mean().sqrt()/o_ex.pow(2).mean().sqrt()).item()
for T in (1, 8):
  for rh in (True,False):
    e=[run(s,rh,T=T) for s in range(40)]
    print(f"T={T} round_h={rh}: median {statistics.median(e):.2e} max {max(e):.2e} (40 seeds, one head)")
