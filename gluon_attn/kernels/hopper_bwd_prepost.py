"""The Hopper backward's kernels before and after the main one (``hopper_bwd``): ``preprocess`` (delta =
rowsum(dO * O), less the lse's incoming gradient, and the lse in log2 units), and dQ's fp32 accumulator back to
dQ's rows: ``dq_from_fragments`` for DQ_FRAG's fragment order, ``padded_rows`` and ``row_index`` for packed
sequences, whose rows start on whole query blocks there."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from . import cdiv, next_power_of_2
from .toolchain import COMPILE_OPTIONS


# ---------------------------------------------------------------------------------------------
# Preprocessing: delta = rowsum(dO * O) (minus the lse's incoming gradient), lse in log2 units
# ---------------------------------------------------------------------------------------------
@gluon.jit(do_not_specialize=["N", "H", "so_z", "so_h", "so_n", "sd_z", "sd_h", "sd_n", "zero_words"])
def _bwd_preprocess(o_ptr, do_ptr, lse_ptr, glse_ptr, delta_ptr, lse2_ptr, N, H, so_z, so_h, so_n, sd_z, sd_h, sd_n,
                    zero_ptr, zero_words, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, HAS_GLSE: gl.constexpr,
                    D_REAL: gl.constexpr = 0, ZERO: gl.constexpr = False):
    """One block of rows of one head: O and dO [Z, H, N, D] by strides; lse, its gradient, delta and
    the log2 lse [Z * H, N] contiguous. Rows that saw no key (lse -inf, output 0) get +inf: P = 0.
    D_REAL > 0: the tensors' head dim, below HEAD_DIM (a power of two), whose columns past it are masked.
    ZERO: also zero fp32 words [0, zero_words) at zero_ptr, a share per program (a prepared backward's workspace:
    dQ's accumulator, the scheduler's counter and locks, without a memset launch of their own)."""
    LANES_D: gl.constexpr = HEAD_DIM // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANES_D, LANES_D], [4, 1], [1, 0])
    hz = gl.program_id(1)
    z = hz // H
    h = hz - z * H
    rows = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, layout))
    ok = rows < N
    r64 = gl.expand_dims(rows.to(gl.int64), 1)
    keep = gl.expand_dims(ok, 1)
    if D_REAL > 0:
        keep = keep & gl.expand_dims(cols < D_REAL, 0)
    o = gl.load(o_ptr + z.to(gl.int64) * so_z + h.to(gl.int64) * so_h + r64 * so_n + gl.expand_dims(cols, 0),
                mask=keep, other=0.0)
    do = gl.load(do_ptr + z.to(gl.int64) * sd_z + h.to(gl.int64) * sd_h + r64 * sd_n + gl.expand_dims(cols, 0),
                 mask=keep, other=0.0)
    delta = gl.sum(o.to(gl.float32) * do.to(gl.float32), 1)
    at = hz.to(gl.int64) * N + rows
    if HAS_GLSE:
        delta = delta - gl.load(glse_ptr + at, mask=ok, other=0.0)
    gl.store(delta_ptr + at, delta, mask=ok)
    lse = gl.load(lse_ptr + at, mask=ok, other=0.0)
    gl.store(lse2_ptr + at, gl.where(lse == -float("inf"), float("inf"), lse * 1.4426950408889634), mask=ok)
    if ZERO:
        ZBLOCK: gl.constexpr = 512
        zl: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
        programs = gl.num_programs(0) * gl.num_programs(1)
        per = (zero_words + programs * ZBLOCK - 1) // (programs * ZBLOCK) * ZBLOCK
        start = (hz * gl.num_programs(0) + gl.program_id(0)).to(gl.int64) * per
        offs = gl.arange(0, ZBLOCK, zl)
        for i in range(0, per, ZBLOCK):
            at_z = start + i + offs
            gl.store(zero_ptr + at_z, gl.zeros([ZBLOCK], gl.float32, zl), mask=at_z < zero_words)


_PRE_BLOCK = 64  # rows per program of ``_bwd_preprocess``


def preprocess(o, do, lse, grad_lse=None):
    """(delta, lse in log2 units) for o, do [Z, H, N, D] (any strides with a unit last one) and lse
    [Z, H, N] (contiguous rows): both [Z, H, N] fp32."""
    Z, H, N, D = o.shape
    delta = torch.empty((Z, H, N), dtype=torch.float32, device=o.device)
    lse2 = torch.empty_like(delta)
    if N == 0 or Z * H == 0:
        return delta, lse2
    o, do = _unit_last(o), _unit_last(do)
    glse = grad_lse.contiguous() if grad_lse is not None else lse
    grid, sizes, consts = _preprocess_terms(o, do, grad_lse is not None)
    _bwd_preprocess[grid](o, do, lse.contiguous(), glse, delta, lse2, *sizes, delta, 0, **consts, num_warps=4,
                          **COMPILE_OPTIONS)
    return delta, lse2


def _preprocess_terms(o, do, has_glse: bool) -> tuple:
    """(grid, the sizes and strides after the pointers, the constexprs) of a ``_bwd_preprocess`` launch."""
    Z, H, N, D = o.shape
    width = next_power_of_2(D)
    consts = dict(HEAD_DIM=width, BLOCK=_PRE_BLOCK, HAS_GLSE=has_glse, D_REAL=D if width != D else 0)
    return (cdiv(N, _PRE_BLOCK), Z * H), (N, H, *o.stride()[:3], *do.stride()[:3]), consts


def preprocess_launch(o, do, lse, grad_lse=None, zero_words: int = 0):
    """``preprocess`` of one call signature by address (``hopper_bwd_host.prepare``): a function of (stream, the
    addresses of o, do, lse, the lse's gradient (lse's where there is none), delta, the log2 lse, and where
    ``zero_words`` fp32 words are to be zeroed) that launches the compiled kernel directly; None where it cannot
    (strides that are not unit, a kernel that needs the JIT's launcher)."""
    from .launch import direct_launcher, placeholder

    Z, H, N, D = o.shape
    if N == 0 or Z * H == 0 or o.stride(-1) != 1 or do.stride(-1) != 1 or not lse.is_contiguous():
        return None
    grid, sizes, consts = _preprocess_terms(o, do, grad_lse is not None)
    consts["ZERO"] = zero_words > 0
    rows = placeholder(o.device, torch.float32)
    direct = direct_launcher(_bwd_preprocess, (o, do, lse, grad_lse if grad_lse is not None else lse, rows, rows,
                                               *sizes, rows, zero_words), consts, grid, 4)
    if direct is None:
        return None
    return lambda stream, op, dp, lp, gp, delta, lse2, zero: direct(
        grid, stream, (op, dp, lp, gp, delta, lse2, *sizes, zero, zero_words), consts)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()



# ---------------------------------------------------------------------------------------------
# After the kernel: dQ's accumulator back to dQ's rows
# ---------------------------------------------------------------------------------------------
@triton.jit
def _dq_from_fragments(acc_ptr, dq_ptr, N_Q, H, s_z, s_h, s_n, scale, BLOCK_M: tl.constexpr,
                       HEAD_DIM: tl.constexpr, D_REAL: tl.constexpr = 0):
    """One query block of one head: DQ_FRAG's accumulator chunks (``hopper_bwd._fragment_order``) back to dQ's rows,
    scaled and cast: two of [64, 64] (D=64: by queries, D=128: by head dims), or the 192/128 pair's three of [64 head
    dims, 32 queries] (BLOCK_M 32, HEAD_DIM 192: one at a time)."""
    blk = tl.program_id(0)
    hz = tl.program_id(1)
    base = acc_ptr + (hz.to(tl.int64) * tl.num_programs(0) + blk) * (BLOCK_M * HEAD_DIM)
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    z = hz // H
    row_ptrs = dq_ptr + z.to(tl.int64) * s_z + (hz - z * H) * s_h + rows[:, None] * s_n
    # Chunk c's element (16 w + 8 h + rr, 8 i + 2 cc + p) at ((i * 4 + w) * 32 + 4 rr + cc) * 4 + 2 h + p
    if BLOCK_M == 32:  # the pair's chunks, dQ^T [64 head dims 64 c + ..., 32 queries]
        for c in tl.static_range(HEAD_DIM // 64):
            x = tl.reshape(tl.load(base + c * 2048 + tl.arange(0, 2048)), [4, 4, 8, 4, 2, 2])  # (i, w, rr, cc, h, p)
            x = tl.reshape(tl.permute(x, [0, 3, 5, 1, 4, 2]), [BLOCK_M, 64])
            _store_dq_cols(row_ptrs, rows, c * 64 + tl.arange(0, 64), x, N_Q, scale, D_REAL)
    else:
        # (c, i, w, rr, cc, h, p)
        x = tl.reshape(tl.load(base + tl.arange(0, BLOCK_M * HEAD_DIM)), [2, 8, 4, 8, 4, 2, 2])
        if HEAD_DIM == 2 * 64:  # dQ^T: rows are head dims 64 c + ..., columns the block's queries
            x = tl.permute(x, [1, 4, 6, 0, 2, 5, 3])
        else:  # rows are the block's queries 64 WG + ..., columns the head dims
            x = tl.permute(x, [0, 2, 5, 3, 1, 4, 6])
        _store_dq_cols(row_ptrs, rows, tl.arange(0, HEAD_DIM), tl.reshape(x, [BLOCK_M, HEAD_DIM]), N_Q, scale, D_REAL)


@triton.jit
def _store_dq_cols(row_ptrs, rows, cols, x, N_Q, scale, D_REAL: tl.constexpr):
    """``x`` [rows, cols] scaled and cast into dQ's rows at columns ``cols``: rows past N_Q left out, and (a padded
    head dim: dQ has D_REAL columns) the columns past D_REAL."""
    keep = rows[:, None] < N_Q
    if D_REAL > 0:
        keep = keep & (cols[None, :] < D_REAL)
    tl.store(row_ptrs + cols[None, :], (x * scale).to(row_ptrs.dtype.element_ty), mask=keep)


def dq_from_fragments(acc: torch.Tensor, dq: torch.Tensor, block_m: int, scale: float = 1.0):
    """dq [Z, H, N_Q, D'] (unit last stride) = ``scale`` times DQ_FRAG's accumulator ``acc`` [Z, H, rows, D] fp32
    (rows a multiple of ``block_m``; block_m * D = 8192, or the 192/128 pair's 32 x 192), whose query blocks hold their
    chunks in fragment order; D' <= D (a head dim run padded: its first D' columns)."""
    Z, H, rows, D = acc.shape
    if Z * H == 0 or rows == 0:
        return
    grid, args, consts = _fragments_terms(acc.shape, dq, block_m, scale)
    _dq_from_fragments[grid](acc, dq, *args, **consts, num_warps=4, **COMPILE_OPTIONS)


def _fragments_terms(acc_shape: tuple, dq: torch.Tensor, block_m: int, scale: float) -> tuple:
    """(grid, the arguments after the two pointers, the constexprs) of a ``_dq_from_fragments`` launch."""
    Z, H, rows, D = acc_shape
    d_real = dq.shape[3]
    consts = dict(BLOCK_M=block_m, HEAD_DIM=D, D_REAL=d_real if d_real != D else 0)
    return (rows // block_m, Z * H), (dq.shape[2], H, dq.stride(0), dq.stride(1), dq.stride(2), scale), consts


def fragments_launch(acc_shape: tuple, dq: torch.Tensor, block_m: int, scale: float):
    """``dq_from_fragments`` of one call signature by address (``hopper_bwd_host.prepare``): a function of (stream, the
    accumulator's address, dq's) for a dq laid out as ``dq``; None where the compiled kernel needs the JIT's
    launcher."""
    from .launch import direct_launcher, placeholder

    grid, args, consts = _fragments_terms(acc_shape, dq, block_m, scale)
    direct = direct_launcher(_dq_from_fragments, (placeholder(dq.device, torch.float32), dq, *args), consts, grid, 4)
    if direct is None:
        return None
    return lambda stream, acc, dqp: direct(grid, stream, (acc, dqp, *args), consts)


def padded_rows(cu_seqlens_q, block_m: int):
    """Each packed sequence's first row in the dQ accumulator (its rows padded to whole query blocks),
    int32 [B + 1], built on the GPU."""
    lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    starts = torch.zeros_like(cu_seqlens_q, dtype=torch.int32)
    starts[1:] = torch.cumsum((lens + block_m - 1) // block_m * block_m, 0)
    return starts


def row_index(cu_seqlens_q, dq_rows, total: int):
    """For each packed query row, its row in the padded accumulator (on the GPU, no host sync)."""
    tokens = torch.arange(total, device=cu_seqlens_q.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_seqlens_q[1:].to(torch.int32), tokens, right=True)
    return (tokens - cu_seqlens_q.to(torch.int32)[seq] + dq_rows[seq]).to(torch.int64)
