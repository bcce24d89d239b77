"""Per-arch tuning tables: the measured best config of each problem class, written by
``gluon-attn optimize`` and read by the kernels' ``default_config`` (classes never tuned fall back to
the kernel's rule)."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

TABLE_DIR = Path(__file__).resolve().parent.parent / "tuning"


SHORT_CONTEXT = 2048  # N_CTX up to this is "short": few K/V blocks per tile, per-tile costs dominate
# Above this "xlong": a class may have its own entry there, else its "long" one serves. (fp16 D=128
# causal gained 2-6% from the dynamic scheduler at 32768 and 65536, nothing at 16384 and below:
# NOTES v20.)
LONG_CONTEXT = 16384


def context_bucket(n_ctx: int) -> str:
    return "short" if n_ctx <= SHORT_CONTEXT else "long" if n_ctx <= LONG_CONTEXT else "xlong"


BUCKET_LENGTHS = {"short": SHORT_CONTEXT, "long": LONG_CONTEXT, "xlong": LONG_CONTEXT + 1}  # a length of each


def class_cached(fn):
    """A kernel's ``default_config(head_dim, dtype, causal, n_ctx, *more)`` cached per tuning class: ``n_ctx`` stands
    for its bucket (``context_bucket``), so a model's lengths, new at every decode step, find the class's entry instead
    of adding one each (``cache_clear`` after the table changed); ``more``: the kernel's own further arguments (the
    backward's ``head_dim_v``)."""
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def default_config(head_dim: int, dtype: str = "fp16", causal=None, n_ctx: int = 8192, *more):
        return cached(head_dim, dtype, causal, BUCKET_LENGTHS[context_bucket(n_ctx)], *more)

    default_config.cache_clear = cached.cache_clear
    return default_config


def class_key(head_dim: int, dtype: str, causal: bool, n_ctx: int = 8192, pass_name: str = "fwd") -> str:
    """fp16 and bf16 share a class, as do the two fp8 formats; short, long and extra-long contexts do
    not (a config measured at N_CTX=8192 lost up to 25% at 1024: NOTES v5). The backward kernel's
    classes are its own ("bwd-" keys: another kernel, another config type)."""
    kind = "fp8" if dtype.startswith("fp8") else "16bit"
    key = f"D{head_dim}-{kind}-{'causal' if causal else 'noncausal'}-{context_bucket(n_ctx)}"
    return key if pass_name == "fwd" else f"bwd-{key}"


def table_path(arch: str, directory: Optional[Path] = None) -> Path:
    return Path(directory or TABLE_DIR) / f"{arch}.json"


def load(arch: str, directory: Optional[Path] = None) -> dict:
    """The table's entries (read once per file version: a lookup stands in a call's first launch of a length)."""
    path = table_path(arch, directory)
    try:
        stamp = path.stat().st_mtime_ns
    except FileNotFoundError:
        return {}
    return _read(path, stamp)


@functools.lru_cache(maxsize=16)
def _read(path: Path, stamp: int) -> dict:
    return json.loads(path.read_text()).get("entries", {})


def lookup(arch: str, head_dim: int, dtype: str, causal: bool, n_ctx: int = 8192,
           directory: Optional[Path] = None, pass_name: str = "fwd") -> Optional[dict]:
    entries = load(arch, directory)
    key = class_key(head_dim, dtype, causal, n_ctx, pass_name)
    entry = entries.get(key)
    if entry is None and key.endswith("-xlong"):
        entry = entries.get(key[: -len("xlong")] + "long")
    return dict(entry["config"]) if entry else None


def save(arch: str, head_dim: int, dtype: str, causal: bool, config: dict, measured: dict, n_ctx: int = 8192,
         directory: Optional[Path] = None, pass_name: str = "fwd") -> Path:
    """Record a class's winner with what it was measured on (kept beside the config)."""
    path = table_path(arch, directory)
    data = json.loads(path.read_text()) if path.exists() else {"arch": arch, "entries": {}}
    data["entries"][class_key(head_dim, dtype, causal, n_ctx, pass_name)] = {"config": config, "measured": measured}
    data["entries"] = dict(sorted(data["entries"].items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
