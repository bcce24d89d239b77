"""Timing: triton's do_bench on CUDA (L2 flushed between repetitions), a wall-clock loop on CPU, the kernels' own
durations from a profile (``kernel_benchmark``), and ``time_rounds``, the harness that sweep, optimize and name-ab all
time with."""
from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

QUANTILES = (0.2, 0.5, 0.8)
TIMINGS = ("eager", "graph", "kernel")  # the sweeps' --timing: calls as made, CUDA graph replays, kernels' durations
_TIMING_NEEDS = {"graph": "replays CUDA graphs", "kernel": "profiles the kernels on the GPU"}  # (why a GPU is needed)


def timing_without_gpu(timing: str) -> Optional[str]:
    """Why ``--timing`` ``timing`` cannot run here (None where it can): graph and kernel timing need a CUDA GPU."""
    if timing == "eager" or torch.cuda.is_available():
        return None
    return f"--timing {timing} {_TIMING_NEEDS[timing]}: it needs a CUDA GPU (eager timing runs anywhere)"
# Warm-up per timed turn. At a board's power limit (H200s at 700 W through a sweep) a provider timed
# right after another runs for a few hundred ms at the clock the other left: with 25 ms the order of
# the providers moved one cell's ratio from 0.96 to 1.16x, with 1000 ms two orders agreed within 1.4%
# (NOTES v29).
DEFAULT_WARMUP_MS = 1000.0


@dataclass(frozen=True)
class Timing:
    p20_ms: float
    p50_ms: float
    p80_ms: float
    power_w: float = math.nan  # the board's power during the timed repetitions (``BoardSampler``; nan: not read)
    sm_clock_mhz: float = math.nan


def _nvml_readers(device) -> tuple[Callable[[], float], Callable[[], float]]:
    """The board's power in W and SM clock in MHz through NVML (torch.cuda.power_draw, clock_rate: nvidia-ml-py)."""
    return (lambda: torch.cuda.power_draw(device) / 1e3), (lambda: float(torch.cuda.clock_rate(device)))


class BoardSampler:
    """Reads the board's power and SM clock every ``period_s`` on a thread while a benchmark runs; ``summary``
    gives the medians of the readings in its last ``window_s`` (the timed repetitions, after the warm-up). NVML's
    power on Hopper is the average over the last second, so with a warm-up of a second or more of the same
    callable it is that callable's draw. A reader that fails once (no NVML) ends the sampling: nan."""

    def __init__(self, readers: tuple[Callable[[], float], ...], period_s: float = 0.02,
                 clock: Callable[[], float] = time.perf_counter):
        self._readers, self._period, self._clock = readers, period_s, clock
        self._samples: list[tuple] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                values = tuple(read() for read in self._readers)
            except Exception:  # noqa: BLE001 - no NVML here: the columns stay empty
                return
            self._samples.append((self._clock(), *values))
            self._stop.wait(self._period)

    def __enter__(self) -> "BoardSampler":
        if self._readers:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._end = self._clock()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def summary(self, window_s: float) -> tuple[float, ...]:
        """Per reader, the median of its readings in the sampling's last ``window_s`` (nan where none)."""
        recent = [s[1:] for s in self._samples if s[0] >= self._end - window_s]
        return tuple(statistics.median(col) if col else math.nan
                     for col in (zip(*recent) if recent else [()] * len(self._readers)))


def board_columns(power_w: float, clock_mhz: float, tflops: float) -> dict:
    """A row's board columns: power (W) and SM clock (MHz) during the timed repetitions, medians over the rounds,
    and TFLOPS per watt (TFLOP per joule); empty where NVML gave nothing (CPU, no nvidia-ml-py)."""
    if math.isnan(power_w) or power_w <= 0:
        return {}
    return {"power_w": round(power_w, 1), "sm_clock_mhz": None if math.isnan(clock_mhz) else round(clock_mhz),
            "tflops_per_w": tflops / power_w}


SAMPLE_BOARD = True  # benchmark() on CUDA reads power and SM clock during the repetitions (BoardSampler)


_CAPTURE_STREAMS: dict = {}


def capture_stream(device=None) -> "torch.cuda.Stream":
    """The side stream ``graphed`` captures on (one per device). A backward pass is captured only if its forward was
    built on this stream: autograd runs each backward op on its forward's stream, and an op launched on another
    stream during a capture invalidates it (run 209: every backward's capture failed so)."""
    index = torch.device(device if device is not None else "cuda").index
    index = torch.cuda.current_device() if index is None else index
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return _CAPTURE_STREAMS[index]


