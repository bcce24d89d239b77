"""Profiler views on CPU: command parsing, config validity, tuning tables, trace-to-table mapping."""
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gluon_attn.cli import main
from gluon_attn.kernels import tuning
from gluon_attn.problem import Problem
from gluon_attn.profiler import classify, kernel_table, list_configs, select_configs

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "h200-trace-events.json").read_text())


def run(*args):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_configs_valid_ones_pass_the_kernels_own_checks(arch):
    p = Problem(4, 32, 8192, 128, False, "fp16")
    rows = list_configs(p, arch, include_invalid=True)
    valid = [r for r in rows if r["valid"]]
    invalid = [r for r in rows if not r["valid"]]
    assert valid and invalid
    for r in valid:
        assert r["_config"].invalid_reasons(128, "fp16") == []
    for r in invalid:
        assert r["reason"] and r["reason"] == "; ".join(r["_config"].invalid_reasons(128, "fp16"))
    assert rows.index(invalid[0]) > rows.index(valid[-1])  # valid first


def test_configs_exclusion_reasons_name_the_limit():
    rows = list_configs(Problem(1, 1, 1024, 128, False, "fp16"), "sm_90a", include_invalid=True)
    reasons = " ".join(r["reason"] for r in rows)
    assert "shared memory" in reasons and "registers" in reasons
    rows = list_configs(Problem(1, 1, 1024, 128, False, "fp16"), "sm_100a", include_invalid=True)
    assert "tensor memory" in " ".join(r["reason"] for r in rows)


def test_configs_cli_formats_and_limits():
    res = run("configs", "--arch", "sm_90a", "--head-dim", "64", "--format", "json", "--max-configs", "3")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output[res.output.index("["):])
    assert len(rows) == 3 and all(r["valid"] for r in rows) and "schedule" in rows[0]
    res = run("configs", "--arch", "sm_100a", "--all", "--format", "csv")
    assert res.exit_code == 0 and "False" in res.output and "backend,config" in res.output
    res = run("configs", "--arch", "sm_90a", "--format", "md", "--max-configs", "2")
    assert res.exit_code == 0 and "| backend | config |" in res.output
    res = run("configs", "--arch", "sm_90a", "--max-configs", "2")  # rich table (or plain without rich)
    assert res.exit_code == 0 and "hopper" in res.output


def test_configs_cli_rejects_bad_input():
    assert run("configs", "--arch", "sm_80").exit_code != 0
    res = run("configs", "--arch", "sm_90a", "--n-ctx", "0")
    assert res.exit_code != 0
    res = run("configs", "--arch", "sm_90a", "--format", "xml")
    assert res.exit_code != 0 and "md" in res.output


@pytest.mark.parametrize("causal", [False, True])
def test_configs_of_the_192_128_pair_are_the_ones_its_launches_take(causal):
    """``--head-dim-v``: the pair's backward configs are checked with v's head dim (its own 32-query units valid, as
    for no other head dims) and the default among them; its forward configs are PAIR_TILE's blocks, as a dense launch
    of the pair takes; 192/192 keeps D=256's; a pair the kernels do not take is refused naming the one they do; the
    rows' config column (the provider's label) names the config the pair runs."""
    from gluon_attn.bench.gluon_providers import _config_label
    from gluon_attn.kernels import hopper_bwd_host

    flag = "--causal" if causal else "--no-causal"
    out = run("configs", "--arch", "sm_90a", "--head-dim", "192", "--head-dim-v", "128", "--pass", "bwd", flag,
              "--format", "json").output
    bwd = json.loads(out[out.index("["):])
    default = hopper_bwd_host.default_config(192, "fp16", causal, 8192, 128)
    assert default.label() in [r["config"] for r in bwd] and {r["block_m"] for r in bwd} == {32, 64}
    assert all(r["_config"].invalid_reasons(192, "fp16", 128) == [] for r in
               list_configs(Problem(4, 32, 8192, 192, causal, "fp16", HEAD_DIM_V=128, pass_name="bwd"), "sm_90a"))
    same = list_configs(Problem(4, 32, 8192, 192, causal, "fp16", pass_name="bwd"), "sm_90a")
    assert same and {r["_config"].BLOCK_M for r in same} == {64}
    out = run("configs", "--arch", "sm_90a", "--head-dim", "192", "--head-dim-v", "128", flag, "--format",
              "json").output
    fwd = json.loads(out[out.index("["):])
    assert fwd and all(r["config"].endswith("_pair") for r in fwd)
    assert not any(r["config"].endswith("_pair") for r in list_configs(Problem(4, 32, 8192, 192, causal, "fp16"),
                                                                        "sm_90a"))
    bad = run("configs", "--arch", "sm_90a", "--head-dim", "128", "--head-dim-v", "64")
    assert bad.exit_code != 0 and "192/128" in bad.output
    bad = run("configs", "--arch", "sm_100a", "--head-dim", "192", "--head-dim-v", "128")
    assert bad.exit_code != 0 and "sm_100a" in bad.output
    assert _config_label(Problem(4, 32, 8192, 192, causal, "fp16", HEAD_DIM_V=128, pass_name="bwd")) == default.label()
    assert _config_label(Problem(4, 32, 8192, 192, causal, "fp16", HEAD_DIM_V=128)).endswith("_pair")


