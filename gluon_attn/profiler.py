"""Profiler views: valid configurations (dry run), a search for the fastest one, a kernel-level trace.

The configuration space of each backend is enumerated here; validity comes from the kernels' own
``invalid_reasons`` (the checks their launchers apply), never from a second copy of the rules.
"""
from __future__ import annotations

import dataclasses
import re
import statistics
from pathlib import Path
from typing import Callable, Iterable, Optional

from .bench.timing import DEFAULT_WARMUP_MS
from .problem import Problem, own_v_dim

# ---------------------------------------------------------------------------------------------
# Configuration spaces
# ---------------------------------------------------------------------------------------------


SPACES = ("full", "focused")


def list_configs(problem: Problem, arch: str, include_invalid: bool = False,
                 max_configs: Optional[int] = None, space: str = "full") -> list[dict]:
    """Every configuration of the arch's backend for a problem class; invalid ones with their reason. A v head dim
    of its own (the 192/128 pair) must be one the backend pairs (else ValueError, naming them); the forward's configs
    are then the ones a dense launch of the pair takes (``hopper_host.pair_config``: PAIR_TILE's blocks)."""
    from .kernels.backend import backend_for_arch

    backend = backend_for_arch(arch)
    if space not in SPACES:
        raise ValueError(f"unknown config space {space!r}; supported: {', '.join(SPACES)}")
    v_dim = own_v_dim(problem.HEAD_DIM, problem.head_dim_v)
    if v_dim:
        why = backend.head_dim_problem(problem.HEAD_DIM, v_dim)
        if why:
            raise ValueError(why)
    rows = []
    for cfg in backend.config_space(focused=space == "focused", pass_name=problem.pass_name):
        if v_dim and not problem.backward:
            cfg = backend.module.pair_config(cfg, problem.HEAD_DIM, v_dim)
        reasons = cfg.invalid_reasons(problem.HEAD_DIM, problem.dtype, v_dim)
        if reasons and not include_invalid:
            continue
        rows.append({"backend": backend.module_name, **cfg.describe(), "valid": not reasons,
                     "reason": "; ".join(reasons), "_config": cfg})
    rows.sort(key=lambda r: not r["valid"])
    return rows[:max_configs] if max_configs else rows


def select_configs(problem: Problem, arch: str, names: Iterable[str]) -> list:
    """The valid configurations of a problem with these names (``configs``' column), in the order given; a name
    that is not one raises, naming the valid ones."""
    valid = {r["config"]: r["_config"] for r in list_configs(problem, arch)}
    names = list(names)
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"no valid {arch} configuration named {', '.join(unknown)} for {problem.label()}; "
                         f"valid: {', '.join(valid)}")
    return [valid[n] for n in names]


def current_arch() -> Optional[str]:
    import torch
    if not torch.cuda.is_available():
        return None
    from .kernels.backend import backend_for_capability

    backend = backend_for_capability(*torch.cuda.get_device_capability())
    return backend.arch if backend else None


# ---------------------------------------------------------------------------------------------
# Optimize
# ---------------------------------------------------------------------------------------------

