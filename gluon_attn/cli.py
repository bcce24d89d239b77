"""gluon-attn: benchmark, inspect and compare persistent warp-specialized Gluon attention kernels."""
from __future__ import annotations

import json
import os
import math
import sys
from typing import Optional

import click
from click.core import ParameterSource

from .bench.timing import DEFAULT_WARMUP_MS as WARMUP_MS, TIMINGS, timing_without_gpu
from .kernels.backend import BACKENDS
from .problem import DTYPES, PASSES, VARLEN_MIXES

WARMUP_HELP = ("Warm-up per timed turn: long enough for the GPU's clock to settle on this kernel's own "
               "power draw (at the power limit a turn first runs at the clock the previous kernel left).")


def _int_list(ctx, param, value):
    if value is None:
        return None
    items = [v.strip() for v in str(value).split(",") if v.strip()]
    try:
        nums = tuple(int(v) for v in items)
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not nums:
        raise click.BadParameter("expected at least one value")
    return nums


def _str_list(ctx, param, value):
    if value is None:
        return None
    items = tuple(v.strip() for v in str(value).split(",") if v.strip())
    if not items:
        raise click.BadParameter("expected at least one value")
    return items


def _dtype_list(ctx, param, value):
    items = _str_list(ctx, param, value)
    if items is None:
        return None
    bad = [d for d in items if d not in DTYPES]
    if bad:
        raise click.BadParameter(f"unknown dtype(s) {', '.join(bad)}; supported: {', '.join(DTYPES)}")
    return items


CAUSAL = {"false": (False,), "true": (True,), "both": (False, True)}


def _config_value(text: str):
    """A --config value: an integer, a boolean (true/false, any case), else the text itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Benchmark, inspect and compare persistent warp-specialized Gluon attention kernels."""
    # Our kernels ask for FP fusion themselves (toolchain.COMPILE_OPTIONS); the peers' compiles (torch.compile's
    # Triton kernels for Flex) ask nothing, and Triton 3.9 warns on each that its default changes in 3.10: name the
    # default they already get.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def _explicit(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE


@main.command()
@click.option("--n-ctx", callback=_int_list, default="1024,2048,4096,8192,16384,32768", show_default=True,
              help="Context lengths, comma-separated (up to 65536).")
@click.option("--head-dim", callback=_int_list, default="64,128", show_default=True, help="Head dims.")
@click.option("--head-dim-v", "head_dims_v", callback=_int_list, default=None,
              help="v's head dims, comma-separated, an axis crossed with --head-dim (e.g. --head-dim 192 "
                   "--head-dim-v 128: DeepSeek-V3's; 0: the same as q's, the default).")
@click.option("--causal", type=click.Choice(list(CAUSAL)), default="both", show_default=True)
@click.option("--dtype", "dtypes", callback=_dtype_list, default="fp16", show_default=True,
              help=f"Input dtypes: {', '.join(DTYPES)}.")
