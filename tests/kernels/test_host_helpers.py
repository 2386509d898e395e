"""kernels/host.py's launch-sizing helpers agree with Triton's, which they replace on the host."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels.host import cdiv, next_power_of_2, num_sms  # noqa: E402


def test_cdiv_and_next_power_of_2_match_triton() -> None:
    for n in range(0, 5000, 7):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_num_sms_off_cuda_is_the_default() -> None:
    assert num_sms(torch.device("cpu")) == 4
    assert num_sms(torch.device("cpu"), cpu_default=7) == 7
