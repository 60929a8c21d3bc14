"""Turning benchmark rows into the printed table, ``<gpu>.json``, ``<gpu>.md`` and ``<gpu>.png``.

Torch-free: the writers take plain rows (dicts, see ``ROW_KEYS``) so they can be tested on a CPU
from synthetic rows.
"""

from __future__ import annotations

import json
import math
import os
import re

# Every row carries these keys (values may be None); docs/benchmark.md explains each.
ROW_KEYS = (
    "family", "case", "pass", "impl", "status", "note", "ms", "ms_min", "ms_max", "iters",
    "warmup", "bytes", "tbps", "roofline_frac", "floor_ms", "speedup_vs_fla", "rel_rms_vs_kernel_fun", "engaged",
    "peak_mem_gib", "anchor_fla_ms", "shape", "params", "gpu", "device_name", "copy_tbps",
    "versions", "date", "host_ahead",
)
STATUSES = ("ok", "not_run", "error")
IMPLS = ("kernel_fun", "fla", "flashkda")


def gpu_slug(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    s = device_name.lower()
    s = re.sub(r"\bnvidia\b", " ", s)
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    return s or "gpu"


def new_row(**kw) -> dict:
    row = {k: None for k in ROW_KEYS}
    unknown = set(kw) - set(ROW_KEYS)
    if unknown:
        raise KeyError(f"unknown row keys {sorted(unknown)}")
    row.update(kw)
    return row


def _groups(rows: list[dict]) -> list[tuple[tuple[str, str, str], dict[str, dict]]]:
    """Rows grouped by (family, case, pass) in first-seen order, as {impl: row}."""
    out: dict[tuple[str, str, str], dict[str, dict]] = {}
    for r in rows:
        out.setdefault((r["family"], r["case"], r["pass"]), {})[r["impl"]] = r
    return list(out.items())


def _ms(r: dict | None) -> str:
    if r is None:
        return "-"
    if r.get("status") == "ok" and r.get("ms") is not None:
        return f"{r['ms']:.3f}"
    return "not run" if r.get("status") == "not_run" else (r.get("status") or "-")


def _num(x, fmt: str, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, fmt) + suffix


def speedup(ours: dict | None, fla: dict | None) -> float | None:
    """fla ms / kernel_fun ms, when both ran (any other implementation's row in fla's place:
    its ms / kernel_fun ms)."""
    if not ours or not fla or ours.get("ms") is None or fla.get("ms") is None:
        return None
    if ours["status"] != "ok" or fla["status"] != "ok" or ours["ms"] <= 0:
        return None
    return fla["ms"] / ours["ms"]


def _note(ours: dict | None, fla: dict | None, fk: dict | None = None) -> str:
    present = [(tag, r) for tag, r in (("kernel_fun", ours), ("fla", fla), ("flashkda", fk)) if r]
    notes = [f"{tag}: {r['note']}" if len(present) > 1 else r["note"] for tag, r in present if r.get("note")]
    # rows timed with the host kept ahead of the GPU (--host-ahead) report GPU time: said per case,
    # since a merged page may hold both kinds
    ahead = [tag for tag, r in present if r.get("host_ahead") and r.get("status") == "ok"]
    if ahead:
        notes.append("host kept ahead of the GPU: " + ", ".join(ahead))
    return "; ".join(notes)


# flashkda ms, flashkda/ours: blank where FlashKDA has no row (it covers bounded fwd, K=V=128, no GVA)
TABLE_HEADER = ("case", "pass", "kernel_fun ms", "fla ms", "fla/ours", "flashkda ms", "flashkda/ours",
                "ours TB/s", "ours %roof", "fla TB/s", "fla %roof", "floor ms", "fla anchor ms",
                "peak GiB ours/fla", "note")


def table_rows(rows: list[dict]) -> list[tuple[str, ...]]:
    """One line per (case, pass): the columns of TABLE_HEADER, as strings."""
    lines = []
    for (_, case, pass_), by in _groups(rows):
        ours, fla, fk = by.get("kernel_fun"), by.get("fla"), by.get("flashkda")
        any_r = ours or fla or fk
        sp = speedup(ours, fla)
        anchor = (any_r.get("anchor_fla_ms") or {}).get(pass_) if any_r else None
        mem = "/".join(_num((r or {}).get("peak_mem_gib"), ".2f") for r in (ours, fla))
        lines.append((
            case, pass_, _ms(ours), _ms(fla), _num(sp, ".2f", "x"),
            _ms(fk) if fk else "", _num(speedup(ours, fk), ".2f", "x") if fk else "",
            _num((ours or {}).get("tbps"), ".2f"), _num(_pct((ours or {}).get("roofline_frac")), ".1f", "%"),
            _num((fla or {}).get("tbps"), ".2f"), _num(_pct((fla or {}).get("roofline_frac")), ".1f", "%"),
            _num(any_r.get("floor_ms") if any_r else None, ".3f"), _num(anchor, ".2f"),
            mem, _note(ours, fla, fk),
        ))
    return lines


def _pct(frac):
    return None if frac is None else 100.0 * frac


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table for the terminal (the note column is not padded)."""
    body = table_rows(rows)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(TABLE_HEADER)]
    def fmt(cols):
        head = "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cols[:-1], widths[:-1])))
        return (head + "  " + cols[-1]).rstrip()
    out = [fmt(TABLE_HEADER), fmt(tuple("-" * w for w in widths))]
    out += [fmt(b) for b in body]
    return "\n".join(out)


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict], meta: dict) -> str:
    """The committed results page: header (date, GPU, versions, roofline, method) + table."""
    v = meta.get("versions") or {}
    lines = [
        f"# kernel-fun benchmark: {meta.get('device_name', '?')}",
        "",
        f"Generated by `python -m kernel_fun.bench` on {meta.get('date', '?')}. "
        "Do not edit by hand: re-run and commit the three files together.",
        "",
        "| | |",
        "|---|---|",
        f"| GPU | {meta.get('device_name', '?')} (`{meta.get('gpu', '?')}`) |",
    ]
    for key in ("kernel_fun", "extension", "torch", "cuda", "triton", "fla", "fla_backend"):
        if key in v:
            lines.append(f"| {key} | {_md_cell(str(v[key]))} |")
    ct = meta.get("copy_tbps")
    lines += [
        f"| copy roofline (device-to-device, read + write bytes) | "
        f"{_num(ct, '.2f')} TB/s |",
        f"| timing | CUDA events, {meta.get('warmup', '?')} warm-up calls, median of "
        f"{meta.get('iters', '?')}; L2 flushed before each timed call: "
        f"{'yes' if meta.get('flush_l2') else 'no'}; host kept ahead of the GPU (a GPU sleep before each "
        f"timed call, --host-ahead): {meta.get('host_ahead') or 'no'} |",
    ]
    if meta.get("wall_s") is not None:
        lines.append(f"| benchmark wall time | {meta['wall_s']:.0f} s |")
    lines += [
        "",
        "fla/ours > 1 means kernel-fun is faster; flashkda/ours likewise, for FlashKDA (forward only, "
        "bounded gate, K=V=128, no GVA: blank elsewhere; its output checked against ours, rel-RMS "
        "in the note). TB/s = minimal HBM bytes / median time; "
        "%roof = that over the copy roofline; floor ms = bytes / copy roofline; "
        "fla anchor = fla's time in bench/anchors-h200.md (drift check). "
        "\"not run\" rows were not timed; the note says why. See docs/benchmark.md.",
        "",
        "| " + " | ".join(TABLE_HEADER) + " |",
        "|" + "|".join("---" if i < 2 or i == len(TABLE_HEADER) - 1 else "---:"
                       for i in range(len(TABLE_HEADER))) + "|",
    ]
    for b in table_rows(rows):
        lines.append("| " + " | ".join(_md_cell(c) for c in b) + " |")
    for n in meta.get("notes") or []:
        lines += ["", f"Note: {n}"]
    lines.append("")
    return "\n".join(lines)


def write_json(rows: list[dict], path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1, sort_keys=False)
        f.write("\n")
    return path


def write_markdown(rows: list[dict], meta: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(markdown(rows, meta))
    return path


def write_png(rows: list[dict], meta: dict, path: str) -> tuple[bool, str]:
    """Bar chart of fla/ours per case and pass. Returns (written, message); never raises for a
    missing matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return False, f"PNG skipped: matplotlib is not importable ({e})"
    groups = _groups(rows)
    if not groups:
        return False, "PNG skipped: no rows"
    labels, values, colors, texts = [], [], [], []
    for (_, case, pass_), by in groups:
        sp = speedup(by.get("kernel_fun"), by.get("fla"))
        labels.append(f"{case}\n{pass_}")
        values.append(sp if sp is not None else 0.0)
        if sp is None:
            colors.append("#dddddd")
            ours = by.get("kernel_fun")
            texts.append("not run" if (ours is None or ours.get("status") != "ok") else "no fla")
        else:
            colors.append("#2b8a3e" if sp >= 1.0 else "#c92a2a")
            texts.append(f"{sp:.2f}x")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(labels) + 2), 4.5))
    xs = range(len(labels))
    ax.bar(xs, values, color=colors, edgecolor="#555555", linewidth=0.5)
    top = max([v for v in values if v] + [1.0])
    for x, v, t in zip(xs, values, texts):
        ax.text(x, (v if v else 0) + 0.02 * top, t, ha="center", va="bottom", fontsize=7,
                rotation=90 if len(labels) > 12 else 0)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speedup vs fla (fla ms / kernel_fun ms)")
    ax.set_ylim(0, top * 1.25)
    ax.set_title(f"kernel-fun vs fla {(meta.get('versions') or {}).get('fla', '')} on "
                 f"{meta.get('device_name', '?')} ({meta.get('date', '')})", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True, path


def merge_runs(runs: list[list[dict]]) -> tuple[list[dict], dict]:
    """Rows of several runs of the benchmark (each a list of JSON rows, oldest first) as one
    table: per (family, case, pass, impl) the newest timed row wins, else the newest row. For a
    device budget that fits only part of the cases per call. Returns (rows, meta for the page)."""
    best: dict[tuple, dict] = {}
    order: list[tuple] = []
    for rows in runs:
        for r in rows:
            key = (r.get("family"), r.get("case"), r.get("pass"), r.get("impl"))
            if key not in best:
                order.append(key)
                best[key] = r
            elif r.get("status") == "ok" or best[key].get("status") != "ok":
                best[key] = r
    merged = [best[k] for k in order]
    timed = [r for r in merged if r.get("status") == "ok"] or merged
    last = max(timed, key=lambda r: r.get("date") or "")
    dates = sorted({r.get("date") for r in timed if r.get("date")})
    # A run without fla (--no-fla) leaves an older run's fla row beside its own: the ratio of such a
    # row pair is across processes, and the note says so, case by case.
    ok = {(r.get("family"), r.get("case"), r.get("pass"), r.get("impl")): r for r in merged if r.get("status") == "ok"}
    # The same for FlashKDA's rows (a run with --no-flashkda, or one without its build, over one with).
    apart = [f"{c} {p} (ours {r.get('date')}, {o} {ok[(f, c, p, o)].get('date')})"
             for (f, c, p, i), r in ok.items() if i == "kernel_fun"
             for o in ("fla", "flashkda")
             if (f, c, p, o) in ok and ok[(f, c, p, o)].get("date") != r.get("date")]
    same = ("ours and fla's (FlashKDA's) of one case come from the same process" if not apart else
            "ours and fla's (FlashKDA's) of one case come from the same process, except in these rows, where "
            "the other's time (and so the ratio) is from another run: " + "; ".join(apart))
    meta = {"device_name": last.get("device_name"), "gpu": last.get("gpu"), "versions": last.get("versions"),
            "copy_tbps": last.get("copy_tbps"), "date": ", ".join(dates) or last.get("date"),
            "iters": ", ".join(sorted({str(r.get("iters")) for r in timed if r.get("iters")})) or None,
            "warmup": last.get("warmup"), "flush_l2": True,
            "host_ahead": _host_ahead_summary(timed),
            # runs by the dates of the rows kept (each run stamps its own): an input may itself be merged
            "notes": [f"merged from {len(dates) or len(runs)} runs of the benchmark (one per device call); each row "
                      f"keeps its own date and versions in the JSON; {same}"]}
    return merged, meta


def _host_ahead_summary(rows: list[dict]) -> str:
    """The timing line's host-ahead entry for merged rows: yes, no, or the marked rows only."""
    ahead = {bool(r.get("host_ahead")) for r in rows}
    if ahead == {True}:
        return "yes"
    return "rows marked in the note" if True in ahead else "no"


def write_all(rows: list[dict], meta: dict, out_dir: str) -> list[str]:
    """Write exactly <gpu>.json, <gpu>.md and (when matplotlib imports) <gpu>.png under out_dir.
    Returns messages to print."""
    slug = meta.get("gpu") or "gpu"
    msgs = []
    base = os.path.join(out_dir, slug)
    ok, msg = write_png(rows, meta, base + ".png")
    if not ok:
        meta = dict(meta, notes=list(meta.get("notes") or []) + [msg])
    msgs.append(msg if not ok else f"wrote {base}.png")
    write_json(rows, base + ".json")
    write_markdown(rows, meta, base + ".md")
    msgs[:0] = [f"wrote {base}.json", f"wrote {base}.md"]
    return msgs
