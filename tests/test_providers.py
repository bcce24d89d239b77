import pytest
import torch

from gluon_attn.bench.providers import default_providers, get_provider, provider_names
from gluon_attn.bench.timing import benchmark
from gluon_attn.problem import Problem, make_inputs
from gluon_attn.reference import check_accuracy, reference_for


def test_registry_lists_baselines():
    names = provider_names()
    for n in ("cudnn", "fa2", "flex", "math"):
        assert n in names
    assert "math" not in default_providers()


def test_unknown_provider_names_available():
    with pytest.raises(ValueError, match="available: .*cudnn"):
        get_provider("cublas")


def test_gpu_providers_unsupported_without_gpu():
    p = Problem(1, 1, 64, 64, causal=False)
    s = get_provider("cudnn").supports(p, None)
    assert not s.ok and "CUDA GPU" in s.reason


def test_support_rules_name_what_is_supported():
    fp8 = Problem(1, 1, 64, 64, causal=False, dtype="fp8e4m3")
    s = get_provider("cudnn").supports(fp8, (9, 0))
    assert not s.ok and "fp16, bf16" in s.reason
    odd = Problem(1, 1, 64, 72, causal=False)
    s = get_provider("flex").supports(odd, (9, 0))
    assert not s.ok and "powers of two" in s.reason
    s = get_provider("cudnn").supports(Problem(1, 1, 64, 64, False), (8, 0))
    assert not s.ok and "sm_90+" in s.reason
    assert get_provider("fa2").supports(Problem(1, 1, 64, 64, False), (9, 0)).ok


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_math_provider_is_accurate_on_cpu(causal, dtype):
    p = Problem(1, 2, 77, 64, causal=causal, dtype=dtype)
    inputs = make_inputs(p, "cpu", seed=5)
    prov = get_provider("math")
    with prov.context():
        out = prov.prepare(inputs)()
    acc = check_accuracy(out, reference_for(inputs), dtype)
    assert acc.ok, acc.message


def test_cpu_timing_quantiles_ordered():
    x = torch.randn(64, 64)
    t = benchmark(lambda: x @ x, device="cpu", warmup_ms=1, rep_ms=5)
    assert 0 < t.p20_ms <= t.p50_ms <= t.p80_ms