@contextlib.contextmanager
def on_capture_stream(enabled: bool = True):
    """Work inside runs on ``capture_stream()``, ordered after the current stream's work and before its later work
    (build a backward's forward here to capture the backward)."""
    if not enabled:
        yield
        return
    current, side = torch.cuda.current_stream(), capture_stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured once in a CUDA graph (on ``capture_stream()``), and the graph's replay: every kernel ``fn``
    launches, without the host work between them (the GPU's time of the call). ``fn`` runs twice first on the
    current stream (compiles, warms the allocator; a warm-up on a side stream, torch's recipe for capture, broke
    na1d's graph with an illegal address on an H100, run 206); raises where ``fn`` cannot be captured (a host sync,
    a launch on another stream: a backward whose forward was not built ``on_capture_stream``)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream()):
        fn()
    return graph.replay


HOST_CALLS = 20  # calls per batch of host_times (a model's layers: a few dozen calls back to back)
HOST_BATCHES = 5


def host_times(fn: Callable[[], object], *, device: str | torch.device = "cuda", calls: int = HOST_CALLS,
               batches: int = HOST_BATCHES) -> dict:
    """A call as a model makes it: ``calls`` calls issued back to back from an idle queue, ``batches`` times.
    ``host_us``: the time to issue one (the host's work: Python, checks, launches; the GPU runs behind it unless its
    queue fills); ``eager_us``: the wall time per call until the last one has finished (end to end: the longer of
    the host's and the GPU's work). Medians over the batches, in microseconds."""
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    issue, wall = [], []
    for _ in range(batches):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        issue.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return {"host_us": statistics.median(issue), "eager_us": statistics.median(wall)}


def host_times_turns(fns: dict, *, device: str | torch.device = "cuda", calls: int = HOST_CALLS,
                     batches: int = HOST_BATCHES) -> dict:
    """``host_times`` of several calls taking turns batch by batch (a batch of each, then again), so that a slow
    spell of the host falls on all of them alike: name -> ``host_times``' dict of medians over the batches."""
    runs = {name: [] for name in fns}
    for _ in range(batches):
        for name, fn in fns.items():
            runs[name].append(host_times(fn, device=device, calls=calls, batches=1))
    return {name: {key: statistics.median(r[key] for r in rs) for key in ("host_us", "eager_us")}
            for name, rs in runs.items()}


def benchmark(fn: Callable[[], object], *, device: str | torch.device = "cuda", warmup_ms: float = 25,
              rep_ms: float = 100) -> Timing:
    """Median and p20/p80 of ``fn`` in milliseconds; warm-up and repetitions are given in ms, as
    ``triton.testing.do_bench`` takes them (it zeroes a 256 MB buffer before every repetition,
    which flushes L2)."""
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench
        sampler = BoardSampler(_nvml_readers(device) if SAMPLE_BOARD else ())
        with sampler:
            p20, p50, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES))
        power, clock = sampler.summary(rep_ms / 1e3) if SAMPLE_BOARD else (math.nan, math.nan)  # (W, MHz)
        return Timing(float(p20), float(p50), float(p80), power, clock)
    return _cpu_benchmark(fn, warmup_ms, rep_ms)


def _cpu_benchmark(fn, warmup_ms: float, rep_ms: float) -> Timing:
    start = time.perf_counter()
    fn()
    once_ms = max((time.perf_counter() - start) * 1e3, 1e-3)
    for _ in range(max(0, int(warmup_ms / once_ms))):
        fn()
    times = []
    for _ in range(max(3, int(rep_ms / once_ms))):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    p20, p50, p80 = np.quantile(np.asarray(times), QUANTILES)
    return Timing(float(p20), float(p50), float(p80))


KERNEL_MARKER = "spin_kernel"  # ``torch.cuda._sleep``'s kernel: marks where each profiled call starts
MARKER_CYCLES = 1000
FLUSH_NAMES = ("FillFunctor", "Memset")  # the L2 flush (do_bench's: ``zero_`` of a 256 MB buffer)


def split_calls(kernels) -> list[float]:
    """A profile's device events ``[(name, start_us, end_us)]`` in start order, each call preceded by the L2 flush and a
    marker kernel (``KERNEL_MARKER``), the last call followed by a flush and a marker: per call, the summed durations
    of the events between its marker and the next, less the next call's flush (us). Raises where the profile does
    not have that shape (a flush missing before a marker: events lost or reordered)."""
    marks = [i for i, (name, _, _) in enumerate(kernels) if KERNEL_MARKER in name]
    calls = []
    for a, b in zip(marks, marks[1:]):
        body = kernels[a + 1:b]
        if not body or not any(f in body[-1][0] for f in FLUSH_NAMES):
            raise RuntimeError(f"kernel timing: no L2 flush before marker {len(calls) + 1} in the profile; the events "
                               f"there: {[name[:60] for name, _, _ in body[-3:]]}")
        calls.append(sum(end - start for _, start, end in body[:-1]))
    return calls