def test_a_config_variant_provider_labels_its_rows_with_its_own_config():
    """``config_variant`` (a knob's A/B provider): the rows' config column names the variant's config, not gluon's
    default (run 247's PINGPONG and DYNAMIC rows of the pair read BM128_S2)."""
    import dataclasses

    from gluon_attn.bench.gluon_providers import GLUON, config_variant
    from gluon_attn.kernels import hopper_host

    p = Problem(4, 32, 8192, 192, True, "bf16", HEAD_DIM_V=128)
    pair = hopper_host.pair_config(hopper_host.default_config(192, "bf16", True), 192, 128)
    variant = config_variant("gluon-test-pp", "test", "test", lambda q, dtype: dataclasses.replace(pair, PINGPONG=True))
    assert variant.config_fn(p) == "BM128_S2_pp_pair" and GLUON.config_fn(p) == "BM128_S2_pair"


def test_a_backward_config_variant_runs_its_config_in_the_backward_passes_only():
    """``bwd_config_variant`` (a backward knob's A/B without a copy of the tree): its own backward call, its config in
    the rows, and the passes and problems it takes (dense 16-bit backward passes) named where it refuses."""
    import dataclasses

    from gluon_attn.bench.gluon_providers import GLUON, bwd_config_variant
    from gluon_attn.kernels import hopper_bwd_host

    def flipped(q, dtype):
        cfg = hopper_bwd_host.default_config(192, dtype, q.causal, q.N_CTX, 128)
        return dataclasses.replace(cfg, DQ_FRAG=not cfg.DQ_FRAG)

    variant = bwd_config_variant("gluon-test-frag", "test", "test", flipped)
    bwd = Problem(4, 32, 8192, 192, True, "fp16", HEAD_DIM_V=128, pass_name="bwd")
    assert variant.backward_runner is not None and GLUON.backward_runner is None
    assert variant.config_fn(bwd) == "bwd_BM32_Q3_FR" and GLUON.config_fn(bwd) == "bwd_BM32_Q3"
    assert variant.rule(bwd, (9, 0)) is None
    assert "passes bwd and fwd+bwd" in variant.rule(dataclasses.replace(bwd, pass_name="fwd"), (9, 0))
    assert "dense 16-bit" in variant.rule(Problem(1, 32, 8192, 128, True, "fp16", varlen="uniform", pass_name="bwd"),
                                          (9, 0))


def test_head_dim_v_is_refused_where_a_command_has_no_pair():
    """--na problems have v's head dim equal to q's; optimize --install would key the pair's winner by q's head dim
    (192/192 would take it): both refused before any GPU work, naming why; profile takes the option."""
    res = run("configs", "--na", "--token-layout", "64,64", "--window", "7,7", "--head-dim", "64", "--head-dim-v", "32")
    assert res.exit_code != 0 and "--head-dim-v" in res.output
    res = run("optimize", "--head-dim", "192", "--head-dim-v", "128", "--install")
    assert res.exit_code != 0 and "keyed by q's head dim" in res.output
    res = run("profile", "--head-dim", "192", "--head-dim-v", "128")
    assert "no such option" not in res.output


