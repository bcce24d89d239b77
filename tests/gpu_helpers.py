"""Shared by the GPU correctness tests of both kernels."""
import itertools

import torch

from gluon_attn.problem import Inputs, Problem, make_inputs

# dtype x head dim x causal x (Z, H, N_CTX): tails of every kind, odd Z*H, a single key.
CORRECTNESS_GRID = list(itertools.product(["fp16", "bf16", "fp8e4m3", "fp8e5"], [64, 128], [False, True],
                                          [(1, 1, 1), (1, 3, 17), (3, 1, 1000), (2, 2, 4096 + 3)]))


def projection_view_inputs(Z, H, N, D, causal, dtype) -> Inputs:
    """Inputs whose q, k, v are ``x.view(Z, N, H, D).transpose(1, 2)`` views, as a model's projection
    hands them over: [Z, H, N, D] with a contiguous last dim but not contiguous."""
    base = make_inputs(Problem(Z, N, H, D, causal, dtype), "cuda")  # laid out [Z, N, H, D]
    q, k, v = (t.transpose(1, 2) for t in (base.q, base.k, base.v))
    return Inputs(Problem(Z, H, N, D, causal, dtype), q, k, v, base.descale_q, base.descale_k, base.descale_v)


def fp8_scales(inputs) -> dict:
    p = inputs.problem
    return dict(descale_q=inputs.descale_q, descale_k=inputs.descale_k, descale_v=inputs.descale_v) \
        if p.is_fp8 else {}


def run_poisoned(launch, inputs, **kw):
    """Call ``launch(q, k, v, ...)`` writing into a NaN-filled output, so unwritten elements show."""
    out = torch.full((*inputs.q.shape[:-1], inputs.v.shape[-1]), float("nan"), dtype=inputs.out_dtype, device="cuda")
    return launch(inputs.q, inputs.k, inputs.v, causal=inputs.problem.causal, out=out, **fp8_scales(inputs), **kw)
