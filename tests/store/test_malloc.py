"""lora_common.malloc: the glibc thresholds the store and the node's engine core set."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_thresholds_are_set_on_glibc() -> None:
    # In a child: the thresholds are process-wide and this process is shared by other tests.
    code = "from lora_common.malloc import keep_freed_buffers as k; import sys; sys.exit(0 if k() and k() else 1)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0

