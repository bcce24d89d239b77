"""The one interface to the Gluon kernels: a ``Backend`` per target arch, and the lookups by arch name
and by compute capability. Everything outside ``kernels/`` (the API, the providers, ``inspect``,
``configs``, ``optimize``) goes through it, so adding an arch means adding its kernel module (the device code,
e.g. ``hopper.py``) and beside it the kernel's host module, named after it with ``_host`` (``hopper_host.py``:
``Backend.module``), that defines:

  CONFIG         the config dataclass (frozen; its fields are the knobs; ``invalid_reasons``,
                 ``label`` and ``describe``)
  HEAD_DIMS, DTYPES
  default_config(head_dim, dtype, causal=None, n_ctx=8192)  the tuned or rule-based config (cached)
  packed_config(cfg)                                       that config's form for packed (varlen) batches
  config_space() / in_focused_space(cfg)                    what ``configs`` and ``optimize`` walk
  launch(q, k, v, **options)                               run it on validated CUDA tensors (GQA, N_Q != N_KV;
                                                           ``varlen=schedule.Packed`` for packed sequences)
  build(dtype, head_dim, causal, cfg, name, varlen) -> KernelBuild  compile-only (``inspect``, tests)

and one line in ``BACKENDS`` below. A backend with a backward names its kernel module too (``bwd_module_name``),
whose host module defines the same names for the backward pass (``launch(do, q, k, v, o, lse, **options)``).
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType

from ..validation import pairs_text
from .toolchain import check_triton

# A kernel module's host side lives beside it under its name with this suffix (hopper.py -> hopper_host.py).
HOST_SUFFIX = "_host"


@dataclass(frozen=True)
class Backend:
    arch: str  # the compile target, e.g. "sm_90a"
    major: int  # the compute capability major it runs on
    target: int  # triton's GPUTarget number
    description: str
    module_name: str  # the kernel module under gluon_attn.kernels (device code; ``configs`` shows this name)
    bwd_module_name: str | None = None  # the backward's kernel module (None: no backward on this arch)

    @functools.cached_property  # (attention() reaches it on every call: imported once)
    def module(self) -> ModuleType:
        """The forward's host module (``<module_name>_host``: configs, launches, builds)."""
        check_triton()  # (a kernel module written for another Triton would fail to import, less clearly)
        return importlib.import_module(f"{__package__}.{self.module_name}{HOST_SUFFIX}")

    @functools.cached_property
    def bwd(self) -> ModuleType | None:
        """The backward's host module (``<bwd_module_name>_host``), or None."""
        if self.bwd_module_name is None:
            return None
        check_triton()
        return importlib.import_module(f"{__package__}.{self.bwd_module_name}{HOST_SUFFIX}")

    def backward_problems(self, head_dim: int, dtype: str, head_dim_v: int | None = None) -> list[str]:
        """Why this backend cannot run the backward of a problem class (empty when it can)."""
        if self.bwd is None:
            return [f"no backward on {self.arch} (the backward runs on {backward_text()})"]
        why = []
        if dtype not in self.bwd.DTYPES:
            why.append(f"dtype {dtype} (the backward takes {', '.join(self.bwd.DTYPES)})")
        pairs = getattr(self.bwd, "HEAD_DIM_PAIRS", ())
        if head_dim not in self.bwd.HEAD_DIMS:
            why.append(f"head dim {head_dim} (the backward takes {', '.join(map(str, self.bwd.HEAD_DIMS))})")
        elif head_dim_v not in (None, head_dim) and (head_dim, head_dim_v) not in pairs:
            why.append(f"head dims {head_dim}/{head_dim_v} (the backward takes v's head dim equal to q's"
                       f"{pairs_text(pairs, ', or ')})")
        return why

    def head_dim_problem(self, head_dim: int, head_dim_v: int | None = None) -> str | None:
        """Why this backend's forward cannot take these head dims (q/k, v), or None."""
        if head_dim not in self.head_dims:
            return f"head dim {head_dim} is not supported on {self.arch}; supported: {head_dims_text()}"
        if head_dim_v not in (None, head_dim) and (head_dim, head_dim_v) not in self.head_dim_pairs:
            return (f"head dims {head_dim} (q, k) and {head_dim_v} (v) are not supported on {self.arch}: v's head dim "
                    f"equals q's{pairs_text(self.head_dim_pairs, ', or ')}")
        return None

    @property
    def config_type(self):
        return self.module.CONFIG

    @property
    def head_dims(self) -> tuple[int, ...]:
        return self.module.HEAD_DIMS

    @property
    def head_dim_pairs(self) -> tuple[tuple[int, int], ...]:
        """(q/k, v) head dims with v's of its own."""
        return getattr(self.module, "HEAD_DIM_PAIRS", ())

    @property
    def dtypes(self) -> tuple[str, ...]:
        return self.module.DTYPES

    def default_config(self, head_dim: int, dtype: str, causal=None, n_ctx: int = 8192, pass_name: str = "fwd",
                       head_dim_v: int = 0):
        """The config a dense launch of the class takes; ``head_dim_v``: v's head dim where it is not q's (the 192/128
        pair: the forward in ``pair_config``'s blocks, the backward in its own units)."""
        if pass_name != "fwd":
            return self._pass_module(pass_name).default_config(head_dim, dtype, causal, n_ctx, head_dim_v)
        cfg = self.module.default_config(head_dim, dtype, causal, n_ctx)
        if head_dim_v in (0, head_dim):
            return cfg
        why = self.head_dim_problem(head_dim, head_dim_v)
        if why:
            raise ValueError(why)
        return self.module.pair_config(cfg, head_dim, head_dim_v)

    def _pass_module(self, pass_name: str) -> ModuleType:
        """The forward's module, or for a backward pass (bwd, fwd+bwd) the backward's."""
        if pass_name == "fwd":
            return self.module
        if self.bwd is None:
            raise ValueError(f"no backward kernel on {self.arch} (the backward runs on {backward_text()})")
        return self.bwd

    def packed_config(self, cfg):
        """The default config's form for packed (varlen) launches and builds."""
        return self.module.packed_config(cfg)

    def clear_caches(self) -> None:
        """Forget cached defaults and the plans and prepared launches made with them (after the tuning table
        changed)."""
        from ..cache import clear_all

        self.module.default_config.cache_clear()
        for name in ("_launch_plan", "_na_box_plan"):
            if hasattr(self.module, name):
                getattr(self.module, name).cache_clear()
        clear_all()  # (the routes and prepared launches made with the old configs)
        if self.bwd is not None:
            self.bwd.default_config.cache_clear()

    def config_space(self, focused: bool = False, pass_name: str = "fwd"):
        mod = self._pass_module(pass_name)
        return (cfg for cfg in mod.config_space() if not focused or mod.in_focused_space(cfg))

    def launch(self, q, k, v, **options):
        return self.module.launch(q, k, v, **options)

    def build(self, dtype: str, head_dim: int, causal: bool, cfg, name: str, varlen: bool = False, **more):
        """The forward's compile-only build (``more``: the module's own options, e.g. sm_90a's ``head_dim_v``)."""
        return self.module.build(dtype, head_dim, causal, cfg, name, varlen, **more)


