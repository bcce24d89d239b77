"""The attention problem: shape, dtype, FLOP count and an input factory."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

import torch

# Names used on the command line and in result files, mapped to torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8e5": torch.float8_e5m2,
    "fp8e4m3": torch.float8_e4m3fn,
}
FP8_DTYPES = ("fp8e5", "fp8e4m3")
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; supported: {', '.join(DTYPES)}") from None


def own_v_dim(d_qk: int, d_v: Optional[int]) -> int:
    """v's head dim where it is not q's (the 192/128 pair's 128), else 0: how configs, builds and launches name a
    problem whose v has no head dim of its own (``d_v`` None or 0 too)."""
    return d_v if d_v and d_v != d_qk else 0


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}") from None


# Named length mixes of packed batches (``Problem.varlen``): N_CTX tokens in all, cut into sequences by a
# seeded generator, so a mix names the same lengths on every machine.
VARLEN_MIXES = {
    "uniform": "lengths drawn uniformly from 512 to 4096",
    "longtail": "many short sequences and a few long ones: lengths log-normal around ~700 (sigma 1.3), "
                "16 to N_CTX / 4",
}


def varlen_lengths(mix: str, total: int) -> tuple[int, ...]:
    """The sequence lengths of a named mix summing to ``total`` tokens (the last one takes the rest)."""
    import random

    if mix not in VARLEN_MIXES:
        raise ValueError(f"unknown varlen mix {mix!r}; known: {', '.join(VARLEN_MIXES)}")
    rng = random.Random(f"{mix}:{total}")
    lengths: list[int] = []
    left = total
    while left > 0:
        if mix == "uniform":
            n = rng.randint(512, 4096)
        else:
            n = int(min(max(16, rng.lognormvariate(6.55, 1.3)), max(16, total // 4)))
        n = min(n, left)
        lengths.append(n)
        left -= n
    return tuple(lengths)


# Passes a problem can time (``Problem.pass_name``): the forward, the backward alone (the forward ran
# once, its graph kept), or both; FLOPs of the backward count 2.5x the forward's (FA's convention:
# five matmuls to the forward's two).
PASSES = ("fwd", "bwd", "fwd+bwd")
PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def _visible_pairs(n_q: int, n_k: int, causal: bool) -> float:
    """(query, key) pairs a forward multiplies: all, or causal (bottom-right aligned) all but the upper
    triangle of the square part, counted as half the square as FlashAttention's benchmarks do (N^2 / 2
    for N_Q = N_KV)."""
    if not causal:
        return float(n_q) * n_k
    return float(n_q) * n_k - min(n_q, n_k) ** 2 / 2.0


@dataclass(frozen=True)
class Problem:
    """One attention forward: q [Z, H, N_CTX, HEAD_DIM], k and v [Z, H_KV, N_KV, HEAD_DIM] (v: HEAD_DIM_V);
    H_KV defaults to H, N_KV to N_CTX (causal with N_KV != N_CTX is aligned bottom-right). With ``varlen``
    (a ``VARLEN_MIXES`` name) the batch is packed: N_CTX tokens in sequences of the mix's lengths, q
    [N_CTX, H, D], k and v [N_CTX, H_KV, D], Z = 1. ``pass_name`` (``PASSES``): what is timed, the forward,
    the backward or both (rows.csv: ``pass``)."""

    Z: int
    H: int
    N_CTX: int
    HEAD_DIM: int
    causal: bool
    dtype: str = "fp16"
    HEAD_DIM_V: Optional[int] = None
    H_KV: Optional[int] = None
    N_KV: Optional[int] = None
    varlen: Optional[str] = None
    pass_name: str = "fwd"

    def __post_init__(self):
        for field in ("Z", "H", "N_CTX", "HEAD_DIM"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
        for field in ("HEAD_DIM_V", "H_KV", "N_KV"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
        if self.H % self.h_kv:
            raise ValueError(f"H_KV {self.h_kv} must divide H {self.H}")
        if self.varlen is not None:
            if self.varlen not in VARLEN_MIXES:
                raise ValueError(f"unknown varlen mix {self.varlen!r}; known: {', '.join(VARLEN_MIXES)}")
            if self.Z != 1 or self.N_KV is not None:
                raise ValueError("a packed (varlen) problem has Z = 1 and its keys are its queries (no N_KV)")
        dtype_from_name(self.dtype)
        if self.pass_name not in PASSES:
            raise ValueError(f"unknown pass {self.pass_name!r}; known: {', '.join(PASSES)}")

    @property
    def backward(self) -> bool:
        """Whether the timed call runs the backward (bwd or fwd+bwd)."""
        return self.pass_name != "fwd"

    @property
    def head_dim_v(self) -> int:
        return self.HEAD_DIM if self.HEAD_DIM_V is None else self.HEAD_DIM_V

    @property
    def h_kv(self) -> int:
        return self.H if self.H_KV is None else self.H_KV

    @property
    def n_kv(self) -> int:
        return self.N_CTX if self.N_KV is None else self.N_KV

    @property
    def seqlens(self) -> tuple[int, ...]:
        """The packed sequences' lengths (varlen), else ()."""
        return varlen_lengths(self.varlen, self.N_CTX) if self.varlen else ()

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def flops(self) -> float:
        """Matmul FLOPs of the pass: the forward's 2 (D + Dv) per (query, key) pair a head multiplies: N_Q N_KV,
        causal N_Q N_KV - min(N_Q, N_KV)^2 / 2 (N^2 / 2 for self-attention); packed: summed over sequences;
        times ``PASS_FLOPS`` (backward 2.5, forward + backward 3.5)."""
        per_pair = 2.0 * (self.HEAD_DIM + self.head_dim_v)
        if self.varlen:
            pairs = sum(_visible_pairs(n, n, self.causal) for n in self.seqlens)
        else:
            pairs = self.Z * _visible_pairs(self.N_CTX, self.n_kv, self.causal)
        return self.H * per_pair * pairs * PASS_FLOPS[self.pass_name]

    def tflops(self, ms: float) -> float:
        return self.flops / (ms * 1e-3) / 1e12

    def key(self) -> dict:
        return dataclasses.asdict(self)

    def label(self) -> str:
        heads = f" H_KV={self.h_kv}" if self.h_kv != self.H else ""
        keys = f" N_KV={self.n_kv}" if self.n_kv != self.N_CTX else ""
        mix = f" varlen={self.varlen}" if self.varlen else ""
        direction = f" pass={self.pass_name}" if self.backward else ""
        v = f"/{self.head_dim_v}" if self.head_dim_v != self.HEAD_DIM else ""
        return (f"Z={self.Z} H={self.H}{heads} N_CTX={self.N_CTX}{keys}{mix} D={self.HEAD_DIM}{v} "
                f"causal={self.causal} dtype={self.dtype}{direction}")


