"""The benchmark's cases: one named list, one dataclass per case, and the byte model.

Pure Python (no torch): ``python -m kernel_fun.bench --list`` and the CPU tests use it as is.
The shapes are the named cases of bench/anchors-h200.md; ``anchor_fla_ms`` holds fla's
numbers measured there (H200, fla 0.5.2), printed next to ours so machine drift shows.

Byte model (``Case.bytes(pass_)``): the fewest HBM bytes the call must move - every input read
once and every output written once:
    fwd      = inputs + outputs
    fwd+bwd  = fwd + (inputs read again + d(outputs) read + d(inputs) written)
             = 3 * inputs + 2 * outputs
Gradients have their inputs' dtypes, so d(inputs) has the byte size of inputs. Intermediates
that a real implementation saves or recomputes are deliberately NOT counted: this is the floor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PASSES = ("fwd", "fwd+bwd")
FAMILIES = ("kda", "cconv")

_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "int32": 4, "int64": 8}


def _nbytes(dtype: str, *dims: int) -> int:
    n = _SIZE[dtype]
    for d in dims:
        n *= d
    return n


@dataclass(frozen=True)
class KdaCase:
    """chunk_kda(q, k, v, g, beta, A_log=..., dt_bias=..., <flags>) on random bf16 inputs.

    q, k [B,T,H,K], v [B,T,HV,V], raw gate g [B,T,HV,K] (random normal), beta logits [B,T,HV],
    A_log = log U[1,16] fp32 [HV], dt_bias fp32 [HV*K] (small random). The gate and the beta
    sigmoid and the q/k l2norm are always computed in the kernel (use_*_in_kernel=True).
    ``lower_bound`` None is fla's unbounded gate; set, with ``safe_gate``, the bounded one.
    ``doc_lens`` packs B=1 documents along T (cu_seqlens int32 on the device + cu_seqlens_cpu).
    """

    name: str
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    lower_bound: float | None = None
    safe_gate: bool = False
    doc_lens: tuple[int, ...] | None = None
    anchor_fla_ms: dict[str, float] = field(default_factory=dict)
    what: str = ""
    family: str = "kda"
    dtype: str = "bf16"

    def __post_init__(self):
        if self.HV % self.H:
            raise ValueError(f"{self.name}: HV={self.HV} is not a multiple of H={self.H}")
        if self.doc_lens is not None and (self.B != 1 or sum(self.doc_lens) != self.T):
            raise ValueError(f"{self.name}: packed docs need B == 1 and sum(doc_lens) == T")

    @property
    def gate(self) -> str:
        return "unbounded" if self.lower_bound is None else "bounded"

    def shape(self) -> dict:
        d = {"B": self.B, "T": self.T, "H": self.H, "HV": self.HV, "K": self.K, "V": self.V,
             "dtype": self.dtype}
        if self.doc_lens is not None:
            d["doc_lens"] = list(self.doc_lens)
        return d

    def params(self) -> dict:
        """The keyword arguments of the call (tensors named, not included)."""
        p = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True,
             "use_beta_sigmoid_in_kernel": True, "A_log": "log U[1,16] fp32 [HV]",
             "dt_bias": "fp32 [HV*K]"}
        if self.lower_bound is not None:
            p["lower_bound"] = self.lower_bound
        if self.safe_gate:
            p["safe_gate"] = True
        if self.doc_lens is not None:
            p["cu_seqlens"] = "int32 [N+1] on device, plus cu_seqlens_cpu"
        return p

    def describe(self) -> str:
        s = f"B{self.B} T{self.T} H{self.H}"
        s += f" HV{self.HV}" if self.HV != self.H else ""
        s += f" K{self.K} V{self.V} {self.gate} gate"
        if self.safe_gate:
            s += f" (lower_bound={self.lower_bound:g}, safe_gate)"
        if self.doc_lens is not None:
            s += f", {len(self.doc_lens)} packed docs"
        return s

    def io_bytes(self) -> tuple[int, int]:
        """(input bytes, output bytes) of one forward call."""
        B, T, H, HV, K, V, dt = self.B, self.T, self.H, self.HV, self.K, self.V, self.dtype
        inputs = (2 * _nbytes(dt, B, T, H, K)          # q, k
                  + _nbytes(dt, B, T, HV, V)           # v
                  + _nbytes(dt, B, T, HV, K)           # g (raw gate)
                  + _nbytes(dt, B, T, HV)              # beta (logits)
                  + _nbytes("fp32", HV)                # A_log
                  + _nbytes("fp32", HV * K))           # dt_bias
        if self.doc_lens is not None:
            inputs += _nbytes("int32", len(self.doc_lens) + 1)
        outputs = _nbytes(dt, B, T, HV, V)             # o (no final state requested)
        return inputs, outputs

    def bytes(self, pass_: str) -> int:
        return _pass_bytes(*self.io_bytes(), pass_)


@dataclass(frozen=True)
class CconvCase:
    """causal_conv1d(x, weight, activation=...) on random bf16 x [B,T,D] and weight [D,W]."""

    name: str
    B: int
    T: int
    D: int
    W: int = 4
    activation: str | None = "silu"
    anchor_fla_ms: dict[str, float] = field(default_factory=dict)
    what: str = ""
    family: str = "cconv"
    dtype: str = "bf16"

    def shape(self) -> dict:
        return {"B": self.B, "T": self.T, "D": self.D, "W": self.W, "dtype": self.dtype}

    def params(self) -> dict:
        return {"activation": self.activation, "bias": None}

    def describe(self) -> str:
        return f"B{self.B} T{self.T} D{self.D} W{self.W} {self.activation or 'no act'}, no bias"

    def io_bytes(self) -> tuple[int, int]:
        inputs = _nbytes(self.dtype, self.B, self.T, self.D) + _nbytes(self.dtype, self.D, self.W)
        outputs = _nbytes(self.dtype, self.B, self.T, self.D)
        return inputs, outputs

    def bytes(self, pass_: str) -> int:
        return _pass_bytes(*self.io_bytes(), pass_)


def _pass_bytes(inputs: int, outputs: int, pass_: str) -> int:
    if pass_ == "fwd":
        return inputs + outputs
    if pass_ == "fwd+bwd":
        # forward, then the backward reads the inputs and d(out), writes d(inputs)
        return (inputs + outputs) + (inputs + outputs + inputs)
    raise ValueError(f"unknown pass {pass_!r} (want one of {PASSES})")


_UNB = dict(lower_bound=None, safe_gate=False)
_BND = dict(lower_bound=-5.0, safe_gate=True)

# The one list. Order = the order of the table.
CASES: tuple[KdaCase | CconvCase, ...] = (
    KdaCase("prod8192", B=16, T=8192, H=16, HV=16, K=128, V=256, **_UNB,
            anchor_fla_ms={"fwd": 9.67, "fwd+bwd": 49.57},
            what="OLMo-core production call (unbounded gate)"),
    KdaCase("k3_h32", B=8, T=8192, H=32, HV=32, K=128, V=128, **_UNB,
            anchor_fla_ms={"fwd": 7.81, "fwd+bwd": 42.56}, what="Kimi-K3-like heads, unbounded"),
    KdaCase("small", B=4, T=4096, H=16, HV=16, K=128, V=128, **_UNB,
            anchor_fla_ms={"fwd": 1.74, "fwd+bwd": 6.70}, what="small batch, unbounded"),
    KdaCase("bounded_b16", B=16, T=8192, H=16, HV=16, K=128, V=128, **_BND,
            anchor_fla_ms={"fwd": 6.69}, what="bounded gate (NeMo Kimi-K3 call)"),
    KdaCase("bounded_b8_h32", B=8, T=8192, H=32, HV=32, K=128, V=128, **_BND,
            anchor_fla_ms={"fwd": 6.73}, what="bounded gate, 32 heads (FlashKDA's B8 H32 case)"),
    KdaCase("bounded_b1", B=1, T=8192, H=16, HV=16, K=128, V=128, **_BND,
            anchor_fla_ms={"fwd": 1.75}, what="one sequence, bounded"),
    KdaCase("long_b1_t32k", B=1, T=32768, H=32, HV=32, K=128, V=128, **_BND,
            anchor_fla_ms={"fwd": 4.78}, what="few long sequences (32 sequence-heads)"),
    KdaCase("long_b1_t32k_doc", B=1, T=32768, H=32, HV=32, K=128, V=128, **_BND, doc_lens=(32768,),
            what="long_b1_t32k as packed-sequence trainers call it: one document in cu_seqlens"),
    KdaCase("long_b1_t32k_h8", B=1, T=32768, H=8, HV=8, K=128, V=128, **_BND,
            what="few heads per GPU (tensor parallel), long: 16 scan chains (the split forward's case)"),
    KdaCase("long_docs_h8", B=1, T=32768, H=8, HV=8, K=128, V=128, **_BND, doc_lens=(24576, 8192),
            what="two long documents of unequal length, few heads: the varlen split from the longest document"),
    KdaCase("long_b1_t128k", B=1, T=131072, H=32, HV=32, K=128, V=128, **_BND,
            what="one long sequence (the context-parallel row cp2_b1_t128k splits it over 2 GPUs)"),
    KdaCase("varlen", B=1, T=8192, H=32, HV=32, K=128, V=128, **_BND,
            doc_lens=(1300, 547, 2048, 963, 271, 3063),
            anchor_fla_ms={"fwd": 1.32}, what="packed documents, bounded"),
    KdaCase("gva", B=8, T=8192, H=8, HV=16, K=128, V=128, **_UNB,
            what="grouped value attention HV = 2H, unbounded"),
    CconvCase("cconv_d2048", B=16, T=8192, D=2048,
              anchor_fla_ms={"fwd": 0.60, "fwd+bwd": 3.14}, what="KDA q/k conv width"),
    CconvCase("cconv_d4096", B=16, T=8192, D=4096,
              anchor_fla_ms={"fwd": 0.90, "fwd+bwd": 5.62}, what="KDA v conv width"),
    CconvCase("cconv_small", B=4, T=4096, D=2048,
              anchor_fla_ms={"fwd": 0.16, "fwd+bwd": 1.17}, what="small"),
)

CASE_NAMES = tuple(c.name for c in CASES)
if len(set(CASE_NAMES)) != len(CASE_NAMES):  # pragma: no cover - a typo in the list above
    raise RuntimeError("duplicate case names in kernel_fun.bench.cases.CASES")


def select(family: str = "all", names: list[str] | tuple[str, ...] | None = None):
    """Cases of one family ("kda", "cconv" or "all"), optionally only the given names (in the
    order given, so a time-budgeted run measures the most important cases first). An unknown name raises ValueError listing the known ones."""
    if family not in ("all",) + FAMILIES:
        raise ValueError(f"unknown family {family!r} (want all, {', '.join(FAMILIES)})")
    if names:
        unknown = [n for n in names if n not in CASE_NAMES]
        if unknown:
            raise ValueError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASE_NAMES)}")
        by_name = {c.name: c for c in CASES}
        return [by_name[n] for n in dict.fromkeys(names) if family == "all" or by_name[n].family == family]
    return [c for c in CASES if family == "all" or c.family == family]


def passes(pass_: str) -> tuple[str, ...]:
    if pass_ == "all":
        return PASSES
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r} (want fwd, fwd+bwd or all)")
    return (pass_,)
