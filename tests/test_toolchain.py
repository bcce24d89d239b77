"""The Triton the kernels need: a wrong one is named, with the recipe, by the first kernel call (not deep inside a
compile), and the package still imports under it."""
import os
import subprocess
import sys

import pytest
import torch
import triton

from gluon_attn import api
from gluon_attn.kernels import toolchain
from gluon_attn.kernels.toolchain import REQUIRED_TRITON, prepare_device, triton_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_required_triton_has_no_problem(monkeypatch):
    monkeypatch.setattr(triton, "__version__", REQUIRED_TRITON)
    assert triton_problem() is None
    toolchain.check_triton()
    prepare_device.__wrapped__(8)  # (not Hopper: nothing to switch)


def test_an_older_triton_is_named_with_the_recipe(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    problem = triton_problem()
    assert problem is not None
    assert "3.6.0" in problem and REQUIRED_TRITON in problem
    assert f"pip install triton=={REQUIRED_TRITON}" in problem and toolchain.RECIPE in problem
    assert os.path.dirname(os.path.dirname(triton.__file__)) in problem  # where it was imported from
    assert "\n" not in problem
    with pytest.raises(RuntimeError) as raised:
        prepare_device.__wrapped__(9)
    assert str(raised.value) == problem


def test_the_first_kernel_call_raises_it(monkeypatch):
    """api._capability (asked before any launch) runs prepare_device: on a wrong Triton it raises the problem
    instead of a compile error."""
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(toolchain, "prepare_device", prepare_device.__wrapped__)  # uncached, for this test only
    with pytest.raises(RuntimeError, match=r"needs triton 3\.9\.0; this Python imports triton 3\.6\.0"):
        api._capability.__wrapped__(0)


def test_the_recipe_is_where_the_message_points():
    heading = toolchain.RECIPE.split("'")[1]
    with open(os.path.join(ROOT, "docs", "usage.md")) as f:
        assert f"### {heading}\n" in f.read()


@pytest.mark.skipif(not os.environ.get("GLUON_ATTN_OTHER_TRITON"),
                    reason="GLUON_ATTN_OTHER_TRITON (a folder holding another Triton) not set")
def test_the_package_imports_under_another_triton():
    """With another Triton first on PYTHONPATH the package and its CLI import, and ``env`` names the problem on
    one line instead of a traceback."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ["GLUON_ATTN_OTHER_TRITON"], ROOT])}
    res = subprocess.run([sys.executable, "-c", "import gluon_attn, gluon_attn.cli; "
                          "from gluon_attn.kernels.toolchain import triton_problem; print(triton_problem())"],
                         env=env, capture_output=True, text=True, timeout=300, cwd="/")
    assert res.returncode == 0, res.stderr[-2000:]
    res = subprocess.run([sys.executable, "-m", "gluon_attn.cli", "env"], env=env, capture_output=True, text=True,
                         timeout=300, cwd="/")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stdout.startswith("PROBLEM: gluon-attn needs triton")


def test_each_target_is_assembled_by_its_ptxas():
    """sm_90a by the wheel's CUDA 12.9 ptxas (13.4's spills on these kernels: toolchain's docstring), sm_100a by its
    ptxas-blackwell, also after a Hopper process switched its own kernels to the 12.9 one; Triton's compile-cache
    key names the ptxas each used; the knob is as it was afterwards."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas, get_ptxas_version

    if toolchain._USER_PTXAS:
        pytest.skip("a ptxas named in TRITON_PTXAS_BLACKWELL_PATH is kept for every target")
    before = get_ptxas(90).path
    with knobs.nvidia.scope():
        for switched in (False, True):
            if switched:  # what prepare_device does in a process on a Hopper GPU
                knobs.nvidia.ptxas_blackwell = knobs.nvidia.ptxas.path
            with toolchain.ptxas_for(90):
                assert get_ptxas(90).path.endswith("/ptxas") and "12.9" in get_ptxas_version(90)
            with toolchain.ptxas_for(100):
                assert get_ptxas(100).path.endswith("/ptxas-blackwell") and "13." in get_ptxas_version(100)
    assert get_ptxas(90).path == before
