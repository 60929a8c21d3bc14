# Which 16-bit intermediate makes dA_log's error large? An fp64 re-implementation of the KDA
# backward (the stages of src/kernel_fun/ref/kda_bwd.py, fixed-length batches only) with one switch
# per intermediate that rounds it to the case's 16-bit dtype at the point where our kernels or
# fla 0.5.2's store it (docs/notes/2026-12-02-dalog-floor.md has the table of who stores what).
# Prints dA_log / ddt_bias / dg rel-RMS against the unrounded fp64 result for: no rounding, each
# single rounding, our set, fla's set, and each set less one rounding; and (--emu) the error of
# our kernels on the host emulator (tests/emu) on the same CPU inputs.
#
# Run: . /work/venv/bin/activate; python scripts/dev/dalog_floor.py [--cases a,b] [--seeds 3] [--emu]
# (CPU only, ~1 min without --emu; KF_EMU_ROOT=<a git archive of a commit> builds the emulator there.)
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "src")]

from kernel_fun.bench import accuracy as acc  # noqa: E402
from kernel_fun.ref.kda import _common, _flags, _from_chunks, _to_chunks  # noqa: E402
from kernel_fun.ref.kda_bwd import _gate_bwd, _masks, chunk_kda_bwd_reference  # noqa: E402

# One switch per intermediate, with where it is rounded (O = ours stores / feeds it in 16 bits,
# F = fla 0.5.2 does).
SWITCHES = {
    "qk": "F    q^, k^ after the l2norm (fla's l2norm_fwd writes the input dtype)",
    "beta": "F    sigmoid(beta) (fla's fused_beta_sigmoid writes beta's dtype)",
    "Aqk": "OF   Aqk saved by the forward",
    "Akk": "OF   the WY factor of w / u / dv / dkexp: ours Akk = M diag(beta), fla's A = M",
    "M": "O    M = (I + L)^-1 for dbeta and dL (fla: the same stored A as above)",
    "bx": "F    beta v and beta k exp(gn) as the WY products' operands (fla form only)",
    "kexp": "OF   k exp(gn) as the operand of w and of dAkk += dw kexp^T",
    "w": "OF   w",
    "u": "F    u = Akk v (ours recomputes v' = Akk v - w h in one fp32 accumulator)",
    "vn": "OF   v' (fla's v_new; ours the V1 tile)",
    "h": "OF   h checkpoints (the state as the operand of w h, do h, v' dh, h dh)",
    "qg": "OF   qg (dh scan)",
    "kg": "OF   kg (re-scan, dh scan)",
    "vn_s": "     v' in the re-scan only (h += kg^T v'; v' of the backward products unrounded)",
    "vn_g": "     v' in the backward products only (dAqk, dkg; the re-scan's v' unrounded)",
    "h_s": "     h as the re-scan's operand of w h only",
    "h_g": "     h checkpoints in the grads products only (do h, dv' h, h dh)",
    "dh_s": "     dh as the dh scan's operand of kg dh only",
    "dh_g": "     dh checkpoints in the grads products only (v' dh, h dh)",
    "dvA": "F    Aqk^T do before kg dh is added (fla's chunk_kda_bwd_dAv output)",
    "dvn": "OF   dv'",
    "dh": "OF   dh checkpoints (and the operand of kg dh)",
    "dh_last": "     (an exemption, not a rounding) the last chunk's dh = dht exact in the grads products",
    "vn_last": "     (an exemption) the last chunk's v' exact in the grads products (hi + lo there only)",
    "dw": "OF   dw = -(dv' h^T)",
    "dM": "OF   dAkk diag(beta) and Z = dM M^T before dL = -(M^T Z)",
}
OURS = {"Aqk", "Akk", "M", "kexp", "w", "vn", "h", "qg", "kg", "dvn", "dh", "dw", "dM"}
FLA = {"qk", "beta", "Aqk", "Akk", "bx", "kexp", "w", "u", "vn", "h", "qg", "kg", "dvA", "dvn", "dh", "dw", "dM"}


