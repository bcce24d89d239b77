"""Persistent, warp-specialized attention forward for Blackwell (sm_100a): TMA + tcgen05 + tensor memory.

A program owns a 256-row query tile as two 128-row halves (the M of one tcgen05 MMA). Partitions
(``gl.warp_specialize``), each a named function:
  * ``_correction_partition`` (default, 4 warps): rescales O_h in tensor memory by alpha between the
    PV MMAs, normalises O at the end of a tile and stages it in shared memory;
  * ``_load_partition`` (1 warp): TMA loads of the two Q halves and of K, V through one ring;
  * ``_mma_partition`` (1 warp): issues S_h = Q_h K^T and O_h += P_h V with ``tcgen05_mma``,
    interleaving the halves so one half's softmax overlaps the other half's MMAs;
  * ``_softmax_partition`` x2 (4 warps each, one per half): S from tensor memory, online exp2
    softmax, P written back over S (reinterpreted to the input dtype), alpha / m_i / l_i written to
    spare columns of the same S buffer for the correction partition;
  * ``_epilogue_partition`` (1 warp): TMA stores of O.

Every handshake is a ``channels.Signal`` slot (shared-memory buffers: ``Ring``, tensor-memory buffers:
``TmemRing``, barrier-only: ``Signal``) with index and phase carried in ``RingIndex``.

No Blackwell GPU was available to this project: this kernel is verified by compiling it for sm_100a
and reading its SASS and resources (tests/test_blackwell_compile.py), never by running it.
"""
import functools
import itertools
from dataclasses import dataclass
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (TensorMemoryLayout, mbarrier, tcgen05_commit,
                                                                 tcgen05_mma, tensor_memory_descriptor_type, tma)
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from .launch import DescArg, checked_config, launch_cached, placeholder, sm_count, softmax_args, tma_ready
from .channels import Descs, Ring, RingIndex, Signal, TmemRing, aggregate, opaque, tma_load_2d
from .common import resolve_output
from .masks import mask_block
from .schedule import Shape, work_units
from .naming import kernel_symbol

# One tcgen05 MMA covers 128 rows; a tile is two such halves, each with its own softmax partition.
HALF_ROWS = 128
ROWS_PER_HALF = gl.constexpr(HALF_ROWS)  # the same, for device code
LN2 = gl.constexpr(0.6931471805599453)
# Warps per partition, in warp_specialize order after the default (correction, 4 warps):
# load, mma, softmax0, softmax1, epilogue.
WORKER_WARPS = (1, 1, 4, 4, 1)
SOFTMAX_WARPS = gl.constexpr(4)
NUM_WARPS = 4
# setmaxnreg budgets (per thread). The three 1-warp partitions share one warpgroup, which gets the
# largest of their counts. The MMA warp needs 48: ptxas keeps the shared-memory descriptors of every
# k-step in registers, and under a ``cutlass_`` name hoists more of them (at 24 it spilled 18-68
# instructions per fp16 build). The correction partition (default) gets what the others leave.
LOAD_REGS = gl.constexpr(24)
MMA_REGS = gl.constexpr(48)
EPILOGUE_REGS = gl.constexpr(24)
SM100_REGS_PER_THREAD = 512  # 64K registers over 128 threads: the per-thread budgets of 4 warpgroups sum to this
CORRECTION_MIN_REGS = 64  # one O column chunk (<= 32 fp32), the row statistics and addresses
SM100_SMEM_BYTES = 232448  # 227 KB of dynamic shared memory per block
SM100_TMEM_COLUMNS = 512
SMEM_SLACK = 1024


@gluon.constexpr_function
def get_tmem_reg_layout(dtype, shape, layout, num_warps):
    """The register layout of a tcgen05.ld/st (32x32b) of a [M, N] tensor-memory tile over ``num_warps``."""
    return tensor_memory_descriptor_type(dtype, shape, layout, shape).get_reg_layout(num_warps=num_warps)
HEAD_DIMS = (64, 128)
DTYPES = ("fp16", "bf16", "fp8e5", "fp8e4m3")


@aggregate
class Cfg:
    """Every partition's view of the launch: the problem's sizes (``schedule.Shape``), the grid, the
    scales and outputs, and every compile-time choice of the build."""
    shape: Shape
    num_progs: gl.tensor
    qk_scale: gl.tensor
    o_scale: gl.tensor
    lse_ptr: gl.tensor
    o_ptr: gl.tensor  # VARLEN: the packed [total, H, D] output, for the masked store of a sequence's last tile
    dtype: gl.constexpr
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    CAUSAL: gl.constexpr
    SPLIT_D: gl.constexpr  # column chunks the correction partition works O in
    RETURN_LSE: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, shape, num_progs, qk_scale, o_scale, lse_ptr, o_ptr, dtype, BLOCK_M, BLOCK_N, CAUSAL, SPLIT_D,
                 RETURN_LSE):
        self.shape = shape
        self.num_progs = num_progs
        self.qk_scale = qk_scale
        self.o_scale = o_scale
        self.lse_ptr = lse_ptr
        self.o_ptr = o_ptr
        self.dtype = gl.constexpr(dtype)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.SPLIT_D = gl.constexpr(SPLIT_D)
        self.RETURN_LSE = gl.constexpr(RETURN_LSE)

    @gluon.jit
    def localized(self):
        """The config with the launch's sizes and grid through ``opaque``, for a partition to derive
        its own values from."""
        sh = self.shape
        shape = Shape(opaque(sh.N_Q), opaque(sh.N_KV), sh.num_hz, sh.H, sh.G, opaque(sh.group_hz), sh.seq_ptr,
                      opaque(sh.n_seqs), sh.BLOCK_M, sh.BLOCK_N, sh.CAUSAL, sh.VARLEN)
        return Cfg(shape, opaque(self.num_progs), self.qk_scale, self.o_scale, self.lse_ptr, self.o_ptr, self.dtype,
                   self.BLOCK_M, self.BLOCK_N, self.CAUSAL, self.SPLIT_D, self.RETURN_LSE)

    @gluon.jit
    def units(self):
        """This program's first unit and the number of units: its share is ``range(first, n, num_progs)``."""
        return _program_id(self.num_progs), opaque(self.shape.num_units())


