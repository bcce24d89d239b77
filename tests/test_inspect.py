import json

import pytest
from click.testing import CliRunner

from gluon_attn.cli import main
from gluon_attn.inspection import (BuildRequest, inspect_kernel, opcode_histogram, ordered_histogram,
                                sass_instructions, wgmma_operand_hazards)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", ["plain", "cutlass"])
def test_tma_copy_compiles_for_both_targets(arch, name):
    res = inspect_kernel(BuildRequest(kernel="tma_copy", arch=arch, dtype="fp16", head_dim=64, kernel_name=name))
    rep = res.report
    expected = "gluon_tma_scale" if name == "plain" else "cutlass_gluon_tma_scale"
    assert rep.kernel_name == expected
    assert f"Function : {expected}" in res.sass
    assert f".entry {expected}(" in res.compiled.asm["ptx"]
    assert rep.registers > 0 and rep.spill_instructions == 0 and rep.local_bytes == 0
    assert rep.shared_bytes >= 64 * 64 * 2  # one fp16 tile
    assert rep.num_warps == 4 and rep.tmem_columns == 0
    assert rep.has("UTMALDG") and rep.has("UTMASTG")  # the TMA copy engine, both directions
    assert rep.instructions == sum(n for _, n in rep.histogram)


def test_histogram_parsing_puts_mma_first():
    sass = """
        /*0000*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], RZ, !UPT ;  /* 0x0 */
        /*0010*/              @P0  FFMA R1, R2, R3, R4 ;  /* 0x0 */
        /*0020*/                   FFMA R1, R2, R3, R4 ;  /* 0x0 */
        /*0030*/              @!UP1 UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], idesc[UR9], UPT ;  /* 0x0 */
        /*0040*/                   EXIT ;
    """
    assert sass_instructions(sass)[0] == "HGMMA.64x128x16.F32"
    hist = opcode_histogram(sass)
    assert hist == {"HGMMA": 1, "FFMA": 2, "UTCHMMA": 1, "EXIT": 1}
    assert [op for op, _ in ordered_histogram(hist)] == ["HGMMA", "UTCHMMA", "FFMA", "EXIT"]


def test_wgmma_operand_hazards_find_writes_to_registers_an_mma_still_reads():
    """A register-input wgmma reads its A fragment (4 registers from the named one) until the WARPGROUP.DEPBAR
    that retires its group: a write before that is a hazard, one after it is not, and a write at a loop's top
    counts against an MMA still in flight from the body's end."""
    def rows(*lines):
        return "\n".join(f"        /*{16 * i:04x}*/                   {t} ;  /* 0x0 */" for i, t in enumerate(lines))

    safe = rows("HGMMA.64x128x16.F32 R88, R184, gdesc[UR20].tnspB, R88",
                "HGMMA.64x128x16.F32 R88, R188, gdesc[UR20].tnspB, R88, gsb0",
                "FMUL R12, R1, R2", "STS.64 [R185], R2",
                "WARPGROUP.DEPBAR.LE gsb0, 0x0", "F2FP.F16.F32.PACK_AB R185, R1, R2", "EXIT")
    assert wgmma_operand_hazards(safe) == []
    early = rows("HGMMA.64x128x16.F32 R88, R184, gdesc[UR20].tnspB, R88",
                 "FMUL R187, R1, R2",  # R184..R187: the first MMA's A, its group not even committed
                 "HGMMA.64x128x16.F32 R88, R188, gdesc[UR20].tnspB, R88, gsb0",
                 "LDS.64 R190, [R3]",  # R190-R191: the second MMA's A
                 "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT")
    assert [t.split()[1] for t in wgmma_operand_hazards(early)] == ["FMUL", "LDS.64"]
    # one group left in flight (DEPBAR ..., 0x1) keeps the newer group's registers live
    one_left = rows("HGMMA.64x64x16.F32 R24, R100, gdesc[UR4], R24, gsb0",
                    "HGMMA.64x64x16.F32 R56, R120, gdesc[UR8], R56, gsb0",
                    "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MOV R101, R3", "IADD3 R121, R1, R2, RZ",
                    "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT")
    assert [t.split()[1] for t in wgmma_operand_hazards(one_left)] == ["IADD3"]
    across = rows("FMUL R150, R1, R2",  # the loop's top: the MMA issued at its end is still in flight
                  "WARPGROUP.DEPBAR.LE gsb0, 0x0",
                  "HGMMA.64x64x16.F32 R24, R148, gdesc[UR4], R24, gsb0",
                  "@P0 BRA 0x0", "EXIT")
    assert [t.split()[1] for t in wgmma_operand_hazards(across)] == ["FMUL"]


