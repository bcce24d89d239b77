"""DeepSeek-V3's head dims (q, k 192; v 128) in FA4's tile for them: 128-key blocks with K in 64-column pieces
(``HopperConfig.PAIR_TILE``) against the D=256 kernel's 64-key blocks (NOTES v88). Importing this module registers the
provider ``gluon-pairtile``: today's forward with the class's config and PAIR_TILE on (a benchmark launch:
``attention(config=...)``, forward only).

Usage: PYTHONPATH=. python3 experiments/power_probe.py --register pair_tile --providers gluon,gluon-pairtile,fa4 \\
           --head-dim 192 --head-dim-v 128 -Z 4 -H 32 --n-ctx 16384 --out DIR
"""
import dataclasses

from gluon_attn.bench.gluon_providers import config_variant
from gluon_attn.bench.provider import register


def pair_tile_config(dtype: str, causal: bool, n_ctx: int):
    """The pair's config (its kernel's, the D=256 one) with PAIR_TILE on."""
    from gluon_attn.kernels import hopper_host

    return dataclasses.replace(hopper_host.default_config(192, dtype, causal, n_ctx), PAIR_TILE=True)


register(config_variant("gluon-pairtile", "Gluon (PAIR_TILE)",
                        "today's forward of the 192/128 pair in 128-key blocks (PAIR_TILE=True)",
                        lambda p, dtype: pair_tile_config(dtype, p.causal, p.N_CTX)))
