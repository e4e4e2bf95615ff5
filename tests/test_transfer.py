"""A step's batch moved in one copy and its statistics read back in one (trl_lite.trainer.step.transfer).

The buffer is checked byte for byte: tensors of mixed dtypes and odd sizes go in, the same values,
dtypes and shapes come out as views of one buffer; scalars keep their order; a step's batch keeps
every value the user gave. On the CPU the copy is a host memcpy; the buffer logic is the same.
"""

import numpy as np
import pytest
import torch

from trl_lite.trainer.step.experience import StepBatch
from trl_lite.trainer.step.transfer import (
    _ALIGN,
    _pack,
    _unpack,
    batch_to_device,
    stack_scalars,
    to_device_together,
    to_host_together,
)


def _mixed():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 151_936, (7,), generator=g),  # token ids, int64
        torch.randint(-5, 5, (3,), generator=g, dtype=torch.int32),
        torch.rand(5, generator=g) > 0.5,  # bool, 5 bytes: the next piece must be realigned
        torch.randn(2, 3, generator=g).t(),  # float32, not contiguous
        torch.randn(3, generator=g, dtype=torch.float64),
        torch.randn(1, generator=g).to(torch.bfloat16),
        torch.tensor(2.5),  # 0-d
    ]


def test_the_buffer_holds_every_tensor_aligned_and_gives_it_back():
    tensors = _mixed()
    buffer, spans = _pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    assert all(start % _ALIGN == 0 for start, _ in spans)
    assert [size for _, size in spans] == [t.numel() * t.element_size() for t in tensors]
    copied = buffer.clone()  # what the device gets
    for got, expected in zip(_unpack(copied, spans, tensors), tensors):
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
        assert got.untyped_storage().data_ptr() == copied.untyped_storage().data_ptr()  # views of the one buffer


def test_to_device_together_moves_host_tensors_in_one_buffer_and_keeps_none():
    tensors = _mixed()
    moved = to_device_together([tensors[0], None, *tensors[1:]], "cpu")
    assert moved[1] is None
    moved = [moved[0], *moved[2:]]
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1
    for got, expected in zip(moved, tensors):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert to_device_together([None], "cpu") == [None]


def test_stack_scalars_keeps_the_order_of_numbers_and_tensors():
    values = [1.5, torch.tensor(2.0), np.float64(-3.25), torch.tensor([4.0], dtype=torch.float64), 7]
    stacked = stack_scalars(values, "cpu")
    assert stacked.dtype == torch.float32 and stacked.tolist() == [1.5, 2.0, -3.25, 4.0, 7.0]
    assert stack_scalars([torch.tensor(1.0)], "cpu").tolist() == [1.0]


def test_to_host_together_keeps_shapes():
    parts = [torch.arange(3.0), torch.zeros(0), torch.ones(2, 2)]
    back = to_host_together(parts)
    assert [b.shape for b in back] == [p.shape for p in parts] and all(torch.equal(a, b) for a, b in zip(back, parts))
    assert to_host_together([]) == []


@pytest.mark.parametrize("with_extras", [False, True])
def test_a_step_batch_keeps_every_value(with_extras):
    g = torch.Generator().manual_seed(1)
    queries = [torch.randint(3, 50, (n,), generator=g) for n in (2, 5, 3)]
    responses = [torch.randint(3, 50, (n,), generator=g, dtype=torch.int32) for n in (4, 1, 6)]
    scores = [0.5, torch.tensor(-1.25), np.float32(3.0)]
    masks = [torch.ones(len(r), dtype=torch.long) for r in responses] if with_extras else None
    gen = [-torch.rand(len(r), generator=g) for r in responses] if with_extras else None
    staleness = torch.tensor([0.0, 1.0, 2.0]) if with_extras else None
    batch = StepBatch(queries, responses, scores, masks, None, gen, None, staleness)
    eos = torch.tensor([True, False, True]) if with_extras else None
    moved, moved_eos = batch_to_device(batch, "cpu", eos)
    for got, expected in zip(moved.queries + moved.responses, queries + responses):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert moved.scores.dtype == torch.float32 and moved.scores.tolist() == [0.5, -1.25, 3.0]
    if with_extras:
        assert all(torch.equal(a, b) for a, b in zip(moved.response_masks, masks))
        assert all(torch.equal(a, b) for a, b in zip(moved.generation_logprobs, gen))
        assert torch.equal(moved.staleness, staleness) and torch.equal(moved_eos, eos)
        tensors = [*moved.queries, *moved.responses, *moved.response_masks, *moved.generation_logprobs, moved_eos]
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one buffer, one copy
    else:
        assert moved.response_masks is None and moved.generation_logprobs is None and moved_eos is None