def kernel_benchmark(fn: Callable[[], object], *, device: str | torch.device = "cuda", warmup_ms: float = 25,
                     rep_ms: float = 100) -> Timing:
    """``--timing kernel``: the GPU's own time of one call, the durations of every kernel it launches summed as the
    profiler (CUPTI, through torch.profiler) records them: what the GPU works, without launch latency, the gaps
    between a call's kernels or any host time. L2 is flushed before each call as ``do_bench`` flushes it, so each
    call reads its inputs from memory as the other modes' repetitions do. Warm-up for ``warmup_ms`` of plain calls,
    then ~``rep_ms`` of calls (10 to 100) in one profile; p20/p50/p80 over them in milliseconds. The calls take a
    plain eager call's path (``api.profiled_as_eager``): the kernels a user's call launches."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    from triton.runtime import driver

    from .. import api

    flush = driver.active.get_empty_cache_for_benchmark()  # (do_bench's 256 MB, zeroed before each call as there)
    fn()
    torch.cuda.synchronize(device)
    t0, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - t0 < warmup_ms / 1e3:
        fn()
        n += 1
    torch.cuda.synchronize(device)
    once_ms = (time.perf_counter() - t0) * 1e3 / n
    reps = max(10, min(100, int(rep_ms / max(once_ms, 1e-3))))
    # (our calls take the path a user's call takes, not the op's, which they take while a profiler records)
    with api.profiled_as_eager(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            driver.active.clear_cache(flush)
            torch.cuda._sleep(MARKER_CYCLES)
            fn()
        driver.active.clear_cache(flush)
        torch.cuda._sleep(MARKER_CYCLES)
        torch.cuda.synchronize(device)
    events = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == DeviceType.CUDA), key=lambda e: e[1])
    calls = split_calls(events)
    if len(calls) != reps:
        raise RuntimeError(f"kernel timing: {len(calls)} calls found in the profile of {reps}")
    p20, p50, p80 = np.quantile(np.asarray(calls) / 1e3, QUANTILES)
    return Timing(float(p20), float(p50), float(p80))


@dataclass(frozen=True)
class Rounds:
    """One callable's timings over interleaved rounds, and the medians a row keeps."""
    timings: tuple  # one Timing per round, in round order

    @property
    def p50s(self) -> list[float]:
        return [t.p50_ms for t in self.timings]

    def median(self, q: str = "p50_ms") -> float:
        """The rounds' median of field ``q`` (rounds without a reading, nan, left out; nan if none has one)."""
        values = [v for v in (getattr(t, q) for t in self.timings) if not math.isnan(v)]
        return statistics.median(values) if values else math.nan

    @property
    def spread(self) -> float:
        """(max - min) / median of the rounds' p50s."""
        return (max(self.p50s) - min(self.p50s)) / self.median()


def time_rounds(fns: dict, *, rounds: int, warmup_ms: float = DEFAULT_WARMUP_MS, rep_ms: float = 100,
                device: str | torch.device = "cuda",
                context: Callable[[object], contextlib.AbstractContextManager] = lambda key: contextlib.nullcontext(),
                timer: Optional[Callable[..., Timing]] = None) -> tuple[dict, dict]:
    """The one timing harness: every callable of ``fns`` once per round for ``rounds`` rounds, the
    order turning by one each round (no callable always first or always after the same one: at a
    board's power limit a turn inherits the clock its predecessor left), each turn warmed up for
    ``warmup_ms`` first. A callable that raises is dropped from later rounds. ``timer``: how a turn is timed
    (``benchmark``, the default, or ``kernel_benchmark``). Returns ({key: Rounds}, {key: exception})."""
    timer = timer or benchmark
    samples = {key: [] for key in fns}
    failed = {}
    for r in range(rounds):
        order = list(samples)
        turn = r % max(len(order), 1)
        for key in order[turn:] + order[:turn]:
            try:
                with context(key):
                    samples[key].append(timer(fns[key], device=device, warmup_ms=warmup_ms, rep_ms=rep_ms))
            except Exception as exc:  # noqa: BLE001 - recorded for the caller, the others go on
                failed[key] = exc
                del samples[key]
    return {key: Rounds(tuple(t)) for key, t in samples.items()}, failed
