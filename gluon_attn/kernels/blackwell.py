"""Persistent, warp-specialized attention forward for Blackwell (sm_100a): TMA + tcgen05 + tensor memory,
scheduled by cluster launch control, in clusters of 1, 2 or 4 CTAs.

A cluster owns a query tile of two halves; a half is 128 rows per CTA (the M of one tcgen05 MMA). With one
CTA a half is 128 rows. With 2 (or 4) CTAs a half is 256 (512) rows: each CTA pair issues its S = Q K^T and
O += P V as one two-CTA tcgen05 MMA (``cta_group::2``, M = 256) from the pair's leader, each CTA holding its
own 128 rows of Q, S, P and O, half of each K tile's keys and half of each V tile's columns; the two pairs of a
4-CTA cluster share K and V through multicast TMA loads. Clusters run non-causal dense problems; causal and
packed problems take one CTA (the key ranges of a cluster's rows would differ).

Partitions (``gl.warp_specialize``), each a named function:
  * ``_correction_partition`` (default, 4 warps): rescales O_h in tensor memory by alpha between the
    PV MMAs (packed FP32x2 ``mul2``), normalises O at the end of a tile and stages it in shared memory;
  * ``_load_partition`` (1 warp): TMA loads of the two Q halves and of K, V through one ring;
  * ``_mma_partition`` (1 warp): issues S_h = Q_h K^T and O_h += P_h V with ``tcgen05_mma``,
    interleaving the halves so one half's softmax overlaps the other half's MMAs;
  * ``_softmax_partition`` x2 (4 warps each, one per half): S from tensor memory, online exp2
    softmax (its arguments by packed FP32x2 ``fma2``), P written back over S (reinterpreted to the input
    dtype), alpha and l_i written to spare columns of the same S buffer for the correction partition; the
    logsumexp of a tile's rows at its end;
  * ``_epilogue_partition`` (1 warp): TMA stores of O (a packed sequence's last rows: masked stores);
  * ``_schedule_partition`` (1 warp): the work units, from cluster launch control (``Scheduler``), handed to
    the other six (``UnitRing``).

The schedule is dynamic: the grid has one cluster per work unit, each cluster starts with its own unit, and
the schedule partition asks the hardware (``clusterlaunchcontrol.try_cancel``) for a cluster that has not
started yet, whose unit this cluster then takes (one launch holds the SMs, the units go to whoever finishes
first). Every handshake is a ``channels.Signal`` slot (shared-memory buffers: ``Ring``, tensor-memory buffers:
``TmemRing``, barrier-only: ``Signal``) with index and phase carried in ``RingIndex``; a barrier that the CTAs
of a pair share lives in the pair's leader (``_signal``).

No Blackwell GPU was available to this project: this kernel has never run. It is verified by compiling it
for sm_100a and reading its SASS and resources (tests/test_blackwell_compile.py), never by running it.

This module is the device code only (the @gluon.jit functions, aggregates, constexpr helpers and the constants they
read); its host side (``BlackwellConfig`` with sm_100's limits, the tuning lookups, ``plan_launch``, the launch, the
compile-only ``build``) is ``blackwell_host.py``, which imports this module.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (TensorMemoryLayout, allocate_tensor_memory, clc, fma2,
                                                                 mbarrier, mul2, tcgen05_commit, tcgen05_mma,
                                                                 tcgen05_mma_barrier_count,
                                                                 tensor_memory_descriptor_type, tma)
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from .channels import Descs, Ring, RingIndex, Signal, TmemRing, aggregate, block_cols, block_view, opaque
from .masks import (BoxRows, TileMask, WalkBoxes, box_dims, walk_reciprocals, walk_step, window_blocks, window_bounds,
                    window_boxes_load, window_dims, window_words)
from .schedule import Shape, Work
from .naming import kernel_symbol

# One tcgen05 MMA covers 128 rows of a CTA; a tile is two such halves per CTA, each with its own softmax partition.
HALF_ROWS = 128
ROWS_PER_CTA = gl.constexpr(HALF_ROWS)  # the same, for device code
LN2 = gl.constexpr(0.6931471805599453)
SOFTMAX_WARPS = gl.constexpr(4)  # each softmax partition's (``blackwell_host.WORKER_WARPS``)
# setmaxnreg budgets (per thread). The four 1-warp partitions share one warpgroup, which gets the largest of
# their counts; the correction partition (default) gets what the others leave. Under ptxas 13.4 a value that
# lives across the partitions (the thread index) keeps its register only while every partition leaves one
# free: at 24 for the 1-warp ones or 192 for the softmax ones it went to local memory.
LOAD_REGS = gl.constexpr(32)
MMA_REGS = gl.constexpr(32)
EPILOGUE_REGS = gl.constexpr(32)
SCHEDULE_REGS = gl.constexpr(32)
# Units the schedule partition may hand out ahead of the slowest partition that takes them.
UNIT_SLOTS = gl.constexpr(2)
# The partitions that take each unit from the schedule partition: load, mma, softmax x2, correction, epilogue.
UNIT_CONSUMERS = gl.constexpr(6)
# A slot's words: the unit, then its Work's z, h, hk, q_base, k_base, n_q, n_k, first, second, n_tiles.
UNIT_WORDS = gl.constexpr(11)


# ---------------------------------------------------------------------------------------------
# Cluster layouts: which CTA holds which part of a tile
# ---------------------------------------------------------------------------------------------
@gluon.constexpr_function
def _log2(n):
    return int(n).bit_length() - 1


@gluon.constexpr_function
def cluster_bases(num_ctas):
    """CTA bases of a [rows, cols] tile (Q, S, P, O, their row statistics): each CTA its own 128 rows. With 4
    CTAs, CTAs 0-1 and 2-3 are the two-CTA MMA pairs."""
    return [[1 << i, 0] for i in range(_log2(num_ctas))]


@gluon.constexpr_function
def k_bases(num_ctas):
    """A K tile [keys, D] (the B operand of S = Q K^T, transposed): the CTAs of a pair take half of the keys
    each; the pairs of a 4-CTA cluster take the same keys (broadcast: one multicast load)."""
    n = _log2(num_ctas)
    return [[1, 0]] + [[0, 0]] * (n - 1) if n else []


@gluon.constexpr_function
def v_bases(num_ctas):
    """A V tile [keys, D] (the B operand of O += P V): the CTAs of a pair take half of the columns each;
    the pairs take the same columns."""
    n = _log2(num_ctas)
    return [[0, 1]] + [[0, 0]] * (n - 1) if n else []


@gluon.constexpr_function
def replicated_bases(num_ctas, rank=1):
    """Every CTA its own copy (scheduler words, a barrier the CTAs share through their leader)."""
    return [[0] * int(rank)] * _log2(num_ctas)


@gluon.constexpr_function
def descriptor_bases(bases):
    """The bases of a [rows, cols] tile for the [1, 1, rows, cols] block of a [Z, H, N, D] descriptor."""
    return [[0, 0] + list(b) for b in bases]


@gluon.constexpr_function
def tmem_layout(cols, num_ctas, col_stride=1):
    """Tensor memory of a [128 * num_ctas, cols] tile: 128 lanes of each CTA, two-CTA when the CTAs pair."""
    return TensorMemoryLayout([HALF_ROWS, int(cols)], col_stride=col_stride, cga_layout=cluster_bases(num_ctas),
                              two_ctas=int(num_ctas) > 1)


@gluon.constexpr_function
def get_tmem_reg_layout(dtype, cols, num_ctas, num_warps):
    """The register layout of a tcgen05.ld/st (32x32b) of a [128 * num_ctas, cols] tensor-memory tile over
    ``num_warps``: thread i of a CTA holds its row i."""
    shape = [HALF_ROWS * int(num_ctas), int(cols)]
    ty = tensor_memory_descriptor_type(dtype, shape, tmem_layout(cols, num_ctas), shape)
    return ty.get_reg_layout(num_warps=num_warps)


@gluon.constexpr_function
def _stat_reg_layout(num_warps, num_ctas):
    # Tensor-memory lane i is thread i: one row per thread, as the 32x32b TMEM messages move data.
    return gl.BlockedLayout([1, 1], [32, 1], [num_warps, 1], [0, 1], cga_layout=cluster_bases(num_ctas))


@gluon.constexpr_function
def _word_layouts(num_warps, num_ctas):
    """(shared, register) layouts of one int32 scheduler word: a copy per CTA, every thread the same value."""
    bases = replicated_bases(num_ctas)
    return (gl.SwizzledSharedLayout(1, 1, 1, [0], cga_layout=bases),
            gl.BlockedLayout([1], [32], [num_warps], [0], cga_layout=bases))


@aggregate
class Cfg:
    """Every partition's view of the launch: the problem's sizes (``schedule.Shape``), the scales and outputs,
    and every compile-time choice of the build."""
    shape: Shape
    qk_scale: gl.tensor
    o_scale: gl.tensor
    lse_ptr: gl.tensor
    o_ptr: gl.tensor  # VARLEN: the packed [total, H, D] output, for the masked store of a sequence's last tile
    dtype: gl.constexpr
    BLOCK_M: gl.constexpr  # query rows of a cluster's tile: 2 halves of M
    M: gl.constexpr  # rows of a half over the cluster: 128 per CTA
    BLOCK_N: gl.constexpr
    CAUSAL: gl.constexpr
    SPLIT_D: gl.constexpr  # column chunks the correction partition works O in
    RETURN_LSE: gl.constexpr
    NUM_CTAS: gl.constexpr
    PADDED: gl.constexpr  # tensors' head dim < the build's (``blackwell_host.kernel_head_dim``): register stores clip
    WINDOW: gl.constexpr  # neighborhood attention (the Hopper forward's WINDOW modes): 1, 2 rows; 4-7 2-D, 8-15 3-D
    NA_DIMS: gl.constexpr  # the WINDOW mode's spatial dimensions (0 none)
    TX: gl.constexpr  # 2-D/3-D windows: the tile's box (its halves along x) and a key block's box
    TY: gl.constexpr
    TZ: gl.constexpr
    KX: gl.constexpr
    KY: gl.constexpr
    KZ: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, shape, qk_scale, o_scale, lse_ptr, o_ptr, dtype, BLOCK_M, BLOCK_N, CAUSAL, SPLIT_D, RETURN_LSE,
                 NUM_CTAS, PADDED=False, WINDOW=0, q_box=(1, 1, 1), k_box=(1, 1, 1)):
        self.shape = shape
        self.qk_scale = qk_scale
        self.o_scale = o_scale
        self.lse_ptr = lse_ptr
        self.o_ptr = o_ptr
        self.dtype = gl.constexpr(dtype)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.M = gl.constexpr(BLOCK_M // 2)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.SPLIT_D = gl.constexpr(SPLIT_D)
        self.RETURN_LSE = gl.constexpr(RETURN_LSE)
        self.NUM_CTAS = gl.constexpr(NUM_CTAS)
        self.PADDED = gl.constexpr(PADDED)
        self.WINDOW = gl.constexpr(WINDOW)
        self.NA_DIMS = gl.constexpr(window_dims(WINDOW))
        self.TX = gl.constexpr(2 * q_box[0])  # (q_box: a half's, the descriptor's block)
        self.TY = gl.constexpr(q_box[1])
        self.TZ = gl.constexpr(q_box[2])
        self.KX = gl.constexpr(k_box[0])
        self.KY = gl.constexpr(k_box[1])
        self.KZ = gl.constexpr(k_box[2])

    @gluon.jit
    def localized(self):
        """The config with the launch's sizes through ``opaque``, for a partition to derive its own values from."""
        sh = self.shape
        shape = Shape(opaque(sh.N_Q), opaque(sh.N_KV), sh.num_hz, sh.H, sh.G, opaque(sh.group_hz), sh.seq_ptr,
                      opaque(sh.n_seqs), sh.BLOCK_M, sh.BLOCK_N, sh.CAUSAL, sh.VARLEN, sh.SINGLES)
        return Cfg(shape, self.qk_scale, self.o_scale, self.lse_ptr, self.o_ptr, self.dtype, self.BLOCK_M,
                   self.BLOCK_N, self.CAUSAL, self.SPLIT_D, self.RETURN_LSE, self.NUM_CTAS, self.PADDED, self.WINDOW,
                   (self.TX // 2, self.TY, self.TZ), (self.KX, self.KY, self.KZ))

    @gluon.jit
    def tile_blocks(self, w, pid_m):
        """The key blocks tile ``pid_m`` visits, [lo, hi): all up to its last key (causal: its diagonal), or with
        WINDOW those its rows' windows reach (``masks.window_blocks``; kernel size and stride at seq_ptr); 2-D/3-D
        windows: the count of the key boxes its queries' windows reach (``tile_boxes``), from 0."""
        if self.NA_DIMS >= 2:
            _, nx, _, ny, _, nz, _, _, _ = self.tile_boxes(pid_m)
            return gl.to_tensor(0), nx * ny * nz
        elif self.WINDOW:
            win_k, win_s = window_words(self.shape.seq_ptr)
            t0 = pid_m * self.BLOCK_M
            lo, hi, _, _ = window_blocks(t0, t0 + self.BLOCK_M - 1, w.n_k, win_k, win_s, self.BLOCK_N, self.WINDOW)
            return lo, hi
        else:
            return gl.to_tensor(0), w.kv_blocks(pid_m)

    @gluon.jit
    def boxes(self):
        """2-D/3-D windows: the launch's ``masks.WindowBoxes`` (words at seq_ptr, the tile's and key block's boxes)."""
        return window_boxes_load(self.shape.seq_ptr, self.TX, self.TY, self.TZ, self.KX, self.KY, self.KZ,
                                 self.WINDOW)

    @gluon.jit
    def tile_boxes(self, pid_m):
        """2-D/3-D windows: tile ``pid_m``'s key boxes, per dimension (x, y, z) the first box's first key and the
        number of boxes (``masks.WindowBoxes.keys``, from the tile's halo; z 0 and 1 in 2-D), and its first query
        position (x0, y0, z0)."""
        na = self.boxes()
        x0, y0, z0 = na.tile_origin(pid_m)
        ox, nx, oy, ny, oz, nz = na.keys(x0, x0 + self.TX - 1, y0, y0 + self.TY - 1, z0, z0 + self.TZ - 1, True)
        return ox, nx, oy, ny, oz, nz, x0, y0, z0

    @gluon.jit
    def box_coords(self, w, h, x, y, z):
        """A box's descriptor coordinates: [z, h, x, y, 0] over [Z, H, Lx, Ly, D] views (2-D), [h, x, y, z, 0] over
        [H, Lx, Ly, Lz, D] ones (3-D, a batch a launch), as the Hopper forward's."""
        if self.NA_DIMS == 3:
            return [h, x, y, z, 0]
        else:
            return [w.z, h, x, y, 0]

    @gluon.jit
    def take_unit(self, units, it):
        """Consumer: the next unit from the schedule partition (-1: none left) and its ``Work``."""
        unit, w = units.take(it, self.shape)
        return unit, w, it.next()


# ---------------------------------------------------------------------------------------------
# Channels of a cluster: barriers shared by a CTA pair, the unit ring, the scheduler
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _signal(NUM: gl.constexpr, READY_COUNT: gl.constexpr, EMPTY_COUNT: gl.constexpr, READY_PAIRED: gl.constexpr,
            EMPTY_PAIRED: gl.constexpr):
    """A ``Signal`` of NUM slots. A PAIRED barrier is one per CTA pair, in the pair's leader: the arrives of
    both CTAs count on it (its count is per CTA) and only the leader, which issues the pair's MMAs, waits on
    it. Without a cluster both are the CTA's own barriers."""
    ready = mbarrier.allocate_mbarrier(batch=NUM, two_ctas=READY_PAIRED)
    empty = mbarrier.allocate_mbarrier(batch=NUM, two_ctas=EMPTY_PAIRED)
    for i in gl.static_range(NUM):
        mbarrier.init(ready.index(i), count=READY_COUNT)
        mbarrier.init(empty.index(i), count=EMPTY_COUNT)
    return Signal(ready, empty, NUM)


@gluon.jit
def _store_word(mem, value):
    reg_layout: gl.constexpr = _word_layouts(gl.num_warps(), gl.num_ctas())[1]
    mem.store(gl.full([1], value, gl.int32, reg_layout))


@gluon.jit
def _load_word(mem):
    reg_layout: gl.constexpr = _word_layouts(gl.num_warps(), gl.num_ctas())[1]
    return mem.load(reg_layout).reshape([])


@aggregate
class UnitRing:
    """The schedule partition's work units as the other partitions take them: a ``Signal`` ring of NUM slots,
    each with the unit's number (-1: no more units) and, for packed sequences, its ``schedule.Work`` as the
    schedule partition computed it from the table (the consumers repeat neither the table search nor its
    divisions; a dense unit's work is a few operations on launch arguments, which each consumer derives itself).
    Each CTA has its own."""
    sig: Signal
    words: gl.shared_memory_descriptor
    NUM: gl.constexpr
    WORDS: gl.constexpr

    @gluon.jit
    def alloc(NUM: gl.constexpr, CONSUMERS: gl.constexpr, VARLEN: gl.constexpr):
        WORDS: gl.constexpr = UNIT_WORDS if VARLEN else 1
        layout: gl.constexpr = _word_layouts(1, gl.num_ctas())[0]
        words = gl.allocate_shared_memory(gl.int32, [WORDS * NUM, 1], layout)
        return UnitRing(_signal(NUM, 1, CONSUMERS, False, False), words, NUM, WORDS)

    @gluon.jit
    def publish(self, it, unit, w):
        """Producer: wait until slot ``it`` is free, write the unit (and its work), arrive on its ready barrier
        (which releases the stores to the partitions that wait on it)."""
        ready = self.sig.acquire_empty(it)
        base = it.index * self.WORDS
        _store_word(self.words.index(base), unit)
        if self.WORDS > 1:
            fields = (w.z, w.h, w.hk, w.q_base, w.k_base, w.n_q, w.n_k, w.first, w.second, w.n_tiles)
            for i in gl.static_range(UNIT_WORDS - 1):
                _store_word(self.words.index(base + 1 + i), fields[i])
        mbarrier.arrive(ready, count=1)

    @gluon.jit
    def take(self, it, shape):
        """Consumer: the unit of slot ``it`` and its ``Work``; the slot goes back to the producer."""
        self.sig.wait_ready(it)
        base = it.index * self.WORDS
        unit = _load_word(self.words.index(base))
        if self.WORDS > 1:
            z = _load_word(self.words.index(base + 1))
            h = _load_word(self.words.index(base + 2))
            hk = _load_word(self.words.index(base + 3))
            q_base = _load_word(self.words.index(base + 4))
            k_base = _load_word(self.words.index(base + 5))
            n_q = _load_word(self.words.index(base + 6))
            n_k = _load_word(self.words.index(base + 7))
            first = _load_word(self.words.index(base + 8))
            second = _load_word(self.words.index(base + 9))
            n_tiles = _load_word(self.words.index(base + 10))
            self.sig.release(it)
            if shape.CAUSAL:
                shift = n_k - n_q  # bottom-right: query i sees keys <= i + N_KV - N_Q
            else:
                shift = gl.to_tensor(0)
            w = Work(z, h, hk, z * shape.H + h, q_base, k_base, n_q, n_k, shift, first, second, n_tiles,
                     shape.BLOCK_M, shape.BLOCK_N, shape.CAUSAL)
        else:
            self.sig.release(it)
            w = shape.work(unit)
        return unit, w


@aggregate
class Scheduler:
    """Cluster launch control: ``ask`` has the pair leader (CTA 0 of the cluster) try to cancel a cluster that
    has not started, its answer multicast to the result buffer and barrier of every CTA of the cluster;
    ``answer`` is the cancelled cluster's unit (its cluster id: the grid has one cluster per unit), or ``none``.
    With a cluster, CTA 0 asks again only after every CTA has read the last answer (``consumed``, in CTA 0)."""
    result: gl.shared_memory_descriptor
    bar: gl.shared_memory_descriptor
    consumed: gl.shared_memory_descriptor
    NUM_CTAS: gl.constexpr

    @gluon.jit
    def alloc():
        NUM_CTAS: gl.constexpr = gl.num_ctas()
        layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0], cga_layout=replicated_bases(NUM_CTAS))
        result = gl.allocate_shared_memory(gl.int64, [2], layout)  # the 16-byte try_cancel response
        bar = mbarrier.allocate_mbarrier()
        mbarrier.init(bar, count=1)
        consumed = gl.allocate_shared_memory(gl.int64, [1], layout)
        if NUM_CTAS > 1:
            mbarrier.init(consumed, count=1)  # (one arrive per CTA: the count is per CTA)
        return Scheduler(result, bar, consumed, NUM_CTAS)

    @gluon.jit
    def ask(self, phase):
        if self.NUM_CTAS > 1:
            mbarrier.wait(self.consumed, phase ^ 1)
            mbarrier.expect(self.bar, 16, from_cta=0)
        else:
            mbarrier.expect(self.bar, 16)
        clc.try_cancel(self.result, self.bar)

    @gluon.jit
    def answer(self, phase, none):
        mbarrier.wait(self.bar, phase)
        res = clc.load_result(self.result)
        if self.NUM_CTAS > 1:
            mbarrier.arrive(self.consumed)
        return gl.where(res.is_canceled(), res.program_id(0), none)


