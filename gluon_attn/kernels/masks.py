"""What the three kernels (sm_90a forward and backward, sm_100a forward) share to decide which scores count: the
causal / key-tail mask of S blocks that cross the diagonal or the last key, the 1-D windows' bounds, and the 2-D/3-D
windows' boxes (``box_dims``, ``walk_box``, ``walk_step``, ``WindowBoxes``, ``BoxRows``, ``BoxKeys``, ``WalkBoxes``,
``BoxWalk``); and the one per-tile mask object, ``TileMask``, built once before a tile's blocks and applied to each
block's scores, whatever the mode (dense key tail, causal, 1-D window, 2-D/3-D boxes) and whichever layout of them:
a query tile's S (the sm_90a forward's, ``apply``; the sm_100a softmax's two column halves, ``apply_halves``) or a
warpgroup's key rows against its query blocks, S^T (the sm_90a backward's, ``apply_transposed``)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .channels import aggregate, constexpr_value as _value, opaque


@gluon.constexpr_function
def box_dims(block, dims):
    """A 2-D or 3-D window's box (x, y, z) from its descriptor block ([1, 1, x, y, D] or [1, x, y, z, D]); (1, 1, 1)
    otherwise."""
    b = [_value(d) for d in list(block)]
    n = _value(dims)
    return (b[2], b[3], 1) if n == 2 else (b[1], b[2], b[3]) if n == 3 else (1, 1, 1)


@gluon.jit
def walk_box(j, lo_x, lo_y, lo_z, ny, nz, DIMS: gl.constexpr):
    """Block j of a walk, row-major over its key boxes: the box (jx, jy, jz) (jz 0 in 2-D)."""
    if DIMS == 3:
        jxy = j // nz
        jz = lo_z + j - jxy * nz
    else:
        jxy = j
        jz = 0
    jr = jxy // ny
    return lo_x + jr, lo_y + jxy - jr * ny, jz


@gluon.jit
def small_quotient(a, b, inv_b):
    """a // b for 0 <= a < 2^22 and b >= 1, with inv_b = 1 / b in fp32 (made once): the float quotient, corrected by
    one step either way (its error is below one for such a); ~8 instructions where an integer division takes ~16."""
    q = (gl.to_tensor(a).to(gl.float32) * inv_b).to(gl.int32)
    r = a - q * b
    q = gl.where(r >= b, q + 1, q)
    return gl.where(r < 0, q - 1, q)


@gluon.jit
def magic_quotient(n, m, p):
    """n // d for 0 <= n < 2^31 from the divisor's two words (``hopper_host.division_words``: p = 31 + ceil(log2 d),
    m = ceil(2^p / d) < 2^32, m's bits in an int32): the product's bits from p on, exact for every such n
    (Granlund-Montgomery); one wide multiply and a shift where an integer division takes ~20 instructions."""
    wide = n.to(gl.uint64) * m.to(gl.uint32, bitcast=True).to(gl.uint64)
    return (wide >> p.to(gl.uint64)).to(gl.int32)


@gluon.jit
def walk_reciprocals(ny, nz):
    """1 / ny and 1 / nz in fp32, made once a tile for ``walk_step`` (1 / nz is 1.0 where nz is a constant: 2-D)."""
    inv_nz = 1.0
    if not isinstance(nz, int):
        inv_nz = 1.0 / nz.to(gl.float32)
    return 1.0 / ny.to(gl.float32), inv_nz


@gluon.jit
def walk_step(j, ny, nz, inv_ny, inv_nz, DIMS: gl.constexpr):
    """Step j of a walk row-major over key boxes (nx x) ny (x nz): the box (ix, iy, iz) (iz 0 in 2-D), by float
    quotients (``small_quotient``; the reciprocals from ``walk_reciprocals``). The forwards' loaders and
    ``WalkBoxes.box`` take their steps from it."""
    if DIMS == 3:
        jxy = small_quotient(j, nz, inv_nz)
        iz = j - jxy * nz
    else:
        jxy = j
        iz = 0
    ix = small_quotient(jxy, ny, inv_ny)
    return ix, jxy - ix * ny, iz


@gluon.jit
def mask_block(s, start_n, q_row0, N_CTX, CAUSAL: gl.constexpr, OPAQUE_ROWS: gl.constexpr = False):
    """S (rows from q_row0, keys from start_n) with -inf where a key is past N_CTX or (causal) past the
    row's diagonal. One bound per row, the last key it may see relative to start_n, is compared with
    the block's column numbers: no per-element index arithmetic, and few live registers (it removed the
    causal softmax's spills on sm_100a).

    A column number of a wgmma accumulator is 8 i + 2 (lane % 4) + p, i and p fixed by the register: its
    thread's part ``lane`` = 2 (lane % 4) moves to the bound's side, so each register compares a constant
    with the thread's bound, and no column number is kept in a register (kept, three of them spilled
    from the masked loop of the 192-row D=64 tile at 160 registers: NOTES v62). Where a thread owns
    whole rows (tensor-memory layouts) ``lane`` is a constant per register too, and folds away.
    OPAQUE_ROWS: the row numbers through ``opaque``, so that they are derived in the loop rather than
    before the partitions split and kept in local memory across ``setmaxnreg`` (the D=256 forward)."""
    M: gl.constexpr = s.shape[0]
    CH: gl.constexpr = s.shape[1]
    last = gl.full([M], N_CTX - 1, gl.int32, gl.SliceLayout(1, s.type.layout))
    if CAUSAL:
        rows = gl.arange(0, M, gl.SliceLayout(1, s.type.layout))
        if OPAQUE_ROWS:
            rows = opaque(rows)
        last = gl.minimum(last, q_row0 + rows)
    cols = gl.arange(0, CH, gl.SliceLayout(0, s.type.layout))
    lane = (cols // 2) % 4 * 2
    keep = gl.expand_dims(cols - lane, 0) <= gl.expand_dims(last - start_n, 1) - gl.expand_dims(lane, 0)
    return gl.where(keep, s, -float("inf"))


@gluon.jit
def mask_block_transposed(s, key0, q0, shift, N_KV, CAUSAL: gl.constexpr):
    """S^T (rows: keys from key0; columns: queries from q0) with -inf where a key is past N_KV or (causal,
    bottom-right) past the column's diagonal (query i sees keys <= i + shift). As ``mask_block``: one bound per
    row, the first column that may see the key (past the block for a key past N_KV), compared with the
    block's column numbers."""
    M: gl.constexpr = s.shape[0]
    CH: gl.constexpr = s.shape[1]
    keys = key0 + gl.arange(0, M, gl.SliceLayout(1, s.type.layout))
    if CAUSAL:
        first = keys - shift - q0
    else:
        first = gl.zeros([M], gl.int32, gl.SliceLayout(1, s.type.layout))
    first = gl.where(keys < N_KV, first, CH)
    cols = gl.arange(0, CH, gl.SliceLayout(0, s.type.layout))
    keep = gl.expand_dims(cols, 0) >= gl.expand_dims(first, 1)
    return gl.where(keep, s, -float("inf"))


