"""The fused all-reduce + add + norm (`--all-reduce fused`) between two GPUs, one process each
(torch.multiprocessing): its sums against the reference on every rank's inputs and against
NCCL's all-reduce followed by the add + norm kernel, bit-identical on both ranks; eagerly, with
a bias and with Gemma's norms, and from two CUDA graphs of three chained calls (64 rows and 8)
replayed alternately 100 times with new inputs before each replay: a rank that read a peer's
slot of an earlier call, or raced ahead into one a peer still reads, gets a wrong sum.
Skipped with fewer than 2 GPUs. NVLink multicast stays off."""
from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

WORLD, H, EPS, REPLAYS = 2, 4096, 1e-5, 100
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def inputs(call: int, rows: int, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every rank's partial rows of call `call` and the residual stream: each rank makes all of
    them from the same seed, so each can compute the expected result alone."""
    gen = torch.Generator().manual_seed(7919 * call + rows)
    partials = [(2 * torch.randn(rows, H, generator=gen)).to(torch.bfloat16).to(device) for _ in range(WORLD)]
    return partials, torch.randn(rows, H, generator=gen).to(torch.bfloat16).to(device)


def assert_within_bf16_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """A norm's reciprocal square root summed in another order moves a value by one bfloat16
    step at most."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)


def assert_same_on_every_rank(*tensors: torch.Tensor) -> None:
    import torch.distributed as dist

    for t in tensors:
        everyone = [torch.empty_like(t) for _ in range(WORLD)]
        dist.all_gather(everyone, t.contiguous())
        assert all(torch.equal(everyone[0], other) for other in everyone[1:])


def not_called(*args, **kwargs):
    raise AssertionError("the fused kernel fits this message: the unfused add + norm must not run")


def worker(rank: int, rendezvous: str) -> None:
    import torch.distributed as dist

    from inference_node.parallel.group import init_tensor_parallel, leave_tensor_parallel
    from inference_node.parallel.shard import Shard
    from kernels.allreduce import all_reduce_add_rms_norm
    from kernels.norm import add_rms_norm_lora

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = init_tensor_parallel(Shard(rank, WORLD), device, rendezvous, timeout_s=120, all_reduce="fused")
    assert tp.fused is not None and not getattr(tp.fused.handle, "multicast_ptr", 0)
    gen = torch.Generator().manual_seed(1)
    weight = (1 + 0.1 * torch.randn(H, generator=gen)).to(torch.bfloat16).to(device)
    bias = torch.randn(H, generator=gen).to(torch.bfloat16).to(device)
    out_norm = (0.3 * torch.randn(H, generator=gen)).to(torch.bfloat16).to(device)
    try:
        # Eager: against the reference, and against NCCL then the add + norm kernel.
        for call, (rows, options) in enumerate([(1, {}), (64, {}), (128, {}), (64, {"bias": bias}),
                                                (64, {"unit_offset": True, "out_norm": out_norm})]):
            partials, residual = inputs(call, rows, device)
            bias_arg = options.get("bias")
            norm_options = {k: v for k, v in options.items() if k != "bias"}
            new, normed = tp.all_reduce_add_norm(partials[rank].clone(), residual, weight, EPS, not_called,
                                                 bias_arg, **norm_options)
            new_ref, normed_ref = all_reduce_add_rms_norm(partials, residual, weight, EPS, **options)
            if "out_norm" in options:  # the output's own norm before the add: rounded alike, not bit for bit
                assert_within_bf16_rounding(new, new_ref)
            else:  # the sum in rank order, the bias and the add: the reference's roundings exactly
                assert torch.equal(new, new_ref), (rows, options)
            assert_within_bf16_rounding(normed, normed_ref)
            summed = partials[rank].clone()
            dist.all_reduce(summed)
            if bias_arg is not None:
                summed = summed + bias_arg
            new_nccl, normed_nccl = add_rms_norm_lora(residual, summed, weight, EPS, None, **norm_options)
            assert_within_bf16_rounding(new, new_nccl)
            assert_within_bf16_rounding(normed, normed_nccl)
            assert_same_on_every_rank(new, normed)

        # CUDA graphs of three chained calls at two sizes, replayed alternately.
        graphs = {}
        for rows in (64, 8):
            xs = [torch.zeros(rows, H, dtype=torch.bfloat16, device=device) for _ in range(3)]
            residual = torch.zeros(rows, H, dtype=torch.bfloat16, device=device)
            tp.all_reduce_add_norm(xs[0], residual, weight, EPS, not_called)  # compiled outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outs, h = [], residual
                for x in xs:
                    h, normed = tp.all_reduce_add_norm(x, h, weight, EPS, not_called)
                    outs.append((h, normed))
            graphs[rows] = graph, xs, residual, outs
        torch.cuda.synchronize()
        dist.barrier()
        for replay in range(REPLAYS):
            rows = (64, 8)[replay % 2]
            graph, xs, residual, outs = graphs[rows]
            expected, h = [], None
            for k, x in enumerate(xs):
                partials, first_residual = inputs(1000 + 3 * replay + k, rows, device)
                x.copy_(partials[rank])
                if k == 0:
                    residual.copy_(first_residual)
                    h = first_residual
                h, normed = all_reduce_add_rms_norm(partials, h, weight, EPS)
                expected.append((h, normed))
            graph.replay()
            torch.cuda.synchronize()
            for k, ((got_h, got_normed), (want_h, want_normed)) in enumerate(zip(outs, expected)):
                assert torch.equal(got_h, want_h), f"replay {replay} ({rows} rows), call {k}: a stale or wrong sum"
                assert_within_bf16_rounding(got_normed, want_normed)
            if replay % 10 == 0:
                assert_same_on_every_rank(*outs[-1])
        dist.barrier()
    finally:
        torch.cuda.synchronize()
        leave_tensor_parallel()


@pytest.mark.timeout(600)
def test_fused_all_reduce_add_norm_between_two_gpus(monkeypatch):
    for name, value in MULTICAST_OFF.items():
        monkeypatch.setenv(name, value)
    with tempfile.TemporaryDirectory(prefix="fused-allreduce-") as work:
        context = torch.multiprocessing.spawn(worker, args=(os.path.join(work, "rendezvous"),), nprocs=WORLD,
                                              join=False)
        deadline = time.monotonic() + 420
        while not context.join(timeout=5):  # a rank's failure is raised here (the other is ended)
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail("the ranks did not finish in 420 s: a rank waits on a flag its peer never set")
