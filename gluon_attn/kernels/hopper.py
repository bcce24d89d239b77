"""Persistent, warp-specialized attention forward for Hopper (sm_90a): TMA + async wgmma.

Partitions (``gl.warp_specialize``):
  * ``_consumer_partition`` x2 or x3: 4-warp consumer warpgroups, each owning 64 query rows of a
    128-row tile (two, 240 registers each) or a 192-row tile (three, 160 registers each; FA3's tile
    for D=64). All read the same K/V stages. Inside a warpgroup the softmax of block j+1 runs
    while the wgmma of P_j V_j is in flight (intra-warpgroup overlap); across the warpgroups a
    cycle of hardware named barriers can hand the tensor cores on (PINGPONG, FA3's warp scheduler
    barriers), so that one warpgroup's GEMMs issue while another does its softmax.
  * ``_load_partition``: one warp issuing TMA loads: each warpgroup's Q rows once per tile, then K
    and V through a KV_STAGES-deep ring (see ``channels.Ring``).

The grid is persistent (one program per SM) and walks work units with ``schedule.unit_tiles`` (causal:
mirrored pairs of query blocks, equal work per unit; with the dynamic scheduler and at least SINGLES_MIN_BLOCKS
query blocks, single tiles longest first).

This module is the device code only: the @gluon.jit functions, aggregates, constexpr helpers and the constants they
read. Its host side (``HopperConfig``, the tuning lookups, launch plans and launches, the compile-only ``build``,
SINGLES_MIN_BLOCKS) is ``hopper_host.py``, which imports this module (never the other way round).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .channels import (Descs, Ring, RingIndex, aggregate, block_cols, block_view, constexpr_value as _value,
                       named_barrier_arrive, named_barrier_sync, store_rows, tma_load_2d)
from .masks import (BoxRows, TileMask, WalkBoxes, box_dims, magic_quotient, walk_reciprocals, walk_step,
                    window_blocks, window_boxes_load, window_dims, window_words)
from .schedule import (LOCATED_WORDS, Shape, Work, end_units, publish_located, publish_unit, read_located, read_unit,
                       slot_words_alloc)
from .naming import kernel_symbol

LOADER_REGS = gl.constexpr(24)  # the TMA warp only computes coordinates
# Two Q tiles per consumer warpgroup: the loader fetches the next tile's rows during this one.
Q_STAGES = 2
# Keys per K/V block (the N of the S wgmma): 128 won in every class (NOTES v15, v33).
BLOCK_N = 128
# Head dim 256 (NOTES v35): O is 64 x 256 fp32 per warpgroup (128 registers a thread), so S takes 64-key
# blocks, Q one slot per warpgroup (64 KB for the tile) and O leaves from registers (no 64 KB staging
# buffer): Q + two K/V stages make 192 KB.
WIDE_HEAD_DIM = 256
WIDE_BLOCK_N = 64


@gluon.constexpr_function
def block_n(head_dim) -> int:
    return WIDE_BLOCK_N if _value(head_dim) == WIDE_HEAD_DIM else BLOCK_N


@gluon.constexpr_function
def q_stages(head_dim) -> int:
    return 1 if _value(head_dim) == WIDE_HEAD_DIM else Q_STAGES
LN2 = gl.constexpr(0.6931471805599453)
Smem = gl.shared_memory_descriptor | gl.constexpr  # an aggregate's buffer, or None where a build has none


@gluon.constexpr_function
def _box_rows(block):
    """Rows of a descriptor block [1, (1,) rows..., D] as a 2-D tile: the product of its middle dims."""
    rows = 1
    for d in list(block)[1:-1]:
        rows *= _value(d)
    return rows


@gluon.constexpr_function
def _wgmma_layout(n, bits):
    """A wgmma accumulator of one warpgroup: 64 rows, N = ``n`` columns, K = 32 bytes of input."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 256 // bits])


