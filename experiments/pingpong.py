"""The warpgroups' turns (PINGPONG) on our sm_90a forward against its default, for the sustained power probe
(NOTES v85: FA4's sm90 forward takes turns for exactly the class D <= 128 with two consumer warpgroups; ours has the
knob off there). Importing this module registers the provider ``gluon-pingpong``: today's forward with the class's
tuned config but PINGPONG=True (a benchmark launch: ``attention(config=...)``, forward only).

Usage: PYTHONPATH=. python3 experiments/power_probe.py --register pingpong --providers gluon,gluon-pingpong,fa4 \
           --head-dim 128 -Z 4 -H 32 --n-ctx 8192 --out DIR
"""
import dataclasses

from gluon_attn.bench.gluon_providers import config_variant
from gluon_attn.bench.provider import register


def pingpong_config(head_dim: int, dtype: str, causal: bool, n_ctx: int):
    """The class's tuned sm_90a config with the warpgroups taking turns."""
    from gluon_attn.kernels import hopper_host

    return dataclasses.replace(hopper_host.default_config(head_dim, dtype, causal, n_ctx), PINGPONG=True)


register(config_variant("gluon-pingpong", "Gluon (PINGPONG)",
                        "today's forward with its warpgroups taking turns (PINGPONG=True)",
                        lambda p, dtype: pingpong_config(p.HEAD_DIM, dtype, p.causal, p.N_CTX)))
