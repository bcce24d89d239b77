"""experiments/generate_bench.py's CPU dry run (gluon falls back to SDPA there): a tiny model through every phase,
the implementations' timed generates interleaved, the tables written."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_run_times_both_implementations_in_turns_and_writes_the_tables(tmp_path):
    args = ["--device", "cpu", "--layers", "1", "--hidden", "32", "--intermediate", "64", "--heads", "2",
            "--kv-heads", "1", "--vocab", "50", "--prompt", "8", "--new", "3", "--batches", "1", "--prefill", "16",
            "--repeats", "3", "--out", str(tmp_path)]
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "generate_bench.py"), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads((tmp_path / "generate.json").read_text())
    decode = result["decode"]["1"]
    assert [len(decode[impl]["seconds"]) for impl in ("sdpa", "gluon")] == [3, 3]
    for impl in ("sdpa", "gluon"):
        assert decode[impl]["tokens_per_s"] == 3 / min(decode[impl]["seconds"])
        assert decode[impl]["tokens_per_s_median"] <= decode[impl]["tokens_per_s"]
    assert decode["gluon/sdpa"] == decode["gluon"]["tokens_per_s"] / decode["sdpa"]["tokens_per_s"]
    assert result["agreement"]["1"]["teacher_forced_top1"] == 1.0  # (the same SDPA underneath on the CPU)
    table = (tmp_path / "generate.md").read_text()
    assert "| (medians) |" in table and "| 16 |" in table
    alternating = decode["alternating"]
    # 3 new tokens a generate: the prefill, then 2 timed steps, one of each implementation; two generates
    assert [alternating[impl]["steps"] for impl in ("sdpa", "gluon")] == [2, 2]
    assert alternating["gluon/sdpa"] == alternating["sdpa"]["step_ms_median"] / alternating["gluon"]["step_ms_median"]
    assert "Alternating steps" in table


def test_the_alternating_processor_switches_the_implementation_before_every_step_and_times_the_one_that_ran():
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_bench", ROOT / "experiments" / "generate_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    class Model:
        impl = "a"

        def set_attn_implementation(self, name):
            self.impl = name

    model = Model()
    proc = bench._Alternate(model, ("a", "b"))
    ran = []
    for step in range(5):  # (the processor runs after each forward: the first after the prefill, which ran "a")
        ran.append(model.impl)
        proc(None, None)
    assert ran == ["a", "b", "a", "b", "a"]
    # each step timed under the implementation that ran it; the prefill not timed
    assert [len(proc.steps["a"]), len(proc.steps["b"])] == [2, 2]
