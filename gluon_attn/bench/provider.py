"""What a benchmark provider is: ``Provider`` (what it supports, how it prepares a timed call), ``Call``,
``Support``, and the registry every provider module adds itself to (``register``). The registry's
readers are in ``providers``, which imports every provider module once."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..problem import Inputs, Problem
from ..validation import check_qkv, check_varlen

SIXTEEN_BIT = ("fp16", "bf16")


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
class Call:
    """A prepared forward pass: ``call()`` runs it and returns its output; ``descale_o`` turns that
    output into real values (out * descale_o), for providers that write a scaled fp8 output."""

    fn: Callable[[], torch.Tensor]
    descale_o: float = 1.0

    def __call__(self) -> torch.Tensor:
        return self.fn()


def autograd_call(make_forward: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                  pass_name: str) -> Callable[[], tuple]:
    """A backward pass through autograd: ``make_forward(q, k, v)`` prepares the forward on leaf copies of q, k, v that
    require grad; ``bwd`` keeps one forward's graph and its call is ``torch.autograd.grad`` of it against ``do``
    (reshaped as the output), ``fwd+bwd`` runs both. The call returns (dq, dk, dv)."""
    if pass_name == "bwd":
        # ``bwd`` repeats the backward over one forward's graph (retain_graph), which a compiled backward (Flex's)
        # with donated buffers refuses with a RuntimeError; whether it had donated some differed between processes
        # (run 214: the same sweep passed in a CLI process and failed in a pytest one).
        from torch._functorch import config as functorch_config
        functorch_config.donated_buffer = False
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    forward = make_forward(*leaves)
    if pass_name == "bwd":
        with torch.enable_grad():
            out = forward()
        grad = do.reshape(out.shape)
        return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)

    def both():
        with torch.enable_grad():
            out = forward()
            return torch.autograd.grad(out, leaves, do.reshape(out.shape))
    return both


PEERS_INSTALL_HINT = "pip install -e '.[peers]' (offline: docs/usage.md, 'Peers')"


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
    # What the output holds for a problem (a DTYPES name): the input dtype unless said otherwise.
    out_dtype_fn: Callable[[Problem], str] = lambda p: p.dtype
    # A rule beyond dtype x head dim x arch: the reason a problem is not supported, or None.
    rule: Callable[[Problem, Optional[tuple[int, int]]], Optional[str]] = lambda p, arch: None
    # Optional packages: the distribution to report the version of, and the module whose import
    # proves the provider usable here (None: torch's own, always there).
    package: str = "torch"
    library: str = ""  # what the providers table calls it (default: the package)
    module: Optional[str] = None
    features: str = "causal, non-causal"
    # True for the libraries a user would pick instead of ours: tables rate every other provider
    # against the fastest of them for the same problem and dtype.
    peer: bool = False
    # Problem shapes beyond self-attention with as many K/V heads as query heads: GQA/MQA (H_KV < H),
    # N_KV != N_CTX ("non-causal", or "all" where causal is aligned bottom-right), packed batches.
    gqa: bool = False
    cross_lengths: str = "none"
    varlen: bool = False
    # The backward passes (``Problem.pass_name`` bwd, fwd+bwd) time autograd through the forward the runner
    # builds: True where that forward is differentiable; ``backward_rule`` narrows it like ``rule``.
    backward: bool = False
    backward_rule: Callable[[Problem, Optional[tuple[int, int]]], Optional[str]] = lambda p, arch: None
    # A provider whose forward is not differentiable (a library's graph API) times its own backward: this
    # makes the call for a backward pass, returning (dq, dk, dv), instead of autograd.
    backward_runner: Optional[Callable[[Inputs], Call]] = None
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.label_fn() if self.label_fn else self.name

    @property
    def version(self) -> str:
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return ""

    def describe(self, arch: Optional[tuple[int, int]]) -> dict:
        """One row of the providers table: what it is, what it takes, whether it runs here."""
        here = self.available()
        if here.ok and self.needs_cuda:
            if arch is None:
                here = Support(False, "needs a CUDA GPU (none visible)")
            elif not (self.arch_ok(arch) if self.arch_ok else arch >= self.min_arch):
                here = Support(False, f"supports {self.archs_text}, not sm_{arch[0]}{arch[1]}")
        version = f"{self.package} {self.version}" if self.version else f"{self.package}: not installed"
        return {"provider": self.name, "library": self.library or self.package, "version": version,
                "dtypes": ", ".join(self.dtypes), "head dims": self.head_dims_text, "archs": self.archs_text,
                "features": self.features, "peer": "yes" if self.peer else "",
                "usable here": "yes" if here.ok else f"no: {here.reason}"}

    def available(self) -> Support:
        """Whether the provider's package imports here; if not, why and how to install it."""
        return _importable(self.module, self.package) if self.module else SUPPORTED

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
        shape = self._shape_reason(problem)
        if shape:
            return Support(False, f"{self.name}: {shape}")
        reason = self.rule(problem, arch)
        if not reason and problem.backward:
            reason = self.backward_rule(problem, arch) if self.backward else \
                "times the forward only here (no backward wired for this provider)"
        if reason:
            return Support(False, f"{self.name}: {reason}")
        return self.available()

    def _shape_reason(self, p: Problem) -> Optional[str]:
        if p.h_kv != p.H and not self.gqa:
            return f"takes as many K/V heads as query heads only, not H_KV={p.h_kv} with H={p.H}"
        if p.n_kv != p.N_CTX:
            if self.cross_lengths == "none":
                return f"takes N_KV = N_CTX only, not N_KV={p.n_kv} with N_CTX={p.N_CTX}"
            if self.cross_lengths == "non-causal" and p.causal:
                return "takes N_KV != N_CTX non-causal only (its causal mask is aligned top-left)"
        if p.varlen and not self.varlen:
            return "has no packed (varlen) interface here"
        return None

    def prepare(self, inputs: Inputs) -> Call:
        if inputs.problem.varlen:
            m = inputs.max_seqlen
            check_varlen(inputs.q, inputs.k, inputs.v, inputs.cu_seqlens, inputs.cu_seqlens, m, m, dtypes=self.dtypes,
                         what=self.name, require_cuda=self.needs_cuda)
        else:
            check_qkv(inputs.q, inputs.k, inputs.v, dtypes=self.dtypes, require_cuda=self.needs_cuda,
                      what=self.name)
        available = self.available()
        if not available.ok:
            raise RuntimeError(available.reason)
        if inputs.problem.backward:
            return self._backward_call(inputs)
        made = self.runner(inputs)
        return made if isinstance(made, Call) else Call(made)

    def _backward_call(self, inputs: Inputs) -> Call:
        """The backward passes through autograd, the same way for every provider: the forward runs on leaf
        copies of q, k, v that require grad; ``bwd`` keeps one forward's graph and times
        ``torch.autograd.grad`` of it against ``inputs.do``, ``fwd+bwd`` times both. The call returns
        (dq, dk, dv). A provider with a ``backward_runner`` makes its own call."""
        if self.backward_runner is not None:
            return self.backward_runner(inputs)
        return Call(autograd_call(lambda q, k, v: self.runner(dataclasses.replace(inputs, q=q, k=k, v=v)),
                                  inputs.q, inputs.k, inputs.v, inputs.do, inputs.problem.pass_name))


@functools.lru_cache(maxsize=None)
def _importable(module: str, package: str) -> Support:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing and (module == missing or module.startswith(missing + ".")):
            return Support(False, f"{package} is not installed: {PEERS_INSTALL_HINT}")
        return Support(False, f"{package}: import {module} failed ({type(exc).__name__}: {exc}); "
                              f"{PEERS_INSTALL_HINT}")
    except Exception as exc:  # a broken install (missing shared library, ABI mismatch) is not a crash
        return Support(False, f"{package}: import {module} failed ({type(exc).__name__}: {str(exc)[:200]})")
    return SUPPORTED


PROVIDERS: dict[str, Provider] = {}


def register(provider: Provider) -> Provider:
    PROVIDERS[provider.name] = provider
    return provider


def cudnn_label() -> str:
    """cuDNN's version as torch links it, e.g. "cuDNN 9.19"."""
    ver = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not ver:
        return "cuDNN"
    major, minor = ver // 10000, (ver % 10000) // 100
    if ver < 10000:  # cuDNN 8 encoding: major*1000 + minor*100 + patch
        major, minor = ver // 1000, (ver % 1000) // 100
    return f"cuDNN {major}.{minor}"
