"""The environment a result was measured in: GPU, clocks, driver and library versions, git state."""
from __future__ import annotations

import datetime
import json
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _git() -> dict:
    """Commit and dirty flag of the tree. Where the tree travelled (a GPU machine running a copy),
    GLUON_ATTN_GIT_COMMIT / GLUON_ATTN_GIT_DIRTY carry what the sender's checkout said and win."""
    import os

    if os.environ.get("GLUON_ATTN_GIT_COMMIT"):
        # Set by whoever sent the tree: a copied .git may be stale there (seen: a copy's git metadata
        # named an older commit than the files it held).
        dirty = os.environ.get("GLUON_ATTN_GIT_DIRTY", "").lower() in ("1", "true", "yes")
        return {"git_commit": os.environ["GLUON_ATTN_GIT_COMMIT"], "git_dirty": dirty}
    commit = _run(["git", "rev-parse", "HEAD"], REPO_ROOT)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], REPO_ROOT)
    dirty = bool(status) if status is not None else None
    return {"git_commit": commit, "git_dirty": dirty}


_SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem",
               "power.limit", "temperature.gpu")


def _nvidia_smi(index: int) -> dict:
    out = _run(["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(_SMI_FIELDS)}",
                "--format=csv,noheader,nounits"])
    if not out:
        return {}
    values = [v.strip() for v in out.splitlines()[0].split(",")]
    return {f"smi.{k}": v for k, v in zip(_SMI_FIELDS, values)}


# The optional peers' packages (``pip install -e ".[peers]"``) and what they run on.
PEER_PACKAGES = ("flash-attn-4", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13",
                 "quack-kernels", "apache-tvm-ffi")


def _package_versions() -> dict:
    import importlib.metadata

    versions = {}
    for name in PEER_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _ptxas_sm90a() -> dict:
    """The ptxas that assembles the sm_90a kernels (``kernels/toolchain.py``: the wheel's CUDA 12.9 ``ptxas``, or
    the one a user names in TRITON_PTXAS_BLACKWELL_PATH): its release line and path."""
    from ..kernels import toolchain

    try:
        path = toolchain.sm90a_ptxas()
    except Exception:  # a Triton without these knobs (or none): the problem is recorded beside
        return {"ptxas_sm90a": None, "ptxas_sm90a_path": None}
    out = _run([path, "--version"]) if path else None
    release = next((line.split("tools, ", 1)[-1] for line in (out or "").splitlines() if "release" in line), None)
    return {"ptxas_sm90a": release, "ptxas_sm90a_path": path}


def _triton() -> dict:
    """The Triton this process imports (version, the folder it came from), the sm_90a ptxas, and
    ``toolchain.triton_problem()``: why it cannot build the kernels, None when it is the one they need."""
    import os

    from ..kernels.toolchain import triton_problem

    try:
        import triton
    except ImportError:
        info = {"triton": None, "triton_path": None}
    else:
        info = {"triton": triton.__version__, "triton_path": os.path.dirname(os.path.abspath(triton.__file__))}
    info.update(_ptxas_sm90a())
    info["triton_problem"] = triton_problem()
    return info


def collect_env(command_line: Optional[list[str]] = None) -> dict:
    env = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        **_triton(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "command": shlex.join(command_line if command_line is not None else sys.argv),
    }
    env["packages"] = _package_versions()
    env.update(_git())
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        env.update({
            "gpu": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "l2_cache_mb": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
        })
        env.update(_nvidia_smi(idx))
        env["driver"] = env.get("smi.driver_version")
    else:
        env.update({"gpu": None, "compute_capability": None, "sm_count": None, "driver": None})
    return env


def write_env(path: Path, command_line: Optional[list[str]] = None) -> dict:
    env = collect_env(command_line)
    path.write_text(json.dumps(env, indent=2) + "\n")
    return env
