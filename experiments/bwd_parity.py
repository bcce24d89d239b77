"""Same-call parity of two trees' backward kernels, one config each problem (the tree's own code, same Triton).

    python experiments/bwd_parity.py time LABEL OUT.jsonl      # run from inside a tree (its gluon_attn first)
    python experiments/bwd_parity.py compare OUT.jsonl BASE NEW  # per problem: median NEW / median BASE

`time` appends one line per problem: the median of triton.testing.do_bench over the deterministic backward
(dQ's adds in a fixed order) of fp16 and bf16 D=64 non-causal at N 4096 and 8192, with the config given by
PARITY_CONFIG (fields of HopperBwdConfig, JSON) or the tree's default. Alternate the trees over a few rounds
and `compare` takes the median of each side's rounds.
"""
import json
import os
import statistics
import sys

PROBLEMS = [(dtype, 64, False, n) for dtype in ("fp16", "bf16") for n in (4096, 8192)]


def time_tree(label: str, out: str) -> None:
    import torch
    import triton

    import gluon_attn
    from gluon_attn.api import backward, forward
    from gluon_attn.kernels import hopper_bwd_host

    torch.manual_seed(0)
    for dtype, d, causal, n in PROBLEMS:
        dt = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dtype])
        q, k, v, do = (torch.randn(4, n, 32, d, device="cuda", dtype=dt) for _ in range(4))
        fields = json.loads(os.environ.get("PARITY_CONFIG", "null"))
        cfg = hopper_bwd_host.HopperBwdConfig(**fields) if fields else hopper_bwd_host.default_config(d, dtype, causal)
        o, lse = forward(q, k, v, causal=causal, return_lse=True)

        def fn():
            return backward(do, q, k, v, o, lse, causal=causal, config=cfg, deterministic=True)
        ms = triton.testing.do_bench(fn, warmup=300, rep=300)
        flops = 2.5 * 4 * 4 * 32 * n * n * d * (0.5 if causal else 1.0)
        row = dict(label=label, dtype=dtype, head_dim=d, causal=causal, n_ctx=n, ms=ms, tflops=flops / ms / 1e9,
                   config=str(cfg), triton=triton.__version__, tree=os.path.dirname(gluon_attn.__file__))
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(label, dtype, n, f"{ms:.3f} ms", flush=True)


def compare(path: str, base: str, new: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    keys = sorted({(r["dtype"], r["head_dim"], r["causal"], r["n_ctx"]) for r in rows})
    print(f"| dtype | D | causal | N | {base} ms | {new} ms | {new} / {base} (speed) | rounds |")
    print("|---|---|---|---|---|---|---|---|")
    for key in keys:
        side = {lab: [r["ms"] for r in rows if (r["dtype"], r["head_dim"], r["causal"], r["n_ctx"]) == key
                      and r["label"] == lab] for lab in (base, new)}
        b, m = statistics.median(side[base]), statistics.median(side[new])
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {b:.3f} | {m:.3f} | {b / m:.3f} | "
              f"{len(side[base])}/{len(side[new])} |")


if __name__ == "__main__":
    if sys.argv[1] == "time":
        time_tree(sys.argv[2], sys.argv[3])
    else:
        compare(sys.argv[2], sys.argv[3], sys.argv[4])
