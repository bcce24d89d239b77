"""What the Gluon kernels share: dtype mapping and small host helpers."""

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
# Dynamic scheduling: the loader takes units from a global counter and tells the consumers which
# ---------------------------------------------------------------------------------------------
@gluon.jit
def unit_ids_alloc(NUM: gl.constexpr):
    """One int32 per slot of a Q ring: the number of the work unit whose Q the slot holds."""
    return gl.allocate_shared_memory(gl.int32, [NUM, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def publish_unit(ids, it, unit):
    """Producer, between ``acquire_empty(it)`` and the copy that arrives on the slot's ready barrier:
    that arrive releases this store to whoever waits on the barrier."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    ids.index(it.index).store(gl.full([1], unit, gl.int32, layout))


@gluon.jit
def read_unit(ring, ids, it, NUM_WARPS: gl.constexpr):
    """Consumer: wait for slot ``it`` of the Q ring, then read the unit published beside it."""
    ring.wait_ready(it)
    return gl.max(ids.index(it.index).load(gl.BlockedLayout([1], [32], [NUM_WARPS], [0])), axis=0)


@gluon.jit
def end_units(ring, ids, it):
    """Producer: publish -1 (no more units) in the next slot, arriving on its ready barrier without a copy."""
    _, bar = ring.acquire_empty(it)
    publish_unit(ids, it, -1)
    mbarrier.arrive(bar, count=1)