@gluon.jit
def _cluster_id(anchor):
    """This cluster's index (a CTA outside a cluster launch is a cluster of one), read inside the partition
    that uses it: a plain ``program_id`` is hoisted into the kernel prologue and then has to survive every
    partition's ``setmaxnreg``, which ptxas does through local memory; an asm read with side effects stays where
    it is written."""
    return gl.inline_asm_elementwise("mov.u32 $0, %clusterid.x;", "=r,r", [anchor], dtype=gl.int32, is_pure=False,
                                     pack=1)


@gluon.jit
def _heads_of(desc_q, WINDOW: gl.constexpr):
    """The query heads: [Z, H, ...] descriptors, or 3-D windows' [H, Lx, Ly, Lz, D] (one batch a launch)."""
    if window_dims(WINDOW) == 3:
        return desc_q.shape[0]
    else:
        return desc_q.shape[1]


# ---------------------------------------------------------------------------------------------
# The kernel: buffers, barriers, and the seven partitions
# ---------------------------------------------------------------------------------------------
# Sizes are not value-specialized (see the Hopper kernel: the host launches compiled kernels directly).
@gluon.jit(repr=kernel_symbol, do_not_specialize=["N_Q", "N_KV", "num_hz", "G", "group_hz", "n_seqs"])
def blackwell_attention_kernel(desc_q, desc_k, desc_v, desc_o, o_ptr, lse_ptr, seq_ptr, qk_scale, o_scale, N_Q, N_KV,
                               num_hz, G, group_hz, n_seqs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               KV_STAGES: gl.constexpr, SPLIT_D: gl.constexpr, CAUSAL: gl.constexpr,
                               VARLEN: gl.constexpr, RETURN_LSE: gl.constexpr, SOFTMAX_REGS: gl.constexpr,
                               KERNEL_NAME: gl.constexpr, PADDED: gl.constexpr = False, WINDOW: gl.constexpr = 0):
    # (WINDOW: neighborhood attention along the rows of dense self-attention, one CTA a tile: its kernel size and
    # stride are the two int32 words at seq_ptr, as in the Hopper forward)
    NUM_CTAS: gl.constexpr = gl.num_ctas()
    gl.static_assert(not WINDOW or NUM_CTAS == 1, "WINDOW: each tile visits its own key blocks (no cluster)")
    PAIRED: gl.constexpr = NUM_CTAS > 1
    gl.static_assert(BLOCK_M == 2 * ROWS_PER_CTA * NUM_CTAS, "BLOCK_M: two 128-row halves per CTA")
    dtype: gl.constexpr = desc_q.dtype
    out_dtype: gl.constexpr = desc_o.dtype
    HEAD_DIM: gl.constexpr = block_cols(desc_q.block_type.shape)
    M: gl.constexpr = BLOCK_M // 2
    # NVMMA shared layouts: what TMA writes and tcgen05 reads (128-byte swizzle where rows allow). K and V
    # share one ring (K's layout; V's view is ``_v_view``).
    q_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, HEAD_DIM], dtype,
                                                                cga_layout=cluster_bases(NUM_CTAS))
    kv_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype,
                                                                 cga_layout=k_bases(NUM_CTAS))
    o_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, HEAD_DIM], out_dtype,
                                                                cga_layout=cluster_bases(NUM_CTAS))
    # Tensor memory: fp32 accumulators, one 32-bit column per element (S: BLOCK_N columns, O: HEAD_DIM),
    # two halves: 2 x (BLOCK_N + HEAD_DIM) <= 512 columns per CTA.
    s_tmem: gl.constexpr = tmem_layout(BLOCK_N, NUM_CTAS)
    o_tmem: gl.constexpr = tmem_layout(HEAD_DIM, NUM_CTAS)

    q_mem = gl.allocate_shared_memory(dtype, [2, M, HEAD_DIM], q_smem)
    kv_mem = gl.allocate_shared_memory(dtype, [KV_STAGES, BLOCK_N, HEAD_DIM], kv_smem)
    # How many MMA completions arrive on a barrier of each CTA: 1, or with a 4-CTA cluster both pairs' (their
    # K and V tiles came from one multicast load).
    QK_ARRIVALS: gl.constexpr = tcgen05_mma_barrier_count([q_mem.index(0), kv_mem.index(0).permute((1, 0))],
                                                          multicast=PAIRED, two_ctas=PAIRED)
    PV_ARRIVALS: gl.constexpr = tcgen05_mma_barrier_count([_v_view(kv_mem.index(0))], multicast=PAIRED,
                                                          two_ctas=PAIRED)
    gl.static_assert(QK_ARRIVALS == PV_ARRIVALS, "one K/V ring: K and V slots are released by as many MMAs")
    # Q and K/V: every CTA of a pair loads its part onto the leader's ready barrier; the MMAs release each
    # CTA's slots. S and O: the MMAs arrive on every CTA's ready barrier; each CTA's softmax / correction
    # partition hands its part back to the leader.
    q_ring = Ring(q_mem, _signal(2, 1, QK_ARRIVALS, PAIRED, False), 2)
    kv_ring = Ring(kv_mem, _signal(KV_STAGES, 1, QK_ARRIVALS, PAIRED, False), KV_STAGES)
    epi_mem = gl.allocate_shared_memory(out_dtype, [2, M, HEAD_DIM], o_smem)
    epi_ring = Ring(epi_mem, _signal(2, 1, 1, False, False), 2)
    s_ring0 = TmemRing(allocate_tensor_memory(gl.float32, [1, M, BLOCK_N], s_tmem),
                       _signal(1, QK_ARRIVALS, 1, False, PAIRED), 1)
    s_ring1 = TmemRing(allocate_tensor_memory(gl.float32, [1, M, BLOCK_N], s_tmem),
                       _signal(1, QK_ARRIVALS, 1, False, PAIRED), 1)
    o_ring0 = TmemRing(allocate_tensor_memory(gl.float32, [1, M, HEAD_DIM], o_tmem),
                       _signal(1, PV_ARRIVALS, 1, False, PAIRED), 1)
    o_ring1 = TmemRing(allocate_tensor_memory(gl.float32, [1, M, HEAD_DIM], o_tmem),
                       _signal(1, PV_ARRIVALS, 1, False, PAIRED), 1)
    stat0 = _signal(1, 1, 1, False, False)
    stat1 = _signal(1, 1, 1, False, False)
    units = UnitRing.alloc(UNIT_SLOTS, UNIT_CONSUMERS, VARLEN)
    scheduler = Scheduler.alloc()
    fence_async_shared()
    shape = Shape(N_Q, N_KV, num_hz, _heads_of(desc_q, WINDOW), G, group_hz, seq_ptr, n_seqs, BLOCK_M, BLOCK_N,
                  CAUSAL, VARLEN, CAUSAL)
    cfg = Cfg(shape, qk_scale, o_scale, lse_ptr, o_ptr, dtype, BLOCK_M, BLOCK_N, CAUSAL, SPLIT_D, RETURN_LSE,
              NUM_CTAS, PADDED, WINDOW, box_dims(desc_q.block_type.shape, window_dims(WINDOW)),
              box_dims(desc_k.block_type.shape, window_dims(WINDOW)))
    descs = Descs(desc_q, desc_k, desc_v, desc_o)

    gl.warp_specialize([
        (_correction_partition, (cfg, units, s_ring0, s_ring1, stat0, stat1, o_ring0, o_ring1, epi_ring)),
        (_load_partition, (cfg, descs, units, q_ring, kv_ring)),
        (_mma_partition, (cfg, units, q_ring, kv_ring, s_ring0, s_ring1, o_ring0, o_ring1)),
        (_softmax_partition, (cfg, units, s_ring0, stat0, 0)),
        (_softmax_partition, (cfg, units, s_ring1, stat1, 1)),
        (_epilogue_partition, (cfg, units, descs, epi_ring)),
        (_schedule_partition, (cfg, units, scheduler)),
    ], [1, 1, 4, 4, 1, 1],  # = blackwell_host.WORKER_WARPS
        [LOAD_REGS, MMA_REGS, SOFTMAX_REGS, SOFTMAX_REGS, EPILOGUE_REGS, SCHEDULE_REGS])




