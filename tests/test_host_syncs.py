"""Host-device syncs of a step made by trl_lite itself, counted on the CPU.

On a GPU every read of a device value from Python (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``)
waits for the queued kernels. This counts such reads whose caller is trl_lite's code while the experience
is made and while the learner trains: one per mini-batch (the skip guard, a collective decision) and one per
optimizer step (the gradients' finiteness after clipping), nothing per row or per token. Reads inside
transformers are not counted here (``make gpu-check`` measures every sync on a GPU).
"""

import collections
import os
import sys
import warnings

import pytest
import torch
from tiny_models import make_gpt2, make_tokenizer, random_batch

import trl_lite
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

PACKAGE_DIR = os.path.dirname(trl_lite.__file__)
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


@pytest.fixture
def count_reads(monkeypatch):
    """Count the device reads of ``READS`` whose immediate caller is a trl_lite module, by caller."""
    counts = collections.Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE_DIR):
                counts[(_name, os.path.relpath(caller, PACKAGE_DIR), sys._getframe(1).f_lineno)] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("gradient_accumulation_steps", [1, 2])
def test_one_sync_per_minibatch_and_one_per_update(count_reads, padding_free, gradient_accumulation_steps):
    config = PPOConfig(batch_size=8, mini_batch_size=2, ppo_epochs=2, max_grad_norm=1.0, padding_free=padding_free,
                       gradient_accumulation_steps=gradient_accumulation_steps)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PPOTrainer(config, AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2()), tokenizer=make_tokenizer())
    batch = trainer._check_step_inputs(*random_batch(8), None, None, None, None, None)
    count_reads.clear()
    experience = trainer.experience_maker.make(batch)
    # Making the experience reads nothing back per mini-batch or per row (single process: no reductions).
    assert sum(count_reads.values()) == 0, dict(count_reads)
    trainer.learner.train(experience)
    minibatches = config.ppo_epochs * config.batch_size // config.mini_batch_size
    updates = minibatches // gradient_accumulation_steps
    by_site = collections.Counter()
    for (name, module, _), n in count_reads.items():
        by_site[(name, module)] += n
    # Per epoch one more .tolist(): the permutation, drawn on the host by torch.randperm (no device read).
    reads = minibatches + config.ppo_epochs
    assert by_site == {("tolist", "trainer/learner.py"): reads, ("item", "trainer/learner.py"): updates}
