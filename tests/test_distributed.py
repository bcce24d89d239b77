"""Ring attention on CPU processes (gloo) with the math local attention: every rank's output and gradients
against attention over the whole sequence in one process; zigzag sharding; bad input."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gluon_attn.distributed import (MathAttention, gather_sequence, ring_attention, shard_sequence, zigzag_shard,
                                    zigzag_unshard)


def _full(q, k, v, causal):
    """Attention over the whole sequence with autograd (the reference for values and gradients)."""
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(g, 1)


def _worker(rank, world, path, causal, shapes):
    (Z, H, H_KV, N, D) = shapes
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # the same global tensors on every rank
        q, k, v = torch.randn(Z, H, N, D), torch.randn(Z, H_KV, N, D), torch.randn(Z, H_KV, N, D)
        dout = torch.randn(Z, H, N, D)
        ql, kl, vl = (shard_sequence(t, rank, world, causal).requires_grad_() for t in (q, k, v))
        out, lse = ring_attention(ql, kl, vl, causal=causal, return_lse=True)
        out.backward(shard_sequence(dout, rank, world, causal))
        # every rank's rows and gradients gathered, the sequence put back together, compared on every rank
        got = [gather_sequence(t, causal) for t in (out, ql.grad, kl.grad, vl.grad)]
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = _full(qr, kr, vr, causal)
        ref.backward(dout)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref, qr.grad, kr.grad, vr.grad)):
            torch.testing.assert_close(a, b.detach(), atol=2e-5, rtol=2e-5, msg=lambda m: f"{name}: {m}")
        ref_lse = torch.logsumexp(_scores_full(q, k, causal), -1)
        torch.testing.assert_close(gather_sequence(lse, causal), ref_lse, atol=2e-5, rtol=2e-5)
    finally:
        dist.destroy_process_group()


def _scores_full(q, k, causal):
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return s


@pytest.mark.parametrize("world,causal", [(2, False), (2, True), (3, True), (3, False)])
def test_ring_attention_matches_one_process_in_values_and_gradients(tmp_path, world, causal):
    """GQA (4 query heads on 2 K/V heads), 2-3 ranks (an odd ring too), causal by zigzag chunks."""
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), causal, (2, 4, 2, 12 * world, 8)), nprocs=world,
             join=True)


def test_zigzag_shards_balance_causal_work_and_put_the_sequence_back():
    x = torch.arange(2 * 3 * 8).reshape(1, 1, 48, 1).float()
    parts = [zigzag_shard(x, r, 4) for r in range(4)]
    assert parts[0].flatten()[:6].tolist() == [0, 1, 2, 3, 4, 5] and parts[0].flatten()[6:].tolist() == list(
        range(42, 48))
    assert torch.equal(zigzag_unshard(parts), x)
    # causal work per rank (keys each rank's queries see): equal
    seen = [sum(int(i) + 1 for i in p.flatten()) for p in parts]
    assert len(set(seen)) == 1
    with pytest.raises(ValueError, match="2 x world"):
        zigzag_shard(torch.zeros(1, 1, 10, 1), 0, 3)


def test_math_local_attention_backward_is_autograd_of_its_forward():
    torch.manual_seed(2)
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    impl = MathAttention()
    for causal in (False, True):
        out, lse = impl.forward(q, k, v, causal, 0.3)
        do = torch.randn_like(out)
        want = torch.autograd.grad((out * do).sum(), (q, k, v))
        got = impl.backward(do, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), causal, 0.3)
        for a, b in zip(got, want):  # (the math path computes in fp32)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_ring_attention_says_what_it_needs():
    q = torch.zeros(1, 4, 6, 8)
    with pytest.raises(RuntimeError, match="process group"):
        ring_attention(q, q, q)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="chunks of one length"):
            ring_attention(q, torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8))
        with pytest.raises(ValueError, match="must divide H"):
            ring_attention(q, torch.zeros(1, 3, 6, 8), torch.zeros(1, 3, 6, 8))
        with pytest.raises(ValueError, match="even local length"):
            ring_attention(torch.zeros(1, 4, 5, 8), torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), causal=True)
        with pytest.raises(ValueError, match="unknown local attention"):
            ring_attention(q, q, q, local="flash")
        # one rank: the ring is plain attention
        torch.manual_seed(3)
        a, b, c = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        torch.testing.assert_close(ring_attention(a, b, c, causal=True), _full(a, b, c, True))
    finally:
        dist.destroy_process_group()