# ---------------------------------------------------------------------------------------------
# The correction partition (default, 4 warps): O rescales, O / l, the lse
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _correct_half(s_ring, stat_sig, c_it, o_ring, o_it, rescale, SPLIT_D: gl.constexpr):
    """Read this block's statistics; from the second block on, rescale O by alpha between PVs."""
    NUM_CTAS: gl.constexpr = gl.num_ctas()
    s_buf = s_ring.mem.index(0)
    stat_layout: gl.constexpr = _stat_reg_layout(4, NUM_CTAS)
    o_mem = o_ring.mem.index(0)
    M: gl.constexpr = o_mem.shape[0]
    HEAD_DIM: gl.constexpr = o_mem.shape[1]
    CHUNK: gl.constexpr = HEAD_DIM // SPLIT_D
    chunk_layout: gl.constexpr = get_tmem_reg_layout(gl.float32, CHUNK, NUM_CTAS, 4)
    row_layout: gl.constexpr = gl.SliceLayout(1, chunk_layout)
    stat_sig.wait_ready(c_it)
    alpha = gl.convert_layout(_stat_view(s_buf, 0).load(stat_layout).reshape([M]), row_layout)
    l_i = gl.convert_layout(_stat_view(s_buf, 1).load(stat_layout).reshape([M]), row_layout)
    stat_sig.release(c_it)
    if rescale:
        o_buf = o_ring.wait_ready(o_it)  # the previous PV has landed
        # In column chunks, to bound the registers each thread holds; two columns per packed FP32x2 multiply.
        alpha2 = gl.expand_dims(alpha, 1)
        for i in gl.static_range(SPLIT_D):
            o_chunk = o_buf.slice(i * CHUNK, CHUNK)
            o_chunk.store(mul2(o_chunk.load(chunk_layout), alpha2))
        o_ring.release(o_it)  # the next PV may accumulate
        o_it = o_it.next()
    return c_it.next(), o_it, l_i


