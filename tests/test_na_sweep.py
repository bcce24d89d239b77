"""``sweep --na`` on CPU: NATTEN's vocabulary on the command line, a row per (problem, provider) with the attended
pairs and the speedup over the fastest dense provider of the same run, the accuracy gate on sampled rows (a wrong
provider is caught), unsupported providers naming why, and resume."""
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from gluon_attn.bench import neighborhood as na_bench
from gluon_attn.cli import main
from gluon_attn.neighborhood import attended_pairs, neighborhood

ARGS = ["sweep", "--na", "--token-layout", "97;12x10", "--window", "7;5x3", "-Z", "1", "-H", "2", "--head-dim", "64",
        "--warmup-ms", "1", "--rep-ms", "3"]


def run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_na_rows_carry_the_pattern_the_pairs_and_the_speedup_over_dense(tmp_path):
    res = run([*ARGS, "--providers", "math,dense-math,gluon,flex", "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "r" / "rows.csv", keep_default_na=False)
    # 97 with window 7; 12x10 with windows 7 (every dimension) and 5x3: the 1-D window does not meet the 2-D layout
    assert sorted(set(zip(df.token_layout.astype(str), df.window.astype(str)))) == [("12x10", "5x3"), ("12x10", "7x7"),
                                                                                     ("97", "7")]
    ok = df[df.provider.isin(["math", "dense-math"])]
    assert (ok.status == "ok").all() and (ok.speedup_vs_dense.astype(float) > 0).all()
    assert (df[df.provider == "dense-math"].speedup_vs_dense.astype(float) == 1.0).all()
    one_d = df[(df.token_layout.astype(str) == "97") & (df.provider == "math")].iloc[0]
    assert int(one_d.attended_pairs) == attended_pairs(neighborhood((97,), 7)) == 97 * 7
    unsupported = df[df.provider.isin(["gluon", "flex"])]
    assert (unsupported.status == "unsupported").all()
    assert unsupported.message.str.contains("sm_90a|CUDA|1-D layouts").all()
    assert "speedup vs dense" in (tmp_path / "r" / "tables.md").read_text()
    # ours carries its plan (the default tiles and configs --na's bound) even where it cannot run; the others none
    gluon = df[df.provider == "gluon"].set_index("token_layout")
    assert gluon.loc["97", "tiles"] == "128/128" and float(gluon.loc["97", "bound"]) == round(97 ** 2 / 128 ** 2, 3)
    assert (df[df.provider != "gluon"].tiles == "").all() and (df[df.provider != "gluon"].bound == "").all()
    assert set(df.timing) == {"eager"} and "(eager timing)" in (tmp_path / "r" / "tables.md").read_text()
    res = run([*ARGS, "--providers", "math,dense-math", "--out", str(tmp_path / "r"), "--resume"])
    assert res.exit_code == 0 and len(pd.read_csv(tmp_path / "r" / "rows.csv")) == len(df)  # nothing new


def test_na_gate_catches_a_wrong_provider(tmp_path, monkeypatch):
    def wrong(p, q, k, v):
        return lambda: torch.zeros(*q.shape[:-1], v.shape[-1])
    monkeypatch.setitem(na_bench.PROVIDERS, "math", wrong)
    res = run([*ARGS[:3], "97", "--window", "7", *ARGS[6:], "--providers", "math,dense-math", "--out",
               str(tmp_path / "w")])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "w" / "rows.csv", keep_default_na=False)
    assert df[df.provider == "math"].status.tolist() == ["wrong"]
    assert df[df.provider == "dense-math"].status.tolist() == ["ok"]


def test_na_sweep_refuses_what_natten_refuses(tmp_path):
    res = CliRunner().invoke(main, ["sweep", "--na", "--token-layout", "64", "--window", "8", "--stride", "9",
                                    "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "`stride` cannot be larger than `kernel_size`" in res.output
    res = CliRunner().invoke(main, ["sweep", "--na", "--token-layout", "64", "--out", str(tmp_path / "y")])
    assert res.exit_code != 0 and "--na needs --token-layout and --window" in res.output
    res = CliRunner().invoke(main, ["sweep", "--na", "--token-layout", "64", "--window", "8", "--providers", "nat",
                                    "--out", str(tmp_path / "z")])
    assert res.exit_code != 0 and "unknown --na providers ['nat']" in res.output
    res = CliRunner().invoke(main, ["sweep", "--na", "--token-layout", "64", "--window", "8", "--gpus", "2",
                                    "--varlen", "uniform", "--out", str(tmp_path / "g")])
    assert res.exit_code != 0 and "not with --gpus, --varlen" in res.output
    res = CliRunner().invoke(main, ["sweep", "--na", "--token-layout", "64", "--window", "8", "--pass", "back",
                                    "--out", str(tmp_path / "p")])
    assert res.exit_code != 0 and "--pass ['back']: one of fwd, bwd, fwd+bwd" in res.output
    res = CliRunner().invoke(main, ["sweep", "--timing", "graph", "--out", str(tmp_path / "t")])
    assert res.exit_code != 0 and "--timing graph replays CUDA graphs: it needs a CUDA GPU" in res.output
    if not torch.cuda.is_available():
        res = run([*ARGS, "--timing", "graph", "--providers", "math", "--out", str(tmp_path / "c")])
        assert res.exit_code != 0 and "--timing graph replays CUDA graphs: it needs a CUDA GPU" in res.output
        for args in (["sweep"], ARGS):
            res = run([*args, "--timing", "kernel", "--providers", "math", "--out", str(tmp_path / "k")])
            assert res.exit_code != 0 and "--timing kernel profiles the kernels on the GPU: it needs a CUDA GPU" \
                in res.output
    with pytest.raises(ValueError, match="expected 1-3 integers per value"):
        na_bench.parse_dims_list("a;b", "--window")


def test_na_backward_passes_gate_the_gradients_and_count_their_flops(tmp_path, monkeypatch):
    """--pass bwd and fwd+bwd: autograd through each neighborhood provider (the dense ones time their own backward);
    the gate compares dQ at the sampled query rows and dK, dV at the sampled keys with fp32 gradients; FLOPs are 2.5x
    and 3.5x the forward's; a wrong gradient is caught."""
    res = run([*ARGS[:3], "97;12x10", "--window", "7;5x3", *ARGS[6:], "--pass", "fwd,bwd,fwd+bwd", "--providers",
               "math,dense-math", "--out", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "b" / "rows.csv", keep_default_na=False)
    assert sorted(set(df["pass"])) == ["bwd", "fwd", "fwd+bwd"] and (df.status == "ok").all(), df.message.tolist()
    assert "pass bwd" in (tmp_path / "b" / "tables.md").read_text()
    one = df[(df.token_layout.astype(str) == "97") & (df.provider == "math")].set_index("pass")
    fwd_work = one.tflops.astype(float) * one.p50_ms.astype(float)  # FLOPs / 1e9, whatever the time
    assert abs(fwd_work["bwd"] / fwd_work["fwd"] - 2.5) < 1e-6 and abs(fwd_work["fwd+bwd"] / fwd_work["fwd"] - 3.5) < 1e-6

    real = na_bench._reference_grads

    def wrong_dk(p, q, k, v, do, rows, keys, dense, chunk=256):
        dq, dk, dv = real(p, q, k, v, do, rows, keys, dense, chunk)
        return (dq, dk * 1.5, dv) if not dense else (dq, dk, dv)
    monkeypatch.setattr(na_bench, "_reference_grads", wrong_dk)
    res = run([*ARGS[:3], "97", "--window", "7", *ARGS[6:], "--pass", "bwd", "--providers", "math,dense-math",
               "--out", str(tmp_path / "w")])
    df = pd.read_csv(tmp_path / "w" / "rows.csv", keep_default_na=False)
    assert df.set_index("provider").status.to_dict() == {"math": "wrong", "dense-math": "ok"}
    assert "dk:" in df[df.provider == "math"].message.iloc[0]


def test_reference_gradients_equal_autograd_of_the_explicit_mask():
    """``_reference_grads`` (dQ from each sampled row's softmax, dK and dV from every query in chunks) against
    autograd through ``na_reference`` on a small 2-D pattern with GQA."""
    from gluon_attn.neighborhood import na_reference
    nb = neighborhood((9, 11), (5, 3), (2, 1), (1, 2), (True, False))
    p = na_bench.NAProblem(2, 4, 2, 16, "fp16", nb, "bwd")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 9, 11, h, 16, generator=gen) for h in (4, 2, 2))
    do = torch.randn(2, 9, 11, 4, 16, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    na_reference(*leaves, (5, 3), (2, 1), (1, 2), (True, False)).backward(do)
    rows = torch.tensor([0, 5, 17, 50, 98])
    dq, dk, dv = na_bench._reference_grads(p, q, k, v, do, rows, rows, dense=False, chunk=7)
    flat = na_bench._flat
    torch.testing.assert_close(dq, flat(leaves[0].grad)[:, :, rows], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dk, flat(leaves[1].grad)[:, :, rows], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dv, flat(leaves[2].grad)[:, :, rows], atol=1e-4, rtol=1e-4)


def test_optimize_na_needs_a_hopper_gpu_and_naming_it(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without an H100/H200")
    res = CliRunner().invoke(main, ["optimize", "--na", "--token-layout", "64", "--window", "8", "--out",
                                    str(tmp_path / "o")])
    assert res.exit_code != 0 and "optimize --na times the sm_90a kernels: it needs an H100 or H200" in res.output
    res = CliRunner().invoke(main, ["optimize", "--na", "--window", "8"])
    assert res.exit_code != 0 and "--na needs --token-layout and --window" in res.output


def test_optimize_na_configs_refuses_a_pair_the_kernel_does_not_take(tmp_path):
    """--configs with --na names tile pairs as configs --na lists them; an unknown one is refused before any GPU is
    needed, naming pairs the kernel takes."""
    res = CliRunner().invoke(main, ["optimize", "--na", "--token-layout", "30,48,80", "--window", "18,24,24",
                                    "--head-dim", "128", "--dtype", "bf16", "--configs", "2x8x8/3x3x3",
                                    "--out", str(tmp_path / "o")])
    assert res.exit_code != 0
    assert "takes no tile pair 2x8x8/3x3x3" in res.output and "2x8x8/2x8x8" in res.output, res.output
    if not torch.cuda.is_available():  # a pair it takes passes the names' check and meets the GPU's
        res = CliRunner().invoke(main, ["optimize", "--na", "--token-layout", "30,48,80", "--window", "18,24,24",
                                        "--head-dim", "128", "--dtype", "bf16", "--configs", "2x8x8/1x4x32",
                                        "--out", str(tmp_path / "o")])
        assert res.exit_code != 0 and "it needs an H100 or H200" in res.output, res.output


def test_na_rows_carry_the_boards_readings(tmp_path, monkeypatch):
    """Power, SM clock and TFLOPS per watt, as the dense sweep's rows (``timing.BoardSampler``; faked here)."""
    from gluon_attn.bench import timing as timing_mod

    def fake_benchmark(fn, *, device="cuda", warmup_ms=25, rep_ms=100):
        fn()
        return timing_mod.Timing(1.0, 2.0, 3.0, 500.0, 1600.0)

    monkeypatch.setattr(timing_mod, "benchmark", fake_benchmark)
    res = run(["sweep", "--na", "--token-layout", "97", "--window", "7", "-Z", "1", "-H", "2", "--head-dim", "64",
               "--providers", "math,dense-math", "--out", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "b" / "rows.csv")
    assert (df.power_w == 500.0).all() and (df.sm_clock_mhz == 1600).all()
    assert ((df.tflops_per_w - df.tflops / 500.0).abs() < 1e-12).all()


def test_na_tables_show_our_plan_bound_and_the_share_of_it_reached():
    """The table puts the measured speedup beside the bound of the tiles the call took (the tiles issue's check:
    >= 0.6 of the bound), for ours only."""
    from gluon_attn.bench.neighborhood import NAProblem, gluon_plan, na_tables
    plan = gluon_plan(NAProblem(16, 4, 4, 64, "fp16", neighborhood((56, 56), 7)))
    # (halo boxes: the forward's walk; 64-position query boxes, two programs an SM, NOTES v108)
    assert plan == {"tiles": "8x8/8x16", "bound": 12.25}
    assert gluon_plan(NAProblem(1, 2, 2, 64, "fp16", neighborhood((56, 56), 7), "fwd+bwd")) == {}
    key = dict(B=16, H=4, H_KV=4, HEAD_DIM=64, dtype="fp16", token_layout="56x56", window="7x7", stride="1x1",
               dilation="1x1", causal_dims="0x0", timing="graph", message="")
    df = pd.DataFrame([{**key, "pass": "fwd", "provider": "gluon", "p50_ms": 0.105, "tflops": 24.0,
                        "speedup_vs_dense": 3.437, "status": "ok", **plan},
                       {**key, "pass": "fwd", "provider": "dense-gluon", "p50_ms": 0.384, "tflops": 420.1,
                        "speedup_vs_dense": 1.0, "status": "ok", "tiles": "", "bound": ""}])
    text = na_tables(df)
    assert "| provider | ms | TFLOPS | speedup vs dense | tiles | bound | of bound | status |" in text
    assert "| gluon | 0.105 | 24.0 | 3.44x | 8x8/8x16 | 12.25x | 0.28 | ok |" in text  # (3.437 / 12.25)
    assert "| dense-gluon | 0.384 | 420.1 | 1.00x |  |  |  | ok |" in text
