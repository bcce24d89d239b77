"""Ring attention on two or more GPUs (NCCL, NVLink multicast off) with the Gluon kernels as the local
attention: output and gradients against the fp32 reference of the whole sequence on one GPU, within the accuracy
gate (run on a multi-GPU Hopper host)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu


def _worker(rank, world, path, causal):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        from gluon_attn.distributed import gather_sequence, ring_attention, shard_sequence
        from gluon_attn.reference import attention_reference, check_accuracy, check_gradients

        Z, H, H_KV, N, D = 2, 8, 2, 1024 * world, 128
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(s, generator=gen, device="cuda").half()
                         for s in ((Z, H, N, D), (Z, H_KV, N, D), (Z, H_KV, N, D), (Z, H, N, D)))

        ql, kl, vl = (shard_sequence(t, rank, world, causal).requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, causal=causal)
        out.backward(shard_sequence(dout, rank, world, causal))
        got = [gather_sequence(t, causal) for t in (out, ql.grad, kl.grad, vl.grad)]
        if rank == 0:
            qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
            ref = attention_reference(qr, kr, vr, causal=causal)
            ref.backward(dout.float())
            acc = check_accuracy(got[0].float(), ref.detach(), "fp16")
            assert acc.ok, acc.message
            grads = check_gradients(got[1:], (qr.grad, kr.grad, vr.grad), "fp16")
            assert grads.ok, grads.message
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_on_the_gpus_matches_one_gpu(tmp_path, causal):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("ring attention across GPUs needs two or more")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the local attention's backward is the sm_90a kernel")
    world = min(torch.cuda.device_count(), 4)
    mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), causal), nprocs=world, join=True)
