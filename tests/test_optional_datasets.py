"""``datasets`` is needed by the reward trainer's data preparation only: ``import trl_lite`` and a PPO
``step()`` work without it (the GPU machine's own Python has no ``datasets``), and the reward path says
which package is missing. Run in a subprocess with the package made unimportable, so this process keeps it."""

import os
import subprocess
import sys
import textwrap

import trl_lite

ROOT = os.path.dirname(os.path.dirname(trl_lite.__file__))
TESTS = os.path.dirname(os.path.abspath(__file__))

_BLOCK = """
import sys
sys.modules["datasets"] = None  # any import of datasets now raises ImportError
"""


def _run_without_datasets(body: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    script = _BLOCK + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_import_and_a_ppo_step_without_datasets():
    out = _run_without_datasets(
        """
        import warnings
        import torch
        from tiny_models import make_gpt2, make_tokenizer, random_batch
        from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

        assert sys.modules["datasets"] is None
        torch.manual_seed(0)
        config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = PPOTrainer(config, AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2()),
                                 tokenizer=make_tokenizer())
        stats = trainer.step(*random_batch(4))
        print("loss", stats["ppo/loss/total"])
        print("loaded", sorted(m for m in sys.modules if m.startswith("datasets.")))
        """
    )
    loss = float(out.split("loss ", 1)[1].split()[0])
    assert loss == loss  # a finite number was trained on (NaN would differ from itself)
    assert "loaded []" in out


def test_the_reward_data_path_names_the_missing_package():
    out = _run_without_datasets(
        """
        from trl_lite.trainer.reward.reward_data import as_dataset
        try:
            as_dataset([{"chosen": "a", "rejected": "b"}], "train_dataset")
        except ImportError as error:
            print("error:", error)
        """
    )
    assert "error:" in out and "'datasets'" in out and "pip install datasets" in out
