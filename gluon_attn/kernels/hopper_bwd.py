"""Persistent, warp-specialized attention backward for Hopper (sm_90a): TMA + async wgmma.

FA2/FA3's key-block formulation. A work unit is one K/V block of 128 keys of one K/V head; its two
consumer warpgroups own 64 keys each and walk every query block that sees them (and, with GQA, every
query head of the group: dK and dV are summed over the group in registers, no atomics):

  S^T  = K_w Q^T        P^T = exp2(S^T * scale*log2e - lse*log2e)     (lse from the forward)
  dP^T = V_w dO^T       dS^T = P^T * (dP^T - delta)                    (delta = rowsum(dO * O))
  dV_w += P^T dO        dK_w += dS^T Q                                 (P^T, dS^T as wgmma A from registers)
  dQ   += dS K          (both warpgroups' dS^T halves in shared memory; a TMA reduce-add into fp32)

Working transposed (keys as the wgmma's M) keeps P^T and dS^T in the registers that feed the dV and dK
wgmmas. dQ: with D=128 (64-query blocks) each warpgroup computes 64 of dQ^T's head-dim rows
(dQ^T = K^T dS^T, FA3's dQ_swapAB); with D=64 (128-query blocks) each computes 64 query rows of dQ.
Each share is staged in shared memory as a [queries, head dims] tile and added with one TMA reduce-add
into an fp32 accumulator [Z, H, N_Q, D]; the host scales (``dq_scaled_in_loop``) and casts it (DQ_FRAG: staged
and accumulated in the registers' order, and put back in rows by the cast, ``dq_from_fragments``). ``delta`` and
the lse in log2 units come from ``preprocess`` (both in ``hopper_bwd_prepost``). D=256: a unit is 64 keys shared
by both warpgroups, which split each block's queries for S^T/dP^T and the head dims for dK/dV/dQ
(``_bwd_blocks_wide``). DETERMINISTIC: dQ's adds in key-block order (``_dq_reduce``). At a unit's end each
warpgroup stages its dK, then its dV, in its dQ buffer and TMA-stores them (``_store_kv``). S_AHEAD: the next
block's S^T runs under this block's dQ add; DQ_FIRST: dK's wgmma does (FA3/FA4's order). LSE_TOP (D=128
dense): consumer 1 reads the lse before its S^T issue, consumer 0 after its S^T wait, which keeps consumer 1
ahead (``_bwd_blocks``). DS_FIRST (all but D=64 non-causal): a warpgroup's dS^T half is stored before its dV
wgmma is issued, so the stores do not queue behind that wgmma's operand reads. MASK_BY_ROW (D=64 causal): the
diagonal blocks' mask is one bound per key row.

WINDOW (neighborhood attention): 1-D windows along the rows (a unit's query blocks from binary searches over the
windows, ``_window_work``); 2-D/3-D windows with units of key boxes walking query boxes (``BoxWalk``,
``hopper_na_boxes_bwd``: the lse, delta and dQ accumulator laid out box after box, so the dQ adds are the dense ones).

Partitions: a TMA warp (the unit's K and V halves once; Q and dO blocks through a Q_STAGES ring; units
from a global counter, the unit number published beside K/V) and two consumer warpgroups, 240 registers
each (``BwdConsumer``: a warpgroup's buffers; ``BwdUnit``: its part of a unit; ``BwdLoop``: its state across
the unit's query blocks). Units (``schedule.KeyShape``) go in chunks of heads (about one wave), key blocks
outermost inside a chunk: the programs running at once read the same Q and dO blocks from L2, and (causal)
the longest units come first.
"""

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon import aggregate

from .tuning import class_cached
from .channels import RingIndex, Signal, block_cols, block_view, opaque, store_rows
from .hopper_bwd_prepost import padded_rows, row_index, dq_from_fragments, preprocess
from .common import box_rows, box_splits, rows_to_grid, window_label
from .launch import DescArg, LOG2E, launch_cached, placeholder, sm_count, tma_aligned, tma_ready
from .hopper import (HEAD_DIM_PAIRS as _FWD_PAIRS, kernel_head_dim, reduce_d, window_box_mode, window_box_table,
                     window_mode, window_table)
from .masks import (box_dims, box_outside, mask_block_transposed, mask_cols_between, walk_box, window_bounds,
                    window_boxes_load, window_dims, window_query_blocks, window_query_bounds, window_words)
from .naming import kernel_symbol
from .schedule import KeyShape, KeyWork, publish_unit, read_unit, slot_words_alloc

KEYS_PER_WARPGROUP = 64
BLOCK_N = 2 * KEYS_PER_WARPGROUP  # keys per unit: two consumer warpgroups
WIDE_HEAD_DIM = 256  # D=256: a unit is 64 keys, the warpgroups split queries and head dims (``_bwd_blocks_wide``)
WIDE_BLOCK_N = KEYS_PER_WARPGROUP
HEAD_DIMS = (32, 64, 96, 128, 192, 256)  # what the backward takes: 32, 96, 192 run padded (``hopper.kernel_head_dim``)
HEAD_DIM_PAIRS = _FWD_PAIRS  # (q/k, v) head dims: v's, dO's and dV's columns past its own are zeros / clipped
DTYPES = ("fp16", "bf16")
LOADER_REGS = gl.constexpr(24)  # the TMA warp only computes coordinates
CONSUMER_REGS = gl.constexpr(240)
NUM_WARPS = 4  # the default partition: consumer 0 (LOADER_WARPS 1) or the loader (4)


@gluon.constexpr_function
def dq_scaled_in_loop(head_dim, causal) -> bool:
    """Whether a block loop multiplies its dQ share by the scale before staging it (32 FMUL per thread per block),
    or the accumulator stays unscaled and the host's cast scales it: out of the loop everywhere but D=128 causal,
    whose eight STS.128 then go back to back and which ran slower without the multiplies (NOTES v54, v93)."""
    return head_dim == 2 * KEYS_PER_WARPGROUP and bool(causal)


@gluon.constexpr_function
def _wgmma_layout(n):
    """A 16-bit wgmma accumulator of one warpgroup: 64 rows, N = ``n`` columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


def block_n(head_dim: int) -> int:
    """Keys per unit."""
    return WIDE_BLOCK_N if head_dim == WIDE_HEAD_DIM else BLOCK_N


@aggregate
class BwdCfg:
    dtype: gl.constexpr
    HEAD_DIM: gl.constexpr
    BLOCK_M: gl.constexpr  # queries per block
    HALF: gl.constexpr  # keys per consumer warpgroup (WIDE: keys per unit, shared by both)
    WIDE: gl.constexpr  # D=256
    BLOCK_N: gl.constexpr  # keys per unit
    KV_PARTS: gl.constexpr  # [HALF, D] parts of a unit's K and V
    DQ_ADDS: gl.constexpr  # dQ reduce-adds per query block per unit (DETERMINISTIC's turn)
    KV_COLS: gl.constexpr  # head dims of a warpgroup's dK and dV
    Q_STAGES: gl.constexpr
    S_AHEAD: gl.constexpr  # the next block's S^T issued under this block's dQ add (``_bwd_blocks``)
    DQ_FIRST: gl.constexpr  # dQ's wgmma before dK's, its add staged while dK runs (``_bwd_blocks``)
    DQ_FRAG: gl.constexpr  # dQ's shares staged in the registers' order, the accumulator too (``_dq_reduce``)
    CAUSAL: gl.constexpr
    VARLEN: gl.constexpr
    DETERMINISTIC: gl.constexpr  # dQ's adds in key-block order (``_dq_reduce``)
    DQ_T: gl.constexpr  # dQ^T = K^T dS^T (head dim split over the warpgroups), else dQ = dS K (queries split)
    LSE_TOP: gl.constexpr  # consumer 1 reads the lse before its S^T issue, consumer 0 after its wait (``_bwd_blocks``)
    DS_FIRST: gl.constexpr  # dS^T's half stored before the dV (and dK) wgmma is issued (``_bwd_blocks``)
    MASK_BY_ROW: gl.constexpr  # the mask as one bound per key row (``masks.mask_block_transposed``)
    DQ_SCALED: gl.constexpr  # dQ's share scaled before staging, not by the host's cast (``_dq_reduce``)
    # K's and V's wgmma descriptors computed in each block from an opaque slot number (``opaque``), not hoisted
    # out of the block loop: hoisted, the k-steps' descriptors stayed live across it and (causal D=128, every
    # D=256 build) went to local memory, reloaded before every S^T wgmma. D=64 (four k-steps) keeps them hoisted
    # but with S_AHEAD, which spills them otherwise (NOTES v38, v93).
    KV_DESC_PER_BLOCK: gl.constexpr
    s_layout: gl.constexpr  # S^T, dP^T, dS^T: [64 keys, BLOCK_M] (WIDE: [64 keys, BLOCK_M / 2])
    PADDED: gl.constexpr  # the tensors' head dim is below HEAD_DIM (``hopper.kernel_head_dim``): stores clip columns
    QK_DIM: gl.constexpr  # q's and k's head dim, and v's (V_DIM): HEAD_DIM, or a padded one's own, over which S^T
    V_DIM: gl.constexpr  # and dP^T reduce in power-of-two pieces (``hopper.reduce_d``)
    WINDOW: gl.constexpr  # neighborhood attention along the rows: 1 non-causal, 2 causal windows (0: none); 4-15 boxes
    NA_DIMS: gl.constexpr  # the WINDOW mode's spatial dimensions (0 none; 2, 3: query and key boxes, ``BoxWalk``)
    TX: gl.constexpr  # 2-D/3-D windows: a query block's box (TX x TY x TZ = BLOCK_M positions)
    TY: gl.constexpr
    TZ: gl.constexpr
    KX: gl.constexpr  # and a unit's key box (KX x KY x KZ = BLOCK_N; each warpgroup's 64 keys the half along x)
    KY: gl.constexpr
    KZ: gl.constexpr
    kv_layout: gl.constexpr  # dK, dV: [64 keys, D] (WIDE: [64 keys, D / 2])
    a_layout: gl.constexpr  # P^T, dS^T as the A operand of the dV and dK wgmmas
    dq_layout: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, dtype, HEAD_DIM, BLOCK_M, Q_STAGES, S_AHEAD, DQ_FIRST, DQ_FRAG, CAUSAL, VARLEN,
                 DETERMINISTIC, PADDED=False, WINDOW=0, q_block=(), k_block=(), QK_DIM=0, V_DIM=0):
        self.PADDED = gl.constexpr(PADDED)
        self.QK_DIM = gl.constexpr(QK_DIM or HEAD_DIM)
        self.V_DIM = gl.constexpr(V_DIM or HEAD_DIM)
        self.WINDOW = gl.constexpr(WINDOW)
        dims = window_dims(WINDOW)
        self.NA_DIMS = gl.constexpr(dims)
        tx, ty, tz = box_dims(q_block, dims)
        kx, ky, kz = box_dims(k_block, dims)
        self.TX = gl.constexpr(tx)
        self.TY = gl.constexpr(ty)
        self.TZ = gl.constexpr(tz)
        self.KX = gl.constexpr(2 * kx if dims >= 2 else 1)  # (the descriptor's block is a warpgroup's half box)
        self.KY = gl.constexpr(ky)
        self.KZ = gl.constexpr(kz)
        self.dtype = gl.constexpr(dtype)
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.HALF = gl.constexpr(KEYS_PER_WARPGROUP)
        wide = HEAD_DIM == WIDE_HEAD_DIM
        self.WIDE = gl.constexpr(wide)
        self.BLOCK_N = gl.constexpr(WIDE_BLOCK_N if wide else BLOCK_N)
        self.KV_PARTS = gl.constexpr(1 if wide else 2)
        self.DQ_ADDS = gl.constexpr(4 if wide else 2)
        self.KV_COLS = gl.constexpr(HEAD_DIM // 2 if wide else HEAD_DIM)
        self.Q_STAGES = gl.constexpr(Q_STAGES)
        self.S_AHEAD = gl.constexpr(S_AHEAD)
        self.DQ_FIRST = gl.constexpr(DQ_FIRST)
        self.DQ_FRAG = gl.constexpr(DQ_FRAG)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.VARLEN = gl.constexpr(VARLEN)
        self.DETERMINISTIC = gl.constexpr(DETERMINISTIC)
        self.DQ_T = gl.constexpr(HEAD_DIM == 2 * KEYS_PER_WARPGROUP)
        # (D=128 dense: with both consumers reading early, the packed causal build spilled 4-8 instructions into
        # each block loop, D=64 non-causal 26-34 where its bound is 16)
        self.LSE_TOP = gl.constexpr(HEAD_DIM == 2 * KEYS_PER_WARPGROUP and not VARLEN and not S_AHEAD)
        # (not D=64 non-causal, which issues dV's and dK's wgmmas back to back and ran slower with it: NOTES v53)
        self.DS_FIRST = gl.constexpr(not (HEAD_DIM == KEYS_PER_WARPGROUP and not CAUSAL))
        # The diagonal blocks' mask as one bound per key row (~32 compares and selects per thread) rather than
        # per-element index arithmetic (~230 instructions), where it gained: D=64 causal. D=128 causal ran slower
        # with it (ptxas reallocated its unmasked loops), so the other classes keep the per-element form (NOTES v53).
        self.MASK_BY_ROW = gl.constexpr(HEAD_DIM == KEYS_PER_WARPGROUP and CAUSAL)
        self.DQ_SCALED = gl.constexpr(dq_scaled_in_loop(HEAD_DIM, CAUSAL))
        self.KV_DESC_PER_BLOCK = gl.constexpr(HEAD_DIM != KEYS_PER_WARPGROUP or S_AHEAD)
        self.s_layout = gl.constexpr(_wgmma_layout(BLOCK_M // 2 if wide else BLOCK_M))
        self.kv_layout = gl.constexpr(_wgmma_layout(self.KV_COLS.value))
        self.a_layout = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=self.kv_layout.value, k_width=2))
        self.dq_layout = gl.constexpr(self.s_layout.value if (self.DQ_T.value or wide) else self.kv_layout.value)


@aggregate
class BwdRun:
    """Launch values the consumers read."""
    shape: KeyShape  # sizes, heads, the packed sequences' table (see ``schedule.KeyShape``)
    qk_scale: gl.tensor  # sm_scale * log2(e)
    sm_scale: gl.tensor
    lse_ptr: gl.tensor  # lse * log2(e), +inf for rows that saw no key
    delta_ptr: gl.tensor
    desc_dq: tma.tensor_descriptor  # the fp32 dQ accumulator: [Z * H, rows, D]
    desc_dk: tma.tensor_descriptor  # dK, dV as K and V: [Z, H_KV, N_KV, D] (packed: [1, H_KV, total, D])
    desc_dv: tma.tensor_descriptor
    dk_ptr: gl.tensor  # (the same tensors, for a packed sequence's last keys)
    dv_ptr: gl.tensor
    dq_locks: gl.tensor  # DETERMINISTIC: per query block of each head, the dQ adds done so far (int32)
    locks_per_head: gl.tensor


@aggregate
class KVHalves:
    """A unit's K and V, one [64, D] half per consumer warpgroup, the unit number beside them, and the
    ready (one TMA barrier) / empty (both consumers) pair."""
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    ids: gl.shared_memory_descriptor
    sig: Signal


@aggregate
class QdO:
    """The ring of query blocks: Q and dO (TMA) and the rows' lse and delta (written by the loader's
    warps before the copies' expect-arrive releases them), one barrier pair per slot."""
    q: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor
    lse: gl.shared_memory_descriptor
    delta: gl.shared_memory_descriptor
    sig: Signal