def core(q, k, v, gate, beta, scale, h0, do, dht, rnd, lp, form, BT=64):
    """kda_bwd_core's math with the chosen roundings. form 'ours' | 'fla' (which WY factor is stored).
    Returns dgate [B, T, HV, K] (the log-space gate's gradient)."""
    R = (lambda n, x: x.to(lp).to(x.dtype) if n in rnd else x)
    B, T, HV, K = q.shape
    V = v.shape[-1]
    cd, dev = q.dtype, q.device
    qc, kc, vc, gc, doc = (_to_chunks(x, BT) for x in (q, k, v, gate, do))
    bc = _to_chunks(beta, BT)
    NT = qc.shape[2]
    ge, gt = _masks(BT, dev)
    zero = torch.zeros((), dtype=cd)
    gn = torch.cumsum(gc, dim=-2)
    G = gn[..., -1, :]
    diff = gn[..., :, None, :] - gn[..., None, :, :]
    E = torch.exp(torch.where(ge[:, :, None], diff, torch.full((), float("-inf"), dtype=cd)))
    Aqk = scale * torch.einsum("...id,...jd,...ijd->...ij", qc, kc, E)
    Kt = torch.where(gt, torch.einsum("...id,...jd,...ijd->...ij", kc, kc, E), zero)
    L = bc[..., :, None] * Kt
    eye = torch.eye(BT, dtype=cd)
    M = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    Aqk_r = R("Aqk", Aqk)
    if form == "ours":
        Akk_r, M_r = R("Akk", M * bc[..., None, :]), R("M", M)
        A_apply = lambda X: Akk_r @ X                                   # noqa: E731
        A_T_apply = lambda Y: Akk_r.transpose(-1, -2) @ Y               # noqa: E731
    else:  # fla: one stored A = M; beta applied to the operands (rounded) and after the transposed product
        M_r = R("Akk", M)
        A_apply = lambda X: M_r @ R("bx", bc[..., None] * X)            # noqa: E731
        A_T_apply = lambda Y: bc[..., None] * (M_r.transpose(-1, -2) @ Y)  # noqa: E731
    kexp = kc * torch.exp(gn)
    kexp_r = R("kexp", kexp)
    w = R("w", A_apply(kexp_r))
    u = R("u", A_apply(vc))
    kg = kc * torch.exp(G[..., None, :] - gn)
    qg = qc * torch.exp(gn)
    kg_r, qg_r = R("kg", kg), R("qg", qg)

    h = h0 if h0 is not None else torch.zeros(B, HV, K, V, dtype=cd)
    hs, vns = [], []
    for c in range(NT):
        hr = R("h", h)
        hs.append(R("h_g", hr))
        vn = R("vn", u[:, :, c] - w[:, :, c] @ R("h_s", hr))
        vns.append(vn if "vn_last" in rnd and c == NT - 1 else R("vn_g", vn))  # vn_last: as dh_last, for v'
        h = torch.exp(G[:, :, c])[..., None] * h + kg_r[:, :, c].transpose(-1, -2) @ R("vn_s", vn)
    dh = dht if dht is not None else torch.zeros(B, HV, K, V, dtype=cd)
    dhs, dvns = [None] * NT, [None] * NT
    for c in reversed(range(NT)):
        dhr = R("dh", dh)
        dvn = R("dvn", R("dvA", Aqk_r[:, :, c].transpose(-1, -2) @ doc[:, :, c]) + kg_r[:, :, c] @ R("dh_s", dhr))
        # dh_last: the last chunk's dh (= dht) kept exact in the grads products (kda_bwd_grads could read
        # the fp32 dht there instead of its bf16 checkpoint)
        dhs[c], dvns[c] = (dh if "dh_last" in rnd and c == NT - 1 else R("dh_g", dhr)), dvn
        dh = (torch.exp(G[:, :, c])[..., None] * dh + scale * qg_r[:, :, c].transpose(-1, -2) @ doc[:, :, c]
              - w[:, :, c].transpose(-1, -2) @ dvn)
    h_all, dh_all = torch.stack(hs, 2), torch.stack(dhs, 2)
    vn, dvn = torch.stack(vns, 2), torch.stack(dvns, 2)

    dAqk = torch.where(ge, doc @ vn.transpose(-1, -2), zero)
    dqg = doc @ h_all.transpose(-1, -2)
    dkg = vn @ dh_all.transpose(-1, -2)
    dw = R("dw", -(dvn @ h_all.transpose(-1, -2)))
    dAkk = dw @ kexp_r.transpose(-1, -2) + dvn @ vc.transpose(-1, -2)
    dkexp = A_T_apply(dw)
    dM = R("dM", dAkk * bc[..., None, :])
    Z = R("dM", dM @ M_r.transpose(-1, -2))
    dL = torch.where(gt, -(M_r.transpose(-1, -2) @ Z), zero)
    dKt = bc[..., :, None] * dL
    dA1 = scale * dAqk
    P = (torch.einsum("...ij,...id,...jd,...ijd->...ijd", dA1, qc, kc, E)
         + torch.einsum("...ij,...id,...jd,...ijd->...ijd", dKt, kc, kc, E))
    dgn = P.sum(-2) - P.sum(-3)
    dgn = dgn + scale * qg * dqg - kg * dkg + kexp * dkexp
    dG = torch.exp(G) * (h_all * dh_all).sum(-1) + (kg * dkg).sum(-2)
    dgn = dgn.clone()
    dgn[..., -1, :] += dG
    dgate = torch.flip(torch.cumsum(torch.flip(dgn, [-2]), -2), [-2])
    return _from_chunks(dgate, T)


