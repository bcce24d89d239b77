"""``sweep --cp N``: ring attention (``gluon_attn.distributed``) over N ranks of this host, one process per GPU,
timed per cell against the single-GPU kernel at the per-GPU length, and checked against the single-GPU result
over the whole sequence (forward and, for a backward pass, the gradients).

Every rank draws the same inputs (one seed), takes its chunk (zigzag for causal) and runs the same fixed number
of warm-up and timed calls, so that the collectives stay in step; a cell's time is the slowest rank's. A row per
cell: provider ``ring-cp<N>`` (TFLOPS per GPU: the whole problem's FLOPs / time / N, ``vs_single_gpu`` its
ratio to the single-GPU kernel on N_CTX / N tokens), with the accuracy of the gathered output (and gradients)
against the single-GPU result. Cells whose inputs do not fit are ``oom`` rows: the largest N_CTX with an ``ok``
row is the longest context that fits. GPUs talk over NCCL with its NVLink multicast off (NCCL_NVLS_ENABLE=0);
CPU processes over gloo with the math local attention (the tests)."""
from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .report import ROWS_FILE, write_reports
from .sweep import KEY_FIELDS, RowWriter, _problem_key, done_cells, prepare_out_dir

WARMUP_CALLS, TIMED_CALLS = 3, 10