@aggregate
class DsBufs:
    """dS^T of both warpgroups, double-buffered: [2 slots x 2 halves, 64 keys, BLOCK_M]; a slot's barrier
    completes when both halves are written (count 2). A warpgroup rewrites a slot two blocks later, after
    it saw the other's next half arrive, which that one writes after its dQ wgmma on this slot."""
    mem: gl.shared_memory_descriptor
    bars: gl.shared_memory_descriptor

    @gluon.jit
    def half(self, it, i):
        """Half ``i`` (warpgroup i's keys) of slot ``it``."""
        return self.mem.index(it.index * 2 + i)

    @gluon.jit
    def exchange(self, it):
        """After writing this warpgroup's half of slot ``it``: publish it and wait for the other's."""
        fence_async_shared()
        bar = self.bars.index(it.index)
        mbarrier.arrive(bar, count=1)
        mbarrier.wait(bar, it.phase)


@aggregate
class BwdConsumer:
    """What belongs to one consumer warpgroup: the buffers it reads and writes (the unit's K/V halves, the Q/dO
    ring, the dS^T exchange, WIDE's P^T halves) and its own dQ staging buffer, which also stages its dK and dV
    at a unit's end (``_store_kv``)."""
    kv: KVHalves
    qd: QdO
    ds: DsBufs
    ps: gl.shared_memory_descriptor  # WIDE: the P^T halves (else not used)
    dq_buf: gl.shared_memory_descriptor
    WG: gl.constexpr  # which 64 keys of the unit (WIDE: which half of the queries and of the head dims)


@aggregate
class BwdUnit:
    """A consumer warpgroup's part of one unit: the unit (``schedule.KeyWork``), its first key (WIDE: the unit's,
    shared by both warpgroups) and the first head dim of its dK and dV (WIDE: of its half)."""
    w: KeyWork
    key0: gl.tensor
    col0: gl.constexpr


@aggregate
class BwdWindowUnit:
    """WINDOW: a ``BwdUnit`` with, for each of its 64 key rows, the queries that attend the key, [q_lo, q_hi)
    (``masks.window_query_bounds``): the masked blocks compare the block's query numbers with them."""
    w: KeyWork
    key0: gl.tensor
    col0: gl.constexpr
    q_lo: gl.tensor
    q_hi: gl.tensor


@aggregate
class BoxWalk:
    """2-D/3-D windows: a unit's key box, from (kx0, ky0, kz0), and its walk over the query boxes that attend it, row-
    major over [lo_x, ...) x [lo_y, lo_y + ny) x [lo_z, lo_z + nz) (n in all; nz = 1 in 2-D), per dimension the 1-D
    backward's query blocks (``masks.window_query_blocks``); a query box inside [ulo, uhi) in every dimension has every
    query attend every key (no mask). nqy, nqz: query boxes per grid row, for a box's number (its rows in the lse,
    delta and dQ's accumulator, which are laid out box after box)."""
    kx0: gl.tensor
    ky0: gl.tensor
    kz0: gl.tensor
    lo_x: gl.tensor
    lo_y: gl.tensor
    lo_z: gl.tensor
    ny: gl.tensor
    nz: gl.tensor
    n: gl.tensor
    ulo_x: gl.tensor
    uhi_x: gl.tensor
    ulo_y: gl.tensor
    uhi_y: gl.tensor
    ulo_z: gl.tensor
    uhi_z: gl.tensor
    nqy: gl.tensor
    nqz: gl.tensor

    @gluon.jit
    def box(self, j, DIMS: gl.constexpr):
        """Step j's query box: (x, y, z) in boxes (z 0 in 2-D), its number and whether it needs a mask."""
        bx, by, bz = walk_box(j, self.lo_x, self.lo_y, self.lo_z, self.ny, self.nz, DIMS)
        partial = box_outside(bx, by, bz, self.ulo_x, self.uhi_x, self.ulo_y, self.uhi_y, self.ulo_z, self.uhi_z, DIMS)
        number = bx * self.nqy + by
        if DIMS == 3:
            number = number * self.nqz + bz
        return bx, by, bz, number, partial


@aggregate
class BwdBoxUnit:
    """2-D/3-D windows: a ``BwdUnit`` with its ``BoxWalk`` and, for each of its 64 key rows, the queries that attend
    the key per dimension, [lo, hi) in x, y (and z) (``masks.window_query_bounds``; in 2-D the z pair repeats y's)."""
    w: KeyWork
    key0: gl.tensor
    col0: gl.constexpr
    walk: BoxWalk
    lo_x: gl.tensor
    hi_x: gl.tensor
    lo_y: gl.tensor
    hi_y: gl.tensor
    lo_z: gl.tensor
    hi_z: gl.tensor


@aggregate
class BwdLoop:
    """A consumer warpgroup's state across a unit's query blocks: the Q/dO ring's and the dS^T slots' positions,
    its dK and dV accumulators, and (DETERMINISTIC) the dQ lock whose add is still in flight (-1: none)."""
    q_it: RingIndex
    ds_it: RingIndex
    dk: gl.tensor
    dv: gl.tensor
    held: gl.tensor


# Sizes are not value-specialized (``launch_cached`` keys on the constexprs alone).
@gluon.jit(repr=kernel_symbol, do_not_specialize=["N_Q", "N_KV", "Z", "H", "H_KV", "n_seqs", "group_hz", "num_progs",
                                                  "locks_per_head"])
