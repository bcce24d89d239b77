"""Kernel-name specialization.

ptxas treats kernels whose names contain ``cutlass`` specially, so the name is a knob worth
measuring. The name travels as a string constexpr (``KERNEL_NAME``): constexprs are part of
Triton's compile-cache key, so two names can never be handed each other's binary, and the
``repr`` hook below makes that constexpr the PTX ``.entry`` / cubin symbol.
"""
from __future__ import annotations

import re

CUTLASS_PREFIX = "cutlass_"
# What attention(), the gluon provider and `inspect` use unless told otherwise (cutlass_ for fp8, as the
# seed kernel does), on both arches.
DEFAULT_NAME_CHOICE = "auto"
_VALID = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def kernel_symbol(specialization) -> str:
    """``gluon.jit(repr=...)`` hook: the compiled symbol is the KERNEL_NAME constexpr."""
    return str(specialization.constants["KERNEL_NAME"])


def check_symbol(name: str) -> str:
    if not isinstance(name, str) or not _VALID.match(name):
        raise ValueError(f"kernel name {name!r} is not a valid symbol (letters, digits, '_'; not starting with a digit)")
    return name


def resolve_name(base: str, choice: str, *, is_fp8: bool = False) -> str:
    """Map a name choice to a symbol.

    ``plain``: ``base``; ``cutlass``: ``cutlass_`` + base; ``auto``: cutlass-prefixed for fp8 only;
    anything else is taken as the literal symbol.
    """
    if choice == "plain":
        return base
    if choice == "cutlass":
        return CUTLASS_PREFIX + base
    if choice == "auto":
        return CUTLASS_PREFIX + base if is_fp8 else base
    return check_symbol(choice)
