import json
import os

import pandas as pd
import pytest
from click.testing import CliRunner

from gluon_attn.bench import sweep as sweep_mod
from gluon_attn.bench import timing as timing_mod
from gluon_attn.bench.report import load_rows, tables_markdown
from gluon_attn.bench.sweep import SweepSpec, gate_heads, run_sweep
from gluon_attn.cli import main

HAS_CUDA = __import__("torch").cuda.is_available()

SMALL = ["--providers", "math", "--n-ctx", "32,77", "--head-dim", "64", "-Z", "1", "-H", "2",
         "--warmup-ms", "1", "--rep-ms", "3", "--quiet"]


def run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_sweep_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "res"
    res = run(["sweep", *SMALL, "--dtype", "fp16,fp8e4m3", "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "rows.csv")
    # 2 N x 2 causal x 2 dtypes x 1 provider
    assert len(df) == 8
    fp16 = df[df.dtype == "fp16"]
    assert (fp16.status == "ok").all()
    assert (fp16.p20_ms <= fp16.p50_ms).all() and (fp16.p50_ms <= fp16.p80_ms).all()
    assert (fp16.tflops > 0).all() and (fp16.max_abs_err < 1e-2).all()
    # The math provider has no fp8 path: recorded as unsupported, with the reason.
    fp8 = df[df.dtype == "fp8e4m3"]
    assert (fp8.status == "unsupported").all() and fp8.message.str.contains("fp16, bf16").all()
    env = json.loads((out / "env.json").read_text())
    for key in ("torch", "triton", "git_commit", "git_dirty", "command", "gpu", "sm_count", "cudnn"):
        assert key in env
    tables = (out / "tables.md").read_text()
    assert "Attention Z=1 H=2 D=64 causal=False:" in tables
    assert "Attention Z=1 H=2 D=64 causal=True:" in tables
    assert "| dtype | N_CTX | math |" in tables and "| fp16 | 77 |" in tables
    assert (out / "tflops.png").stat().st_size > 1000
    assert "rows.csv" in res.output


def test_sweep_refuses_to_mix_results_without_resume(tmp_path):
    out = tmp_path / "res"
    assert run(["sweep", *SMALL, "--causal", "false", "--out", str(out)]).exit_code == 0
    res = CliRunner().invoke(main, ["sweep", *SMALL, "--causal", "false", "--out", str(out)])
    assert res.exit_code != 0 and "--resume" in res.output


def test_interrupted_sweep_loses_nothing_and_resumes(tmp_path, monkeypatch):
    spec = SweepSpec(n_ctx=(16, 32, 48), head_dims=(64,), causal=(False, True), dtypes=("fp16",), batch=1,
                     heads=1, providers=("math",), warmup_ms=1, rep_ms=2)
    seen = []

    def stop_after_three(row):
        seen.append(row)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, tmp_path, progress=False, on_row=stop_after_three)
    rows = pd.read_csv(tmp_path / "rows.csv")
    assert len(rows) == 3  # every finished row is on disk

    measured = []
    real = sweep_mod.gate_cell

    def counting(problem, name, *a, **k):
        measured.append((problem.N_CTX, problem.causal))
        return real(problem, name, *a, **k)

    monkeypatch.setattr(sweep_mod, "gate_cell", counting)
    run_sweep(spec, tmp_path, resume=True, progress=False)
    assert len(measured) == 3  # only the cells not done before
    rows = pd.read_csv(tmp_path / "rows.csv")
    assert len(rows) == 6
    assert len(rows.drop_duplicates(subset=["N_CTX", "causal"])) == 6
    env = json.loads((tmp_path / "env.json").read_text())
    assert len(env["resumed"]) == 1


def test_failing_provider_marks_cell_and_sweep_goes_on(tmp_path, monkeypatch):
    from gluon_attn.bench import providers

    prov = providers.get_provider("math")
    real = prov.runner
    calls = []

    def flaky(inputs):
        calls.append(inputs.problem.N_CTX)
        if inputs.problem.N_CTX == 32:
            raise RuntimeError("kernel launch failed")
        return real(inputs)

    monkeypatch.setattr(prov, "runner", flaky)
    spec = SweepSpec(n_ctx=(16, 32, 48), head_dims=(64,), causal=(False,), dtypes=("fp16",), batch=1, heads=1,
                     providers=("math",), warmup_ms=1, rep_ms=2)
    run_sweep(spec, tmp_path, progress=False)
    rows = pd.read_csv(tmp_path / "rows.csv")
    assert list(rows.status) == ["ok", "error", "ok"]
    assert "kernel launch failed" in rows.message[1]
    assert "error" in (tmp_path / "tables.md").read_text()


def test_wrong_output_is_recorded_not_timed(tmp_path, monkeypatch):
    from gluon_attn.bench import providers

    prov = providers.get_provider("math")
    real = prov.runner
    monkeypatch.setattr(prov, "runner", lambda inputs: (lambda f=real(inputs): f() * 1.5))
    timed = []
    monkeypatch.setattr(timing_mod, "benchmark", lambda *a, **k: timed.append(1))
    spec = SweepSpec(n_ctx=(40,), head_dims=(64,), causal=(True,), dtypes=("fp16",), batch=1, heads=2,
                     providers=("math",), warmup_ms=1, rep_ms=2)
    run_sweep(spec, tmp_path, progress=False)
    rows = pd.read_csv(tmp_path / "rows.csv")
    assert rows.status[0] == "wrong" and "max|out-ref|" in rows.message[0]
    assert pd.isna(rows.tflops[0]) and not timed


@pytest.mark.skipif(HAS_CUDA, reason="checks the message shown without a GPU")
def test_gpu_providers_without_gpu_exit_with_one_line(tmp_path):
    res = CliRunner().invoke(main, ["sweep", "--providers", "cudnn,math", "--out", str(tmp_path / "x")])
    assert res.exit_code != 0
    msg = res.output.strip()
    assert len(msg.splitlines()) == 1
    assert "CUDA GPU" in msg and "gluon-attn inspect" in msg


@pytest.mark.parametrize("args,needle", [
    (["--providers", "nope"], "available:"),
    (["--dtype", "fp32"], "supported: fp16, bf16, fp8e5, fp8e4m3"),
    (["--n-ctx", "0"], "N_CTX must be an integer >= 1"),
    (["--n-ctx", "131072"], "maximum 65536"),
    (["--n-ctx", "abc"], "comma-separated integers"),
    (["--causal", "maybe"], "false"),
])
def test_bad_options_are_named(tmp_path, args, needle):
    res = CliRunner().invoke(main, ["sweep", "--providers", "math", *args, "--out", str(tmp_path / "o")])
    assert res.exit_code != 0
    assert needle in res.output


def test_unwritable_out(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = CliRunner().invoke(main, ["sweep", *SMALL, "--out", str(blocker / "sub")])
    assert res.exit_code != 0 and "not a writable directory" in res.output


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_read_only_out(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    res = CliRunner().invoke(main, ["sweep", *SMALL, "--out", str(ro)])
    assert res.exit_code != 0 and "not a writable directory" in res.output


def test_experiment_spec_and_overrides(tmp_path):
    spec_file = tmp_path / "exp.toml"
    spec_file.write_text('n_ctx = [24, 40]\nhead_dims = [64]\ncausal = [true]\ndtypes = ["bf16"]\n'
                         'batch = 1\nheads = 2\nproviders = ["math"]\nwarmup_ms = 1\nrep_ms = 2\n')
    out = tmp_path / "o"
    res = run(["sweep", "--experiment", str(spec_file), "--n-ctx", "24", "--quiet", "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "rows.csv")
    assert list(df.N_CTX) == [24] and list(df.dtype) == ["bf16"] and list(df.causal) == [True]


def test_shipped_seed_spec_reproduces_the_seed_grid():
    spec = SweepSpec.from_file("experiments/seed-table.toml")
    assert (spec.batch, spec.heads) == (4, 32)
    assert spec.head_dims == (64, 128) and spec.causal == (False, True)
    assert spec.n_ctx == (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    assert "fp16" in spec.dtypes and any(d.startswith("fp8") for d in spec.dtypes)
    assert {"cudnn", "fa2", "flex"} <= set(spec.providers)


def test_spec_rejects_unknown_keys(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("n_ctx = [16]\nheaddim = [64]\n")
    with pytest.raises(ValueError, match="unknown keys"):
        SweepSpec.from_file(f)


def test_gate_heads_bounds_reference_cost():
    assert gate_heads(128, 1024) == list(range(128))
    heads = gate_heads(128, 32768)
    assert heads[0] == 0 and heads[-1] == 127 and 2 <= len(heads) <= 4


def test_tables_speedup_column_against_cudnn():
    rows = []
    for prov, tf in (("cudnn", 400.0), ("gluon", 440.0)):
        for n in (1024, 2048):
            rows.append(dict(Z=4, H=32, N_CTX=n, HEAD_DIM=64, HEAD_DIM_V=None, causal=False, dtype="fp16",
                             provider=prov, label=prov, status="ok", tflops=tf, message=""))
    rows.append(dict(Z=4, H=32, N_CTX=1024, HEAD_DIM=64, HEAD_DIM_V=None, causal=False, dtype="fp8e4m3",
                     provider="gluon", label="gluon", status="ok", tflops=600.0, message=""))
    rows.append(dict(Z=4, H=32, N_CTX=1024, HEAD_DIM=64, HEAD_DIM_V=None, causal=False, dtype="fp8e4m3",
                     provider="cudnn", label="cudnn", status="unsupported", tflops=None, message="no fp8"))
    md = tables_markdown(pd.DataFrame(rows))
    assert "Attention Z=4 H=32 D=64 causal=False:" in md
    assert "| dtype | N_CTX | cudnn | gluon | best peer | gluon / best peer | gluon / cudnn fp16 |" in md
    assert "| fp16 | 1024 | 400.0 | 440.0 | cudnn | 1.10x | 1.10x |" in md
    # fp8 is rated against cuDNN fp16 (secondary) but has no fp8 peer here: no best-peer ratio.
    assert "| fp8e4m3 | 1024 |  | 600.0 |  |  | 1.50x |" in md
    assert "unsupported" not in md  # an all-unsupported cell is left empty


def test_rounds_interleave_providers_and_keep_medians(tmp_path, monkeypatch):
    """Each round times every provider once, in turn, the order turning by one each round (no provider
    always first or always after the same one); a row keeps the medians over its rounds."""
    import contextlib
    import dataclasses

    from gluon_attn.bench import providers
    from gluon_attn.bench.timing import Timing

    current = []

    @contextlib.contextmanager
    def twin_context():
        current.append("math-twin")
        yield
        current.pop()

    twin = dataclasses.replace(providers.get_provider("math"), name="math-twin", context=twin_context)
    monkeypatch.setitem(providers.PROVIDERS, "math-twin", twin)
    calls = []
    p50s = {"math": iter([3.0, 1.0, 2.0]), "math-twin": iter([5.0, 4.0, 9.0])}

    def fake_benchmark(fn, **kw):
        name = current[-1] if current else "math"
        calls.append(name)
        p50 = next(p50s[name])
        return Timing(p50 * 0.9, p50, p50 * 1.1)

    monkeypatch.setattr(timing_mod, "benchmark", fake_benchmark)  # the harness's own timer
    spec = SweepSpec(n_ctx=(16,), head_dims=(64,), causal=(False,), dtypes=("fp16",), batch=1, heads=1,
                     providers=("math", "math-twin"), warmup_ms=1, rep_ms=1, rounds=3)
    run_sweep(spec, tmp_path, progress=False)
    assert calls == ["math", "math-twin", "math-twin", "math", "math", "math-twin"]
    rows = pd.read_csv(tmp_path / "rows.csv").set_index("provider")
    assert rows.loc["math", "p50_ms"] == 2.0 and rows.loc["math-twin", "p50_ms"] == 5.0
    assert rows.loc["math", "rounds"] == 3 and rows.loc["math", "round_spread"] == pytest.approx(1.0)
    assert rows.loc["math-twin", "round_spread"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rounds"):
        SweepSpec(rounds=0)


def test_resume_keeps_an_older_files_columns(tmp_path):
    """A rows.csv written before a column existed is continued in its own columns."""
    spec = SweepSpec(n_ctx=(16, 32), head_dims=(64,), causal=(False,), dtypes=("fp16",), batch=1, heads=1,
                     providers=("math",), warmup_ms=1, rep_ms=1)
    run_sweep(spec, tmp_path, progress=False)
    old = pd.read_csv(tmp_path / "rows.csv").drop(columns=["rounds", "round_spread"])
    old[old.N_CTX == 16].to_csv(tmp_path / "rows.csv", index=False)
    run_sweep(spec, tmp_path, resume=True, progress=False)
    rows = pd.read_csv(tmp_path / "rows.csv")
    assert list(rows.columns) == list(old.columns) and len(rows) == 2 and (rows.status == "ok").all()


def test_tables_and_plots_show_peak_memory_with_the_ratio_to_math(tmp_path):
    """Rows that recorded peak device memory get a memory table per block (MB per provider and N_CTX, each
    provider's ratio to the math reference where it ran) and memory.png on a log scale; CPU rows (no memory
    recorded) get neither."""
    rows = []
    for n in (1024, 2048, 4096):
        for prov, mb in (("math", 4 * (n / 1024) ** 2 * 32.0), ("gluon", n / 1024 * 2.0), ("cudnn", None)):
            rows.append(dict(Z=1, H=8, N_CTX=n, HEAD_DIM=64, HEAD_DIM_V=64, causal=False, dtype="fp16", provider=prov,
                             status="ok" if mb else "oom", tflops=100.0, p50_ms=1.0, peak_mem_mb=mb, gpu="H100", label=prov,
                             message="" if mb else "out of memory"))
    pd.DataFrame(rows).to_csv(tmp_path / "rows.csv", index=False)
    from gluon_attn.bench.report import write_reports
    written = [p.name for p in write_reports(tmp_path)]
    assert "memory.png" in written and (tmp_path / "memory.png").stat().st_size > 5000
    tables = (tmp_path / "tables.md").read_text()
    assert "Peak memory of a call (MB, beyond the inputs):" in tables
    assert "| dtype | N_CTX | gluon | math | gluon / math |" in tables
    assert "| fp16 | 4096 | 8.0 | 2048.0 | 0.00x |" in tables and "| fp16 | 1024 | 2.0 | 128.0 | 0.02x |" in tables
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    pd.DataFrame([{**r, "peak_mem_mb": None, "status": "ok"} for r in rows]).to_csv(cpu / "rows.csv", index=False)
    assert "memory.png" not in [p.name for p in write_reports(cpu)]
    assert "Peak memory" not in (cpu / "tables.md").read_text()


def test_rows_carry_the_boards_power_clock_and_tflops_per_watt(tmp_path, monkeypatch):
    """Where the benchmark read the board (NVML, on a GPU), each row keeps the rounds' median power and SM clock
    and TFLOPS per watt; where it did not (CPU), the columns stay empty."""
    readings = iter([600.0, 700.0, 650.0] * 8)

    def fake_benchmark(fn, *, device="cuda", warmup_ms=25, rep_ms=100):
        fn()
        return timing_mod.Timing(1.0, 2.0, 3.0, next(readings), 1755.0)

    monkeypatch.setattr(timing_mod, "benchmark", fake_benchmark)
    out = tmp_path / "p"
    res = run(["sweep", *SMALL, "--causal", "false", "--rounds", "3", "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "rows.csv")
    assert len(df) == 2 and (df.power_w == 650.0).all() and (df.sm_clock_mhz == 1755).all()
    assert ((df.tflops_per_w - df.tflops / 650.0).abs() < 1e-9).all()
    monkeypatch.undo()
    res = run(["sweep", *SMALL, "--causal", "false", "--out", str(tmp_path / "cpu")])
    df = pd.read_csv(tmp_path / "cpu" / "rows.csv")
    assert df.power_w.isna().all() and df.tflops_per_w.isna().all()
