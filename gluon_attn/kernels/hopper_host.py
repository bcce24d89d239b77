"""The host side of the sm_90a forward, whose device code is ``hopper.py``: ``HopperConfig`` (the knobs a tuning
class picks, with their validity check) and the head dims and dtypes it takes; the tuning lookups (``default_config``,
``packed_config``, ``config_space``, ``in_focused_space``); the launch plans (``_launch_plan``, ``_na_box_plan``,
``block_shapes``, ``kernel_constexprs``); the launches the backend calls (``hopper_attention`` = ``launch``, its
``prepare``d form per call signature, ``hopper_na_boxes`` and ``prepare_na_boxes`` for 2-D/3-D windows) and the
compile-only ``build``. It is sm_90a's ``backend.Backend.module``.
"""

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..cache import BoundedCache, shallow_copy, signature
from .common import box_rows, box_splits, resolve_output, window_label
from .hopper import (BLOCK_N, LOADER_REGS, WIDE_BLOCK_N, WIDE_HEAD_DIM, block_n, hopper_attention_kernel,
                     q_stages)
from .launch import (LOG2E, DescArg, FixedLaunch, checked_config, compiled, device_index, hooks_active, launch_cached,
                     meta_like, placeholder, sm_count, softmax_args, tma_aligned, tma_ready, tma_strides,
                     zeroed_counter)
from .schedule import work_units
from .tuning import class_cached
from .v_transpose import fp8_vt

# Each consumer warpgroup owns this many query rows: the M of one wgmma instruction is 64 per
# warpgroup, and 64 rows keep S (64 x BLOCK_N fp32) and O (64 x D fp32) in registers together.
ROWS_PER_WARPGROUP = 64
SM90_SMEM_BYTES = 232448  # 227 KB of dynamic shared memory per block on H100/H200
SM90_REGISTERS = 65536
BARRIER_BYTES = 8
SMEM_SLACK = 512  # alignment padding the compiler adds to the estimate (seen: 280-420 B)
HEAD_DIMS = (32, 64, 96, 128, 192, 256)  # what the forward takes (q and k; v the same, or HEAD_DIM_PAIRS)
# Head dims the kernel is built for. The others run in the next one up (``kernel_head_dim``): TMA reads the
# columns past the tensors' head dim as zeros (Q K^T unchanged, O's extra columns 0) and clips its stores there;
# the stores from registers clip them with the kernel's PADDED. FLOPs count the real head dim.
KERNEL_HEAD_DIMS = (64, 128, 256)
_PADDED_TO = {32: 64, 96: 128, 192: 256}
# (q/k head dim, v head dim) pairs with a v head dim of its own (DeepSeek-V3's 192/128): the q/k head dim's kernel
# runs them, v's columns past its own read as zeros (P V's extra columns 0) and O's clipped as a padded head dim's.
HEAD_DIM_PAIRS = ((192, 128),)
PAIR = HEAD_DIM_PAIRS[0]
PAIR_K_COLS = 64  # PAIR_TILE: K's pieces (192 = 3 x 64; Gluon's tiles are powers of two)
DTYPES = ("fp16", "bf16", "fp8e5", "fp8e4m3")


def kernel_head_dim(head_dim: int) -> int:
    """The head dim of the kernel that runs a problem's head dim (itself, or padded: 32 -> 64, 96 -> 128,
    192 -> 256)."""
    return _PADDED_TO.get(head_dim, head_dim)


def qk_pieces(head_dim: int) -> int:
    """The QK_DIM constexpr of a head dim: itself where the kernel is larger (S = Q K^T over its own columns, in
    power-of-two pieces: ``hopper._qk``), else 0 (the kernel's own)."""
    return head_dim if kernel_head_dim(head_dim) != head_dim else 0


def head_dim_consts(head_dim: int, head_dim_v: int) -> tuple[bool, int, int]:
    """(PADDED, QK_DIM, V_DIM) of q's and k's head dim ``head_dim`` and v's ``head_dim_v`` in the kernel that runs
    them (``kernel_head_dim``): stores clip columns where either is not the kernel's (HEAD_DIM_PAIRS: O has v's head
    dim), ``qk_pieces`` and ``v_cols``."""
    kernel_dim = kernel_head_dim(head_dim)
    return kernel_dim != head_dim or head_dim_v != head_dim, qk_pieces(head_dim), v_cols(kernel_dim, head_dim_v)


def _pair_tile(cfg: "HopperConfig", qk_dim: int, head_dim_v: int, window: int = 0) -> bool:
    """Whether a launch takes PAIR_TILE's blocks; the knob on anything but the dense 192/128 pair is an error."""
    if not cfg.PAIR_TILE:
        return False
    if (qk_dim, head_dim_v) != PAIR or window:
        raise ValueError(f"PAIR_TILE is the dense {PAIR[0]}/{PAIR[1]} pair's (q, k / v head dims); this launch has "
                         f"{qk_dim or 'the kernel'}'s / {head_dim_v}{' and a window' if window else ''}")
    return True


def pair_config(cfg: "HopperConfig", qk_dim: int, head_dim_v: int) -> "HopperConfig":
    """A dense launch's default for its head dims: the 192/128 pair in PAIR_TILE's 128-key blocks (FA4's tile for it,
    NOTES v94), any other pair the config as it is."""
    return dataclasses.replace(cfg, PAIR_TILE=True) if (qk_dim, head_dim_v) == PAIR else cfg


def v_cols(kernel_dim: int, head_dim_v: int) -> int:
    """The V_DIM constexpr: v's head dim where it is a power of two below the kernel's (32 in the D=64 kernel, the
    192/128 pair's 128 in the D=256 one: O's accumulator and PV's columns are v's), else 0 (the kernel's; a padded
    96 or 192 reads V's zero columns)."""
    return head_dim_v if head_dim_v < kernel_dim and head_dim_v & (head_dim_v - 1) == 0 else 0


