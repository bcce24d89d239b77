"""Compile-only checks of the sm_90a kernel: every dtype x head dim x causal, no GPU needed."""
import itertools
import re

import pytest

from gluon_attn.inspection import BuildRequest, inspect_kernel, mma_loops, sass_rows, wgmma_operand_hazards
from gluon_attn.kernels.hopper import LOADER_REGS
from gluon_attn.kernels.hopper_host import HopperConfig, default_config

DTYPES = ["fp16", "bf16", "fp8e5", "fp8e4m3"]
GRID = list(itertools.product(DTYPES, [64, 128, 256], [False, True]))


def _unmasked_loop_spills(sass: str) -> int:
    """LDL/STL in the MMA loops that do not mask (no FSEL: not the diagonal or key-tail loop)."""
    rows = sass_rows(sass)
    total = 0
    for lo, hi in mma_loops(sass):
        body = [line for addr, line in rows if lo <= addr <= hi]
        if not any(" FSEL" in line for line in body):
            total += sum(1 for line in body if " LDL" in line or " STL" in line)
    return total


@pytest.mark.compile
@pytest.mark.parametrize("dtype,head_dim,causal", GRID)
def test_hopper_kernel_compiles_clean(dtype, head_dim, causal):
    res = inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", dtype=dtype, head_dim=head_dim,
                                      causal=causal, kernel_name="auto"))
    rep = res.report
    fp8 = dtype.startswith("fp8")
    mma = "QGMMA" if fp8 else "HGMMA"
    assert rep.has(mma), rep.histogram[:5]
    assert not rep.has("HMMA")  # no fallback to the pre-Hopper MMA path
    # No register spills anywhere: every default build is spill-free under Triton 3.9 with the wheel's 12.9
    # ptxas, the 192 x 128 D=64 tiles at 160 registers included (on 3.6 they spilled per tile, and causal in
    # its masked loop: NOTES v17, v25, v62).
    cfg = default_config(head_dim, dtype, causal)
    assert _unmasked_loop_spills(res.sass) == 0
    assert rep.spill_instructions == 0 and rep.local_bytes == 0 and rep.stack_bytes == 0
    # P's wgmma reads its A operand from registers: the 12.9 ptxas must not reuse them before the MMA retires
    assert wgmma_operand_hazards(res.sass) == []
    expected = "cutlass_gluon_attention" if fp8 else "gluon_attention"
    assert rep.kernel_name == expected
    assert f"Function : {expected}" in res.sass
    # Warp specialization: two or three (192-row tiles) 4-warp consumer warpgroups, the first the default
    # partition, and a 1-warp loader whose warpgroup is padded to 4 warps at 24 registers, with the register
    # split applied by setmaxnreg.
    assert rep.num_warps == 4 and rep.total_warps == 4 + 4 * cfg.consumers
    assert cfg.consumer_regs in rep.setmaxnreg
    assert min(rep.setmaxnreg) <= 512 - cfg.consumers * cfg.consumer_regs  # the loader's warpgroup gives its up
    assert 24 in rep.setmaxnreg
    # one loader warp issues every copy (a 4-warp loader elected a warp per copy, after a partition bar.sync)
    assert not [t for t in res.sass.splitlines() if "UTMALDG" in t and "@" in t.split("UTMALDG")[0]]
    assert rep.has("UTMALDG") and rep.has("SYNCS")
    if head_dim == 256:
        # O leaves from registers (64 x 256 fp32 per warpgroup: no room for a staging buffer)
        assert not rep.has("UTMASTG") and rep.has("STG")
    else:
        assert rep.has("UTMASTG")  # O leaves through TMA
    assert rep.shared_bytes <= 232448


@pytest.mark.compile
def test_two_names_never_share_a_binary():
    reqs = [BuildRequest(kernel="attention", arch="sm_90a", dtype="fp16", head_dim=64, kernel_name=n)
            for n in ("plain", "cutlass", "plain")]
    names = [inspect_kernel(r).report.kernel_name for r in reqs]
    assert names == ["gluon_attention", "cutlass_gluon_attention", "gluon_attention"]


