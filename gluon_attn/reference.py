"""fp32 oracle for attention forward, and the per-dtype accuracy gate."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .problem import Inputs


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                        sm_scale: float | None = None, descale_q: float = 1.0, descale_k: float = 1.0,
                        descale_v: float = 1.0, return_lse: bool = False,
                        max_scores: int = 1 << 27):
    """softmax(q k^T * sm_scale) v in fp32 on the inputs' device. q [Z, H, N_Q, D], k and v
    [Z, H_KV, N_KV, D] with H_KV dividing H (query head h reads K/V head h // (H / H_KV)). Causal is
    aligned bottom-right: query i sees keys <= i + N_KV - N_Q (top-left when N_Q == N_KV); a row that
    sees no key gives 0 and lse -inf. Returns fp32 output (and natural-log logsumexp [Z, H, N_Q]).

    Query rows are processed in chunks so that at most ``max_scores`` fp32 scores exist at once:
    long contexts stay within memory."""
    Z, H, n_q, _ = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    if H % h_kv:
        raise ValueError(f"reference: H_KV {h_kv} must divide H {H}")
    kf = (k.float() * descale_k).repeat_interleave(H // h_kv, dim=1)
    vf = (v.float() * descale_v).repeat_interleave(H // h_kv, dim=1)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros(Z, H, n_q, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((Z, H, n_q), float("-inf"), dtype=torch.float32, device=q.device)
    if n_k == 0:
        return (out, lse) if return_lse else out
    rows = max(1, min(n_q, max_scores // max(1, Z * H * n_k)))
    for start in range(0, n_q, rows):
        stop = min(n_q, start + rows)
        qf = q[:, :, start:stop].float() * descale_q
        s = torch.matmul(qf, kf.transpose(-1, -2)) * sm_scale
        if causal:
            qi = torch.arange(start, stop, device=q.device)[:, None] + (n_k - n_q)
            ki = torch.arange(n_k, device=q.device)[None, :]
            s = s.masked_fill(ki > qi, float("-inf"))
        chunk_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - chunk_lse[..., None]).nan_to_num(0.0)  # (rows with no key: -inf - -inf)
        out[:, :, start:stop] = torch.matmul(p, vf)
        lse[:, :, start:stop] = chunk_lse
        del s
    return (out, lse) if return_lse else out


def attention_backward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *,
                                 causal: bool, sm_scale: float | None = None, max_scores: int = 1 << 26):
    """fp32 gradients (dq, dk, dv) of ``attention_reference``'s output against ``do``, computed directly
    (P, dP = dO V^T, dS = P (dP - rowsum(dO O)), dQ = dS K s, dK = dS^T Q s, dV = P^T dO) in chunks of query
    rows, so that long contexts need no autograd graph. Shapes and GQA as ``attention_reference``; dk and
    dv are summed over each K/V head's query heads."""
    Z, H, n_q, D = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    group = H // h_kv
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    dq = torch.zeros(Z, H, n_q, D, dtype=torch.float32, device=q.device)
    dk = torch.zeros(Z, H, n_k, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros(Z, H, n_k, v.shape[-1], dtype=torch.float32, device=q.device)
    rows = max(1, min(n_q, max_scores // max(1, Z * H * n_k)))
    for start in range(0, n_q, rows) if n_k else ():
        stop = min(n_q, start + rows)
        qf = q[:, :, start:stop].float()
        dof = do[:, :, start:stop].float()
        s = torch.matmul(qf, kf.transpose(-1, -2)) * sm_scale
        if causal:
            qi = torch.arange(start, stop, device=q.device)[:, None] + (n_k - n_q)
            s = s.masked_fill(torch.arange(n_k, device=q.device)[None, :] > qi, float("-inf"))
        p = torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True)).nan_to_num(0.0)
        del s
        delta = (dof * torch.matmul(p, vf)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(dof, vf.transpose(-1, -2)) - delta)
        dq[:, :, start:stop] = torch.matmul(ds, kf) * sm_scale
        dk += torch.matmul(ds.transpose(-1, -2), qf) * sm_scale
        dv += torch.matmul(p.transpose(-1, -2), dof)
        del p, ds
    dk = dk.view(Z, h_kv, group, n_k, D).sum(2)
    dv = dv.view(Z, h_kv, group, n_k, v.shape[-1]).sum(2)
    return dq, dk, dv


def varlen_backward_reference(q, k, v, do, cu_seqlens_q, cu_seqlens_k, *, causal: bool,
                              sm_scale: float | None = None):
    """``attention_backward_reference`` of each packed sequence ([total, H, D] tensors); fp32 grads."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for b in range(len(cq) - 1):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        parts = ((q, sq), (k, sk), (v, sk), (do, sq))
        g = attention_backward_reference(*(t[s].transpose(0, 1)[None] for t, s in parts), causal=causal,
                                         sm_scale=sm_scale)
        dq[sq], dk[sk], dv[sk] = (x[0].transpose(0, 1) for x in g)
    return dq, dk, dv


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, *, causal: bool, sm_scale: float | None = None,
                     return_lse: bool = False):
    """``attention_reference`` of each packed sequence: q [total_q, H, D], k and v [total_k, H_KV, D];
    fp32 output [total_q, H, Dv] (and lse [H, total_q])."""
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o, l = attention_reference(q[qs].transpose(0, 1)[None], k[ks].transpose(0, 1)[None],
                                   v[ks].transpose(0, 1)[None], causal=causal, sm_scale=sm_scale, return_lse=True)
        out[qs] = o[0].transpose(0, 1)
        lse[:, qs] = l[0]
    return (out, lse) if return_lse else out


def reference_for(inputs: Inputs, sm_scale: float | None = None, return_lse: bool = False):
    return attention_reference(inputs.q, inputs.k, inputs.v, causal=inputs.problem.causal, sm_scale=sm_scale,
                               descale_q=inputs.descale_q, descale_k=inputs.descale_k,
                               descale_v=inputs.descale_v, return_lse=return_lse)


@dataclass(frozen=True)
class Tolerance:
    max_abs: float  # largest allowed |out - ref| for one element
    rel_l2: float  # largest allowed ||out - ref|| / ||ref||


# Chosen from the rounding of each input format (fp16: 11 bits, bf16: 8, e4m3: 4, e5m2: 3 bits of
# significand) plus the rounding of P to the input dtype before the PV product, with margin.
TOLERANCES: dict[str, Tolerance] = {
    "fp16": Tolerance(max_abs=1e-2, rel_l2=5e-3),
    "bf16": Tolerance(max_abs=4e-2, rel_l2=2e-2),
    "fp8e4m3": Tolerance(max_abs=1.5e-1, rel_l2=8e-2),
    "fp8e5": Tolerance(max_abs=3e-1, rel_l2=1.6e-1),
}


@dataclass(frozen=True)
class Accuracy:
    ok: bool
    max_abs: float
    rel_l2: float
    message: str


# Significand bits of the fp8 output formats: an output written in one of them is rounded once more,
# by up to half a unit in the last place, 2^-(bits + 1) of its value.
OUTPUT_ROUNDING_BITS = {"fp8e4m3": 3, "fp8e5": 2}


def tolerance(dtype: str, out_dtype: str | None = None, ref_max: float = 0.0) -> Tolerance:
    """The tolerance of the input dtype; an fp8 output's own rounding (half an ulp, relative) is added:
    ``2^-(bits+1) * max|ref|`` to the element bound and ``2^-(bits+1)`` to the relative one."""
    tol = TOLERANCES[dtype]
    bits = OUTPUT_ROUNDING_BITS.get(out_dtype or "")
    if bits is None:
        return tol
    half_ulp = 2.0 ** -(bits + 1)
    return Tolerance(max_abs=tol.max_abs + half_ulp * ref_max, rel_l2=tol.rel_l2 + half_ulp)


# Gradients, each compared relative to its largest reference element (they scale with the sequence):
# P and dS are rounded to the input dtype before their matmuls, dQ/dK/dV sum over a whole sequence.
GRAD_TOLERANCES: dict[str, Tolerance] = {
    "fp16": Tolerance(max_abs=2e-2, rel_l2=1e-2),
    "bf16": Tolerance(max_abs=8e-2, rel_l2=4e-2),
}


def check_gradients(grads, refs, dtype: str) -> Accuracy:
    """dq, dk, dv against fp32 reference gradients, each scaled by its reference's largest element; the
    worst of the three is reported."""
    tol = GRAD_TOLERANCES.get(dtype)
    if tol is None:
        return Accuracy(False, math.inf, math.inf, f"no gradient tolerance for {dtype}")
    worst_abs, worst_rel, bad = 0.0, 0.0, []
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        scale = max(float(r.abs().max().item()) if r.numel() else 0.0, 1e-30)
        acc = check_accuracy(g.float() / scale, r / scale, "fp16")
        if not math.isfinite(acc.max_abs):
            return Accuracy(False, acc.max_abs, acc.rel_l2, f"{name}: {acc.message}")
        worst_abs, worst_rel = max(worst_abs, acc.max_abs), max(worst_rel, acc.rel_l2)
        if acc.max_abs > tol.max_abs or acc.rel_l2 > tol.rel_l2:
            bad.append(f"{name}: max|g-ref|/max|ref|={acc.max_abs:.3g} (tol {tol.max_abs:g}), "
                       f"rel_l2={acc.rel_l2:.3g} (tol {tol.rel_l2:g})")
    return Accuracy(not bad, worst_abs, worst_rel, "; ".join(bad))


def check_accuracy(out: torch.Tensor, ref: torch.Tensor, dtype: str, out_dtype: str | None = None) -> Accuracy:
    """Compare an output (real values: an fp8 output already descaled) with the fp32 reference under the
    tolerance of the input dtype, widened by the rounding of the output format when that is fp8."""
    tol = tolerance(dtype, out_dtype, float(ref.abs().max().item()) if ref.numel() else 0.0)
    if tuple(out.shape) != tuple(ref.shape):
        return Accuracy(False, math.inf, math.inf, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o = out.float()
    n_bad = int((~torch.isfinite(o)).sum().item())
    if n_bad:
        return Accuracy(False, math.nan, math.nan, f"{n_bad} non-finite output elements (unwritten or overflow)")
    diff = (o - ref).abs()
    max_abs = float(diff.max().item()) if diff.numel() else 0.0
    rel = float((torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item())
    ok = max_abs <= tol.max_abs and rel <= tol.rel_l2
    msg = "" if ok else (f"max|out-ref|={max_abs:.3g} (tol {tol.max_abs:g}), "
                         f"rel_l2={rel:.3g} (tol {tol.rel_l2:g})")
    return Accuracy(ok, max_abs, rel, msg)
