"""The peers (cuDNN through cudnn-frontend, FlashAttention-4) against the fp32 reference, on a GPU with
the peers installed (``pip install -e ".[peers]"``); skipped, with the reason, where they are not."""
import itertools

import pandas as pd
import pytest
import torch

from gluon_attn.bench.providers import get_provider
from gluon_attn.bench.sweep import SweepSpec, run_sweep
from gluon_attn.problem import Problem, make_inputs
from gluon_attn.reference import check_accuracy, reference_for
from gluon_attn.validation import UnsupportedError

pytestmark = pytest.mark.gpu

# Sizes that are not multiples of any tile, an odd head count, a single query.
SHAPES = [(1, 3, 17), (2, 2, 1000), (1, 1, 1)]
GRID = list(itertools.product(["cudnn-fe", "fa4"], ["fp16", "bf16", "fp8e4m3", "fp8e5"], [64, 128], [False, True]))


def _poison_allocator(nbytes: int) -> None:
    """Leave NaNs in the caching allocator's free blocks, so that an output a library allocates with
    torch.empty and does not fully write shows NaN instead of stale numbers."""
    torch.full((nbytes // 2 + 1024,), float("nan"), dtype=torch.float16, device="cuda")


@pytest.mark.parametrize("provider,dtype,d,causal", GRID)
def test_peer_matches_the_fp32_reference(provider, dtype, d, causal):
    prov = get_provider(provider)
    arch = torch.cuda.get_device_capability()
    ran = 0
    for Z, H, N in SHAPES:
        p = Problem(Z, H, N, d, causal=causal, dtype=dtype)
        support = prov.supports(p, arch)
        if not support.ok:
            pytest.skip(support.reason)
        inputs = make_inputs(p, "cuda")
        try:
            call = prov.prepare(inputs)
        except UnsupportedError:  # declined at build time (cuDNN's fp8 graph has no engine for one query)
            continue
        ran += 1
        _poison_allocator(Z * H * N * d * 4)
        out = call()
        assert tuple(out.shape) == (Z, H, N, d)
        assert str(out.dtype).endswith({"fp16": "float16", "bf16": "bfloat16", "fp8e4m3": "e4m3fn",
                                        "fp8e5": "e5m2"}[prov.out_dtype_fn(p)])
        acc = check_accuracy(out.float() * call.descale_o, reference_for(inputs), dtype,
                             out_dtype=prov.out_dtype_fn(p))
        assert acc.ok, f"{p.label()}: {acc.message}"
        # A second call on the same prepared state gives the same output (nothing consumed by the first).
        torch.testing.assert_close(call().float(), out.float(), rtol=0, atol=0)
    assert ran >= len(SHAPES) - 1, "the library declined more than the single-query shape"


def test_fa4_fp8_on_hopper_is_unsupported_with_its_reason():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("checks the sm_90 rule")
    s = get_provider("fa4").supports(Problem(1, 1, 64, 128, causal=False, dtype="fp8e4m3"), (9, 0))
    assert not s.ok and ("sm_100" in s.reason or "not installed" in s.reason)


def test_sweep_rates_gluon_against_the_peers(tmp_path):
    for name in ("cudnn-fe", "fa4"):
        available = get_provider(name).available()
        if not available.ok:
            pytest.skip(available.reason)
    spec = SweepSpec(n_ctx=(1000,), head_dims=(128,), causal=(True,), dtypes=("fp16", "fp8e4m3"), batch=1, heads=4,
                     providers=("cudnn", "cudnn-fe", "fa4", "gluon"), warmup_ms=5, rep_ms=10)
    run_sweep(spec, tmp_path, progress=False)
    rows = pd.read_csv(tmp_path / "rows.csv").set_index(["provider", "dtype"])
    for key in [("cudnn", "fp16"), ("cudnn-fe", "fp16"), ("fa4", "fp16"), ("gluon", "fp16"),
                ("cudnn-fe", "fp8e4m3"), ("gluon", "fp8e4m3")]:
        assert rows.loc[key, "status"] == "ok", (key, rows.loc[key, "message"])
        assert rows.loc[key, "peak_mem_mb"] > 0
    assert rows.loc[("cudnn-fe", "fp8e4m3"), "out_dtype"] == "fp8e4m3"
    assert rows.loc[("gluon", "fp8e4m3"), "out_dtype"] == "fp16"
    tables = (tmp_path / "tables.md").read_text()
    assert "gluon / best peer" in tables and (tmp_path / "speedup-vs-peer.png").exists()


def test_backward_passes_of_the_graph_peer_and_the_deterministic_mode(tmp_path):
    """cudnn-fe's backward graph (sdpa_backward, no autograd) and gluon's deterministic backward, timed and
    gated on dQ/dK/dV like every backward: odd lengths, GQA, causal and not."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("gluon's backward runs on sm_90a")
    available = get_provider("cudnn-fe").available()
    if not available.ok:
        pytest.skip(available.reason)
    spec = SweepSpec(n_ctx=(1000,), head_dims=(64, 128), causal=(False, True), dtypes=("bf16",), batch=2, heads=4,
                     kv_heads=(2,), passes=("bwd", "fwd+bwd"), providers=("cudnn-fe", "gluon", "gluon-det"),
                     warmup_ms=5, rep_ms=10)
    run_sweep(spec, tmp_path, progress=False)
    rows = pd.read_csv(tmp_path / "rows.csv")
    assert len(rows) == 3 * 2 * 2 * 2
    bad = rows[rows.status != "ok"]
    assert bad.empty, bad[["provider", "pass", "HEAD_DIM", "causal", "message"]].to_string()
