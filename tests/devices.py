"""Device helpers for tests that run on the CPU (CI) and with a GPU visible (``scripts/gpu_check.py``).

- :func:`on_cpu`, :func:`assert_close`, :func:`assert_equal`: compare results with CPU references by
  moving both to the CPU first (a trainer's results sit on ``accelerator.device``).
- :func:`accelerator_device` and :func:`inputs_reaching`: test on the CPU that an entry point moves
  CPU inputs to the device it computes on. The accelerator's device is faked as ``meta`` (a device that
  is not the CPU), and the call is stopped where the inputs reach the model: the devices they arrive on
  are recorded. Without the move they would arrive on the CPU - what fails on a GPU with CPU inputs.
"""

from __future__ import annotations

from contextlib import contextmanager

import accelerate
import torch

#: A device other than the CPU that every machine has: it stands in for the GPU in the tests of the moves.
FAKE_DEVICE = torch.device("meta")


def on_cpu(value):
    """``value`` with every tensor in it (also inside lists, tuples and dicts) detached and on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(item) for item in value)
    return value


def assert_close(actual, expected, **kwargs) -> None:
    """``torch.testing.assert_close`` of the two after moving both to the CPU."""
    torch.testing.assert_close(on_cpu(actual), on_cpu(expected), **kwargs)


def assert_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The two tensors are equal (shape and values), wherever each sits."""
    actual, expected = on_cpu(actual), on_cpu(expected)
    assert torch.equal(actual, expected), f"{actual} != {expected}"


@contextmanager
def accelerator_device(monkeypatch, device: torch.device = FAKE_DEVICE):
    """Every ``Accelerator``'s ``device`` reads ``device`` inside the block (the class property is patched)."""
    monkeypatch.setattr(accelerate.Accelerator, "device", property(lambda self: device))
    yield device


class ReachedTheModel(Exception):
    """Raised by :func:`inputs_reaching` where the inputs reach the model: the call stops there."""


def _tensor_devices(value) -> list[torch.device]:
    if isinstance(value, torch.Tensor):
        return [value.device]
    if isinstance(value, dict):
        return [d for item in value.values() for d in _tensor_devices(item)]
    if isinstance(value, (list, tuple)):
        return [d for item in value for d in _tensor_devices(item)]
    return []


@contextmanager
def inputs_reaching(owner, method: str = "forward"):
    """Replace ``owner.method`` (e.g. a model's ``forward`` or ``generate``) inside the block by a stand-in
    that records the devices of the tensors it is called with (keyword ``name -> devices``, positional
    arguments under ``"args"``) into the yielded dict and raises :class:`ReachedTheModel`."""
    seen: dict[str, list[torch.device]] = {}

    def stand_in(*args, **kwargs):
        seen["args"] = _tensor_devices(args)
        seen.update({name: _tensor_devices(value) for name, value in kwargs.items() if _tensor_devices(value)})
        raise ReachedTheModel

    had_own = method in vars(owner)
    original = getattr(owner, method)
    setattr(owner, method, stand_in)
    try:
        yield seen
    finally:
        if had_own:
            setattr(owner, method, original)
        else:
            delattr(owner, method)