def grads(inputs, kw, do, dht, rnd=frozenset(), form="ours"):
    """(dA_log, ddt_bias, dg) in fp64 with the chosen roundings (fixed-length batches)."""
    lp = inputs[0].dtype
    f = _flags(kw.get("use_qk_l2norm_in_kernel", False), kw.get("use_gate_in_kernel", False),
               kw.get("use_beta_sigmoid_in_kernel", False), kw.get("allow_neg_eigval", False),
               kw.get("lower_bound"), _d(kw.get("A_log")), _d(kw.get("dt_bias")))
    c = _common(*(x.double() for x in inputs), kw.get("scale"), _d(kw.get("initial_state")),
                kw.get("state_v_first", False), None, f)
    assert kw.get("cu_seqlens") is None, "fixed-length only"
    svf = kw.get("state_v_first", False)
    dht = None if dht is None else (dht.double().transpose(-1, -2) if svf else dht.double())
    R = (lambda n, x: x.to(lp).double() if n in rnd else x)
    qe, ke, beta = R("qk", c["qe"]), R("qk", c["ke"]), R("beta", c["beta"])
    dgate = core(qe, ke, c["v"], c["g"], beta, c["scale"], c["h0"], do.double(), dht, rnd, lp, form)
    if kw.get("use_gate_in_kernel"):
        dg, dA, ddt = _gate_bwd(inputs[3].double(), dgate, _d(kw.get("A_log")), _d(kw.get("dt_bias")),
                                kw.get("lower_bound"))
    else:
        dg, dA, ddt = dgate, None, None
    return dA, ddt, dg


def _d(x):
    return None if x is None else x.detach().double()


def rel(ref, got):
    if ref is None or got is None:
        return float("nan")
    ref, got = ref.double().reshape(-1), got.double().reshape(-1)
    d = ref.pow(2).mean().sqrt().item()
    return (ref - got).pow(2).mean().sqrt().item() / d if d else float("nan")


