"""Process-group machinery beside the engines: how the processes of a run share the work of one batch.

:mod:`.sequence_parallel`: sequence parallelism (Ulysses) - the processes of one group each hold a slice of
every packed pass's tokens (docs/sequence_parallel.md).
"""

from .sequence_parallel import SequenceParallel, data_parallel_size, sequence_parallel_size

__all__ = ["SequenceParallel", "data_parallel_size", "sequence_parallel_size"]
