"""What the Gluon kernels share: dtype mapping and small host helpers."""

from typing import NamedTuple

import torch
from triton.experimental.gluon import language as gl

_GL_DTYPES = {
    torch.float16: gl.float16,
    torch.bfloat16: gl.bfloat16,
    torch.float8_e5m2: gl.float8e5,
    torch.float8_e4m3fn: gl.float8e4nv,
    torch.float32: gl.float32,
}
# Signature strings Triton uses for tensor-descriptor element types.
_SIG_DTYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e5m2: "fp8e5",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float32: "fp32",
}


def gl_dtype(dtype: torch.dtype):
    return _GL_DTYPES[dtype]


def sig_dtype(dtype: torch.dtype) -> str:
    return _SIG_DTYPES[dtype]


def resolve_output(q: torch.Tensor, out, out_dtype, is_fp8: bool):
    """The output tensor and dtype both kernels write: 16-bit inputs write their own dtype, fp8
    inputs fp16 (or bf16 on request); a new output keeps q's strides (layout)."""
    if out_dtype is None:
        out_dtype = torch.float16 if is_fp8 else q.dtype
    if out_dtype not in (torch.float16, torch.bfloat16) or (not is_fp8 and out_dtype != q.dtype):
        raise ValueError(f"out_dtype {out_dtype} not supported: 16-bit inputs write their own dtype, "
                         f"fp8 inputs write float16 or bfloat16")
    if out is None:
        return torch.empty_like(q, dtype=out_dtype), out_dtype
    if out.shape != q.shape or out.dtype != out_dtype or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {out_dtype} on {q.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out, out_dtype


def descriptor_signature(dtype: torch.dtype, block_shape, layout) -> str:
    """The signature string of a tensor-descriptor argument, for compile-only builds."""
    dims = ", ".join(str(int(d)) for d in block_shape)
    return f"tensordesc<{sig_dtype(dtype)}[{dims}],{layout!r}>"


# ---------------------------------------------------------------------------------------------
# Device-side pieces both attention kernels share
# ---------------------------------------------------------------------------------------------
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon.language.nvidia.blackwell import (  # noqa: E402
    allocate_tensor_memory, tensor_memory_descriptor)
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # noqa: E402
from triton.language.core import _aggregate as aggregate  # noqa: E402


@aggregate
class RingIndex:
    """Position in a ring of NUM buffers: the slot index and the mbarrier phase to wait for."""
    index: gl.tensor
    phase: gl.tensor
    NUM: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, index, phase, NUM):
        self.index = index
        self.phase = phase
        self.NUM = gl.constexpr(NUM)

    @gluon.jit
    def start(NUM: gl.constexpr):
        return RingIndex(gl.to_tensor(0), gl.to_tensor(0), NUM)

    @gluon.must_use_result
    @gluon.jit
    def next(self):
        if self.NUM == 1:
            return RingIndex(self.index, self.phase ^ 1, self.NUM)
        nxt = self.index + 1
        wrap = nxt == self.NUM
        return RingIndex(gl.where(wrap, 0, nxt), gl.where(wrap, self.phase ^ 1, self.phase), self.NUM)


