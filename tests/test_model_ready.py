"""The benchmark's GQA / N_KV / packed-batch axes on CPU: problems, FLOPs, length mixes, the sweep's new
options and rows.csv columns, provider support rules, older results read with the new columns, and the
custom ops' fake implementations (meta tensors, torch.compile without a graph break)."""
import itertools
import json

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

import gluon_attn
from gluon_attn.bench.providers import get_provider
from gluon_attn.bench.report import load_rows, tables_markdown
from gluon_attn.cli import main
from gluon_attn.problem import VARLEN_MIXES, Problem, make_inputs, varlen_lengths
from gluon_attn.reference import attention_reference, varlen_reference
from gluon_attn.validation import UnsupportedError

from .interpreter import run_interpreted


def run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_problem_flops_count_visible_pairs():
    self_attn = Problem(2, 8, 1000, 64, causal=True)
    assert self_attn.flops == 2 * 8 * 2 * 128 * 1000 * 1000 / 2  # N^2 / 2, as before
    decode = Problem(2, 8, 16, 64, causal=True, N_KV=4096)
    assert decode.flops == 2 * 8 * 2 * 128 * (16 * 4096 - 16 * 16 / 2)
    assert Problem(2, 8, 16, 64, causal=False, N_KV=4096).flops == 2 * 8 * 2 * 128 * 16 * 4096
    gqa = Problem(2, 8, 1000, 64, causal=True, H_KV=2)
    assert gqa.flops == self_attn.flops  # FLOPs follow the query heads
    packed = Problem(1, 8, 65536, 128, causal=True, varlen="longtail")
    assert packed.flops == pytest.approx(8 * 2 * 256 * sum(n * n / 2 for n in packed.seqlens))


def test_problem_rejects_bad_shapes_naming_why():
    with pytest.raises(ValueError, match="H_KV 3 must divide H 8"):
        Problem(1, 8, 100, 64, False, H_KV=3)
    with pytest.raises(ValueError, match="unknown varlen mix 'zipf'; known: uniform, longtail"):
        Problem(1, 8, 100, 64, False, varlen="zipf")
    with pytest.raises(ValueError, match="Z = 1"):
        Problem(2, 8, 100, 64, False, varlen="uniform")


