"""Compile-only checks of the sm_100a kernel (no Blackwell GPU exists here: these are its only checks)."""
import dataclasses
import itertools
import re

import pytest

from gluon_attn.inspection import (BuildRequest, analyze, back_branches, compile_build, innermost, inspect_kernel,
                                   make_build, sass_instructions, sass_rows)
from gluon_attn.kernels import blackwell, blackwell_host
from gluon_attn.kernels.blackwell_host import BlackwellConfig, default_config

DTYPES = ["fp16", "bf16", "fp8e5", "fp8e4m3"]
GRID = list(itertools.product(DTYPES, [64, 128], [False, True], ["plain", "cutlass"]))


def inspect(req: BuildRequest):
    """``inspect_kernel``: ``compile_build`` passes the build's own compile options (``KernelBuild.extra``: the
    cluster size, ``num_ctas``)."""
    return inspect_kernel(req)


_UNIFORM_BACK_BRANCH = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+BRA\.U\s+!?UP\d,\s+0x([0-9a-f]+)")


def block_loops(sass: str) -> list[tuple[int, int]]:
    """Address spans of the innermost loops that run once per K/V block: the softmax's (exp2 on MUFU) and the
    MMA warp's (tcgen05 MMAs). Loops are backward branches, uniform-predicated ones (``BRA.U !UPn``) included."""
    rows = sass_rows(sass)
    spans = list(back_branches(sass))
    for addr, line in rows:
        m = _UNIFORM_BACK_BRANCH.match(line)
        if m and int(m.group(2), 16) < addr:
            spans.append((int(m.group(2), 16), addr))
    hot = ("MUFU.EX2", "UTCHMMA", "UTCQMMA")
    return [(lo, hi) for lo, hi in innermost(spans)
            if any(lo <= a <= hi and any(op in line for op in hot) for a, line in rows)]


def local_lines(sass: str) -> list[tuple[int, str]]:
    return [(a, line) for a, line in sass_rows(sass) if re.search(r"\b(LDL|STL)\b", line)]


def block_loop_locals(sass: str) -> int:
    loops = block_loops(sass)
    return sum(1 for a, _ in local_lines(sass) if any(lo <= a <= hi for lo, hi in loops))


def mnemonics(sass: str) -> set[str]:
    return set(sass_instructions(sass))


def assert_no_spills(res):
    rep = res.report
    assert local_lines(res.sass) == [] and rep.spill_instructions == 0, local_lines(res.sass)[:4]
    assert rep.stack_bytes == 0 and rep.local_bytes == 0


