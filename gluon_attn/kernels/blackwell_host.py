"""The host side of the sm_100a forward, whose device code is ``blackwell.py``: ``BlackwellConfig`` (tile,
pipeline, split and cluster knobs, checked against sm_100's limits) and the head dims and dtypes it takes; the tuning
lookups (``default_config``, ``packed_config``, ``config_space``) and a config's one-CTA form; the descriptors'
blocks and cluster layouts; the launch plan (``plan_launch``, ``LaunchPlan``: host logic, tested on CPU); the launch
the backend calls (``blackwell_attention`` = ``launch``) and the compile-only ``build``. It is sm_100a's
``backend.Backend.module``. Compile-verified only: no Blackwell GPU was available to this project.
"""
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

import torch
from triton.experimental.gluon import language as gl

from .blackwell import (EPILOGUE_REGS, HALF_ROWS, LOAD_REGS, MMA_REGS, SCHEDULE_REGS, UNIT_SLOTS, UNIT_WORDS,
                        blackwell_attention_kernel, cluster_bases, descriptor_bases, k_bases, v_bases)
from .common import box_splits, resolve_output, window_label
from .launch import DescArg, checked_config, launch_cached, placeholder, sm_count, softmax_args, tma_ready
from .schedule import work_units
from .tuning import class_cached

# Warps per partition, in warp_specialize order after the default (correction, 4 warps):
# load, mma, softmax0, softmax1, epilogue, schedule.
WORKER_WARPS = (1, 1, 4, 4, 1, 1)
NUM_WARPS = 4
SM100_REGS_PER_THREAD = 512  # 64K registers over 128 threads: the per-thread budgets of 4 warpgroups sum to this
CORRECTION_MIN_REGS = 64  # one O column chunk (16 fp32 by default), the row statistics and addresses
SM100_SMEM_BYTES = 232448  # 227 KB of dynamic shared memory per block
SM100_TMEM_COLUMNS = 512
SMEM_SLACK = 1024
CLUSTER_SIZES = (1, 2, 4)
HEAD_DIMS = (32, 64, 96, 128)  # what the forward takes: 32 and 96 run padded in the D=64 and D=128 builds
KERNEL_HEAD_DIMS = (64, 128)  # head dims the kernel is built for (as the Hopper kernel's: ``kernel_head_dim``)
DTYPES = ("fp16", "bf16", "fp8e5", "fp8e4m3")
CLUSTER_DTYPES = ("fp16", "bf16")
CLUSTER_HEAD_DIMS = (128,)


