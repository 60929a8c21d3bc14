"""kernel_fun.versions(): one dict of the versions that matter for a bug report."""

from __future__ import annotations

import importlib.metadata as md


def _dist_version(*names: str) -> str:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return "not installed"


def collect() -> dict[str, str]:
    import kernel_fun
    from kernel_fun import _ext

    out = {"kernel_fun": kernel_fun.__version__}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda or "not installed"
    except ImportError:
        out["torch"] = out["cuda"] = "not installed"
    out["triton"] = _dist_version("triton")
    out["fla"] = _dist_version("fla-core", "flash-linear-attention")
    out["cutlass"] = _dist_version("nvidia-cutlass")
    info = _ext.build_info()
    out["extension"] = info if info else f"unavailable ({_ext.status()[1]})"
    out["device"] = "unknown"
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(torch.cuda.current_device())
            out["device"] = f"{p.name} sm{p.major}{p.minor}"
        else:
            out["device"] = "no CUDA device"
    except Exception:  # noqa: BLE001 - versions() must never raise
        pass
    return out
