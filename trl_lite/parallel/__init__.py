"""Process-group machinery beside the engines: how the processes of a run share the work of one batch.

:mod:`.sequence_parallel`: sequence parallelism (Ulysses) - the processes of one group each hold a slice of
every packed pass's tokens (docs/sequence_parallel.md); :mod:`.no_sequence_parallel`: the same methods, each a
no-op, for a run without it, so the trainer's parts call one interface either way.
"""

from .no_sequence_parallel import NoSequenceParallel
from .sequence_parallel import SequenceParallel, data_parallel_size, sequence_parallel_size

__all__ = ["NoSequenceParallel", "SequenceParallel", "data_parallel_size", "sequence_parallel_size"]
