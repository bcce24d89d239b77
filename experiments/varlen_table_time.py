"""GPU and host time per call of the packed table (``schedule.varlen_table``) and of a whole packed call, today's
package against a copy (``before_after.py --make NAME=REV``) whose table was built by PyTorch's ops.

GPU time: CALLS back-to-back calls queued behind a sleep kernel, so the host never holds the GPU up, timed by
CUDA events; host time: ``decode_host.host_us`` (batches of 20 calls from an idle GPU, median over batches).

Usage (GPU): PYTHONPATH=.:.before python3 experiments/varlen_table_time.py --copy tab [--mix longtail] [--n 65536]
"""
import argparse
import importlib

from decode_host import gpu_us, host_us  # (this folder is the script's first path entry)

CALLS = 200
SLEEP_CYCLES = 50_000_000  # (~30 ms of spinning: every call below is queued before the first runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copy", required=True, help="the copy's name (package gluon_attn_NAME on the path)")
    ap.add_argument("--mix", default="longtail")
    ap.add_argument("--n", type=int, default=65536, help="tokens in the packed batch")
    args = ap.parse_args()

    from gluon_attn.problem import Problem, make_inputs

    p = Problem(1, 32, args.n, 128, True, "fp16", H_KV=8, varlen=args.mix)
    inp = make_inputs(p, "cuda")
    cu = inp.cu_seqlens
    lens = (cu[1:] - cu[:-1]).tolist()
    print(f"{args.mix} mix of {args.n} tokens: {len(lens)} sequences, longest {max(lens)}; GQA 32/8, D=128, causal")
    for name in ("gluon_attn", f"gluon_attn_{args.copy}"):
        pkg = importlib.import_module(name)
        schedule = importlib.import_module(f"{name}.kernels.schedule")

        def table():
            return schedule.varlen_table(cu, cu, 32, 128, True)

        def call():
            return pkg.attention_varlen(inp.q, inp.k, inp.v, cu, cu, max(lens), max(lens), causal=True)

        rev = getattr(pkg, "__file__", "")
        print(f"{name:24s} table: GPU {gpu_us(table, CALLS, SLEEP_CYCLES):7.1f} us/call, "
              f"host {host_us(table):6.1f} us/call;  whole call: GPU {gpu_us(call, CALLS, SLEEP_CYCLES) / 1e3:7.3f} "
              f"ms/call, host {host_us(call):6.1f} us/call  ({rev})")


if __name__ == "__main__":
    main()
