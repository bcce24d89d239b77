"""experiments/fa4_tiles.py: the provider that holds FA4's sm90 backward to 64-query blocks. FA4 is not installed
on CPU machines, so its tile function is a stand-in module with FA4's signature and its D=128 rule (80 queries
non-causal, 64 causal)."""
import sys
import types

import pytest

from gluon_attn.bench.providers import get_provider

from .experiment_scripts import load_experiment


@pytest.fixture
def fa4_tiles(monkeypatch):
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._tile_size_bwd_sm90 = lambda head_dim, head_dim_v, causal, local, sparse_block_size_q=None: (
        64 if causal or local else 80)
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    package = types.ModuleType("flash_attn")
    package.cute = cute
    for name, mod in (("flash_attn", package), ("flash_attn.cute", cute), ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, mod)
    yield load_experiment("fa4_tiles"), interface
    from gluon_attn.bench.provider import PROVIDERS
    PROVIDERS.pop("fa4-m64", None)


def test_the_tile_is_forced_only_inside_the_call(fa4_tiles):
    mod, interface = fa4_tiles
    mod._patch_once()
    mod._patch_once()  # (wrapped once: a second wrap would not change the answer, but it is not done)
    tile = interface._tile_size_bwd_sm90
    assert getattr(tile, "_m64_wrapped", False)
    assert tile(128, 128, False, False) == 80 and tile(128, 128, True, False) == 64
    with mod._m64():
        assert tile(128, 128, False, False, sparse_block_size_q=None) == 64
    assert tile(128, 128, False, False) == 80


def test_the_provider_is_fa4_with_its_own_backward_call(fa4_tiles):
    mod, _ = fa4_tiles
    provider = get_provider("fa4-m64")
    fa4 = get_provider("fa4")
    assert provider.backward and provider.backward_runner is mod._m64_backward
    assert provider.runner is fa4.runner and provider.package == fa4.package
    assert not provider.peer  # (not one of the sweep's peers: an experiment's variant of one)