def test_tuning_table_lookup_and_save(tmp_path):
    assert tuning.class_key(64, "bf16", True) == tuning.class_key(64, "fp16", True) == "D64-16bit-causal-long"
    assert tuning.class_key(64, "fp8e5", False, 1024) == "D64-fp8-noncausal-short"
    assert tuning.lookup("sm_90a", 64, "fp16", False, directory=tmp_path) is None  # never tuned
    tuning.save("sm_90a", 64, "fp16", False, {"KV_STAGES": 3, "PINGPONG": True}, {"tflops": 1.0},
                n_ctx=16384, directory=tmp_path)
    assert tuning.lookup("sm_90a", 64, "bf16", False, 4096, directory=tmp_path) == {"KV_STAGES": 3, "PINGPONG": True}
    assert tuning.lookup("sm_90a", 64, "fp16", False, 1024, directory=tmp_path) is None  # short: not measured
    assert tuning.lookup("sm_90a", 64, "fp16", True, directory=tmp_path) is None
    # Beyond 16384 keys a class's own "xlong" entry, else its "long" one.
    assert tuning.class_key(64, "fp16", False, 32768) == "D64-16bit-noncausal-xlong"
    assert tuning.lookup("sm_90a", 64, "fp16", False, 65536, directory=tmp_path) == {"KV_STAGES": 3, "PINGPONG": True}
    tuning.save("sm_90a", 64, "fp16", False, {"KV_STAGES": 2}, {"tflops": 1.0}, n_ctx=32768, directory=tmp_path)
    assert tuning.lookup("sm_90a", 64, "fp16", False, 65536, directory=tmp_path) == {"KV_STAGES": 2}
    assert tuning.lookup("sm_90a", 64, "fp16", False, 16384, directory=tmp_path) == {"KV_STAGES": 3, "PINGPONG": True}


def test_committed_sm90_table_drives_the_defaults():
    from gluon_attn.kernels import hopper_bwd_host
    from gluon_attn.kernels.hopper_host import HopperConfig, default_config
    entries = tuning.load("sm_90a")
    seed = {f"D{d}-{kind}-{mode}-long" for d in (64, 128) for kind in ("16bit", "fp8")
            for mode in ("causal", "noncausal")}
    assert seed <= set(entries)  # the seed grid's classes, measured at N_CTX=8192
    for key, entry in entries.items():
        pass_name, (d, kind, mode, bucket) = ("bwd", key.split("-")[1:]) if key.startswith("bwd-") \
            else ("fwd", key.split("-"))
        dtype = "fp8e4m3" if kind == "fp8" else "fp16"
        assert bucket in ("long", "xlong")
        n = int(entry["measured"]["problem"].split("N_CTX=")[1].split()[0])  # (a key is its measurement's class)
        assert tuning.class_key(int(d[1:]), dtype, mode == "causal", n, pass_name) == key
        assert key not in seed or n == 8192
        if pass_name == "fwd":
            assert default_config(int(d[1:]), dtype, mode == "causal", n) == HopperConfig(**entry["config"])
        else:
            assert hopper_bwd_host.default_config(int(d[1:]), dtype, mode == "causal", n) == \
                hopper_bwd_host.HopperBwdConfig(**entry["config"])
        assert entry["measured"]["tflops"] > 0
    # Extra-long contexts: fp16 D=128 has its own entries (the dynamic scheduler; causal runs it from
    # 4096 keys on, non-causal only beyond 16384), as does fp8 D=128 non-causal (static up to 16384
    # keys, dynamic beyond: steady-state variants, NOTES v30); the others take their
    # long entry.
    for causal in (False, True):
        assert default_config(128, "fp16", causal, 65536).DYNAMIC
        assert default_config(128, "fp16", causal, 16384).DYNAMIC == causal
    assert [default_config(128, "fp8e4m3", False, n).DYNAMIC for n in (4096, 16384, 32768)] == [False, False, True]
    assert default_config(64, "fp16", False, 65536) == default_config(64, "fp16", False, 8192)
    # Short contexts were never tuned: the rule (two warpgroups, no ping-pong, deepest ring).
    short = default_config(128, "fp16", True, 1024)
    assert short.BLOCK_M == 128 and not short.PINGPONG and short.KV_STAGES == 2


def test_untuned_class_falls_back_to_the_rule():
    from gluon_attn.kernels.blackwell_host import default_config
    assert tuning.load("sm_100a") == {}
    cfg = default_config(128, "fp16", True)  # no sm_100a measurements: the rule, not a crash
    assert cfg.invalid_reasons(128, "fp16") == []


