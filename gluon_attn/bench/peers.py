"""The peers a user would pick instead of our kernel, as optional benchmark providers:

- ``cudnn-fe``: cuDNN's SDPA through the cudnn-frontend Python graph API, 16-bit and fp8 (e4m3/e5m2
  with per-tensor descales; the fp8 graph writes an fp8 output, scaled by an output scale that is
  calibrated once from the graph's own amax, as a model does with delayed scaling);
- ``fa4``: FlashAttention-4's CuTe-DSL kernels (``flash_attn.cute.flash_attn_func``) on [Z, N, H, D]
  views of our [Z, H, N, D] inputs.

Both are installed with ``pip install -e ".[peers]"``; without them their cells are ``unsupported``
with the install hint. Everything a call needs (cuDNN graph, workspace, output buffer, scales) is made
in ``prepare``, so the timed call is the library's own launch path.
"""
from __future__ import annotations

import collections
import math
from typing import Optional

import torch

from ..problem import DTYPES, FP8_DTYPES, Inputs, Problem
from ..validation import UnsupportedError
from .provider import SIXTEEN_BIT, Call, Provider, cudnn_label, register

# ---------------------------------------------------------------------------------------------
# cuDNN through cudnn-frontend's graph API
# ---------------------------------------------------------------------------------------------

# Tensor uids of the forward graph (and of the training pair: the forward with stats, the backward).
_Q, _K, _V, _O = 1, 2, 3, 4
_DO, _STATS, _DQ, _DK, _DV = 5, 6, 7, 8, 9
_DESCALE_Q, _DESCALE_K, _DESCALE_V, _DESCALE_S, _SCALE_S, _SCALE_O, _AMAX_S, _AMAX_O = range(10, 18)
# P (values in [0, 1]) is stored in fp8 as P * scale_s: the largest power of two that keeps P = 1
# finite, so small probabilities stay out of the subnormal range.
_P_SCALE = {"fp8e4m3": 256.0, "fp8e5": 32768.0}
_GRAPHS: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
_GRAPH_CACHE_SIZE = 16
_HANDLES: dict[int, object] = {}


def _handle(device: torch.device):
    import cudnn

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HANDLES:
        with torch.cuda.device(index):
            _HANDLES[index] = cudnn.create_handle()
    handle = _HANDLES[index]
    cudnn.set_stream(handle, torch.cuda.current_stream(index).cuda_stream)
    return handle


def _dims(p: Problem) -> dict:
    return {"q": (p.Z, p.H, p.N_CTX, p.HEAD_DIM), "k": (p.Z, p.h_kv, p.n_kv, p.HEAD_DIM),
            "v": (p.Z, p.h_kv, p.n_kv, p.head_dim_v), "o": (p.Z, p.H, p.N_CTX, p.head_dim_v)}


def _o_stride(p: Problem) -> tuple:
    """A contiguous [Z, H, N_Q, Dv] output."""
    return (p.H * p.N_CTX * p.head_dim_v, p.N_CTX * p.head_dim_v, p.head_dim_v, 1)


def _graph_with_inputs(p: Problem, strides: tuple, handle):
    """A graph in the problem's io type with its q, k, v tensors (uids _Q, _K, _V; ``strides`` theirs)."""
    import cudnn

    io = DTYPES[p.dtype]
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    dims = _dims(p)
    q, k, v = (g.tensor(uid=uid, dim=dims[n], stride=st, data_type=io)
               for uid, n, st in zip((_Q, _K, _V), ("q", "k", "v"), strides))
    return g, q, k, v


def _build_graph(p: Problem, strides: tuple, handle):
    """The forward graph of one problem: O = softmax(Q K^T / sqrt(D)) V, no stats (inference)."""
    import cudnn

    io = DTYPES[p.dtype]
    g, q, k, v = _graph_with_inputs(p, strides, handle)
    attn_scale = 1.0 / math.sqrt(p.HEAD_DIM)
    causal = _causal_args(p)
    if p.is_fp8:
        def scalar(uid):
            return g.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)

        o, _, amax_s, amax_o = g.sdpa_fp8(
            q, k, v, scalar(_DESCALE_Q), scalar(_DESCALE_K), scalar(_DESCALE_V), scalar(_DESCALE_S),
            scalar(_SCALE_S), scalar(_SCALE_O), generate_stats=False, attn_scale=attn_scale, **causal)
        for uid, t in ((_AMAX_S, amax_s), (_AMAX_O, amax_o)):
            t.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)) \
                .set_data_type(cudnn.data_type.FLOAT)
    else:
        o, _ = g.sdpa(q, k, v, generate_stats=False, attn_scale=attn_scale, **causal)
    o.set_uid(_O).set_output(True).set_dim(_dims(p)["o"]).set_stride(_o_stride(p)).set_data_type(io)
    return _finish(g)