def case_inputs(name, s):
    case = acc.BY_NAME[name]
    case = dataclasses.replace(case, seed=case.seed + 100 * s)
    inputs, kw, seeds = acc.make_inputs(case, device="cpu")
    kw = {k: v for k, v in kw.items() if v is not None and k not in ("safe_gate", "cu_seqlens_cpu")}
    dht = seeds["ht"] if kw.get("output_final_state") else None
    return inputs, kw, seeds["o"], dht


def emu_grads(inputs, kw, do, dht):
    # KF_EMU_ROOT: a clean export of a commit (git archive) to build the emulator from, when the
    # working tree's kernels or emulator are mid-edit
    root = os.environ.get("KF_EMU_ROOT")
    if root:
        sys.path.insert(0, os.path.join(root, "tests"))
        sys.modules.pop("helpers", None)
    from helpers import emu_module
    emu = emu_module()
    g, _ = emu.backward_stages(*inputs, do, dht, **kw, saved=None)
    return g["dA_log"], g["ddt_bias"], g["dg"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="strong_bounded_T200,mix24,mix30,mix09")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--emu", action="store_true", help="also our kernels on the host emulator")
    ap.add_argument("--loo", action="store_true", help="also each set less one rounding")
    ap.add_argument("--only", default="", help="comma list of config labels to run (e.g. OURS,FLA)")
    a = ap.parse_args()
    configs = [("none", frozenset(), "ours")]  # the unrounded re-implementation (checked against the stage reference)
    configs += [(n, frozenset({n}), "fla" if n == "bx" else "ours") for n in SWITCHES if not n.endswith("_last")]
    configs += [("OURS", frozenset(OURS), "ours"), ("FLA", frozenset(FLA), "fla")]
    if a.loo:
        configs += [(f"OURS-{n}", frozenset(OURS - {n}), "ours") for n in sorted(OURS)]
        configs += [(f"FLA-{n}", frozenset(FLA - {n}), "fla") for n in sorted(FLA)]
    if a.only:
        configs = [cfg for cfg in configs if cfg[0] in a.only.split(",")]
    for name in a.cases.split(","):
        print(f"\n== {name}: {acc.BY_NAME[name].label()}  (rel-RMS vs unrounded fp64; seeds 0..{a.seeds - 1})")
        rows = {cfg[0]: [] for cfg in configs}
        if a.emu:
            rows["EMU(our kernels)"] = []
        for s in range(a.seeds):
            inputs, kw, do, dht = case_inputs(name, s)
            ref = grads(inputs, kw, do, dht)
            if s == 0 and "none" in rows:  # the unrounded re-implementation is the stage reference
                full = chunk_kda_bwd_reference(*(x.double() for x in inputs), do.double(),
                                               None if dht is None else dht.double(),
                                               **{k: (_d(v) if torch.is_tensor(v) else v) for k, v in kw.items()
                                                  if k != "output_final_state"})
                assert rel(full["dg"], ref[2]) < 1e-10 and rel(full["dA_log"], ref[0]) < 1e-8
                print(f"   dA_log (seed 0) = {[f'{x:.4g}' for x in ref[0].reshape(-1).tolist()]}")
            for label, rnd, form in configs:
                got = grads(inputs, kw, do, dht, rnd, form)
                rows[label].append([rel(r, g) for r, g in zip(ref, got)])
            if a.emu:
                got = emu_grads(inputs, kw, do, dht)
                rows["EMU(our kernels)"].append([rel(r, g) for r, g in zip(ref, got)])
        w = max(30, 9 * a.seeds)
        print(f"   {'config':<18} {'dA_log per seed':<{w}} {'mean':>9} | {'ddt_bias':>9} | {'dg':>9}")
        for label, vals in rows.items():
            t = torch.tensor(vals)
            per = " ".join(f"{x:.2e}" for x in t[:, 0].tolist())
            print(f"   {label:<18} {per:<{w}} {t[:, 0].mean().item():9.2e} | {t[:, 1].mean().item():9.2e} |"
                  f" {t[:, 2].mean().item():9.2e}")


if __name__ == "__main__":
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    main()
