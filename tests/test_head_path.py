"""One object decides the LM head's path of a pass (issue 59 item 6): HeadPath.choose gives the head and its chunk,
the pass runs with that choice, and memory/lm_head_chunk_size reports the path the policy's training passes took
rather than a second computation of the rule."""

import dataclasses

import torch
from tiny_models import make_gpt2, make_tokenizer, random_batch

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.trainer.step.head_path import OWN_LOGITS, HeadChoice


def make_trainer(**config):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=3))
    return PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=1, **config), model,
                      tokenizer=make_tokenizer())  # fmt: skip


def test_the_statistic_is_the_path_the_training_passes_took():
    trainer = make_trainer(lm_head_chunk_size=3)
    head = trainer.forward.head
    chosen, real = [], head.choose

    def choose(model, tokens, own_logits=False, record=False):
        choice = real(model, tokens, own_logits, record)
        if record:  # the training passes: run them on chunks of 2 instead
            choice = dataclasses.replace(choice, chunk=2)
            head._taken[id(model)] = 2
            chosen.append(choice)
        return choice

    head.choose = choose
    stats = trainer.step(*random_batch(4, seed=1))
    assert len(chosen) == 2  # one decision per training pass
    assert float(stats["memory/lm_head_chunk_size"]) == 2.0  # the path taken, not the rule's 3


def test_a_choice_names_its_head_and_chunk():
    trainer = make_trainer(lm_head_chunk_size=0)
    head = trainer.forward.head
    choice = head.choose(trainer.model, 10)
    assert choice.fused and choice.chunk == 0 and not choice.partitioned
    assert head.choose(trainer.model, 10, own_logits=True) == HeadChoice(None, OWN_LOGITS)
    assert head.taken(trainer.model, 10) == 0  # before any training pass: the rule's
    stats = trainer.step(*random_batch(4, seed=2))
    assert float(stats["memory/lm_head_chunk_size"]) == 0.0
    assert torch.isfinite(torch.as_tensor(stats["ppo/loss/total"])).all()