@aggregate
class Cfg:
    """Every compile-time choice of a build, and the register layouts the consumers compute in."""
    dtype: gl.constexpr
    out_dtype: gl.constexpr
    HEAD_DIM: gl.constexpr
    SPLIT_M: gl.constexpr  # rows per consumer warpgroup
    BLOCK_M: gl.constexpr  # rows per tile: 2 or 3 consumer warpgroups
    BLOCK_N: gl.constexpr
    NUM_CONSUMERS: gl.constexpr
    KV_STAGES: gl.constexpr
    CAUSAL: gl.constexpr
    V_TRANSPOSED: gl.constexpr  # fp8: V arrives as V^T tiles (wgmma wants B K-major)
    PINGPONG: gl.constexpr
    RETURN_LSE: gl.constexpr
    DYNAMIC: gl.constexpr
    SUM_MMA: gl.constexpr
    SOFTMAX_SUM: gl.constexpr  # the softmax adds its row sums (without SUM_MMA, or for the lse)
    Q_STAGES: gl.constexpr  # Q slots per consumer warpgroup
    O_DIRECT: gl.constexpr  # O stored from registers (head dim 256), else staged in shared memory for TMA
    BOX_PAIRS: gl.constexpr  # 2-D/3-D 64-row tiles: a tile of two key blocks takes both at once (``_pair_tile``)
    PADDED: gl.constexpr  # tensors' head dim below HEAD_DIM (``hopper_host.kernel_head_dim``): stores clip columns
    QK_DIM: gl.constexpr  # q's and k's head dim: HEAD_DIM, or a padded one's own (S = Q K^T in pieces, ``_qk``)
    V_DIM: gl.constexpr  # O's columns: HEAD_DIM, or the 192/128 pair's v head dim (PV over V's first V_DIM, ``_v_b``)
    K_COLS: gl.constexpr  # a K tile's columns: HEAD_DIM, or (PAIR_TILE, ``hopper_host``) 64 of K_CHUNKS pieces,
    K_CHUNKS: gl.constexpr  # K_HEAD of them stacked along the rows of a K slot ([K_HEAD * BLOCK_N, K_COLS]), the rest
    K_HEAD: gl.constexpr  # in ``KV.k_tail``'s slot (tiles are powers of two; ``_load_k``, ``_k_piece``)
    WINDOW: gl.constexpr  # neighborhood attention along the rows: 1 non-causal, 2 causal windows (0: none); 4-7 2-D
    NA_DIMS: gl.constexpr  # the WINDOW mode's spatial dimensions (0 none)
    TXC: gl.constexpr  # 2-D/3-D: a consumer's query box is TXC x TY (x TZ) positions, the tile's NUM_CONSUMERS x
    TY: gl.constexpr  # TXC x TY (x TZ); a key block KX x KY (x KZ) (the descriptors' blocks: [1, 1, x, y, D] in
    TZ: gl.constexpr  # 2-D, [1, x, y, z, D] in 3-D); 1 otherwise
    KX: gl.constexpr
    KY: gl.constexpr
    KZ: gl.constexpr
    BOX_HALO: gl.constexpr  # 2-D/3-D: key boxes from the tile's halo (``masks.window_keys``); fp8 the lattice's (V^T)
    UNIT_STRIDES: gl.constexpr  # 2-D/3-D: every stride 1 (``masks.window_boxes_load``)
    COMBINE: gl.constexpr  # decode's chunks: the last warpgroup of a K/V head combines its parts (``_combine_parts``)
    s_layout: gl.constexpr  # S = Q K^T accumulator
    o_layout: gl.constexpr  # O accumulator
    p_layout: gl.constexpr  # P as the PV wgmma's A operand from registers
    l_layout: gl.constexpr  # SUM_MMA: the 64 x 8 row-sum accumulator
    pl_layout: gl.constexpr  # SUM_MMA: P as that wgmma's A operand

    @gluon.constexpr_function
    def __init__(self, dtype, out_dtype, HEAD_DIM, SPLIT_M, BLOCK_M, BLOCK_N, KV_STAGES, CAUSAL, V_TRANSPOSED,
                 PINGPONG, RETURN_LSE, DYNAMIC, SUM_MMA, PADDED=False, WINDOW=0, q_box=(), k_box=(), QK_DIM=0,
                 V_DIM=0, K_COLS=0, UNIT_STRIDES=False, COMBINE=False):
        self.PADDED = gl.constexpr(PADDED)
        self.COMBINE = gl.constexpr(COMBINE)
        self.UNIT_STRIDES = gl.constexpr(UNIT_STRIDES)
        self.QK_DIM = gl.constexpr(_value(QK_DIM) or _value(HEAD_DIM))
        self.V_DIM = gl.constexpr(_value(V_DIM) or _value(HEAD_DIM))
        k_cols = _value(K_COLS) or _value(HEAD_DIM)
        self.K_COLS = gl.constexpr(k_cols)
        self.K_CHUNKS = gl.constexpr(1 if k_cols == _value(HEAD_DIM) else -(-self.QK_DIM.value // k_cols))
        self.K_HEAD = gl.constexpr(_pow2_floor(self.K_CHUNKS))
        self.WINDOW = gl.constexpr(WINDOW)
        self.NA_DIMS = gl.constexpr(window_dims(WINDOW))
        q_dims, k_dims = box_dims(q_box, self.NA_DIMS), box_dims(k_box, self.NA_DIMS)
        self.TXC = gl.constexpr(q_dims[0])
        self.TY = gl.constexpr(q_dims[1])
        self.TZ = gl.constexpr(q_dims[2])
        self.KX = gl.constexpr(k_dims[0])
        self.KY = gl.constexpr(k_dims[1])
        self.KZ = gl.constexpr(k_dims[2])
        self.dtype = gl.constexpr(dtype)
        self.out_dtype = gl.constexpr(out_dtype)
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.SPLIT_M = gl.constexpr(SPLIT_M)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.NUM_CONSUMERS = gl.constexpr(_value(BLOCK_M) // _value(SPLIT_M))
        self.KV_STAGES = gl.constexpr(KV_STAGES)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.V_TRANSPOSED = gl.constexpr(V_TRANSPOSED)
        self.BOX_HALO = gl.constexpr(not _value(V_TRANSPOSED))
        self.PINGPONG = gl.constexpr(PINGPONG)
        self.RETURN_LSE = gl.constexpr(RETURN_LSE)
        self.DYNAMIC = gl.constexpr(DYNAMIC)
        self.SUM_MMA = gl.constexpr(SUM_MMA)
        # The lse stays the log of the exact sum (a wgmma sums P as rounded to the input type: one fp8
        # e5m2 value is off by up to 12.5%), so with RETURN_LSE the softmax keeps its adds as well.
        self.SOFTMAX_SUM = gl.constexpr(bool(_value(RETURN_LSE)) or not _value(SUM_MMA))
        self.Q_STAGES = gl.constexpr(q_stages(_value(HEAD_DIM)))
        self.O_DIRECT = gl.constexpr(_value(HEAD_DIM) == WIDE_HEAD_DIM)
        bits = _value(dtype).primitive_bitwidth
        # 2-D/3-D windows' 64-row tiles: a tile of two key blocks takes both at once (``_pair_tile``; one consumer's
        # 232 registers hold both S beside O, two consumers' 168 do not)
        self.BOX_PAIRS = gl.constexpr(self.NA_DIMS.value >= 2 and self.NUM_CONSUMERS.value == 1 and bits == 16
                                      and not _value(SUM_MMA))
        # P feeds the PV wgmma from registers: 4 bytes per register, so k_width packs 2 fp16 or 4 fp8
        # values; it matches the accumulator's row/column ownership. The row-sum wgmma reads the same
        # registers (A's layout does not depend on N).
        self.s_layout = gl.constexpr(_wgmma_layout(_value(BLOCK_N), bits))
        self.o_layout = gl.constexpr(_wgmma_layout(_value(self.V_DIM), bits))
        self.p_layout = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=self.o_layout.value,
                                                         k_width=32 // bits))
        self.l_layout = gl.constexpr(_wgmma_layout(8, bits))
        self.pl_layout = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=self.l_layout.value,
                                                          k_width=32 // bits))


@aggregate
class Run:
    """The launch's runtime values every partition reads."""
    shape: Shape  # sizes, heads, the packed sequences' table (see ``schedule.Shape``)
    num_progs: gl.tensor  # the persistent grid
    qk_scale: gl.tensor  # sm_scale * log2(e) (fp8: times the q and k descales)
    o_scale: gl.tensor  # the v descale (1 for 16-bit)
    lse_ptr: gl.tensor
    o_ptr: gl.tensor  # the output, for stores without TMA (a packed sequence's last tile; O_DIRECT)
    sched_ptr: gl.tensor  # DYNAMIC: the unit counter


@aggregate
class KV:
    """The K and V rings every consumer warpgroup reads (PAIR_TILE: K's last piece in ``k_tail``, slot for slot)."""
    k: Ring
    v: Ring
    k_tail: Smem  # None but for PAIR_TILE


@aggregate
class Consumer:
    """What belongs to one consumer warpgroup: its Q ring (and, with DYNAMIC, the unit numbers beside
    the slots; packed, where each unit lies), its O staging buffer and its SUM_MMA ones tile (PINGPONG's
    turns are named barriers)."""
    q_ring: Ring
    unit_ids: Smem  # None without DYNAMIC
    located: Smem  # None unless DYNAMIC and packed
    o_buf: Smem  # None with O_DIRECT
    ones: Smem  # None without SUM_MMA
    WG: gl.constexpr  # which 64 rows of the tile


@aggregate
class Rows:
    """A consumer's running state over the key blocks of one tile: row max and sum, O, the SUM_MMA row
    sums, and P of the previous block (the next PV wgmma's operand, see ``_pv_carry``)."""
    m_i: gl.tensor
    l_i: gl.tensor
    acc: gl.tensor
    l_acc: gl.tensor
    p_prev: gl.tensor


# ---------------------------------------------------------------------------------------------
# The kernel: shared memory, barriers, and the partitions
# ---------------------------------------------------------------------------------------------
# Sizes are not value-specialized: the host launches a compiled kernel directly (``launch_cached``) keyed
# on the constexprs alone, which is only sound if no binary depends on a size's value (N_Q % 16, N_KV == 1).
@gluon.jit(repr=kernel_symbol, do_not_specialize=["N_Q", "N_KV", "num_hz", "G", "group_hz", "n_seqs", "num_progs"])
def hopper_attention_kernel(desc_q, desc_k, desc_v, desc_o, o_ptr, lse_ptr, sched_ptr, seq_ptr, qk_scale, o_scale, N_Q,
                            N_KV, num_hz, G, group_hz, n_seqs, num_progs, BLOCK_M: gl.constexpr,
                            KV_STAGES: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr,
                            V_TRANSPOSED: gl.constexpr, PINGPONG: gl.constexpr, RETURN_LSE: gl.constexpr,
                            DYNAMIC: gl.constexpr, SUM_MMA: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, KERNEL_NAME: gl.constexpr, SINGLES: gl.constexpr = False,
                            PADDED: gl.constexpr = False, WINDOW: gl.constexpr = 0, QK_DIM: gl.constexpr = 0,
                            V_DIM: gl.constexpr = 0, UNIT_STRIDES: gl.constexpr = False,
                            COMBINE: gl.constexpr = False):
    # (WINDOW: neighborhood attention over the rows of dense self-attention, its kernel size and stride the two
    # int32 words at seq_ptr, which packed sequences use and windows do not; ``window_blocks``)
    # (2-D windows: the blocks are boxes [1, 1, x, y, D] of [Z, H, Lx, Ly, D] views; a box's rows are x * y)
    cfg = Cfg(desc_q.dtype, desc_o.dtype, block_cols(desc_q.block_type.shape), _box_rows(desc_q.block_type.shape),
              BLOCK_M, _box_rows(desc_k.block_type.shape), KV_STAGES, CAUSAL, V_TRANSPOSED, PINGPONG, RETURN_LSE,
              DYNAMIC, SUM_MMA, PADDED, WINDOW, desc_q.block_type.shape, desc_k.block_type.shape, QK_DIM, V_DIM,
              block_cols(desc_k.block_type.shape), UNIT_STRIDES, COMBINE)
    # (SINGLES, with DYNAMIC: causal units are single tiles, longest first; ``schedule.unit_tiles``,
    # ``hopper_host.singles``)
    # (COMBINE: decode's chunks, [splits, Z * H_KV, rows, D] views (``decode.PreparedSplit``): o_ptr the parts' outputs,
    # lse_ptr their lse, seq_ptr a zeroed int32 counter per K/V head, sched_ptr the combined output; ``_combine_parts``;
    # n_seqs the keys the last split sees beyond N_KV: ``Shape.LAST_KEYS``)
    # (the query heads: dimension 1 of [Z, H, ...] views, 0 of 3-D windows' [H, Z Lx, Ly, Lz, D] ones)
    shape = Shape(N_Q, N_KV, num_hz, desc_q.shape[0] if cfg.NA_DIMS == 3 else desc_q.shape[1], G, group_hz, seq_ptr,
                  n_seqs, BLOCK_M, _box_rows(desc_k.block_type.shape), CAUSAL, VARLEN, SINGLES, COMBINE)
    run = Run(shape, num_progs, qk_scale, o_scale, lse_ptr, o_ptr, sched_ptr)
    descs = Descs(desc_q, desc_k, desc_v, desc_o)
    # NVMMA shared layouts (128-byte swizzle where the row allows): what TMA writes and wgmma reads
    # without bank conflicts.
    q_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.SPLIT_M, cfg.HEAD_DIM], cfg.dtype)
    k_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.BLOCK_N, cfg.K_COLS], cfg.dtype)
    # (V's tile is its descriptor's block: [BLOCK_N, D], fp8's V^T [D, BLOCK_N]; PAIR_TILE: v's 128 columns)
    v_shape: gl.constexpr = [_box_rows(desc_v.block_type.shape), block_cols(desc_v.block_type.shape)]
    v_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for(v_shape, cfg.dtype)
    o_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([cfg.SPLIT_M, cfg.HEAD_DIM], cfg.out_dtype)

    # Two Q tiles per consumer: the loader starts the next tile's rows while this one finishes.
    q_ring0 = Ring.alloc(cfg.dtype, [cfg.SPLIT_M, cfg.HEAD_DIM], q_smem, cfg.Q_STAGES, 1)
    if cfg.NUM_CONSUMERS >= 2:
        q_ring1 = Ring.alloc(cfg.dtype, [cfg.SPLIT_M, cfg.HEAD_DIM], q_smem, cfg.Q_STAGES, 1)
    else:
        q_ring1 = q_ring0  # not loaded
    if cfg.NUM_CONSUMERS == 3:
        q_ring2 = Ring.alloc(cfg.dtype, [cfg.SPLIT_M, cfg.HEAD_DIM], q_smem, cfg.Q_STAGES, 1)
    else:
        q_ring2 = q_ring1  # not loaded
    k_ring = Ring.alloc(cfg.dtype, [cfg.K_HEAD * cfg.BLOCK_N, cfg.K_COLS], k_smem, cfg.KV_STAGES, cfg.NUM_CONSUMERS)
    if cfg.K_CHUNKS > cfg.K_HEAD:
        k_tail = gl.allocate_shared_memory(cfg.dtype, [cfg.KV_STAGES, (cfg.K_CHUNKS - cfg.K_HEAD) * cfg.BLOCK_N,
                                                       cfg.K_COLS], k_smem)
    else:
        k_tail = None
    kv = KV(k_ring, Ring.alloc(cfg.dtype, v_shape, v_smem, cfg.KV_STAGES, cfg.NUM_CONSUMERS), k_tail)
    o0 = None  # (None: a build without the buffer; O_DIRECT, DYNAMIC, packed, SUM_MMA decide)
    o1 = None
    o2 = None
    if not cfg.O_DIRECT:
        o_bufs = gl.allocate_shared_memory(cfg.out_dtype, [cfg.NUM_CONSUMERS, cfg.SPLIT_M, cfg.HEAD_DIM], o_smem)
        o0 = o_bufs.index(0)
        o1 = o_bufs.index(cfg.NUM_CONSUMERS // 2)
        o2 = o_bufs.index(cfg.NUM_CONSUMERS - 1)
    ids0 = None
    ids1 = None
    ids2 = None
    if cfg.DYNAMIC:
        ids0, ids1, ids2 = _consumer_slot_words(cfg, 1)
    loc0 = None
    loc1 = None
    loc2 = None
    if VARLEN and cfg.DYNAMIC:
        loc0, loc1, loc2 = _consumer_slot_words(cfg, LOCATED_WORDS)
    ones0 = None
    ones1 = None
    ones2 = None
    if cfg.SUM_MMA:
        ones0, ones1, ones2 = _ones_tiles(cfg)
    fence_async_shared()
    c0 = Consumer(q_ring0, ids0, loc0, o0, ones0, 0)
    c1 = Consumer(q_ring1, ids1, loc1, o1, ones1, 1)
    c2 = Consumer(q_ring2, ids2, loc2, o2, ones2, 2)

    # Consumer 0 is the default partition (the kernel's 4 warps), the others 4-warp workers; the loader is a
    # 1-warp worker (its warpgroup padded with idle warps at 24 registers). A 4-warp loader ran its code on
    # every warp with a partition bar.sync at each TMA issue (NOTES v49). NUM_CONSUMERS x 128 threads x
    # CONSUMER_REGS plus the loader's warpgroup at 24 must fit the 64K-register file. (The partition list
    # is written out: Gluon does not take (function, args) pairs from variables.)
    if cfg.NUM_CONSUMERS == 3:
        gl.warp_specialize([(_consumer_partition, (cfg, run, descs, kv, c0)),
                            (_load_partition, (cfg, run, descs, kv, c0, c1, c2)),
                            (_consumer_partition, (cfg, run, descs, kv, c1)),
                            (_consumer_partition, (cfg, run, descs, kv, c2))],
                           [1, 4, 4], [LOADER_REGS, CONSUMER_REGS, CONSUMER_REGS])
    elif cfg.NUM_CONSUMERS == 1:
        gl.warp_specialize([(_consumer_partition, (cfg, run, descs, kv, c0)),
                            (_load_partition, (cfg, run, descs, kv, c0, c1, c2))],
                           [1], [LOADER_REGS])
    else:
        gl.warp_specialize([(_consumer_partition, (cfg, run, descs, kv, c0)),
                            (_load_partition, (cfg, run, descs, kv, c0, c1, c2)),
                            (_consumer_partition, (cfg, run, descs, kv, c1))],
                           [1, 4], [LOADER_REGS, CONSUMER_REGS])


@gluon.jit
def _consumer_slot_words(cfg, WORDS: gl.constexpr):
    """WORDS int32 beside each Q slot of every consumer warpgroup (``schedule.slot_words_alloc``); with two
    consumers the third is the second's (the loader and the consumers reach it only with three)."""
    w0 = slot_words_alloc(cfg.Q_STAGES, WORDS)
    if cfg.NUM_CONSUMERS >= 2:
        w1 = slot_words_alloc(cfg.Q_STAGES, WORDS)
    else:
        w1 = w0
    if cfg.NUM_CONSUMERS == 3:
        w2 = slot_words_alloc(cfg.Q_STAGES, WORDS)
    else:
        w2 = w1
    return w0, w1, w2


@gluon.jit
def _ones_tiles(cfg):
    """SUM_MMA: the row sums' B operands (see ``_row_sum_mma``), [8, BLOCK_N] of ones read K-major
    through a permuted view as V^T is. 16-bit: one tile for all consumers, written here by the loader's
    warpgroup before the partitions split (2 KB: fp16 D=128 fits it beside two Q tiles per consumer,
    not one per consumer). fp8: one per consumer, each written by its consumer as f16 words (see
    ``_fill_ones``)."""
    ONES_TILES: gl.constexpr = 1 if cfg.dtype.primitive_bitwidth == 16 else cfg.NUM_CONSUMERS
    ones = gl.allocate_shared_memory(cfg.dtype, [ONES_TILES, 8, cfg.BLOCK_N],
                                     gl.NVMMASharedLayout.get_default_for([8, cfg.BLOCK_N], cfg.dtype))
    if ONES_TILES == 1:
        _fill_ones(ones.index(0))
    return ones.index(0), ones.index(1 if ONES_TILES > 1 else 0), ones.index(ONES_TILES - 1)


# ---------------------------------------------------------------------------------------------
# The loader (one warp): Q tiles and the K/V ring
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _load_partition(cfg, run, descs, kv, c0, c1, c2):
    """The TMA warp. Units: this program's share (unit = pid + k x grid), or with DYNAMIC its first
    unit and then whatever the scheduler's counter hands out when the previous unit's loads are issued
    (a program that runs slower takes fewer units); -1 beside a last Q slot ends the consumers' walk."""
    n_units = run.shape.num_units()
    # With two Q slots the loader runs a whole tile ahead: the next tile's Q and first K/V blocks are
    # in flight while this tile finishes.
    q_it = RingIndex.start(c0.q_ring.NUM)
    kv_it = RingIndex.start(cfg.KV_STAGES)
    if cfg.DYNAMIC:
        unit = gl.program_id(0)
        while unit < n_units:
            q_it, kv_it = _load_unit(cfg, run, descs, kv, c0, c1, c2, unit, q_it, kv_it)
            unit = run.num_progs + gl.atomic_add(run.sched_ptr, 1)
        end_units(c0.q_ring, c0.unit_ids, q_it)
        if cfg.NUM_CONSUMERS >= 2:
            end_units(c1.q_ring, c1.unit_ids, q_it)
        if cfg.NUM_CONSUMERS == 3:
            end_units(c2.q_ring, c2.unit_ids, q_it)
    else:
        for unit in range(gl.program_id(0), n_units, run.num_progs):
            q_it, kv_it = _load_unit(cfg, run, descs, kv, c0, c1, c2, unit, q_it, kv_it)


@gluon.jit
def _load_unit(cfg, run, descs, kv, c0, c1, c2, unit, q_it, kv_it):
    """The loads of one work unit: each tile's Q rows into the consumers' Q rings (with DYNAMIC, the
    unit's number beside each, for the consumers to read), then its K/V blocks into the ring."""
    ROWS: gl.constexpr = cfg.SPLIT_M
    if run.shape.VARLEN:
        loc = run.shape.locate(unit)
        w = run.shape.packed_work(loc)
    elif cfg.NA_DIMS >= 2:
        loc = None
        w = _box_work(cfg, run, unit)
    else:
        loc = None
        w = run.shape.work(unit)
    for t in range(w.n_tiles):
        pid_m = w.tile(t)
        if cfg.NA_DIMS >= 2:
            q_it, kv_it = _load_tile_boxes(cfg, run, descs, kv, c0, c1, c2, unit, w, pid_m, q_it, kv_it)
        else:
            q0 = pid_m * cfg.BLOCK_M
            _load_q(descs.q, c0, q_it, unit, loc, w.q_coords(q0), cfg.DYNAMIC, run.shape.VARLEN)
            if cfg.NUM_CONSUMERS >= 2:
                _load_q(descs.q, c1, q_it, unit, loc, w.q_coords(q0 + ROWS), cfg.DYNAMIC, run.shape.VARLEN)
            if cfg.NUM_CONSUMERS == 3:
                _load_q(descs.q, c2, q_it, unit, loc, w.q_coords(q0 + 2 * ROWS), cfg.DYNAMIC, run.shape.VARLEN)
            q_it = q_it.next()
            if cfg.WINDOW:
                win_k, win_s = window_words(run.shape.seq_ptr)
                j_lo, j_hi, _, _ = window_blocks(q0, q0 + cfg.BLOCK_M - 1, w.n_k, win_k, win_s, cfg.BLOCK_N,
                                                 cfg.WINDOW)
                n_kv = j_hi - j_lo
            else:
                j_lo = 0
                n_kv = w.kv_blocks(pid_m)
            for j in range(n_kv):
                start_n = (j_lo + j) * cfg.BLOCK_N
                k_buf, k_bar = kv.k.acquire_empty(kv_it)
                _load_k(cfg, descs.k, w, start_n, k_bar, k_buf, kv, kv_it)
                v_buf, v_bar = kv.v.acquire_empty(kv_it)
                if cfg.V_TRANSPOSED:
                    # V^T is [Z, H_KV, D, N_KV] (packed: [1, H_KV, D, total]): keys are the last coordinate.
                    tma_load_2d(descs.v, [w.z, w.hk, 0, w.k_base + start_n], v_bar, v_buf)
                else:
                    tma_load_2d(descs.v, w.kv_coords(start_n), v_bar, v_buf)
                kv_it = kv_it.next()
    return q_it, kv_it


@gluon.jit
def _load_k(cfg, desc_k, w, start_n, bar, buf, kv, it):
    """A key block's K into slot ``it``: one block, or (PAIR_TILE) its K_CHUNKS pieces of K_COLS columns
    (``_k_piece``), all on one expect of their bytes."""
    if cfg.K_CHUNKS == 1:
        tma_load_2d(desc_k, w.kv_coords(start_n), bar, buf)
    else:
        mbarrier.expect(bar, cfg.K_CHUNKS * desc_k.block_type.nbytes)
        for c in gl.static_range(cfg.K_CHUNKS):
            tma.async_load(desc_k, [w.z, w.hk, w.k_base + start_n, c * cfg.K_COLS], bar,
                           block_view(_k_piece(cfg, buf, kv, it, c), desc_k))


@gluon.jit
def _k_piece(cfg, buf, kv, it, c: gl.constexpr):
    """PAIR_TILE: piece c of slot ``it``'s K ([BLOCK_N, K_COLS]): in the ring's slot ``buf`` below K_HEAD, else in
    ``kv.k_tail``'s."""
    if c < cfg.K_HEAD:
        return buf.slice(c * cfg.BLOCK_N, cfg.BLOCK_N)
    else:
        return kv.k_tail.index(it.index).slice((c - cfg.K_HEAD) * cfg.BLOCK_N, cfg.BLOCK_N)


@gluon.jit
def _box_coords(cfg, na, z, h, x, y, zz):
    """A box's descriptor coordinates: [z, h, x, y, 0] over 2-D windows' [Z, H, Lx, Ly, D] views, [h, z Lx + x, y, zz,
    0] over 3-D windows' [H, Z Lx, Ly, Lz, D] ones (TMA's five dimensions: the batches folded into x, each Lx long; the
    host folds them where the query tiles divide Lx, so that no tile's store reaches the next batch)."""
    if cfg.NA_DIMS == 3:
        return [h, z * na.Lx + x, y, zz, 0]
    else:
        return [z, h, x, y, 0]


@gluon.jit
def _box_window(cfg, run):
    return window_boxes_load(run.shape.seq_ptr, cfg.NUM_CONSUMERS * cfg.TXC, cfg.TY, cfg.TZ, cfg.KX, cfg.KY, cfg.KZ,
                             cfg.WINDOW, cfg.UNIT_STRIDES)


# 2-D/3-D windows: where the launch's division words start at seq_ptr (after the window's nine,
# ``hopper_host.box_division_words``): (m, p) of each divisor that takes a unit apart, in the order of the DIV_*
# numbers, then H_KV.
BOX_DIVISION_WORDS = gl.constexpr(9)
DIV_GROUP = gl.constexpr(0)  # a K/V head's units: G x tiles
DIV_G = gl.constexpr(1)  # query heads per K/V head
DIV_HKV = gl.constexpr(2)  # K/V heads
DIV_TY = gl.constexpr(3)  # query tiles along y
DIV_TZ = gl.constexpr(4)  # query tiles along z (3-D)
HKV_WORD = gl.constexpr(10)  # H_KV itself, after the five pairs


@gluon.jit
def _box_quotient(run, n, DIV: gl.constexpr):
    """n // the launch's divisor DIV (``masks.magic_quotient``)."""
    at = run.shape.seq_ptr + BOX_DIVISION_WORDS + 2 * DIV
    return magic_quotient(n, gl.load(at), gl.load(at + 1))


@gluon.jit
def _box_work(cfg, run, unit):
    """2-D/3-D windows: the ``Work`` of ``unit``, one query tile, in ``schedule.unit_tiles``' order for the launch's
    head groups of G (a K/V head's query heads, tiles outermost inside), taken apart by the launch's division words
    instead of integer divisions (four a unit, on the way to its first S; NOTES v110)."""
    G = run.shape.G
    group = _box_quotient(run, unit, DIV_GROUP)  # (z, K/V head) as z H_KV + hk
    r = unit - group * (G * (run.shape.N_Q // cfg.BLOCK_M))
    m = _box_quotient(run, r, DIV_G)
    i = r - m * G
    z = _box_quotient(run, group, DIV_HKV)
    hk = group - z * gl.load(run.shape.seq_ptr + BOX_DIVISION_WORDS + HKV_WORD)
    one = gl.to_tensor(1)
    zero = gl.to_tensor(0)
    return Work(z, hk * G + i, hk, group * G + i, zero, zero, run.shape.N_Q, run.shape.N_KV, zero, m, m, one,
                cfg.BLOCK_M, cfg.BLOCK_N, False)


@gluon.jit
def _box_origin(run, na, pid_m):
    """``WindowBoxes.tile_origin`` by the launch's division words (its remainder arithmetic written out again here:
    a shared helper moves ptxas' schedule of the 2-D/3-D builds, sm_100a's included, NOTES v110)."""
    tiles_y = gl.cdiv(na.Ly, na.TY)
    if na.DIMS == 3:
        tiles_z = gl.cdiv(na.Lz, na.TZ)
        txy = _box_quotient(run, pid_m, DIV_TZ)
        tx = _box_quotient(run, txy, DIV_TY)
        return tx * na.TX, (txy - tx * tiles_y) * na.TY, (pid_m - txy * tiles_z) * na.TZ
    else:
        tx = _box_quotient(run, pid_m, DIV_TY)
        return tx * na.TX, (pid_m - tx * tiles_y) * na.TY, 0


@gluon.jit
def _load_tile_boxes(cfg, run, descs, kv, c0, c1, c2, unit, w, pid_m, q_it, kv_it):
    """2-D/3-D windows: query tile ``pid_m``'s boxes (one TXC x TY (x TZ) box per consumer, stacked along x), then the
    key blocks its queries attend, row-major over the boxes of the window's key range (``WindowBoxes.blocks``)."""
    na = _box_window(cfg, run)
    x0, y0, z0 = _box_origin(run, na, pid_m)
    _load_q(descs.q, c0, q_it, unit, unit, _box_coords(cfg, na, w.z, w.h, x0, y0, z0), cfg.DYNAMIC, False)
    if cfg.NUM_CONSUMERS >= 2:
        _load_q(descs.q, c1, q_it, unit, unit, _box_coords(cfg, na, w.z, w.h, x0 + cfg.TXC, y0, z0), cfg.DYNAMIC,
                False)
    if cfg.NUM_CONSUMERS == 3:
        _load_q(descs.q, c2, q_it, unit, unit, _box_coords(cfg, na, w.z, w.h, x0 + 2 * cfg.TXC, y0, z0), cfg.DYNAMIC,
                False)
    q_it = q_it.next()
    ox, nx, oy, ny, oz, nz = na.keys(x0, x0 + na.TX - 1, y0, y0 + na.TY - 1, z0, z0 + na.TZ - 1, cfg.BOX_HALO)
    inv_ny, inv_nz = walk_reciprocals(ny, nz)
    for j in range(nx * ny * nz):
        ix, iy, iz = walk_step(j, ny, nz, inv_ny, inv_nz, cfg.NA_DIMS)
        kx0 = ox + ix * cfg.KX
        ky0 = oy + iy * cfg.KY
        kz0 = oz + iz * cfg.KZ
        coords = _box_coords(cfg, na, w.z, w.hk, kx0, ky0, kz0)
        k_buf, k_bar = kv.k.acquire_empty(kv_it)
        tma_load_2d(descs.k, coords, k_bar, k_buf)
        v_buf, v_bar = kv.v.acquire_empty(kv_it)
        if cfg.V_TRANSPOSED:
            # fp8: V^T [Z (3-D: 1), H_KV, D, boxes x BLOCK_N], the lattice's key boxes one after another, each box's
            # keys in its row-major order (``hopper_host._v_box_rows``, then ``fp8_vt``)
            z_v = 0 if cfg.NA_DIMS == 3 else w.z
            n_v = na.block_number(kx0 // cfg.KX, ky0 // cfg.KY, kz0 // cfg.KZ)
            tma_load_2d(descs.v, [z_v, w.hk, 0, n_v * cfg.BLOCK_N], v_bar, v_buf)
        else:
            tma_load_2d(descs.v, coords, v_bar, v_buf)
        kv_it = kv_it.next()
    return q_it, kv_it


@gluon.jit
def _load_q(desc_q, c, q_it, unit, loc, coords, DYNAMIC: gl.constexpr, VARLEN: gl.constexpr):
    """One consumer warpgroup's Q rows into its ring's slot ``q_it`` (with DYNAMIC, the unit's number
    beside them, and packed, where the unit lies: the slot's ready barrier releases all)."""
    q_buf, q_bar = c.q_ring.acquire_empty(q_it)
    if DYNAMIC:
        publish_unit(c.unit_ids, q_it, unit)
        if VARLEN:
            publish_located(c.located, q_it, loc)
    tma_load_2d(desc_q, coords, q_bar, q_buf)


@gluon.jit
def _store_staged(o_buf, o_ptr, desc_o, w, q_row0, VARLEN: gl.constexpr, PADDED: gl.constexpr = False):
    """A warpgroup's O rows from their staging buffer: a TMA store (dense: rows past N_Q are clipped by
    the descriptor), or for a packed sequence's last rows, which the descriptor would not clip at the
    next sequence, masked stores of 16 bytes per thread."""
    if VARLEN and q_row0 + o_buf.shape[0] > w.n_q:
        M: gl.constexpr = o_buf.shape[0]
        D: gl.constexpr = o_buf.shape[1]
        VEC: gl.constexpr = 128 // o_buf.dtype.primitive_bitwidth
        layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // D, D // VEC], [4, 1], [1, 0])
        store_rows(o_buf.load(layout), o_ptr, desc_o, w.z, w.h, w.q_base, q_row0, w.n_q, 0, PADDED)
    else:
        o_view = o_buf.reinterpret(o_buf.dtype, desc_o.block_type.shape, desc_o.layout)
        tma.async_store(desc_o, w.q_coords(q_row0), o_view)


# ---------------------------------------------------------------------------------------------
# The consumers (a warpgroup each): S, softmax, PV, the epilogue
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _consumer_partition(cfg, run, descs, kv, me):
    """A consumer warpgroup's walk over the work units: its program's share (unit = pid + k x grid),
    or with DYNAMIC the units the loader took from the scheduler's counter, read with each unit's
    first Q tile (-1: no more)."""
    q_it = RingIndex.start(me.q_ring.NUM)
    kv_it = RingIndex.start(cfg.KV_STAGES)
    if cfg.PINGPONG and me.WG == 0:
        named_barrier_arrive(0, 256)  # consumer 0 holds the first turn (see ``_kv_loop``)
    if cfg.SUM_MMA and cfg.dtype.primitive_bitwidth == 8:
        _fill_ones(me.ones)  # (16-bit: the one shared tile, written before the partitions split)
    if cfg.DYNAMIC:
        unit = read_unit(me.q_ring, me.unit_ids, q_it, 4)
        while unit >= 0:
            q_it, kv_it = _consumer_unit(cfg, run, kv, me, descs.o, unit, q_it, kv_it)
            unit = read_unit(me.q_ring, me.unit_ids, q_it, 4)
    else:
        for unit in range(gl.program_id(0), run.shape.num_units(), run.num_progs):
            q_it, kv_it = _consumer_unit(cfg, run, kv, me, descs.o, unit, q_it, kv_it)
    tma.store_wait(0)


@gluon.jit
def _consumer_unit(cfg, run, kv, me, desc_o, unit, q_it, kv_it):
    """One work unit (one tile, or a causal pair's two) of one consumer warpgroup: its 64 rows of each
    tile through the K/V ring, then O (and the lse) out. Returns the ring positions."""
    s_row: gl.constexpr = gl.SliceLayout(1, cfg.s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, cfg.o_layout)
    if run.shape.VARLEN and cfg.DYNAMIC:
        # Where the unit lies, as the loader found it (the table's binary search is a chain of global loads).
        w = run.shape.packed_work(read_located(me.located, q_it, 4))
    elif cfg.NA_DIMS >= 2:
        w = _box_work(cfg, run, unit)
    else:
        w = run.shape.work(unit, True)
    for t in range(w.n_tiles):
        pid_m = w.tile(t)
        q_row0 = pid_m * cfg.BLOCK_M + me.WG * cfg.SPLIT_M
        if cfg.NA_DIMS >= 2:
            na = _box_window(cfg, run)
            x0, y0, z0 = _box_origin(run, na, pid_m)
            x0c = x0 + me.WG * cfg.TXC  # this consumer's box
            q = me.q_ring.wait_ready(q_it)
            st, kv_it, n_walk = _window_boxes_walk(cfg, run, kv, me, q, kv_it, w, q_row0, na, x0, y0, z0, x0c)
        elif cfg.WINDOW:
            q = me.q_ring.wait_ready(q_it)
            st, kv_it = _window_blocks_walk(cfg, run, kv, me, q, kv_it, w, pid_m, q_row0)
        else:
            n_blocks = w.kv_blocks(pid_m)
            # Blocks [0, n_unmasked) lie entirely inside the key range and below this warpgroup's diagonal.
            n_unmasked = w.unmasked_blocks(q_row0)
            q = me.q_ring.wait_ready(q_it)

            # Block 0: S_0 and its softmax, no O yet.
            mask = TileMask.dense(q_row0, w.shift, w.n_k, cfg.BLOCK_N, cfg.CAUSAL, cfg.O_DIRECT)
            s, m_i, l_i = _first_s(cfg, kv, q, kv_it)
            if n_unmasked > 0:
                p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, mask, 0, run.qk_scale, False, cfg.SOFTMAX_SUM)
            else:
                p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, mask, 0, run.qk_scale, True, cfg.SOFTMAX_SUM)
            acc = gl.zeros([cfg.SPLIT_M, cfg.V_DIM], gl.float32, cfg.o_layout)
            l_acc = gl.zeros([cfg.SPLIT_M, 8], gl.float32, cfg.l_layout)  # (SUM_MMA only)
            st = Rows(m_i, l_i, acc, l_acc, _pv_carry(p, cfg.dtype, cfg.p_layout, cfg.V_TRANSPOSED))

            mid = gl.maximum(n_unmasked, 1)
            st, kv_it = _kv_loop(cfg, run, kv, me, q, st, kv_it, 1, mid, mask, False)
            st, kv_it = _kv_loop(cfg, run, kv, me, q, st, kv_it, mid, n_blocks, mask, True)

        # Q is no longer read: let the loader fetch the next tile's half while the last PV runs.
        me.q_ring.release(q_it)
        q_it = q_it.next()
        if cfg.BOX_PAIRS:
            acc = st.acc
            l_acc = st.l_acc
            if n_walk != 2:  # (a two-block tile comes whole, ``_pair_tile``)
                v = kv.v.wait_ready(kv_it)
                acc = warpgroup_mma(st.p_prev, _v_b(cfg, v), st.acc)
                kv.v.release(kv_it)
                kv_it = kv_it.next()
        else:
            v = kv.v.wait_ready(kv_it)
            p_op = _pv_a(st.p_prev, cfg.dtype, cfg.p_layout, cfg.V_TRANSPOSED)
            acc = warpgroup_mma(p_op, _v_b(cfg, v), st.acc)
            l_acc = st.l_acc
            if cfg.SUM_MMA:
                l_acc = l_acc + warpgroup_mma_wait(0, deps=[_row_sum_mma(p_op, me.ones, l_acc, cfg.pl_layout)])
            kv.v.release(kv_it)
            kv_it = kv_it.next()

        if cfg.SUM_MMA:
            # Every column of l_acc holds the row's sum; the max reads one without a float sum's rounding.
            l_o = gl.convert_layout(gl.max(l_acc, 1), o_row)
        else:
            l_o = gl.convert_layout(st.l_i, o_row)
        # Rows that see no key (causal with N_Q > N_KV, an empty key sequence) have l = 0: output 0.
        o = (acc * gl.expand_dims(gl.where(l_o > 0, run.o_scale / l_o, 0.0), 1)).to(cfg.out_dtype)
        if cfg.O_DIRECT or cfg.COMBINE:  # (COMBINE: plain stores, which its counter's fences order)
            store_rows(o, run.o_ptr, desc_o, w.z, w.h, w.q_base, q_row0, w.n_q, 0, cfg.PADDED)
        else:
            # Stage in shared memory and TMA-store (dense: rows past N_Q are clipped by the descriptor);
            # wait for the previous tile's store before overwriting the staging buffer.
            tma.store_wait(0)
            if cfg.V_DIM < cfg.HEAD_DIM:  # (the columns past v's head dim are clipped by the descriptor)
                me.o_buf.slice(0, cfg.V_DIM, dim=1).store(o)
            else:
                me.o_buf.store(o)
            fence_async_shared()
            if cfg.NA_DIMS >= 2:  # (the box's rows past the grid are clipped by the descriptor)
                tma.async_store(desc_o, _box_coords(cfg, na, w.z, w.h, x0c, y0, z0), block_view(me.o_buf, desc_o))
            else:
                _store_staged(me.o_buf, run.o_ptr, desc_o, w, q_row0, run.shape.VARLEN, cfg.PADDED)
        if cfg.RETURN_LSE:
            lse = (st.m_i + gl.log2(st.l_i)) * LN2
            if cfg.NA_DIMS >= 2:
                na.store_lse(run.lse_ptr, w, x0c, y0, z0, lse, s_row)
            else:
                rows = q_row0 + gl.arange(0, cfg.SPLIT_M, s_row)
                gl.store(run.shape.lse_row(run.lse_ptr, w) + rows, lse, mask=rows < w.n_q)
        if cfg.COMBINE:
            _combine_parts(cfg, run, desc_o, w)
    return q_it, kv_it


@gluon.jit
def _combine_parts(cfg, run, desc_o, w):
    """COMBINE (decode's chunks: unit (split w.z, K/V head w.h) of [splits, Z * H_KV, rows, D] views): this
    warpgroup's part is stored; it arrives at its K/V head's counter, and the warpgroup that arrives last (every
    warpgroup of every split before it) combines the head's parts into the output, as ``decode._combine_kernel``
    does: out = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s, row by row, the output's rows those of a
    contiguous [Z, H, N_Q, D] (row (K/V head, group, query)). The arrival is the CUDA guide's last-block pattern: every
    thread fences its stores at GPU scope, the warpgroup meets at a barrier, one thread adds 1 with acq_rel (a scalar
    atomic, its result broadcast), and the last warpgroup's threads fence again before reading the others' parts."""
    gl.inline_asm("fence.acq_rel.gpu;")
    gl.barrier()
    splits = run.shape.num_hz // run.shape.H
    arrived = gl.atomic_add(run.shape.seq_ptr + w.h, 1, sem="acq_rel", scope="gpu")
    if arrived == splits * cfg.NUM_CONSUMERS - 1:
        gl.inline_asm("fence.acq_rel.gpu;")
        D: gl.constexpr = cfg.V_DIM
        ROWS: gl.constexpr = 16
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [4, 1], [1, 0])
        col = gl.arange(0, D, gl.SliceLayout(0, layout))
        st = desc_o.strides
        part_step = st[0] // 8 * 8  # (a split's parts; the strides are multiples of 8 elements, ``store_rows``)
        row_step = st[2] // 8 * 8
        head = run.o_ptr + w.h.to(gl.int64) * (st[1] // 8 * 8)
        out_head = run.sched_ptr.to(gl.pointer_type(cfg.out_dtype), bitcast=True) + w.h.to(gl.int64) * w.n_q * D
        lse_head = run.lse_ptr + w.h.to(gl.int64) * w.n_q
        lse_step = run.shape.H.to(gl.int64) * w.n_q
        for r0 in range(0, w.n_q, ROWS):
            rows = r0 + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
            keep = rows < w.n_q
            m = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, layout))
            total = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, layout))
            acc = gl.zeros([ROWS, D], gl.float32, layout)
            for s in range(0, splits):
                lse_s = gl.load(lse_head + s * lse_step + rows, mask=keep, other=0.0)
                o_s = gl.load(head + s * part_step + gl.expand_dims(rows.to(gl.int64) * row_step, 1)
                              + gl.expand_dims(col, 0), mask=gl.expand_dims(keep, 1), other=0.0)
                m_new = gl.maximum(m, lse_s)  # (every chunk's row saw keys: finite)
                alpha = gl.exp(m - m_new)
                p = gl.exp(lse_s - m_new)
                acc = acc * gl.expand_dims(alpha, 1) + o_s.to(gl.float32) * gl.expand_dims(p, 1)
                total = total * alpha + p
                m = m_new
            out = (acc / gl.expand_dims(total, 1)).to(cfg.out_dtype)
            gl.store(out_head + gl.expand_dims(rows.to(gl.int64) * D, 1) + gl.expand_dims(col, 0), out,
                     mask=gl.expand_dims(keep, 1))


