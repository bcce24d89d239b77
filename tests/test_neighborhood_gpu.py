"""na1d, na2d and na3d on Hopper (run on an H100/H200): the forward's WINDOW modes against the fp32 reference with
NATTEN's explicit mask (``na_reference``), over lengths that are not multiples of the tiles, windows smaller and
larger than a key block, strides from 1 to the kernel size (blocked), dilations, causal windows, GQA, the lse and
additional keys;
the allocator poisoned with NaN before each call, so rows the kernel fails to write show."""
import contextlib
import itertools

import pytest
import torch

from gluon_attn import na1d, na2d, na3d
from gluon_attn.neighborhood import na_reference
from gluon_attn.reference import check_accuracy

from .test_backward_gpu import _poison_allocator

pytestmark = pytest.mark.gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("na1d runs on the sm_90a forward; this GPU is not Hopper")


def _inputs(B, L, H, H_KV, D, dtype, seed, extra=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *s: torch.randn(s, generator=gen, device="cuda").to(DTYPES[dtype])  # noqa: E731
    q, k, v = make(B, L, H, D), make(B, L, H_KV, D), make(B, L, H_KV, D)
    return (q, k, v) + ((make(B, extra, H_KV, D), make(B, extra, H_KV, D)) if extra else ())


def _check(out, lse, ref, ref_lse, dtype):
    acc = check_accuracy(out.float(), ref, dtype)
    assert acc.ok, acc.message
    if lse is not None:
        torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


CASES = [  # (L, kernel_size, stride, dilation)
    (1000, 7, 1, 1), (1000, 64, 1, 1), (1000, 255, 1, 1), (2053, 513, 1, 1), (2053, 513, 256, 1),
    (2053, 513, 513, 1), (1000, 128, 128, 1), (999, 31, 5, 3), (1024, 300, 100, 2), (300, 300, 1, 1),
]


@pytest.mark.parametrize("dtype,case,causal", list(itertools.product(["fp16", "bf16"], CASES, [False, True])))
def test_na1d_matches_the_reference(dtype, case, causal):
    _hopper()
    L, K, S, dil = case
    q, k, v = _inputs(2, L, 4, 2, 64, dtype, hash((case, causal)) % (1 << 31))
    _poison_allocator()
    out, lse = na1d(q, k, v, K, stride=S, dilation=dil, is_causal=causal, return_lse=True)
    ref, ref_lse = na_reference(q, k, v, K, S, dil, causal, return_lse=True)
    assert out.shape == (2, L, 4, 64) and lse.shape == (2, L, 4)
    _check(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_na1d_head_dims_scale_and_additional_keys(D, causal):
    _hopper()
    q, k, v, ak, av = _inputs(1, 777, 8, 8, D, "fp16", D + causal, extra=37)
    _poison_allocator()
    out, lse = na1d(q, k, v, 65, stride=2, is_causal=causal, scale=0.05, additional_keys=ak, additional_values=av,
                    return_lse=True)
    ref, ref_lse = na_reference(q, k, v, 65, 2, 1, causal, scale=0.05, additional_keys=ak, additional_values=av,
                                return_lse=True)
    _check(out, lse, ref, ref_lse, "fp16")


@pytest.mark.parametrize("q_tile", [128, 192])
def test_na1d_query_tiles(q_tile):
    """NATTEN's q_tile_shape picks the kernel's query tile (192 rows: three consumer warpgroups at D=64)."""
    _hopper()
    q, k, v = _inputs(2, 1500, 4, 4, 64, "bf16", q_tile)
    _poison_allocator()
    out = na1d(q, k, v, 129, stride=3, q_tile_shape=(q_tile,), kv_tile_shape=(128,))
    _check(out, None, na_reference(q, k, v, 129, 3), None, "bf16")


def test_na1d_without_lse_and_the_dense_window():
    """kernel_size = L (non-causal) is dense attention: na1d equals it."""
    _hopper()
    import gluon_attn
    q, k, v = _inputs(2, 513, 4, 4, 64, "fp16", 3)
    out = na1d(q, k, v, 513)
    dense = gluon_attn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out, dense, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", ["fp8e4m3", "fp8e5"])
@pytest.mark.parametrize("D,case", [(128, (2053, 513, 1, 1)), (64, (999, 31, 5, 3)), (256, (777, 65, 2, 1))])
def test_na1d_fp8_matches_the_reference_on_the_dequantized_inputs(dtype, D, case):
    """na1d's fp8 forward (fp16 output) against the fp32 reference of the values the fp8 inputs stand for (x times
    its descale), GQA, strides and dilation; additional keys merged through fp8 ``attention``."""
    from gluon_attn.problem import DTYPES as ALL
    _hopper()
    L, K, S, dil = case
    gen = torch.Generator(device="cuda").manual_seed(D + L)
    make = lambda h: torch.randn(2, L, h, D, generator=gen, device="cuda")  # noqa: E731
    real = make(4), make(2), make(2)
    scales = [float(t.abs().max()) / 200 for t in real]
    q, k, v = (t.div(sc).to(ALL[dtype]) for t, sc in zip(real, scales))
    ak, av = (torch.randn(2, 33, 2, D, generator=gen, device="cuda").div(sc).to(ALL[dtype]) for sc in scales[1:])
    _poison_allocator()
    out, lse = na1d(q, k, v, K, stride=S, dilation=dil, return_lse=True, additional_keys=ak, additional_values=av,
                    descale_q=scales[0], descale_k=scales[1], descale_v=scales[2])
    deq = [t.float() * sc for t, sc in zip((q, k, v), scales)]
    ref, ref_lse = na_reference(*deq, K, S, dil, False, additional_keys=ak.float() * scales[1],
                                additional_values=av.float() * scales[2], return_lse=True)
    assert out.dtype == torch.float16
    acc = check_accuracy(out.float(), ref, dtype, "fp16")
    assert acc.ok, acc.message
    torch.testing.assert_close(lse, ref_lse, atol=3e-2, rtol=3e-2)


BACKWARD_CASES = [  # (L, kernel_size, stride, dilation, D)
    (1000, 7, 1, 1, 64), (1000, 129, 1, 1, 128), (2053, 513, 1, 1, 64), (2053, 513, 256, 1, 128),
    (1000, 128, 128, 1, 64), (999, 31, 5, 3, 128), (777, 65, 2, 2, 256),
]


def _check_window_grads(op, q, k, v, K, S, dil, causal, dtype):
    """dQ, dK, dV of ``op`` (na1d, na2d, na3d) through autograd, the allocator poisoned first, against the fp32
    reference's."""
    from .test_backward_gpu import _check_grads, _ref_grads
    do = torch.randn_like(q)
    _poison_allocator()
    op(q, k, v, K, stride=S, dilation=dil, is_causal=causal).backward(do)
    _, refs = _ref_grads(lambda a, b, c: na_reference(a, b, c, K, S, dil, causal), (q, k, v), do)
    _check_grads((q.grad, k.grad, v.grad), refs, dtype)


@pytest.mark.parametrize("dtype,case,causal", list(itertools.product(["fp16", "bf16"], BACKWARD_CASES, [False, True])))
def test_na1d_backward_matches_the_reference(dtype, case, causal):
    """dQ, dK, dV through autograd (the backward's WINDOW mode per dilation group) against the fp32 reference's."""
    _hopper()
    L, K, S, dil, D = case
    q, k, v = (t.requires_grad_() for t in _inputs(2, L, 4, 2, D, dtype, hash((case, causal, 1)) % (1 << 31)))
    _check_window_grads(na1d, q, k, v, K, S, dil, causal, dtype)


def test_na1d_backward_through_the_lse_and_additional_keys():
    """The lse's gradient reaches the kernel (grad_lse) where additional keys are merged by it."""
    from .test_backward_gpu import _check_grads, _ref_grads
    _hopper()
    q, k, v, ak, av = (t.requires_grad_() for t in _inputs(1, 700, 4, 4, 64, "fp16", 11, extra=29))
    do = torch.randn_like(q)
    out = na1d(q, k, v, 63, stride=3, additional_keys=ak, additional_values=av)
    out.backward(do)
    _, refs = _ref_grads(lambda a, b, c, d, e: na_reference(a, b, c, 63, 3, additional_keys=d, additional_values=e),
                         (q, k, v, ak, av), do)
    _check_grads((q.grad, k.grad, v.grad), refs[:3], "fp16")
    _check_grads((ak.grad, av.grad), refs[3:], "fp16")


@pytest.mark.parametrize("timing", ["eager", "graph"])
def test_na_sweep_runs_every_provider_through_the_gate(tmp_path, timing):
    """``sweep --na`` on a GPU: na1d, FlexAttention's block mask and the dense providers pass the gate; rows carry
    the speedup over the fastest dense one; each timing (graph: every provider captured in a CUDA graph)."""
    _hopper()
    import pandas as pd
    from click.testing import CliRunner

    from gluon_attn.cli import main
    res = CliRunner().invoke(main, ["sweep", "--na", "--token-layout", "4096", "--window", "257", "--stride", "1;8",
                                    "-Z", "1", "-H", "4", "--head-dim", "128", "--dtype", "bf16", "--providers",
                                    "gluon,flex,dense-gluon,dense-cudnn", "--warmup-ms", "20", "--rep-ms", "20",
                                    "--timing", timing, "--out", str(tmp_path / "na")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "na" / "rows.csv", keep_default_na=False)
    assert len(df) == 8 and (df.status == "ok").all(), df[["provider", "status", "message"]]
    assert (df.speedup_vs_dense.astype(float) > 0).all() and set(df.timing) == {timing}


def _failed_rows(df) -> str:
    """The rows not ``ok``, each with its message in full (pytest shortens a long repr)."""
    return "\n".join(f"{r['token_layout']} {r['provider']} {r['pass']}: {r['status']}: {r['message']}"
                     for _, r in df[df.status != "ok"].iterrows())


def test_na_sweep_times_the_backward_passes_through_the_gate(tmp_path):
    """``sweep --na --pass bwd,fwd+bwd`` on a GPU: na1d's backward, Flex's and the dense providers' pass the gradient
    gate (dQ, dK, dV at sampled tokens against fp32), in 1-D and 2-D."""
    _hopper()
    import pandas as pd
    from click.testing import CliRunner

    from gluon_attn.cli import main
    for layout, window in (("4096", "257"), ("48x40", "9x7")):  # (layouts and windows are crossed axes)
        res = CliRunner().invoke(main, ["sweep", "--na", "--token-layout", layout, "--window", window, "-Z", "1",
                                        "-H", "4", "--kv-heads", "2", "--head-dim", "128", "--dtype", "bf16", "--pass",
                                        "bwd,fwd+bwd", "--providers", "gluon,flex,dense-gluon,dense-cudnn",
                                        "--warmup-ms", "20", "--rep-ms", "20", "--out", str(tmp_path / "b"),
                                        "--resume"], catch_exceptions=False)
        assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "b" / "rows.csv", keep_default_na=False)
    assert len(df) == 2 * 2 * 4 and (df.status == "ok").all(), _failed_rows(df)


def test_graph_timing_captures_the_backward_passes(tmp_path):
    """``--timing graph --pass bwd,fwd+bwd``: each provider's backward is captured (its forward built on the capture
    stream: autograd runs the backward on the forward's stream) and replayed, na1d's and the dense kernels' alike."""
    _hopper()
    import pandas as pd
    from click.testing import CliRunner

    from gluon_attn.cli import main
    res = CliRunner().invoke(main, ["sweep", "--na", "--token-layout", "4000", "--window", "257", "--stride", "1;64",
                                    "-Z", "1", "-H", "2", "--head-dim", "128", "--dtype", "bf16", "--pass",
                                    "bwd,fwd+bwd", "--providers", "gluon,dense-gluon,dense-cudnn,flex",
                                    "--timing", "graph", "--warmup-ms", "20", "--rep-ms", "20",
                                    "--out", str(tmp_path / "g")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "g" / "rows.csv", keep_default_na=False)
    assert len(df) == 2 * 2 * 4 and (df.status == "ok").all(), _failed_rows(df)
    assert (df.timing == "graph").all() and (df.p50_ms.astype(float) > 0).all()


def test_optimize_na_times_the_tile_pairs_the_kernel_takes(tmp_path):
    """``optimize --na`` on a 2-D problem: the plan's best pairs and the default, each gated, timed, fastest first."""
    _hopper()
    import pandas as pd
    from click.testing import CliRunner

    from gluon_attn.cli import main
    res = CliRunner().invoke(main, ["optimize", "--na", "--token-layout", "48,40", "--window", "9,7", "-Z", "1",
                                    "-H", "4", "--head-dim", "64", "--dtype", "bf16", "--max-configs", "3",
                                    "--rounds", "1", "--rep-ms", "10", "--warmup-ms", "10", "--out",
                                    str(tmp_path / "o")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "o" / "optimize.csv", keep_default_na=False)
    assert 3 <= len(df) <= 4 and (df.status == "ok").all() and df["default"].astype(str).str.contains("True").any()
    assert list(df.p50_ms.astype(float)) == sorted(df.p50_ms.astype(float)) and "best:" in res.output
    # --configs: only the named pairs (here the last of those timed above and one below --max-configs)
    named = [f"{df.q_tile_shape.iloc[-1]}/{df.kv_tile_shape.iloc[-1]}", "32x4/8x16"]
    res = CliRunner().invoke(main, ["optimize", "--na", "--token-layout", "48,40", "--window", "9,7", "-Z", "1",
                                    "-H", "4", "--head-dim", "64", "--dtype", "bf16", "--configs", ",".join(named),
                                    "--rounds", "1", "--rep-ms", "10", "--warmup-ms", "10", "--out",
                                    str(tmp_path / "c")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "c" / "optimize.csv", keep_default_na=False)
    assert sorted(df.q_tile_shape + "/" + df.kv_tile_shape) == sorted(named) and (df.status == "ok").all()
    # --pass bwd: the backward's boxes (backward_q_tile_shape / backward_kv_tile_shape), gated on the gradients
    res = CliRunner().invoke(main, ["optimize", "--na", "--token-layout", "48,40", "--window", "9,7", "-Z", "1",
                                    "-H", "4", "--head-dim", "128", "--dtype", "bf16", "--pass", "bwd",
                                    "--max-configs", "3", "--rounds", "1", "--rep-ms", "10", "--warmup-ms", "10",
                                    "--out", str(tmp_path / "b")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "b" / "optimize.csv", keep_default_na=False)
    assert 3 <= len(df) <= 4 and (df.status == "ok").all(), df.to_dict("records")
    assert set(df.q_tile_shape.map(lambda s: eval(s.replace("x", "*")))) == {64}  # (D=128's 64-position query boxes)


def test_profile_na_lists_the_neighborhood_kernels_forward_and_backward():
    """``profile --na --backprop``: na1d's forward and backward kernels under torch.profiler, ours first."""
    _hopper()
    from click.testing import CliRunner

    from gluon_attn.cli import main
    res = CliRunner().invoke(main, ["profile", "--na", "--token-layout", "4096", "--window", "257", "-Z", "1", "-H",
                                    "4", "--head-dim", "128", "--dtype", "bf16", "--backprop", "--iters", "3",
                                    "--format", "csv"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "attention forward" in res.output and "attention backward" in res.output
    res = CliRunner().invoke(main, ["profile", "--na", "--token-layout", "48,40", "--window", "9,7", "-H", "4",
                                    "--head-dim", "128", "--dtype", "bf16", "--backprop", "--iters", "3", "--format",
                                    "csv"], catch_exceptions=False)
    assert res.exit_code == 0 and "attention backward" in res.output, res.output


def test_fa4_with_the_neighborhood_as_mask_mod_passes_the_gate(tmp_path):
    """FA4's sm_90 forward with the neighborhood as a mask_mod and block-sparse key tiles (``bench.fa4_na``): 1-D
    with dilation, 2-D causal in one dimension, 3-D with GQA, against NATTEN's mask on the gate's rows."""
    _hopper()
    pytest.importorskip("flash_attn.cute")
    import pandas as pd
    from click.testing import CliRunner

    from gluon_attn.cli import main
    for layout, window, extra in (("1000", "65", ["--dilation", "3"]), ("40x72", "9x17", ["--causal-dims", "1x0"]),
                                  ("9x12x20", "3x5x7", ["--kv-heads", "2"])):
        out = tmp_path / layout
        res = CliRunner().invoke(main, ["sweep", "--na", "--token-layout", layout, "--window", window, *extra, "-Z",
                                        "2", "-H", "4", "--head-dim", "128", "--dtype", "bf16", "--providers",
                                        "fa4,gluon", "--warmup-ms", "20", "--rep-ms", "20", "--out", str(out)],
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
        df = pd.read_csv(out / "rows.csv", keep_default_na=False)
        assert (df.status == "ok").all(), df[["provider", "status", "message"]]


def test_na1d_deterministic_backward_repeats_bit_for_bit():
    """Under torch.use_deterministic_algorithms dQ's adds go in key-block order, each query block's starting at
    the first key block its windows reach: two runs agree exactly, and with the reference."""
    from .test_backward_gpu import _check_grads, _ref_grads
    _hopper()
    q, k, v = (t.requires_grad_() for t in _inputs(1, 1500, 4, 2, 128, "fp16", 21))
    do = torch.randn_like(q)
    grads = _deterministic_grads_twice(lambda: na1d(q, k, v, 257, stride=4, is_causal=True), (q, k, v), do)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    _, refs = _ref_grads(lambda a, b, c: na_reference(a, b, c, 257, 4, 1, True), (q, k, v), do)
    _check_grads(grads[0], refs, "fp16")


@pytest.mark.parametrize("causal", [False, True])
def test_na1d_with_the_192_128_pair_forward_backward_and_deterministic(causal):
    """q and k 192, v 128 (DeepSeek-V3's head dims) in na1d: the output against the reference, and the backward, which
    runs in the pair's own units (32-query blocks, 128-key units) in its WINDOW mode, against the reference's
    gradients; under torch.use_deterministic_algorithms two runs agree bit for bit."""
    from .test_backward_gpu import _check_grads, _ref_grads
    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(192 + causal)
    make = lambda *s: torch.randn(s, generator=gen, device="cuda").half().requires_grad_()  # noqa: E731
    q, k, v = make(2, 1000, 4, 192), make(2, 1000, 2, 192), make(2, 1000, 2, 128)
    do = torch.randn(2, 1000, 4, 128, generator=gen, device="cuda").half()
    call = lambda: na1d(q, k, v, 255, stride=4, is_causal=causal)  # noqa: E731
    with torch.no_grad():
        _check(call().float(), None, na_reference(q.float(), k.float(), v.float(), 255, 4, 1, causal), None, "fp16")
    grads = _deterministic_grads_twice(call, (q, k, v), do)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    _, refs = _ref_grads(lambda a, b, c: na_reference(a, b, c, 255, 4, 1, causal), (q, k, v), do)
    _check_grads(grads[0], refs, "fp16")
    for t in (q, k, v):
        t.grad = None
    _poison_allocator()
    call().backward(do)
    _check_grads((q.grad, k.grad, v.grad), refs, "fp16")


def _deterministic_grads_twice(call, leaves, do):
    """The leaves' gradients of ``call()`` against ``do``, twice, under torch.use_deterministic_algorithms."""
    grads = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            for t in leaves:
                t.grad = None
            call().backward(do)
            grads.append([t.grad.clone() for t in leaves])
    finally:
        torch.use_deterministic_algorithms(False)
    return grads


def _inputs2(B, X, Y, H, H_KV, D, dtype, seed, extra=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *s: torch.randn(s, generator=gen, device="cuda").to(DTYPES[dtype])  # noqa: E731
    q, k, v = make(B, X, Y, H, D), make(B, X, Y, H_KV, D), make(B, X, Y, H_KV, D)
    return (q, k, v) + ((make(B, extra, H_KV, D), make(B, extra, H_KV, D)) if extra else ())


CASES2 = [  # (layout, kernel_size, stride, dilation): sizes that are not multiples of the boxes
    ((37, 45), (7, 9), 1, 1), ((64, 64), 13, 1, 1), ((40, 72), (16, 33), (4, 11), 1), ((48, 40), (16, 8), (16, 8), 1),
    ((33, 50), (5, 7), (2, 3), (3, 2)), ((20, 24), (20, 24), 1, 1), ((100, 9), (31, 5), (7, 5), 1),
    ((34, 51), (5, 7), 1, (2, 2)),  # (y's groups of 26 and 25: a launch per group; (33, 50)'s fold into heads)
]


@pytest.mark.parametrize("dtype,case,causal", list(itertools.product(
    ["fp16", "bf16"], CASES2, [(False, False), (True, False), (False, True), (True, True)])))
def test_na2d_matches_the_reference(dtype, case, causal):
    """The 2-D WINDOW mode against NATTEN's explicit mask: windows shifted at the borders, strides up to blocked,
    dilation groups as strided views, causal per dimension, GQA, the lse."""
    _hopper()
    layout, K, S, dil = case
    q, k, v = _inputs2(2, *layout, 4, 2, 64, dtype, hash((case, causal)) % (1 << 31))
    _poison_allocator()
    out, lse = na2d(q, k, v, K, stride=S, dilation=dil, is_causal=causal, return_lse=True)
    ref, ref_lse = na_reference(q, k, v, K, S, dil, causal, return_lse=True)
    assert out.shape == (2, *layout, 4, 64) and lse.shape == (2, *layout, 4)
    _check(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("layout,dil", [((33, 50), (3, 2)), ((34, 51), (2, 2)), ((32, 48), (1, 4)),
                                        ((32, 30), (4, 3))])
def test_na2d_dilation_groups_folded_into_heads_and_batches(B, layout, dil):
    """Fewer batches than x's dilation groups: x's groups are the launch's batches (a launch per batch) and y's its
    heads where they are as long (one launch for (33, 50) at (3, 2) with one batch); y's groups of unequal length
    launch apart. The checked call, then its route (the prepared launches on the same views), against NATTEN's mask,
    into poisoned memory, GQA."""
    _hopper()
    q, k, v = _inputs2(B, *layout, 4, 2, 64, "bf16", hash((B, layout, dil)) % (1 << 31))
    ref, ref_lse = na_reference(q, k, v, (5, 7), 1, dil, False, return_lse=True)
    for _ in range(3):
        _poison_allocator()
        out, lse = na2d(q, k, v, (5, 7), dilation=dil, return_lse=True)
        _check(out, lse, ref, ref_lse, "bf16")
        _poison_allocator()
        _check(na2d(q, k, v, (5, 7), dilation=dil), None, ref, None, "bf16")


@pytest.mark.parametrize("boxes", [((128, 1), (128, 1)), ((2, 64), (1, 128)), ((16, 8), (8, 16)), ((4, 32), (32, 4))])
def test_na2d_tile_shapes_head_dim_128_scale_and_additional_keys(boxes):
    """NATTEN's q_tile_shape / kv_tile_shape choose the boxes: every shape gives the reference's output."""
    _hopper()
    q, k, v, ak, av = _inputs2(1, 45, 70, 8, 8, 128, "bf16", sum(boxes[0]), extra=19)
    _poison_allocator()
    out, lse = na2d(q, k, v, (11, 21), stride=(2, 3), is_causal=(False, True), scale=0.05, additional_keys=ak,
                    additional_values=av, return_lse=True, q_tile_shape=boxes[0], kv_tile_shape=boxes[1])
    ref, ref_lse = na_reference(q, k, v, (11, 21), (2, 3), 1, (False, True), scale=0.05, additional_keys=ak,
                                additional_values=av, return_lse=True)
    _check(out, lse, ref, ref_lse, "bf16")


@pytest.mark.parametrize("op", ["na1d", "na2d", "na3d"])
def test_additional_keys_take_a_route_and_merge_in_one_launch(op):
    """A plain eager call with additional keys, repeated with fresh inputs of one signature: the first call makes its
    route (additional keys' shapes in the key), the later ones take it; each merges the extra keys into the
    neighborhood's output and lse in one launch (``merge.merge_pair_``). Every call against the reference, the
    allocator poisoned (GQA, a causal dimension, dilation; the lse returned or not)."""
    from gluon_attn import neighborhood

    _hopper()
    shapes = {"na1d": ((2, 301, 4, 2, 64), dict(kernel_size=33, stride=2)),
              "na2d": ((2, 30, 41, 4, 2, 64), dict(kernel_size=(7, 9), is_causal=(True, False))),
              "na3d": ((1, 9, 10, 11, 4, 2, 32), dict(kernel_size=(3, 5, 3), dilation=(1, 2, 1)))}
    shape, kw = shapes[op]
    fn = {"na1d": na1d, "na2d": na2d, "na3d": na3d}[op]
    *grid, H, H_KV, D = shape[1:]
    gen = torch.Generator(device="cuda").manual_seed(len(op) + sum(grid))
    make = lambda *s: torch.randn(s, generator=gen, device="cuda").half()  # noqa: E731
    neighborhood._NA_ROUTES.clear()
    for turn in range(3):
        q, k, v = make(shape[0], *grid, H, D), make(shape[0], *grid, H_KV, D), make(shape[0], *grid, H_KV, D)
        ak, av = make(shape[0], 23, H_KV, D), make(shape[0], 23, H_KV, D)
        _poison_allocator()
        out, lse = fn(q, k, v, **kw, additional_keys=ak, additional_values=av, return_lse=True)
        ref, ref_lse = na_reference(q, k, v, kw["kernel_size"], kw.get("stride", 1), kw.get("dilation", 1),
                                    kw.get("is_causal", False), additional_keys=ak, additional_values=av,
                                    return_lse=True)
        _check(out, lse, ref, ref_lse, "fp16")
        _poison_allocator()
        _check(fn(q, k, v, **kw, additional_keys=ak, additional_values=av), None, ref, None, "fp16")
        assert len(neighborhood._NA_ROUTES) == 2  # (one route each: the lse returned and not)


def test_kernel_timing_profiles_the_kernels_a_users_call_launches():
    """``--timing kernel`` profiles its calls (torch.profiler), under which a call takes the custom op's path: with
    ``api.profiled_as_eager`` (its timer's context) an na2d call with additional keys launches what a user's plain
    call launches (the neighborhood's kernel, the extra keys' and the one-launch merge), not the op's merge of ~27
    PyTorch kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from gluon_attn import api
    from gluon_attn.bench.timing import kernel_benchmark

    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 30, 41, 4, 64, generator=gen, device="cuda").half() for _ in range(3))
    ak, av = (torch.randn(2, 23, 4, 64, generator=gen, device="cuda").half() for _ in range(2))
    call = lambda: na2d(q, k, v, kernel_size=7, additional_keys=ak, additional_values=av)  # noqa: E731
    call()

    def kernels(context):
        torch.cuda.synchronize()
        with context, profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]

    eager, op = kernels(api.profiled_as_eager()), kernels(contextlib.nullcontext())
    assert len(eager) <= 4 and any("merge_pair" in n for n in eager), eager
    assert len(op) > len(eager) and not any("merge_pair" in n for n in op), op
    assert kernel_benchmark(call).p50_ms > 0


@pytest.mark.parametrize("case", [
    ((56, 56), (7, 7), (False, False), 1, ((16, 8), (8, 16))), ((56, 56), (7, 7), (True, False), 1, ((8, 16), (16, 8))),
    ((30, 41), (3, 5), (False, True), (2, 1), ((16, 8), (4, 32))), ((64, 64), (7, 7), (False, False), 1, None),
    ((16, 16, 16), (3, 3, 3), (False, False, False), 1, None), ((16, 16, 16), (5, 5, 5), (True, False, False), 1, None),
    ((12, 10, 9), (5, 3, 3), (False, True, False), (1, 2, 1), ((2, 4, 16), (4, 2, 16)))])
def test_small_windows_over_halo_boxes_match_the_reference(case):
    """Small windows, where the forward's key boxes start at each query tile's halo (not the lattice's): windows
    shifted at the borders, boxes past the grid and into the next batch (3-D's batches folded into x), causal
    dimensions, dilation groups, GQA, the lse; the default boxes and given ones."""
    _hopper()
    layout, K, causal, dil, boxes = case
    gen = torch.Generator(device="cuda").manual_seed(sum(layout) + sum(K))
    make = lambda h: torch.randn(4, *layout, h, 64, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    q, k, v = make(4), make(2), make(2)
    tiles = dict(q_tile_shape=boxes[0], kv_tile_shape=boxes[1]) if boxes else {}
    op = na2d if len(layout) == 2 else na3d
    _poison_allocator()
    out, lse = op(q, k, v, K, dilation=dil, is_causal=causal, return_lse=True, **tiles)
    ref, ref_lse = na_reference(q, k, v, K, 1, dil, causal, return_lse=True)
    _check(out, lse, ref, ref_lse, "bf16")


def test_na2d_equals_dense_attention_over_the_whole_grid():
    _hopper()
    import gluon_attn
    q, k, v = _inputs2(2, 24, 40, 4, 4, 128, "fp16", 5)
    out = na2d(q, k, v, (24, 40))
    flat = lambda t: t.reshape(2, 24 * 40, 4, 128).transpose(1, 2)  # noqa: E731
    dense = gluon_attn.attention(flat(q), flat(k), flat(v)).transpose(1, 2).reshape(out.shape)
    torch.testing.assert_close(out, dense, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dims", [2, 3])
def test_na2d_na3d_deterministic_backward_repeats_bit_for_bit(dims):
    """Under torch.use_deterministic_algorithms dQ's adds into each query box go in the order of the key boxes that
    reach it (``hopper_bwd._box_turn``): two runs agree exactly, and with the reference (GQA, a causal dimension)."""
    from .test_backward_gpu import _check_grads, _ref_grads
    _hopper()
    if dims == 2:
        q, k, v = (t.requires_grad_() for t in _inputs2(1, 45, 70, 4, 2, 128, "bf16", 8))
        op, K, S, causal = na2d, (11, 21), (2, 3), (False, True)
    else:
        gen = torch.Generator(device="cuda").manual_seed(9)
        make = lambda h: torch.randn(1, 10, 12, 14, h, 64, generator=gen, device="cuda").to(torch.bfloat16)  # noqa
        q, k, v = (t.requires_grad_() for t in (make(4), make(2), make(2)))
        op, K, S, causal = na3d, (5, 7, 9), (1, 2, 3), (True, False, False)
    do = torch.randn_like(q)
    grads = _deterministic_grads_twice(lambda: op(q, k, v, K, stride=S, is_causal=causal), (q, k, v), do)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    _, refs = _ref_grads(lambda a, b, c: na_reference(a, b, c, K, S, 1, causal), (q, k, v), do)
    _check_grads(grads[0], refs, "bf16")


@pytest.mark.parametrize("dtype,case,causal,D", [
    (dtype, case, causal, (128, 64)[i % 2]) for i, (dtype, case, causal) in enumerate(itertools.product(
        ["fp16", "bf16"], CASES2, [(False, False), (True, False), (False, True), (True, True)]))])
def test_na2d_backward_matches_the_reference(dtype, case, causal, D):
    """dQ, dK, dV through autograd (the backward's 2-D WINDOW mode: key boxes walking the query boxes that attend
    them) against the fp32 reference's, GQA, every case and causal combination, head dims 64 and 128 in turn."""
    _hopper()
    (X, Y), K, S, dil = case
    q, k, v = (t.requires_grad_() for t in _inputs2(1, X, Y, 4, 2, D, dtype, hash((case, causal, D)) % (1 << 31)))
    _check_window_grads(na2d, q, k, v, K, S, dil, causal, dtype)


@pytest.mark.parametrize("boxes", [((8, 8), (8, 16)), ((4, 16), (2, 64)), ((1, 64), (16, 8))])
def test_na2d_backward_tile_shapes_lse_and_additional_keys(boxes):
    """The backward's tile shapes (``backward_q_tile_shape``, ``backward_kv_tile_shape``) and the lse's gradient
    (additional keys merged by it) through the 2-D backward, batch 2."""
    from .test_backward_gpu import _check_grads, _ref_grads
    _hopper()
    q, k, v, ak, av = (t.requires_grad_() for t in _inputs2(2, 45, 70, 4, 4, 128, "bf16", sum(boxes[1]), extra=19))
    do = torch.randn_like(q)
    kw = dict(kernel_size=(11, 21), stride=(2, 3), is_causal=(False, True))
    out = na2d(q, k, v, **kw, scale=0.05, additional_keys=ak, additional_values=av, backward_q_tile_shape=boxes[0],
               backward_kv_tile_shape=boxes[1])
    out.backward(do)
    _, refs = _ref_grads(lambda a, b, c, d, e: na_reference(a, b, c, kw["kernel_size"], kw["stride"], 1,
                                                            kw["is_causal"], scale=0.05, additional_keys=d,
                                                            additional_values=e), (q, k, v, ak, av), do)
    _check_grads((q.grad, k.grad, v.grad), refs[:3], "bf16")
    _check_grads((ak.grad, av.grad), refs[3:], "bf16")


CASES3 = [  # (layout, kernel_size, stride, dilation)
    ((9, 12, 10), (3, 5, 7), 1, 1), ((12, 16, 20), (5, 8, 8), (2, 4, 8), 1), ((10, 9, 14), (4, 3, 5), 1, (2, 3, 2)),
    ((8, 8, 16), (8, 8, 16), 1, 1), ((17, 6, 11), (9, 6, 4), (9, 3, 4), 1),
]


@pytest.mark.parametrize("dtype,case,causal", list(itertools.product(
    ["fp16", "bf16"], CASES3, [(False, False, False), (True, False, True), (True, True, True)])))
def test_na3d_matches_the_reference(dtype, case, causal):
    """The 3-D WINDOW mode against NATTEN's explicit mask: boxes of [H, X, Y, Z, D] views a batch at a time, odd
    grids, strides, dilation groups, causal per dimension, GQA, the lse."""
    _hopper()
    layout, K, S, dil = case
    gen = torch.Generator(device="cuda").manual_seed(hash((case, causal)) % (1 << 31))
    make = lambda h: torch.randn(2, *layout, h, 64, generator=gen, device="cuda").to(DTYPES[dtype])  # noqa: E731
    q, k, v = make(4), make(2), make(2)
    _poison_allocator()
    out, lse = na3d(q, k, v, K, stride=S, dilation=dil, is_causal=causal, return_lse=True)
    ref, ref_lse = na_reference(q, k, v, K, S, dil, causal, return_lse=True)
    assert out.shape == (2, *layout, 4, 64) and lse.shape == (2, *layout, 4)
    _check(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("layout,boxes", [((8, 8, 16), ((4, 2, 16), (8, 1, 16))), ((6, 12, 10), ((2, 8, 8), (2, 8, 8))),
                                           ((7, 8, 8), ((2, 8, 8), (2, 8, 8)))])
def test_na3d_batches_in_one_launch_with_more_heads_than_x(layout, boxes):
    """na3d's batches folded into x (one launch for all, where the query tiles divide x; (7, 8, 8) does not fold), with
    more query heads than the grid's x (the kernel's head count is the view's dimension 0), GQA, the lse, and the
    same call again through its prepared route."""
    _hopper()
    from gluon_attn.kernels import hopper_host
    from gluon_attn.neighborhood import _folds, neighborhood
    gen = torch.Generator(device="cuda").manual_seed(len(layout) + layout[0])
    make = lambda h: torch.randn(3, *layout, h, 64, generator=gen, device="cuda").to(torch.float16)  # noqa: E731
    q, k, v = make(12), make(4), make(4)
    assert _folds(neighborhood(layout, 3), boxes, (q, k, v), False, hopper_host) == (layout[0] % boxes[0][0] == 0)
    _poison_allocator()
    tiles = dict(q_tile_shape=boxes[0], kv_tile_shape=boxes[1])
    out, lse = na3d(q, k, v, 3, return_lse=True, **tiles)
    ref, ref_lse = na_reference(q, k, v, 3, 1, 1, False, return_lse=True)
    _check(out, lse, ref, ref_lse, "fp16")
    for _ in range(2):  # (the second call takes the route the first made)
        _poison_allocator()
        _check(na3d(q, k, v, 3, **tiles), None, ref, None, "fp16")


@pytest.mark.parametrize("boxes", [((16, 8, 1), (2, 8, 8)), ((8, 4, 4), (4, 8, 4)), ((128, 1, 1), (1, 1, 128))])
def test_na3d_tile_shapes_and_additional_keys(boxes):
    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(sum(boxes[0]))
    make = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    q, k, v, ak, av = make(1, 11, 13, 18, 4, 128), make(1, 11, 13, 18, 4, 128), make(1, 11, 13, 18, 4, 128), \
        make(1, 7, 4, 128), make(1, 7, 4, 128)
    _poison_allocator()
    out, lse = na3d(q, k, v, (5, 7, 9), stride=(1, 2, 3), is_causal=(False, True, False), additional_keys=ak,
                    additional_values=av, return_lse=True, q_tile_shape=boxes[0], kv_tile_shape=boxes[1])
    ref, ref_lse = na_reference(q, k, v, (5, 7, 9), (1, 2, 3), 1, (False, True, False), additional_keys=ak,
                                additional_values=av, return_lse=True)
    _check(out, lse, ref, ref_lse, "bf16")


@pytest.mark.parametrize("case,causal,D", [(CASES3[0], (False, False, False), 128), (CASES3[1], (True, False, True), 64),
                                           (CASES3[2], (False, True, False), 128), (CASES3[4], (True, True, True), 128)])
def test_na3d_backward_matches_the_reference(case, causal, D):
    """dQ, dK, dV through the backward's 3-D WINDOW mode (a launch per batch and dilation group) against the fp32
    reference's: batch 2, GQA, strides, dilations and causal dimensions."""
    _hopper()
    layout, K, S, dil = case
    gen = torch.Generator(device="cuda").manual_seed(hash((case, causal)) % (1 << 31))
    make = lambda h: torch.randn(2, *layout, h, D, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    q, k, v = (t.requires_grad_() for t in (make(4), make(2), make(2)))
    _check_window_grads(na3d, q, k, v, K, S, dil, causal, "bf16")


PADDED_CASES = {  # dims -> (layout, kernel_size, stride, dilation, is_causal): NATTEN's small windows, odd grids
    1: (1000, 7, 1, 2, True), 2: ((37, 45), (7, 7), (1, 2), 1, (False, True)),
    3: ((9, 12, 10), (3, 5, 3), 1, (1, 2, 1), (True, False, False)),
}


@pytest.mark.parametrize("dims,D,dtype", [(dims, D, dtype) for dims in (1, 2, 3) for D in (32, 96)
                                          for dtype in ("fp16", "bf16")])
def test_na_head_dims_32_and_96_forward_and_backward(dims, D, dtype):
    """Head dims 32 (NATTEN's classic models) and 96 in na1d, na2d and na3d, run in the D=64 and D=128 kernels (the
    columns past the tensors' read as zeros, the O box store and the gradients' clipped): output, lse and dQ, dK, dV
    against the fp32 reference's, batch 2, GQA, a causal dimension and a dilation."""
    from .test_backward_gpu import _check_grads, _ref_grads
    _hopper()
    layout, K, S, dil, causal = PADDED_CASES[dims]
    spatial = (layout,) if dims == 1 else layout
    gen = torch.Generator(device="cuda").manual_seed(dims * 1000 + D)
    make = lambda h: torch.randn(2, *spatial, h, D, generator=gen, device="cuda").to(DTYPES[dtype])  # noqa: E731
    q, k, v = (t.requires_grad_() for t in (make(4), make(2), make(2)))
    op = (na1d, na2d, na3d)[dims - 1]
    _poison_allocator()
    out, lse = op(q, k, v, K, stride=S, dilation=dil, is_causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    with torch.no_grad():
        ref, ref_lse = na_reference(q, k, v, K, S, dil, causal, return_lse=True)
    _check(out.detach(), lse.detach(), ref, ref_lse, dtype)
    do = torch.randn_like(q)
    _poison_allocator()
    op(q, k, v, K, stride=S, dilation=dil, is_causal=causal).backward(do)
    _, refs = _ref_grads(lambda a, b, c: na_reference(a, b, c, K, S, dil, causal), (q, k, v), do)
    _check_grads((q.grad, k.grad, v.grad), refs, dtype)


@pytest.mark.parametrize("dims,dtype,D", [(2, "fp8e4m3", 128), (2, "fp8e5", 64), (3, "fp8e4m3", 128),
                                          (3, "fp8e5", 64)])
def test_na2d_na3d_fp8_match_the_reference_on_the_dequantized_inputs(dims, dtype, D):
    """na2d's and na3d's fp8 forward (fp16 output, V^T made of the key boxes) against the fp32 reference of the
    values the fp8 inputs stand for; odd grids, strides, dilation, causal per dimension, GQA, additional keys."""
    from gluon_attn.problem import DTYPES as ALL
    _hopper()
    layout, K, S, dil, causal = (((37, 45), (9, 13), (2, 3), (1, 2), (False, True)) if dims == 2 else
                                 ((11, 14, 19), (5, 7, 9), (1, 2, 3), (2, 1, 1), (True, False, False)))
    gen = torch.Generator(device="cuda").manual_seed(D + dims)
    make = lambda h: torch.randn(2, *layout, h, D, generator=gen, device="cuda")  # noqa: E731
    real = make(4), make(2), make(2)
    scales = [float(t.abs().max()) / 200 for t in real]
    q, k, v = (t.div(sc).to(ALL[dtype]) for t, sc in zip(real, scales))
    ak, av = (torch.randn(2, 9, 2, D, generator=gen, device="cuda").div(sc).to(ALL[dtype]) for sc in scales[1:])
    _poison_allocator()
    op = na2d if dims == 2 else na3d
    out, lse = op(q, k, v, K, stride=S, dilation=dil, is_causal=causal, return_lse=True, additional_keys=ak,
                  additional_values=av, descale_q=scales[0], descale_k=scales[1], descale_v=scales[2])
    deq = [t.float() * sc for t, sc in zip((q, k, v), scales)]
    ref, ref_lse = na_reference(*deq, K, S, dil, causal, additional_keys=ak.float() * scales[1],
                                additional_values=av.float() * scales[2], return_lse=True)
    assert out.dtype == torch.float16 and out.shape == (2, *layout, 4, D)
    acc = check_accuracy(out.float(), ref, dtype, "fp16")
    assert acc.ok, acc.message
    torch.testing.assert_close(lse, ref_lse, atol=3e-2, rtol=3e-2)


def test_neighborhood_op_passes_opcheck_and_compiles_without_a_graph_break():
    """``gluon_attn::neighborhood_attention``: torch.library.opcheck (schema, fake, autograd registration) on a 2-D
    GQA call with grads, and torch.compile(fullgraph=True) of na2d and na1d with a loss, forward and backward, against
    eager."""
    _hopper()
    q, k, v = (t.requires_grad_() for t in _inputs2(1, 37, 45, 4, 2, 128, "bf16", 3))
    args = (q, k, v, [7, 9], [1, 2], [1, 1], [False, True], 0.1, None, None, None, None, 1.0, 1.0, 1.0, True, False)
    torch.library.opcheck(torch.ops.gluon_attn.neighborhood_attention, args)

    def loss(a, b, c):
        return (na2d(a, b, c, (7, 9), stride=(1, 2), is_causal=(False, True)).float().square().mean()
                + na1d(a.flatten(1, 2), b.flatten(1, 2), c.flatten(1, 2), 65).float().mean())

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, atol=2e-3, rtol=2e-2)
