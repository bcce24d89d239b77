"""The sweep runner: problems x providers -> accuracy gate -> timing -> one CSV row per measurement.

Each problem's providers are gated first, then timed in ``rounds`` interleaved rounds (each provider
once per round, in turn); a row holds the medians over its rounds. Rows are appended and flushed as
each problem finishes, so an interrupted sweep loses at most the problem it was on, and ``resume``
skips the cells already recorded.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import itertools
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

from ..problem import DTYPES, PASSES, VARLEN_MIXES, Inputs, Problem, make_inputs
from ..reference import (attention_backward_reference, attention_reference, check_accuracy, check_gradients,
                         varlen_backward_reference, varlen_reference)
from ..validation import UnsupportedError
from .providers import cuda_arch, default_providers, get_provider
from .report import ROWS_FILE, write_reports
from .timing import (DEFAULT_WARMUP_MS, TIMINGS, board_columns, graphed, host_times, kernel_benchmark,
                     time_rounds)

DEFAULT_N_CTX = (1024, 2048, 4096, 8192, 16384, 32768)
MAX_N_CTX = 65536
KEY_FIELDS = ("Z", "H", "H_KV", "N_CTX", "N_KV", "varlen", "HEAD_DIM", "HEAD_DIM_V", "causal", "dtype", "pass",
              "provider")
COLUMNS = KEY_FIELDS + (
    "label", "kernel_name", "config", "p20_ms", "p50_ms", "p80_ms", "tflops", "max_abs_err", "rel_l2_err",
    "status", "message", "gpu", "timestamp", "rounds", "round_spread", "out_dtype", "peak_mem_mb", "gpu_index",
    "cp_ranks", "vs_single_gpu", "power_w", "sm_clock_mhz", "tflops_per_w", "timing", "host_us", "eager_us",
)
IN_FLIGHT_FILE = "in-flight.json"  # the problem a sweep is on (gone when it ends): what a dead worker was doing
STATUSES = ("ok", "wrong", "unsupported", "oom", "error")


@dataclass(frozen=True)
class SweepSpec:
    n_ctx: tuple[int, ...] = DEFAULT_N_CTX
    head_dims: tuple[int, ...] = (64, 128)
    causal: tuple[bool, ...] = (False, True)
    dtypes: tuple[str, ...] = ("fp16",)
    batch: int = 4
    heads: int = 32
    providers: tuple[str, ...] = field(default_factory=lambda: tuple(default_providers()))
    warmup_ms: float = DEFAULT_WARMUP_MS
    rep_ms: float = 100.0
    rounds: int = 1  # timing rounds per cell, providers interleaved; rows keep the medians
    head_dims_v: tuple[Optional[int], ...] = (None,)  # v's head dims (an axis); None: each problem's q/k head dim
    kv_heads: tuple[Optional[int], ...] = (None,)  # K/V heads (GQA/MQA); None: as many as query heads
    n_kv: tuple[Optional[int], ...] = (None,)  # keys per head; None: N_CTX (self-attention)
    varlen: tuple[Optional[str], ...] = (None,)  # packed-batch mixes (problem.VARLEN_MIXES); None: dense
    passes: tuple[str, ...] = ("fwd",)  # problem.PASSES: fwd, bwd, fwd+bwd
    description: str = ""
    cp_ranks: int = 1  # ranks each cell's sequence is split over (sweep --cp): N_CTX up to MAX_N_CTX per rank
    timing: str = "eager"  # the rounds' calls as made, "graph": replayed CUDA graphs, "kernel": the kernels' durations

    def __post_init__(self):
        if self.timing not in TIMINGS:
            raise ValueError(f"timing must be one of {', '.join(TIMINGS)}, got {self.timing!r}")
        for n in self.n_ctx:
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"N_CTX must be an integer >= 1, got {n!r}")
            if n > MAX_N_CTX * self.cp_ranks:
                per_rank = f" ({MAX_N_CTX} per rank over {self.cp_ranks} ranks)" if self.cp_ranks > 1 else ""
                raise ValueError(f"N_CTX {n} is larger than the supported maximum {MAX_N_CTX * self.cp_ranks}"
                                 f"{per_rank}")
        for d in self.dtypes:
            if d not in DTYPES:
                raise ValueError(f"unknown dtype {d!r}; supported: {', '.join(DTYPES)}")
        for p in self.providers:
            get_provider(p)  # raises with the list of known providers
        if self.batch < 1 or self.heads < 1:
            raise ValueError(f"batch and heads must be >= 1, got {self.batch}, {self.heads}")
        if self.warmup_ms <= 0 or self.rep_ms <= 0:
            raise ValueError("warmup_ms and rep_ms must be > 0")
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds must be an integer >= 1, got {self.rounds!r}")
        if not self.n_ctx or not self.head_dims or not self.causal or not self.dtypes or not self.providers:
            raise ValueError("a sweep needs at least one N_CTX, head dim, causal mode, dtype and provider")
        if not self.kv_heads or not self.n_kv or not self.varlen or not self.head_dims_v:
            raise ValueError("kv_heads, n_kv, varlen and head_dims_v need at least one value (None: the default)")
        for dv in self.head_dims_v:
            if dv is not None and (not isinstance(dv, int) or isinstance(dv, bool) or dv < 1):
                raise ValueError(f"v's head dims must be integers >= 1, got {dv!r}")
        for h in self.kv_heads:
            if h is not None and (not isinstance(h, int) or h < 1 or self.heads % h):
                raise ValueError(f"kv heads must divide the {self.heads} query heads, got {h!r}")
        for n in self.n_kv:
            if n is not None and (not isinstance(n, int) or not 1 <= n <= MAX_N_CTX):
                raise ValueError(f"N_KV must be an integer from 1 to {MAX_N_CTX}, got {n!r}")
        for mix in self.varlen:
            if mix is not None and mix not in VARLEN_MIXES:
                raise ValueError(f"unknown varlen mix {mix!r}; known: {', '.join(VARLEN_MIXES)}")
        for direction in self.passes:
            if direction not in PASSES:
                raise ValueError(f"unknown pass {direction!r}; known: {', '.join(PASSES)}")
        if not self.passes:
            raise ValueError("a sweep needs at least one pass (fwd, bwd, fwd+bwd)")
        if any(m is not None for m in self.varlen) and any(n is not None for n in self.n_kv):
            raise ValueError("varlen mixes are self-attention: give no n_kv with them")

    def problems(self) -> Iterator[Problem]:
        """Every cell's problem; a packed (varlen) one has N_CTX tokens in all and Z = 1."""
        seen = set()
        for direction, dtype, d, dv, causal, h_kv, n_kv, mix, n in itertools.product(
                self.passes, self.dtypes, self.head_dims, self.head_dims_v, self.causal, self.kv_heads, self.n_kv,
                self.varlen, self.n_ctx):
            # (v's head dim equal to q's is the default: one problem, however it was asked for)
            problem = Problem(1 if mix else self.batch, self.heads, n, d, causal, dtype, None if dv == d else dv,
                              H_KV=h_kv, N_KV=n_kv, varlen=mix, pass_name=direction)
            if problem not in seen:
                seen.add(problem)
                yield problem

    @property
    def n_cells(self) -> int:
        return len(list(self.problems())) * len(self.providers)

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides) -> "SweepSpec":
        """Read an experiment spec (TOML); keyword overrides win over the file."""
        with open(path, "rb") as f:
            data = tomllib.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        data.update(overrides)
        for key in ("n_ctx", "head_dims", "causal", "dtypes", "providers", "kv_heads", "n_kv", "varlen", "passes",
                    "head_dims_v"):
            if key in data:
                # (TOML has no null: 0 or "" in kv_heads / n_kv / varlen / head_dims_v means the default)
                data[key] = tuple(None if key in ("kv_heads", "n_kv", "varlen", "head_dims_v") and not v else v
                                  for v in data[key])
        return cls(**data)