@gluon.constexpr_function
def _pow2_floor(n):
    return 1 << (_value(n).bit_length() - 1)


@gluon.jit
def reduce_d(a, b, zeros, DIM: gl.constexpr, HEAD_DIM: gl.constexpr, IS_ASYNC: gl.constexpr = True):
    """A [rows, D] tile times another's transpose (S = Q K^T; the backward's S^T = K Q^T, dP^T = V dO^T) over their
    first DIM head dims, a wgmma token (IS_ASYNC) or the result: all of the kernel's HEAD_DIM, or a padded head dim's
    own in power-of-two pieces of the same tiles (96 = 64 + 32, 192 = 128 + 64, 32; v's 128 of the 192/128 pair), so
    that the zero columns past it take no k-steps."""
    if DIM == HEAD_DIM:
        out = warpgroup_mma(a, b.permute((1, 0)), zeros, use_acc=False, is_async=IS_ASYNC)
    else:
        A: gl.constexpr = _pow2_floor(DIM)
        out = warpgroup_mma(a.slice(0, A, dim=1), b.slice(0, A, dim=1).permute((1, 0)), zeros, use_acc=False,
                            is_async=True)
        if DIM > A:
            out = warpgroup_mma(a.slice(A, DIM - A, dim=1), b.slice(A, DIM - A, dim=1).permute((1, 0)), out,
                                is_async=True)
        if not IS_ASYNC:
            out = warpgroup_mma_wait(0, deps=[out])
    return out