@aggregate
class Signal:
    """A ring of NUM ready/empty mbarrier pairs: the producer/consumer handshake without buffers.

    The producer waits ``empty`` (a fresh mbarrier counts as if its phase 1 had completed, so the
    first pass through the ring does not block), produces, and arrives on ``ready`` (or lets the
    copy engine / tensor core arrive); each of the NUM_CONSUMERS partitions waits ``ready`` and
    arrives on ``empty`` once done (an arrive from a multi-warp partition counts once)."""
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    NUM: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ready, empty, NUM):
        self.ready = ready
        self.empty = empty
        self.NUM = gl.constexpr(NUM)

    @gluon.jit
    def alloc(NUM: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
        ready = gl.allocate_shared_memory(gl.int64, [NUM, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=NUM_CONSUMERS)
        return Signal(ready, empty, NUM)

    @gluon.jit
    def acquire_empty(self, it):
        """Producer: wait until slot ``it`` may be produced into; returns its ready barrier."""
        mbarrier.wait(self.empty.index(it.index), it.phase ^ 1)
        return self.ready.index(it.index)

    @gluon.jit
    def wait_ready(self, it):
        """Consumer: wait until slot ``it`` has been produced."""
        mbarrier.wait(self.ready.index(it.index), it.phase)

    @gluon.jit
    def arrive_ready(self, it):
        """Producer that produces with ordinary instructions: publish slot ``it``."""
        mbarrier.arrive(self.ready.index(it.index), count=1)

    @gluon.jit
    def release(self, it):
        """Consumer: hand slot ``it`` back to the producer."""
        mbarrier.arrive(self.empty.index(it.index), count=1)

    @gluon.jit
    def empty_bar(self, it):
        """The empty barrier of slot ``it``, for consumers that release asynchronously (MMA commits)."""
        return self.empty.index(it.index)

    @gluon.jit
    def destroy(self):
        for i in gl.static_range(self.NUM):
            mbarrier.invalidate(self.ready.index(i))
            mbarrier.invalidate(self.empty.index(i))


def _buffer_ring(mem_type, allocate, what: str):
    """A producer/consumer ring of buffers of one memory kind, each guarded by a ``Signal`` slot."""

    @aggregate
    class BufferRing:
        mem: mem_type
        sig: Signal
        NUM: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, mem, sig, NUM):
            self.mem = mem
            self.sig = sig
            self.NUM = gl.constexpr(NUM)

        @gluon.jit
        def alloc(dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr, NUM: gl.constexpr,
                  NUM_CONSUMERS: gl.constexpr):
            mem = allocate(dtype, [NUM] + shape, layout)
            return BufferRing(mem, Signal.alloc(NUM, NUM_CONSUMERS), NUM)

        @gluon.jit
        def acquire_empty(self, it):
            """Producer: wait until slot ``it`` may be overwritten; returns (buffer, its ready barrier)."""
            return self.mem.index(it.index), self.sig.acquire_empty(it)

        @gluon.jit
        def wait_ready(self, it):
            """Consumer: wait until slot ``it`` holds data; returns the buffer."""
            self.sig.wait_ready(it)
            return self.mem.index(it.index)

        @gluon.jit
        def release(self, it):
            """Consumer: hand slot ``it`` back to the producer."""
            self.sig.release(it)

        @gluon.jit
        def destroy(self):
            self.sig.destroy()

    BufferRing.__doc__ = f"A producer/consumer ring of {what} buffers, each guarded by a ``Signal`` slot."
    return BufferRing


# Shared-memory buffers (TMA destinations, MMA operands) and, on Blackwell, tensor-memory buffers
# (MMA accumulators; the tensor core arrives on ``ready`` through the MMA's mbarriers).
Ring = _buffer_ring(gl.shared_memory_descriptor, gl.allocate_shared_memory, "shared-memory")
TmemRing = _buffer_ring(tensor_memory_descriptor, allocate_tensor_memory, "tensor-memory")


@gluon.jit
def tma_load_2d(desc, coords, bar, buf):
    """TMA-load one block of a 4-D [Z, H, N, D] descriptor into a 2-D shared buffer. Out-of-bounds rows
    are zero-filled per head, so tails never read a neighbouring head; the 2-D buffer has the block's
    swizzle and is viewed as the 4-D block for the copy."""
    view = buf._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, coords, bar, view)


@gluon.jit
def tma_load_2d_pair(desc_a, desc_b, coords_a, coords_b, bar, buf_a, buf_b):
    """Two blocks (of two descriptors) into two buffers on one barrier: its expected byte count is the
    sum, so the barrier completes once both copies have landed."""
    view_a = buf_a._reinterpret(desc_a.dtype, desc_a.block_type.shape, desc_a.layout)
    view_b = buf_b._reinterpret(desc_b.dtype, desc_b.block_type.shape, desc_b.layout)
    mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_a, coords_a, bar, view_a)
    tma.async_copy_global_to_shared(desc_b, coords_b, bar, view_b)


