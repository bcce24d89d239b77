"""DeepSeek-V3's head dims (q, k 192; v 128): the forward's default, FA4's tile for them (128-key blocks with K in
64-column pieces, ``HopperConfig.PAIR_TILE``, ``hopper_host.pair_config``), against the D=256 kernel's 64-key
blocks it ran in before (NOTES v88, v94). Importing this module registers the provider ``gluon-64keys``: today's
forward with the class's config and PAIR_TILE off (a benchmark launch: ``attention(config=...)``, forward only).

Usage: PYTHONPATH=. python3 experiments/power_probe.py --register pair_tile --providers gluon,gluon-64keys,fa4 \\
           --head-dim 192 --head-dim-v 128 -Z 4 -H 32 --n-ctx 16384 --out DIR
"""
from gluon_attn.bench.gluon_providers import config_variant
from gluon_attn.bench.provider import register


def keys64_config(dtype: str, causal: bool, n_ctx: int):
    """The pair's config (its kernel's, the D=256 one) as the tuning table gives it: 64-key blocks, PAIR_TILE off."""
    from gluon_attn.kernels import hopper_host

    return hopper_host.default_config(192, dtype, causal, n_ctx)


register(config_variant("gluon-64keys", "Gluon (64-key blocks)",
                        "the forward of the 192/128 pair in the D=256 kernel's 64-key blocks (PAIR_TILE=False)",
                        lambda p, dtype: keys64_config(dtype, p.causal, p.N_CTX)))