@gluon.jit
def _qk(cfg, q, k, IS_ASYNC: gl.constexpr, kv, it):
    """S = Q K^T over q's and k's head dim (``reduce_d``), or IS_ASYNC its wgmma token."""
    zeros = gl.zeros([cfg.SPLIT_M, cfg.BLOCK_N], gl.float32, cfg.s_layout)
    if cfg.K_CHUNKS == 1:
        return reduce_d(q, k, zeros, cfg.QK_DIM, cfg.HEAD_DIM, IS_ASYNC)
    else:  # (PAIR_TILE: Q's columns against each of K's pieces)
        s = zeros
        for c in gl.static_range(cfg.K_CHUNKS):
            s = warpgroup_mma(q.slice(c * cfg.K_COLS, cfg.K_COLS, dim=1), _k_piece(cfg, k, kv, it, c).permute((1, 0)),
                              s, use_acc=c > 0, is_async=True)
        if not IS_ASYNC:
            s = warpgroup_mma_wait(0, deps=[s])
        return s


@gluon.jit
def _first_s(cfg, kv, q, kv_it):
    """A tile's first S = Q K^T (its K slot released), and the running max and sum before any block."""
    s_row: gl.constexpr = gl.SliceLayout(1, cfg.s_layout)
    k = kv.k.wait_ready(kv_it)
    s = _qk(cfg, q, k, False, kv, kv_it)
    kv.k.release(kv_it)
    m_i = gl.full([cfg.SPLIT_M], -float("inf"), gl.float32, s_row)
    l_i = gl.full([cfg.SPLIT_M], 0.0, gl.float32, s_row)
    return s, m_i, l_i


