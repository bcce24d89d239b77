"""What a user sees at the end of a run, checked in a subprocess on stderr: no nanobind leak report after Triton's IR
was built (a compile-only build), and `gluon-attn plot` on a folder whose rows.csv is not a sweep's says so in one
line."""
import os
import subprocess
import sys


def _run(code: str, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


def test_importing_and_compiling_a_kernel_leaves_no_leak_report(tmp_path):
    # (a cold Triton cache: a real compile, whose IR objects outlive what a cache hit makes)
    res = _run("import gluon_attn.kernels.hopper_bwd_host, gluon_attn.kernels.blackwell_host\n"
               "from gluon_attn.inspection import compile_build\n"
               "from gluon_attn.kernels.hopper_host import build, HopperConfig\n"
               "compile_build(build('fp16', 64, False, HopperConfig(), 'gluon_attention'), 'sm_90a')\n"
               "print('compiled')", TRITON_CACHE_DIR=str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "compiled" in res.stdout
    assert "nanobind" not in res.stderr and "leaked" not in res.stderr, res.stderr[-2000:]
    assert "TRITON_DEFAULT_FP_FUSION" not in res.stderr


def test_plot_on_rows_that_are_not_a_sweeps_says_so_in_one_line(tmp_path):
    (tmp_path / "rows.csv").write_text("kernel_name,p50_ms\ncutlass_x,1.0\n")
    res = subprocess.run([sys.executable, "-m", "gluon_attn.cli", "plot", str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 1
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "not a sweep's rows" in lines[0], res.stderr
    assert "Traceback" not in res.stderr