@click.option("-Z", "--batch", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("-H", "--heads", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--kv-heads", callback=_int_list, default=None,
              help="K/V heads, comma-separated (GQA/MQA; each must divide --heads; default: as many as --heads).")
@click.option("--n-kv", callback=_int_list, default=None,
              help="Keys per head, comma-separated (default: N_CTX). With fewer queries than keys this is decode "
                   "or chunked prefill; causal is aligned bottom-right.")
@click.option("--varlen", "varlen", callback=_str_list, default=None,
              help=f"Packed batches of a named length mix ({', '.join(VARLEN_MIXES)}; README): N_CTX is then the "
                   f"tokens in all, Z = 1.")
@click.option("--pass", "passes", callback=_str_list, default=None,
              help="Passes to time, comma-separated: fwd, bwd (the backward alone; FLOPs 2.5x the forward's), "
                   "fwd+bwd (3.5x). Default: fwd.")
@click.option("--providers", callback=_str_list, default=None,
              help="Providers, comma-separated (default: every GPU provider).")
@click.option("--warmup-ms", type=click.FloatRange(min=0, min_open=True), default=WARMUP_MS, show_default=True,
              help=WARMUP_HELP)
@click.option("--rep-ms", type=click.FloatRange(min=0, min_open=True), default=100.0, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Timing rounds per cell, providers interleaved; rows keep the medians.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results/sweep", show_default=True)
@click.option("--resume", is_flag=True, help="Continue a sweep in --out, skipping recorded cells.")
@click.option("--experiment", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read the grid from a spec in experiments/ (options given explicitly win).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--shard", default=None, metavar="I/N",
              help="Run only shard I of N (every N-th group of problems differing only in N_CTX, from the I-th; "
                   "for Slurm arrays and the like: `gluon-attn merge` combines the shards' folders).")
@click.option("--gpus", default=None, metavar="N|all",
              help="Spread the problems over this many of the host's GPUs (or all): a worker process per GPU, "
                   "its folder in --out/gpu-<index>, the rows merged into --out with a gpu_index column.")
@click.option("--gpu-index", type=int, default=None, hidden=True)
@click.option("--cp", "cp_ranks", type=click.IntRange(min=2), default=None, metavar="N",
              help="Context parallelism: each cell as ring attention over N GPUs of this host (per-GPU TFLOPS, the "
                   "ratio to one GPU at N_CTX/N, checked against one GPU's result); without CUDA, N CPU processes.")
@click.option("--na", is_flag=True,
              help="Neighborhood attention problems in NATTEN's vocabulary (--token-layout, --window, --stride, "
                   "--dilation, --causal-dims; ';' between values of an axis, e.g. --window '2048;256'), each "
                   "provider beside dense attention over the same tokens: rows.csv's speedup_vs_dense. Providers: "
                   "gluon (na1d-na3d), flex, fa4, math; dense-<any sweep provider> (dense-gluon, dense-cudnn, dense-fa4, ...).")
@click.option("--token-layout", default=None, metavar="L[xL[xL]]", help="--na: token layouts.")
@click.option("--window", default=None, metavar="K[xK[xK]]", help="--na: kernel sizes.")
@click.option("--stride", "na_stride", default="1", show_default=True, help="--na: strides.")
@click.option("--dilation", "na_dilation", default="1", show_default=True, help="--na: dilations.")
@click.option("--causal-dims", default="0", show_default=True, metavar="0|1[x...]",
              help="--na: causal per dimension (1: causal).")
@click.option("--timing", type=click.Choice(TIMINGS), default="eager", show_default=True,
              help="eager times each call as made (the host's work counts where it outlasts the GPU's); "
                   "graph times it captured in a CUDA graph (the GPU's time of everything it launches, the "
                   "replay's launch included); kernel sums the durations of the kernels it launches as the "
                   "profiler records them (as NATTEN's profiler reports kernels: no launch latency or gaps). L2 "
                   "is flushed before every timed call in each mode. Every row also records host_us and eager_us: "
                   "calls back to back from an idle queue, the time to issue one and to finish it.")
@click.pass_context
def sweep(ctx, n_ctx, head_dim, head_dims_v, causal, dtypes, batch, heads, kv_heads, n_kv, varlen, passes, providers,
          warmup_ms, rep_ms, rounds, out_dir, resume, experiment, quiet, shard, gpus, gpu_index, cp_ranks, na,
          token_layout, window, na_stride, na_dilation, causal_dims, timing):
    """Sweep a grid of problems over providers: accuracy gate, then TFLOPS tables and plots."""
    import torch

    if na:
        others = [name for name, given in (("--gpus", gpus), ("--shard", shard), ("--cp", cp_ranks),
                                            ("--experiment", experiment), ("--varlen", varlen), ("--n-kv", n_kv),
                                            ("--head-dim-v", head_dims_v)) if given]
        if others:
            raise click.UsageError(f"--na takes its problems from --token-layout, --window, --stride, --dilation and "
                                   f"--causal-dims (one GPU): not with {', '.join(others)}")
        _na_sweep(token_layout, window, na_stride, na_dilation, causal_dims, batch, heads, kv_heads, head_dim, dtypes,
                  providers, rounds, warmup_ms, rep_ms, out_dir, resume, timing, passes or ("fwd",))
        return

    why = timing_without_gpu(timing)
    if why:
        raise click.UsageError(why)
    from .bench.providers import default_providers, get_provider
    from .bench.sweep import OutDirError, SweepSpec, parse_shard, run_sweep

    given = {
        "n_ctx": ("n_ctx", n_ctx), "head_dims": ("head_dim", head_dim), "causal": ("causal", CAUSAL[causal]),
        "dtypes": ("dtypes", dtypes), "batch": ("batch", batch), "heads": ("heads", heads),
        "providers": ("providers", providers), "warmup_ms": ("warmup_ms", warmup_ms),
        "rep_ms": ("rep_ms", rep_ms), "rounds": ("rounds", rounds), "kv_heads": ("kv_heads", kv_heads),
        "n_kv": ("n_kv", n_kv), "varlen": ("varlen", varlen), "passes": ("passes", passes),
        "cp_ranks": ("cp_ranks", cp_ranks), "timing": ("timing", timing),
        "head_dims_v": ("head_dims_v", tuple(dv or None for dv in head_dims_v) if head_dims_v else None),
    }
    try:
        if experiment:
            overrides = {k: v for k, (opt, v) in given.items() if _explicit(ctx, opt) and v is not None}
            spec = SweepSpec.from_file(experiment, **overrides)
        else:
            values = {k: v for k, (opt, v) in given.items() if v is not None}
            values.setdefault("providers", tuple(default_providers()))
            spec = SweepSpec(**values)
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc)) from None

    try:
        shard = parse_shard(shard) if shard else None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if cp_ranks is not None:
        if gpus is not None or shard:
            raise click.UsageError("--cp runs each cell on several GPUs at once: not with --gpus or --shard")
        if torch.cuda.is_available() and cp_ranks > torch.cuda.device_count():
            raise click.UsageError(f"--cp {cp_ranks}: this host has {torch.cuda.device_count()} GPUs")
        from .bench.context_parallel import run_cp_sweep
        try:
            out = run_cp_sweep(spec, out_dir, cp_ranks, resume=resume)
        except OutDirError as exc:
            raise click.UsageError(str(exc)) from None
        click.echo((out / "tables.md").read_text() if (out / "tables.md").exists() else "no rows")
        click.echo(f"results in {out}: rows.csv (ring-cp{cp_ranks}: TFLOPS per GPU, vs_single_gpu), env.json")
        return
    if gpus is not None:
        if shard:
            raise click.UsageError("--gpus spreads the whole sweep over the GPUs; --shard is for one worker of it")
        available = torch.cuda.device_count()
        count = available if gpus == "all" else int(gpus) if gpus.isdigit() else 0
        if count < 1 or count > available:
            raise click.UsageError(f"--gpus takes a number from 1 to the GPUs visible ({available}) or 'all'; "
                                   f"got {gpus!r}")
        from .bench.parallel import run_on_gpus
        try:
            out = run_on_gpus(_worker_args(sys.argv), out_dir, list(range(count)), total=spec.n_cells,
                              resume=resume, progress=not quiet)
        except RuntimeError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        click.echo((out / "tables.md").read_text() if (out / "tables.md").exists() else "no rows")
        click.echo(f"results in {out}: rows.csv (gpu_index per row), env.json, tables.md; each GPU's own in "
                   f"{out}/gpu-<index>")
        return
    needs_gpu = [p for p in spec.providers if get_provider(p).needs_cuda]
    if needs_gpu and not torch.cuda.is_available():
        click.echo(f"error: providers {', '.join(needs_gpu)} need a CUDA GPU and none is visible; "
                   f"`gluon-attn inspect` works anywhere, and `--providers math` runs on CPU.", err=True)
        sys.exit(2)
    try:
        out = run_sweep(spec, out_dir, resume=resume, command_line=sys.argv, progress=not quiet, shard=shard,
                        gpu_index=gpu_index)
    except OutDirError as exc:
        raise click.UsageError(str(exc)) from None
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted: rows so far are in {out_dir}/rows.csv; rerun with --resume to continue",
                   err=True)
        sys.exit(130)
    click.echo((out / "tables.md").read_text() if (out / "tables.md").exists() else "no rows")
    click.echo(f"results in {out}: rows.csv, env.json, tables.md, tflops.png")


