"""The 192/128 pair's forward (PAIR_TILE's 128-key blocks) under the two schedule knobs the tuning table has never set
for it, as providers beside its default (the D=256 kernel's table-less rule: static units, no ping-pong):
``gluon-pp`` (PINGPONG: the consumer warpgroups take turns issuing their wgmmas) and ``gluon-dyn`` (DYNAMIC: units
from a global counter as programs free up), forward only (``attention(config=...)``).

Usage (GPU; FA4 on PYTHONPATH): python3 experiments/pair_configs.py sweep --experiment experiments/pair-fwd-configs.toml
--out DIR (the gluon-attn CLI with these providers registered).
"""
import dataclasses

from gluon_attn.bench.gluon_providers import config_variant
from gluon_attn.bench.provider import register


def _pair(dtype: str, causal: bool, n_ctx: int, **knobs):
    from gluon_attn.kernels import hopper_host

    cfg = hopper_host.pair_config(hopper_host.default_config(192, dtype, causal, n_ctx), 192, 128)
    return dataclasses.replace(cfg, **knobs)


register(config_variant("gluon-pp", "Gluon (pair, ping-pong)", "the 192/128 pair's forward with PINGPONG on",
                        lambda p, dtype: _pair(dtype, p.causal, p.N_CTX, PINGPONG=True)))
register(config_variant("gluon-dyn", "Gluon (pair, dynamic units)", "the 192/128 pair's forward with DYNAMIC on",
                        lambda p, dtype: _pair(dtype, p.causal, p.N_CTX, DYNAMIC=True)))

if __name__ == "__main__":
    from gluon_attn.cli import main

    main()
