"""kernel-fun: Hopper CUDA C++ kernels for KDA and short causal conv1d, a drop-in for fla.

Importing this package imports nothing heavy: torch, the compiled extension and fla load on
first use. Families: ``kernel_fun.kda`` (chunk_kda) and ``kernel_fun.cconv`` (causal_conv1d).
"""

__version__ = "0.1.0"  # the one source of the version (pyproject reads it)

__all__ = ["__version__", "versions", "strict", "KernelFunUnsupported", "kda", "cconv", "ref"]


def versions() -> dict[str, str]:
    """Versions of everything a bug report needs; "not installed" / "unknown" when absent."""
    from kernel_fun._versions import collect

    return collect()


def strict(enabled: bool = True):
    """Context manager: inside it, a call our kernels cannot serve raises KernelFunUnsupported with
    the reason instead of falling back to fla. KERNEL_FUN_STRICT=1 does the same process-wide."""
    from kernel_fun._dispatch import strict as _strict

    return _strict(enabled)


def __getattr__(name):  # lazy submodules: `import kernel_fun` stays light
    if name == "KernelFunUnsupported":
        from kernel_fun._dispatch import KernelFunUnsupported

        return KernelFunUnsupported
    if name in ("kda", "cconv", "ref", "bench"):
        import importlib

        return importlib.import_module(f"kernel_fun.{name}")
    raise AttributeError(f"module 'kernel_fun' has no attribute {name!r}")
