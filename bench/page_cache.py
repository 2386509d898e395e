"""A file's pages in the OS page cache: dropped (so the next read comes from the disk) and
counted (so a benchmark can say whether the drop took: on tmpfs the files are memory)."""
from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path


def drop(path: Path) -> bool:
    """Writes the file's dirty pages back, then asks the kernel to drop its cached pages
    (posix_fadvise DONTNEED only drops clean pages). False where the call does not exist."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def resident_share(path: Path) -> float | None:
    """The share of the file's pages in the page cache (mincore over a mapping that is never
    touched, so asking faults nothing in); None where the C library cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        map_file, unmap, mincore = libc.mmap, libc.munmap, libc.mincore
    except (OSError, AttributeError):
        return None
    map_file.restype = ctypes.c_void_p
    map_file.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                         ctypes.c_long]
    unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    size = path.stat().st_size
    if size == 0:
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        address = map_file(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = (ctypes.c_ubyte * pages)()
            if mincore(address, size, vector) != 0:
                return None
            return sum(v & 1 for v in vector) / pages
        finally:
            unmap(address, size)
    finally:
        os.close(fd)


def filesystem_of(path: Path) -> str:
    """The type of the file system holding `path` (its longest mount point in
    /proc/self/mounts), or "unknown"."""
    resolved, best, kind = str(path.resolve()), "", "unknown"
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind
