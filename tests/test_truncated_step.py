"""Truncated sampling in step() (PPO_SPEC section 23): with PPOConfig truncating, the rollout's lp_old is
log pi_T^K over the policy's kept sets - checked against a float64 brute force (full sort, explicit
renormalisation) - the reference log-probs are the untruncated pi_T, the first pass's ratio is 1, every training
pass replays the rollout's sets (padded, packed, prefix sharing, token budget, one buffer and chunked heads give
the same step), and the transformers engine's generation log-probs equal lp_old (the gap of section 15 is noise);
GPT-2 and a tiny rotary GQA Qwen2."""

import copy
import math
import warnings

import pytest
import torch
from test_truncated_head import brute_kept
from tiny_models import make_gpt2, make_qwen2, make_tokenizer

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.core.kept_sets import Truncation

T = 0.7
CUTS = {"top_k": dict(top_k=6), "top_p": dict(top_p=0.8), "min_p": dict(min_p=0.1),
        "qwen_style": dict(top_k=20, top_p=0.8, min_p=0.02)}  # fmt: skip
QUERIES = [torch.tensor(q) for q in ([5, 6, 7, 8, 9], [10, 11], [5, 6, 7, 8, 9], [14, 15, 16])]


def make_lm(arch: str):
    lm = make_gpt2(seed=3) if arch == "gpt2" else make_qwen2(seed=3)
    with torch.no_grad():  # logits spread wide: the cuts keep a few tokens, not all
        lm.get_input_embeddings().weight.mul_(4.0)
        if lm.get_output_embeddings().weight is not lm.get_input_embeddings().weight:
            lm.get_output_embeddings().weight.mul_(4.0)
    return lm


def make_trainer(lm, cut, sgd: bool = False, **options):
    torch.manual_seed(42)  # the value head's initialisation
    model = AutoModelForCausalLMWithValueHead.from_pretrained(copy.deepcopy(lm))
    config = PPOConfig(batch_size=4, mini_batch_size=options.pop("mini_batch_size", 4), temperature=T, seed=0,
                       **cut, **options)  # fmt: skip
    # Plain SGD: the update is the gradient itself (Adam's first steps are its signs, which float noise flips).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if sgd else None
    return PPOTrainer(config, model, tokenizer=make_tokenizer(), optimizer=optimizer)


def captured_step(trainer, queries, responses, **kwargs):
    """step() and the Experience its rollout made."""
    seen = []
    make = trainer.experience_maker.make
    trainer.experience_maker.make = lambda batch: seen.append(make(batch)) or seen[-1]
    stats = trainer.step(queries, responses, [torch.tensor(float(i)) for i in range(len(queries))], **kwargs)
    trainer.experience_maker.make = make
    return stats, seen[0]


def brute_logprobs(lm, query, response, cut):
    """float64 (log pi_T^K, log pi_T) of each response token: kept sets by the brute-force rule on the float64
    logits / T, the sampled token added."""
    lm64 = copy.deepcopy(lm).double().eval()
    with torch.no_grad():
        z = lm64(input_ids=torch.cat([query, response])[None]).logits[0, len(query) - 1 : -1] / T
    keep = brute_kept(z, Truncation(**cut))
    keep[torch.arange(len(response)), response] = True
    truncated = torch.log_softmax(z.masked_fill(~keep, -math.inf), -1)[torch.arange(len(response)), response]
    return truncated, torch.log_softmax(z, -1)[torch.arange(len(response)), response]


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
@pytest.mark.parametrize("name", list(CUTS))
def test_lp_old_is_the_renormalised_policy_the_reference_untruncated_and_the_engine_agrees(arch, name):
    cut = CUTS[name]
    lm = make_lm(arch)
    trainer = make_trainer(lm, cut, ppo_epochs=1)
    torch.manual_seed(0)
    responses, gen_logprobs = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=6, do_sample=True,
                                               return_logprobs=True)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats, experience = captured_step(trainer, QUERIES, responses, generation_logprobs=gen_logprobs)
    assert not [w for w in caught if "re-derived" in str(w.message)]  # the engine's own sets were replayed
    for i, (query, response) in enumerate(zip(QUERIES, responses)):
        truncated, full = brute_logprobs(lm, query, response, cut)
        n = len(response)
        assert torch.allclose(experience.logprobs[i, :n].double(), truncated, atol=2e-5), name
        assert torch.allclose(experience.ref_logprobs[i, :n].double(), full, atol=2e-5)  # the reference: pi_T
        assert torch.allclose(gen_logprobs[i].double(), truncated, atol=2e-5)  # the engine's: the warpers' sets
        assert bool((truncated > full + 1e-6).any())  # the cut acted
    # One pass, one optimizer step after it: the ratio is 1, and the gap of section 15 is float noise.
    assert float(torch.as_tensor(stats["ppo/policy/ratio"]).sub(1).abs().max()) < 1e-5
    assert float(stats["rollout/logprob_diff/max"]) < 1e-5
    assert float(stats["policy/entropy_untruncated"]) > float(stats["ppo/policy/entropy"])


def weights(trainer):
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.pretrained_model.parameters()])


LAYOUTS = {
    "padded": dict(padding_free=False, lm_head_chunk_size=0),
    "padded_chunked_head": dict(padding_free=False, lm_head_chunk_size=2),
    "packed": dict(padding_free=True, lm_head_chunk_size=0),
    "packed_chunked_head": dict(padding_free=True, lm_head_chunk_size=3),
    "prefix_sharing": dict(padding_free=True, prefix_sharing=True),
    "token_budget": dict(padding_free=True, max_tokens_per_minibatch=14),
}


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_every_layout_replays_the_same_kept_sets_and_takes_the_same_step(arch):
    lm, cut = make_lm(arch), CUTS["qwen_style"]
    base = make_trainer(lm, cut)
    torch.manual_seed(0)
    responses = base.generate(QUERIES, return_prompt=False, max_new_tokens=6, do_sample=True)
    results = {}
    for name, options in LAYOUTS.items():
        trainer = make_trainer(lm, cut, sgd=True, mini_batch_size=2, ppo_epochs=2, **options)
        torch.manual_seed(5)
        stats, experience = captured_step(trainer, QUERIES, responses)
        results[name] = (experience.logprobs, weights(trainer), experience.rows.kept)
    logprobs, after, kept = results["padded"]
    assert kept is not None and kept.ids.numel() > 0
    before = weights(make_trainer(lm, cut))
    assert float((after - before).abs().max()) > 1e-3  # the step moved the policy
    for name, (other_lp, other_w, other_kept) in results.items():
        assert torch.allclose(other_lp, logprobs, atol=2e-5), name
        assert torch.equal(other_kept.offsets, kept.offsets) and torch.equal(other_kept.ids, kept.ids), name
        assert float((other_w - after).abs().max()) < 2e-5, name


def test_an_untruncated_run_carries_no_kept_sets():
    lm = make_lm("gpt2")
    trainer = make_trainer(lm, {})
    torch.manual_seed(0)
    responses = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=4, do_sample=True)
    stats, experience = captured_step(trainer, QUERIES, responses)
    assert experience.rows.kept is None and "policy/entropy_untruncated" not in stats