@gluon.jit
def _first_block(cfg, run, kv, q, kv_it, mask, j):
    """WINDOW: a tile's first key block (block j of ``mask``), masked: S and its softmax, no O yet (the dense walk
    chooses its block 0's mask at run time, in ``_consumer_unit``). Returns the tile's running state (``Rows``) and
    the ring position, which still holds this block's V."""
    s, m_i, l_i = _first_s(cfg, kv, q, kv_it)
    p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, mask, j, run.qk_scale, True, cfg.SOFTMAX_SUM)
    acc = gl.zeros([cfg.SPLIT_M, cfg.V_DIM], gl.float32, cfg.o_layout)
    l_acc = gl.zeros([cfg.SPLIT_M, 8], gl.float32, cfg.l_layout)  # (SUM_MMA only)
    return Rows(m_i, l_i, acc, l_acc, _pv_carry(p, cfg.dtype, cfg.p_layout, cfg.V_TRANSPOSED)), kv_it


@gluon.jit
def _window_blocks_walk(cfg, run, kv, me, q, kv_it, w, pid_m, q_row0):
    """WINDOW: one consumer's rows of a tile over the tile's key blocks [lo, hi) (what the loader loads): the first
    block and the blocks before and after the ones all of this warpgroup's rows attend wholly are masked."""
    win_k, win_s = window_words(run.shape.seq_ptr)
    t0 = pid_m * cfg.BLOCK_M
    lo, hi, _, _ = window_blocks(t0, t0 + cfg.BLOCK_M - 1, w.n_k, win_k, win_s, cfg.BLOCK_N, cfg.WINDOW)
    _, _, ulo, uhi = window_blocks(q_row0, q_row0 + cfg.SPLIT_M - 1, w.n_k, win_k, win_s, cfg.BLOCK_N, cfg.WINDOW)
    mask = TileMask.window(q_row0, w.shift, w.n_k, win_k, win_s, cfg.BLOCK_N, cfg.WINDOW)
    st, kv_it = _first_block(cfg, run, kv, q, kv_it, mask, lo)
    a = gl.minimum(gl.maximum(ulo, lo + 1), hi)
    b = gl.maximum(gl.minimum(uhi, hi), a)
    st, kv_it = _kv_loop(cfg, run, kv, me, q, st, kv_it, lo + 1, a, mask, True)
    st, kv_it = _kv_loop(cfg, run, kv, me, q, st, kv_it, a, b, mask, False)
    st, kv_it = _kv_loop(cfg, run, kv, me, q, st, kv_it, b, hi, mask, True)
    return st, kv_it


