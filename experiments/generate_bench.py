"""A real client: Hugging Face generate on a Llama-style model (random weights, nothing downloaded) with
``attn_implementation="gluon"`` against ``"sdpa"`` on the same GPU, in one process.

- decode: a prompt of PROMPT tokens, greedy NEW tokens with the KV cache (HF's dynamic cache: the key length grows by
  one every step), batch 1 and 8; tokens/s of the second generate (the first pays compiles and allocations);
- prefill: one forward over 2048 and 8192 tokens (batch 1, no cache), median of a few;
- agreement: teacher-forced, the same token sequences (SDPA's greedy output) fed through each implementation's cached
  decode step by step, the share of positions whose top-1 token agrees; free-running, the share of generated tokens
  that are equal, and the step of the first difference (random weights give near-ties: two correct kernels part after
  the first flip).

Usage (GPU): PYTHONPATH=. python3 experiments/generate_bench.py --out OUT [--layers 16 --hidden 2048 ...]
Writes OUT/generate.json and OUT/generate.md."""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

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


@torch.no_grad()
def generate(model, prompt, new: int):
    return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True)


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
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (gluon falls back to SDPA)")
    args = ap.parse_args()
    import gluon_attn.integrations.transformers as gluon_hf

    gluon_hf.register()
    model = build(args)
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
            secs = timed(lambda: outs.__setitem__(impl, generate(model, prompt, args.new)), args.repeats)
            result["decode"].setdefault(str(b), {})[impl] = {"tokens_per_s": b * args.new / min(secs),
                                                               "seconds": secs}
        r = result["decode"][str(b)]
        r["gluon/sdpa"] = r["gluon"]["tokens_per_s"] / r["sdpa"]["tokens_per_s"]
        same = outs["gluon"][:, args.prompt:] == outs["sdpa"][:, args.prompt:]
        differ = (~same).any(0).nonzero()
        picks = {}
        for impl in impls:
            model.set_attn_implementation(impl)
            picks[impl] = teacher_forced(model, outs["sdpa"], args.prompt)
        result["agreement"][str(b)] = {
            "teacher_forced_top1": (picks["gluon"] == picks["sdpa"]).float().mean().item(),
            "sdpa_reproduces_itself": (picks["sdpa"] == outs["sdpa"][:, args.prompt:]).float().mean().item(),
            "free_running_equal": same.float().mean().item(),
            "free_running_first_difference": int(differ[0]) if len(differ) else None}
    for n in map(int, args.prefill.split(",")):
        ids = torch.randint(0, args.vocab, (1, n), generator=gen).to(args.device)
        for impl in impls:
            model.set_attn_implementation(impl)
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
                secs = timed(lambda: model(input_ids=ids, use_cache=False), 5)
            result["prefill"].setdefault(str(n), {})[impl] = {"ms": statistics.median(secs) * 1e3}
        p = result["prefill"][str(n)]
        p["gluon/sdpa"] = p["sdpa"]["ms"] / p["gluon"]["ms"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "generate.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["model"]
    lines = [f"# Generate benchmark ({result['gpu']}): Llama-style, {m['layers']} layers, hidden {m['hidden']}, "
             f"{m['heads']}/{m['kv_heads']} heads, bf16, random weights; prompt {m['prompt']}, {m['new']} new tokens",
             "", "| batch | sdpa tokens/s | gluon tokens/s | gluon / sdpa | teacher-forced top-1 agreement | "
             "free-running equal (first difference) |", "|---|---|---|---|---|---|"]
    for b, r in result["decode"].items():
        a = result["agreement"][b]
        lines.append(f"| {b} | {r['sdpa']['tokens_per_s']:.1f} | {r['gluon']['tokens_per_s']:.1f} | "
                     f"{r['gluon/sdpa']:.3f} | {a['teacher_forced_top1']:.1%} | {a['free_running_equal']:.1%} "
                     f"({a['free_running_first_difference']}) |")
    lines += ["", "| prefill tokens | sdpa ms | gluon ms | gluon / sdpa (speed) |", "|---|---|---|---|"]
    for n, p in result["prefill"].items():
        lines.append(f"| {n} | {p['sdpa']['ms']:.2f} | {p['gluon']['ms']:.2f} | {p['gluon/sdpa']:.3f} |")
    (out / "generate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