@gluon.jit
def tile_coords(tile_id, num_pid_m, num_hz, group_hz, CAUSAL: gl.constexpr):
    """Persistent tile scheduler: tile id -> (query block, batch*head).

    Tiles are walked in groups of ``group_hz`` heads so that the tiles running at once share those
    heads' K/V in L2 (the host sizes the group to fit). Within a group, causal walks the query
    blocks from the last (longest) to the first, so the static round-robin over programs ends on
    short tiles and balances the work; non-causal tiles are all equally long."""
    tiles_per_group = group_hz * num_pid_m
    group = tile_id // tiles_per_group
    r = tile_id - group * tiles_per_group
    first_hz = group * group_hz
    group_size = gl.minimum(num_hz - first_hz, group_hz)
    m = r // group_size
    off_hz = first_hz + r % group_size
    if CAUSAL:
        pid_m = num_pid_m - 1 - m
    else:
        pid_m = m
    return pid_m, off_hz


@gluon.jit
def mask_block(s, start_n, q_row0, N_CTX, CAUSAL: gl.constexpr):
    """S (rows from q_row0, keys from start_n) with -inf where a key is past N_CTX or (causal) past the
    row's diagonal. One bound per row, the last key it may see relative to start_n, is compared with
    the block's column numbers, which are constants in a thread's registers: no per-element index
    arithmetic, and few live registers (it removed the causal softmax's spills on sm_100a)."""
    M: gl.constexpr = s.shape[0]
    CH: gl.constexpr = s.shape[1]
    last = gl.full([M], N_CTX - 1, gl.int32, gl.SliceLayout(1, s.type.layout))
    if CAUSAL:
        last = gl.minimum(last, q_row0 + gl.arange(0, M, gl.SliceLayout(1, s.type.layout)))
    cols = gl.arange(0, CH, gl.SliceLayout(0, s.type.layout))
    keep = gl.expand_dims(cols, 0) <= gl.expand_dims(last - start_n, 1)
    return gl.where(keep, s, -float("inf"))


