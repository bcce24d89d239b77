"""GPU checks of the harness (run on the GPU machine; skipped without a CUDA GPU)."""
import pytest
import torch

from gluon_attn.bench.providers import get_provider
from gluon_attn.bench.sweep import SweepSpec, run_sweep
from gluon_attn.problem import Problem, make_inputs
from gluon_attn.reference import check_accuracy, reference_for

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("provider", ["cudnn", "fa2", "flex"])
@pytest.mark.parametrize("causal", [False, True])
def test_baseline_providers_pass_the_gate(provider, causal):
    p = Problem(2, 3, 300, 128, causal=causal, dtype="fp16")
    prov = get_provider(provider)
    support = prov.supports(p, torch.cuda.get_device_capability())
    if not support.ok:
        pytest.skip(support.reason)
    inputs = make_inputs(p, "cuda", seed=11)
    with prov.context():
        out = prov.prepare(inputs)()
    acc = check_accuracy(out, reference_for(inputs), "fp16")
    assert acc.ok, acc.message


def test_tma_scale_kernel_runs_on_hopper():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    from gluon_attn.kernels.tma_copy import tma_scale

    x = torch.randn(2, 3, 200, 64, device="cuda", dtype=torch.float16)
    y = tma_scale(x, 3.0, block_m=64)
    torch.testing.assert_close(y, x * 3.0)
    # Non-contiguous view whose last dim is contiguous: [Z, N, H, D] seen as [Z, H, N, D].
    base = torch.randn(2, 200, 3, 64, device="cuda", dtype=torch.float16)
    xv = base.transpose(1, 2)
    torch.testing.assert_close(tma_scale(xv, 0.5), xv * 0.5)


def test_small_gpu_sweep(tmp_path):
    spec = SweepSpec(n_ctx=(512, 1000), head_dims=(64,), causal=(False, True), dtypes=("fp16", "fp8e4m3"),
                     batch=1, heads=4, providers=("cudnn", "fa2"), warmup_ms=5, rep_ms=10)
    run_sweep(spec, tmp_path, progress=False)
    import pandas as pd
    df = pd.read_csv(tmp_path / "rows.csv")
    assert set(df[df.dtype == "fp16"].status) == {"ok"}
    assert set(df[df.dtype == "fp8e4m3"].status) == {"unsupported"}


def test_sweep_rows_read_the_boards_power_and_clock(tmp_path):
    """On a GPU with NVML (nvidia-ml-py) each timed row has the board's power and SM clock during its repetitions,
    within what an H100/H200 can report, and TFLOPS per watt consistent with them."""
    pytest.importorskip("pynvml")
    spec = SweepSpec(n_ctx=(4096,), head_dims=(128,), causal=(False,), dtypes=("fp16",), batch=4, heads=16,
                     providers=("cudnn",), warmup_ms=300, rep_ms=100)
    run_sweep(spec, tmp_path, progress=False)
    import pandas as pd
    row = pd.read_csv(tmp_path / "rows.csv").iloc[0]
    assert row.status == "ok"
    assert 60 < row.power_w < 1000 and 300 < row.sm_clock_mhz < 2200
    assert row.tflops_per_w == pytest.approx(row.tflops / row.power_w, rel=1e-3)  # (rows.csv rounds power_w to 0.1 W)
