"""Shared by the GPU correctness tests of both kernels."""
import torch


def fp8_scales(inputs) -> dict:
    p = inputs.problem
    return dict(descale_q=inputs.descale_q, descale_k=inputs.descale_k, descale_v=inputs.descale_v) \
        if p.is_fp8 else {}


def run_poisoned(launch, inputs, **kw):
    """Call ``launch(q, k, v, ...)`` writing into a NaN-filled output, so unwritten elements show."""
    out = torch.full(inputs.q.shape, float("nan"), dtype=inputs.out_dtype, device="cuda")
    return launch(inputs.q, inputs.k, inputs.v, causal=inputs.problem.causal, out=out, **fp8_scales(inputs), **kw)
