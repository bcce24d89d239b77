"""DeepSeek-V3's head dims (q, k 192; v 128) in FA4's tile for them: 128-key blocks with K in 64-column pieces
(``HopperConfig.PAIR_TILE``) against the D=256 kernel's 64-key blocks (NOTES v88). Importing this module registers the
provider ``gluon-pairtile``: today's forward with the class's config and PAIR_TILE on (a benchmark launch:
``attention(config=...)``, forward only).

Usage: PYTHONPATH=. python3 experiments/power_probe.py --register pair_tile --providers gluon,gluon-pairtile,fa4 \\
           --head-dim 192 --head-dim-v 128 -Z 4 -H 32 --n-ctx 16384 --out DIR
"""
import dataclasses

from gluon_attn.bench.gluon_providers import attention_runner
from gluon_attn.bench.provider import register
from gluon_attn.bench.providers import get_provider


def pair_tile_config(dtype: str, causal: bool, n_ctx: int):
    """The pair's config (its kernel's, the D=256 one) with PAIR_TILE on."""
    from gluon_attn.kernels import hopper

    return dataclasses.replace(hopper.default_config(192, dtype, causal, n_ctx), PAIR_TILE=True)


def _runner(inputs):
    from gluon_attn.api import attention
    from gluon_attn.problem import dtype_name

    p = inputs.problem
    cfg = pair_tile_config(dtype_name(inputs.q.dtype), p.causal, p.N_CTX)
    return attention_runner(lambda q, k, v, **kw: attention(q, k, v, config=cfg, **kw))(inputs)


register(dataclasses.replace(get_provider("gluon"), name="gluon-pairtile", runner=_runner, backward_runner=None,
                             description="today's forward of the 192/128 pair in 128-key blocks (PAIR_TILE=True)",
                             label_fn=lambda: "Gluon (PAIR_TILE)"))
