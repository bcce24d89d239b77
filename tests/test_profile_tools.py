"""experiments/profile_backward.py's readers of Nsight Compute source-page exports, on a small synthetic export."""
import pandas as pd

from .experiment_scripts import load_experiment

TOTAL = "Warp Stall Sampling (All Samples)"


def _tool():
    return load_experiment("profile_backward")


def _export(tmp_path, rows):
    """An ``ncu --page source --print-source sass --csv`` export: a kernel-name line, then one row per instruction."""
    df = pd.DataFrame(rows, columns=["Address", "Source", "Instructions Executed", TOTAL,
                                     "Warp Stall Sampling (Not-issued Samples)", "stall_short_sb", "stall_barrier",
                                     "stall_long_sb"])
    path = tmp_path / "sass.csv"
    with open(path, "w") as f:
        f.write('"Kernel Name","gluon_attention_bwd"\n')
        df.to_csv(f, index=False)
    return path


def test_loop_table_finds_the_wgmma_loop_and_scales_its_stalls(tmp_path):
    base = 0x7f0000001000
    rows = [
        (hex(base), "MOV R1, c[0x0][0x28]", "128", 5, 5, 0, 0, 5),
        # the block loop: a wgmma, an exponent's FFMA waiting on an LDS, a barrier, the back-edge
        (hex(base + 0x10), "HGMMA.64x64x16.F32 R184, gdesc[UR12], RZ, !UPT", "1,000", 10, 10, 0, 0, 10),
        (hex(base + 0x20), "FFMA R220, R184, UR13, -R20", "1,000", 60, 60, 60, 0, 0),
        (hex(base + 0x30), "BAR.SYNC.DEFER_BLOCKING 0x3, 0x80", "1,000", 30, 30, 0, 30, 0),
        (hex(base + 0x40), f"@!P1 BRA {hex(base + 0x10)}", "1,000", 0, 0, 0, 0, 0),
        # a wait's retry loop without a wgmma: not a block loop
        (hex(base + 0x50), "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2", "10", 7, 7, 0, 0, 7),
        (hex(base + 0x60), f"@!P1 BRA {hex(base + 0x50)}", "10", 0, 0, 0, 0, 0),
        (hex(base + 0x70), "EXIT", "128", 1, 1, 0, 0, 1),
    ]
    table = _tool().mma_loop_table(str(_export(tmp_path, rows)), cycles=2000.0, iters_per_warp=1.0)
    lines = table.splitlines()
    assert lines[0] == "loop 0x10-0x40: 4 instructions, 1000 warp-iterations, 100 samples", table
    assert "0x50" not in table
    # shares of the loop's stall samples (100: 60 short-scoreboard, 30 barrier, 10 long-scoreboard), as cycles
    assert lines[1].split() == ["short_sb", "60.0%", "1200", "cycles"], lines[1]
    assert lines[2].split() == ["barrier", "30.0%", "600", "cycles"], lines[2]
    assert lines[3].split() == ["long_sb", "10.0%", "200", "cycles"], lines[3]
    assert "short_sb     100.0%  FFMA R220, R184, UR13, -R20" in table


def test_loop_table_without_scale_prints_shares_only(tmp_path):
    base = 0x7f0000002000
    rows = [
        (hex(base), "HGMMA.64x128x16.F32 R24, R200, gdesc[UR16].tnspB, R24", "50", 4, 4, 0, 4, 0),
        (hex(base + 0x10), f"BRA {hex(base)}", "50", 0, 0, 0, 0, 0),
    ]
    table = _tool().mma_loop_table(str(_export(tmp_path, rows)))
    assert "barrier" in table and "100.0%" in table and "cycles" not in table
