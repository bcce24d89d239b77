"""Correctness of the sm_100a kernel against the fp32 reference: the Hopper kernel's grid. Runs only on a
Blackwell GPU (none was available to this project; these tests have never run)."""
import pytest
import torch

from gluon_attn.kernels.blackwell_host import BlackwellConfig, blackwell_attention
from gluon_attn.problem import Problem, make_inputs
from gluon_attn.reference import check_accuracy, reference_for

from .gpu_helpers import CORRECTNESS_GRID, projection_view_inputs, run_poisoned

pytestmark = pytest.mark.gpu


def _blackwell():
    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        pytest.skip(f"needs an sm_100 (Blackwell) GPU; this one is sm_{major}{minor}")


def _run(inputs, **kw):
    return run_poisoned(blackwell_attention, inputs, **kw)


@pytest.mark.parametrize("dtype,head_dim,causal,zhn", CORRECTNESS_GRID)
def test_matches_reference(dtype, head_dim, causal, zhn):
    _blackwell()
    Z, H, N = zhn
    inputs = make_inputs(Problem(Z, H, N, head_dim, causal, dtype), "cuda")
    acc = check_accuracy(_run(inputs), reference_for(inputs), dtype)
    assert acc.ok, acc.message


@pytest.mark.parametrize("dtype", ["fp16", "fp8e4m3"])
@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_and_lse(dtype, causal):
    _blackwell()
    inputs = projection_view_inputs(2, 3, 777, 128, causal, dtype)
    out, lse = _run(inputs, return_lse=True)
    ref, ref_lse = reference_for(inputs, return_lse=True)
    assert check_accuracy(out, ref, dtype).ok
    torch.testing.assert_close(lse, ref_lse, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("cluster", [1, 2, 4])
@pytest.mark.parametrize("zhn", [(1, 3, 17), (3, 1, 1000), (2, 2, 4096 + 3)])
def test_cluster_sizes_match_reference(dtype, cluster, zhn):
    """Non-causal D=128 in clusters of 1, 2 (two-CTA MMA pairs, the default) and 4 CTAs (two pairs sharing K and
    V by multicast): the same results."""
    _blackwell()
    Z, H, N = zhn
    inputs = make_inputs(Problem(Z, H, N, 128, False, dtype), "cuda")
    stages = 3 if cluster == 1 else 6
    out = _run(inputs, config=BlackwellConfig(CLUSTER=cluster, KV_STAGES=stages))
    acc = check_accuracy(out, reference_for(inputs), dtype)
    assert acc.ok, acc.message


@pytest.mark.parametrize("causal", [False, True])
def test_more_units_than_clusters_fit(causal):
    """More clusters than the GPU runs at once: those that finish first take the units of clusters that have not
    started (cluster launch control); every unit is done exactly once."""
    _blackwell()
    inputs = make_inputs(Problem(2, 16, 2048, 128, causal, "fp16"), "cuda")
    acc = check_accuracy(_run(inputs), reference_for(inputs), "fp16")
    assert acc.ok, acc.message