# ---------------------------------------------------------------------------------------------
# The kernel: buffers, barriers, and the six partitions
# ---------------------------------------------------------------------------------------------
# Sizes are not value-specialized (see the Hopper kernel: the host launches compiled kernels directly).
@gluon.jit(repr=kernel_symbol, do_not_specialize=["N_Q", "N_KV", "num_hz", "G", "group_hz", "n_seqs", "num_progs"])
def blackwell_attention_kernel(desc_q, desc_k, desc_v, desc_o, o_ptr, lse_ptr, seq_ptr, qk_scale, o_scale, N_Q, N_KV,
                               num_hz, G, group_hz, n_seqs, num_progs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               KV_STAGES: gl.constexpr, SPLIT_D: gl.constexpr, CAUSAL: gl.constexpr,
                               VARLEN: gl.constexpr, RETURN_LSE: gl.constexpr, SOFTMAX_REGS: gl.constexpr,
                               KERNEL_NAME: gl.constexpr):
    dtype: gl.constexpr = desc_q.dtype
    out_dtype: gl.constexpr = desc_o.dtype
    HEAD_DIM: gl.constexpr = desc_q.block_type.shape[3]
    M: gl.constexpr = ROWS_PER_HALF
    # NVMMA shared layouts: what TMA writes and tcgen05 reads (128-byte swizzle where rows allow).
    q_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, HEAD_DIM], dtype)
    kv_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    o_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, HEAD_DIM], out_dtype)
    # Tensor memory: fp32 accumulators, one 32-bit column per element (S: BLOCK_N columns, O: HEAD_DIM),
    # two halves: 2 x (BLOCK_N + HEAD_DIM) <= 512 columns.
    s_tmem: gl.constexpr = TensorMemoryLayout([M, BLOCK_N], col_stride=1)
    o_tmem: gl.constexpr = TensorMemoryLayout([M, HEAD_DIM], col_stride=1)

    q_ring = Ring.alloc(dtype, [M, HEAD_DIM], q_smem, 2, 1)
    kv_ring = Ring.alloc(dtype, [BLOCK_N, HEAD_DIM], kv_smem, KV_STAGES, 1)
    epi_ring = Ring.alloc(out_dtype, [M, HEAD_DIM], o_smem, 2, 1)
    s_ring0 = TmemRing.alloc(gl.float32, [M, BLOCK_N], s_tmem, 1, 1)
    s_ring1 = TmemRing.alloc(gl.float32, [M, BLOCK_N], s_tmem, 1, 1)
    o_ring0 = TmemRing.alloc(gl.float32, [M, HEAD_DIM], o_tmem, 1, 1)
    o_ring1 = TmemRing.alloc(gl.float32, [M, HEAD_DIM], o_tmem, 1, 1)
    stat0 = Signal.alloc(1, 1)
    stat1 = Signal.alloc(1, 1)
    fence_async_shared()
    shape = Shape(N_Q, N_KV, num_hz, desc_q.shape[1], G, group_hz, seq_ptr, n_seqs, BLOCK_M, BLOCK_N, CAUSAL, VARLEN)
    cfg = Cfg(shape, num_progs, qk_scale, o_scale, lse_ptr, o_ptr, dtype, BLOCK_M, BLOCK_N, CAUSAL, SPLIT_D,
              RETURN_LSE)
    descs = Descs(desc_q, desc_k, desc_v, desc_o)

    gl.warp_specialize([
        (_correction_partition, (cfg, s_ring0, s_ring1, stat0, stat1, o_ring0, o_ring1, epi_ring)),
        (_load_partition, (cfg, descs, q_ring, kv_ring)),
        (_mma_partition, (cfg, q_ring, kv_ring, s_ring0, s_ring1, o_ring0, o_ring1)),
        (_softmax_partition, (cfg, s_ring0, stat0, 0)),
        (_softmax_partition, (cfg, s_ring1, stat1, 1)),
        (_epilogue_partition, (cfg, descs, epi_ring)),
    ], [1, 1, 4, 4, 1], [LOAD_REGS, MMA_REGS, SOFTMAX_REGS, SOFTMAX_REGS, EPILOGUE_REGS])  # = WORKER_WARPS


