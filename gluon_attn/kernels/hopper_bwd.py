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
(``_bwd_blocks_wide``); the 192/128 pair (q/k 192, v 128) in its own units of the same buffers: 32-query blocks
against 128 keys split by keys as D=128's, dQ^T in 64-head-dim chunks (``_bwd_blocks_pair``). DETERMINISTIC: dQ's
adds in key-block order (``_dq_reduce``). At a unit's end each warpgroup stages its dK, then its dV, in its dQ
buffer and TMA-stores them (``_store_kv``). S_AHEAD: the next block's S^T runs under this block's dQ add; DQ_FIRST:
dK's wgmma does (FA3/FA4's order). LSE_TOP (D=128 dense): consumer 1 reads the lse before its S^T issue, consumer 0
after its S^T wait, which keeps consumer 1 ahead (``_bwd_blocks``). DS_FIRST (all but D=64 non-causal): a
warpgroup's dS^T half is stored before its dV wgmma is issued, so the stores do not queue behind that wgmma's operand
reads. MASK_BY_ROW (D=64 causal): the diagonal blocks' mask is one bound per key row.

WINDOW (neighborhood attention): 1-D windows along the rows (a unit's query blocks from binary searches over the
windows, ``_window_work``); 2-D/3-D windows with units of key boxes walking query boxes (``masks.BoxWalk``,
``hopper_bwd_host.hopper_na_boxes_bwd``: the lse, delta and dQ accumulator laid out box after box, so the dQ adds
are the dense ones).

Partitions: a TMA warp (the unit's K and V halves once; Q and dO blocks through a Q_STAGES ring; units
from a global counter, the unit number published beside K/V) and two consumer warpgroups, 240 registers
each (``BwdConsumer``: a warpgroup's buffers; ``BwdUnit``: its part of a unit, with its keys' ``masks.TileMask``;
``BwdLoop``: its state across the unit's query blocks). Units (``schedule.KeyShape``) go in chunks of heads (about
one wave), key blocks outermost inside a chunk: the programs running at once read the same Q and dO blocks from L2,
and (causal) the longest units come first.

This module is the device code only (the @gluon.jit functions, aggregates, constexpr helpers and the constants they
read); its host side (``HopperBwdConfig``, the tuning lookups, the launches, the compile-only ``build``) is
``hopper_bwd_host.py``, which imports this module.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon import aggregate

from .channels import RingIndex, Signal, block_cols, block_view, constexpr_value as _value, opaque, store_rows
from .hopper import reduce_d
from .masks import (BoxKeys, BoxWalk, TileMask, box_dims, window_bounds, window_boxes_load, window_dims,
                    window_query_blocks, window_query_bounds, window_words)
from .naming import kernel_symbol
from .schedule import KeyShape, KeyWork, publish_unit, read_unit, slot_words_alloc

KEYS_PER_WARPGROUP = 64
BLOCK_N = 2 * KEYS_PER_WARPGROUP  # keys per unit: two consumer warpgroups
WIDE_HEAD_DIM = 256  # D=256: a unit is 64 keys, the warpgroups split queries and head dims (``_bwd_blocks_wide``)
WIDE_BLOCK_N = KEYS_PER_WARPGROUP
# The 192/128 pair in its own units (``_bwd_blocks_pair``): the D=256 kernel's buffers with 32-query blocks, 128-key
# units split by keys as D=128's, dK in a 128- and a 64-column accumulator.
PAIR_BLOCK_M = 32
LOADER_REGS = gl.constexpr(24)  # the TMA warp only computes coordinates
CONSUMER_REGS = gl.constexpr(240)


@gluon.constexpr_function
def dq_scaled_in_loop(head_dim, causal) -> bool:
    """Whether a block loop multiplies its dQ share by the scale before staging it (32 FMUL per thread per block),
    or the accumulator stays unscaled and the host's cast scales it: out of the loop everywhere but D=128 causal,
    whose eight STS.128 then go back to back and which ran slower without the multiplies (NOTES v54, v93). (The
    192/128 pair's causal units in fragment order ran 3-4.5% slower with them: NOTES v113.)"""
    return head_dim == 2 * KEYS_PER_WARPGROUP and bool(causal)