def _cell_key(row: dict) -> tuple:
    """A rows.csv row's cell (rows written before H_KV / N_KV / varlen / pass existed: H, N_CTX, dense and
    the forward)."""
    def given(v):
        return v not in ("", None) and str(v) != "nan"

    def norm(k, v):
        if k in ("causal",):
            return str(v).lower() in ("true", "1")
        if k == "HEAD_DIM_V":
            return int(float(v)) if given(v) else None
        if k in ("H_KV", "N_KV"):
            return int(float(v)) if given(v) else int(row["H" if k == "H_KV" else "N_CTX"])
        if k == "varlen":
            return str(v) if given(v) else ""
        if k == "pass":
            return str(v) if given(v) else "fwd"
        if k in ("Z", "H", "N_CTX", "HEAD_DIM"):
            return int(v)
        return str(v)
    return tuple(norm(k, row.get(k, "")) for k in KEY_FIELDS)


def _problem_key(problem: Problem, provider: str) -> tuple:
    return (problem.Z, problem.H, problem.h_kv, problem.N_CTX, problem.n_kv, problem.varlen or "", problem.HEAD_DIM,
            problem.HEAD_DIM_V, problem.causal, problem.dtype, problem.pass_name, provider)


class RowWriter:
    """Append rows to a CSV, flushing each one to disk."""

    def __init__(self, path: Path, columns: Sequence[str] = COLUMNS):
        self.path = path
        new = not path.exists() or path.stat().st_size == 0
        columns = tuple(columns)
        if not new:  # resuming: keep the file's own columns (an older sweep may lack the newer ones)
            with open(path, newline="") as f:
                columns = tuple(next(csv.reader(f)))
        self.columns = columns
        self._f = open(path, "a", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=columns, extrasaction="ignore")
        if new:
            self._w.writeheader()
            self._flush()

    def _flush(self):
        self._f.flush()
        os.fsync(self._f.fileno())

    def write(self, row: dict) -> None:
        self._w.writerow({k: row.get(k, "") for k in self.columns})
        self._flush()

    def close(self):
        self._f.close()


