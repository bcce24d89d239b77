"""Neighborhood attention on CPU: NATTEN's window rules, the fp32 reference, and the tile math (which K/V tiles a
query tile visits, which need a mask) against the reference mask."""
import itertools
import math
import random

import pytest
import torch

from gluon_attn.neighborhood import (attended_pairs, dim_mask, group_tokens, groups, kv_visits, na_reference,
                                     neighborhood, neighborhood_mask, plan_stats, tile_grid)
from gluon_attn.reference import attention_reference


def test_windows_shift_at_the_borders_and_end_at_the_query_when_causal():
    # L=7, K=3: interior queries centred, the first and last windows shifted inside
    assert dim_mask(7, 3, 1, 1, False).int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1]]
    assert dim_mask(7, 3, 1, 1, True).int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]]
    # even K=4, stride 2: a stride group shares its leader's (gS + S//2) window, two keys left of it, one right
    m = dim_mask(9, 4, 2, 1, False)
    assert [row.nonzero().flatten().tolist() for row in m] == [
        [0, 1, 2, 3]] * 2 + [[1, 2, 3, 4]] * 2 + [[3, 4, 5, 6]] * 2 + [[5, 6, 7, 8]] * 3
    # dilation 2: two interleaved groups (lengths 5 and 4), each an L=5 / L=4 problem of K=3
    m = dim_mask(9, 3, 1, 2, False)
    assert m[0].nonzero().flatten().tolist() == [0, 2, 4] and m[7].nonzero().flatten().tolist() == [3, 5, 7]
    assert m[8].nonzero().flatten().tolist() == [4, 6, 8]