def _finish(g):
    import cudnn

    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except cudnn.cudnnGraphNotSupportedError as exc:
        raise UnsupportedError(f"cuDNN has no engine for this graph: {str(exc).splitlines()[0][:200]}") from None
    return g


def _causal_args(p: Problem) -> dict:
    # Causal with N_KV != N_CTX: the bottom-right diagonal, as ours and FA's (self-attention keeps the
    # plain causal mask, the graph every earlier run measured).
    if p.causal and p.n_kv != p.N_CTX:
        return dict(use_causal_mask_bottom_right=True)
    return dict(use_causal_mask=p.causal)


def _build_training_graphs(p: Problem, strides: tuple, handle):
    """The training pair of one 16-bit problem: the forward with its softmax stats [Z, H, N, 1] (fp32), and
    the backward graph (``sdpa_backward``) taking O, dO and the stats, writing dQ, dK, dV in q, k, v's
    layouts."""
    import cudnn

    io = DTYPES[p.dtype]
    attn_scale = 1.0 / math.sqrt(p.HEAD_DIM)
    dims, o_stride = _dims(p), _o_stride(p)
    stats_dim, stats_stride = (p.Z, p.H, p.N_CTX, 1), (p.H * p.N_CTX, p.N_CTX, 1, 1)
    q_s, k_s, v_s, do_s = strides
    graphs = []
    for backward in (False, True):
        g, q, k, v = _graph_with_inputs(p, (q_s, k_s, v_s), handle)
        if not backward:
            o, stats = g.sdpa(q, k, v, generate_stats=True, attn_scale=attn_scale, **_causal_args(p))
            o.set_uid(_O).set_output(True).set_dim(dims["o"]).set_stride(o_stride).set_data_type(io)
            stats.set_uid(_STATS).set_output(True).set_dim(stats_dim).set_stride(stats_stride) \
                .set_data_type(cudnn.data_type.FLOAT)
        else:
            o = g.tensor(uid=_O, dim=dims["o"], stride=o_stride, data_type=io)
            do = g.tensor(uid=_DO, dim=dims["o"], stride=do_s, data_type=io)
            stats = g.tensor(uid=_STATS, dim=stats_dim, stride=stats_stride, data_type=cudnn.data_type.FLOAT)
            dq, dk, dv = g.sdpa_backward(q, k, v, o, do, stats, attn_scale=attn_scale, **_causal_args(p))
            for t, uid, n, st in ((dq, _DQ, "q", q_s), (dk, _DK, "k", k_s), (dv, _DV, "v", v_s)):
                t.set_uid(uid).set_output(True).set_dim(dims[n]).set_stride(st).set_data_type(io)
        graphs.append(_finish(g))
    return tuple(graphs)


def _graph(p: Problem, strides: tuple, handle, build=None):
    """Graphs are built once per problem and input layout (building takes ~0.1-1 s); a few are kept.
    ``build`` (default: the forward graph) makes what the key names."""
    build = build or _build_graph
    key = (p, strides, torch.cuda.current_device(), build.__name__)
    if key in _GRAPHS:
        _GRAPHS.move_to_end(key)
        return _GRAPHS[key]
    g = build(p, strides, handle)
    _GRAPHS[key] = g
    while len(_GRAPHS) > _GRAPH_CACHE_SIZE:
        _GRAPHS.popitem(last=False)
    return g


def _pow2_at_most(x: float) -> float:
    return 2.0 ** math.floor(math.log2(x))


