"""The backward without a GPU: the sm_90a backward kernel compiled for every dtype x head dim x causal x
packed build and its SASS read; the fp32 reference gradients against autograd; passes in problems, sweeps,
tables, tuning keys and the CLI; the custom ops' autograd wiring on meta tensors."""
import itertools
import json
import re

import pytest
import torch
from click.testing import CliRunner

import gluon_attn
from gluon_attn.bench.report import load_rows, tables_markdown
from gluon_attn.bench.sweep import SweepSpec, _cell_key
from gluon_attn.cli import main
from gluon_attn.inspection import (BuildRequest, back_branches, compile_build, inspect_kernel, make_build,
                                   mma_loops, sass_rows, wgmma_operand_hazards)
from gluon_attn.kernels import hopper_bwd, hopper_bwd_host, tuning
from gluon_attn.kernels.backend import BACKENDS
from gluon_attn.problem import Problem, make_inputs
from gluon_attn.reference import (attention_backward_reference, attention_reference, check_gradients,
                                  varlen_backward_reference, varlen_reference)

from .interpreter import run_interpreted

BUILDS = list(itertools.product(("fp16", "bf16"), (64, 128, 256), (False, True), (False, True)))


@pytest.mark.parametrize("dtype,head_dim,causal,varlen", BUILDS)
def test_backward_kernel_compiles_for_sm90a(dtype, head_dim, causal, varlen):
    """Warp-specialized (a 24-register loader, two 240-register consumer warpgroups), fp16/bf16 wgmma, TMA
    loads and one TMA reduce-add per block for dQ (no per-element atomics), in shared memory's budget; the
    unmasked loop keeps its registers (the masked one, diagonal blocks only, may spill a little)."""
    got = inspect_kernel(BuildRequest(kernel="attention_bwd", arch="sm_90a", dtype=dtype, head_dim=head_dim,
                                      causal=causal, varlen=varlen))
    rep = got.report
    assert rep.has("HGMMA") and 24 in rep.setmaxnreg and 240 in rep.setmaxnreg
    sass = got.sass
    assert "UTMAREDG" in sass and "REDG.E.ADD" not in sass and "UTMALDG" in sass
    assert wgmma_operand_hazards(sass) == []  # (dV's and dK's wgmma read P^T and dS^T from registers)
    # The loader: one warp issuing every copy (no per-warp election), but for D=64 non-causal, whose 4-warp
    # default partition elects a warp per copy (LOADER_WARPS=4: with one warp, ptxas spilled in its loop)
    loader_warps = hopper_bwd_host.default_config(head_dim, dtype, causal).LOADER_WARPS
    assert loader_warps == (4 if head_dim == 64 and not causal else 1)
    copies = [t for t in sass.splitlines() if "UTMALDG" in t]
    assert all(("@" in t.split("UTMALDG")[0]) == (loader_warps == 4) for t in copies), copies
    # dQ's shares: staged in fragment order (STS.128) for a 2-D reduce-add into [chunks * 128, 32] where the class
    # takes DQ_FRAG (dense D=64, D=128 causal); else as [rows, D] tiles (3-D)
    frag = hopper_bwd_host.default_config(head_dim, dtype, causal).DQ_FRAG and not varlen
    assert ("UTMAREDG.2D.ADD" in sass) == frag and ("UTMAREDG.3D.ADD" in sass) != frag
    assert rep.shared_bytes <= hopper_bwd_host.SM90_SMEM_BYTES
    assert rep.shared_bytes >= hopper_bwd_host.default_config(head_dim).smem_bytes(head_dim) - 1024
    # The MMA loops: each consumer's masked loop (diagonal blocks, a key tail), then its unmasked one, where
    # long sequences spend their time: that one keeps (nearly) all of its registers.
    rows = sass_rows(sass)
    spills = [sum(1 for a, t in rows if lo <= a <= hi and re.search(r"\b(LDL|STL)\b", t.split(";")[0]))
              for lo, hi in mma_loops(sass)]
    # (D=128/256: K/V's and, with one stage, Q/dO's shared-memory slots come through an opaque copy each
    # block, so their wgmma descriptors are not hoisted out of the loops, where they had filled the
    # registers: up to 90 LDL/STL per block at D=256, 6 LDL.64 per block in causal D=128)
    assert len(spills) == 4, spills
    if head_dim == 64:
        assert max(spills[1], spills[3]) <= 16 and sum(spills) <= 120, spills
    else:
        assert max(spills) == 0, spills
    if head_dim == 256:
        assert "HGMMA.64x128x16.F32" in sass and "HGMMA.64x32x16.F32" in sass  # dK/dV halves; S^T, dQ^T halves


