"""Which sm_90a config (and head grouping) runs GQA prefill fastest, against FA4 in the same run: every valid
config of a head dim registered as its own provider (``gluon:LABEL``, ``gluon:LABEL:gN`` with N heads
walked together), timed in a sweep beside FA4 in turning order.

Usage: PYTHONPATH=. python3 experiments/gqa_configs.py --spec experiments/gqa.toml --n-ctx 16384,32768 --out DIR
       (--configs LABEL,... times only those configs, beside today's ``gluon``; --peers the peers to time)
"""
import argparse
import dataclasses

from gluon_attn.bench.gluon_providers import attention_runner
from gluon_attn.bench.provider import Provider, register
from gluon_attn.bench.providers import get_provider
from gluon_attn.bench.report import load_rows
from gluon_attn.bench.sweep import SweepSpec, run_sweep
from gluon_attn.kernels.hopper_host import config_space


def register_config(cfg, group):
    from gluon_attn.api import attention

    def run(q, k, v, causal=False, **kw):
        return attention(q, k, v, causal=causal, config=cfg, head_group_size=group, **kw)

    today = get_provider("gluon")
    name = f"gluon:{cfg.label()}" + (f":g{group}" if group else "")
    register(dataclasses.replace(today, name=name, label_fn=lambda: name, runner=attention_runner(run),
                                 config_fn=lambda p: cfg.label(), peer=False))
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="experiments/gqa.toml")
    ap.add_argument("--n-ctx", default="16384,32768")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--groups", default="0,1", help="head groups to try (0: the default, one K/V head's)")
    ap.add_argument("--configs", default="", help="config labels to time (default: every valid one)")
    ap.add_argument("--peers", default="fa4", help="peer providers beside them (the first is the reference)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup-ms", type=float, default=300)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    names = []
    labels = set(filter(None, args.configs.split(",")))
    for cfg in config_space():
        if labels and cfg.label() not in labels:
            continue
        if (labels or cfg.BLOCK_M == 128) and not cfg.invalid_reasons(args.head_dim, "fp16"):
            for g in map(int, args.groups.split(",")):
                names.append(register_config(cfg, g or None))
    peers = tuple(filter(None, args.peers.split(",")))
    if labels:
        names.append("gluon")  # today's default config for each cell
    spec = SweepSpec.from_file(args.spec, n_ctx=tuple(map(int, args.n_ctx.split(","))), head_dims=(args.head_dim,),
                               providers=(*peers, *names), rounds=args.rounds, warmup_ms=args.warmup_ms)
    out = run_sweep(spec, args.out, resume=True, progress=False)
    df = load_rows(out)
    ok = df[df.status == "ok"]
    for (causal, n), g in ok.groupby(["causal", "N_CTX"]):
        ref = peers[0]
        top = g[g.provider == ref].tflops.max()
        best = g[~g.provider.isin(peers)].sort_values("tflops", ascending=False).head(6)
        print(f"causal={causal} N_CTX={n}: {ref} {top:.1f}; " + "; ".join(
            f"{r.provider} {r.tflops:.1f} ({r.tflops / top:.3f})" for r in best.itertuples()))


if __name__ == "__main__":
    main()
