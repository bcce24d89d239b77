"""A sweep spread over a host's GPUs: one worker process per GPU, each pinned to its GPU (CUDA_VISIBLE_DEVICES)
and running its shard of the problems (``sweep --shard I/N``) into a folder of its own with its own warm-up and
rounds; the folders are merged into one results folder (``merge_sweeps``) with a ``gpu_index`` column. A worker
that dies loses only the cell it was on: an error row records it and the worker starts again from its rows."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .report import ROWS_FILE
from .sweep import merge_sweeps, record_lost_cells

MAX_RESTARTS = 20  # per worker: each restart follows a cell recorded as lost, so a sweep always ends


def _rows(path: Path) -> int:
    try:
        with open(path) as f:
            return max(0, sum(1 for _ in f) - 1)
    except OSError:
        return 0


def run_on_gpus(sweep_args: Sequence[str], out: str | os.PathLike, gpus: Sequence[int], *, total: int,
                resume: bool = False, progress: bool = True, worker: Optional[Sequence[str]] = None) -> Path:
    """Run ``gluon-attn sweep <sweep_args>`` as one worker per GPU index in ``gpus`` (shard i+1 of len(gpus) into
    ``out/gpu-<index>``), restart a worker that dies after recording its lost cell, and merge the folders into
    ``out``. ``total``: the sweep's cells, for the progress bar. ``worker``: the command before the sweep's
    arguments (default: this Python running the package's CLI)."""
    from tqdm.auto import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    worker = list(worker or [sys.executable, "-m", "gluon_attn.cli", "sweep"])
    n = len(gpus)
    dirs = {g: out / f"gpu-{g}" for g in gpus}

    def start(i, g, again):
        cmd = worker + list(sweep_args) + ["--shard", f"{i + 1}/{n}", "--gpu-index", str(g), "--out", str(dirs[g]),
                                           "--quiet"] + (["--resume"] if (resume or again) else [])
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(g), "PYTHONUNBUFFERED": "1"}
        log = open(dirs[g].with_suffix(".log"), "a")
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log

    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    procs = {g: start(i, g, False) for i, g in enumerate(gpus)}
    restarts = {g: 0 for g in gpus}
    failed = {}
    bar = tqdm(total=total, desc=f"sweep on {n} GPUs", unit="cell", disable=not progress, dynamic_ncols=True)
    try:
        while procs:
            time.sleep(0.5)
            bar.n = sum(_rows(d / ROWS_FILE) for d in dirs.values())
            bar.refresh()
            for i, g in enumerate(gpus):
                if g not in procs or procs[g][0].poll() is None:
                    continue
                proc, log = procs.pop(g)
                log.close()
                if proc.returncode == 0:
                    continue
                lost = record_lost_cells(dirs[g], f"worker on GPU {g} died (exit code {proc.returncode}) during this "
                                                  f"cell; log: {dirs[g].with_suffix('.log').name}")
                restarts[g] += 1
                if lost and restarts[g] <= MAX_RESTARTS:
                    procs[g] = start(i, g, True)
                else:  # died outside a cell (setup, arguments): starting again would fail the same way
                    failed[g] = proc.returncode
    finally:
        for proc, log in procs.values():
            proc.kill()
            log.close()
        bar.close()
    with_rows = [d for d in dirs.values() if (d / ROWS_FILE).exists()]
    if with_rows:
        merge_sweeps(out, with_rows, replace=True)  # (a resumed run's earlier merge is rewritten)
    if failed:
        raise RuntimeError("; ".join(f"the worker on GPU {g} exited with {rc} outside a cell (log: "
                                     f"{dirs[g].with_suffix('.log')})" for g, rc in failed.items()))
    return out