# ---------------------------------------------------------------------------------------------
# The correction partition (default, 4 warps): O rescales, O / l, the lse
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _correct_half(s_ring, stat_sig, c_it, o_ring, o_it, rescale, SPLIT_D: gl.constexpr):
    """Read this block's statistics; from the second block on, rescale O by alpha between PVs."""
    s_buf = s_ring.mem.index(0)
    stat_layout: gl.constexpr = _stat_reg_layout(4)
    o_mem = o_ring.mem.index(0)
    M: gl.constexpr = o_mem.shape[0]
    HEAD_DIM: gl.constexpr = o_mem.shape[1]
    CHUNK: gl.constexpr = HEAD_DIM // SPLIT_D
    chunk_layout: gl.constexpr = get_tmem_reg_layout(gl.float32, [M, CHUNK], TensorMemoryLayout([M, CHUNK], 1), 4)
    row_layout: gl.constexpr = gl.SliceLayout(1, chunk_layout)
    stat_sig.wait_ready(c_it)
    alpha = gl.convert_layout(_stat_view(s_buf, 0).load(stat_layout).reshape([M]), row_layout)
    m_i = gl.convert_layout(_stat_view(s_buf, 1).load(stat_layout).reshape([M]), row_layout)
    l_i = gl.convert_layout(_stat_view(s_buf, 2).load(stat_layout).reshape([M]), row_layout)
    stat_sig.release(c_it)
    if rescale:
        o_buf = o_ring.wait_ready(o_it)  # the previous PV has landed
        # In column chunks, to bound the registers each thread holds.
        for i in gl.static_range(SPLIT_D):
            o_chunk = o_buf.slice(i * CHUNK, CHUNK)
            o_chunk.store(o_chunk.load(chunk_layout) * gl.expand_dims(alpha, 1))
        o_ring.release(o_it)  # the next PV may accumulate
        o_it = o_it.next()
    return c_it.next(), o_it, m_i, l_i


@gluon.jit
def _finish_half(cfg, o_ring, o_it, epi_ring, epi_it, m_i, l_i, w, q_row0):
    """After the last PV: O / l, in the output dtype, into the epilogue's shared-memory buffer (a packed
    sequence's last rows straight to the output, masked: the epilogue's descriptor would not clip them
    at the next sequence). Rows that see no key have l = 0 and get 0."""
    SPLIT_D: gl.constexpr = cfg.SPLIT_D
    o_mem = o_ring.mem.index(0)
    M: gl.constexpr = o_mem.shape[0]
    HEAD_DIM: gl.constexpr = o_mem.shape[1]
    CHUNK: gl.constexpr = HEAD_DIM // SPLIT_D
    chunk_layout: gl.constexpr = get_tmem_reg_layout(gl.float32, [M, CHUNK], TensorMemoryLayout([M, CHUNK], 1), 4)
    o_buf = o_ring.wait_ready(o_it)
    smem, smem_ready = epi_ring.acquire_empty(epi_it)
    out_dtype: gl.constexpr = smem.dtype
    scale = gl.expand_dims(gl.where(l_i > 0, cfg.o_scale / l_i, 0.0), 1)
    rows = q_row0 + gl.arange(0, M, gl.SliceLayout(1, chunk_layout))
    if cfg.shape.VARLEN and q_row0 + M > w.n_q:
        H = cfg.shape.H
        row_ptr = cfg.o_ptr + ((w.q_base + rows).to(gl.int64) * H + w.h) * HEAD_DIM
        cols = gl.arange(0, CHUNK, gl.SliceLayout(0, chunk_layout))
        for i in gl.static_range(SPLIT_D):
            o = o_buf.slice(i * CHUNK, CHUNK).load(chunk_layout) * scale
            ptrs = gl.expand_dims(row_ptr + i * CHUNK, 1) + gl.expand_dims(cols, 0)
            gl.store(ptrs, o.to(out_dtype), mask=gl.expand_dims(rows < w.n_q, 1))
    else:
        for i in gl.static_range(SPLIT_D):
            o = o_buf.slice(i * CHUNK, CHUNK).load(chunk_layout) * scale
            smem.slice(i * CHUNK, CHUNK, dim=1).store(o.to(out_dtype))
    fence_async_shared()
    mbarrier.arrive(smem_ready, count=1)
    o_ring.release(o_it)  # the next tile's first PV may overwrite O
    if cfg.RETURN_LSE:
        lse = (m_i + gl.log2(l_i)) * LN2
        gl.store(cfg.shape.lse_row(cfg.lse_ptr, w) + rows, lse, mask=rows < w.n_q)
    return o_it.next(), epi_it.next()


@gluon.jit
def _correction_partition(cfg, s_ring0, s_ring1, stat0, stat1, o_ring0, o_ring1, epi_ring):
    SPLIT_D: gl.constexpr = cfg.SPLIT_D
    c0_it = RingIndex.start(1)
    c1_it = RingIndex.start(1)
    o0_it = RingIndex.start(1)
    o1_it = RingIndex.start(1)
    epi_it = RingIndex.start(epi_ring.NUM)
    cfg = cfg.localized()
    first_unit, n_units = cfg.units()
    for unit in range(first_unit, n_units, cfg.num_progs):
        w = cfg.shape.work(unit)
        for t in range(w.n_tiles):
            pid_m = w.tile(t)
            n_blocks = w.kv_blocks(pid_m)
            # Block 0 carries no rescale; its statistics are the final ones when it is the only block.
            c0_it, o0_it, m0, l0 = _correct_half(s_ring0, stat0, c0_it, o_ring0, o0_it, False, SPLIT_D)
            c1_it, o1_it, m1, l1 = _correct_half(s_ring1, stat1, c1_it, o_ring1, o1_it, False, SPLIT_D)
            for j in range(1, n_blocks):
                c0_it, o0_it, m0, l0 = _correct_half(s_ring0, stat0, c0_it, o_ring0, o0_it, True, SPLIT_D)
                c1_it, o1_it, m1, l1 = _correct_half(s_ring1, stat1, c1_it, o_ring1, o1_it, True, SPLIT_D)
            q_row0 = pid_m * cfg.BLOCK_M
            o0_it, epi_it = _finish_half(cfg, o_ring0, o0_it, epi_ring, epi_it, m0, l0, w, q_row0)
            o1_it, epi_it = _finish_half(cfg, o_ring1, o1_it, epi_ring, epi_it, m1, l1, w, q_row0 + ROWS_PER_HALF)


