"""A dataloader wrapper that knows its position inside the current pass, for exact resume."""

from __future__ import annotations

import torch


class ResumableLoader:
    """Iterates a prepared dataloader and remembers where it is, so a checkpoint can resume mid-epoch.

    The shuffle order comes from a seeded generator: its state at the start of the current pass
    plus the number of batches handed out identify the position exactly.
    """

    def __init__(self, dataloader, generator: torch.Generator):
        self.dataloader = dataloader
        self.generator = generator
        self._epoch_start_state = generator.get_state()
        self._served = 0
        self._skip = 0

    def __len__(self):
        return len(self.dataloader)

    def __getattr__(self, name):
        return getattr(self.dataloader, name)

    def __iter__(self):
        if self._skip:
            self.generator.set_state(self._epoch_start_state)
        else:
            self._epoch_start_state = self.generator.get_state()
        skip, self._skip = self._skip, 0
        self._served = 0
        for i, batch in enumerate(self.dataloader):
            if i < skip:
                continue
            self._served = i + 1
            yield batch
        self._served = 0
        self._epoch_start_state = self.generator.get_state()

    def state_dict(self) -> dict:
        # Loaded but not iterated yet: the position is the loaded one, still to be skipped.
        served = self._skip if self._skip else self._served
        return {"epoch_start_state": self._epoch_start_state.tolist(), "served": served}

    def load_state_dict(self, state: dict) -> None:
        self._epoch_start_state = torch.tensor(state["epoch_start_state"], dtype=torch.uint8)
        self._skip = state["served"]
        self.generator.set_state(self._epoch_start_state)
