"""Packed and padded steps agree on 2 processes under DeepSpeed ZeRO-2 (CPU, gloo).

The script `tests/distributed/packing_step.py` runs two steps with mini-batches of 2 rows, gradient
accumulation over 2 of them, 2 epochs, response masks and a left-padding tokenizer, once packed and
once padded; the updated weights and every statistic must agree to float32 rounding.
"""

import numpy as np
import pytest
import torch
from test_distributed import SCRIPTS, deepspeed_cpu_collectives, launch  # noqa: F401 (fixture)

pytestmark = pytest.mark.xdist_group("distributed")


def test_packed_and_padded_steps_agree_under_zero2(tmp_path):
    results = {}
    for padding_free in (1, 0):
        out = tmp_path / str(padding_free)
        out.mkdir()
        launch("deepspeed_zero2", SCRIPTS / "packing_step.py", "--padding_free", str(padding_free), "--output_dir", str(out))
        results[padding_free] = torch.load(out / "result.pt", weights_only=False)
    packed, padded = results[1], results[0]
    assert packed["packed"] and not padded["packed"]

    assert sorted(packed["named_parameters"]) == sorted(padded["named_parameters"])
    for name, weight in padded["named_parameters"].items():
        torch.testing.assert_close(packed["named_parameters"][name], weight, rtol=1e-5, atol=1e-6, msg=name)
    # Both steps trained, and the statistics gathered over both processes agree.
    assert packed["stats"][0]["ppo/loss/total"] != packed["stats"][1]["ppo/loss/total"]
    for a, b in zip(packed["stats"], padded["stats"]):
        assert a.keys() == b.keys()
        for key, value in b.items():
            np.testing.assert_allclose(a[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert len(packed["stats"][0]["objective/kl_dist"]) == 16  # rows of both processes