@dataclass(frozen=True)
class HopperConfig:
    """The sm_90a kernel's knobs: each is picked by some tuning class (gluon_attn/tuning/sm_90a.json).
    What the fixed choices measured, and the knobs that went, are in experiments/NOTES.md (v33)."""
    BLOCK_M: int = 2 * ROWS_PER_WARPGROUP  # query rows per tile: 64 per consumer warpgroup (128: two, 192: three)
    KV_STAGES: int = 2  # depth of the K and V rings
    PINGPONG: bool = False  # the consumer warpgroups take turns issuing their GEMMs
    DYNAMIC: bool = False  # units handed out by a global counter as programs free up (else pid + k x grid)
    SUM_MMA: bool = False  # the row sums by a wgmma against a tile of ones (else adds in the softmax)
    # the 192/128 pair in 128-key blocks, K in 64-column pieces (else the D=256 kernel's 64); a dense launch without a
    # config takes it for the pair (``pair_config``)
    PAIR_TILE: bool = False

    @staticmethod
    def block_n(head_dim: int) -> int:
        return block_n(head_dim)

    @property
    def consumers(self) -> int:
        return self.BLOCK_M // ROWS_PER_WARPGROUP

    @property
    def ctas_per_sm(self) -> int:
        """Programs an SM holds at once: two of one consumer warpgroup (BLOCK_M 64), so that one's per-tile work
        (its first S, last PV and epilogue) runs beside the other's MMAs; else one."""
        return 2 if self.consumers == 1 else 1

    @property
    def compile_options(self) -> dict:
        """Launch-time registers per thread for ``ctas_per_sm`` programs of two warpgroups (the consumer's and the
        loader's); setmaxnreg then moves them from the loader to the consumer."""
        return {"maxnreg": SM90_REGISTERS // self.ctas_per_sm // 256} if self.ctas_per_sm > 1 else {}

    @property
    def consumer_regs(self) -> int:
        """Registers per consumer thread (setmaxnreg): the program's share of the 64K-register file less the
        loader's warpgroup, shared by the consumer warpgroups, in multiples of 8."""
        return (SM90_REGISTERS // self.ctas_per_sm // 128 - int(LOADER_REGS)) // self.consumers // 8 * 8

    def smem_bytes(self, head_dim: int, in_bytes: int, out_bytes: int) -> int:
        bn, qs = block_n(head_dim), q_stages(head_dim)
        q = qs * self.BLOCK_M * head_dim * in_bytes
        kv = 2 * self.KV_STAGES * bn * head_dim * in_bytes
        if self.PAIR_TILE:  # (128-key blocks: K's 192 columns in pieces, V's 128)
            bn = BLOCK_N
            kv = self.KV_STAGES * BLOCK_N * (PAIR[0] + PAIR[1]) * in_bytes
        # O staged for its TMA store (head dim 256: stored from registers)
        o = 0 if head_dim == WIDE_HEAD_DIM else self.BLOCK_M * head_dim * out_bytes
        bars = BARRIER_BYTES * (2 * self.consumers * qs + 2 * 2 * self.KV_STAGES)
        # SUM_MMA's ones: one shared tile for 16-bit inputs, one per consumer for fp8
        ones_tiles = (self.consumers if in_bytes == 1 else 1) if self.SUM_MMA else 0
        ones = ones_tiles * 8 * bn * in_bytes
        return q + kv + o + bars + ones

    def consumer_register_estimate(self, head_dim: int, in_bytes: int) -> int:
        """Live registers per consumer thread in the steady state: S (fp32), P as the loop carries it
        (16-bit pairs, fp8 too), O (fp32), 64 rows over 128 threads, plus ~32 for indices, row
        statistics and temporaries (the three-warpgroup fp8 D=64 build holds S + P + O = 128 at 160
        registers without spilling)."""
        s = ROWS_PER_WARPGROUP * block_n(head_dim) // 128
        p = s // 2
        o = ROWS_PER_WARPGROUP * head_dim // 128
        return s + p + o + 32

    def invalid_reasons(self, head_dim: int, dtype: str, head_dim_v: int = 0) -> list[str]:
        """Why this config cannot run a problem class (empty when it can); ``head_dim_v``: v's head dim where it is
        not q's (0: q's; the 192/128 pair's 128)."""
        reasons = []
        in_bytes = 1 if dtype.startswith("fp8") else 2
        if head_dim not in HEAD_DIMS:
            reasons.append(f"head dim {head_dim} not supported (supported: {', '.join(map(str, HEAD_DIMS))})")
        if self.PAIR_TILE and head_dim != PAIR[0]:
            reasons.append(f"PAIR_TILE is the {PAIR[0]}/{PAIR[1]} pair's, not head dim {head_dim}'s")
        elif self.PAIR_TILE and head_dim_v not in (0, PAIR[1]):
            reasons.append(f"PAIR_TILE is the {PAIR[0]}/{PAIR[1]} pair's, not {head_dim}/{head_dim_v}'s")
        head_dim = kernel_head_dim(head_dim)
        if self.BLOCK_M not in (ROWS_PER_WARPGROUP, 2 * ROWS_PER_WARPGROUP, 3 * ROWS_PER_WARPGROUP):
            reasons.append(f"BLOCK_M {self.BLOCK_M} not in (64, 128, 192): one to three consumer warpgroups of 64 "
                           f"rows")
            return reasons
        if self.consumers == 1 and self.PINGPONG:
            reasons.append("PINGPONG takes turns between consumer warpgroups: BLOCK_M 64 has one")
        if self.KV_STAGES < 2:
            reasons.append("KV_STAGES must be >= 2 to overlap loads with compute")
        if head_dim in HEAD_DIMS:
            need = self.consumer_register_estimate(head_dim, in_bytes)
            if need > self.consumer_regs:
                reasons.append(f"registers: ~{need} live per consumer thread > {self.consumer_regs} "
                               f"({self.consumers} consumer warpgroups)")
            smem = self.smem_bytes(head_dim, in_bytes, 2)
            if self.ctas_per_sm * (smem + SMEM_SLACK) > SM90_SMEM_BYTES:
                reasons.append(f"shared memory: {self.ctas_per_sm} x ({smem} B + {SMEM_SLACK} B of alignment) > "
                               f"{SM90_SMEM_BYTES} B")
        return reasons

    def label(self) -> str:
        return (f"BM{self.BLOCK_M}_S{self.KV_STAGES}{'_pp' if self.PINGPONG else ''}{'_dyn' if self.DYNAMIC else ''}"
                f"{'_lmma' if self.SUM_MMA else ''}{'_pair' if self.PAIR_TILE else ''}")

    def describe(self) -> dict:
        """The columns ``configs`` and ``optimize`` show it with."""
        return {"config": self.label(), "block_m": self.BLOCK_M, "block_n": f"{BLOCK_N} ({WIDE_BLOCK_N} at D=256)",
                "stages": self.KV_STAGES,
                "partitions": f"loader + {self.consumers} consumer WGs",
                "schedule": "overlap+ping-pong" if self.PINGPONG else "overlap", "regs": self.consumer_regs,
                "units": "dynamic" if self.DYNAMIC else "static",
                "row sum": "wgmma" if self.SUM_MMA else "adds"}


CONFIG = HopperConfig


def config_space():
    """Every combination of the knobs (``configs --all`` shows why the invalid ones are) a dense launch takes
    (BLOCK_M 64 is the 2-D/3-D windows' alone: ``neighborhood.box_configs``)."""
    for block_m, stages, pingpong, dynamic, sum_mma in itertools.product(
            (128, 192), (2, 3, 4, 5, 6), (False, True), (False, True), (False, True)):
        yield HopperConfig(BLOCK_M=block_m, KV_STAGES=stages, PINGPONG=pingpong, DYNAMIC=dynamic, SUM_MMA=sum_mma)


def in_focused_space(cfg: HopperConfig) -> bool:
    """What ``optimize`` times by default: up to 4 K/V stages."""
    return cfg.KV_STAGES <= 4


@class_cached
def default_config(head_dim: int, dtype: str, causal: Optional[bool] = None, n_ctx: int = 8192) -> HopperConfig:
    """The tuning table's entry for the problem class, else a rule: the deepest K/V ring that fits. (A padded head
    dim without an entry of its own takes its kernel's: ``kernel_head_dim``.)"""
    from . import tuning

    if causal is not None:
        for d in dict.fromkeys((head_dim, kernel_head_dim(head_dim))):
            entry = tuning.lookup("sm_90a", d, dtype, causal, n_ctx)
            if entry is not None:
                cfg = HopperConfig(**entry)
                if not cfg.invalid_reasons(head_dim, dtype):
                    return cfg
    head_dim = kernel_head_dim(head_dim)
    best = None
    for stages in (2, 3, 4):
        cfg = HopperConfig(KV_STAGES=stages)
        if not cfg.invalid_reasons(head_dim, dtype):
            best = cfg
    if best is None:
        raise ValueError(f"no valid Hopper config for head dim {head_dim}, dtype {dtype}")
    return best


def packed_config(cfg: HopperConfig) -> HopperConfig:
    """The default config's form for packed sequences of different lengths: units go to programs as they
    free up (the dynamic scheduler; the sequences come longest first)."""
    return dataclasses.replace(cfg, DYNAMIC=True)


def block_shapes(head_dim: int, cfg: HopperConfig, v_transposed: bool, boxes=None, pair_tile: bool = False) -> dict:
    """The block each descriptor argument moves (Q and O: one consumer warpgroup's rows). ``boxes``: 2-D or 3-D
    windows' (query box, key box), boxes of [Z, H, Lx, Ly, D] or [H, Lx, Ly, Lz, D] views (a consumer's Q and O: TX /
    consumers x the rest). ``pair_tile`` (the 192/128 pair in the D=256 kernel, ``HopperConfig.PAIR_TILE``): 128-key
    blocks, K's in pieces of 64 columns, V's of v's 128."""
    if pair_tile:
        q = [1, 1, ROWS_PER_WARPGROUP, head_dim]
        v = [1, 1, PAIR[1], BLOCK_N] if v_transposed else [1, 1, BLOCK_N, PAIR[1]]
        return {"desc_q": q, "desc_k": [1, 1, BLOCK_N, PAIR_K_COLS], "desc_v": v, "desc_o": q}
    if boxes is not None:  # (fp8: V^T of the key boxes in a row, [Z, H_KV, D, boxes x keys], ``_v_box_rows``)
        (tx, *q_rest), kv = boxes
        lead = [1] * (4 - len(kv))  # ([Z, H] before a 2-D grid, [H] before a 3-D one)
        q = lead + [tx // (cfg.BLOCK_M // ROWS_PER_WARPGROUP), *q_rest, head_dim]
        v = [1, 1, head_dim, block_n(head_dim)] if v_transposed else lead + [*kv, head_dim]
        return {"desc_q": q, "desc_k": lead + [*kv, head_dim], "desc_v": v, "desc_o": q}
    q = [1, 1, ROWS_PER_WARPGROUP, head_dim]
    bn = block_n(head_dim)
    v = [1, 1, head_dim, bn] if v_transposed else [1, 1, bn, head_dim]
    return {"desc_q": q, "desc_k": [1, 1, bn, head_dim], "desc_v": v, "desc_o": q}


# Causal query blocks per head from which the dynamic scheduler hands out single tiles, longest first, rather than
# mirrored pairs (``schedule.unit_tiles``). Measured against pairs at the H100's power limit (NOTES v51): +0.4-0.7%
# with 128 and 256 blocks per head (fp16 and fp8 D=128, N 16384 and 32768), -1.1% with 32 (N=4096) and -0.5% with 86
# (fp8 D=64, 192-row tiles, N=16384): a unit per tile costs the loader one more counter round trip per tile, which
# short tiles do not earn back from the shorter last round.
SINGLES_MIN_BLOCKS = 128


def singles(cfg: HopperConfig, causal: bool, varlen: bool, n_q: int) -> bool:
    """Whether the causal units are single tiles (dense, dynamic scheduler, at least SINGLES_MIN_BLOCKS blocks)."""
    return bool(causal and cfg.DYNAMIC and not varlen and -(-n_q // cfg.BLOCK_M) >= SINGLES_MIN_BLOCKS)


def kernel_constexprs(cfg: HopperConfig, causal: bool, v_transposed: bool, return_lse: bool, name: str,
                      varlen: bool = False, single_tiles: bool = False, padded: bool = False, window: int = 0,
                      qk_dim: int = 0, v_dim: int = 0, unit_strides: bool = False, combine: bool = False) -> dict:
    """``qk_dim``: q's and k's head dim where the kernel's is larger (``kernel_head_dim``), else 0; ``v_dim``: v's
    (``v_cols``); ``unit_strides``: a 2-D/3-D window whose strides are all 1 (``masks.window_boxes_load``);
    ``combine``: decode's chunks combining their parts in the launch (the COMBINE constexpr)."""
    return dict(BLOCK_M=cfg.BLOCK_M, KV_STAGES=cfg.KV_STAGES, CAUSAL=bool(causal), VARLEN=bool(varlen),
                V_TRANSPOSED=bool(v_transposed), PINGPONG=cfg.PINGPONG, RETURN_LSE=bool(return_lse),
                DYNAMIC=cfg.DYNAMIC, SUM_MMA=cfg.SUM_MMA, CONSUMER_REGS=cfg.consumer_regs,
                KERNEL_NAME=name, SINGLES=bool(single_tiles), PADDED=bool(padded), WINDOW=int(window),
                QK_DIM=int(qk_dim), V_DIM=int(v_dim), UNIT_STRIDES=bool(unit_strides), COMBINE=bool(combine))


RUNTIME_SIGNATURE = {"lse_ptr": "*fp32", "sched_ptr": "*i32", "seq_ptr": "*i32", "qk_scale": "fp32",
                     "o_scale": "fp32", "N_Q": "i32", "N_KV": "i32", "num_hz": "i32", "G": "i32", "group_hz": "i32",
                     "n_seqs": "i32", "num_progs": "i32"}
NUM_WARPS = 4  # the default partition (consumer 0) is one warpgroup; setmaxnreg works per warpgroup


@dataclass(frozen=True)
class _Plan:
    """What a launch needs that depends only on the problem's sizes and options, not on its tensors."""
    blocks: dict
    grid: int
    group: int
    dynamic: bool
    consts: dict
    key: tuple  # ``launch_cached``'s key without the device
    options: dict  # compile options beyond the package's (``HopperConfig.compile_options``; the consts determine them)


@functools.lru_cache(maxsize=1024)
def _launch_plan(Z: int, H: int, H_KV: int, N_Q: int, N_KV: int, D: int, D_V: int, dtype: torch.dtype,
                 out_dtype: torch.dtype, causal: bool, config: Optional[HopperConfig], return_lse: bool,
                 kernel_name: str, head_group_size: Optional[int], n_sms: int, n_seqs: int, window: int = 0,
                 combine: bool = False) -> _Plan:
    """``n_seqs`` > 0: packed sequences, Z = 1 and N_Q the longest sequence's queries (for the grid). ``window``:
    neighborhood attention along the rows (1 non-causal, 2 causal windows; ``causal`` False: every tile is a unit
    of its own, as non-causal ones). ``combine``: decode's chunks combining their parts (``decode``; a static
    schedule with the lse: the scheduler's counter word carries the output)."""
    from ..problem import dtype_name

    name = dtype_name(dtype)
    is_fp8 = name.startswith("fp8")
    varlen = n_seqs > 0
    cfg = checked_config("Hopper", config, default_config, D, name, causal, max(N_Q, N_KV))
    if cfg.consumers == 1:
        raise ValueError(f"{cfg.label()}: BLOCK_M 64 (one consumer warpgroup, two programs an SM) is the 2-D/3-D "
                         f"windows' tile; dense, packed and 1-D window launches take BLOCK_M 128 or 192")
    padded, qk_dim, v_dim = head_dim_consts(D, D_V)
    D = kernel_head_dim(D)
    if varlen and config is None:
        cfg = packed_config(cfg)
    elif config is None and not window:
        cfg = pair_config(cfg, qk_dim, D_V)
    single_tiles = singles(cfg, causal, varlen, N_Q)
    grid = min(cfg.ctas_per_sm * n_sms, work_units(-(-N_Q // cfg.BLOCK_M), (n_seqs or Z) * H, causal, single_tiles))
    if combine:
        if not return_lse or varlen or window or causal or is_fp8 or padded:
            raise ValueError("combine: decode's chunks (16-bit, non-causal, dense, the lse returned)")
        cfg = dataclasses.replace(cfg, DYNAMIC=False)  # (equal chunks; the scheduler's word carries the output)
    consts = kernel_constexprs(cfg, causal, is_fp8, return_lse, kernel_name, varlen, single_tiles, padded, window,
                               qk_dim, v_dim, combine=combine)
    pair_tile = _pair_tile(cfg, qk_dim, D_V, window)
    G = H // H_KV
    # The scheduler walks ``head_group_size`` heads together, by default the query heads of one K/V head
    # (``schedule.unit_tiles``; causal groups must divide the heads: pairs are walked in whole groups).
    group = head_group_size or G
    if causal and ((n_seqs and H % group) or (Z * H) % group):
        raise ValueError(f"head_group_size {group} must divide the {H if n_seqs else Z * H} heads with causal")
    key = (hopper_attention_kernel, dtype, out_dtype, D, *consts.values(), pair_tile)
    return _Plan(block_shapes(D, cfg, is_fp8, pair_tile=pair_tile), max(grid, 1), group, cfg.DYNAMIC, consts, key,
                 cfg.compile_options)


def combines(plan: "_Plan") -> bool:
    """Whether decode's chunks combine their parts in this plan's launch: head dim 128 in two-consumer 128-row tiles,
    the builds that have run on a GPU (run 278). Others keep the combine's own launch: head dim 64 compiles without
    spills in 128-row tiles but has not run; the three-consumer 192-row tiles (head dim 64 from 4096 keys a chunk)
    spill 23 registers outside their MMA loops and have not run either."""
    return plan.consts["COMBINE"] and plan.consts["BLOCK_M"] == 128 and plan.blocks["desc_q"][-1] == 128


def hopper_attention(q, k, v, *, causal: bool = False, sm_scale: Optional[float] = None,
                     descale_q: float = 1.0, descale_k: float = 1.0, descale_v: float = 1.0,
                     return_lse: bool = False, out: Optional[torch.Tensor] = None,
                     out_dtype: Optional[torch.dtype] = None, config: Optional[HopperConfig] = None,
                     kernel_name: str = "gluon_attention", head_group_size: Optional[int] = None, varlen=None,
                     window: Optional[tuple[int, int, bool]] = None, combine=None):
    """Launch the sm_90a kernel on validated CUDA tensors (see ``gluon_attn.attention``): q [Z, H, N_Q, D],
    k and v [Z, H_KV, N_KV, D]; with ``varlen`` (a ``schedule.Packed``), [1, H, total, D] views of packed
    sequences. Small problems take tens of microseconds on the GPU, so a call signature seen before runs its
    ``prepare``d launch: the tensors' addresses, the outputs' allocations and the C launch. ``combine``: (the
    combined output, a zeroed int32 counter per K/V head, the keys the last split sees beyond N_KV - them) for
    decode's chunks (``decode.run``; the general path): None where the plan's tiles do not combine (``combines``),
    with nothing launched."""
    if combine is not None:
        return _launch_general(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=return_lse, out=out,
                               config=config, kernel_name=kernel_name, combine=combine)
    call = prepare(q, k, v, causal=causal, sm_scale=sm_scale, descale_q=descale_q, descale_k=descale_k,
                   descale_v=descale_v, return_lse=return_lse, out=out, out_dtype=out_dtype, config=config,
                   kernel_name=kernel_name, head_group_size=head_group_size, varlen=varlen, window=window)
    if call is not None:
        res = call(q, k, v, out, varlen)
        if res is not None:
            return res
    return _launch_general(q, k, v, causal=causal, sm_scale=sm_scale, descale_q=descale_q, descale_k=descale_k,
                           descale_v=descale_v, return_lse=return_lse, out=out, out_dtype=out_dtype, config=config,
                           kernel_name=kernel_name, head_group_size=head_group_size, varlen=varlen, window=window)


_PREPARED = BoundedCache(1024)


def call_key(q, k, v, out, *options) -> tuple:
    """What a prepared launch is made for: every tensor's shape, strides, dtype and device, and the options (the
    data pointers change call by call: ``_Prepared`` checks their alignment and encodes descriptors per address)."""
    return (*signature(q, k, v), None if out is None else signature(out), *options)


def prepare(q, k, v, *, causal=False, sm_scale=None, descale_q=1.0, descale_k=1.0, descale_v=1.0, return_lse=False,
            out=None, out_dtype=None, config=None, kernel_name="gluon_attention", head_group_size=None, varlen=None,
            window=None, combine=False) -> Optional["_Prepared"]:
    """The prepared launch of ``hopper_attention``'s call signature (cached, bounded: ``_PREPARED``), or None where
    its tensors need copies first (a layout TMA cannot address: ``_launch_general`` takes those). Errors are raised
    by ``_launch_plan`` and ``resolve_output`` as on every call; nothing is cached for a call that raises.
    ``combine``: decode's chunks combining their parts (``run_ptrs`` with the counters as ``table`` and the output
    as ``sched``)."""
    packed = None if varlen is None else (varlen.n_seqs, varlen.max_q, varlen.max_k)
    key = call_key(q, k, v, out, bool(causal), sm_scale, descale_q, descale_k, descale_v, bool(return_lse), out_dtype,
                   config, kernel_name, head_group_size, packed, window, bool(combine))
    call = _PREPARED.get(key)
    if call is None:
        call = _Prepared.make(q, k, v, causal, sm_scale, descale_q, descale_k, descale_v, return_lse, out, out_dtype,
                              config, kernel_name, head_group_size, varlen, window, bool(combine))
        _PREPARED.put(key, call)
    return call or None


class _Prepared:
    """One call signature's launch of the sm_90a kernel: the plan, the descriptors' blocks, shapes and strides, the
    output's layout, the runtime scalars and, once the JIT has compiled the kernel, its ``FixedLaunch``. A call checks
    the tensors' addresses (16-byte aligned: else None, and the general path copies) and makes the outputs."""

    @staticmethod
    def make(q, k, v, causal, sm_scale, descale_q, descale_k, descale_v, return_lse, out, out_dtype, config,
             kernel_name, head_group_size, varlen, window, combine=False):
        Z, H, N_Q, D = q.shape
        H_KV, N_KV = k.shape[1], k.shape[2]
        is_fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        meta_q = meta_like(q)
        made, out_dtype = resolve_output(meta_q, None if out is None else meta_like(out), out_dtype, is_fp8,
                                         v.shape[3])
        n_seqs = 0 if varlen is None else varlen.n_seqs
        mode = window_mode(window, varlen, causal, N_Q, N_KV)
        plan = _launch_plan(Z, H, H_KV, varlen.max_q if varlen else N_Q, varlen.max_k if varlen else N_KV, D,
                            v.shape[3], q.dtype, out_dtype, bool(causal), config, bool(return_lse), kernel_name,
                            head_group_size, sm_count(q.device), n_seqs, mode, combine)
        if not all(tma_strides(t) for t in (meta_q, k, made)) or (not is_fp8 and not tma_strides(v)):
            return False  # (copies first: the general path)
        self = _Prepared()
        self.plan, self.fp8, self.return_lse, self.causal = plan, is_fp8, bool(return_lse), bool(causal)
        self.combines = combines(plan)  # (decode's chunks: whether this launch combines their parts)
        self.device, self.heads = q.device, H
        self.index = device_index(q.device)
        self.out_shape, self.out_strides, self.out_dtype = tuple(made.shape), tuple(made.stride()), out_dtype
        self.lse_shape = (Z, H, N_Q)
        self.qk_scale = (1.0 / math.sqrt(D) if sm_scale is None else sm_scale) * LOG2E * descale_q * descale_k
        # (pointer arguments as addresses: the C launcher takes an int as it is, a tensor costs a data_ptr() call and
        # a cuPointerGetAttribute)
        self.unused = placeholder(q.device, torch.int32).data_ptr()
        self.unused_f32 = placeholder(q.device, torch.float32).data_ptr()
        self.window_table = None if window is None else window_table(q.device, int(window[0]), int(window[1]))
        self.table_ptr = self.unused if self.window_table is None else self.window_table.data_ptr()
        self.scalars = (float(descale_v), N_Q, N_KV, Z * H, H // H_KV, plan.group, n_seqs, plan.grid)
        b = plan.blocks
        if is_fp8:
            n_pad = -(-N_KV // 16) * 16
            v_desc = (b["desc_v"], [Z, H_KV, v.shape[3], n_pad], [H_KV * v.shape[3] * n_pad, v.shape[3] * n_pad,
                                                                   n_pad, 1])
        else:
            v_desc = (b["desc_v"], list(v.shape), list(v.stride()))
        self.descs = [(b["desc_q"], list(q.shape), list(q.stride())), (b["desc_k"], list(k.shape), list(k.stride())),
                      v_desc, (b["desc_o"], list(made.shape), list(made.stride()))]
        self.launch = None
        return self

    def _fixed(self) -> Optional[FixedLaunch]:
        self.launch = _fixed_launch(self.plan, self.descs, self.device)
        return self.launch

    def with_keys(self, k, v, last_keys: int = 0) -> "_Prepared":
        """This launch for k and v of another count of keys, everything else as made (the caller keeps the tuning
        class, hence the plan, the same): their descriptors' shapes and strides and the N_KV scalar (16 bits).
        ``last_keys``: decode's chunks combining their parts, views that many keys longer (``with_last_keys``)."""
        return self.with_key_layouts(list(k.shape), list(k.stride()), list(v.shape), list(v.stride()), last_keys)

    def with_key_layouts(self, k_shape: list, k_strides: list, v_shape: list, v_strides: list,
                         last_keys: int = 0) -> "_Prepared":
        """``with_keys`` given K's and V's shapes and strides (lists) rather than the tensors (decode's chunk views,
        which a growing cache's new count needs only as numbers)."""
        other = shallow_copy(self)
        descs = self.descs
        k_desc, v_desc = (descs[1][0], k_shape, k_strides), (descs[2][0], v_shape, v_strides)
        other.descs = [descs[0], k_desc, v_desc, descs[3]]
        other.scalars = self._key_scalars(k_shape[2], last_keys)
        # (the launch's K and V descriptors of the new shapes; Q's and O's encodings shared)
        other.launch = self.launch and self.launch.with_shapes({1: k_desc[1:], 2: v_desc[1:]})
        return other

    def with_last_keys(self, extra: int) -> "_Prepared":
        """Decode's chunks combining their parts (``combine``) over views ``extra`` keys longer than the equal chunks:
        the last split attends to all of them, the others to N_KV - ``extra`` (the n_seqs word, ``Shape.LAST_KEYS``).
        The same descriptors and launch."""
        other = shallow_copy(self)
        other.scalars = self._key_scalars(self.scalars[2], extra)
        return other

    def _key_scalars(self, n_kv: int, last_keys: int) -> tuple:
        """The runtime scalars for views of ``n_kv`` keys: N_KV itself, or, for decode's chunks combining their
        parts (COMBINE), N_KV - ``last_keys`` with ``last_keys`` in the n_seqs word (the last split's extra keys)."""
        if not self.plan.consts["COMBINE"]:
            assert not last_keys, "extra keys for the last split: decode's chunks (COMBINE) only"
            return (*self.scalars[:2], n_kv, *self.scalars[3:])
        assert 0 <= last_keys < n_kv
        return (*self.scalars[:2], n_kv - last_keys, *self.scalars[3:6], last_keys, *self.scalars[7:])

    def __call__(self, q, k, v, out=None, varlen=None):
        launch = self.launch or self._fixed()
        if launch is None or hooks_active():
            return None  # (not compiled yet, or a profiler hook: the JIT's path)
        if out is None:
            out = torch.empty_strided(self.out_shape, self.out_strides, dtype=self.out_dtype, device=self.device)
        if self.fp8:
            v = fp8_vt(v)[0]
        qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        if (qp | kp | vp | op) & 15:
            return None
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device) if self.return_lse else None
        plan = self.plan
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        if varlen is not None:
            table = varlen.table(self.heads, plan.consts["BLOCK_M"], self.causal, counter=plan.dynamic)
            sched = table[-1:] if plan.dynamic else self.unused
        else:
            table = self.table_ptr
            sched = zeroed_counter(self.index, stream) if plan.dynamic else self.unused
        launch(stream, (qp, kp, vp, op), (op, self.unused_f32 if lse is None else lse.data_ptr(), sched, table,
                                          self.qk_scale, *self.scalars))
        return (out, lse) if self.return_lse else out

    def run_ptrs(self, stream: int, ptrs: tuple, out, lse, table=None, sched=None) -> bool:
        """The launch on tensors given by their (16-byte aligned) addresses, ``out`` its output (a tensor or address:
        the pointer the kernel's row stores take) and ``lse`` its lse buffer (a placeholder without ``return_lse``):
        decode's split launches (``decode.PreparedSplit``), na1d's groups, packed sequences (``table`` and ``sched``:
        their table and its counter). Not for fp8. False where it cannot launch (not compiled, a profiler hook)."""
        launch = self.launch or self._fixed()
        if launch is None or hooks_active():
            return False
        if table is None:  # (packed sequences pass their table and counter)
            table = self.table_ptr
            sched = zeroed_counter(self.index, stream) if self.plan.dynamic else self.unused
        launch(stream, ptrs, (out, lse, sched, table, self.qk_scale, *self.scalars))
        return True

    def run(self, stream: int, ptrs: tuple) -> bool:
        """``run_ptrs`` without an lse, the output at ``ptrs[3]`` (na1d's groups; ``_PreparedBoxes.run``'s form)."""
        return self.run_ptrs(stream, ptrs, ptrs[3], self.unused_f32)


def _fixed_launch(plan: "_Plan", descs: list, device) -> Optional[FixedLaunch]:
    """The ``FixedLaunch`` of a prepared launch once the JIT has compiled its kernel (None before, or where the
    compiled kernel needs the JIT's own launcher)."""
    direct = compiled(hopper_attention_kernel, plan.key, device)
    if direct is None or not direct.usable:
        return None
    return FixedLaunch(direct, plan.grid, descs, plan.consts)


def _launch_general(q, k, v, *, causal: bool = False, sm_scale: Optional[float] = None,
                    descale_q: float = 1.0, descale_k: float = 1.0, descale_v: float = 1.0,
                    return_lse: bool = False, out: Optional[torch.Tensor] = None,
                    out_dtype: Optional[torch.dtype] = None, config: Optional[HopperConfig] = None,
                    kernel_name: str = "gluon_attention", head_group_size: Optional[int] = None, varlen=None,
                    window: Optional[tuple[int, int, bool]] = None, combine=None):
    """``hopper_attention``'s launch through the JIT's path (the first call of a specialization compiles it) with
    copies of tensors TMA cannot address; everything that depends only on sizes and options is a cached ``_Plan``.
    ``combine``: (output, counters, the last split's extra keys) of decode's chunks (``hopper_attention``)."""
    Z, H, N_Q, D = q.shape
    H_KV, N_KV = k.shape[1], k.shape[2]
    is_fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    out, out_dtype = resolve_output(q, out, out_dtype, is_fp8, v.shape[3])
    n_seqs = 0 if varlen is None else varlen.n_seqs
    mode = window_mode(window, varlen, causal, N_Q, N_KV)
    plan = _launch_plan(Z, H, H_KV, varlen.max_q if varlen else N_Q, varlen.max_k if varlen else N_KV, D, v.shape[3],
                        q.dtype, out_dtype, bool(causal), config, bool(return_lse), kernel_name, head_group_size,
                        sm_count(q.device), n_seqs, mode, combine is not None)
    blocks = plan.blocks
    if combine is not None:  # (checked before ``tma_ready``, which would copy an output the combine cannot take)
        if not tma_aligned(out):
            raise ValueError("combine: the parts' output must be TMA-ready as given (the combine reads it)")
        if not combines(plan):
            return None  # (the caller runs its parts and their combine as two launches)
    out_t = tma_ready(out)
    if is_fp8:
        vt, v_shape, v_strides = fp8_vt(v)
        desc_v = DescArg(vt, blocks["desc_v"], v_shape, v_strides)
    else:
        desc_v = DescArg.of(tma_ready(v), blocks["desc_v"])
    desc_k = DescArg.of(tma_ready(k), blocks["desc_k"])
    desc_q, desc_o = DescArg.of(tma_ready(q), blocks["desc_q"]), DescArg.of(out_t, blocks["desc_o"])

    qk_scale, lse, lse_arg = softmax_args(q, sm_scale, descale_q, descale_k, return_lse)
    # The dynamic scheduler's counter starts at zero on every call (a fresh allocation: calls on other
    # streams never share one); packed sequences have it as their table's last word (one launch builds both).
    unused = placeholder(q.device, torch.int32)
    if varlen:
        table = varlen.table(H, plan.consts["BLOCK_M"], causal, counter=plan.dynamic)
        sched = table[-1:] if plan.dynamic else unused
    elif window is not None:
        table = window_table(q.device, int(window[0]), int(window[1]))
        sched = torch.zeros(1, dtype=torch.int32, device=q.device) if plan.dynamic else unused
    elif combine is not None:
        # (the combined output through the scheduler's word, which a static schedule leaves; the keys the last split
        # sees beyond the others' through n_seqs, which dense launches leave: the kernel's ``Shape.LAST_KEYS``)
        sched, table, last_keys = combine
        N_KV, n_seqs = N_KV - last_keys, last_keys
    else:
        table = unused
        sched = torch.zeros(1, dtype=torch.int32, device=q.device) if plan.dynamic else unused
    args = (desc_q, desc_k, desc_v, desc_o, out_t, lse_arg, sched, table, qk_scale, float(descale_v), N_Q, N_KV,
            Z * H, H // H_KV, plan.group, n_seqs, plan.grid)
    launch_cached(hopper_attention_kernel, NUM_WARPS, plan.grid, args, plan.consts, q.device, key=plan.key,
                  options=plan.options)
    if out_t is not out:
        out.copy_(out_t)
    return (out, lse) if return_lse else out


launch = hopper_attention


def window_mode(window: Optional[tuple[int, int, bool]], varlen, causal: bool, n_q: int, n_kv: int) -> int:
    """The WINDOW constexpr of a launch's ``window`` (kernel size, stride, causal) of neighborhood attention along the
    rows: 0 without one, 1 non-causal, 2 causal windows; refused but over dense self-attention (both passes)."""
    if window is None:
        return 0
    if varlen is not None or causal or n_q != n_kv:
        raise ValueError("window: neighborhood attention over the rows of dense self-attention (N_Q = N_KV, "
                         "causal=False: the window's own causality is window[2])")
    return 2 if window[2] else 1


@functools.lru_cache(maxsize=256)
def window_table(device: torch.device, kernel_size: int, stride: int) -> torch.Tensor:
    """WINDOW: the kernel size and stride the kernel reads at seq_ptr, made on the device once per window (a
    copy from the host on every call stood between na1d's calls: NOTES v69)."""
    return torch.tensor([kernel_size, stride], dtype=torch.int32, device=device)


WINDOW_BOX_HEAD_DIMS = (32, 64, 96, 128)  # 2-D/3-D windows: O staged for a TMA box store (not D=256's stores by
# rows); 32 and 96 in the D=64 and D=128 kernels, as the dense ones (``kernel_head_dim``)


def window_box_mode(causal: tuple) -> int:
    """The WINDOW constexpr of a 2-D window, 4 + causal_x + 2 causal_y, or a 3-D one, 8 + causal_x + 2 causal_y +
    4 causal_z."""
    return (4 if len(causal) == 2 else 8) + sum(int(c) << d for d, c in enumerate(causal))


def window_boxes(cfg: HopperConfig, head_dim: int, dims: int = 2) -> tuple:
    """Every (query box, key box) the kernel takes for a 2-D or 3-D window: a query tile of the config's rows as
    consumers x TXC by TY (by TZ) positions (powers of two, TXC x TY (x TZ) = 64), a key block of its keys as KX x KY
    (x KZ) (powers of two)."""
    consumers = cfg.BLOCK_M // ROWS_PER_WARPGROUP
    bn = block_n(head_dim)
    q = [(consumers * b[0], *b[1:]) for b in box_splits(ROWS_PER_WARPGROUP, dims)]
    return tuple((a, b) for a in q for b in box_splits(bn, dims))


def hopper_na_boxes(q, k, v, *, window: tuple, boxes: tuple, sm_scale: float, return_lse: bool = False, out=None,
                    config: Optional[HopperConfig] = None, kernel_name: str = "gluon_attention",
                    descale_q: float = 1.0, descale_k: float = 1.0, descale_v: float = 1.0, batches: int = 1):
    """2-D or 3-D neighborhood attention over one dilation group. 2-D: q [Z, H, Lx, Ly, D], k and v [Z, H_KV, Lx, Ly,
    D]; 3-D: q [H, Z Lx, Ly, Lz, D], k and v [H_KV, Z Lx, Ly, Lz, D], the Z = ``batches`` batches folded into x (TMA
    takes five dimensions; ``fold_batches`` says where they may be); views of any strides TMA takes. ``window``: per
    dimension (kernel size, stride, causal); ``boxes``: (query box, key box) from ``window_boxes``; out like q (fp16
    for fp8 inputs; a view to write, or made). fp8: per-tensor descales as ``hopper_attention`` takes them, V^T made
    of the key boxes (``_v_box_rows``, ``fp8_vt``; 3-D: one batch). Returns out (and the lse [Z, H, Lx Ly] or
    [H, Lx Ly Lz] (Z = 1) or [Z, H, Lx Ly Lz], natural log, fp32)."""
    dims = len(window)
    is_fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if batches != 1 and (dims != 3 or is_fp8 or not fold_batches(q.shape[1] // batches, boxes)):
        raise ValueError(f"batches fold into x in 3-D windows of 16 bits whose query tiles divide the grid's x; got "
                         f"{batches} over {dims}-D, {q.dtype}, x {q.shape[1]}, boxes {boxes}")
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float16 if is_fp8 else q.dtype, device=q.device)
    boxes = tuple(map(tuple, boxes))
    Z, H, H_KV, grid, plan, n_rows, words = _box_terms(q, k, window, boxes, config, return_lse, kernel_name, batches)
    b = plan.blocks
    descs = [DescArg.of(tma_ready(t), b[n]) for t, n in ((q, "desc_q"), (k, "desc_k"))]
    if is_fp8:
        vt, v_shape, v_strides = fp8_vt(_v_box_rows(v if dims == 2 else v.unsqueeze(0), boxes[1]))
        descs.append(DescArg(vt, b["desc_v"], v_shape, v_strides))
    else:
        descs.append(DescArg.of(tma_ready(v), b["desc_v"]))
    out_t = tma_ready(out)
    tokens = 1
    for g in grid:
        tokens *= g
    lse = torch.empty((Z, H, tokens) if dims == 2 or batches > 1 else (H, tokens), dtype=torch.float32,
                      device=q.device) if return_lse else None
    unused = placeholder(q.device, torch.int32)
    sched = torch.zeros(1, dtype=torch.int32, device=q.device) if plan.dynamic else unused
    args = (*descs, DescArg.of(out_t, b["desc_o"]), out_t,
            lse if lse is not None else placeholder(q.device, torch.float32), sched, words,
            sm_scale * LOG2E * descale_q * descale_k,
            float(descale_v), n_rows, n_rows, Z * H,
            H // H_KV, plan.group, 0, plan.grid)
    launch_cached(hopper_attention_kernel, NUM_WARPS, plan.grid, args, plan.consts, q.device, key=plan.key,
                  options=plan.options)
    if out_t is not out:
        out.copy_(out_t)
    return (out, lse) if return_lse else out


def prepare_na_boxes(q, k, v, out, *, window: tuple, boxes: tuple, sm_scale: float,
                     config: Optional[HopperConfig] = None, kernel_name: str = "gluon_attention", batches: int = 1):
    """``hopper_na_boxes``'s launch of one group's views (16 bits, no lse) prepared: a ``_PreparedBoxes`` whose
    ``run`` takes the four tensors' addresses; None where it cannot be (fp8, a layout TMA cannot take)."""
    if q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or \
            not all(tma_strides(t) for t in (q, k, v, out)):
        return None
    boxes = tuple(map(tuple, boxes))
    Z, H, H_KV, _, plan, n_rows, words = _box_terms(q, k, window, boxes, config, False, kernel_name, batches)
    b = plan.blocks
    descs = [(b[n], list(t.shape), list(t.stride())) for t, n in ((q, "desc_q"), (k, "desc_k"), (v, "desc_v"),
                                                                   (out, "desc_o"))]
    return _PreparedBoxes(plan, descs, words, q.device,
                          (sm_scale * LOG2E, 1.0, n_rows, n_rows, Z * H, H // H_KV, plan.group, 0, plan.grid))


def fold_batches(x: int, boxes: tuple) -> bool:
    """Whether a 3-D window launch may take its batches folded into x (grid x ``x`` each): its query tiles divide x,
    so that no tile's rows (stored by TMA, clipped only at the folded view's end) reach the next batch. Key boxes may
    cross into it: the keys past a batch's x lie in no window, and are masked."""
    return x % boxes[0][0] == 0


def _box_terms(q, k, window: tuple, boxes: tuple, config, return_lse: bool, kernel_name: str,
               batches: int = 1) -> tuple:
    """What a 2-D/3-D window launch takes of its views, shared by ``hopper_na_boxes`` and ``prepare_na_boxes``: (Z,
    H, H_KV, the grid, the plan, the query tiles as rows (N_Q and N_KV), the words the kernel reads at seq_ptr)."""
    dims = len(window)
    if dims == 3:
        H, *grid, D = q.shape
        grid[0] //= batches
        Z, H_KV = batches, k.shape[0]
    else:
        Z, H, *grid, D = q.shape
        H_KV = k.shape[1]
    causal = tuple(bool(c) for _, _, c in window)
    plan = _na_box_plan(Z, H, H_KV, tuple(grid), D, q.dtype, config, bool(return_lse), kernel_name,
                        sm_count(q.device), window_box_mode(causal), boxes, all(s == 1 for _, s, _ in window))
    tiles = 1
    for g, t in zip(grid, boxes[0]):
        tiles *= -(-g // t)
    words = (grid[0], grid[1], window[0][0], window[0][1], window[1][0], window[1][1])
    words += (grid[2], window[2][0], window[2][1]) if dims == 3 else (0, 0, 0)
    tiles_yz = [-(-g // t) for g, t in zip(grid[1:], boxes[0][1:])] + [1]
    words += box_division_words(H // H_KV, H_KV, tiles, tiles_yz[0], tiles_yz[1])
    return (Z, H, H_KV, grid, plan, plan.consts["BLOCK_M"] * tiles,
            window_box_table(q.device, tuple(int(x) for x in words)))


def division_words(d: int) -> tuple:
    """The two words of n // d for 0 <= n < 2^31 (``masks.magic_quotient``): m = ceil(2^p / d) < 2^32 as an int32's
    bits and p = 31 + ceil(log2 d) (Granlund-Montgomery: 2^p <= m d < 2^p + 2^(p - 31), so the quotient is exact)."""
    if not 1 <= d < 1 << 31:
        raise ValueError(f"a divisor in [1, 2^31) is taken; got {d}")
    p = 31 + (d - 1).bit_length()
    m = -(-(1 << p) // d)
    return (m - (1 << 32) if m >= 1 << 31 else m), p


def box_division_words(G: int, H_KV: int, tiles: int, tiles_y: int, tiles_z: int) -> tuple:
    """The sm_90a forward's 2-D/3-D division words, after the window's nine (``hopper.BOX_DIVISION_WORDS``): those
    of a K/V head's units (G x tiles), G, H_KV, the query tiles along y and along z (``hopper.DIV_*``), then H_KV."""
    words = ()
    for d in (G * tiles, G, H_KV, tiles_y, tiles_z):
        words += division_words(d)
    return words + (H_KV,)


class _PreparedBoxes:
    """A 2-D/3-D window launch of one group's views with its plan, descriptors and words fixed
    (``prepare_na_boxes``)."""

    def __init__(self, plan: _Plan, descs: list, words: torch.Tensor, device, scalars: tuple):
        self.plan, self.descs, self.words, self.device, self.scalars = plan, descs, words, device, scalars
        self.index = device_index(device)
        self.unused = placeholder(device, torch.int32).data_ptr()  # (addresses: ``_Prepared``'s note)
        self.unused_f32 = placeholder(device, torch.float32).data_ptr()
        self.words_ptr = words.data_ptr()
        self.launch = None

    def run(self, stream: int, ptrs: tuple) -> bool:
        """Launch on the four tensors' (16-byte aligned) addresses; False where it cannot (not compiled, a hook)."""
        if self.launch is None:
            self.launch = _fixed_launch(self.plan, self.descs, self.device)
        if self.launch is None or hooks_active():
            return False
        sched = zeroed_counter(self.index, stream) if self.plan.dynamic else self.unused
        self.launch(stream, ptrs, (ptrs[3], self.unused_f32, sched, self.words_ptr, *self.scalars))
        return True


def _v_box_rows(v: torch.Tensor, box: tuple) -> torch.Tensor:
    """fp8 2-D/3-D windows: V's key boxes one after another, [Z, H_KV, boxes x prod(box), D] from v [Z, H_KV, *grid,
    D] (any strides; ``common.box_rows`` on its bytes): box (jx, jy(, jz)) is number (jx ny + jy)(nz) + jz
    (``WindowBoxes.block_number``), its keys in row-major order, positions past the grid zero (their P is 0: no NaN
    from the padding). ``fp8_vt`` then makes the kernel's V^T of it, its 16-key permutation inside each box."""
    return box_rows(v.view(torch.uint8), box, 0).view(v.dtype)


@functools.lru_cache(maxsize=256)
def _na_box_plan(Z: int, H: int, H_KV: int, grid: tuple, D: int, dtype: torch.dtype, config: Optional[HopperConfig],
                 return_lse: bool, kernel_name: str, n_sms: int, mode: int, boxes: tuple,
                 unit_strides: bool = False) -> _Plan:
    """``_launch_plan`` for 2-D/3-D windows (every query tile a unit, the heads of a K/V head walked together);
    ``unit_strides``: every dimension's stride is 1, a build of its own."""
    from ..problem import dtype_name

    name = dtype_name(dtype)
    cfg = checked_config("Hopper", config, default_config, D, name, False, 8192)
    taken = window_boxes(cfg, D, len(grid))
    if boxes not in taken:
        raise ValueError(f"{len(grid)}-D window boxes {boxes} are not taken with {cfg.label()} at D={D}: {taken}")
    padded, qk_dim, v_dim = head_dim_consts(D, D)  # (32 and 96: the next kernel up, its O box store clipped)
    D = kernel_head_dim(D)
    tiles = 1
    for g, t in zip(grid, boxes[0]):
        tiles *= -(-g // t)
    grid_size = min(cfg.ctas_per_sm * n_sms, work_units(tiles, Z * H, False))
    is_fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    consts = kernel_constexprs(cfg, False, is_fp8, return_lse, kernel_name, False, False, padded, mode, qk_dim, v_dim,
                               unit_strides)
    key = (hopper_attention_kernel, dtype, torch.float16 if is_fp8 else dtype, D, *consts.values(), boxes)
    return _Plan(block_shapes(D, cfg, is_fp8, boxes), max(grid_size, 1), H // H_KV, cfg.DYNAMIC, consts, key,
                 cfg.compile_options)


@functools.lru_cache(maxsize=256)
def window_box_table(device: torch.device, words: tuple) -> torch.Tensor:
    """2-D/3-D windows: the grid and each dimension's kernel size and stride, the words the kernel reads at seq_ptr
    (``masks.WindowBoxes``: Lx, Ly, Kx, Sx, Ky, Sy, then Lz, Kz, Sz), made on the device once."""
    return torch.tensor(words, dtype=torch.int32, device=device)


def build(dtype: str, head_dim: int, causal: bool, cfg: HopperConfig, name: str, varlen: bool = False,
          single_tiles: bool = False, window: int = 0, boxes=None, head_dim_v: Optional[int] = None,
          unit_strides: bool = False, combine: bool = False):
    """The compile-only build of one specialization (``inspect``, the compile tests; ``single_tiles``: the
    long causal contexts' unit per tile, ``singles``; ``window``: neighborhood attention along the rows, 1
    non-causal, 2 causal windows; 4-15 2-D/3-D windows over ``boxes``, ``unit_strides`` where every stride is 1)."""
    from ..problem import dtype_from_name
    from .build import KernelBuild
    from .common import descriptor_signature, sig_dtype

    is_fp8 = dtype.startswith("fp8")
    in_dtype = dtype_from_name(dtype)
    out_dtype = dtype_from_name("fp16") if is_fp8 else in_dtype

    head_dim_v = head_dim_v or head_dim
    padded, qk_dim, v_dim = head_dim_consts(head_dim, head_dim_v)
    constexprs = kernel_constexprs(cfg, causal, is_fp8, combine, name, varlen, single_tiles, padded, window, qk_dim,
                                   v_dim, unit_strides, combine)
    pair_tile = _pair_tile(cfg, qk_dim, head_dim_v, window)
    descs = {n: descriptor_signature(out_dtype if n == "desc_o" else in_dtype, block)
             for n, block in block_shapes(kernel_head_dim(head_dim), cfg, is_fp8, boxes, pair_tile).items()}
    o_ptr = {"o_ptr": "*" + sig_dtype(out_dtype)}
    return KernelBuild(fn=hopper_attention_kernel,
                       signature={**descs, **o_ptr, **RUNTIME_SIGNATURE, **{k: "constexpr" for k in constexprs}},
                       constexprs=constexprs, num_warps=NUM_WARPS, name=name, extra=cfg.compile_options,
                       description=f"Hopper attention {dtype} D={head_dim}"
                                   f"{f'/{head_dim_v}' if head_dim_v != head_dim else ''}"
                                   f"{f' (the D={kernel_head_dim(head_dim)} kernel)' if padded else ''} "
                                   f"causal={causal}{' varlen' if varlen else ''}"
                                   f"{window_label(window, boxes)}{cfg.label()}")
