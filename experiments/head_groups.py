"""How many heads the causal scheduler walks together: importing this module registers ``gluon-gN`` for N in
1, 2, 8 and 16, today's kernel with ``head_group_size=N`` (the default, ``gluon``, walks the query heads of one
K/V head: 4 at GQA 32/8). With single tiles a group's tiles go longest first, each query block of the group's
heads one after another, so about 132 / N query blocks of N heads are in flight at a time. FA4's sm90 forward
(a grid of single tiles in `SingleTileLPTScheduler`'s order) walks 2 query heads together at N_KV=32768, D=128
(as many as 50 MB of L2 holds K/V of, rounded down to a power of two).

Usage: PYTHONPATH=. python3 experiments/power_probe.py --register head_groups \
           --providers gluon,gluon-g2,gluon-g8,fa4 --h-kv 8 --causal -Z 2 --n-ctx 32768 --out DIR
"""
import dataclasses

from gluon_attn.bench.gluon_providers import attention_runner
from gluon_attn.bench.provider import register
from gluon_attn.bench.providers import get_provider

GROUPS = (1, 2, 8, 16)


def register_group(group: int) -> str:
    import gluon_attn.api as api

    def run(q, k, v, causal=False, **kw):
        return api.attention(q, k, v, causal=causal, head_group_size=group, **kw)

    def run_varlen(*args, **kw):
        raise ValueError(f"gluon-g{group}: dense problems only (attention_varlen takes no head_group_size)")

    name = f"gluon-g{group}"
    register(dataclasses.replace(get_provider("gluon"), name=name, label_fn=lambda: name,
                                 runner=attention_runner(run, run_varlen), peer=False, varlen=False))
    return name


for _g in GROUPS:
    register_group(_g)
