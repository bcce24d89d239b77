"""Neighborhood attention's semantics (NATTEN's na1d/na2d/na3d) and its tile math.

Tokens lie on a grid ``spatial`` (1-3 dims; tensors heads-last, [B, *spatial, H, D], NATTEN's layout). Per
dimension, with size L, kernel size K, stride S, dilation Dl and causal C (NATTEN's rules, read from its source):

- dilation: token x is in group ``x % Dl`` at position ``x // Dl``; a query attends only keys of its own group,
  and the window math below runs on positions within the group, whose length is ``ceil((L - g) / Dl)``;
- non-causal: the queries of a stride group ``[gS, gS + S)`` share the window of their leader
  ``min(gS + S // 2, L - 1)``; it starts at ``clamp(leader - K // 2, 0, L - K)`` and holds K keys (shifted at
  the borders, so every query sees K keys; an even K has one more key left of the leader than right);
- causal: the leader is the group's last query ``min(gS + S - 1, L - 1)``; the window starts at
  ``max(leader - K + 1, 0)`` and ends at the query itself (a query sees keys up to and including its own
  position);

and a query attends a key when every dimension's window holds it. ``stride == kernel_size`` is blocked
attention; ``kernel_size == size`` in every dimension (non-causal) is dense attention.

The tile math: a query tile is a box of positions of one dilation group (``q_tile_shape`` per dimension), and
so is a K/V tile. Window starts and ends never decrease along a dimension, so the K/V tiles a query tile needs
are, per dimension, those from the tile holding its first query's window start to the one holding its last
query's window end; a K/V tile needs no mask when, in every dimension, it lies inside the layout and inside the
window of the tile's first query's end and last query's start (then inside every query's window).
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import api as _api, merge as _merge  # (modules: a call looks their names up, as a test's stand-ins set them)
from .cache import BoundedCache, layout, signature

NA_DIMS = (1, 2, 3)


def _per_dim(name: str, value, n: int, *, minimum: int) -> tuple[int, ...]:
    what = f"an integer or a tuple of {n} integers, each >= {minimum}"
    values = (value,) * n if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, (tuple, list)) or len(values) != n or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in values):
        raise ValueError(f"`{name}` must be {what} (one per spatial dimension of a {n}-D problem); got {value!r}")
    return tuple(values)


@dataclass(frozen=True)
class Neighborhood:
    """One neighborhood attention problem's pattern: per spatial dimension its size, kernel size, stride,
    dilation and causal flag (validated by ``neighborhood``)."""
    spatial: tuple[int, ...]
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    is_causal: tuple[bool, ...]

    @property
    def dims(self) -> int:
        return len(self.spatial)

    @property
    def tokens(self) -> int:
        return math.prod(self.spatial)

    def group_sizes(self, dim: int) -> list[int]:
        """Positions in each dilation group of dimension ``dim``: ceil((L - g) / dilation)."""
        L, d = self.spatial[dim], self.dilation[dim]
        return [L // d + (g < L % d) for g in range(d)]

    def is_dense(self) -> bool:
        return all(k == s for k, s in zip(self.kernel_size, self.spatial)) and not any(self.is_causal)


def each_dim(values: tuple):
    """A one-value tuple as NATTEN's int (it applies to every dimension), a longer one as it is: the command line's
    form of NATTEN's arguments (``configs --na``, ``sweep --na``)."""
    return values[0] if len(values) == 1 else values


def neighborhood(spatial: Sequence[int], kernel_size, stride=1, dilation=1, is_causal=False) -> Neighborhood:
    """Validate NATTEN's arguments against a token layout (ints apply to every dimension) and return the pattern.
    NATTEN's rules: kernel sizes >= 2, kernel size x dilation <= size, stride <= kernel size."""
    spatial = tuple(int(s) for s in spatial)
    n = len(spatial)
    if n not in NA_DIMS or any(s < 1 for s in spatial):
        raise ValueError(f"neighborhood attention runs over 1, 2 or 3 spatial dimensions of positive size; got the "
                         f"token layout {spatial}")
    kernel = _per_dim("kernel_size", kernel_size, n, minimum=2)
    stride = _per_dim("stride", stride, n, minimum=1)
    dilation = _per_dim("dilation", dilation, n, minimum=1)
    causal = (is_causal,) * n if isinstance(is_causal, bool) else is_causal
    if not isinstance(causal, (tuple, list)) or len(causal) != n or not all(isinstance(c, bool) for c in causal):
        raise ValueError(f"`is_causal` must be a bool or a tuple of {n} bools; got {is_causal!r}")
    if any(k * d > s for k, d, s in zip(kernel, dilation, spatial)):
        raise ValueError(f"`kernel_size` x `dilation` cannot be larger than the token layout in any dimension; got "
                         f"kernel_size={kernel}, dilation={dilation}, token layout {spatial}")
    if any(s > k for s, k in zip(stride, kernel)):
        raise ValueError(f"`stride` cannot be larger than `kernel_size` in any dimension; got stride={stride}, "
                         f"kernel_size={kernel}")
    return Neighborhood(spatial, kernel, stride, dilation, tuple(causal))


def _pattern(spatial, kernel_size, stride, dilation, is_causal) -> Neighborhood:
    """``neighborhood``, remembered per arguments (the operations validate the same pattern on every call; ints,
    tuples and lists of ints and bools are taken as NATTEN takes them). Refusals are not remembered."""
    key = tuple(tuple(a) if isinstance(a, list) else a for a in (tuple(spatial), kernel_size, stride, dilation,
                                                                  is_causal))
    try:
        return _pattern_of(*key)
    except TypeError:  # (something unhashable: validate without the memo, which names what is wrong)
        return neighborhood(spatial, kernel_size, stride, dilation, is_causal)


@functools.lru_cache(maxsize=512)
def _pattern_of(spatial, kernel_size, stride, dilation, is_causal) -> Neighborhood:
    return neighborhood(spatial, kernel_size, stride, dilation, is_causal)


# ---------------------------------------------------------------------------------------------
# One dimension, on positions within a dilation group of length L (ints or integer tensors)
# ---------------------------------------------------------------------------------------------

