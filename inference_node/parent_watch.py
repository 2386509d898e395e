"""Child processes of a node die with it: a node killed with SIGKILL leaves no engine core
holding the GPU and no front end holding the port."""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Asks Linux to send `sig` to this process when its parent exits (elsewhere the
    processes' own watchers notice within a second), and exits now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if not parent_alive():
        os._exit(1)


def parent_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is None or os.getppid() == parent.pid
