"""``sweep --na``: neighborhood attention problems in NATTEN's vocabulary (token layout, window, stride, dilation, causal
per dimension), each provider timed in interleaved rounds beside dense attention over the same tokens, every cell
gated on accuracy first. A row per (problem, provider): TFLOPS on the attended pairs (4 D FLOPs a pair), and
``speedup_vs_dense``: the fastest dense provider's time in the same run over this provider's.

Providers: ``gluon`` (``na1d``, ``na2d``, ``na3d``: sm_90a), ``flex`` (FlexAttention with the neighborhood as a
mask_mod, its block mask built once per problem), ``fa4`` (FlashAttention-4's sm_90 forward with the neighborhood as
a mask_mod and block-sparse key tile lists, ``bench.fa4_na``), ``math`` (the fp32 reference
with NATTEN's explicit mask: CPU and small layouts); dense over all tokens: ``dense-<any sweep provider>``
(``dense-gluon``, ``dense-cudnn``, ``dense-fa4``, ``dense-math``, ...), the sweep's own providers on [B, H, N, D]
views. The gate compares each NA provider with the reference on a sample of query rows (``GATE_ROWS``), each dense
one with its own fp32 reference on those rows."""
from __future__ import annotations

import datetime
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..neighborhood import Neighborhood, attended_pairs, each_dim, na_reference, neighborhood, neighborhood_mask
from ..problem import DTYPES, FP8_DTYPES, PASS_FLOPS, PASSES
from ..reference import check_accuracy, check_gradients
from .provider import autograd_call
from .refusal import Unsupported
from .sweep import RowWriter, prepare_out_dir
from .timing import (TIMINGS, board_columns, graphed, host_times, kernel_benchmark, on_capture_stream, time_rounds,
                     timing_without_gpu)

NA_COLUMNS = ("B", "H", "H_KV", "HEAD_DIM", "dtype", "token_layout", "window", "stride", "dilation", "causal_dims",
              "pass", "provider", "label", "p20_ms", "p50_ms", "p80_ms", "tflops", "attended_pairs", "speedup_vs_dense",
              "max_abs_err", "rel_l2_err", "status", "message", "rounds", "round_spread", "gpu", "timestamp", "timing",
              "power_w", "sm_clock_mhz", "tflops_per_w", "host_us", "eager_us", "tiles", "bound")
NA_KEY = ("B", "H", "H_KV", "HEAD_DIM", "dtype", "token_layout", "window", "stride", "dilation", "causal_dims",
          "pass", "provider")
GATE_ROWS = 256  # query rows per (batch, head) the gate compares


def _dims(values: Sequence) -> str:
    return "x".join(str(int(v)) for v in values)


@dataclass(frozen=True)
class NAProblem:
    B: int
    H: int
    H_KV: int
    HEAD_DIM: int
    dtype: str
    nb: Neighborhood
    pass_name: str = "fwd"  # problem.PASSES: fwd, bwd (the gradients alone), fwd+bwd

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def backward(self) -> bool:
        return self.pass_name != "fwd"

    def key(self, provider: str) -> tuple:
        nb = self.nb
        return (self.B, self.H, self.H_KV, self.HEAD_DIM, self.dtype, _dims(nb.spatial), _dims(nb.kernel_size),
                _dims(nb.stride), _dims(nb.dilation), _dims(nb.is_causal), self.pass_name, provider)

    def flops(self, dense: bool = False) -> float:
        """4 D FLOPs a pair forward, times ``problem.PASS_FLOPS`` (2.5 backward, 3.5 both)."""
        pairs = self.nb.tokens ** 2 if dense else attended_pairs(self.nb)
        return 4.0 * self.B * self.H * pairs * self.HEAD_DIM * PASS_FLOPS[self.pass_name]

    def label(self) -> str:
        nb = self.nb
        return (f"NA B={self.B} H={self.H}{f' H_KV={self.H_KV}' if self.H_KV != self.H else ''} D={self.HEAD_DIM} "
                f"{self.dtype} layout {_dims(nb.spatial)} window {_dims(nb.kernel_size)} stride {_dims(nb.stride)} "
                f"dilation {_dims(nb.dilation)} causal {_dims(nb.is_causal)}"
                f"{'' if self.pass_name == 'fwd' else ' pass=' + self.pass_name}")