def _na_sweep(token_layout, window, stride, dilation, causal_dims, batch, heads, kv_heads, head_dims, dtypes,
              providers, rounds, warmup_ms, rep_ms, out_dir, resume, timing, passes):
    import torch

    from .bench.neighborhood import na_problems, parse_dims_list, run_na_sweep
    from .bench.sweep import OutDirError

    if token_layout is None or window is None:
        raise click.UsageError("--na needs --token-layout and --window")
    if providers is None:
        providers = (("gluon", "flex", "fa4", "dense-gluon", "dense-cudnn", "dense-fa4") if torch.cuda.is_available()
                     else ("math", "dense-math"))
    try:
        causal = [tuple(bool(c) for c in dims) for dims in parse_dims_list(causal_dims, "--causal-dims")]
        problems = na_problems(parse_dims_list(token_layout, "--token-layout"), parse_dims_list(window, "--window"),
                               parse_dims_list(stride, "--stride"), parse_dims_list(dilation, "--dilation"), causal,
                               batch=batch, heads=heads, kv_heads=(kv_heads or (None,))[0], head_dims=head_dims,
                               dtypes=dtypes, passes=tuple(passes))
        out = run_na_sweep(problems, providers, out_dir, rounds=rounds, warmup_ms=warmup_ms, rep_ms=rep_ms,
                           resume=resume, command_line=sys.argv, timing=timing)
    except (ValueError, OutDirError) as exc:
        raise click.UsageError(str(exc)) from None
    click.echo((out / "tables.md").read_text())
    click.echo(f"results in {out}: rows.csv (TFLOPS on the attended pairs, speedup_vs_dense), env.json, tables.md")


def _worker_args(argv: list[str]) -> list[str]:
    """A ``sweep`` command line's arguments for its workers: without --gpus, --out, --resume, --quiet (each worker
    gets its own)."""
    args = argv[argv.index("sweep") + 1:] if "sweep" in argv else argv[1:]
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--gpus", "--out", "--shard", "--gpu-index"):
            skip = "=" not in a
            continue
        if a in ("--resume", "--quiet"):
            continue
        kept.append(a)
    return kept


