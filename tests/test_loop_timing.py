"""The rollout loop's speed-related behaviour: batched generation sorted into chunks by query length
(same answers, given order), the chunk-wise cut after EOS, and the per-phase times of `trainer.timed`."""

import pytest
import torch
from devices import equal
from tiny_models import make_gpt2, make_tokenizer, random_batch

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer


def make_trainer(padding_side="right"):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=1))
    return PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=1), model, tokenizer=make_tokenizer(padding_side))


def test_batched_generation_answers_each_query_in_the_given_order():
    trainer = make_trainer()
    queries = [torch.tensor(q) for q in ([5, 6, 7, 8, 9], [10], [11, 12, 13], [14, 15], [16, 17, 18, 19])]
    responses = trainer.generate(queries, batch_size=2, return_prompt=False, max_new_tokens=4, do_sample=False)
    lm = trainer.model.pretrained_model.eval()
    for query, response in zip(queries, responses):
        alone = lm.generate(input_ids=query[None].to(lm.device), attention_mask=torch.ones(1, len(query), dtype=torch.long, device=lm.device),
                            max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(query):]
        eos = (alone == 1).nonzero()
        expected = alone[: int(eos[0]) + 1] if len(eos) else alone
        assert equal(response, expected)


def test_trim_generations_cuts_padding_prompt_and_after_the_first_eos():
    trainer = make_trainer()
    eos, pad = 1, 0
    # Prompt width 3: row 0's query has 2 tokens (one pad), row 1's 3 tokens including an EOS, which must not cut.
    generations = torch.tensor([[pad, 5, 6, 7, eos, pad, pad], [eos, 8, 9, 10, 11, 12, eos]])
    full = trainer._trim_generations(generations, 3, [2, 3], return_prompt=True, remove_padding=True)
    assert [t.tolist() for t in full] == [[5, 6, 7, eos], [eos, 8, 9, 10, 11, 12, eos]]
    responses = trainer._trim_generations(generations, 3, [2, 3], return_prompt=False, remove_padding=True)
    assert [t.tolist() for t in responses] == [[7, eos], [10, 11, 12, eos]]
    kept = trainer._trim_generations(generations, 3, [2, 3], return_prompt=False, remove_padding=False)
    assert [t.tolist() for t in kept] == [[7, eos, pad, pad], [10, 11, 12, eos]]


def test_timed_phases_and_generation_time_appear_in_the_next_step_only():
    trainer = make_trainer()
    queries, _, _ = random_batch(4, seed=0)
    responses = trainer.generate(queries, batch_size=2, return_prompt=False, max_new_tokens=3, do_sample=False)
    with trainer.timed("rollout/reward"):
        scores = [torch.tensor(float(len(r))) for r in responses]
    with trainer.timed("rollout/reward"):
        pass
    stats = trainer.step(queries, [r if len(r) else torch.tensor([3]) for r in responses], scores)
    assert stats["time/rollout/generate"] > 0 and stats["time/rollout/reward"] >= 0
    stats = trainer.step(queries, [torch.tensor([3, 4])] * 4, scores)
    assert "time/rollout/generate" not in stats and "time/rollout/reward" not in stats
    with pytest.raises(ValueError, match="a phase name must be a non-empty string"):
        with trainer.timed(""):
            pass


def test_step_phases_are_timed_with_device_events_on_cuda(monkeypatch):
    """On CUDA a phase mark is a CUDA event recorded in stream order (no host sync when it is made); the
    seconds come from the events' own clock once they completed. A stand-in event class checks the calls."""
    from trl_lite.trainer.step.timing import StepClock

    calls = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = len(calls) * 0.5  # stand-in device clock: milliseconds
            calls.append("record")

        def synchronize(self):
            calls.append("synchronize")

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = StepClock(torch.device("cuda"))
    a, b, c = clock.mark(), clock.mark(), clock.mark()
    assert calls == ["record"] * 3  # marking never waits
    seconds = clock.seconds({"first": (a, b), "whole": (a, c)})
    assert seconds == {"first": 0.5e-3, "whole": 1e-3}
    assert calls[3:] == ["synchronize", "synchronize"]
    cpu = StepClock(torch.device("cpu"))
    start = cpu.mark()
    assert isinstance(start, float) and cpu.seconds({"x": (start, start + 2.0)}) == {"x": 2.0}