def work_units(num_pid_m: int, num_hz: int, causal: bool, pairs: bool) -> int:
    """Host side of ``unit_tiles``: how many work units the persistent loop walks."""
    return num_hz * ((num_pid_m + 1) // 2 if causal and pairs else num_pid_m)


@gluon.jit
def num_units(num_pid_m, num_hz, CAUSAL: gl.constexpr, PAIRS: gl.constexpr):
    if CAUSAL and PAIRS:
        return num_hz * ((num_pid_m + 1) // 2)
    else:
        return num_hz * num_pid_m


@gluon.jit
def unit_tiles(unit, num_pid_m, num_hz, group_hz, CAUSAL: gl.constexpr, PAIRS: gl.constexpr):
    """A work unit of the persistent loop -> (batch*head, first query block, second query block,
    number of tiles: 1 or 2). Each partition walks ``for unit in range(pid, num_units, num_progs)``
    and, inside, the unit's tiles ``first + t * (second - first)``.

    Causal with PAIRS: a unit is query block i and its mirror num_pid_m - 1 - i of one head (the
    middle block alone when num_pid_m is odd), so every unit holds the same number of K/V blocks:
    programs stay in step (balance without a longest-first order), and the units running at once
    cover a few consecutive heads, whose K/V stays in L2. Otherwise a unit is one tile
    (``tile_coords``)."""
    if CAUSAL and PAIRS:
        per_head = (num_pid_m + 1) // 2
        off_hz = unit // per_head
        i = unit - off_hz * per_head
        mirror = num_pid_m - 1 - i
        return off_hz, mirror, i, 2 - (mirror == i).to(gl.int32)
    else:
        pid_m, off_hz = tile_coords(unit, num_pid_m, num_hz, group_hz, CAUSAL)
        return off_hz, pid_m, pid_m, 1


@gluon.jit
def kv_block_range(pid_m, N_CTX, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Number of key/value blocks a query block visits (causal: up to its diagonal)."""
    if CAUSAL:
        hi = gl.minimum((pid_m + 1) * BLOCK_M, N_CTX)
    else:
        hi = N_CTX
    return gl.cdiv(hi, BLOCK_N)




# ---------------------------------------------------------------------------------------------
# The last round: tail tiles split into key-range pieces
# ---------------------------------------------------------------------------------------------
# A persistent grid of P programs walking U equal units ends with a partial round: U % P units on as
# many programs while the others idle (4096 tiles on 132 SMs: 31.03 per program, but the busiest does
# 32, 3% of the run). The units of that round are instead cut into tiles (a causal pair into its two
# query blocks) and each tile's key blocks into ``pieces`` ranges, one per program. The programs of a
# tile's first pieces write their partial O (normalised, fp32) and log2-sum-exp to a workspace; the
# last piece's program waits for them and merges them into the output.
MIN_PIECE_BLOCKS = 4  # below this a piece's own cost (Q load, pipeline fill, partial store) dominates
MAX_PIECES = 8  # the merge reads pieces - 1 partial tiles from L2 (a power of two, see ``tail_slot``)


class TailPlan(NamedTuple):
    """How the persistent loop walks: ``n_full`` whole units, then ``n_tail_tiles`` tiles as
    ``pieces`` key ranges each (``pieces`` = 1, ``n_tail_tiles`` = 0: no tail pieces)."""
    n_full: int
    pieces: int
    n_tail_tiles: int

    @property
    def n_units(self) -> int:
        return self.n_full + self.n_tail_tiles * self.pieces

    @property
    def piece_shift(self) -> int:
        return self.pieces.bit_length() - 1


def tail_plan(num_pid_m: int, num_hz: int, causal: bool, pairs: bool, n_progs: int, n_ctx: int, block_m: int,
              block_n: int, enabled: bool = True) -> TailPlan:
    """Host side of ``work_item``: split the last partial round when its tiles fit on the programs
    (causal without pairs walks longest first and ends on short tiles already: never split)."""
    units = work_units(num_pid_m, num_hz, causal, pairs)
    whole = TailPlan(units, 1, 0)
    full = units // n_progs * n_progs
    if not enabled or full == units or (causal and not pairs):
        return whole
    if causal:
        per_head = (num_pid_m + 1) // 2
        firsts = [u % per_head for u in range(full, units)]  # the shorter block of each pair
        n_tail_tiles = 2 * (units - full)
        nb_min = min(-(-min((i + 1) * block_m, n_ctx) // block_n) for i in firsts)
    else:
        n_tail_tiles = units - full
        nb_min = -(-n_ctx // block_n)
    if n_tail_tiles > n_progs:
        return whole
    pieces = max(1, min(MAX_PIECES, n_progs // n_tail_tiles, nb_min // MIN_PIECE_BLOCKS))
    pieces = 1 << (pieces.bit_length() - 1)  # a power of two: the kernel splits units by shifts
    if pieces == 1 and not causal:
        return whole
    return TailPlan(full, pieces, n_tail_tiles)


@gluon.jit
def tail_slot(unit, n_full, piece_shift):
    """(piece, log2 of the pieces, tail tile) of a unit: units below n_full are whole (piece 0 of 1,
    tail tile 0); the others are piece ``q % pieces`` of tail tile ``q // pieces``, q = unit - n_full,
    pieces = 2^piece_shift: shifts and masks rather than integer divisions."""
    q = unit - n_full
    shift = (q >= 0).to(gl.int32) * piece_shift
    q = gl.maximum(q, 0)
    tail_tile = q >> shift
    return q - (tail_tile << shift), shift, tail_tile


@gluon.jit
def work_item(unit, num_pid_m, num_hz, group_hz, n_full, piece_shift, CAUSAL: gl.constexpr, PAIRS: gl.constexpr,
              SPLIT: gl.constexpr):
    """``unit_tiles`` with the last round split (``tail_plan``): a unit -> (batch*head, first query
    block, second query block, number of tiles, piece, log2 of the pieces). Units below n_full are whole
    (piece 0 of 1); the others are piece ``piece`` of the key blocks of a tail tile (``tail_slot``). Written
    without branches: one inlined ``unit_tiles`` (integer divisions) instead of one per case. Without
    SPLIT every unit is whole (and the code is ``unit_tiles``'s alone)."""
    piece, shift, tail_tile = tail_slot(unit, n_full, piece_shift)
    is_tail = (unit >= n_full).to(gl.int32)
    if not SPLIT:
        off_hz, first_m, second_m, n_tiles = unit_tiles(unit, num_pid_m, num_hz, group_hz, CAUSAL, PAIRS)
        piece = unit * 0
        shift = piece
    elif CAUSAL and PAIRS:
        # Tail tiles 2u and 2u + 1: the two query blocks of pair n_full + u (the second is empty when
        # the pair is a single middle block).
        base = unit + is_tail * (n_full + tail_tile // 2 - unit)
        off_hz, first_m, second_m, n_tiles = unit_tiles(base, num_pid_m, num_hz, group_hz, CAUSAL, PAIRS)
        second = tail_tile % 2
        first_m = first_m + second * (second_m - first_m)
        second_m = second_m + is_tail * (first_m - second_m)
        n_tiles = n_tiles - is_tail * (n_tiles - gl.minimum(n_tiles - second, 1))
    else:
        base = unit + is_tail * (n_full + tail_tile - unit)
        off_hz, first_m, second_m, n_tiles = unit_tiles(base, num_pid_m, num_hz, group_hz, CAUSAL, PAIRS)
    return off_hz, first_m, second_m, n_tiles, piece, shift


@gluon.jit
def piece_range(n_blocks, piece, shift):
    """Key blocks [lo, hi) of piece ``piece`` of 2^shift (all of them for a whole tile)."""
    return (piece * n_blocks) >> shift, ((piece + 1) * n_blocks) >> shift


@gluon.jit
def _per_thread(ptr, NUM_WARPS: gl.constexpr):
    # ``ptr`` once per thread of a NUM_WARPS partition: inline asm on it runs exactly once per thread.
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    return ptr + gl.zeros([32 * NUM_WARPS], gl.int32, layout)


@gluon.jit
def count_arrive(counter_ptr, NUM_WARPS: gl.constexpr):
    """Every thread of the partition adds 1 to the counter with release semantics at GPU scope, after
    its own stores: a reader that sees the count also sees every thread's stores."""
    gl.inline_asm_elementwise("red.release.gpu.global.add.s32 [$1], 1;\n\tmov.b32 $0, 0;", "=r,l",
                              [_per_thread(counter_ptr, NUM_WARPS)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def count_wait(counter_ptr, target, NUM_WARPS: gl.constexpr):
    """Every thread of the partition spins with acquire loads until the counter reaches ``target``
    (the writers it waits for run on other programs of the same persistent grid, all resident)."""
    ptrs = _per_thread(counter_ptr, NUM_WARPS)
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tWAIT_COUNT:\n\tld.acquire.gpu.global.b32 $0, [$1];\n\tsetp.lt.s32 p, $0, $2;\n\t"
        "@p bra WAIT_COUNT;\n\t}", "=r,l,r", [ptrs, gl.full(ptrs.shape, target, gl.int32, ptrs.type.layout)],
        dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def opaque(x):
    """``x`` (i32) through an asm copy with side effects. What is derived from the copy is computed
    where the copy is: not hoisted above it (e.g. before the partitions split, to live through every
    ``setmaxnreg``) and not merged with the same expression computed earlier (which would keep that
    value live in between)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)
