"""The persistent scheduler the kernels walk: the forward's work units (causal: mirrored pairs of query blocks;
otherwise single tiles, optionally in head groups) and the key-block range of a query block; the backward's
units, one key block each, and the query-block range of a key block (``KeyShape``); the dynamic scheduler's
unit numbers published beside the Q (backward: K/V) slots."""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon import aggregate

from . import cdiv
from ..validation import offsets_bad
from .channels import opaque


@gluon.jit
def head_group(unit, blocks, num_hz, group_hz):
    """A walk over ``num_hz`` heads of ``blocks`` blocks each, in groups of ``group_hz`` heads (the last group
    may have fewer), blocks outermost inside a group: unit -> (its block, its place r in its group, the group's
    first head, the group's heads). Its head is the first one plus r modulo the group's heads."""
    per_group = group_hz * blocks
    group = unit // per_group
    r = unit - group * per_group
    first_hz = group * group_hz
    group_size = gl.minimum(num_hz - first_hz, group_hz)
    return r // group_size, r, first_hz, group_size


@gluon.jit
def tile_coords(tile_id, num_pid_m, num_hz, group_hz):
    """Non-causal tile id -> (query block, batch*head). Tiles are walked in groups of ``group_hz``
    heads (1 unless the caller asks for more: one head's query blocks already share its K/V in L2),
    all tiles equally long (``head_group``)."""
    m, r, first_hz, group_size = head_group(tile_id, num_pid_m, num_hz, group_hz)
    off_hz = first_hz + r % group_size
    return m, off_hz


