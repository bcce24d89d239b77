"""The host side of the sm_90a backward, whose device code is ``hopper_bwd.py``: ``HopperBwdConfig`` (its knobs and
their validity check) and the head dims and dtypes it takes; the tuning lookups (``default_config``, ``config_space``);
the launch terms (``kernel_constexprs``, ``block_shapes``, ``box_block_shapes``, the grid and head chunks); the
launches the backend calls (``hopper_attention_bwd`` = ``launch``, its ``prepare``d form, ``hopper_na_boxes_bwd``
for 2-D/3-D windows) and the compile-only ``build``. It is sm_90a's ``backend.Backend.bwd``. Its pre- and
post-processing kernels (delta and the log2 lse, dQ's cast) are in ``hopper_bwd_prepost.py``.
"""

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from . import cdiv
from .common import box_rows, box_splits, rows_to_grid, window_label
from .hopper_bwd import (BLOCK_N, CONSUMER_REGS, KEYS_PER_WARPGROUP, PAIR_BLOCK_M, WIDE_BLOCK_N, WIDE_HEAD_DIM,
                         dq_scaled_in_loop, hopper_attention_bwd_kernel, pair_units)
from .hopper_bwd_prepost import padded_rows, row_index, dq_from_fragments, preprocess
from .hopper_host import (HEAD_DIM_PAIRS as _FWD_PAIRS, PAIR, kernel_head_dim, window_box_mode, window_box_table,
                          window_mode, window_table)
from .launch import (DescArg, LOG2E, hooks_active, launch_cached, placeholder, scratch, sm_count, tma_aligned,
                     tma_ready, tma_strides)
from .tuning import class_cached
from ..problem import own_v_dim

# What the backward takes: 32, 96, 192 run padded (``hopper_host.kernel_head_dim``).
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
HEAD_DIM_PAIRS = _FWD_PAIRS  # (q/k, v) head dims: v's, dO's and dV's columns past its own are zeros / clipped
DTYPES = ("fp16", "bf16")
NUM_WARPS = 4  # the default partition: consumer 0 (LOADER_WARPS 1) or the loader (4)


def block_n(head_dim: int, block_m: int = 0) -> int:
    """Keys per unit in the ``head_dim`` kernel (``block_m``: the config's query block; the 192/128 pair's own 32-query
    blocks take 128-key units, ``hopper_bwd.pair_units``)."""
    return WIDE_BLOCK_N if head_dim == WIDE_HEAD_DIM and not pair_units(head_dim, block_m) else BLOCK_N


def v_block_cols(head_dim: int, head_dim_v: int = 0) -> int:
    """The columns of V's and dO's blocks (descriptors and buffers) in the ``head_dim`` kernel: its own, but 128 for a
    v of at most 128 in the D=256 kernel (the 192/128 pair), which leaves room for a second Q/dO stage."""
    return 128 if head_dim == WIDE_HEAD_DIM and 0 < head_dim_v <= 128 else head_dim


SM90_SMEM_BYTES = 232448