def test_inspect_cli_reports_and_dumps(tmp_path):
    res = CliRunner().invoke(main, ["inspect", "--kernel", "tma_copy", "--arch", "sm_90a", "--head-dim", "128",
                                    "--dump", str(tmp_path), "--top", "100"])
    assert res.exit_code == 0, res.output
    for needle in ("gluon_tma_scale", "registers", "spills", "shared mem", "tensor mem", "warps", "UTMALDG"):
        assert needle in res.output
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["gluon_tma_scale.cubin", "gluon_tma_scale.ptx", "gluon_tma_scale.sass",
                     "gluon_tma_scale.ttgir"]


def test_inspect_rejects_unknown_kernel_and_arch():
    res = CliRunner().invoke(main, ["inspect", "--kernel", "gemm"])
    assert res.exit_code != 0 and "available:" in res.output
    res = CliRunner().invoke(main, ["inspect", "--arch", "sm_80"])
    assert res.exit_code != 0 and "sm_90a" in res.output


def test_config_values_parse_booleans_and_integers():
    from gluon_attn.cli import _config_value

    assert _config_value("False") is False and _config_value("true") is True
    assert _config_value("128") == 128 and _config_value("fp8") == "fp8"


def test_every_entry_point_defaults_to_the_same_kernel_name():
    import inspect as stdlib_inspect

    from gluon_attn.api import attention
    from gluon_attn.bench.providers import get_provider
    from gluon_attn.cli import main
    from gluon_attn.problem import Problem

    api_default = stdlib_inspect.signature(attention).parameters["kernel_name"].default
    cli_default = next(p.default for p in main.commands["inspect"].params if p.name == "kernel_name")
    assert api_default == cli_default == BuildRequest().kernel_name == "auto"
    gluon = get_provider("gluon")
    assert gluon.kernel_name_fn(Problem(1, 1, 64, 64, False, "fp8e4m3")) == "cutlass_gluon_attention"
    assert gluon.kernel_name_fn(Problem(1, 1, 64, 64, False, "fp16")) == "gluon_attention"


def test_inspect_cli_builds_the_packed_sequence_kernel():
    from click.testing import CliRunner

    from gluon_attn.cli import main

    res = CliRunner().invoke(main, ["inspect", "--varlen", "--causal", "--head-dim", "64", "--json"])
    assert res.exit_code == 0, res.output
    assert "varlen" in json.loads(res.output)["description"]
    bad = CliRunner().invoke(main, ["inspect", "--varlen", "--dtype", "fp8e4m3"])
    assert bad.exit_code != 0 and "dtypes fp16, bf16" in bad.output


def test_inspect_cli_builds_the_192_128_pair_as_its_launches_do():
    """``--head-dim-v``: the pair's forward in PAIR_TILE's 128-key blocks and its backward in its own 32-query units
    (the configs a dense launch takes), compiled; head dims the kernels do not pair are refused naming the pair."""
    from click.testing import CliRunner

    from gluon_attn.cli import main

    fwd = CliRunner().invoke(main, ["inspect", "--head-dim", "192", "--head-dim-v", "128", "--json"])
    assert fwd.exit_code == 0, fwd.output
    assert "D=192/128" in json.loads(fwd.output)["description"] and "_pair" in json.loads(fwd.output)["description"]
    bwd = CliRunner().invoke(main, ["inspect", "--pass", "bwd", "--head-dim", "192", "--head-dim-v", "128", "--json"])
    assert bwd.exit_code == 0, bwd.output
    assert "D=192/128" in json.loads(bwd.output)["description"] and "bwd_BM32" in json.loads(bwd.output)["description"]
    bad = CliRunner().invoke(main, ["inspect", "--head-dim", "128", "--head-dim-v", "64"])
    assert bad.exit_code != 0 and "192/128" in bad.output
    bad = CliRunner().invoke(main, ["inspect", "--pass", "bwd", "--head-dim", "128", "--head-dim-v", "64"])
    assert bad.exit_code != 0 and "192/128" in bad.output