def optimize(problem: Problem, *, max_configs: Optional[int] = None, warmup_ms: float = DEFAULT_WARMUP_MS,
             rep_ms: float = 100, progress: bool = True, configs: Optional[Iterable] = None, out_dir=None,
             install: bool = False, space: str = "focused", rounds: int = 2, only: Optional[Iterable[str]] = None) -> dict:
    """Time every valid configuration on the current GPU (accuracy gate first) and return the ranking
    (``only``: just the named ones, from the full space).
    With ``out_dir``, the winner goes into ``out_dir/<arch>.json`` (a tuning table of the same form as
    the package's, merged with what that folder holds) and the ranking into ``out_dir/optimize.csv``;
    only ``install`` writes the package's own table, which ``attention`` reads.

    Every configuration is gated first, then all are timed with ``time_rounds`` (``rounds`` passes, the
    order turning each pass) and ranked by the median of their per-pass medians: a GPU's clocks drift
    over a search (boost at the start, power limits later), which a single pass charges to whichever
    configs ran first or last."""
    import torch
    import triton
    from tqdm.auto import tqdm

    from .api import attention
    from .bench.sweep import GateReference
    from .bench.timing import time_rounds
    from .kernels import tuning
    from .problem import make_inputs
    arch = current_arch()
    if arch is None:
        from .kernels.backend import supported_text
        raise RuntimeError(f"optimize needs a CUDA GPU with a Gluon kernel ({supported_text()}); "
                           "`gluon-attn configs --arch ...` lists configurations anywhere")
    candidates = list(configs) if configs is not None else \
        [r["_config"] for r in list_configs(problem, arch, max_configs=max_configs, space=space)] if only is None \
        else select_configs(problem, arch, only)
    inputs = make_inputs(problem, "cuda")
    gate = GateReference.compute(inputs)
    fp8 = dict(descale_q=inputs.descale_q, descale_k=inputs.descale_k, descale_v=inputs.descale_v) \
        if problem.is_fp8 else {}
    if problem.backward:
        # The backward kernel's configs: its call alone (fwd+bwd ranks them the same way), after one forward.
        from .api import backward, forward
        out, lse = forward(inputs.q, inputs.k, inputs.v, causal=problem.causal, return_lse=True)
    results, fns, rows = [], {}, {}
    for i, cfg in enumerate(tqdm(candidates, desc=f"gate {problem.label()}", disable=not progress)):
        if problem.backward:
            def fn(cfg=cfg):
                return backward(inputs.do, inputs.q, inputs.k, inputs.v, out, lse, causal=problem.causal, config=cfg)
        else:
            def fn(cfg=cfg):
                return attention(inputs.q, inputs.k, inputs.v, causal=problem.causal, config=cfg, **fp8)
        row = {**cfg.describe(), "_config": cfg}
        try:
            acc = gate.check(fn(), 1.0, problem.dtype, None)
        except torch.cuda.OutOfMemoryError as exc:
            results.append({**row, "status": "oom", "message": str(exc).splitlines()[0][:200]})
            torch.cuda.empty_cache()
            continue
        except Exception as exc:  # a config that fails to compile or launch is recorded, the search goes on
            results.append({**row, "status": "error", "message": _error_text(exc)})
            continue
        if not acc.ok:
            results.append({**row, "status": "wrong", "message": acc.message})
            continue
        fns[i], rows[i] = fn, row
    timed, failed = time_rounds(fns, rounds=rounds, warmup_ms=warmup_ms, rep_ms=rep_ms)
    for i, exc in failed.items():
        results.append({**rows[i], "status": "error", "message": _error_text(exc)})
    for i, t in timed.items():
        p50 = t.median()
        results.append({**rows[i], "status": "ok", "p50_ms": p50, "p20_ms": t.median("p20_ms"),
                        "p80_ms": t.median("p80_ms"), "tflops": problem.tflops(p50), "rounds": len(t.timings),
                        "spread": t.spread})
    ok = sorted((r for r in results if r["status"] == "ok"), key=lambda r: r["p50_ms"])
    summary = {"arch": arch, "results": ok + [r for r in results if r["status"] != "ok"], "best": None}
    if ok:
        best = ok[0]
        tf = [r["tflops"] for r in ok]
        summary.update(best=best, spread={"best_tflops": max(tf), "median_tflops": statistics.median(tf),
                                          "worst_tflops": min(tf), "valid": len(ok), "tried": len(results)})
        fields = dataclasses.asdict(best["_config"])
        measured = {"problem": problem.label(), "tflops": round(best["tflops"], 1), "p50_ms": best["p50_ms"],
                    "gpu": torch.cuda.get_device_name(), "configs_timed": len(ok), "triton": triton.__version__}

        def record(directory):
            return str(tuning.save(arch, problem.HEAD_DIM, problem.dtype, problem.causal, fields, measured,
                                   n_ctx=problem.N_CTX, directory=directory,
                                   pass_name="fwd" if not problem.backward else "bwd"))

        if out_dir is not None:
            summary["table"] = record(Path(out_dir))
        if install:
            summary["installed"] = record(None)
            _clear_config_caches()
    if out_dir is not None:
        _write_ranking(summary["results"], Path(out_dir) / "optimize.csv")
    return summary


def _write_ranking(results: list[dict], path: Path) -> None:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([{k: v for k, v in r.items() if not k.startswith("_")} for r in results]).to_csv(path, index=False)


