"""gluon_attn.integrations.transformers in a randomly initialised Llama-style model (GQA 8/2) on the GPU:
logits against transformers' SDPA attention for prefill, cached decoding, packed batches, and the SDPA
fallback (with its one-time warning) for a padding mask."""
import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

import gluon_attn.integrations.transformers as gluon_hf  # noqa: E402


def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel here targets sm_90a; this GPU is not Hopper")


def _model(dtype, head_dim=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=8 * head_dim, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).to("cuda", dtype).eval()


def _logits(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits.float()


def _close(a, b, dtype):
    tol = 2e-2 if dtype == torch.float16 else 8e-2
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= tol * max(scale, 1.0), ((a - b).abs().max().item(), scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_logits_match_sdpa(dtype, head_dim):
    _hopper()
    gluon_hf.register()
    model = _model(dtype, head_dim)
    ids = torch.randint(0, 512, (2, 301), device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback on this path
        ours = _logits(model, "gluon", input_ids=ids)
    _close(ours, _logits(model, "sdpa", input_ids=ids), dtype)


def test_cached_decoding_matches_sdpa():
    _hopper()
    gluon_hf.register()
    model = _model(torch.float16)
    ids = torch.randint(0, 512, (2, 77), device="cuda")
    outs = {}
    for impl in ("gluon", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        outs[impl] = torch.stack(gen.logits).float()
    # The first new tokens' logits (before any greedy choice could diverge) agree.
    _close(outs["gluon"][:4], outs["sdpa"][:4], torch.float16)


def test_packed_batch_matches_separate_sequences():
    _hopper()
    gluon_hf.register()
    model = _model(torch.bfloat16)
    lengths = [100, 7, 250]
    seqs = [torch.randint(0, 512, (1, n), device="cuda") for n in lengths]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    # (transformers detects packing from position_ids only without a cache: the training setup)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = _logits(model, "gluon", input_ids=packed, position_ids=position_ids, use_cache=False)
    ref = torch.cat([_logits(model, "sdpa", input_ids=s) for s in seqs], dim=1)
    _close(ours, ref, torch.bfloat16)


def test_padding_mask_falls_back_to_sdpa_with_one_warning():
    _hopper()
    gluon_hf.register()
    gluon_hf._WARNED.clear()
    model = _model(torch.float16)
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :10] = 0  # left padding
    with pytest.warns(UserWarning, match="attention mask other than causal"):
        ours = _logits(model, "gluon", input_ids=ids, attention_mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        _logits(model, "gluon", input_ids=ids, attention_mask=mask)
    _close(ours, _logits(model, "sdpa", input_ids=ids, attention_mask=mask), torch.float16)