# Neighborhood attention along one dimension (NATTEN's windows; ``gluon_attn.neighborhood.window_start`` and
# ``window_end`` are the host's statement of the same rules, its tests the reference): WINDOW 1 non-causal, 2 causal.
@gluon.jit
def window_words(seq_ptr):
    """The kernel size and stride a WINDOW launch passes as the two int32 words at seq_ptr
    (``hopper_host.window_table``; packed sequences' table otherwise)."""
    return gl.load(seq_ptr), gl.load(seq_ptr + 1)


@gluon.jit
def window_bounds(i, L, K, S, WINDOW: gl.constexpr):
    """[start, end) of the keys query position ``i`` attends (positions in a dilation group of ``L``), for a
    window of ``K`` keys moved every ``S`` queries: the window is centred on the stride group's leader and shifted
    inside the layout at its borders (causal: it ends at the query)."""
    if WINDOW == 2:
        leader = gl.minimum((i // S) * S + S - 1, L - 1)
        start = gl.maximum(leader - K + 1, 0)
        end = gl.minimum(i + 1, L)
    else:
        leader = gl.minimum((i // S) * S + S // 2, L - 1)
        start = gl.minimum(gl.maximum(leader - K // 2, 0), L - K)
        end = start + K
    return start, end


@gluon.jit
def mask_window(s, start_n, q_row0, L, K, S, WINDOW: gl.constexpr):
    """S (rows from q_row0, keys from start_n) with -inf outside each row's window (``window_bounds``); rows past
    L keep the last row's window (their output is not stored)."""
    M: gl.constexpr = s.shape[0]
    CH: gl.constexpr = s.shape[1]
    rows = gl.minimum(q_row0 + gl.arange(0, M, gl.SliceLayout(1, s.type.layout)), L - 1)
    start, end = window_bounds(rows, L, K, S, WINDOW)
    cols = start_n + gl.arange(0, CH, gl.SliceLayout(0, s.type.layout))
    keep = (gl.expand_dims(cols, 0) >= gl.expand_dims(start, 1)) & (gl.expand_dims(cols, 0) < gl.expand_dims(end, 1))
    return gl.where(keep, s, -float("inf"))


@gluon.jit
def window_blocks(r0, r1, L, K, S, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr):
    """For query rows [r0, r1] (clamped into the layout): the key blocks some row attends, [lo, hi), and the blocks
    every row attends wholly inside the layout, [ulo, uhi) (empty when ulo >= uhi): window starts and ends never
    decrease with the row, so the first and last rows decide (``neighborhood.kv_tile_range``, ``kv_keys_unmasked``)."""
    a = gl.minimum(r0, L - 1)
    b = gl.minimum(r1, L - 1)
    start_a, end_a = window_bounds(a, L, K, S, WINDOW)
    start_b, end_b = window_bounds(b, L, K, S, WINDOW)
    lo = start_a // BLOCK_N
    hi = gl.cdiv(end_b, BLOCK_N)
    ulo = gl.cdiv(start_b, BLOCK_N)
    uhi = gl.minimum(end_a, L) // BLOCK_N
    return lo, hi, ulo, uhi


@gluon.jit
def window_keys(r0, r1, L, K, S, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr, HALO: gl.constexpr):
    """For query rows [r0, r1] (clamped into the layout): the key boxes of BLOCK_N positions that hold their keys,
    as the first box's first key, o, and the number of boxes from it, n. HALO: o is the first row's window start
    (the boxes cover the rows' halo and no more: at small windows a box of the lattice holds keys of no row in
    part); else the lattice's box that holds it (o a multiple of BLOCK_N: fp8's V^T holds the lattice's boxes)."""
    start_a, _ = window_bounds(gl.minimum(r0, L - 1), L, K, S, WINDOW)
    _, end_b = window_bounds(gl.minimum(r1, L - 1), L, K, S, WINDOW)
    if HALO:
        o = start_a
    else:
        o = start_a // BLOCK_N * BLOCK_N
    return o, gl.cdiv(end_b - o, BLOCK_N)


@gluon.jit
def window_keys_unmasked(r0, r1, o, L, K, S, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr):
    """The boxes of BLOCK_N keys from key o, [ulo, uhi) (numbered from o's, empty when ulo >= uhi), whose keys every
    query row of [r0, r1] attends, inside the layout: the last row's window start and the first row's end decide
    (``window_blocks``' ulo and uhi, from o). o is at or before the first row's window start."""
    _, end_a = window_bounds(gl.minimum(r0, L - 1), L, K, S, WINDOW)
    start_b, _ = window_bounds(gl.minimum(r1, L - 1), L, K, S, WINDOW)
    return gl.cdiv(start_b - o, BLOCK_N), (gl.minimum(end_a, L) - o) // BLOCK_N


@gluon.jit
def window_query_bounds(keys, L, K, S, WINDOW: gl.constexpr):
    """For each key position of ``keys`` (a vector): the queries that attend it, [q_lo, q_hi): q_lo the first query
    whose window ends past the key, q_hi the first whose window starts past it (windows' starts and ends never
    decrease; keys past the layout get an empty range). Two binary searches over the query positions, side by side."""
    a_lo = keys * 0
    a_hi = a_lo + L
    b_lo = a_lo
    b_hi = a_hi
    span = L
    while span > 0:
        a_mid = (a_lo + a_hi) // 2
        _, a_end = window_bounds(a_mid, L, K, S, WINDOW)
        a_open = a_lo < a_hi
        a_hi = gl.where(a_open & (a_end > keys), a_mid, a_hi)
        a_lo = gl.where(a_open & (a_end <= keys), a_mid + 1, a_lo)
        b_mid = (b_lo + b_hi) // 2
        b_start, _ = window_bounds(b_mid, L, K, S, WINDOW)
        b_open = b_lo < b_hi
        b_hi = gl.where(b_open & (b_start > keys), b_mid, b_hi)
        b_lo = gl.where(b_open & (b_start <= keys), b_mid + 1, b_lo)
        span = span // 2
    return a_lo, b_lo


@gluon.jit
def mask_cols_between(s, c0, lo, hi):
    """``s`` (columns numbered from c0) with -inf outside each row's columns [lo, hi): two bounds per row, compared
    with the block's column numbers. The backward's S^T against each key row's queries (``window_query_bounds``);
    the Blackwell forward's S against each query row's window (``window_bounds``)."""
    CH: gl.constexpr = s.shape[1]
    cols = c0 + gl.arange(0, CH, gl.SliceLayout(0, s.type.layout))
    keep = (gl.expand_dims(cols, 0) >= gl.expand_dims(lo, 1)) & (gl.expand_dims(cols, 0) < gl.expand_dims(hi, 1))
    return gl.where(keep, s, -float("inf"))


@gluon.jit
def _first_past(x, L, K, S, WINDOW: gl.constexpr, ENDS: gl.constexpr):
    """The first query position whose window ends (ENDS) or starts past key x, L if none: a binary search, the
    windows' starts and ends never decreasing."""
    lo = gl.to_tensor(0)
    hi = L
    while lo < hi:
        mid = (lo + hi) // 2
        start, end = window_bounds(mid, L, K, S, WINDOW)
        if ENDS:
            past = end > x
        else:
            past = start > x
        if past:
            hi = mid
        else:
            lo = mid + 1
    return lo


@gluon.jit
def window_query_blocks(n0, BLOCK_N: gl.constexpr, L, K, S, BLOCK_M: gl.constexpr, WINDOW: gl.constexpr):
    """The backward's view (a unit is key block [n0, n0 + BLOCK_N)): the query blocks some query of which attends a
    key of the block, [m_lo, m_end), and those whose every query attends every key of a block wholly inside the
    layout, [m_a, m_b) (clamped into the first range; empty when m_a >= m_b). By binary searches over the query
    positions, the windows' starts and ends never decreasing (``neighborhood``'s inverse, on the GPU)."""
    last = gl.minimum(n0 + BLOCK_N, L) - 1
    first_q = _first_past(n0, L, K, S, WINDOW, True)  # the first query that sees a key >= n0
    end_q = _first_past(last, L, K, S, WINDOW, False)  # past the last query that sees a key <= last
    m_lo = first_q // BLOCK_M
    m_end = gl.maximum(gl.cdiv(end_q, BLOCK_M), m_lo)
    # every query of block m sees [n0, n0 + BLOCK_N): its first query's window ends at or past the block's end, its
    # last query's window starts at or before n0
    full_q = _first_past(n0 + BLOCK_N - 1, L, K, S, WINDOW, True)
    m_a = gl.minimum(gl.maximum(gl.cdiv(full_q, BLOCK_M), m_lo), m_end)
    past_q = _first_past(n0, L, K, S, WINDOW, False)
    m_b = gl.maximum(gl.minimum(past_q // BLOCK_M, m_end), m_a)
    m_b = gl.where(n0 + BLOCK_N > L, m_a, m_b)  # a key block past the layout masks every query block
    return m_lo, m_a, m_b, m_end


# Neighborhood attention over two or three dimensions (na2d, na3d): WINDOW = 4 + causal_x + 2 causal_y (2-D) or
# 8 + causal_x + 2 causal_y + 4 causal_z (3-D). Tokens of one dilation group lie on an [Lx, Ly(, Lz)] grid; a query
# tile is a TX x TY (x TZ) box of them, a key block a KX x KY (x KZ) box, each row-major (TMA boxes over [Z, H, Lx,
# Ly, D] or [H, Z Lx, Ly, Lz, D] views, 3-D's batches folded into x: no token permute). Per dimension the 1-D rules
# above hold (``window_bounds``, ``window_blocks``); a query attends a key when every dimension's window holds it.
@gluon.constexpr_function
def window_dims(WINDOW) -> int:
    """Spatial dimensions of a WINDOW mode: 0 none, 1 (1, 2), 2 (4-7), 3 (8-15)."""
    w = WINDOW.value if isinstance(WINDOW, gl.constexpr) else WINDOW
    return 0 if w == 0 else 1 if w < 4 else 2 if w < 8 else 3


@gluon.constexpr_function
def _dim_mode(WINDOW, dim) -> int:
    """The 1-D WINDOW mode of dimension ``dim`` of a 2-D or 3-D one (1 non-causal, 2 causal)."""
    w = WINDOW.value if isinstance(WINDOW, gl.constexpr) else WINDOW
    return 2 if (w - (4 if w < 8 else 8)) >> dim & 1 else 1


@gluon.jit
def box_outside(jx, jy, jz, ulo_x, uhi_x, ulo_y, uhi_y, ulo_z, uhi_z, DIMS: gl.constexpr):
    """Whether box (jx, jy, jz) lies outside [ulo, uhi) in some dimension (z only in 3-D): a visit that needs its mask,
    the unmasked boxes being a rectangle per dimension."""
    outside = (jx < ulo_x) | (jx >= uhi_x) | (jy < ulo_y) | (jy >= uhi_y)
    if DIMS == 3:
        outside = outside | (jz < ulo_z) | (jz >= uhi_z)
    return outside


@aggregate
class WindowBoxes:
    """na2d's and na3d's pattern as the kernel reads it: the grid [Lx, Ly(, Lz)] and per dimension the kernel size
    and stride (int32 words at seq_ptr: Lx, Ly, Kx, Sx, Ky, Sy, then in 3-D Lz, Kz, Sz;
    ``hopper_host.window_box_table``), the query tile and key block boxes (constexprs: from the descriptors' blocks)
    and each dimension's mode. In 2-D the z fields are unused stand-ins (TZ = KZ = 1)."""
    Lx: gl.tensor
    Ly: gl.tensor
    Kx: gl.tensor
    Sx: gl.tensor | gl.constexpr  # (constexpr 1 with UNIT_STRIDES: ``window_bounds``' divisions by it fold away)
    Ky: gl.tensor
    Sy: gl.tensor | gl.constexpr
    Lz: gl.tensor
    Kz: gl.tensor
    Sz: gl.tensor | gl.constexpr
    TX: gl.constexpr  # query tile (all consumers' rows)
    TY: gl.constexpr
    TZ: gl.constexpr
    KX: gl.constexpr  # key block
    KY: gl.constexpr
    KZ: gl.constexpr
    MX: gl.constexpr  # 1-D modes per dimension
    MY: gl.constexpr
    MZ: gl.constexpr
    DIMS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, Lx, Ly, Kx, Sx, Ky, Sy, Lz, Kz, Sz, TX, TY, TZ, KX, KY, KZ, WINDOW, UNIT_STRIDES=False):
        self.Lx = Lx
        self.Ly = Ly
        self.Kx = Kx
        self.Sx = gl.constexpr(1) if _value(UNIT_STRIDES) else Sx
        self.Ky = Ky
        self.Sy = gl.constexpr(1) if _value(UNIT_STRIDES) else Sy
        self.Lz = Lz
        self.Kz = Kz
        self.Sz = gl.constexpr(1) if _value(UNIT_STRIDES) else Sz
        self.TX = gl.constexpr(TX)
        self.TY = gl.constexpr(TY)
        self.TZ = gl.constexpr(TZ)
        self.KX = gl.constexpr(KX)
        self.KY = gl.constexpr(KY)
        self.KZ = gl.constexpr(KZ)
        self.MX = gl.constexpr(_dim_mode(WINDOW, 0))
        self.MY = gl.constexpr(_dim_mode(WINDOW, 1))
        self.MZ = gl.constexpr(_dim_mode(WINDOW, 2))
        self.DIMS = gl.constexpr(window_dims(WINDOW))

    @gluon.jit
    def tile_origin(self, pid_m):
        """The first query position (x, y, z) of query tile ``pid_m`` (tiles row-major over the grid; z 0 in 2-D)."""
        tiles_y = gl.cdiv(self.Ly, self.TY)
        if self.DIMS == 3:
            tiles_z = gl.cdiv(self.Lz, self.TZ)
            txy = pid_m // tiles_z
            tx = txy // tiles_y
            return tx * self.TX, (txy - tx * tiles_y) * self.TY, (pid_m - txy * tiles_z) * self.TZ
        else:
            tx = pid_m // tiles_y
            return tx * self.TX, (pid_m - tx * tiles_y) * self.TY, 0

    @gluon.jit
    def blocks(self, x0, x1, y0, y1, z0, z1):
        """For the queries [x0, x1] x [y0, y1] (x [z0, z1]): per dimension the lattice's key blocks some of them
        attend, [lo, hi), and those all of them attend wholly inside the grid, [ulo, uhi) (``window_blocks``): x's
        four, y's, then z's (2-D: one block, unmasked). The backward's key boxes are the lattice's; the forward walks
        ``keys``."""
        lo_x, hi_x, ulo_x, uhi_x = window_blocks(x0, x1, self.Lx, self.Kx, self.Sx, self.KX, self.MX)
        lo_y, hi_y, ulo_y, uhi_y = window_blocks(y0, y1, self.Ly, self.Ky, self.Sy, self.KY, self.MY)
        if self.DIMS == 3:
            lo_z, hi_z, ulo_z, uhi_z = window_blocks(z0, z1, self.Lz, self.Kz, self.Sz, self.KZ, self.MZ)
        else:
            lo_z, hi_z, ulo_z, uhi_z = 0, 1, 0, 1
        return lo_x, hi_x, ulo_x, uhi_x, lo_y, hi_y, ulo_y, uhi_y, lo_z, hi_z, ulo_z, uhi_z

    @gluon.jit
    def keys(self, x0, x1, y0, y1, z0, z1, HALO: gl.constexpr):
        """For the queries [x0, x1] x [y0, y1] (x [z0, z1]): per dimension the key boxes that hold their keys, as the
        first box's first key and the number of boxes (``window_keys``): (ox, nx, oy, ny, oz, nz); 2-D: oz 0, nz 1.
        The forward's walk (``WalkBoxes``); the backward's key boxes are the lattice's (``blocks``)."""
        ox, nx = window_keys(x0, x1, self.Lx, self.Kx, self.Sx, self.KX, self.MX, HALO)
        oy, ny = window_keys(y0, y1, self.Ly, self.Ky, self.Sy, self.KY, self.MY, HALO)
        if self.DIMS == 3:
            oz, nz = window_keys(z0, z1, self.Lz, self.Kz, self.Sz, self.KZ, self.MZ, HALO)
        else:
            oz = 0
            nz = 1
        return ox, nx, oy, ny, oz, nz

    @gluon.jit
    def unmasked(self, x0, x1, y0, y1, z0, z1, ox, oy, oz):
        """For the queries [x0, x1] x [y0, y1] (x [z0, z1]): per dimension the key boxes from (ox, oy, oz) that all of
        them attend wholly inside the grid (``window_keys_unmasked``): ulo_x, uhi_x, ulo_y, uhi_y, ulo_z, uhi_z
        (2-D: one box, unmasked)."""
        ulo_x, uhi_x = window_keys_unmasked(x0, x1, ox, self.Lx, self.Kx, self.Sx, self.KX, self.MX)
        ulo_y, uhi_y = window_keys_unmasked(y0, y1, oy, self.Ly, self.Ky, self.Sy, self.KY, self.MY)
        if self.DIMS == 3:
            ulo_z, uhi_z = window_keys_unmasked(z0, z1, oz, self.Lz, self.Kz, self.Sz, self.KZ, self.MZ)
        else:
            ulo_z = 0
            uhi_z = 1
        return ulo_x, uhi_x, ulo_y, uhi_y, ulo_z, uhi_z

    @gluon.jit
    def store_lse(self, lse_ptr, w, x0, y0, z0, lse, row_layout: gl.constexpr):
        """The lse of the row-major box of queries from (x0, y0, z0) (``lse.shape[0] // (TY TZ)`` x TY x TZ rows) at
        their grid positions in [Z, H, Lx Ly] (3-D: [Z, H, Lx Ly Lz]; ``w``: the unit's batch and head), those past
        the grid not stored."""
        r = gl.arange(0, lse.shape[0], row_layout)
        if self.DIMS == 3:
            qz = z0 + r % self.TZ
            qy = y0 + r // self.TZ % self.TY
            qx = x0 + r // (self.TZ * self.TY)
            at = lse_ptr + w.off_hz.to(gl.int64) * (self.Lx * self.Ly * self.Lz) + (qx * self.Ly + qy) * self.Lz + qz
            gl.store(at, lse, mask=(qx < self.Lx) & (qy < self.Ly) & (qz < self.Lz))
        else:
            qx = x0 + r // self.TY
            qy = y0 + r % self.TY
            at = lse_ptr + w.off_hz.to(gl.int64) * (self.Lx * self.Ly) + qx * self.Ly + qy
            gl.store(at, lse, mask=(qx < self.Lx) & (qy < self.Ly))

    @gluon.jit
    def block_number(self, jx, jy, jz):
        """Key box (jx, jy, jz)'s number, row-major over the grid's boxes (fp8's V^T holds them in this order)."""
        n = jx * gl.cdiv(self.Ly, self.KY) + jy
        if self.DIMS == 3:
            n = n * gl.cdiv(self.Lz, self.KZ) + jz
        return n


@gluon.jit
def window_boxes_load(seq_ptr, TX: gl.constexpr, TY: gl.constexpr, TZ: gl.constexpr, KX: gl.constexpr,
                      KY: gl.constexpr, KZ: gl.constexpr, WINDOW: gl.constexpr, UNIT_STRIDES: gl.constexpr = False):
    """The ``WindowBoxes`` of a launch: its words at seq_ptr, its boxes and mode. UNIT_STRIDES: every dimension's
    stride is 1 (the launch checked it), taken as the constant 1 instead of its word, so that the windows' bounds
    divide by nothing (the sm_90a forward: ~130 fewer instructions a tile at 64-position tiles, NOTES v109)."""
    if window_dims(WINDOW) == 3:
        lz = gl.load(seq_ptr + 6)
        kz = gl.load(seq_ptr + 7)
        sz = gl.load(seq_ptr + 8)
    else:
        lz = gl.load(seq_ptr + 1)  # (stand-ins)
        kz = lz
        sz = lz
    return WindowBoxes(gl.load(seq_ptr), gl.load(seq_ptr + 1), gl.load(seq_ptr + 2), gl.load(seq_ptr + 3),
                       gl.load(seq_ptr + 4), gl.load(seq_ptr + 5), lz, kz, sz, TX, TY, TZ, KX, KY, KZ, WINDOW,
                       UNIT_STRIDES)


@aggregate
class BoxRows:
    """2-D/3-D windows: each row of a row-major box of queries from (x0, y0, z0) with its window per dimension, [s, e)
    (``window_bounds``, computed once a tile, not once a block; rows past the grid keep the last row's), to mask S
    against a key box (``mask``): the one box mask of both forwards (the sm_90a consumers' rows, two a thread; the
    sm_100a softmax's, a thread a row). In 2-D the z pair repeats y's."""
    sx: gl.tensor
    ex: gl.tensor
    sy: gl.tensor
    ey: gl.tensor
    sz: gl.tensor
    ez: gl.tensor
    KY: gl.constexpr
    KZ: gl.constexpr
    DIMS: gl.constexpr

    @gluon.jit
    def of(na, x0, y0, z0, M: gl.constexpr, TY: gl.constexpr, TZ: gl.constexpr, row_layout: gl.constexpr):
        """The M rows of the box [M / (TY TZ), TY, TZ] from (x0, y0, z0) under ``na`` (a ``WindowBoxes``)."""
        r = gl.arange(0, M, row_layout)
        if na.DIMS == 3:
            qz = gl.minimum(z0 + r % TZ, na.Lz - 1)
            r = r // TZ
            sz, ez = window_bounds(qz, na.Lz, na.Kz, na.Sz, na.MZ)
        qx = gl.minimum(x0 + r // TY, na.Lx - 1)
        qy = gl.minimum(y0 + r % TY, na.Ly - 1)
        sx, ex = window_bounds(qx, na.Lx, na.Kx, na.Sx, na.MX)
        sy, ey = window_bounds(qy, na.Ly, na.Ky, na.Sy, na.MY)
        if na.DIMS != 3:
            sz = sy
            ez = ey
        return BoxRows(sx, ex, sy, ey, sz, ez, na.KY, na.KZ, na.DIMS)

    @gluon.jit
    def mask(self, s, c0, kx0, ky0, kz0):
        """S (rows: these; columns c0.. of the key box from (kx0, ky0, kz0), row-major) with -inf where a dimension's
        window does not hold the key (keys past the grid included)."""
        c = c0 + gl.arange(0, s.shape[1], gl.SliceLayout(0, s.type.layout))
        if self.DIMS == 3:
            kz = gl.expand_dims(kz0 + c % self.KZ, 0)
            c = c // self.KZ
        kx = gl.expand_dims(kx0 + c // self.KY, 0)
        ky = gl.expand_dims(ky0 + c % self.KY, 0)
        keep = (kx >= gl.expand_dims(self.sx, 1)) & (kx < gl.expand_dims(self.ex, 1)) & \
            (ky >= gl.expand_dims(self.sy, 1)) & (ky < gl.expand_dims(self.ey, 1))
        if self.DIMS == 3:
            keep = keep & (kz >= gl.expand_dims(self.sz, 1)) & (kz < gl.expand_dims(self.ez, 1))
        return gl.where(keep, s, -float("inf"))


@aggregate
class WalkBoxes:
    """2-D/3-D windows: the walk of one consumer (sm_100a: one softmax half) over its tile's key boxes, row-major over
    nx x ny x nz boxes of KX x KY x KZ keys from key (ox, oy, oz) (step j is box (j // (ny nz), j // nz % ny, j % nz)
    from there; nz = 1 in 2-D: ``WindowBoxes.keys``); the boxes all of its queries attend wholly, [ulo, uhi) per
    dimension (numbered from the first), need no mask; its queries' box starts at (x0, y0, z0)."""
    ox: gl.tensor
    oy: gl.tensor
    oz: gl.tensor | gl.constexpr
    ny: gl.tensor
    nz: gl.tensor | gl.constexpr
    inv_ny: gl.tensor  # 1 / ny, 1 / nz in fp32 (``small_quotient``)
    inv_nz: gl.tensor | gl.constexpr
    ulo_x: gl.tensor
    uhi_x: gl.tensor
    ulo_y: gl.tensor
    uhi_y: gl.tensor
    ulo_z: gl.tensor | gl.constexpr
    uhi_z: gl.tensor | gl.constexpr
    x0: gl.tensor
    y0: gl.tensor
    z0: gl.tensor | gl.constexpr

    @gluon.jit
    def of(ox, oy, oz, ny, nz, ulo_x, uhi_x, ulo_y, uhi_y, ulo_z, uhi_z, x0, y0, z0):
        """The walk, with the reciprocals its steps divide by."""
        inv_ny, inv_nz = walk_reciprocals(ny, nz)
        return WalkBoxes(ox, oy, oz, ny, nz, inv_ny, inv_nz, ulo_x, uhi_x, ulo_y, uhi_y, ulo_z, uhi_z, x0, y0, z0)

    @gluon.jit
    def box(self, j, KX: gl.constexpr, KY: gl.constexpr, KZ: gl.constexpr, DIMS: gl.constexpr):
        """Step j's key box: its first key (kx0, ky0, kz0), and whether it needs the mask (outside the unmasked boxes
        in some dimension)."""
        ix, iy, iz = walk_step(j, self.ny, self.nz, self.inv_ny, self.inv_nz, DIMS)
        outside = box_outside(ix, iy, iz, self.ulo_x, self.uhi_x, self.ulo_y, self.uhi_y, self.ulo_z, self.uhi_z, DIMS)
        return self.ox + ix * KX, self.oy + iy * KY, self.oz + iz * KZ, outside


Word = gl.tensor | gl.constexpr  # a runtime value, or None where the tile's mode has none


@aggregate
class BoxWalk:
    """2-D/3-D windows: a unit's key box, from (kx0, ky0, kz0), and its walk over the query boxes that attend it, row-
    major over [lo_x, ...) x [lo_y, lo_y + ny) x [lo_z, lo_z + nz) (n in all; nz = 1 in 2-D), per dimension the 1-D
    backward's query blocks (``window_query_blocks``); a query box inside [ulo, uhi) in every dimension has every
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
class BoxKeys:
    """2-D/3-D windows, the sm_90a backward's S^T: each key row's queries per dimension, [lo, hi) (made once a unit),
    to mask S^T against a query box (``mask``): ``BoxRows``' counterpart for S^T. In 2-D the z pair repeats y's."""
    lo_x: gl.tensor
    hi_x: gl.tensor
    lo_y: gl.tensor
    hi_y: gl.tensor
    lo_z: gl.tensor
    hi_z: gl.tensor
    TX: gl.constexpr  # a query box
    TY: gl.constexpr
    TZ: gl.constexpr
    DIMS: gl.constexpr

    @gluon.jit
    def mask(self, s, bx, by, bz):
        """S^T (columns: query box (bx, by, bz)'s positions, row-major) with -inf where a dimension's queries [lo, hi)
        of the key do not hold the column's query (positions past the grid included)."""
        c = gl.arange(0, s.shape[1], gl.SliceLayout(0, s.type.layout))
        if self.DIMS == 3:
            qz = gl.expand_dims(bz * self.TZ + c % self.TZ, 0)
            c = c // self.TZ
        qx = gl.expand_dims(bx * self.TX + c // self.TY, 0)
        qy = gl.expand_dims(by * self.TY + c % self.TY, 0)
        keep = (qx >= gl.expand_dims(self.lo_x, 1)) & (qx < gl.expand_dims(self.hi_x, 1)) & \
            (qy >= gl.expand_dims(self.lo_y, 1)) & (qy < gl.expand_dims(self.hi_y, 1))
        if self.DIMS == 3:
            keep = keep & (qz >= gl.expand_dims(self.lo_z, 1)) & (qz < gl.expand_dims(self.hi_z, 1))
        return gl.where(keep, s, -float("inf"))


@aggregate
class TileMask:
    """Which scores of one tile count, built once before the tile's blocks and applied to each block's scores, in
    each kernel's layout of them: ``apply`` to the sm_90a forward's S (a consumer's query rows against key block j),
    ``at`` and then ``apply_halves`` to the sm_100a softmax's, read as two column halves (a thread a row), and ``at``
    and then ``apply_transposed`` to the sm_90a backward's S^T (a warpgroup's key rows against the query block from
    q0; TRANSPOSED). ``at`` finds a 2-D/3-D step's box ahead of its scores. Modes (constexpr CAUSAL, WINDOW): the
    dense key tail and causal diagonal (``dense``: ``mask_block``; ``keys_dense``: ``mask_block_transposed`` or per
    element); a 1-D window, each block's bounds from its rows (``window``, ``mask_window``: sm_90a) or each row's
    [lo, hi) made once a tile (``window_rows``: sm_100a, a row a thread; ``keys_window``: each key's queries); a
    2-D/3-D window's boxes (``boxes``: the query rows' windows, ``BoxRows``, against each key box along a
    ``WalkBoxes``; ``keys_boxes``: the key rows' queries, ``BoxKeys``, against each query box along a ``BoxWalk``).
    The fields a mode does not read are None."""
    row0: Word  # dense, ``window``: the tile's first query row; TRANSPOSED: the warpgroup's first key
    shift: Word  # dense, ``window``: the causal diagonal's shift (query i sees keys <= i + shift)
    n_k: Word  # dense: the keys; ``window``: the layout's length
    win_k: Word  # ``window``: the window's kernel size and stride
    win_s: Word
    lo: Word  # ``window_rows``, ``keys_window``: each row's columns [lo, hi) (a query's keys; a key's queries)
    hi: Word
    rows: BoxRows | BoxKeys | gl.constexpr  # 2-D/3-D: the rows' windows and the walk over the column boxes
    walk: WalkBoxes | BoxWalk | gl.constexpr
    bx: Word  # 2-D/3-D, ``at``'s: the step's box (forward: its first key per dimension; TRANSPOSED: the query box,
    by: Word  # in boxes) and whether it needs the mask
    bz: Word
    partial: Word
    KX: gl.constexpr  # forward: a key box
    KY: gl.constexpr
    KZ: gl.constexpr
    BLOCK_N: gl.constexpr  # forward: keys per block (dense, 1-D: block j starts at key j BLOCK_N)
    CAUSAL: gl.constexpr
    WINDOW: gl.constexpr  # as ``hopper.Cfg.WINDOW``: 0 dense, 1-2 one dimension, 4-15 boxes
    OPAQUE_ROWS: gl.constexpr  # forward dense: see ``mask_block``
    TRANSPOSED: gl.constexpr  # S^T: rows are keys, columns queries (``keys_*``)
    BY_ROW: gl.constexpr  # TRANSPOSED dense: ``mask_block_transposed`` (else per element)

    @gluon.jit
    def dense(row0, shift, n_k, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, OPAQUE_ROWS: gl.constexpr = False):
        return TileMask(row0, shift, n_k, None, None, None, None, None, None, None, None, None, None, 1, 1, 1,
                        BLOCK_N, CAUSAL, 0, OPAQUE_ROWS, False, False)

    @gluon.jit
    def window(row0, shift, L, K, S, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr):
        """A 1-D window of K keys moved every S queries over a layout of L (``window_bounds``), each block's
        bounds from its rows."""
        return TileMask(row0, shift, L, K, S, None, None, None, None, None, None, None, None, 1, 1, 1, BLOCK_N,
                        False, WINDOW, False, False, False)

    @gluon.jit
    def window_rows(lo, hi, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr):
        """A 1-D window as each row's keys [lo, hi), made once a tile."""
        return TileMask(None, None, None, None, None, lo, hi, None, None, None, None, None, None, 1, 1, 1, BLOCK_N,
                        False, WINDOW, False, False, False)

    @gluon.jit
    def boxes(rows, walk, KX: gl.constexpr, KY: gl.constexpr, KZ: gl.constexpr, WINDOW: gl.constexpr):
        """2-D/3-D: ``rows`` the rows' windows (``BoxRows.of``: once a tile, not once a block)."""
        return TileMask(None, None, None, None, None, None, None, rows, walk, None, None, None, None, KX, KY, KZ,
                        KX * KY * KZ, False, WINDOW, False, False, False)

    @gluon.jit
    def keys_dense(key0, shift, n_k, CAUSAL: gl.constexpr, BY_ROW: gl.constexpr):
        """S^T: the keys from key0 against queries, the key tail n_k and (bottom-right) causal diagonal."""
        return TileMask(key0, shift, n_k, None, None, None, None, None, None, None, None, None, None, 1, 1, 1, 1,
                        CAUSAL, 0, False, True, BY_ROW)

    @gluon.jit
    def keys_window(key0, shift, n_k, q_lo, q_hi, WINDOW: gl.constexpr):
        """S^T, a 1-D window: each key row's queries [q_lo, q_hi) (``window_query_bounds``)."""
        return TileMask(key0, shift, n_k, None, None, q_lo, q_hi, None, None, None, None, None, None, 1, 1, 1, 1,
                        False, WINDOW, False, True, False)

    @gluon.jit
    def keys_boxes(key0, shift, n_k, walk, keys, WINDOW: gl.constexpr):
        """S^T, 2-D/3-D: ``keys`` the key rows' queries per dimension (``BoxKeys``), against the query boxes of the
        unit's ``walk`` (``BoxWalk``)."""
        return TileMask(key0, shift, n_k, None, None, None, None, keys, walk, None, None, None, None, 1, 1, 1, 1,
                        False, WINDOW, False, True, False)

    @gluon.jit
    def apply(self, s, j, MASKED: gl.constexpr):
        """S of key block j (2-D/3-D: step j of the walk) with -inf where a key does not count; unchanged unless
        MASKED (a block every row sees wholly). Boxes mask the walk's steps outside its unmasked boxes."""
        if MASKED:
            if window_dims(self.WINDOW) >= 2:
                kx0, ky0, kz0, outside = self.walk.box(j, self.KX, self.KY, self.KZ, self.rows.DIMS)
                if outside:
                    s = self.rows.mask(s, 0, kx0, ky0, kz0)
            elif window_dims(self.WINDOW) == 1:
                s = mask_window(s, j * self.BLOCK_N, self.row0 + self.shift, self.n_k, self.win_k, self.win_s,
                                self.WINDOW)
            else:
                s = mask_block(s, j * self.BLOCK_N, self.row0 + self.shift, self.n_k, self.CAUSAL, self.OPAQUE_ROWS)
        return s

    @gluon.jit
    def at(self, j):
        """The mask of step j for ``apply_halves`` and ``apply_transposed``: 2-D/3-D windows find its box here, at
        the top of the block (found after the scores are waited for, the 3-D builds' SASS changed); the other
        modes' is this mask."""
        if window_dims(self.WINDOW) >= 2:
            if self.TRANSPOSED:
                bx, by, bz, _, partial = self.walk.box(j, window_dims(self.WINDOW))
            else:
                bx, by, bz, partial = self.walk.box(j, self.KX, self.KY, self.KZ, self.rows.DIMS)
            return TileMask(self.row0, self.shift, self.n_k, self.win_k, self.win_s, self.lo, self.hi, self.rows,
                            self.walk, bx, by, bz, partial, self.KX, self.KY, self.KZ, self.BLOCK_N, self.CAUSAL,
                            self.WINDOW, self.OPAQUE_ROWS, self.TRANSPOSED, self.BY_ROW)
        else:
            return self

    @gluon.jit
    def apply_halves(self, s0, s1, j, MASKED: gl.constexpr):
        """Block j's S (2-D/3-D: the mask ``at`` the block) as its two column halves, with -inf where a key does not
        count; unchanged unless MASKED. Boxes mask the walk's steps outside its unmasked boxes."""
        CH: gl.constexpr = s0.shape[1]
        if MASKED:
            if window_dims(self.WINDOW) >= 2:
                if self.partial:
                    s0 = self.rows.mask(s0, 0, self.bx, self.by, self.bz)
                    s1 = self.rows.mask(s1, CH, self.bx, self.by, self.bz)
            elif window_dims(self.WINDOW) == 1:
                start_n = j * self.BLOCK_N
                s0 = mask_cols_between(s0, start_n, self.lo, self.hi)
                s1 = mask_cols_between(s1, start_n + CH, self.lo, self.hi)
            else:
                start_n = j * self.BLOCK_N
                diag_row0 = self.row0 + self.shift
                s0 = mask_block(s0, start_n, diag_row0, self.n_k, self.CAUSAL)
                s1 = mask_block(s1, start_n + CH, diag_row0, self.n_k, self.CAUSAL)
        return s0, s1

    @gluon.jit
    def apply_transposed(self, s, q0, MASKED: gl.constexpr):
        """S^T of the query block from q0 (2-D/3-D: the mask ``at`` its step) with -inf where the key does not count;
        unchanged unless MASKED. Boxes mask the walk's steps outside its unmasked boxes."""
        if MASKED:
            if window_dims(self.WINDOW) >= 2:
                if self.partial:
                    s = self.rows.mask(s, self.bx, self.by, self.bz)
            elif window_dims(self.WINDOW) == 1:
                s = mask_cols_between(s, q0, self.lo, self.hi)
            elif self.BY_ROW:
                s = mask_block_transposed(s, self.row0, q0, self.shift, self.n_k, self.CAUSAL)
            else:
                keys = gl.expand_dims(self.row0 + gl.arange(0, s.shape[0], gl.SliceLayout(1, s.type.layout)), 1)
                ok = keys < self.n_k
                if self.CAUSAL:
                    cols = gl.arange(0, s.shape[1], gl.SliceLayout(0, s.type.layout))
                    ok = ok & (keys <= gl.expand_dims(q0 + cols, 0) + self.shift)
                s = gl.where(ok, s, -float("inf"))
        return s
