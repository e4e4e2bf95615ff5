"""Truncated sampling replays the sampler's own kept sets (PPO_SPEC section 23, docs/truncated_sampling.md): the
transformers engine records what its warpers kept, step() finds those records by the rows' tokens (sliced and copied
responses too) and scores lp_old over them - not over the sets the rollout pass would re-derive, which differ when
the policy moved since sampling or a repetition penalty shaped the sampler's logits. Rows without a record are
re-derived, said once per run. Checked against a float64 brute force (full sort, explicit renormalisation) on GPT-2
and a tiny rotary GQA Qwen2."""

import copy
import math
import warnings

import pytest
import torch
from test_truncated_head import brute_kept
from test_truncated_step import CUTS, QUERIES, T, captured_step, make_lm, make_trainer

from trl_lite.core.kept_sets import KeptSets, Truncation


def logits64(lm, query, response):
    """float64 logits ``(n, V)`` predicting each response token (before the temperature)."""
    lm64 = copy.deepcopy(lm).double().eval()
    with torch.no_grad():
        return lm64(input_ids=torch.cat([query, response])[None]).logits[0, len(query) - 1 : -1]


def penalised(z, query, response, penalty, prompt):
    """transformers' repetition penalty on raw logits ``z`` ``(n, V)``: at step t, every token of the ``prompt`` (the
    query as ``generate`` saw it, left padding included) and of the response so far is divided (positive) or
    multiplied (negative) by ``penalty``."""
    out = z.clone()
    for t in range(len(response)):
        seen = torch.cat([prompt, response[:t]]).unique()
        row = out[t, seen]
        out[t, seen] = torch.where(row < 0, row * penalty, row / penalty)
    return out


def over_set(z, response, keep):
    """``log pi_T^K`` of the response tokens: ``z / T`` renormalised over ``keep`` (the label added), float64."""
    keep = keep.clone()
    keep[torch.arange(len(response)), response] = True
    return torch.log_softmax((z / T).masked_fill(~keep, -math.inf), -1)[torch.arange(len(response)), response]


def rederived(caught) -> list:
    return [w for w in caught if "re-derived" in str(w.message)]