def window_start(i, L: int, K: int, S: int, causal: bool):
    """First key position of query position ``i``'s window (NATTEN's get_win_start)."""
    if causal:
        leader = _minimum((i // S) * S + S - 1, L - 1)
        return _maximum(leader - K + 1, 0)
    leader = _minimum((i // S) * S + S // 2, L - 1)
    return _minimum(_maximum(leader - K // 2, 0), L - K)


def window_end(i, L: int, K: int, S: int, causal: bool):
    """One past the last key position of query position ``i``'s window (NATTEN's get_win_end)."""
    if causal:
        return _minimum(i + 1, L)
    return window_start(i, L, K, S, causal) + K


def _minimum(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return min(a, b)


def _maximum(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)


def dim_windows(L: int, K: int, S: int, dilation: int, causal: bool, device=None):
    """Along one dimension of size L: each token's dilation group, position in it, and window [start, end) in
    positions of its group (tensors of L)."""
    x = torch.arange(L, device=device)
    g, p = x % dilation, x // dilation
    lengths = L // dilation + (g < L % dilation).long()  # each token's group length
    return g, p, window_start(p, lengths, K, S, causal), window_end(p, lengths, K, S, causal)


def dim_mask(L: int, K: int, S: int, dilation: int, causal: bool, device=None) -> torch.Tensor:
    """[L, L] bool: query token x attends key token y along one dimension of size L (dilation groups included)."""
    g, p, start, end = dim_windows(L, K, S, dilation, causal, device)
    return (g[:, None] == g[None, :]) & (p[None, :] >= start[:, None]) & (p[None, :] < end[:, None])


def neighborhood_mask(nb: Neighborhood, device=None, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N, N] bool over the tokens in row-major order of the layout (N = prod(spatial)): query attends key (``rows``:
    only those queries' rows, [len(rows), N]). A query attends a key when every dimension's mask says so."""
    rows = torch.arange(nb.tokens) if rows is None else rows.cpu()
    q_coords = torch.unravel_index(rows, nb.spatial)
    k_coords = torch.unravel_index(torch.arange(nb.tokens), nb.spatial)
    mask = torch.ones(len(rows), nb.tokens, dtype=torch.bool)
    for d in range(nb.dims):
        m = dim_mask(nb.spatial[d], nb.kernel_size[d], nb.stride[d], nb.dilation[d], nb.is_causal[d])
        mask &= m[q_coords[d]][:, k_coords[d]]
    return mask.to(device)


def attended_pairs(nb: Neighborhood) -> int:
    """How many (query, key) pairs the pattern attends (the work a neighborhood kernel cannot skip): per
    dimension the sum of the window sizes, multiplied over the dimensions (the pattern is separable)."""
    total = 1
    for d in range(nb.dims):
        _, _, start, end = dim_windows(nb.spatial[d], nb.kernel_size[d], nb.stride[d], nb.dilation[d],
                                       nb.is_causal[d])
        total *= int((end - start).sum())
    return total


# ---------------------------------------------------------------------------------------------
# Reference: fp32 attention with the explicit mask
# ---------------------------------------------------------------------------------------------

def na_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size, stride=1, dilation=1,
                 is_causal=False, scale: Optional[float] = None, additional_keys: Optional[torch.Tensor] = None,
                 additional_values: Optional[torch.Tensor] = None, return_lse: bool = False):
    """Neighborhood attention in fp32 on the inputs' device: q [B, *spatial, H, D], k and v [B, *spatial, H_KV, D]
    (H_KV dividing H: query head h reads K/V head h // (H / H_KV)); ``additional_keys``/``additional_values``
    [B, N_extra, H_KV, D], seen by every query. Returns the output [B, *spatial, H, D_v] in fp32 (and the
    natural-log lse [B, *spatial, H]). The oracle of the neighborhood kernels' tests: a dense [N, N] mask."""
    from .reference import attention_reference

    if q.dim() not in (4, 5, 6) or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k and v are [B, *spatial, H, D] with 1-3 spatial dims; got ranks {q.dim()}, {k.dim()}, "
                         f"{v.dim()}")
    spatial = tuple(q.shape[1:-2])
    if tuple(k.shape[1:-2]) != spatial or tuple(v.shape[1:-2]) != spatial:
        raise ValueError(f"q, k and v must share one token layout; got {spatial}, {tuple(k.shape[1:-2])}, "
                         f"{tuple(v.shape[1:-2])}")
    nb = neighborhood(spatial, kernel_size, stride, dilation, is_causal)
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    flat = lambda t: t.reshape(B, nb.tokens, t.shape[-2], t.shape[-1]).transpose(1, 2)  # noqa: E731  [B, H, N, D]
    qf, kf, vf = flat(q), flat(k), flat(v)
    scale = scale if scale else D ** -0.5
    mask = neighborhood_mask(nb, q.device)
    h_kv = k.shape[-2]
    s = torch.matmul(qf.float(), kf.float().repeat_interleave(H // h_kv, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.matmul(torch.softmax(s, -1), vf.float().repeat_interleave(H // h_kv, 1))
    if (additional_keys is None) != (additional_values is None):
        raise ValueError("`additional_keys` and `additional_values` go together: give both or neither")
    if additional_keys is not None:
        from .merge import merge_attentions
        add, add_lse = attention_reference(qf, additional_keys.transpose(1, 2), additional_values.transpose(1, 2),
                                           causal=False, sm_scale=scale, return_lse=True)
        out, lse = merge_attentions([out, add], [lse, add_lse])
    out = out.transpose(1, 2).reshape(B, *spatial, H, out.shape[-1])
    lse = lse.transpose(1, 2).reshape(B, *spatial, H)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Tile math: which K/V tiles a query tile visits, and which of them need a mask
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVVisit:
    """A K/V tile a query tile visits: its tile coordinates in the dilation group's tile grid (halo boxes: its number
    from the first), its first key position per dimension, and whether some (query, key) pair of the two tiles is not
    attended (or lies outside the layout), so that it needs a mask."""
    tile: tuple[int, ...]
    masked: bool
    start: tuple[int, ...] = ()


def kv_tile_range(q_first: int, q_last: int, L: int, K: int, S: int, causal: bool, tile: int) -> range:
    """Along one dimension (positions in a dilation group of length L): the K/V tiles (of ``tile`` positions)
    holding some key of the queries [q_first, q_last]."""
    lo = window_start(q_first, L, K, S, causal)
    hi = window_end(q_last, L, K, S, causal)
    return range(lo // tile, -(-hi // tile))


def kv_keys_unmasked(q_first: int, q_last: int, k0: int, L: int, K: int, S: int, causal: bool, tile: int) -> bool:
    """Along one dimension: every query of [q_first, q_last] attends every key of [k0, k0 + tile) (a lattice's tile or
    a halo box), which lie wholly inside the layout (window starts and ends never decrease, so the extreme queries
    decide)."""
    k1 = k0 + tile
    return k1 <= L and window_start(q_last, L, K, S, causal) <= k0 and k1 <= window_end(q_first, L, K, S, causal)


def kv_halo(q_first: int, q_last: int, L: int, K: int, S: int, causal: bool, tile: int) -> tuple[int, int]:
    """Along one dimension: the boxes of ``tile`` keys from the first query's window start that hold every key of the
    queries [q_first, q_last] (their halo): (the first key, the number of boxes). The 2-D/3-D forward's walk
    (``masks.window_keys``): at small windows the lattice's tiles hold keys of no query in part, so a query tile
    visits more of them (64 x 64, 7 x 7: 196 against 169 with these boxes)."""
    lo = window_start(q_first, L, K, S, causal)
    return lo, -(-(window_end(q_last, L, K, S, causal) - lo) // tile)


def kv_starts(q_first: int, q_last: int, L: int, K: int, S: int, causal: bool, tile: int,
              halo: bool) -> list[tuple[int, int]]:
    """Along one dimension: the K/V tiles the queries [q_first, q_last] visit, as (number, first key): the lattice's
    tiles of ``kv_tile_range`` (numbered in the grid), or with ``halo`` the boxes of ``kv_halo`` (numbered from 0)."""
    if halo:
        lo, n = kv_halo(q_first, q_last, L, K, S, causal, tile)
        return [(i, lo + i * tile) for i in range(n)]
    return [(t, t * tile) for t in kv_tile_range(q_first, q_last, L, K, S, causal, tile)]


def _first_past(x: int, L: int, K: int, S: int, causal: bool, ends: bool) -> int:
    """The first query position whose window ends (``ends``) or starts past key x, L if none (``masks._first_past``)."""
    bound = window_end if ends else window_start
    return next((i for i in range(L) if bound(i, L, K, S, causal) > x), L)


def key_queries(j: int, L: int, K: int, S: int, causal: bool) -> range:
    """Along one dimension: the queries that attend key position ``j``, a contiguous range since window starts and
    ends never decrease: from the first query whose window ends past j to before the first whose window starts past
    it (the backward's inverse; ``masks.window_query_bounds`` finds both ends by binary search on the GPU)."""
    first = _first_past(j, L, K, S, causal, True)
    return range(first, max(_first_past(j, L, K, S, causal, False), first))


def q_tile_ranges(k0: int, k_tile: int, L: int, K: int, S: int, causal: bool, q_tile: int) -> tuple[range, range]:
    """Along one dimension, for the keys [k0, k0 + k_tile): the query tiles holding some query that attends one of
    them, and those whose every query attends every one of them (empty where the key tile runs past L): the
    backward's visits and its unmasked ones. ``masks.window_query_blocks`` is this, step for step, in Gluon."""
    last = min(k0 + k_tile, L) - 1
    lo = _first_past(k0, L, K, S, causal, True) // q_tile
    end = max(-(-_first_past(last, L, K, S, causal, False) // q_tile), lo)
    a = min(max(-(-_first_past(k0 + k_tile - 1, L, K, S, causal, True) // q_tile), lo), end)
    b = max(min(_first_past(k0, L, K, S, causal, False) // q_tile, end), a)
    if k0 + k_tile > L:
        b = a
    return range(lo, end), range(a, b)


def tile_grid(nb: Neighborhood, group: tuple[int, ...], tile_shape: Sequence[int]) -> tuple[int, ...]:
    """Tiles per dimension covering dilation group ``group``'s positions."""
    return tuple(-(-nb.group_sizes(d)[group[d]] // tile_shape[d]) for d in range(nb.dims))


def kv_visits(nb: Neighborhood, group: tuple[int, ...], q_tile: tuple[int, ...], q_tile_shape: Sequence[int],
              kv_tile_shape: Sequence[int], halo: bool = False) -> list[KVVisit]:
    """The K/V tiles query tile ``q_tile`` of dilation group ``group`` visits, in row-major order, each with
    whether it needs a mask: per dimension the range of ``kv_tile_range`` (``halo``: the boxes of ``kv_halo``),
    unmasked where every dimension is."""
    per_dim = []
    for d in range(nb.dims):
        L = nb.group_sizes(d)[group[d]]
        K, S, c, tq, tk = nb.kernel_size[d], nb.stride[d], nb.is_causal[d], q_tile_shape[d], kv_tile_shape[d]
        q_first = q_tile[d] * tq
        q_last = min(q_first + tq, L) - 1
        starts = kv_starts(q_first, q_last, L, K, S, c, tk, halo)
        per_dim.append([(t, k0, kv_keys_unmasked(q_first, q_last, k0, L, K, S, c, tk)) for t, k0 in starts])
    return [KVVisit(tuple(t for t, _, _ in combo), not all(full for _, _, full in combo),
                    tuple(k0 for _, k0, _ in combo)) for combo in itertools.product(*per_dim)]


def groups(nb: Neighborhood):
    """Every dilation group, row-major over the dimensions' groups."""
    return itertools.product(*(range(d) for d in nb.dilation))


def group_tokens(nb: Neighborhood, group: tuple[int, ...], tile_shape: Sequence[int], tile: tuple[int, ...]):
    """Row-major token indices (of the whole layout) of ``tile`` of dilation group ``group``, clipped to the
    layout: the tokens a kernel loads as one TMA box over the group's strided view."""
    axes = []
    for d in range(nb.dims):
        L = nb.group_sizes(d)[group[d]]
        pos = range(tile[d] * tile_shape[d], min((tile[d] + 1) * tile_shape[d], L))
        axes.append([group[d] + nb.dilation[d] * p for p in pos])
    strides = [math.prod(nb.spatial[d + 1:]) for d in range(nb.dims)]
    return [sum(c * s for c, s in zip(coords, strides)) for coords in itertools.product(*axes)]


@dataclass(frozen=True)
class TilePlanStats:
    """What a plan visits: query tiles, K/V tile visits, how many of those need a mask, the (query, key) pairs the
    visits cover (the padding of partial tiles is not counted) and the pairs the kernel computes (``computed_pairs``:
    every visit a whole query tile by a whole key tile, padding included: its cost). With ``halo`` the K/V tiles are
    the boxes from each query tile's halo (``kv_halo``: the 2-D/3-D forward's in 16 bits), else the lattice's."""
    q_tiles: int
    kv_visits: int
    masked_visits: int
    visited_pairs: int
    computed_pairs: int


@functools.lru_cache(maxsize=4096)
def _dim_tile_visits(L: int, K: int, S: int, causal: bool, tq: int, tk: int, halo: bool = False) -> tuple:
    """Along one dimension of a dilation group of length L: per query tile of ``tq`` positions, (the K/V tiles of
    ``tk`` it visits, those unmasked, query positions x key positions visited) (``plan_stats``'s terms; ``halo``:
    the boxes of ``kv_halo``)."""
    tiles = []
    for t in range(-(-L // tq)):
        q_first, q_last = t * tq, min((t + 1) * tq, L) - 1
        starts = [k0 for _, k0 in kv_starts(q_first, q_last, L, K, S, causal, tk, halo)]
        full = sum(kv_keys_unmasked(q_first, q_last, k0, L, K, S, causal, tk) for k0 in starts)
        keys = sum(max(min(k0 + tk, L) - k0, 0) for k0 in starts)
        tiles.append((len(starts), full, (q_last - q_first + 1) * keys))
    return tuple(tiles)


def forward_halo(nb: Neighborhood, dtype: Optional[torch.dtype] = None) -> bool:
    """Whether the sm_90a forward walks each query tile's halo boxes (2-D/3-D windows in 16 bits) rather than the
    lattice's key tiles (1-D windows; fp8, whose V^T holds the lattice's boxes): ``plan_stats``' ``halo``."""
    return nb.dims >= 2 and dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)


def plan_stats(nb: Neighborhood, q_tile_shape: Sequence[int], kv_tile_shape: Sequence[int],
               halo: bool = False) -> TilePlanStats:
    """Sum ``kv_visits`` over every dilation group and query tile (the dry run's numbers: work against the
    attended pairs, the share of masked tiles). Separable, so summed per dimension and multiplied: per dimension
    and group, each query tile's (visits, unmasked visits, query positions x key positions visited), and a sum
    over the tiles' combinations of their products is the product of the dimensions' sums."""
    q_tiles = visits = unmasked = pairs = 0
    per_dim = []  # per dimension: per group, per query tile: (n_visits, n_unmasked, visited position pairs)
    for d in range(nb.dims):
        K, S, c, tq, tk = nb.kernel_size[d], nb.stride[d], nb.is_causal[d], q_tile_shape[d], kv_tile_shape[d]
        per_dim.append([_dim_tile_visits(L, K, S, c, tq, tk, halo) for L in nb.group_sizes(d)])
    for g in groups(nb):
        # (a sum over every combination of the dimensions' tiles of a product is the product of the sums)
        tiles = [per_dim[d][g[d]] for d in range(nb.dims)]
        q_tiles += math.prod(len(t) for t in tiles)
        visits += math.prod(sum(v for v, _, _ in t) for t in tiles)
        unmasked += math.prod(sum(f for _, f, _ in t) for t in tiles)
        pairs += math.prod(sum(p for _, _, p in t) for t in tiles)
    return TilePlanStats(q_tiles, visits, visits - unmasked, pairs,
                         visits * math.prod(q_tile_shape) * math.prod(kv_tile_shape))


def tile_shapes(nb: Neighborhood, rows: int) -> list[tuple[int, ...]]:
    """Tile shapes of ``rows`` tokens (a power of two) as powers of two per dimension, none longer than its
    dimension's largest dilation group rounded up to a power of two."""
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"a tile's rows are a power of two; got {rows}")
    caps = [1 << (max(nb.group_sizes(d)) - 1).bit_length() for d in range(nb.dims)]
    shapes = []
    for exps in itertools.product(*(range(c.bit_length()) for c in caps)):
        shape = tuple(1 << e for e in exps)
        if math.prod(shape) == rows:
            shapes.append(shape)
    return shapes


def plan_table(nb: Neighborhood, q_rows: int = 128, kv_rows: Sequence[int] = (128,),
               halo: bool = False) -> list[dict]:
    """Every (query tile, K/V tile) shape pair of those sizes with its plan's numbers (``halo``: K/V tiles from each
    query tile's halo, as the 2-D/3-D forward walks them), the fewest computed pairs first (``plan_rank``; with
    ``halo`` a masked visit's pairs weigh more): the dry run of the neighborhood kernel's tile choice. ``bound``: the
    speedup over dense attention if visited tiles ran as fast as dense ones (dense pairs / computed pairs: a tile past
    the layout's edge costs its padding too)."""
    dense = nb.tokens ** 2
    attended = attended_pairs(nb)
    rows = []
    for kv in kv_rows:
        for q_shape in tile_shapes(nb, q_rows):
            for kv_shape in tile_shapes(nb, kv):
                st = plan_stats(nb, q_shape, kv_shape, halo)
                rows.append({"q_tile_shape": q_shape, "kv_tile_shape": kv_shape, "q_tiles": st.q_tiles,
                             "kv_visits": st.kv_visits, "masked": f"{st.masked_visits / max(st.kv_visits, 1):.0%}",
                             "visited / attended": round(st.visited_pairs / attended, 3),
                             "computed / attended": round(st.computed_pairs / attended, 3),
                             "bound": f"{dense / st.computed_pairs:.1f}x",
                             "_rank": plan_rank(nb, (q_shape, kv_shape), halo)})
    rows.sort(key=lambda r: r["_rank"])
    return rows


# ---------------------------------------------------------------------------------------------
# The operation: na1d on the Hopper forward's WINDOW mode
# ---------------------------------------------------------------------------------------------

def na1d(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel_size, stride=1, dilation=1,
         is_causal=False, scale: Optional[float] = None, additional_keys: Optional[torch.Tensor] = None,
         additional_values: Optional[torch.Tensor] = None, return_lse: bool = False, q_tile_shape=None,
         kv_tile_shape=None, descale_q: Optional[float] = None, descale_k: Optional[float] = None,
         descale_v: Optional[float] = None, backward_q_tile_shape=None, backward_kv_tile_shape=None):
    """1-D neighborhood attention, NATTEN's ``na1d``: query [B, L, H, D], key [B, L, H_KV, D] and value
    [B, L, H_KV, Dv] CUDA tensors (heads last, NATTEN's layout; H_KV divides H: GQA without repeating K/V), each
    query attending the ``kernel_size`` keys of its window (module docstring: ``stride``, ``dilation``,
    ``is_causal``); ``additional_keys``/``additional_values`` [B, N_extra, H_KV, D(v)] are seen by every query
    (through ``merge_attentions``). Returns the output [B, L, H, Dv] (and with ``return_lse`` the natural-log
    logsumexp [B, L, H], fp32).

    Runs the sm_90a forward with its WINDOW mode (fp16, bf16; fp8 e4m3/e5m2 at head dims 64, 128, 256, with
    per-tensor ``descale_q/k/v`` as ``attention`` takes them, the output fp16): a query tile visits only the key
    blocks of its rows' windows, masking the blocks at their edges; each dilation group is a strided view, so no
    token moves, and one launch takes them all as heads where they are as long (``_na1d_groups``). Differentiable in
    16 bits (autograd): the backward's WINDOW mode, a unit of keys visiting the query blocks that attend them (dQ's
    adds in a fixed order under ``torch.use_deterministic_algorithms``).

    NATTEN's performance knobs, optional: ``q_tile_shape`` (queries per tile: (128,) or (192,), as the kernel's
    tiles for the head dim and dtype allow) and ``kv_tile_shape`` (keys per block: (128,), (64,) at D=256: the
    kernel's one block); by default the tuned dense config's. ``backward_q_tile_shape`` and
    ``backward_kv_tile_shape``: the backward's query block and key block, validated against the one pair its
    kernel takes at the head dim ((128,) and (128,) at D=64; (64,) and (128,) at 128; (64,) and (64,) at 256:
    ``backward_tiles``)."""
    if torch.compiler.is_compiling():  # (one opaque op: its implementation validates when it runs)
        return _traced(1, query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys,
                       additional_values, return_lse, (q_tile_shape, kv_tile_shape),
                       (backward_q_tile_shape, backward_kv_tile_shape), (descale_q, descale_k, descale_v))
    return _na1d(query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys, additional_values,
                 return_lse, q_tile_shape, kv_tile_shape, descale_q, descale_k, descale_v, backward_q_tile_shape,
                 backward_kv_tile_shape)


def _na1d(query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys, additional_values,
          return_lse, q_tile_shape, kv_tile_shape, descale_q, descale_k, descale_v, backward_q_tile_shape,
          backward_kv_tile_shape, via_op: bool = True):
    """na1d's checks and call: through the custom op where autograd or a mode needs it (``via_op``; the op's own
    implementation calls this without), else the kernels directly (a call signature seen before: its route)."""
    rkey = _route_key(query, key, value, additional_keys, additional_values, 1, kernel_size, stride, dilation,
                      is_causal, scale, return_lse, q_tile_shape, kv_tile_shape, descale_q, descale_k, descale_v,
                      backward_q_tile_shape, backward_kv_tile_shape) if via_op else None
    if rkey is not None:
        route = _NA_ROUTES.get(rkey)
        res = None if route is None else route(query, key, value, additional_keys, additional_values)
        if res is not None:
            return res
    from .kernels.backend import all_head_dim_pairs, all_head_dims
    from .problem import DTYPE_NAMES, FP8_DTYPES
    from .validation import UnsupportedError, check_qkv

    what = "na1d"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{what}: {name} must be a 4-D tensor [B, L, heads, head_dim] (NATTEN's layout), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if tuple(key.shape[:2]) != tuple(query.shape[:2]) or tuple(value.shape[:3]) != tuple(key.shape[:3]):
        raise ValueError(f"{what}: query, key and value must share [B, L] (and key and value their heads); got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    B, L, H, D = query.shape
    nb = _pattern((L,), kernel_size, stride, dilation, is_causal)
    _check_backward_tiles(what, nb, D, backward_q_tile_shape, backward_kv_tile_shape, value.shape[3])
    K, S, dil, causal = nb.kernel_size[0], nb.stride[0], nb.dilation[0], nb.is_causal[0]
    views = [t.transpose(1, 2) for t in (query, key, value)]  # [B, heads, L, D] views
    fp8 = DTYPE_NAMES.get(query.dtype) in FP8_DTYPES
    descales = _descales(what, query, descale_q, descale_k, descale_v)
    check_qkv(*views, head_dims=all_head_dims(), dtypes=("fp16", "bf16", *FP8_DTYPES),
              require_cuda=query.device.type != "meta", what=what, head_dim_pairs=all_head_dim_pairs())
    if (additional_keys is None) != (additional_values is None):
        raise ValueError(f"{what}: `additional_keys` and `additional_values` go together: give both or neither")
    if fp8 and (D not in FP8_HEAD_DIMS or value.shape[3] != D):
        raise UnsupportedError(f"{what}: fp8 takes head dims {', '.join(map(str, FP8_HEAD_DIMS))} (v's as q's); got "
                               f"{D} and {value.shape[3]}")
    backend = _sm90_backend(what, query)
    why = backend.head_dim_problem(D, value.shape[3])
    if why:
        raise UnsupportedError(f"{what}: {why}")
    config = _na_config(backend.module, D, query.dtype, L, q_tile_shape, kv_tile_shape)
    scale = scale if scale else D ** -0.5
    window = (K, S, causal, dil)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if grad and fp8:
        raise UnsupportedError(f"{what}: the backward takes fp16 and bf16; fp8 runs the forward only")
    need_lse = return_lse or additional_keys is not None
    out, lse = _dispatch(query, key, value, nb, scale, (q_tile_shape, kv_tile_shape),
                         (backward_q_tile_shape, backward_kv_tile_shape), descales, need_lse, grad,
                         lambda: _na1d_forward(query, key, value, window, scale, config, backend, need_lse, descales),
                         via_op)
    if rkey is not None:
        fast = None
        if not need_lse and not fp8:
            fast = _GroupsRoute.make((query, key, value, out), [
                (lambda views: backend.module.prepare(*views[:3], causal=False, sm_scale=scale, return_lse=False,
                                                      out=views[3], window=(K, S, causal), config=config),
                 [group(t) for t in (query, key, value, out)])
                for group in _na1d_groups(dil, (query, key, value, out))])
        route = fast or _Route(functools.partial(_na1d_forward, window=window, scale=scale, config=config,
                                                 backend=backend, need_lse=need_lse, descales=descales), return_lse,
                               None if additional_keys is None else (scale, descales))
    if additional_keys is not None:
        out, lse = _with_additional_keys(query, out, lse, additional_keys, additional_values, scale, descales)
    if rkey is not None:
        _NA_ROUTES.put(rkey, route)  # (once the call went through: a call that raised leaves no route)
    return (out, lse) if return_lse else out


_NA_ROUTES = BoundedCache(256)


def _route_key(query, key, value, additional_keys, additional_values, *options) -> Optional[tuple]:
    """What a route of na1d/na2d/na3d is made for (every tensor's shape, strides, dtype, device, the additional keys
    and values included; the pattern and options), or None where none is taken: a gradient to record, anything the
    custom op must see (``api._plain_eager``), or inputs that are not tensors (refused by the checks)."""
    tensors = (query, key, value)
    if additional_keys is not None or additional_values is not None:
        tensors += (additional_keys, additional_values)
    if not _api._plain_eager(*tensors) or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return None
    rkey = (*signature(*tensors), options)
    try:
        hash(rkey)
    except TypeError:  # (lists among the options, as NATTEN's callers may pass them)
        listed = tuple(tuple(o) if isinstance(o, list) else o for o in options)
        rkey = rkey[:-1] + (listed,)
        try:
            hash(rkey)
        except TypeError:
            return None
    return rkey


class _Route:
    """A validated na1d/na2d/na3d call signature: its forward with everything but the tensors bound; ``extra``:
    (scale, descales) of its additional keys' part, merged after it (``_with_additional_keys``)."""

    def __init__(self, forward, return_lse: bool, extra: Optional[tuple] = None):
        self.forward, self.return_lse, self.extra = forward, return_lse, extra

    def __call__(self, query, key, value, additional_keys=None, additional_values=None):
        out, lse = self.forward(query, key, value)
        if self.extra is not None:
            out, lse = _with_additional_keys(query, out, lse, additional_keys, additional_values, *self.extra)
        return (out, lse) if self.return_lse else out


class _GroupsRoute:
    """A na1d/na2d/na3d call signature in 16 bits without an lse: the output made, and each launch (a dilation group;
    in 3-D a batch too) by address, its views being fixed byte offsets into the tensors (``hopper_host.prepare``,
    ``hopper_host.prepare_na_boxes``). A call returns None where it cannot launch (an address TMA cannot take, a
    kernel not yet compiled, a profiler hook): the route's caller then takes the checked path."""

    @staticmethod
    def make(tensors: tuple, parts: list) -> Optional["_GroupsRoute"]:
        """``tensors``: (query, key, value, out) of a call that ran; ``parts``: per launch (prepare, its four views)."""
        from .kernels.launch import device_index

        base = [t.data_ptr() for t in tensors]
        groups = []
        for prepare, views in parts:
            prepared = prepare(views)
            offsets = tuple(v.data_ptr() - b for v, b in zip(views, base))
            if prepared is None or any(o % 16 for o in offsets):
                return None
            groups.append((prepared.run, offsets))
        self = _GroupsRoute()
        self.groups, self.out_layout = groups, layout(tensors[3])
        self.index = device_index(tensors[3].device)
        return self

    def __call__(self, query, key, value, *_):  # (made only for calls without additional keys)
        qp, kp, vp = query.data_ptr(), key.data_ptr(), value.data_ptr()
        if (qp | kp | vp) & 15:
            return None
        shape, strides, dtype = self.out_layout
        out = torch.empty_strided(shape, strides, dtype=dtype, device=query.device)
        op = out.data_ptr()
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        for run, (a, b, c, d) in self.groups:
            if not run(stream, (qp + a, kp + b, vp + c, op + d)):
                return None
        return out


def _with_additional_keys(query, out, lse, additional_keys, additional_values, scale, descales=(1.0, 1.0, 1.0)):
    """The neighborhood's output and lse ([B, *spatial, H, Dv], [B, *spatial, H]) merged with attention over the
    additional keys [B, N_extra, H_KV, D] (every query sees them): ``attention`` over the flattened tokens, then
    ``merge_attentions`` by the two lse's, NATTEN's way. A plain eager call that records no gradient merges in one
    launch into the neighborhood's output and lse, which it made (``merge_pair_``)."""
    B, H = query.shape[0], query.shape[-2]
    tokens = lambda t: t.reshape(B, -1, H, t.shape[-1])  # noqa: E731  [B, N, H, D]
    fp8 = dict(zip(("descale_q", "descale_k", "descale_v"), descales)) if query.element_size() == 1 else {}
    extra, extra_lse = _api.attention(tokens(query).transpose(1, 2), additional_keys.transpose(1, 2),
                                      additional_values.transpose(1, 2), sm_scale=scale, return_lse=True, **fp8)
    extra, extra_lse = extra.transpose(1, 2), extra_lse.transpose(1, 2)  # [B, N, H, Dv], [B, N, H]
    if out.is_contiguous() and lse.is_contiguous() and extra.stride(-1) == 1 and \
            _api._plain_eager(out, lse, extra, extra_lse) and \
            not (torch.is_grad_enabled() and (out.requires_grad or lse.requires_grad or extra.requires_grad)):
        _merge.merge_pair_(tokens(out), lse.view(B, -1, H), extra, extra_lse, lse.view(B, -1, H))
        return out, lse
    merged, merged_lse = _merge.merge_attentions([tokens(out), extra], [lse.reshape(B, -1, H), extra_lse])
    return merged.reshape(out.shape), merged_lse.reshape(lse.shape)


def _sm90_backend(what: str, query: torch.Tensor):
    """The backend of ``query``'s GPU, refused naming it unless sm_90a (the neighborhood modes' kernels)."""
    from .api import _capability
    from .kernels.backend import backend_for_arch, backend_for_capability
    from .validation import UnsupportedError

    if query.device.type == "meta":  # (meta tensors take the custom op's fake: judged by the sm_90a kernels' rules)
        return backend_for_arch("sm_90a")
    device = query.device.index if query.device.index is not None else torch.cuda.current_device()
    backend = backend_for_capability(*_capability(device))
    if backend is None or backend.arch != "sm_90a":
        raise UnsupportedError(f"{what}: runs on sm_90a (H100/H200) only; this GPU is "
                               f"{backend.arch if backend else 'another architecture'}")
    return backend


FP8_HEAD_DIMS = (64, 128, 256)  # na1d's fp8 forward: the kernels' own head dims (no padded ones)


def _descales(what: str, query: torch.Tensor, descale_q, descale_k, descale_v) -> tuple:
    """(descale_q, descale_k, descale_v) as floats (1.0 where not given); refused for inputs that are not fp8."""
    from .problem import DTYPE_NAMES, FP8_DTYPES

    descales = tuple(1.0 if d is None else float(d) for d in (descale_q, descale_k, descale_v))
    dtype = getattr(query, "dtype", None)
    if descales != (1.0, 1.0, 1.0) and DTYPE_NAMES.get(dtype) not in FP8_DTYPES:
        raise ValueError(f"{what}: descale_q/k/v are for fp8 inputs; these are {DTYPE_NAMES.get(dtype, dtype)}")
    return descales


def _fp8_launch(query: torch.Tensor, descales: tuple) -> dict:
    """The launch's fp8 arguments: the descales and the kernel name ``attention`` gives fp8 (ptxas schedules it
    better); none for 16-bit inputs."""
    if query.element_size() != 1:
        return {}
    from .api import KERNEL_BASE_NAME
    from .kernels.naming import DEFAULT_NAME_CHOICE, resolve_name
    return dict(zip(("descale_q", "descale_k", "descale_v"), descales),
                kernel_name=resolve_name(KERNEL_BASE_NAME, DEFAULT_NAME_CHOICE, is_fp8=True))


def backward_tiles(nb: Neighborhood, head_dim: int, head_dim_v: int = 0) -> Optional[tuple]:
    """The sm_90a backward's default (query tile, key tile) for this pattern at this head dim (``head_dim_v``: v's,
    where it differs: the 192/128 pair's own units). 1-D: its kernel takes one pair per head dims (the dQ split fixes
    the query block). 2-D/3-D: boxes of those blocks' positions, the pair computing the fewest pairs (``plan_rank``)
    of ``hopper_bwd_host.window_boxes``. None where the head dim is not taken."""
    from .kernels import hopper_bwd_host

    if nb.dims == 1:
        if head_dim not in hopper_bwd_host.HEAD_DIMS:
            return None
        d = hopper_bwd_host.kernel_head_dim(head_dim)
        v_dim = head_dim_v if head_dim_v != head_dim else 0
        block_m = hopper_bwd_host.default_config(head_dim, "fp16", None, 8192, v_dim).BLOCK_M
        return (block_m,), (hopper_bwd_host.block_n(d, block_m),)
    taken = hopper_bwd_host.window_boxes(head_dim, nb.dims)
    return _best_boxes(nb, None, None, taken) if taken else None


def _check_backward_tiles(what: str, nb: Neighborhood, head_dim: int, q_shape, kv_shape,
                          head_dim_v: int = 0) -> Optional[tuple]:
    """NATTEN's ``backward_q_tile_shape`` / ``backward_kv_tile_shape``: None (the default, ``backward_tiles``) or a
    shape the backward takes, anything else refused naming what it takes. Returns the backward's pair (None where the
    head dim is not taken: the forward refuses it)."""
    from .kernels import hopper_bwd_host

    if nb.dims == 1:
        taken = tuple(t for t in (backward_tiles(nb, head_dim, head_dim_v),) if t is not None)
    else:
        taken = hopper_bwd_host.window_boxes(head_dim, nb.dims)
    if not taken:
        return None
    for name, given, shapes in (("backward_q_tile_shape", q_shape, sorted({q for q, _ in taken})),
                                ("backward_kv_tile_shape", kv_shape, sorted({kv for _, kv in taken}))):
        if given is not None and (not isinstance(given, (tuple, list)) or tuple(given) not in shapes):
            raise ValueError(f"{what}: `{name}` {given!r} is not taken: at head dim {head_dim} the backward's are "
                             f"{', '.join(str(x) for x in shapes)}")
    return _best_boxes(nb, tuple(q_shape) if q_shape else None, tuple(kv_shape) if kv_shape else None, tuple(taken))


def _na_config(kernels, head_dim: int, dtype: torch.dtype, L: int, q_tile_shape, kv_tile_shape):
    """The sm_90a forward's config for na1d's tile shapes (None: the tuned dense config's), refused naming what the
    kernel takes."""
    import dataclasses

    from .problem import dtype_name

    name = dtype_name(dtype)
    base = kernels.default_config(head_dim, name, False, L)
    bn = kernels.block_n(kernels.kernel_head_dim(head_dim))
    if kv_tile_shape is not None and tuple(kv_tile_shape) != (bn,):
        raise ValueError(f"na1d: `kv_tile_shape` {tuple(kv_tile_shape)} is not taken: the kernel's key blocks are "
                         f"({bn},) at head dim {head_dim}")
    if q_tile_shape is None:
        return base
    taken = [m for m in (128, 192) if not dataclasses.replace(base, BLOCK_M=m).invalid_reasons(head_dim, name)]
    if not isinstance(q_tile_shape, (tuple, list)) or len(q_tile_shape) != 1 or q_tile_shape[0] not in taken:
        raise ValueError(f"na1d: `q_tile_shape` {q_tile_shape!r} is not taken: at head dim {head_dim} {name} the "
                         f"kernel's query tiles are {', '.join(f'({m},)' for m in taken)}")
    return dataclasses.replace(base, BLOCK_M=int(q_tile_shape[0]))


def _na1d_forward(query, key, value, window, scale, config, backend, need_lse: bool = True,
                  descales=(1.0, 1.0, 1.0)):
    """na1d's neighborhood part: (out [B, L, H, Dv] (fp16 for fp8 inputs), lse [B, L, H] fp32, None without
    ``need_lse``), a launch per dilation group or one of them all as heads (``_na1d_groups``)."""
    K, S, causal, dil = window
    B, L, H, _ = query.shape
    fp8 = _fp8_launch(query, descales)
    out = torch.empty((B, L, H, value.shape[3]), dtype=torch.float16 if fp8 else query.dtype, device=query.device)
    lse = torch.empty((B, L, H), dtype=torch.float32, device=query.device) if need_lse else None
    for group in _na1d_groups(dil, (query, key, value, out), heads=not fp8):
        q, k, v = (group(t) for t in (query, key, value))
        res = backend.module.launch(q, k, v, causal=False, sm_scale=scale, return_lse=need_lse, out=group(out),
                                    window=(K, S, causal), config=config, **fp8)
        if need_lse:
            _lse_view(group, lse).copy_(res[1])
    return out, lse


def _lse_view(view, lse: torch.Tensor) -> torch.Tensor:
    """A launch's ``view`` (made for [B, *grid, H, ..] tensors) of an lse [B, *grid, H]: a unit last dimension added
    for it, then taken off (the launch's [B, heads, *grid_g] or the like, a view)."""
    return view(lse.unsqueeze(-1))[..., 0]


def _fold_dilation(t: torch.Tensor, dim: int, d: int) -> torch.Tensor:
    """[B, ..., L, H(, D)], ``dim`` the index of the last spatial dimension (heads right after it), as [B, ..., L / d,
    d H(, D)]: that dimension's ``d`` dilation groups as heads (group g's head h is head g H + h; K/V heads alike, so
    GQA's head h // (H / H_KV) stays in its group), a view (``_folds_heads`` checks that it is one)."""
    shape = list(t.shape)
    return t.view(*shape[:dim], shape[dim] // d, d * shape[dim + 1], *shape[dim + 2:])


def _folds_heads(L: int, d: int, dim: int, tensors) -> bool:
    """Whether the last spatial dimension's dilation groups (``d`` of them over its ``L`` positions, index ``dim``) can
    launch as heads of one launch (``_fold_dilation``): each group as long (d divides L) and, in every tensor, that
    dimension's stride the heads' (H of them) times theirs, so that a group's positions and the heads merge in a
    view. Else a launch per group."""
    return d > 1 and L % d == 0 and all(t.stride(dim) == t.shape[dim + 1] * t.stride(dim + 1) for t in tensors)


def _na1d_groups(dil: int, tensors, heads: bool = True) -> list:
    """na1d's launches: per launch, the [B, heads, Lg, D] view it makes of a [B, L, heads, D] tensor (of ``tensors``'
    layout): one of every dilation group as heads where they fold (``heads`` and ``_folds_heads``; 16 bits), else one
    per group g (tokens g, g + dil, ...)."""
    if dil == 1:
        return [lambda t: t.transpose(1, 2)]
    if heads and _folds_heads(tensors[0].shape[1], dil, 1, tensors):
        return [lambda t: _fold_dilation(t, 1, dil).transpose(1, 2)]
    return [lambda t, g=g: t[:, g::dil].transpose(1, 2) for g in range(dil)]


def _dispatch(query, key, value, nb: Neighborhood, scale: float, tiles: tuple, backward_tiles_: tuple, descales: tuple,
              need_lse: bool, grad: bool, direct, via_op: bool = True):
    """na1d/na2d/na3d's neighborhood part, (out, lse or None): through the custom op
    ``gluon_attn::neighborhood_attention`` (autograd through it and its backward op, meta tensors, dispatch modes),
    or ``direct``: inside the op's implementation (not ``via_op``), and for a plain eager call that needs no gradient
    (the op's own work without its dispatch: ``api._plain_eager``)."""
    if not via_op or (not grad and _api._plain_eager(query, key, value)):
        return direct()
    out, lse = _neighborhood_op(query, key, value, (nb.kernel_size, nb.stride, nb.dilation, nb.is_causal), scale,
                                tiles, backward_tiles_ or (None, None), descales, need_lse or grad)
    return out, (lse if need_lse else None)


def _neighborhood_op(query, key, value, pattern: tuple, scale: float, tiles: tuple, backward_tiles_: tuple,
                     descales: tuple, need_lse: bool):
    """``gluon_attn::neighborhood_attention`` called with ``pattern`` (kernel sizes, strides, dilations, causal flags,
    a value per dimension), the tile shapes as lists or None, descales as floats (None: 1.0); the backward's
    deterministic mode as ``torch.use_deterministic_algorithms`` says now."""
    listed = lambda t: None if t is None else [int(x) for x in t]  # noqa: E731
    kernel_size, stride, dilation, is_causal = pattern
    return torch.ops.gluon_attn.neighborhood_attention(
        query, key, value, listed(kernel_size), listed(stride), listed(dilation), [bool(c) for c in is_causal],
        float(scale), listed(tiles[0]), listed(tiles[1]), listed(backward_tiles_[0]), listed(backward_tiles_[1]),
        *(1.0 if d is None else float(d) for d in descales), need_lse, torch.are_deterministic_algorithms_enabled())


def na_forward(query, key, value, kernel_size, stride, dilation, is_causal, scale: float, q_tile_shape=None,
               kv_tile_shape=None, descales=(1.0, 1.0, 1.0), need_lse: bool = True, backward_tiles_=(None, None)):
    """The custom op's implementation (``ops.neighborhood_attention_op``): (out, lse or None) of [B, *spatial, heads,
    D] tensors and a pattern given per dimension, checked as na1d/na2d/na3d check them (a traced call reaches the
    checks only here)."""
    dims = query.dim() - 3
    descales = tuple(descales) if query.element_size() == 1 else (None, None, None)  # (16 bits: none given)
    if dims == 1:
        res = _na1d(query, key, value, kernel_size, stride, dilation, is_causal, scale, None, None, need_lse,
                    q_tile_shape, kv_tile_shape, *descales, *backward_tiles_, via_op=False)
    else:
        what = f"na{dims}d"
        res = _na_boxes(what, dims, query, key, value, kernel_size, stride, dilation, is_causal, scale, None, None,
                        need_lse, q_tile_shape, kv_tile_shape, _descales(what, query, *descales), *backward_tiles_,
                        via_op=False)
    return res if need_lse else (res, None)


def _traced(dims: int, query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys,
            additional_values, return_lse, tiles, backward_tiles_, descales):
    """na1d/na2d/na3d under torch.compile: the pattern per dimension and the custom op alone, as ``attention`` is
    traced (the op's implementation checks everything when it runs: ``na_forward``)."""
    per = lambda x: tuple(x) if isinstance(x, (tuple, list)) else (x,) * dims  # noqa: E731
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    need_lse = return_lse or additional_keys is not None
    scale = scale if scale else query.shape[-1] ** -0.5
    out, lse = _neighborhood_op(query, key, value, tuple(map(per, (kernel_size, stride, dilation, is_causal))), scale,
                                tiles, backward_tiles_, descales, need_lse or grad)
    if additional_keys is not None:
        out, lse = _with_additional_keys(query, out, lse, additional_keys, additional_values, scale,
                                         tuple(1.0 if d is None else float(d) for d in descales))
    return (out, lse) if return_lse else out


def na_backward(d_out, query, key, value, out, lse, d_lse, kernel_size, stride, dilation, is_causal, scale: float,
                backward_q_tile_shape=None, backward_kv_tile_shape=None, deterministic: bool = False):
    """The backward op's implementation (``ops.neighborhood_attention_backward_op``): (dq, dk, dv) laid out as query,
    key, value. 1-D: the backward's WINDOW mode per dilation group (dQ, dK, dV of each group's strided views;
    ``deterministic``: dQ's adds in a fixed order). 2-D/3-D: its box modes per batch (3-D) and dilation group,
    writing through the groups' views (``hopper_bwd_host.hopper_na_boxes_bwd``). ``d_lse``: the lse's incoming gradient
    (None: none), folded in as ``attention``'s backward does."""
    dims = query.dim() - 3
    what = f"na{dims}d"
    nb = _pattern(tuple(query.shape[1:dims + 1]), tuple(kernel_size), tuple(stride), tuple(dilation),
                  tuple(is_causal))
    backend = _sm90_backend(what, query)
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    if dims == 1:
        K, S, causal, dil = nb.kernel_size[0], nb.stride[0], nb.is_causal[0], nb.dilation[0]
        lses = [t.unsqueeze(-1) for t in (lse, d_lse) if t is not None]
        for view in _na1d_groups(dil, (d_out, query, key, value, out, dq, dk, dv, *lses)):
            glse = None if d_lse is None else _lse_view(view, d_lse).contiguous()
            gq, gk, gv = backend.bwd.launch(view(d_out), view(query), view(key), view(value), view(out),
                                            _lse_view(view, lse).contiguous(), causal=False,
                                            sm_scale=scale, grad_lse=glse, window=(K, S, causal),
                                            deterministic=deterministic)
            view(dq).copy_(gq)
            view(dk).copy_(gk)
            view(dv).copy_(gv)
        return dq, dk, dv
    boxes = _check_backward_tiles(what, nb, query.shape[-1], backward_q_tile_shape, backward_kv_tile_shape)
    window = tuple(zip(nb.kernel_size, nb.stride, nb.is_causal))
    lses = [t.unsqueeze(-1) for t in (lse, d_lse) if t is not None]
    for view, _ in _launch_views(nb, (d_out, query, key, value, out, dq, dk, dv, *lses)):
        # (the launch's [B, heads, tokens] (2-D) or [heads, tokens] (3-D, a batch))
        lse_of = lambda t, view=view: _lse_view(view, t).flatten(-dims)  # noqa: E731
        backend.bwd.hopper_na_boxes_bwd(
            view(d_out), view(query), view(key), view(value), view(out), lse_of(lse), window=window, boxes=boxes,
            sm_scale=scale, grad_lse=None if d_lse is None else lse_of(d_lse), dq=view(dq), dk=view(dk), dv=view(dv),
            deterministic=deterministic)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# na2d, na3d: the Hopper forward's 2-D and 3-D WINDOW modes (query tiles and key blocks as boxes of the grid)
# ---------------------------------------------------------------------------------------------

def na2d(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel_size, stride=1, dilation=1,
         is_causal=False, scale: Optional[float] = None, additional_keys: Optional[torch.Tensor] = None,
         additional_values: Optional[torch.Tensor] = None, return_lse: bool = False, q_tile_shape=None,
         kv_tile_shape=None, descale_q: Optional[float] = None, descale_k: Optional[float] = None,
         descale_v: Optional[float] = None, backward_q_tile_shape=None, backward_kv_tile_shape=None):
    """2-D neighborhood attention, NATTEN's ``na2d``: query [B, X, Y, H, D], key and value [B, X, Y, H_KV, D] CUDA
    tensors (heads last; H_KV divides H), each query attending the kernel_size[0] x kernel_size[1] keys of its
    window (``stride``, ``dilation``, ``is_causal`` per dimension, or one int/bool for both: module docstring);
    ``additional_keys``/``additional_values`` [B, N_extra, H_KV, D] seen by every query. Returns the output
    [B, X, Y, H, D] (and with ``return_lse`` the natural-log logsumexp [B, X, Y, H], fp32).

    Runs the sm_90a forward's 2-D WINDOW mode (fp16, bf16, head dims 32, 64, 96, 128, 32 and 96 in the D=64 and
    D=128 kernels; fp8 e4m3/e5m2 at 64 and 128 with per-tensor ``descale_q/k/v`` as ``attention`` takes them, the
    output fp16, V^T made of the key boxes): a query tile is a
    box of the grid (``q_tile_shape``: (TX, TY), 128 positions) and a key block one too (``kv_tile_shape``: (KX,
    KY), 128); TMA loads the boxes from views of the tensors, so no token moves; a tile visits the key boxes of its
    queries' windows (in 16 bits from each tile's halo: ``kv_halo``), masking only those not wholly inside every one of
    its queries' windows. Each dilation group is a strided view; y's groups launch together as heads where they are
    as long (``_group_views``), x's on their own. The defaults: the pair of boxes
    that computes the fewest (query, key) pairs, padding included, a masked visit's weighing 1.25x (``plan_rank``).
    Differentiable in 16 bits (autograd): the backward's 2-D WINDOW mode, a unit a key box (``backward_kv_tile_shape``:
    (KX, KY), 128 keys, KX >= 2) walking the query boxes (``backward_q_tile_shape``: 64 positions at D=128, 128 at
    D=64) whose windows reach it; defaults as the forward's (``backward_tiles``). Under
    ``torch.use_deterministic_algorithms`` dQ's adds into each query box go in the order of the key boxes that reach
    it."""
    if torch.compiler.is_compiling():  # (one opaque op: its implementation validates when it runs)
        return _traced(2, query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys,
                       additional_values, return_lse, (q_tile_shape, kv_tile_shape),
                       (backward_q_tile_shape, backward_kv_tile_shape), (descale_q, descale_k, descale_v))
    return _na_boxes("na2d", 2, query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys,
                     additional_values, return_lse, q_tile_shape, kv_tile_shape,
                     (descale_q, descale_k, descale_v), backward_q_tile_shape,
                     backward_kv_tile_shape)


def na3d(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel_size, stride=1, dilation=1,
         is_causal=False, scale: Optional[float] = None, additional_keys: Optional[torch.Tensor] = None,
         additional_values: Optional[torch.Tensor] = None, return_lse: bool = False, q_tile_shape=None,
         kv_tile_shape=None, descale_q: Optional[float] = None, descale_k: Optional[float] = None,
         descale_v: Optional[float] = None, backward_q_tile_shape=None, backward_kv_tile_shape=None):
    """3-D neighborhood attention, NATTEN's ``na3d``: query [B, X, Y, Z, H, D], key and value [B, X, Y, Z, H_KV, D],
    as ``na2d`` with three dimensions: the sm_90a forward's 3-D WINDOW mode, boxes (TX, TY, TZ) and (KX, KY, KZ) of
    128 positions over [H, B X, Y, Z, D] views (TMA's five dimensions: the batches folded into x, one launch a
    dilation group, where the query boxes divide X; else, in fp8 and in the backward, a launch per batch and group
    over [H, X, Y, Z, D]); fp8 as na2d's; the backward as na2d's, in three dimensions."""
    if torch.compiler.is_compiling():  # (one opaque op: its implementation validates when it runs)
        return _traced(3, query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys,
                       additional_values, return_lse, (q_tile_shape, kv_tile_shape),
                       (backward_q_tile_shape, backward_kv_tile_shape), (descale_q, descale_k, descale_v))
    return _na_boxes("na3d", 3, query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys,
                     additional_values, return_lse, q_tile_shape, kv_tile_shape,
                     (descale_q, descale_k, descale_v), backward_q_tile_shape,
                     backward_kv_tile_shape)


def _na_boxes(what, dims, query, key, value, kernel_size, stride, dilation, is_causal, scale, additional_keys,
              additional_values, return_lse, q_tile_shape, kv_tile_shape, descales=(None, None, None),
              backward_q_tile_shape=None, backward_kv_tile_shape=None, via_op: bool = True):
    """na2d and na3d: NATTEN's checks, then the kernel's, then a launch per dilation group (2-D: per x group where y's
    fold into heads; 3-D: and batch); a call signature seen before takes its route. ``descales``: as given (None: 1),
    checked here."""
    rkey = _route_key(query, key, value, additional_keys, additional_values, dims, kernel_size, stride, dilation,
                      is_causal, scale, return_lse, q_tile_shape, kv_tile_shape, *descales, backward_q_tile_shape,
                      backward_kv_tile_shape) if via_op else None
    if rkey is not None:
        route = _NA_ROUTES.get(rkey)
        res = None if route is None else route(query, key, value, additional_keys, additional_values)
        if res is not None:
            return res
    descales = _descales(what, query, *descales)
    from .kernels.backend import backend_for_arch
    from .problem import FP8_DTYPES
    from .validation import UnsupportedError, check_qkv

    axes = "X, Y" if dims == 2 else "X, Y, Z"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims + 3:
            raise ValueError(f"{what}: {name} must be a {dims + 3}-D tensor [B, {axes}, heads, head_dim] (NATTEN's "
                             f"layout), got {getattr(t, 'shape', type(t).__name__)}")
    if tuple(key.shape[:dims + 1]) != tuple(query.shape[:dims + 1]) or \
            tuple(value.shape[:dims + 2]) != tuple(key.shape[:dims + 2]):
        raise ValueError(f"{what}: query, key and value must share [B, {axes}] (and key and value their heads); got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    D = query.shape[-1]
    nb = _pattern(tuple(query.shape[1:dims + 1]), kernel_size, stride, dilation, is_causal)
    bwd_boxes = _check_backward_tiles(what, nb, D, backward_q_tile_shape, backward_kv_tile_shape)
    # [B, heads, X, D]: what check_qkv reads (the other spatial dims at their first position)
    rows = [t[(slice(None), slice(None)) + (0,) * (dims - 1)].transpose(1, 2) for t in (query, key, value)]
    box_dims = backend_for_arch("sm_90a").module.WINDOW_BOX_HEAD_DIMS
    check_qkv(*rows, head_dims=box_dims, dtypes=("fp16", "bf16", *FP8_DTYPES),
              require_cuda=query.device.type != "meta", what=what)
    if (additional_keys is None) != (additional_values is None):
        raise ValueError(f"{what}: `additional_keys` and `additional_values` go together: give both or neither")
    fp8_dims = [d for d in box_dims if d in FP8_HEAD_DIMS]  # (the kernels' own, no padded ones)
    if query.element_size() == 1 and D not in fp8_dims:
        raise UnsupportedError(f"{what}: fp8 takes head dims {', '.join(map(str, fp8_dims))}; got {D} (fp16 and bf16 "
                               f"take {', '.join(str(d) for d in box_dims if d not in fp8_dims)} too)")
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if grad and query.element_size() == 1:
        raise UnsupportedError(f"{what}: the backward takes fp16 and bf16; fp8 runs the forward only")
    backend = _sm90_backend(what, query)
    config, boxes = na_box_config(backend.module, D, query.dtype, nb, q_tile_shape, kv_tile_shape)
    scale = scale if scale else D ** -0.5
    need_lse = return_lse or additional_keys is not None
    out, lse = _dispatch(query, key, value, nb, scale, (q_tile_shape, kv_tile_shape), bwd_boxes, descales, need_lse,
                         grad, lambda: _na_boxes_forward(query, key, value, nb, scale, config, boxes, backend, need_lse,
                                                         descales), via_op)
    if rkey is not None:
        fast = None
        if not need_lse and query.element_size() == 2:
            window = tuple(zip(nb.kernel_size, nb.stride, nb.is_causal))
            tensors = (query, key, value, out)
            fold = _folds(nb, boxes, tensors, False, backend.module)
            fast = _GroupsRoute.make(tensors, [
                (lambda views, n=n: backend.module.prepare_na_boxes(*views, window=window, boxes=boxes,
                                                                    sm_scale=scale, config=config, batches=n),
                 [view(t) for t in tensors])
                for view, n in _launch_views(nb, tensors, fold)])
        route = fast or _Route(functools.partial(_na_boxes_forward, nb=nb, scale=scale, config=config, boxes=boxes,
                                                 backend=backend, need_lse=need_lse, descales=descales), return_lse,
                               None if additional_keys is None else (scale, descales))
    if additional_keys is not None:
        out, lse = _with_additional_keys(query, out, lse, additional_keys, additional_values, scale, descales)
    if rkey is not None:
        _NA_ROUTES.put(rkey, route)  # (once the call went through: a call that raised leaves no route)
    return (out, lse) if return_lse else out


def box_configs(kernels, head_dim: int, dtype: torch.dtype, nb: Neighborhood) -> list:
    """The sm_90a forward's configs for 2-D/3-D windows: the tuned dense config at 128-row tiles and, in 16 bits where
    it fits, the same at 64-row ones (one consumer warpgroup, two programs an SM), whose row sums the softmax adds
    (no SUM_MMA: 1.01-1.05x over the wgmma's sums on the small windows, run 235, NOTES v110)."""
    import dataclasses

    from .problem import dtype_name

    name = dtype_name(dtype)
    base = kernels.default_config(head_dim, name, False, nb.tokens)
    cfgs = [dataclasses.replace(base, BLOCK_M=128)]
    if not name.startswith("fp8"):
        small = dataclasses.replace(base, BLOCK_M=64, PINGPONG=False, SUM_MMA=False)
        cfgs += [small] if not small.invalid_reasons(head_dim, name) else []
    return cfgs


def na_box_config(kernels, head_dim: int, dtype: torch.dtype, nb: Neighborhood, q_tile_shape=None,
                  kv_tile_shape=None):
    """The sm_90a forward's config and boxes (query box, key box) for a 2-D or 3-D pattern: the tuned dense config at
    128-row tiles (192-row ones spill under the 2-D mask) or, in 16 bits where it fits, at 64-row tiles (one consumer
    warpgroup, two programs an SM: ``HopperConfig.ctas_per_sm``), and the given tile shapes (refused naming those
    the kernel takes) or the pair ``plan_rank`` puts first over both (the fewest computed pairs over the halo boxes
    the forward walks in 16 bits, a masked visit's weighing ``FORWARD_MASKED_COST``; fp8 over the lattice's)."""
    what = f"na{nb.dims}d"
    cfgs = box_configs(kernels, head_dim, dtype, nb)
    taken = {c: kernels.window_boxes(c, head_dim, nb.dims) for c in cfgs}
    pairs = [(p, c) for c in cfgs for p in taken[c]]
    qs, kvs = sorted({p[0] for p, _ in pairs}), sorted({p[1] for p, _ in pairs})
    for label, given, shapes in (("q_tile_shape", q_tile_shape, qs), ("kv_tile_shape", kv_tile_shape, kvs)):
        if given is not None and (not isinstance(given, (tuple, list)) or tuple(given) not in shapes):
            raise ValueError(f"{what}: `{label}` {given!r} is not taken: at head dim {head_dim} the kernel's are "
                             f"{', '.join(str(s) for s in shapes)}")
    q_shape = tuple(q_tile_shape) if q_tile_shape else None
    kv_shape = tuple(kv_tile_shape) if kv_tile_shape else None
    halo = forward_halo(nb, dtype)
    best = []
    for c in cfgs:
        if any((q_shape is None or q == q_shape) and (kv_shape is None or kv == kv_shape) for q, kv in taken[c]):
            boxes = _best_boxes(nb, q_shape, kv_shape, tuple(taken[c]), halo)
            best.append((plan_rank(nb, boxes, halo), c.BLOCK_M, c, boxes))
    _, _, cfg, boxes = min(best, key=lambda b: b[:2])
    return cfg, boxes


def sm90_tiles(nb: Neighborhood, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """(every (query tile, K/V tile) shape pair the sm_90a forward takes for this pattern at this head dim, the pair
    na1d/na2d/na3d choose by default): ``configs --na``'s kernel column. Empty where the head dim is not taken."""
    import dataclasses

    from .kernels.backend import backend_for_arch
    from .problem import dtype_name

    kernels = backend_for_arch("sm_90a").module
    try:
        if nb.dims == 1:
            base = kernels.default_config(head_dim, dtype_name(dtype), False, nb.tokens)
            bn = kernels.block_n(kernels.kernel_head_dim(head_dim))
            taken = [((m,), (bn,)) for m in (128, 192)
                     if not dataclasses.replace(base, BLOCK_M=m).invalid_reasons(head_dim, dtype_name(dtype))]
            return tuple(taken), ((base.BLOCK_M,), (bn,))
        if head_dim not in kernels.WINDOW_BOX_HEAD_DIMS:
            return (), None
        _, boxes = na_box_config(kernels, head_dim, dtype, nb)
        return tuple(p for c in box_configs(kernels, head_dim, dtype, nb)
                     for p in kernels.window_boxes(c, head_dim, nb.dims)), boxes
    except ValueError:
        return (), None


@functools.lru_cache(maxsize=256)
def _best_boxes(nb: Neighborhood, q_shape, kv_shape, taken: tuple, halo: bool = False) -> tuple:
    """Of the boxes the kernel takes (those matching the given shapes): the pair ``plan_rank`` puts first."""
    pairs = [p for p in taken if (q_shape is None or p[0] == q_shape) and (kv_shape is None or p[1] == kv_shape)]
    return min(pairs, key=lambda pair: plan_rank(nb, pair, halo))


# The sm_90a forward's masked box block against an unmasked one: its loop issues 616 instructions a consumer warp
# against 392 (D=64: two per score more, NOTES v99); two warps a scheduler make ~1230 issue cycles a 128 x 128 block
# where the tensor core needs ~1024, so a masked visit costs ~1.2-1.25x an unmasked one.
FORWARD_MASKED_COST = 1.25


def plan_rank(nb: Neighborhood, pair: tuple, halo: bool = False) -> tuple:
    """How the plan orders a (query tile, K/V tile) pair: fewest computed pairs (the blocks the kernel runs, a box
    past the layout's edge with its padding: ranked by the pairs inside the layout alone, a 128 x 1 box over a
    64-wide grid looked as good as a 64 x 2 one and ran three times as long), then fewest masked visits, then fewest
    visited pairs, then the widest K/V tile along the last dimension (the default's choice, ``optimize --na``'s
    candidates). ``halo`` (the 2-D/3-D forward's halo boxes, as ``plan_stats``): the computed pairs of a masked
    visit count ``FORWARD_MASKED_COST`` times (a 30x48x80 grid under an 18x24x24 window would otherwise take 1x4x32
    key boxes, every visit masked, for 1.7% fewer pairs than 2x8x8's 66%)."""
    st = plan_stats(nb, pair[0], pair[1], halo)
    cost = st.computed_pairs
    if halo and st.kv_visits:
        cost = cost * (1 + (FORWARD_MASKED_COST - 1) * st.masked_visits / st.kv_visits)
    return cost, st.masked_visits, st.visited_pairs, -pair[1][-1]


def _launch_views(nb: Neighborhood, tensors, fold: bool = False, fp8: bool = False):
    """``_group_views`` of the launches over ``tensors`` ([B, *grid, H, ..], all they view), with the folds their
    layouts allow in 16 bits: the last dimension's dilation groups as heads (``_folds_heads``) and, in 2-D with fewer
    batches than x's groups, x's as the view's batches (``_x_as_batches``)."""
    batch = tensors[0].shape[0]
    heads = not fp8 and _folds_heads(nb.spatial[-1], nb.dilation[-1], nb.dims, tensors)
    return _group_views(nb, batch, fold, heads, not fp8 and _x_as_batches(nb, batch))


def _group_views(nb: Neighborhood, batch: int, fold: bool = False, heads: bool = False, xbatch: bool = False):
    """na2d's and na3d's launches: for each (batch, dilation group) of [B, *grid, H, D] tensors, the view a launch
    makes of one and the batches it holds: [B, heads, *grid_g, D] (2-D: all batches at once) or [heads,
    *grid_g, D] (3-D: one batch a launch, TMA taking five dimensions), or with ``fold`` (3-D, ``_folds``) [heads, B
    Xg, Yg, Zg, D], the batches folded into x (the batches a launch holds: B folded, else 1). With ``heads``
    (``_folds_heads``) the last dimension's dilation groups are heads of one launch (``_fold_dilation``): a launch per
    group of the other dimensions. With ``xbatch`` (2-D, fewer batches than x's groups: ``_x_as_batches``) x's groups
    are the view's batches, [dx, heads, Xg, Yg, D] (x = xg dx + g: batch g's stride Y H D), a launch per batch, so
    that with ``heads`` one launch a batch takes every group."""
    dims = nb.dims
    if xbatch:
        dx, dy = nb.dilation
        for b, ys in itertools.product(range(batch), [slice(None)] if heads or dy == 1 else
                                       [slice(g, None, dy) for g in range(dy)]):
            def view(t, ys=ys, b=b):
                v = t[:, :, ys][b]  # [X, Yg (or Y), H, ..]
                if heads:
                    v = _fold_dilation(v, 1, dy)
                return v.unflatten(0, (v.shape[0] // dx, dx)).movedim(1, 0).movedim(-2, 1)
            yield view, 1
        return
    whole = dims == 2 or fold
    batches = [slice(None)] if whole else range(batch)
    perm = (0, dims + 1, *range(1, dims + 1), dims + 2) if dims == 2 else (dims, *range(dims), dims + 1)
    dilation = (*nb.dilation[:-1], 1) if heads else nb.dilation
    for b, group in itertools.product(batches, itertools.product(*(range(d) for d in dilation))):
        at = (b,) + tuple(slice(g, None, d) for g, d in zip(group, dilation))
        base = (lambda t, at=at: t[at].flatten(0, 1)) if fold else (lambda t, at=at: t[at])
        if heads:  # (the last dimension is 2 in each base: [B, Xg, Y, ..], [Xg, Yg, Z, ..] or [B Xg, Yg, Z, ..])
            yield (lambda t, base=base: _fold_dilation(base(t), 2, nb.dilation[-1]).permute(*perm)), \
                batch if fold else 1
        else:
            yield (lambda t, base=base: base(t).permute(*perm)), batch if fold else 1


def _x_as_batches(nb: Neighborhood, batch: int) -> bool:
    """Whether na2d's launches take x's dilation groups as the view's batches (``_group_views``' ``xbatch``), a launch
    per batch: fewer batches than x's groups (else a launch per x group takes every batch) and x's groups as long (dx
    divides X)."""
    return nb.dims == 2 and batch < nb.dilation[0] and nb.spatial[0] % nb.dilation[0] == 0


def _folds(nb: Neighborhood, boxes: tuple, tensors, fp8: bool, kernels) -> bool:
    """Whether na3d's forward launches once a dilation group for every batch (``_group_views``' ``fold``): 16 bits,
    more than one batch, query tiles that divide each group's x (the backend module's ``fold_batches``) and tensors
    whose batches lie one after another along x, so that folding them is a view."""
    batch = tensors[0].shape[0]
    if nb.dims != 3 or fp8 or batch == 1:
        return False
    fold_batches = kernels.fold_batches
    for group in groups(nb):
        at = (slice(None),) + tuple(slice(g, None, d) for g, d in zip(group, nb.dilation))
        for t in tensors:
            v = t[at]
            if not fold_batches(v.shape[1], boxes) or v.stride(0) != v.shape[1] * v.stride(1):
                return False
    return True


def _na_boxes_forward(query, key, value, nb: Neighborhood, scale, config, boxes, backend, need_lse: bool = True,
                      descales=(1.0, 1.0, 1.0)):
    """na2d's and na3d's neighborhood part: (out [B, *grid, H, Dv] (fp16 for fp8 inputs), lse [B, *grid, H] fp32,
    None without ``need_lse``), a launch per dilation group on [B, heads, Xg, Yg, D] views (2-D) or [heads, B Xg, Yg,
    Zg, D] ones (3-D, the batches folded into x where ``_folds``; else a launch per batch and group, TMA taking five
    dimensions)."""
    fp8 = _fp8_launch(query, descales)
    out = torch.empty((*query.shape[:-1], value.shape[-1]), dtype=torch.float16 if fp8 else query.dtype,
                      device=query.device)
    lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device) if need_lse else None
    window = tuple(zip(nb.kernel_size, nb.stride, nb.is_causal))
    tensors = (query, key, value, out)
    for view, batches in _launch_views(nb, tensors, _folds(nb, boxes, tensors, bool(fp8), backend.module), bool(fp8)):
        res = backend.module.hopper_na_boxes(view(query), view(key), view(value), window=window, boxes=boxes,
                                             sm_scale=scale, return_lse=need_lse, out=view(out), config=config,
                                             batches=batches, **fp8)
        if need_lse:
            # (the launch's view of the lse: [B, heads, Xg, Yg] or [heads, (B) Xg, Yg, Zg]; the kernel's is [B, heads,
            # tokens] or [heads, tokens], [B, heads, tokens] with 3-D batches folded into x, which run batch by batch)
            lse_g = _lse_view(view, lse)
            lse_g.copy_((res[1].movedim(0, 1) if batches > 1 else res[1]).reshape(lse_g.shape))
    return out, lse
