"""The one timing harness (``time_rounds``): turning order, medians, dropped failures; and that the
commands time through it rather than through loops of their own."""
import contextlib
import math
import re
import statistics
import threading
import time
from pathlib import Path

import pytest

from gluon_attn.bench.timing import BoardSampler, Rounds, Timing, host_times_turns, split_calls, time_rounds


def test_turns_rotate_by_one_each_round_and_rows_keep_medians():
    turns = []

    @contextlib.contextmanager
    def record(key):
        turns.append(key)
        yield

    fns = {k: (lambda: sum(range(100))) for k in "abc"}
    timed, failed = time_rounds(fns, rounds=4, warmup_ms=0.1, rep_ms=0.5, device="cpu", context=record)
    assert not failed and set(timed) == set("abc")
    assert turns == list("abc" "bca" "cab" "abc")
    assert all(len(t.timings) == 4 and t.median() > 0 and t.spread >= 0 for t in timed.values())


def test_host_times_take_turns_batch_by_batch():
    """Ours and a peer's batches alternate, so that a slow spell of the host falls on both: each call's batches are
    interleaved, and each name gets the medians of its own calls' times."""
    order = []
    fns = {"slow": lambda: (order.append("slow"), time.sleep(0.001)), "fast": lambda: order.append("fast")}
    times = host_times_turns(fns, device="cpu", calls=2, batches=3)
    assert order == ["slow", "slow", "fast", "fast"] * 3
    assert times["slow"]["host_us"] >= 1000 > times["fast"]["host_us"]
    assert all(t["eager_us"] >= t["host_us"] for t in times.values())


def test_a_failing_callable_is_dropped_and_reported():
    calls = {"bad": 0}

    def bad():
        calls["bad"] += 1
        raise RuntimeError("launch failed")

    timed, failed = time_rounds({"ok": lambda: None, "bad": bad}, rounds=3, warmup_ms=0.1, rep_ms=0.2, device="cpu")
    assert set(timed) == {"ok"} and len(timed["ok"].timings) == 3
    assert isinstance(failed["bad"], RuntimeError) and calls["bad"] == 1  # not retried in later rounds


def test_a_custom_timer_times_every_turn():
    """``time_rounds``' timer (``kernel_benchmark`` for --timing kernel): called for each callable in each round with
    the harness's warm-up and repetitions, its Timing kept per round."""
    seen = []

    def timer(fn, *, device, warmup_ms, rep_ms):
        fn()
        seen.append((device, warmup_ms, rep_ms))
        return Timing(1.0, 2.0 + len(seen), 3.0)

    hits = []
    timed, failed = time_rounds({"a": lambda: hits.append("a"), "b": lambda: hits.append("b")}, rounds=2,
                                warmup_ms=7, rep_ms=9, device="cpu", timer=timer)
    assert not failed and hits == ["a", "b", "b", "a"] and seen == [("cpu", 7, 9)] * 4
    assert timed["a"].p50s == [3.0, 6.0] and timed["b"].p50s == [4.0, 5.0]


def test_kernel_timing_splits_a_profile_into_calls():
    """--timing kernel's profile: [flush, marker, the call's kernels] per call, then a last flush and marker. Each call
    is the summed durations of the events between its marker and the next, the next flush left out (a call's own
    fill kernels count); a profile that lost a flush is refused."""
    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, ...>"
    spin = "at::cuda::(anonymous namespace)::spin_kernel(long)"
    events = [(fill, 0, 50), (spin, 51, 52),
              ("gluon_attention", 53, 93), ("gluon_attention_combine", 95, 97), (fill, 98, 148), (spin, 149, 150),
              ("flex_attention", 151, 171), (fill, 172, 173), (fill, 175, 225), (spin, 226, 227),
              (fill, 230, 280), (spin, 281, 282)]
    assert split_calls(events) == [42, 21, 0]
    assert split_calls([("Memset (Device)", 0, 5), (spin, 6, 7), ("k", 8, 10), ("Memset (Device)", 11, 16),
                        (spin, 17, 18)]) == [2]
    with pytest.raises(RuntimeError, match="no L2 flush before marker 1"):
        split_calls([(fill, 0, 50), (spin, 51, 52), ("gluon_attention", 53, 93), (spin, 94, 95)])


def test_rounds_statistics():
    r = Rounds((Timing(1, 2, 3), Timing(1, 4, 5), Timing(2, 3, 9)))
    assert r.p50s == [2, 4, 3] and r.median() == 3 and r.median("p80_ms") == 5
    assert r.spread == (4 - 2) / 3


def test_rounds_medians_skip_rounds_without_a_board_reading():
    r = Rounds((Timing(1, 2, 3, 700.0, 1755.0), Timing(1, 2, 3), Timing(1, 2, 3, 650.0, 1980.0)))
    assert r.median("power_w") == 675.0 and r.median("sm_clock_mhz") == (1755.0 + 1980.0) / 2
    assert math.isnan(Rounds((Timing(1, 2, 3),)).median("power_w"))


def test_board_sampler_keeps_the_readings_of_the_last_window():
    """Readings are taken on a thread while the body runs; ``summary`` keeps those of the last window (the timed
    repetitions after the warm-up), per reader."""
    now = [0.0]
    watts = iter(range(100, 100000, 10))
    took = threading.Event()

    def power():
        now[0] += 1.0  # each reading one (fake) second after the last
        took.set()
        return float(next(watts))

    with BoardSampler((power, lambda: 1500.0), period_s=0.001, clock=lambda: now[0]) as s:
        took.wait(5)
        while len(s._samples) < 10:
            threading.Event().wait(0.001)
    recent = [w for t, w, _ in s._samples if t >= s._end - 2.5]
    assert 1 <= len(recent) <= 4 and len(recent) < len(s._samples)
    assert s.summary(2.5) == (statistics.median(recent), 1500.0)
    assert s.summary(1e9)[0] == statistics.median(w for _, w, _ in s._samples)


def test_board_sampler_without_nvml_reads_nan():
    def no_nvml():
        raise ModuleNotFoundError("pynvml")

    with BoardSampler((no_nvml, no_nvml), period_s=0.001) as s:
        pass
    assert all(math.isnan(v) for v in s.summary(1.0))
    with BoardSampler(()) as s:  # (sampling off: no thread)
        pass
    assert s.summary(1.0) == ()


def test_no_command_times_outside_the_harness():
    """Only the harness calls ``benchmark``: sweep, optimize, name-ab and the experiment scripts go
    through ``time_rounds`` (warm-up and turning order in one place)."""
    root = Path(__file__).resolve().parents[1]
    callers = [str(p.relative_to(root)) for p in [*root.joinpath("gluon_attn").rglob("*.py"),
                                                   *root.joinpath("experiments").glob("*.py")]
               if p.name != "timing.py" and re.search(r"\bbenchmark\(", p.read_text())]
    assert callers == []


def test_profiled_as_eager_holds_only_inside_and_is_restored_after_an_error():
    """``api.profiled_as_eager`` (``--timing kernel``'s context: our calls take the plain eager path while its
    profiler records) is off outside, on inside, nested or not, and off again after an error."""
    from gluon_attn import api

    assert not api._PROFILED_AS_EAGER
    with api.profiled_as_eager():
        with api.profiled_as_eager():
            assert api._PROFILED_AS_EAGER
        assert api._PROFILED_AS_EAGER
    assert not api._PROFILED_AS_EAGER
    with pytest.raises(KeyError):
        with api.profiled_as_eager():
            raise KeyError("x")
    assert not api._PROFILED_AS_EAGER
