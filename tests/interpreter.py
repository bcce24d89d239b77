"""Kernel tests on CPU: a script run in a fresh interpreter with TRITON_INTERPRET=1 (triton reads it at import, so it
cannot be switched on inside the test process)."""
import os
import subprocess
import sys


def run_interpreted(script: str, *args) -> None:
    """Run ``script`` with ``args`` under triton's interpreter; it passes by printing "ok" and exiting with 0."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