# ---------------------------------------------------------------------------------------------
# The load (1 warp) and MMA (1 warp) partitions
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _load_partition(cfg, descs, q_ring, kv_ring):
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    BLOCK_N: gl.constexpr = cfg.BLOCK_N
    q_it = RingIndex.start(q_ring.NUM)
    kv_it = RingIndex.start(kv_ring.NUM)
    cfg = cfg.localized()
    first_unit, n_units = cfg.units()
    for unit in range(first_unit, n_units, cfg.num_progs):
        w = cfg.shape.work(unit)
        for t in range(w.n_tiles):
            pid_m = w.tile(t)
            for half in gl.static_range(2):
                q_buf, q_bar = q_ring.acquire_empty(q_it)
                tma_load_2d(descs.q, w.q_coords(pid_m * BLOCK_M + half * ROWS_PER_HALF), q_bar, q_buf)
                q_it = q_it.next()
            for j in range(w.kv_blocks(pid_m)):
                # K and V share one ring, alternating, in the order the MMA partition consumes them.
                k_buf, k_bar = kv_ring.acquire_empty(kv_it)
                tma_load_2d(descs.k, w.kv_coords(j * BLOCK_N), k_bar, k_buf)
                kv_it = kv_it.next()
                v_buf, v_bar = kv_ring.acquire_empty(kv_it)
                tma_load_2d(descs.v, w.kv_coords(j * BLOCK_N), v_bar, v_buf)
                kv_it = kv_it.next()


@gluon.jit
def _issue_pv(s_ring, s_it, o_ring, o_it, v_buf, use_acc, extra_bars: gl.constexpr, v_empty, dtype: gl.constexpr):
    """O_h (+)= P_h V once the softmax has written P_h and the correction has rescaled O_h."""
    s_buf, _ = s_ring.acquire_empty(s_it)
    o_buf, o_ready = o_ring.acquire_empty(o_it)
    if extra_bars:
        tcgen05_mma(_p_view(s_buf, dtype), v_buf, o_buf, use_acc=use_acc, mbarriers=[o_ready, v_empty])
    else:
        tcgen05_mma(_p_view(s_buf, dtype), v_buf, o_buf, use_acc=use_acc, mbarriers=[o_ready])
    return s_it.next(), o_it.next()


@gluon.jit
def _mma_partition(cfg, q_ring, kv_ring, s_ring0, s_ring1, o_ring0, o_ring1):
    dtype: gl.constexpr = kv_ring.mem.dtype
    q_it = RingIndex.start(q_ring.NUM)
    kv_it = RingIndex.start(kv_ring.NUM)
    s0_it = RingIndex.start(1)
    s1_it = RingIndex.start(1)
    o0_it = RingIndex.start(1)
    o1_it = RingIndex.start(1)
    # The first S of each half goes into a free buffer: take the fresh phase once. From then on a
    # half's S buffer is re-acquired before each PV (the softmax has written P over it) and the next
    # QK^T writes it after that PV, in tcgen05 issue order.
    s0, s0_ready = s_ring0.acquire_empty(s0_it)
    s0_it = s0_it.next()
    s1, s1_ready = s_ring1.acquire_empty(s1_it)
    s1_it = s1_it.next()
    cfg = cfg.localized()
    first_unit, n_units = cfg.units()
    for unit in range(first_unit, n_units, cfg.num_progs):
        w = cfg.shape.work(unit)
        for t in range(w.n_tiles):
            pid_m = w.tile(t)
            n_blocks = w.kv_blocks(pid_m)
            q0_it = q_it
            q0 = q_ring.wait_ready(q_it)
            q_it = q_it.next()
            q1_it = q_it
            q1 = q_ring.wait_ready(q_it)
            q_it = q_it.next()

            k_it = kv_it
            k = kv_ring.wait_ready(kv_it)
            kv_it = kv_it.next()
            tcgen05_mma(q0, k.permute((1, 0)), s0, use_acc=False, mbarriers=[s0_ready])
            tcgen05_mma(q1, k.permute((1, 0)), s1, use_acc=False, mbarriers=[s1_ready, kv_ring.sig.empty_bar(k_it)])
            v_it = kv_it
            v = kv_ring.wait_ready(kv_it)
            kv_it = kv_it.next()
            s0_it, o0_it = _issue_pv(s_ring0, s0_it, o_ring0, o0_it, v, False, False, v, dtype)

            for j in range(1, n_blocks):
                k_it = kv_it
                k = kv_ring.wait_ready(kv_it)
                kv_it = kv_it.next()
                tcgen05_mma(q0, k.permute((1, 0)), s0, use_acc=False, mbarriers=[s0_ready])
                # Half 1's PV of the previous block runs while half 0's softmax works on S_0.
                s1_it, o1_it = _issue_pv(s_ring1, s1_it, o_ring1, o1_it, v, j > 1, True,
                                         kv_ring.sig.empty_bar(v_it), dtype)
                tcgen05_mma(q1, k.permute((1, 0)), s1, use_acc=False, mbarriers=[s1_ready, kv_ring.sig.empty_bar(k_it)])
                v_it = kv_it
                v = kv_ring.wait_ready(kv_it)
                kv_it = kv_it.next()
                s0_it, o0_it = _issue_pv(s_ring0, s0_it, o_ring0, o0_it, v, True, False, v, dtype)

            # Both Q halves are read by every QK^T issued so far: release them when those complete.
            tcgen05_commit(q_ring.sig.empty_bar(q0_it))
            tcgen05_commit(q_ring.sig.empty_bar(q1_it))
            s1_it, o1_it = _issue_pv(s_ring1, s1_it, o_ring1, o1_it, v, n_blocks > 1, True,
                                     kv_ring.sig.empty_bar(v_it), dtype)


