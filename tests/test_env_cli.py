import json

from click.testing import CliRunner

from gluon_attn.cli import main


def test_env_prints_what_env_json_records():
    res = CliRunner().invoke(main, ["env", "--json"])
    assert res.exit_code == 0
    env = json.loads(res.output)
    for key in ("torch", "triton", "cuda", "cudnn", "gpu", "compute_capability", "sm_count", "driver",
                "git_commit", "git_dirty", "command", "timestamp"):
        assert key in env
    assert env["triton"] == "3.6.0"
    plain = CliRunner().invoke(main, ["env"])
    assert plain.exit_code == 0 and "triton" in plain.output


def test_sender_commit_wins_over_a_copied_git(monkeypatch):
    from gluon_attn.bench import environment
    monkeypatch.setenv("GLUON_ATTN_GIT_COMMIT", "0123abc")
    monkeypatch.setenv("GLUON_ATTN_GIT_DIRTY", "0")
    assert environment._git() == {"git_commit": "0123abc", "git_dirty": False}
    monkeypatch.delenv("GLUON_ATTN_GIT_COMMIT")
    assert environment._git()["git_commit"] != "0123abc"