@gluon.jit
def _finish_half(cfg, o_ring, o_it, epi_ring, epi_it, l_i):
    """After the last PV: O / l, in the output dtype, into the epilogue's shared-memory buffer. Rows that see
    no key have l = 0 and get 0."""
    SPLIT_D: gl.constexpr = cfg.SPLIT_D
    o_mem = o_ring.mem.index(0)
    M: gl.constexpr = o_mem.shape[0]
    HEAD_DIM: gl.constexpr = o_mem.shape[1]
    CHUNK: gl.constexpr = HEAD_DIM // SPLIT_D
    chunk_layout: gl.constexpr = get_tmem_reg_layout(gl.float32, CHUNK, cfg.NUM_CTAS, 4)
    o_buf = o_ring.wait_ready(o_it)
    smem, smem_ready = epi_ring.acquire_empty(epi_it)
    out_dtype: gl.constexpr = smem.dtype
    scale = gl.expand_dims(gl.where(l_i > 0, cfg.o_scale / l_i, 0.0), 1)
    for i in gl.static_range(SPLIT_D):
        o = mul2(o_buf.slice(i * CHUNK, CHUNK).load(chunk_layout), scale)
        smem.slice(i * CHUNK, CHUNK, dim=1).store(o.to(out_dtype))
    fence_async_shared()
    mbarrier.arrive(smem_ready, count=1)
    o_ring.release(o_it)  # the next tile's first PV may overwrite O
    return o_it.next(), epi_it.next()