@dataclass(frozen=True)
class HopperBwdConfig:
    """The sm_90a backward's knobs. BLOCK_M: queries per block (D=128: 64, dQ^T split by head dim; D=64:
    128, dQ split by queries); Q_STAGES: depth of the Q/dO ring; S_AHEAD: the next query block's S^T wgmma
    issued while this block's dQ share is added (D=64/128); DQ_FIRST: dQ's wgmma issued before dK's, and its share
    staged and added while dK runs (D=64/128, not with S_AHEAD); DQ_FRAG: dQ's shares staged, and accumulated, in
    the order the wgmma registers hold them (D=64/128 and the 192/128 pair's own units; packed sequences and the
    deterministic mode keep [rows, D]);
    LOADER_WARPS: the TMA loader as a 1-warp worker partition, or (4) as the 4-warp default partition; V_SPLIT:
    D=96's dK and dV as [64, 64] + [64, 32] accumulators over its own 96 head dims (the D=128 kernel's [64, 128] ones
    compute 32 zero columns each)."""
    BLOCK_M: int = 64
    Q_STAGES: int = 2
    S_AHEAD: bool = False
    DQ_FIRST: bool = False
    DQ_FRAG: bool = False
    LOADER_WARPS: int = 1
    V_SPLIT: bool = False

    def smem_bytes(self, head_dim: int, head_dim_v: int = 0) -> int:
        """In the ``head_dim`` kernel; ``head_dim_v``: v's, where it differs (V and dO ``v_block_cols`` wide)."""
        pair = pair_units(head_dim, self.BLOCK_M)
        wide = head_dim == WIDE_HEAD_DIM and not pair
        cols = head_dim + v_block_cols(head_dim, head_dim_v)  # (a K and a V row; a Q and a dO row)
        kv = block_n(head_dim, self.BLOCK_M) * cols * 2
        qdo = self.Q_STAGES * self.BLOCK_M * cols * 2
        ds = 2 * BLOCK_N * self.BLOCK_M * 2  # (dS^T, two slots; D=256: dS^T and P^T, 64 keys)
        dq = 2 * KEYS_PER_WARPGROUP * (64 if wide or pair else self.BLOCK_M if head_dim == 128 else head_dim) * 4
        rows = 2 * self.Q_STAGES * self.BLOCK_M * 4  # (lse and delta)
        return kv + qdo + ds + dq + rows + 8 * (2 + 2 * self.Q_STAGES + 2) + 16

    def invalid_reasons(self, head_dim: int, dtype: str, head_dim_v: int = 0) -> list[str]:
        reasons = []
        if dtype not in DTYPES:
            reasons.append(f"dtype {dtype} not supported by the backward (supported: {', '.join(DTYPES)})")
        if head_dim not in HEAD_DIMS:
            reasons.append(f"head dim {head_dim} not supported by the backward "
                           f"(supported: {', '.join(map(str, HEAD_DIMS))})")
            return reasons
        pair = (head_dim, head_dim_v) == PAIR
        if self.V_SPLIT and (head_dim != 96 or head_dim_v not in (0, 96)):
            reasons.append(f"V_SPLIT: D=96's dK and dV in 64 + 32 columns, not head dim {head_dim}'s")
        head_dim = kernel_head_dim(head_dim)
        want = (128,) if head_dim == 64 else (PAIR_BLOCK_M, 64) if pair else (64,)
        if self.BLOCK_M not in want:
            note = "; 32: the 192/128 pair in its own units" if head_dim == WIDE_HEAD_DIM else ""
            reasons.append(f"BLOCK_M {self.BLOCK_M}: D={head_dim} takes {' or '.join(map(str, want))} (the dQ split"
                           f"{note})")
        if self.Q_STAGES < 1:
            reasons.append("Q_STAGES must be >= 1")
        if self.LOADER_WARPS not in (1, 4):
            reasons.append(f"LOADER_WARPS {self.LOADER_WARPS} not in (1, 4)")
        if self.S_AHEAD and head_dim == WIDE_HEAD_DIM:
            reasons.append(f"S_AHEAD: D={WIDE_HEAD_DIM}'s block loop has no early S^T (supported: D 64, 128)")
        if self.DQ_FRAG and head_dim == WIDE_HEAD_DIM and not (pair and self.BLOCK_M == PAIR_BLOCK_M):
            reasons.append(f"DQ_FRAG: D={WIDE_HEAD_DIM} adds [64, 64] chunks of its own (supported: D 64, 128, and "
                           f"the {PAIR[0]}/{PAIR[1]} pair in its own units, BLOCK_M {PAIR_BLOCK_M})")
        if self.DQ_FIRST and (head_dim == WIDE_HEAD_DIM or self.S_AHEAD):
            reasons.append(f"DQ_FIRST: D 64 and 128, without S_AHEAD (D={WIDE_HEAD_DIM} issues its own order; with "
                           f"S_AHEAD it measured 0.90-0.99x of DQ_FIRST alone)")
        smem = self.smem_bytes(head_dim, head_dim_v)
        if smem + 512 > SM90_SMEM_BYTES:
            reasons.append(f"shared memory: {smem} B + 512 B of alignment > {SM90_SMEM_BYTES} B")
        return reasons

    def label(self) -> str:
        return (f"bwd_BM{self.BLOCK_M}_Q{self.Q_STAGES}" + ("_SA" if self.S_AHEAD else "")
                + ("_QF" if self.DQ_FIRST else "") + ("_FR" if self.DQ_FRAG else "")
                + ("_L4" if self.LOADER_WARPS == 4 else "") + ("_vs" if self.V_SPLIT else ""))

    def describe(self) -> dict:
        return {"config": self.label(), "block_m": self.BLOCK_M,
                "block_n": f"{BLOCK_N} ({WIDE_BLOCK_N} at D=256 but BLOCK_M 32)",
                "stages": self.Q_STAGES, "s_ahead": self.S_AHEAD, "dq_first": self.DQ_FIRST, "dq_frag": self.DQ_FRAG,
                "partitions": (f"loader ({self.LOADER_WARPS} warp{'s' if self.LOADER_WARPS > 1 else ''})"
                               " + 2 consumer WGs"),
                "regs": int(CONSUMER_REGS), "dq": "dQ^T by head dim" if self.BLOCK_M <= 64 else "dQ by queries",
                "units": "dynamic"}


def config_space():
    for block_m, stages, ahead, first, frag, loader, split in itertools.product(
            (PAIR_BLOCK_M, 64, 128), (1, 2, 3), (False, True), (False, True), (False, True), (1, 4), (False, True)):
        yield HopperBwdConfig(BLOCK_M=block_m, Q_STAGES=stages, S_AHEAD=ahead, DQ_FIRST=first, DQ_FRAG=frag,
                              LOADER_WARPS=loader, V_SPLIT=split)


