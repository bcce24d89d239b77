"""Sweeps in pieces on CPU: shards that partition the grid and merge back into one folder, worker processes per
"GPU" (CPU workers here) with their rows merged, and a worker that dies losing only its cell."""
import json
import sys

import pandas as pd
import pytest
from click.testing import CliRunner

from gluon_attn.bench.parallel import run_on_gpus
from gluon_attn.bench.sweep import KEY_FIELDS, SweepSpec, _problem_key, parse_shard, shard_problems
from gluon_attn.cli import _worker_args, main

GRID = ["--providers", "math", "--n-ctx", "16,32,48", "--head-dim", "64", "-Z", "1", "-H", "2",
        "--warmup-ms", "1", "--rep-ms", "2"]
SPEC = SweepSpec(n_ctx=(16, 32, 48), head_dims=(64,), causal=(False, True), dtypes=("fp16",), batch=1, heads=2,
                 providers=("math",), warmup_ms=1, rep_ms=2)


def run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _cells(path):
    df = pd.read_csv(path)
    return sorted(zip(df.N_CTX, df.causal)), df


def test_shards_partition_the_grid_and_merge_into_one_folder(tmp_path):
    parts = []
    for i in (1, 2, 3, 4):
        out = tmp_path / f"shard-{i}"
        assert run(["sweep", *GRID, "--quiet", "--shard", f"{i}/4", "--out", str(out)]).exit_code == 0
        parts.append(out)
        assert json.loads((out / "env.json").read_text())["shard"] == f"{i}/4"
    counts = [len(pd.read_csv(p / "rows.csv")) for p in parts]
    assert counts == [2, 2, 1, 1]  # 6 problems dealt round-robin
    res = run(["merge", str(tmp_path / "all"), *map(str, parts)])
    assert res.exit_code == 0, res.output
    cells, df = _cells(tmp_path / "all" / "rows.csv")
    assert cells == sorted((n, c) for n in (16, 32, 48) for c in (False, True)) and (df.status == "ok").all()
    assert "gpu_index" in df.columns
    env = json.loads((tmp_path / "all" / "env.json").read_text())
    assert len(env["sweeps"]) == 4 and env["merged_from"][0].endswith("shard-1")
    assert (tmp_path / "all" / "tables.md").exists()
    # resuming a shard runs nothing new
    assert run(["sweep", *GRID, "--quiet", "--shard", "1/4", "--out", str(parts[0]), "--resume"]).exit_code == 0
    assert len(pd.read_csv(parts[0] / "rows.csv")) == 2