@gluon.jit
def _window_boxes_walk(cfg, run, kv, me, q, kv_it, w, q_row0, na, x0, y0, z0, x0c):
    """2-D/3-D windows: one consumer's box of a tile over the tile's key blocks (what ``_load_tile_boxes`` loads),
    each masked unless all of this consumer's queries attend all of its keys (``TileMask.apply``)."""
    ox, nx, oy, ny, oz, nz = na.keys(x0, x0 + na.TX - 1, y0, y0 + na.TY - 1, z0, z0 + na.TZ - 1, cfg.BOX_HALO)
    ulo_x, uhi_x, ulo_y, uhi_y, ulo_z, uhi_z = na.unmasked(x0c, x0c + cfg.TXC - 1, y0, y0 + na.TY - 1, z0,
                                                           z0 + na.TZ - 1, ox, oy, oz)
    walk = WalkBoxes.of(ox, oy, oz, ny, nz, ulo_x, uhi_x, ulo_y, uhi_y, ulo_z, uhi_z, x0c, y0, z0)
    rows = BoxRows.of(na, x0c, y0, z0, cfg.SPLIT_M, cfg.TY, cfg.TZ, gl.SliceLayout(1, cfg.s_layout))
    mask = TileMask.boxes(rows, walk, cfg.KX, cfg.KY, cfg.KZ, cfg.WINDOW)
    n = nx * ny * nz
    if cfg.BOX_PAIRS:  # (a static branch: fp8's P cannot take ``_pair_tile``'s operands, so it is never traced)
        if n == 2:
            st, kv_it = _pair_tile(cfg, run, kv, q, kv_it, mask)
        else:
            st, kv_it = _first_block(cfg, run, kv, q, kv_it, mask, 0)
            st, kv_it = _kv_loop(cfg, run, kv, me, q, st, kv_it, 1, n, mask, True)
    else:
        st, kv_it = _first_block(cfg, run, kv, q, kv_it, mask, 0)
        st, kv_it = _kv_loop(cfg, run, kv, me, q, st, kv_it, 1, n, mask, True)
    return st, kv_it, n


