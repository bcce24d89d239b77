"""experiments/sleep_waits.py and pingpong.py: FA4's sleeping barrier waits and its warpgroup turns on our forward,
for A/Bs (NOTES v85). The PTX rewrite touches only the kernel of its name, and the build of that name has a
NANOSLEEP after each wait's try; the turns' provider takes the tuned config with PINGPONG on."""
import dataclasses

import pytest

from .experiment_scripts import load_experiment


@pytest.fixture
def sleep_waits(monkeypatch):
    from triton import knobs

    from gluon_attn.bench import provider

    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", None)  # (restored after the test)
    monkeypatch.setattr(provider, "PROVIDERS", dict(provider.PROVIDERS))  # (the module registers gluon-sleep)
    return load_experiment("sleep_waits")


def test_the_rewrite_adds_the_hint_to_its_kernels_waits_only(sleep_waits):
    wait = "mbarrier.try_wait.parity.shared::cta.b64 complete, [%r100], %r3897;"
    ptx = f".visible .entry {sleep_waits.NAME}(\n{{\nwaitLoop:\n\t{wait}\n\t@!complete bra.uni waitLoop;\n}}"
    out = sleep_waits.with_hint(ptx)
    assert "[%r100], %r3897, 10000000;" in out and out.count("10000000") == 1
    assert sleep_waits.with_hint(out) == out  # (a wait with a hint keeps it)
    other = ptx.replace(sleep_waits.NAME, "gluon_attention")
    assert sleep_waits.with_hint(other) == other
    assert sleep_waits._hook()[0].startswith("sleep_waits")  # (the cache key tells the builds apart)


@pytest.mark.compile
def test_the_sleeping_build_sleeps_and_the_default_build_does_not(sleep_waits):
    from gluon_attn.inspection import compile_build, opcode_histogram, sass_text
    from gluon_attn.kernels import hopper_host

    cfg = hopper_host.default_config(128, "fp16", False)
    counts = {}
    for name in ("gluon_attention", sleep_waits.NAME):
        sass = sass_text(compile_build(hopper_host.build("fp16", 128, False, cfg, name), "sm_90a").asm["cubin"])
        counts[name] = opcode_histogram(sass).get("NANOSLEEP", 0)
    assert counts["gluon_attention"] == 0 and counts[sleep_waits.NAME] >= 8


def test_the_pingpong_provider_takes_the_tuned_config_with_turns(monkeypatch):
    """experiments/pingpong.py: ``gluon-pingpong`` is the class's tuned config with PINGPONG on, and valid."""
    from gluon_attn.bench import provider
    from gluon_attn.kernels import hopper_host

    monkeypatch.setattr(provider, "PROVIDERS", dict(provider.PROVIDERS))
    cfg = load_experiment("pingpong").pingpong_config(128, "fp16", False, 8192)
    base = hopper_host.default_config(128, "fp16", False, 8192)
    assert cfg.PINGPONG and not base.PINGPONG and cfg == dataclasses.replace(base, PINGPONG=True)
    assert not cfg.invalid_reasons(128, "fp16") and "gluon-pingpong" in provider.PROVIDERS