def work_units(num_pid_m: int, num_hz: int, causal: bool, singles: bool = False) -> int:
    """Host side of ``unit_tiles``: how many work units the persistent loop walks."""
    return num_hz * ((num_pid_m + 1) // 2 if causal and not singles else num_pid_m)


@gluon.jit
def num_units(num_pid_m, num_hz, CAUSAL: gl.constexpr, SINGLES: gl.constexpr = False):
    if CAUSAL and not SINGLES:
        return num_hz * ((num_pid_m + 1) // 2)
    else:
        return num_hz * num_pid_m


@gluon.jit
def unit_tiles(unit, num_pid_m, num_hz, group_hz, CAUSAL: gl.constexpr, SINGLES: gl.constexpr = False):
    """A work unit of the persistent loop -> (batch*head, first query block, second query block,
    number of tiles: 1 or 2). Each partition walks ``for unit in range(pid, num_units, num_progs)``
    and, inside, the unit's tiles ``first + t * (second - first)``.

    Causal: a unit is query block i and its mirror num_pid_m - 1 - i of one head (the
    middle block alone when num_pid_m is odd), so every unit holds the same number of K/V blocks:
    programs stay in step (balance without a longest-first order). The ``group_hz`` heads of a group
    (with GQA: the query heads of one K/V head; ``num_hz`` is a multiple of it) take their pair i one
    after another, so the units running at once read the same K/V blocks from L2. Non-causal: a unit
    is one tile (``tile_coords``).

    Causal SINGLES (with the dynamic scheduler): a unit is one tile, the ``group_hz`` heads' tiles walked
    longest first (query block num_pid_m - 1 down to 0, each block of the group's heads one after another).
    Pairs all take as long, so the last round of a dynamic schedule is a whole pair on a few programs while
    the others idle (4096 pairs over 132 programs: 31.03 rounds, ~3% of the kernel); single tiles end
    with the shortest ones (FA3/FA4's longest-processing-time-first order)."""
    if CAUSAL:
        # The group's units: step i (pair i, or with SINGLES the i-th longest block) of each of its heads in turn.
        if SINGLES:
            per_head = num_pid_m
        else:
            per_head = (num_pid_m + 1) // 2
        per_group = per_head * group_hz
        group = unit // per_group
        r = unit - group * per_group
        i = r // group_hz
        off_hz = group * group_hz + (r - i * group_hz)
        mirror = num_pid_m - 1 - i
        if SINGLES:
            return off_hz, mirror, mirror, 1
        else:
            return off_hz, mirror, i, 2 - (mirror == i).to(gl.int32)
    else:
        pid_m, off_hz = tile_coords(unit, num_pid_m, num_hz, group_hz)
        return off_hz, pid_m, pid_m, 1


@aggregate
class Shape:
    """The problem's runtime sizes as every partition's scheduler sees them.

    Dense: Z batches of N_Q queries and N_KV keys, ``num_hz`` = Z * H. VARLEN (packed sequences, FA's
    convention): the descriptors view [total, H, D] tensors as [1, H, total, D] and ``seq_ptr`` holds
    an int32 table [cu_q (B+1) | cu_k (B+1) | cu_units (B+1) | order (B)]: the sequences' query and
    key offsets, the running count of work units with the sequences taken longest first, and which
    sequence each position of that order is (the host's ``varlen_table``)."""
    N_Q: gl.tensor
    N_KV: gl.tensor
    num_hz: gl.tensor
    H: gl.tensor  # query heads
    G: gl.tensor  # query heads per K/V head (GQA; 1 without)
    group_hz: gl.tensor  # heads walked together (see ``unit_tiles``)
    seq_ptr: gl.tensor
    n_seqs: gl.tensor
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    CAUSAL: gl.constexpr
    VARLEN: gl.constexpr
    SINGLES: gl.constexpr  # dense causal: single tiles, longest first (``unit_tiles``)
    # Decode's chunks (the sm_90a kernel's COMBINE): the last split, batch z = num_hz / H - 1 of the [splits, ...]
    # views, sees ``n_seqs`` keys more than N_KV (an uneven split's remainder, its view longer by them)
    LAST_KEYS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, N_Q, N_KV, num_hz, H, G, group_hz, seq_ptr, n_seqs, BLOCK_M, BLOCK_N, CAUSAL, VARLEN,
                 SINGLES=False, LAST_KEYS=False):
        self.N_Q = N_Q
        self.N_KV = N_KV
        self.num_hz = num_hz
        self.H = H
        self.G = G
        self.group_hz = group_hz
        self.seq_ptr = seq_ptr
        self.n_seqs = n_seqs
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.VARLEN = gl.constexpr(VARLEN)
        self.SINGLES = gl.constexpr(SINGLES and not VARLEN)  # (packed sequences: pairs, see ``varlen_table``)
        self.LAST_KEYS = gl.constexpr(LAST_KEYS and not VARLEN)

    @gluon.jit
    def num_units(self):
        """How many work units the persistent loop walks."""
        if self.VARLEN:
            return packed_units(self.seq_ptr, self.n_seqs)
        else:
            return num_units(gl.cdiv(self.N_Q, self.BLOCK_M), self.num_hz, self.CAUSAL, self.SINGLES)

    @gluon.jit
    def lse_row(self, lse_ptr, w):
        """Where unit ``w``'s logsumexp row starts: lse is [Z, H, N_Q] dense, [H, total] packed (total =
        cu_q[B])."""
        if self.VARLEN:
            row_len = packed_total(self.seq_ptr, self.n_seqs)
        else:
            row_len = self.N_Q
        return lse_ptr + w.off_hz.to(gl.int64) * row_len + w.q_base

    @gluon.jit
    def work(self, unit, OPAQUE_SIZES: gl.constexpr = False):
        """The ``Work`` of a unit. OPAQUE_SIZES: the dense lengths read through an opaque copy, so that what
        a partition derives from them (``N_KV - 1`` for the mask) is computed there, not before the
        partitions split and kept in local memory across their ``setmaxnreg``."""
        if self.VARLEN:
            w = self.packed_work(self.locate(unit))
        else:
            q_base = gl.to_tensor(0)
            k_base = gl.to_tensor(0)
            n_q = self.N_Q
            n_k = self.N_KV
            if OPAQUE_SIZES:
                n_q = opaque(n_q)
                n_k = opaque(n_k)
            off_hz, first, second, n_tiles = unit_tiles(unit, gl.cdiv(n_q, self.BLOCK_M), self.num_hz,
                                                        self.group_hz, self.CAUSAL, self.SINGLES)
            z = off_hz // self.H
            h = off_hz - z * self.H
            if self.LAST_KEYS:
                n_k = n_k + gl.where(off_hz >= self.num_hz - self.H, self.n_seqs, 0)
            w = self._work(z, h, off_hz, q_base, k_base, n_q, n_k, first, second, n_tiles)
        return w

    @gluon.jit
    def locate(self, unit):
        """Packed sequences: where unit ``unit`` lies (``Located``), read from the table by a binary search, a
        chain of dependent global loads. The loader does this once per unit and publishes the result beside
        the unit's Q slot (``publish_located``), so that the consumers do not wait on the chain."""
        b, local = packed_position(self.seq_ptr, self.n_seqs, unit)
        return sequence_located(self.seq_ptr, self.n_seqs, b, local)

    @gluon.jit
    def packed_work(self, loc):
        """The ``Work`` of a packed unit from where it lies (``locate``)."""
        off_hz, first, second, n_tiles = unit_tiles(loc.local, gl.cdiv(loc.n_q, self.BLOCK_M), self.H,
                                                    self.group_hz, self.CAUSAL)
        return self._work(gl.to_tensor(0), off_hz, off_hz, loc.q_base, loc.k_base, loc.n_q, loc.n_k, first,
                          second, n_tiles)

    @gluon.jit
    def _work(self, z, h, off_hz, q_base, k_base, n_q, n_k, first, second, n_tiles):
        if self.CAUSAL:
            shift = n_k - n_q  # bottom-right: query i sees keys <= i + N_KV - N_Q
        else:
            shift = gl.to_tensor(0)
        return Work(z, h, h // self.G, off_hz, q_base, k_base, n_q, n_k, shift, first, second, n_tiles,
                    self.BLOCK_M, self.BLOCK_N, self.CAUSAL)


@aggregate
class Located:
    """Where a packed unit lies: its number inside its sequence, the sequence's query offset and length, and
    its key offset and length (``Shape.locate``)."""
    local: gl.tensor
    q_base: gl.tensor
    n_q: gl.tensor
    k_base: gl.tensor
    n_k: gl.tensor


@gluon.jit
def packed_position(seq_ptr, n_seqs, unit):
    """Packed sequences: (the sequence unit ``unit`` belongs to, the unit's number inside it). The
    sequence is the one at the last position p of the table's order with cu_units[p] <= unit (binary
    search)."""
    cu_units = seq_ptr + 2 * n_seqs + 2
    lo = gl.to_tensor(0)
    hi = n_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = gl.load(cu_units + mid) <= unit
        lo = gl.where(below, mid, lo)
        hi = gl.where(below, hi, mid)
    local = unit - gl.load(cu_units + lo)
    return gl.load(seq_ptr + 3 * n_seqs + 3 + lo), local


@gluon.jit
def sequence_located(seq_ptr, n_seqs, b, local):
    """Unit ``local`` of packed sequence ``b`` (``packed_position``) as a ``Located``: the sequence's query and
    key offsets and lengths, read from the table's cu_q and cu_k."""
    q_base = gl.load(seq_ptr + b)
    n_q = gl.load(seq_ptr + b + 1) - q_base
    k_base = gl.load(seq_ptr + n_seqs + 1 + b)
    n_k = gl.load(seq_ptr + n_seqs + 2 + b) - k_base
    return Located(local, q_base, n_q, k_base, n_k)


@gluon.jit
def packed_units(seq_ptr, n_seqs):
    """Packed sequences: how many work units there are (the table's cu_units[B])."""
    return gl.load(seq_ptr + 3 * n_seqs + 2)


@gluon.jit
def packed_total(seq_ptr, n_seqs):
    """Packed sequences: the queries of all of them (cu_q[B]), the length of an lse row ([H, total])."""
    return gl.load(seq_ptr + n_seqs)


@aggregate
class Work:
    """One work unit: which batch, query head and K/V head, where its rows start in the descriptors'
    row dimension (``q_base``, ``k_base``: 0 dense, the sequence's offset packed), its lengths, the
    causal diagonal's shift, and its one or two query blocks (``tile(t)``)."""
    z: gl.tensor
    h: gl.tensor
    hk: gl.tensor
    off_hz: gl.tensor  # z * H + h: the lse's row (its row length is the descriptors' row extent)
    q_base: gl.tensor
    k_base: gl.tensor
    n_q: gl.tensor
    n_k: gl.tensor
    shift: gl.tensor
    first: gl.tensor
    second: gl.tensor
    n_tiles: gl.tensor
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    CAUSAL: gl.constexpr

    @gluon.jit
    def tile(self, t):
        """The query block of the unit's tile t."""
        return self.first + t * (self.second - self.first)

    @gluon.jit
    def kv_blocks(self, pid_m):
        """Key/value blocks query block ``pid_m`` visits (causal: up to its last row's diagonal); at least
        one, so that every tile's rows pass through the softmax (rows with no key end with l = 0)."""
        hi = self.n_k
        if self.CAUSAL:
            hi = gl.minimum((pid_m + 1) * self.BLOCK_M + self.shift, hi)
        return gl.maximum(gl.cdiv(hi, self.BLOCK_N), 1)

    @gluon.jit
    def unmasked_blocks(self, q_row0):
        """Blocks [0, n) lie inside the key range and below the diagonal of rows q_row0 on: no mask."""
        n = self.n_k // self.BLOCK_N
        if self.CAUSAL:
            n = gl.minimum(n, gl.maximum(q_row0 + self.shift + 1, 0) // self.BLOCK_N)
        return n

    @gluon.jit
    def kv_coords(self, start_n):
        return [self.z, self.hk, self.k_base + start_n, 0]

    @gluon.jit
    def q_coords(self, q_row0):
        return [self.z, self.h, self.q_base + q_row0, 0]


# ---------------------------------------------------------------------------------------------
# The backward's units: one key block of one K/V head each
# ---------------------------------------------------------------------------------------------
@aggregate
class KeyShape:
    """The backward's runtime sizes as its partitions' scheduler sees them. A unit is one block of BLOCK_N keys
    of one K/V head; it walks the query blocks that see its keys (``KeyWork``). Dense: Z batches, units in chunks
    of ``group_hz`` (batch, K/V head) pairs with key blocks outermost inside a chunk (``head_group``). VARLEN:
    the table of ``varlen_table`` built with units per key block (``by_keys``), followed by each sequence's first
    row in the dQ accumulator (B + 1)."""
    N_Q: gl.tensor
    N_KV: gl.tensor
    Z: gl.tensor
    H: gl.tensor
    H_KV: gl.tensor
    G: gl.tensor
    seq_ptr: gl.tensor
    n_seqs: gl.tensor
    group_hz: gl.tensor  # dense: (batch, K/V head) pairs walked together
    BLOCK_M: gl.constexpr  # queries per block
    BLOCK_N: gl.constexpr  # keys per unit
    CAUSAL: gl.constexpr
    VARLEN: gl.constexpr
    KEYS_OUTER: gl.constexpr  # packed: a sequence's units key block by key block, its K/V heads inside

    @gluon.jit
    def num_units(self):
        if self.VARLEN:
            return packed_units(self.seq_ptr, self.n_seqs)
        else:
            return self.Z * self.H_KV * gl.cdiv(self.N_KV, self.BLOCK_N)

    @gluon.jit
    def row_len(self):
        """The lse/delta rows' length: N_Q dense ([Z, H, N_Q]), the packed total ([H, total])."""
        if self.VARLEN:
            return packed_total(self.seq_ptr, self.n_seqs)
        else:
            return self.N_Q

    @gluon.jit
    def work(self, unit):
        """The ``KeyWork`` of a unit."""
        if self.VARLEN:
            b, local = packed_position(self.seq_ptr, self.n_seqs, unit)
            loc = sequence_located(self.seq_ptr, self.n_seqs, b, local)
            q_base = loc.q_base
            n_q = loc.n_q
            k_base = loc.k_base
            n_k = loc.n_k
            if self.KEYS_OUTER:
                nb = local // self.H_KV
                hk = local - nb * self.H_KV
            else:
                n_blocks = gl.cdiv(n_k, self.BLOCK_N)
                hk = local // n_blocks
                nb = local - hk * n_blocks
            z = gl.to_tensor(0)
            dq_base = gl.load(self.seq_ptr + 4 * self.n_seqs + 3 + b)
        else:
            q_base = gl.to_tensor(0)
            k_base = gl.to_tensor(0)
            n_q = self.N_Q
            n_k = self.N_KV
            # Chunks of ``group_hz`` heads (about one wave of units), key blocks outermost inside a chunk: the
            # units running at once share their heads' Q and dO in L2, and (causal) the longest go first.
            nb, r, first, size = head_group(unit, gl.cdiv(n_k, self.BLOCK_N), self.Z * self.H_KV, self.group_hz)
            hz = first + (r - nb * size)  # (``tile_coords``'s r % size compiles to other instructions here)
            z = hz // self.H_KV
            hk = hz - z * self.H_KV
            dq_base = gl.to_tensor(0)
        n0 = nb * self.BLOCK_N
        m_hi = gl.cdiv(n_q, self.BLOCK_M)
        if self.CAUSAL:
            shift = n_k - n_q  # bottom-right: query i sees keys <= i + shift
            # The first query that sees key n0 is n0 - shift; from block m_full on, every query of the
            # block sees every key of the unit (m * BLOCK_M + shift >= n0 + BLOCK_N - 1).
            m_lo = gl.minimum(gl.maximum(n0 - shift, 0) // self.BLOCK_M, m_hi)
            m_full = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(n0 + self.BLOCK_N - 1 - shift, 0), self.BLOCK_M),
                                           m_lo), m_hi)
        else:
            shift = gl.to_tensor(0)
            m_lo = gl.to_tensor(0)
            m_full = gl.to_tensor(0)
        # A key block that runs past the keys masks every query block.
        m_full = gl.where(n0 + self.BLOCK_N > n_k, m_hi, m_full)
        return KeyWork(z, hk, q_base, k_base, n_q, n_k, shift, n0, m_lo, m_full, m_hi, dq_base)


