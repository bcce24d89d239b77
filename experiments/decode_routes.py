"""Decode steps by route: the ordinary launch against the decode split (``gluon_attn.decode``), each as a model calls
it (plain eager, a shape seen before), beside SDPA's step as a Hugging Face model makes it (one query:
``enable_gqa``, no mask; more: the K/V heads repeated and the bottom-right causal mask as a boolean tensor, which is
what ``sdpa_attention_forward`` passes), to
calibrate the split plan's host costs (``decode.ORDINARY_HOST_BLOCKS``, ``SPLIT_HOST_BLOCKS``, ``TAIL_HOST_BLOCKS``):
which route the plan takes, and what each route costs.

Each route is made once through ``gluon_attn.attention`` with ``decode.plan`` forced (None: the ordinary launch; the
plan without host costs: the split) and then called as the route itself, so both pay the same API overhead (none);
``host_times_turns``: 20 calls back to back from an idle queue, median of 9 batches, the three taking turns. ``host
us``: the time to issue a call; ``eager us``: the wall time per call until the last has finished (the longer of the
host's and the GPU's work).

Usage (GPU): PYTHONPATH=. python3 experiments/decode_routes.py > decode-routes.md"""
import torch
import torch.nn.functional as F

import gluon_attn
from gluon_attn import api, decode
from gluon_attn.bench.timing import host_times_turns

SHAPES = [(z, n_q, n_kv) for z in (1, 8) for n_q in (1, 4) for n_kv in (1024, 2048, 4097, 8192)]
H, H_KV, D = 32, 8, 128


def route_of(q, k, v, causal: bool, plan):
    """The route ``attention`` makes for this call with ``decode.plan`` replaced by ``plan``, and the plan it took."""
    original = decode.plan
    taken = []

    def forced(*args, **kw):
        p = plan(original, *args, **kw)
        taken.append(p)
        return p

    decode.plan = forced
    try:
        api._ROUTES.clear()
        api._FAMILIES.clear()
        for _ in range(2):  # (the first call makes the route; the second compiles what the route launches)
            gluon_attn.attention(q, k, v, causal=causal)
        key = api._route_key(q, k, v, causal, None, None, None, None, False, None, "auto")
        route = api._ROUTES.get(key)
    finally:
        decode.plan = original
    assert route is not None
    return route, (taken[0] if taken else None)


def sdpa_as_hf(q, k, v, mask):
    """SDPA's step as transformers' ``sdpa_attention_forward`` makes it: without a mask, GQA inside SDPA; with one,
    the K/V heads repeated first (``repeat_kv``) and the mask passed as a tensor."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    z, h_kv, n, d = k.shape
    rep = q.shape[1] // h_kv
    k, v = (t[:, :, None].expand(z, h_kv, rep, n, d).reshape(z, h_kv * rep, n, d) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def describe(p) -> str:
    return "ordinary" if p is None else f"split {p.splits} x {p.chunk}" + (f" + tail {p.tail}" if p.tail else "")


def main():
    from gluon_attn.kernels.launch import sm_count

    print(f"# Decode steps by route ({torch.cuda.get_device_name()}): q [Z, {H}, N_Q, {D}] bf16 against {H_KV} K/V "
          f"heads, causal where N_Q > 1\n")
    print("| Z | N_Q | keys | the plan takes | its host / eager us | ordinary host / eager us | split (the plan "
          "without host costs) host / eager us | SDPA host / eager us | the plan's / SDPA's eager |")
    print("|---|---|---|---|---|---|---|---|---|")
    for z, n_q, n_kv in SHAPES:
        causal = n_q > 1
        q = torch.randn(z, H, n_q, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(z, H_KV, n_kv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ordinary, _ = route_of(q, k, v, causal, lambda orig, *a, **kw: None)
        split, split_plan = route_of(q, k, v, causal, lambda orig, *a, **kw: orig(*a, **{**kw, "host": False}))
        planned, current = route_of(q, k, v, causal, lambda orig, *a, **kw: orig(*a, **kw))
        # (the causal mask aligned bottom-right, as ours; SDPA's is_causal would align it top-left)
        mask = torch.ones(n_q, n_kv, dtype=torch.bool, device="cuda").tril(n_kv - n_q)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        for name, r in (("ordinary", ordinary), ("split", split), ("plan", planned)):
            out = r(q, k, v)
            err = (out.float() - ref.float()).abs().max().item()
            assert err < 2e-2, (name, z, n_q, n_kv, err)
        t = host_times_turns({"ordinary": lambda: ordinary(q, k, v), "split": lambda: split(q, k, v),
                              "plan": lambda: planned(q, k, v),
                              "sdpa": lambda: sdpa_as_hf(q, k, v, mask if causal else None)}, batches=9)
        cell = {n: f"{t[n]['host_us']:.1f} / {t[n]['eager_us']:.1f}" for n in t}
        print(f"| {z} | {n_q} | {n_kv} | {describe(current)} | {cell['plan']} | {cell['ordinary']} | {cell['split']} "
              f"({describe(split_plan)}) | {cell['sdpa']} | {t['plan']['eager_us'] / t['sdpa']['eager_us']:.2f} |",
              flush=True)
    print(f"\n(SMs: {sm_count(torch.device('cuda'))}; the plan's host costs in key blocks: ordinary "
          f"{decode.ORDINARY_HOST_BLOCKS}, split {decode.SPLIT_HOST_BLOCKS}, tail {decode.TAIL_HOST_BLOCKS})")


if __name__ == "__main__":
    main()