@pytest.mark.compile
@pytest.mark.parametrize("dtype,head_dim,causal,name", GRID)
def test_blackwell_kernel_compiles(dtype, head_dim, causal, name):
    res = inspect(BuildRequest(kernel="attention", arch="sm_100a", dtype=dtype, head_dim=head_dim, causal=causal,
                               kernel_name=name))
    rep = res.report
    ops = mnemonics(res.sass)
    fp8 = dtype.startswith("fp8")
    assert rep.has("UTCQMMA" if fp8 else "UTCHMMA"), rep.histogram[:5]
    assert not rep.has("HGMMA") and not rep.has("HMMA")
    # tcgen05 tensor-memory loads and stores (S, P, the statistics, O) and the TMA engine.
    assert rep.has("LDTM") and rep.has("STTM")
    assert rep.has("UTMALDG") and rep.has("UTMASTG")
    # Packed FP32x2: the softmax's exponent arguments (fma2) and the correction's O rescale and 1 / l (mul2).
    assert rep.has("FFMA2") and rep.has("FMUL2")
    # Tensor memory: S and O of two halves, within the 512 columns; shared memory within 227 KB per CTA.
    assert 0 < rep.tmem_columns <= 512
    assert rep.shared_bytes <= blackwell_host.SM100_SMEM_BYTES
    # Partitions: correction (4 warps, default), load 1, mma 1, softmax 4 + 4, epilogue 1, schedule 1 -> 16
    # warps, whole warpgroups for setmaxnreg.
    assert rep.num_warps == 4 and sum(blackwell_host.WORKER_WARPS) + 4 == 16 and rep.total_warps == 16
    # Register budgets: softmax, the 1-warp partitions' warpgroup, the correction partition what is left;
    # together the whole register file.
    cfg = default_config(head_dim, dtype, causal)
    one_warp = int(blackwell.MMA_REGS)
    assert {cfg.SOFTMAX_REGS, one_warp, cfg.correction_regs()} <= set(rep.setmaxnreg)
    assert 4 * 32 * (2 * cfg.SOFTMAX_REGS + one_warp + cfg.correction_regs()) == 65536
    expected = "gluon_attention" if name == "plain" else "cutlass_gluon_attention"
    assert rep.kernel_name == expected and f"Function : {expected}" in res.sass
    # Cluster launch control: the schedule partition's try_cancel (UGETNEXTWORKID; a cluster's answer goes to
    # every CTA: BROADCAST) and its query of the answer.
    assert rep.has("UGETNEXTWORKID")
    ptx = res.compiled.asm["ptx"]
    assert "clusterlaunchcontrol.try_cancel" in ptx and "clusterlaunchcontrol.query_cancel.get_first_ctaid" in ptx
    cluster = blackwell_host.cluster_fits(head_dim, dtype, causal)
    assert cfg.CLUSTER == (2 if cluster else 1)
    assert res.compiled.metadata.num_ctas == cfg.CLUSTER
    if cluster:
        # Non-causal 16-bit D=128: a 2-CTA cluster. Every MMA is a two-CTA tcgen05 MMA issued by the pair's
        # leader, every commit multicast to both CTAs, every TMA load the two-CTA form (completing on the
        # leader's barrier), the tensor memory allocated for the pair, the try_cancel answer broadcast.
        assert ".explicitcluster" in ptx and ".reqnctapercluster 2" in ptx
        assert {op for op in ops if op.startswith("UTCHMMA")} == {"UTCHMMA.2CTA"}
        assert {op for op in ops if op.startswith("UTCBAR")} == {"UTCBAR.2CTA.MULTICAST"}
        assert {op for op in ops if op.startswith("UTMALDG")} == {"UTMALDG.4D.2CTA"}
        assert "UTCATOMSWS.2CTA.FIND_AND_SET.ALIGN" in ops and "UGETNEXTWORKID.BROADCAST" in ops
        assert "tcgen05.mma.cta_group::2" in ptx and "cta_group::1" not in ptx
    else:
        assert ".reqnctapercluster" not in ptx and not any(".2CTA" in op for op in ops)
        assert "UGETNEXTWORKID.SELFCAST" in ops and "cta_group::2" not in ptx
    if name == "plain":
        # No register spills: no local-memory instruction anywhere in the SASS.
        assert_no_spills(res)
    else:
        # Under the cutlass_ name ptxas 13.4 keeps the values computed before the partitions split and used in
        # them (the thread index and its warpgroup-relative form; for fp8, the auto name's dtype, nothing else) in
        # local memory: stored in the prologue, reloaded where a partition starts and once per unit, never in a
        # per-block loop. The 16-bit builds keep more there, and the causal ones reload a few words in the
        # softmax's block loops. The plain name, the 16-bit default, has none (above).
        stack, per_block = CUTLASS_LOCAL[(fp8, causal)]
        assert 0 < rep.stack_bytes <= stack and rep.local_bytes == 0
        assert block_loop_locals(res.sass) <= per_block, block_loop_locals(res.sass)


# (fp8, causal) -> (stack bytes, LDL/STL inside the per-block loops) of the cutlass_ builds under ptxas 13.4,
# as measured (both head dims).
CUTLASS_LOCAL = {(True, False): (8, 0), (True, True): (8, 0), (False, False): (24, 0), (False, True): (40, 8)}


@pytest.mark.compile
def test_auto_name_prefixes_cutlass_for_fp8_only():
    fp8 = inspect(BuildRequest(kernel="attention", arch="sm_100a", dtype="fp8e4m3", head_dim=64,
                               kernel_name="auto")).report
    fp16 = inspect(BuildRequest(kernel="attention", arch="sm_100a", dtype="fp16", head_dim=64,
                                kernel_name="auto")).report
    assert fp8.kernel_name == "cutlass_gluon_attention" and fp16.kernel_name == "gluon_attention"


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_four_cta_cluster_multicasts_k_and_v(dtype):
    """CLUSTER=4: two two-CTA MMA pairs sharing each K and V tile, loaded once for both pairs (TMA multicast)."""
    res = inspect(BuildRequest(kernel="attention", arch="sm_100a", dtype=dtype, head_dim=128, causal=False,
                               kernel_name="plain", config={"CLUSTER": 4}))
    ops = mnemonics(res.sass)
    ptx = res.compiled.asm["ptx"]
    assert res.compiled.metadata.num_ctas == 4 and ".reqnctapercluster 4" in ptx
    assert "UTMALDG.4D.MULTICAST.2CTA" in ops and "UTMALDG.4D.2CTA" in ops  # K, V multicast; Q per CTA
    assert "multicast::cluster" in ptx
    assert {op for op in ops if op.startswith("UTCHMMA")} == {"UTCHMMA.2CTA"}
    assert "UGETNEXTWORKID.BROADCAST" in ops
    assert 0 < res.report.tmem_columns <= 512 and res.report.shared_bytes <= blackwell_host.SM100_SMEM_BYTES
    assert_no_spills(res)


