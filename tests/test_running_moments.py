"""RunningMoments against float64 statistics of everything seen (docs/algorithm.md section 2): merged on the
device without a read (what the trainer uses), and read back only when a host number is asked for."""

import numpy as np
import pytest
import torch

from trl_lite.trainer.state.running_moments import RunningMoments


def _batches():
    g = torch.Generator().manual_seed(0)
    # Far from 0 and of different sizes: a one-pass sum of squares about 0 would lose digits here.
    return [1000.0 + 3.0 * torch.randn(n, generator=g) for n in (1, 7, 2, 30)]


def test_merged_on_the_device_equals_the_statistics_of_everything_seen():
    running, seen = RunningMoments(), []
    for xs in _batches():
        mean, std = running.update_on_device(xs)
        assert running._device is not None  # nothing read back yet
        seen.extend(xs.double().tolist())
        want_std = np.std(seen, ddof=1) if len(seen) > 1 else 1.0
        assert mean.dtype == torch.float64 and mean.item() == pytest.approx(np.mean(seen), rel=1e-14)
        assert std.item() == pytest.approx(want_std, rel=1e-9)
    assert running.count == len(seen) and running._device is None  # one read, when asked
    assert running.mean == pytest.approx(np.mean(seen), rel=1e-14)
    assert running.std == pytest.approx(np.std(seen, ddof=1), rel=1e-9)
    assert running.var == pytest.approx(np.var(seen), rel=1e-9)


def test_update_returns_the_batch_statistics_and_the_state_round_trips():
    running, seen = RunningMoments(), []
    for xs in _batches():
        batch_mean, batch_std = running.update(xs)
        seen.extend(xs.double().tolist())
        values = xs.double().numpy()
        assert batch_mean == pytest.approx(values.mean(), rel=1e-14)
        assert batch_std == pytest.approx(values.std(ddof=1) if len(values) > 1 else 0.0, rel=1e-7, abs=1e-12)
    restored = RunningMoments()
    restored.load_state_dict(running.state_dict())
    assert restored.state_dict() == running.state_dict() and restored.count == len(seen)
    assert RunningMoments().std == 1.0 and RunningMoments().var == 0.0
