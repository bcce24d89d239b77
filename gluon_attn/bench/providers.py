"""Provider registry: every attention implementation the benchmark can run.

A provider says which (GPU arch, dtype, head dim, causal) cells it supports; an unsupported cell is
recorded as such by the runner, never a crash. ``prepare`` returns a closure that runs the forward
pass on prepared inputs and returns the output tensor [Z, H, N_CTX, Dv].
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..problem import Inputs, Problem
from ..validation import check_qkv


@dataclass(frozen=True)
class Support:
    ok: bool
    reason: str = ""


SUPPORTED = Support(True)


def cuda_arch() -> Optional[tuple[int, int]]:
    """Compute capability of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


@dataclass
class Provider:
    name: str
    description: str
    needs_cuda: bool
    dtypes: tuple[str, ...]
    head_dims: Callable[[int], bool]
    head_dims_text: str
    min_arch: tuple[int, int] = (8, 0)
    archs_text: str = "sm_80+"
    arch_ok: Optional[Callable[[tuple[int, int]], bool]] = None
    runner: Optional[Callable[[Inputs], Callable[[], torch.Tensor]]] = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    label_fn: Optional[Callable[[], str]] = None
    kernel_name_fn: Callable[[Problem], str] = lambda p: ""
    config_fn: Callable[[Problem], str] = lambda p: ""
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.label_fn() if self.label_fn else self.name

    def supports(self, problem: Problem, arch: Optional[tuple[int, int]]) -> Support:
        if self.needs_cuda and arch is None:
            return Support(False, f"{self.name} needs a CUDA GPU")
        if arch is not None and self.needs_cuda:
            ok = self.arch_ok(arch) if self.arch_ok else arch >= self.min_arch
            if not ok:
                return Support(False, f"{self.name} supports {self.archs_text}, not sm_{arch[0]}{arch[1]}")
        if problem.dtype not in self.dtypes:
            return Support(False, f"{self.name} supports dtypes {', '.join(self.dtypes)}, not {problem.dtype}")
        for d in {problem.HEAD_DIM, problem.head_dim_v}:
            if not self.head_dims(d):
                return Support(False, f"{self.name} supports head dims {self.head_dims_text}, not {d}")
        return SUPPORTED

    def prepare(self, inputs: Inputs) -> Callable[[], torch.Tensor]:
        check_qkv(inputs.q, inputs.k, inputs.v, dtypes=self.dtypes, require_cuda=self.needs_cuda, what=self.name)
        return self.runner(inputs)


PROVIDERS: dict[str, Provider] = {}


def register(provider: Provider) -> Provider:
    PROVIDERS[provider.name] = provider
    return provider


def _load_kernel_providers() -> None:
    # The Gluon kernels register themselves when their module can be imported.
    from . import gluon_providers  # noqa: F401


def get_provider(name: str) -> Provider:
    _load_kernel_providers()
    try:
        return PROVIDERS[name]
    except KeyError:
        raise ValueError(f"unknown provider {name!r}; available: {', '.join(provider_names())}") from None


def provider_names() -> list[str]:
    _load_kernel_providers()
    return list(PROVIDERS)


def default_providers() -> list[str]:
    """What a sweep runs unless told otherwise: everything but the CPU-only oracle."""
    return [n for n in provider_names() if n != "math"]


# ---------------------------------------------------------------------------------------------
# SDPA-backed providers
# ---------------------------------------------------------------------------------------------

def _sdpa_context(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, backend_name))


def _sdpa_runner(inputs: Inputs) -> Callable[[], torch.Tensor]:
    q, k, v, causal = inputs.q, inputs.k, inputs.v, inputs.problem.causal
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(q, k, v, is_causal=causal)


def _cudnn_label() -> str:
    ver = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not ver:
        return "cuDNN"
    major, minor = ver // 10000, (ver % 10000) // 100
    if ver < 10000:  # cuDNN 8 encoding: major*1000 + minor*100 + patch
        major, minor = ver // 1000, (ver % 1000) // 100
    return f"cuDNN {major}.{minor}"


SIXTEEN_BIT = ("fp16", "bf16")

register(Provider(
    name="cudnn",
    description="torch SDPA, CUDNN_ATTENTION backend",
    needs_cuda=True,
    dtypes=SIXTEEN_BIT,
    head_dims=lambda d: d % 8 == 0 and d <= 256,
    head_dims_text="multiples of 8 up to 256",
    min_arch=(9, 0),
    archs_text="sm_90+",
    runner=_sdpa_runner,
    context=functools.partial(_sdpa_context, "CUDNN_ATTENTION"),
    label_fn=_cudnn_label,
    kernel_name_fn=lambda p: "cudnn sdpa",
))

register(Provider(
    name="fa2",
    description="torch SDPA, FLASH_ATTENTION backend (FlashAttention-2)",
    needs_cuda=True,
    dtypes=SIXTEEN_BIT,
    head_dims=lambda d: d % 8 == 0 and d <= 256,
    head_dims_text="multiples of 8 up to 256",
    runner=_sdpa_runner,
    context=functools.partial(_sdpa_context, "FLASH_ATTENTION"),
    label_fn=lambda: "FA2 (SDPA flash)",
    kernel_name_fn=lambda p: "flash_fwd",
))

register(Provider(
    name="math",
    description="torch SDPA, MATH backend: any device, for tests and CPU runs",
    needs_cuda=False,
    dtypes=SIXTEEN_BIT,
    head_dims=lambda d: d >= 1,
    head_dims_text="any",
    runner=_sdpa_runner,
    context=functools.partial(_sdpa_context, "MATH"),
    label_fn=lambda: "SDPA math",
))


# ---------------------------------------------------------------------------------------------
# FlexAttention (compiled)
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _flex_runner(inputs: Inputs) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask
    q, k, v, p = inputs.q, inputs.k, inputs.v, inputs.problem
    block_mask = None
    if p.causal:
        block_mask = create_block_mask(_causal_mask, None, None, p.N_CTX, p.N_CTX, device=q.device)
    flex = _compiled_flex()
    return lambda: flex(q, k, v, block_mask=block_mask)


register(Provider(
    name="flex",
    description="torch FlexAttention, compiled (block mask for causal)",
    needs_cuda=True,
    dtypes=SIXTEEN_BIT,
    head_dims=lambda d: d >= 16 and d <= 256 and (d & (d - 1)) == 0,
    head_dims_text="powers of two from 16 to 256",
    runner=_flex_runner,
    label_fn=lambda: "Flex (compiled)",
    kernel_name_fn=lambda p: "triton flex_attention",
))
