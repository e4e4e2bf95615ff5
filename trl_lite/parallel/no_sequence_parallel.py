"""The sequence-parallel part of a run without sequence parallelism (``sp_size`` 1).

Each process is a group of its own: the trainer's parts call the same methods as on a
:class:`~.sequence_parallel.SequenceParallel` group and get what they would have computed without one.
"""

from __future__ import annotations

import torch

from ..models.packed_attention import PACKED_SDPA


class NoSequenceParallel:
    """:class:`~.sequence_parallel.SequenceParallel`'s methods for a group of one process: every one a no-op."""

    size = 1
    cuts = False  # packed passes run whole
    attention = PACKED_SDPA  # packed passes attend per row on this process alone
    row_share = 1.0  # every process holds rows of its own: each adds its whole sum

    def share(self, value):
        """``value`` as it is (the group's first process is this one)."""
        return value

    def generate(self, generate, queries, check=None):
        """``generate(queries)``: the process generates its own batch (``check`` is left to ``generate``)."""
        return generate(queries)

    def check_same_rows(self, *parts) -> None:
        """Nothing to compare: no other process trains this process's rows."""

    def check_models(self, pack: bool, modules: list, row_attention: dict) -> None:
        """Nothing to check: passes are not cut."""

    def one_per_group(self, gathered: torch.Tensor, processes: int) -> torch.Tensor:
        """All of ``gathered``: every process's rows are its own."""
        return gathered
