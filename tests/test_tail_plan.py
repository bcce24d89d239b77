"""The persistent loop's last round (``common.tail_plan``): which units run whole, which as pieces."""
import pytest

from gluon_attn.kernels.common import MAX_PIECES, MIN_PIECE_BLOCKS, TailPlan, tail_plan, work_units


def _tiles(plan: TailPlan, num_pid_m: int, causal: bool):
    """The kernel's ``work_item`` walk on the host: (batch*head, query block, piece, pieces) per unit."""
    per_head = (num_pid_m + 1) // 2
    out = []
    for unit in range(plan.n_units):
        if unit < plan.n_full:
            if causal:
                hz, i = divmod(unit, per_head)
                blocks = sorted({i, num_pid_m - 1 - i})
                out += [(hz, m, 0, 1) for m in blocks]
            else:
                out.append((unit // num_pid_m, unit % num_pid_m, 0, 1))
            continue
        t, piece = divmod(unit - plan.n_full, plan.pieces)
        if causal:
            hz, i = divmod(plan.n_full + t // 2, per_head)
            m = i if t % 2 else num_pid_m - 1 - i
            if t % 2 and m == num_pid_m - 1 - i:
                continue  # the second tile of a single middle block: empty
        else:
            hz, m = divmod(plan.n_full + t, num_pid_m)
        out.append((hz, m, piece, plan.pieces))
    return out


@pytest.mark.parametrize("num_pid_m,num_hz,causal,expect", [
    (32, 128, False, TailPlan(4092, 8, 4)),  # N=4096, Z*H=128 on 132 programs: 4 tiles left over
    (64, 128, False, TailPlan(8184, 8, 8)),  # N=8192
    (64, 128, True, TailPlan(4092, 4, 8)),  # causal N=8192: 4 pairs -> 8 tiles of 29..36 blocks
    (16, 128, False, TailPlan(2048, 1, 0)),  # 2048 tiles: 68 left over, too many to split
    (8, 3, True, TailPlan(0, 1, 24)),  # 12 pairs as 24 single tiles (blocks too few to cut)
])
def test_seed_shapes(num_pid_m, num_hz, causal, expect):
    assert tail_plan(num_pid_m, num_hz, causal, True, 132, num_pid_m * 128, 128, 128) == expect


@pytest.mark.parametrize("num_pid_m,num_hz,causal", [
    (32, 128, False), (64, 128, True), (8, 3, True), (33, 5, False), (33, 8, True), (34, 4, False), (9, 1, True),
    (1, 1, False), (200, 7, True)])
def test_every_tile_once_and_every_key_block_once(num_pid_m, num_hz, causal):
    n_progs, block = 132, 128
    plan = tail_plan(num_pid_m, num_hz, causal, True, n_progs, num_pid_m * block - 5, block, block)
    assert plan.pieces & (plan.pieces - 1) == 0 and plan.pieces <= MAX_PIECES  # the kernel shifts by log2
    if plan.n_tail_tiles:  # whole rounds, then at most one tail item per program
        assert plan.n_full % n_progs == 0 and plan.n_tail_tiles * plan.pieces <= n_progs
    seen = {}
    for hz, m, piece, pieces in _tiles(plan, num_pid_m, causal):
        n_blocks = m + 1 if causal else num_pid_m
        lo, hi = piece * n_blocks // pieces, (piece + 1) * n_blocks // pieces  # ``piece_range``
        if pieces > 1:
            assert hi - lo >= MIN_PIECE_BLOCKS // 2
        seen.setdefault((hz, m), []).append((lo, hi))
    assert sorted(seen) == [(hz, m) for hz in range(num_hz) for m in range(num_pid_m)]
    for ranges in seen.values():
        ranges.sort()
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_off_and_grouped_causal_run_whole():
    whole = TailPlan(work_units(32, 128, False, True), 1, 0)
    assert tail_plan(32, 128, False, True, 132, 4096, 128, 128, enabled=False) == whole
    grouped = tail_plan(64, 128, True, False, 132, 8192, 128, 128)
    assert grouped == TailPlan(work_units(64, 128, True, False), 1, 0)