@pytest.mark.compile
def test_config_knobs_change_the_binary():
    pp, flat = (inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", dtype="fp16", head_dim=128,
                                            config={"PINGPONG": on})) for on in (1, 0))
    assert pp.report.has("HGMMA") and flat.report.has("HGMMA")
    # Ping-pong adds the turns: hardware named barriers 8 and 9 (256 threads: the warpgroup whose turn it is
    # syncs, the one before it in the cycle arrives), no mbarrier (SYNCS) instruction more.
    assert dict(pp.report.histogram)["SYNCS"] == dict(flat.report.histogram)["SYNCS"]
    for bar in ("0x8", "0x9"):
        assert f"BAR.SYNC.DEFER_BLOCKING {bar}, 0x100" in pp.sass and f"BAR.ARV {bar}, 0x100" in pp.sass
        assert f" {bar}, 0x100" not in flat.sass
    # Three consumer warpgroups (the D=64 tile) cycle through 8, 9 and 10; Triton's own partition barriers keep
    # to ids below 8 (NAMED_BARRIER_BASE), so the two never share one.
    three = inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", dtype="fp16", head_dim=64,
                                        config={"BLOCK_M": 192, "KV_STAGES": 2, "PINGPONG": 1})).sass
    ids = {int(m, 16) for m in re.findall(r"BAR\.(?:SYNC\.DEFER_BLOCKING|ARV) (0x[0-9a-f]+)", three)}
    assert {8, 9, 10} <= ids and all(i < 8 for i in ids - {8, 9, 10}), ids


@pytest.mark.compile
@pytest.mark.parametrize("dtype,head_dim,causal", [("fp16", 128, True), ("fp8e4m3", 128, False),
                                                   ("bf16", 64, False)])
def test_dynamic_scheduler_builds(dtype, head_dim, causal):
    """DYNAMIC: the loader takes units from a global counter (one atomic add per unit, a GPU-scope
    ATOMG) and publishes them beside the Q tiles; the static schedule has no atomic. Both spill-free."""
    def build(dynamic):
        return inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", dtype=dtype, head_dim=head_dim,
                                           causal=causal, kernel_name="auto",
                                           config={"DYNAMIC": dynamic, "BLOCK_M": 128, "PINGPONG": False})).report
    dyn, static = build(1), build(0)
    assert dyn.has("ATOMG") and not static.has("ATOMG")
    assert dyn.spill_instructions == 0 and static.spill_instructions == 0
    assert dyn.shared_bytes > static.shared_bytes  # the unit numbers beside the Q slots


@pytest.mark.compile
def test_single_tile_units_build():
    """Long causal contexts under the dynamic scheduler take one tile per unit, longest first (``singles``):
    that build is spill-free and its MMA loops are the pairs build's (the same wgmmas, lengths within 2%: only the
    unit -> tile mapping differs); shorter contexts keep the pairs."""
    from gluon_attn.inspection import (compile_build, mma_loop_spills, resource_usage, sass_instructions,
                                      sass_rows, sass_text)
    from gluon_attn.kernels import hopper_host

    cfg = default_config(128, "fp16", True, 32768)
    assert cfg.DYNAMIC and hopper_host.singles(cfg, True, False, 32768) and hopper_host.singles(cfg, True, False, 16384)
    assert not hopper_host.singles(cfg, True, False, 8192) and not hopper_host.singles(cfg, True, True, 32768)
    assert not hopper_host.singles(HopperConfig(DYNAMIC=False), True, False, 32768)

    def loops(single):
        cubin = compile_build(hopper_host.build("fp16", 128, True, cfg, "gluon_attention", single_tiles=single),
                              "sm_90a").asm["cubin"]
        sass = sass_text(cubin)
        rows = sass_rows(sass)
        ops = [sass_instructions("\n".join(line for addr, line in rows if lo <= addr <= hi))
               for lo, hi in mma_loops(sass)]
        return ops, mma_loop_spills(sass), resource_usage(cubin).get("LOCAL", 0), sass

    pairs, pair_spills, _, pair_sass = loops(False)
    single, single_spills, local, single_sass = loops(True)
    assert single_sass != pair_sass
    assert len(single) == len(pairs) >= 2
    for s_ops, p_ops in zip(single, pairs):
        # (ptxas moves a few register copies: 462 vs 466 instructions in the unmasked loop when this was written)
        assert [op for op in s_ops if "GMMA" in op] == [op for op in p_ops if "GMMA" in op]
        assert abs(len(s_ops) - len(p_ops)) <= 0.02 * len(p_ops)
    assert single_spills == 0 and pair_spills == 0 and local == 0


