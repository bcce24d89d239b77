"""FA4's sm90 backward at the query tile Gluon 3.6 can express: importing this module registers the provider
``fa4-m64``, FA4 whose backward takes the 64-query block it uses for causal masks in every class (non-causal
D=128 takes 80 queries otherwise, with dQ computed transposed; Gluon 3.6 refuses a wgmma of 80 columns and an
[80, D] shared tile: `gluon_limits.py`). The forward is FA4's own. Timing both ``fa4`` and ``fa4-m64`` beside
``gluon`` in one run says how much of FA4's non-causal lead is its tile (NOTES v54).

Usage: PYTHONPATH=. python3 experiments/power_probe.py --register fa4_tiles \
           --providers gluon,fa4,fa4-m64 --pass bwd --head-dim 128 -Z 4 --n-ctx 8192 --out DIR
"""
import contextlib
import dataclasses

from gluon_attn.bench.peers import FA4
from gluon_attn.bench.provider import Call, register

# A module global, not thread-local: autograd runs CUDA backward functions on its own device threads.
_forced = {"m64": False}


def _patch_once():
    """Wrap FA4's sm90 backward tile choice: while forced it answers as for a causal mask (64 queries, dQ not
    transposed); that only picks the tile, the mask itself stays the call's."""
    from flash_attn.cute import interface

    if getattr(interface._tile_size_bwd_sm90, "_m64_wrapped", False):
        return
    original = interface._tile_size_bwd_sm90

    def tile_size(head_dim, head_dim_v, causal, local, *args, **kwargs):
        return original(head_dim, head_dim_v, causal or _forced["m64"], local, *args, **kwargs)

    tile_size._m64_wrapped = True
    interface._tile_size_bwd_sm90 = tile_size


@contextlib.contextmanager
def _m64():
    _forced["m64"] = True
    try:
        yield
    finally:
        _forced["m64"] = False


def _m64_backward(inputs) -> Call:
    """FA4's backward call as every autograd provider's (``Provider._backward_call``), run with the tile forced."""
    _patch_once()
    call = dataclasses.replace(FA4, backward_runner=None)._backward_call(inputs)

    def run():
        with _m64():
            return call()

    return Call(run)


FA4_M64 = register(dataclasses.replace(
    FA4, name="fa4-m64", backward_runner=_m64_backward, peer=False,
    description="FA4 with its sm90 backward held to 64-query blocks (as for causal masks) in every class",
    label_fn=lambda: f"FA4 {FA4.version or ''} (backward at 64-query blocks)".replace("  ", " ")))
