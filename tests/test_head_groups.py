"""experiments/head_groups.py: providers that run today's kernel with the scheduler walking N heads together."""
from types import SimpleNamespace

import pytest

import gluon_attn.api as api
from gluon_attn.bench.provider import PROVIDERS
from gluon_attn.bench.providers import get_provider

from .experiment_scripts import load_experiment


@pytest.fixture
def head_groups():
    mod = load_experiment("head_groups")
    yield mod
    for g in mod.GROUPS:
        PROVIDERS.pop(f"gluon-g{g}", None)


def _inputs(varlen=False):
    problem = SimpleNamespace(varlen=varlen, causal=True, is_fp8=False)
    return SimpleNamespace(q="q", k="k", v="v", problem=problem, cu_seqlens="cu", max_seqlen=7)


def test_each_provider_passes_its_group_to_the_kernel(head_groups, monkeypatch):
    calls = []
    monkeypatch.setattr(api, "attention", lambda q, k, v, **kw: calls.append(kw) or "out")
    for g in head_groups.GROUPS:
        provider = get_provider(f"gluon-g{g}")
        assert not provider.peer and not provider.varlen
        assert provider.runner(_inputs())() == "out"
        assert calls[-1] == {"causal": True, "head_group_size": g}
    assert len(calls) == len(head_groups.GROUPS)


def test_packed_problems_are_refused_by_name(head_groups):
    with pytest.raises(ValueError, match="gluon-g2: dense problems only"):
        get_provider("gluon-g2").runner(_inputs(varlen=True))()