def test_cluster_builds_fall_back_to_one_cta():
    """A cluster config asked for a problem a cluster does not take (causal, packed) builds the one-CTA kernel."""
    for causal, varlen in ((True, False), (False, True)):
        build = make_build(BuildRequest(kernel="attention", arch="sm_100a", dtype="fp16", head_dim=128,
                                        causal=causal, varlen=varlen, config={"CLUSTER": 2}))
        assert build.extra == {"num_ctas": 1} and build.constexprs["BLOCK_M"] == 256
        assert "_c2" not in build.description
    dense = make_build(BuildRequest(kernel="attention", arch="sm_100a", dtype="fp16", head_dim=128))
    assert dense.extra == {"num_ctas": 2} and dense.constexprs["BLOCK_M"] == 512
    assert "cga_layout=[[0, 0, 1, 0]]" in dense.signature["desc_q"]
    assert "cga_layout=[[0, 0, 0, 1]]" in dense.signature["desc_v"]


def test_default_configs_fit_sm100():
    for dtype, d, causal in itertools.product(DTYPES, [64, 128], [False, True]):
        cfg = default_config(d, dtype, causal)
        assert cfg.invalid_reasons(d, dtype) == []
        assert cfg.tmem_columns(d) <= 512 and cfg.smem_bytes(d, 1 if "fp8" in dtype else 2, 2) <= 232448
        assert cfg.CLUSTER == (2 if (d == 128 and not causal and dtype in ("fp16", "bf16")) else 1)
    # The deepest ring that fits: 3 K/V tiles at D=128 fp16 on one CTA, more for fp8 and D=64; 6 on a CTA of a
    # pair (it holds half of each tile).
    assert default_config(128, "fp16").KV_STAGES == 3 and default_config(128, "fp16", True).KV_STAGES == 3
    assert default_config(128, "fp8e4m3").KV_STAGES > 3 and default_config(64, "fp16").KV_STAGES > 3
    assert default_config(128, "fp16", False).KV_STAGES == 6 and default_config(128, "bf16", False).BLOCK_M == 512


def test_invalid_blackwell_configs_say_why():
    assert any("tensor memory: 768 columns" in r for r in BlackwellConfig(BLOCK_N=256).invalid_reasons(128, "fp16"))
    reasons = BlackwellConfig(KV_STAGES=6).invalid_reasons(128, "fp16")
    assert any("shared memory" in r for r in reasons)
    assert BlackwellConfig(KV_STAGES=6, CLUSTER=2).invalid_reasons(128, "fp16") == []
    assert any("BLOCK_N 256" in r for r in BlackwellConfig(BLOCK_N=256).invalid_reasons(128, "fp16"))
    assert any("head dim 80 not supported (supported: 32, 64, 96, 128)" in r
               for r in BlackwellConfig().invalid_reasons(80, "fp16"))
    assert BlackwellConfig().invalid_reasons(96, "fp16") == []  # (the D=128 build's resources)
    assert any("clusters take head dim 128, not 96" in r for r in BlackwellConfig(CLUSTER=2).invalid_reasons(96, "fp16"))
    assert any("SPLIT_D" in r for r in BlackwellConfig(SPLIT_D=3).invalid_reasons(128, "fp16"))
    assert any("CLUSTER 3" in r for r in BlackwellConfig(CLUSTER=3).invalid_reasons(128, "fp16"))
    assert any("clusters take fp16, bf16" in r for r in BlackwellConfig(CLUSTER=2).invalid_reasons(128, "fp8e4m3"))
    assert any("clusters take head dim 128" in r for r in BlackwellConfig(CLUSTER=2).invalid_reasons(64, "fp16"))
    assert BlackwellConfig().tmem_columns(128) == 512 and BlackwellConfig().tmem_columns(64) == 384
    assert BlackwellConfig(CLUSTER=2).BLOCK_M == 512 and BlackwellConfig(CLUSTER=4).BLOCK_M == 1024


@pytest.mark.compile
@pytest.mark.parametrize("dtype,head_dim,causal", list(itertools.product(["fp16", "bf16"], [64, 128],
                                                                            [False, True])))