# ---------------------------------------------------------------------------------------------
# The softmax partitions (4 warps each, one per 128-row half)
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _exp_chunk(s, m_new, qk_scale, p_tmem, dtype: gl.constexpr, NW: gl.constexpr):
    """exp2 of one column chunk, written to its P columns; returns the chunk's row sums."""
    M: gl.constexpr = s.shape[0]
    CH: gl.constexpr = s.shape[1]
    p_layout: gl.constexpr = get_tmem_reg_layout(dtype, [M, CH], TensorMemoryLayout([M, CH], col_stride=1), NW)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    p_tmem.store(gl.convert_layout(p.to(dtype), p_layout))
    return gl.sum(p, 1)


@gluon.jit
def _softmax_block(cfg, s_ring, s_it, stat_sig, m_i, l_i, start_n, diag_row0, n_k, MASKED: gl.constexpr):
    """One block: S -> P (written over S), alpha / m / l to the correction partition.

    S is read as two column halves: both are needed for the row max, but each half's exp2 and P
    store can then finish before the other's starts, which keeps a softmax thread (one row each)
    within its register budget."""
    NW: gl.constexpr = SOFTMAX_WARPS
    dtype: gl.constexpr = cfg.dtype
    qk_scale = cfg.qk_scale
    s_buf = s_ring.wait_ready(s_it)
    M: gl.constexpr = s_buf.shape[0]
    BLOCK_N: gl.constexpr = s_buf.shape[1]
    CH: gl.constexpr = BLOCK_N // 2
    c_layout: gl.constexpr = get_tmem_reg_layout(gl.float32, [M, CH], TensorMemoryLayout([M, CH], col_stride=1), NW)
    stat_layout: gl.constexpr = _stat_reg_layout(NW)
    s0 = s_buf.slice(0, CH).load(c_layout)
    s1 = s_buf.slice(CH, CH).load(c_layout)
    if MASKED:
        s0 = mask_block(s0, start_n, diag_row0, n_k, cfg.CAUSAL)
        s1 = mask_block(s1, start_n + CH, diag_row0, n_k, cfg.CAUSAL)
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
    _stat_view(s_buf, 1).store(gl.convert_layout(gl.expand_dims(m_new, 1), stat_layout))
    _stat_view(s_buf, 2).store(gl.convert_layout(gl.expand_dims(l_i, 1), stat_layout))
    stat_sig.arrive_ready(s_it)
    s_ring.release(s_it)  # P is in place: the MMA partition may issue PV
    return s_it.next(), m_new, l_i


@gluon.jit
def _softmax_loop(cfg, s_ring, s_it, stat_sig, m_i, l_i, lo, hi, w, q_row0, MASKED: gl.constexpr):
    BLOCK_N: gl.constexpr = s_ring.mem.shape[2]
    for j in range(lo, hi):
        s_it, m_i, l_i = _softmax_block(cfg, s_ring, s_it, stat_sig, m_i, l_i, j * BLOCK_N, q_row0 + w.shift, w.n_k,
                                        MASKED)
    return s_it, m_i, l_i


@gluon.jit
def _softmax_partition(cfg, s_ring, stat_sig, HALF: gl.constexpr):
    NW: gl.constexpr = SOFTMAX_WARPS
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    M: gl.constexpr = s_ring.mem.shape[1]
    BLOCK_N: gl.constexpr = s_ring.mem.shape[2]
    CH: gl.constexpr = BLOCK_N // 2
    chunk_layout: gl.constexpr = get_tmem_reg_layout(gl.float32, [M, CH], TensorMemoryLayout([M, CH], col_stride=1),
                                                     NW)
    row_layout: gl.constexpr = gl.SliceLayout(1, chunk_layout)
    s_it = RingIndex.start(1)
    cfg = cfg.localized()
    first_unit, n_units = cfg.units()
    for unit in range(first_unit, n_units, cfg.num_progs):
        w = cfg.shape.work(unit)
        for t in range(w.n_tiles):
            pid_m = w.tile(t)
            n_blocks = w.kv_blocks(pid_m)
            q_row0 = pid_m * BLOCK_M + HALF * ROWS_PER_HALF
            # Blocks [0, n_unmasked) lie inside the key range and below this half's diagonal: no mask.
            n_unmasked = gl.minimum(w.unmasked_blocks(q_row0), n_blocks)
            m_i = gl.full([M], -float("inf"), gl.float32, row_layout)
            l_i = gl.full([M], 0.0, gl.float32, row_layout)
            s_it, m_i, l_i = _softmax_loop(cfg, s_ring, s_it, stat_sig, m_i, l_i, 0, n_unmasked, w, q_row0, False)
            s_it, m_i, l_i = _softmax_loop(cfg, s_ring, s_it, stat_sig, m_i, l_i, n_unmasked, n_blocks, w, q_row0,
                                           True)


