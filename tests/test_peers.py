"""The peer providers' registry entries, support rules and missing-package path (CPU only)."""
import dataclasses
import json

import pandas as pd
import pytest
from click.testing import CliRunner

from gluon_attn.bench import providers
from gluon_attn.bench.providers import PEERS_INSTALL_HINT, get_provider
from gluon_attn.bench.report import peer_frame, tables_markdown
from gluon_attn.bench.sweep import SweepSpec, run_sweep
from gluon_attn.cli import main
from gluon_attn.problem import Problem

H100 = (9, 0)
B200 = (10, 0)


def test_peers_are_registered_as_peers():
    for name in ("cudnn-fe", "fa4", "cudnn"):
        assert get_provider(name).peer, name
    for name in ("gluon", "fa2", "flex", "math"):
        assert not get_provider(name).peer, name
    assert get_provider("cudnn-fe").package == "nvidia-cudnn-frontend"
    assert get_provider("fa4").package == "flash-attn-4"
    assert {"fp16", "bf16", "fp8e4m3", "fp8e5"} <= set(get_provider("cudnn-fe").dtypes)


def test_fa4_fp8_is_blackwell_only_and_says_so():
    fp8 = Problem(1, 1, 64, 128, causal=False, dtype="fp8e4m3")
    s = get_provider("fa4").rule(fp8, H100)
    assert s and "sm_100" in s and "sm_90" in s
    assert get_provider("fa4").rule(fp8, B200) is None
    assert get_provider("fa4").rule(Problem(1, 1, 64, 128, causal=True), H100) is None
    wide = Problem(1, 1, 64, 256, causal=False, HEAD_DIM_V=128)
    assert "128" in get_provider("fa4").rule(wide, B200)
    assert get_provider("fa4").rule(wide, H100) is None  # sm_90 takes up to 256


def test_cudnn_fe_fp8_needs_hopper():
    fp8 = Problem(1, 1, 64, 64, causal=False, dtype="fp8e5")
    assert "sm_90" in get_provider("cudnn-fe").rule(fp8, (8, 0))
    assert get_provider("cudnn-fe").rule(fp8, H100) is None


def _fake_peer(module="gluon_attn_no_such_package.cute", package="no-such-package"):
    """The CPU oracle dressed as a peer whose optional package is missing."""
    return dataclasses.replace(get_provider("math"), name="ghost", module=module, package=package, peer=True)


def test_missing_package_is_unsupported_with_install_hint(monkeypatch):
    ghost = _fake_peer()
    monkeypatch.setitem(providers.PROVIDERS, "ghost", ghost)
    s = ghost.supports(Problem(1, 1, 16, 64, causal=False), None)
    assert not s.ok and "no-such-package is not installed" in s.reason and PEERS_INSTALL_HINT in s.reason
    with pytest.raises(RuntimeError, match="not installed"):
        from gluon_attn.problem import make_inputs
        ghost.prepare(make_inputs(Problem(1, 1, 16, 64, causal=False), "cpu", seed=1))
    row = ghost.describe(None)
    assert row["version"] == "no-such-package: not installed" and row["usable here"].startswith("no: ")


