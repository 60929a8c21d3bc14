"""One input of the gradient-accuracy matrix, stage by stage, on the GPU: the fp64 stage reference
(kernel_fun.ref.kda_bwd with return_stages), our kernels' intermediates (kernel_fun.kda._kernel's
backward_stages) and fla 0.5.2's (its internal functions, recorded by wrapping them in
fla.ops.kda.chunk_bwd's namespace while fla's chunk_kda runs forward and backward). Prints each
stage's rel-RMS against the reference, side by side, and saves the inputs and every stage to
OUT/stages_<case>_s<seed>.pt, so that the host emulator and the storage models
(scripts/dev/dalog_floor.py) can run on the very same numbers afterwards.

Why: on strong_bounded_T200 our dA_log is ~10x fla's over 4 of 5 seeds while our storage model
predicted fla no better than us (docs/notes/2026-12-02-dalog-floor.md); the first stage where fla is
much closer to the reference than we are is where the difference lives.

    PYTHONPATH=/tmp/site:src python3 scripts/dev/stage_compare.py strong_bounded_T200 --seed 0 --out $OUT

Without a GPU, the same comparison on the CPU: ours on the host emulator, fla through Triton's
interpreter (scripts/dev/fla_interp.py), on freshly drawn inputs or on a GPU run's saved ones:

    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/dev/stage_compare.py strong_bounded_T200 --emu \
        [--from stages_strong_bounded_T200_s0.pt]

Fixed-length cases only (no cu_seqlens), state_v_first off.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from kernel_fun.bench import accuracy as acc
from kernel_fun.check import rel_rms
from kernel_fun.ref.kda_bwd import _gate_bwd, chunk_kda_bwd_reference

BT = 64


def _record(module, names, store):
    """Wrap module.<name> for each name so that every call appends (args, kwargs, outputs) to
    store[name]; returns an undo function."""
    saved = {}
    for n in names:
        fn = getattr(module, n)
        saved[n] = fn

        def wrapper(*a, __fn=fn, __n=n, **kw):
            out = __fn(*a, **kw)
            det = lambda x: x.detach().clone() if torch.is_tensor(x) else x  # noqa: E731
            store.setdefault(__n, []).append(({k: det(v) for k, v in kw.items()},
                                              tuple(det(o) for o in out) if isinstance(out, tuple) else det(out)))
            return out
        setattr(module, n, wrapper)
    return lambda: [setattr(module, n, f) for n, f in saved.items()]


def _best(name, got, refs: dict):
    """rel-RMS of got against the closest of several candidate references (a stage whose scale or
    factor convention differs between implementations: Aqk with or without scale, M or M diag(beta))."""
    errs = {lab: rel_rms(r.double(), got.double()) for lab, r in refs.items() if r.shape == got.shape}
    if not errs:
        return None, f"{name}: no reference of shape {tuple(got.shape)}"
    lab = min(errs, key=errs.get)
    return errs[lab], lab


def _ours_stages(inputs, kw, seeds, scale, emu=False):
    """Our backward's intermediates (backward_stages: dA, dL, h_ckpt, dh_ckpt, pA, ...) plus the
    forward's saved M, through the GPU ops or, with emu, the host emulator (tests/emu/kda_emu.py)."""
    if emu:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "emu"))
        import kda_emu

        return kda_emu.training_call(*inputs, seeds["o"], seeds["ht"], scale=scale,
                                     **{n: kw.get(n) for n in kda_emu.CALL_KEYS})[2:]
    else:
        from kernel_fun.kda import _kernel as kk
        from kernel_fun.kda._options import KdaOptions

        opts = KdaOptions.from_call(scale=scale, use_qk_l2norm_in_kernel=kw["use_qk_l2norm_in_kernel"],
                                    use_gate_in_kernel=kw["use_gate_in_kernel"],
                                    use_beta_sigmoid_in_kernel=kw["use_beta_sigmoid_in_kernel"],
                                    allow_neg_eigval=kw["allow_neg_eigval"], lower_bound=kw.get("lower_bound"),
                                    A_log=kw.get("A_log"), state_v_first=False, chunk_size=BT)
        common = dict(opts=opts, initial_state=kw.get("initial_state"), A_log=kw.get("A_log"),
                      dt_bias=kw.get("dt_bias"))
        ws = kk.forward_stages(*inputs, **common)[3]
        grads, st = kk.backward_stages(*inputs, seeds["o"], seeds["ht"], saved=(ws["Aqk"], ws["Akk"], ws["M"]),
                                       **common)
    st["M"] = ws["M"]
    return grads, st


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("--seed", type=int, default=None, help="default: the case's own")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--from", dest="inputs_from", default=None,
                    help="the inputs saved by an earlier run (OUT/stages_<case>_s<seed>.pt) instead of drawing them")
    ap.add_argument("--emu", action="store_true",
                    help="no GPU: ours on the host emulator; fla only under TRITON_INTERPRET=1 (Triton's CPU "
                         "interpreter, with the GPU's 16-bit rounding put in by scripts/dev/fla_interp.py)")
    a = ap.parse_args()
    case = acc.BY_NAME[a.case]
    if a.seed is not None:
        case = dataclasses.replace(case, seed=a.seed)
    assert case.cu is None and not case.state_v_first, "fixed-length, K-first states only"
    if a.inputs_from:  # the very inputs of an earlier run (a GPU run's, say), moved to this device
        dev = "cpu" if a.emu else "cuda"
        saved = torch.load(a.inputs_from)
        inputs = [x.to(dev) for x in saved["inputs"]]
        kw = {n_: (x.to(dev) if torch.is_tensor(x) and n_ != "cu_seqlens_cpu" else x) for n_, x in saved["kw"].items()}
        seeds = {n_: (x.to(dev) if x is not None else None) for n_, x in saved["seeds"].items()}
        if saved.get("e2e"):
            print("the saved run's end-to-end errors:", {i: {k_: f"{e_:.2e}" for k_, e_ in e.items()}
                                                        for i, e in saved["e2e"].items() if e})
    else:
        inputs, kw, seeds = acc.make_inputs(case, device="cpu" if a.emu else "cuda")
    q, k, v, g, beta = inputs
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = (T + BT - 1) // BT
    scale = kw.get("scale") or K ** -0.5

    # ---- the fp64 stage reference
    c64 = lambda t: None if t is None else t.double()  # noqa: E731
    rkw = dict(scale=kw.get("scale"), initial_state=c64(kw.get("initial_state")),
               use_qk_l2norm_in_kernel=kw["use_qk_l2norm_in_kernel"], use_gate_in_kernel=kw["use_gate_in_kernel"],
               use_beta_sigmoid_in_kernel=kw["use_beta_sigmoid_in_kernel"], allow_neg_eigval=kw["allow_neg_eigval"],
               lower_bound=kw.get("lower_bound"), A_log=c64(kw.get("A_log")), dt_bias=c64(kw.get("dt_bias")))
    ref, rst = chunk_kda_bwd_reference(*(c64(x) for x in inputs), c64(seeds["o"]), c64(seeds["ht"]),
                                       return_stages=True, **rkw)

    # ---- the end-to-end errors (the matrix's own numbers, for orientation) and fla's stages
    e2e, rec = {}, None
    if not a.emu:
        e2e["ours"] = acc.errors(acc.reference(inputs, kw, seeds), acc.ours(inputs, kw, seeds))
    if not a.emu or os.environ.get("TRITON_INTERPRET") == "1":  # on the CPU: fla through Triton's interpreter
        try:
            if a.emu:
                import fla_interp  # beside this script

                fla_interp.enable()
            import fla.ops.kda.chunk_bwd as fb
        except ImportError as e:
            print(f"fla not importable ({e}): ours only")
        else:
            rec = {}
            undo = _record(fb, ["chunk_kda_bwd_dAv", "chunk_gated_delta_rule_bwd_dhu", "chunk_gated_delta_rule_fwd_h",
                                "chunk_kda_bwd_wy_dqkg_fused", "chunk_kda_bwd_intra", "chunk_local_cumsum",
                                "kda_gate_bwd", "recompute_w_u_fwd"], rec)
            try:
                fla_out = acc.fla(inputs, kw, seeds)
            finally:
                undo()
            e2e["fla"] = acc.errors(acc.reference(inputs, kw, seeds), fla_out)

    # ---- ours: the backward's intermediates (the training path: from the forward's saved factors)
    ours_grads, ours_st = _ours_stages(inputs, kw, seeds, scale, emu=a.emu)
    if a.emu:  # the emulator's gradients end to end, as the GPU rows (o and ht are not returned here)
        e2e["ours"] = {k_: e_ for k_, e_ in acc.errors(acc.reference(inputs, kw, seeds), ours_grads).items()
                       if ours_grads.get(k_) is not None}

    # ---- the reference stages in each implementation's layout
    M = rst["M"]                                   # [B, T, HV, 64]
    bet = beta.double() if not kw["use_beta_sigmoid_in_kernel"] else torch.sigmoid(beta.double())
    Akk = M.clone()
    for c0 in range(0, T, BT):  # Akk[i, j] = M[i, j] beta_j, j the chunk-local column
        c1 = min(T, c0 + BT)
        Akk[:, c0:c1, :, :c1 - c0] *= bet[:, c0:c1].transpose(1, 2).unsqueeze(1)
    h_ref, dh_ref = rst["h"], rst["dh"]            # [B, NT, HV, K, V]
    rows = []

    def add(stage, ours_err, fla_err, note=""):
        rows.append((stage, ours_err, fla_err, note))

    def flat_states(x):  # [B, NT, HV, K, V] -> [B*NT, HV, V, K] (our checkpoints' layout)
        return x.reshape(B * NT, HV, K, V).transpose(-1, -2)

    o_M = o_h = o_dh = o_dA = None
    if ours_st:
        o_M = _best("M", ours_st["M"].reshape(B, T, HV, BT).float(), {"M": M, "Akk": Akk})
        o_h = rel_rms(flat_states(h_ref), ours_st["h_ckpt"][:B * NT].double())
        o_dh = rel_rms(flat_states(dh_ref), ours_st["dh_ckpt"][:B * NT].double())
        o_dA = _best("dAqk", ours_st["dA"].reshape(B, T, HV, BT), {"dAqk": rst["dAqk"], "scale dAqk": scale * rst["dAqk"]})
    f_M = f_h = f_vn = f_dh = f_dA = f_dAkk = f_dgn = f_dgate = None
    try:  # fla's internals are matched by name and position (fla 0.5.2): report a mismatch, go on
        last = lambda n: rec[n][-1] if rec and rec.get(n) else None  # noqa: E731  (kwargs, outputs)
        if last("chunk_gated_delta_rule_fwd_h"):  # the backward's recompute: the last call
            h_f, vn_f = last("chunk_gated_delta_rule_fwd_h")[1][:2]
            f_h, f_vn = rel_rms(h_ref, h_f.double()), rel_rms(rst["v_new"], vn_f.double())
        if last("recompute_w_u_fwd"):  # the saved factor w, u are rebuilt from
            f_M = _best("M", last("recompute_w_u_fwd")[0]["A"].double(), {"M": M, "Akk": Akk})
        if last("chunk_gated_delta_rule_bwd_dhu"):
            f_dh = rel_rms(dh_ref, last("chunk_gated_delta_rule_bwd_dhu")[1][0].double())
        if last("chunk_kda_bwd_dAv"):
            f_dA = _best("dAqk", last("chunk_kda_bwd_dAv")[1][0].double(),
                         {"dAqk": rst["dAqk"], "scale dAqk": scale * rst["dAqk"]})
        if last("chunk_kda_bwd_wy_dqkg_fused"):
            f_dAkk = _best("dAkk", last("chunk_kda_bwd_wy_dqkg_fused")[1][5].double(), {"dAkk": rst["dAkk"]})
        if last("chunk_local_cumsum"):
            kwc, outc = last("chunk_local_cumsum")
            if kwc.get("g") is not None:
                f_dgn = rel_rms(rst["dgn"].reshape(kwc["g"].shape), kwc["g"].double())
            f_dgate = rel_rms(rst["dgate"].reshape(outc.shape), outc.double())
    except Exception as e:  # noqa: BLE001
        print(f"fla's stages not matched: {type(e).__name__}: {e}")
    add("M / Akk (saved factor)", o_M, f_M)
    add("h (state before each chunk)", o_h, f_h)
    add("v' (v_new)", None, f_vn, "ours: never stored (the grads kernel's V1 tile)")
    add("dh (state gradient each chunk reads)", o_dh, f_dh)
    add("dAqk", o_dA, f_dA)
    add("dAkk", None, f_dAkk, "ours: in smem only")
    add("dgn (per-row dg before the cumsum)", None, f_dgn)
    add("dgate (after the reverse cumsum)", None, f_dgate)
    fla_g = e2e.get("fla") or {}
    for key in ("dg", "dA_log", "ddt_bias"):
        if ref.get(key) is not None and ours_grads.get(key) is not None:
            add(f"{key} (final)", rel_rms(ref[key].reshape(-1), ours_grads[key].reshape(-1).double()), fla_g.get(key),
                "fla: against the recurrence" if key in fla_g else "")

    # per-chunk dA_log partials: ours (pA before the passes: rows past 0 of each 64-chunk segment are
    # untouched, row 0 holds the segment sum) against the reference's
    if kw["use_gate_in_kernel"] and kw.get("A_log") is not None:
        dgate = rst["dgate"]  # [B, T, HV, K]
        part_ref = []
        for b in range(B):
            for c0 in range(0, T, BT):
                c1 = min(T, c0 + BT)
                _, dA_c, _ = _gate_bwd(g[b:b + 1, c0:c1].double(), dgate[b:b + 1, c0:c1], c64(kw["A_log"]),
                                       c64(kw.get("dt_bias")), kw.get("lower_bound"))
                part_ref.append(dA_c.reshape(-1))
        part_ref = torch.stack(part_ref)  # [B*NT, HV]
        print("per-chunk dA_log partials, reference:", [f"{x:.4e}" for x in part_ref[:, 0].tolist()[:8]])
        if "pA" in ours_st:
            pa = ours_st["pA"][:B * NT].double()
            print("                              ours:", [f"{x:.4e}" for x in pa[:, 0].tolist()[:8]],
                  "(row 0: the segment's sum)")
        if rec and rec.get("kda_gate_bwd"):
            print("fla dA (after its sum):", rec["kda_gate_bwd"][-1][1][1].reshape(-1).tolist()[:4])

    # Which tokens carry dg's error: dA_log / ddt_bias are sums over tokens, so one token whose dgate
    # is large (the last row of a sequence with the final state's gradient, under a strong gate) can
    # carry the whole error (docs/notes/2026-12-02-dalog-floor.md, fifth session).
    fla_dg = rec["kda_gate_bwd"][-1][1][0] if rec and rec.get("kda_gate_bwd") else None
    if not kw["use_gate_in_kernel"] and rec and rec.get("chunk_local_cumsum"):
        fla_dg = rec["chunk_local_cumsum"][-1][1]
    for impl, got in (("ours", ours_grads.get("dg")), ("fla", fla_dg)):
        if got is None or ref.get("dg") is None:
            continue
        err = (got.double().cpu() - ref["dg"].double().cpu()).reshape(B * T, -1).pow(2).sum(-1)  # per token
        top = err.argsort(descending=True)[:3].tolist()
        tot = err.sum().item()
        print(f"dg error by token, {impl}: " + ", ".join(f"t={i} {err[i].item() / tot:.0%}" for i in top)
              + f" of the squared error (rel-RMS {rel_rms(ref['dg'].reshape(-1), got.reshape(-1).double()):.2e})")

    print(f"\n{case.name} seed {case.seed}: {case.label()}")
    print("end to end (rel-RMS against the fp64 recurrence):")
    for impl, e in e2e.items():
        if e:
            print(f"  {impl:5s} " + "  ".join(f"{k} {v:.2e}" for k, v in e.items()))
    print("\n| stage | ours | fla | note |\n|---|---:|---:|---|")
    for stage, o, f, note in rows:
        def fmt(x):
            if x is None:
                return "-"
            if isinstance(x, tuple):
                return "-" if x[0] is None else f"{x[0]:.2e} (as {x[1]})"
            return f"{x:.2e}"
        print(f"| {stage} | {fmt(o)} | {fmt(f)} | {note} |")

    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"stages_{case.name}_s{case.seed}.pt")
    keep = {"inputs": [x.cpu() for x in inputs], "kw": {n: (x.cpu() if torch.is_tensor(x) else x) for n, x in kw.items()},
            "seeds": {n: (x.cpu() if x is not None else None) for n, x in seeds.items()},
            "ref_stages": {n: x.cpu() for n, x in rst.items() if torch.is_tensor(x)},
            "ref": {n: (x.cpu() if torch.is_tensor(x) else x) for n, x in ref.items()},
            "ours_stages": {n: x.cpu() for n, x in ours_st.items() if torch.is_tensor(x)},
            "ours_grads": {n: x.cpu() for n, x in ours_grads.items() if torch.is_tensor(x)},
            "fla_calls": {n: [(dict((kk_, vv.cpu() if torch.is_tensor(vv) else vv) for kk_, vv in kwd.items()
                                    if torch.is_tensor(vv)),
                               tuple(o.cpu() for o in out if torch.is_tensor(o)) if isinstance(out, tuple) else out.cpu())
                              for kwd, out in calls] for n, calls in (rec or {}).items()},
            "e2e": e2e}
    torch.save(keep, path)
    small = os.path.join(a.out, f"inputs_{case.name}_s{case.seed}.pt")  # what --from needs, small enough to fetch
    torch.save({n: keep[n] for n in ("inputs", "kw", "seeds", "e2e")}, small)
    print(f"\nwrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB) and {small}")


if __name__ == "__main__":
    main()
