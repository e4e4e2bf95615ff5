"""The transformers engine records its sampler's kept sets as it samples (docs/truncated_sampling.md): a processor at
the very end of transformers' list compacts each step's finite set to token ids, so no ``rows x vocabulary`` scores
are kept for the whole call. The sets equal those of the scores the sampler drew from (``output_scores``, compacted as
before) on GPT-2 and a tiny rotary GQA Qwen2 - top-k, top-p, min-p, their combination, a repetition penalty, left
padding, T != 1, a capped set - a caller's ``logits_processor`` still runs before the warpers, and every classic
``generate()`` shape (one 1-D query, lists in chunks, ``return_prompt=False``, ``remove_padding=False`` then cut)
records sets that ``step()`` replays. A greedy call records nothing: its rows are scored under ``PPOConfig``'s
``pi_T^K``, the sets re-derived, said once."""

import math
import warnings

import pytest
import torch
from test_truncated_head import brute_kept
from test_truncated_replay import logits64, over_set, rederived
from test_truncated_step import CUTS, QUERIES, T, captured_step, make_lm, make_trainer
from transformers import LogitsProcessorList

from trl_lite.core.kept_sets import Truncation, ids_of_mask
from trl_lite.engines.kept_recorder import KeptRecorder, recorded_rows, recording

SETTINGS = {**{name: dict(cut, temperature=T) for name, cut in CUTS.items()},
            "penalty_hot": dict(top_k=6, top_p=0.9, temperature=1.3, repetition_penalty=3.0),
            "top_p_flat": dict(top_p=0.95, temperature=4.0)}  # fmt: skip


class Banned:
    """A caller's processor: bans one token, and keeps what it was given (to see where transformers ran it)."""

    def __init__(self, token: int):
        self.token, self.seen = token, []

    def __call__(self, input_ids, scores):
        self.seen.append(scores.clone())
        return scores.masked_fill(torch.arange(scores.shape[-1]) == self.token, -math.inf)