@pytest.mark.parametrize("head_dim", [64, 128])
def test_s_ahead_issues_the_next_scores_under_the_dq_add(head_dim):
    """S_AHEAD: each block loop issues the next block's S^T (a zero-initialised wgmma on K, untransposed)
    after this block's dQ wgmma (transposed A) and before its TMA reduce-add, and waits for it only after
    the add; ptxas keeps the wgmmas asynchronous (a serialised build has a wait after every one). Off, the
    loop starts with S^T and dP^T and issues no zero-initialised untransposed wgmma after dQ's."""
    found = {}
    for ahead in (False, True):
        req = BuildRequest(kernel="attention_bwd", arch="sm_90a", dtype="fp16", head_dim=head_dim, causal=True,
                           config={"S_AHEAD": ahead, "DQ_FIRST": False})
        got = inspect_kernel(req)
        assert ("_SA" in got.report.description) == ahead, got.report.description
        rows = sass_rows(got.sass)
        tails = []
        for lo, hi in mma_loops(got.sass):
            body = [t.split(";")[0] for a, t in rows if lo <= a <= hi]
            assert sum("WARPGROUP.DEPBAR" in t for t in body) <= 6, body
            dq = max(i for i, t in enumerate(body) if "HGMMA" in t and ".tnspA" in t)
            scores = [i for i, t in enumerate(body) if "HGMMA" in t and "RZ, !UPT" in t and ".tnsp" not in t]
            adds = [i for i, t in enumerate(body) if "UTMAREDG" in t]
            tails.append(any(dq < i < max(adds) for i in scores))
        found[ahead] = tails
    assert len(found[True]) == 4 and all(found[True]), found
    assert not any(found[False]), found


