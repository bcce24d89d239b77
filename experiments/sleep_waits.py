"""FA4's sleeping barrier waits on our sm_90a forward (NOTES v85): importing this module registers the provider
``gluon-sleep``, today's forward under the kernel name ``gluon_attention_sleep`` whose PTX gets, before ptxas, a
suspend-time hint on every ``mbarrier.try_wait`` (FA4's 10,000,000 ns: SASS ``NANOSLEEP.SYNCS`` after a failed
``TRYWAIT`` where Gluon's lowering polls ``TRYWAIT; BRA``). Only kernels of that name are rewritten (a stage hook,
``triton.knobs.runtime.add_stages_inspection_hook``); every other compile goes through unchanged. The forward's
default name, ``gluon_attention``, differs from it by the suffix alone (names with ``cutlass`` are the special ones).

Usage: PYTHONPATH=. python3 experiments/power_probe.py --register sleep_waits --providers gluon,gluon-sleep,fa4 \
           --head-dim 128 -Z 4 -H 32 --n-ctx 8192 --out DIR
       PYTHONPATH=. python3 experiments/sleep_waits.py   # compile-only check: NANOSLEEP in the SASS
"""
import dataclasses
import re

from triton import knobs

from gluon_attn.bench.gluon_providers import attention_runner
from gluon_attn.bench.provider import register
from gluon_attn.bench.providers import get_provider

NAME = "gluon_attention_sleep"
SUSPEND_NS = 10_000_000  # FA4's (CUTLASS DSL's) hint
_WAIT = re.compile(r"(mbarrier\.try_wait\.parity[\w.:]*\s+\w+,\s*\[[^\]]+\],\s*[%\w]+)\s*;")


def with_hint(ptx: str) -> str:
    """``ptx`` with the suspend-time hint on each try_wait that has none, if it is the kernel NAME's."""
    if not re.search(rf"\.entry\s+{NAME}\b", ptx):
        return ptx
    return _WAIT.sub(rf"\1, {SUSPEND_NS};", ptx)


def _hook(*args):
    """The stage hook: called bare, it returns the cache key's addition; with the backend's stages, it wraps the
    PTX stage."""
    if not args:
        return f"sleep_waits-{SUSPEND_NS}", f"sleep_waits-{SUSPEND_NS}"
    _backend, stages, _options, _language, _capability = args
    make_ptx = stages["ptx"]
    stages["ptx"] = lambda src, metadata: with_hint(make_ptx(src, metadata))


knobs.runtime.add_stages_inspection_hook = _hook


def _sleeping_attention(q, k, v, **kw):
    from gluon_attn.api import attention
    return attention(q, k, v, kernel_name=NAME, **kw)


register(dataclasses.replace(
    get_provider("gluon"), name="gluon-sleep", description=f"today's forward with sleeping barrier waits ({NAME})",
    runner=attention_runner(_sleeping_attention), backward_runner=None,
    label_fn=lambda: f"Gluon (waits sleep {SUSPEND_NS} ns)"))


if __name__ == "__main__":
    from gluon_attn.inspection import compile_build, opcode_histogram, sass_text
    from gluon_attn.kernels import hopper_host

    cfg = hopper_host.default_config(128, "fp16", False)
    for name in ("gluon_attention", NAME):
        build = hopper_host.build("fp16", 128, False, cfg, name)
        sass = sass_text(compile_build(build, "sm_90a").asm["cubin"])
        hist = opcode_histogram(sass)
        print(name, {op: n for op, n in hist.items() if op.startswith(("NANOSLEEP", "SYNCS", "TRYWAIT"))})
