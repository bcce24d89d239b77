"""A real client: Hugging Face generate on a Llama-style model (random weights, nothing downloaded) with
``attn_implementation="gluon"`` against ``"sdpa"`` on the same GPU, in one process.

- decode: a prompt of PROMPT tokens, greedy NEW tokens with the KV cache (HF's dynamic cache: the key length grows by
  one every step), batch 1 and 8; after a warm-up generate of each (compiles, allocations), REPEATS timed generates
  of each, the two implementations taking turns (the order turning each round); tokens/s of the fastest (and the
  median's in generate.json);
- prefill: one forward over 2048 and 8192 tokens (batch 1, no cache), median of 5 interleaved turns;
- agreement: teacher-forced, the same token sequences (SDPA's greedy output) fed through each implementation's cached
  decode step by step, the share of positions whose top-1 token agrees; beside it the same share between SDPA's flash
  and memory-efficient backends (two correct kernels: the near-tie floor of random weights) and each implementation's
  share against attention computed in fp32; free-running, the share of generated tokens that are equal, and the step
  of the first difference (random weights give near-ties: two correct kernels part after the first flip).

Usage (GPU): PYTHONPATH=. python3 experiments/generate_bench.py --out OUT [--layers 16 --hidden 2048 ...]
Writes OUT/generate.json and OUT/generate.md. ``--profile B[,B...]``: instead, where a generate step's time goes at
each batch (``profile``): OUT/profile.md."""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (the default the peers' compiles get, named: no warning)


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=16384, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(device=args.device, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def register_fp32_attention(name: str = "fp32-attention") -> None:
    """An attention implementation that computes in fp32 (SDPA on fp32 copies, the output cast back): the arbiter of
    the agreement figures (the rest of the model stays in bf16)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def fp32_attention(module, query, key, value, attention_mask, **kwargs):
        out, _ = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
        return out.to(query.dtype), None

    AttentionInterface.register(name, fp32_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def in_turns(model, impls: tuple, turns: int, run) -> dict:
    """``run(impl)`` timed ``turns`` times for each attention implementation, the implementations taking turns and
    the order turning each round: a host that drifts within the run (clocks, other load) moves both implementations'
    samples alike instead of one implementation's block of them. Seconds per call, by implementation."""
    secs = {impl: [] for impl in impls}
    for turn in range(turns):
        for impl in impls if turn % 2 == 0 else impls[::-1]:
            model.set_attn_implementation(impl)
            secs[impl] += timed(lambda: run(impl), 1)
    return secs


@torch.no_grad()
def generate(model, prompt, new: int):
    return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True)


class _Alternate:
    """A logits processor that times each decode step (from the end of one step's forward to the end of the next's,
    the GPU synchronised at both) and switches the attention implementation for the next step: one generate then
    times both implementations token by token, so that a slow spell of the host falls on both alike."""

    def __init__(self, model, impls: tuple):
        self.model, self.impls, self.turn = model, impls, 0
        self.steps = {impl: [] for impl in impls}
        self.last = None

    def __call__(self, input_ids, scores):
        _sync()
        now = time.perf_counter()
        if self.last is not None:
            self.steps[self.impls[self.turn]].append(now - self.last)
        self.turn = 1 - self.turn
        self.model.set_attn_implementation(self.impls[self.turn])
        self.last = time.perf_counter()
        return scores


@torch.no_grad()
def alternating(model, prompt, new: int, impls: tuple, generates: int = 2) -> dict:
    """Seconds per decode step of each implementation, the implementations taking turns step by step in ``generates``
    generates (the first implementation alternating between them): implementation -> list of step times."""
    from transformers import LogitsProcessorList

    steps = {impl: [] for impl in impls}
    for g in range(generates):
        order = impls if g % 2 == 0 else impls[::-1]
        model.set_attn_implementation(order[0])
        # (the processor switches before each step: the prefill runs order[0], the first timed step order[1])
        proc = _Alternate(model, order)
        model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True,
                       logits_processor=LogitsProcessorList([proc]))
        for impl in impls:
            steps[impl] += proc.steps[impl]
    return steps


@torch.no_grad()
def teacher_forced(model, seq, prompt_len: int) -> torch.Tensor:
    """Top-1 tokens at each generated position of ``seq`` [B, T], fed one step at a time through the cache."""
    out = model(input_ids=seq[:, :prompt_len], use_cache=True)
    past, picks = out.past_key_values, [out.logits[:, -1].argmax(-1)]
    for t in range(prompt_len, seq.shape[1] - 1):
        out = model(input_ids=seq[:, t:t + 1], past_key_values=past, use_cache=True)
        past = out.past_key_values
        picks.append(out.logits[:, -1].argmax(-1))
    return torch.stack(picks, 1)