def hopper_attention_bwd_kernel(desc_q, desc_k, desc_v, desc_do, desc_dq, desc_dk, desc_dv, dk_ptr, dv_ptr, lse_ptr,
                                delta_ptr, sched_ptr, seq_ptr, dq_locks, qk_scale, sm_scale, N_Q, N_KV, Z, H, H_KV,
                                n_seqs, group_hz, num_progs, locks_per_head, BLOCK_M: gl.constexpr,
                                Q_STAGES: gl.constexpr, S_AHEAD: gl.constexpr, DQ_FIRST: gl.constexpr,
                                DQ_FRAG: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr,
                                DETERMINISTIC: gl.constexpr, LOADER_WARPS: gl.constexpr, KERNEL_NAME: gl.constexpr,
                                PADDED: gl.constexpr = False, WINDOW: gl.constexpr = 0, QK_DIM: gl.constexpr = 0,
                                V_DIM: gl.constexpr = 0):
    # (WINDOW: neighborhood attention over the rows of dense self-attention, its kernel size and stride the two
    # int32 words at seq_ptr, as in the forward; ``masks.window_query_blocks``)
    cfg = BwdCfg(desc_q.dtype, block_cols(desc_q.block_type.shape), BLOCK_M, Q_STAGES, S_AHEAD, DQ_FIRST, DQ_FRAG,
                 CAUSAL, VARLEN, DETERMINISTIC, PADDED, WINDOW, desc_q.block_type.shape, desc_k.block_type.shape,
                 QK_DIM, V_DIM)
    shape = KeyShape(N_Q, N_KV, Z, H, H_KV, H // H_KV, seq_ptr, n_seqs, group_hz, BLOCK_M, cfg.BLOCK_N, CAUSAL,
                     VARLEN, DETERMINISTIC)
    run = BwdRun(shape, qk_scale, sm_scale, lse_ptr, delta_ptr, desc_dq, desc_dk, desc_dv, dk_ptr, dv_ptr,
                 dq_locks, locks_per_head)
    q_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_M, cfg.HEAD_DIM], cfg.dtype)
    k_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.HALF, cfg.HEAD_DIM], cfg.dtype)
    ds_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.HALF, cfg.BLOCK_M], cfg.dtype)

    kv = KVHalves(gl.allocate_shared_memory(cfg.dtype, [cfg.KV_PARTS, cfg.HALF, cfg.HEAD_DIM], k_smem),
                  gl.allocate_shared_memory(cfg.dtype, [cfg.KV_PARTS, cfg.HALF, cfg.HEAD_DIM], k_smem),
                  slot_words_alloc(1), Signal.alloc(1, 2))
    rows_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    qd = QdO(gl.allocate_shared_memory(cfg.dtype, [cfg.Q_STAGES, cfg.BLOCK_M, cfg.HEAD_DIM], q_smem),
             gl.allocate_shared_memory(cfg.dtype, [cfg.Q_STAGES, cfg.BLOCK_M, cfg.HEAD_DIM], q_smem),
             gl.allocate_shared_memory(gl.float32, [cfg.Q_STAGES, cfg.BLOCK_M], rows_smem),
             gl.allocate_shared_memory(gl.float32, [cfg.Q_STAGES, cfg.BLOCK_M], rows_smem),
             Signal.alloc(cfg.Q_STAGES, 2))
    ds_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ds_bars.index(i), count=2)
    # Each warpgroup's dQ share stages here for its TMA reduce-add into the fp32 accumulator.
    dq_shape: gl.constexpr = [cfg.HALF, 64]  # (16 KB: a [64, 64] fp32 share; DQ_FRAG views it as its [128, 32] block)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2] + dq_shape,
                                        gl.NVMMASharedLayout.get_default_for(dq_shape, gl.float32))
    if cfg.WIDE:
        # Each warpgroup's half of the queries: its dS^T and P^T [64 keys, BLOCK_M / 2], two slots.
        x_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.HALF, cfg.BLOCK_M // 2], cfg.dtype)
        ds = DsBufs(gl.allocate_shared_memory(cfg.dtype, [4, cfg.HALF, cfg.BLOCK_M // 2], x_smem), ds_bars)
        ps = gl.allocate_shared_memory(cfg.dtype, [4, cfg.HALF, cfg.BLOCK_M // 2], x_smem)
    else:
        ds = DsBufs(gl.allocate_shared_memory(cfg.dtype, [4, cfg.HALF, cfg.BLOCK_M], ds_smem), ds_bars)
        ps = ds.mem  # (unused: the P^T halves stay in registers)
    fence_async_shared()
    c0 = BwdConsumer(kv, qd, ds, ps, dq_bufs.index(0), 0)
    c1 = BwdConsumer(kv, qd, ds, ps, dq_bufs.index(1), 1)
    if LOADER_WARPS == 1:
        # The loader a 1-warp worker (its warpgroup padded at 24 registers), consumer 0 the default partition.
        gl.warp_specialize([(_bwd_consumer, (cfg, run, c0)),
                            (_bwd_load, (cfg, run, desc_q, desc_k, desc_v, desc_do, kv, qd, sched_ptr, num_progs)),
                            (_bwd_consumer, (cfg, run, c1))],
                           [1, 4], [LOADER_REGS, CONSUMER_REGS])
    else:
        # The loader the default partition: its code runs on all 4 warps (a partition bar.sync at each copy).
        gl.warp_specialize([(_bwd_load, (cfg, run, desc_q, desc_k, desc_v, desc_do, kv, qd, sched_ptr, num_progs)),
                            (_bwd_consumer, (cfg, run, c0)),
                            (_bwd_consumer, (cfg, run, c1))],
                           [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# ---------------------------------------------------------------------------------------------
# The loader (one warp)
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _bwd_load(cfg, run, desc_q, desc_k, desc_v, desc_do, kv, qd, sched_ptr, num_progs):
    """Units from the global counter (the first one: the program id): per unit its K and V halves and
    number, then the Q and dO blocks of every query head of the group in the consumers' order; -1 beside
    an empty K/V slot ends the consumers' walk."""
    shape = run.shape
    n_units = shape.num_units()
    row_len = shape.row_len()
    rows_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    kv_it = RingIndex.start(1)
    q_it = RingIndex.start(cfg.Q_STAGES)
    unit = gl.program_id(0)
    while unit < n_units:
        w = shape.work(unit)
        bar = kv.sig.acquire_empty(kv_it)
        publish_unit(kv.ids, kv_it, unit)
        mbarrier.expect(bar, 2 * cfg.KV_PARTS * desc_k.block_type.nbytes)
        if cfg.NA_DIMS >= 2:
            walk = _box_walk(cfg, run, w)
        for i in gl.static_range(cfg.KV_PARTS):
            if cfg.NA_DIMS >= 2:
                coords = _key_half_coords(cfg, w, walk, i)
            else:
                coords = [w.z, w.hk, w.k_base + w.n0 + i * cfg.HALF, 0]
            tma.async_load(desc_k, coords, bar, block_view(kv.k.index(i), desc_k))
            tma.async_load(desc_v, coords, bar, block_view(kv.v.index(i), desc_v))
        kv_it = kv_it.next()
        if cfg.NA_DIMS >= 2:
            q_it = _load_query_boxes(cfg, run, desc_q, desc_do, qd, w, walk, q_it)
        else:
            if cfg.WINDOW:
                w, q_hi = _window_work(cfg, run, w)
            else:
                q_hi = w.m_hi
            for g in range(shape.G):
                h = w.hk * shape.G + g
                stats = (w.z * shape.H + h).to(gl.int64) * row_len + w.q_base
                for j in range(w.m_lo, q_hi):
                    m = _block_at(cfg, j, w.m_lo, q_hi)
                    coords = [w.z, h, w.q_base + m * cfg.BLOCK_M, 0]
                    rows = m * cfg.BLOCK_M + gl.arange(0, cfg.BLOCK_M, rows_layout)
                    in_q = rows < w.n_q
                    # Rows past the sequence: lse +inf makes their P (and dS) 0, whatever Q and dO hold there.
                    lse = gl.load(run.lse_ptr + stats + rows, mask=in_q, other=float("inf"))
                    delta = gl.load(run.delta_ptr + stats + rows, mask=in_q, other=0.0)
                    q_it = _push_query_block(desc_q, desc_do, qd, q_it, coords, lse, delta)
        unit = num_progs + gl.atomic_add(sched_ptr, 1)
    bar = kv.sig.acquire_empty(kv_it)
    publish_unit(kv.ids, kv_it, -1)
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _key_half_coords(cfg, w, walk, i):
    """2-D/3-D windows: the descriptor coordinates of half ``i`` (along x) of the unit's key box: [z, h, x, y, 0] over
    [Z, H_KV, Lx, Ly, D] views, [h, x, y, z, 0] over [H_KV, Lx, Ly, Lz, D] ones (3-D: one batch a launch)."""
    x = walk.kx0 + i * (cfg.KX // 2)
    if cfg.NA_DIMS == 3:
        return [w.hk, x, walk.ky0, walk.kz0, 0]
    else:
        return [w.z, w.hk, x, walk.ky0, 0]


@gluon.jit
def _load_query_boxes(cfg, run, desc_q, desc_do, qd, w, walk, q_it):
    """2-D/3-D windows: the Q and dO boxes of the unit's walk (``BoxWalk``) for every query head of the group, with
    their rows' lse and delta (laid out box after box by the host, +inf and 0 past the grid)."""
    shape = run.shape
    row_len = shape.row_len()
    rows_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    for g in range(shape.G):
        h = w.hk * shape.G + g
        stats = (w.z * shape.H + h).to(gl.int64) * row_len
        for j in range(walk.n):
            bx, by, bz, m, _ = walk.box(j, cfg.NA_DIMS)
            if cfg.NA_DIMS == 3:
                coords = [h, bx * cfg.TX, by * cfg.TY, bz * cfg.TZ, 0]
            else:
                coords = [w.z, h, bx * cfg.TX, by * cfg.TY, 0]
            rows = m * cfg.BLOCK_M + gl.arange(0, cfg.BLOCK_M, rows_layout)
            q_it = _push_query_block(desc_q, desc_do, qd, q_it, coords, gl.load(run.lse_ptr + stats + rows),
                                     gl.load(run.delta_ptr + stats + rows))
    return q_it


@gluon.jit
def _push_query_block(desc_q, desc_do, qd, q_it, coords, lse, delta):
    """Into Q/dO slot ``q_it`` once free: the block's lse and delta rows (the loader's warps' stores, released by the
    copies' expect-arrive), and its Q and dO by TMA at ``coords``; returns the next slot."""
    bar = qd.sig.acquire_empty(q_it)
    qd.lse.index(q_it.index).store(lse)
    qd.delta.index(q_it.index).store(delta)
    mbarrier.expect(bar, 2 * desc_q.block_type.nbytes)
    tma.async_load(desc_q, coords, bar, block_view(qd.q.index(q_it.index), desc_q))
    tma.async_load(desc_do, coords, bar, block_view(qd.do.index(q_it.index), desc_do))
    return q_it.next()


# ---------------------------------------------------------------------------------------------
# The consumers (a warpgroup each: 64 keys of the unit)
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _bwd_consumer(cfg, run, me):
    """A consumer warpgroup's walk over its units: dK and dV of its 64 keys (WIDE, D=256: of the unit's 64
    keys and its half of the head dims, ``_bwd_blocks_wide``), summed over every query block and query head of
    the group, then stored."""
    kv_it = RingIndex.start(1)
    q_it = RingIndex.start(cfg.Q_STAGES)
    ds_it = RingIndex.start(2)
    shape = run.shape
    unit = read_unit(me.kv.sig, me.kv.ids, kv_it, 4)
    while unit >= 0:
        w = shape.work(unit)
        if cfg.NA_DIMS >= 2:
            q_hi = w.m_hi  # (not used: the walk is the ``BoxWalk``'s)
        elif cfg.WINDOW:
            w, q_hi = _window_work(cfg, run, w)
        else:
            q_hi = w.m_hi
        if cfg.WIDE:
            u = BwdUnit(w, w.n0, me.WG * cfg.KV_COLS)
        else:
            u = BwdUnit(w, w.n0 + me.WG * cfg.HALF, 0)
        if cfg.NA_DIMS >= 2:
            u = _box_unit(cfg, run, u, _box_walk(cfg, run, w), me.WG)
        elif cfg.WINDOW:
            u = _window_unit(cfg, run, u)
        st = BwdLoop(q_it, ds_it, gl.zeros([cfg.HALF, cfg.KV_COLS], gl.float32, cfg.kv_layout),
                     gl.zeros([cfg.HALF, cfg.KV_COLS], gl.float32, cfg.kv_layout), gl.to_tensor(-1))
        for g in range(shape.G):
            hz = w.z * shape.H + w.hk * shape.G + g
            # The masked query blocks, then the others; DETERMINISTIC the other way round (the loader's order:
            # from the last query block down, see ``_block_at``).
            if cfg.NA_DIMS >= 2:
                # every step of the walk masked or not as its box lies (``BoxWalk.box``)
                st = _blocks(cfg, run, me, u, st, 0, u.walk.n, hz, True)
            elif cfg.WINDOW:
                # masked [m_lo, m_full), unmasked [m_full, m_hi), masked [m_hi, q_hi) (``_window_work``); in the
                # loader's order: DETERMINISTIC from the last block down
                if cfg.DETERMINISTIC:
                    st = _blocks(cfg, run, me, u, st, w.m_hi, q_hi, hz, True)
                    st = _blocks(cfg, run, me, u, st, w.m_full, w.m_hi, hz, False)
                    st = _blocks(cfg, run, me, u, st, w.m_lo, w.m_full, hz, True)
                else:
                    st = _blocks(cfg, run, me, u, st, w.m_lo, w.m_full, hz, True)
                    st = _blocks(cfg, run, me, u, st, w.m_full, w.m_hi, hz, False)
                    st = _blocks(cfg, run, me, u, st, w.m_hi, q_hi, hz, True)
            else:
                for piece in gl.static_range(2):
                    MASKED = _masked_piece(piece, cfg.DETERMINISTIC)  # (a constexpr: it selects the loop's code)
                    lo, hi = w.query_blocks(MASKED)
                    st = _blocks(cfg, run, me, u, st, lo, hi, hz, MASKED)
        if cfg.DETERMINISTIC:
            # (before the next unit, which may be this head's next key block and wait on this add)
            _dq_release(run, st.held)
        q_it = st.q_it
        ds_it = st.ds_it
        me.kv.sig.release(kv_it)
        kv_it = kv_it.next()
        _store_kv(cfg, me, u, st.dk * run.sm_scale, run.desc_dk, run.dk_ptr)
        _store_kv(cfg, me, u, st.dv, run.desc_dv, run.dv_ptr)
        unit = read_unit(me.kv.sig, me.kv.ids, kv_it, 4)
    tma.store_wait(0)


@gluon.jit
def _window_work(cfg, run, w):
    """WINDOW: the unit's query blocks as its key block's neighborhoods give them (``masks.window_query_blocks``):
    the unit with masked [m_lo, m_full), unmasked [m_full, m_hi), and the end of the masked blocks after them."""
    win_k, win_s = window_words(run.shape.seq_ptr)
    m_lo, m_a, m_b, m_end = window_query_blocks(w.n0, cfg.BLOCK_N, w.n_k, win_k, win_s, cfg.BLOCK_M, cfg.WINDOW)
    return KeyWork(w.z, w.hk, w.q_base, w.k_base, w.n_q, w.n_k, w.shift, w.n0, m_lo, m_a, m_b, w.dq_base), m_end


@gluon.jit
def _window_unit(cfg, run, u):
    """WINDOW: the unit with its key rows' query ranges, once per unit (two bounds a row, in S^T's row layout)."""
    keys = u.key0 + gl.arange(0, cfg.HALF, gl.SliceLayout(1, cfg.s_layout))
    win_k, win_s = window_words(run.shape.seq_ptr)
    q_lo, q_hi = window_query_bounds(keys, u.w.n_k, win_k, win_s, cfg.WINDOW)
    return BwdWindowUnit(u.w, u.key0, u.col0, q_lo, q_hi)


@gluon.jit
def _box_walk(cfg, run, w):
    """2-D/3-D windows: unit ``w``'s key box (its number ``w.n0 // BLOCK_N``, row-major over the grid's key boxes)
    and the query boxes that attend it (``BoxWalk``)."""
    na = window_boxes_load(run.shape.seq_ptr, cfg.TX, cfg.TY, cfg.TZ, cfg.KX, cfg.KY, cfg.KZ, cfg.WINDOW)
    kb = w.n0 // cfg.BLOCK_N
    nky = gl.cdiv(na.Ly, cfg.KY)
    if cfg.NA_DIMS == 3:
        nkz = gl.cdiv(na.Lz, cfg.KZ)
        kxy = kb // nkz
        kz0 = (kb - kxy * nkz) * cfg.KZ
        lo_z, ulo_z, uhi_z, hi_z = window_query_blocks(kz0, cfg.KZ, na.Lz, na.Kz, na.Sz, cfg.TZ, na.MZ)
        nqz = gl.cdiv(na.Lz, cfg.TZ)
    else:
        kxy = kb
        kz0 = kb * 0
        lo_z = kz0
        ulo_z = kz0
        uhi_z = kz0 + 1
        hi_z = kz0 + 1
        nqz = kz0 + 1
    kbx = kxy // nky
    kx0 = kbx * cfg.KX
    ky0 = (kxy - kbx * nky) * cfg.KY
    lo_x, ulo_x, uhi_x, hi_x = window_query_blocks(kx0, cfg.KX, na.Lx, na.Kx, na.Sx, cfg.TX, na.MX)
    lo_y, ulo_y, uhi_y, hi_y = window_query_blocks(ky0, cfg.KY, na.Ly, na.Ky, na.Sy, cfg.TY, na.MY)
    ny = hi_y - lo_y
    nz = hi_z - lo_z
    return BoxWalk(kx0, ky0, kz0, lo_x, lo_y, lo_z, ny, nz, (hi_x - lo_x) * ny * nz, ulo_x, uhi_x, ulo_y, uhi_y,
                   ulo_z, uhi_z, gl.cdiv(na.Ly, cfg.TY), nqz)


@gluon.jit
def _box_unit(cfg, run, u, walk, WG: gl.constexpr):
    """2-D/3-D windows: the unit with its walk and, for each of warpgroup WG's 64 keys (its half of the key box along
    x, row-major), the queries that attend it per dimension, once per unit (``BwdBoxUnit``)."""
    na = window_boxes_load(run.shape.seq_ptr, cfg.TX, cfg.TY, cfg.TZ, cfg.KX, cfg.KY, cfg.KZ, cfg.WINDOW)
    r = gl.arange(0, cfg.HALF, gl.SliceLayout(1, cfg.s_layout))
    if cfg.NA_DIMS == 3:
        lo_z, hi_z = window_query_bounds(walk.kz0 + r % cfg.KZ, na.Lz, na.Kz, na.Sz, na.MZ)
        r = r // cfg.KZ
    kx = walk.kx0 + WG * (cfg.KX // 2) + r // cfg.KY
    lo_x, hi_x = window_query_bounds(kx, na.Lx, na.Kx, na.Sx, na.MX)
    lo_y, hi_y = window_query_bounds(walk.ky0 + r % cfg.KY, na.Ly, na.Ky, na.Sy, na.MY)
    if cfg.NA_DIMS != 3:
        lo_z = lo_y
        hi_z = hi_y
    return BwdBoxUnit(u.w, u.key0, u.col0, walk, lo_x, hi_x, lo_y, hi_y, lo_z, hi_z)


@gluon.jit
def _mask_query_box(cfg, u, s, bx, by, bz):
    """2-D/3-D windows: S^T (rows: the warpgroup's keys; columns: query box (bx, by, bz)'s positions, row-major) with
    -inf where a dimension's queries [lo, hi) of the key (``BwdBoxUnit``) do not hold the column's query (positions
    past the grid included)."""
    c = gl.arange(0, s.shape[1], gl.SliceLayout(0, s.type.layout))
    if cfg.NA_DIMS == 3:
        qz = gl.expand_dims(bz * cfg.TZ + c % cfg.TZ, 0)
        c = c // cfg.TZ
    qx = gl.expand_dims(bx * cfg.TX + c // cfg.TY, 0)
    qy = gl.expand_dims(by * cfg.TY + c % cfg.TY, 0)
    keep = (qx >= gl.expand_dims(u.lo_x, 1)) & (qx < gl.expand_dims(u.hi_x, 1)) & \
        (qy >= gl.expand_dims(u.lo_y, 1)) & (qy < gl.expand_dims(u.hi_y, 1))
    if cfg.NA_DIMS == 3:
        keep = keep & (qz >= gl.expand_dims(u.lo_z, 1)) & (qz < gl.expand_dims(u.hi_z, 1))
    return gl.where(keep, s, -float("inf"))


@gluon.constexpr_function
def _masked_piece(piece, DETERMINISTIC):
    """Whether piece ``piece`` (0 or 1) of a unit's query blocks of one head is its masked one (``KeyWork``): the
    first, or DETERMINISTIC the second."""
    return (piece == 1) == bool(DETERMINISTIC)


@gluon.jit
def _blocks(cfg, run, me, u, st, lo, hi, dq_row, MASKED: gl.constexpr):
    """Query blocks [lo, hi) of one query head (dQ's accumulator rows ``dq_row``) for consumer ``me`` from loop
    state ``st``; returns the state after them."""
    if cfg.WIDE:
        return _bwd_blocks_wide(cfg, run, me, u, st, lo, hi, dq_row, MASKED)
    else:
        return _bwd_blocks(cfg, run, me, u, st, lo, hi, dq_row, MASKED)


@gluon.jit
def _bwd_blocks_wide(cfg, run, me, u, st, lo, hi, dq_row, MASKED: gl.constexpr):
    """D=256, query blocks [lo, hi) of one query head against the unit's 64 keys. Warpgroup WG computes S^T
    and dP^T for its half of each block's queries ([64 keys, BLOCK_M / 2]: no exchange of fp32 scores),
    shares its P^T and dS^T halves through shared memory, and accumulates its half of the head dims of dK
    and dV ([64 keys, 128]) and of dQ (two [64 head dims, queries] chunks): 128 accumulator registers, as
    the 128-key units' [64 keys, D=128] pair."""
    QH: gl.constexpr = cfg.BLOCK_M // 2  # queries per warpgroup (scores)
    DH: gl.constexpr = cfg.HEAD_DIM // 2  # head dims per warpgroup (gradients)
    DQ_CHUNK: gl.constexpr = 64  # head dims per dQ reduce-add
    WG: gl.constexpr = me.WG
    w = u.w
    # (the block loop carries these as values of their own, in this order: the carried values' order reaches ptxas)
    dk, dv, q_it, ds_it, held = st.dk, st.dv, st.q_it, st.ds_it, st.held
    for j in range(lo, hi):
        kv_slot = opaque(0)  # (KV_DESC_PER_BLOCK)
        k = me.kv.k.index(kv_slot)
        v = me.kv.v.index(kv_slot)
        m = _block_at(cfg, j, lo, hi)
        m0 = m * cfg.BLOCK_M
        me.qd.sig.wait_ready(q_it)
        q_slot = opaque(q_it.index)  # (one stage: its descriptors would be hoisted too)
        q = me.qd.q.index(q_slot)
        do = me.qd.do.index(q_slot)
        zeros = gl.zeros([cfg.HALF, QH], gl.float32, cfg.s_layout)
        s_tok = reduce_d(k, q.slice(WG * QH, QH, dim=0), zeros, cfg.QK_DIM, cfg.HEAD_DIM)
        dp_tok = reduce_d(v, do.slice(WG * QH, QH, dim=0), zeros, cfg.V_DIM, cfg.HEAD_DIM)
        s = warpgroup_mma_wait(1, deps=[s_tok])
        lse = me.qd.lse.index(q_it.index).slice(WG * QH, QH).load(gl.SliceLayout(0, cfg.s_layout))
        p, d_s, held = _scores_to_grads(cfg, run, u, s, dp_tok, lse, me.qd.delta.index(q_it.index).slice(WG * QH, QH),
                                        m0 + WG * QH, held, MASKED)
        me.ps.index(ds_it.index * 2 + WG).store(p.to(cfg.dtype))
        me.ds.half(ds_it, WG).store(d_s.to(cfg.dtype))
        me.ds.exchange(ds_it)
        # dV, dK [64 keys, this warpgroup's head dims] over both query halves.
        dv_tok = warpgroup_mma(me.ps.index(ds_it.index * 2), do.slice(0, QH, dim=0).slice(WG * DH, DH, dim=1), dv,
                               is_async=True)
        dv_tok = warpgroup_mma(me.ps.index(ds_it.index * 2 + 1), do.slice(QH, QH, dim=0).slice(WG * DH, DH, dim=1),
                               dv_tok, is_async=True)
        dk_tok = warpgroup_mma(me.ds.half(ds_it, 0), q.slice(0, QH, dim=0).slice(WG * DH, DH, dim=1), dk, is_async=True)
        dk_tok = warpgroup_mma(me.ds.half(ds_it, 1), q.slice(QH, QH, dim=0).slice(WG * DH, DH, dim=1), dk_tok,
                               is_async=True)
        # dQ^T [64 head dims, queries] = K^T[those head dims, keys] dS^T[keys, queries], per query half.
        for c in gl.static_range(DH // DQ_CHUNK):
            k_t = k.slice(WG * DH + c * DQ_CHUNK, DQ_CHUNK, dim=1).permute((1, 0))
            acc = gl.zeros([DQ_CHUNK, QH], gl.float32, cfg.dq_layout)
            t0 = warpgroup_mma(k_t, me.ds.half(ds_it, 0), acc, use_acc=False, is_async=True)
            t1 = warpgroup_mma(k_t, me.ds.half(ds_it, 1), acc, use_acc=False, is_async=True)
            if c == 0:
                dv, dk, dq0, dq1 = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, t0, t1])
                me.qd.sig.release(q_it)
            else:
                dq0, dq1 = warpgroup_mma_wait(0, deps=[t0, t1])
            held = _dq_claim(cfg, run, dq_row, u, m0, held, c == 0)
            me.dq_buf.slice(0, QH, dim=0).permute((1, 0)).store(dq0)
            me.dq_buf.slice(QH, QH, dim=0).permute((1, 0)).store(dq1)
            _dq_add(run, [dq_row, w.dq_base + m0, WG * DH + c * DQ_CHUNK], me.dq_buf)
        q_it = q_it.next()
        ds_it = ds_it.next()
    return BwdLoop(q_it, ds_it, dk, dv, held)


@gluon.jit
def _bwd_blocks(cfg, run, me, u, st, lo, hi, dq_row, MASKED: gl.constexpr):
    """Query blocks [lo, hi) of one query head against this warpgroup's 64 keys.

    S_AHEAD: block j + 1's S^T wgmma is issued as soon as block j's wgmmas are done, and runs while block j's
    dQ share is staged and reduce-added (both warpgroups reach that point together, so the tensor cores had
    nothing else queued then); it is waited before the loop's back-edge (an accumulator in flight across it
    makes ptxas serialise the wgmmas). It gained at D=64 causal (NOTES v39).
    DQ_FIRST: dQ's wgmma right after the dS exchange, then dK's, under which the dQ share is staged and added. It
    gained at D=128 and lost at D=64 non-causal, whose loops then spill (NOTES v44)."""
    WG: gl.constexpr = me.WG
    w = u.w
    # (the block loop carries these as values of their own, in this order: the carried values' order reaches ptxas)
    dk, dv, q_it, ds_it, held = st.dk, st.dv, st.q_it, st.ds_it, st.held
    if not cfg.KV_DESC_PER_BLOCK:
        k_me = me.kv.k.index(WG)
        v_me = me.kv.v.index(WG)
    s = gl.zeros([cfg.HALF, cfg.BLOCK_M], gl.float32, cfg.s_layout)
    if cfg.S_AHEAD:
        if lo < hi:
            s = warpgroup_mma_wait(0, deps=[_issue_scores(cfg, _k_slot(cfg, me), me.qd, q_it)])
    for j in range(lo, hi):
        if cfg.KV_DESC_PER_BLOCK:
            kv_slot = opaque(WG)
            k_me = me.kv.k.index(kv_slot)
            v_me = me.kv.v.index(kv_slot)
        if cfg.NA_DIMS >= 2:
            bx, by, bz, m, partial = u.walk.box(j, cfg.NA_DIMS)
        else:
            m = _block_at(cfg, j, lo, hi)
            bx, by, bz, partial = 0, 0, 0, 0
        m0 = m * cfg.BLOCK_M
        lse_first: gl.constexpr = cfg.LSE_TOP and WG == 1
        if lse_first:
            # Consumer 1 reads the lse before its S^T issue (FA4's place), consumer 0 after its S^T wait. An LDS issued
            # while wgmmas stream their operands from shared memory returns only as they finish, so read after the S^T
            # wait it holds up the first exponent; read early by one consumer, that one runs ahead of the other and the
            # block is shorter, by both (in step) longer (NOTES v52, v93). (D=64, D=256 and packed builds: unchanged.)
            s_tok, lse = _issue_scores(cfg, k_me, me.qd, q_it, READ_LSE=True)
        elif not cfg.S_AHEAD:
            s_tok = _issue_scores(cfg, k_me, me.qd, q_it)
        q = me.qd.q.index(q_it.index)
        do = me.qd.do.index(q_it.index)
        zeros = gl.zeros([cfg.HALF, cfg.BLOCK_M], gl.float32, cfg.s_layout)
        dp_tok = reduce_d(v_me, do, zeros, cfg.V_DIM, cfg.HEAD_DIM)
        if not cfg.S_AHEAD:
            s = warpgroup_mma_wait(1, deps=[s_tok])
        if not lse_first:
            lse = me.qd.lse.index(q_it.index).load(gl.SliceLayout(0, cfg.s_layout))
        p, d_s, held = _scores_to_grads(cfg, run, u, s, dp_tok, lse, me.qd.delta.index(q_it.index), m0, held, MASKED,
                                        bx, by, bz, partial)
        p_a = gl.convert_layout(p.to(cfg.dtype), cfg.a_layout)
        if cfg.DS_FIRST:
            # dS^T's half goes to shared memory before dV's wgmma is issued: stored after it, the stores queued behind
            # the operand reads of the wgmma just issued, and the fence that publishes them held up this consumer and
            # the other at the exchange. D=64 non-causal keeps the old order (NOTES v53, v93).
            ds16 = d_s.to(cfg.dtype)
            ds_a = gl.convert_layout(ds16, cfg.a_layout)
            me.ds.half(ds_it, WG).store(ds16)
            dv_tok = warpgroup_mma(p_a, do, dv, is_async=True)
        else:
            dv_tok = warpgroup_mma(p_a, do, dv, is_async=True)
            ds16 = d_s.to(cfg.dtype)
            ds_a = gl.convert_layout(ds16, cfg.a_layout)
        if not cfg.DQ_FIRST:
            dk_tok = warpgroup_mma(ds_a, q, dk, is_async=True)
        if not cfg.DS_FIRST:
            me.ds.half(ds_it, WG).store(ds16)
        me.ds.exchange(ds_it)
        dq_tok = _dq_mma(cfg, me.kv.k, me.ds.half(ds_it, 0), me.ds.half(ds_it, 1), WG)
        if cfg.DQ_FIRST:
            # FA3/FA4's order: dK's wgmma after dQ's, and dQ's share staged and reduce-added under it (otherwise
            # no wgmma is in flight while both warpgroups stage their shares).
            dv = warpgroup_mma_wait(1, deps=[dv_tok])
            dk_tok = warpgroup_mma(ds_a, q, dk, is_async=True)
            dq = warpgroup_mma_wait(1, deps=[dq_tok])
            held = _dq_claim(cfg, run, dq_row, u, m0, held, True)
            _dq_reduce(cfg, run, me, w, dq, dq_row, m0)
            dk = warpgroup_mma_wait(0, deps=[dk_tok])
            me.qd.sig.release(q_it)
            q_it = q_it.next()
        else:
            dv, dk, dq = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok])
            me.qd.sig.release(q_it)
            q_it = q_it.next()
            held = _dq_claim(cfg, run, dq_row, u, m0, held, True)
            if cfg.S_AHEAD:
                # (each branch stages the add: an async wgmma's result cannot leave the ``if`` it was issued in)
                if j + 1 < hi:
                    s_tok = _issue_scores(cfg, _k_slot(cfg, me), me.qd, q_it)
                    _dq_reduce(cfg, run, me, w, dq, dq_row, m0)
                    s = warpgroup_mma_wait(0, deps=[s_tok])
                else:
                    _dq_reduce(cfg, run, me, w, dq, dq_row, m0)
                    s = zeros  # (not this block's S^T: that would keep it live through the block)
            else:
                _dq_reduce(cfg, run, me, w, dq, dq_row, m0)
        ds_it = ds_it.next()
    return BwdLoop(q_it, ds_it, dk, dv, held)


@gluon.jit
def _k_slot(cfg, me):
    """This warpgroup's K half (KV_DESC_PER_BLOCK: through an opaque slot number, see ``opaque``)."""
    if cfg.KV_DESC_PER_BLOCK:
        return me.kv.k.index(opaque(me.WG))
    else:
        return me.kv.k.index(me.WG)


@gluon.jit
def _issue_scores(cfg, k_me, qd, q_it, READ_LSE: gl.constexpr = False):
    """Wait for Q/dO slot ``q_it`` and issue the warpgroup's S^T = K Q^T wgmma on it. READ_LSE: read the slot's
    lse in between (before the wgmma streams from shared memory) and return (token, lse)."""
    qd.sig.wait_ready(q_it)
    if READ_LSE:
        lse = qd.lse.index(q_it.index).load(gl.SliceLayout(0, cfg.s_layout))
    zeros = gl.zeros([cfg.HALF, cfg.BLOCK_M], gl.float32, cfg.s_layout)
    tok = reduce_d(k_me, qd.q.index(q_it.index), zeros, cfg.QK_DIM, cfg.HEAD_DIM)
    if READ_LSE:
        return tok, lse
    else:
        return tok


@gluon.jit
def _scores_to_grads(cfg, run, u, s, dp_tok, lse, delta_rows, q0, held, MASKED: gl.constexpr, bx=0, by=0, bz=0,
                     partial=0):
    """P^T and dS^T of a warpgroup's [64 keys from u.key0, queries from q0] tile, from its S^T and its dP^T
    wgmma in flight, the queries' lse (log2 units, loaded) and their delta in shared memory. MASKED: keys past the
    sequence and (causal) past each query's diagonal get P = 0; 2-D/3-D windows: the keys outside the windows of
    query box (bx, by, bz) when ``partial``. DETERMINISTIC: the previous block's dQ add is counted while dP^T finishes
    (``_dq_release_early``). Returns (P^T, dS^T, the dQ lock held)."""
    col: gl.constexpr = gl.SliceLayout(0, cfg.s_layout)
    row: gl.constexpr = gl.SliceLayout(1, cfg.s_layout)
    if MASKED:
        if cfg.NA_DIMS >= 2:
            if partial:
                s = _mask_query_box(cfg, u, s, bx, by, bz)
        elif cfg.WINDOW:
            s = mask_cols_between(s, q0, u.q_lo, u.q_hi)
        elif cfg.MASK_BY_ROW:
            s = mask_block_transposed(s, u.key0, q0, u.w.shift, u.w.n_k, cfg.CAUSAL)
        else:
            keys = gl.expand_dims(u.key0 + gl.arange(0, cfg.HALF, row), 1)
            ok = keys < u.w.n_k
            if cfg.CAUSAL:
                ok = ok & (keys <= gl.expand_dims(q0 + gl.arange(0, s.shape[1], col), 0) + u.w.shift)
            s = gl.where(ok, s, -float("inf"))
    p = gl.exp2(s * run.qk_scale - gl.expand_dims(lse, 0))
    held = _dq_release_early(cfg, run, held)
    dp = warpgroup_mma_wait(0, deps=[dp_tok])
    d_s = p * (dp - gl.expand_dims(delta_rows.load(col), 0))
    return p, d_s, held


@gluon.jit
def _block_at(cfg, j, lo, hi):
    """The query block the j-th step of [lo, hi) visits: in order, or (DETERMINISTIC) from the last block
    down. Walking down, a unit's blocks end at its causal diagonal: the units of one head all start on the
    last query block and each follows the previous key block's dQ adds a block behind (walking up, a short
    unit would wait at its first block for every longer one to get there)."""
    if cfg.DETERMINISTIC:
        return lo + hi - 1 - j
    else:
        return j


@gluon.jit
def _dq_mma(cfg, k_halves, ds0, ds1, WG: gl.constexpr):
    """This warpgroup's share of dS K over the unit's 128 keys (two wgmmas, one per key half)."""
    if cfg.DQ_T:
        # dQ^T rows [64 WG, +64) = K^T[those head dims, keys] dS^T[keys, queries]
        acc = gl.zeros([cfg.HALF, cfg.BLOCK_M], gl.float32, cfg.dq_layout)
        tok = warpgroup_mma(k_halves.index(0).slice(WG * cfg.HALF, cfg.HALF, dim=1).permute((1, 0)),
                            ds0, acc, use_acc=False, is_async=True)
        tok = warpgroup_mma(k_halves.index(1).slice(WG * cfg.HALF, cfg.HALF, dim=1).permute((1, 0)),
                            ds1, tok, is_async=True)
    else:
        # dQ rows [m0 + 64 WG, +64) = dS[those queries, keys] K[keys, head dims]
        acc = gl.zeros([cfg.HALF, cfg.HEAD_DIM], gl.float32, cfg.dq_layout)
        tok = warpgroup_mma(ds0.slice(WG * cfg.HALF, cfg.HALF, dim=1).permute((1, 0)),
                            k_halves.index(0), acc, use_acc=False, is_async=True)
        tok = warpgroup_mma(ds1.slice(WG * cfg.HALF, cfg.HALF, dim=1).permute((1, 0)),
                            k_halves.index(1), tok, is_async=True)
    return tok


@gluon.jit
def _dq_reduce(cfg, run, me, w, dq, hz, m0):
    """Add this warpgroup's dQ share to the fp32 accumulator [Z * H, rows, D] with one TMA reduce-add (DQ_T:
    the block's queries x head dims [64 WG, +64); else the block's queries [64 WG, +64) x all head dims), not
    per-thread atomics from registers, which held the kernel back (NOTES v36, v93). A packed sequence's
    rows start on a whole query block of the accumulator (the reduce's innermost coordinate must be 16-byte
    aligned: an unaligned one faulted), so its last block's rows past the sequence add exact zeros (their
    P and dS are 0) into its own padding.

    DETERMINISTIC: fp32 adds in arrival order would make dQ's rounding depend on timing, so each query
    block of each head has a lock counting the adds done into it; key block j's warpgroups add after the
    DQ_ADDS * j adds of key blocks 0..j-1 (one per warpgroup, D=256 two; the key blocks that reach a query
    block are a prefix: causal's first query block grows with the key block). An add is released (lock + 1)
    once it has completed, which is checked in the middle of the next block (``_dq_release_early``; one add
    in flight per warpgroup), and at the unit's end.
    Units are taken in key-block order per head (``KeyShape.work``), so a wait is always on a unit that is
    already running or done: no deadlock. Units of a head run at once (they share Q, dO and dQ in L2; causal:
    the host makes them about an eighth of a wave): walking their query blocks down (``_block_at``), each
    trails the previous key block's by about half a block.
    The caller claims the buffer (and the lock) first (``_dq_claim``).

    DQ_FRAG: the share is staged in the order its registers hold it (a thread's four values of each 8-column
    group side by side: 8 STS.128 per thread, where the [queries, head dims] tile took 32 STS.32 that kept the
    shared-memory instruction queue full: NOTES v45), and the accumulator is kept in that order as
    [chunks * 128, 32] fp32, a chunk of 4096 per warpgroup share (``_fragment_order``); ``dq_from_fragments`` puts
    the rows back after the kernel.

    DQ_SCALED: the share is multiplied by the scale here; otherwise the host's cast scales the accumulator."""
    if cfg.DQ_SCALED:
        dq = dq * run.sm_scale
    if cfg.DQ_FRAG:
        chunk = (hz * run.locks_per_head + (w.dq_base + m0) // cfg.BLOCK_M) * 2 + me.WG
        tile = me.dq_buf.reinterpret(gl.float32, run.desc_dq.block_type.shape, run.desc_dq.layout)
        tile.store(_fragment_order(dq))
        _dq_add(run, [chunk * tile.shape[0], 0], tile)
    elif cfg.DQ_T:
        # dQ^T's registers go into the [queries, head dims] tile transposed: the accumulator is [rows, D]
        # for both splits, so the host's cast reads it in order (NOTES v36, v93).
        me.dq_buf.permute((1, 0)).store(dq)
        _dq_add(run, [hz, w.dq_base + m0, me.WG * cfg.HALF], me.dq_buf)
    else:
        me.dq_buf.store(dq)
        _dq_add(run, [hz, w.dq_base + m0 + me.WG * cfg.HALF, 0], me.dq_buf)


@gluon.jit
def _fragment_order(x):
    """A [64, 64] wgmma accumulator as [128, 32] in its registers' order. A thread's registers 4 i + 2 h + p hold
    element (16 w + 8 h + rr, 8 i + 2 cc + p), w its warp, lane 4 rr + cc (``to_linear_layout``): flat index
    ((i * 4 + w) * 32 + lane) * 4 + 2 h + p, so each thread's four values of a column group lie side by side."""
    x = gl.permute(gl.reshape(x, [4, 2, 8, 8, 4, 2]), [3, 0, 2, 4, 1, 5])  # (i, w, rr, cc, h, p)
    return gl.reshape(x, [128, 32])


@gluon.jit
def _dq_release_early(cfg, run, held):
    """DETERMINISTIC, in the middle of a block (the previous block's add, issued a half block ago, has most
    likely landed): count it now rather than at the next add, so that the next key block's unit trails
    this one by about half a block instead of a whole one. Returns the lock still held (-1)."""
    if cfg.DETERMINISTIC:
        _dq_release(run, held)
        held = gl.to_tensor(-1)
    return held


@gluon.jit
def _dq_claim(cfg, run, hz, u, m0, held, RELEASED: gl.constexpr):
    """Before staging a dQ add into the warpgroup's buffer: the previous add has read it (DETERMINISTIC: has
    completed, and is counted), and (DETERMINISTIC) this key block's turn at the block's lock has come.
    RELEASED: the previous add was already counted this block (``_dq_release_early``, whose full bulk wait
    also freed the buffer). Returns the lock held."""
    w = u.w
    if cfg.DETERMINISTIC:
        if not RELEASED:
            _dq_release(run, held)
        held = hz * run.locks_per_head + (w.dq_base + m0) // cfg.BLOCK_M
        lock = run.dq_locks + held
        if cfg.NA_DIMS >= 2:
            turn = cfg.DQ_ADDS * _box_turn(cfg, run, u.walk, m0 // cfg.BLOCK_M)
        elif cfg.WINDOW:
            # the key blocks that add into this query block start at its first query's window, not at 0
            win_k, win_s = window_words(run.shape.seq_ptr)
            start, _ = window_bounds(gl.minimum(m0, w.n_q - 1), w.n_k, win_k, win_s, cfg.WINDOW)
            turn = cfg.DQ_ADDS * (w.n0 // cfg.BLOCK_N - start // cfg.BLOCK_N)
        else:
            turn = cfg.DQ_ADDS * (w.n0 // cfg.BLOCK_N)
        done = gl.load(lock, volatile=True)
        while done < turn:
            done = gl.load(lock, volatile=True)
    else:
        tma.store_wait(0)
    return held


@gluon.jit
def _box_turn(cfg, run, walk, qb):
    """2-D/3-D windows, DETERMINISTIC: the unit's key box's place among the key boxes whose dQ adds reach query box
    ``qb`` (its number), row-major over their range (the forward's ``WindowBoxes.blocks`` of the query box): units
    take key boxes in that order, and the query boxes a key box walks are exactly those whose range holds it (per
    dimension the same relation, ``window_query_blocks`` against ``window_blocks``), so a wait is always on an
    earlier unit that adds here."""
    na = window_boxes_load(run.shape.seq_ptr, cfg.TX, cfg.TY, cfg.TZ, cfg.KX, cfg.KY, cfg.KZ, cfg.WINDOW)
    if cfg.NA_DIMS == 3:
        qxy = qb // walk.nqz
        z0 = (qb - qxy * walk.nqz) * cfg.TZ
    else:
        qxy = qb
        z0 = qb * 0
    qbx = qxy // walk.nqy
    x0 = qbx * cfg.TX
    y0 = (qxy - qbx * walk.nqy) * cfg.TY
    lo_x, _, _, _, lo_y, hi_y, _, _, lo_z, hi_z, _, _ = na.blocks(x0, x0 + cfg.TX - 1, y0, y0 + cfg.TY - 1, z0,
                                                                  z0 + cfg.TZ - 1)
    return ((walk.kx0 // cfg.KX - lo_x) * (hi_y - lo_y) + walk.ky0 // cfg.KY - lo_y) * (hi_z - lo_z) + \
        walk.kz0 // cfg.KZ - lo_z


@gluon.jit
def _dq_add(run, coords, buf):
    """TMA reduce-add of a staged share into the fp32 accumulator (cp.reduce.async.bulk.tensor .add: UTMAREDG);
    its completion is tracked like a TMA store's (``tma.store_wait``, ``_dq_release``)."""
    fence_async_shared()
    tma.async_atomic_add(run.desc_dq, coords, block_view(buf, run.desc_dq))


@gluon.jit
def _dq_release(run, held):
    """DETERMINISTIC: wait until this warpgroup's bulk copies have completed (written, not only read:
    ``tma.store_wait`` waits for reads), then count the add under lock ``held`` (nothing when -1)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    lanes = gl.arange(0, 32 * gl.num_warps(), layout)
    # Every thread waits for its own bulk groups (the issuing thread's are the ones that count); the sum
    # makes the lock's update depend on all of them.
    waited = gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tmov.b32 $0, $1;", "=r,r", [lanes * 0],
                                       dtype=gl.int32, is_pure=False, pack=1)
    one = 1 + gl.sum(waited, axis=0)
    counter = gl.where(held >= 0, 0, -1)  # the lane that counts it (-1: none)
    gl.atomic_add(run.dq_locks + gl.maximum(held, 0) + lanes * 0, lanes * 0 + one, mask=lanes == counter,
                  sem="release", scope="gpu")


@gluon.jit
def _store_kv(cfg, me, u, x, desc, ptr):
    """This warpgroup's 64 rows of dK or dV (its head dims from ``u.col0``): staged in its dQ buffer (the last
    dQ add has read it) and TMA-stored, dense rows past N_KV clipped by the descriptor. A packed sequence's
    last keys, which the descriptor would not clip at the next sequence, go out as masked stores from the
    registers. (Stored from the registers everywhere, the 16-bit scalar stores took microseconds per unit.)"""
    if cfg.VARLEN and u.key0 + x.shape[0] > u.w.n_k:
        store_rows(x.to(cfg.dtype), ptr, desc, u.w.z, u.w.hk, u.w.k_base, u.key0, u.w.n_k, u.col0, cfg.PADDED)
    else:
        tma.store_wait(0)
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([x.shape[0], x.shape[1]], cfg.dtype)
        tile = me.dq_buf.reinterpret(cfg.dtype, [x.shape[0], x.shape[1]], layout)
        tile.store(x.to(cfg.dtype))
        fence_async_shared()
        if cfg.NA_DIMS >= 2:
            coords = _key_half_coords(cfg, u.w, u.walk, me.WG)
        else:
            coords = [u.w.z, u.w.hk, u.w.k_base + u.key0, u.col0]
        tma.async_store(desc, coords, block_view(tile, desc))


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------
SM90_SMEM_BYTES = 232448


@dataclass(frozen=True)
class HopperBwdConfig:
    """The sm_90a backward's knobs. BLOCK_M: queries per block (D=128: 64, dQ^T split by head dim; D=64:
    128, dQ split by queries); Q_STAGES: depth of the Q/dO ring; S_AHEAD: the next query block's S^T wgmma
    issued while this block's dQ share is added (D=64/128); DQ_FIRST: dQ's wgmma issued before dK's, and its share
    staged and added while dK runs (D=64/128, not with S_AHEAD); DQ_FRAG: dQ's shares staged, and accumulated, in
    the order the wgmma registers hold them (D=64/128; packed sequences and the deterministic mode keep [rows, D]);
    LOADER_WARPS: the TMA loader as a 1-warp worker partition, or (4) as the 4-warp default partition."""
    BLOCK_M: int = 64
    Q_STAGES: int = 2
    S_AHEAD: bool = False
    DQ_FIRST: bool = False
    DQ_FRAG: bool = False
    LOADER_WARPS: int = 1

    def smem_bytes(self, head_dim: int) -> int:
        wide = head_dim == WIDE_HEAD_DIM
        kv = 2 * block_n(head_dim) * head_dim * 2
        qdo = 2 * self.Q_STAGES * self.BLOCK_M * head_dim * 2
        ds = 2 * BLOCK_N * self.BLOCK_M * 2  # (dS^T, two slots; D=256: dS^T and P^T, 64 keys)
        dq = 2 * KEYS_PER_WARPGROUP * (64 if wide else self.BLOCK_M if head_dim == 128 else head_dim) * 4
        rows = 2 * self.Q_STAGES * self.BLOCK_M * 4  # (lse and delta)
        return kv + qdo + ds + dq + rows + 8 * (2 + 2 * self.Q_STAGES + 2) + 16

    def invalid_reasons(self, head_dim: int, dtype: str) -> list[str]:
        reasons = []
        if dtype not in DTYPES:
            reasons.append(f"dtype {dtype} not supported by the backward (supported: {', '.join(DTYPES)})")
        if head_dim not in HEAD_DIMS:
            reasons.append(f"head dim {head_dim} not supported by the backward "
                           f"(supported: {', '.join(map(str, HEAD_DIMS))})")
            return reasons
        head_dim = kernel_head_dim(head_dim)
        want = 128 if head_dim == 64 else 64
        if self.BLOCK_M != want:
            reasons.append(f"BLOCK_M {self.BLOCK_M}: D={head_dim} takes {want} (the dQ split)")
        if self.Q_STAGES < 1:
            reasons.append("Q_STAGES must be >= 1")
        if self.LOADER_WARPS not in (1, 4):
            reasons.append(f"LOADER_WARPS {self.LOADER_WARPS} not in (1, 4)")
        if self.S_AHEAD and head_dim == WIDE_HEAD_DIM:
            reasons.append(f"S_AHEAD: D={WIDE_HEAD_DIM}'s block loop has no early S^T (supported: D 64, 128)")
        if self.DQ_FRAG and head_dim == WIDE_HEAD_DIM:
            reasons.append(f"DQ_FRAG: D={WIDE_HEAD_DIM} adds [64, 64] chunks of its own (supported: D 64, 128)")
        if self.DQ_FIRST and (head_dim == WIDE_HEAD_DIM or self.S_AHEAD):
            reasons.append(f"DQ_FIRST: D 64 and 128, without S_AHEAD (D={WIDE_HEAD_DIM} issues its own order; with "
                           f"S_AHEAD it measured 0.90-0.99x of DQ_FIRST alone)")
        smem = self.smem_bytes(head_dim)
        if smem + 512 > SM90_SMEM_BYTES:
            reasons.append(f"shared memory: {smem} B + 512 B of alignment > {SM90_SMEM_BYTES} B")
        return reasons

    def label(self) -> str:
        return (f"bwd_BM{self.BLOCK_M}_Q{self.Q_STAGES}" + ("_SA" if self.S_AHEAD else "")
                + ("_QF" if self.DQ_FIRST else "") + ("_FR" if self.DQ_FRAG else "")
                + ("_L4" if self.LOADER_WARPS == 4 else ""))

    def describe(self) -> dict:
        return {"config": self.label(), "block_m": self.BLOCK_M, "block_n": f"{BLOCK_N} ({WIDE_BLOCK_N} at D=256)",
                "stages": self.Q_STAGES, "s_ahead": self.S_AHEAD, "dq_first": self.DQ_FIRST, "dq_frag": self.DQ_FRAG,
                "partitions": f"loader ({self.LOADER_WARPS} warp{'s' if self.LOADER_WARPS > 1 else ''}) + 2 consumer WGs",
                "regs": int(CONSUMER_REGS), "dq": "dQ^T by head dim" if self.BLOCK_M == 64 else "dQ by queries",
                "units": "dynamic"}


def config_space():
    for block_m, stages, ahead, first, frag, loader in itertools.product((64, 128), (1, 2, 3), (False, True),
                                                                          (False, True), (False, True), (1, 4)):
        yield HopperBwdConfig(BLOCK_M=block_m, Q_STAGES=stages, S_AHEAD=ahead, DQ_FIRST=first, DQ_FRAG=frag,
                              LOADER_WARPS=loader)


@class_cached
def default_config(head_dim: int, dtype: str = "fp16", causal=None, n_ctx: int = 8192) -> HopperBwdConfig:
    """The tuning table's backward entry for the class (``optimize --pass bwd``), else the rule: the
    query block the head dim's dQ split takes, a two-deep Q/dO ring (D=256: one, for shared memory), the
    early S^T for D=64 causal, the one class where it gained (NOTES v39), dQ's wgmma before dK's for D=128, where it
    gained (NOTES v44), and dQ staged in fragment order (NOTES v45, v54); the loader as one warp but for D=64
    non-causal, where ptxas then spilled in the block loop (NOTES v49). A padded head dim without an entry of its
    own takes its kernel's (``hopper.kernel_head_dim``)."""
    from . import tuning

    if causal is not None:
        for d in dict.fromkeys((head_dim, kernel_head_dim(head_dim))):
            entry = tuning.lookup("sm_90a", d, dtype, causal, n_ctx, pass_name="bwd")
            if entry is not None:
                cfg = HopperBwdConfig(**entry)
                if not cfg.invalid_reasons(head_dim, dtype):
                    return cfg
    head_dim = kernel_head_dim(head_dim)
    return HopperBwdConfig(BLOCK_M=128 if head_dim == 64 else 64, Q_STAGES=1 if head_dim == WIDE_HEAD_DIM else 2,
                           S_AHEAD=head_dim == 64 and bool(causal), DQ_FIRST=head_dim == 128,
                           DQ_FRAG=head_dim in (64, 128),
                           LOADER_WARPS=4 if head_dim == 64 and not causal else 1)


def in_focused_space(cfg: HopperBwdConfig) -> bool:
    return True


def _reduce_dims(D: int, d_qk: int, d_v: int) -> tuple[int, int]:
    """The QK_DIM and V_DIM constexprs of a launch in the D kernel: q's and k's head dim and v's where below D, else 0
    (the kernel's own). D=32 keeps the D=64 kernel's: in two k-steps its causal block loop spilled 52 instructions
    where the kernel's four spill 24."""
    return tuple(d if D > d >= 64 else 0 for d in (d_qk, d_v))


def dq_frag(cfg: HopperBwdConfig, varlen: bool, deterministic: bool) -> bool:
    """Whether a launch keeps dQ's accumulator in fragment order (``_dq_reduce``): the config asks for it and the
    launch is dense and not deterministic (packed sequences and the deterministic mode keep [rows, D])."""
    return cfg.DQ_FRAG and not varlen and not deterministic


def kernel_constexprs(cfg: HopperBwdConfig, causal: bool, varlen: bool, name: str,
                      deterministic: bool = False, padded: bool = False, window: int = 0, qk_dim: int = 0,
                      v_dim: int = 0) -> dict:
    """``qk_dim``, ``v_dim``: q's and k's, and v's, head dims where the kernel's is larger, else 0."""
    return dict(BLOCK_M=cfg.BLOCK_M, Q_STAGES=cfg.Q_STAGES, S_AHEAD=cfg.S_AHEAD, DQ_FIRST=cfg.DQ_FIRST,
                DQ_FRAG=dq_frag(cfg, varlen, deterministic), CAUSAL=bool(causal),
                VARLEN=bool(varlen), DETERMINISTIC=bool(deterministic), LOADER_WARPS=cfg.LOADER_WARPS,
                KERNEL_NAME=name, PADDED=bool(padded), WINDOW=int(window), QK_DIM=int(qk_dim), V_DIM=int(v_dim))


FRAGMENT_BLOCK = [128, 32]  # DQ_FRAG: one warpgroup's [64, 64] share as a block of the [chunks * 128, 32] accumulator


def block_shapes(head_dim: int, cfg: HopperBwdConfig, frag: bool = False) -> dict:
    q = [1, 1, cfg.BLOCK_M, head_dim]
    kv = [1, 1, KEYS_PER_WARPGROUP, head_dim]
    # (DQ_T and D=256: 64 queries x 64 head dims; else 64 queries x D = 64; DQ_FRAG: a share in fragment order)
    dq = FRAGMENT_BLOCK if frag else [1, 64, 64]
    dkv = [1, 1, KEYS_PER_WARPGROUP, head_dim // 2 if head_dim == WIDE_HEAD_DIM else head_dim]  # (a warpgroup's)
    return {"desc_q": q, "desc_k": kv, "desc_v": kv, "desc_do": q, "desc_dq": dq, "desc_dk": dkv, "desc_dv": dkv}


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
    cfg = config or default_config(D_real, dtype_name(q.dtype), bool(causal), max(N_Q, N_KV))
    bad = cfg.invalid_reasons(D_real, dtype_name(q.dtype))
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
        table = torch.cat([varlen.table(H_KV, block_n(D), causal, by_keys=True), dq_rows])
        grid = sm_count(dev)
        # (a bound of the padded total without a host sync; whole blocks keep TMA's 16-byte row strides)
        rows = (triton.cdiv(N_Q, cfg.BLOCK_M) + varlen.n_seqs) * cfg.BLOCK_M
    else:
        table = window_table(dev, int(window[0]), int(window[1])) if mode else placeholder(dev, torch.int32)
        grid, rows = _dense_grid(Z, H_KV, N_Q, N_KV, D, cfg, sm_count(dev))
    group_hz = _group_hz(Z, H_KV, N_KV, D, grid, causal, deterministic)
    locks = (torch.zeros(Z * H * (rows // cfg.BLOCK_M), dtype=torch.int32, device=dev) if deterministic
             else placeholder(dev, torch.int32))
    dq_acc = torch.zeros((Z, H, rows, D), dtype=torch.float32, device=dev)
    consts, key = _launch_consts(cfg, q, v, D, causal, varlen is not None, kernel_name, deterministic, mode)
    frag = consts["DQ_FRAG"]
    blocks = block_shapes(D, cfg, frag)
    # (DQ_FRAG: the same memory as [chunks * 128, 32], each query block of a head two chunks in fragment order)
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


def _dense_grid(Z: int, H_KV: int, N_Q: int, N_KV: int, D: int, cfg: HopperBwdConfig, sms: int) -> tuple[int, int]:
    """(programs, dQ accumulator rows per head) of a launch that is not packed: a program per key block up to the
    SM count; the query rows padded to whole query blocks."""
    return max(1, min(sms, Z * H_KV * triton.cdiv(N_KV, block_n(D)))), triton.cdiv(N_Q, cfg.BLOCK_M) * cfg.BLOCK_M


def _group_hz(Z: int, H_KV: int, N_KV: int, D: int, grid: int, causal: bool, deterministic: bool) -> int:
    """Dense units go in chunks of this many heads, key blocks outermost inside: about one wave, so the units
    running at once share their heads' Q, dO and dQ rows in L2. Deterministic and causal: eight waves, so
    that only about an eighth of a wave are one head's key blocks, which wait on each other's dQ adds
    (non-causal units are all as long: after the first wave they come free, and start, already staggered;
    eight waves there cost L2 hits: NOTES v37).
    Packed sequences: key blocks outermost, K/V heads inside (``KeyShape.work``)."""
    waves = 8 if deterministic and causal else 1
    return max(1, min(Z * H_KV, waves * grid // triton.cdiv(N_KV, block_n(D))))


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
        if not all(tma_aligned(meta_like(t)) for t in (q, k, v, do)) or o.stride(-1) != 1 or do.stride(-1) != 1 \
                or not lse.is_contiguous() or (grad_lse is not None and not grad_lse.is_contiguous()):
            return None
        cfg = default_config(D_real, dtype_name(q.dtype), causal, max(N_Q, N_KV))
        D = kernel_head_dim(D_real)
        grid, rows = _dense_grid(Z, H_KV, N_Q, N_KV, D, cfg, sm_count(dev))
        group_hz = _group_hz(Z, H_KV, N_KV, D, grid, causal, deterministic)
        consts, key = _launch_consts(cfg, q, v, D, causal, False, kernel_name, deterministic, 0)
        main = compiled(hopper_attention_bwd_kernel, key, dev)
        if main is None or not main.usable:
            return None
        self = _PreparedBwd()
        self.index, self.device = device_index(dev), dev
        self.dq_layout = layout(torch.empty_like(meta_like(q)))
        dk, dv = torch.empty_like(meta_like(k)), torch.empty_like(meta_like(v))
        if not (tma_aligned(dk) and tma_aligned(dv)):
            dk, dv = torch.empty(k.shape, dtype=k.dtype, device="meta"), torch.empty(v.shape, dtype=v.dtype, device="meta")
        self.dk_layout, self.dv_layout = layout(dk), layout(dv)
        # The workspace, fp32 words at 128-byte aligned byte offsets: dQ's accumulator, the counter, the locks,
        # delta and the log2 lse (the stream's scratch memory; the preprocess zeroes the words before delta: the
        # accumulator, the counter and the locks must start at 0).
        acc_words = Z * H * rows * D
        locks_words = Z * H * (rows // cfg.BLOCK_M) if deterministic else 0
        (_, self.counter, self.locks, self.delta, self.lse2), nbytes = aligned_offsets(
            [4 * n for n in (acc_words, 1, locks_words, Z * H * N_Q, Z * H * N_Q)])
        self.words = nbytes // 4
        frag = consts["DQ_FRAG"]
        blocks = block_shapes(D, cfg, frag)
        acc_view = ([acc_words // FRAGMENT_BLOCK[1], FRAGMENT_BLOCK[1]], [FRAGMENT_BLOCK[1], 1]) if frag else \
            ([Z * H, rows, D], [rows * D, D, 1])
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
        self.post = fragments_launch((Z, H, rows, D), torch.empty_strided(*self.dq_layout[:2], dtype=q.dtype,
                                                                          device=dev), cfg.BLOCK_M, cast_scale) \
            if frag else None
        if frag and self.post is None or self.pre is None:
            return None
        # (not fragments: dQ = the accumulator's first N_Q rows and D_real columns, scaled)
        self.acc_rows = ((Z, H, N_Q, D_real), (H * rows * D, rows * D, D, 1))
        self.cast_scale = cast_scale
        return self

    def __call__(self, do, q, k, v, o, lse, grad_lse):
        from .launch import hooks_active, scratch

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


BOX_HEAD_DIMS = (32, 64, 96, 128)  # 2-D/3-D windows: the forward's (``hopper.WINDOW_BOX_HEAD_DIMS``)


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
    A unit is a key box, walking the query boxes whose windows reach it (``BoxWalk``); the lse, delta and dQ's fp32
    accumulator are laid out box after box (``box_rows``), so the dense kernel's dQ reduce-adds serve unchanged, and
    dQ comes back to the grid in the cast (``rows_to_grid``). ``deterministic``: dQ's adds into each query box in
    the order of the key boxes that reach it (``_box_turn``). Returns (dq, dk, dv)."""
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
          deterministic: bool = False, window: int = 0, boxes=None):
    """The compile-only build of one specialization (``inspect --pass bwd``, the compile tests; ``window``: the
    neighborhood mode, 1 non-causal, 2 causal windows, 4-15 2-D/3-D ones over ``boxes``, (query box, key box))."""
    from ..problem import dtype_from_name
    from .build import KernelBuild
    from .common import descriptor_signature, sig_dtype

    in_dtype = dtype_from_name(dtype)
    padded = kernel_head_dim(head_dim) != head_dim
    if boxes is not None:  # (as ``hopper_na_boxes_bwd`` launches them)
        cfg = dataclasses.replace(cfg, S_AHEAD=False, DQ_FRAG=False)
    constexprs = kernel_constexprs(cfg, causal, varlen, name, deterministic, padded, window,
                                   *_reduce_dims(kernel_head_dim(head_dim), head_dim, head_dim))
    frag = constexprs["DQ_FRAG"]  # (as the launch reads it)
    cfg = dataclasses.replace(cfg, DQ_FRAG=frag)  # (the description's label: the config as launched)
    shapes = (box_block_shapes(kernel_head_dim(head_dim), boxes) if boxes is not None
              else block_shapes(kernel_head_dim(head_dim), cfg, frag))
    descs = {n: descriptor_signature(torch.float32 if n == "desc_dq" else in_dtype, block)
             for n, block in shapes.items()}
    ptrs = {"dk_ptr": "*" + sig_dtype(in_dtype), "dv_ptr": "*" + sig_dtype(in_dtype)}
    sig = {**descs, **ptrs, **RUNTIME_SIGNATURE, **{k: "constexpr" for k in constexprs}}
    return KernelBuild(fn=hopper_attention_bwd_kernel, signature=sig, constexprs=constexprs, num_warps=NUM_WARPS,
                       name=name, description=f"Hopper attention backward {dtype} D={head_dim}"
                                              f"{f' (the D={kernel_head_dim(head_dim)} kernel)' if padded else ''}"
                                              f" causal={causal}"
                                              f"{' varlen' if varlen else ''}"
                                              f"{' deterministic' if deterministic else ''}"
                                              f"{window_label(window, boxes)}{cfg.label()}")