@gluon.constexpr_function
def _wgmma_layout(n):
    """A 16-bit wgmma accumulator of one warpgroup: 64 rows, N = ``n`` columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def wide_share(qk_dim, v_dim, wg, grad):
    """WIDE: warpgroup ``wg``'s share of a gradient's head dims, (first, count): of dV's and dK's columns, or of dQ's
    64-column chunks (``grad`` "dq"). D=256 halves each. Below it (q/k 192, v 192 or the 192/128 pair) the shares
    skip the padded columns and balance the two warpgroups' MMA work: warpgroup 0 dV's first 128 columns, dK's last
    64 and dQ's first chunk, warpgroup 1 dV's columns past 128 (none for the pair), dK's first 128 and dQ's other
    two chunks (the pair: 256 head dims of dV, dK and dQ a warpgroup, against 384 and 128 over D=256's halves)."""
    qk_dim, v_dim, wg = _value(qk_dim), _value(v_dim), _value(wg)
    if qk_dim == WIDE_HEAD_DIM:
        return {"dv": (wg * 128, 128), "dk": (wg * 128, 128), "dq": (wg * 2, 2)}[grad]
    assert qk_dim == 192 and v_dim in (128, 192), f"no wide share for q/k {qk_dim}, v {v_dim}"
    if wg == 0:
        return {"dv": (0, 128), "dk": (128, qk_dim - 128), "dq": (0, 1)}[grad]
    return {"dv": (128, v_dim - 128), "dk": (0, 128), "dq": (1, qk_dim // 64 - 1)}[grad]


@gluon.constexpr_function
def pair_units(head_dim, block_m):
    """Whether a D=256 launch runs the 192/128 pair in its own units (``_bwd_blocks_pair``): 32-query blocks."""
    return _value(head_dim) == WIDE_HEAD_DIM and _value(block_m) == PAIR_BLOCK_M


@gluon.constexpr_function
def grad_share(wide, kv_cols, qk_dim, v_dim, wg, grad):
    """Warpgroup ``wg``'s (first column, count) of dK's or dV's head dims: ``wide_share``, else all of them."""
    return wide_share(qk_dim, v_dim, wg, grad) if _value(wide) else (0, _value(kv_cols))


@gluon.jit
def _grad_zeros(cfg, WG: gl.constexpr, grad: gl.constexpr):
    """Warpgroup WG's dK or dV accumulator, zero: [64 keys, its head dims] (a share of none, WIDE's dV of the 192/128
    pair in warpgroup 1, holds 8 columns it never adds to)."""
    n: gl.constexpr = max(grad_share(cfg.WIDE, cfg.KV_COLS, cfg.QK_DIM, cfg.V_DIM, WG, grad)[1], 8)
    return gl.zeros([cfg.HALF, n], gl.float32, _wgmma_layout(n))


@aggregate
class BwdCfg:
    dtype: gl.constexpr
    HEAD_DIM: gl.constexpr
    BLOCK_M: gl.constexpr  # queries per block
    HALF: gl.constexpr  # keys per consumer warpgroup (WIDE: keys per unit, shared by both)
    WIDE: gl.constexpr  # D=256 (not PAIR)
    PAIR: gl.constexpr  # the 192/128 pair in its own units: 32-query blocks, 128 keys split by keys (``pair_units``)
    V_SPLIT: gl.constexpr  # D=96 in the D=128 kernel: dK and dV as [64, 64] + [64, 32] accumulators (``dk2``, ``dv2``)
    BLOCK_N: gl.constexpr  # keys per unit
    KV_PARTS: gl.constexpr  # [HALF, D] parts of a unit's K and V
    DQ_ADDS: gl.constexpr  # dQ reduce-adds per query block per unit (DETERMINISTIC's turn)
    KV_COLS: gl.constexpr  # head dims of a warpgroup's dK and dV (WIDE: D=256's halves; a share, ``wide_share``)
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
    PADDED: gl.constexpr  # tensors' head dim below HEAD_DIM (``hopper_host.kernel_head_dim``): stores clip columns
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
    kv_layout: gl.constexpr  # dK, dV: [64 keys, D] (WIDE: [64 keys, D / 2]; the accumulators ``_grad_zeros``)
    a_layout: gl.constexpr  # P^T, dS^T as the A operand of the dV and dK wgmmas
    dq_layout: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, dtype, HEAD_DIM, BLOCK_M, Q_STAGES, S_AHEAD, DQ_FIRST, DQ_FRAG, CAUSAL, VARLEN,
                 DETERMINISTIC, PADDED=False, WINDOW=0, q_block=(), k_block=(), QK_DIM=0, V_DIM=0, V_SPLIT=False):
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
        pair = pair_units(HEAD_DIM, BLOCK_M)
        wide = HEAD_DIM == WIDE_HEAD_DIM and not pair
        self.WIDE = gl.constexpr(wide)
        self.PAIR = gl.constexpr(pair)
        split = V_SPLIT and HEAD_DIM == 2 * KEYS_PER_WARPGROUP and self.QK_DIM.value == 96 and self.V_DIM.value == 96
        self.V_SPLIT = gl.constexpr(split)
        self.BLOCK_N = gl.constexpr(WIDE_BLOCK_N if wide else BLOCK_N)
        self.KV_PARTS = gl.constexpr(1 if wide else 2)
        # (WIDE: dQ's 64-column chunks; PAIR: two a warpgroup, ``_bwd_blocks_pair``)
        self.DQ_ADDS = gl.constexpr(self.QK_DIM.value // 64 if wide else 4 if pair else 2)
        # (PAIR: dV's and dK's first 128; dK's last 64 a second accumulator. V_SPLIT: the first 64; the last 32 of 96)
        self.KV_COLS = gl.constexpr(HEAD_DIM // 2 if wide or pair or split else HEAD_DIM)
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
        self.dq_layout = gl.constexpr(self.s_layout.value if (self.DQ_T.value or wide or pair) else
                                      self.kv_layout.value)


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
    shared by both warpgroups), the first head dim of its dK and of its dV (WIDE: of its share, ``wide_share``) and
    its keys' mask (``masks.TileMask`` of S^T; 2-D/3-D windows: with the unit's walk over query boxes,
    ``masks.BoxWalk``)."""
    w: KeyWork
    key0: gl.tensor
    dk_col0: gl.constexpr
    dv_col0: gl.constexpr
    mask: TileMask


@aggregate
class BwdLoop:
    """A consumer warpgroup's state across a unit's query blocks: the Q/dO ring's and the dS^T slots' positions,
    its dK and dV accumulators, and (DETERMINISTIC) the dQ lock whose add is still in flight (-1: none); PAIR: dK's
    last 64 head dims (``dk2``; else a scalar the loops pass on); V_SPLIT: dK's and dV's last 32 (``dk2``, ``dv2``)."""
    q_it: RingIndex
    ds_it: RingIndex
    dk: gl.tensor
    dv: gl.tensor
    held: gl.tensor
    dk2: gl.tensor
    dv2: gl.tensor


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
                                V_DIM: gl.constexpr = 0, V_SPLIT: gl.constexpr = False):
    # (WINDOW: neighborhood attention over the rows of dense self-attention, its kernel size and stride the two
    # int32 words at seq_ptr, as in the forward; ``masks.window_query_blocks``)
    cfg = BwdCfg(desc_q.dtype, block_cols(desc_q.block_type.shape), BLOCK_M, Q_STAGES, S_AHEAD, DQ_FIRST, DQ_FRAG,
                 CAUSAL, VARLEN, DETERMINISTIC, PADDED, WINDOW, desc_q.block_type.shape, desc_k.block_type.shape,
                 QK_DIM, V_DIM, V_SPLIT)
    shape = KeyShape(N_Q, N_KV, Z, H, H_KV, H // H_KV, seq_ptr, n_seqs, group_hz, BLOCK_M, cfg.BLOCK_N, CAUSAL,
                     VARLEN, DETERMINISTIC)
    run = BwdRun(shape, qk_scale, sm_scale, lse_ptr, delta_ptr, desc_dq, desc_dk, desc_dv, dk_ptr, dv_ptr,
                 dq_locks, locks_per_head)
    q_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_M, cfg.HEAD_DIM], cfg.dtype)
    k_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.HALF, cfg.HEAD_DIM], cfg.dtype)
    ds_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.HALF, cfg.BLOCK_M], cfg.dtype)
    # V and dO as wide as their descriptors' blocks: the kernel's head dim, or (the 192/128 pair in the D=256
    # kernel) v's 128 columns, whose saving makes room for a second Q/dO stage.
    V_COLS: gl.constexpr = block_cols(desc_v.block_type.shape)
    v_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.HALF, V_COLS], cfg.dtype)
    do_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_M, V_COLS], cfg.dtype)

    kv = KVHalves(gl.allocate_shared_memory(cfg.dtype, [cfg.KV_PARTS, cfg.HALF, cfg.HEAD_DIM], k_smem),
                  gl.allocate_shared_memory(cfg.dtype, [cfg.KV_PARTS, cfg.HALF, V_COLS], v_smem),
                  slot_words_alloc(1), Signal.alloc(1, 2))
    rows_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    qd = QdO(gl.allocate_shared_memory(cfg.dtype, [cfg.Q_STAGES, cfg.BLOCK_M, cfg.HEAD_DIM], q_smem),
             gl.allocate_shared_memory(cfg.dtype, [cfg.Q_STAGES, cfg.BLOCK_M, V_COLS], do_smem),
             gl.allocate_shared_memory(gl.float32, [cfg.Q_STAGES, cfg.BLOCK_M], rows_smem),
             gl.allocate_shared_memory(gl.float32, [cfg.Q_STAGES, cfg.BLOCK_M], rows_smem),
             Signal.alloc(cfg.Q_STAGES, 2))
    ds_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ds_bars.index(i), count=2)
    # Each warpgroup's dQ share stages here for its TMA reduce-add into the fp32 accumulator.
    dq_shape: gl.constexpr = [cfg.HALF, 64]  # (16 KB: a [64, 64] fp32 share; DQ_FRAG views it as its [128, 32] block)
    if cfg.PAIR:
        # (a warpgroup's two [32 queries, 64 head dims] shares, each a whole tile of the descriptor's swizzle: rows of
        # one [64, 64] tile are not contiguous in its 128-byte swizzle)
        share: gl.constexpr = [cfg.BLOCK_M, 64]
        pair_bufs = gl.allocate_shared_memory(gl.float32, [4] + share,
                                              gl.NVMMASharedLayout.get_default_for(share, gl.float32))
        dq0 = pair_bufs.slice(0, 2, dim=0)
        dq1 = pair_bufs.slice(2, 2, dim=0)
    else:
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2] + dq_shape,
                                            gl.NVMMASharedLayout.get_default_for(dq_shape, gl.float32))
        dq0 = dq_bufs.index(0)
        dq1 = dq_bufs.index(1)
    if cfg.WIDE:
        # Each warpgroup's half of the queries: its dS^T and P^T [64 keys, BLOCK_M / 2], two slots.
        x_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.HALF, cfg.BLOCK_M // 2], cfg.dtype)
        ds = DsBufs(gl.allocate_shared_memory(cfg.dtype, [4, cfg.HALF, cfg.BLOCK_M // 2], x_smem), ds_bars)
        ps = gl.allocate_shared_memory(cfg.dtype, [4, cfg.HALF, cfg.BLOCK_M // 2], x_smem)
    else:
        ds = DsBufs(gl.allocate_shared_memory(cfg.dtype, [4, cfg.HALF, cfg.BLOCK_M], ds_smem), ds_bars)
        ps = ds.mem  # (unused: the P^T halves stay in registers)
    fence_async_shared()
    c0 = BwdConsumer(kv, qd, ds, ps, dq0, 0)
    c1 = BwdConsumer(kv, qd, ds, ps, dq1, 1)
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
        mbarrier.expect(bar, cfg.KV_PARTS * (desc_k.block_type.nbytes + desc_v.block_type.nbytes))
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
    mbarrier.expect(bar, desc_q.block_type.nbytes + desc_do.block_type.nbytes)
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
        u = _unit(cfg, run, w, me.WG)
        if cfg.PAIR or cfg.V_SPLIT:
            dk2 = gl.zeros([cfg.HALF, cfg.QK_DIM - cfg.KV_COLS], gl.float32, _wgmma_layout(cfg.QK_DIM - cfg.KV_COLS))
        else:
            dk2 = gl.to_tensor(0.0)
        if cfg.V_SPLIT:
            dv2 = gl.zeros([cfg.HALF, cfg.V_DIM - cfg.KV_COLS], gl.float32, _wgmma_layout(cfg.V_DIM - cfg.KV_COLS))
        else:
            dv2 = gl.to_tensor(0.0)
        st = BwdLoop(q_it, ds_it, _grad_zeros(cfg, me.WG, "dk"), _grad_zeros(cfg, me.WG, "dv"), gl.to_tensor(-1), dk2,
                     dv2)
        for g in range(shape.G):
            hz = w.z * shape.H + w.hk * shape.G + g
            # The masked query blocks, then the others; DETERMINISTIC the other way round (the loader's order:
            # from the last query block down, see ``_block_at``).
            if cfg.NA_DIMS >= 2:
                # every step of the walk masked or not as its box lies (``BoxWalk.box``)
                st = _blocks(cfg, run, me, u, st, 0, u.mask.walk.n, hz, True)
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
        _store_kv(cfg, me, u, st.dk * run.sm_scale, run.desc_dk, run.dk_ptr, u.dk_col0)
        if cfg.PAIR or cfg.V_SPLIT:
            _store_kv(cfg, me, u, st.dk2 * run.sm_scale, run.desc_dk, run.dk_ptr, cfg.KV_COLS)
        if grad_share(cfg.WIDE, cfg.KV_COLS, cfg.QK_DIM, cfg.V_DIM, me.WG, "dv")[1] > 0:
            _store_kv(cfg, me, u, st.dv, run.desc_dv, run.dv_ptr, u.dv_col0)
        if cfg.V_SPLIT:
            _store_kv(cfg, me, u, st.dv2, run.desc_dv, run.dv_ptr, cfg.KV_COLS)
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
def _unit(cfg, run, w, WG: gl.constexpr):
    """Warpgroup WG's part of unit ``w`` (``BwdUnit``), its keys' mask made once per unit."""
    if cfg.WIDE:
        key0 = w.n0
    else:
        key0 = w.n0 + WG * cfg.HALF
    dk_col0: gl.constexpr = grad_share(cfg.WIDE, cfg.KV_COLS, cfg.QK_DIM, cfg.V_DIM, WG, "dk")[0]
    dv_col0: gl.constexpr = grad_share(cfg.WIDE, cfg.KV_COLS, cfg.QK_DIM, cfg.V_DIM, WG, "dv")[0]
    if cfg.NA_DIMS >= 2:
        mask = _box_mask(cfg, run, w, key0, _box_walk(cfg, run, w), WG)
    elif cfg.WINDOW:
        mask = _window_mask(cfg, run, w, key0)
    else:
        mask = TileMask.keys_dense(key0, w.shift, w.n_k, cfg.CAUSAL, cfg.MASK_BY_ROW)
    return BwdUnit(w, key0, dk_col0, dv_col0, mask)


@gluon.jit
def _window_mask(cfg, run, w, key0):
    """WINDOW: the mask of the keys from key0 by their query ranges (two bounds a row, in S^T's row layout)."""
    keys = key0 + gl.arange(0, cfg.HALF, gl.SliceLayout(1, cfg.s_layout))
    win_k, win_s = window_words(run.shape.seq_ptr)
    q_lo, q_hi = window_query_bounds(keys, w.n_k, win_k, win_s, cfg.WINDOW)
    return TileMask.keys_window(key0, w.shift, w.n_k, q_lo, q_hi, cfg.WINDOW)


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
def _box_mask(cfg, run, w, key0, walk, WG: gl.constexpr):
    """2-D/3-D windows: the mask of warpgroup WG's 64 keys (its half of the key box along x, row-major) along the
    unit's walk: the queries that attend each key per dimension."""
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
    keys = BoxKeys(lo_x, hi_x, lo_y, hi_y, lo_z, hi_z, cfg.TX, cfg.TY, cfg.TZ, cfg.NA_DIMS)
    return TileMask.keys_boxes(key0, w.shift, w.n_k, walk, keys, cfg.WINDOW)


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
    elif cfg.PAIR:
        return _bwd_blocks_pair(cfg, run, me, u, st, lo, hi, dq_row, MASKED)
    else:
        return _bwd_blocks(cfg, run, me, u, st, lo, hi, dq_row, MASKED)


@gluon.jit
def _bwd_blocks_wide(cfg, run, me, u, st, lo, hi, dq_row, MASKED: gl.constexpr):
    """D=256, query blocks [lo, hi) of one query head against the unit's 64 keys. Warpgroup WG computes S^T
    and dP^T for its half of each block's queries ([64 keys, BLOCK_M / 2]: no exchange of fp32 scores),
    shares its P^T and dS^T halves through shared memory, and accumulates its share of the head dims of dK
    and dV and of dQ's 64-column chunks ([64 head dims, queries] each; ``wide_share``: D=256's halves, 128
    accumulator registers as the 128-key units' [64 keys, D=128] pair; q/k 192 the real columns only)."""
    QH: gl.constexpr = cfg.BLOCK_M // 2  # queries per warpgroup (scores)
    DQ_CHUNK: gl.constexpr = 64  # head dims per dQ reduce-add
    WG: gl.constexpr = me.WG
    DV0: gl.constexpr = wide_share(cfg.QK_DIM, cfg.V_DIM, WG, "dv")[0]
    DVN: gl.constexpr = wide_share(cfg.QK_DIM, cfg.V_DIM, WG, "dv")[1]
    DK0: gl.constexpr = wide_share(cfg.QK_DIM, cfg.V_DIM, WG, "dk")[0]
    DKN: gl.constexpr = wide_share(cfg.QK_DIM, cfg.V_DIM, WG, "dk")[1]
    DQ0: gl.constexpr = wide_share(cfg.QK_DIM, cfg.V_DIM, WG, "dq")[0]
    DQN: gl.constexpr = wide_share(cfg.QK_DIM, cfg.V_DIM, WG, "dq")[1]
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
        p, d_s, held = _scores_to_grads(cfg, run, u.mask, s, dp_tok, lse,
                                        me.qd.delta.index(q_it.index).slice(WG * QH, QH), m0 + WG * QH, held, MASKED)
        me.ps.index(ds_it.index * 2 + WG).store(p.to(cfg.dtype))
        me.ds.half(ds_it, WG).store(d_s.to(cfg.dtype))
        me.ds.exchange(ds_it)
        # dV, dK [64 keys, this warpgroup's head dims] over both query halves.
        if DVN > 0:
            dv_tok = warpgroup_mma(me.ps.index(ds_it.index * 2), do.slice(0, QH, dim=0).slice(DV0, DVN, dim=1), dv,
                                   is_async=True)
            dv_tok = warpgroup_mma(me.ps.index(ds_it.index * 2 + 1), do.slice(QH, QH, dim=0).slice(DV0, DVN, dim=1),
                                   dv_tok, is_async=True)
        dk_tok = warpgroup_mma(me.ds.half(ds_it, 0), q.slice(0, QH, dim=0).slice(DK0, DKN, dim=1), dk, is_async=True)
        dk_tok = warpgroup_mma(me.ds.half(ds_it, 1), q.slice(QH, QH, dim=0).slice(DK0, DKN, dim=1), dk_tok,
                               is_async=True)
        # dQ^T [64 head dims, queries] = K^T[those head dims, keys] dS^T[keys, queries], per query half.
        for c in gl.static_range(DQN):
            k_t = k.slice((DQ0 + c) * DQ_CHUNK, DQ_CHUNK, dim=1).permute((1, 0))
            acc = gl.zeros([DQ_CHUNK, QH], gl.float32, cfg.dq_layout)
            t0 = warpgroup_mma(k_t, me.ds.half(ds_it, 0), acc, use_acc=False, is_async=True)
            t1 = warpgroup_mma(k_t, me.ds.half(ds_it, 1), acc, use_acc=False, is_async=True)
            if c == 0:
                if DVN > 0:
                    dv, dk, dq0, dq1 = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, t0, t1])
                else:
                    dk, dq0, dq1 = warpgroup_mma_wait(0, deps=[dk_tok, t0, t1])
                me.qd.sig.release(q_it)
            else:
                dq0, dq1 = warpgroup_mma_wait(0, deps=[t0, t1])
            held = _dq_claim(cfg, run, dq_row, u, m0, held, c == 0)
            me.dq_buf.slice(0, QH, dim=0).permute((1, 0)).store(dq0)
            me.dq_buf.slice(QH, QH, dim=0).permute((1, 0)).store(dq1)
            _dq_add(run, [dq_row, w.dq_base + m0, (DQ0 + c) * DQ_CHUNK], me.dq_buf)
        q_it = q_it.next()
        ds_it = ds_it.next()
    return BwdLoop(q_it, ds_it, dk, dv, held, st.dk2, st.dv2)


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
    # (V_SPLIT, D=96: dK's and dV's head dims 64-95 in accumulators of their own, fed the same A operand; else the
    # scalars the loops pass on)
    dk2, dv2 = st.dk2, st.dv2
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
        mask = u.mask.at(j)  # (before the step's box number: the order the walk's ``box`` computes them in)
        if cfg.NA_DIMS >= 2:
            _, _, _, m, _ = u.mask.walk.box(j, cfg.NA_DIMS)
        else:
            m = _block_at(cfg, j, lo, hi)
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
        p, d_s, held = _scores_to_grads(cfg, run, mask, s, dp_tok, lse, me.qd.delta.index(q_it.index), m0, held,
                                        MASKED)
        p_a = gl.convert_layout(p.to(cfg.dtype), cfg.a_layout)
        if cfg.DS_FIRST:
            # dS^T's half goes to shared memory before dV's wgmma is issued: stored after it, the stores queued behind
            # the operand reads of the wgmma just issued, and the fence that publishes them held up this consumer and
            # the other at the exchange. D=64 non-causal keeps the old order (NOTES v53, v93).
            ds16 = d_s.to(cfg.dtype)
            ds_a = gl.convert_layout(ds16, cfg.a_layout)
            me.ds.half(ds_it, WG).store(ds16)
            if cfg.V_SPLIT:
                dv_tok, dv2_tok = _split_mma(cfg, p_a, do, dv, dv2)
            else:
                dv_tok = warpgroup_mma(p_a, do, dv, is_async=True)
        else:
            if cfg.V_SPLIT:
                dv_tok, dv2_tok = _split_mma(cfg, p_a, do, dv, dv2)
            else:
                dv_tok = warpgroup_mma(p_a, do, dv, is_async=True)
            ds16 = d_s.to(cfg.dtype)
            ds_a = gl.convert_layout(ds16, cfg.a_layout)
        if not cfg.DQ_FIRST:
            if cfg.V_SPLIT:
                dk_tok, dk2_tok = _split_mma(cfg, ds_a, q, dk, dk2)
            else:
                dk_tok = warpgroup_mma(ds_a, q, dk, is_async=True)
        if not cfg.DS_FIRST:
            me.ds.half(ds_it, WG).store(ds16)
        me.ds.exchange(ds_it)
        dq_tok = _dq_mma(cfg, me.kv.k, me.ds.half(ds_it, 0), me.ds.half(ds_it, 1), WG)
        if cfg.DQ_FIRST and cfg.V_SPLIT:
            # (as below, each gradient two wgmma groups: dV's two and dQ's two in flight, then dK's two)
            dv, dv2 = warpgroup_mma_wait(2, deps=[dv_tok, dv2_tok])
            dk_tok, dk2_tok = _split_mma(cfg, ds_a, q, dk, dk2)
            dq = warpgroup_mma_wait(2, deps=[dq_tok])
            held = _dq_claim(cfg, run, dq_row, u, m0, held, True)
            _dq_reduce(cfg, run, me, w, dq, dq_row, m0)
            dk, dk2 = warpgroup_mma_wait(0, deps=[dk_tok, dk2_tok])
            me.qd.sig.release(q_it)
            q_it = q_it.next()
        elif cfg.DQ_FIRST:
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
            if cfg.V_SPLIT:
                dv, dv2, dk, dk2, dq = warpgroup_mma_wait(0, deps=[dv_tok, dv2_tok, dk_tok, dk2_tok, dq_tok])
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
    return BwdLoop(q_it, ds_it, dk, dv, held, dk2, dv2)


@gluon.jit
def _split_mma(cfg, a, b, acc, acc2):
    """V_SPLIT's two wgmmas of one gradient, both async: A times B's first KV_COLS head dims into ``acc`` and its last
    V_DIM - KV_COLS (D=96: 64 + 32) into ``acc2``, fed the same A operand. Returns their two tokens."""
    LO: gl.constexpr = cfg.KV_COLS
    HI_N: gl.constexpr = cfg.V_DIM - cfg.KV_COLS
    a_hi: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_wgmma_layout(HI_N), k_width=2)
    tok = warpgroup_mma(a, b.slice(0, LO, dim=1), acc, is_async=True)
    tok2 = warpgroup_mma(gl.convert_layout(a, a_hi, assert_trivial=True), b.slice(LO, HI_N, dim=1), acc2, is_async=True)
    return tok, tok2