@dataclass(frozen=True)
class BlackwellConfig:
    """Tile, pipeline, split and cluster knobs of the sm_100a kernel."""
    BLOCK_N: int = 128  # keys per K/V tile (and the N of the S MMA)
    KV_STAGES: int = 3  # K and V tiles alternate in one ring of this many buffers
    SPLIT_D: int = 8  # column chunks the correction partition rescales O in (bounds its registers)
    SOFTMAX_REGS: int = 200  # per thread, each softmax partition (setmaxnreg)
    CLUSTER: int = 1  # CTAs per cluster: 1; 2 (a two-CTA MMA pair); 4 (two pairs sharing K/V by multicast)

    @property
    def BLOCK_M(self) -> int:
        """Query rows per cluster tile: two halves of 128 rows per CTA, one softmax partition each."""
        return 2 * HALF_ROWS * self.CLUSTER

    def smem_bytes(self, head_dim: int, in_bytes: int, out_bytes: int) -> int:
        """Shared memory per CTA: its Q rows of both halves, its part of each K/V tile (a pair splits a
        tile), the O staging of both halves, the barriers and scheduler words."""
        q = 2 * HALF_ROWS * head_dim * in_bytes
        kv = self.KV_STAGES * self.BLOCK_N * head_dim * in_bytes // min(self.CLUSTER, 2)
        o = 2 * HALF_ROWS * head_dim * out_bytes
        bars = 8 * 2 * (2 + self.KV_STAGES + 2 + 4 + 2 + int(UNIT_SLOTS)) + 8 * 2
        words = 16 + 4 * int(UNIT_WORDS) * int(UNIT_SLOTS)  # the try_cancel response, the units
        return q + kv + o + bars + words

    def tmem_columns(self, head_dim: int) -> int:
        """S and O of both halves, fp32: one column per element (per CTA)."""
        return 2 * (self.BLOCK_N + head_dim)

    def correction_regs(self) -> int:
        """The default (correction) partition's budget: what the worker warpgroups leave."""
        one_warp = max(int(LOAD_REGS), int(MMA_REGS), int(EPILOGUE_REGS), int(SCHEDULE_REGS))
        return SM100_REGS_PER_THREAD - 2 * self.SOFTMAX_REGS - one_warp

    def invalid_reasons(self, head_dim: int, dtype: str, head_dim_v: int = 0) -> list[str]:
        reasons = []
        if head_dim_v not in (0, head_dim):
            reasons.append(f"head dims {head_dim}/{head_dim_v}: v's head dim is q's on sm_100a")
        in_bytes = 1 if dtype.startswith("fp8") else 2
        if dtype not in DTYPES:
            reasons.append(f"dtype {dtype} not supported (supported: {', '.join(DTYPES)})")
        if head_dim not in HEAD_DIMS:
            reasons.append(f"head dim {head_dim} not supported (supported: {', '.join(map(str, HEAD_DIMS))})")
        real_head_dim, head_dim = head_dim, kernel_head_dim(head_dim)
        if self.BLOCK_N not in (64, 128):
            reasons.append(f"BLOCK_N {self.BLOCK_N} not in (64, 128)")
        if self.KV_STAGES < 2:
            reasons.append("KV_STAGES must be >= 2 (K and V of one block)")
        if head_dim in HEAD_DIMS and (head_dim % self.SPLIT_D or (head_dim // self.SPLIT_D) < 8):
            reasons.append(f"SPLIT_D {self.SPLIT_D} must divide head dim {head_dim} into chunks of >= 8")
        if self.SOFTMAX_REGS % 8 or not 24 <= self.SOFTMAX_REGS <= 256:
            reasons.append(f"SOFTMAX_REGS {self.SOFTMAX_REGS} must be a multiple of 8 in [24, 256]")
        # S (BLOCK_N fp32 per thread: one row each) must fit beside P and temporaries.
        if self.SOFTMAX_REGS < self.BLOCK_N + 48:
            reasons.append(f"registers: a softmax thread holds a {self.BLOCK_N}-wide S row: SOFTMAX_REGS "
                           f"{self.SOFTMAX_REGS} < {self.BLOCK_N + 48}")
        if self.correction_regs() < CORRECTION_MIN_REGS:
            reasons.append(f"registers: 2 softmax warpgroups at {self.SOFTMAX_REGS} leave the correction partition "
                           f"{self.correction_regs()} < {CORRECTION_MIN_REGS}")
        if self.CLUSTER not in CLUSTER_SIZES:
            reasons.append(f"CLUSTER {self.CLUSTER} not in {CLUSTER_SIZES}")
        elif self.CLUSTER > 1:
            if dtype not in CLUSTER_DTYPES:
                reasons.append(f"CLUSTER {self.CLUSTER}: clusters take {', '.join(CLUSTER_DTYPES)}, not {dtype}")
            if real_head_dim not in CLUSTER_HEAD_DIMS:
                reasons.append(f"CLUSTER {self.CLUSTER}: clusters take head dim "
                               f"{', '.join(map(str, CLUSTER_HEAD_DIMS))}, not {real_head_dim}")
        if head_dim in HEAD_DIMS:
            cols = self.tmem_columns(head_dim)
            if cols > SM100_TMEM_COLUMNS:
                reasons.append(f"tensor memory: {cols} columns > {SM100_TMEM_COLUMNS}")
            smem = self.smem_bytes(head_dim, in_bytes, 2)
            if smem + SMEM_SLACK > SM100_SMEM_BYTES:
                reasons.append(f"shared memory: {smem} B > {SM100_SMEM_BYTES} B")
        return reasons

    def label(self) -> str:
        cluster = f"_c{self.CLUSTER}" if self.CLUSTER > 1 else ""
        return (f"BM{self.BLOCK_M}_BN{self.BLOCK_N}_S{self.KV_STAGES}_D{self.SPLIT_D}"
                f"_r{self.SOFTMAX_REGS}{cluster}")

    def describe(self) -> dict:
        """The columns ``configs`` and ``optimize`` show it with."""
        return {"config": self.label(), "block_m": self.BLOCK_M, "block_n": self.BLOCK_N, "stages": self.KV_STAGES,
                "partitions": "corr+load+mma+2 softmax+epi", "schedule": "CLC, halves interleaved",
                "split_d": self.SPLIT_D, "regs": self.SOFTMAX_REGS, "cluster": self.CLUSTER}


CONFIG = BlackwellConfig


def config_space():
    for block_n, stages, split_d, regs, cluster in itertools.product((64, 128, 256), range(2, 9), (1, 2, 4, 8),
                                                                     (176, 184, 192, 200), CLUSTER_SIZES):
        yield BlackwellConfig(BLOCK_N=block_n, KV_STAGES=stages, SPLIT_D=split_d, SOFTMAX_REGS=regs, CLUSTER=cluster)


def in_focused_space(cfg: BlackwellConfig) -> bool:
    """128-key tiles and 192 softmax registers (no sm_100 measurements to narrow it further)."""
    return cfg.BLOCK_N == 128 and cfg.SOFTMAX_REGS == 192


def kernel_head_dim(head_dim: int) -> int:
    """The head dim of the build that runs a problem's head dim: itself, or the next built one up (32 -> 64,
    96 -> 128): TMA reads the columns past the tensors' head dim as zeros and clips its stores there, the packed
    tail's register stores clip them under PADDED."""
    return next((d for d in KERNEL_HEAD_DIMS if d >= head_dim), head_dim) if head_dim in HEAD_DIMS else head_dim


def cluster_fits(head_dim: int, dtype: str, causal: Optional[bool], varlen: bool = False) -> bool:
    """Whether a problem class may run in a cluster: non-causal dense problems (a cluster's rows share their
    key range) of the clusters' dtypes and head dims."""
    return causal is False and not varlen and dtype in CLUSTER_DTYPES and head_dim in CLUSTER_HEAD_DIMS


def _deepest(head_dim: int, dtype: str, **fields) -> Optional[BlackwellConfig]:
    """The config with the deepest K/V ring (up to 8 tiles) that is valid for the class, or None."""
    best = None
    for stages in range(2, 9):
        cfg = BlackwellConfig(KV_STAGES=stages, **fields)
        if not cfg.invalid_reasons(head_dim, dtype):
            best = cfg
    return best


@class_cached
def default_config(head_dim: int, dtype: str, causal: Optional[bool] = None, n_ctx: int = 8192) -> BlackwellConfig:
    """The sm_100a tuning table's entry for the class (none measured: no Blackwell GPU here), else the
    rule: non-causal 16-bit D=128 in two-CTA clusters (upstream Triton's attention example's choice),
    everything else one CTA; the deepest K/V ring that fits shared memory, capped at 8 tiles."""
    from . import tuning

    if causal is not None:
        entry = tuning.lookup("sm_100a", head_dim, dtype, causal, n_ctx)
        if entry is not None:
            cfg = BlackwellConfig(**entry)
            if not cfg.invalid_reasons(head_dim, dtype):
                return cfg
    best = None
    if cluster_fits(head_dim, dtype, causal):
        best = _deepest(head_dim, dtype, CLUSTER=2)
    if best is None:
        best = _deepest(head_dim, dtype)
    if best is None:
        raise ValueError(f"no valid Blackwell config for head dim {head_dim}, dtype {dtype}")
    return best


def single_cta_config(cfg: BlackwellConfig) -> BlackwellConfig:
    """A config's one-CTA form (for problems a cluster does not take): the same knobs, with no deeper K/V
    ring than one CTA holds at the clusters' head dim and dtypes (a cluster's CTA holds half of each tile)."""
    if cfg.CLUSTER == 1:
        return cfg
    one = _deepest(CLUSTER_HEAD_DIMS[-1], CLUSTER_DTYPES[0], BLOCK_N=cfg.BLOCK_N, SPLIT_D=cfg.SPLIT_D,
                   SOFTMAX_REGS=cfg.SOFTMAX_REGS)
    stages = min(cfg.KV_STAGES, one.KV_STAGES) if one is not None else 2
    return dataclasses.replace(cfg, CLUSTER=1, KV_STAGES=stages)


def packed_config(cfg: BlackwellConfig) -> BlackwellConfig:
    """The default config's form for packed sequences: one CTA (the schedule is otherwise the same)."""
    return single_cta_config(cfg)


def fitted_config(cfg: BlackwellConfig, head_dim: int, dtype: str, causal: bool, varlen: bool) -> BlackwellConfig:
    """The config a problem runs with: its one-CTA form where a cluster does not take the problem."""
    return cfg if cluster_fits(head_dim, dtype, causal, varlen) else single_cta_config(cfg)


def window_boxes(cfg: BlackwellConfig, head_dim: int, dims: int = 2) -> tuple:
    """Every (query box, key box) the one-CTA kernel takes for a 2-D or 3-D window: a tile of BLOCK_M positions as TX
    x TY (x TZ), its halves along x (TX >= 2), a key block of BLOCK_N as KX x KY (x KZ), powers of two."""
    cfg = single_cta_config(cfg)  # (a window's tiles take one CTA, as ``build`` makes them)
    q = [b for b in box_splits(cfg.BLOCK_M, dims) if b[0] >= 2]
    return tuple((a, b) for a in q for b in box_splits(cfg.BLOCK_N, dims))


def block_shapes(head_dim: int, cfg: BlackwellConfig, boxes=None):
    """The descriptors' blocks (a cluster's: the CTAs share them as ``descriptor_cga_layouts`` says): Q and O
    one half of the tile, K and V one key tile (of the build's head dim: ``kernel_head_dim``). ``boxes``: 2-D or
    3-D windows' (tile box, key box) over [Z, H, Lx, Ly, D] or [H, Lx, Ly, Lz, D] views (a half: TX / 2 along x)."""
    head_dim = kernel_head_dim(head_dim)
    if boxes is not None:
        (tx, *q_rest), kv = boxes
        lead = [1] * (4 - len(kv))
        q = lead + [tx // 2, *q_rest, head_dim]
        kv = lead + [*kv, head_dim]
        return q, kv, kv, q
    q = [1, 1, cfg.BLOCK_M // 2, head_dim]
    kv = [1, 1, cfg.BLOCK_N, head_dim]
    return q, kv, kv, q


def descriptor_cga_layouts(cfg: BlackwellConfig):
    """Which CTA of the cluster holds which part of each descriptor's block (Q, K, V, O), as the kernel's
    shared layouts say (empty without a cluster)."""
    n = cfg.CLUSTER
    q = descriptor_bases(cluster_bases(n))
    return q, descriptor_bases(k_bases(n)), descriptor_bases(v_bases(n)), q


def descriptor_layouts(cfg: BlackwellConfig, head_dim: int, in_dtype: torch.dtype, out_dtype: torch.dtype,
                       boxes=None):
    """The shared layouts of the Q, K, V, O descriptors' blocks."""
    from .common import gl_dtype

    blocks = block_shapes(head_dim, cfg, boxes)
    dtypes = (in_dtype, in_dtype, in_dtype, out_dtype)
    return [gl.NVMMASharedLayout.get_default_for(list(b), gl_dtype(t), cga_layout=c or None)
            for b, t, c in zip(blocks, dtypes, descriptor_cga_layouts(cfg))]


def kernel_constexprs(cfg: BlackwellConfig, causal: bool, return_lse: bool, name: str, varlen: bool = False,
                      padded: bool = False, window: int = 0) -> dict:
    return dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, KV_STAGES=cfg.KV_STAGES, SPLIT_D=cfg.SPLIT_D,
                CAUSAL=bool(causal), VARLEN=bool(varlen), RETURN_LSE=bool(return_lse), SOFTMAX_REGS=cfg.SOFTMAX_REGS,
                KERNEL_NAME=name, PADDED=bool(padded), WINDOW=int(window))


RUNTIME_SIGNATURE = {"lse_ptr": "*fp32", "seq_ptr": "*i32", "qk_scale": "fp32", "o_scale": "fp32", "N_Q": "i32",
                     "N_KV": "i32", "num_hz": "i32", "G": "i32", "group_hz": "i32", "n_seqs": "i32"}


@dataclass
class LaunchPlan:
    """Everything a launch needs, computed on the host without touching a GPU (tested on CPU).

    ``grid`` counts clusters of ``num_ctas`` CTAs: one per work unit (cluster launch control hands the units of
    clusters that have not started to those that finish first). ``desc_cga_layouts``: how the CTAs of a
    cluster share each descriptor's block (Q, K, V, O), which the descriptors' layouts must carry."""
    config: BlackwellConfig
    grid: int
    num_ctas: int
    args: tuple
    constexprs: dict
    out: torch.Tensor
    lse: Optional[torch.Tensor]
    signature: tuple
    desc_cga_layouts: tuple


def plan_launch(q, k, v, *, causal: bool, sm_scale: Optional[float], descale_q: float, descale_k: float,
                descale_v: float, return_lse: bool, out: Optional[torch.Tensor], out_dtype: Optional[torch.dtype],
                config: Optional[BlackwellConfig], kernel_name: str, head_group_size: Optional[int] = None,
                varlen=None) -> LaunchPlan:
    """q [Z, H, N_Q, D], k and v [Z, H_KV, N_KV, D]; with ``varlen`` (a ``schedule.Packed``), [1, H, total, D]
    views of packed sequences."""
    from ..problem import dtype_name

    Z, H, N_Q, D = q.shape
    H_KV, N_KV = k.shape[1], k.shape[2]
    if varlen is not None:
        N_Q, N_KV = varlen.max_q, varlen.max_k  # (the grid's size; each sequence's come from the table)
    name = dtype_name(q.dtype)
    is_fp8 = name.startswith("fp8")
    cfg = checked_config("Blackwell", config, default_config, D, name, causal, max(N_Q, N_KV))
    cfg = fitted_config(cfg, D, name, causal, varlen is not None)
    out, out_dtype = resolve_output(q, out, out_dtype, is_fp8)
    bq, bk, bv, bo = block_shapes(D, cfg)
    tensors = [tma_ready(t) for t in (q, k, v, out)]
    descs = [DescArg.of(t, b) for t, b in zip(tensors, (bq, bk, bv, bo))]
    qk_scale, lse, lse_arg = softmax_args(q, sm_scale, descale_q, descale_k, return_lse)
    n_seqs = 0 if varlen is None else varlen.n_seqs
    # One cluster per unit (packed: per unit of the longest sequence's count, an upper bound; the clusters
    # past the table's count find no unit). Dense causal units are single tiles, longest first.
    grid = max(1, work_units(-(-N_Q // cfg.BLOCK_M), (n_seqs or Z) * H, causal, singles=causal and varlen is None))
    G = H // H_KV
    group = G if causal else (head_group_size or G)  # (see schedule.unit_tiles)
    table = varlen.table(H, cfg.BLOCK_M, causal) if varlen is not None else placeholder(q.device, torch.int32)
    args = (*descs, tensors[3], lse_arg, table, qk_scale, float(descale_v), q.shape[2], k.shape[2], Z * H, G, group,
            n_seqs)
    consts = kernel_constexprs(cfg, causal, return_lse, kernel_name, varlen is not None, kernel_head_dim(D) != D)
    return LaunchPlan(cfg, grid, cfg.CLUSTER, args, consts, out if tensors[3] is out else tensors[3], lse,
                      (q.dtype, out_dtype, D), descriptor_cga_layouts(cfg))


def _cluster_args(plan: LaunchPlan) -> tuple:
    """The plan's arguments with each descriptor carrying its block's cluster layout (``DescArg.cga_layout``)."""
    if plan.num_ctas == 1:
        return plan.args
    descs = [a._replace(cga_layout=tuple(tuple(b) for b in bases))
             for a, bases in zip(plan.args[:4], plan.desc_cga_layouts)]
    return (*descs, *plan.args[4:])


def blackwell_attention(q, k, v, *, causal: bool = False, sm_scale: Optional[float] = None, descale_q: float = 1.0,
                        descale_k: float = 1.0, descale_v: float = 1.0, return_lse: bool = False,
                        out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                        config: Optional[BlackwellConfig] = None, kernel_name: str = "gluon_attention",
                        head_group_size: Optional[int] = None, varlen=None):
    """Launch the sm_100a kernel on validated CUDA tensors (see ``gluon_attn.attention`` and ``plan_launch``).
    Compile-verified only: no Blackwell GPU was available to this project; this kernel has never run."""
    sm_count(q.device)  # (the first call of a device checks the toolchain)
    options = dict(causal=causal, sm_scale=sm_scale, descale_q=descale_q, descale_k=descale_k, descale_v=descale_v,
                   return_lse=return_lse, out=out, out_dtype=out_dtype, kernel_name=kernel_name,
                   head_group_size=head_group_size, varlen=varlen)
    plan = plan_launch(q, k, v, config=config, **options)
    launch_cached(blackwell_attention_kernel, NUM_WARPS, plan.grid, _cluster_args(plan), plan.constexprs, q.device,
                  plan.signature, num_ctas=plan.num_ctas)
    result = plan.out
    if out is not None and result is not out:
        out.copy_(result)
        result = out
    return (result, plan.lse) if return_lse else result


launch = blackwell_attention


def build(dtype: str, head_dim: int, causal: bool, cfg: BlackwellConfig, name: str, varlen: bool = False,
          window: int = 0, boxes=None):
    """The compile-only build of one specialization (``inspect``, the compile tests). ``extra["num_ctas"]``:
    the cluster size, a compile option of its own. ``window``: neighborhood attention (the Hopper forward's WINDOW
    modes: 1, 2 along the rows; 4-7 2-D, 8-15 3-D over ``boxes``, (tile box, key box) of ``window_boxes``), one CTA a
    tile."""
    from ..problem import dtype_from_name
    from .build import KernelBuild
    from .common import descriptor_signature, sig_dtype

    cfg = single_cta_config(cfg) if window else fitted_config(cfg, head_dim, dtype, causal, varlen)
    in_dtype = dtype_from_name(dtype)
    out_dtype = dtype_from_name("fp16") if dtype.startswith("fp8") else in_dtype

    blocks = block_shapes(head_dim, cfg, boxes)
    layouts = descriptor_layouts(cfg, head_dim, in_dtype, out_dtype, boxes)
    padded = kernel_head_dim(head_dim) != head_dim
    constexprs = kernel_constexprs(cfg, causal, False, name, varlen, padded, window)
    descs = {n: descriptor_signature(t, block, layout) for n, t, block, layout in zip(
        ("desc_q", "desc_k", "desc_v", "desc_o"), (in_dtype, in_dtype, in_dtype, out_dtype), blocks, layouts)}
    o_ptr = {"o_ptr": "*" + sig_dtype(out_dtype)}
    return KernelBuild(fn=blackwell_attention_kernel,
                       signature={**descs, **o_ptr, **RUNTIME_SIGNATURE, **{k: "constexpr" for k in constexprs}},
                       constexprs=constexprs, num_warps=NUM_WARPS, name=name,
                       description=f"Blackwell attention {dtype} D={head_dim}"
                                   f"{f' (the D={kernel_head_dim(head_dim)} kernel)' if padded else ''} "
                                   f"causal={causal}{' varlen' if varlen else ''}"
                                   f"{window_label(window, boxes)}{cfg.label()}",
                       extra={"num_ctas": cfg.CLUSTER})