def _clock(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _time(fn, device, all_ranks: bool = True) -> float:
    """ms per call. ``all_ranks``: every rank makes the same number of calls, and the slowest rank's time is taken
    (else this rank alone)."""
    for _ in range(WARMUP_CALLS):
        fn()
    if all_ranks:
        dist.barrier()
    t0 = _clock(device)
    for _ in range(TIMED_CALLS):
        fn()
    ms = (_clock(device) - t0) * 1e3 / TIMED_CALLS
    if all_ranks:
        slowest = torch.tensor([ms], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        ms = float(slowest.item())
    return ms


def _passes(pass_name, forward, backward):
    """The callable a pass times: the forward alone, the backward alone (from one forward's result), or both.
    ``forward()`` returns (out, state); ``backward(out, state)`` the gradients."""
    if pass_name == "fwd":
        return lambda: forward()[0]
    if pass_name == "bwd":
        out, state = forward()
        return lambda: backward(out, state)
    return lambda: backward(*forward())


def _cell(problem, rank, world, device, local, impl):
    """One cell on every rank; rank 0 returns its row's fields."""
    from ..distributed import gather_sequence, ring_attention, shard_sequence
    from ..problem import make_inputs
    from ..reference import check_accuracy, check_gradients

    inputs = make_inputs(problem, device, seed=1234)
    q, k, v, dout = inputs.q, inputs.k, inputs.v, inputs.do
    causal, grad = problem.causal, problem.backward
    ql, kl, vl = (shard_sequence(t, rank, world, causal).requires_grad_(grad) for t in (q, k, v))
    dl = shard_sequence(dout, rank, world, causal) if grad else None

    def ring_forward():
        with torch.set_grad_enabled(grad):
            return ring_attention(ql, kl, vl, causal=causal, local=local), None

    def ring_backward(out, _):
        return torch.autograd.grad(out, (ql, kl, vl), dl, retain_graph=True)
    ms = _time(_passes(problem.pass_name, ring_forward, ring_backward), device)
    out = ring_forward()[0]
    grads = ring_backward(out, None) if grad else ()
    got = [gather_sequence(t, causal) for t in (out, *grads)]
    if rank != 0:
        return None
    scale = q.shape[-1] ** -0.5
    row = {"p50_ms": ms, "tflops": problem.flops / (ms * 1e-3) / 1e12 / world, "cp_ranks": world}
    # the single-GPU kernel at the per-GPU length, on rank 0 alone
    n = problem.N_CTX // world
    qs, ks, vs = q[:, :, :n], k[:, :, :n], v[:, :, :n]
    ds = dout[:, :, :n] if grad else None
    single_ms = _time(_passes(problem.pass_name, lambda: impl.forward(qs, ks, vs, causal, scale),
                              lambda o, lse: impl.backward(ds, qs, ks, vs, o, lse, causal, scale)),
                      device, all_ranks=False)
    single_tflops = problem.flops * (n / problem.N_CTX) ** 2 / (single_ms * 1e-3) / 1e12
    row["vs_single_gpu"] = row["tflops"] / single_tflops
    note = f"single GPU at N_CTX/{world}: {single_tflops:.1f} TFLOPS"
    # against the single-GPU result over the whole sequence
    try:
        ref, lse = impl.forward(q, k, v, causal, scale)
        acc = check_accuracy(got[0].float(), ref.float(), problem.dtype)
        if acc.ok and grad:
            acc = check_gradients(got[1:], [g.float() for g in impl.backward(dout, q, k, v, ref, lse, causal, scale)],
                                  problem.dtype)
        row.update(status="ok" if acc.ok else "wrong", max_abs_err=acc.max_abs, rel_l2_err=acc.rel_l2,
                   message=f"{acc.message + '; ' if acc.message else ''}{note}")
    except torch.cuda.OutOfMemoryError:
        row.update(status="ok", message=f"the whole sequence does not fit one GPU, not checked against it; {note}")
    return row


def _worker(rank, world, rendezvous, spec, out_dir, local, resume):
    device = torch.device(f"cuda:{rank}") if local == "gluon" else torch.device("cpu")
    if device.type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{rendezvous}",
                            rank=rank, world_size=world)
    from ..distributed import _local
    impl = _local(local)
    name = f"ring-cp{world}"
    done = done_cells(Path(out_dir) / ROWS_FILE) if resume else set()
    writer = RowWriter(Path(out_dir) / ROWS_FILE) if rank == 0 else None
    try:
        for problem in spec.problems():
            if _problem_key(problem, name) in done:
                continue
            base = {**dict(zip(KEY_FIELDS, _problem_key(problem, name))), "label": f"ring attention, {world} ranks",
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
            why = _unsupported(problem, world)
            if why:
                row = {"status": "unsupported", "message": why}
            elif not _fits_every_rank(problem, device):
                row = {"status": "oom", "message": "inputs do not fit every GPU"}
            else:
                row = _cell(problem, rank, world, device, local, impl)
            if rank == 0:
                writer.write({**base, **row, "timestamp": datetime.datetime.now(datetime.timezone.utc)
                              .isoformat(timespec="seconds")})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if writer:
            writer.close()
        dist.destroy_process_group()


def _fits_every_rank(problem, device) -> bool:
    """Whether every rank has room for the problem's inputs (q, k, v, dO as a whole sequence), agreed on by all
    before any collective of the cell starts (one rank out of memory mid-ring would leave the others waiting)."""
    try:
        torch.empty(4 * problem.Z * problem.H * problem.N_CTX * problem.HEAD_DIM, dtype=problem.torch_dtype,
                    device=device)
        fits = torch.ones(1, device=device)
    except torch.cuda.OutOfMemoryError:
        fits = torch.zeros(1, device=device)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    return bool(fits.item())


def _unsupported(problem, world) -> Optional[str]:
    if problem.varlen or problem.n_kv != problem.N_CTX:
        return "ring attention splits self-attention over the ranks: no packed batches, N_KV = N_CTX"
    if problem.is_fp8:
        return "ring attention runs 16-bit inputs (the backward and the lse merge are 16-bit paths)"
    if problem.N_CTX % (2 * world if problem.causal else world):
        return f"N_CTX must split into {2 * world if problem.causal else world} equal chunks"
    return None


def run_cp_sweep(spec, out, world: int, *, resume: bool = False, local: Optional[str] = None) -> Path:
    """The sweep's grid as ring attention over ``world`` ranks (GPUs when CUDA is there, else gloo CPU processes
    with the math attention), rows into ``out`` (``resume`` skips recorded cells)."""
    import json

    from .environment import collect_env

    out_dir = prepare_out_dir(out, resume)
    local = local or ("gluon" if torch.cuda.is_available() else "math")
    env = collect_env(None)
    env["cp_ranks"] = world
    env["gpus"] = [torch.cuda.get_device_name(i) for i in range(world)] if local == "gluon" else []
    (out_dir / "env.json").write_text(json.dumps(env, indent=2, default=str) + "\n")
    rendezvous = out_dir / ".rendezvous"
    rendezvous.unlink(missing_ok=True)
    mp.spawn(_worker, args=(world, str(rendezvous), spec, str(out_dir), local, resume), nprocs=world, join=True)
    rendezvous.unlink(missing_ok=True)
    write_reports(out_dir)
    return out_dir
