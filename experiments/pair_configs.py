"""The 192/128 pair under knobs its defaults do not set, as providers beside them.

Forward (PAIR_TILE's 128-key blocks; the D=256 kernel's table-less rule: static units, no ping-pong),
``attention(config=...)``: ``gluon-pp`` (PINGPONG: the consumer warpgroups take turns issuing their wgmmas) and
``gluon-dyn`` (DYNAMIC: units from a global counter as programs free up).

Backward (its own 32-query units), ``api.backward(config=...)`` after gluon's forward: ``gluon-bwd-rule`` (the default
config given, the fair reference: a given config skips the prepared route) and ``gluon-bwd-frag`` (DQ_FRAG the other
way: dQ^T's chunks in fragment order where the default stages them transposed, causal, and the other way round),
for the causal fragment order's 4.2% (NOTES v113), timed or under Nsight Compute.

Usage (GPU; FA4 on PYTHONPATH): python3 experiments/pair_configs.py sweep --experiment experiments/pair-fwd-configs.toml
--out DIR (the gluon-attn CLI with these providers registered); the backward's:
  python3 experiments/pair_configs.py sweep --experiment experiments/pair-bwd-ab-causal.toml \
      --providers gluon,gluon-bwd-rule,gluon-bwd-frag,fa4 --out DIR
  NCU_PROVIDERS="gluon-bwd-rule gluon-bwd-frag" NCU_MASKS=causal \
      NCU_ARGS="--head-dim 192 --head-dim-v 128 --register pair_configs" experiments/gpu_run.sh ncu -- OUT
"""
import dataclasses

from gluon_attn.bench.gluon_providers import bwd_config_variant, config_variant
from gluon_attn.bench.provider import register


def _pair(dtype: str, causal: bool, n_ctx: int, **knobs):
    from gluon_attn.kernels import hopper_host

    cfg = hopper_host.pair_config(hopper_host.default_config(192, dtype, causal, n_ctx), 192, 128)
    return dataclasses.replace(cfg, **knobs)


register(config_variant("gluon-pp", "Gluon (pair, ping-pong)", "the 192/128 pair's forward with PINGPONG on",
                        lambda p, dtype: _pair(dtype, p.causal, p.N_CTX, PINGPONG=True)))
register(config_variant("gluon-lmma", "Gluon (pair, row sums by wgmma)", "the 192/128 pair's forward with SUM_MMA on",
                        lambda p, dtype: _pair(dtype, p.causal, p.N_CTX, SUM_MMA=True)))
register(config_variant("gluon-dyn", "Gluon (pair, dynamic units)", "the 192/128 pair's forward with DYNAMIC on",
                        lambda p, dtype: _pair(dtype, p.causal, p.N_CTX, DYNAMIC=True)))


def _pair_bwd(dtype: str, causal: bool, n_ctx: int, flip_frag: bool = False):
    from gluon_attn.kernels import hopper_bwd_host

    cfg = hopper_bwd_host.default_config(192, dtype, causal, n_ctx, 128)
    return dataclasses.replace(cfg, DQ_FRAG=not cfg.DQ_FRAG) if flip_frag else cfg


register(bwd_config_variant("gluon-bwd-rule", "Gluon (pair, backward's default given)",
                            "the 192/128 pair's backward in its default config, given (the config path)",
                            lambda p, dtype: _pair_bwd(dtype, p.causal, p.N_CTX)))
register(bwd_config_variant("gluon-bwd-frag", "Gluon (pair, backward's DQ_FRAG flipped)",
                            "the 192/128 pair's backward with DQ_FRAG the other way (causal: fragment order)",
                            lambda p, dtype: _pair_bwd(dtype, p.causal, p.N_CTX, flip_frag=True)))

if __name__ == "__main__":
    from gluon_attn.cli import main

    main()
