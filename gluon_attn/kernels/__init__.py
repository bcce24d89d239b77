"""Gluon kernels of the package and what they share.

At exit this empties triton.runtime.jit._triton_jit_function_registry (torch's C++-held callables keep it alive past
teardown, and via our JIT functions' __globals__ it pinned the Gluon IR builder types, which nanobind reported leaked)
and drops GluonOpBuilder/GluonSemantic from Triton's gluon _semantic module: after a real compile libtriton's
never-freed GluonLayouts static holds the layout classes, whose methods' globals keep that module's dict alive unwiped.
``launch_module`` gives the launch module to the call paths outside the package, imported at first use."""
import atexit as _atexit


def _release_jit_registry():
    import sys
    jit = sys.modules.get("triton.runtime.jit")
    registry = getattr(jit, "_triton_jit_function_registry", None)
    if registry is not None:
        registry.clear()
    semantic = sys.modules.get("triton.experimental.gluon.language._semantic")
    if semantic is not None:
        for name in ("GluonOpBuilder", "GluonSemantic"):  # GluonSemantic's annotations name GluonOpBuilder too
            semantic.__dict__.pop(name, None)


_atexit.register(_release_jit_registry)


_LAUNCH = None


def launch_module():
    """``gluon_attn.kernels.launch``, imported at first use (it loads Triton's Gluon, which ``import gluon_attn`` does
    not need) and kept: a call's hot path reads names off it, where an import statement would cost ~0.7 us a call."""
    global _LAUNCH
    if _LAUNCH is None:
        from . import launch

        _LAUNCH = launch
    return _LAUNCH


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints, for the host's arithmetic: ``triton.cdiv`` is a ConstexprFunction since triton 3.9, ~1.9 us
    a call from Python (on this project's CPUs), on every call's path where a launch's grid or block is worked out."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (0 for 0, as ``triton.next_power_of_2``), in plain Python (see ``cdiv``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
