import json
import os

import triton
from click.testing import CliRunner

from gluon_attn.cli import main
from gluon_attn.kernels.toolchain import REQUIRED_TRITON


def _runner():
    try:
        return CliRunner(mix_stderr=False)  # click 8.1: stderr apart only when asked
    except TypeError:
        return CliRunner()  # click >= 8.2: always apart


def _env_json():
    res = _runner().invoke(main, ["env", "--json"])
    assert res.exit_code == 0, res.output
    return res, json.loads(res.stdout)


def test_env_prints_what_env_json_records():
    _, env = _env_json()
    for key in ("torch", "triton", "triton_path", "ptxas_sm90a", "ptxas_sm90a_path", "triton_problem", "cuda",
                "cudnn", "gpu", "compute_capability", "sm_count", "driver", "git_commit", "git_dirty", "command",
                "timestamp"):
        assert key in env
    # The Triton this process really imports, and where from.
    assert env["triton"] == triton.__version__
    assert env["triton_path"] == os.path.dirname(os.path.abspath(triton.__file__))
    assert (env["triton_problem"] is None) == (triton.__version__ == REQUIRED_TRITON)
    # The sm_90a ptxas: the wheel's own (CUDA 12.x), its release line recorded.
    assert env["ptxas_sm90a_path"].startswith(env["triton_path"])
    assert env["ptxas_sm90a"].startswith("release ")
    plain = CliRunner().invoke(main, ["env"])
    assert plain.exit_code == 0 and "triton" in plain.output and env["triton_path"] in plain.output


def test_env_names_a_triton_the_kernels_cannot_use(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    res, env = _env_json()
    problem = env["triton_problem"]
    assert env["triton"] == "3.6.0"
    assert "3.6.0" in problem and REQUIRED_TRITON in problem and "Triton 3.9 on the GPU machines" in problem
    assert f"PROBLEM: {problem}" in res.stderr
    plain = CliRunner().invoke(main, ["env"])
    assert plain.exit_code == 0 and plain.exception is None
    assert plain.output.splitlines()[0] == f"PROBLEM: {problem}" and "Traceback" not in plain.output


def test_sender_commit_wins_over_a_copied_git(monkeypatch):
    from gluon_attn.bench import environment
    monkeypatch.setenv("GLUON_ATTN_GIT_COMMIT", "0123abc")
    monkeypatch.setenv("GLUON_ATTN_GIT_DIRTY", "0")
    assert environment._git() == {"git_commit": "0123abc", "git_dirty": False}
    monkeypatch.delenv("GLUON_ATTN_GIT_COMMIT")
    assert environment._git()["git_commit"] != "0123abc"