@aggregate
class KeyWork:
    """One backward unit: key block ``n0`` of K/V head ``hk`` of batch ``z``; its query blocks [m_lo, m_hi), of
    which [m_lo, m_full) need a mask (the causal diagonal, or every block when the key block runs past
    the keys)."""
    z: gl.tensor
    hk: gl.tensor
    q_base: gl.tensor
    k_base: gl.tensor
    n_q: gl.tensor
    n_k: gl.tensor
    shift: gl.tensor
    n0: gl.tensor
    m_lo: gl.tensor
    m_full: gl.tensor
    m_hi: gl.tensor
    dq_base: gl.tensor  # where the sequence's rows start in the dQ accumulator

    @gluon.jit
    def query_blocks(self, MASKED: gl.constexpr):
        """The query blocks [lo, hi) that need a mask (MASKED) or need none."""
        if MASKED:
            return self.m_lo, self.m_full
        else:
            return self.m_full, self.m_hi


# ---------------------------------------------------------------------------------------------
# Dynamic scheduling: the loader takes units from a global counter and tells the consumers which
# ---------------------------------------------------------------------------------------------
LOCATED_WORDS = gl.constexpr(5)  # int32 per slot for where a packed unit lies (``Located``'s fields)


@gluon.jit
def slot_words_alloc(NUM: gl.constexpr, WORDS: gl.constexpr = 1):
    """WORDS int32 per slot of a ring of NUM slots, published by the producer beside each slot's data: the
    number of the work unit whose Q the slot holds (1 word), where a packed unit lies (``LOCATED_WORDS``)."""
    return gl.allocate_shared_memory(gl.int32, [WORDS * NUM, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def _store_int(mem, value):
    """One int32 into shared memory (every thread of the partition writes the same value)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    mem.store(gl.full([1], value, gl.int32, layout))


@gluon.jit
def _load_int(mem, NUM_WARPS: gl.constexpr):
    """One int32 from shared memory, as a scalar of a partition of NUM_WARPS warps."""
    return gl.max(mem.load(gl.BlockedLayout([1], [32], [NUM_WARPS], [0])), axis=0)


@gluon.jit
def publish_unit(ids, it, unit):
    """Producer, between ``acquire_empty(it)`` and the copy that arrives on the slot's ready barrier:
    that arrive releases this store to whoever waits on the barrier."""
    _store_int(ids.index(it.index), unit)


@gluon.jit
def read_unit(ring, ids, it, NUM_WARPS: gl.constexpr):
    """Consumer: wait for slot ``it`` of a ring (the Q ring; the backward's K/V signal), then read the unit
    published beside it."""
    ring.wait_ready(it)
    return _load_int(ids.index(it.index), NUM_WARPS)


@gluon.jit
def publish_located(info, it, loc):
    """Producer, beside ``publish_unit``: where the unit lies (released by the same arrive). ``info`` holds
    ``LOCATED_WORDS`` per slot (``slot_words_alloc``)."""
    i = LOCATED_WORDS * it.index
    _store_int(info.index(i), loc.local)
    _store_int(info.index(i + 1), loc.q_base)
    _store_int(info.index(i + 2), loc.n_q)
    _store_int(info.index(i + 3), loc.k_base)
    _store_int(info.index(i + 4), loc.n_k)


@gluon.jit
def read_located(info, it, NUM_WARPS: gl.constexpr):
    """Consumer, after ``read_unit`` on the same slot: where the unit lies (shared-memory loads, no chain)."""
    i = LOCATED_WORDS * it.index
    return Located(_load_int(info.index(i), NUM_WARPS), _load_int(info.index(i + 1), NUM_WARPS),
                   _load_int(info.index(i + 2), NUM_WARPS), _load_int(info.index(i + 3), NUM_WARPS),
                   _load_int(info.index(i + 4), NUM_WARPS))


@gluon.jit
def end_units(ring, ids, it):
    """Producer: publish -1 (no more units) in the next slot, arriving on its ready barrier without a copy."""
    _, bar = ring.acquire_empty(it)
    publish_unit(ids, it, -1)
    mbarrier.arrive(bar, count=1)


# ---------------------------------------------------------------------------------------------
# Host side of the packed (varlen) schedule
# ---------------------------------------------------------------------------------------------
TABLE_BLOCK = 64  # sequences per program of ``_varlen_table_kernel``, and per step of its comparisons
TABLE_WARPS = 4


def varlen_table(cu_seqlens_q, cu_seqlens_k, heads: int, block_m: int, causal: bool, by_keys: bool = False,
                 counter: bool = False):
    """The int32 table ``Shape`` reads for packed sequences, built on the GPU without a host sync (so
    CUDA-graph capture works): [cu_q | cu_k | cu_units | order]. The sequences are taken longest first
    (by keys, then queries), so a persistent program that finishes early picks up the short ones last:
    the long tail of a mix does not end on one long sequence. ``counter``: one more word, zero, for the
    dynamic scheduler's unit counter (``Packed.table``).

    On the GPU one launch builds it (``_varlen_table_kernel``, 3.5 us): PyTorch's ops took ~20 launches and
    150-170 us of GPU time, in the stream before the attention kernel (NOTES v59). PyTorch's ops stay for CPU
    tensors, where they are the kernel's reference in the tests."""
    import torch

    n_seqs = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_q.is_cuda:
        from .launch import launch_cached

        cu_q, cu_k = (c if c.dtype == torch.int32 and c.stride(0) == 1 else c.to(torch.int32).contiguous()
                      for c in (cu_seqlens_q, cu_seqlens_k))
        table = torch.empty(4 * n_seqs + 3 + counter, dtype=torch.int32, device=cu_q.device)
        consts = dict(CAUSAL=bool(causal), BY_KEYS=bool(by_keys), COUNTER=bool(counter), BLOCK=TABLE_BLOCK)
        launch_cached(_varlen_table_kernel, TABLE_WARPS, cdiv(n_seqs + 1, TABLE_BLOCK),
                      (cu_q, cu_k, table, n_seqs, heads, block_m, table, 0, 0), consts, cu_q.device,
                      key=(_varlen_table_kernel, *consts.values()))
        return table
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_seqlens_k.to(torch.int32)
    len_q = cu_q[1:] - cu_q[:-1]
    len_k = cu_k[1:] - cu_k[:-1]
    if by_keys:
        # The backward: one unit per block of ``block_m`` keys per (K/V) head.
        units = heads * ((len_k + block_m - 1) // block_m)
    else:
        blocks = (len_q + block_m - 1) // block_m
        units = heads * ((blocks + 1) // 2 if causal else blocks)
    # One key sorts by keys then queries (both < 2^31 / 2^16 in practice; int64 keeps it exact).
    order = torch.argsort(len_k.to(torch.int64) * (1 << 32) + len_q, descending=True, stable=True)
    cu_units = torch.zeros_like(cu_q)
    cu_units[1:] = torch.cumsum(units[order], 0, dtype=torch.int32)
    parts = [cu_q, cu_k, cu_units, order.to(torch.int32)]
    if counter:
        parts.append(torch.zeros(1, dtype=torch.int32))
    return torch.cat(parts)


@triton.jit
def _seq_units(cu_q_ptr, cu_k_ptr, b, valid, heads, block_m, CAUSAL: tl.constexpr, BY_KEYS: tl.constexpr):
    """Sequence ``b``'s query and key lengths and work units (0 where not ``valid``), as ``varlen_table`` counts
    them."""
    len_q = tl.load(cu_q_ptr + b + 1, mask=valid, other=0) - tl.load(cu_q_ptr + b, mask=valid, other=0)
    len_k = tl.load(cu_k_ptr + b + 1, mask=valid, other=0) - tl.load(cu_k_ptr + b, mask=valid, other=0)
    if BY_KEYS:
        units = heads * ((len_k + block_m - 1) // block_m)
    else:
        blocks = (len_q + block_m - 1) // block_m
        if CAUSAL:
            blocks = (blocks + 1) // 2
        units = heads * blocks
    return len_q, len_k, units


# (The offsets are the caller's tensors, possibly views at any int32 offset: the launch is cached by constexprs only
# (``launch_cached``), so the kernel must not assume the first call's 16-byte alignment.)
@triton.jit(do_not_specialize=["n_seqs", "heads", "block_m", "total_q", "total_k"],
            do_not_specialize_on_alignment=["cu_q_ptr", "cu_k_ptr", "table_ptr", "flag_ptr"])
def _varlen_table_kernel(cu_q_ptr, cu_k_ptr, table_ptr, n_seqs, heads, block_m, flag_ptr, total_q, total_k,
                         CAUSAL: tl.constexpr, BY_KEYS: tl.constexpr, COUNTER: tl.constexpr, BLOCK: tl.constexpr,
                         CHECK: tl.constexpr = False):
    """``varlen_table`` for BLOCK sequences i per program: the offsets copied, then each sequence's place p in
    the order (how many sequences go before it: more keys, then more queries, then a lower index, the stable
    descending sort) and the units of those up to and including it, by comparing it with every sequence,
    BLOCK at a time; it writes order[p] = i and cu_units[p + 1]. O(B^2) comparisons, spread over the programs:
    one step of one program for the few dozen sequences of a batch. CHECK: program 0 also writes at flag_ptr
    whether the query offsets (against total_q) and the key offsets (against total_k) keep the offsets' rule, 1 or
    0 each (``validation.offsets_bad``), for a prepared call's ``torch._assert_async`` (``checked_table_launcher``)."""
    if CHECK:
        if tl.program_id(0) == 0:
            tl.store(flag_ptr, (offsets_bad(cu_q_ptr, total_q, n_seqs + 1, BLOCK) == 0).to(tl.int32))
            tl.store(flag_ptr + 1, (offsets_bad(cu_k_ptr, total_k, n_seqs + 1, BLOCK) == 0).to(tl.int32))
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    edge = i <= n_seqs
    tl.store(table_ptr + i, tl.load(cu_q_ptr + i, mask=edge), mask=edge)
    tl.store(table_ptr + n_seqs + 1 + i, tl.load(cu_k_ptr + i, mask=edge), mask=edge)
    valid = i < n_seqs
    lq_i, lk_i, _ = _seq_units(cu_q_ptr, cu_k_ptr, i, valid, heads, block_m, CAUSAL, BY_KEYS)
    place = tl.zeros([BLOCK], tl.int32)
    upto = tl.zeros([BLOCK], tl.int32)
    j0 = 0
    while j0 < n_seqs:  # (a while: triton's interpreter, the CPU tests' runner, cannot range over a runtime bound)
        j = j0 + tl.arange(0, BLOCK)
        lq_j, lk_j, u_j = _seq_units(cu_q_ptr, cu_k_ptr, j, j < n_seqs, heads, block_m, CAUSAL, BY_KEYS)
        same_k = lk_j[None, :] == lk_i[:, None]
        later = (lq_j[None, :] < lq_i[:, None]) | ((lq_j[None, :] == lq_i[:, None]) & (j[None, :] >= i[:, None]))
        before = (lk_j[None, :] > lk_i[:, None]) | (same_k & ~later)
        before = before & (j < n_seqs)[None, :]
        place += tl.sum(before.to(tl.int32), 1)
        upto += tl.sum(tl.where(before | (j[None, :] == i[:, None]), u_j[None, :], 0), 1)
        j0 += BLOCK
    cu_units = table_ptr + 2 * (n_seqs + 1)
    tl.store(cu_units + place + 1, upto, mask=valid)
    tl.store(cu_units + n_seqs + 1 + place, i, mask=valid)
    first = i == 0
    tl.store(cu_units + i, tl.zeros_like(i), mask=first)
    if COUNTER:
        tl.store(table_ptr + 4 * n_seqs + 3 + i, tl.zeros_like(i), mask=first)


def checked_table_launcher(cu_seqlens_q, cu_seqlens_k, heads: int, block_m: int, causal: bool, counter: bool):
    """For a prepared packed call (int32 CUDA offsets with a unit stride, B + 1 of them): a function of (stream, the
    two offsets' addresses, the table's address, the flags' address, total_q, total_k) that builds ``varlen_table``
    at the table's address and writes the two offsets' checks (``_varlen_table_kernel``'s CHECK) at the flags', in
    one launch by address."""
    import torch

    from .launch import direct_launcher, placeholder

    n_seqs = cu_seqlens_q.shape[0] - 1
    consts = dict(CAUSAL=bool(causal), BY_KEYS=False, COUNTER=bool(counter), BLOCK=TABLE_BLOCK, CHECK=True)
    grid = cdiv(n_seqs + 1, TABLE_BLOCK)
    unused = placeholder(cu_seqlens_q.device, torch.int32)
    direct = direct_launcher(_varlen_table_kernel, (cu_seqlens_q, cu_seqlens_k, unused, n_seqs, heads, block_m, unused,
                                                    0, 0), consts, grid, TABLE_WARPS)
    if direct is None:
        return None
    return lambda stream, cq, ck, table, flags, total_q, total_k: direct(
        grid, stream, (cq, ck, table, n_seqs, heads, block_m, flags, total_q, total_k), consts)


class Packed:
    """A launch's packed sequences (FA's varlen arguments): int32 offsets [B + 1] of each sequence's
    queries and keys in the [total, H, D] tensors, and the longest lengths (they size the grid)."""

    def __init__(self, cu_seqlens_q, cu_seqlens_k, max_q: int, max_k: int):
        self.cu_seqlens_q = cu_seqlens_q
        self.cu_seqlens_k = cu_seqlens_k
        self.max_q = int(max_q)
        self.max_k = int(max_k)
        self.n_seqs = cu_seqlens_q.shape[0] - 1

    def table(self, heads: int, block_m: int, causal: bool, by_keys: bool = False, counter: bool = False):
        """``varlen_table`` of these sequences; ``counter``: its last word is the dynamic scheduler's unit
        counter, zero (one launch for both)."""
        return varlen_table(self.cu_seqlens_q, self.cu_seqlens_k, heads, block_m, causal, by_keys, counter)
