"""All-reduce of decode-sized messages through PyTorch's symmetric memory (`--all-reduce symm`).

Inside a CUDA graph NCCL takes 15–22 µs to sum a decode step's `[64, hidden]` bf16 rows over
2–4 H100/H200s; PyTorch's one-shot kernel, which reads every peer's copy straight from its
memory over NVLink, takes 13–20 (two-shot, a reduce-scatter then an all-gather through peer
memory, wins from about 1 MB). A decode step runs 2 × layers + 1 of them, so the node uses
these kernels for messages up to `max_bytes` and NCCL for larger ones (prompt steps).

The buffer comes from the CUDA backend (peer memory by CUDA IPC). Nothing here turns NVLink
multicast on: no multimem operation is called, and TORCH_SYMM_MEM_DISABLE_MULTICAST is the
operator's to set (`python -m bench.tensor_parallel allreduce` measures both ways of summing).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

ONE_SHOT_MAX_BYTES = 512 << 10  # one-shot below this, two-shot above (bench.tensor_parallel allreduce)
MAX_BYTES = 4 << 20             # larger messages go to NCCL: two-shot's lead fades past this


def open_symmetric_buffer(numel: int, dtype: torch.dtype, device: torch.device,
                          group_name: str) -> tuple[torch.Tensor, object, list[str]]:
    """A symmetric-memory buffer of `numel` elements, rendezvoused over the group: (buffer,
    its handle, notes on what the installed PyTorch offered)."""
    import torch.distributed._symmetric_memory as symm_mem

    notes: list[str] = []
    if hasattr(symm_mem, "set_backend"):
        try:  # the one-shot and two-shot kernels are the CUDA backend's
            symm_mem.set_backend("CUDA")
        except Exception as exc:  # noqa: BLE001 - the default backend is used, and named
            notes.append(f"set_backend('CUDA') refused ({str(exc).splitlines()[0][:120]}): default backend")
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # required by older torch, a deprecated no-op in newer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(group_name)
    buffer = symm_mem.empty(numel, dtype=dtype, device=device)
    return buffer, symm_mem.rendezvous(buffer, group_name), notes


@dataclass
class SymmetricAllReduce:
    """Sums decode-sized messages over the group through one symmetric buffer."""

    group_name: str
    dtype: torch.dtype
    device: torch.device
    max_bytes: int = MAX_BYTES
    buffer: torch.Tensor = field(init=False)
    handle: object = field(init=False)   # the rendezvous' handle (a benchmark checks it has no multicast address)

    def __post_init__(self) -> None:
        ops = torch.ops.symm_mem
        if not (hasattr(ops, "one_shot_all_reduce_copy_out") and hasattr(ops, "two_shot_all_reduce_out")):
            raise RuntimeError("--all-reduce symm needs torch.ops.symm_mem's one_shot_all_reduce_copy_out "
                               f"and two_shot_all_reduce_out, which torch {torch.__version__} lacks")
        numel = self.max_bytes // torch.empty((), dtype=self.dtype).element_size()
        self.buffer, self.handle, _ = open_symmetric_buffer(numel, self.dtype, self.device, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in a new tensor (the kernels read the peers' buffers
        while writing theirs, so the output cannot be x itself)."""
        out = torch.empty_like(x)
        staged = self.buffer[:x.numel()].view_as(x)
        if x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, out)
        else:
            staged.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, out)
        return out
