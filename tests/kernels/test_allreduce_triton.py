"""The fused all-reduce kernel's copy, sum, add and norm against its reference, in one process:
the "peers" are buffers this process allocates and fills, their addresses the kernel's table,
and the flags are left out (sync=False). It tests the math and the slots the epochs pick, not
the barrier between GPUs (tests/kernels/test_allreduce_gpu.py does, over two GPUs).

Runs where Triton can execute: CUDA, or CPU tensors in Triton's interpreter (skipped in the
main pytest process on a CPU; test_triton_interpreter.py runs it in a child with
TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(),
    reason="needs CUDA, or TRITON_INTERPRET=1 (test_triton_interpreter.py runs it that way)")


def peer_buffers(world: int, max_rows: int, slot_bytes: int):
    """Every rank's buffer in this process, and each rank's PeerBuffers over them."""
    from kernels.allreduce import PeerBuffers, PeerLayout

    layout = PeerLayout(world, max_rows, slot_bytes)
    buffers = [torch.zeros(layout.nbytes, dtype=torch.uint8, device=DEVICE) for _ in range(world)]
    addresses = [b.data_ptr() for b in buffers]
    return buffers, [PeerBuffers(layout, r, buffers[r], PeerBuffers.offsets_of(addresses, r, torch.device(DEVICE)),
                                 torch.zeros(max_rows, dtype=torch.int32, device=DEVICE)) for r in range(world)]


def slot(buffer: torch.Tensor, layout, parity: int, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [rows, hidden] of one parity's slot of a rank's buffer (layout.py)."""
    start = layout.flags_bytes + parity * layout.slot_bytes
    return buffer[start:start + rows * hidden * dtype.itemsize].view(dtype).view(rows, hidden)


@pytest.mark.parametrize("world, rank, tokens, hidden, dtype, options", [
    (2, 0, 3, 64, torch.float32, "plain"),
    (4, 2, 5, 200, torch.bfloat16, "plain"),      # a row narrower than its block (masked columns)
    (2, 1, 4, 96, torch.bfloat16, "bias"),
    (4, 3, 2, 128, torch.bfloat16, "gemma"),      # (1 + w) norms, the output normed before the add
    (8, 5, 2, 64, torch.float32, "gemma"),
])
def test_fused_all_reduce_add_norm_matches_reference(world, rank, tokens, hidden, dtype, options):
    """Two calls back to back: each writes this rank's rows into the slot of its epoch's
    parity (1, then 0) and sums the peers' rows of that slot, not the other's."""
    from kernels.allreduce import all_reduce_add_rms_norm
    from kernels.allreduce.triton_kernel import all_reduce_add_rms_norm_triton

    gen = torch.Generator().manual_seed(world * 100 + tokens)
    buffers, peers = peer_buffers(world, max_rows=8, slot_bytes=8 * 256 * 4)
    layout = peers[rank].layout
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    kwargs = {}
    if options == "bias":
        kwargs["bias"] = torch.randn(hidden, generator=gen).to(dtype).to(DEVICE)
    if options == "gemma":
        kwargs = {"unit_offset": True, "out_norm": (0.3 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)}
    for call, parity in enumerate((1, 0)):
        partials = [(3 * torch.randn(tokens, hidden, generator=gen)).to(dtype).to(DEVICE) for _ in range(world)]
        residual = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
        for p in range(world):  # the peers' rows, where their own calls would have put them
            if p != rank:
                slot(buffers[p], layout, parity, tokens, hidden, dtype).copy_(partials[p])
                slot(buffers[p], layout, 1 - parity, tokens, hidden, dtype).fill_(1e4)  # the other slot: never read
        x = partials[rank].clone()
        new, normed = all_reduce_add_rms_norm_triton(x, residual, weight, 1e-6, peers[rank], sync=False, **kwargs)
        new_ref, normed_ref = all_reduce_add_rms_norm(partials, residual, weight, 1e-6, **kwargs)
        assert torch.equal(slot(buffers[rank], layout, parity, tokens, hidden, dtype), x)  # its rows, for the peers
        assert torch.equal(peers[rank].epochs[:tokens].cpu(), torch.full((tokens,), call + 1, dtype=torch.int32))
        assert torch.count_nonzero(peers[rank].epochs[tokens:]) == 0
        # Rounded as the reference rounds, but for the norm's reciprocal square root (and
        # the interpreter's narrowing to bfloat16): close, with a floor scaled to the values.
        for got, want in ((new, new_ref), (normed, normed_ref)):
            rel = 1e-5 if dtype == torch.float32 else 2e-2
            floor = rel * max(1.0, want.float().abs().max().item())
            torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=rel, atol=floor)
        if options == "plain" and (dtype == torch.float32 or not INTERPRET):
            # The sum and the add alone: the reference's roundings exactly (the interpreter
            # narrows float32 to bfloat16 its own way).
            assert torch.equal(new, new_ref)


def test_epochs_wrap_around_and_pick_slots_by_parity():
    """Epochs count modulo 2**30: the call after 2**30 - 1 takes epoch 0, slot 0."""
    from kernels.allreduce.layout import EPOCH_MASK
    from kernels.allreduce.triton_kernel import all_reduce_add_rms_norm_triton

    buffers, peers = peer_buffers(2, max_rows=4, slot_bytes=4 * 64 * 4)
    layout = peers[0].layout
    peers[0].epochs.fill_(EPOCH_MASK)
    slot(buffers[1], layout, 0, 2, 64, torch.float32).fill_(2.0)
    slot(buffers[1], layout, 1, 2, 64, torch.float32).fill_(7.0)
    x, residual, weight = (torch.ones(2, 64, device=DEVICE), torch.zeros(2, 64, device=DEVICE),
                           torch.ones(64, device=DEVICE))
    new, _ = all_reduce_add_rms_norm_triton(x, residual, weight, 1e-6, peers[0], sync=False)
    assert torch.equal(new.cpu(), torch.full((2, 64), 3.0)) and peers[0].epochs[:2].tolist() == [0, 0]
    assert peers[0].epochs[2:].tolist() == [EPOCH_MASK] * 2
