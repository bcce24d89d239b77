"""The causal / key-tail mask both kernels apply to S blocks that cross the diagonal or the last key."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


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
