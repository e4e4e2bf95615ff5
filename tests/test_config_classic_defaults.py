"""``PPOConfig()`` against classic TRL 0.11.4's ``PPOConfig()``, field by field.

``CLASSIC_DEFAULTS`` is classic's ``trl/trainer/ppo_config.py`` at tag v0.11.4, read there and written out here
by hand (classic is never imported): every field classic had, with the value an instance has after classic's
``__post_init__`` (``backward_batch_size`` is derived there, the ``global_*`` sizes and ``world_size`` are filled
by the trainer). A classic script run without flags reads the three hub names, so they must be classic's too; the
test builds no model and downloads nothing.
"""

import math
import sys
from dataclasses import fields

from transformers import HfArgumentParser

from trl_lite import PPOConfig

CLASSIC_DEFAULTS = {
    "seed": 0,
    "log_with": None,
    "task_name": None,
    "model_name": "gpt2",
    "query_dataset": "stanfordnlp/imdb",
    "reward_model": "sentiment-analysis:lvwerra/distilbert-imdb",
    "remove_unused_columns": True,
    "tracker_kwargs": {},
    "accelerator_kwargs": {},
    "project_kwargs": {},
    "tracker_project_name": "trl",
    "push_to_hub_if_best_kwargs": {},
    "steps": 20000,
    "learning_rate": 1.41e-5,
    "adap_kl_ctrl": True,
    "init_kl_coef": 0.2,
    "kl_penalty": "kl",
    "target": 6.0,
    "horizon": 10000.0,
    "gamma": 1.0,
    "lam": 0.95,
    "cliprange": 0.2,
    "cliprange_value": 0.2,
    "vf_coef": 0.1,
    "batch_size": 128,
    "forward_batch_size": None,
    "mini_batch_size": 128,
    "gradient_accumulation_steps": 1,
    "world_size": None,
    "ppo_epochs": 4,
    "max_grad_norm": None,
    "optimize_cuda_cache": None,
    "optimize_device_cache": False,
    "early_stopping": False,
    "target_kl": 1.0,
    "compare_steps": 1,
    "ratio_threshold": 10.0,
    "use_score_scaling": False,
    "use_score_norm": False,
    "score_clip": None,
    "whiten_rewards": False,
    "gradient_checkpointing": False,
    "is_encoder_decoder": None,
    "is_peft_model": None,
    "backward_batch_size": 128,  # mini_batch_size * gradient_accumulation_steps, set in __post_init__
    "global_backward_batch_size": None,
    "global_batch_size": None,
    "dataset_num_proc": None,
}


def _mismatches(config) -> dict:
    """``{field: (trl_lite's value, classic's value)}`` for every classic field whose value or type differs."""
    out = {}
    for name, want in CLASSIC_DEFAULTS.items():
        got = getattr(config, name)
        if got != want or type(got) is not type(want):
            out[name] = (got, want)
    return out


def test_every_classic_field_has_classics_default():
    config = PPOConfig()
    assert _mismatches(config) == {}
    # Classic's one derived attribute outside the fields: ceil(steps / batch_size).
    assert config.total_ppo_epochs == math.ceil(20000 / 128) == 157


def test_every_classic_field_is_a_field_here():
    """Each classic name is a dataclass field (so HfArgumentParser gives it a flag), not just an attribute."""
    ours = {f.name for f in fields(PPOConfig)}
    assert sorted(set(CLASSIC_DEFAULTS) - ours) == []
    assert "exp_name" in ours


def test_exp_name_is_the_scripts_file_name_without_py(monkeypatch):
    # Classic: os.path.basename(sys.argv[0])[: -len(".py")].
    monkeypatch.setattr(sys, "argv", ["examples/scripts/ppo.py", "--steps", "2"])
    assert PPOConfig().exp_name == "ppo"


def test_a_classic_script_without_flags_parses_to_the_classic_defaults(monkeypatch):
    """`python examples/scripts/ppo.py` with no flags: HfArgumentParser yields classic's config."""
    monkeypatch.setattr(sys, "argv", ["ppo.py"])
    (config,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(args=[])
    assert _mismatches(config) == {}
    assert config.exp_name == "ppo"
