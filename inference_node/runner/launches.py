"""Each step's launch choices: the Tuning of its bucket in the node's tuning table
(kernels/tuning_table.py StepTunings: by rows and distinct adapters), with the decode GEMM and
elementwise ops built on it once per Tuning (model/launch.py)."""
from __future__ import annotations

import torch

from kernels.tuning import DEFAULT_TUNING, Tuning
from kernels.tuning_table import StepTunings

from ..model.launch import LaunchChoices


class StepLaunches:
    def __init__(self, device: torch.device, tunings: StepTunings, gemm_groups: frozenset[str]) -> None:
        """gemm_groups: the projections the model's weights are laid out for (its load's):
        every Tuning must keep them, a bucket of the table cannot change the layout."""
        self.tunings = tunings
        self._by_tuning: dict[int, LaunchChoices] = {}
        for tuning in (tunings.base, *(t for _, _, t in tunings.entries)):
            if tuning.gemm_groups != gemm_groups:
                raise ValueError("gemm_groups sets the weights' layout: load the model again")
            if id(tuning) not in self._by_tuning:
                self._by_tuning[id(tuning)] = LaunchChoices.of(device, tuning)
        self.base = self._by_tuning[id(tunings.base)]

    @classmethod
    def fixed(cls, device: torch.device, tuning: Tuning = DEFAULT_TUNING) -> "StepLaunches":
        """One tuning for every step (no table)."""
        return cls(device, StepTunings.fixed(tuning), tuning.gemm_groups)

    def for_step(self, rows: int, adapters: int = 0) -> LaunchChoices:
        """The launch choices of a step of `rows` rows (tokens, or a graph's padded batch) and
        `adapters` distinct adapters: its bucket's, or the base where the table has none."""
        return self._by_tuning[id(self.tunings.for_step(rows, adapters))]