def test_blackwell_packed_sequence_builds_compile(dtype, head_dim, causal):
    """The same packed-sequence indexing as sm_90a (schedule.Shape): compiles for sm_100a with tcgen05 MMAs,
    TMA, the masked tail stores, one CTA per cluster (also where dense problems take two), and no spills."""
    res = inspect(BuildRequest(kernel="attention", arch="sm_100a", dtype=dtype, head_dim=head_dim,
                               causal=causal, varlen=True))
    rep = res.report
    assert rep.has("UTCHMMA") and rep.has("UTMALDG") and rep.has("UTMASTG") and rep.has("STG")
    assert 0 < rep.tmem_columns <= 512 and rep.shared_bytes <= blackwell_host.SM100_SMEM_BYTES
    assert res.compiled.metadata.num_ctas == 1 and "UGETNEXTWORKID.SELFCAST" in mnemonics(res.sass)
    assert_no_spills(res)


@pytest.mark.compile
@pytest.mark.parametrize("causal,varlen", [(False, False), (True, False), (True, True)])
def test_return_lse_builds_compile(causal, varlen):
    """The builds that also write the logsumexp (the softmax partitions store it at the end of a tile, where their
    registers are free): the stores are there; ptxas 13.4 keeps the global-memory descriptor the dense ones need
    in local memory between the partitions' start (one 8-byte slot, loaded once per softmax partition), never in a
    per-block loop; the packed one has nothing there."""
    build = make_build(BuildRequest(kernel="attention", arch="sm_100a", dtype="fp16", head_dim=128, causal=causal,
                                    varlen=varlen))
    build = dataclasses.replace(build, constexprs={**build.constexprs, "RETURN_LSE": True})
    res = analyze(compile_build(build, "sm_100a"), "sm_100a")
    ops = mnemonics(res.sass)
    assert "STG.E" in ops and res.compiled.metadata.num_ctas == (1 if causal or varlen else 2)
    assert block_loop_locals(res.sass) == 0 and res.report.stack_bytes <= (0 if varlen else 8)
    assert len(local_lines(res.sass)) <= (0 if varlen else 3)


@pytest.mark.compile
@pytest.mark.parametrize("dtype,head_dim,causal", [("fp16", 96, True), ("bf16", 32, False), ("fp8e4m3", 96, False)])
def test_padded_head_dims_run_their_builds_binary(dtype, head_dim, causal):
    """Head dims 32 and 96 run in the D=64 and D=128 builds (``blackwell_host.kernel_head_dim``): TMA reads the columns
    past the tensors' head dim as zeros and clips O's stores, so a dense padded build is its kernel's binary with
    the one-CTA config (clusters take D=128 itself only)."""
    padded = inspect(BuildRequest(kernel="attention", arch="sm_100a", dtype=dtype, head_dim=head_dim, causal=causal))
    cfg = default_config(head_dim, dtype, causal)
    own_dim = blackwell_host.kernel_head_dim(head_dim)
    assert cfg.CLUSTER == 1 and cfg == blackwell_host.single_cta_config(default_config(own_dim, dtype, causal))
    own = inspect(BuildRequest(kernel="attention", arch="sm_100a", dtype=dtype,
                               head_dim=blackwell_host.kernel_head_dim(head_dim), causal=causal,
                               config=dataclasses.asdict(cfg)))
    assert re.sub(r"\s+", " ", padded.sass) == re.sub(r"\s+", " ", own.sass)
    assert f"D={head_dim} (the D={blackwell_host.kernel_head_dim(head_dim)} kernel)" in padded.report.description


@pytest.mark.compile
@pytest.mark.parametrize("causal", [False, True])
def test_padded_packed_builds_clip_the_tail_columns(causal):
    """A packed sequence's last tile goes out by masked stores from shared memory: the padded build's rows are the
    output's head dim long and the columns past it masked (PADDED), so its binary differs from D=128's; it keeps
    the packed builds' shape (tcgen05, TMA, the masked stores, no spills)."""
    padded = inspect(BuildRequest(kernel="attention", arch="sm_100a", dtype="fp16", head_dim=96, causal=causal,
                                  varlen=True))
    own = inspect(BuildRequest(kernel="attention", arch="sm_100a", dtype="fp16", head_dim=128, causal=causal,
                               varlen=True))
    assert padded.sass != own.sass
    rep = padded.report
    assert rep.has("UTCHMMA") and rep.has("UTMASTG") and rep.has("STG")
    assert_no_spills(padded)
