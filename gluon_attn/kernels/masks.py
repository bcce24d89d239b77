"""The causal / key-tail mask both kernels apply to S blocks that cross the diagonal or the last key."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .channels import opaque


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
    decrease with the row, so the first and last rows decide (``neighborhood.kv_tile_range``, ``kv_tile_unmasked``)."""
    a = gl.minimum(r0, L - 1)
    b = gl.minimum(r1, L - 1)
    start_a, end_a = window_bounds(a, L, K, S, WINDOW)
    start_b, end_b = window_bounds(b, L, K, S, WINDOW)
    lo = start_a // BLOCK_N
    hi = gl.cdiv(end_b, BLOCK_N)
    ulo = gl.cdiv(start_b, BLOCK_N)
    uhi = gl.minimum(end_a, L) // BLOCK_N
    return lo, hi, ulo, uhi