@pytest.mark.parametrize("n", [64, 32])
def test_dq_frag_reads_the_accumulator_registers_as_the_wgmma_lays_them_out(n):
    """``_fragment_order`` assumes the [64, N] wgmma accumulator (N 64; the 192/128 pair's 32) holds, in a thread's
    registers 4 i + 2 h + p, element (16 w + 8 h + rr, 8 i + 2 cc + p), w the warp and lane = 4 rr + cc: triton's
    own layout."""
    from triton._C.libtriton import gluon_ir, ir
    from triton.experimental.gluon.language._semantic import GluonSemantic

    ctx = ir.context()
    ir.load_dialects(ctx)
    layout = hopper_bwd._wgmma_layout(n)
    ll = GluonSemantic(gluon_ir.GluonOpBuilder(ctx)).to_linear_layout(layout, [64, n]).value
    assert ll.reg_bases == [[0, 1], [8, 0]] + [[0, 8 << b] for b in range((n // 8).bit_length() - 1)]  # p, h, i
    assert ll.lane_bases == [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]  # cc, rr
    assert ll.warp_bases == [[16, 0], [32, 0]]  # w


_FRAGMENTS_SCRIPT = """
import sys, torch
from gluon_attn.kernels import hopper_bwd_prepost
D, BM, Z, H, N, DR = (int(a) for a in sys.argv[1:])  # (DR: dQ's head dim, below D when run padded)
torch.manual_seed(0)
rows = -(-N // BM) * BM
ref = torch.randn(Z, H, rows // BM, BM, D)
# chunk WG of a query block: element (r, c) = (16 w + 8 h + rr, 8 i + 2 cc + p) at [i][w][rr][cc][h][p]
N = min(BM, 64)  # (a chunk is [64, N]: the 192/128 pair's own units, 32-query blocks, [64 head dims, 32 queries])
r, c = torch.meshgrid(torch.arange(64), torch.arange(N), indexing="ij")
off = ((c // 8 * 4 + r // 16) * 32 + r % 8 * 4 + c % 8 // 2) * 4 + r // 8 % 2 * 2 + c % 2
acc = torch.empty(Z, H, rows // BM, BM * D // (64 * N), 64 * N)
for wg in range(acc.shape[3]):
    # D=128 and 256 (dQ^T): r is head dim 64 WG + r, c the query; D=64: r is query 64 WG + r, c the head dim
    q, d = (c, 64 * wg + r) if D >= 128 else (64 * wg + r, c)
    acc[:, :, :, wg, off.flatten()] = ref[:, :, :, q.flatten(), d.flatten()]
dq = torch.full((Z, H, N, D), float("nan"), dtype=torch.float16)[..., :DR]  # (a view: the columns past DR stay NaN)
hopper_bwd_prepost.dq_from_fragments(acc.view(Z, H, rows, D), dq, BM, 0.125)  # (the accumulator is unscaled)
want = (ref.reshape(Z, H, rows, D)[:, :, :N, :DR] * 0.125).half()
assert torch.equal(dq, want), (dq.float() - want.float()).abs().max()
assert dq._base[..., DR:].isnan().all()  # nothing written past dQ's own columns
print("ok")
"""


@pytest.mark.parametrize("head_dim,block_m,dq_dim", [(64, 128, 64), (128, 64, 128), (64, 128, 32), (128, 64, 96),
                                                     (192, 32, 192)])
def test_dq_from_fragments_puts_the_rows_back(head_dim, block_m, dq_dim):
    """The host's cast of DQ_FRAG's accumulator (triton's interpreter, on CPU) inverts the chunk order above:
    every row of dQ, a partial last query block included, from its place in the fragments, times the scale; a
    head dim run padded (32 in the D=64 kernel, 96 in the D=128 one) gets its own columns and no others, as does
    the 192/128 pair's accumulator (32-query blocks of three [64 head dims, 32 queries] chunks, ``_bwd_blocks_pair``)."""
    run_interpreted(_FRAGMENTS_SCRIPT, head_dim, block_m, 2, 3, 150, dq_dim)


@pytest.mark.parametrize("causal", [False, True])
def test_dq_first_stages_the_dq_add_under_dk(causal):
    """DQ_FIRST (D=128's default): in each block loop the dQ wgmmas (transposed A) come before dK's (A from the
    registers, after the dQ ones), and the dQ share's staging (STS) and TMA reduce-add are issued while dK is in
    flight: between dK's issue and the loop's last wgmma wait. Off, every wgmma is waited before the staging."""
    for first in (False, True):
        got = inspect_kernel(BuildRequest(kernel="attention_bwd", arch="sm_90a", dtype="fp16", head_dim=128,
                                          causal=causal, config={"DQ_FIRST": first}))
        assert ("_QF" in got.report.description) == first, got.report.description
        rows = sass_rows(got.sass)
        for lo, hi in mma_loops(got.sass):
            body = [t.split(";")[0] for a, t in rows if lo <= a <= hi]
            dq = [i for i, t in enumerate(body) if "HGMMA" in t and ".tnspA" in t]
            rs = [i for i, t in enumerate(body) if re.search(r"HGMMA\.64x128x16\.F32 R\d+, R\d+", t)]  # dV, dK
            staging = [i for i, t in enumerate(body) if re.search(r"\bSTS\b", t)]
            add = [i for i, t in enumerate(body) if "UTMAREDG" in t]
            last_wait = max(i for i, t in enumerate(body) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in t)
            assert dq and rs and staging and len(add) == 1, (len(dq), len(rs), len(staging), add)
            if first:
                assert max(rs) > max(dq) and max(rs) < min(staging) and add[0] < last_wait, (dq, rs, add, last_wait)
            else:
                assert max(rs) < min(dq) and last_wait < min(staging), (dq, rs, staging, last_wait)


@pytest.mark.parametrize("head_dim,causal", [(128, False), (128, True), (64, True), (64, False)])
def test_ds_first_stores_ds_before_the_dv_issue(head_dim, causal):
    """DS_FIRST (all but D=64 non-causal): in each block loop the dS^T half's stores (STSM) come before dV's wgmma
    (the loop's first with A from the registers), and the fence that publishes them after it, so that the stores
    do not queue behind that wgmma's operand reads (NOTES v53). D=64 non-causal keeps the stores after dV's and
    dK's issue."""
    got = inspect_kernel(BuildRequest(kernel="attention_bwd", arch="sm_90a", dtype="fp16", head_dim=head_dim,
                                      causal=causal))
    first = not (head_dim == 64 and not causal)
    rows = sass_rows(got.sass)
    loops = mma_loops(got.sass)
    assert len(loops) == 4, loops
    for lo, hi in loops:
        body = [t.split(";")[0] for a, t in rows if lo <= a <= hi]
        stores = [i for i, t in enumerate(body) if re.search(r"\bSTSM\b", t)]
        rs = [i for i, t in enumerate(body) if re.search(r"HGMMA\.64x\d+x16\.F32 R\d+, R\d+", t)]
        fences = [i for i, t in enumerate(body) if "FENCE.VIEW.ASYNC.S" in t]
        assert stores and rs and fences, (len(stores), len(rs), len(fences))
        if first:
            fence = min(i for i in fences if i > max(stores))
            assert max(stores) < min(rs) < fence, (stores, rs, fences)
        else:
            assert min(rs) < min(stores), (stores, rs)


def test_d64_causal_masks_by_key_row():
    """D=64 causal (MASK_BY_ROW): the diagonal blocks' mask is one bound per key row compared with the block's
    column numbers, so each masked loop is at most ~250 instructions longer than its unmasked twin (the per-element
    index arithmetic made it ~480 longer: 1196 against 707)."""
    got = inspect_kernel(BuildRequest(kernel="attention_bwd", arch="sm_90a", dtype="fp16", head_dim=64, causal=True))
    rows = sass_rows(got.sass)
    sizes = [sum(1 for a, _ in rows if lo <= a <= hi) for lo, hi in mma_loops(got.sass)]
    assert len(sizes) == 4, sizes
    masked, unmasked = sizes[0::2], sizes[1::2]  # (each consumer: its masked loop, then its unmasked one)
    assert all(0 < m - u < 300 for m, u in zip(masked, unmasked)), sizes


@pytest.mark.parametrize("head_dim,causal,varlen", [(128, True, False), (64, False, True)])
def test_deterministic_backward_orders_the_dq_adds(head_dim, causal, varlen):
    """deterministic=True: dQ still goes by TMA reduce-add, each add waits its turn on a per-query-block lock
    (a spin on a strong load) and is counted with a release add only after a full bulk-group wait (not the
    ``.read`` wait a TMA store uses); the default build has none of it."""
    req = dict(kernel="attention_bwd", arch="sm_90a", dtype="fp16", head_dim=head_dim, causal=causal, varlen=varlen)
    det = inspect_kernel(BuildRequest(**req, deterministic=True))
    plain = inspect_kernel(BuildRequest(**req))
    assert "deterministic" in det.report.description
    for got, want in ((det, True), (plain, False)):
        sass = got.sass
        assert "UTMAREDG" in sass and "REDG.E.ADD.F32" not in sass
        assert ("REDG.E.ADD.STRONG.GPU" in sass) == want
        rows = sass_rows(sass)
        spins = []
        for lo, hi in back_branches(sass):
            body = [t for a, t in rows if lo <= a <= hi]
            if len(body) <= 4 and any("LDG.E.STRONG" in t for t in body):
                spins.append(hi)
        assert (len(spins) >= 2) == want, spins  # (the masked and the unmasked loop's wait, per warpgroup)
        # One bulk-group wait per block and warpgroup (deterministic: the mid-block count's full wait; the
        # dQ claim after it waits for nothing more): the block loops, not the spins, hold the wgmmas.
        # (a wait's retry branch from the out-of-line code after the function's end also jumps back)
        loops = [(lo, hi) for lo, hi in back_branches(sass)
                 if any(lo <= a <= hi and "HGMMA" in t for a, t in rows)
                 and not any(lo <= a <= hi and "EXIT" in t for a, t in rows)]
        blocks = [[t for a, t in rows if lo <= a <= hi] for lo, hi in loops
                  if not any((lo, hi) != o and lo <= o[0] and o[1] <= hi for o in loops)]
        waits = [sum("DEPBAR.LE SB0, 0x0" in t for t in body) for body in blocks]
        assert len(waits) == 4 and set(waits) == {1}, waits
    assert det.report.shared_bytes <= plain.report.shared_bytes + 64  # (the wait's cross-warp sum)
    ptx = compile_build(make_build(BuildRequest(**req, deterministic=True)), "sm_90a").asm["ptx"]
    assert len(re.findall(r"cp\.async\.bulk\.wait_group 0;", ptx)) >= 2


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_launch_binds_to_the_kernel(monkeypatch, deterministic):
    """The host's launch (on CPU tensors, the GPU-only pieces stubbed) passes one value per runtime parameter of
    the kernel in its order, descriptors where it takes descriptors, and constexprs the kernel declares."""
    launched = {}
    monkeypatch.setattr(hopper_bwd_host, "preprocess", lambda o, do, lse, g=None: (torch.zeros(lse.shape),) * 2)
    monkeypatch.setattr(hopper_bwd_host, "sm_count", lambda dev: 132)
    monkeypatch.setattr(hopper_bwd_host, "launch_cached", lambda fn, warps, grid, args, consts, dev, key=None:
                        launched.update(fn=fn, args=args, consts=consts))
    monkeypatch.setattr(hopper_bwd_host, "dq_from_fragments",
                        lambda acc, dq, block_m, scale: launched.update(fragments=acc))
    Z, H, H_KV, N, D = 1, 4, 2, 200, 128
    q, o, do = (torch.randn(Z, H, N, D, dtype=torch.float16) for _ in range(3))
    k, v = (torch.randn(Z, H_KV, N, D, dtype=torch.float16) for _ in range(2))
    dq, dk, dv = hopper_bwd_host.hopper_attention_bwd(do, q, k, v, o, torch.zeros(Z, H, N), causal=True,
                                                      deterministic=deterministic)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    params = launched["fn"].params
    runtime = [p.name for p in params if not p.is_constexpr]
    assert len(launched["args"]) == len(runtime), (len(launched["args"]), runtime)
    for name, arg in zip(runtime, launched["args"]):
        assert isinstance(arg, hopper_bwd_host.DescArg) == name.startswith("desc_"), name
    assert set(launched["consts"]) == {p.name for p in params if p.is_constexpr}
    assert launched["consts"]["DETERMINISTIC"] == deterministic
    # dQ's accumulator: in fragment order as [chunks * 128, 32], rows put back after the kernel (dense, not
    # deterministic: DQ_FRAG); else [Z * H, rows, D] through TMA and a plain copy
    acc = launched["args"][runtime.index("desc_dq")]
    assert launched["consts"]["DQ_FRAG"] == (not deterministic) == ("fragments" in launched)
    want = [Z * H * 256 * D // 32, 32] if not deterministic else [Z * H, 256, D]
    assert list(acc.shape) == want and acc.block_shape == ([128, 32] if not deterministic else [1, 64, 64])


def test_deterministic_mode_follows_torch():
    from gluon_attn.api import _deterministic

    assert _deterministic(True) and not _deterministic(False)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert _deterministic(None)
        torch.use_deterministic_algorithms(False)
        assert not _deterministic(None)
    finally:
        torch.use_deterministic_algorithms(was)


def test_backward_builds_refuse_what_it_does_not_take():
    for req, what in ((BuildRequest(kernel="attention_bwd", arch="sm_100a"), "no backward on sm_100a"),
                      (BuildRequest(kernel="attention_bwd", head_dim=256, config={"Q_STAGES": 2}), "shared memory"),
                      (BuildRequest(kernel="attention_bwd", dtype="fp8e4m3"), "fp16, bf16")):
        with pytest.raises(ValueError, match=what):
            inspect_kernel(req)


@pytest.mark.parametrize("causal,n_q,n_k,h,h_kv", [(False, 37, 37, 4, 2), (True, 37, 37, 4, 4), (True, 20, 45, 4, 1),
                                                    (True, 45, 20, 2, 2), (False, 1, 33, 2, 1)])
def test_reference_gradients_match_autograd(causal, n_q, n_k, h, h_kv):
    gen = torch.Generator().manual_seed(n_q * 7 + n_k)
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64) for s in
               ((2, h, n_q, 16), (2, h_kv, n_k, 16), (2, h_kv, n_k, 16)))
    do = torch.randn((2, h, n_q, 16), generator=gen)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    attention_reference(*leaves, causal=causal, sm_scale=0.3).backward(do)
    for got, leaf in zip(attention_backward_reference(q, k, v, do, causal=causal, sm_scale=0.3, max_scores=300),
                         leaves):
        # Both sides are fp32 sums over up to 45 keys of terms up to ~3: CPU GEMM kernels differ in summation
        # order between machines (2.3e-5 seen), while a wrong formula misses by 1e-1 or more.
        torch.testing.assert_close(got, leaf.grad, rtol=1e-4, atol=1e-4)


def test_varlen_reference_gradients_match_autograd():
    cu = torch.tensor([0, 5, 6, 30], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    q, do = torch.randn((30, 4, 16), generator=gen), torch.randn((30, 4, 16), generator=gen)
    k, v = torch.randn((30, 2, 16), generator=gen), torch.randn((30, 2, 16), generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    varlen_reference(*leaves, cu, cu, causal=True).backward(do)
    for got, leaf in zip(varlen_backward_reference(q, k, v, do, cu, cu, causal=True), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-4, atol=1e-4)  # fp32 on both sides, as above


def test_gradient_check_fails_wrong_gradients():
    refs = [torch.randn(4, 8, 16) for _ in range(3)]
    assert check_gradients([r.half() for r in refs], refs, "fp16").ok
    bad = [refs[0].half(), refs[1].half() * 1.1, refs[2].half()]
    acc = check_gradients(bad, refs, "fp16")
    assert not acc.ok and "dk" in acc.message
    nan = [refs[0].clone(), refs[1], refs[2]]
    nan[0][0, 0, 0] = float("nan")
    assert not check_gradients(nan, refs, "fp16").ok


def test_passes_scale_flops_and_keys():
    fwd = Problem(2, 4, 512, 64, True)
    assert Problem(2, 4, 512, 64, True, pass_name="bwd").flops == pytest.approx(2.5 * fwd.flops)
    assert Problem(2, 4, 512, 64, True, pass_name="fwd+bwd").flops == pytest.approx(3.5 * fwd.flops)
    assert "pass=bwd" in Problem(2, 4, 512, 64, True, pass_name="bwd").label()
    with pytest.raises(ValueError, match="fwd, bwd, fwd\\+bwd"):
        Problem(2, 4, 512, 64, True, pass_name="backward")
    inputs = make_inputs(Problem(1, 4, 33, 64, False, H_KV=2, pass_name="bwd"), "cpu")
    assert inputs.do.shape == inputs.q.shape and inputs.do.dtype == inputs.q.dtype
    assert make_inputs(fwd, "cpu").do is None
    # rows written before the pass column are forward rows; sweeps take passes from specs too
    old = {"Z": "1", "H": "2", "N_CTX": "64", "HEAD_DIM": "64", "causal": "True", "dtype": "fp16", "provider": "x"}
    assert _cell_key(old) == _cell_key({**old, "pass": "fwd"}) != _cell_key({**old, "pass": "bwd"})
    spec = SweepSpec(n_ctx=(64,), head_dims=(64,), causal=(True,), passes=("fwd", "bwd"), providers=("math",))
    assert [p.pass_name for p in spec.problems()] == ["fwd", "bwd"] and spec.n_cells == 2
    with pytest.raises(ValueError, match="unknown pass"):
        SweepSpec(passes=("back",), providers=("math",))
    assert tuning.class_key(128, "fp16", True, 8192, "bwd") == "bwd-" + tuning.class_key(128, "fp16", True, 8192)


def test_sweep_times_every_pass_and_gates_gradients(tmp_path):
    """--pass fwd,bwd,fwd+bwd on the CPU oracle provider: one row per pass, gradients gated, tables per pass."""
    out = tmp_path / "sw"
    res = CliRunner().invoke(main, ["sweep", "--providers", "math", "--pass", "fwd,bwd,fwd+bwd", "--n-ctx", "48,80",
                                    "--head-dim", "64", "-Z", "1", "-H", "4", "--kv-heads", "2", "--rep-ms", "2",
                                    "--warmup-ms", "2", "--quiet", "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = load_rows(out)
    assert sorted(set(df["pass"])) == ["bwd", "fwd", "fwd+bwd"] and (df.status == "ok").all()
    assert (df[df["pass"] != "fwd"].rel_l2_err < 1e-2).all()
    md = tables_markdown(df)
    assert "Attention bwd Z=1 H=4 H_KV=2" in md and "Attention fwd+bwd" in md
    # a provider without a backward gets an unsupported row naming why
    res = CliRunner().invoke(main, ["sweep", "--providers", "math", "--pass", "bwd", "--n-ctx", "48", "--head-dim",
                                    "64", "-Z", "1", "-H", "2", "--quiet", "--out", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output


def test_backward_providers_declare_it():
    from gluon_attn.bench.providers import get_provider

    p = Problem(1, 2, 128, 64, True, pass_name="bwd")
    here = get_provider("gluon").supports(p, (9, 0))
    assert here.ok or "not installed" in here.reason
    why = get_provider("gluon").supports(p, (10, 0)).reason
    assert "no backward on sm_100a" in why
    fe = get_provider("cudnn-fe")
    assert fe.backward and fe.backward_runner is not None  # (its own backward graph, not autograd)
    assert fe.supports(p, (9, 0)).ok or "not installed" in fe.supports(p, (9, 0)).reason
    assert "16-bit" in fe.supports(Problem(1, 2, 128, 64, True, dtype="fp8e4m3", pass_name="bwd"), (9, 0)).reason \
        or "not installed" in fe.supports(p, (9, 0)).reason
    det = get_provider("gluon-det")
    assert "backward only" in det.supports(Problem(1, 2, 128, 64, True), (9, 0)).reason
    assert det.supports(p, (9, 0)).ok or "not installed" in det.supports(p, (9, 0)).reason
    wide = get_provider("gluon").supports(Problem(1, 2, 128, 256, True, pass_name="bwd"), (9, 0))
    assert wide.ok or "not installed" in wide.reason


def test_configs_and_inspect_take_the_backward_pass():
    res = CliRunner().invoke(main, ["configs", "--pass", "bwd", "--arch", "sm_90a", "--head-dim", "128", "--all",
                                    "--format", "json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output[res.output.index("["):])
    assert {r["config"] for r in rows if r["valid"]} == {f"bwd_BM64_Q{q}{a}{f}{w}" for q in (1, 2, 3)
                                                         for a in ("", "_SA", "_QF") for f in ("", "_FR")
                                                         for w in ("", "_L4")}
    res = CliRunner().invoke(main, ["configs", "--pass", "bwd", "--arch", "sm_100a"])
    assert res.exit_code != 0 and "no backward kernel on sm_100a" in res.output
    res = CliRunner().invoke(main, ["inspect", "--pass", "bwd", "--arch", "sm_100a"])
    assert res.exit_code != 0 and "no backward on sm_100a" in res.output


def test_backward_op_fakes_and_varlen_autograd_on_meta():
    q = torch.empty(20, 4, 64, dtype=torch.float16, device="meta", requires_grad=True)
    kv = torch.empty(20, 2, 64, dtype=torch.float16, device="meta", requires_grad=True)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out = gluon_attn.attention_varlen(q, kv, kv, cu, cu, 10, 10, causal=True)
    out.sum().backward()
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape
    dq, dk, dv = torch.ops.gluon_attn.attention_backward(*(torch.empty(1, 2, 8, 64, device="meta", dtype=torch.half)
                                                           for _ in range(5)), torch.empty(1, 2, 8, device="meta"),
                                                         None, True, None, "auto")
    assert dq.shape == dk.shape == dv.shape == (1, 2, 8, 64)


def test_readme_says_the_blackwell_backward_is_out_of_scope():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "Blackwell backward" in readme and BACKENDS["sm_100a"].bwd is None
