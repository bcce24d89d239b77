"""Host helpers both kernels share: dtype maps, descriptor signatures, the output tensor, box layouts of 2-D/3-D
windows, a build's window words."""

from typing import Optional

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


def resolve_output(q: torch.Tensor, out, out_dtype, is_fp8: bool, head_dim_v: Optional[int] = None):
    """The output tensor and dtype both kernels write: 16-bit inputs write their own dtype, fp8
    inputs fp16 (or bf16 on request); a new output keeps q's strides (layout), with v's head dim
    (``head_dim_v``, default q's)."""
    if out_dtype is None:
        out_dtype = torch.float16 if is_fp8 else q.dtype
    if out_dtype not in (torch.float16, torch.bfloat16) or (not is_fp8 and out_dtype != q.dtype):
        raise ValueError(f"out_dtype {out_dtype} not supported: 16-bit inputs write their own dtype, "
                         f"fp8 inputs write float16 or bfloat16")
    shape = (*q.shape[:-1], head_dim_v or q.shape[-1])
    if out is None:
        return empty_in_layout_of(q, shape, out_dtype), out_dtype
    if tuple(out.shape) != shape or out.dtype != out_dtype or out.device != q.device:
        raise ValueError(f"out must be {shape} {out_dtype} on {q.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out, out_dtype


def empty_in_layout_of(t: torch.Tensor, shape, dtype) -> torch.Tensor:
    """An empty tensor of ``shape`` whose dimensions lie in memory in ``t``'s order (``empty_like`` where the
    shapes agree; else the last dimension may differ, e.g. an output with v's head dim)."""
    if tuple(shape) == tuple(t.shape):
        return torch.empty_like(t, dtype=dtype)
    order = sorted(range(t.dim()), key=lambda i: (t.stride(i), i), reverse=True)  # outermost first
    dense = torch.empty([shape[i] for i in order], dtype=dtype, device=t.device)
    return dense.permute([order.index(i) for i in range(t.dim())])


def descriptor_signature(dtype: torch.dtype, block_shape, layout=None) -> str:
    """The signature string of a tensor-descriptor argument, for compile-only builds (layout: the
    block's default NVMMA shared layout unless given)."""
    if layout is None:
        layout = gl.NVMMASharedLayout.get_default_for(list(block_shape), gl_dtype(dtype))
    dims = ", ".join(str(int(d)) for d in block_shape)
    return f"tensordesc<{sig_dtype(dtype)}[{dims}],{layout!r}>"


def box_splits(total: int, dims: int) -> list[tuple[int, ...]]:
    """Every way to write ``total`` (a power of two) as a product of ``dims`` powers of two, in order: the boxes of
    ``total`` positions the neighborhood windows' kernels take (query tiles and key blocks over a 1-3 D grid)."""
    if dims == 1:
        return [(total,)]
    return [rest + (p,) for p in (1 << e for e in range(total.bit_length())) if p <= total
            for rest in box_splits(total // p, dims - 1)]


def box_rows(t: torch.Tensor, box: tuple, fill=0) -> torch.Tensor:
    """t [Z, H, *grid, *rest] (any strides) with its positions laid out box after box: [Z, H, boxes x prod(box),
    *rest], box (jx, jy(, jz)) number (jx ny + jy)(nz) + jz (``masks.WindowBoxes.block_number``), each box's positions
    row-major, ``fill`` past the grid."""
    Z, H = t.shape[:2]
    dims = len(box)
    grid, rest = t.shape[2:2 + dims], t.shape[2 + dims:]
    n = [-(-g // b) for g, b in zip(grid, box)]
    padded = t.new_full((Z, H, *(c * b for c, b in zip(n, box)), *rest), fill)
    padded[(slice(None), slice(None), *(slice(0, g) for g in grid))] = t
    split = padded.view(Z, H, *(x for c, b in zip(n, box) for x in (c, b)), *rest)  # [Z, H, n0, b0, n1, b1, ...]
    order = (0, 1, *(2 + 2 * d for d in range(dims)), *(3 + 2 * d for d in range(dims)),
             *range(2 + 2 * dims, 2 + 2 * dims + len(rest)))
    return split.permute(*order).reshape(Z, H, -1, *rest)


def rows_to_grid(rows: torch.Tensor, grid: tuple, box: tuple, out: torch.Tensor, scale: float = 1.0) -> None:
    """``box_rows``'s inverse into ``out`` [Z, H, *grid, D'] (any strides, D' <= D): rows [Z, H, boxes x prod(box),
    D] times ``scale``, in one pass where the grid is whole boxes."""
    Z, H, _, D = rows.shape
    dims = len(box)
    n = [-(-g // b) for g, b in zip(grid, box)]
    split = rows.view(Z, H, *n, *box, D)
    order = (0, 1, *(x for d in range(dims) for x in (2 + d, 2 + dims + d)), 2 + 2 * dims)
    boxed = split.permute(*order)[..., :out.shape[-1]]  # [Z, H, n0, b0, n1, b1, ..., D']
    if all(g % b == 0 for g, b in zip(grid, box)):
        torch.mul(boxed, scale, out=out.view(Z, H, *(x for c, b in zip(n, box) for x in (c, b)), out.shape[-1]))
    else:
        whole = boxed.reshape(Z, H, *(c * b for c, b in zip(n, box)), out.shape[-1])
        out.copy_(whole[(slice(None), slice(None), *(slice(0, g) for g in grid))] * scale)


def window_label(window: int, boxes=None) -> str:
    """A build description's words for its WINDOW mode."""
    if window < 4:
        return [" ", " window ", " causal window "][window]
    dims = 2 if window < 8 else 3
    causal = "".join("c" if (window - (4 if dims == 2 else 8)) >> d & 1 else "-" for d in range(dims))
    box = lambda b: "x".join(map(str, b))  # noqa: E731
    return f" {dims}-D window (causal {causal}, q {box(boxes[0])}, kv {box(boxes[1])}) "
