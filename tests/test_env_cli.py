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
