"""Provider registry: every attention implementation the benchmark can run.

A provider says which (GPU arch, dtype, head dim, causal) cells it supports; an unsupported cell is
recorded as such by the runner, never a crash, and so is a provider whose optional package is not
installed (with the install hint). ``prepare`` returns a ``Call``: the timed forward pass on prepared
inputs, returning the output tensor [Z, H, N_CTX, Dv], and the factor that turns that output into
real values (1 unless the provider writes a scaled fp8 output).
"""
from __future__ import annotations

# Importing a provider module registers its providers, in this order (the order of tables and of
# the default provider list).
from . import torch_providers  # noqa: F401  (cudnn, fa2, math, flex)
from . import gluon_providers  # noqa: F401, I001  (gluon)
from . import peers  # noqa: F401, I001  (cudnn-fe, fa4)
from .provider import (PEERS_INSTALL_HINT, PROVIDERS, SUPPORTED, SIXTEEN_BIT, Call, Provider,  # noqa: F401
                       Support, cuda_arch, register)


def get_provider(name: str) -> Provider:
    try:
        return PROVIDERS[name]
    except KeyError:
        raise ValueError(f"unknown provider {name!r}; available: {', '.join(provider_names())}") from None


def provider_names() -> list[str]:
    return list(PROVIDERS)


def default_providers() -> list[str]:
    """What a sweep runs unless told otherwise: everything but the CPU-only oracle."""
    return [n for n in provider_names() if n != "math"]
