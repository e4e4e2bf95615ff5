"""Device helpers for tests that run on the CPU (CI) and with a GPU visible (``scripts/gpu_check.py``).

- :func:`on_cpu`, :func:`assert_close`, :func:`equal`: compare results with CPU references by
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

#: How much wider float32 tolerances are where the trainer runs on a GPU (as it does whenever one is
#: visible) and its results are compared with a reference computed on the CPU. The CPU tolerances of
#: the suite hold two float32 computations of the same formula in different layouts; on a GPU the
#: kernels sum in other orders again (TF32 stays off: torch's default for matrix products), so the two
#: sides drift apart by a few float32 roundings more (the H100 run of 2026-11-26: 1.3e-6 against an atol
#: of 1e-6 for ``score_scaling_only``). On the CPU the factor is 1: the CPU tolerances are unchanged.
FLOAT32_SLACK = 10.0 if torch.cuda.is_available() else 1.0

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


def equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """``torch.equal`` of the two tensors (shape and values), wherever each sits."""
    return torch.equal(on_cpu(actual), on_cpu(expected))


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