@gluon.jit
def _bwd_blocks_pair(cfg, run, me, u, st, lo, hi, dq_row, MASKED: gl.constexpr):
    """PAIR (q/k 192, v 128 in the D=256 kernel's buffers): 32-query blocks [lo, hi) of one query head against this
    warpgroup's 64 keys of a 128-key unit, as D=128's units split the keys (no exchange of P^T, and dS^T's only for
    dQ). The accumulators: dV [64, 128], dK's first 128 head dims and its last 64 (``st.dk2``), 160 registers a
    thread, which D=128's [64 keys x 64 queries] scores would take past the 240 a consumer has; here S^T and dP^T
    are [64 keys, 32 queries]. dQ^T in 64-head-dim chunks [64, 32 queries], two a warpgroup and block, equal in
    MMA work: chunk WG over the unit's 128 keys (both dS^T halves), and the last chunk over this warpgroup's own 64
    keys (its own half), each staged in a [32, 64] buffer of its own and reduce-added (DQ_ADDS 4 a block and unit);
    DQ_FRAG (non-causal's default) stages each as a [64, 32] chunk in its registers' order (``_fragment_order``).
    The order is FA3/FA4's (DQ_FIRST's at D=128): dV, the dS^T exchange, dQ^T's chunks, then dK's two wgmmas, under
    which dQ's shares are staged and added; the Q/dO slot is released once dK has read Q (NOTES v112)."""
    WG: gl.constexpr = me.WG
    HALF: gl.constexpr = cfg.HALF
    HI: gl.constexpr = cfg.KV_COLS  # (dK's second accumulator's first head dim: 128)
    HI_N: gl.constexpr = cfg.QK_DIM - cfg.KV_COLS
    hi_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_wgmma_layout(HI_N), k_width=2)
    w = u.w
    # (the block loop carries these as values of their own, in this order: the carried values' order reaches ptxas)
    dk, dk2, dv, q_it, ds_it, held = st.dk, st.dk2, st.dv, st.q_it, st.ds_it, st.held
    for j in range(lo, hi):
        kv_slot = opaque(WG)  # (KV_DESC_PER_BLOCK)
        k_me = me.kv.k.index(kv_slot)
        v_me = me.kv.v.index(kv_slot)
        mask = u.mask.at(j)
        m = _block_at(cfg, j, lo, hi)
        m0 = m * cfg.BLOCK_M
        s_tok = _issue_scores(cfg, k_me, me.qd, q_it)
        q = me.qd.q.index(q_it.index)
        do = me.qd.do.index(q_it.index)
        zeros = gl.zeros([HALF, cfg.BLOCK_M], gl.float32, cfg.s_layout)
        dp_tok = reduce_d(v_me, do, zeros, cfg.V_DIM, cfg.HEAD_DIM)
        s = warpgroup_mma_wait(1, deps=[s_tok])
        lse = me.qd.lse.index(q_it.index).load(gl.SliceLayout(0, cfg.s_layout))
        p, d_s, held = _scores_to_grads(cfg, run, mask, s, dp_tok, lse, me.qd.delta.index(q_it.index), m0, held,
                                        MASKED)
        p_a = gl.convert_layout(p.to(cfg.dtype), cfg.a_layout)
        ds16 = d_s.to(cfg.dtype)
        ds_a = gl.convert_layout(ds16, cfg.a_layout)
        # (dS^T's half stored before the wgmmas are issued, as DS_FIRST)
        me.ds.half(ds_it, WG).store(ds16)
        dv_tok = warpgroup_mma(p_a, do, dv, is_async=True)
        me.ds.exchange(ds_it)
        # dQ^T [64 head dims, queries] = K^T[those head dims, keys] dS^T[keys, queries], then dK's wgmmas, under which
        # dQ's shares are staged and added (FA3/FA4's order, DQ_FIRST's)
        acc = gl.zeros([HALF, cfg.BLOCK_M], gl.float32, cfg.dq_layout)
        own = warpgroup_mma(k_me.slice(HI, HI_N, dim=1).permute((1, 0)), me.ds.half(ds_it, WG), acc, use_acc=False,
                            is_async=True)
        both = warpgroup_mma(me.kv.k.index(0).slice(WG * HALF, HALF, dim=1).permute((1, 0)), me.ds.half(ds_it, 0),
                             acc, use_acc=False, is_async=True)
        both = warpgroup_mma(me.kv.k.index(1).slice(WG * HALF, HALF, dim=1).permute((1, 0)), me.ds.half(ds_it, 1),
                             both, is_async=True)
        dk_tok = warpgroup_mma(ds_a, q.slice(0, HI, dim=1), dk, is_async=True)
        dk2_tok = warpgroup_mma(gl.convert_layout(ds16, hi_a), q.slice(HI, HI_N, dim=1), dk2, is_async=True)
        dv, dq_own, dq_both = warpgroup_mma_wait(2, deps=[dv_tok, own, both])
        held = _dq_claim(cfg, run, dq_row, u, m0, held, True)
        buf_both = me.dq_buf.index(0)
        buf_own = me.dq_buf.index(1)
        if cfg.DQ_FRAG:
            # (the chunks in their registers' order: 4 STS.128 a thread each, against 16 STS.32 transposed; the query
            # block's three [64, 32] chunks of the accumulator, head dims 64 c + ...)
            chunk = (dq_row * run.locks_per_head + (w.dq_base + m0) // cfg.BLOCK_M) * (cfg.QK_DIM // HALF)
            t_both = buf_both.reinterpret(gl.float32, run.desc_dq.block_type.shape, run.desc_dq.layout)
            t_own = buf_own.reinterpret(gl.float32, run.desc_dq.block_type.shape, run.desc_dq.layout)
            t_both.store(_fragment_order(dq_both))
            t_own.store(_fragment_order(dq_own))
            _dq_add(run, [(chunk + WG) * t_both.shape[0], 0], t_both)
            _dq_add(run, [(chunk + HI // HALF) * t_own.shape[0], 0], t_own)
        else:
            buf_both.permute((1, 0)).store(dq_both)
            buf_own.permute((1, 0)).store(dq_own)
            _dq_add(run, [dq_row, w.dq_base + m0, WG * HALF], buf_both)
            if cfg.DETERMINISTIC:
                # (both warpgroups add into the last chunk: warpgroup 1 once the block's three other adds are counted)
                held = _dq_claim(cfg, run, dq_row, u, m0, held, False, 3 if WG == 1 else 0)
            _dq_add(run, [dq_row, w.dq_base + m0, HI], buf_own)
        dk, dk2 = warpgroup_mma_wait(0, deps=[dk_tok, dk2_tok])
        me.qd.sig.release(q_it)
        q_it = q_it.next()
        ds_it = ds_it.next()
    return BwdLoop(q_it, ds_it, dk, dv, held, dk2, st.dv2)


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
def _scores_to_grads(cfg, run, mask, s, dp_tok, lse, delta_rows, q0, held, MASKED: gl.constexpr):
    """P^T and dS^T of a warpgroup's [64 keys from mask.row0, queries from q0] tile, from its S^T and its dP^T wgmma
    in flight, the queries' lse (log2 units, loaded) and their delta in shared memory. MASKED: the keys ``mask`` (a
    ``masks.TileMask`` at this block) leaves out get P = 0. DETERMINISTIC: the previous block's dQ add is counted
    while dP^T finishes (``_dq_release_early``). Returns (P^T, dS^T, the dQ lock held)."""
    col: gl.constexpr = gl.SliceLayout(0, cfg.s_layout)
    s = mask.apply_transposed(s, q0, MASKED)
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
    """A [64, N] wgmma accumulator (N 64, or the pair's 32) as [2 N, 32] in its registers' order. A thread's registers
    4 i + 2 h + p hold element (16 w + 8 h + rr, 8 i + 2 cc + p), w its warp, lane 4 rr + cc (``to_linear_layout``):
    flat index ((i * 4 + w) * 32 + lane) * 4 + 2 h + p, so each thread's four values of a column group lie side by
    side."""
    N: gl.constexpr = x.shape[1]
    x = gl.permute(gl.reshape(x, [4, 2, 8, N // 8, 4, 2]), [3, 0, 2, 4, 1, 5])  # (i, w, rr, cc, h, p)
    return gl.reshape(x, [2 * N, 32])


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
def _dq_claim(cfg, run, hz, u, m0, held, RELEASED: gl.constexpr, AFTER: gl.constexpr = 0):
    """Before staging a dQ add into the warpgroup's buffer: the previous add has read it (DETERMINISTIC: has
    completed, and is counted), and (DETERMINISTIC) this key block's turn at the block's lock has come and AFTER of
    its own adds there are counted (PAIR: both warpgroups add into the last chunk, warpgroup 1 after warpgroup 0).
    RELEASED: the previous add was already counted this block (``_dq_release_early``, whose full bulk wait
    also freed the buffer). Returns the lock held."""
    w = u.w
    if cfg.DETERMINISTIC:
        if not RELEASED:
            _dq_release(run, held)
        held = hz * run.locks_per_head + (w.dq_base + m0) // cfg.BLOCK_M
        lock = run.dq_locks + held
        if cfg.NA_DIMS >= 2:
            turn = cfg.DQ_ADDS * _box_turn(cfg, run, u.mask.walk, m0 // cfg.BLOCK_M) + AFTER
        elif cfg.WINDOW:
            # the key blocks that add into this query block start at its first query's window, not at 0
            win_k, win_s = window_words(run.shape.seq_ptr)
            start, _ = window_bounds(gl.minimum(m0, w.n_q - 1), w.n_k, win_k, win_s, cfg.WINDOW)
            turn = cfg.DQ_ADDS * (w.n0 // cfg.BLOCK_N - start // cfg.BLOCK_N) + AFTER
        else:
            turn = cfg.DQ_ADDS * (w.n0 // cfg.BLOCK_N) + AFTER
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
def _store_kv(cfg, me, u, x, desc, ptr, col0: gl.constexpr):
    """This warpgroup's 64 rows of dK or dV (its head dims from ``col0``): staged in its dQ buffer (the last
    dQ add has read it) and TMA-stored, dense rows past N_KV clipped by the descriptor. A packed sequence's
    last keys, which the descriptor would not clip at the next sequence, go out as masked stores from the
    registers. (Stored from the registers everywhere, the 16-bit scalar stores took microseconds per unit.)
    A share narrower than the descriptor's block (WIDE's last 64 of q/k 192) fills the block's first columns;
    the rest lie past the head dim, where the store clips them."""
    if cfg.VARLEN and u.key0 + x.shape[0] > u.w.n_k:
        store_rows(x.to(cfg.dtype), ptr, desc, u.w.z, u.w.hk, u.w.k_base, u.key0, u.w.n_k, col0, cfg.PADDED)
    else:
        tma.store_wait(0)
        n: gl.constexpr = block_cols(desc.block_type.shape)
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([x.shape[0], n], cfg.dtype)
        tile = me.dq_buf.reinterpret(cfg.dtype, [x.shape[0], n], layout)
        if x.shape[1] < n:
            tile.slice(0, x.shape[1], dim=1).store(x.to(cfg.dtype))
        else:
            tile.store(x.to(cfg.dtype))
        fence_async_shared()
        if cfg.NA_DIMS >= 2:
            coords = _key_half_coords(cfg, u.w, u.mask.walk, me.WG)
        else:
            coords = [u.w.z, u.w.hk, u.w.k_base + u.key0, col0]
        tma.async_store(desc, coords, block_view(tile, desc))