def done_cells(path: Path) -> set[tuple]:
    if not path.exists() or path.stat().st_size == 0:
        return set()
    with open(path, newline="") as f:
        return {_cell_key(r) for r in csv.DictReader(f)}


def gate_heads(n_heads: int, n_ctx: int, budget: int = 1 << 32, n_kv: Optional[int] = None) -> list[int]:
    """Which (batch*head) slices the accuracy gate compares: all of them while the fp32 reference's
    scores stay within ``budget`` elements, else evenly spaced ones, always the first and the last."""
    count = max(2, min(n_heads, budget // (n_ctx * (n_kv or n_ctx))))
    if count >= n_heads:
        return list(range(n_heads))
    step = (n_heads - 1) / (count - 1)
    return sorted({round(i * step) for i in range(count)})


@dataclass
class GateReference:
    """The fp32 reference of the query heads the gate compares: dense [len(heads), N_Q, Dv] over (batch,
    head) slices, packed [total, len(heads), Dv] over heads."""
    heads: list[int]
    out: torch.Tensor
    varlen: bool = False

    @classmethod
    def compute(cls, inputs: Inputs) -> "GateReference":
        if inputs.problem.backward:
            return BackwardGate.compute(inputs)
        p = inputs.problem
        group = p.H // p.h_kv
        if p.varlen:
            heads = gate_heads(p.H, max(p.seqlens), budget=1 << 30)
            kv = [h // group for h in heads]
            q, k, v = inputs.q[:, heads], inputs.k[:, kv], inputs.v[:, kv]
            ref = varlen_reference(q, k, v, inputs.cu_seqlens, inputs.cu_seqlens, causal=p.causal)
            return cls(heads, ref, varlen=True)
        heads = gate_heads(p.Z * p.H, p.N_CTX, n_kv=p.n_kv)
        # (batch, head) slice i reads K/V slice (i // H) * H_KV + (i % H) // group
        kv = [(i // p.H) * p.h_kv + (i % p.H) // group for i in heads]

        def pick(t, rows):
            return t.reshape(-1, t.shape[-2], t.shape[-1])[rows][None]

        ref = attention_reference(pick(inputs.q, heads), pick(inputs.k, kv), pick(inputs.v, kv), causal=p.causal,
                                  descale_q=inputs.descale_q, descale_k=inputs.descale_k,
                                  descale_v=inputs.descale_v)
        return cls(heads, ref[0])

    def select(self, out: torch.Tensor) -> torch.Tensor:
        if self.varlen:
            return out[:, self.heads]
        Z, H, N, Dv = out.shape
        return out.reshape(Z * H, N, Dv)[self.heads]

    def check(self, result, descale_o: float, dtype: str, out_dtype: str):
        """The accuracy of what a prepared call returned (here: the output)."""
        return check_accuracy(self.select(result).float() * descale_o, self.out, dtype, out_dtype=out_dtype)


@dataclass
class BackwardGate:
    """fp32 reference gradients of the K/V heads the gate compares, with all their query heads (dK and dV
    sum over them): dense over (batch, K/V head) slices, packed over K/V heads. ``check`` takes a backward
    call's (dq, dk, dv)."""
    q_rows: list[int]
    kv_rows: list[int]
    refs: tuple
    varlen: bool = False

    @classmethod
    def compute(cls, inputs: Inputs) -> "BackwardGate":
        p = inputs.problem
        group = p.H // p.h_kv
        if p.varlen:
            kv = gate_heads(p.h_kv, max(p.seqlens), budget=(1 << 29) // group)
            qh = [h * group + g for h in kv for g in range(group)]
            refs = varlen_backward_reference(inputs.q[:, qh], inputs.k[:, kv], inputs.v[:, kv], inputs.do[:, qh],
                                             inputs.cu_seqlens, inputs.cu_seqlens, causal=p.causal)
            return cls(qh, kv, refs, varlen=True)
        kv = gate_heads(p.Z * p.h_kv, p.N_CTX, budget=(1 << 31) // group, n_kv=p.n_kv)
        qh = [(j // p.h_kv) * p.H + (j % p.h_kv) * group + g for j in kv for g in range(group)]

        def pick(t, rows):
            return t.reshape(-1, t.shape[-2], t.shape[-1])[rows][None]

        refs = attention_backward_reference(pick(inputs.q, qh), pick(inputs.k, kv), pick(inputs.v, kv),
                                            pick(inputs.do, qh), causal=p.causal)
        return cls(qh, kv, tuple(r[0] for r in refs))

    def select(self, grads) -> tuple:
        dq, dk, dv = grads
        if self.varlen:
            return dq[:, self.q_rows], dk[:, self.kv_rows], dv[:, self.kv_rows]

        def pick(t, rows):
            return t.reshape(-1, t.shape[-2], t.shape[-1])[rows]

        return pick(dq, self.q_rows), pick(dk, self.kv_rows), pick(dv, self.kv_rows)

    def check(self, result, descale_o: float, dtype: str, out_dtype: str):
        return check_gradients(self.select(result), self.refs, dtype)


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _free_cuda():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gate_cell(problem: Problem, provider_name: str, inputs: Optional[Inputs], gate: Optional[GateReference],
              arch) -> tuple[dict, Optional[Callable[[], torch.Tensor]]]:
    """One provider on one problem, up to timing: support check and accuracy gate. Returns the row so
    far and the function to time, or None (the row's status says why: unsupported, wrong, oom, error).
    On CUDA the row records the peak device memory that preparing and making the first call took
    beyond what existed before (inputs, reference): output, workspace, anything cached for the call."""
    provider = get_provider(provider_name)
    row = dict(zip(KEY_FIELDS, _problem_key(problem, provider_name)))
    row.update(label=provider.label, kernel_name=provider.kernel_name_fn(problem),
               config=provider.config_fn(problem), out_dtype=provider.out_dtype_fn(problem))
    support = provider.supports(problem, arch)
    if not support.ok:
        return {**row, "status": "unsupported", "message": support.reason}, None
    on_cuda = inputs.q.device.type == "cuda"
    try:
        with provider.context():
            if on_cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            call = provider.prepare(inputs)
            out = call()
            if on_cuda:
                torch.cuda.synchronize()
                row["peak_mem_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
            acc = gate.check(out, call.descale_o, problem.dtype, row["out_dtype"])
            del out
            row.update(max_abs_err=acc.max_abs, rel_l2_err=acc.rel_l2)
            if not acc.ok:
                return {**row, "status": "wrong", "message": acc.message}, None
    except UnsupportedError as exc:  # the library declined this problem at build time
        _free_cuda()
        return {**row, "status": "unsupported", "message": _short(exc)}, None
    except Exception as exc:  # a failing provider marks its cell; the sweep goes on
        return _failed(row, exc), None
    return row, call


def _failed(row: dict, exc: BaseException) -> dict:
    _free_cuda()
    status = "oom" if isinstance(exc, torch.cuda.OutOfMemoryError) else "error"
    return {**row, "status": status, "message": _short(exc)}


def time_cells(problem: Problem, cells: list, *, rounds: int, warmup_ms: float, rep_ms: float, device,
               timing: str = "eager") -> list[dict]:
    """Time the gated cells ``[(row, fn or None)]`` of one problem with ``time_rounds`` (each provider
    once per round, the order turning) and complete their rows with the medians over the rounds
    (p20/p50/p80) and the rounds' spread, and each call's host and end-to-end eager time (``host_times``: calls
    back to back, as a model makes them). ``timing`` "graph": the rounds time each call captured in a CUDA graph
    (``graphed``: the GPU's time of its launches); "kernel": the durations of the kernels it launches
    (``kernel_benchmark``)."""
    rows = [row for row, _ in cells]
    fns = {i: fn for i, (_, fn) in enumerate(cells) if fn is not None}
    context = lambda i: get_provider(rows[i]["provider"]).context()  # noqa: E731
    hosts = {}
    for i, fn in list(fns.items()):
        try:
            with context(i):
                hosts[i] = host_times(fn, device=device)
                if timing == "graph":
                    fns[i] = graphed(fn)
        except Exception as exc:  # noqa: BLE001 - one provider's failure is its row
            rows[i] = _failed(rows[i], exc)
            del fns[i]
    timed, failed = time_rounds(fns, rounds=rounds, warmup_ms=warmup_ms, rep_ms=rep_ms, device=device,
                                context=context, timer=kernel_benchmark if timing == "kernel" else None)
    for i, exc in failed.items():
        rows[i] = _failed(rows[i], exc)
    for i, h in hosts.items():
        rows[i].update(timing=timing, **h)
    for i, t in timed.items():
        p50 = t.median()
        tflops = problem.tflops(p50)
        rows[i].update(status="ok", p20_ms=t.median("p20_ms"), p50_ms=p50, p80_ms=t.median("p80_ms"),
                       tflops=tflops, rounds=len(t.timings), round_spread=t.spread,
                       **board_columns(t.median("power_w"), t.median("sm_clock_mhz"), tflops))
    return rows


class OutDirError(ValueError):
    pass


def prepare_out_dir(out: str | os.PathLike, resume: bool) -> Path:
    """Create ``out`` and make sure it is writable; refuse to mix a new sweep into old results."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise OutDirError(f"--out {str(out)!r} is not a writable directory: {exc.strerror or exc}") from None
    rows = path / ROWS_FILE
    if rows.exists() and rows.stat().st_size > 0 and not resume:
        raise OutDirError(f"{rows} already holds results: pass --resume to continue that sweep, "
                          f"or choose another --out")
    return path


def parse_shard(text: str) -> tuple[int, int]:
    """"I/N" (1 <= I <= N) -> (I, N)."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise ValueError(f"--shard takes I/N with 1 <= I <= N (shard I of N, e.g. 2/4); got {text!r}")
    return i, n


def shard_problems(problems: Iterable[Problem], shard: Optional[tuple[int, int]]) -> list[Problem]:
    """Shard I of N: every N-th group of problems from the I-th, a group being the problems that differ only in
    N_CTX (they share their compiled kernels, so each worker compiles about 1/N of them: with a group per worker the
    compilation was each worker's fixed cost); every N-th problem where there are fewer groups than shards. A
    problem's providers stay together, so their ratios are measured in one process on one GPU."""
    problems = list(problems)
    if shard is None:
        return problems
    i, n = shard
    groups: dict = {}
    for p in problems:
        key = tuple(value for name, value in dataclasses.asdict(p).items() if name != "N_CTX")
        groups.setdefault(key, []).append(p)
    if len(groups) < n:
        return problems[i - 1::n]
    return [p for group in list(groups.values())[i - 1::n] for p in group]


def run_sweep(spec: SweepSpec, out: str | os.PathLike, *, resume: bool = False,
              device: Optional[str] = None, command_line: Optional[list[str]] = None,
              progress: bool = True, on_row: Optional[Callable[[dict], None]] = None,
              shard: Optional[tuple[int, int]] = None, gpu_index: Optional[int] = None) -> Path:
    """Run the grid (``shard`` (I, N): its I-th of N shares, ``shard_problems``), writing rows.csv, env.json,
    tables.md and tflops.png under ``out``; ``gpu_index`` goes into every row (the host's GPU the sweep ran on;
    default: the current CUDA device's index)."""
    from tqdm.auto import tqdm

    from .environment import collect_env

    out_dir = prepare_out_dir(out, resume)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    arch = cuda_arch() if torch.device(device).type == "cuda" else None

    env_path = out_dir / "env.json"
    env = collect_env(command_line)
    env["spec"] = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(spec).items()}
    if shard is not None:
        env["shard"] = f"{shard[0]}/{shard[1]}"
    if gpu_index is None and torch.device(device).type == "cuda":
        gpu_index = torch.cuda.current_device()
    env["gpu_index"] = gpu_index
    if resume and env_path.exists():
        first = json.loads(env_path.read_text())
        first.setdefault("resumed", []).append(env)
        env_path.write_text(json.dumps(first, indent=2) + "\n")
    else:
        env_path.write_text(json.dumps(env, indent=2) + "\n")

    rows_path = out_dir / ROWS_FILE
    done = done_cells(rows_path) if resume else set()
    writer = RowWriter(rows_path)
    problems = shard_problems(spec.problems(), shard)
    bar = tqdm(total=len(problems) * len(spec.providers), desc="sweep", unit="cell", disable=not progress,
               dynamic_ncols=True)
    gpu = env.get("gpu") or "cpu"
    in_flight = out_dir / IN_FLIGHT_FILE
    try:
        for problem in problems:
            todo = [p for p in spec.providers if _problem_key(problem, p) not in done]
            bar.update(len(spec.providers) - len(todo))
            if not todo:
                continue
            bar.set_postfix_str(problem.label())
            in_flight.write_text(json.dumps([dict(zip(KEY_FIELDS, _problem_key(problem, p))) for p in todo]))
            inputs = gate = None
            setup_error = None
            needs_inputs = any(get_provider(p).supports(problem, arch).ok for p in todo)
            if needs_inputs:
                try:
                    inputs = make_inputs(problem, device)
                    gate = GateReference.compute(inputs)
                except torch.cuda.OutOfMemoryError as exc:
                    setup_error = ("oom", "inputs/reference: " + _short(exc))
                    inputs = gate = None
                    _free_cuda()
            cells = []
            for name in todo:
                if setup_error and get_provider(name).supports(problem, arch).ok:
                    p = get_provider(name)
                    row = {**dict(zip(KEY_FIELDS, _problem_key(problem, name))), "label": p.label,
                           "status": setup_error[0], "message": setup_error[1]}
                    cells.append((row, None))
                else:
                    cells.append(gate_cell(problem, name, inputs, gate, arch))
            for row in time_cells(problem, cells, rounds=spec.rounds, warmup_ms=spec.warmup_ms, rep_ms=spec.rep_ms,
                                  device=device, timing=spec.timing):
                row["gpu"] = gpu
                row["gpu_index"] = "" if gpu_index is None else gpu_index
                row["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
                writer.write(row)
                if on_row:
                    on_row(row)
                bar.update(1)
            del inputs, gate
            _free_cuda()
        in_flight.unlink(missing_ok=True)
    finally:
        bar.close()
        writer.close()
        write_reports(out_dir)
    return out_dir


def record_lost_cells(out: str | os.PathLike, why: str) -> int:
    """After the process running a sweep in ``out`` died: the cells of the problem it was on (its in-flight file)
    that have no row get an error row saying ``why``, so that a resumed sweep goes past them. Returns how many."""
    out = Path(out)
    marker = out / IN_FLIGHT_FILE
    if not marker.exists():
        return 0
    done = done_cells(out / ROWS_FILE)
    lost = [c for c in json.loads(marker.read_text()) if _cell_key(c) not in done]
    writer = RowWriter(out / ROWS_FILE)
    try:
        for cell in lost:
            writer.write({**cell, "label": get_provider(cell["provider"]).label, "status": "error", "message": why,
                          "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    finally:
        writer.close()
    marker.unlink()
    return len(lost)


def merge_sweeps(out: str | os.PathLike, dirs: Iterable[str | os.PathLike], *, replace: bool = False) -> Path:
    """One results folder from several sweeps' (shards', GPUs'): their rows in one rows.csv (a cell in two of
    them: the later folder's row), env.json listing each folder's environment, tables and plots redrawn.
    ``replace``: ``out`` may already hold results (an earlier merge of the same folders), which are rewritten."""
    out = Path(out)
    dirs = [Path(d) for d in dirs]
    for d in dirs:
        if not (d / ROWS_FILE).exists():
            raise OutDirError(f"{d} holds no {ROWS_FILE}: not a sweep's results folder")
    if any(d.resolve() == out.resolve() for d in dirs):
        raise OutDirError(f"merge writes {out}: it cannot also be one of the folders merged")
    out = prepare_out_dir(out, resume=replace)
    rows, columns = {}, list(COLUMNS)
    for d in dirs:
        with open(d / ROWS_FILE, newline="") as f:
            reader = csv.DictReader(f)
            columns += [c for c in reader.fieldnames or () if c not in columns]
            for r in reader:
                rows[_cell_key(r)] = r
    with open(out / ROWS_FILE, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows.values():
            w.writerow({c: r.get(c, "") for c in columns})
    envs = [json.loads((d / "env.json").read_text()) if (d / "env.json").exists() else {} for d in dirs]
    (out / "env.json").write_text(json.dumps({"merged_from": [str(d) for d in dirs], "sweeps": envs,
                                              "gpus": sorted({(e.get("gpu_index"), e.get("gpu")) for e in envs},
                                                             key=str)}, indent=2, default=list) + "\n")
    write_reports(out)
    return out