# ---------------------------------------------------------------------------------------------
# The epilogue partition (1 warp): TMA stores
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _epilogue_partition(cfg, descs, epi_ring):
    desc_o = descs.o
    BLOCK_M: gl.constexpr = cfg.BLOCK_M
    epi_it = RingIndex.start(epi_ring.NUM)
    cfg = cfg.localized()
    first_unit, n_units = cfg.units()
    for unit in range(first_unit, n_units, cfg.num_progs):
        w = cfg.shape.work(unit)
        for t in range(w.n_tiles):
            pid_m = w.tile(t)
            for half in gl.static_range(2):
                smem = epi_ring.wait_ready(epi_it)
                q_row0 = pid_m * BLOCK_M + half * ROWS_PER_HALF
                # Dense: rows past N_Q are clipped by the descriptor. A packed sequence's last rows went
                # out masked from the correction partition (``_finish_half``).
                if not (cfg.shape.VARLEN and q_row0 + ROWS_PER_HALF > w.n_q):
                    view = smem.reinterpret(desc_o.dtype, desc_o.block_type.shape, desc_o.layout)
                    tma.async_store(desc_o, w.q_coords(q_row0), view)
                    tma.store_wait(0)
                epi_ring.release(epi_it)
                epi_it = epi_it.next()


# ---------------------------------------------------------------------------------------------
# Tensor-memory views
# ---------------------------------------------------------------------------------------------

@gluon.jit
def _p_view(s_buf, dtype: gl.constexpr):
    """P over S: the same columns reinterpreted as the input dtype, packed (2 fp16 or 4 fp8 per
    32-bit column), so P takes the first BLOCK_N / 2 (or / 4) columns of S."""
    M: gl.constexpr = s_buf.shape[0]
    BLOCK_N: gl.constexpr = s_buf.shape[1]
    layout: gl.constexpr = TensorMemoryLayout([M, BLOCK_N], col_stride=1)
    return s_buf.reinterpret(dtype, [M, BLOCK_N], layout)