def test_broken_install_is_unsupported_not_a_crash(tmp_path, monkeypatch):
    (tmp_path / "broken_peer_mod.py").write_text("raise OSError('libcuda.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ghost = _fake_peer(module="broken_peer_mod", package="broken-peer")
    s = ghost.supports(Problem(1, 1, 16, 64, causal=False), None)
    assert not s.ok and "import broken_peer_mod failed" in s.reason and "libcuda" in s.reason


def test_sweep_with_a_missing_peer_records_unsupported_rows(tmp_path, monkeypatch):
    monkeypatch.setitem(providers.PROVIDERS, "ghost", _fake_peer())
    spec = SweepSpec(n_ctx=(16,), head_dims=(64,), causal=(False, True), dtypes=("fp16",), batch=1, heads=1,
                     providers=("math", "ghost"), warmup_ms=1, rep_ms=1)
    run_sweep(spec, tmp_path, progress=False)
    rows = pd.read_csv(tmp_path / "rows.csv")
    ghost = rows[rows.provider == "ghost"]
    assert len(ghost) == 2 and (ghost.status == "unsupported").all()
    assert ghost.message.str.contains("not installed").all()
    assert (rows[rows.provider == "math"].status == "ok").all()
    env = json.loads((tmp_path / "env.json").read_text())
    assert "flash-attn-4" in env["packages"] and "nvidia-cudnn-frontend" in env["packages"]


def test_providers_command_lists_every_provider():
    res = CliRunner().invoke(main, ["providers", "--format", "json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output[res.output.index("["):])
    names = [r["provider"] for r in rows]
    assert {"cudnn", "cudnn-fe", "fa4", "fa2", "flex", "gluon", "math"} <= set(names)
    by = {r["provider"]: r for r in rows}
    assert by["math"]["usable here"] == "yes"
    assert by["fa4"]["library"].startswith("FlashAttention-4") and by["fa4"]["peer"] == "yes"
    for r in rows:
        assert set(r) >= {"library", "version", "dtypes", "head dims", "archs", "features", "usable here"}
    plain = CliRunner().invoke(main, ["providers"]).output
    assert "cudnn-fe" in plain and "usable here" in plain


def _row(provider, dtype, tflops, n=4096, causal=False, status="ok", out_dtype=None):
    return dict(Z=4, H=32, N_CTX=n, HEAD_DIM=128, HEAD_DIM_V=None, causal=causal, dtype=dtype, provider=provider,
                label=provider, status=status, tflops=tflops if status == "ok" else None, message="",
                out_dtype=out_dtype or dtype)


def test_tables_rate_each_dtype_against_its_best_peer():
    df = pd.DataFrame([
        _row("cudnn", "fp16", 560.0), _row("fa4", "fp16", 600.0), _row("cudnn-fe", "fp16", 565.0),
        _row("gluon", "fp16", 606.0), _row("fa2", "fp16", 350.0),
        _row("cudnn-fe", "fp8e4m3", 900.0, out_dtype="fp8e4m3"), _row("gluon", "fp8e4m3", 810.0, out_dtype="fp16"),
        _row("fa4", "fp8e4m3", None, status="unsupported"), _row("cudnn", "fp8e4m3", None, status="unsupported"),
    ])
    frame = peer_frame(df).set_index(["provider", "dtype"])
    assert frame.loc[("gluon", "fp16"), "best_peer"] == "fa4"
    assert frame.loc[("gluon", "fp16"), "vs_peer"] == pytest.approx(606 / 600)
    # fp8 meets cuDNN's fp8 graph, never a 16-bit peer.
    assert frame.loc[("gluon", "fp8e4m3"), "best_peer"] == "cudnn-fe"
    assert frame.loc[("gluon", "fp8e4m3"), "vs_peer"] == pytest.approx(0.9)
    md = tables_markdown(df)
    header = next(line for line in md.splitlines() if line.startswith("| dtype |"))
    assert "gluon / best peer" in header and "gluon / cudnn fp16" in header and "fa2 / best peer" in header
    assert "cudnn-fe / best peer" not in header  # peers are what the others are rated against
    fp16 = next(line for line in md.splitlines() if line.startswith("| fp16 | 4096 |"))
    fp8 = next(line for line in md.splitlines() if line.startswith("| fp8e4m3 | 4096 |"))
    assert "| fa4 | 1.01x | 0.58x | 1.08x | 0.62x |" in fp16
    assert "| cudnn-fe | 0.90x |" in fp8 and "1.45x" in fp8  # secondary: 810 / cuDNN fp16 560
    assert "cudnn-fe fp8e4m3 writes fp8e4m3" in md and "gluon fp8e4m3 writes fp16" in md


def test_speedup_vs_peer_plot_is_written(tmp_path):
    from gluon_attn.bench.report import write_reports

    rows = [_row(p, "fp16", tf, n=n) for n in (1024, 4096) for p, tf in (("fa4", 500.0), ("gluon", 520.0))]
    pd.DataFrame(rows).to_csv(tmp_path / "rows.csv", index=False)
    written = {p.name for p in write_reports(tmp_path)}
    assert {"tables.md", "tflops.png", "speedup-vs-peer.png"} <= written
    assert (tmp_path / "speedup-vs-peer.png").stat().st_size > 1000