def _error_text(exc: Exception) -> str:
    """A failed config's message: exception type and the first line of its text."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def _clear_config_caches():
    from .kernels.backend import BACKENDS
    for backend in BACKENDS.values():
        backend.clear_caches()


# ---------------------------------------------------------------------------------------------
# Kernel trace
# ---------------------------------------------------------------------------------------------

# (pattern, framework, readable operation); first match wins. Our kernels are matched by exact
# symbol before these.
KERNEL_NAMES: list[tuple[str, str, str]] = [
    (r"cudnn|fmha.*sm9|sdpa.*cudnn|cutlass.*fmha", "cuDNN", "SDPA (cuDNN fused attention)"),
    (r"flash_bwd", "FlashAttention-2", "attention backward (SDPA flash)"),
    (r"flash_fwd|flash::|pytorch_flash", "FlashAttention-2", "attention forward (SDPA flash)"),
    (r"triton_tem_fused|flex_attention", "Triton (FlexAttention)", "flex attention forward"),
    (r"^triton_", "Triton (torch.compile)", "fused pointwise/reduction"),
    (r"elementwise_kernel|vectorized_elementwise", "PyTorch", "elementwise"),
    (r"reduce_kernel", "PyTorch", "reduction"),
    (r"transpose|copy_kernel|CatArrayBatchedCopy", "PyTorch", "copy / transpose"),
    (r"fill|zero", "PyTorch", "fill"),
]
FILTERED = re.compile(r"memcpy|memset|synchroniz|cudaEvent|Memcpy|Memset", re.IGNORECASE)
OUR_KERNELS = ("gluon_attention", "cutlass_gluon_attention", "gluon_attention_bwd", "cutlass_gluon_attention_bwd",
               "_bwd_preprocess")


def classify(name: str, our_names: Iterable[str] = OUR_KERNELS, arch: str = "") -> tuple[str, str]:
    if name in set(our_names):
        if name == "_bwd_preprocess":
            return "gluon-attn", "backward preprocess (delta = rowsum(dO O))"
        what = "backward" if name.endswith("_bwd") else "forward"
        return "gluon-attn", f"attention {what} ({arch or 'Gluon'})"
    for pattern, framework, operation in KERNEL_NAMES:
        if re.search(pattern, name, re.IGNORECASE):
            return framework, operation
    return "other", name[:60]


def kernel_table(events: list[dict], our_names: Iterable[str] = OUR_KERNELS, arch: str = "") -> list[dict]:
    """Device kernels of a trace as rows (framework, arch, operation, kernel, calls, time): our kernels
    first, then by total time; copies, fills of memcpy kind and synchronisation left out.
    ``events``: dicts with name, count, device_time_us (device-side kernel events only)."""
    ours = set(our_names)
    rows = []
    for ev in events:
        name = ev["name"]
        if FILTERED.search(name) or ev.get("device_time_us", 0) <= 0:
            continue
        framework, operation = classify(name, ours, arch)
        rows.append({"framework": framework, "arch": arch, "operation": operation, "kernel": name[:80],
                     "calls": int(ev["count"]), "time_us": round(float(ev["device_time_us"]), 1),
                     "avg_us": round(float(ev["device_time_us"]) / max(1, int(ev["count"])), 1)})
    rows.sort(key=lambda r: (r["framework"] != "gluon-attn", -r["time_us"]))
    return rows


def record_events(fn: Callable[[], object], iters: int = 10) -> list[dict]:
    """Run ``fn`` under torch.profiler; device kernel events as plain dicts (name, count, device_time_us)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = []
    for ev in prof.key_averages():
        device_us = getattr(ev, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(ev, "self_cuda_time_total", 0)
        if getattr(ev, "device_type", None) is not None and "CUDA" not in str(ev.device_type):
            continue
        if device_us and device_us > 0:
            events.append({"name": ev.key, "count": int(ev.count), "device_time_us": float(device_us)})
    return events


def profile_problem(problem: Problem, provider: str, iters: int = 10) -> tuple[list[dict], list[dict]]:
    """(raw events, table rows) for one provider on one problem."""
    from .bench.providers import get_provider
    from .problem import make_inputs

    prov = get_provider(provider)
    inputs = make_inputs(problem, "cuda")
    with prov.context():
        events = record_events(prov.prepare(inputs), iters)
    arch = current_arch() or ""
    return events, kernel_table(events, OUR_KERNELS, arch)
