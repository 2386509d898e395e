"""glibc malloc settings for the processes that move adapters as multi-megabyte messages.

gRPC's receive buffers and each message's bytes object are megabytes, allocated and freed
for every shard. With glibc's defaults a freed block that large goes back to the kernel (an
mmap'd block is unmapped; the heap top is trimmed past twice the block), so the next one
faults its pages in again: on loopback that costs more CPU than the copies themselves.
Raising both thresholds keeps such blocks in the heap for reuse, at the price of up to
`trim_threshold` bytes of freed memory kept per arena.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # above the largest shard (16 MiB) and its header
TRIM_THRESHOLD_BYTES = 128 << 20


def keep_freed_buffers(mmap_threshold: int = MMAP_THRESHOLD_BYTES, trim_threshold: int = TRIM_THRESHOLD_BYTES) -> bool:
    """Sets glibc's mmap and trim thresholds for this process; False where the C library is
    not glibc (nothing changes there). Call once at process start, before the traffic."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    if not done:
        log.warning("mallopt refused the thresholds; large buffers are returned to the kernel as they are freed")
    return done