@gluon.jit
def _correction_partition(cfg, units, s_ring0, s_ring1, stat0, stat1, o_ring0, o_ring1, epi_ring):
    SPLIT_D: gl.constexpr = cfg.SPLIT_D
    c0_it = RingIndex.start(1)
    c1_it = RingIndex.start(1)
    o0_it = RingIndex.start(1)
    o1_it = RingIndex.start(1)
    epi_it = RingIndex.start(epi_ring.NUM)
    u_it = RingIndex.start(units.NUM)
    cfg = cfg.localized()
    unit, w, u_it = cfg.take_unit(units, u_it)
    while unit >= 0:
        for t in range(w.n_tiles):
            pid_m = w.tile(t)
            lo, hi = cfg.tile_blocks(w, pid_m)
            n_blocks = hi - lo
            # Block 0 carries no rescale; its statistics are the final ones when it is the only block.
            c0_it, o0_it, l0 = _correct_half(s_ring0, stat0, c0_it, o_ring0, o0_it, False, SPLIT_D)
            c1_it, o1_it, l1 = _correct_half(s_ring1, stat1, c1_it, o_ring1, o1_it, False, SPLIT_D)
            for j in range(1, n_blocks):
                c0_it, o0_it, l0 = _correct_half(s_ring0, stat0, c0_it, o_ring0, o0_it, True, SPLIT_D)
                c1_it, o1_it, l1 = _correct_half(s_ring1, stat1, c1_it, o_ring1, o1_it, True, SPLIT_D)
            o0_it, epi_it = _finish_half(cfg, o_ring0, o0_it, epi_ring, epi_it, l0)
            o1_it, epi_it = _finish_half(cfg, o_ring1, o1_it, epi_ring, epi_it, l1)
        unit, w, u_it = cfg.take_unit(units, u_it)


# ---------------------------------------------------------------------------------------------
# The load (1 warp) and MMA (1 warp) partitions
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _tma_load(desc, coords, bar, buf):
    """TMA-load one block of a 4-D [Z, H, N, D] descriptor into a 2-D shared buffer (out-of-bounds rows are
    zero-filled per head, so tails never read a neighbouring head). In a cluster each CTA loads its part of
    the block (multicast to the CTAs that share it) and counts its own bytes on the barrier."""
    mbarrier.expect(bar, desc.nbytes_per_cta)
    tma.async_load(desc, coords, bar, block_view(buf, desc), multicast=gl.num_ctas() > 1)


@gluon.jit
def _schedule_partition(cfg, units, scheduler):
    """The work units of this cluster: its own (the cluster id), then those of clusters that have not started,
    from cluster launch control, each handed to the other partitions (with, for packed sequences, its work from
    the table). The next unit is asked for once this one is handed over: a cluster holds at most one unit
    beyond those its partitions have started."""
    VARLEN: gl.constexpr = cfg.shape.VARLEN
    u_it = RingIndex.start(units.NUM)
    phase = gl.to_tensor(0)
    cfg = cfg.localized()
    n_units = cfg.shape.num_units()
    unit = _cluster_id(n_units)
    none = gl.to_tensor(-1)
    no_work = Work(none, none, none, none, none, none, none, none, none, none, none, none, cfg.BLOCK_M, cfg.BLOCK_N,
                   cfg.CAUSAL)
    while unit < n_units:
        if VARLEN:
            units.publish(u_it, unit, cfg.shape.packed_work(cfg.shape.locate(unit)))
        else:
            units.publish(u_it, unit, no_work)
        u_it = u_it.next()
        scheduler.ask(phase)
        unit = scheduler.answer(phase, n_units)
        phase = phase ^ 1
    units.publish(u_it, none, no_work)