def _cudnn_fe_runner(inputs: Inputs) -> Call:
    p, q, k, v = inputs.problem, inputs.q, inputs.k, inputs.v
    dev = q.device
    handle = _handle(dev)
    g = _graph(p, (tuple(q.stride()), tuple(k.stride()), tuple(v.stride())), handle)
    # Poisoned: an element the graph does not write fails the accuracy gate.
    out = torch.full((p.Z, p.H, p.N_CTX, p.head_dim_v), float("nan"), dtype=q.dtype, device=dev)
    pack = {_Q: q, _K: k, _V: v, _O: out}
    workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=dev)
    descale_o = 1.0
    if p.is_fp8:
        def scalar(x):
            return torch.full((1, 1, 1, 1), float(x), dtype=torch.float32, device=dev)

        s_scale = _P_SCALE[p.dtype]
        pack.update({_DESCALE_Q: scalar(inputs.descale_q), _DESCALE_K: scalar(inputs.descale_k),
                     _DESCALE_V: scalar(inputs.descale_v), _SCALE_S: scalar(s_scale),
                     _DESCALE_S: scalar(1.0 / s_scale), _SCALE_O: scalar(1.0),
                     _AMAX_S: scalar(0.0), _AMAX_O: scalar(0.0)})
        # Calibrate the output scale once (the delayed scaling a model keeps from its last step):
        # the largest power of two that maps this problem's |O| max to at most half the fp8 range.
        g.execute(pack, workspace, handle=handle)
        amax_o = float(pack[_AMAX_O].item())
        if not math.isfinite(amax_o):
            raise RuntimeError(f"cudnn-fe fp8: the calibration call reported amax(O) = {amax_o}")
        scale_o = _pow2_at_most(0.5 * torch.finfo(q.dtype).max / max(amax_o, 1e-30))
        pack[_SCALE_O].fill_(scale_o)
        descale_o = 1.0 / scale_o

    def call() -> torch.Tensor:
        g.execute(pack, workspace, handle=handle)
        return out

    return Call(call, descale_o=descale_o)


def _cudnn_fe_backward(inputs: Inputs) -> Call:
    """The backward passes through cuDNN's own backward graph (no autograd: the graphs are called as a
    training framework calls them). ``bwd`` runs the forward (with stats) once and times the backward
    graph; ``fwd+bwd`` times both. Outputs are NaN-poisoned: what the graphs do not write fails the gate."""
    p, q, k, v, do = inputs.problem, inputs.q, inputs.k, inputs.v, inputs.do
    dev = q.device
    handle = _handle(dev)
    strides = tuple(tuple(t.stride()) for t in (q, k, v, do))
    fwd, bwd = _graph(p, strides, handle, build=_build_training_graphs)
    out = torch.full((p.Z, p.H, p.N_CTX, p.head_dim_v), float("nan"), dtype=q.dtype, device=dev)
    stats = torch.full((p.Z, p.H, p.N_CTX, 1), float("nan"), dtype=torch.float32, device=dev)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    fwd_pack = {_Q: q, _K: k, _V: v, _O: out, _STATS: stats}
    bwd_pack = {_Q: q, _K: k, _V: v, _O: out, _DO: do, _STATS: stats, _DQ: dq, _DK: dk, _DV: dv}
    workspace = torch.empty(max(1, fwd.get_workspace_size(), bwd.get_workspace_size()), dtype=torch.uint8,
                            device=dev)
    if p.pass_name == "bwd":
        fwd.execute(fwd_pack, workspace, handle=handle)

        def call():
            bwd.execute(bwd_pack, workspace, handle=handle)
            return dq, dk, dv
    else:
        def call():
            fwd.execute(fwd_pack, workspace, handle=handle)
            bwd.execute(bwd_pack, workspace, handle=handle)
            return dq, dk, dv
    return Call(call)


def _cudnn_fe_backward_rule(p: Problem, arch: Optional[tuple[int, int]]) -> Optional[str]:
    if p.is_fp8:
        return "the backward graph is wired for 16-bit inputs only (cuDNN's fp8 backward is not)"
    return None


def _cudnn_fe_rule(p: Problem, arch: Optional[tuple[int, int]]) -> Optional[str]:
    if p.is_fp8 and arch is not None and arch < (9, 0):
        return "cuDNN's fp8 SDPA needs sm_90+"
    return None


def _cudnn_fe_label() -> str:
    ver = CUDNN_FE.version
    return f"{cudnn_label()} via cudnn-frontend {ver}" if ver else f"{cudnn_label()} via cudnn-frontend"


# ---------------------------------------------------------------------------------------------
# FlashAttention-4 (CuTe DSL)
# ---------------------------------------------------------------------------------------------