@pytest.mark.parametrize("mix", list(VARLEN_MIXES))
def test_length_mixes_are_fixed_and_sum_to_the_total(mix):
    lengths = varlen_lengths(mix, 65536)
    assert sum(lengths) == 65536 and min(lengths) >= 1
    assert lengths == varlen_lengths(mix, 65536)  # the same lengths every time, on every machine
    if mix == "longtail":
        # a long tail: most sequences short, a few long ones carrying much of the work
        assert sorted(lengths)[len(lengths) // 2] < 2048 and max(lengths) > 8192
    else:
        assert all(512 <= n <= 4096 for n in lengths[:-1])


def test_inputs_and_references_for_gqa_and_packed_problems():
    p = Problem(2, 4, 33, 64, causal=True, H_KV=2, N_KV=50)
    x = make_inputs(p, "cpu", seed=0)
    assert x.q.shape == (2, 4, 33, 64) and x.k.shape == (2, 2, 50, 64) and x.cu_seqlens is None
    # The reference's GQA equals repeating each K/V head for its query heads; bottom-right causal:
    # query i sees keys <= i + 17.
    ref = attention_reference(x.q, x.k, x.v, causal=True)
    k, v = (t.repeat_interleave(2, dim=1).float() for t in (x.k, x.v))
    mask = torch.ones(33, 50, dtype=torch.bool).tril(diagonal=17)
    sdpa = torch.nn.functional.scaled_dot_product_attention(x.q.float(), k, v, attn_mask=mask)
    torch.testing.assert_close(ref, sdpa, atol=1e-5, rtol=1e-5)

    packed = make_inputs(Problem(1, 4, 3000, 64, causal=True, H_KV=1, varlen="longtail"), "cpu", seed=0)
    assert packed.q.shape == (3000, 4, 64) and packed.k.shape == (3000, 1, 64)
    assert packed.cu_seqlens.dtype == torch.int32 and int(packed.cu_seqlens[-1]) == 3000
    out = varlen_reference(packed.q, packed.k, packed.v, packed.cu_seqlens, packed.cu_seqlens, causal=True)
    first = int(packed.cu_seqlens[1])
    alone = attention_reference(packed.q[:first].transpose(0, 1)[None], packed.k[:first].transpose(0, 1)[None],
                                packed.v[:first].transpose(0, 1)[None], causal=True)
    torch.testing.assert_close(out[:first], alone[0].transpose(0, 1))


def test_reference_rows_without_keys_are_zero_with_lse_minus_inf():
    q, k = torch.randn(1, 1, 5, 16), torch.randn(1, 1, 2, 16)
    out, lse = attention_reference(q, k, k, causal=True, return_lse=True)
    assert (out[0, 0, :3] == 0).all() and torch.isneginf(lse[0, 0, :3]).all() and torch.isfinite(lse[0, 0, 3:]).all()


def test_provider_support_names_what_each_takes():
    arch = (9, 0)
    gqa = Problem(4, 32, 4096, 128, True, H_KV=8)
    decode = Problem(4, 32, 16, 128, True, N_KV=8192)
    packed = Problem(1, 32, 65536, 128, True, H_KV=8, varlen="longtail")
    for name in ("gluon", "cudnn", "cudnn-fe", "fa4"):
        assert get_provider(name).supports(gqa, arch).reason.find("K/V heads") < 0, name
    assert get_provider("gluon").supports(decode, arch).reason == "" or get_provider("gluon").supports(decode, arch).ok
    sdpa = get_provider("cudnn").supports(decode, arch)
    assert not sdpa.ok and "aligned top-left" in sdpa.reason
    assert get_provider("cudnn").supports(Problem(4, 32, 16, 128, False, N_KV=8192), arch).ok
    assert "no packed (varlen) interface" in get_provider("cudnn").supports(packed, arch).reason
    assert "no packed (varlen) interface" in get_provider("cudnn-fe").supports(packed, arch).reason
    assert "K/V heads" in get_provider("flex").supports(gqa, arch).reason
    fp8_packed = Problem(1, 32, 65536, 128, True, "fp8e4m3", varlen="uniform")
    assert "take dtypes fp16, bf16" in get_provider("gluon").supports(fp8_packed, arch).reason


SMALL = ["--providers", "math", "--head-dim", "64", "-Z", "2", "-H", "4", "--warmup-ms", "1", "--rep-ms", "2"]


def test_sweep_axes_reach_rows_and_tables(tmp_path):
    out = tmp_path / "res"
    res = run(["sweep", *SMALL, "--n-ctx", "16,100", "--kv-heads", "4,1", "--n-kv", "100", "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "rows.csv")
    assert {"H_KV", "N_KV", "varlen"} <= set(df.columns)
    assert len(df) == 2 * 2 * 2  # N_CTX x causal x kv heads
    assert set(df.H_KV) == {4, 1} and set(df.N_KV) == {100}
    # SDPA's causal is top-left: with 16 queries against 100 keys that cell is unsupported, not wrong.
    cross_causal = df[(df.N_CTX == 16) & df.causal]
    assert (cross_causal.status == "unsupported").all()
    assert (df[(df.N_CTX == 100) | ~df.causal].status == "ok").all()
    tables = (out / "tables.md").read_text()
    assert "H_KV=1" in tables and "| N_KV |" in tables
    env = json.loads((out / "env.json").read_text())
    assert env["spec"]["kv_heads"] == [4, 1] and env["spec"]["n_kv"] == [100]


def test_sweep_head_dim_v_axis(tmp_path):
    """--head-dim-v is an axis crossed with --head-dim (0: the same as q's, one problem however it is asked for);
    rows record HEAD_DIM_V, FLOPs count both head dims, and gluon names the pairs it takes."""
    out = tmp_path / "res"
    res = run(["sweep", *SMALL[:2], "--head-dim", "64,96", "--head-dim-v", "32,0,64", "-Z", "1", "-H", "2",
               "--warmup-ms", "1", "--rep-ms", "2", "--n-ctx", "16", "--causal", "false", "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "rows.csv")
    pairs = sorted((d, -1 if pd.isna(dv) else int(dv)) for d, dv in zip(df.HEAD_DIM, df.HEAD_DIM_V))
    assert pairs == [(64, -1), (64, 32), (96, -1), (96, 32), (96, 64)]  # (64, 64) is (64, same)
    assert (df.status == "ok").all()
    assert json.loads((out / "env.json").read_text())["spec"]["head_dims_v"] == [32, None, 64]
    tables = (out / "tables.md").read_text()  # a block per (q/k, v) head dims: no pair hides another
    assert all(f"D={dims} causal=False" in tables for dims in ("64", "64/32", "96", "96/32", "96/64"))
    assert Problem(1, 2, 16, 192, False, HEAD_DIM_V=128).flops == 4 * 2 * 16 * 16 * (192 + 128) / 2
    arch = (9, 0)
    assert get_provider("gluon").supports(Problem(1, 2, 16, 192, False, HEAD_DIM_V=128), arch).ok
    why = get_provider("gluon").supports(Problem(1, 2, 16, 128, False, HEAD_DIM_V=64), arch).reason
    assert "head dims 128 (q, k) and 64 (v) are not supported on sm_90a" in why and "192/128" in why
    bwd = Problem(1, 2, 16, 192, False, HEAD_DIM_V=128, pass_name="bwd")
    assert get_provider("gluon").supports(bwd, arch).ok


def test_sweep_varlen_axis_records_unsupported_providers(tmp_path):
    out = tmp_path / "res"
    res = run(["sweep", *SMALL, "--n-ctx", "3000", "--varlen", "longtail", "--causal", "true", "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "rows.csv", keep_default_na=False)
    assert list(df.varlen) == ["longtail"] and list(df.Z) == [1] and list(df.status) == ["unsupported"]
    bad = run(["sweep", *SMALL, "--varlen", "zipf", "--out", str(tmp_path / "x")])
    assert bad.exit_code != 0 and "known: uniform, longtail" in bad.output


def test_results_from_before_the_new_columns_still_read(tmp_path):
    old = tmp_path / "rows.csv"
    old.write_text("Z,H,N_CTX,HEAD_DIM,HEAD_DIM_V,causal,dtype,provider,label,status,tflops\n"
                   "4,32,4096,128,,True,fp16,gluon,g,ok,500\n4,32,4096,128,,True,fp16,cudnn,c,ok,450\n")
    df = load_rows(tmp_path)
    assert list(df.H_KV) == [32, 32] and list(df.N_KV) == [4096, 4096] and list(df.varlen) == ["", ""]
    assert "1.11x" in tables_markdown(df)


def test_custom_ops_fake_impls_give_shapes_on_meta_tensors():
    q = torch.empty(2, 8, 100, 128, dtype=torch.float16, device="meta")
    kv = torch.empty(2, 2, 300, 128, dtype=torch.float16, device="meta")
    out, lse = gluon_attn.attention(q, kv, kv, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == torch.float16 and lse.shape == (2, 8, 100)
    fp8 = q.to(torch.float8_e4m3fn)
    assert gluon_attn.attention(fp8, fp8, fp8, descale_q=1.0).dtype == torch.float16
    pq = torch.empty(1000, 8, 64, dtype=torch.bfloat16, device="meta")
    pk = torch.empty(1000, 2, 64, dtype=torch.bfloat16, device="meta")
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = gluon_attn.attention_varlen(pq, pk, pk, cu, cu, 700, 700, causal=True, return_lse=True)
    assert out.shape == (1000, 8, 64) and lse.shape == (8, 1000)
    # v's own head dim (192/128): the output has v's, in q's layout
    q192 = torch.empty(2, 100, 8, 192, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    k192 = torch.empty(2, 2, 300, 192, dtype=torch.bfloat16, device="meta")
    v128 = torch.empty(2, 2, 300, 128, dtype=torch.bfloat16, device="meta")
    out = gluon_attn.attention(q192, k192, v128, causal=True)
    assert out.shape == (2, 8, 100, 128) and out.stride() == (100 * 8 * 128, 128, 8 * 128, 1)


def test_torch_compile_traces_the_ops_without_a_graph_break():
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    def block(q, k, v):
        return gluon_attn.attention(q * 2, k, v, causal=True).sum()

    q = torch.empty(1, 4, 64, 64, dtype=torch.float16, device="meta")
    kv = torch.empty(1, 2, 64, 64, dtype=torch.float16, device="meta")
    torch.compile(block, backend=backend, fullgraph=True)(q, kv, kv)
    assert len(seen) == 1 and torch.ops.gluon_attn.attention in seen[0]


def test_autograd_records_the_op_and_its_backward_on_meta_tensors():
    """Inputs that require grad: the forward asks for the lse, the backward op (fake on meta) gives grads of
    the inputs' shapes, GQA included; under no_grad nothing is recorded."""
    q = torch.empty(1, 4, 8, 64, dtype=torch.float16, device="meta", requires_grad=True)
    kv = torch.empty(1, 2, 8, 64, dtype=torch.float16, device="meta", requires_grad=True)
    out = gluon_attn.attention(q, kv, kv, causal=True)
    assert out.requires_grad and out.shape == q.shape
    out.sum().backward()
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape
    with torch.no_grad():
        assert not gluon_attn.attention(q, kv, kv).requires_grad


def test_inputs_that_require_grad_where_no_backward_runs_are_refused_before_any_work():
    for dtype, d, what in ((torch.float8_e4m3fn, 64, "fp16, bf16"), (torch.float8_e5m2, 256, "fp16, bf16")):
        q = torch.empty(1, 2, 8, d, dtype=torch.float32, device="meta", requires_grad=True).to(dtype)
        with pytest.raises(UnsupportedError, match=what):
            gluon_attn.attention(q, q, q)
        with torch.no_grad():
            gluon_attn.attention(q.detach(), q.detach(), q.detach())
    q = torch.empty(1, 2, 8, 256, dtype=torch.float16, device="meta", requires_grad=True)
    gluon_attn.attention(q, q, q).sum().backward()  # (D=256 has a backward)
    assert q.grad.shape == q.shape


def test_transformers_integration_registers_and_falls_back_on_cpu():
    transformers = pytest.importorskip("transformers")
    import warnings

    import gluon_attn.integrations.transformers as gluon_hf
    from transformers import LlamaConfig, LlamaForCausalLM

    assert gluon_hf.register() == "gluon"
    assert "gluon" in transformers.AttentionInterface._global_mapping
    cfg = LlamaConfig(vocab_size=100, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (1, 9))
    gluon_hf._WARNED.clear()
    model.set_attn_implementation("gluon")
    with torch.no_grad(), pytest.warns(UserWarning, match="tensors on cpu"):
        ours = model(ids).logits
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        torch.testing.assert_close(ours, model(ids).logits)


def test_transformers_integration_routes_calls(monkeypatch):
    """Which kernel entry each model call reaches (the kernels replaced by the fp32 reference on CPU):
    plain prefill -> attention (causal, no K/V repeat), packed position_ids -> attention_varlen with the
    sequences' offsets; logits equal SDPA's on the same model."""
    pytest.importorskip("transformers")
    import gluon_attn.api as api
    import gluon_attn.integrations.transformers as gluon_hf
    from transformers import LlamaConfig, LlamaForCausalLM

    assert gluon_hf.attention is api.attention and gluon_hf.attention_varlen is api.attention_varlen
    calls = []

    def dense(q, k, v, causal=False, sm_scale=None):
        calls.append(("attention", tuple(q.shape), tuple(k.shape), causal))
        return attention_reference(q, k, v, causal=causal, sm_scale=sm_scale).to(q.dtype)

    def packed(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, sm_scale=None):
        calls.append(("attention_varlen", cu_q.tolist(), max_q, causal))
        return varlen_reference(q, k, v, cu_q, cu_k, causal=causal, sm_scale=sm_scale).to(q.dtype)

    monkeypatch.setattr(gluon_hf, "attention", dense)  # (the integration's own references to api's entries)
    monkeypatch.setattr(gluon_hf, "attention_varlen", packed)
    monkeypatch.setattr(gluon_hf, "_fallback_reason", lambda *a, **k: None)
    gluon_hf.register()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    lengths = [10, 7, 25]
    seqs = [torch.randint(0, 128, (1, n)) for n in lengths]

    def logits(impl, **inputs):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            return model(**inputs).logits

    torch.testing.assert_close(logits("gluon", input_ids=seqs[2]), logits("sdpa", input_ids=seqs[2]))
    assert calls == [("attention", (1, 4, 25, 32), (1, 2, 25, 32), True)]
    ids = torch.cat(seqs, 1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    ours = logits("gluon", input_ids=ids, position_ids=pos, use_cache=False)
    assert calls[-1] == ("attention_varlen", [0, 10, 17, 42], 25, True)
    ref = torch.cat([logits("sdpa", input_ids=s) for s in seqs], 1)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_decode_plan_packs_query_heads_and_splits_long_keys():
    from gluon_attn import decode

    p = decode.plan(8, 32, 8, 1, 32768, False, block_m=128, sms=132)  # a GQA decode step, 64 K/V heads
    assert p is not None and p.rows == 4 and p.splits >= 2 and p.splits * p.chunk + p.tail == 32768
    # Few K/V heads: more chunks, so that the units fill the 132 programs.
    assert decode.plan(1, 8, 8, 1, 32768, False, block_m=128, sms=132).splits >= 8
    # Many K/V heads already fill them: packed, not split.
    assert decode.plan(64, 32, 8, 1, 32768, False, block_m=128, sms=132).splits == 1
    # Causal with several queries: the keys not every query sees go to the masked tail.
    c = decode.plan(8, 32, 8, 16, 32768, True, block_m=128, sms=132)
    assert c.splits * c.chunk <= 32768 - 16 + 1 and c.tail >= 15
    # A short cache: one query's split (two launches' host work, 20 blocks) beats the ordinary launch's GPU time (two
    # rounds of 65 blocks). Its tail is one more prepared launch (4 blocks) or the combine's own (none): 16 causal
    # queries take the tail's launch (less GPU work than the combine reading the tail's K/V once per row), a cache
    # grown by one key the combine's.
    assert decode.plan(8, 32, 8, 1, 8192, False, block_m=128, sms=132).splits >= 2
    c = decode.plan(8, 32, 8, 16, 8192, True, block_m=128, sms=132)
    assert c.splits >= 2 and c.tail == 16 and not c.fused_tail
    grown = decode.plan(8, 32, 8, 1, 8193, False, block_m=128, sms=132)
    assert grown.splits >= 2 and grown.tail == 1 and grown.fused_tail
    # Where the GPU's time decides (a long cache, or no host work: CUDA-graph replay), the tail's own launch, which
    # reads the tail's K/V once per K/V head rather than once per row.
    assert not decode.plan(8, 32, 8, 16, 32768, True, block_m=128, sms=132).fused_tail
    assert not decode.plan(8, 32, 8, 16, 8192, True, block_m=128, sms=132, host=False).fused_tail
    # A tail longer than the combine takes runs as a launch of its own.
    long_tail = decode.plan(8, 8, 8, 100, 8192, True, block_m=128, sms=132, host=False)
    assert long_tail.tail >= 99 and not long_tail.fused_tail


def test_decode_plans_of_many_counts_at_once_are_plan_ones(monkeypatch):
    """``decode.plans`` (a growing cache's next counts, planned over arrays) gives ``plan_one``'s plan for every count,
    tie-breaks included: across batch sizes, head groupings, query counts, causal or not, tiles, host costs, head dims
    and absorbed tails, over counts that cross MIN_KEYS, chunk lengths and the fused tail's limit."""
    from gluon_attn import decode

    cases = 0
    for Z, (H, H_KV), N_Q, causal, block_m, host, head_dim, absorb in itertools.product(
            [1, 8, 64], [(32, 8), (8, 8), (4, 1)], [1, 4, 16, 100], [False, True], [128, 192], [True, False],
            [64, 128], [False, True]):
        start = (1000, 4090, 8170, 32760)[cases % 4]
        counts = range(start, start + 30)
        made = decode.plans(Z, H, H_KV, N_Q, counts, causal, block_m, 132, True, host, head_dim, absorb)
        assert made == [decode.plan_one(Z, H, H_KV, N_Q, n, causal, block_m, 132, True, host, head_dim, absorb)
                        for n in counts]
        cases += 1
    assert decode.plans(8, 32, 8, 1, range(4096, 4100), False, 128, 132, kv_mergeable=False) == [None] * 4


def test_a_growing_caches_plans_are_made_ahead_and_kept_bounded(monkeypatch):
    """``decode.plan``: a count one to GROWTH keys past a planned one plans the next PLAN_AHEAD counts with it (a
    lookup at the next steps), each as ``plan_one`` makes it; the counts kept per family and the families are
    bounded."""
    from gluon_attn import decode

    decode.clear_plans()
    args = (1, 32, 8, 1)
    assert decode.plan(*args, 8192, False, 128, 132) == decode.plan_one(*args, 8192, False, 128, 132)
    (family, counts), = decode._PLANS.items()
    assert list(counts) == [8192]  # (a count alone: no growth seen)
    decode.plan(*args, 8193, False, 128, 132)
    assert sorted(counts) == [8192, *range(8193, 8193 + decode.PLAN_AHEAD)]
    for n in range(8193, 8193 + decode.PLAN_AHEAD):
        assert counts[n] == decode.plan_one(*args, n, False, 128, 132)
    # A speculative step's cache grows by several keys: planned ahead too, from the count it grew from.
    decode.plan(*args, 9000, False, 128, 132)
    assert 9000 + decode.PLAN_AHEAD - 1 not in counts
    decode.plan(*args, 9000 + decode.GROWTH, False, 128, 132)
    assert 9000 + decode.GROWTH + decode.PLAN_AHEAD - 1 in counts
    monkeypatch.setattr(decode, "_MAX_COUNTS", 100)
    monkeypatch.setattr(decode, "_MAX_FAMILIES", 3)
    for n in range(8193 + decode.PLAN_AHEAD, 8193 + 3 * decode.PLAN_AHEAD):
        decode.plan(*args, n, False, 128, 132)
        assert len(decode._PLANS[family]) <= 100 + decode.PLAN_AHEAD
    for z in range(2, 6):
        decode.plan(z, 32, 8, 1, 8192, False, 128, 132)
        assert len(decode._PLANS) <= 3
    decode.clear_plans()
    assert not decode._PLANS


def test_decode_plan_charges_a_tail_launch(monkeypatch):
    """With no tail fused, 16 causal queries against 2048 keys pay the tail's launch (its GPU time and host work)
    and are the ordinary launch's."""
    from gluon_attn import decode

    decode.clear_plans()
    monkeypatch.setattr(decode, "FUSED_TAIL_KEYS", 0)
    try:
        assert decode.plan(1, 32, 8, 16, 2048, True, block_m=128, sms=132) is None
        p = decode.plan(1, 32, 8, 16, 2048, True, block_m=128, sms=132, host=False)
        assert p.tail >= 15 and not p.fused_tail
    finally:
        decode.clear_plans()


def test_decode_plan_costs_the_longer_of_host_and_gpu():
    """Host work runs ahead of the GPU, so a plan's cost is the longer of the two; the GPU's is at least the time
    the cache's bytes take from memory."""
    from gluon_attn import decode

    # Few K/V heads: 16 or more chunks are all bound by the cache's bytes (30 blocks), and the least GPU work among
    # them is taken.
    p = decode.plan(1, 8, 8, 1, 32768, False, block_m=128, sms=132)
    assert p.splits == 16  # 128 units in one round (19 blocks); 32 chunks take two rounds (20)
    # Memory-bound (a 2 GB cache): equal cost for one chunk or two, one chunk is less GPU work.
    assert decode.plan(64, 32, 8, 1, 32768, False, block_m=128, sms=132).splits == 1
    # The ordinary launch's own host work: a problem shorter on the GPU than the split's host work is left to it.
    assert decode.plan(1, 4, 1, 1, 1024, False, block_m=128, sms=132) is None
    # A batch-1 step against a long cache (4k-8k keys): the ordinary launch's GPU time (33-65 blocks for its one
    # round) is longer than the split's host work, so the split (run 269: 1.3-2.3x faster there).
    assert decode.plan(1, 32, 8, 1, 4096, False, block_m=128, sms=132).splits >= 2
    assert decode.plan(1, 32, 8, 1, 8192, False, block_m=128, sms=132).splits >= 2


@pytest.mark.parametrize("why", ["rows", "keys", "layout", "prefill", "mha-fills"])
def test_decode_plan_declines_where_the_ordinary_launch_serves(why):
    from gluon_attn import decode

    args = {"rows": (8, 32, 8, 64, 32768, False), "keys": (8, 32, 8, 1, decode.MIN_KEYS - 1, False),
            "layout": (8, 32, 8, 1, 32768, False), "prefill": (1, 32, 8, 4096, 32768, True),
            "mha-fills": (4, 32, 32, 1, 4096, False)}[why]
    assert decode.plan(*args, block_m=128, sms=132, kv_mergeable=why != "layout") is None


def test_decode_plan_invariants_over_a_grid():
    from gluon_attn import decode

    for Z, H, H_KV, N_Q, N_KV, causal, block_m, sms in itertools.product(
            [1, 3, 8], [8, 32], [1, 8], [1, 2, 16], [1024, 5000, 32768 + 7], [False, True], [128, 192], [114, 132]):
        p = decode.plan(Z, H, H_KV, N_Q, N_KV, causal, block_m=block_m, sms=sms)
        if p is None:
            continue
        assert p.rows == H // H_KV * N_Q <= block_m
        assert p.splits * p.chunk + p.tail == N_KV and p.chunk >= 1
        assert p.splits == 1 or p.chunk >= decode.MIN_CHUNK
        if causal and N_Q > 1:
            assert p.tail >= N_Q - 1  # every masked key is in the tail


def test_decode_chunks_are_views_of_the_cache():
    from gluon_attn import decode

    k = torch.randn(3, 2, 1000, 8)
    p = decode.DecodePlan(splits=4, chunk=240, rows=1, tail=40)
    view = decode._chunks(k, p)
    assert view.shape == (4, 6, 240, 8) and view.data_ptr() == k.data_ptr()
    for s, z, h in itertools.product(range(4), range(3), range(2)):
        assert torch.equal(view[s, z * 2 + h], k[z, h, s * 240:(s + 1) * 240])
    assert decode.mergeable(k) and not decode.mergeable(k.transpose(1, 2).contiguous().transpose(1, 2))


def test_decode_plan_absorbs_a_tail_every_query_sees_into_the_last_chunk():
    """Where the chunks' launch combines (``absorb``), a cache grown past an even split (the chunks' remainder, which
    every query sees) is one launch: the last chunk takes the tail (``absorbed``), costed at most one more block a
    unit, so the split is taken where the tail's own launch or the combine's fused tail cost more. A causal step's
    masked keys are never absorbed (the chunks attend without the mask), nor is anything without ``absorb``."""
    from gluon_attn import decode

    for n_kv in (4097, 8193, 8192 + 15, 6007, 32768 + 7):
        p = decode.plan(1, 32, 8, 1, n_kv, False, block_m=128, sms=132, absorb=True)
        assert p is not None and p.tail == n_kv - p.splits * p.chunk and 0 < p.tail < p.splits <= p.chunk
        assert p.absorbed and not p.fused_tail
        q = decode.plan(1, 32, 8, 1, n_kv, False, block_m=128, sms=132)
        assert q is None or not q.absorbed
    # Without absorbing, a batch-1 step's tail is the combine's (fused) or a launch.
    assert decode.plan(1, 32, 8, 1, 4097, False, block_m=128, sms=132).fused_tail
    # A tail of masked keys stays a part of its own.
    c = decode.plan(1, 32, 8, 4, 8192, True, block_m=128, sms=132, absorb=True)
    assert c is not None and c.tail >= 3 and not c.absorbed
    for Z, N_Q, N_KV, causal in itertools.product([1, 3, 8], [1, 2, 16], [1024, 5000, 32768 + 7], [False, True]):
        p = decode.plan(Z, 32, 8, N_Q, N_KV, causal, block_m=128, sms=132, absorb=True)
        if p is not None and p.absorbed:
            assert (not causal or N_Q == 1) and 0 < p.tail < p.chunk and not p.fused_tail
            assert p.splits * p.chunk + p.tail == N_KV


def test_absorbed_chunks_are_longer_views_whose_last_ends_at_the_cache():
    """The absorbed views: every chunk starts where the even split's does and is longer by the tail; the keys past a
    chunk's own are the next chunk's first (the kernel masks them: N_KV is the even chunk), the last chunk's are
    the tail, up to the cache's last key and never past it."""
    from gluon_attn import decode

    k = torch.randn(3, 2, 1003, 8)
    p = decode.DecodePlan(splits=4, chunk=250, rows=1, tail=3, absorbed=True)
    view = decode._chunks(k, p, True)
    assert view.shape == (4, 6, 253, 8) and view.data_ptr() == k.data_ptr()
    for s, z, h in itertools.product(range(4), range(3), range(2)):
        assert torch.equal(view[s, z * 2 + h], k[z, h, s * 250:s * 250 + 253])
    assert torch.equal(view[3, 5, -1], k[2, 1, -1])
    assert torch.equal(decode._chunks(k, p), decode._chunks(k, decode.DecodePlan(4, 250, 1, 3)))


def test_the_one_launch_split_is_taken_where_its_combine_addresses_hold():
    """``decode.combined``: the chunks combine in their launch only without a tail, without the lse returned, in
    16-bit, and where the output's rows lie as a contiguous [Z, H, N_Q, D]'s (the kernel writes row (K/V head, group,
    query) at (z H + h) N_Q + n); ``hopper_host.combines``: only for head dim 128 in 128-row tiles (what has run);
    ``_launch_plan`` refuses a combine for what is not decode's chunks."""
    from gluon_attn import decode
    from gluon_attn.kernels import hopper_host

    p = decode.DecodePlan(splits=2, chunk=4096, rows=8, tail=0)
    bf16 = torch.bfloat16
    out = torch.empty(2, 32, 2, 128, dtype=bf16, device="meta")
    assert decode.combined(p, False, out, bf16)
    assert decode.combined(p, False, torch.empty(2, 1, 32, 128, dtype=bf16, device="meta").transpose(1, 2), bf16)
    assert not decode.combined(p, False, torch.empty(2, 2, 32, 128, dtype=bf16, device="meta").transpose(1, 2), bf16)
    assert not decode.combined(p, True, out, bf16)
    assert not decode.combined(decode.DecodePlan(2, 4096, 8, 3, True), False, out, bf16)
    assert not decode.combined(decode.DecodePlan(2, 4096, 8, 3), False, out, bf16)
    assert decode.combined(decode.DecodePlan(2, 4096, 8, 3, absorbed=True), False, out, bf16)
    assert not decode.combined(decode.DecodePlan(2, 4096, 8, 3, absorbed=True), True, out, bf16)
    assert not decode.combined(p, False, out.float(), torch.float32)

    def plan(D, n_kv, combine=True, causal=False):
        return hopper_host._launch_plan(2, 8, 8, 4, n_kv, D, D, bf16, bf16, causal, None, True, "gluon_attention",
                                        None, 132, 0, 0, combine)

    assert hopper_host.combines(plan(128, 1024)) and hopper_host.combines(plan(128, 16384))
    assert not hopper_host.combines(plan(64, 1024)) and not hopper_host.combines(plan(64, 4096))
    assert plan(64, 4096).consts["BLOCK_M"] == 192
    assert not hopper_host.combines(plan(128, 1024, combine=False))
    with pytest.raises(ValueError, match="decode's chunks"):
        plan(128, 1024, causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1, 3000), (1, 6, 3, 5, 2001), (3, 4, 4, 7, 1500), (1, 2, 2, 70, 3000)])
def test_decode_run_combines_chunks_exactly(causal, shape):
    """The packing, the chunk views, the tail and the lse combine, with the fp32 reference as the launch: the
    result is the whole problem's."""
    from gluon_attn import decode

    Z, H, H_KV, N_Q, N_KV = shape
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(Z, H, N_Q, 16, generator=gen)
    k, v = (torch.randn(Z, H_KV, N_KV, 16, generator=gen) for _ in range(2))
    p = decode.plan(Z, H, H_KV, N_Q, N_KV, causal, block_m=128, sms=64, host=False)
    assert p is not None and (p.splits > 1 or p.tail)
    launched = []

    def launch(q, k, v, *, causal, return_lse, sm_scale, out):
        launched.append((tuple(q.shape), tuple(k.shape), causal))
        o, lse = attention_reference(q, k, v, causal=causal, return_lse=True, sm_scale=sm_scale)
        out.copy_(o)
        return out, lse

    out, lse = decode.run(launch, q, k, v, p, causal=causal, sm_scale=None, return_lse=True,
                          out=torch.empty_like(q))
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert launched[0] == ((p.splits, Z * H_KV, p.rows, 16), (p.splits, Z * H_KV, p.chunk, 16), False)
    assert len(launched) == 1 + (p.tail > 0 and not p.fused_tail)  # (a short tail is the combine's own)


_COMBINE_SCRIPT = r"""
import sys
import torch
import triton
from gluon_attn import decode

splits, tail, Z, H, N_Q, D = map(int, sys.argv[1:])
gen = torch.Generator().manual_seed(11)
parts = splits + tail
o = torch.randn(parts, Z, H, N_Q, D, generator=gen).half()
lse_chunks = torch.randn(splits, Z * H * N_Q, generator=gen) * 4
lse_tail = torch.randn(Z, H, N_Q, generator=gen) * 4 if tail else None
if tail:  # a row that saw no key of the tail: lse -inf, output 0
    lse_tail[0, 0, 0] = float("-inf")
    o[splits, 0, 0, 0] = 0
want = torch.empty(Z, H, N_Q, D).half()
want_lse = decode.combine(o, lse_chunks, lse_tail, want)  # (CPU tensors: PyTorch's ops)
out = torch.full((Z, N_Q, H, D), float("nan")).half().transpose(1, 2)  # a strided output, NaN where unwritten
lse = torch.full((Z, H, N_Q), float("nan"))
block_p = triton.next_power_of_2(parts)
args, consts, _ = decode.combine_args(o, lse_chunks.reshape(splits, Z, H, N_Q), lse_tail, out, lse, None, lse_chunks)
assert consts["BLOCK_P"] == block_p and consts["BLOCK_T"] == 0
decode._combine_kernel[(Z * H * N_Q,)](*args, **consts)
torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
print("ok")
"""


@pytest.mark.parametrize("parts", [(5, 1, 2, 3, 4, 64), (64, 1, 1, 2, 1, 256), (3, 0, 2, 4, 3, 128), (1, 1, 1, 1, 5, 64)])
def test_decode_combine_kernel_matches_torch(parts):
    """The combine's GPU kernel (triton's interpreter, on CPU) against PyTorch's ops: chunks with and without a tail,
    a tail row with no key (weight 0), 64 chunks of D=256 (several loads of parts per row), a strided output."""
    run_interpreted(_COMBINE_SCRIPT, *parts)


_FUSED_TAIL_SCRIPT = r"""
import sys
import torch
from gluon_attn import decode

splits, Z, H, H_KV, N_Q, N_KV, n_tail, D, causal = map(int, sys.argv[1:])
gen = torch.Generator().manual_seed(13)
q = torch.randn(Z, N_Q, H, D, generator=gen).half().transpose(1, 2)  # a projection's [Z, N, H, D] view
k, v = (torch.randn(Z, H_KV, N_KV, D, generator=gen).half() for _ in range(2))
tail = decode.TailKeys(q, k, v, N_KV - n_tail, bool(causal), 0.3)
o = torch.randn(splits, Z, H, N_Q, D, generator=gen).half()
lse_chunks = torch.randn(splits, Z * H * N_Q, generator=gen) * 4
want = torch.empty(Z, H, N_Q, D).half()
want_lse = decode.combine(o, lse_chunks, None, want, tail)  # (CPU tensors: PyTorch's ops, decode.tail_reference)
out = torch.full((Z, N_Q, H, D), float("nan")).half().transpose(1, 2)
lse = torch.full((Z, H, N_Q), float("nan"))
args, consts, _ = decode.combine_args(o, lse_chunks.reshape(splits, Z, H, N_Q), None, out, lse, tail, lse_chunks)
assert consts["BLOCK_T"] >= n_tail and consts["CAUSAL"] == bool(causal)
decode._combine_kernel[(Z * H * N_Q,)](*args, **consts)
torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
print("ok")
"""


@pytest.mark.parametrize("case", [(2, 2, 8, 2, 16, 300, 16, 64, 1), (2, 1, 4, 1, 16, 200, 15, 128, 1),
                                  (3, 1, 4, 4, 1, 100, 3, 128, 0), (2, 1, 2, 1, 33, 500, 40, 256, 1)])
def test_decode_combine_attends_to_a_short_tail(case):
    """The combine's kernel with the tail's keys its own (triton's interpreter) against PyTorch's ops: GQA's query
    heads reading their K/V head, the causal mask of the last N_Q - 1 keys (15 tail keys: row 0 sees none of them,
    weight 0), a non-causal remainder, D=256 over several steps of keys, a strided q."""
    run_interpreted(_FUSED_TAIL_SCRIPT, *case)


_TABLE_SCRIPT = r"""
import sys
import torch
import triton
from gluon_attn.kernels import schedule

n_seqs, seed = map(int, sys.argv[1:])
gen = torch.Generator().manual_seed(seed)
# Lengths with ties (equal keys, and equal keys and queries) and empty sequences, so the order's tie-breaks matter.
len_k = torch.randint(0, 6, (n_seqs,), generator=gen) * 100
len_q = torch.where(torch.rand(n_seqs, generator=gen) < 0.5, len_k, torch.randint(0, 4, (n_seqs,), generator=gen) * 100)
cu = lambda n: torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]).to(torch.int32)  # noqa: E731
cu_q, cu_k = cu(len_q), cu(len_k)
for causal, by_keys, counter in [(True, False, True), (False, False, False), (True, True, False)]:
    want = schedule.varlen_table(cu_q, cu_k, 3, 64, causal, by_keys, counter)  # (CPU tensors: PyTorch's ops)
    got = torch.full_like(want, -7)
    schedule._varlen_table_kernel[(triton.cdiv(n_seqs + 1, schedule.TABLE_BLOCK),)](
        cu_q, cu_k, got, n_seqs, 3, 64, got, 0, 0, CAUSAL=causal, BY_KEYS=by_keys, COUNTER=counter,
        BLOCK=schedule.TABLE_BLOCK)
    assert torch.equal(got, want), (causal, by_keys, counter, got.tolist(), want.tolist())
# CHECK: the same table, and program 0's verdict on each offsets tensor against its packed length
from gluon_attn.validation import _offsets_problem
bad_q = cu_q.clone()
if n_seqs > 1:
    bad_q[1] = bad_q[-1] + 1  # (decreases after it)
for qs, total_q, total_k in [(cu_q, int(cu_q[-1]), int(cu_k[-1])), (cu_q, int(cu_q[-1]) + 1, int(cu_k[-1])),
                             (bad_q, int(cu_q[-1]), int(cu_k[-1]) - 1)]:
    want = schedule.varlen_table(qs, cu_k, 3, 64, True, False, True)
    got = torch.full_like(want, -7)
    flags = torch.full((2,), -7, dtype=torch.int32)
    schedule._varlen_table_kernel[(triton.cdiv(n_seqs + 1, schedule.TABLE_BLOCK),)](
        qs, cu_k, got, n_seqs, 3, 64, flags, total_q, total_k, CAUSAL=True, BY_KEYS=False, COUNTER=True,
        BLOCK=schedule.TABLE_BLOCK, CHECK=True)
    expect = [int(_offsets_problem(qs.tolist(), total_q) is None), int(_offsets_problem(cu_k.tolist(), total_k) is None)]
    assert torch.equal(got, want) or qs is bad_q  # (decreasing offsets: no table is promised)
    assert flags.tolist() == expect, (flags.tolist(), expect, qs.tolist(), total_q, total_k)
print("ok")
"""


@pytest.mark.parametrize("n_seqs,seed", [(1, 0), (31, 1), (64, 2), (150, 3)])
def test_varlen_table_kernel_matches_torch(n_seqs, seed):
    """The packed table's GPU kernel (triton's interpreter, on CPU) against PyTorch's ops, word for word: the order
    (a stable sort by keys, then queries, longest first) and the running unit counts with ties and empty sequences,
    one program and several (150 sequences: three programs, three steps of comparisons each), with the counter; and
    its CHECK mode's verdict on good offsets, a wrong packed length and decreasing offsets, as the host's rule."""
    run_interpreted(_TABLE_SCRIPT, n_seqs, seed)


_BAD_OFFSETS = [  # (cu_seqlens_q, cu_seqlens_k, what the message must name); q holds 10 rows, k 12
    ([0, 6, 4, 10], [0, 5, 7, 12], r"cu_seqlens_q .*= q\.shape\[0\] = 10\); got \[0, 6, 4, 10\]: it decreases at index 2"),
    ([2, 4, 10], [0, 5, 12], r"cu_seqlens_q .*got \[2, 4, 10\]: it starts at 2"),
    ([0, 4, 9], [0, 5, 12], r"cu_seqlens_q .*got \[0, 4, 9\]: it ends at 9, not 10"),
    ([0, 4, 10], [0, 5, 13], r"cu_seqlens_k .*= k\.shape\[0\] = 12\); got \[0, 5, 13\]: it ends at 13, not 12"),
    ([0, 4, 10], [0, 13, 12], r"cu_seqlens_k .*got \[0, 13, 12\]: it decreases at index 2 \(13 -> 12\)"),
]


def _packed_cpu(dtype=torch.float16):
    return torch.randn(10, 4, 64).to(dtype), torch.randn(12, 2, 64).to(dtype), torch.randn(12, 2, 64).to(dtype)


@pytest.mark.parametrize("cu_q, cu_k, named", _BAD_OFFSETS)
def test_varlen_offsets_checked_on_the_host_naming_what_is_wrong(cu_q, cu_k, named):
    """Offsets that decrease, do not start at 0 or do not end at the packed length are refused before any launch
    (host tensors: on the host), by the forward and by the backward (which takes the offsets again)."""
    from gluon_attn import api

    q, k, v = _packed_cpu()
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k))
    rule = "must start at 0, not decrease, and end at the packed length N"
    with pytest.raises(ValueError, match=rule) as raised:
        gluon_attn.attention_varlen(q, k, v, cu_q, cu_k, 8, 8, causal=True)
    assert raised.match(named) and str(raised.value).startswith("gluon attention_varlen: ")
    out, lse = torch.zeros_like(q), torch.zeros(4, 10)
    with pytest.raises(ValueError, match=named):
        api.backward_varlen(torch.zeros_like(q), q, k, v, out, lse, cu_q, cu_k, 8, 8, causal=True)


def test_varlen_offsets_that_hold_pass_the_check():
    q, k, v = _packed_cpu()
    cu_q, cu_k = torch.tensor([0, 4, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs CUDA tensors"):  # (past the offsets: the kernels need a GPU)
        gluon_attn.attention_varlen(q, k, v, cu_q, cu_k, 6, 7)
    empty = torch.zeros(1, dtype=torch.int32)  # no sequence, no rows
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        gluon_attn.attention_varlen(q[:0], k[:0], v[:0], empty, empty, 0, 0)


def test_varlen_offsets_device_condition_matches_the_host_check():
    """CUDA offsets are judged on the GPU by ``offsets_valid`` (then ``torch._assert_async``): the same condition,
    evaluated here on CPU tensors, agrees with the host check on every case; meta offsets are not checked."""
    from gluon_attn.validation import _offsets_problem, check_offsets, offsets_valid

    cases = [[0], [0, 0], [0, 10], [0, 3, 3, 10], [0, 6, 4, 10], [1, 10], [0, 9], [0, 11], [0, 10, 9], [-1, 0, 10]]
    gen = torch.Generator().manual_seed(0)
    cases += [torch.randint(-2, 12, (n,), generator=gen).tolist() for n in (1, 2, 3, 5, 8) for _ in range(20)]
    cases += [[0] + sorted(torch.randint(0, 11, (n,), generator=gen).tolist()) + [10] for n in range(5)]
    for values in cases:
        for n in (0, 10):
            cu = torch.tensor(values, dtype=torch.int32)
            assert bool(offsets_valid(cu, n)) == (_offsets_problem(values, n) is None), (values, n)
    meta = torch.empty(4, dtype=torch.int32, device="meta")
    check_offsets("attention_varlen", meta, meta, 10, 12)