@pytest.mark.parametrize("L", [5, 8, 13, 22])
def test_each_key_is_seen_by_the_queries_natten_backward_derives(L):
    """NATTEN's backward walks, per key, the queries that see it ([q_start, q_end): its own formulas, the
    inverse of the forward's windows); the mask's columns must be those ranges."""
    for K in range(2, L + 1):
        for S in range(1, K + 1):
            wl, wr = K // 2, K // 2 + K % 2 - 1
            off = S - S // 2 - 1
            for causal in (False, True):
                m = dim_mask(L, K, S, 1, causal)
                for j in range(L):
                    if causal:
                        lo, hi = j, min(((j + K) // S + (j + K >= L)) * S, L)
                    else:
                        lo = (((j >= K) * (j - wr + off)) // S) * S
                        hi = L if j >= L - K else ((j + wl + off + 1) // S) * S
                    assert m[:, j].nonzero().flatten().tolist() == list(range(lo, hi)), (L, K, S, causal, j)
                if not causal:
                    assert (m.sum(1) == K).all()  # every query sees K keys


def test_the_pattern_is_the_product_of_its_dimensions():
    nb = neighborhood((6, 5, 7), (3, 2, 4), (1, 2, 3), (2, 1, 1), (False, True, False))
    m = neighborhood_mask(nb).reshape(6, 5, 7, 6, 5, 7)
    per = [dim_mask(6, 3, 1, 2, False), dim_mask(5, 2, 2, 1, True), dim_mask(7, 4, 3, 1, False)]
    for a, b, c in [(0, 0, 0), (5, 4, 6), (3, 1, 2)]:
        want = per[0][a][:, None, None] & per[1][b][None, :, None] & per[2][c][None, None, :]
        assert torch.equal(m[a, b, c], want)
    assert attended_pairs(nb) == int(m.sum())


def _random_problems(seed, n):
    rng = random.Random(seed)
    for _ in range(n):
        dims = rng.choice([1, 2, 3])
        spatial, kernel, stride, dilation, causal = [], [], [], [], []
        for _ in range(dims):
            d = rng.choice([1, 1, 2, 3])
            k = rng.randint(2, 6)
            spatial.append(rng.randint(k * d, k * d + (17 if dims < 3 else 6)))
            kernel.append(k)
            stride.append(rng.randint(1, k))
            dilation.append(d)
            causal.append(rng.random() < 0.3)
        q_tile = tuple(rng.choice([1, 2, 3, 4, 8]) for _ in range(dims))
        kv_tile = tuple(rng.choice([1, 2, 3, 4, 8]) for _ in range(dims))
        yield neighborhood(spatial, tuple(kernel), tuple(stride), tuple(dilation), tuple(causal)), q_tile, kv_tile


@pytest.mark.parametrize("seed", range(4))
def test_tile_visits_cover_every_attended_pair_and_unmasked_tiles_are_wholly_attended(seed):
    """For odd layouts, strides, dilations, causal dims and tiles that do not divide them: a K/V tile holding any
    pair the reference mask attends is visited; a tile visited without a mask is attended in every pair; and no
    visited tile is empty of attended pairs (the per-dimension ranges are tight)."""
    for nb, q_tile, kv_tile in _random_problems(seed, 25):
        mask = neighborhood_mask(nb)
        for g in groups(nb):
            kv_grid = list(itertools.product(*(range(n) for n in tile_grid(nb, g, kv_tile))))
            for qt in itertools.product(*(range(n) for n in tile_grid(nb, g, q_tile))):
                rows = group_tokens(nb, g, q_tile, qt)
                visits = {v.tile: v.masked for v in kv_visits(nb, g, qt, q_tile, kv_tile)}
                for kt in kv_grid:
                    block = mask[rows][:, group_tokens(nb, g, kv_tile, kt)]
                    full = block.all() and block.shape[1] == _full_tile_keys(kv_tile)
                    if kt not in visits:
                        assert not block.any(), (nb, q_tile, kv_tile, g, qt, kt)
                        continue
                    assert block.any(), ("an empty visit", nb, q_tile, kv_tile, g, qt, kt)
                    if not visits[kt]:
                        assert full, ("unmasked but not wholly attended", nb, q_tile, kv_tile, g, qt, kt)
        # cross-group pairs are never attended: every attended pair was checked inside its group
        total = sum(int(mask[group_tokens(nb, g, nb.spatial, (0,) * nb.dims)][:, group_tokens(nb, g, nb.spatial,
                    (0,) * nb.dims)].sum()) for g in groups(nb))
        assert total == int(mask.sum())


@pytest.mark.parametrize("seed", range(3))
def test_halo_boxes_cover_every_attended_key_and_never_outnumber_the_lattice(seed):
    """The 2-D/3-D forward's halo boxes (``kv_halo``: from the first query's window start, as ``masks.window_keys``
    walks them): every key a query tile's queries attend lies in one of its boxes, a box visited without a mask has
    every pair attended inside the layout, no box is empty of attended pairs, ``plan_stats(halo=True)`` sums them,
    and a tile never visits more boxes than lattice tiles (an interval of keys needs at least that many boxes)."""
    from gluon_attn.neighborhood import kv_halo
    for nb, q_tile, kv_tile in _random_problems(200 + seed, 20):
        mask = neighborhood_mask(nb)
        strides = [math.prod(nb.spatial[d + 1:]) for d in range(nb.dims)]
        visits = masked = 0
        for g in groups(nb):
            for qt in itertools.product(*(range(n) for n in tile_grid(nb, g, q_tile))):
                rows = group_tokens(nb, g, q_tile, qt)
                halo = kv_visits(nb, g, qt, q_tile, kv_tile, halo=True)
                lattice = kv_visits(nb, g, qt, q_tile, kv_tile)
                assert len(halo) <= len(lattice)
                visits += len(halo)
                covered = set()
                for v in halo:
                    masked += v.masked
                    axes = []
                    for d in range(nb.dims):
                        L = nb.group_sizes(d)[g[d]]
                        axes.append([(g[d] + nb.dilation[d] * p) if p < L else None
                                     for p in range(v.start[d], v.start[d] + kv_tile[d])])
                    keys = [sum(c * st for c, st in zip(coords, strides)) for coords in itertools.product(*axes)
                            if None not in coords]
                    covered.update(keys)
                    block = mask[rows][:, keys]
                    assert block.any(), ("an empty box", nb, q_tile, kv_tile, g, qt, v)
                    if not v.masked:
                        assert len(keys) == _full_tile_keys(kv_tile) and block.all(), (nb, q_tile, kv_tile, v)
                attended = set(torch.nonzero(mask[rows].any(0)).flatten().tolist())
                assert attended <= covered, (nb, q_tile, kv_tile, g, qt)
        st = plan_stats(nb, q_tile, kv_tile, halo=True)
        assert (st.kv_visits, st.masked_visits) == (visits, masked)
        assert st.computed_pairs <= plan_stats(nb, q_tile, kv_tile).computed_pairs


def test_forward_ranks_halo_boxes_in_16_bits_and_the_lattice_in_fp8():
    """The 2-D/3-D forward's default in 16 bits is the pair computing the fewest pairs over halo boxes (at 64 x 64,
    7 x 7: 16 x 8 query boxes against 8 x 16 key boxes, 96 visits, bound 10.7x, where the lattice's best computed
    12.7x the attended pairs, bound 6.6x); fp8's V^T holds the lattice's boxes, so its default is ranked on them."""
    from gluon_attn.kernels import hopper_host
    from gluon_attn.neighborhood import forward_halo, na_box_config
    nb = neighborhood((64, 64), (7, 7))
    assert forward_halo(nb, torch.float16) and not forward_halo(nb, torch.float8_e4m3fn)
    assert not forward_halo(neighborhood((4096,), 7), torch.float16)
    _, boxes = na_box_config(hopper_host, 128, torch.float16, nb)
    st = plan_stats(nb, *boxes, halo=True)
    assert boxes == ((16, 8), (8, 16)) and st.kv_visits == 96 and f"{nb.tokens ** 2 / st.computed_pairs:.1f}" == "10.7"
    _, fp8 = na_box_config(hopper_host, 128, torch.float8_e4m3fn, nb)
    lattice = plan_stats(nb, *fp8)
    assert fp8 in (((2, 64), (2, 64)), ((64, 2), (64, 2))) and lattice.kv_visits == 156
    assert lattice.computed_pairs > 1.6 * st.computed_pairs
    # a masked visit weighs more in the forward's rank: at 30x48x80 under 18x24x24 the 1x4x32 key boxes compute 1.7%
    # fewer pairs than 2x8x8 but mask every visit (66% for 2x8x8)
    from gluon_attn.neighborhood import FORWARD_MASKED_COST, plan_rank
    nb = neighborhood((30, 48, 80), (18, 24, 24))
    _, boxes = na_box_config(hopper_host, 128, torch.bfloat16, nb)
    fewest = ((2, 8, 8), (1, 4, 32))
    a, b = plan_stats(nb, *boxes, halo=True), plan_stats(nb, *fewest, halo=True)
    assert boxes == ((2, 8, 8), (2, 8, 8)) and b.computed_pairs < a.computed_pairs < 1.02 * b.computed_pairs
    assert b.masked_visits == b.kv_visits and a.masked_visits < 0.7 * a.kv_visits and FORWARD_MASKED_COST > 1
    assert plan_rank(nb, boxes, True) < plan_rank(nb, fewest, True)


def _full_tile_keys(kv_tile):
    n = 1
    for t in kv_tile:
        n *= t
    return n


def test_blocked_and_dense_patterns_need_no_masks_where_tiles_align():
    blocked = neighborhood((64,), 16, stride=16)
    st = plan_stats(blocked, (16,), (16,))
    assert st.masked_visits == 0 and st.q_tiles == 4 and st.kv_visits == 4
    assert st.visited_pairs == attended_pairs(blocked) == 64 * 16
    dense = neighborhood((12, 8), (12, 8))
    st = plan_stats(dense, (4, 4), (4, 8))
    assert st.masked_visits == 0 and st.visited_pairs == 96 * 96
    # a sliding window: interior tiles run unmasked, the window's edges pay for the masks
    nb = neighborhood((256,), 64)
    st = plan_stats(nb, (16,), (16,))
    assert 0 < st.masked_visits < st.kv_visits and st.visited_pairs >= attended_pairs(nb)
    assert st.kv_visits - st.masked_visits >= st.q_tiles * 2


def test_na_reference_is_dense_or_causal_attention_when_the_window_is_the_layout():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 11, 4, 16), torch.randn(2, 11, 2, 16), torch.randn(2, 11, 2, 16)
    for causal in (False, True):
        out, lse = na_reference(q, k, v, kernel_size=11, is_causal=causal, return_lse=True)
        ref, ref_lse = attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                                           return_lse=True)
        torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_na_reference_attends_the_window_and_every_additional_key():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 5, 6, 2, 8), torch.randn(1, 5, 6, 1, 8), torch.randn(1, 5, 6, 1, 8)
    ak, av = torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    nb = neighborhood((5, 6), (3, 4), (1, 2), 1, (True, False))
    out = na_reference(q, k, v, (3, 4), stride=(1, 2), is_causal=(True, False), additional_keys=ak,
                       additional_values=av)
    # by hand: the 30 tokens and the 3 extra keys, the extra ones seen by every query
    kk = torch.cat([k.reshape(1, 30, 1, 8), ak], 1)[0, :, 0]
    vv = torch.cat([v.reshape(1, 30, 1, 8), av], 1)[0, :, 0]
    allowed = torch.cat([neighborhood_mask(nb), torch.ones(30, 3, dtype=torch.bool)], 1)
    for h in range(2):
        s = (q.reshape(30, 2, 8)[:, h] @ kk.T) * 8 ** -0.5
        want = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vv
        torch.testing.assert_close(out.reshape(30, 2, 8)[:, h], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("args,message", [
    (((10,), 6, 1, 2), r"`kernel_size` x `dilation` cannot be larger"),
    (((10,), 3, 4), r"`stride` cannot be larger than `kernel_size`"),
    (((10,), 1), r"`kernel_size` must be an integer or a tuple of 1 integers, each >= 2"),
    (((10, 8), (3, 3, 3)), r"`kernel_size` must be .* tuple of 2 integers"),
    (((10, 8), 3, 1, 1, (True,)), r"`is_causal` must be a bool or a tuple of 2 bools"),
    (((10,), 3, 0), r"`stride` must be .* each >= 1"),
    (((2, 2, 2, 2), 2), r"1, 2 or 3 spatial dimensions"),
])
def test_bad_arguments_are_refused_naming_them(args, message):
    with pytest.raises(ValueError, match=message):
        neighborhood(*args)


def test_na_reference_refuses_layouts_that_disagree():
    q = torch.randn(1, 6, 6, 2, 8)
    with pytest.raises(ValueError, match="share one token layout"):
        na_reference(q, torch.randn(1, 6, 5, 2, 8), torch.randn(1, 6, 5, 2, 8), 3)
    with pytest.raises(ValueError, match="give both or neither"):
        na_reference(q, q, q, 3, additional_keys=torch.randn(1, 2, 2, 8))


@pytest.mark.parametrize("seed", range(2))
def test_plan_stats_sum_the_visits_tile_by_tile(seed):
    for nb, q_tile, kv_tile in _random_problems(100 + seed, 15):
        q_tiles = visits = masked = pairs = 0
        for g in groups(nb):
            for qt in itertools.product(*(range(n) for n in tile_grid(nb, g, q_tile))):
                q_tiles += 1
                n_q = len(group_tokens(nb, g, q_tile, qt))
                for v in kv_visits(nb, g, qt, q_tile, kv_tile):
                    visits += 1
                    masked += v.masked
                    pairs += n_q * len(group_tokens(nb, g, kv_tile, v.tile))
        st = plan_stats(nb, q_tile, kv_tile)
        assert (st.q_tiles, st.kv_visits, st.masked_visits, st.visited_pairs) == (q_tiles, visits, masked, pairs)
        assert st.visited_pairs >= attended_pairs(nb)


def test_configs_na_lists_tile_shapes_with_their_plans():
    from click.testing import CliRunner

    from gluon_attn.cli import main
    from gluon_attn.neighborhood import plan_table, tile_shapes

    run = CliRunner().invoke
    res = run(main, ["configs", "--na", "--token-layout", "32768", "--window", "2048", "--kv-rows", "64,128",
                     "--format", "md"])
    assert res.exit_code == 0, res.output
    assert "ideal 16.0x dense" in res.output and "| 128 | 128 | 256 | 4336 | 11% | 1.059 | 1.059 | 15.1x | default |" \
        in res.output and "| 128 | 64 | 256 | 8672 | 11% | 1.059 | 1.059 | 15.1x | no |" in res.output
    # 2-D: the sm_90a column marks the boxes the kernel takes and na2d's default
    res = run(main, ["configs", "--na", "--token-layout", "256x256", "--window", "80x80", "--stride", "16",
                     "--format", "csv", "--max-configs", "64"])
    assert res.exit_code == 0 and res.output.count(",default") == 1 and ",no" in res.output, res.output
    res = run(main, ["configs", "--na", "--token-layout", "30x48x80", "--window", "18,24,24", "--stride", "16,8,8",
                     "--max-configs", "1", "--format", "csv"])
    assert res.exit_code == 0 and "2x8x8,2x8x8,900,72900,0%,1.0,1.0,11.1x" in res.output
    # the table is ordered by computed pairs (padding included), and every shape has the tile's token count
    nb = neighborhood((40, 24), (9, 7), (3, 1), (1, 2), (False, True))
    table = plan_table(nb, 64, (32, 64))
    computed = [plan_stats(nb, r["q_tile_shape"], r["kv_tile_shape"]).computed_pairs for r in table]
    assert computed == sorted(computed) and table[0]["bound"] == f"{nb.tokens ** 2 / computed[0]:.1f}x"
    # (dimension 2: groups of 12 tokens under dilation 2, so a tile takes at most 16 of them)
    assert tile_shapes(nb, 64) == [(4, 16), (8, 8), (16, 4), (32, 2), (64, 1)]
    for args, message in [(["--token-layout", "64", "--window", "8", "--stride", "9"], "`stride` cannot be larger"),
                          (["--token-layout", "8,8", "--window", "3"], "no tile of 128 query tokens"),
                          (["--window", "3"], "--na needs --token-layout and --window")]:
        res = run(main, ["configs", "--na", *args])
        assert res.exit_code != 0 and message in res.output, res.output


def test_na1d_refuses_what_it_does_not_take_naming_it():
    """na1d's checks before any launch: NATTEN's layout and rules, then the kernel's (CUDA tensors, 16-bit)."""
    from gluon_attn import na1d
    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"4-D tensor \[B, L, heads, head_dim\]"):
        na1d(q[0], q[0], q[0], 7)
    with pytest.raises(ValueError, match="must share"):
        na1d(q, q[:, :32], q[:, :32], 7)
    with pytest.raises(ValueError, match="`stride` cannot be larger than `kernel_size`"):
        na1d(q, q, q, 7, stride=8)
    with pytest.raises(ValueError, match="`kernel_size` x `dilation` cannot be larger"):
        na1d(q, q, q, 33, dilation=2)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        na1d(q, q, q, 7)
    with pytest.raises(ValueError, match="dtype"):
        na1d(q.float(), q.float(), q.float(), 7)


@pytest.mark.compile
@pytest.mark.parametrize("dtype,d,window", [("fp16", 128, 1), ("bf16", 64, 2), ("fp16", 256, 2)])
def test_window_builds_compile_without_spills_in_their_block_loops(dtype, d, window):
    """The sm_90a forward's WINDOW mode (na1d; 1 non-causal, 2 causal windows): each tile's key range and the
    window masks at its edges, the rest of the kernel the dense one's. (D=256's epilogue spills a few values
    outside the block loops, as its padded builds do.)"""
    from gluon_attn.inspection import analyze, compile_build, wgmma_operand_hazards
    from gluon_attn.kernels import hopper_host

    cfg = hopper_host.default_config(d, dtype, False)
    build = hopper_host.build(dtype, d, False, cfg, "gluon_attention", window=window)
    got = analyze(compile_build(build, "sm_90a"), "sm_90a", build.description, build.num_warps)
    rep = got.report
    assert build.constexprs["WINDOW"] == window and not build.constexprs["CAUSAL"]
    assert rep.has("HGMMA") and rep.has("UTMALDG") and rep.has("MUFU")
    assert rep.loop_spill_instructions == 0 and wgmma_operand_hazards(got.sass) == []
    assert rep.spill_instructions <= (16 if d == 256 else 0)
    dense = hopper_host.build(dtype, d, False, cfg, "gluon_attention")
    assert dense.constexprs["WINDOW"] == 0


def test_window_words_are_made_once_per_device_and_window():
    from gluon_attn.kernels.hopper_host import window_table
    words = window_table(torch.device("cpu"), 2048, 256)
    assert words.dtype == torch.int32 and words.tolist() == [2048, 256]
    assert window_table(torch.device("cpu"), 2048, 256) is words
    assert window_table(torch.device("cpu"), 2048, 1).tolist() == [2048, 1]


def test_na1d_tile_shapes_are_the_kernels_and_refused_naming_them():
    """NATTEN's q_tile_shape / kv_tile_shape: the sm_90a forward's query tiles (128 or 192 rows, as registers allow
    for the head dim) and its one key block size; the default is the tuned dense config."""
    from gluon_attn.kernels import hopper_host
    from gluon_attn.neighborhood import _na_config
    assert _na_config(hopper_host, 128, torch.float16, 32768, None, None) == \
        hopper_host.default_config(128, "fp16", False, 32768)
    assert _na_config(hopper_host, 64, torch.bfloat16, 4096, (192,), (128,)).BLOCK_M == 192
    assert _na_config(hopper_host, 64, torch.bfloat16, 4096, [128], None).BLOCK_M == 128
    with pytest.raises(ValueError, match=r"`q_tile_shape` \(192,\) is not taken: at head dim 128 fp16 the kernel's "
                                         r"query tiles are \(128,\)"):
        _na_config(hopper_host, 128, torch.float16, 4096, (192,), None)
    with pytest.raises(ValueError, match=r"`kv_tile_shape` \(128,\) is not taken: the kernel's key blocks are \(64,\) "
                                         r"at head dim 256"):
        _na_config(hopper_host, 256, torch.float16, 4096, None, (128,))


def test_backward_tile_shapes_are_the_backward_kernels_and_refused_naming_them():
    """NATTEN's backward_q_tile_shape / backward_kv_tile_shape: the sm_90a backward takes one pair per head dim (its
    dQ split fixes the query block), checked against the kernel's own config rule, and refused otherwise; 2-D and
    3-D windows take boxes of those blocks' positions (the key box at least 2 along x); ``configs --na`` prints the
    pair."""
    from click.testing import CliRunner

    from gluon_attn import na1d, na2d
    from gluon_attn.cli import main
    from gluon_attn.kernels import hopper_bwd_host
    from gluon_attn.neighborhood import _check_backward_tiles, backward_tiles
    one_d = neighborhood((4096,), 257)
    for d, want in ((64, ((128,), (128,))), (128, ((64,), (128,))), (256, ((64,), (64,))), (96, ((64,), (128,)))):
        assert backward_tiles(one_d, d) == want
        cfg = hopper_bwd_host.default_config(d, "fp16", False, 4096)
        assert not cfg.invalid_reasons(d, "fp16") and (cfg.BLOCK_M,) == want[0]
        _check_backward_tiles("na1d", one_d, d, want[0], list(want[1]))  # (taken: no error)
    # (q/k 192 with v 128: the pair's own units, 32-query blocks against 128 keys; v 192 keeps the D=256 kernel's)
    assert backward_tiles(one_d, 192, 128) == ((32,), (128,)) and backward_tiles(one_d, 192, 192) == ((64,), (64,))
    _check_backward_tiles("na1d", one_d, 192, (32,), (128,), 128)
    with pytest.raises(ValueError, match=r"`backward_q_tile_shape` \(64,\) is not taken: at head dim 192"):
        _check_backward_tiles("na1d", one_d, 192, (64,), None, 128)
    two_d = neighborhood((48, 40), (9, 7))
    assert backward_tiles(two_d, 128) in hopper_bwd_host.window_boxes(128, 2)
    assert backward_tiles(two_d, 256) is None and hopper_bwd_host.window_boxes(256, 2) == ()
    assert _check_backward_tiles("na2d", two_d, 128, (8, 8), None)[0] == (8, 8)
    assert _check_backward_tiles("na2d", two_d, 128, None, None) == backward_tiles(two_d, 128)
    with pytest.raises(ValueError, match=r"na2d: `backward_kv_tile_shape` \(1, 128\) is not taken: at head dim 128"):
        _check_backward_tiles("na2d", two_d, 128, None, (1, 128))  # (a warpgroup's keys are half the box along x)
    with pytest.raises(ValueError, match=r"na1d: `backward_q_tile_shape` \(128,\) is not taken: at head dim 128 the "
                                         r"backward's are \(64,\)$"):
        _check_backward_tiles("na1d", one_d, 128, (128,), None)
    with pytest.raises(ValueError, match=r"`backward_kv_tile_shape` \(128,\) is not taken: at head dim 256"):
        _check_backward_tiles("na1d", one_d, 256, None, (128,))
    q = torch.zeros(1, 64, 2, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="`backward_q_tile_shape` 64 is not taken"):
        na1d(q, q, q, 7, backward_q_tile_shape=64)
    q2 = torch.zeros(1, 12, 10, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"na2d: `backward_q_tile_shape` \(8, 8\) is not taken: at head dim 64"):
        na2d(q2, q2, q2, 3, backward_q_tile_shape=(8, 8))  # (D=64's query blocks are 128 positions)
    res = CliRunner().invoke(main, ["configs", "--na", "--token-layout", "256x256", "--window", "80x80", "--head-dim",
                                    "128", "--pass", "bwd", "--format", "csv"])
    rows = [line.split(",") for line in res.output.strip().splitlines()]
    assert res.exit_code == 0 and rows[0][:2] == ["q_tile_shape", "kv_tile_shape"], res.output
    col = rows[0].index("sm_90a")
    assert rows[1][:2] == ["8x8", "8x16"] and rows[1][col] == "default"  # (the backward's boxes: 64 / 128 positions)
    assert all(eval(r[0].replace("x", "*")) == 64 and eval(r[1].replace("x", "*")) == 128 for r in rows[1:])
    assert all(r[col] == ("no" if r[1].startswith("1x") else "yes") for r in rows[2:])  # (a key box is >= 2 along x)
    res = CliRunner().invoke(main, ["configs", "--na", "--token-layout", "4096", "--window", "257", "--head-dim",
                                    "64", "--format", "md"])
    assert res.exit_code == 0 and "backward (sm_90a, head dim 64): backward_q_tile_shape (128,), " \
        "backward_kv_tile_shape (128,)" in res.output, res.output


@pytest.mark.compile
@pytest.mark.parametrize("dtype,d,window,deterministic", [("fp16", 128, 1, False), ("bf16", 64, 2, False),
                                                          ("fp16", 128, 2, True), ("fp16", 256, 1, False)])
def test_backward_window_builds_compile_without_spills_in_their_block_loops(dtype, d, window, deterministic):
    """The sm_90a backward's WINDOW mode (na1d's gradients): each key block's query blocks by binary searches over
    the windows, its key rows' query ranges once per unit, the masked blocks compared with them. (The unit's setup
    spills a few values outside the block loops: 12-79 instructions under ptxas 12.9.)"""
    from gluon_attn.inspection import analyze, compile_build, wgmma_operand_hazards
    from gluon_attn.kernels import hopper_bwd_host

    cfg = hopper_bwd_host.default_config(d, dtype, False)
    build = hopper_bwd_host.build(dtype, d, False, cfg, "gluon_attention_bwd", deterministic=deterministic,
                                  window=window)
    got = analyze(compile_build(build, "sm_90a"), "sm_90a", build.description, build.num_warps)
    rep = got.report
    assert build.constexprs["WINDOW"] == window and not build.constexprs["CAUSAL"]
    assert rep.has("HGMMA") and rep.loop_spill_instructions == 0 and wgmma_operand_hazards(got.sass) == []
    assert hopper_bwd_host.build(dtype, d, False, cfg, "gluon_attention_bwd").constexprs["WINDOW"] == 0


@pytest.mark.compile
@pytest.mark.parametrize("dtype,d,mode,boxes", [("fp16", 128, 4, ((8, 8), (8, 16))), ("bf16", 64, 7, ((8, 16), (8, 16))),
                                               ("bf16", 128, 9, ((2, 4, 8), (2, 8, 8))),
                                               ("fp16", 32, 5, ((16, 8), (8, 16))),
                                               ("bf16", 96, 8, ((2, 4, 8), (2, 8, 8)))])
def test_backward_box_builds_compile(dtype, d, mode, boxes):
    """The sm_90a backward's 2-D/3-D WINDOW modes (na2d's, na3d's gradients): a unit a key box, its halves along x the
    warpgroups' keys (5-D descriptor blocks), query boxes walked with a mask only where partial; the dense and 1-D
    builds' SASS is unchanged (checked by hash when the modes were added)."""
    from gluon_attn.inspection import analyze, compile_build, wgmma_operand_hazards
    from gluon_attn.kernels import hopper_bwd_host

    cfg = hopper_bwd_host.default_config(d, dtype, False)
    build = hopper_bwd_host.build(dtype, d, False, cfg, "gluon_attention_bwd", window=mode, boxes=boxes)
    assert boxes in hopper_bwd_host.window_boxes(d, len(boxes[0])) and build.constexprs["PADDED"] == (d in (32, 96))
    # (a warpgroup's half of the key box along x; 32 and 96 in the D=64 and D=128 kernels' blocks)
    half = hopper_bwd_host.box_block_shapes(hopper_bwd_host.kernel_head_dim(d), boxes)["desc_k"]
    assert half[-len(boxes[1]) - 1] == boxes[1][0] // 2 and str(half) in build.signature["desc_k"]
    assert not build.constexprs["DQ_FRAG"] and build.constexprs["WINDOW"] == mode
    assert f"q {'x'.join(map(str, boxes[0]))}, kv {'x'.join(map(str, boxes[1]))}" in build.description
    got = analyze(compile_build(build, "sm_90a"), "sm_90a", build.description, build.num_warps)
    assert got.report.has("HGMMA") and wgmma_operand_hazards(got.sass) == []
    with pytest.raises(ValueError, match="backward boxes .* are not taken at D=128"):
        hopper_bwd_host.hopper_na_boxes_bwd(*[torch.zeros(1, 2, 8, 8, 128)] * 5, torch.zeros(1, 2, 64),
                                            window=((3, 1, False), (3, 1, False)), boxes=((8, 8), (1, 128)),
                                            sm_scale=1.0)


@pytest.mark.parametrize("seed", range(12))
def test_the_backward_visits_every_query_tile_of_a_key_tile_and_masks_none_it_needs(seed):
    """The backward's tile math (``q_tile_ranges``, which ``masks.window_query_blocks`` states in Gluon): for a key
    tile, the query tiles it visits hold every query that attends one of its keys, and in the unmasked ones every
    query attends every key; ``key_queries`` is each key's column of NATTEN's mask."""
    from gluon_attn.neighborhood import key_queries, q_tile_ranges, window_end, window_start
    rng = random.Random(seed)
    L = rng.randint(20, 300)
    K = rng.randint(2, L)
    S = rng.randint(1, K)
    causal = rng.random() < 0.5
    mask = dim_mask(L, K, S, 1, causal)  # [query, key]
    for j in range(L):
        assert list(key_queries(j, L, K, S, causal)) == mask[:, j].nonzero().flatten().tolist()
    q_tile, k_tile = rng.choice([(8, 16), (16, 8), (32, 32)])
    for k0 in range(0, L, k_tile):
        visits, full = q_tile_ranges(k0, k_tile, L, K, S, causal, q_tile)
        keys = mask[:, k0:k0 + k_tile]
        needed = {i // q_tile for i in keys.any(1).nonzero().flatten().tolist()}
        assert needed <= set(visits)
        for m in full:
            rows = keys[m * q_tile:(m + 1) * q_tile]
            assert k0 + k_tile <= L and rows.shape[0] == q_tile and rows.all()
        assert all(window_start(i, L, K, S, causal) <= window_end(i, L, K, S, causal) for i in range(L))


def test_na2d_refuses_what_it_does_not_take_naming_it():
    """na2d's checks before any launch: NATTEN's layout and rules, then the kernel's (CUDA, head dims 32, 64, 96 and
    128, fp8 at 64 and 128 and forward only)."""
    from gluon_attn import na2d
    q = torch.zeros(1, 12, 10, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"5-D tensor \[B, X, Y, heads, head_dim\]"):
        na2d(q[0], q[0], q[0], 3)
    with pytest.raises(ValueError, match="must share"):
        na2d(q, q[:, :6], q[:, :6], 3)
    with pytest.raises(ValueError, match="`stride` cannot be larger than `kernel_size`"):
        na2d(q, q, q, (3, 5), stride=(3, 6))
    with pytest.raises(ValueError, match="`kernel_size` x `dilation` cannot be larger"):
        na2d(q, q, q, 7, dilation=(1, 2))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        na2d(q, q, q, 3)
    with pytest.raises(ValueError, match="head dim 48 .* supported: 32, 64, 96, 128"):
        na2d(q[..., :48], q[..., :48], q[..., :48], 3)
    meta8 = torch.empty(1, 12, 10, 2, 32, dtype=torch.float8_e4m3fn, device="meta")
    with pytest.raises(ValueError, match="fp8 takes head dims 64, 128; got 32"):
        na2d(meta8, meta8, meta8, 3)


def test_na2d_tile_boxes_are_the_kernels_and_the_default_computes_fewest_pairs():
    """The 2-D forward's boxes: query tiles of 128 positions as two consumers' stacked boxes, key blocks of 128; the
    default computes the fewest pairs (over each query tile's halo boxes) of every pair of boxes the kernel takes, and
    shapes it does not take are refused naming those it does."""
    from gluon_attn.kernels import hopper_host
    from gluon_attn.neighborhood import na_box_config
    nb = neighborhood((256, 256), 80, 1)
    cfg, boxes = na_box_config(hopper_host, 128, torch.bfloat16, nb)
    taken = hopper_host.window_boxes(cfg, 128)
    assert cfg.BLOCK_M == 128 and boxes in taken and ((128, 1), (1, 128)) in taken and ((2, 64), (128, 1)) in taken
    assert all(tx * ty == 128 and kx * ky == 128 for (tx, ty), (kx, ky) in taken)
    best = plan_stats(nb, *boxes, halo=True)  # (the forward's walk: each query tile's halo boxes)
    assert best.computed_pairs == min(plan_stats(nb, q, kv, halo=True).computed_pairs for q, kv in taken)
    assert best.visited_pairs < 1.3 * attended_pairs(nb)  # (the boxes' padding around 80 x 80 windows)
    cfg64, boxes64 = na_box_config(hopper_host, 64, torch.float16, nb, (16, 8), None)
    assert cfg64.BLOCK_M == 128 and boxes64[0] == (16, 8)
    with pytest.raises(ValueError, match=r"`q_tile_shape` \(8, 8\) is not taken: at head dim 128 the kernel's are "
                                         r"\(2, 64\), \(4, 32\)"):
        na_box_config(hopper_host, 128, torch.float16, nb, (8, 8), None)
    with pytest.raises(ValueError, match=r"`kv_tile_shape` \(3, 3\) is not taken"):
        na_box_config(hopper_host, 128, torch.float16, nb, None, (3, 3))


@pytest.mark.compile
@pytest.mark.parametrize("dtype,d,causal,boxes", [("fp16", 128, (False, False), ((32, 4), (16, 8))),
                                                   ("bf16", 64, (True, True), ((32, 4), (8, 16))),
                                                   ("fp16", 128, (True, False), ((2, 64), (1, 128))),
                                                   ("bf16", 128, (False, True), ((128, 1), (128, 1))),
                                                   ("bf16", 32, (False, True), ((16, 8), (8, 16))),
                                                   ("fp16", 96, (True, False), ((4, 32), (16, 8)))])
def test_window2_builds_compile_without_spills(dtype, d, causal, boxes):
    """The sm_90a forward's 2-D WINDOW modes (na2d): Q, K, V and O as TMA boxes of [Z, H, Lx, Ly, D] views, the
    2-D mask on the blocks not wholly inside every query's window; no spills, no wgmma operand hazards."""
    import dataclasses

    from gluon_attn.inspection import analyze, compile_build, wgmma_operand_hazards
    from gluon_attn.kernels import hopper_host

    cfg = dataclasses.replace(hopper_host.default_config(d, dtype, False), BLOCK_M=128)
    mode = hopper_host.window_box_mode(causal)
    build = hopper_host.build(dtype, d, False, cfg, "gluon_attention", window=mode, boxes=boxes)
    kd = hopper_host.kernel_head_dim(d)  # (32 and 96 in the D=64 and D=128 kernels: QK^T over their own columns)
    assert build.signature["desc_q"].startswith(f"tensordesc<{'fp16' if dtype == 'fp16' else 'bf16'}"
                                                f"[1, 1, {boxes[0][0] // 2}, {boxes[0][1]}, {kd}]")
    assert f"[1, 1, {boxes[1][0]}, {boxes[1][1]}, {kd}]" in build.signature["desc_k"]
    assert build.constexprs["PADDED"] == (kd != d) and build.constexprs["QK_DIM"] == (d if kd != d else 0)
    got = analyze(compile_build(build, "sm_90a"), "sm_90a", build.description, build.num_warps)
    rep = got.report
    assert build.constexprs["WINDOW"] == mode and "2-D window" in build.description
    assert rep.has("HGMMA") and rep.has("UTMALDG") and rep.has("UTMASTG") and rep.has("MUFU")
    assert rep.spill_instructions == 0 and wgmma_operand_hazards(got.sass) == []


def test_na3d_refuses_what_it_does_not_take_naming_it():
    from gluon_attn import na3d
    q = torch.zeros(1, 6, 8, 10, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"6-D tensor \[B, X, Y, Z, heads, head_dim\]"):
        na3d(q[0], q[0], q[0], 3)
    with pytest.raises(ValueError, match="must share"):
        na3d(q, q[:, :, :4], q[:, :, :4], 3)
    with pytest.raises(ValueError, match="`stride` cannot be larger than `kernel_size`"):
        na3d(q, q, q, (3, 5, 5), stride=(3, 5, 6))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        na3d(q, q, q, 3)


def test_small_grids_default_boxes_do_not_overhang_the_layout():
    """Boxes longer than the layout cost their padding: a 128 x 1 box over a 64-wide grid computes 128 x 128 blocks of
    which a quarter lies inside it. The default ranks pairs by the pairs the kernel computes (padding included), so on
    small grids with small windows it takes boxes that fit (the 128 x 1 defaults ran 3x (2-D 7x7) to 25x (3-D 5x5x5)
    slower on an H200), and the bound counts the padding."""
    from gluon_attn.kernels import hopper_bwd_host, hopper_host
    from gluon_attn.neighborhood import backward_tiles, na_box_config, plan_table
    # (D=64: 64-position query boxes, two programs an SM; D=128's 128-position ones, one)
    cases = [((64, 64), (7, 7), {64: (((8, 8), (8, 16)), ((8, 8), (16, 8))),
                                 128: (((16, 8), (8, 16)), ((8, 16), (16, 8)))}), ((56, 56), (7, 7), None),
             ((16, 16, 16), (3, 3, 3), None), ((16, 16, 16), (5, 5, 5), None)]
    for grid, window, expected in cases:
        nb = neighborhood(grid, window)
        for head_dim in (64, 128):
            _, boxes = na_box_config(hopper_host, head_dim, torch.float16, nb)
            cfg = na_box_config(hopper_host, head_dim, torch.float16, nb)[0]
            taken = hopper_host.window_boxes(cfg, head_dim, nb.dims)
            bwd = backward_tiles(nb, head_dim)
            # (the forward walks halo boxes, the backward the lattice's)
            for pair, pairs, halo in ((boxes, taken, True), (bwd, hopper_bwd_host.window_boxes(head_dim, nb.dims),
                                                              False)):
                st = plan_stats(nb, *pair, halo=halo)
                assert st.computed_pairs == min(plan_stats(nb, *p, halo=halo).computed_pairs for p in pairs)
                # (no box past the next power of two of its dimension)
                assert all(t <= 1 << (g - 1).bit_length() for t, g in zip(pair[0], grid)), pair
                assert st.computed_pairs == st.kv_visits * math.prod(pair[0]) * math.prod(pair[1])
            if expected:
                assert boxes in expected[head_dim]
        for halo in (False, True):
            row = plan_table(nb, halo=halo)[0]
            first = plan_stats(nb, row["q_tile_shape"], row["kv_tile_shape"], halo=halo)
            assert row["bound"] == f"{nb.tokens ** 2 / first.computed_pairs:.1f}x"
    # the 128 x 1 pair computes four times the 64 x 2 one at 64 x 64 / 7 x 7, while the pairs inside the layout tie
    nb = neighborhood((64, 64), (7, 7))
    wide, fit = plan_stats(nb, (128, 1), (128, 1)), plan_stats(nb, (64, 2), (64, 2))
    assert wide.computed_pairs > 2.5 * fit.computed_pairs and wide.visited_pairs < fit.visited_pairs


def test_na3d_folds_batches_into_x_only_where_each_tile_stays_in_its_batch():
    """na3d's forward launches once for every batch where folding them into x is a view and the query tiles divide x
    (a tile past its batch's x would store into the next batch); otherwise a launch per batch, as the backward always
    does. fp8 keeps a launch per batch (its V^T is made per batch)."""
    from gluon_attn.kernels import hopper_host
    from gluon_attn.neighborhood import _folds, _group_views
    boxes = ((4, 2, 16), (8, 1, 16))
    nb = neighborhood((16, 16, 16), 3)
    q = torch.zeros(3, 16, 16, 16, 8, 64, dtype=torch.float16)
    assert _folds(nb, boxes, (q, q, q), False, hopper_host)
    assert not _folds(nb, boxes, (q, q, q), True, hopper_host)
    assert not _folds(nb, boxes, (q[:1], q[:1], q[:1]), False, hopper_host)  # (one batch: nothing to fold)
    assert not _folds(nb, ((8, 2, 8), (8, 1, 16)), (q[:, :12], q[:, :12], q[:, :12]), False, hopper_host)  # 12 % 8
    batch_inner = torch.zeros(16, 3, 16, 16, 8, 64, dtype=torch.float16).transpose(0, 1)  # (batches not along x)
    assert not _folds(nb, boxes, (batch_inner, q, q), False, hopper_host)
    dilated = neighborhood((16, 16, 16), 3, dilation=(3, 1, 1))  # (groups of 6, 5, 5 along x)
    assert not _folds(dilated, boxes, (q, q, q), False, hopper_host)
    launches = list(_group_views(nb, 3, fold=True))
    assert len(launches) == 1 and launches[0][1] == 3
    view = launches[0][0](q)
    assert view.shape == (8, 48, 16, 16, 64) and view.data_ptr() == q.data_ptr() and view.stride(1) == q.stride(1)
    assert [n for _, n in _group_views(nb, 3)] == [1, 1, 1]
    assert [n for _, n in _group_views(neighborhood((64, 64), 7), 3)] == [1]  # (2-D: batches are the view's Z)
    with pytest.raises(ValueError, match="batches fold into x in 3-D windows of 16 bits whose query tiles divide"):
        hopper_host.hopper_na_boxes(view, view, view, window=((3, 1, False),) * 3, boxes=((8, 2, 8), (8, 1, 16)),
                                    sm_scale=1.0, batches=4)


def test_na3d_boxes_and_the_plan_of_natten_3d_case():
    """The 3-D forward's boxes: query tiles of 128 positions (two consumers' boxes stacked along x), key blocks of
    128, every split into powers of two; NATTEN's 3-D case picks boxes whose plan is the fewest visits (at stride
    (16, 8, 8) exactly the attended pairs: 11.1x dense, NATTEN's ideal)."""
    from gluon_attn.kernels import hopper_host
    from gluon_attn.neighborhood import na_box_config
    nb = neighborhood((30, 48, 80), (18, 24, 24), (16, 8, 8))
    cfg, boxes = na_box_config(hopper_host, 128, torch.bfloat16, nb)
    taken = hopper_host.window_boxes(cfg, 128, 3)
    assert len(taken) == 28 * 36 and all(math.prod(q) == 128 and math.prod(kv) == 128 for q, kv in taken)
    st = plan_stats(nb, *boxes)
    assert st.visited_pairs == attended_pairs(nb) and st.masked_visits == 0
    assert st.visited_pairs == min(plan_stats(nb, q, kv).visited_pairs for q, kv in taken)
    assert hopper_host.block_shapes(128, cfg, False, ((8, 4, 4), (2, 8, 8)))["desc_q"] == [1, 4, 4, 4, 128]
    with pytest.raises(ValueError, match=r"na3d: `kv_tile_shape` \(4, 4, 4\) is not taken"):
        na_box_config(hopper_host, 128, torch.float16, nb, None, (4, 4, 4))


@pytest.mark.compile
@pytest.mark.parametrize("causal,boxes", [((False, False, False), ((16, 8, 1), (2, 8, 8))),
                                          ((True, False, True), ((8, 4, 4), (4, 8, 4)))])
def test_window3_builds_compile_without_spills(causal, boxes):
    """The 3-D WINDOW modes (na3d): boxes of [H, Lx, Ly, Lz, D] views, one batch a launch; no spills, no hazards."""
    import dataclasses

    from gluon_attn.inspection import analyze, compile_build, wgmma_operand_hazards
    from gluon_attn.kernels import hopper_host

    cfg = dataclasses.replace(hopper_host.default_config(128, "bf16", False), BLOCK_M=128)
    mode = hopper_host.window_box_mode(causal)
    build = hopper_host.build("bf16", 128, False, cfg, "gluon_attention", window=mode, boxes=boxes)
    assert 8 <= mode <= 15 and "3-D window" in build.description
    assert f"[1, {boxes[0][0] // 2}, {boxes[0][1]}, {boxes[0][2]}, 128]" in build.signature["desc_q"]
    got = analyze(compile_build(build, "sm_90a"), "sm_90a", build.description, build.num_warps)
    rep = got.report
    assert rep.has("HGMMA") and rep.has("UTMALDG") and rep.has("UTMASTG")
    assert rep.spill_instructions == 0 and wgmma_operand_hazards(got.sass) == []


def test_small_windows_take_64_position_query_boxes_two_programs_an_sm():
    """In 16 bits at D <= 64 the plan ranks one consumer warpgroup's 64-position query boxes (BLOCK_M 64, two programs
    an SM) beside two's 128-position ones and takes whichever computes fewer pairs: the small windows' halos fit the
    smaller boxes (56x56 7x7: bound 7.8x -> 12.2x); fp8 and D=128 keep 128 rows (D=128's two programs would not fit
    the shared memory twice)."""
    from gluon_attn.kernels import hopper_host
    from gluon_attn.neighborhood import na_box_config
    for grid, window, d in (((56, 56), 7, 64), ((96, 96), 13, 64), ((16, 16, 16), 3, 64), ((56, 56), 7, 32)):
        cfg, boxes = na_box_config(hopper_host, d, torch.float16, neighborhood(grid, window))
        assert cfg.BLOCK_M == 64 and not cfg.PINGPONG and cfg.ctas_per_sm == 2, (grid, cfg)
        assert math.prod(boxes[0]) == 64 and boxes in hopper_host.window_boxes(cfg, d, len(grid))
        assert cfg.compile_options == {"maxnreg": 128} and cfg.consumer_regs == 232
        plan = hopper_host._na_box_plan(16, 4, 4, grid, d, torch.float16, cfg, False, "gluon_attention", 132,
                                        hopper_host.window_box_mode((False,) * len(grid)), boxes)
        assert plan.grid <= 2 * 132 and plan.consts["BLOCK_M"] == 64
    assert plan.grid == 2 * 132  # (16 x 4 heads of 16^3 over 2 x 2 x 16 boxes: more tiles than two an SM)
    for dtype, d in ((torch.float8_e4m3fn, 64), (torch.float16, 128)):
        assert na_box_config(hopper_host, d, dtype, neighborhood((56, 56), 7))[0].BLOCK_M == 128
    # (dense launches keep two or three consumers: the one-consumer tile ran on a GPU under 2-D/3-D windows only)
    with pytest.raises(ValueError, match="BLOCK_M 64 .* is the 2-D/3-D windows' tile"):
        hopper_host._launch_plan(1, 8, 8, 1024, 1024, 64, 64, torch.float16, torch.float16, False, cfg, False,
                                 "gluon_attention", None, 132, 0)
    assert all(c.BLOCK_M != 64 for c in hopper_host.config_space())


def test_a_window_of_unit_strides_takes_its_own_build(monkeypatch):
    """A 2-D/3-D launch whose strides are all 1 takes the UNIT_STRIDES build (the windows' bounds then divide by no
    stride); any stride above 1 keeps the build that reads the strides from the launch's words, which carry them."""
    from gluon_attn.kernels import hopper_host
    from gluon_attn.neighborhood import na_box_config

    monkeypatch.setattr(hopper_host, "sm_count", lambda device: 132)  # (CPU tensors: no device to ask)
    monkeypatch.setattr(hopper_host, "window_box_table", lambda device, words: torch.tensor(words, dtype=torch.int32))
    cfg, boxes = na_box_config(hopper_host, 64, torch.float16, neighborhood((56, 56), 7))
    q = torch.empty(2, 4, 56, 56, 64, dtype=torch.float16)
    plans = {}
    for strides in ((1, 1), (1, 2), (3, 1)):
        window = tuple((7, s, False) for s in strides)
        *_, plan, _, words = hopper_host._box_terms(q, q, window, boxes, cfg, False, "gluon_attention")
        plans[strides] = plan
        assert plan.consts["UNIT_STRIDES"] is (strides == (1, 1))
        # (then the 2-D stand-ins for z, and the division words: G x 49 tiles, G = 1, H_KV 4, 7 tiles along y, 1)
        assert words.tolist() == [56, 56, 7, strides[0], 7, strides[1], 0, 0, 0,
                                  *hopper_host.box_division_words(1, 4, 49, 7, 1)]
    assert plans[(1, 1)].key != plans[(1, 2)].key and plans[(1, 2)].key == plans[(3, 1)].key


@pytest.mark.compile
@pytest.mark.parametrize("dims,boxes", [(2, ((8, 8), (8, 16))), (3, ((2, 2, 16), (4, 2, 16)))])
def test_unit_stride_builds_divide_by_no_stride(dims, boxes):
    """The UNIT_STRIDES build takes each stride as the constant 1: the integer divisions of the windows' bounds by the
    strides (an I2F.RP/MUFU.RCP chain each) leave the SASS, ~130 instructions of a 56x56 7x7 tile's once-a-tile code
    (NOTES v109); the rest of the build is unchanged (the same block loop, no spills, 128 registers)."""
    import dataclasses

    from gluon_attn.inspection import analyze, compile_build
    from gluon_attn.kernels import hopper_host

    cfg = dataclasses.replace(hopper_host.default_config(64, "fp16", False), BLOCK_M=64, PINGPONG=False)
    got = {}
    for unit in (False, True):
        build = hopper_host.build("fp16", 64, False, cfg, "gluon_attention",
                                  window=hopper_host.window_box_mode((False,) * dims), boxes=boxes, unit_strides=unit)
        assert build.constexprs["UNIT_STRIDES"] is unit
        got[unit] = analyze(compile_build(build, "sm_90a"), "sm_90a", build.description, build.num_warps)
    general, unit = got[False].report, got[True].report
    assert unit.registers == general.registers == 128 and unit.spill_instructions == 0
    assert unit.instructions < general.instructions - 100
    assert got[True].sass.count("I2F.RP") < got[False].sass.count("I2F.RP")
    ops_general, ops_unit = dict(general.histogram), dict(unit.histogram)
    assert ops_unit["HGMMA"] == ops_general["HGMMA"] and ops_unit["MUFU"] < ops_general["MUFU"]


def test_division_words_give_every_quotient_exactly():
    """The 2-D/3-D launch's division words (``hopper_host.division_words``, read by ``masks.magic_quotient``): for any
    divisor in [1, 2^31) the product's bits from p on are n // d for every n in [0, 2^31), the edges included; the
    table carries them after the window's nine words; a divisor out of range is refused."""
    import random

    from gluon_attn.kernels import hopper_host

    rng = random.Random(7)
    divisors = list(range(1, 600)) + [rng.randrange(1, 1 << 31) for _ in range(3000)] + \
        [(1 << k) + e for k in range(1, 31) for e in (-1, 0, 1)]
    for d in divisors:
        m, p = hopper_host.division_words(d)
        assert -(1 << 31) <= m < 1 << 31 and 31 <= p <= 62
        m &= (1 << 32) - 1
        for n in (0, 1, d - 1, d, d + 1, 2 * d - 1, (1 << 31) - 1, rng.randrange(1 << 31), rng.randrange(1 << 16)):
            if 0 <= n < 1 << 31:
                assert (n * m) >> p == n // d, (d, n)
    words = hopper_host.box_division_words(4, 2, 49, 7, 1)
    assert len(words) == 11 and words[-1] == 2 and words[:2] == hopper_host.division_words(4 * 49)
    for bad in (0, -3, 1 << 31):
        with pytest.raises(ValueError, match=r"divisor in \[1, 2\^31\)"):
            hopper_host.division_words(bad)


@pytest.mark.compile
@pytest.mark.parametrize("dims,boxes", [(2, ((8, 8), (8, 16))), (3, ((2, 2, 16), (4, 2, 16)))])
def test_box_units_are_taken_apart_without_integer_division(dims, boxes):
    """A 2-D/3-D forward build takes its units and tiles apart by the launch's division words (a wide multiply and a
    shift each, NOTES v110): with unit strides no integer division (the I2F.RP/MUFU.RCP/F2I chain) is left in the
    SASS, consumer or loader, and the build keeps 128 registers and no spills."""
    from gluon_attn.inspection import analyze, compile_build
    from gluon_attn.kernels import hopper_host
    from gluon_attn.neighborhood import box_configs

    grid = (56, 56) if dims == 2 else (16, 16, 16)
    cfg = box_configs(hopper_host, 64, torch.float16, neighborhood(grid, 3))[-1]  # (the plans' 64-row config)
    assert cfg.BLOCK_M == 64
    build = hopper_host.build("fp16", 64, False, cfg, "gluon_attention",
                              window=hopper_host.window_box_mode((False,) * dims), boxes=boxes, unit_strides=True)
    got = analyze(compile_build(build, "sm_90a"), "sm_90a", build.description, build.num_warps)
    assert got.report.registers == 128 and got.report.spill_instructions == 0
    assert "I2F.RP" not in got.sass and "HGMMA" in got.sass


def _hgmma_runs(sass: str) -> dict:
    """The most HGMMA instructions of each shape issued with no wgmma wait (WARPGROUP.DEPBAR) between them."""
    runs, current = {}, {}
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR" in line:
            current = {}
        elif "HGMMA." in line:
            shape = line.split("HGMMA.")[1].split(".")[0]
            current[shape] = current.get(shape, 0) + 1
            runs[shape] = max(runs.get(shape, 0), current[shape])
    return runs


@pytest.mark.compile
@pytest.mark.parametrize("dims,boxes", [(2, {64: ((8, 8), (8, 16)), 128: ((16, 8), (8, 16))}),
                                        (3, {64: ((2, 2, 16), (4, 2, 16)), 128: ((4, 2, 16), (4, 2, 16))})])
def test_two_block_box_tiles_issue_both_scores_and_both_pv_before_waiting(dims, boxes):
    """The 64-row 2-D/3-D builds take a tile of two key blocks whole (``BOX_PAIRS``, NOTES v116): both S = Q K^T
    (4 k-steps each at D=64) are in flight before the first wait, and both PV (8 k-steps each) after one softmax;
    one block at a time, at most one S and one PV were. The 128-row builds (two consumers, 168 registers) keep the
    block-at-a-time walk."""
    import dataclasses

    from gluon_attn.inspection import compile_build, sass_text
    from gluon_attn.kernels import hopper_host

    base = hopper_host.default_config(64, "fp16", False)
    runs = {}
    for block_m in (64, 128):
        cfg = dataclasses.replace(base, BLOCK_M=block_m, PINGPONG=base.PINGPONG and block_m > 64,
                                  SUM_MMA=base.SUM_MMA and block_m > 64)
        build = hopper_host.build("fp16", 64, False, cfg, "gluon_attention",
                                  window=hopper_host.window_box_mode((False,) * dims), boxes=boxes[block_m],
                                  unit_strides=True)
        assert build.constexprs["BLOCK_M"] == block_m
        runs[block_m] = _hgmma_runs(sass_text(compile_build(build, "sm_90a").asm["cubin"]))
    assert runs[64]["64x128x16"] == 8 and runs[64]["64x64x16"] == 16
    assert runs[128]["64x128x16"] == 4 and runs[128]["64x64x16"] == 8


@pytest.mark.compile
@pytest.mark.parametrize("dtype,d,causal,boxes", [("fp16", 64, (False, False), ((8, 8), (8, 16))),
                                                   ("bf16", 32, (True, False), ((16, 4), (8, 16))),
                                                   ("fp16", 64, (False, True, False), ((2, 2, 16), (4, 2, 16)))])
def test_one_consumer_box_builds_fit_two_programs_an_sm(dtype, d, causal, boxes):
    """BLOCK_M 64's builds: one consumer warpgroup and the loader's, launched at 128 registers a thread (two programs
    an SM hold the 64K-register file) and moved by setmaxnreg to 232 for the consumer and 24 for the loader; no spills,
    no wgmma operand hazards, shared memory for two programs."""
    import dataclasses
    import re

    from gluon_attn.inspection import analyze, compile_build, resource_usage, wgmma_operand_hazards
    from gluon_attn.kernels import hopper_host

    cfg = dataclasses.replace(hopper_host.default_config(d, dtype, False), BLOCK_M=64, PINGPONG=False)
    build = hopper_host.build(dtype, d, False, cfg, "gluon_attention", window=hopper_host.window_box_mode(causal),
                              boxes=boxes)
    assert build.extra == {"maxnreg": 128}
    kernel = compile_build(build, "sm_90a")
    assert resource_usage(kernel.asm["cubin"])["REG"] == 128 and 2 * kernel.metadata.shared <= 232448
    assert {"24", "232"} <= set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"]))
    got = analyze(kernel, "sm_90a", build.description, build.num_warps)
    assert got.report.has("HGMMA") and got.report.spill_instructions == 0 and wgmma_operand_hazards(got.sass) == []


@pytest.mark.compile
@pytest.mark.parametrize("dtype,d,causal,boxes", [("fp8e4m3", 128, (False, False), ((32, 4), (16, 8))),
                                                   ("fp8e5", 64, (True, False), ((2, 64), (1, 128))),
                                                   ("fp8e4m3", 128, (False, False, False), ((16, 8, 1), (2, 8, 8))),
                                                   ("fp8e4m3", 64, (True, False, True), ((8, 4, 4), (4, 8, 4)))])
def test_fp8_box_window_builds_compile_without_spills(dtype, d, causal, boxes):
    """na2d's and na3d's fp8 forward: the box WINDOW modes of the fp8 builds, Q and K boxes as in 16-bit and V^T
    tiles [D, 128 keys] of the key boxes laid one after another (``_v_box_rows``); 128-row tiles, the kernel name
    ``attention`` gives fp8; fp16 output; no spills, no wgmma operand hazards."""
    import dataclasses

    from gluon_attn.inspection import analyze, compile_build, wgmma_operand_hazards
    from gluon_attn.kernels import hopper_host

    cfg = dataclasses.replace(hopper_host.default_config(d, dtype, False), BLOCK_M=128)
    build = hopper_host.build(dtype, d, False, cfg, "cutlass_gluon_attention",
                              window=hopper_host.window_box_mode(causal), boxes=boxes)
    assert build.constexprs["V_TRANSPOSED"] and "-D window" in build.description
    assert f"[1, 1, {d}, 128]" in build.signature["desc_v"] and build.signature["desc_o"].startswith("tensordesc<fp16")
    got = analyze(compile_build(build, "sm_90a"), "sm_90a", build.description, build.num_warps)
    rep = got.report
    assert rep.has("QGMMA") and not rep.has("HGMMA") and rep.has("UTMALDG") and rep.has("UTMASTG")
    assert rep.spill_instructions == 0 and wgmma_operand_hazards(got.sass) == []


@pytest.mark.compile
@pytest.mark.parametrize("dtype,d,window", [("fp8e4m3", 128, 1), ("fp8e5", 64, 2), ("fp8e4m3", 256, 1)])
def test_fp8_window_builds_compile_without_spills(dtype, d, window):
    """na1d's fp8 forward: the WINDOW mode of the fp8 builds (V^T tiles, 192-row tiles at D=64), under the kernel
    name ``attention`` gives fp8; no spills, no wgmma operand hazards."""
    from gluon_attn.inspection import analyze, compile_build, wgmma_operand_hazards
    from gluon_attn.kernels import hopper_host

    build = hopper_host.build(dtype, d, False, hopper_host.default_config(d, dtype, False), "cutlass_gluon_attention",
                              window=window)
    got = analyze(compile_build(build, "sm_90a"), "sm_90a", build.description, build.num_warps)
    assert build.constexprs["V_TRANSPOSED"] and build.constexprs["WINDOW"] == window
    assert got.report.spill_instructions == 0 and wgmma_operand_hazards(got.sass) == []


def test_na1d_fp8_refusals_name_what_it_takes():
    from gluon_attn import na1d
    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="descale_q/k/v are for fp8 inputs; these are fp16"):
        na1d(q, q, q, 7, descale_q=0.5)


def test_the_operations_validate_a_pattern_once_and_still_refuse_bad_ones():
    """``_pattern``: the operations' memo of ``neighborhood`` (the same object for the same arguments, lists taken
    as tuples), which never remembers a refusal."""
    from gluon_attn.neighborhood import _pattern
    a = _pattern((40, 24), [9, 7], (3, 1), 1, (False, True))
    assert a is _pattern([40, 24], (9, 7), [3, 1], 1, [False, True]) and a == neighborhood((40, 24), (9, 7), (3, 1),
                                                                                            1, (False, True))
    for _ in range(2):
        with pytest.raises(ValueError, match="`stride` cannot be larger than `kernel_size`"):
            _pattern((64,), 8, 9, 1, False)
    with pytest.raises(ValueError, match="`kernel_size` must be an integer or a tuple"):
        _pattern((64,), {"k": 8}, 1, 1, False)


@pytest.mark.parametrize("grid,box", [((5, 7), (2, 8)), ((3, 4, 6), (2, 2, 4)), ((16, 8), (16, 8))])
def test_v_box_rows_lays_the_key_boxes_one_after_another(grid, box):
    """fp8's V before its transpose (``hopper_host._v_box_rows``): the grid's key boxes in row-major order of their
    numbers (the kernel's ``WindowBoxes.block_number``), each box's keys row-major, positions past the grid zero;
    from a strided view, fp8 bytes kept."""
    import itertools

    from gluon_attn.kernels.hopper_host import _v_box_rows
    Z, H, D = 2, 3, 16
    v = torch.randn(Z, *grid, H, D).to(torch.float8_e4m3fn)
    view = v.movedim(-2, 1)  # [Z, H, *grid, D], not contiguous
    rows = _v_box_rows(view, box)
    counts = [-(-g // b) for g, b in zip(grid, box)]
    assert rows.dtype == v.dtype and rows.shape == (Z, H, math.prod(counts) * math.prod(box), D)
    raw, got = view.view(torch.uint8), rows.view(torch.uint8)
    for number, blk in enumerate(itertools.product(*(range(c) for c in counts))):
        for r, inner in enumerate(itertools.product(*(range(b) for b in box))):
            pos = tuple(j * b + i for j, b, i in zip(blk, box, inner))
            row = got[:, :, number * math.prod(box) + r]
            if all(p < g for p, g in zip(pos, grid)):
                assert torch.equal(row, raw[(slice(None), slice(None), *pos)])
            else:
                assert not row.any()


def test_descales_are_for_fp8_inputs_in_every_dimension():
    from gluon_attn import na2d, na3d
    q2, q3 = torch.zeros(1, 6, 8, 2, 64, dtype=torch.float16), torch.zeros(1, 4, 6, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="na2d: descale_q/k/v are for fp8 inputs; these are fp16"):
        na2d(q2, q2, q2, 3, descale_q=0.5)
    with pytest.raises(ValueError, match="na3d: descale_q/k/v are for fp8 inputs; these are bf16"):
        na3d(q3, q3, q3, 3, descale_v=2.0)


@pytest.mark.compile
@pytest.mark.parametrize("dtype,d,window", [("fp16", 128, 1), ("bf16", 64, 2), ("fp8e4m3", 128, 1)])
def test_blackwell_window_builds_compile(dtype, d, window):
    """The sm_100a forward takes the same 1-D policy (``blackwell.Cfg.tile_blocks``: the key blocks its rows' windows
    reach; each softmax half masks those not wholly inside all of its rows' windows, against per-row bounds computed
    once a tile), one CTA a tile (a cluster's CTAs would share K/V tiles that their windows do not). Compile-verified
    only: tcgen05 MMAs, nothing spilled in the block loops; the one local-memory value is seq_ptr's second word's
    address, stored once and read at each partition's start."""
    from gluon_attn.inspection import analyze, compile_build
    from gluon_attn.kernels import blackwell_host

    build = blackwell_host.build(dtype, d, False, blackwell_host.default_config(d, dtype, False), "gluon_attention",
                                 window=window)
    assert build.constexprs["WINDOW"] == window and build.extra["num_ctas"] == 1 and "window" in build.description
    got = analyze(compile_build(build, "sm_100a"), "sm_100a", build.description, build.num_warps)
    rep = got.report
    assert rep.has("UTCHMMA") or rep.has("UTCQMMA")
    assert rep.loop_spill_instructions == 0 and got.sass.count(" STL") == 1


@pytest.mark.compile
@pytest.mark.parametrize("dtype,d,mode,boxes", [("fp16", 128, 4, ((16, 16), (8, 16))),
                                               ("fp8e4m3", 64, 7, ((32, 8), (8, 16))),
                                               ("bf16", 128, 9, ((2, 16, 8), (2, 8, 8)))])
def test_blackwell_box_builds_compile(dtype, d, mode, boxes):
    """The sm_100a forward takes the 2-D/3-D policy too (the Hopper forward's WINDOW 4-15): a tile is a box of 256
    positions whose halves along x are the two softmax partitions' 128 rows, loaded (and O stored) as 5-D descriptor
    boxes; the loader walks the key boxes its queries' windows reach (``Cfg.tile_boxes``), the MMA and correction
    partitions count them, and each softmax half masks the boxes not wholly inside all of its rows' windows against
    per-row windows computed once a tile (``masks.BoxRows``). One CTA a tile. Compile-verified only; the dense and
    1-D builds hash to the same SASS as before (checked when added). Two 64-bit seq_ptr offsets go to local memory
    in the prologue and are read at the partitions' starts (at most 2 instructions inside a block loop)."""
    from gluon_attn.inspection import analyze, compile_build
    from gluon_attn.kernels import blackwell_host

    cfg = blackwell_host.default_config(d, dtype, False)
    assert boxes in blackwell_host.window_boxes(cfg, d, len(boxes[0]))
    build = blackwell_host.build(dtype, d, False, cfg, "gluon_attention", window=mode, boxes=boxes)
    q, k, _, o = blackwell_host.block_shapes(d, cfg, boxes)  # (a half of the tile: TX / 2 along x)
    assert q == o and q[-len(boxes[0]) - 1:] == [boxes[0][0] // 2, *boxes[0][1:], d]
    assert build.extra["num_ctas"] == 1 and str(q) in build.signature["desc_q"] and str(k) in build.signature["desc_k"]
    got = analyze(compile_build(build, "sm_100a"), "sm_100a", build.description, build.num_warps)
    assert got.report.has("UTCHMMA") or got.report.has("UTCQMMA")
    assert got.report.loop_spill_instructions <= 2 and got.sass.count(" STL") <= 4


def test_neighborhood_ops_trace_and_record_autograd_on_meta_tensors():
    """na1d/na2d/na3d go through the custom op ``gluon_attn::neighborhood_attention`` where autograd, a mode or
    torch.compile needs it: on meta tensors its fake gives the output and lse shapes, autograd records its backward op
    (grads of the inputs' shapes, GQA included), and torch.compile(fullgraph=True) traces a call as that one op (with
    additional keys: ``attention``'s op and the merge), without a graph break."""
    import gluon_attn  # noqa: F401  (registers the ops)
    from gluon_attn import na1d, na2d, na3d

    q = torch.empty(2, 300, 4, 128, dtype=torch.float16, device="meta", requires_grad=True)
    kv = torch.empty(2, 300, 2, 128, dtype=torch.float16, device="meta", requires_grad=True)
    out = na1d(q, kv, kv, 31, stride=2)
    assert out.shape == q.shape and out.requires_grad
    out.sum().backward()
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape
    x = torch.empty(1, 40, 48, 4, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    out, lse = na2d(x, x, x, (9, 7), stride=(2, 1), return_lse=True)
    assert out.shape == x.shape and lse.shape == x.shape[:-1]
    (out.sum() + lse.sum()).backward()
    assert x.grad.shape == x.shape
    x3 = torch.empty(1, 6, 8, 10, 2, 64, dtype=torch.bfloat16, device="meta")
    assert na3d(x3, x3, x3, (3, 3, 5)).shape == x3.shape
    seen = []

    def backend(gm, example_inputs):
        seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    y = x.detach()
    torch.compile(lambda a: na2d(a * 2, a, a, (9, 7)).sum(), backend=backend, fullgraph=True)(y)
    torch.compile(lambda a: na2d(a, a, a, 5, additional_keys=a[:, 0], additional_values=a[:, 0]), backend=backend,
                  fullgraph=True)(y)
    assert len(seen) == 2 and torch.ops.gluon_attn.neighborhood_attention in seen[0]
    assert {torch.ops.gluon_attn.neighborhood_attention, torch.ops.gluon_attn.attention} <= set(seen[1])


def test_the_neighborhood_op_carries_the_pattern_tiles_and_gradients_to_the_kernels(monkeypatch):
    """The custom op's plumbing on CPU, the kernels' launches replaced by the fp32 reference (no GPU here): with
    inputs that require grad, na1d and na2d go through ``gluon_attn::neighborhood_attention``, whose implementation
    checks the call (a bad tile shape is refused naming it) and hands the pattern and the lse request to the
    launcher; autograd brings the pattern, the backward tiles, the lse's gradient and the deterministic flag to the
    backward op, whose gradients come back to the inputs."""
    import gluon_attn.neighborhood as nh
    from gluon_attn import validation
    from gluon_attn.kernels.backend import backend_for_arch

    monkeypatch.setattr(nh, "_sm90_backend", lambda what, q: backend_for_arch("sm_90a"))
    real_check = validation.check_qkv
    monkeypatch.setattr(validation, "check_qkv", lambda *a, **kw: real_check(*a, **{**kw, "require_cuda": False}))
    seen = {}

    def reference_forward(q, k, v, nb, scale, need_lse):
        out, lse = nh.na_reference(q, k, v, nb.kernel_size, nb.stride, nb.dilation, nb.is_causal, scale=scale,
                                   return_lse=True)
        seen["need_lse"] = need_lse
        return out.to(q.dtype), (lse if need_lse else None)

    monkeypatch.setattr(nh, "_na1d_forward", lambda q, k, v, window, scale, config, backend, need_lse, descales:
                        reference_forward(q, k, v, nh._pattern((q.shape[1],), window[0], window[1], window[3],
                                                               window[2]), scale, need_lse))
    monkeypatch.setattr(nh, "_na_boxes_forward", lambda q, k, v, nb, scale, config, boxes, backend, need_lse=True,
                        descales=(1.0, 1.0, 1.0): reference_forward(q, k, v, nb, scale, need_lse))

    def recorded_backward(d_out, q, k, v, out, lse, d_lse, kernel_size, stride, dilation, is_causal, scale,
                          bq, bkv, deterministic):
        seen.update(pattern=(kernel_size, stride, dilation, is_causal), tiles=(bq, bkv), d_lse=d_lse is not None,
                    deterministic=deterministic, lse=lse.shape)
        return 2 * d_out, torch.full_like(k, 3.0), torch.zeros_like(v)

    monkeypatch.setattr(nh, "na_backward", recorded_backward)
    gen = torch.Generator().manual_seed(5)
    make = lambda *s: torch.randn(*s, generator=gen).half()  # noqa: E731
    q, k, v = make(1, 37, 4, 64).requires_grad_(), make(1, 37, 2, 64).requires_grad_(), make(1, 37, 2, 64)
    out = nh.na1d(q, k, v, 9, stride=2, dilation=2, is_causal=True)
    want = nh.na_reference(q, k, v, 9, 2, 2, True)
    torch.testing.assert_close(out, want.to(out.dtype))
    assert out.requires_grad and seen["need_lse"]  # (the backward needs the lse)
    out.sum().backward()
    assert seen["pattern"] == ([9], [2], [2], [True]) and seen["tiles"] == (None, None) and not seen["d_lse"]
    assert seen["lse"] == q.shape[:-1] and (q.grad == 2).all() and (k.grad == 3).all()
    x = make(1, 12, 10, 2, 64).requires_grad_()
    out, lse = nh.na2d(x, x, x, (5, 3), stride=(1, 3), backward_q_tile_shape=(8, 16), return_lse=True)
    want, want_lse = nh.na_reference(x, x, x, (5, 3), (1, 3), return_lse=True)
    torch.testing.assert_close(out, want.to(out.dtype))
    torch.testing.assert_close(lse, want_lse)
    (out.sum() + lse.sum()).backward()
    assert seen["pattern"] == ([5, 3], [1, 3], [1, 1], [False, False]) and seen["tiles"][0] == [8, 16]
    assert seen["tiles"][1][0] >= 2 and seen["tiles"][1][0] * seen["tiles"][1][1] == 128  # (the resolved key box)
    assert seen["d_lse"] and not seen["deterministic"] and (x.grad == 5).all()  # (2 as q, 3 as k, 0 as v)
    with pytest.raises(ValueError, match="`q_tile_shape` .* is not taken"):
        torch.ops.gluon_attn.neighborhood_attention(x.detach(), x.detach(), x.detach(), [5, 3], [1, 1], [1, 1],
                                                    [False, False], 0.1, [3, 3], None, None, None, 1.0, 1.0, 1.0,
                                                    False, False)


def test_calls_with_additional_keys_take_a_route_keyed_on_them(monkeypatch):
    """A plain eager na1d/na2d call with additional keys (kernels, GPU and ``attention`` stood in for on the CPU)
    makes a route keyed on every tensor's signature, the additional ones included; a call of the same signature
    takes it (no checks again) and still merges its own additional keys; other additional keys or ones that require
    grad take no route of the first's. Every output and lse against the fp32 reference."""
    import gluon_attn.api as api
    import gluon_attn.neighborhood as nh
    from gluon_attn import validation
    from gluon_attn.kernels.backend import backend_for_arch
    from gluon_attn.reference import attention_reference

    monkeypatch.setattr(nh, "_sm90_backend", lambda what, q: backend_for_arch("sm_90a"))
    checks = []
    real_check = validation.check_qkv
    monkeypatch.setattr(validation, "check_qkv", lambda *a, **kw: checks.append(kw["what"]) or
                        real_check(*a, **{**kw, "require_cuda": False}))
    monkeypatch.setattr(api, "_plain_eager", lambda *tensors: all(type(t) is torch.Tensor for t in tensors))

    def reference_forward(q, k, v, nb, scale):
        out, lse = nh.na_reference(q, k, v, nb.kernel_size, nb.stride, nb.dilation, nb.is_causal, scale=scale,
                                   return_lse=True)
        return out.to(q.dtype), lse

    monkeypatch.setattr(nh, "_na1d_forward", lambda q, k, v, window, scale, config, backend, need_lse, descales:
                        reference_forward(q, k, v, nh._pattern((q.shape[1],), window[0], window[1], window[3],
                                                               window[2]), scale))
    monkeypatch.setattr(nh, "_na_boxes_forward", lambda q, k, v, nb, scale, config, boxes, backend, need_lse=True,
                        descales=(1.0, 1.0, 1.0): reference_forward(q, k, v, nb, scale))
    monkeypatch.setattr(api, "attention", lambda q, k, v, sm_scale=None, return_lse=False, **kw: (
        lambda o_l: (o_l[0].to(q.dtype), o_l[1]))(attention_reference(q, k, v, causal=False, sm_scale=sm_scale, return_lse=True)))
    nh._NA_ROUTES.clear()
    gen = torch.Generator().manual_seed(9)
    make = lambda *s: torch.randn(*s, generator=gen).half()  # noqa: E731
    for op, grid, kw in [(nh.na1d, (37,), dict(kernel_size=9, stride=2)),
                         (nh.na2d, (12, 10), dict(kernel_size=(5, 3), is_causal=(True, False)))]:
        routes = len(nh._NA_ROUTES)
        for turn, extra in enumerate([7, 7, 5]):
            q, k, v = make(2, *grid, 4, 32), make(2, *grid, 2, 32), make(2, *grid, 2, 32)
            ak, av = make(2, extra, 2, 32), make(2, extra, 2, 32)
            del checks[:]
            out, lse = op(q, k, v, **kw, additional_keys=ak, additional_values=av, return_lse=True, scale=0.3)
            ref, ref_lse = nh.na_reference(q, k, v, kw["kernel_size"], kw.get("stride", 1), 1,
                                           kw.get("is_causal", False), scale=0.3, additional_keys=ak,
                                           additional_values=av, return_lse=True)
            torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
            # (turn 1: the first's route, no checks; turns 0 and 2: checked, each leaving a route of its own)
            assert bool(checks) == (turn != 1) and len(nh._NA_ROUTES) == routes + (1 if turn < 2 else 2)
        key = lambda a: nh._route_key(q, k, v, a, av, 1)  # noqa: E731
        assert key(ak) is not None and key(ak) != key(ak[:, :3]) and key(ak.requires_grad_()) is None
    nh._NA_ROUTES.clear()


@pytest.mark.parametrize("grid,box", [((16, 24), (8, 8)), ((13, 21), (8, 16)), ((5, 7, 9), (2, 4, 8))])
def test_box_rows_lays_positions_out_box_after_box_and_rows_to_grid_puts_them_back(grid, box):
    """``common.box_rows`` (the 2-D/3-D backward's lse, delta and dQ rows; fp8's V boxes): box number (jx ny + jy)(nz)
    + jz, its positions row-major, ``fill`` past the grid; ``rows_to_grid`` the inverse into a strided view, scaled
    (one pass where the grid is whole boxes, through a copy where it is not)."""
    from gluon_attn.kernels.common import box_rows, rows_to_grid

    t = torch.randn(2, 3, *grid, 4)
    rows = box_rows(t, box, float("nan"))
    counts = [-(-g // b) for g, b in zip(grid, box)]
    size = math.prod(box)
    assert rows.shape == (2, 3, math.prod(counts) * size, 4)
    for number, at in enumerate(itertools.product(*(range(c) for c in counts))):
        for r, pos in enumerate(itertools.product(*(range(b) for b in box))):
            g = tuple(i * b + p for i, b, p in zip(at, box, pos))
            got = rows[:, :, number * size + r]
            if all(x < n for x, n in zip(g, grid)):
                assert torch.equal(got, t[(slice(None), slice(None), *g)])
            else:
                assert torch.isnan(got).all()
    assert box_rows(t[..., 0], box, float("inf")).shape == rows.shape[:3]  # (the lse's rows: no head dim)
    out = torch.zeros(2, 3, *grid, 6)[..., 1:5]  # (a strided view)
    rows_to_grid(rows.nan_to_num(0.0), grid, box, out, 2.0)
    torch.testing.assert_close(out, 2 * t)


def test_the_last_dimensions_dilation_groups_launch_as_heads_where_they_fold():
    """A dilation along the last spatial dimension is not a launch a group (the host's cost per call): where the
    groups are as long and a tensor's positions and heads merge in a view, na2d launches once per x group with y's
    groups as heads (group g's head h is head g H + h, K/V heads alike so that GQA's head h // G stays in its group),
    na1d once; each launch's view addresses exactly the elements of the per-group views it replaces. Otherwise (the
    groups of unequal length, strides that do not merge) a launch per group, as before."""
    from gluon_attn.neighborhood import _fold_dilation, _folds_heads, _group_views, _na1d_groups

    B, X, Y, H, H_KV, D = 2, 16, 12, 4, 2, 8
    q = torch.arange(B * X * Y * H * D, dtype=torch.float32).reshape(B, X, Y, H, D)
    k = torch.arange(B * X * Y * H_KV * D, dtype=torch.float32).reshape(B, X, Y, H_KV, D) + 1e6
    nb = neighborhood((X, Y), 3, dilation=(2, 3))
    assert _folds_heads(Y, 3, 2, (q, k)) and _fold_dilation(q, 2, 3).data_ptr() == q.data_ptr()
    launches = list(_group_views(nb, B, heads=True))
    assert len(launches) == 2 and len(list(_group_views(nb, B))) == 6
    for g0, (view, n) in enumerate(launches):
        vq, vk = view(q), view(k)
        assert n == 1 and vq.shape == (B, 3 * H, X // 2, Y // 3, D) and vk.shape == (B, 3 * H_KV, X // 2, Y // 3, D)
        for g1 in range(3):
            for h in range(H):
                assert torch.equal(vq[:, g1 * H + h], q[:, g0::2, g1::3, h])
                G = H // H_KV  # (the kernel's K/V head of query head g1 H + h is that group's head h // G)
                assert torch.equal(vk[:, (g1 * H + h) // G], k[:, g0::2, g1::3, h // G])
    lse = torch.arange(B * X * Y * H, dtype=torch.float32).reshape(B, X, Y, H)
    assert torch.equal(launches[1][0](lse.unsqueeze(-1))[:, 2 * H + 1, ..., 0], lse[:, 1::2, 2::3, 1])
    # (no fold: y's groups of unequal length, or a packed projection whose positions and heads do not merge)
    assert not _folds_heads(13, 3, 2, (q,))
    qkv = torch.zeros(B, X, Y, 3, H, D)[:, :, :, 0]
    assert not _folds_heads(Y, 3, 2, (q, qkv)) and _folds_heads(Y, 3, 2, (q,))
    # na1d: one launch of every group as heads
    t = torch.arange(B * 12 * H * D, dtype=torch.float32).reshape(B, 12, H, D)
    (one,) = _na1d_groups(4, (t,))
    assert one(t).shape == (B, 4 * H, 3, D)
    for g in range(4):
        for h in range(H):
            assert torch.equal(one(t)[:, g * H + h], t[:, g::4, h])
    assert len(_na1d_groups(4, (t[:, :10],))) == 4 and len(_na1d_groups(4, (t,), heads=False)) == 4
    assert len(_na1d_groups(1, (t,))) == 1


@pytest.mark.parametrize("B", [2, 1])
@pytest.mark.parametrize("dims,layout,kernel,stride,dilation,causal", [
    (2, (16, 18), (3, 5), (1, 2), (2, 3), (False, True)),  # (y's 3 groups as heads, x's 2 launches; one batch: one)
    (2, (15, 13), 3, 1, (3, 2), False),  # (y's groups of 7 and 6: a launch per group; x's 3 as batches: per batch)
    (2, (12, 18), 3, 1, (4, 3), (True, False)),  # (y's groups as heads, x's 4 as batches: a launch per batch)
    (3, (8, 6, 8), (3, 3, 3), 1, (2, 1, 2), (False, True, False)),  # (z's groups as heads, batches folded into x)
    (3, (7, 6, 8), 3, (1, 2, 1), (1, 2, 2), False),  # (z's groups as heads, a launch per batch: x of 7)
    (1, (24,), 5, 2, 4, True), (1, (23,), 5, 1, 4, False)])
def test_the_folded_launches_compute_each_group_as_the_per_group_launches_did(B, dims, layout, kernel, stride,
                                                                             dilation, causal, monkeypatch):
    """The forward's launches with the last dimension's dilation groups as heads, the kernels stood in for by the
    fp32 reference run on each launch's views as the kernel reads them (a window of kernel, stride and causal over
    each head's grid, no dilation; 3-D batches folded into x taken apart again): output and lse against the reference
    on the whole layout with its dilation, GQA included, where the groups fold and where they do not."""
    from types import SimpleNamespace

    from gluon_attn import neighborhood as na_mod
    from gluon_attn.neighborhood import _na1d_forward, _na_boxes_forward

    def window_of(view_window):
        return [tuple(w[i] for w in view_window) for i in range(3)]

    def boxes(q, k, v, *, window, sm_scale, return_lse, out, batches=1, **_):
        # 2-D: [B, heads, X, Y, D] views, lse [B, heads, tokens]; 3-D: [heads, Z X, Y, Z', D], lse [Z, heads, tokens]
        # with Z > 1 batches folded into x, else [heads, tokens]
        K, S, C = window_of(window)
        if len(window) == 2:
            heads_last = lambda t: t.movedim(1, -2)  # noqa: E731
            o, lse = na_reference(*map(heads_last, (q, k, v)), K, S, 1, C, scale=sm_scale, return_lse=True)
            out.copy_(o.movedim(-2, 1))
            return out, lse.movedim(-1, 1).flatten(2)
        split = lambda t: t.unflatten(1, (batches, -1)).movedim(0, -2)  # noqa: E731  ([Z, X, Y, Z', heads, D])
        o, lse = na_reference(*map(split, (q, k, v)), K, S, 1, C, scale=sm_scale, return_lse=True)
        out.copy_(o.movedim(-2, 0).flatten(1, 2))
        lse = lse.movedim(-1, 1).flatten(2)  # [Z, heads, tokens]
        return out, (lse if batches > 1 else lse[0])

    def launch(q, k, v, *, window, sm_scale, return_lse, out, **_):  # [B, heads, Lg, D] views
        K, S, C = window
        o, lse = na_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), K, S, 1, C, scale=sm_scale,
                              return_lse=True)
        out.copy_(o.transpose(1, 2))
        return out, lse.transpose(1, 2)

    backend = SimpleNamespace(module=SimpleNamespace(hopper_na_boxes=boxes, launch=launch,
                                                     fold_batches=lambda x, _boxes: x % 4 == 0))
    H, H_KV, D = 4, 2, 8
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, *layout, H, D, generator=gen)
    k, v = (torch.randn(B, *layout, H_KV, D, generator=gen) for _ in range(2))
    nb = neighborhood(layout, kernel, stride, dilation, causal)
    if dims >= 2:
        launches, real = [], na_mod._group_views

        def counted(*args):
            got = list(real(*args))
            launches.extend(got)
            return got

        monkeypatch.setattr(na_mod, "_group_views", counted)
        out, lse = _na_boxes_forward(q, k, v, nb, 0.3, None, None, backend)
        folded_x = dims == 3 and B > 1 and layout[0] // nb.dilation[0] % 4 == 0
        # (x's groups as the view's batches, a launch per batch, where the batches are fewer)
        x_batches = dims == 2 and B < nb.dilation[0] and layout[0] % nb.dilation[0] == 0
        groups = math.prod(nb.dilation[:-1]) // (nb.dilation[0] if x_batches else 1)
        groups *= B if x_batches or not (dims == 2 or folded_x) else 1
        assert len(launches) == groups * (1 if layout[-1] % nb.dilation[-1] == 0 else nb.dilation[-1])
    else:
        window = (nb.kernel_size[0], nb.stride[0], nb.is_causal[0], nb.dilation[0])
        out, lse = _na1d_forward(q, k, v, window, 0.3, None, backend)
    ref, ref_lse = na_reference(q, k, v, kernel, stride, dilation, causal, scale=0.3, return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B", [2, 1])
@pytest.mark.parametrize("dims,layout,kernel,dilation", [(1, (24,), 5, 4), (2, (16, 18), (3, 5), (2, 3)),
                                                         (2, (15, 13), 3, (3, 2)), (2, (12, 18), 3, (4, 3)),
                                                         (3, (7, 6, 8), 3, (1, 2, 2))])
def test_the_backward_launches_on_the_folded_views_as_the_forward(B, dims, layout, kernel, dilation, monkeypatch):
    """The backward's launches (the last dimension's dilation groups as heads where they fold), the kernels stood in
    for by autograd through the fp32 reference on each launch's views: each launch receives its views' own lse and
    lse gradient, and dQ, dK, dV match autograd through the reference on the whole dilated layout, GQA included."""
    from types import SimpleNamespace

    from gluon_attn import neighborhood as na_mod

    H, H_KV, D = 4, 2, 32
    nb = neighborhood(layout, kernel, 1, dilation, False)
    K, C = nb.kernel_size, nb.is_causal

    def grads(views, do, lse, d_lse, heads_dim):
        """dQ, dK, dV of the reference on [.., heads, ..] views (``heads_dim`` the heads' index), heads moved last."""
        to_last = lambda t: t.movedim(heads_dim, -2)  # noqa: E731
        if dims == 3:  # ([heads, X, Y, Z, D] of one batch)
            to_last = lambda t: t.movedim(0, -2).unsqueeze(0)  # noqa: E731
        leaves = [to_last(t).detach().requires_grad_() for t in views]
        o, l = na_reference(*leaves, K, 1, 1, C, scale=0.3, return_lse=True)
        got_lse = l.movedim(-1, 1).flatten(2)[0] if dims == 3 else \
            (l.movedim(-1, 1).flatten(2) if dims == 2 else l.transpose(1, 2))
        torch.testing.assert_close(lse, got_lse, atol=1e-5, rtol=1e-5)  # (the launch's own lse)
        loss = (o * to_last(do)).sum() + (l * (d_lse.reshape(got_lse.shape).movedim(1 if dims == 2 else 0, -1)
                                               .reshape(l.shape) if dims != 1 else d_lse.transpose(1, 2))).sum()
        return [g.squeeze(0).movedim(-2, 0) if dims == 3 else g.movedim(-2, heads_dim)
                for g in torch.autograd.grad(loss, leaves)]

    launches = []

    def boxes_bwd(do, q, k, v, o, lse, *, grad_lse, dq, dk, dv, **_):
        launches.append(q.shape)
        for dst, g in zip((dq, dk, dv), grads((q, k, v), do, lse, grad_lse, 1)):
            dst.copy_(g)

    def launch(do, q, k, v, o, lse, *, grad_lse, **_):
        launches.append(q.shape)
        return grads((q, k, v), do, lse, grad_lse, 1)

    backend = SimpleNamespace(bwd=SimpleNamespace(hopper_na_boxes_bwd=boxes_bwd, launch=launch))
    monkeypatch.setattr(na_mod, "_sm90_backend", lambda what, q: backend)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, *layout, H, D, generator=gen)
    k, v = (torch.randn(B, *layout, H_KV, D, generator=gen) for _ in range(2))
    out, lse = (t.contiguous() for t in na_reference(q, k, v, K, 1, dilation, C, scale=0.3, return_lse=True))
    do, d_lse = torch.randn_like(out), torch.randn_like(lse)
    got = na_mod.na_backward(do, q, k, v, out, lse, d_lse, K, (1,) * dims, nb.dilation, C, 0.3)
    folds = layout[-1] % nb.dilation[-1] == 0  # (the last dimension's groups as heads: one launch for them all)
    # (x's groups as the view's batches, a launch per batch, where the batches are fewer)
    x_batches = dims == 2 and B < nb.dilation[0] and layout[0] % nb.dilation[0] == 0
    per_launch = math.prod(nb.dilation) // (nb.dilation[-1] if folds else 1) // (nb.dilation[0] if x_batches else 1)
    assert len(launches) == per_launch * (B if dims == 3 or x_batches else 1)
    assert all(shape[0 if dims == 3 else 1] == (nb.dilation[-1] if folds else 1) * H for shape in launches)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, l = na_reference(*leaves, K, 1, dilation, C, scale=0.3, return_lse=True)
    ref = torch.autograd.grad((o * do).sum() + (l * d_lse).sum(), leaves)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