@gluon.jit
def _pair_tile(cfg, run, kv, q, kv_it, mask):
    """BOX_PAIRS: a tile of two key blocks (the small windows' 64-row tiles are two to four), whole: both S issued
    before the first is waited for, one row max over the two (so O has nothing to rescale), both PV issued back to
    back. One block at a time the tile's chain held S_1's wait between the softmaxes and PV_0's before the last.
    Returns the tile's final state (``Rows``: O, the row max and sum) and the ring past block 1."""
    it1 = kv_it.next()
    k0 = kv.k.wait_ready(kv_it)
    t0 = _qk(cfg, q, k0, True, kv, kv_it)
    k1 = kv.k.wait_ready(it1)
    t1 = _qk(cfg, q, k1, True, kv, it1)
    s0 = warpgroup_mma_wait(1, deps=[t0])
    kv.k.release(kv_it)
    s0 = mask.apply(s0, 0, True)
    m0 = gl.max(s0, 1)
    s1 = warpgroup_mma_wait(0, deps=[t1])
    kv.k.release(it1)
    s1 = mask.apply(s1, 1, True)
    m_i = gl.maximum(m0, gl.max(s1, 1)) * run.qk_scale
    m_exp = gl.expand_dims(gl.where(m_i == -float("inf"), 0.0, m_i), 1)
    p0 = gl.exp2(s0 * run.qk_scale - m_exp)
    p1 = gl.exp2(s1 * run.qk_scale - m_exp)
    l_i = gl.sum(p0, 1) + gl.sum(p1, 1)
    p1 = _pv_carry(p1, cfg.dtype, cfg.p_layout, False)  # (16-bit: the operand itself)
    v0 = kv.v.wait_ready(kv_it)
    acc = warpgroup_mma(_pv_carry(p0, cfg.dtype, cfg.p_layout, False), _v_b(cfg, v0),
                        gl.zeros([cfg.SPLIT_M, cfg.V_DIM], gl.float32, cfg.o_layout), use_acc=False, is_async=True)
    v1 = kv.v.wait_ready(it1)
    acc = warpgroup_mma(p1, _v_b(cfg, v1), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    kv.v.release(kv_it)
    kv.v.release(it1)
    l_acc = gl.zeros([cfg.SPLIT_M, 8], gl.float32, cfg.l_layout)  # (SUM_MMA only)
    return Rows(m_i, l_i, acc, l_acc, p1), it1.next()


@gluon.jit
def _kv_loop(cfg, run, kv, me, q, st, kv_it, lo, hi, mask, MASKED: gl.constexpr):
    """Blocks j in [lo, hi): S_j = Q K_j^T, softmax, O += P_{j-1} V_{j-1}. ``kv_it`` points at block
    j-1's K/V slot (its V is still to be used); P_{j-1} arrives in ``st.p_prev`` (see ``_pv_a``). S_j is
    masked by ``mask`` (a ``TileMask``) if MASKED.
    With SUM_MMA the row sums accumulate in ``st.l_acc`` (64 x 8 fp32, every column alike; see
    ``_row_sum_mma``), and the softmax's own only with SOFTMAX_SUM."""
    m_i, l_i, acc, l_acc, p_prev = st.m_i, st.l_i, st.acc, st.l_acc, st.p_prev
    for j in range(lo, hi):
        kv_next = kv_it.next()
        # Issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back; the softmax of S_j then runs
        # while the PV wgmma is still in flight.
        k = kv.k.wait_ready(kv_next)
        v = kv.v.wait_ready(kv_it)
        if cfg.PINGPONG:
            # This warpgroup's turn: named barrier WG completes when the previous warpgroup in the cycle has
            # arrived there (bar.arrive, after issuing its GEMMs) and this one syncs (128 + 128 threads).
            named_barrier_sync(me.WG, 256)
        # (Written before S_j is issued; ptxas still places fp8's converts between S_j's first
        # and second wgmma, where they overlap that GEMM.)
        p_op = _pv_a(p_prev, cfg.dtype, cfg.p_layout, cfg.V_TRANSPOSED)
        s_tok = _qk(cfg, q, k, True, kv, kv_next)
        if cfg.SUM_MMA:
            # P_{j-1}'s row sums between S_j and PV_{j-1}: landed with S_j, so that one wait is left
            # in flight during the softmax, PV's, as without the knob.
            l_tok = _row_sum_mma(p_op, me.ones, l_acc, cfg.pl_layout)
        o_tok = warpgroup_mma(p_op, _v_b(cfg, v), acc, is_async=True)
        if cfg.PINGPONG:
            # The next warpgroup may issue its GEMMs now; this one turns to its softmax.
            named_barrier_arrive((me.WG + 1) % cfg.NUM_CONSUMERS, 256)
        # S_j's group (and the row sums') are the oldest in flight: PV_{j-1} may go on.
        if cfg.SUM_MMA:
            s, l_blk = warpgroup_mma_wait(1, deps=[s_tok, l_tok])
            l_acc = l_acc + l_blk
        else:
            s = warpgroup_mma_wait(1, deps=[s_tok])
        kv.k.release(kv_next)
        p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, mask, j, run.qk_scale, MASKED, cfg.SOFTMAX_SUM)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        kv.v.release(kv_it)
        acc = _rescale(acc, alpha)
        if cfg.SUM_MMA:
            l_acc = _rescale(l_acc, alpha)
        p_prev = _pv_carry(p, cfg.dtype, cfg.p_layout, cfg.V_TRANSPOSED)
        kv_it = kv_next
    return Rows(m_i, l_i, acc, l_acc, p_prev), kv_it