def profile(model, args, batch: int) -> str:
    """Where a generate step's time goes at ``batch``, for each implementation: wall time of a generate of 32 new
    tokens (after one of the same lengths), the time spent inside its attention function (transformers' call of it,
    wrapper included; SDPA's too) and outside it, in Python's garbage collector during it, the calls that missed a
    route (validated and planned again), the same with the collector off; then cProfile's top host functions;
    torch.profiler's GPU kernels last (CUPTI, once started, slows every later launch)."""
    import cProfile
    import gc
    import io
    import pstats

    import gluon_attn.integrations.transformers as gluon_hf
    from gluon_attn import validation

    prompt = torch.randint(1, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(args.device)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    spent = {"attn": 0.0, "gc": 0.0, "misses": 0, "calls": 0}
    inner = {"gluon": gluon_hf.gluon_attention_forward, "sdpa": sdpa_attention_forward}

    def timer(fn):
        def timed_attention(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent["attn"] += time.perf_counter() - t0
                spent["calls"] += 1
        return timed_attention

    check = validation.check_qkv

    def counted_check(*a, **kw):
        spent["misses"] += 1
        return check(*a, **kw)

    gc_start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            spent["gc"] += time.perf_counter() - gc_start[0]

    from transformers import AttentionInterface
    for name, fn in inner.items():
        AttentionInterface.register(name, timer(fn))
    import gluon_attn.api as api_module
    api_module.check_qkv = counted_check
    gc.callbacks.append(on_gc)
    lines = ["| impl | gc | ms for 32 tokens | in attention ms (us a call) | outside it ms | gc ms | route misses |",
             "|---|---|---|---|---|---|---|"]
    try:
        for collector in ("on", "off"):
            for impl in ("gluon", "sdpa", "gluon"):
                model.set_attn_implementation(impl)
                generate(model, prompt, 32)
                if collector == "off":
                    gc.collect()
                    gc.disable()
                spent.update(attn=0.0, gc=0.0, misses=0, calls=0)
                secs = timed(lambda: generate(model, prompt, 32), 1)[0]
                gc.enable()
                per_call = spent["attn"] / max(spent["calls"], 1) * 1e6
                lines.append(f"| {impl} | {collector} | {secs * 1e3:.1f} | {spent['attn'] * 1e3:.1f} ({per_call:.1f}) "
                             f"| {(secs - spent['attn']) * 1e3:.1f} | {spent['gc'] * 1e3:.1f} | {spent['misses']} |")
    finally:
        gc.callbacks.remove(on_gc)
        api_module.check_qkv = check
        for name, fn in inner.items():
            AttentionInterface.register(name, fn)
    parts = [f"## batch {batch}\n\n" + "\n".join(lines)]
    for impl in ("sdpa", "gluon"):
        model.set_attn_implementation(impl)
        generate(model, prompt, 32)
        pr = cProfile.Profile()
        pr.enable()
        generate(model, prompt, 32)
        _sync()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        parts.append(f"## {impl}, batch {batch}: cProfile\n\n```\n{s.getvalue()}```")
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    for impl in ("sdpa", "gluon"):
        model.set_attn_implementation(impl)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate(model, prompt, 8)
            _sync()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60)
        parts.append(f"### {impl}: GPU time by kernel (8 tokens, torch.profiler)\n\n```\n{table}\n```")
    return "\n\n".join(parts) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--repeats", type=int, default=4, help="timed generates per implementation, interleaved")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (gluon falls back to SDPA)")
    ap.add_argument("--profile", default="", metavar="BATCHES", help="profile generate steps at these batches (1,8)")
    args = ap.parse_args()
    import gluon_attn.integrations.transformers as gluon_hf

    gluon_hf.register()
    register_fp32_attention()
    model = build(args)
    if args.profile:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.md").write_text("\n".join(profile(model, args, int(b)) for b in args.profile.split(",")))
        return
    impls = ("sdpa", "gluon")
    result = {"model": {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads",
                                                      "vocab", "prompt", "new")},
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "decode": {}, "prefill": {}, "agreement": {}}
    gen = torch.Generator(device="cpu").manual_seed(1)
    for b in map(int, args.batches.split(",")):
        prompt = torch.randint(0, args.vocab, (b, args.prompt), generator=gen).to(args.device)
        outs = {}
        for impl in impls:
            model.set_attn_implementation(impl)
            generate(model, prompt, args.new)  # warm-up: compiles, allocations

        def run(impl):
            outs[impl] = generate(model, prompt, args.new)

        secs = in_turns(model, impls, args.repeats, run)
        for impl in impls:
            result["decode"].setdefault(str(b), {})[impl] = {
                "tokens_per_s": b * args.new / min(secs[impl]),
                "tokens_per_s_median": b * args.new / statistics.median(secs[impl]), "seconds": secs[impl]}
        r = result["decode"][str(b)]
        r["gluon/sdpa"] = r["gluon"]["tokens_per_s"] / r["sdpa"]["tokens_per_s"]
        r["gluon/sdpa_median"] = r["gluon"]["tokens_per_s_median"] / r["sdpa"]["tokens_per_s_median"]
        steps = alternating(model, prompt, args.new, impls)
        r["alternating"] = {impl: {"step_ms_median": statistics.median(steps[impl]) * 1e3, "steps": len(steps[impl])}
                            for impl in impls}
        r["alternating"]["gluon/sdpa"] = (r["alternating"]["sdpa"]["step_ms_median"]
                                          / r["alternating"]["gluon"]["step_ms_median"])
        same = outs["gluon"][:, args.prompt:] == outs["sdpa"][:, args.prompt:]
        differ = (~same).any(0).nonzero()
        picks = {}
        for impl in (*impls, "fp32-attention"):
            model.set_attn_implementation(impl)
            picks[impl] = teacher_forced(model, outs["sdpa"], args.prompt)
        model.set_attn_implementation("sdpa")
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):  # (the CPU dry run: math)
            picks["sdpa-efficient"] = teacher_forced(model, outs["sdpa"], args.prompt)
        agree = lambda a, b: (picks[a] == picks[b]).float().mean().item()  # noqa: E731
        result["agreement"][str(b)] = {
            "teacher_forced_top1": agree("gluon", "sdpa"),
            # the floor between two correct kernels: SDPA's own flash and memory-efficient backends
            "sdpa_efficient_vs_sdpa": agree("sdpa-efficient", "sdpa"),
            # against attention in fp32 (the rest of the model as it is): which kernel is the closer
            "gluon_vs_fp32_attention": agree("gluon", "fp32-attention"),
            "sdpa_vs_fp32_attention": agree("sdpa", "fp32-attention"),
            "sdpa_reproduces_itself": (picks["sdpa"] == outs["sdpa"][:, args.prompt:]).float().mean().item(),
            "free_running_equal": same.float().mean().item(),
            "free_running_first_difference": int(differ[0]) if len(differ) else None}
    for n in [int(x) for x in args.prefill.split(",") if x]:  # (--prefill "": none)
        ids = torch.randint(0, args.vocab, (1, n), generator=gen).to(args.device)
        with torch.no_grad():
            for impl in impls:
                model.set_attn_implementation(impl)
                model(input_ids=ids, use_cache=False)
            secs = in_turns(model, impls, 5, lambda impl: model(input_ids=ids, use_cache=False))
        for impl in impls:
            result["prefill"].setdefault(str(n), {})[impl] = {"ms": statistics.median(secs[impl]) * 1e3}
        p = result["prefill"][str(n)]
        p["gluon/sdpa"] = p["sdpa"]["ms"] / p["gluon"]["ms"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "generate.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["model"]
    lines = [f"# Generate benchmark ({result['gpu']}): Llama-style, {m['layers']} layers, hidden {m['hidden']}, "
             f"{m['heads']}/{m['kv_heads']} heads, bf16, random weights; prompt {m['prompt']}, {m['new']} new tokens",
             "", "| batch | sdpa tokens/s | gluon tokens/s | gluon / sdpa | (medians) | "
             "teacher-forced top-1 agreement | "
             "SDPA efficient / flash | gluon / fp32 attention | SDPA / fp32 attention | "
             "free-running equal (first difference) |", "|---|---|---|---|---|---|---|---|---|---|"]
    alt = ["", "Alternating steps (two generates, the implementation switched at every token; median step time):", "",
           "| batch | sdpa ms a step | gluon ms a step | gluon / sdpa (speed) | steps each |", "|---|---|---|---|---|"]
    for b, r in result["decode"].items():
        a = result["agreement"][b]
        lines.append(f"| {b} | {r['sdpa']['tokens_per_s']:.1f} | {r['gluon']['tokens_per_s']:.1f} | "
                     f"{r['gluon/sdpa']:.3f} | {r['gluon/sdpa_median']:.3f} | {a['teacher_forced_top1']:.1%} | "
                     f"{a['sdpa_efficient_vs_sdpa']:.1%} | "
                     f"{a['gluon_vs_fp32_attention']:.1%} | {a['sdpa_vs_fp32_attention']:.1%} | "
                     f"{a['free_running_equal']:.1%} ({a['free_running_first_difference']}) |")
        t = r["alternating"]
        alt.append(f"| {b} | {t['sdpa']['step_ms_median']:.2f} | {t['gluon']['step_ms_median']:.2f} | "
                   f"{t['gluon/sdpa']:.3f} | {t['gluon']['steps']} |")
    lines += alt
    lines += ["", "| prefill tokens | sdpa ms | gluon ms | gluon / sdpa (speed) |", "|---|---|---|---|"]
    for n, p in result["prefill"].items():
        lines.append(f"| {n} | {p['sdpa']['ms']:.2f} | {p['gluon']['ms']:.2f} | {p['gluon/sdpa']:.3f} |")
    (out / "generate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