@gluon.jit
def _load_partition(cfg, descs, units, q_ring, kv_ring):
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    q_it = RingIndex.start(q_ring.NUM)
    kv_it = RingIndex.start(kv_ring.NUM)
    u_it = RingIndex.start(units.NUM)
    cfg = cfg.localized()
    unit, w, u_it = cfg.take_unit(units, u_it)
    while unit >= 0:
        for t in range(w.n_tiles):
            pid_m = w.tile(t)
            if cfg.NA_DIMS >= 2:
                q_it, kv_it = _load_tile_boxes(cfg, descs, w, pid_m, q_ring, q_it, kv_ring, kv_it)
            else:
                for half in gl.static_range(2):
                    q_buf, q_bar = q_ring.acquire_empty(q_it)
                    _tma_load(descs.q, w.q_coords(pid_m * BLOCK_M + half * cfg.M), q_bar, q_buf)
                    q_it = q_it.next()
                lo, hi = cfg.tile_blocks(w, pid_m)
                for j in range(lo, hi):
                    # K and V share one ring, alternating, in the order the MMA partition consumes them.
                    k_buf, k_bar = kv_ring.acquire_empty(kv_it)
                    _tma_load(descs.k, w.kv_coords(j * BLOCK_N), k_bar, k_buf)
                    kv_it = kv_it.next()
                    v_buf, v_bar = kv_ring.acquire_empty(kv_it)
                    _tma_load(descs.v, w.kv_coords(j * BLOCK_N), v_bar, _v_view(v_buf))
                    kv_it = kv_it.next()
        unit, w, u_it = cfg.take_unit(units, u_it)