def _row_max_depth(sass: str) -> list[int]:
    """Per MMA loop: the longest chain of dependent FMNMX before the loop's first shuffle (the row max
    of S's first row inside each thread)."""
    import re
    rows = sass_rows(sass)
    depths = []
    for lo, hi in mma_loops(sass):
        depth, best = {}, 0
        for addr, line in rows:
            if not lo <= addr <= hi:
                continue
            if "SHFL" in line:
                break
            m = re.search(r"FMNMX (R\d+), (R\d+), (R\d+)", line)
            if m:
                depth[m.group(1)] = 1 + max(depth.get(m.group(2), 0), depth.get(m.group(3), 0))
                best = max(best, depth[m.group(1)])
            elif (w := re.search(r"\*/\s+(?:@!?U?P\w+\s+)?[A-Z0-9_.]+ (R\d+)", line)):
                depth.pop(w.group(1), None)  # overwritten by something else
        depths.append(best)
    return depths


@pytest.mark.compile
@pytest.mark.parametrize("dtype,head_dim,causal,knobs", [
    ("fp16", 128, False, {}), ("fp8e4m3", 128, True, {}), ("bf16", 64, False, {}),
    ("fp8e4m3", 128, False, {"KV_STAGES": 3, "SUM_MMA": False})])
def test_row_max_is_a_tree(dtype, head_dim, causal, knobs):
    """S's row max inside a thread is a tree of independent FMNMX (depth log2 of the 2 x BLOCK_N / 8 values):
    Triton 3.9 reduces ``gl.max`` that way (3.6 made one dependent chain of 15-31, which the ROW_TREE knob,
    removed with 3.6, halved by hand: NOTES v23, v62)."""
    res = inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", dtype=dtype, head_dim=head_dim,
                                      causal=causal, config={"BLOCK_M": 128, **knobs}))
    assert res.report.spill_instructions == 0
    depths = _row_max_depth(res.sass)
    assert len(depths) >= 2 and max(depths) <= 6, depths


def test_default_configs_are_valid():
    for dtype, d, causal in itertools.product(DTYPES, [64, 128], [None, False, True]):
        cfg = default_config(d, dtype, causal)
        assert cfg.invalid_reasons(d, dtype) == []
    # The rule for classes without a table entry (causal unknown): the deepest ring that fits.
    assert default_config(128, "fp16").KV_STAGES == 2 and default_config(64, "fp16").KV_STAGES == 4


def test_invalid_configs_say_why():
    assert any("shared memory" in r for r in HopperConfig(KV_STAGES=4).invalid_reasons(128, "fp16"))
    # Three warpgroups at 160 registers cannot hold D=128's S + P + O.
    assert any("registers: ~192 live per consumer thread > 160" in r
               for r in HopperConfig(BLOCK_M=192).invalid_reasons(128, "fp16"))
    assert any("BLOCK_M 256 not in (64, 128, 192)" in r for r in HopperConfig(BLOCK_M=256).invalid_reasons(64, "fp16"))
    # One consumer warpgroup: no turns to take; two programs an SM must fit the shared memory twice (D=128's do not).
    assert any("PINGPONG takes turns" in r
               for r in HopperConfig(BLOCK_M=64, PINGPONG=True).invalid_reasons(64, "fp16"))
    assert any("shared memory: 2 x" in r for r in HopperConfig(BLOCK_M=64).invalid_reasons(128, "fp16"))
    assert HopperConfig(BLOCK_M=64).invalid_reasons(64, "fp16") == []
    assert any("KV_STAGES must be >= 2" in r for r in HopperConfig(KV_STAGES=1).invalid_reasons(64, "fp16"))
    assert any("head dim 80" in r for r in HopperConfig().invalid_reasons(80, "fp16"))
    assert HopperConfig().invalid_reasons(96, "fp16") == []  # (the D=128 kernel's: ``kernel_head_dim``)
    # Head dim 256: 64-key blocks and one Q slot per warpgroup; two K/V stages fit, three do not, and three
    # warpgroups at 160 registers cannot hold O (128 registers a thread) beside S and P.
    assert HopperConfig(KV_STAGES=2).invalid_reasons(256, "fp16") == []
    assert any("shared memory" in r for r in HopperConfig(KV_STAGES=3).invalid_reasons(256, "fp16"))
    assert any("registers" in r for r in HopperConfig(BLOCK_M=192).invalid_reasons(256, "fp16"))


def test_register_budgets_fill_the_register_file():
    """The consumers' setmaxnreg budget follows the tile: two warpgroups at 240, three at 160, with the
    loader's warpgroup at 24 within the 64K registers."""
    assert (HopperConfig(BLOCK_M=128).consumer_regs, HopperConfig(BLOCK_M=192).consumer_regs) == (240, 160)
    for cfg in (HopperConfig(BLOCK_M=128), HopperConfig(BLOCK_M=192)):
        assert cfg.consumers * 128 * cfg.consumer_regs + 128 * 24 <= 65536


