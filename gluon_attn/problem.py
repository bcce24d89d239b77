"""The attention problem: shape, dtype, FLOP count and an input factory."""
from __future__ import annotations

import dataclasses
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


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class Problem:
    """One attention forward: q, k, v of shape [Z, H, N_CTX, HEAD_DIM] (v: HEAD_DIM_V)."""

    Z: int
    H: int
    N_CTX: int
    HEAD_DIM: int
    causal: bool
    dtype: str = "fp16"
    HEAD_DIM_V: Optional[int] = None

    def __post_init__(self):
        for field in ("Z", "H", "N_CTX", "HEAD_DIM"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
        if self.HEAD_DIM_V is not None and (not isinstance(self.HEAD_DIM_V, int) or self.HEAD_DIM_V < 1):
            raise ValueError(f"HEAD_DIM_V must be an integer >= 1, got {self.HEAD_DIM_V!r}")
        dtype_from_name(self.dtype)

    @property
    def head_dim_v(self) -> int:
        return self.HEAD_DIM if self.HEAD_DIM_V is None else self.HEAD_DIM_V

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def flops(self) -> float:
        """Matmul FLOPs of the forward pass: 2*N^2*D for QK^T plus 2*N^2*Dv for PV, per head; halved if causal."""
        per_head = 2.0 * self.N_CTX * self.N_CTX * (self.HEAD_DIM + self.head_dim_v)
        total = self.Z * self.H * per_head
        return total * 0.5 if self.causal else total

    def tflops(self, ms: float) -> float:
        return self.flops / (ms * 1e-3) / 1e12

    def key(self) -> dict:
        return dataclasses.asdict(self)

    def label(self) -> str:
        return (f"Z={self.Z} H={self.H} N_CTX={self.N_CTX} D={self.HEAD_DIM} "
                f"causal={self.causal} dtype={self.dtype}")


@dataclass
class Inputs:
    """Tensors for one problem. For fp8, q/k/v are the quantized tensors and the
    descale factors turn them back into the values the reference uses (x_real = x * descale)."""

    problem: Problem
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descale_q: float = 1.0
    descale_k: float = 1.0
    descale_v: float = 1.0

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
    shapes = {
        "q": (p.Z, p.H, p.N_CTX, p.HEAD_DIM),
        "k": (p.Z, p.H, p.N_CTX, p.HEAD_DIM),
        "v": (p.Z, p.H, p.N_CTX, p.head_dim_v),
    }
    made = {}
    for name, shape in shapes.items():
        base = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if p.is_fp8:
            made[name] = _quantize(base, p.torch_dtype)
        else:
            made[name] = (base.to(p.torch_dtype), 1.0)
    return Inputs(p, made["q"][0], made["k"][0], made["v"][0],
                  descale_q=made["q"][1], descale_k=made["k"][1], descale_v=made["v"][1])