def as_sets(ids, counts):
    return [sorted(row[: int(n)].tolist()) for row, n in zip(ids, counts)]


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_recorded_sets_are_those_of_the_scores_the_sampler_drew_from(arch, name):
    lm, settings = make_lm(arch).eval(), SETTINGS[name]
    if name == "top_p_flat":
        with torch.no_grad():  # a flat distribution: sets of hundreds of tokens, over the small cap below
            lm.get_output_embeddings().weight.mul_(0.05)
    bound = 3 if name == "top_p_flat" else 1024
    width = max(len(q) for q in QUERIES)
    input_ids = torch.stack([torch.cat([torch.zeros(width - len(q), dtype=torch.long), q]) for q in QUERIES])
    mask = (input_ids != 0).long()  # left padding (the queries hold no token 0)
    banned, recorder = Banned(token=int(QUERIES[0][0])), KeptRecorder(bound=bound)
    torch.manual_seed(0)
    with recording(lm, recorder):
        out = lm.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, max_new_tokens=6, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True,
                          logits_processor=LogitsProcessorList([banned]), **settings)  # fmt: skip
    assert "_get_logits_processor" not in lm.__dict__  # the model's own method again
    steps = len(out.scores)
    recorded = recorder.step_sets(out.sequences, steps)
    tokens = out.sequences[:, -steps:]
    sizes = []
    for t, scores in enumerate(out.scores):
        ids, counts = ids_of_mask(scores > -math.inf, scores, tokens[:, t], bound)  # as the engine compacted before
        assert as_sets(*recorded[t]) == as_sets(ids, counts), t
        sizes += counts.tolist()
    # The caller's processor ran where transformers puts it - before the warpers (its input was not cut yet) - and its
    # ban reached the sets (never kept, the sampled token aside).
    assert len(banned.seen) == steps and all(bool((seen > -math.inf).all()) for seen in banned.seen)
    assert all(banned.token not in s or banned.token in tokens[:, t].tolist()
               for t in range(steps) for s in as_sets(*recorded[t]))  # fmt: skip
    if name == "top_p_flat":
        assert max(sizes) == bound + 1  # capped: the bound's most probable and the sampled token
    rows = recorded_rows(recorded, [steps, 3, steps, 0])
    assert [r.width for r in rows] == [steps, 3, steps, 0]
    for t in range(3):
        one, _ = rows[1].for_slots(torch.tensor([0]), torch.tensor([t]))
        assert sorted(one[0, : int(rows[1].counts[t])].tolist()) == as_sets(*recorded[t])[1]


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_every_classic_generate_shape_records_sets_that_step_replays(arch):
    lm, cut = make_lm(arch), CUTS["qwen_style"]
    trainer = make_trainer(lm, cut, ppo_epochs=1)
    shapes = {
        # one 1-D query at a time, as classic notebooks loop: (1, S) with the prompt, sliced off by the caller
        "single": lambda q: trainer.generate(q, max_new_tokens=6, do_sample=True).squeeze(0)[len(q) :],
        "single_no_prompt": lambda q: trainer.generate(q, return_prompt=False, max_new_tokens=6, do_sample=True)[0],
    }
    for name, one in shapes.items():
        torch.manual_seed(0)
        responses = [one(q) for q in QUERIES]
        distinct = {(tuple(q.tolist()), tuple(r.tolist())) for q, r in zip(QUERIES, responses)}
        assert len(trainer.generation.records) == len(distinct), name  # one record per sampled row's tokens
        check_replayed(trainer, lm, cut, responses, name)
    lists = {
        "chunks_of_two": dict(batch_size=2),
        "with_prompt": dict(return_prompt=True),
        "padded_then_cut": dict(remove_padding=False, max_new_tokens=8),
    }
    for name, options in lists.items():
        torch.manual_seed(1)
        options = {"return_prompt": False, "max_new_tokens": 6, **options}
        out = trainer.generate(QUERIES, do_sample=True, **options)
        responses = [row[len(q) :] if options["return_prompt"] else row for q, row in zip(QUERIES, out)]
        if name == "padded_then_cut":
            responses = [row[:5] for row in responses]  # the caller cuts the padded output: the records' beginnings
        check_replayed(trainer, lm, cut, responses, name)


def check_replayed(trainer, lm, cut, responses, name):
    """step() finds a record for every row (nothing re-derived) and scores lp_old over the sampler's sets (the policy
    did not move: the float64 rule's sets)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, experience = captured_step(trainer, QUERIES, responses)
    assert not rederived(caught), name
    assert experience.rows.kept is not None
    for i, (query, response) in enumerate(zip(QUERIES, responses)):
        z = logits64(lm, query, response)
        sets = brute_kept(z / T, Truncation(**cut))
        assert torch.allclose(experience.logprobs[i, : len(response)].double(), over_set(z, response, sets),
                              atol=2e-5), (name, i)  # fmt: skip
    lm.load_state_dict(trainer.model.pretrained_model.state_dict())  # the next shape samples from the updated policy


def test_a_greedy_call_records_nothing_and_its_rows_are_scored_under_the_configs_truncated_policy():
    lm, cut = make_lm("gpt2"), CUTS["top_p"]
    trainer = make_trainer(lm, cut, ppo_epochs=1)
    single = trainer.generate(QUERIES[0], return_prompt=False, max_new_tokens=6, do_sample=False)[0]
    responses = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=6, do_sample=False)
    assert torch.equal(single, responses[0])
    assert len(trainer.generation.records) == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, experience = captured_step(trainer, QUERIES, responses)
    messages = rederived(caught)
    assert len(messages) == 1 and "4 of 4 responses" in str(messages[0].message)
    assert "greedy" in str(messages[0].message)
    for i, (query, response) in enumerate(zip(QUERIES, responses)):
        z = logits64(lm, query, response)
        sets = brute_kept(z / T, Truncation(**cut))
        assert torch.allclose(experience.logprobs[i, : len(response)].double(), over_set(z, response, sets),
                              atol=2e-5)  # fmt: skip
