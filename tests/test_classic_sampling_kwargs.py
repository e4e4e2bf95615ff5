"""Classic PPOTrainer.generate(**kwargs) samples as its kwargs say, as classic TRL did (PPO_SPEC sections 22-23,
docs/truncated_sampling.md): a kwarg that differs from PPOConfig (top_p=0.9 in ppo_multi_adapter.py's kwargs)
draws from the kwarg's distribution - checked against a float64 nucleus of the model's logits - with one warning
per run naming the kwarg, the config's value and that the trainer scores under PPOConfig's distribution; the
log-probs generate() returns are PPOConfig's; the engines' own entry points still refuse it."""

import copy
import warnings

import pytest
import torch
from tiny_models import VOCAB_SIZE, make_gpt2, make_tokenizer

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

QUERY = torch.tensor([5, 6, 7, 8, 9])
# examples/classic/ppo_multi_adapter.py's generation kwargs as classic TRL wrote them: nucleus sampling in the call.
CLASSIC_MULTI_ADAPTER = {"top_k": 0.0, "top_p": 0.9, "do_sample": True, "pad_token_id": 0}


def sharp_trainer(**config) -> PPOTrainer:
    """A tiny GPT-2 whose logits are spread wide (embeddings x 6, tied to the head): top-p 0.9 visibly cuts."""
    lm = make_gpt2(seed=3)
    with torch.no_grad():
        lm.transformer.wte.weight.mul_(6.0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(lm)
    return PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, **config), model, tokenizer=make_tokenizer())


def first_token_logits(trainer) -> torch.Tensor:
    lm64 = copy.deepcopy(trainer.model.pretrained_model).double().eval()
    with torch.no_grad():
        return lm64(input_ids=QUERY[None]).logits[0, -1]


def nucleus(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """(V,) float64: softmax(z) cut to the smallest most-probable set holding top_p, renormalised (full sort)."""
    p = torch.softmax(z, -1)
    order = p.argsort(descending=True)
    before = torch.cumsum(p[order], 0) - p[order]  # mass of the tokens ranked above each
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order[before < top_p]] = True
    q = torch.where(keep, p, 0.0)
    return q / q.sum()


def test_a_classic_top_p_kwarg_samples_the_nucleus_warns_once_and_is_scored_under_ppoconfig():
    trainer = sharp_trainer()
    z = first_token_logits(trainer)
    expected = nucleus(z, 0.9)
    assert 0.5 * float((expected - torch.softmax(z, -1)).abs().sum()) > 0.08  # the cut matters for this model
    torch.manual_seed(0)
    with pytest.warns(UserWarning) as caught:
        rows, logprobs = trainer.generate([QUERY], return_prompt=False, max_new_tokens=1, num_return_sequences=3000,
                                          return_logprobs=True, **CLASSIC_MULTI_ADAPTER)  # fmt: skip
    messages = [str(w.message) for w in caught if "generate() got" in str(w.message)]
    assert len(messages) == 1
    assert "top_p=0.9, but PPOConfig.top_p=1.0" in messages[0] and "scores the rollouts" in messages[0]
    assert "Set PPOConfig.top_p=0.9 to score what was sampled" in messages[0]
    assert "top_k" not in messages[0].split(":")[0]  # top_k=0.0 is the config's (off): neutral, not named
    tokens = torch.stack([row[0] for row in rows])
    assert float(expected[tokens].min()) > 0  # only nucleus tokens were drawn
    counts = torch.bincount(tokens, minlength=VOCAB_SIZE).double() / len(tokens)
    assert 0.5 * float((counts - expected).abs().sum()) < 0.04
    # The returned log-probs are PPOConfig's distribution (untruncated softmax(z)): what step() scores.
    got = torch.stack([lp[0] for lp in logprobs]).double()
    assert float((got - torch.log_softmax(z, -1)[tokens]).abs().max()) < 1e-5
    # One warning per run: further calls, the single-query path included, are silent.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.generate([QUERY], return_prompt=False, max_new_tokens=2, **CLASSIC_MULTI_ADAPTER)
        trainer.generate(QUERY, max_new_tokens=2, **CLASSIC_MULTI_ADAPTER)


def test_a_classic_temperature_kwarg_samples_at_it_and_a_new_kwarg_is_named_once_more():
    trainer = sharp_trainer(temperature=0.7)
    z = first_token_logits(trainer)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match=r"generate\(\) got temperature=1.5, but PPOConfig.temperature=0.7"):
        rows = trainer.generate([QUERY], return_prompt=False, max_new_tokens=1, num_return_sequences=3000,
                                do_sample=True, temperature=1.5)  # fmt: skip
    counts = torch.bincount(torch.stack([row[0] for row in rows]), minlength=VOCAB_SIZE).double() / len(rows)
    # Sampling noise of 3000 draws over 57 tokens is about 0.05 in total variation; the two temperatures are 0.3 apart.
    assert 0.5 * float((counts - torch.softmax(z / 1.5, -1)).abs().sum()) < 0.1
    assert 0.5 * float((counts - torch.softmax(z / 0.7, -1)).abs().sum()) > 0.2  # not the config's
    with pytest.warns(UserWarning, match=r"got typical_p=0.9, but PPOConfig has no typical_p setting"):
        trainer.generate([QUERY], max_new_tokens=1, do_sample=True, temperature=1.5, typical_p=0.9)


def test_a_classic_ppo_multi_adapter_style_run_with_top_p_in_its_kwargs_steps():
    trainer = sharp_trainer()
    queries = [QUERY, QUERY[:3], QUERY[1:], QUERY[:4]]
    with pytest.warns(UserWarning, match="top_p=0.9, but PPOConfig.top_p=1.0"):
        responses = trainer.generate(queries, return_prompt=False, max_new_tokens=4, **CLASSIC_MULTI_ADAPTER)
    stats = trainer.step(queries, responses, [torch.tensor(1.0), torch.tensor(0.0), torch.tensor(0.5), torch.tensor(0.2)])
    assert torch.isfinite(torch.tensor(stats["ppo/loss/total"])).all()