@main.command("merge")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.argument("dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
def merge_cmd(out_dir, dirs):
    """Merge sweeps' results folders (shards, GPUs) into OUT_DIR: one rows.csv, env.json listing each folder's
    environment, tables and plots."""
    from .bench.sweep import OutDirError, merge_sweeps

    try:
        out = merge_sweeps(out_dir, dirs)
    except OutDirError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo((out / "tables.md").read_text() if (out / "tables.md").exists() else "no rows")
    click.echo(f"merged {len(dirs)} folders into {out}")


@main.command("inspect")
@click.option("--kernel", default="attention", show_default=True, help="Kernel kind to compile.")
@click.option("--arch", type=click.Choice(list(BACKENDS)), default=next(iter(BACKENDS)), show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="fp16", show_default=True)
@click.option("--head-dim", type=int, default=128, show_default=True)
@click.option("--head-dim-v", type=int, default=None,
              help="v's head dim where it differs from q's (the 192/128 pair: --head-dim 192 --head-dim-v 128).")
@click.option("--causal/--no-causal", default=False, show_default=True)
@click.option("--varlen", is_flag=True, help="The packed-batch build (attention_varlen; fp16/bf16).")
@click.option("--pass", "pass_name", type=click.Choice(["fwd", "bwd"]), default="fwd", show_default=True,
              help="The forward kernel, or the backward's (sm_90a; --kernel attention).")
@click.option("--kernel-name", default="auto", show_default=True,
              help="auto (cutlass_ for fp8, as attention() does) | plain | cutlass | a literal symbol name.")
@click.option("--config", "config_items", multiple=True, metavar="KEY=VALUE",
              help="Kernel config override, e.g. --config BLOCK_N=128 (repeatable).")
@click.option("--dump", "dump_dir", type=click.Path(file_okay=False), default=None,
              help="Write PTX, TTGIR, cubin and SASS here.")
@click.option("--top", type=int, default=25, show_default=True, help="Histogram rows to show.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect_cmd(kernel, arch, dtype, head_dim, head_dim_v, causal, varlen, pass_name, kernel_name, config_items,
                dump_dir, top, as_json):
    """Compile a Gluon kernel for a target without a GPU and report its resources and SASS mix."""
    from .inspection import BuildRequest, dump, inspect_kernel

    config = {}
    for item in config_items:
        if "=" not in item:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--config")
        key, value = item.split("=", 1)
        config[key.strip()] = _config_value(value.strip())
    if pass_name == "bwd":
        if kernel != "attention":
            raise click.UsageError(f"--pass bwd is the attention backward; --kernel {kernel} has none")
        kernel = "attention_bwd"
    req = BuildRequest(kernel=kernel, arch=arch, dtype=dtype, head_dim=head_dim, causal=causal,
                       kernel_name=kernel_name, config=config, varlen=varlen, head_dim_v=head_dim_v or 0)
    try:
        result = inspect_kernel(req)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    rep = result.report
    if as_json:
        click.echo(json.dumps(rep.to_dict(), indent=2))
    else:
        _print_report(rep, top)
    if dump_dir:
        for path in dump(result, dump_dir):
            click.echo(f"wrote {path}")


def _print_report(rep, top: int) -> None:
    from .tables import render_table

    click.echo(f"kernel       {rep.kernel_name}  ({rep.arch})  {rep.description}")
    click.echo(f"registers    {rep.registers} / thread")
    click.echo(f"spills       {rep.spill_instructions} local-memory instructions, {rep.loop_spill_instructions} in "
               f"MMA loops (stack {rep.stack_bytes} B, local {rep.local_bytes} B)")
    click.echo(f"shared mem   {rep.shared_bytes} B")
    click.echo(f"tensor mem   {rep.tmem_columns} columns")
    click.echo(f"warps        {rep.num_warps} default partition, {rep.total_warps} in all")
    if rep.setmaxnreg:
        click.echo(f"setmaxnreg   {', '.join(map(str, rep.setmaxnreg))} registers/thread (partition budgets)")
    click.echo(f"instructions {rep.instructions}")
    rows = [{"opcode": op, "count": n} for op, n in rep.histogram[:top]]
    click.echo(render_table(rows, title="SASS histogram (MMA first)"))


@main.command("name-ab")
@click.option("--arch", "archs", callback=_str_list, default=",".join(BACKENDS), show_default=True)
@click.option("--dtype", "dtypes", callback=_dtype_list, default="fp16,bf16,fp8e5,fp8e4m3", show_default=True)
@click.option("--head-dim", callback=_int_list, default="64,128", show_default=True)
@click.option("--causal", type=click.Choice(list(CAUSAL)), default="both", show_default=True)
@click.option("--names", callback=_str_list, default="gluon_attention,cutlass_gluon_attention", show_default=True,
              help="Two kernel names, A,B.")
@click.option("--experiment", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Take dtypes, head dims and causal modes from a sweep spec.")
@click.option("--timed/--static-only", default=None,
              help="Time both names (needs a GPU of a listed arch); default: whenever one is present.")
@click.option("--n-ctx", type=click.IntRange(min=1), default=8192, show_default=True, help="N_CTX of the timed part.")
@click.option("--rounds", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--rep-ms", type=click.FloatRange(min=0, min_open=True), default=50.0, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results/name-ab", show_default=True)
@click.option("--quiet", is_flag=True)
@click.pass_context
def name_ab_cmd(ctx, archs, dtypes, head_dim, causal, names, experiment, timed, n_ctx, rounds, rep_ms, out_dir,
                quiet):
    """Compile (and time) the same kernel under two names: what the name does to ptxas."""
    from .bench.sweep import OutDirError, SweepSpec
    from .inspection import ARCHS
    from .kernels.naming import check_symbol
    from .name_ab import run_name_ab

    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise click.BadParameter(f"unknown arch {', '.join(bad)}; supported: {', '.join(ARCHS)}", param_hint="--arch")
    if len(names) != 2 or names[0] == names[1]:
        raise click.BadParameter("give two different names, A,B", param_hint="--names")
    try:
        for n in names:
            check_symbol(n)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--names") from None
    causal_modes = CAUSAL[causal]
    if experiment:
        spec = SweepSpec.from_file(experiment)
        dtypes = dtypes if _explicit(ctx, "dtypes") else spec.dtypes
        head_dim = head_dim if _explicit(ctx, "head_dim") else spec.head_dims
        causal_modes = causal_modes if _explicit(ctx, "causal") else spec.causal
    try:
        out = run_name_ab(out_dir, archs=archs, dtypes=dtypes, head_dims=head_dim, causal=causal_modes,
                          names=tuple(names), timed=timed, n_ctx=n_ctx, rounds=rounds, rep_ms=rep_ms,
                          command_line=sys.argv, progress=not quiet)
    except (OutDirError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    click.echo((out / "report.md").read_text())
    click.echo(f"results in {out}: rows.csv, env.json, report.md")


def _problem_options(f):
    for opt in reversed([
        click.option("-Z", "--batch", type=click.IntRange(min=1), default=4, show_default=True),
        click.option("-H", "--heads", type=click.IntRange(min=1), default=32, show_default=True),
        click.option("--n-ctx", type=click.IntRange(min=1), default=8192, show_default=True),
        click.option("--head-dim", type=click.IntRange(min=1), default=128, show_default=True),
        click.option("--head-dim-v", type=click.IntRange(min=1), default=None,
                     help="v's head dim where it differs from q's (the 192/128 pair: --head-dim 192 "
                          "--head-dim-v 128)."),
        click.option("--causal/--no-causal", default=False, show_default=True),
        click.option("--dtype", type=click.Choice(list(DTYPES)), default="fp16", show_default=True),
        click.option("--pass", "pass_name", type=click.Choice(list(PASSES)), default="fwd", show_default=True,
                     help="The forward, the backward (its kernel's configs), or both."),
        click.option("--format", "fmt", type=click.Choice(["table", "md", "csv", "json"]), default="table",
                     show_default=True),
    ]):
        f = opt(f)
    return f


def _problem(batch, heads, n_ctx, head_dim, causal, dtype, pass_name="fwd", head_dim_v=None):
    from .problem import Problem
    try:
        return Problem(batch, heads, n_ctx, head_dim, causal, dtype, HEAD_DIM_V=head_dim_v, pass_name=pass_name)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _no_v_dim(head_dim_v, head_dim, what: str) -> None:
    """Refuse a v head dim of its own where the command's mode has none (the neighborhood problems' v is q's)."""
    if head_dim_v not in (None, head_dim):
        raise click.UsageError(f"--head-dim-v: {what} problems have v's head dim equal to q's")


def _na_pattern_options(f):
    """configs, optimize and profile --na: one neighborhood pattern in NATTEN's vocabulary (``_na_pattern``)."""
    for opt in reversed([
        click.option("--token-layout", default=None, metavar="L[,L[,L]]", help="--na: the token layout (1-3 dims)."),
        click.option("--window", default=None, metavar="K[,K[,K]]", help="--na: the kernel size per dimension."),
        click.option("--stride", default="1", show_default=True, metavar="S[,S[,S]]",
                     help="--na: stride per dimension."),
        click.option("--dilation", default="1", show_default=True, metavar="D[,D[,D]]", help="--na: dilation."),
        click.option("--causal-dims", default="", metavar="0|1[,...]",
                     help="--na: causal per dimension (default none)."),
    ]):
        f = opt(f)
    return f


def _na_pattern(token_layout, window, stride, dilation, causal_dims):
    """The ``Neighborhood`` of ``_na_pattern_options``' values (refused as NATTEN refuses it: ValueError)."""
    from .neighborhood import each_dim, neighborhood

    if token_layout is None or window is None:
        raise click.UsageError("--na needs --token-layout and --window")
    flags = tuple(c.strip().lower() in ("1", "true", "yes") for c in causal_dims.split(",") if c.strip())
    return neighborhood(_na_dims(token_layout, "--token-layout"), each_dim(_na_dims(window, "--window")),
                        each_dim(_na_dims(stride, "--stride")), each_dim(_na_dims(dilation, "--dilation")),
                        each_dim(flags) if flags else False)


@main.command("configs")
@_problem_options
@click.option("--arch", type=click.Choice(list(BACKENDS)), default=None,
              help="Target (default: the current GPU's).")
@click.option("--all", "show_all", is_flag=True, help="Also list invalid configurations, with the reason.")
@click.option("--max-configs", type=click.IntRange(min=1), default=None)
@click.option("--space", type=click.Choice(["full", "focused"]), default="full", show_default=True)
@click.option("--na", is_flag=True, help="A neighborhood attention problem (NATTEN's vocabulary, below): its tile "
                                         "shapes with the K/V tiles they visit, the masked share and the bound.")
@_na_pattern_options
@click.option("--q-rows", type=click.IntRange(min=1), default=None,
              help="--na: tokens per query tile (default: the plan's, 64 or 128 in the forward; with --pass bwd or "
                   "fwd+bwd the backward's query block at the head dim).")
@click.option("--kv-rows", callback=_int_list, default="128", show_default=True,
              help="--na: tokens per K/V tile, comma-separated (the backward's: 128).")
def configs_cmd(batch, heads, n_ctx, head_dim, head_dim_v, causal, dtype, pass_name, fmt, arch, show_all, max_configs,
                space, na, token_layout, window, stride, dilation, causal_dims, q_rows, kv_rows):
    """List the valid kernel configurations for a problem (a dry run of optimize); with --na, a neighborhood
    attention problem's tile shapes and what each makes the kernel visit."""
    from .profiler import current_arch, list_configs
    from .tables import render

    if na:
        _no_v_dim(head_dim_v, head_dim, "--na")
        _na_configs(token_layout, window, stride, dilation, causal_dims, q_rows, kv_rows, max_configs, fmt, head_dim,
                    pass_name, dtype)
        return

    arch = arch or current_arch()
    if arch is None:
        raise click.UsageError(f"no GPU of a backend here ({', '.join(BACKENDS)}): pass --arch")
    problem = _problem(batch, heads, n_ctx, head_dim, causal, dtype, pass_name, head_dim_v)
    try:
        rows = list_configs(problem, arch, include_invalid=show_all, max_configs=max_configs, space=space)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    valid = sum(r["valid"] for r in rows)
    click.echo(render(rows, fmt, title=f"{arch} configurations for {problem.label()}: {valid} valid"
                                       f"{f', {len(rows) - valid} invalid' if show_all else ''}"))


def _na_dims(text: Optional[str], what: str) -> tuple[int, ...]:
    """One value of --na's dimension lists (``bench.neighborhood.parse_dims_list``)."""
    from .bench.neighborhood import parse_dims_list
    try:
        values = parse_dims_list(text, what)
    except ValueError:
        values = []
    if len(values) != 1:
        raise click.BadParameter(f"expected 1-3 integers (e.g. 256,256), got {text!r}", param_hint=what)
    return values[0]


def _na_configs(token_layout, window, stride, dilation, causal_dims, q_rows, kv_rows, max_configs, fmt, head_dim=128,
                pass_name="fwd", dtype="bf16"):
    from .bench.neighborhood import backward_pairs
    from .neighborhood import attended_pairs, backward_tiles, forward_halo, plan_table, sm90_tiles
    from .problem import dtype_from_name
    from .tables import render

    backward = pass_name != "fwd"
    try:
        nb = _na_pattern(token_layout, window, stride, dilation, causal_dims)
        if backward:  # (the backward's blocks at this head dim: its pairs, or none)
            taken, default = backward_pairs(nb, head_dim)
            if default is not None:
                q_rows, kv_rows = math.prod(default[0]), (math.prod(default[1]),)
        # (the forward walks 2-D/3-D windows' halo boxes in 16 bits; the backward and fp8 the lattice's)
        halo = not backward and forward_halo(nb, dtype_from_name(dtype))
        if not backward:
            taken, default = sm90_tiles(nb, head_dim, dtype_from_name(dtype))
            if q_rows is None and default and nb.dims > 1:  # (2-D/3-D: the query box the plan takes, 64 or 128)
                q_rows = math.prod(default[0])
        q_rows = q_rows or 128
        rows = plan_table(nb, q_rows, kv_rows, halo)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if not rows:
        raise click.UsageError(f"no tile of {q_rows} query tokens and {', '.join(map(str, kv_rows))} key tokens fits "
                               f"the layout {'x'.join(map(str, nb.spatial))} (powers of two per dimension): give "
                               f"smaller --q-rows / --kv-rows")
    for r in rows:  # (what the sm_90a kernel takes at this head dim, and na*d's default)
        pair = (r["q_tile_shape"], r["kv_tile_shape"])
        r["sm_90a"] = "default" if pair == default else "yes" if pair in taken else "no"
    shown = [{k: (v if not isinstance(v, tuple) else "x".join(map(str, v))) for k, v in r.items()
              if not k.startswith("_")} for r in rows[:max_configs or 10]]
    ideal = nb.tokens ** 2 / attended_pairs(nb)
    title = (f"neighborhood attention over {'x'.join(map(str, nb.spatial))} tokens, window "
             f"{'x'.join(map(str, nb.kernel_size))}, stride {'x'.join(map(str, nb.stride))}, dilation "
             f"{'x'.join(map(str, nb.dilation))}, causal {'x'.join(str(int(c)) for c in nb.is_causal)}: "
             f"ideal {ideal:.1f}x dense; {len(rows)} {'backward ' if backward else ''}tile shape pairs, the best "
             f"{len(shown)}")
    click.echo(render(shown, fmt, title=title))
    if fmt in ("table", "md") and not backward:  # (csv and json stay the table alone)
        bwd = backward_tiles(nb, head_dim)
        which = "the kernel's one pair" if nb.dims == 1 else "the default: fewest computed pairs"
        click.echo(f"backward (sm_90a, head dim {head_dim}): " + (
            f"backward_q_tile_shape {bwd[0]}, backward_kv_tile_shape {bwd[1]} ({which})" if bwd
            else "not taken at this head dim"))


@main.command("optimize")
@_problem_options
@click.option("--max-configs", type=click.IntRange(min=1), default=None)
@click.option("--warmup-ms", type=click.FloatRange(min=0, min_open=True), default=WARMUP_MS, show_default=True,
              help=WARMUP_HELP)
@click.option("--rep-ms", type=click.FloatRange(min=0, min_open=True), default=100.0, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results/scratch-optimize",
              show_default=True, help="Folder for the winner (<arch>.json, a tuning table) and optimize.csv.")
@click.option("--install", is_flag=True,
              help="Also write the winner into the package's tuning table, which attention() uses by default.")
@click.option("--space", type=click.Choice(["focused", "full"]), default="focused", show_default=True,
              help="focused: the knobs that moved measurements; full: every valid configuration.")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="Timing passes over the configs, alternating order; ranked by the median.")
@click.option("--configs", "only", default=None, metavar="NAME,...",
              help="Time only these configurations (names as `configs` lists them, from the full space; with --na, "
                   "tile pairs as QxQ/KxK, e.g. 2x8x8/1x4x32).")
@click.option("--na", is_flag=True, help="A neighborhood attention problem (as `configs --na`): time the tile shape "
                                         "pairs the kernel takes, the plan's best --max-configs (default 8); with "
                                         "--pass bwd or fwd+bwd the backward's.")
@_na_pattern_options
def optimize_cmd(batch, heads, n_ctx, head_dim, head_dim_v, causal, dtype, pass_name, fmt, max_configs, warmup_ms,
                 rep_ms, out_dir, install, space, rounds, only, na, token_layout, window, stride, dilation,
                 causal_dims):
    """Time every valid configuration for a problem; write the fastest to --out (--install: also to the
    package's tuning table). With --na, a neighborhood attention problem's tile shapes."""
    from .profiler import optimize
    from .tables import render

    if na:
        _no_v_dim(head_dim_v, head_dim, "--na")
        _na_optimize(token_layout, window, stride, dilation, causal_dims, batch, heads, head_dim, dtype, max_configs,
                     rounds, warmup_ms, rep_ms, out_dir, fmt, pass_name, _names(only))
        return

    problem = _problem(batch, heads, n_ctx, head_dim, causal, dtype, pass_name, head_dim_v)
    if install and problem.head_dim_v != head_dim:
        # (a winner for the pair would be read as q's head dim's and taken by 192/192 too)
        raise click.UsageError("--install: the tuning table is keyed by q's head dim alone; with --head-dim-v the "
                               "winner goes to --out only")
    try:
        summary = optimize(problem, max_configs=max_configs, warmup_ms=warmup_ms, rep_ms=rep_ms, out_dir=out_dir,
                           install=install, space=space, rounds=rounds,
                           only=_names(only))
    except (RuntimeError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    cols = ("config", "schedule", "stages", "status", "tflops", "p50_ms", "rounds", "message")
    rows = [{c: r.get(c, "") for c in cols} for r in summary["results"]]
    click.echo(render(rows, fmt, title=f"optimize {problem.label()} on {summary['arch']}"))
    if summary["best"] is None:
        click.echo("no configuration passed the accuracy gate", err=True)
        sys.exit(1)
    sp = summary["spread"]
    click.echo(f"best: {summary['best']['config']} {sp['best_tflops']:.1f} TFLOPS (median {sp['median_tflops']:.1f}, "
               f"worst {sp['worst_tflops']:.1f} over {sp['valid']} valid of {sp['tried']})")
    click.echo(f"written to {summary['table']}" + (f" and installed in {summary['installed']}"
                                                    if "installed" in summary else " (--install: into the package)"))


def _names(only):
    """--configs NAME,...: the names, or None."""
    names = [n.strip() for n in (only or "").split(",") if n.strip()]
    return names or None


def _na_optimize(token_layout, window, stride, dilation, causal_dims, batch, heads, head_dim, dtype, max_configs,
                 rounds, warmup_ms, rep_ms, out_dir, fmt, pass_name="fwd", only=None):
    from .bench.neighborhood import optimize_na
    from .tables import render

    try:
        nb = _na_pattern(token_layout, window, stride, dilation, causal_dims)
        summary = optimize_na(nb, batch=batch, heads=heads, kv_heads=None, head_dim=head_dim, dtype=dtype,
                              max_configs=max_configs or 8, rounds=rounds, warmup_ms=warmup_ms, rep_ms=rep_ms,
                              out_dir=out_dir, pass_name=pass_name, only=only)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    cols = ("q_tile_shape", "kv_tile_shape", "default", "visited / attended", "masked", "status", "p50_ms", "tflops",
            "message")
    rows = [{c: r.get(c, "") for c in cols} for r in summary["results"]]
    click.echo(render(rows, fmt, title=f"optimize {summary['problem'].label()}"))
    best, default = summary["best"], summary["default"]
    if best is None:
        click.echo("no tile shape pair passed the accuracy gate", err=True)
        sys.exit(1)
    said = "not timed (--configs)" if default is None else (
        f"{default['q_tile_shape']} / {default['kv_tile_shape']} {default.get('p50_ms', float('nan')):.4f} ms")
    click.echo(f"best: {best['q_tile_shape']} / {best['kv_tile_shape']} {best['p50_ms']:.4f} ms; the default "
               f"{said}; written to {out_dir}/optimize.csv")


@main.command("profile")
@_problem_options
@click.option("--provider", default="gluon", show_default=True)
@click.option("--iters", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--save-events", type=click.Path(dir_okay=False), default=None,
              help="Also write the raw kernel events as JSON (the tests' trace fixture format).")
@click.option("--backprop", is_flag=True, help="Profile the forward and backward (--pass fwd+bwd, NATTEN's name).")
@click.option("--na", is_flag=True, help="A neighborhood attention problem (as `configs --na`; --provider: gluon, "
                                         "flex, fa4, math or dense-<provider>).")
@_na_pattern_options
@click.pass_context
def profile_cmd(ctx, batch, heads, n_ctx, head_dim, head_dim_v, causal, dtype, pass_name, fmt, provider, iters,
                save_events, backprop, na, token_layout, window, stride, dilation, causal_dims):
    """Run one problem under torch.profiler and list the kernels that ran, ours first."""
    import torch

    from .bench.providers import get_provider
    from .profiler import profile_problem
    from .tables import render

    try:
        prov = get_provider(provider)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if not torch.cuda.is_available():
        click.echo("error: profile needs a CUDA GPU; `gluon-attn inspect` works anywhere", err=True)
        sys.exit(2)
    if backprop:
        if _explicit(ctx, "pass_name") and pass_name == "fwd":
            raise click.UsageError("--backprop profiles the backward: it does not go with --pass fwd")
        pass_name = pass_name if _explicit(ctx, "pass_name") else "fwd+bwd"
    if na:
        _no_v_dim(head_dim_v, head_dim, "--na")
        _na_profile(token_layout, window, stride, dilation, causal_dims, batch, heads, head_dim, dtype, pass_name,
                    provider, iters, save_events, fmt)
        return
    problem = _problem(batch, heads, n_ctx, head_dim, causal, dtype, pass_name, head_dim_v)
    support = prov.supports(problem, torch.cuda.get_device_capability())
    if not support.ok:
        raise click.UsageError(support.reason)
    events, rows = profile_problem(problem, provider, iters)
    if save_events:
        from pathlib import Path
        Path(save_events).write_text(json.dumps(events, indent=2) + "\n")
    click.echo(render(rows, fmt, title=f"{provider} on {problem.label()}, {iters} calls"))


def _na_profile(token_layout, window, stride, dilation, causal_dims, batch, heads, head_dim, dtype, pass_name, provider,
                iters, save_events, fmt):
    from .bench.neighborhood import NAProblem, Unsupported, na_call
    from .profiler import OUR_KERNELS, current_arch, kernel_table, record_events
    from .tables import render

    try:
        nb = _na_pattern(token_layout, window, stride, dilation, causal_dims)
        p = NAProblem(batch, heads, heads, head_dim, dtype, nb, pass_name)
        fn = na_call(p, provider)
    except (ValueError, Unsupported) as exc:
        raise click.UsageError(str(exc)) from None
    events = record_events(fn, iters)
    if save_events:
        from pathlib import Path
        Path(save_events).write_text(json.dumps(events, indent=2) + "\n")
    rows = kernel_table(events, OUR_KERNELS, current_arch() or "")
    click.echo(render(rows, fmt, title=f"{provider} on {p.label()}, {iters} calls"))


@main.command("plot")
@click.argument("results", type=click.Path(exists=True, file_okay=False))
def plot_cmd(results):
    """TFLOPS and speedup-vs-cuDNN plots (and tables.md) from a results folder's rows.csv."""
    from .bench.report import write_reports

    try:
        written = write_reports(results)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    for path in written:
        click.echo(f"wrote {path}")


@main.command("providers")
@click.option("--format", "fmt", type=click.Choice(["table", "md", "csv", "json"]), default="table",
              show_default=True)
def providers_cmd(fmt):
    """Every provider: library and version, dtypes, head dims, archs, features; usable here or why not."""
    import torch

    from .bench.providers import cuda_arch, get_provider, provider_names
    from .tables import render

    arch = cuda_arch()
    where = torch.cuda.get_device_name() + f" (sm_{arch[0]}{arch[1]})" if arch else "this machine (no CUDA GPU)"
    rows = [get_provider(n).describe(arch) for n in provider_names()]
    click.echo(render(rows, fmt, title=f"providers on {where}; peer = rated against in the tables"))


@main.command("env")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (what env.json records).")
def env_cmd(as_json):
    """Print the environment a result would be recorded with (for bug reports). A Triton the kernels cannot
    use is named first, on one line, with the recipe (``triton_problem``)."""
    from .bench.environment import collect_env

    env = collect_env()
    problem = env.get("triton_problem")
    if as_json:
        click.echo(json.dumps(env, indent=2))
        if problem:
            click.echo(f"PROBLEM: {problem}", err=True)
        return
    if problem:
        click.echo(f"PROBLEM: {problem}")
    width = max(len(k) for k in env)
    for k, v in env.items():
        if k != "triton_problem":
            click.echo(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