BACKENDS = {b.arch: b for b in (
    Backend("sm_90a", 9, 90, "sm_90a (H100/H200)", "hopper", "hopper_bwd"),
    Backend("sm_100a", 10, 100, "sm_100a (B200/GB200, compile-verified only)", "blackwell"),
)}


# Packed sequences (``attention_varlen``): 16-bit only. fp8's V^T tiles permute keys in groups of 16
# aligned to the tensor's start (``v_transpose``), which a sequence starting at any row would break.
VARLEN_DTYPES = ("fp16", "bf16")

# Every backend takes the same dtypes (a test holds them equal), so callers that validate before picking a
# backend (attention(), the gluon provider) read them from any one. Head dims differ (256: sm_90a only).
ANY_BACKEND = next(iter(BACKENDS.values()))


@functools.lru_cache(maxsize=None)
def all_head_dims() -> tuple[int, ...]:
    """Every head dim some backend takes (imports the kernel modules: not done when this module is imported)."""
    return tuple(sorted({d for b in BACKENDS.values() for d in b.head_dims}))


@functools.lru_cache(maxsize=None)
def all_head_dim_pairs() -> tuple[tuple[int, int], ...]:
    """Every (q/k, v) head-dim pair with v's of its own some backend takes."""
    return tuple(sorted({p for b in BACKENDS.values() for p in b.head_dim_pairs}))


def head_dims_text() -> str:
    """"32, 64, 96, 128, 192, 256, 192/128 (sm_90a); 32, 64, 96, 128 (sm_100a)": what each backend takes (q/k/v's
    head dim, then (q/k, v) pairs)."""
    return "; ".join(f"{', '.join([*map(str, b.head_dims), *(f'{d}/{dv}' for d, dv in b.head_dim_pairs)])} "
                     f"({b.arch})" for b in BACKENDS.values())


def backward_text() -> str:
    """"sm_90a (D 64, 128; fp16, bf16)": where the backward runs."""
    return "; ".join(f"{b.arch} (D {', '.join(map(str, b.bwd.HEAD_DIMS))}; {', '.join(b.bwd.DTYPES)})"
                     for b in BACKENDS.values() if b.bwd_module_name is not None)


def supported_text() -> str:
    return ", ".join(b.description for b in BACKENDS.values())


def backend_for_arch(arch: str) -> Backend:
    try:
        return BACKENDS[arch]
    except KeyError:
        raise ValueError(f"no attention kernel for {arch!r}; available: {', '.join(BACKENDS)}") from None


_BY_MAJOR = {b.major: b for b in BACKENDS.values()}


def backend_for_capability(major: int, minor: int = 0) -> Backend | None:
    """The backend that runs on a GPU of this compute capability, or None."""
    return _BY_MAJOR.get(major)
