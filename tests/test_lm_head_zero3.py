"""The chunked LM head under DeepSpeed ZeRO-3 (issue 50, item 5): 2 processes launched on the CPU (gloo).

A ZeRO-3 head holds only a shard of its weight outside its own forward; the trainer runs the fused head as the
module's forward (``trl_lite.core.lm_head.call_head``), so DeepSpeed gathers the weight for the pass and again
for the backward, and the chunk rule counts the full vocabulary (``weight.ds_shape``).
"""

import json

import pytest
import torch
from test_distributed import SCRIPTS, deepspeed_cpu_collectives, launch  # noqa: F401

pytestmark = pytest.mark.xdist_group("distributed")



def _zero3_config_partitioning_everything(tmp_path):
    """An accelerate config for ZeRO-3 whose persistence threshold is 0: the tiny model's head (57 x 32, below
    DeepSpeed's default 1e5 elements) is partitioned too, so every pass must gather it."""
    ds_file, config_file = tmp_path / "zero3.json", tmp_path / "zero3.yaml"
    ds_file.write_text(json.dumps({
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    }))  # fmt: skip
    config_file.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
        "num_machines: 1\nmachine_rank: 0\nuse_cpu: false\n"
        f"deepspeed_config:\n  deepspeed_config_file: {ds_file}\n  zero3_init_flag: false\n"
    )
    return config_file


# The default rule's path in both runs: chunks of 3 tokens (equivalence_step.py --head_chunk_tokens), or one buffer.
@pytest.mark.parametrize("chunk", [3, 0])
def test_zero3_takes_the_default_head_path_and_the_step_of_one_process(chunk, tmp_path):
    """ZeRO-3 (2 processes x 4 rows, every weight partitioned) and 1 process x 8 rows, both with the default
    ``lm_head_chunk_size=None``: ZeRO-3 reports the path one process takes (chunks of 3 tokens, or one buffer;
    it took the model's own logits, -1, before) and takes the same SGD step with the same statistics (float32)."""
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir()
    one.mkdir()
    chunks = ("--head_chunk_tokens", str(chunk)) if chunk else ()
    zero3 = _zero3_config_partitioning_everything(tmp_path)
    launch(zero3, SCRIPTS / "equivalence_step.py", "--output_dir", str(two), *chunks)
    launch("single_gpu", SCRIPTS / "equivalence_step.py", "--output_dir", str(one), *chunks, num_processes=1)
    a, b = torch.load(two / "result.pt"), torch.load(one / "result.pt")

    assert a["head_partitioned"] and not b["head_partitioned"]
    assert a["lm_head_chunk_size"] == b["lm_head_chunk_size"] == chunk
    weights_a, weights_b = a["named_parameters"], b["named_parameters"]
    assert sorted(weights_a) == sorted(weights_b)
    max_diff = max((weights_a[k] - weights_b[k]).abs().max().item() for k in weights_a)
    assert max_diff <= 1e-5, f"max abs weight difference {max_diff:.3g}"
    assert a["kl_coef"] == pytest.approx(b["kl_coef"], rel=1e-6)
    for key in ("objective/kl", "objective/entropy", "ppo/loss/policy", "ppo/loss/value", "ppo/policy/approxkl",
                "ppo/policy/entropy"):  # fmt: skip
        assert a["stats"][key] == pytest.approx(b["stats"][key], rel=1e-4, abs=1e-6), key