@class_cached
def default_config(head_dim: int, dtype: str = "fp16", causal=None, n_ctx: int = 8192,
                   head_dim_v: int = 0) -> HopperBwdConfig:
    """The tuning table's backward entry for the class (``optimize --pass bwd``), else the rule: the
    query block the head dim's dQ split takes, a two-deep Q/dO ring (D=256: one, for shared memory; three for the
    192/128 pair, ``head_dim_v`` 128, whose V and dO blocks are 128 columns: ``v_block_cols``), the
    early S^T for D=64 causal, the one class where it gained (NOTES v39), dQ's wgmma before dK's for D=128, where it
    gained (NOTES v44), and dQ staged in fragment order (NOTES v45, v54; the pair's where it gained, non-causal: NOTES
    v113); the loader as one warp but for D=64 non-causal, where ptxas then spilled in the block loop (NOTES v49). A
    padded head dim without an entry of its own takes its kernel's (``hopper_host.kernel_head_dim``)."""
    from . import tuning

    if causal is not None:
        for d in dict.fromkeys((head_dim, kernel_head_dim(head_dim))):
            entry = tuning.lookup("sm_90a", d, dtype, causal, n_ctx, pass_name="bwd")
            if entry is not None:
                cfg = HopperBwdConfig(**entry)
                if not cfg.invalid_reasons(head_dim, dtype, head_dim_v):
                    return cfg
    pair = (head_dim, head_dim_v) == PAIR
    split = head_dim == 96 and head_dim_v in (0, 96)
    head_dim = kernel_head_dim(head_dim)
    one_stage = head_dim == WIDE_HEAD_DIM and v_block_cols(head_dim, head_dim_v) == head_dim
    return HopperBwdConfig(BLOCK_M=128 if head_dim == 64 else PAIR_BLOCK_M if pair else 64,
                           Q_STAGES=1 if one_stage else 3 if pair else 2,
                           S_AHEAD=head_dim == 64 and bool(causal), DQ_FIRST=head_dim == 128,
                           DQ_FRAG=head_dim in (64, 128) or pair and not causal,
                           LOADER_WARPS=4 if head_dim == 64 and not causal else 1, V_SPLIT=split)


def in_focused_space(cfg: HopperBwdConfig) -> bool:
    return True


def _reduce_dims(D: int, d_qk: int, d_v: int) -> tuple[int, int]:
    """The QK_DIM and V_DIM constexprs of a launch in the D kernel: q's and k's head dim and v's where below D, else 0
    (the kernel's own). D=32 keeps the D=64 kernel's: in two k-steps its causal block loop spilled 52 instructions
    where the kernel's four spill 24."""
    return tuple(d if D > d >= 64 else 0 for d in (d_qk, d_v))


def dq_frag(cfg: HopperBwdConfig, varlen: bool, deterministic: bool) -> bool:
    """Whether a launch keeps dQ's accumulator in fragment order (``hopper_bwd._dq_reduce``): the config asks for it
    and the launch is dense and not deterministic (packed sequences and the deterministic mode keep [rows, D])."""
    return cfg.DQ_FRAG and not varlen and not deterministic


def kernel_constexprs(cfg: HopperBwdConfig, causal: bool, varlen: bool, name: str,
                      deterministic: bool = False, padded: bool = False, window: int = 0, qk_dim: int = 0,
                      v_dim: int = 0) -> dict:
    """``qk_dim``, ``v_dim``: q's and k's, and v's, head dims where the kernel's is larger, else 0."""
    return dict(BLOCK_M=cfg.BLOCK_M, Q_STAGES=cfg.Q_STAGES, S_AHEAD=cfg.S_AHEAD, DQ_FIRST=cfg.DQ_FIRST,
                DQ_FRAG=dq_frag(cfg, varlen, deterministic), CAUSAL=bool(causal),
                VARLEN=bool(varlen), DETERMINISTIC=bool(deterministic), LOADER_WARPS=cfg.LOADER_WARPS,
                KERNEL_NAME=name, PADDED=bool(padded), WINDOW=int(window), QK_DIM=int(qk_dim), V_DIM=int(v_dim),
                V_SPLIT=bool(cfg.V_SPLIT))


FRAGMENT_BLOCK = [128, 32]  # DQ_FRAG: one warpgroup's [64, 64] share as a block of the [chunks * 128, 32] accumulator
PAIR_FRAGMENT_BLOCK = [64, 32]  # (the pair's own units: a [64 head dims, 32 queries] chunk)


def block_shapes(head_dim: int, cfg: HopperBwdConfig, frag: bool = False, head_dim_v: int = 0) -> dict:
    """In the ``head_dim`` kernel; ``head_dim_v``: v's head dim where it differs (V's and dO's blocks
    ``v_block_cols`` wide)."""
    q = [1, 1, cfg.BLOCK_M, head_dim]
    kv = [1, 1, KEYS_PER_WARPGROUP, head_dim]
    vc = v_block_cols(head_dim, head_dim_v)
    # (DQ_T and D=256: 64 queries x 64 head dims (the pair's own units: 32 queries); else 64 queries x D = 64;
    # DQ_FRAG: a share in fragment order)
    pair = pair_units(head_dim, cfg.BLOCK_M)
    dq = (PAIR_FRAGMENT_BLOCK if pair else FRAGMENT_BLOCK) if frag else [1, PAIR_BLOCK_M if pair else 64, 64]
    dkv = [1, 1, KEYS_PER_WARPGROUP, head_dim // 2 if head_dim == WIDE_HEAD_DIM else head_dim]  # (a warpgroup's)
    return {"desc_q": q, "desc_k": kv, "desc_v": kv[:3] + [vc], "desc_do": q[:3] + [vc], "desc_dq": dq,
            "desc_dk": dkv, "desc_dv": dkv}


RUNTIME_SIGNATURE = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "sched_ptr": "*i32", "seq_ptr": "*i32",
                     "dq_locks": "*i32", "qk_scale": "fp32", "sm_scale": "fp32", "N_Q": "i32", "N_KV": "i32",
                     "Z": "i32", "H": "i32", "H_KV": "i32", "n_seqs": "i32", "group_hz": "i32", "num_progs": "i32",
                     "locks_per_head": "i32"}


