"""The one options object of a ``chunk_kda`` call, as every KDA op receives it.

``KdaOptions.from_call`` is the only place that turns chunk_kda's keyword arguments into kernel
options; ``encode()`` is the only serialisation, parsed by ``kda::parse_options``
(csrc/kda/kda_options.cpp). Every op of the family takes this one string instead of a keyword
list restated in Python, C++ and the op schemas.
"""

from __future__ import annotations

from dataclasses import dataclass

GATES = ("precomputed", "unbounded", "bounded", "bounded_no_alog")


@dataclass(frozen=True)
class KdaOptions:
    scale: float
    gate: str = "precomputed"          # one of GATES
    lower_bound: float = 0.0           # used by the bounded gates
    l2norm: bool = False               # use_qk_l2norm_in_kernel
    beta_sigmoid: int = 0              # 0: beta as given; 1: sigmoid(beta); 2: 2 * sigmoid(beta)
    state_v_first: bool = False
    chunk_size: int = 64               # fla's; our kernels chunk as they choose (docs/contract.md)
    intermediate_states: bool = False  # return_intermediate_states: h, one state per chunk_size tokens
    # With cu_seqlens: the longest document's tokens, read from the host copy an eager call validates
    # (``with_max_seq_len``), for the launch model (kda_policy.h's longest_chunks); 0: not read
    # (torch.compile, use_graph). The one field that varies per batch, so it is filled in after the
    # routing decision, whose caches stay keyed on the rest.
    max_seq_len: int = 0
    # The launch switches that decide what a training forward leaves for its backward, so they are
    # read by the front (``launch_switches``) into the options, which the backward receives from its
    # forward, not by the C++ launcher on each call: a backward then takes exactly its forward's path
    # and finds what that forward saved. The split scans (KERNEL_FUN_KDA_SPLIT / _SPLIT_CHUNKS): 2
    # (the default) where the launch model says it pays, 0 never, 1 wherever possible; the piece
    # length in chunks, 0 = the launcher's (a split forward saves its states). The token recurrence
    # (KERNEL_FUN_KDA_RECURRENT): -1 the launch policy, 0 never, 1 wherever possible (a recurrent
    # forward writes no chunk factors).
    split: int = 2
    split_chunks: int = 0
    recurrent: int = -1

    def __post_init__(self):
        if self.gate not in GATES:
            raise ValueError(f"KdaOptions.gate must be one of {GATES}, got {self.gate!r}")
        if self.beta_sigmoid not in (0, 1, 2):
            raise ValueError(f"KdaOptions.beta_sigmoid must be 0, 1 or 2, got {self.beta_sigmoid!r}")
        if self.split not in (0, 1, 2) or self.split_chunks < 0:
            raise ValueError(f"KdaOptions.split must be 0, 1 or 2 and split_chunks >= 0, got {self.split!r}, "
                             f"{self.split_chunks!r}")
        if self.recurrent not in (-1, 0, 1):
            raise ValueError(f"KdaOptions.recurrent must be -1, 0 or 1, got {self.recurrent!r}")

    @classmethod
    def from_call(cls, *, scale: float, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
                  use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, lower_bound: float | None,
                  A_log, state_v_first: bool, chunk_size: int, return_intermediate_states: bool = False,
                  switches: tuple[int, int, int] | None = None) -> KdaOptions:
        """chunk_kda's arguments (already validated) -> options. The gate formula is chosen by
        lower_bound (docs/contract.md, "The gate"), not by safe_gate. switches: (split, split_chunks,
        recurrent), default the environment's now (``launch_switches``)."""
        if not use_gate_in_kernel:
            gate = "precomputed"
        elif lower_bound is None:
            gate = "unbounded"
        else:
            gate = "bounded" if A_log is not None else "bounded_no_alog"
        beta = (2 if allow_neg_eigval else 1) if use_beta_sigmoid_in_kernel else 0
        split, chunks, recurrent = launch_switches() if switches is None else switches
        return cls(scale=float(scale), gate=gate, lower_bound=float(lower_bound or 0.0),
                   l2norm=bool(use_qk_l2norm_in_kernel), beta_sigmoid=beta,
                   state_v_first=bool(state_v_first), chunk_size=int(chunk_size),
                   intermediate_states=bool(return_intermediate_states), split=split, split_chunks=chunks,
                   recurrent=recurrent)

    @property
    def uses_A_log(self) -> bool:
        return self.gate in ("unbounded", "bounded")

    @property
    def uses_dt_bias(self) -> bool:
        return self.gate != "precomputed"

    def encode(self) -> str:
        # floats as C99 hex floats: exact round trip through strtod
        return (f"scale={float(self.scale).hex()};gate={self.gate};lower_bound={float(self.lower_bound).hex()};"
                f"l2norm={int(self.l2norm)};beta_sigmoid={self.beta_sigmoid};"
                f"state_v_first={int(self.state_v_first)};chunk_size={self.chunk_size};"
                f"split={self.split};split_chunks={self.split_chunks};recurrent={self.recurrent};"
                f"intermediate_states={int(self.intermediate_states)};max_seq_len={self.max_seq_len}")


def with_max_seq_len(options: str, longest: int) -> str:
    """The encoded options of a varlen call with its longest document's tokens (read from the validated
    host copy of cu_seqlens), where ``encode()`` left 0."""
    head, sep, tail = options.rpartition(";max_seq_len=")
    if not sep or tail != "0":
        raise ValueError(f"options without max_seq_len=0 at their end: {options!r}")
    return f"{head};max_seq_len={longest}"


def launch_switches() -> tuple[int, int, int]:
    """(KERNEL_FUN_KDA_SPLIT, KERNEL_FUN_KDA_SPLIT_CHUNKS, KERNEL_FUN_KDA_RECURRENT), read now: 2 (the
    model decides), 0 and -1 (the policy) unless set; a bad value warns and reads as the default.
    docs/kda-forward.md ("The split scans"), docs/kda.md (the token recurrence)."""
    from kernel_fun import _env

    return (_env.integer("KERNEL_FUN_KDA_SPLIT", 2, 0, 2),
            _env.integer("KERNEL_FUN_KDA_SPLIT_CHUNKS", 0, 0, 1 << 30),
            _env.integer("KERNEL_FUN_KDA_RECURRENT", -1, 0, 1))
