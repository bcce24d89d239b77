"""The persistent scheduler both kernels walk: work units (causal: mirrored pairs of query blocks;
otherwise single tiles, optionally in head groups), the key-block range of a query block, and the dynamic
scheduler's unit numbers published beside the Q slots."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def tile_coords(tile_id, num_pid_m, num_hz, group_hz):
    """Non-causal tile id -> (query block, batch*head). Tiles are walked in groups of ``group_hz``
    heads (1 unless the caller asks for more: one head's query blocks already share its K/V in L2),
    all tiles equally long."""
    tiles_per_group = group_hz * num_pid_m
    group = tile_id // tiles_per_group
    r = tile_id - group * tiles_per_group
    first_hz = group * group_hz
    group_size = gl.minimum(num_hz - first_hz, group_hz)
    m = r // group_size
    off_hz = first_hz + r % group_size
    return m, off_hz


def work_units(num_pid_m: int, num_hz: int, causal: bool) -> int:
    """Host side of ``unit_tiles``: how many work units the persistent loop walks."""
    return num_hz * ((num_pid_m + 1) // 2 if causal else num_pid_m)


@gluon.jit
def num_units(num_pid_m, num_hz, CAUSAL: gl.constexpr):
    if CAUSAL:
        return num_hz * ((num_pid_m + 1) // 2)
    else:
        return num_hz * num_pid_m


@gluon.jit
def unit_tiles(unit, num_pid_m, num_hz, group_hz, CAUSAL: gl.constexpr):
    """A work unit of the persistent loop -> (batch*head, first query block, second query block,
    number of tiles: 1 or 2). Each partition walks ``for unit in range(pid, num_units, num_progs)``
    and, inside, the unit's tiles ``first + t * (second - first)``.

    Causal: a unit is query block i and its mirror num_pid_m - 1 - i of one head (the
    middle block alone when num_pid_m is odd), so every unit holds the same number of K/V blocks:
    programs stay in step (balance without a longest-first order), and the units running at once
    cover a few consecutive heads, whose K/V stays in L2. Non-causal: a unit is one tile
    (``tile_coords``)."""
    if CAUSAL:
        per_head = (num_pid_m + 1) // 2
        off_hz = unit // per_head
        i = unit - off_hz * per_head
        mirror = num_pid_m - 1 - i
        return off_hz, mirror, i, 2 - (mirror == i).to(gl.int32)
    else:
        pid_m, off_hz = tile_coords(unit, num_pid_m, num_hz, group_hz)
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