def test_shard_and_merge_refuse_what_they_cannot_do(tmp_path):
    for bad in ("0/4", "5/4", "2", "a/b"):
        with pytest.raises(ValueError, match="1 <= I <= N"):
            parse_shard(bad)
    res = CliRunner().invoke(main, ["sweep", *GRID, "--shard", "3/2", "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "1 <= I <= N" in res.output
    res = CliRunner().invoke(main, ["merge", str(tmp_path / "out"), str(tmp_path)])
    assert res.exit_code != 0 and "holds no rows.csv" in res.output
    assert shard_problems(SPEC.problems(), None) == list(SPEC.problems())


def test_shards_deal_whole_groups_of_problems_that_share_a_kernel():
    """Problems that differ only in N_CTX share their kernels: a shard takes whole groups of them (every N-th group),
    so that each worker compiles its share of the kernels; with fewer groups than shards, every N-th problem."""
    problems = list(SPEC.problems())  # two groups (causal or not) of three lengths
    first, second = shard_problems(problems, (1, 2)), shard_problems(problems, (2, 2))
    assert [(p.N_CTX, p.causal) for p in first] == [(16, False), (32, False), (48, False)]
    assert [(p.N_CTX, p.causal) for p in second] == [(16, True), (32, True), (48, True)]
    spec = SweepSpec(n_ctx=(16, 32), head_dims=(64, 128), causal=(False, True), dtypes=("fp16",), batch=1, heads=2,
                     providers=("math",))
    shards = [shard_problems(spec.problems(), (i, 3)) for i in (1, 2, 3)]
    assert sorted(len(s) for s in shards) == [2, 2, 4]  # four groups of two over three shards
    assert sorted(map(repr, sum(shards, []))) == sorted(map(repr, spec.problems()))  # a partition
    for shard in shards:
        assert all(len({(p.HEAD_DIM, p.causal) for p in shard if p.N_CTX == n}) == len(shard) // 2 for n in (16, 32))
    assert [p.N_CTX for p in shard_problems(problems, (3, 4))] == [48]  # 2 groups, 4 shards: every 4th problem


def test_context_parallel_lengths_are_bounded_per_rank():
    """A sweep's N_CTX is bounded per GPU: --cp N takes sequences up to N times as long, split over its ranks."""
    with pytest.raises(ValueError, match="larger than the supported maximum 65536"):
        SweepSpec(n_ctx=(131072,), providers=("math",))
    assert SweepSpec(n_ctx=(131072,), providers=("math",), cp_ranks=2).n_ctx == (131072,)
    with pytest.raises(ValueError, match=r"maximum 131072 \(65536 per rank over 2 ranks\)"):
        SweepSpec(n_ctx=(262144,), providers=("math",), cp_ranks=2)
    res = CliRunner().invoke(main, ["sweep", "--cp", "2", "--n-ctx", "262144", "--providers", "math"])
    assert res.exit_code == 2 and "65536 per rank over 2 ranks" in res.output


def test_worker_arguments_drop_what_each_worker_sets_itself():
    argv = ["gluon-attn", "sweep", "--providers", "math", "--gpus", "2", "--out=res", "--resume", "--quiet",
            "--n-ctx", "16", "--gpus=all"]
    assert _worker_args(argv) == ["--providers", "math", "--n-ctx", "16"]


def test_gpus_needs_them(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("checks the refusal without a GPU")
    res = CliRunner().invoke(main, ["sweep", *GRID, "--gpus", "2", "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "--gpus takes a number from 1 to the GPUs visible (0)" in res.output


def test_workers_rows_merge_with_their_gpu_index(tmp_path):
    out = run_on_gpus(GRID, tmp_path / "res", [0, 1], total=6, progress=False)
    cells, df = _cells(out / "rows.csv")
    assert len(cells) == 6 and (df.status == "ok").all()
    assert sorted(df.gpu_index.unique()) == [0, 1]
    assert (out / "gpu-0" / "rows.csv").exists() and (out / "gpu-1.log").exists()


CRASH_ONCE = """
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
flag = out.parent / (out.name + ".crashed")
if os.environ.get("CRASH_GPU") == out.name and not flag.exists():
    flag.write_text("")
    out.mkdir(parents=True, exist_ok=True)
    (out / "in-flight.json").write_text(os.environ["CRASH_CELLS"])
    sys.exit(3)  # died on that cell, before writing its row
from gluon_attn.cli import main
main(["sweep", *args], standalone_mode=True)
"""


def test_a_worker_that_dies_loses_only_its_cell(tmp_path, monkeypatch):
    script = tmp_path / "crash_once.py"
    script.write_text(CRASH_ONCE)
    first = shard_problems(SPEC.problems(), (2, 2))[0]  # the first problem of GPU 1's shard
    cell = dict(zip(KEY_FIELDS, _problem_key(first, "math")))
    monkeypatch.setenv("CRASH_GPU", "gpu-1")
    monkeypatch.setenv("CRASH_CELLS", json.dumps([cell]))
    out = run_on_gpus(GRID, tmp_path / "res", [0, 1], total=6, progress=False, worker=[sys.executable, str(script)])
    cells, df = _cells(out / "rows.csv")
    assert len(cells) == 6  # every cell has its row
    lost = df[df.status == "error"]
    assert len(lost) == 1 and lost.N_CTX.item() == first.N_CTX and bool(lost.causal.item()) == first.causal
    assert "worker on GPU 1 died (exit code 3)" in lost.message.item()
    assert (df.status == "ok").sum() == 5


def test_context_parallel_cells_on_cpu_ranks(tmp_path):
    """--cp 2 without CUDA: two gloo processes with the math attention; each cell's gathered output (and, for the
    backward, its gradients) checked against one process's, its per-rank TFLOPS and the ratio to one process at
    N_CTX / 2 recorded; a length that does not split into the chunks is an unsupported row."""
    res = run(["sweep", "--providers", "math", "--n-ctx", "64,66", "--head-dim", "64", "-Z", "1", "-H", "4",
               "--kv-heads", "2", "--pass", "fwd,fwd+bwd", "--cp", "2", "--quiet", "--out", str(tmp_path / "cp")])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "cp" / "rows.csv")
    assert set(df.provider) == {"ring-cp2"} and len(df) == 8
    ok = df[df.N_CTX == 64]
    assert (ok.status == "ok").all(), ok.message.tolist()
    assert (ok.cp_ranks == 2).all() and (ok.vs_single_gpu > 0).all() and (ok.tflops > 0).all()
    assert (ok.max_abs_err < 1e-3).all()
    odd = df[(df.N_CTX == 66) & df.causal]
    assert (odd.status == "unsupported").all() and odd.message.str.contains("4 equal chunks").all()
    assert json.loads((tmp_path / "cp" / "env.json").read_text())["cp_ranks"] == 2
    res = CliRunner().invoke(main, ["sweep", *GRID, "--cp", "2", "--gpus", "2", "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "not with --gpus" in res.output
