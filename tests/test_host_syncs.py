"""Host-device syncs of a step made by trl_lite itself, counted on the CPU.

On a GPU every read of a device value from Python (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``)
waits for the queued kernels. This counts such reads whose caller is trl_lite's code while the experience
is made and while the learner trains: one per mini-batch (the skip guard, a collective decision) and one per
optimizer step (the gradients' finiteness after clipping), nothing per row or per token. Reads inside
transformers are not counted here (``make gpu-check`` measures every sync on a GPU).

A second test counts the whole step's traffic (trainer/transfer.py lists its budget): the batch's rows go
to the device in one buffer and none on its own, and the statistics come back in one copy.
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


def _trainer_and_batch(config):
    """A trainer of ``config`` on a tiny GPT-2 and a checked batch of 8 random rows for it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PPOTrainer(config, AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2()), tokenizer=make_tokenizer())
    return trainer, trainer._check_step_inputs(*random_batch(8), None, None, None, None, None)


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("gradient_accumulation_steps", [1, 2])
def test_one_sync_per_minibatch_and_one_per_update(count_reads, padding_free, gradient_accumulation_steps):
    config = PPOConfig(batch_size=8, mini_batch_size=2, ppo_epochs=2, max_grad_norm=1.0, padding_free=padding_free,
                       gradient_accumulation_steps=gradient_accumulation_steps)  # fmt: skip
    trainer, batch = _trainer_and_batch(config)
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


def _user_tensors(batch):
    return [*batch.queries, *batch.responses, *batch.scores]


@pytest.mark.parametrize("padding_free", [False, True])
def test_a_step_moves_its_batch_in_one_copy_and_reads_its_statistics_back_in_one(monkeypatch, padding_free):
    """The sync budget of trainer/transfer.py, counted by site over a whole step without its input checks:
    per mini-batch the skip guard, per update the gradients' finiteness, per step one copy back. Reads of
    the host copy are free (host memory on a GPU too) and not counted; nor are host lists' ``.tolist()``."""
    from trl_lite.trainer import statistics
    from trl_lite.trainer import transfer

    config = PPOConfig(batch_size=8, mini_batch_size=2, ppo_epochs=2, max_grad_norm=1.0, padding_free=padding_free)
    trainer, batch = _trainer_and_batch(config)
    user = {id(t) for t in _user_tensors(batch)}
    host_copies, packs, moves, reads = set(), [], [], collections.Counter()

    def to_host_together(tensors):
        out = transfer_to_host(tensors)
        host_copies.update(t.untyped_storage().data_ptr() for t in out)
        return out

    transfer_to_host, pack = transfer.to_host_together, transfer._pack
    monkeypatch.setattr(statistics, "to_host_together", to_host_together)
    monkeypatch.setattr(transfer, "_pack", lambda tensors: packs.append(len(tensors)) or pack(tensors))
    for name in (*READS, "cpu", "numpy", "to", "cuda"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE_DIR) and self.untyped_storage().data_ptr() not in host_copies:
                site = (_name, os.path.relpath(caller, PACKAGE_DIR))
                if _name in ("to", "cuda"):
                    if id(self) in user:  # a user's row moved on its own: one copy (and sync) per row on a GPU
                        moves.append(site)
                else:
                    reads[site] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    experience = trainer.experience_maker.make(batch)
    train_stats, _ = trainer.learner.train(experience)
    before = dict(reads)
    stats = trainer.statistics.step_stats(experience, train_stats)
    assert stats["objective/kl_dist"].shape == (8,) and isinstance(stats["ppo/mean_scores"], float)
    # One buffer per step for the rows (8 queries, 8 responses, the scores, whether each ends with EOS)
    # and one for the host scalars of the statistics; no row moved on its own.
    assert packs == [8 + 8 + 1 + 1, 1] and moves == []
    minibatches = config.ppo_epochs * config.batch_size // config.mini_batch_size
    train_reads = {("tolist", "trainer/learner.py"): minibatches + config.ppo_epochs, ("item", "trainer/learner.py"): minibatches}
    assert before == train_reads
    assert reads == {**train_reads, ("cpu", "trainer/transfer.py"): 1}
    # The budget: at most 2 per training mini-batch (the permutation's .tolist() is a host read).
    assert (sum(before.values()) - config.ppo_epochs) / minibatches <= 2


@pytest.mark.parametrize("options", [{}, {"gradient_accumulation_steps": 2}, {"use_score_scaling": True, "early_stopping": True}])
def test_sync_budget_covers_every_read_of_a_step(count_reads, options):
    """``sync_budget`` (what ``make gpu-check``'s sync row compares with) against the reads of trl_lite's
    own code in a step on the CPU: equal, but the permutations' host ``.tolist()`` (one per epoch)."""
    from trl_lite.trainer.transfer import sync_budget

    config = PPOConfig(batch_size=8, mini_batch_size=2, ppo_epochs=2, max_grad_norm=1.0, target_kl=1e9, **options)
    trainer, batch = _trainer_and_batch(config)
    count_reads.clear()
    experience = trainer.experience_maker.make(batch)
    trainer.statistics.step_stats(experience, trainer.learner.train(experience)[0])
    reads = sum(count_reads.values()) - config.ppo_epochs
    budget = sync_budget(config)
    # The statistics' copy back is a .cpu() (not in READS): counted here by the budget, not by the reads.
    assert reads + 1 == budget["total"]
    assert budget["per_minibatch"] <= 2 and budget["minibatches"] == 8


def test_the_input_checks_read_the_host_once_per_kind_of_input_whatever_the_rows(count_reads):
    from trl_lite.trainer.step_inputs import validate_generation_logprobs, validate_step_inputs

    counts = []
    for rows in (8, 16):
        queries, responses, scores = random_batch(rows)
        masks = [(torch.arange(len(r)) % 2) for r in responses]
        count_reads.clear()
        validate_step_inputs(queries, responses, scores, masks, batch_size=rows, vocab_size=100, is_encoder_decoder=False)
        validate_generation_logprobs([-torch.rand(len(r)) for r in responses], responses)
        counts.append(dict(count_reads))
    # queries, responses, scores, masks, their action count, generation log-probs: one read each.
    assert counts[0] == counts[1] and sum(counts[0].values()) == 6