@gluon.jit
def _stat_view(s_buf, which: gl.constexpr):
    """One fp32 column of S past P's columns: 0 carries alpha, 1 the running max, 2 the running sum."""
    M: gl.constexpr = s_buf.shape[0]
    BLOCK_N: gl.constexpr = s_buf.shape[1]
    layout: gl.constexpr = TensorMemoryLayout([M, 1], col_stride=1)
    return s_buf.slice(BLOCK_N // 2 + which, 1).reinterpret(gl.float32, [M, 1], layout)


@gluon.constexpr_function
def _stat_reg_layout(num_warps):
    # Tensor-memory lane i is thread i: one row per thread, as the 32x32b TMEM messages move data.
    return gl.BlockedLayout([1, 1], [32, 1], [num_warps, 1], [0, 1])


# ---------------------------------------------------------------------------------------------
# Partitions
# ---------------------------------------------------------------------------------------------

@gluon.jit
def _program_id(anchor):
    """This program's index, read inside the partition that uses it. A plain ``program_id`` is
    hoisted into the kernel prologue and then has to survive every partition's ``setmaxnreg``, which
    ptxas does through local memory; an asm read with side effects stays where it is written."""
    return gl.inline_asm_elementwise("mov.u32 $0, %ctaid.x;", "=r,r", [anchor], dtype=gl.int32, is_pure=False,
                                     pack=1)


# ---------------------------------------------------------------------------------------------
# Host side: configuration, validity, launch plan
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlackwellConfig:
    """Tile, pipeline and split knobs of the sm_100a kernel."""
    BLOCK_N: int = 128  # keys per K/V tile (and the N of the S MMA)
    KV_STAGES: int = 3  # K and V tiles alternate in one ring of this many buffers
    SPLIT_D: int = 4  # column chunks the correction partition rescales O in (bounds its registers)
    SOFTMAX_REGS: int = 192  # per thread, each softmax partition (setmaxnreg)

    @property
    def BLOCK_M(self) -> int:
        """Query rows per tile: two 128-row halves, one softmax partition each."""
        return 2 * HALF_ROWS

    def smem_bytes(self, head_dim: int, in_bytes: int, out_bytes: int) -> int:
        q = self.BLOCK_M * head_dim * in_bytes
        kv = self.KV_STAGES * self.BLOCK_N * head_dim * in_bytes
        o = self.BLOCK_M * head_dim * out_bytes
        bars = 8 * 2 * (2 + self.KV_STAGES + 2 + 4 + 2)
        return q + kv + o + bars

    def tmem_columns(self, head_dim: int) -> int:
        """S and O of both halves, fp32: one column per element."""
        return 2 * (self.BLOCK_N + head_dim)

    def correction_regs(self) -> int:
        """The default (correction) partition's budget: what the worker warpgroups leave."""
        one_warp = max(int(LOAD_REGS), int(MMA_REGS), int(EPILOGUE_REGS))
        return SM100_REGS_PER_THREAD - 2 * self.SOFTMAX_REGS - one_warp

    def invalid_reasons(self, head_dim: int, dtype: str) -> list[str]:
        reasons = []
        in_bytes = 1 if dtype.startswith("fp8") else 2
        if dtype not in DTYPES:
            reasons.append(f"dtype {dtype} not supported (supported: {', '.join(DTYPES)})")
        if head_dim not in HEAD_DIMS:
            reasons.append(f"head dim {head_dim} not supported (supported: {', '.join(map(str, HEAD_DIMS))})")
        if self.BLOCK_N not in (64, 128):
            reasons.append(f"BLOCK_N {self.BLOCK_N} not in (64, 128)")
        if self.KV_STAGES < 2:
            reasons.append("KV_STAGES must be >= 2 (K and V of one block)")
        if head_dim in HEAD_DIMS and (head_dim % self.SPLIT_D or (head_dim // self.SPLIT_D) < 16):
            reasons.append(f"SPLIT_D {self.SPLIT_D} must divide head dim {head_dim} into chunks of >= 16")
        if self.SOFTMAX_REGS % 8 or not 24 <= self.SOFTMAX_REGS <= 256:
            reasons.append(f"SOFTMAX_REGS {self.SOFTMAX_REGS} must be a multiple of 8 in [24, 256]")
        # S (BLOCK_N fp32 per thread: one row each) must fit beside P and temporaries.
        if self.SOFTMAX_REGS < self.BLOCK_N + 48:
            reasons.append(f"registers: a softmax thread holds a {self.BLOCK_N}-wide S row: SOFTMAX_REGS "
                           f"{self.SOFTMAX_REGS} < {self.BLOCK_N + 48}")
        if self.correction_regs() < CORRECTION_MIN_REGS:
            reasons.append(f"registers: 2 softmax warpgroups at {self.SOFTMAX_REGS} leave the correction partition "
                           f"{self.correction_regs()} < {CORRECTION_MIN_REGS}")
        if head_dim in HEAD_DIMS:
            cols = self.tmem_columns(head_dim)
            if cols > SM100_TMEM_COLUMNS:
                reasons.append(f"tensor memory: {cols} columns > {SM100_TMEM_COLUMNS}")
            smem = self.smem_bytes(head_dim, in_bytes, 2)
            if smem + SMEM_SLACK > SM100_SMEM_BYTES:
                reasons.append(f"shared memory: {smem} B > {SM100_SMEM_BYTES} B")
        return reasons

    def label(self) -> str:
        return (f"BM{self.BLOCK_M}_BN{self.BLOCK_N}_S{self.KV_STAGES}_D{self.SPLIT_D}"
                f"_r{self.SOFTMAX_REGS}")

    def describe(self) -> dict:
        """The columns ``configs`` and ``optimize`` show it with."""
        return {"config": self.label(), "block_m": self.BLOCK_M, "block_n": self.BLOCK_N, "stages": self.KV_STAGES,
                "partitions": "corr+load+mma+2 softmax+epi", "schedule": "halves interleaved",
                "split_d": self.SPLIT_D, "regs": self.SOFTMAX_REGS}


CONFIG = BlackwellConfig


def config_space():
    for block_n, stages, split_d, regs in itertools.product((64, 128, 256), range(2, 9), (1, 2, 4, 8),
                                                            (176, 184, 192, 200)):
        yield BlackwellConfig(BLOCK_N=block_n, KV_STAGES=stages, SPLIT_D=split_d, SOFTMAX_REGS=regs)


def in_focused_space(cfg: BlackwellConfig) -> bool:
    """128-key tiles and 192 softmax registers (no sm_100 measurements to narrow it further)."""
    return cfg.BLOCK_N == 128 and cfg.SOFTMAX_REGS == 192


@functools.lru_cache(maxsize=None)
def default_config(head_dim: int, dtype: str, causal: Optional[bool] = None, n_ctx: int = 8192) -> BlackwellConfig:
    """The sm_100a tuning table's entry for the class (none measured: no Blackwell GPU here), else the
    rule: the deepest K/V ring that fits shared memory, capped at 8 tiles."""
    from . import tuning

    if causal is not None:
        entry = tuning.lookup("sm_100a", head_dim, dtype, causal, n_ctx)
        if entry is not None:
            cfg = BlackwellConfig(**entry)
            if not cfg.invalid_reasons(head_dim, dtype):
                return cfg
    best = None
    for stages in range(2, 9):
        cfg = BlackwellConfig(KV_STAGES=stages)
        if not cfg.invalid_reasons(head_dim, dtype):
            best = cfg
    if best is None:
        raise ValueError(f"no valid Blackwell config for head dim {head_dim}, dtype {dtype}")
    return best


def packed_config(cfg: BlackwellConfig) -> BlackwellConfig:
    """The default config's form for packed sequences: the same (this kernel's schedule is static)."""
    return cfg


def block_shapes(head_dim: int, cfg: BlackwellConfig):
    q = [1, 1, HALF_ROWS, head_dim]
    kv = [1, 1, cfg.BLOCK_N, head_dim]
    return q, kv, kv, q


def kernel_constexprs(cfg: BlackwellConfig, causal: bool, return_lse: bool, name: str, varlen: bool = False) -> dict:
    return dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, KV_STAGES=cfg.KV_STAGES, SPLIT_D=cfg.SPLIT_D,
                CAUSAL=bool(causal), VARLEN=bool(varlen), RETURN_LSE=bool(return_lse), SOFTMAX_REGS=cfg.SOFTMAX_REGS,
                KERNEL_NAME=name)


RUNTIME_SIGNATURE = {"lse_ptr": "*fp32", "seq_ptr": "*i32", "qk_scale": "fp32", "o_scale": "fp32", "N_Q": "i32",
                     "N_KV": "i32", "num_hz": "i32", "G": "i32", "group_hz": "i32", "n_seqs": "i32",
                     "num_progs": "i32"}


@dataclass
class LaunchPlan:
    """Everything a launch needs, computed on the host without touching a GPU (tested on CPU)."""
    config: BlackwellConfig
    grid: int
    args: tuple
    constexprs: dict
    out: torch.Tensor
    lse: Optional[torch.Tensor]
    signature: tuple


def plan_launch(q, k, v, *, causal: bool, sm_scale: Optional[float], descale_q: float, descale_k: float,
                descale_v: float, return_lse: bool, out: Optional[torch.Tensor], out_dtype: Optional[torch.dtype],
                config: Optional[BlackwellConfig], kernel_name: str, sm_count: int,
                head_group_size: Optional[int] = None, varlen=None) -> LaunchPlan:
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
    out, out_dtype = resolve_output(q, out, out_dtype, is_fp8)
    bq, bk, bv, bo = block_shapes(D, cfg)
    tensors = [tma_ready(t) for t in (q, k, v, out)]
    descs = [DescArg.of(t, b) for t, b in zip(tensors, (bq, bk, bv, bo))]
    qk_scale, lse, lse_arg = softmax_args(q, sm_scale, descale_q, descale_k, return_lse)
    n_seqs = 0 if varlen is None else varlen.n_seqs
    grid = max(1, min(sm_count, work_units(-(-N_Q // cfg.BLOCK_M), (n_seqs or Z) * H, causal)))
    G = H // H_KV
    group = G if causal else (head_group_size or G)  # (see schedule.unit_tiles)
    table = varlen.table(H, cfg.BLOCK_M, causal) if varlen is not None else placeholder(q.device, torch.int32)
    args = (*descs, tensors[3], lse_arg, table, qk_scale, float(descale_v), q.shape[2], k.shape[2], Z * H, G, group,
            n_seqs, grid)
    consts = kernel_constexprs(cfg, causal, return_lse, kernel_name, varlen is not None)
    return LaunchPlan(cfg, grid, args, consts, out if tensors[3] is out else tensors[3], lse,
                      (q.dtype, out_dtype, D))


def blackwell_attention(q, k, v, *, causal: bool = False, sm_scale: Optional[float] = None, descale_q: float = 1.0,
                        descale_k: float = 1.0, descale_v: float = 1.0, return_lse: bool = False,
                        out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                        config: Optional[BlackwellConfig] = None, kernel_name: str = "gluon_attention",
                        head_group_size: Optional[int] = None, varlen=None):
    """Launch the sm_100a kernel on validated CUDA tensors (see ``gluon_attn.attention`` and ``plan_launch``).
    Compile-verified only: no Blackwell GPU was available to this project."""
    plan = plan_launch(q, k, v, causal=causal, sm_scale=sm_scale, descale_q=descale_q, descale_k=descale_k,
                       descale_v=descale_v, return_lse=return_lse, out=out, out_dtype=out_dtype, config=config,
                       kernel_name=kernel_name, sm_count=sm_count(q.device), head_group_size=head_group_size,
                       varlen=varlen)
    launch_cached(blackwell_attention_kernel, NUM_WARPS, plan.grid, plan.args, plan.constexprs, q.device,
                  plan.signature)
    result = plan.out
    if out is not None and result is not out:
        out.copy_(result)
        result = out
    return (result, plan.lse) if return_lse else result


launch = blackwell_attention


def build(dtype: str, head_dim: int, causal: bool, cfg: BlackwellConfig, name: str, varlen: bool = False):
    """The compile-only build of one specialization (``inspect``, the compile tests)."""
    from ..problem import dtype_from_name
    from .build import KernelBuild
    from .common import descriptor_signature, sig_dtype

    in_dtype = dtype_from_name(dtype)
    out_dtype = dtype_from_name("fp16") if dtype.startswith("fp8") else in_dtype

    bq, bk, bv, bo = block_shapes(head_dim, cfg)
    constexprs = kernel_constexprs(cfg, causal, False, name, varlen)
    descs = {n: descriptor_signature(t, block) for n, t, block in (
        ("desc_q", in_dtype, bq), ("desc_k", in_dtype, bk), ("desc_v", in_dtype, bv), ("desc_o", out_dtype, bo))}
    o_ptr = {"o_ptr": "*" + sig_dtype(out_dtype)}
    return KernelBuild(fn=blackwell_attention_kernel,
                       signature={**descs, **o_ptr, **RUNTIME_SIGNATURE, **{k: "constexpr" for k in constexprs}},
                       constexprs=constexprs, num_warps=NUM_WARPS, name=name,
                       description=f"Blackwell attention {dtype} D={head_dim} causal={causal}"
                                   f"{' varlen' if varlen else ''} {cfg.label()}")