# ---------------------------------------------------------------------------------------------
# Softmax and P-operand pieces
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _softmax_block(s, m_i, l_i, mask, j, qk_scale, MASKED: gl.constexpr, SUM: gl.constexpr = True):
    """Online-softmax step on one S block (fp32, log2 domain, scale folded into the exp2 argument).
    Returns P (unnormalised), the rescale factor alpha for O, and the new running max and sum (without
    SUM ``l_i`` passes through: the sum is a wgmma's, see ``_row_sum_mma``).
    Only blocks that cross the key tail, the diagonal or a window's edge are MASKED (block j of the tile's
    ``masks.TileMask``); there a row may have seen no key yet (max -inf), and its exponentials use 0 as the
    max so that they come out 0, not NaN."""
    s = mask.apply(s, j, MASKED)
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_exp = m_new
    if MASKED:
        m_exp = gl.where(m_new == -float("inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_exp, 1))
    alpha = gl.exp2(m_i - m_exp)
    if SUM:
        l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


def _fp8x4_from_f16_asm(cvt: str) -> str:
    # Two f16x2 registers (values 0,1 and 2,3, value 0 in the low half) -> one register of four fp8 bytes.
    return f"{{ .reg .b16 lo, hi; {cvt} lo, $1; {cvt} hi, $2; mov.b32 $0, {{lo, hi}}; }}"


_FP8X4_ASM_E4M3 = gl.constexpr(_fp8x4_from_f16_asm("cvt.rn.satfinite.e4m3x2.f16x2"))
_FP8X4_ASM_E5M2 = gl.constexpr(_fp8x4_from_f16_asm("cvt.rn.satfinite.e5m2x2.f16x2"))


@gluon.jit
def _paired_16bit(p, dtype: gl.constexpr):
    """fp32 -> fp16/bf16, one paired convert per register (keys 2c, 2c+1: the first in the low half,
    as the A operand holds them). Through ``.to`` the compiler converted each value alone and paired
    them the other way round: a PRMT half-swap per register on the path to every PV wgmma."""
    if dtype == gl.float16:
        return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.float16,
                                         is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)


@gluon.jit
def _fp8_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr):
    """fp8 P, carried as f16 pairs (see ``_pv_carry``) -> the A operand of the PV wgmma, four keys per
    register by two paired inline converts.

    The A operand wants 4 consecutive keys per thread where the accumulator holds keys
    {2c, 2c+1, 2c+8, 2c+9} of each 16: converting would shuffle bytes between threads. Instead the
    keys of P are *renamed* (a register relabelling, no data movement) and V^T's columns were
    permuted the same way on the host (``v_transpose.fp8_vt``), so the PV product is unchanged; after
    the relabelling each register pair is the operand's register as it stands."""
    SPLIT_M: gl.constexpr = p.shape[0]
    BLOCK_N: gl.constexpr = p.shape[1]
    pr = p.reshape([SPLIT_M, BLOCK_N // 16, 2, 4, 2]).permute((0, 1, 3, 2, 4)).reshape([SPLIT_M, BLOCK_N])
    pr = gl.convert_layout(pr, p_layout, assert_trivial=True)
    if dtype == gl.float8e4nv:
        return gl.inline_asm_elementwise(_FP8X4_ASM_E4M3, "=r,r,r", [pr], dtype=gl.float8e4nv, is_pure=True, pack=4)
    else:
        return gl.inline_asm_elementwise(_FP8X4_ASM_E5M2, "=r,r,r", [pr], dtype=gl.float8e5, is_pure=True, pack=4)


@gluon.jit
def _pv_carry(p, dtype: gl.constexpr, p_layout: gl.constexpr, KEYS_PERMUTED: gl.constexpr):
    """What the loop carries from the softmax of block j to the PV wgmma of block j. 16-bit: the
    operand itself (paired converts). fp8: P as f16 pairs, packed to fp8 by ``_pv_a`` right before
    the wgmma: carried across the loop edge as fp8, the operand is split into single bytes and packed
    again (PRMT/LOP3/SHF per register); packed next to its use, the register goes straight into the
    wgmma. f16 pairs rather than fp32: half the registers, and 16-bit halves cross the edge as whole
    registers. The second rounding (fp16, then fp8) can differ from a direct one by one fp8 unit in the
    last place, at exact fp8 midpoints only."""
    if KEYS_PERMUTED:
        return _paired_16bit(p, gl.float16)
    else:
        return gl.convert_layout(_paired_16bit(p, dtype), p_layout, assert_trivial=True)


@gluon.jit
def _pv_a(p_prev, dtype: gl.constexpr, p_layout: gl.constexpr, KEYS_PERMUTED: gl.constexpr):
    """The A operand of the PV wgmma from what ``_pv_carry`` kept."""
    if KEYS_PERMUTED:
        return _fp8_operand(p_prev, dtype, p_layout)
    else:
        return p_prev


@gluon.jit
def _rescale(acc, alpha):
    """O *= alpha per row (alpha comes in the S accumulator's row layout)."""
    return acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)


@gluon.jit
def _v_b(cfg, v_buf):
    """PV's B operand: V's tile, or its first V_DIM columns (the 192/128 pair's v head dim in the D=256 kernel)."""
    if cfg.V_DIM < cfg.HEAD_DIM:
        v_buf = v_buf.slice(0, cfg.V_DIM, dim=0 if cfg.V_TRANSPOSED else 1)
    return _v_operand(v_buf, cfg.V_TRANSPOSED)


@gluon.jit
def _v_operand(v_buf, V_TRANSPOSED: gl.constexpr):
    # wgmma's B operand is [K, N] = [BLOCK_N, D]. fp8 needs it K-major, so V arrives as V^T tiles
    # [D, BLOCK_N] and is read through a permuted view; 16-bit V is used as stored.
    if V_TRANSPOSED:
        return v_buf.permute((1, 0))
    else:
        return v_buf


# Row sums on the tensor cores (SUM_MMA): a block's P 1 as a 64 x 8 wgmma against a tile of ones in
# shared memory, issued between the S and PV wgmmas with PV's A registers. The softmax then has no row-sum
# adds (64 FADD per thread and 128-key block, about one in seven of fp8's instructions in the loop) for a
# GEMM 1/16 the size of PV; l sums the P that multiplies V (fp8: as rounded). Each block's sum starts
# from zero and is added to l in registers (``l_acc``, rescaled with O): an fp8 wgmma accumulates with
# fewer mantissa bits than fp32, and l, growing over thousands of keys, came out up to 60% low when the
# wgmma carried it (N_CTX=32768; O, whose terms cancel, is not affected alike).
@gluon.jit
def _row_sum_mma(p_op, ones, l_acc, pl_layout: gl.constexpr):
    """This block's row sums (64 x 8, started from zero; ``l_acc`` gives the shape and layout)."""
    a = gl.convert_layout(p_op, pl_layout, assert_trivial=True)
    return warpgroup_mma(a, ones.permute((1, 0)), gl.zeros_like(l_acc), use_acc=False, is_async=True)


@gluon.jit
def _fill_ones(ones):
    """Write 1.0 over a [R, C] tile (one warpgroup) for ``_row_sum_mma`` to read. fp8 goes in as
    f16 words holding two fp8 ones each (0x3838): the byte pattern of the swizzled tile is the same for
    any element width, and a direct fp8 store left the tile wrong on the GPU (the row sums came out
    wrong with it and right with V's tile in its place)."""
    R: gl.constexpr = ones.shape[0]
    C: gl.constexpr = ones.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    if ones.dtype.primitive_bitwidth == 8:
        ONE_PAIR: gl.constexpr = 0.52734375 if ones.dtype == gl.float8e4nv else 1.05859375  # f16 0x3838 / 0x3C3C
        words = ones.reinterpret(gl.float16, [R, C // 2],
                                  gl.NVMMASharedLayout.get_default_for([R, C // 2], gl.float16))
        words.store(gl.full([R, C // 2], ONE_PAIR, gl.float16, layout))
    else:
        ones.store(gl.full([R, C], 1.0, ones.dtype, layout))
    fence_async_shared()
