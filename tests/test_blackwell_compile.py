"""Compile-only checks of the sm_100a kernel (no Blackwell GPU exists here: these are its only checks)."""
import itertools

import pytest

from gluon_attn.inspection import BuildRequest, inspect_kernel
from gluon_attn.kernels import blackwell
from gluon_attn.kernels.blackwell import BlackwellConfig, default_config

DTYPES = ["fp16", "bf16", "fp8e5", "fp8e4m3"]
GRID = list(itertools.product(DTYPES, [64, 128], [False, True], ["plain", "cutlass"]))


@pytest.mark.compile
@pytest.mark.parametrize("dtype,head_dim,causal,name", GRID)
def test_blackwell_kernel_compiles(dtype, head_dim, causal, name):
    res = inspect_kernel(BuildRequest(kernel="attention", arch="sm_100a", dtype=dtype, head_dim=head_dim,
                                      causal=causal, kernel_name=name))
    rep = res.report
    fp8 = dtype.startswith("fp8")
    assert rep.has("UTCQMMA" if fp8 else "UTCHMMA"), rep.histogram[:5]
    assert not rep.has("HGMMA") and not rep.has("HMMA")
    # tcgen05 tensor-memory loads and stores (S, P, the statistics, O) and the TMA engine.
    assert rep.has("LDTM") and rep.has("STTM")
    assert rep.has("UTMALDG") and rep.has("UTMASTG")
    # Tensor memory: S and O of two halves, within the 512 columns; shared memory within 227 KB.
    assert 0 < rep.tmem_columns <= 512
    assert rep.shared_bytes <= blackwell.SM100_SMEM_BYTES
    # Partitions: correction (4 warps, default), load 1, mma 1, softmax 4 + 4, epilogue 1 -> 15,
    # rounded up to whole warpgroups for setmaxnreg.
    assert rep.num_warps == 4 and sum(blackwell.WORKER_WARPS) + 4 == 15 and rep.total_warps == 16
    # Register budgets: softmax 192, the 1-warp partitions' warpgroup 48 (the MMA warp's count), the
    # correction partition what is left (80); together the whole register file.
    cfg = default_config(head_dim, dtype, causal)
    assert {cfg.SOFTMAX_REGS, int(blackwell.MMA_REGS), cfg.correction_regs()} <= set(rep.setmaxnreg)
    assert 4 * 32 * (2 * cfg.SOFTMAX_REGS + int(blackwell.MMA_REGS) + cfg.correction_regs()) == 65536
    expected = "gluon_attention" if name == "plain" else "cutlass_gluon_attention"
    assert rep.kernel_name == expected and f"Function : {expected}" in res.sass
    # No register spills: no local-memory instruction anywhere in the SASS; except that under the cutlass_
    # name ptxas keeps two or three of the 16-bit D=128 correction partition's row statistics (80
    # registers) in local memory per tile since the shared scheduler (``schedule.Shape``) came in:
    # outside every MMA loop (NOTES v35; the name's SASS follows the PTX's line info, NOTES v34).
    local = [line for line in res.sass.splitlines() if " LDL" in line or " STL" in line]
    if name == "cutlass" and head_dim == 128 and not fp8:
        assert len(local) <= 16 and rep.loop_spill_instructions == 0 and rep.stack_bytes <= 32
    else:
        assert local == [] and rep.spill_instructions == 0
        assert rep.stack_bytes == 0 and rep.local_bytes == 0


@pytest.mark.compile
def test_auto_name_prefixes_cutlass_for_fp8_only():
    fp8 = inspect_kernel(BuildRequest(kernel="attention", arch="sm_100a", dtype="fp8e4m3", head_dim=64,
                                      kernel_name="auto")).report
    fp16 = inspect_kernel(BuildRequest(kernel="attention", arch="sm_100a", dtype="fp16", head_dim=64,
                                       kernel_name="auto")).report
    assert fp8.kernel_name == "cutlass_gluon_attention" and fp16.kernel_name == "gluon_attention"


def test_default_configs_fit_sm100():
    for dtype, d, causal in itertools.product(DTYPES, [64, 128], [False, True]):
        cfg = default_config(d, dtype, causal)
        assert cfg.invalid_reasons(d, dtype) == []
        assert cfg.tmem_columns(d) <= 512 and cfg.smem_bytes(d, 1 if "fp8" in dtype else 2, 2) <= 232448
    # The deepest ring that fits: 3 K/V tiles at D=128 fp16, more for fp8 and D=64.
    assert default_config(128, "fp16").KV_STAGES == 3
    assert default_config(128, "fp8e4m3").KV_STAGES > 3 and default_config(64, "fp16").KV_STAGES > 3


def test_invalid_blackwell_configs_say_why():
    assert any("tensor memory: 768 columns" in r for r in BlackwellConfig(BLOCK_N=256).invalid_reasons(128, "fp16"))
    reasons = BlackwellConfig(KV_STAGES=6).invalid_reasons(128, "fp16")
    assert any("shared memory" in r for r in reasons)
    assert any("BLOCK_N 256" in r for r in BlackwellConfig(BLOCK_N=256).invalid_reasons(128, "fp16"))
    assert any("head dim 96" in r for r in BlackwellConfig().invalid_reasons(96, "fp16"))
    assert any("SPLIT_D" in r for r in BlackwellConfig(SPLIT_D=3).invalid_reasons(128, "fp16"))
    assert BlackwellConfig().tmem_columns(128) == 512 and BlackwellConfig().tmem_columns(64) == 384


@pytest.mark.compile
@pytest.mark.parametrize("dtype,head_dim,causal", list(itertools.product(["fp16", "bf16"], [64, 128],
                                                                            [False, True])))
def test_blackwell_packed_sequence_builds_compile(dtype, head_dim, causal):
    """The same packed-sequence indexing as sm_90a (schedule.Shape): compiles for sm_100a with tcgen05 MMAs,
    TMA, the masked tail stores, and no spills."""
    res = inspect_kernel(BuildRequest(kernel="attention", arch="sm_100a", dtype=dtype, head_dim=head_dim,
                                      causal=causal, varlen=True))
    rep = res.report
    assert rep.has("UTCHMMA") and rep.has("UTMALDG") and rep.has("UTMASTG") and rep.has("STG")
    assert 0 < rep.tmem_columns <= 512 and rep.shared_bytes <= blackwell.SM100_SMEM_BYTES
    assert rep.spill_instructions == 0 and rep.stack_bytes == 0, rep.spill_instructions