def na_problems(layouts, windows, strides, dilations, causal_dims, *, batch: int, heads: int, kv_heads: Optional[int],
                head_dims, dtypes, passes=("fwd",)) -> list[NAProblem]:
    """The grid: every combination of the axes' values whose dimensions agree with the layout's (a one-value
    tuple applies to every dimension, as an int does in NATTEN); ``neighborhood`` refuses, naming the argument, the
    first that breaks NATTEN's rules."""
    unknown = [x for x in passes if x not in PASSES]
    if unknown:
        raise ValueError(f"--pass {unknown}: one of {', '.join(PASSES)}")
    out = []
    for layout, window, stride, dil, causal, d, dtype, pass_name in itertools.product(
            layouts, windows, strides, dilations, causal_dims, head_dims, dtypes, passes):
        if any(len(v) not in (1, len(layout)) for v in (window, stride, dil, causal)):
            continue  # (another layout's values)
        nb = neighborhood(layout, each_dim(window), each_dim(stride), each_dim(dil), each_dim(causal))
        out.append(NAProblem(batch, heads, kv_heads or heads, d, dtype, nb, pass_name))
    if not out:
        raise ValueError("--na: no window, stride, dilation and causal values with as many dimensions as a token "
                         "layout (or one, for every dimension)")
    return out


