"""Producer/consumer channels both kernels build on: ``RingIndex`` (slot index + phase), ``Signal`` (a
ring of ready/empty mbarrier pairs), ``Ring`` and ``TmemRing`` (shared- and tensor-memory buffers with
their Signal), the TMA load into a ring slot, ``Descs`` (the Q, K, V, O descriptors) and ``opaque``."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import allocate_tensor_memory, tensor_memory_descriptor
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon import aggregate


@gluon.constexpr_function
def constexpr_value(x):
    """``x``'s Python value, whether it comes as a constexpr or as the value itself."""
    return x.value if isinstance(x, gl.constexpr) else x


@gluon.constexpr_function
def block_cols(block):
    """A descriptor block's last dimension: the head dim a kernel's Q (or K, V) descriptor carries."""
    return constexpr_value(list(block)[-1])


@aggregate
class RingIndex:
    """Position in a ring of NUM buffers: the slot index and the mbarrier phase to wait for."""
    index: gl.tensor
    phase: gl.tensor
    NUM: gl.constexpr

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
def block_view(buf, desc):
    """A 2-D shared buffer with a descriptor block's swizzle viewed as that (3-D or 4-D) block, for a copy."""
    return buf.reinterpret(desc.dtype, desc.block_type.shape, desc.layout)


@gluon.jit
def tma_load_2d(desc, coords, bar, buf):
    """TMA-load one block of a 4-D [Z, H, N, D] descriptor into a 2-D shared buffer. Out-of-bounds rows
    are zero-filled per head, so tails never read a neighbouring head; the 2-D buffer has the block's
    swizzle and is viewed as the 4-D block for the copy."""
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_load(desc, coords, bar, block_view(buf, desc))


@aggregate
class Descs:
    """The TMA descriptors: Q and O by one warpgroup's rows, K and V by key blocks."""
    q: tma.tensor_descriptor
    k: tma.tensor_descriptor
    v: tma.tensor_descriptor
    o: tma.tensor_descriptor


@gluon.jit
def opaque(x):
    """``x`` (an i32) through an opaque copy: the compiler can neither fold it nor hoist what is derived
    from it. Blackwell: a kernel argument read inside each partition, so what the partition derives
    from it is not computed before the partitions split and kept in local memory across every
    ``setmaxnreg``. Hopper backward: a shared-memory slot number per block, so the wgmma descriptors
    built from it are not hoisted out of the block loop, where they filled the registers."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [gl.to_tensor(x)], dtype=gl.int32, is_pure=False,
                                     pack=1)


# Hardware named barriers for warpgroups of different partitions (``bar.sync`` / ``bar.arrive``): Triton's own
# partition barriers take the low ids (0 for the CTA, then one per partition), so these start at 8 of the 16.
NAMED_BARRIER_BASE = gl.constexpr(8)


@gluon.constexpr_function
def _named_barrier_asm(op, bar_id, threads):
    return f"bar.{op} {bar_id}, {threads};\n\tmov.b32 $0, $1;"


@gluon.jit
def named_barrier_sync(BAR: gl.constexpr, THREADS: gl.constexpr):
    """Wait at hardware named barrier NAMED_BARRIER_BASE + BAR until THREADS threads (a multiple of 128: whole
    warpgroups, this one included) have synced or arrived there. One instruction, no shared memory (FA3/FA4's
    warp-scheduler barriers), where an mbarrier costs a partition-wide ``bar.sync`` before its elected arrive and
    a polling wait."""
    asm: gl.constexpr = _named_barrier_asm("sync", NAMED_BARRIER_BASE + BAR, THREADS)
    gl.inline_asm_elementwise(asm, "=r,r", [gl.to_tensor(0)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def named_barrier_arrive(BAR: gl.constexpr, THREADS: gl.constexpr):
    """Count this warpgroup at named barrier NAMED_BARRIER_BASE + BAR without waiting (``bar.arrive``)."""
    asm: gl.constexpr = _named_barrier_asm("arrive", NAMED_BARRIER_BASE + BAR, THREADS)
    gl.inline_asm_elementwise(asm, "=r,r", [gl.to_tensor(0)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def store_rows(x, ptr, desc, z, h, row_base, row0, n_rows, col0, CLIP_COLS: gl.constexpr = False):
    """Rows [row0, +x.shape[0]) of a [Z, H, N, D] tensor (from column ``col0``) stored from the registers
    through its descriptor's strides, rows at or past ``n_rows`` masked: where TMA would not clip (a packed
    sequence's last rows) or there is no buffer to stage in. ``row_base``: the sequence's first row. (The
    strides are 16-byte multiples; written as multiples of 8 elements, the compiler knows it and stores a
    thread's adjacent columns as one vector instead of 16-bit scalars.) CLIP_COLS: columns at or past the tensor's
    head dim masked too (a head dim the kernel runs padded to its block's)."""
    rows = row0 + gl.arange(0, x.shape[0], gl.SliceLayout(1, x.type.layout))
    cols = col0 + gl.arange(0, x.shape[1], gl.SliceLayout(0, x.type.layout))
    st = desc.strides
    base = ptr + z.to(gl.int64) * (st[0] // 8 * 8) + h.to(gl.int64) * (st[1] // 8 * 8)
    ptrs = base + gl.expand_dims((row_base + rows).to(gl.int64) * (st[2] // 8 * 8), 1) + gl.expand_dims(cols, 0)
    keep = gl.expand_dims(rows < n_rows, 1)
    if CLIP_COLS:
        keep = keep & gl.expand_dims(cols < desc.shape[3], 0)
    gl.store(ptrs, x, mask=keep)