def step_rederived(trainer, queries, responses, **kwargs):
    """``captured_step``'s experience, and the re-derivation warnings the step gave (every warning recorded)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, experience = captured_step(trainer, queries, responses, **kwargs)
    return experience, rederived(caught)


def moved(trainer, seed: int = 11, scale: float = 0.05):
    """Change the policy's weights (its output embedding, tied to the input's for GPT-2) as an update would."""
    head = trainer.model.pretrained_model.get_output_embeddings().weight
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.add_(scale * torch.randn(head.shape, generator=generator))


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_a_policy_moved_since_sampling_is_scored_over_the_samplers_sets(arch):
    lm, cut = make_lm(arch), CUTS["top_k"]  # the fixtures' peaked logits: the other cuts keep one token here
    trainer = make_trainer(lm, cut, ppo_epochs=1)
    torch.manual_seed(0)
    responses = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=6, do_sample=True)
    sampler = copy.deepcopy(trainer.model.pretrained_model)
    moved(trainer)
    now = copy.deepcopy(trainer.model.pretrained_model)
    experience, messages = step_rederived(trainer, QUERIES, responses)
    assert not messages
    differ = False
    for i, (query, response) in enumerate(zip(QUERIES, responses)):
        z_then, z_now = logits64(sampler, query, response), logits64(now, query, response)
        then_sets, now_sets = brute_kept(z_then / T, Truncation(**cut)), brute_kept(z_now / T, Truncation(**cut))
        replayed, re_derived = over_set(z_now, response, then_sets), over_set(z_now, response, now_sets)
        n = len(response)
        assert torch.allclose(experience.logprobs[i, :n].double(), replayed, atol=2e-5)
        differ |= bool((replayed - re_derived).abs().max() > 1e-3)
    assert differ  # the moved policy's own sets would have scored otherwise


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_a_repetition_penalty_cuts_the_samplers_sets_and_step_replays_them(arch):
    lm, cut, penalty = make_lm(arch), CUTS["top_k"], 3.0
    trainer = make_trainer(lm, cut, ppo_epochs=1, repetition_penalty=penalty)
    torch.manual_seed(0)
    responses, engine = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=6, do_sample=True,
                                         return_logprobs=True)  # fmt: skip
    stats, experience = captured_step(trainer, QUERIES, responses, generation_logprobs=engine)
    differ = False
    for i, (query, response) in enumerate(zip(QUERIES, responses)):
        z = logits64(lm, query, response)
        width, pad = max(len(q) for q in QUERIES), trainer.generation.engine.pad_token_id  # one left-padded chunk
        prompt = torch.cat([torch.full((width - len(query),), pad), query])
        sampler_sets = brute_kept(penalised(z, query, response, penalty, prompt) / T, Truncation(**cut))
        replayed = over_set(z, response, sampler_sets)  # the penalty cuts the set; it is not scored
        n = len(response)
        assert torch.allclose(experience.logprobs[i, :n].double(), replayed, atol=2e-5)
        assert torch.allclose(engine[i].double(), replayed, atol=2e-5)
        differ |= bool((replayed - over_set(z, response, brute_kept(z / T, Truncation(**cut)))).abs().max() > 1e-3)
    assert differ  # re-deriving from z / T (no penalty) would have scored other sets
    assert float(stats["rollout/logprob_diff/max"]) < 1e-5
    assert float(torch.as_tensor(stats["ppo/policy/ratio"]).sub(1).abs().max()) < 1e-5


def test_sliced_and_copied_responses_find_their_records_and_an_edited_one_is_re_derived_once():
    lm, cut = make_lm("qwen2"), CUTS["qwen_style"]
    trainer = make_trainer(lm, cut, ppo_epochs=1)
    torch.manual_seed(0)
    full = trainer.generate(QUERIES, return_prompt=True, max_new_tokens=6, do_sample=True)
    responses = [row[len(q) :].clone() for q, row in zip(QUERIES, full)]  # classic: slice the prompt off, copy
    sampler = copy.deepcopy(trainer.model.pretrained_model)
    moved(trainer)
    now = copy.deepcopy(trainer.model.pretrained_model)  # the policy of the rollout pass (step() updates it)
    experience, messages = step_rederived(trainer, QUERIES, responses)
    assert not messages
    for i, (query, response) in enumerate(zip(QUERIES, responses)):
        z_now = logits64(now, query, response)
        then = brute_kept(logits64(sampler, query, response) / T, Truncation(**cut))
        assert torch.allclose(experience.logprobs[i, : len(response)].double(), over_set(z_now, response, then),
                              atol=2e-5)  # fmt: skip
    # Sampled again; one response edited: its sets are re-derived from the rollout pass (said once), the others not.
    torch.manual_seed(1)
    responses = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=6, do_sample=True)
    edited = responses[2].clone()
    edited[-1] = (edited[-1] + 1) % lm.config.vocab_size
    batch = [responses[0], responses[1], edited, responses[3]]
    sampler = copy.deepcopy(trainer.model.pretrained_model)
    moved(trainer, seed=12)
    now = copy.deepcopy(trainer.model.pretrained_model)
    experience, messages = step_rederived(trainer, QUERIES, batch)
    assert len(messages) == 1 and "1 of 4 responses" in str(messages[0].message)
    for i, (query, response) in enumerate(zip(QUERIES, batch)):
        z_now = logits64(now, query, response)
        source = now if i == 2 else sampler  # re-derived: the rollout pass's own logits
        sets = brute_kept(logits64(source, query, response) / T, Truncation(**cut))
        assert torch.allclose(experience.logprobs[i, : len(response)].double(), over_set(z_now, response, sets),
                              atol=2e-5), i  # fmt: skip
    # Nothing recorded for these rows any more (step() took the records): re-derived, and not said again.
    experience, messages = step_rederived(trainer, QUERIES, batch)
    assert not messages and experience.rows.kept is not None
    assert len(trainer.generation.records) == 0


def test_explicit_kept_sets_are_checked_and_replayed():
    lm, cut = make_lm("gpt2"), CUTS["top_p"]
    trainer = make_trainer(lm, cut, ppo_epochs=1)
    torch.manual_seed(0)
    responses = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=5, do_sample=True)
    records = trainer.generation.records.take(QUERIES, responses)
    assert records is not None and all(isinstance(r, KeptSets) and r.width == len(s) for r, s in zip(records, responses))
    with pytest.raises(ValueError, match=r"kept_sets\[1\] must be None or a one-row KeptSets"):
        short = KeptSets.one_row(responses[1][:2].reshape(-1, 1), torch.ones(2, dtype=torch.int64))
        trainer.step(QUERIES, responses, [torch.tensor(1.0)] * 4, kept_sets=[records[0], short, None, None])
    with pytest.raises(ValueError, match="kept_sets must be a list of 4"):
        trainer.step(QUERIES, responses, [torch.tensor(1.0)] * 4, kept_sets=records[:3])
    # A set of the token alone: lp_old is 0 there (log 1), whatever the policy.
    alone = [KeptSets.one_row(r.reshape(-1, 1), torch.ones(len(r), dtype=torch.int64)) for r in responses]
    experience, messages = step_rederived(trainer, QUERIES, responses, kept_sets=alone)
    assert not messages
    assert float(experience.logprobs.abs().max()) == 0.0