@gluon.jit
def _load_tile_boxes(cfg, descs, w, pid_m, q_ring, q_it, kv_ring, kv_it):
    """2-D/3-D windows: tile ``pid_m``'s two Q halves (boxes TX / 2 x TY (x TZ), stacked along x), then the key boxes
    its queries' windows reach, row-major (``Cfg.tile_boxes``), K and V alternating in the one ring."""
    ox, nx, oy, ny, oz, nz, x0, y0, z0 = cfg.tile_boxes(pid_m)
    for half in gl.static_range(2):
        q_buf, q_bar = q_ring.acquire_empty(q_it)
        _tma_load(descs.q, cfg.box_coords(w, w.h, x0 + half * (cfg.TX // 2), y0, z0), q_bar, q_buf)
        q_it = q_it.next()
    inv_ny, inv_nz = walk_reciprocals(ny, nz)
    for j in range(nx * ny * nz):
        ix, iy, iz = walk_step(j, ny, nz, inv_ny, inv_nz, cfg.NA_DIMS)
        coords = cfg.box_coords(w, w.hk, ox + ix * cfg.KX, oy + iy * cfg.KY, oz + iz * cfg.KZ)
        k_buf, k_bar = kv_ring.acquire_empty(kv_it)
        _tma_load(descs.k, coords, k_bar, k_buf)
        kv_it = kv_it.next()
        v_buf, v_bar = kv_ring.acquire_empty(kv_it)
        _tma_load(descs.v, coords, v_bar, _v_view(v_buf))
        kv_it = kv_it.next()
    return q_it, kv_it


@gluon.jit
def _issue_pv(s_ring, s_it, o_ring, o_it, v_buf, use_acc, extra_bars: gl.constexpr, v_empty, dtype: gl.constexpr):
    """O_h (+)= P_h V once the softmax has written P_h and the correction has rescaled O_h."""
    s_buf, _ = s_ring.acquire_empty(s_it)
    o_buf, o_ready = o_ring.acquire_empty(o_it)
    MC: gl.constexpr = gl.num_ctas() > 1
    if extra_bars:
        tcgen05_mma(_p_view(s_buf, dtype), v_buf, o_buf, use_acc=use_acc, multicast=MC, mbarriers=[o_ready, v_empty])
    else:
        tcgen05_mma(_p_view(s_buf, dtype), v_buf, o_buf, use_acc=use_acc, multicast=MC, mbarriers=[o_ready])
    return s_it.next(), o_it.next()


@gluon.jit
def _release_q(q_ring, q_it, q_buf, k_buf):
    """Hand a Q slot back once every QK^T issued so far has completed (in a cluster: to every CTA that holds
    a part of the operands)."""
    if gl.num_ctas() > 1:
        tcgen05_commit(q_ring.sig.empty_bar(q_it), descs=[q_buf, k_buf.permute((1, 0))])
    else:
        tcgen05_commit(q_ring.sig.empty_bar(q_it))


@gluon.jit
def _mma_partition(cfg, units, q_ring, kv_ring, s_ring0, s_ring1, o_ring0, o_ring1):
    dtype: gl.constexpr = kv_ring.mem.dtype
    MC: gl.constexpr = cfg.NUM_CTAS > 1
    q_it = RingIndex.start(q_ring.NUM)
    kv_it = RingIndex.start(kv_ring.NUM)
    s0_it = RingIndex.start(1)
    s1_it = RingIndex.start(1)
    o0_it = RingIndex.start(1)
    o1_it = RingIndex.start(1)
    u_it = RingIndex.start(units.NUM)
    # The first S of each half goes into a free buffer: take the fresh phase once. From then on a
    # half's S buffer is re-acquired before each PV (the softmax has written P over it) and the next
    # QK^T writes it after that PV, in tcgen05 issue order.
    s0, s0_ready = s_ring0.acquire_empty(s0_it)
    s0_it = s0_it.next()
    s1, s1_ready = s_ring1.acquire_empty(s1_it)
    s1_it = s1_it.next()
    cfg = cfg.localized()
    unit, w, u_it = cfg.take_unit(units, u_it)
    while unit >= 0:
        for t in range(w.n_tiles):
            pid_m = w.tile(t)
            lo, hi = cfg.tile_blocks(w, pid_m)
            n_blocks = hi - lo
            q0_it = q_it
            q0 = q_ring.wait_ready(q_it)
            q_it = q_it.next()
            q1_it = q_it
            q1 = q_ring.wait_ready(q_it)
            q_it = q_it.next()

            k_it = kv_it
            k = kv_ring.wait_ready(kv_it)
            kv_it = kv_it.next()
            tcgen05_mma(q0, k.permute((1, 0)), s0, use_acc=False, multicast=MC, mbarriers=[s0_ready])
            tcgen05_mma(q1, k.permute((1, 0)), s1, use_acc=False, multicast=MC,
                        mbarriers=[s1_ready, kv_ring.sig.empty_bar(k_it)])
            v_it = kv_it
            v = _v_view(kv_ring.wait_ready(kv_it))
            kv_it = kv_it.next()
            s0_it, o0_it = _issue_pv(s_ring0, s0_it, o_ring0, o0_it, v, False, False, v, dtype)

            for j in range(1, n_blocks):
                k_it = kv_it
                k = kv_ring.wait_ready(kv_it)
                kv_it = kv_it.next()
                tcgen05_mma(q0, k.permute((1, 0)), s0, use_acc=False, multicast=MC, mbarriers=[s0_ready])
                # Half 1's PV of the previous block runs while half 0's softmax works on S_0.
                s1_it, o1_it = _issue_pv(s_ring1, s1_it, o_ring1, o1_it, v, j > 1, True,
                                         kv_ring.sig.empty_bar(v_it), dtype)
                tcgen05_mma(q1, k.permute((1, 0)), s1, use_acc=False, multicast=MC,
                            mbarriers=[s1_ready, kv_ring.sig.empty_bar(k_it)])
                v_it = kv_it
                v = _v_view(kv_ring.wait_ready(kv_it))
                kv_it = kv_it.next()
                s0_it, o0_it = _issue_pv(s_ring0, s0_it, o_ring0, o0_it, v, True, False, v, dtype)

            # Both Q halves are read by every QK^T issued so far: release them when those complete.
            _release_q(q_ring, q0_it, q0, k)
            _release_q(q_ring, q1_it, q1, k)
            s1_it, o1_it = _issue_pv(s_ring1, s1_it, o_ring1, o1_it, v, n_blocks > 1, True,
                                     kv_ring.sig.empty_bar(v_it), dtype)
        unit, w, u_it = cfg.take_unit(units, u_it)


# ---------------------------------------------------------------------------------------------
# The softmax partitions (4 warps each, one per half)
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _exp_chunk(s, m_new, qk_scale, p_tmem, dtype: gl.constexpr, NW: gl.constexpr):
    """exp2 of one column chunk (its argument by packed FP32x2 FMAs), written to its P columns; returns the
    chunk's row sums."""
    CH: gl.constexpr = s.shape[1]
    p_layout: gl.constexpr = get_tmem_reg_layout(dtype, CH, gl.num_ctas(), NW)
    p = gl.exp2(fma2(s, qk_scale, -gl.expand_dims(m_new, 1)))
    p_tmem.store(gl.convert_layout(p.to(dtype), p_layout))
    return gl.sum(p, 1)


@gluon.jit
def _softmax_block(cfg, s_ring, s_it, stat_sig, m_i, l_i, mask, j, MASKED: gl.constexpr):
    """One block (block j of ``mask``, a ``masks.TileMask``): S -> P (written over S), alpha / m / l to the correction
    partition.

    S is read as two column halves: both are needed for the row max, but each half's exp2 and P
    store can then finish before the other's starts, which keeps a softmax thread (one row each)
    within its register budget."""
    NW: gl.constexpr = SOFTMAX_WARPS
    dtype: gl.constexpr = cfg.dtype
    qk_scale = cfg.qk_scale
    s_buf = s_ring.wait_ready(s_it)
    BLOCK_N: gl.constexpr = s_buf.shape[1]
    CH: gl.constexpr = BLOCK_N // 2
    c_layout: gl.constexpr = get_tmem_reg_layout(gl.float32, CH, cfg.NUM_CTAS, NW)
    stat_layout: gl.constexpr = _stat_reg_layout(NW, cfg.NUM_CTAS)
    s0 = s_buf.slice(0, CH).load(c_layout)
    s1 = s_buf.slice(CH, CH).load(c_layout)
    s0, s1 = mask.apply_halves(s0, s1, j, MASKED)
    m_new = gl.maximum(m_i, gl.maximum(gl.max(s0, 1), gl.max(s1, 1)) * qk_scale)
    m_exp = m_new
    if MASKED:
        # A row that has seen no key yet (max -inf): its exponentials use 0 as the max, giving 0, not NaN.
        m_exp = gl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_exp)
    p_all = _p_view(s_buf, dtype)
    l_new = _exp_chunk(s0, m_exp, qk_scale, p_all.slice(0, CH), dtype, NW)
    l_new += _exp_chunk(s1, m_exp, qk_scale, p_all.slice(CH, CH), dtype, NW)
    l_i = l_i * alpha + l_new
    # The three statistics ride in S's spare columns until the correction partition has read them.
    # The statistics slot turns over once per S block, like S itself: one ring position serves both.
    stat_sig.acquire_empty(s_it)
    _stat_view(s_buf, 0).store(gl.convert_layout(gl.expand_dims(alpha, 1), stat_layout))
    _stat_view(s_buf, 1).store(gl.convert_layout(gl.expand_dims(l_i, 1), stat_layout))
    stat_sig.arrive_ready(s_it)
    s_ring.release(s_it)  # P is in place: the MMA partition may issue PV
    return s_it.next(), m_new, l_i


@gluon.jit
def _softmax_loop(cfg, s_ring, s_it, stat_sig, m_i, l_i, lo, hi, mask, MASKED: gl.constexpr):
    for j in range(lo, hi):
        s_it, m_i, l_i = _softmax_block(cfg, s_ring, s_it, stat_sig, m_i, l_i, mask.at(j), j, MASKED)
    return s_it, m_i, l_i


@gluon.jit
def _softmax_boxes(cfg, s_ring, s_it, stat_sig, m_i, l_i, pid_m, HALF: gl.constexpr, row_layout: gl.constexpr):
    """2-D/3-D windows: half HALF of tile ``pid_m`` (a box TX / 2 x TY (x TZ)) over the tile's key boxes, each masked
    unless every one of the half's queries attends all of it, against the rows' windows computed once a tile."""
    na = cfg.boxes()
    ox, nx, oy, ny, oz, nz, x0, y0, z0 = cfg.tile_boxes(pid_m)
    HX: gl.constexpr = cfg.TX // 2
    xh = x0 + HALF * HX
    ulo_x, uhi_x, ulo_y, uhi_y, ulo_z, uhi_z = na.unmasked(xh, xh + HX - 1, y0, y0 + cfg.TY - 1, z0, z0 + cfg.TZ - 1,
                                                           ox, oy, oz)
    rows = BoxRows.of(na, xh, y0, z0, cfg.M, cfg.TY, cfg.TZ, row_layout)
    walk = WalkBoxes.of(ox, oy, oz, ny, nz, ulo_x, uhi_x, ulo_y, uhi_y, ulo_z, uhi_z, xh, y0, z0)
    mask = TileMask.boxes(rows, walk, cfg.KX, cfg.KY, cfg.KZ, cfg.WINDOW)
    return _softmax_loop(cfg, s_ring, s_it, stat_sig, m_i, l_i, 0, nx * ny * nz, mask, True)


@gluon.jit
def _softmax_partition(cfg, units, s_ring, stat_sig, HALF: gl.constexpr):
    NW: gl.constexpr = SOFTMAX_WARPS
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    M: gl.constexpr = cfg.M
    BLOCK_N: gl.constexpr = s_ring.mem.shape[2]
    CH: gl.constexpr = BLOCK_N // 2
    chunk_layout: gl.constexpr = get_tmem_reg_layout(gl.float32, CH, cfg.NUM_CTAS, NW)
    row_layout: gl.constexpr = gl.SliceLayout(1, chunk_layout)
    s_it = RingIndex.start(1)
    u_it = RingIndex.start(units.NUM)
    cfg = cfg.localized()
    unit, w, u_it = cfg.take_unit(units, u_it)
    while unit >= 0:
        for t in range(w.n_tiles):
            pid_m = w.tile(t)
            q_row0 = pid_m * BLOCK_M + HALF * M
            m_i = gl.full([M], -float("inf"), gl.float32, row_layout)
            l_i = gl.full([M], 0.0, gl.float32, row_layout)
            if cfg.NA_DIMS >= 2:
                s_it, m_i, l_i = _softmax_boxes(cfg, s_ring, s_it, stat_sig, m_i, l_i, pid_m, HALF, row_layout)
            elif cfg.WINDOW:
                # The tile's blocks [lo, hi): masked but those all of this half's rows attend wholly, [a, b).
                win_k, win_s = window_words(cfg.shape.seq_ptr)
                lo, hi = cfg.tile_blocks(w, pid_m)
                _, _, ulo, uhi = window_blocks(q_row0, q_row0 + M - 1, w.n_k, win_k, win_s, BLOCK_N, cfg.WINDOW)
                a = gl.minimum(gl.maximum(ulo, lo), hi)
                b = gl.maximum(gl.minimum(uhi, hi), a)
                # each row's window (a row a thread), rows past the layout as its last row's
                rows = gl.minimum(q_row0 + gl.arange(0, M, row_layout), w.n_k - 1)
                k_lo, k_hi = window_bounds(rows, w.n_k, win_k, win_s, cfg.WINDOW)
                mask = TileMask.window_rows(k_lo, k_hi, BLOCK_N, cfg.WINDOW)
                s_it, m_i, l_i = _softmax_loop(cfg, s_ring, s_it, stat_sig, m_i, l_i, lo, a, mask, True)
                s_it, m_i, l_i = _softmax_loop(cfg, s_ring, s_it, stat_sig, m_i, l_i, a, b, mask, False)
                s_it, m_i, l_i = _softmax_loop(cfg, s_ring, s_it, stat_sig, m_i, l_i, b, hi, mask, True)
            else:
                n_blocks = w.kv_blocks(pid_m)
                # Blocks [0, n_unmasked) lie inside the key range and below this half's diagonal: no mask.
                n_unmasked = gl.minimum(w.unmasked_blocks(q_row0), n_blocks)
                mask = TileMask.dense(q_row0, w.shift, w.n_k, BLOCK_N, cfg.CAUSAL)
                s_it, m_i, l_i = _softmax_loop(cfg, s_ring, s_it, stat_sig, m_i, l_i, 0, n_unmasked, mask, False)
                s_it, m_i, l_i = _softmax_loop(cfg, s_ring, s_it, stat_sig, m_i, l_i, n_unmasked, n_blocks, mask, True)
            if cfg.RETURN_LSE:
                # The rows' final statistics are here, with registers to spare between tiles. Rows that see no
                # key have l = 0: -inf.
                if cfg.NA_DIMS >= 2:
                    na = cfg.boxes()  # (the half's rows: a box TX / 2 x TY (x TZ) from the tile's origin)
                    x0, y0, z0 = na.tile_origin(pid_m)
                    na.store_lse(cfg.lse_ptr, w, x0 + HALF * (cfg.TX // 2), y0, z0, (m_i + gl.log2(l_i)) * LN2,
                                 row_layout)
                else:
                    rows = q_row0 + gl.arange(0, M, row_layout)
                    lse = (m_i + gl.log2(l_i)) * LN2
                    gl.store(cfg.shape.lse_row(cfg.lse_ptr, w) + rows, lse, mask=rows < w.n_q)
        unit, w, u_it = cfg.take_unit(units, u_it)


# ---------------------------------------------------------------------------------------------
# The epilogue partition (1 warp): TMA stores
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _store_tail(cfg, smem, w, q_row0, desc_o):
    """A packed sequence's last tile: the staged rows q_row0 + r < n_q from shared memory to the packed [total, H,
    D] output, masked (the descriptor would not clip them at the next sequence). In pieces of 8 rows by one
    swizzle atom (what a shared-memory view may cut), 16 bytes a thread. PADDED: the output's head dim (its
    descriptor's) is below the tile's: its rows are that long, the columns past it masked."""
    M: gl.constexpr = smem.shape[0]
    HEAD_DIM: gl.constexpr = smem.shape[1]
    BITS: gl.constexpr = smem.dtype.primitive_bitwidth
    ATOM: gl.constexpr = smem.type.layout.swizzle_byte_width * 8 // BITS
    VEC: gl.constexpr = 128 // BITS
    ROWS: gl.constexpr = 8
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // ATOM, ATOM // VEC], [1, 1], [1, 0])
    r = gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    c = gl.arange(0, ATOM, gl.SliceLayout(0, layout))
    H = cfg.shape.H
    for r0 in gl.static_range(0, M, ROWS):
        # (through ``opaque``: each piece's addresses are computed as it is stored, not all of them up front)
        rows = opaque(q_row0 + r0) + r
        keep = gl.expand_dims(rows < w.n_q, 1)
        if cfg.PADDED:
            D_OUT = desc_o.shape[3]
            row_ptr = cfg.o_ptr + ((w.q_base + rows).to(gl.int64) * H + w.h) * D_OUT
        else:
            row_ptr = cfg.o_ptr + ((w.q_base + rows).to(gl.int64) * H + w.h) * HEAD_DIM
        for c0 in gl.static_range(0, HEAD_DIM, ATOM):
            x = smem.slice(r0, ROWS, dim=0).slice(c0, ATOM, dim=1).load(layout)
            if cfg.PADDED:
                gl.store(gl.expand_dims(row_ptr + c0, 1) + gl.expand_dims(c, 0), x,
                         mask=keep & gl.expand_dims(c0 + c < D_OUT, 0))
            else:
                gl.store(gl.expand_dims(row_ptr + c0, 1) + gl.expand_dims(c, 0), x, mask=keep)


@gluon.jit
def _epilogue_partition(cfg, units, descs, epi_ring):
    desc_o = descs.o
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    M: gl.constexpr = cfg.M
    epi_it = RingIndex.start(epi_ring.NUM)
    u_it = RingIndex.start(units.NUM)
    cfg = cfg.localized()
    unit, w, u_it = cfg.take_unit(units, u_it)
    while unit >= 0:
        for t in range(w.n_tiles):
            pid_m = w.tile(t)
            for half in gl.static_range(2):
                smem = epi_ring.wait_ready(epi_it)
                q_row0 = pid_m * BLOCK_M + half * M
                # Dense: rows past N_Q are clipped by the descriptor (2-D/3-D windows: a box's past the grid).
                if cfg.NA_DIMS >= 2:
                    x0, y0, z0 = cfg.boxes().tile_origin(pid_m)
                    tma.async_store(desc_o, cfg.box_coords(w, w.h, x0 + half * (cfg.TX // 2), y0, z0),
                                    block_view(smem, desc_o))
                    tma.store_wait(0)
                elif cfg.shape.VARLEN and q_row0 + M > w.n_q:
                    _store_tail(cfg, smem, w, q_row0, desc_o)
                else:
                    tma.async_store(desc_o, w.q_coords(q_row0), block_view(smem, desc_o))
                    tma.store_wait(0)
                epi_ring.release(epi_it)
                epi_it = epi_it.next()
        unit, w, u_it = cfg.take_unit(units, u_it)


# ---------------------------------------------------------------------------------------------
# Views
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _v_view(buf):
    """A K/V ring slot as a V tile: in a cluster its CTA holds half of the columns instead of half of the keys
    (the same bytes per CTA)."""
    if gl.num_ctas() > 1:
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(buf.shape, buf.dtype,
                                                                    cga_layout=v_bases(gl.num_ctas()))
        return buf.reinterpret(buf.dtype, buf.shape, layout)
    else:
        return buf


@gluon.jit
def _p_view(s_buf, dtype: gl.constexpr):
    """P over S: the same columns reinterpreted as the input dtype, packed (2 fp16 or 4 fp8 per
    32-bit column), so P takes the first BLOCK_N / 2 (or / 4) columns of S."""
    M: gl.constexpr = s_buf.shape[0]
    BLOCK_N: gl.constexpr = s_buf.shape[1]
    layout: gl.constexpr = tmem_layout(BLOCK_N, gl.num_ctas())
    return s_buf.reinterpret(dtype, [M, BLOCK_N], layout)


@gluon.jit
def _stat_view(s_buf, which: gl.constexpr):
    """One fp32 column of S past P's columns: 0 carries alpha, 1 the running sum."""
    M: gl.constexpr = s_buf.shape[0]
    BLOCK_N: gl.constexpr = s_buf.shape[1]
    layout: gl.constexpr = tmem_layout(1, gl.num_ctas())
    return s_buf.slice(BLOCK_N // 2 + which, 1).reinterpret(gl.float32, [M, 1], layout)