def test_inspect_attention_rejects_unsupported():
    with pytest.raises(ValueError, match="head dim 80"):
        inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", head_dim=80))
    with pytest.raises(ValueError, match="unknown config keys"):
        inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", config={"BLOK_M": 64}))
    # A knob that went (NOTES v33) is refused by name, with the ones that remain.
    with pytest.raises(ValueError, match=r"unknown config keys \['OVERLAP'\].*KV_STAGES"):
        inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", config={"OVERLAP": 0}))


@pytest.mark.compile
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_p_is_packed_four_keys_per_register_without_byte_shuffles(causal):
    """fp8 P crosses the loop edge as f16 pairs and two paired converts build each operand register
    next to its PV wgmma: no PRMT byte shuffling (packed early it took PRMT/LOP3/SHF per register)."""
    rep = inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", dtype="fp8e4m3", head_dim=128,
                                      causal=causal)).report
    assert dict(rep.histogram).get("PRMT", 0) == 0
    assert rep.spill_instructions == 0 and rep.stack_bytes == 0


@pytest.mark.compile
def test_loop_spills_are_told_apart_from_per_tile_spills():
    """``mma_loop_spills`` counts local-memory accesses inside the K/V loops only: one placed in a loop's body
    counts, one outside every loop does not; the masked loop is told apart from the unmasked one."""
    from gluon_attn.inspection import mma_loop_spills

    sass = inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", dtype="fp16", head_dim=64)).sass
    loops = mma_loops(sass)
    assert len(loops) >= 2  # the unmasked and the masked loop
    assert mma_loop_spills(sass) == 0
    lines = sass.splitlines()
    def with_spill_at(addr):
        i = next(n for n, line in enumerate(lines) if f"/*{addr:04x}*/" in line)
        forged = lines[i].replace(lines[i].split("*/", 1)[1].split(";")[0], "                   STL [R1], R0 ")
        return "\n".join(lines[:i] + [forged] + lines[i + 1:])
    inside = loops[0][0] + 0x10
    outside = min(addr for addr, _ in sass_rows(sass) if not any(lo <= addr <= hi for lo, hi in loops))
    assert mma_loop_spills(with_spill_at(inside)) == 1
    assert mma_loop_spills(with_spill_at(outside)) == 0


def _loop_opcodes(sass: str, opcode: str) -> list[int]:
    """Count of an opcode in each MMA loop's body."""
    rows = sass_rows(sass)
    return [sum(1 for addr, line in rows if lo <= addr <= hi and f" {opcode}" in line) for lo, hi in mma_loops(sass)]


@pytest.mark.compile
@pytest.mark.parametrize("dtype,causal", [("fp8e4m3", False), ("fp8e5", True), ("fp16", False), ("bf16", True)])
def test_sum_mma_moves_the_row_sums_to_a_wgmma(dtype, causal):
    """SUM_MMA: each K/V loop issues a 64 x 8 wgmma beside PV (against the ones tile) and its softmax
    no longer adds P's values (68 FADD per loop body without it; with it, the 4 of l_acc += a block's sums).
    16-bit D=128 keeps two Q tiles per consumer: its one shared ones tile (2 KB) fits beside them, and
    the values it spills (18 non-causal, 57 causal at 240 registers) are per tile, not in the loops."""
    fp8 = dtype.startswith("fp8")
    def build(sum_mma):
        return inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", dtype=dtype, head_dim=128, causal=causal,
                                           config={"SUM_MMA": sum_mma, "KV_STAGES": 2}))
    on, off = build(True), build(False)
    if fp8:
        assert on.report.spill_instructions == 0
    else:
        assert on.report.spill_instructions <= 64 and on.report.loop_spill_instructions == 0
    assert off.report.spill_instructions == 0
    assert on.report.shared_bytes <= 232448
    # K = 128 keys in steps of 32 bytes: 4 QGMMA (fp8) or 8 HGMMA (16-bit)
    wgmma, steps = ("QGMMA.64x8x32", 4) if fp8 else ("HGMMA.64x8x16", 8)
    assert all(n == steps for n in _loop_opcodes(on.sass, wgmma))
    assert not any(_loop_opcodes(off.sass, wgmma))
    fadd_on, fadd_off = _loop_opcodes(on.sass, "FADD"), _loop_opcodes(off.sass, "FADD")
    assert len(fadd_on) == len(fadd_off) >= 2
    assert max(fadd_on) <= 8 and min(fadd_off) >= 64, (fadd_on, fadd_off)


