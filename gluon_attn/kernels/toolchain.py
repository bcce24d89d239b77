"""The Triton the kernels are written for, and the ptxas each target is assembled with.

The kernels use Triton 3.9's Gluon API (``tma.async_load``, ``.reinterpret``, tensor-memory register
layouts from the descriptor type); an older Triton would fail deep inside a compile, so the first kernel
call and ``gluon-attn env`` say which Triton was imported and how to get 3.9 instead (``triton_problem``).

Triton 3.9 assembles every target from sm_90 up with the CUDA 13.4 ptxas of its wheel
(``ptxas-blackwell``). On this project's sm_90a kernels that ptxas spills where the wheel's other one,
CUDA 12.9's ``ptxas`` (Triton's own for older targets), does not: the fp16 D=64 forward 536 spill
instructions, 292 of them in the K/V loops, against 44 and 14 (NOTES v62). So sm_90a builds go through
``ptxas``; sm_100a builds keep 13.4 (what Triton 3.9 chose for Blackwell). A user who names a ptxas
(``TRITON_PTXAS_BLACKWELL_PATH``) keeps it."""
from __future__ import annotations

import contextlib
import functools
import os

REQUIRED_TRITON = "3.9.0"
# Options every build of the package's Gluon kernels passes: fused multiply-adds on (Triton 3.9's default, which
# 3.10 turns off; the kernels' softmax is written for FFMA: ``s * qk_scale - m`` is one instruction per score).
COMPILE_OPTIONS = {"enable_fp_fusion": True}
RECIPE = "docs/usage.md, 'Triton 3.9 on the GPU machines'"
# A ptxas the user named through Triton's knob for sm_90 and newer targets (``knobs.nvidia.ptxas_blackwell``), read
# once: setting the knob, as this module does, writes the same variable.
_USER_PTXAS = os.environ.get("TRITON_PTXAS_BLACKWELL_PATH")


def triton_problem() -> str | None:
    """Why the imported Triton cannot build these kernels (None when it is the one they need)."""
    try:
        import triton
    except ImportError:
        return f"gluon-attn needs triton {REQUIRED_TRITON}; none is importable here (the recipe: {RECIPE})"
    if triton.__version__ != REQUIRED_TRITON:
        where = os.path.dirname(os.path.dirname(triton.__file__))
        return (f"gluon-attn needs triton {REQUIRED_TRITON}; this Python imports triton {triton.__version__} "
                f"from {where}. Install {REQUIRED_TRITON} (pip install triton=={REQUIRED_TRITON}) or, on a machine "
                f"that cannot install, carry it and put it first on PYTHONPATH: {RECIPE}")
    return None


def check_triton() -> None:
    problem = triton_problem()
    if problem:
        raise RuntimeError(problem)


def _hopper_ptxas() -> str:
    from triton import knobs
    return knobs.nvidia.ptxas.path


def sm90a_ptxas() -> str:
    """The path of the ptxas that assembles the sm_90a kernels: the one a user named, else the wheel's 12.9 one."""
    return _USER_PTXAS or _hopper_ptxas()


def _forget_ptxas_version() -> None:
    # Triton caches the ptxas version per arch for its compile-cache key; the key must name the ptxas used.
    from triton.backends.nvidia import compiler
    compiler.get_ptxas_version.cache_clear()


@contextlib.contextmanager
def ptxas_for(target: int):
    """Compile for ``target`` (90, 100) with its ptxas (the module's docstring says which and why), whatever a
    Hopper process's ``prepare_device`` chose for its own kernels."""
    if _USER_PTXAS:
        yield
        return
    from triton import knobs
    try:
        with knobs.nvidia.scope():
            # (None: the knob's default, the wheel's ptxas-blackwell)
            knobs.nvidia.ptxas_blackwell = _hopper_ptxas() if target == 90 else None
            _forget_ptxas_version()
            yield
    finally:
        _forget_ptxas_version()


@functools.lru_cache(maxsize=None)
def prepare_device(major: int) -> None:
    """Before the first kernel of a process runs on a GPU of compute capability ``major``: check the Triton,
    and on Hopper assemble with the Hopper ptxas from then on (every compile of the process is for that GPU).
    Raises with the recipe when the Triton is not the one the kernels need."""
    check_triton()
    if major == 9 and not _USER_PTXAS:
        from triton import knobs
        knobs.nvidia.ptxas_blackwell = _hopper_ptxas()
        _forget_ptxas_version()