def test_trace_mapping_on_recorded_events():
    events = [e for evs in FIXTURE["providers"].values() for e in evs]
    rows = kernel_table(events, arch="sm_90a")
    assert rows[0]["framework"] == "gluon-attn" and rows[0]["kernel"] == "gluon_attention"
    frameworks = [r["framework"] for r in rows]
    assert {"cuDNN", "FlashAttention-2", "Triton (FlexAttention)"} <= set(frameworks)
    assert not any("Memset" in r["kernel"] for r in rows)  # memcpy/memset/sync filtered out
    others = rows[1:]
    assert [r["time_us"] for r in others] == sorted((r["time_us"] for r in others), reverse=True)
    fa2 = next(r for r in rows if r["framework"] == "FlashAttention-2")
    assert fa2["calls"] == 10 and fa2["avg_us"] == pytest.approx(fa2["time_us"] / 10, abs=0.1)


def test_select_configs_takes_names_from_the_full_space_in_order_and_refuses_others():
    p = Problem(4, 32, 8192, 128, True, "fp16", pass_name="bwd")
    names = [r["config"] for r in list_configs(p, "sm_90a")]
    picked = select_configs(p, "sm_90a", [names[3], names[0]])
    assert [c.describe()["config"] for c in picked] == [names[3], names[0]]
    assert picked[0] != picked[1]
    with pytest.raises(ValueError, match=f"bwd_BM999.*valid: {names[0]}"):
        select_configs(p, "sm_90a", ["bwd_BM999", names[0]])


def test_classify_prefers_exact_names_of_our_kernels():
    assert classify("cutlass_gluon_attention")[0] == "gluon-attn"
    assert classify("cutlass_something_else")[0] != "gluon-attn"
    assert classify("triton_poi_fused_add_0")[0] == "Triton (torch.compile)"


def test_profile_and_optimize_need_a_gpu_and_say_so():
    import torch
    if torch.cuda.is_available():
        pytest.skip("checks the message shown without a GPU")
    res = run("profile", "--provider", "gluon")
    assert res.exit_code != 0 and "CUDA GPU" in res.output
    res = run("optimize", "--head-dim", "64")
    assert res.exit_code != 0 and "configs --arch" in res.output
    assert run("profile", "--provider", "nope").exit_code != 0


def test_plot_command_from_a_results_folder(tmp_path):
    import shutil
    src = Path("results/h100-run-100-peers/sweep")
    for f in ("rows.csv",):
        shutil.copy(src / f, tmp_path / f)
    res = run("plot", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert (tmp_path / "tflops.png").stat().st_size > 10000 and (tmp_path / "speedup.png").exists()
    assert (tmp_path / "speedup-vs-peer.png").exists()
    assert "Attention Z=4 H=32 D=128 causal=True" in (tmp_path / "tables.md").read_text()
    assert run("plot", str(tmp_path / "missing")).exit_code != 0


def test_tables_fall_back_to_plain_text_without_rich(monkeypatch):
    import sys

    from gluon_attn.tables import render
    rows = [{"kernel": "gluon_attention", "calls": 10}]
    assert "┃" in render(rows) or "|" in render(rows)
    monkeypatch.setitem(sys.modules, "rich.console", None)
    monkeypatch.setitem(sys.modules, "rich.table", None)
    plain = render(rows)
    assert "┃" not in plain and "gluon_attention" in plain.splitlines()[-1] and "kernel" in plain


@pytest.mark.gpu
def test_optimize_times_each_config_in_every_round_and_records_the_winner(tmp_path):
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU (the sm_90a kernel)")
    import gluon_attn.kernels.tuning
    from gluon_attn.kernels.hopper_host import HopperConfig
    from gluon_attn.profiler import optimize
    p = Problem(1, 8, 1024, 64, True, "fp16")
    configs = [HopperConfig(KV_STAGES=2), HopperConfig(KV_STAGES=3)]
    package_table = Path(gluon_attn.kernels.tuning.table_path("sm_90a"))
    before = package_table.read_bytes()
    summary = optimize(p, configs=configs, rounds=3, rep_ms=10, warmup_ms=5, progress=False, out_dir=tmp_path)
    assert package_table.read_bytes() == before and "installed" not in summary  # only --install writes it
    assert (tmp_path / "optimize.csv").read_text().count("\n") == 3  # header + two configs
    ok = [r for r in summary["results"] if r["status"] == "ok"]
    assert len(ok) == 2 and all(r["rounds"] == 3 for r in ok)
    assert ok[0]["p50_ms"] <= ok[1]["p50_ms"] and summary["best"] is ok[0]
    table = json.loads(Path(summary["table"]).read_text())
    (entry,) = table["entries"].values()
    assert entry["config"]["KV_STAGES"] == ok[0]["_config"].KV_STAGES