@pytest.mark.compile
@pytest.mark.parametrize("dtype,head_dim,causal", list(itertools.product(["fp16", "bf16"], [64, 128, 256],
                                                                            [False, True])))
def test_packed_sequence_builds_compile(dtype, head_dim, causal):
    """The varlen build (per-sequence lengths from the device table, the last tile of a sequence stored
    with masked stores, paired or 16-byte: never 16-bit scalars) keeps the MMA loops free of spills; any local
    memory is a few values carried across the partitions' register split (D=256 causal, which stores O
    from the registers: a few per tile, outside the MMA loops)."""
    res = inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", dtype=dtype, head_dim=head_dim,
                                      causal=causal, varlen=True))
    rep = res.report
    assert rep.has("HGMMA") and rep.has("UTMALDG")
    assert _unmasked_loop_spills(res.sass) == 0
    if default_config(head_dim, dtype, causal).BLOCK_M == 192:
        # D=64's three warpgroups at 160 registers: as the dense build (above), some values per tile
        assert rep.spill_instructions <= 200
    else:
        assert rep.loop_spill_instructions == 0
        if head_dim == 256:  # (paired O stores: 12 -> 28 instructions, NOTES v41)
            assert rep.spill_instructions <= 32 and rep.stack_bytes <= 32
        else:
            assert rep.spill_instructions <= 16 and rep.stack_bytes <= 16
    assert rep.has("STG")  # the masked tail stores
    assert "STG.E.U16" not in res.sass and "STG.E.16" not in res.sass, "16-bit scalar stores of O"
    assert "varlen" in rep.description
    # Only the loader reads the sequence table (a binary search: a chain of dependent global loads per unit);
    # the consumers read where each unit lies from shared memory beside its Q slot.
    budgets = _global_load_budgets(res.sass)
    assert budgets and set(budgets) == {int(LOADER_REGS)}, budgets


def _global_load_budgets(sass: str) -> list:
    """The setmaxnreg budget in force at each global load (LDG) of the SASS, in address order."""
    budget, found = None, []
    for _, ins in sass_rows(sass):
        m = re.search(r"USETMAXREG\.\S+\s+(?:UP\d+,\s*)?0x([0-9a-f]+)", ins)
        if m:
            budget = int(m.group(1), 16)
        if re.search(r"\bLDG\b", ins):
            found.append(budget)
    return found


@pytest.mark.compile
def test_packed_sequences_refuse_fp8():
    with pytest.raises(ValueError, match="dtypes fp16, bf16"):
        inspect_kernel(BuildRequest(kernel="attention", arch="sm_90a", dtype="fp8e4m3", varlen=True))


@pytest.mark.compile
@pytest.mark.parametrize("dtype,head_dim,n_kv", [("bf16", 128, 1024), ("fp16", 64, 1024), ("bf16", 64, 4096)])
def test_decode_chunks_combine_in_their_launch(dtype, head_dim, n_kv):
    """COMBINE (decode's split in one launch): each warpgroup's part leaves by plain stores (no TMA store), then a
    GPU-scope fence, the warpgroup's barrier and one acq_rel atomic add per warpgroup (the arrival); the last to
    arrive fences again and reads the parts back. The build without it has none of this; both spill-free in the
    two-consumer tiles. The three-consumer 192-row tiles (head dim 64 from 4096 keys, 160 registers a thread) spill
    a few registers (23 LDL/STL, 32 bytes of stack), none in the MMA loops."""
    from gluon_attn.inspection import compile_build, mma_loop_spills, sass_text
    from gluon_attn.kernels import hopper_host

    cfg = default_config(head_dim, dtype, False, n_kv)

    def sass(combine):
        build = hopper_host.build(dtype, head_dim, False, cfg, "gluon_attention", combine=combine)
        return sass_text(compile_build(build, "sm_90a").asm["cubin"])

    combined, plain = sass(True), sass(False)
    atoms = [line for line in combined.splitlines() if re.search(r"\bATOMG?\.", line)]
    assert atoms and all(".ADD" in line for line in atoms), atoms
    assert "MEMBAR" in combined or "FENCE" in combined
    assert "UTMASTG" not in combined and "STG" in combined
    assert not re.search(r"\bATOMG?\.", plain) and "UTMASTG" in plain
    assert not re.search(r"\b(LDL|STL)\b", plain) and mma_loop_spills(combined) == 0
    if cfg.consumers == 2:
        assert not re.search(r"\b(LDL|STL)\b", combined)