def _fa4_runner(inputs: Inputs) -> Call:
    p = inputs.problem
    causal = p.causal
    if p.varlen:
        from flash_attn.cute import flash_attn_varlen_func

        q, k, v, cu, m = inputs.q, inputs.k, inputs.v, inputs.cu_seqlens, inputs.max_seqlen

        def call_varlen() -> torch.Tensor:
            out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m,
                                         causal=causal)
            return out[0] if isinstance(out, tuple) else out

        return Call(call_varlen)
    # [Z, H, N, D] -> [Z, N, H, D] views: FA4 takes any layout whose last dim is contiguous and
    # whose strides are 16-byte aligned without copying it.
    q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))
    if p.is_fp8:
        # The fp8 forward (sm_100) takes per-(batch, head) descales through the interface's forward
        # function; flash_attn_func has no descale arguments.
        from flash_attn.cute.interface import _flash_attn_fwd

        descales = {f"{n}_descale": torch.full((p.Z, p.H), float(getattr(inputs, f"descale_{n}")),
                                               dtype=torch.float32, device=q.device) for n in "qkv"}

        def call() -> torch.Tensor:
            return _flash_attn_fwd(q, k, v, causal=causal, **descales)[0].transpose(1, 2)

        return Call(call)

    from flash_attn.cute import flash_attn_func

    def call() -> torch.Tensor:
        out, _ = flash_attn_func(q, k, v, causal=causal)
        return out.transpose(1, 2)

    return Call(call)


def _fa4_rule(p: Problem, arch: Optional[tuple[int, int]]) -> Optional[str]:
    if p.is_fp8 and (arch is None or arch[0] != 10):
        where = f"sm_{arch[0]}{arch[1]}" if arch else "this machine"
        return f"FA4's fp8 forward runs on sm_100 only (its interface asserts it), not on {where}"
    if arch is not None and arch[0] in (10, 11):
        d, dv = p.HEAD_DIM, p.head_dim_v
        if not (max(d, dv) <= 128 or (d, dv) in ((192, 128), (256, 256))):
            return f"on sm_100 FA4 takes head dims up to 128, (192, 128) or (256, 256), not ({d}, {dv})"
    return None


def _fa4_label() -> str:
    ver = FA4.version
    return f"FA4 {ver}" if ver else "FA4"


def _mult8_to_256(d: int) -> bool:
    return d % 8 == 0 and 8 <= d <= 256


CUDNN_FE = register(Provider(
    name="cudnn-fe",
    description="cuDNN SDPA through the cudnn-frontend Python graph API (16-bit; fp8 with descales, fp8 out)",
    needs_cuda=True,
    dtypes=SIXTEEN_BIT + FP8_DTYPES,
    head_dims=_mult8_to_256,
    head_dims_text="multiples of 8 up to 256",
    min_arch=(8, 0),
    archs_text="sm_80+ (fp8: sm_90+)",
    runner=_cudnn_fe_runner,
    label_fn=_cudnn_fe_label,
    kernel_name_fn=lambda p: "cudnn graph sdpa_fp8" if p.is_fp8 else "cudnn graph sdpa",
    out_dtype_fn=lambda p: p.dtype,  # fp8 in, fp8 out (scaled): the gate reads out * descale_o
    rule=_cudnn_fe_rule,
    package="nvidia-cudnn-frontend",
    library="cuDNN via cudnn-frontend",
    module="cudnn",
    features="causal (bottom-right with N_KV != N_CTX), non-causal; GQA/MQA; fp8 e4m3/e5m2 with per-tensor "
             "descales, fp8 output; backward graph (sdpa_backward, 16-bit)",
    peer=True,
    gqa=True,
    cross_lengths="all",
    backward=True,
    backward_rule=_cudnn_fe_backward_rule,
    backward_runner=_cudnn_fe_backward,
))
FA4 = register(Provider(
    name="fa4",
    description="FlashAttention-4 (flash-attn-4, CuTe DSL): flash_attn.cute.flash_attn_func",
    needs_cuda=True,
    dtypes=SIXTEEN_BIT + FP8_DTYPES,
    head_dims=_mult8_to_256,
    head_dims_text="multiples of 8 from 8 to 256",
    arch_ok=lambda arch: arch[0] in (8, 9, 10, 11, 12),
    archs_text="sm_80, sm_90, sm_100, sm_110, sm_120",
    runner=_fa4_runner,
    label_fn=_fa4_label,
    kernel_name_fn=lambda p: "flash_attn.cute",
    out_dtype_fn=lambda p: "bf16" if p.is_fp8 else p.dtype,
    rule=_fa4_rule,
    package="flash-attn-4",
    library="FlashAttention-4 (CuTe DSL)",
    module="flash_attn.cute",
    features="causal (bottom-right), non-causal; GQA/MQA; N_KV != N_CTX; packed batches "
             "(flash_attn_varlen_func); fp8 on sm_100 only; backward (16-bit)",
    peer=True,
    gqa=True,
    cross_lengths="all",
    varlen=True,
    backward=True,
))