@dataclass
class Inputs:
    """Tensors for one problem. For fp8, q/k/v are the quantized tensors and the
    descale factors turn them back into the values the reference uses (x_real = x * descale).
    Packed (varlen) problems also carry the int32 offsets ``cu_seqlens`` [B + 1] on the tensors' device;
    backward problems the output's incoming gradient ``do`` (random normal, the output's shape)."""

    problem: Problem
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descale_q: float = 1.0
    descale_k: float = 1.0
    descale_v: float = 1.0
    cu_seqlens: Optional[torch.Tensor] = None
    do: Optional[torch.Tensor] = None

    @property
    def max_seqlen(self) -> int:
        return max(self.problem.seqlens) if self.problem.varlen else self.problem.N_CTX

    @property
    def out_dtype(self) -> torch.dtype:
        """fp8 attention writes fp16; 16-bit attention writes its input dtype."""
        return torch.float16 if self.problem.is_fp8 else self.q.dtype


def _quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """Per-tensor scaling into the fp8 range; returns (quantized, descale)."""
    fmax = torch.finfo(dtype).max
    amax = x.abs().max().item()
    # Leave headroom so rounding never overflows the largest finite value.
    descale = max(amax, 1e-12) / (0.5 * fmax)
    return (x / descale).to(dtype), descale


def make_inputs(problem: Problem, device: str | torch.device = "cuda", seed: int | None = None) -> Inputs:
    """Fresh random-normal q, k, v (never zeros). fp8 inputs are made by casting scaled fp32 values."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**63))
    p = problem
    if p.varlen:
        shapes = {"q": (p.N_CTX, p.H, p.HEAD_DIM), "k": (p.N_CTX, p.h_kv, p.HEAD_DIM),
                  "v": (p.N_CTX, p.h_kv, p.head_dim_v)}
    else:
        shapes = {"q": (p.Z, p.H, p.N_CTX, p.HEAD_DIM), "k": (p.Z, p.h_kv, p.n_kv, p.HEAD_DIM),
                  "v": (p.Z, p.h_kv, p.n_kv, p.head_dim_v)}
    made = {}
    for name, shape in shapes.items():
        base = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if p.is_fp8:
            made[name] = _quantize(base, p.torch_dtype)
        else:
            made[name] = (base.to(p.torch_dtype), 1.0)
    cu = None
    if p.varlen:
        cu = torch.tensor([0, *itertools.accumulate(p.seqlens)], dtype=torch.int32, device=device)
    do = None
    if p.backward:
        out_shape = shapes["q"][:-1] + (p.head_dim_v,)
        do = torch.randn(out_shape, generator=gen, device=device, dtype=torch.float32).to(
            torch.float16 if p.is_fp8 else p.torch_dtype)
    return Inputs(p, made["q"][0], made["k"][0], made["v"][0],
                  descale_q=made["q"][1], descale_k=made["k"][1], descale_v=made["v"][1], cu_seqlens=cu, do=do)
