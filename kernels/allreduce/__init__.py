"""The decode all-reduce fused with the residual add and RMSNorm after it: every rank's
partial rows summed in rank order through peer-mapped buffers, in one launch with the add and
norm (triton_kernel.py; CUDA only: its peers are other GPUs). layout.py says where the rows and
the flags lie in each rank's buffer; reference.py is the math the kernel must equal."""
from .layout import PeerBuffers, PeerLayout
from .reference import all_reduce_add_rms_norm

__all__ = ["PeerBuffers", "PeerLayout", "all_reduce_add_rms_norm"]