def _inputs(p: NAProblem, device, seed: int = 1234):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (p.B, *p.nb.spatial)
    make = lambda h: torch.randn(*shape, h, p.HEAD_DIM, generator=gen, device=device).to(p.torch_dtype)  # noqa: E731
    return make(p.H), make(p.H_KV), make(p.H_KV)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[B, *spatial, heads, D] -> [B, heads, N, D] (a view where the layout allows)."""
    return t.reshape(t.shape[0], -1, t.shape[-2], t.shape[-1]).transpose(1, 2)


def _gate_rows(p: NAProblem, device) -> torch.Tensor:
    n = p.nb.tokens
    if n <= GATE_ROWS:
        return torch.arange(n, device=device)
    gen = torch.Generator(device="cpu").manual_seed(7)
    return torch.randperm(n, generator=gen)[:GATE_ROWS].sort().values.to(device)


def _reference_rows(p: NAProblem, q, k, v, rows: torch.Tensor, dense: bool) -> torch.Tensor:
    """fp32 attention of the sampled query rows (all heads): over their neighborhoods, or every key (dense)."""
    qf, kf, vf = (_flat(t).float() for t in (q, k, v))
    g = p.H // p.H_KV
    kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    s = torch.matmul(qf[:, :, rows], kf.transpose(-1, -2)) * p.HEAD_DIM ** -0.5
    if not dense:
        keep = neighborhood_mask(p.nb, rows.device, rows)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(s, -1), vf)  # [B, H, rows, D]


def _reference_grads(p: NAProblem, q, k, v, do, rows: torch.Tensor, keys: torch.Tensor, dense: bool,
                     chunk: int = 256) -> tuple:
    """fp32 gradients at the sampled rows (all heads): dQ of query ``rows`` [B, H, rows, D] (each row needs only its
    own softmax), dK and dV of key ``keys`` [B, H_KV, keys, D] (every query's softmax, ``chunk`` queries at a time),
    under the neighborhood's mask or none (dense)."""
    qf, kf, vf, dof = (_flat(t).float() for t in (q, k, v, do))
    g = p.H // p.H_KV
    kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    scale = p.HEAD_DIM ** -0.5

    def softmax_rows(idx):
        s = torch.matmul(qf[:, :, idx], kf.transpose(-1, -2)) * scale
        if not dense:
            s = s.masked_fill(~neighborhood_mask(p.nb, idx.device, idx), float("-inf"))
        probs = torch.softmax(s, -1)
        delta = (dof[:, :, idx] * torch.matmul(probs, vf)).sum(-1, keepdim=True)  # rowsum(dO * O)
        return probs, delta

    probs, delta = softmax_rows(rows)
    dq = torch.matmul(probs * (torch.matmul(dof[:, :, rows], vf.transpose(-1, -2)) - delta), kf) * scale
    dk = torch.zeros(*qf.shape[:2], len(keys), qf.shape[-1], device=qf.device)
    dv = torch.zeros(*qf.shape[:2], len(keys), vf.shape[-1], device=qf.device)
    for c in range(0, p.nb.tokens, chunk):
        idx = torch.arange(c, min(c + chunk, p.nb.tokens), device=qf.device)
        probs, delta = softmax_rows(idx)
        pk = probs[..., keys]
        ds = pk * (torch.matmul(dof[:, :, idx], vf[:, :, keys].transpose(-1, -2)) - delta)
        dv += torch.matmul(pk.transpose(-1, -2), dof[:, :, idx])
        dk += torch.matmul(ds.transpose(-1, -2), qf[:, :, idx]) * scale
    per_kv = lambda t: t.view(t.shape[0], p.H_KV, g, *t.shape[2:]).sum(2)  # noqa: E731  (GQA: a K/V head's sum)
    return dq, per_kv(dk), per_kv(dv)


def _with_backward(maker: Callable) -> Callable:
    """A neighborhood provider's maker for every pass: the forward's call, or for ``bwd`` and ``fwd+bwd`` autograd
    through it (``provider.autograd_call``, as the dense sweep times the backward), returning (dq, dk, dv) in the
    layout of q, k, v."""
    def make(p: NAProblem, q, k, v, do=None):
        if not p.backward:
            return maker(p, q, k, v)
        return autograd_call(lambda *leaves: maker(p, *leaves), q, k, v, do, p.pass_name)
    return make


# ---------------------------------------------------------------------------------------------
# Providers: each returns a callable of no arguments giving the output ([B, *spatial, H, D] for NA, [B, H, N, D]
# dense), or raises ``Unsupported`` naming why
# ---------------------------------------------------------------------------------------------
def _gluon(p: NAProblem, q, k, v) -> Callable:
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        raise Unsupported("gluon: na1d, na2d and na3d run on sm_90a (H100/H200)")
    if p.dtype not in ("fp16", "bf16") and (p.backward or p.dtype not in FP8_DTYPES):
        raise Unsupported(f"gluon: na1d, na2d and na3d take fp16 and bf16, and fp8 in the forward; not {p.dtype}"
                          f"{' (backward)' if p.backward else ''}")
    from ..neighborhood import na1d, na2d, na3d
    op, nb = (na1d, na2d, na3d)[p.nb.dims - 1], p.nb
    return lambda: op(q, k, v, nb.kernel_size, nb.stride, nb.dilation, nb.is_causal)


def _flex(p: NAProblem, q, k, v) -> Callable:
    if q.device.type != "cuda":
        raise Unsupported("flex: FlexAttention's kernels run on CUDA here")
    if p.dtype not in ("fp16", "bf16"):
        raise Unsupported(f"flex: takes fp16 and bf16, not {p.dtype}")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    windows = [_dim_windows_tensor(p.nb, d, q.device) for d in range(p.nb.dims)]
    spatial = p.nb.spatial
    strides = [math.prod(spatial[d + 1:]) for d in range(p.nb.dims)]

    def mask_mod(b, h, qi, ki):
        keep = qi >= 0
        for d, (g, start, end) in enumerate(windows):
            qc = (qi // strides[d]) % spatial[d]
            kc = (ki // strides[d]) % spatial[d]
            kpos = kc // p.nb.dilation[d]
            keep = keep & (g[qc] == g[kc]) & (kpos >= start[qc]) & (kpos < end[qc])
        return keep

    n = p.nb.tokens
    # (compiled: the eager build materialises [N, N] temporaries, 34 GB each at 65536 tokens)
    block_mask = torch.compile(create_block_mask)(mask_mod, None, None, n, n, device=q.device)
    fn = torch.compile(flex_attention, dynamic=False)
    qf, kf, vf = (_flat(t) for t in (q, k, v))
    enable_gqa = p.H != p.H_KV
    return lambda: fn(qf, kf, vf, block_mask=block_mask, enable_gqa=enable_gqa).transpose(1, 2)


def _dim_windows_tensor(nb: Neighborhood, dim: int, device):
    from ..neighborhood import dim_windows
    g, _, start, end = dim_windows(nb.spatial[dim], nb.kernel_size[dim], nb.stride[dim], nb.dilation[dim],
                                   nb.is_causal[dim], device)
    return g, start, end


def _fa4(p: NAProblem, q, k, v) -> Callable:
    """FlashAttention-4's sm_90 forward with the neighborhood as a ``mask_mod`` and its block-sparse key tile lists
    (``bench.fa4_na``); [B, N, H, D] out."""
    if p.backward:
        raise Unsupported("fa4: the neighborhood provider runs FA4's forward only")
    from .fa4_na import fa4_na_call
    return fa4_na_call(p.nb, q, k, v)


def _math(p: NAProblem, q, k, v) -> Callable:
    if p.nb.tokens > 8192:
        raise Unsupported("math: the fp32 reference's [N, N] mask is for layouts up to 8192 tokens")
    nb = p.nb
    return lambda: na_reference(q, k, v, nb.kernel_size, nb.stride, nb.dilation, nb.is_causal)


def _dense(p: NAProblem, q, k, v, name: str, do=None) -> Callable:
    """``dense-<name>``: the sweep's own provider ``name`` (``bench.providers``) over every token of the layout,
    [B, H, N, D] views of the same tensors, in the problem's pass (its backward the provider's own); refused as that
    provider refuses the dense problem."""
    from ..problem import Inputs, Problem
    from .providers import get_provider

    provider = get_provider(name)
    dense = Problem(p.B, p.H, p.nb.tokens, p.HEAD_DIM, False, p.dtype, H_KV=p.H_KV, pass_name=p.pass_name)
    arch = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    support = provider.supports(dense, arch)
    if not support.ok:
        raise Unsupported(f"dense-{name}: {support.reason}")
    return provider.prepare(Inputs(dense, _flat(q), _flat(k), _flat(v), do=None if do is None else _flat(do)))


PROVIDERS = {"gluon": _with_backward(_gluon), "flex": _with_backward(_flex), "fa4": _fa4,
             "math": _with_backward(_math)}


def _provider(name: str) -> Callable:
    """The maker of an --na provider's call: a neighborhood one (``PROVIDERS``), or ``dense-<a sweep provider>``."""
    if name.startswith("dense-"):
        from .providers import get_provider
        get_provider(name[len("dense-"):])  # (raises, listing the sweep's providers)
        return lambda p, q, k, v, do=None: _dense(p, q, k, v, name[len("dense-"):], do)
    return PROVIDERS[name]


def _incoming_grad(p: NAProblem, device, seed: int = 4321) -> torch.Tensor:
    """The backward passes' gradient of the output, [B, *spatial, H, D], fixed by a seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(p.B, *p.nb.spatial, p.H, p.HEAD_DIM, generator=gen, device=device).to(p.torch_dtype)


def _grad_rows(name: str, grads, rows: torch.Tensor) -> tuple:
    """A provider's (dq, dk, dv) at the gate's token numbers, each [B, heads, rows, D]."""
    flat = (lambda t: t) if name.startswith("dense-") else _flat  # (dense: q's layout, [B, H, N, D])
    return tuple(flat(g)[:, :, rows].float() for g in grads)


def _output_rows(name: str, out: torch.Tensor, p: NAProblem, rows: torch.Tensor) -> torch.Tensor:
    """A provider's output at the gate's rows, as [B, H, rows, D]."""
    if name.startswith("dense-"):  # (the sweep's providers write q's layout, [B, H, N, D])
        return out[:, :, rows].float()
    return _flat(out.reshape(p.B, *p.nb.spatial, p.H, -1))[:, :, rows].float()


def run_na_sweep(problems: Sequence[NAProblem], providers: Sequence[str], out, *, rounds: int, warmup_ms: float,
                 rep_ms: float, resume: bool = False, command_line: Optional[list] = None,
                 on_row: Optional[Callable[[dict], None]] = None, timing: str = "eager") -> Path:
    """Every problem over ``providers`` (NA and dense ones), rows into ``out``/rows.csv, tables into tables.md.
    ``timing``: "eager" times the calls as a user makes them (the host's work included where it outlasts the GPU's:
    small problems), "graph" each call captured in a CUDA graph and replayed (``timing.graphed``: the GPU's time of
    everything the call launches, as NATTEN's profiler reports kernels), "kernel" the durations of the kernels each
    call launches (``timing.kernel_benchmark``: no launch latency or gaps); the rows' ``timing`` column says which."""
    if timing not in TIMINGS:
        raise ValueError(f"timing {timing!r}: one of {', '.join(TIMINGS)}")
    why = timing_without_gpu(timing)
    if why:
        raise ValueError(why)
    import pandas as pd

    from .environment import collect_env

    unknown = [n for n in providers if n not in PROVIDERS and not n.startswith("dense-")]
    if unknown:
        raise ValueError(f"unknown --na providers {unknown}; known: {', '.join(PROVIDERS)}, and dense-<any sweep "
                         f"provider> (dense-gluon, dense-cudnn, dense-fa4, dense-math, ...)")
    makers = {n: _provider(n) for n in providers}
    out_dir = prepare_out_dir(out, resume)
    env = collect_env(command_line)
    env["na"] = True
    (out_dir / "env.json").write_text(json.dumps(env, indent=2, default=str) + "\n")
    rows_path = out_dir / "rows.csv"
    done = set()
    if resume and rows_path.exists() and rows_path.stat().st_size:
        old = pd.read_csv(rows_path, dtype=str, keep_default_na=False)
        done = {tuple(r[c] for c in NA_KEY) for _, r in old.iterrows()}
    writer = RowWriter(rows_path, NA_COLUMNS)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    try:
        for p in problems:
            todo = [n for n in providers if tuple(map(str, p.key(n))) not in done]
            if not todo:
                continue
            q, k, v = _inputs(p, device)
            gate_rows = _gate_rows(p, device)
            do = _incoming_grad(p, device) if p.backward else None
            refs = {}
            cells, rows = {}, {}
            for name in todo:
                base = dict(zip(NA_KEY, p.key(name)), label=name, attended_pairs=attended_pairs(p.nb), gpu=gpu,
                            timing=timing, **(gluon_plan(p) if name == "gluon" else {}))
                dense = name.startswith("dense-")
                try:
                    if p.backward:  # (dQ at the sampled query rows, dK and dV at the same token numbers as keys)
                        with on_capture_stream(timing == "graph"):  # (the forward whose backward is captured)
                            fn = makers[name](p, q, k, v, do)
                        got = _grad_rows(name, fn(), gate_rows)
                        if dense not in refs:
                            refs[dense] = _reference_grads(p, q, k, v, do, gate_rows, gate_rows, dense)
                        acc = check_gradients(got, refs[dense], p.dtype)
                    else:
                        fn = makers[name](p, q, k, v)
                        got = _output_rows(name, fn(), p, gate_rows)
                        if dense not in refs:
                            refs[dense] = _reference_rows(p, q, k, v, gate_rows, dense)
                        acc = check_accuracy(got, refs[dense], p.dtype)
                    base.update(max_abs_err=acc.max_abs, rel_l2_err=acc.rel_l2)
                    if not acc.ok:
                        rows[name] = {**base, "status": "wrong", "message": acc.message}
                        continue
                    cells[name] = fn
                    rows[name] = {**base, "status": "ok"}
                except Unsupported as exc:
                    rows[name] = {**base, "status": "unsupported", "message": str(exc)}
                except Exception as exc:  # noqa: BLE001 - one provider's failure is its row
                    rows[name] = {**base, "status": "error", "message": f"{type(exc).__name__}: {exc}"[:300]}
            for name, fn in list(cells.items()):  # (each call as a model makes it: host and end-to-end time)
                try:
                    rows[name].update(host_times(fn, device=device))
                except Exception as exc:  # noqa: BLE001 - one provider's failure is its row
                    rows[name].update(status="error", message=f"{type(exc).__name__}: {exc}"[:300])
                    del cells[name]
            if timing == "graph":
                cells = _graphs(cells, rows)
            timed, failed = time_rounds(cells, rounds=rounds, warmup_ms=warmup_ms, rep_ms=rep_ms, device=device,
                                        timer=kernel_benchmark if timing == "kernel" else None)
            for name, exc in failed.items():
                rows[name].update(status="error", message=f"{type(exc).__name__}: {exc}"[:300])
            best_dense = min((timed[n].median() for n in timed if n.startswith("dense-")), default=math.nan)
            stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            for name in todo:
                row = rows[name]
                if name in timed:
                    t = timed[name]
                    ms = t.median()
                    tflops = p.flops(name.startswith("dense-")) / (ms * 1e-3) / 1e12
                    row.update(p20_ms=t.median("p20_ms"), p50_ms=ms, p80_ms=t.median("p80_ms"), rounds=rounds,
                               round_spread=t.spread, speedup_vs_dense=best_dense / ms, tflops=tflops,
                               **board_columns(t.median("power_w"), t.median("sm_clock_mhz"), tflops))
                row["timestamp"] = stamp
                writer.write(row)
                if on_row:
                    on_row(row)
            del q, k, v
    finally:
        writer.close()
    (out_dir / "tables.md").write_text(na_tables(pd.read_csv(rows_path, keep_default_na=False)))
    return out_dir


def _graphs(cells: dict, rows: dict) -> dict:
    """--timing graph: each passing provider's call captured in a CUDA graph (``timing.graphed``), FlexAttention's
    last: captured before the others, its graph broke a later replay with an illegal address on an H100 (runs 206
    and 207; each provider alone, and this order, replay cleanly). A provider whose capture fails gets an error row."""
    out = {}
    for name in sorted(cells, key=lambda n: n == "flex"):
        try:
            out[name] = graphed(cells[name])
        except Exception as exc:  # noqa: BLE001 - one provider's failure is its row
            rows[name].update(status="error", message=f"CUDA graph capture: {type(exc).__name__}: {exc}"[:300])
    return out


def gluon_plan(p: NAProblem) -> dict:
    """The ``gluon`` row's plan: ``tiles``, the (query tile, key tile) its call takes by default (the forward's, or the
    backward's for ``bwd``), and ``bound``, dense pairs over the pairs those tiles compute (``configs --na``'s bound:
    the speedup over dense if every visited block ran at the dense rate). Empty where the kernel does not take the
    pattern's head dim, and for ``fwd+bwd`` (two plans)."""
    from ..neighborhood import backward_tiles, forward_halo, plan_stats, sm90_tiles
    if p.pass_name == "fwd+bwd":
        return {}
    pair = backward_tiles(p.nb, p.HEAD_DIM) if p.backward else sm90_tiles(p.nb, p.HEAD_DIM, p.torch_dtype)[1]
    if pair is None:
        return {}
    halo = not p.backward and forward_halo(p.nb, p.torch_dtype)
    bound = p.nb.tokens ** 2 / plan_stats(p.nb, *pair, halo).computed_pairs
    return {"tiles": "/".join(_dims(t) for t in pair), "bound": round(bound, 3)}


def na_tables(df) -> str:
    """One block per problem: each provider's ms, TFLOPS and speedup over the fastest dense provider; for ours, the
    plan's bound (``gluon_plan``) and the share of it the measured speedup reaches."""
    blocks = []
    shape = [c for c in NA_KEY if c != "provider"]
    for key, g in df.groupby(shape, sort=False):
        k = dict(zip(shape, key))
        timing = ", ".join(sorted(set(map(str, g["timing"])) - {""})) if "timing" in g else ""
        direction = f", pass {k['pass']}" if str(k.get("pass", "fwd")) != "fwd" else ""
        lines = [f"NA B={k['B']} H={k['H']} H_KV={k['H_KV']} D={k['HEAD_DIM']} {k['dtype']}: layout "
                 f"{k['token_layout']}, window {k['window']}, stride {k['stride']}, dilation {k['dilation']}, "
                 f"causal {k['causal_dims']}{direction}{f' ({timing} timing)' if timing else ''}", "",
                 "| provider | ms | TFLOPS | speedup vs dense | tiles | bound | of bound | status |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in g.itertuples():
            ok = r.status == "ok"
            num = lambda x, f: (f.format(float(x)) if ok and x not in ("", None) else "")  # noqa: E731
            tiles, bound = getattr(r, "tiles", ""), getattr(r, "bound", "")
            share = float(r.speedup_vs_dense) / float(bound) if ok and bound not in ("", None) and \
                r.speedup_vs_dense != "" else ""
            lines.append(f"| {r.provider} | {num(r.p50_ms, '{:.3f}')} | {num(r.tflops, '{:.1f}')} | "
                         f"{num(r.speedup_vs_dense, '{:.2f}x')} | {tiles} | "
                         f"{f'{float(bound):.2f}x' if bound not in ('', None) else ''} | {num(share, '{:.2f}')} | "
                         f"{r.status}{': ' + r.message if not ok else ''} |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def parse_dims_list(text: str, what: str) -> list[tuple[int, ...]]:
    """"32768" -> [(32768,)]; "256x256;80x80" -> [(256, 256), (80, 80)] (';' between values of the axis)."""
    out = []
    for item in str(text).split(";"):
        try:
            values = tuple(int(v) for v in item.replace("x", ",").split(",") if v.strip())
        except ValueError:
            values = ()
        if not values:
            raise ValueError(f"{what}: expected 1-3 integers per value (e.g. 256x256), values split by ';'; "
                             f"got {text!r}")
        out.append(values)
    return out




def optimize_na(nb: Neighborhood, *, batch: int, heads: int, kv_heads: Optional[int], head_dim: int, dtype: str,
                max_configs: int = 8, rounds: int = 2, warmup_ms: float = 100.0, rep_ms: float = 100.0,
                out_dir=None, pass_name: str = "fwd", only: Optional[Sequence[str]] = None) -> dict:
    """``optimize --na``: time na1d/na2d/na3d with each (query tile, K/V tile) pair the sm_90a kernel takes, the
    ``max_configs`` the plan ranks first (``plan_rank``: fewest computed pairs, then fewest masked visits; the default
    pair always among them), each gated on sampled rows first. ``pass_name`` bwd or fwd+bwd: the backward's pairs
    (``backward_q_tile_shape``, ``backward_kv_tile_shape``: ``backward_pairs``), timed through autograd and gated on
    the gradients as ``sweep --na --pass`` does. ``only``: time just these pairs, named "QxQ/KxK" as ``configs --na``
    lists them (a name the kernel does not take is refused, naming the first it does). Returns {"results": rows
    (fastest first), "best", "default" (None where ``only`` leaves it out)} and writes optimize.csv to ``out_dir``."""
    import pandas as pd

    from ..neighborhood import forward_halo, na1d, na2d, na3d, plan_rank, plan_stats, sm90_tiles

    p = NAProblem(batch, heads, kv_heads or heads, head_dim, dtype, nb, pass_name)
    if p.backward:
        if dtype not in ("fp16", "bf16"):
            raise ValueError(f"the backward takes fp16 and bf16, not {dtype}")
        taken, default = backward_pairs(nb, head_dim)
    else:
        taken, default = sm90_tiles(nb, head_dim, p.torch_dtype)
    if not taken:
        raise ValueError(f"the sm_90a kernel takes no tile pair for this pattern at head dim {head_dim} {dtype}")
    halo = not p.backward and forward_halo(nb, p.torch_dtype)
    ranked = sorted(taken, key=lambda pair: plan_rank(nb, pair, halo))
    if only:
        named = {f"{_dims(qs)}/{_dims(kvs)}": (qs, kvs) for qs, kvs in ranked}
        unknown = [n for n in only if n not in named]
        if unknown:
            raise ValueError(f"the sm_90a kernel takes no tile pair {', '.join(unknown)} for this pattern at head dim "
                             f"{head_dim} {dtype}; it takes e.g. {', '.join(list(named)[:6])}")
        pairs = [named[n] for n in dict.fromkeys(only)]
    else:
        pairs = ranked[:max_configs]
        if default not in pairs:
            pairs.append(default)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise ValueError("optimize --na times the sm_90a kernels: it needs an H100 or H200")
    op = (na1d, na2d, na3d)[nb.dims - 1]
    q, k, v = _inputs(p, "cuda")
    rows_idx = _gate_rows(p, "cuda")
    if p.backward:
        do = _incoming_grad(p, "cuda")
        ref = _reference_grads(p, q, k, v, do, rows_idx, rows_idx, False)
    else:
        ref = _reference_rows(p, q, k, v, rows_idx, False)
    attended = attended_pairs(nb)
    cells, rows = {}, {}
    names = ("backward_q_tile_shape", "backward_kv_tile_shape") if p.backward else ("q_tile_shape", "kv_tile_shape")
    for qs, kvs in pairs:
        st = plan_stats(nb, qs, kvs, halo)
        name = f"{_dims(qs)}/{_dims(kvs)}"
        row = {"q_tile_shape": _dims(qs), "kv_tile_shape": _dims(kvs), "default": (qs, kvs) == default,
               "visited / attended": round(st.visited_pairs / attended, 3),
               "masked": f"{st.masked_visits / max(st.kv_visits, 1):.0%}"}
        tiles = dict(zip(names, (qs, kvs)))
        call = (lambda *t, tiles=tiles: lambda: op(*t, nb.kernel_size, nb.stride, nb.dilation, nb.is_causal, **tiles))
        try:
            if p.backward:
                fn = autograd_call(call, q, k, v, do, pass_name)
                acc = check_gradients(_grad_rows("gluon", fn(), rows_idx), ref, dtype)
            else:
                fn = call(q, k, v)
                acc = check_accuracy(_output_rows("gluon", fn(), p, rows_idx), ref, dtype)
            row.update(status="ok" if acc.ok else "wrong", message=acc.message)
            if acc.ok:
                cells[name] = fn
        except Exception as exc:  # noqa: BLE001 - one pair's failure is its row
            row.update(status="error", message=f"{type(exc).__name__}: {exc}"[:200])
        rows[name] = row
    timed, failed = time_rounds(cells, rounds=rounds, warmup_ms=warmup_ms, rep_ms=rep_ms)
    for name, exc in failed.items():
        rows[name].update(status="error", message=f"{type(exc).__name__}: {exc}"[:200])
    for name, t in timed.items():
        rows[name].update(p50_ms=t.median(), tflops=p.flops() / (t.median() * 1e-3) / 1e12, round_spread=t.spread)
    results = sorted(rows.values(), key=lambda r: r.get("p50_ms", math.inf))
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        pd.DataFrame(results).to_csv(Path(out_dir) / "optimize.csv", index=False)
    best = next((r for r in results if "p50_ms" in r), None)
    return {"results": results, "best": best, "default": next((r for r in results if r["default"]), None),
            "problem": p}


def backward_pairs(nb: Neighborhood, head_dim: int) -> tuple:
    """(every (query tile, key tile) pair the sm_90a backward takes for this pattern at this head dim, the default):
    1-D its one pair; 2-D/3-D boxes (``hopper_bwd_host.window_boxes``) that fit the layout, the default computing the
    fewest pairs (``neighborhood.backward_tiles``). Empty where the head dim is not taken."""
    from ..kernels import hopper_bwd_host
    from ..neighborhood import backward_tiles

    default = backward_tiles(nb, head_dim)
    if default is None:
        return (), None
    if nb.dims == 1:
        return (default,), default
    return hopper_bwd_host.window_boxes(head_dim, nb.dims), default


def na_call(p: NAProblem, provider: str, device="cuda") -> Callable:
    """One --na provider's call on fresh inputs of problem ``p`` (its pass: the forward, or autograd through it),
    for ``profile --na``; raises ``Unsupported`` naming why a provider cannot run it."""
    if provider not in PROVIDERS and not provider.startswith("dense-"):
        raise ValueError(f"unknown --na provider {provider!r}; known: {', '.join(PROVIDERS)}, and dense-<any sweep "
                         f"provider>")
    q, k, v = _inputs(p, device)
    do = _incoming_grad(p, device) if p.backward else None
    return _provider(provider)(p, q, k, v, do) if p.backward else _provider(provider)(p, q, k, v)