def hopper_attention_bwd(do, q, k, v, o, lse, *, causal: bool = False, sm_scale: Optional[float] = None,
                         grad_lse=None, kernel_name: str = "gluon_attention_bwd",
                         config: Optional[HopperBwdConfig] = None, varlen=None, deterministic: bool = False,
                         window: Optional[tuple[int, int, bool]] = None):
    """dQ, dK, dV of ``attention`` on Hopper, for validated CUDA tensors. q, o, do [Z, H, N_Q, D]; k, v
    [Z, H_KV, N_KV, D]; lse [Z, H, N_Q] (the forward's natural-log logsumexp) and its incoming gradient
    (optional). With ``varlen`` (a ``schedule.Packed``): [1, H, total, D] views of packed sequences and lse
    [1, H, total]. ``deterministic``: dQ bit-identical from run to run (its adds in key-block order; dK and
    dV always are). ``window``: (kernel size, stride, causal) of neighborhood attention along the rows, as the
    forward's (dense self-attention, ``causal`` False). Returns (dq, dk, dv) laid out as q, k, v (``empty_like``)."""
    import math
    from ..problem import dtype_name

    Z, H, N_Q, D_real = q.shape
    H_KV, N_KV = k.shape[1], k.shape[2]
    v_dim = own_v_dim(D_real, v.shape[3])
    cfg = config or default_config(D_real, dtype_name(q.dtype), bool(causal), max(N_Q, N_KV), v_dim)
    bad = cfg.invalid_reasons(D_real, dtype_name(q.dtype), v_dim)
    if bad:
        raise ValueError(f"Hopper backward config {cfg.label()} is invalid: {'; '.join(bad)}")
    scale = 1.0 / math.sqrt(D_real) if sm_scale is None else sm_scale
    mode = window_mode(window, varlen, causal, N_Q, N_KV)
    D = kernel_head_dim(D_real)  # (the kernel's: D_real's columns past the tensors read as zeros, stores clip)
    dev = q.device
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if not (tma_aligned(dk) and tma_aligned(dv)):  # (TMA-stored, as K and V are loaded)
        dk, dv = torch.empty(k.shape, dtype=k.dtype, device=dev), torch.empty(v.shape, dtype=v.dtype, device=dev)
    delta, lse2 = preprocess(o, do, lse, grad_lse)
    # The dQ accumulator (fp32; unscaled but for D=128 causal, the cast below multiplies by the scale:
    # ``dq_scaled_in_loop``): per head [rows, D], rows padded to whole query blocks
    # (packed: each sequence's, from the row ``dq_rows`` gives it).
    if varlen is not None:
        # (the unit count is in the device-built table: the grid is the SM count, idle programs end at once)
        dq_rows = padded_rows(varlen.cu_seqlens_q, cfg.BLOCK_M)
        table = torch.cat([varlen.table(H_KV, block_n(D, cfg.BLOCK_M), causal, by_keys=True), dq_rows])
        grid = sm_count(dev)
        # (a bound of the padded total without a host sync; whole blocks keep TMA's 16-byte row strides)
        rows = (cdiv(N_Q, cfg.BLOCK_M) + varlen.n_seqs) * cfg.BLOCK_M
    else:
        table = window_table(dev, int(window[0]), int(window[1])) if mode else placeholder(dev, torch.int32)
        grid, rows = _dense_grid(Z, H_KV, N_Q, N_KV, D, cfg, sm_count(dev))
    group_hz = _group_hz(Z, H_KV, N_KV, block_n(D, cfg.BLOCK_M), grid, causal, deterministic)
    locks = (torch.zeros(Z * H * (rows // cfg.BLOCK_M), dtype=torch.int32, device=dev) if deterministic
             else placeholder(dev, torch.int32))
    consts, key = _launch_consts(cfg, q, v, D, causal, varlen is not None, kernel_name, deterministic, mode)
    frag = consts["DQ_FRAG"]
    dq_acc = torch.zeros((Z, H, rows, acc_cols(D, D_real)), dtype=torch.float32, device=dev)
    blocks = block_shapes(D, cfg, frag, v_dim)
    # (DQ_FRAG: the same memory as [chunks * rows, 32], each query block of a head its chunks in fragment order: two
    # [128, 32] ones, the pair's three [64, 32])
    acc_view = dq_acc.view(-1, FRAGMENT_BLOCK[1]) if frag else dq_acc.view(Z * H, *dq_acc.shape[2:])
    args = (DescArg.of(tma_ready(q), blocks["desc_q"]), DescArg.of(tma_ready(k), blocks["desc_k"]),
            DescArg.of(tma_ready(v), blocks["desc_v"]), DescArg.of(tma_ready(do), blocks["desc_do"]),
            DescArg.of(acc_view, blocks["desc_dq"]), DescArg.of(dk, blocks["desc_dk"]),
            DescArg.of(dv, blocks["desc_dv"]), dk, dv, lse2, delta,
            torch.zeros(1, dtype=torch.int32, device=dev), table, locks, scale * LOG2E, scale, N_Q, N_KV, Z, H, H_KV,
            n_seqs_of(varlen), group_hz, grid, rows // cfg.BLOCK_M)
    launch_cached(hopper_attention_bwd_kernel, NUM_WARPS, grid, args, consts, dev, key=key)
    cast_scale = 1.0 if dq_scaled_in_loop(D, causal) else scale
    if frag:
        dq_from_fragments(dq_acc, dq, cfg.BLOCK_M, cast_scale)
    elif varlen is not None:
        torch.mul(dq_acc.index_select(2, row_index(varlen.cu_seqlens_q, dq_rows, N_Q))[..., :D_real], cast_scale,
                  out=dq)
    else:
        torch.mul(dq_acc[:, :, :N_Q, :D_real], cast_scale, out=dq)
    return dq, dk, dv


def acc_cols(D: int, D_real: int) -> int:
    """The dQ accumulator's columns: the kernel's head dim, but q's 192 in the D=256 kernel (the 192/128 pair and
    192/192): every 64-column chunk those launches add lies inside them (DQ_FRAG's too: three a query block), so the
    cast reads the accumulator whole (a contiguous multiply: 0.41 ms against the strided 256-column one's 0.71 at Z 4,
    H 32, N 8192 on an H200, run 252), the zeroing writes a quarter less, and a call's memory is the peers'."""
    return D_real if D == WIDE_HEAD_DIM and D_real % 64 == 0 else D


def _dense_grid(Z: int, H_KV: int, N_Q: int, N_KV: int, D: int, cfg: HopperBwdConfig, sms: int) -> tuple[int, int]:
    """(programs, dQ accumulator rows per head) of a launch that is not packed: a program per key block up to the
    SM count; the query rows padded to whole query blocks."""
    return (max(1, min(sms, Z * H_KV * cdiv(N_KV, block_n(D, cfg.BLOCK_M)))),
            cdiv(N_Q, cfg.BLOCK_M) * cfg.BLOCK_M)


def _group_hz(Z: int, H_KV: int, N_KV: int, keys: int, grid: int, causal: bool, deterministic: bool) -> int:
    """Dense units go in chunks of this many heads, key blocks outermost inside: about one wave, so the units
    running at once share their heads' Q, dO and dQ rows in L2. Deterministic and causal: eight waves, so
    that only about an eighth of a wave are one head's key blocks, which wait on each other's dQ adds
    (non-causal units are all as long: after the first wave they come free, and start, already staggered;
    eight waves there cost L2 hits: NOTES v37).
    Packed sequences: key blocks outermost, K/V heads inside (``KeyShape.work``)."""
    waves = 8 if deterministic and causal else 1
    return max(1, min(Z * H_KV, waves * grid // cdiv(N_KV, keys)))


def _launch_consts(cfg: HopperBwdConfig, q, v, D: int, causal: bool, varlen: bool, kernel_name: str,
                   deterministic: bool, mode: int) -> tuple[dict, tuple]:
    """(constexprs, the launch key) of a launch that is not 2-D/3-D boxes, in the D kernel for q's and v's head dims
    (``hopper_attention_bwd`` launches by this key, ``prepare`` finds the build by it)."""
    D_real = q.shape[3]
    consts = kernel_constexprs(cfg, causal, varlen, kernel_name, deterministic, D != D_real or v.shape[3] != D_real,
                               mode, *_reduce_dims(D, D_real, v.shape[3]))
    return consts, (hopper_attention_bwd_kernel, q.dtype, D, *consts.values())


def prepare(do, q, k, v, o, lse, grad_lse=None, *, causal: bool = False, sm_scale: Optional[float] = None,
            kernel_name: str = "gluon_attention_bwd", deterministic: bool = False) -> Optional["_PreparedBwd"]:
    """The dense backward of one call signature (``hopper_attention_bwd`` without ``config``, ``varlen`` or
    ``window``) prepared, once a call of it has compiled its kernels: its plan, its descriptors' shapes and strides,
    one zeroed workspace a call (the dQ accumulator, the scheduler's counter, the deterministic mode's locks, delta
    and the log2 lse) and three launches by address (``preprocess``'s, the kernel's, dQ's cast). None where it cannot
    be (a layout TMA cannot take, a kernel that needs the JIT's own launcher)."""
    return _PreparedBwd.make(do, q, k, v, o, lse, grad_lse, bool(causal), sm_scale, kernel_name, bool(deterministic))


class _PreparedBwd:
    """``prepare``'s launches; a call returns None where it cannot launch (an address that is not 16-byte aligned, a
    profiler hook): the caller then takes ``hopper_attention_bwd``."""

    @staticmethod
    def make(do, q, k, v, o, lse, grad_lse, causal, sm_scale, kernel_name, deterministic):
        import math

        from ..cache import layout
        from ..problem import dtype_name
        from .hopper_bwd_prepost import preprocess_launch, fragments_launch
        from .launch import FixedLaunch, aligned_offsets, compiled, device_index, meta_like

        Z, H, N_Q, D_real = q.shape
        H_KV, N_KV = k.shape[1], k.shape[2]
        dev = q.device
        if not all(tma_strides(t) for t in (q, k, v, do)) or o.stride(-1) != 1 or do.stride(-1) != 1 \
                or not lse.is_contiguous() or (grad_lse is not None and not grad_lse.is_contiguous()):
            return None
        v_dim = own_v_dim(D_real, v.shape[3])
        cfg = default_config(D_real, dtype_name(q.dtype), causal, max(N_Q, N_KV), v_dim)
        D = kernel_head_dim(D_real)
        grid, rows = _dense_grid(Z, H_KV, N_Q, N_KV, D, cfg, sm_count(dev))
        group_hz = _group_hz(Z, H_KV, N_KV, block_n(D, cfg.BLOCK_M), grid, causal, deterministic)
        consts, key = _launch_consts(cfg, q, v, D, causal, False, kernel_name, deterministic, 0)
        main = compiled(hopper_attention_bwd_kernel, key, dev)
        if main is None or not main.usable:
            return None
        self = _PreparedBwd()
        self.index, self.device = device_index(dev), dev
        self.dq_layout = layout(torch.empty_like(meta_like(q)))
        dk, dv = torch.empty_like(meta_like(k)), torch.empty_like(meta_like(v))
        if not (tma_strides(dk) and tma_strides(dv)):  # (layouts: the gradients' addresses are each call's)
            dk = torch.empty(k.shape, dtype=k.dtype, device="meta")
            dv = torch.empty(v.shape, dtype=v.dtype, device="meta")
        self.dk_layout, self.dv_layout = layout(dk), layout(dv)
        # The workspace, fp32 words at 128-byte aligned byte offsets: dQ's accumulator, the counter, the locks,
        # delta and the log2 lse (the stream's scratch memory; the preprocess zeroes the words before delta: the
        # accumulator, the counter and the locks must start at 0).
        frag = consts["DQ_FRAG"]
        cols = acc_cols(D, D_real)
        acc_words = Z * H * rows * cols
        locks_words = Z * H * (rows // cfg.BLOCK_M) if deterministic else 0
        (_, self.counter, self.locks, self.delta, self.lse2), nbytes = aligned_offsets(
            [4 * n for n in (acc_words, 1, locks_words, Z * H * N_Q, Z * H * N_Q)])
        self.words = nbytes // 4
        blocks = block_shapes(D, cfg, frag, v_dim)
        acc_view = ([acc_words // FRAGMENT_BLOCK[1], FRAGMENT_BLOCK[1]], [FRAGMENT_BLOCK[1], 1]) if frag else \
            ([Z * H, rows, cols], [rows * cols, cols, 1])
        descs = [(blocks[n], list(t.shape), list(t.stride())) for n, t in (("desc_q", q), ("desc_k", k),
                                                                           ("desc_v", v), ("desc_do", do))]
        descs += [(blocks["desc_dq"], *acc_view)]
        descs += [(blocks[n], list(t.shape), list(t.stride())) for n, t in (("desc_dk", dk), ("desc_dv", dv))]
        self.main = FixedLaunch(main, grid, descs, consts)
        scale = 1.0 / math.sqrt(D_real) if sm_scale is None else sm_scale
        self.scalars = (scale * LOG2E, scale, N_Q, N_KV, Z, H, H_KV, 0, group_hz, grid, rows // cfg.BLOCK_M)
        self.unused = placeholder(dev, torch.int32).data_ptr()
        self.pre = preprocess_launch(o, do, lse, grad_lse, zero_words=self.delta // 4)
        cast_scale = 1.0 if dq_scaled_in_loop(D, causal) else scale
        self.post = fragments_launch((Z, H, rows, cols), torch.empty_strided(*self.dq_layout[:2], dtype=q.dtype,
                                                                          device=dev), cfg.BLOCK_M, cast_scale) \
            if frag else None
        if frag and self.post is None or self.pre is None:
            return None
        # (not fragments: dQ = the accumulator's first N_Q rows and D_real columns, scaled)
        self.acc_rows = ((Z, H, N_Q, D_real), (H * rows * cols, rows * cols, cols, 1))
        self.cast_scale = cast_scale
        return self

    def __call__(self, do, q, k, v, o, lse, grad_lse):
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr())
        op, lp = o.data_ptr(), lse.data_ptr()
        gp = grad_lse.data_ptr() if grad_lse is not None else lp
        if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | op | lp | gp) & 15 or hooks_active():
            return None
        dev = self.device
        dq = torch.empty_strided(self.dq_layout[0], self.dq_layout[1], dtype=self.dq_layout[2], device=dev)
        dk = torch.empty_strided(self.dk_layout[0], self.dk_layout[1], dtype=self.dk_layout[2], device=dev)
        dv = torch.empty_strided(self.dv_layout[0], self.dv_layout[1], dtype=self.dv_layout[2], device=dev)
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        ws = scratch(self.index, stream, 4 * self.words, torch.float32)
        if ws is None:  # (a CUDA graph's capture: memory of its own)
            ws = torch.empty(self.words, dtype=torch.float32, device=dev)
        w = ws.data_ptr()
        # (the preprocess zeroes the words before delta: dQ's accumulator, the counter and the locks)
        self.pre(stream, op, do.data_ptr(), lp, gp, w + self.delta, w + self.lse2, w)
        dkp, dvp = dk.data_ptr(), dv.data_ptr()
        self.main(stream, (*ptrs, w, dkp, dvp), (dkp, dvp, w + self.lse2, w + self.delta, w + self.counter, self.unused,
                                                 w + self.locks, *self.scalars))
        if self.post is not None:
            self.post(stream, w, dq.data_ptr())
        else:
            torch.mul(ws.as_strided(*self.acc_rows), self.cast_scale, out=dq)
        return dq, dk, dv


BOX_HEAD_DIMS = (32, 64, 96, 128)  # 2-D/3-D windows: the forward's (``hopper_host.WINDOW_BOX_HEAD_DIMS``)


def window_boxes(head_dim: int, dims: int = 2) -> tuple:
    """Every (query box, key box) the backward takes for a 2-D or 3-D window at this head dim: a query block of the
    head dim's BLOCK_M positions and a unit's BLOCK_N keys, each split into powers of two per dimension, the key box
    at least 2 along x (each warpgroup's 64 keys are its half along x)."""
    if head_dim not in BOX_HEAD_DIMS:
        return ()
    q = box_splits(default_config(head_dim).BLOCK_M, dims)
    kv = [b for b in box_splits(BLOCK_N, dims) if b[0] >= 2]
    return tuple((a, b) for a in q for b in kv)


def box_block_shapes(head_dim: int, boxes: tuple) -> dict:
    """2-D/3-D windows: the descriptors' blocks. Q, dO: a query box of [Z, H, Lx, Ly, D] (3-D: [H, Lx, Ly, Lz, D])
    views; K, V, dK, dV: a warpgroup's half (along x) of a key box; dQ's accumulator as the dense one (its rows box
    after box)."""
    qb, kb = boxes
    lead = [1] * (4 - len(kb))
    half = lead + [kb[0] // 2, *kb[1:], head_dim]
    return {"desc_q": lead + [*qb, head_dim], "desc_k": half, "desc_v": half, "desc_do": lead + [*qb, head_dim],
            "desc_dq": [1, 64, 64], "desc_dk": half, "desc_dv": half}


def hopper_na_boxes_bwd(do, q, k, v, o, lse, *, window: tuple, boxes: tuple, sm_scale: float, grad_lse=None,
                        dq=None, dk=None, dv=None, config: Optional[HopperBwdConfig] = None,
                        kernel_name: str = "gluon_attention_bwd", deterministic: bool = False):
    """dQ, dK, dV of 2-D or 3-D neighborhood attention over one dilation group (``hopper.hopper_na_boxes``'s
    backward). 2-D: q, o, do [Z, H, Lx, Ly, D], k, v [Z, H_KV, Lx, Ly, D], lse [Z, H, Lx Ly]; 3-D (one batch): [H,
    Lx, Ly, Lz, D], [H_KV, ...], lse [H, Lx Ly Lz]; views of any strides TMA takes; the lse the forward's (natural
    log) and its incoming gradient (optional, as lse). ``window``: per dimension (kernel size, stride, causal);
    ``boxes``: (query box, key box) from ``window_boxes``; dq, dk, dv: views to write (like q, k, v), or made.
    A unit is a key box, walking the query boxes whose windows reach it (``masks.BoxWalk``); the lse, delta and
    dQ's fp32 accumulator are laid out box after box (``box_rows``), so the dense kernel's dQ reduce-adds serve
    unchanged, and dQ comes back to the grid in the cast (``rows_to_grid``). ``deterministic``: dQ's adds into each
    query box in the order of the key boxes that reach it (``hopper_bwd._box_turn``). Returns (dq, dk, dv)."""
    from ..problem import dtype_name

    dims = len(window)
    if dims == 3:
        H, *grid, D_real = q.shape
        Z, H_KV = 1, k.shape[0]
        lead = lambda t: t.unsqueeze(0)  # noqa: E731  (one batch: Z = 1 for the lse and dQ)
    else:
        Z, H, *grid, D_real = q.shape
        H_KV = k.shape[1]
        lead = lambda t: t  # noqa: E731
    grid = tuple(grid)
    boxes = tuple(map(tuple, boxes))
    taken = window_boxes(D_real, dims)
    if boxes not in taken:
        raise ValueError(f"{dims}-D window backward boxes {boxes} are not taken at D={D_real}: {taken}")
    tokens = 1
    for g in grid:
        tokens *= g
    base = config or default_config(D_real, dtype_name(q.dtype), False, tokens)
    cfg = dataclasses.replace(base, S_AHEAD=False, DQ_FRAG=False)
    bad = cfg.invalid_reasons(D_real, dtype_name(q.dtype))
    D = kernel_head_dim(D_real)  # (32 and 96: the next kernel up, as the dense backward; its box stores clipped)
    if bad:
        raise ValueError(f"Hopper backward config {cfg.label()} is invalid: {'; '.join(bad)}")
    dev = q.device
    dq = torch.empty(q.shape, dtype=q.dtype, device=dev) if dq is None else dq
    dk = torch.empty(k.shape, dtype=k.dtype, device=dev) if dk is None else dk
    dv = torch.empty(v.shape, dtype=v.dtype, device=dev) if dv is None else dv
    dk_t = dk if tma_aligned(dk) else torch.empty(k.shape, dtype=k.dtype, device=dev)
    dv_t = dv if tma_aligned(dv) else torch.empty(v.shape, dtype=v.dtype, device=dev)
    flat = lambda t: lead(t).reshape(Z, H, tokens, t.shape[-1])  # noqa: E731  [Z, H, tokens, D] (a view at dilation 1)
    delta, lse2 = preprocess(flat(o), flat(do), lead(lse).reshape(Z, H, tokens),
                             None if grad_lse is None else lead(grad_lse).reshape(Z, H, tokens))
    qbox, kbox = boxes
    lse_rows = box_rows(lse2.view(Z, H, *grid), qbox, float("inf"))  # (+inf past the grid: P = 0 there)
    delta_rows = box_rows(delta.view(Z, H, *grid), qbox, 0.0)
    rows = lse_rows.shape[2]
    n_kb = 1
    for g, b in zip(grid, kbox):
        n_kb *= -(-g // b)
    n_kv = n_kb * BLOCK_N  # (the key boxes as rows: a unit's number is its box's)
    acc = torch.zeros((Z, H, rows, D), dtype=torch.float32, device=dev)
    grid_size = max(1, min(sm_count(dev), Z * H_KV * n_kb))
    group_hz = max(1, min(Z * H_KV, grid_size // n_kb))
    consts = kernel_constexprs(cfg, False, False, kernel_name, deterministic, D != D_real, window_box_mode(
        tuple(bool(c) for _, _, c in window)), *_reduce_dims(D, D_real, D_real))
    locks = (torch.zeros(Z * H * (rows // cfg.BLOCK_M), dtype=torch.int32, device=dev) if deterministic
             else placeholder(dev, torch.int32))
    blocks = box_block_shapes(D, boxes)
    words = (grid[0], grid[1], window[0][0], window[0][1], window[1][0], window[1][1])
    if dims == 3:
        words += (grid[2], window[2][0], window[2][1])
    args = (DescArg.of(tma_ready(q), blocks["desc_q"]), DescArg.of(tma_ready(k), blocks["desc_k"]),
            DescArg.of(tma_ready(v), blocks["desc_v"]), DescArg.of(tma_ready(do), blocks["desc_do"]),
            DescArg.of(acc.view(Z * H, rows, D), blocks["desc_dq"]), DescArg.of(dk_t, blocks["desc_dk"]),
            DescArg.of(dv_t, blocks["desc_dv"]), dk_t, dv_t, lse_rows, delta_rows,
            torch.zeros(1, dtype=torch.int32, device=dev), window_box_table(dev, tuple(int(x) for x in words)),
            locks, sm_scale * LOG2E, sm_scale, rows, n_kv, Z, H, H_KV, 0, group_hz, grid_size,
            rows // cfg.BLOCK_M)
    key = (hopper_attention_bwd_kernel, q.dtype, D, *consts.values(), boxes)
    launch_cached(hopper_attention_bwd_kernel, NUM_WARPS, grid_size, args, consts, dev, key=key)
    rows_to_grid(acc, grid, qbox, lead(dq), sm_scale)
    if dk_t is not dk:
        dk.copy_(dk_t)
    if dv_t is not dv:
        dv.copy_(dv_t)
    return dq, dk, dv


def n_seqs_of(varlen) -> int:
    return 0 if varlen is None else varlen.n_seqs


launch = hopper_attention_bwd


def build(dtype: str, head_dim: int, causal: bool, cfg: HopperBwdConfig, name: str, varlen: bool = False,
          deterministic: bool = False, window: int = 0, boxes=None, head_dim_v: int = 0):
    """The compile-only build of one specialization (``inspect --pass bwd``, the compile tests; ``window``: the
    neighborhood mode, 1 non-causal, 2 causal windows, 4-15 2-D/3-D ones over ``boxes``, (query box, key box);
    ``head_dim_v``: v's head dim where it differs from q's, the 192/128 pair)."""
    from ..problem import dtype_from_name
    from .build import KernelBuild
    from .common import descriptor_signature, sig_dtype

    in_dtype = dtype_from_name(dtype)
    padded = kernel_head_dim(head_dim) != head_dim
    if boxes is not None:  # (as ``hopper_na_boxes_bwd`` launches them)
        cfg = dataclasses.replace(cfg, S_AHEAD=False, DQ_FRAG=False)
    v_dim = own_v_dim(head_dim, head_dim_v)
    constexprs = kernel_constexprs(cfg, causal, varlen, name, deterministic, padded, window,
                                   *_reduce_dims(kernel_head_dim(head_dim), head_dim, head_dim_v or head_dim))
    frag = constexprs["DQ_FRAG"]  # (as the launch reads it)
    cfg = dataclasses.replace(cfg, DQ_FRAG=frag)  # (the description's label: the config as launched)
    shapes = (box_block_shapes(kernel_head_dim(head_dim), boxes) if boxes is not None
              else block_shapes(kernel_head_dim(head_dim), cfg, frag, v_dim))
    descs = {n: descriptor_signature(torch.float32 if n == "desc_dq" else in_dtype, block)
             for n, block in shapes.items()}
    ptrs = {"dk_ptr": "*" + sig_dtype(in_dtype), "dv_ptr": "*" + sig_dtype(in_dtype)}
    sig = {**descs, **ptrs, **RUNTIME_SIGNATURE, **{k: "constexpr" for k in constexprs}}
    return KernelBuild(fn=hopper_attention_bwd_kernel, signature=sig, constexprs=constexprs, num_warps=NUM_WARPS,
                       name=name, description=f"Hopper attention backward {dtype} D={head_dim}"
                                              f"{f'/{head_dim_v}' if head_dim_v and head_dim_v != head_dim else ''}"
                                              f"{f' (the D={kernel_head_dim(head_dim)} kernel)' if padded else ''}"
                                              f" causal={causal}"
                                              f"{' varlen' if varlen else ''}"
                                              f"{' deterministic' if deterministic else ''}"
                                              f"{window_label(window, boxes)}{cfg.label()}")
