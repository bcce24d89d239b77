"""What a compile-only build is: ``BuildRequest`` (kernel kind, arch, dtype, head dim, causal, name,
config overrides) and ``KernelBuild`` (what ``triton.compile`` needs), and the table of builders that
``kernels.registry`` fills, one per kernel kind (``inspection.make_build`` reads it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .naming import DEFAULT_NAME_CHOICE

from .backend import BACKENDS

# The compile targets: one per backend (the tma_copy kernel builds for each too).
ARCHS = {b.arch: b.target for b in BACKENDS.values()}


def check_arch(arch: str) -> int:
    try:
        return ARCHS[arch]
    except KeyError:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(ARCHS)}") from None


@dataclass(frozen=True)
class KernelBuild:
    """Everything ``triton.compile`` needs for one specialization of a Gluon kernel."""
    fn: Any
    signature: dict
    constexprs: dict
    num_warps: int
    name: str
    description: str = ""
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BuildRequest:
    kernel: str = "attention"
    arch: str = "sm_90a"
    dtype: str = "fp16"
    head_dim: int = 128
    causal: bool = False
    kernel_name: str = DEFAULT_NAME_CHOICE
    config: dict = field(default_factory=dict)
    varlen: bool = False  # the packed-sequence build (``attention_varlen``)
    deterministic: bool = False  # the backward's deterministic-dQ build
    head_dim_v: int = 0  # v's head dim where it differs from q's (the 192/128 pair); 0: q's


# kernel kind -> function(BuildRequest) -> KernelBuild; kernels register themselves.
BUILDERS: dict[str, Callable[[BuildRequest], KernelBuild]] = {}


def register_builder(kind: str):
    def deco(fn):
        BUILDERS[kind] = fn
        return fn
    return deco
