"""BestOfNSampler: classic constructor and generate(), batched with left padding, on tiny local models."""

import pytest
import torch
from tiny_models import make_gpt2, make_t5, make_tokenizer

from trl_lite import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, BestOfNSampler, LengthSampler

QUERIES = [[5, 9, 12], [7, 20, 3, 30, 8], [44]]
NO_EOS = {"suppress_tokens": [0, 1, 2]}  # every sample then has exactly its sampled length


@pytest.fixture
def policy():
    return AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=11))


def word_count_score(texts):
    return [float(len(set(t.split()))) for t in texts]


def fixed_lengths(*values):
    it = iter(values)
    return lambda: next(it)


def test_exported_at_the_classic_paths():
    import trl_lite
    import trl_lite.extras

    assert trl_lite.BestOfNSampler is trl_lite.extras.BestOfNSampler is BestOfNSampler


@pytest.mark.parametrize(
    "form,expected_queries",
    [
        (lambda: QUERIES[0], 1),
        (lambda: torch.tensor(QUERIES[1]), 1),
        (lambda: QUERIES, 3),
        (lambda: [torch.tensor(q) for q in QUERIES], 3),
    ],
    ids=["list_of_ints", "1d_tensor", "list_of_lists", "list_of_tensors"],
)
def test_every_classic_query_form(policy, form, expected_queries):
    sampler = BestOfNSampler(policy, make_tokenizer(), word_count_score, LengthSampler(2, 5), sample_size=3, n_candidates=2, seed=0)
    out = sampler.generate(form(), do_sample=True)
    assert len(out) == expected_queries
    assert all(len(texts) == 2 and all(isinstance(t, str) for t in texts) for texts in out)


def test_batched_greedy_equals_each_query_generated_alone(policy):
    """Left padding must not change what a query generates: the reference runs each query unpadded."""
    tokenizer = make_tokenizer()
    lengths = [4, 6, 3]
    sampler = BestOfNSampler(policy, tokenizer, word_count_score, fixed_lengths(*lengths), sample_size=2)
    out = sampler.generate(QUERIES, skip_special_tokens=False, do_sample=False, **NO_EOS)
    for query, length, texts in zip(QUERIES, lengths, out):
        alone = policy.pretrained_model.generate(
            torch.tensor([query]), max_new_tokens=length, do_sample=False, pad_token_id=0, **NO_EOS
        )
        assert texts == [tokenizer.decode(alone[0])]
        assert len(texts[0].split()) == len(query) + length


def test_returns_the_best_scored_samples_best_first(policy):
    tokenizer = make_tokenizer()
    seen = []

    def last_token_id(text):
        return tokenizer.convert_tokens_to_ids(text.split()[-1])

    def score(texts):
        seen.append(list(texts))
        return [float(last_token_id(t)) for t in texts]  # any fixed ranking will do

    sampler = BestOfNSampler(policy, tokenizer, score, LengthSampler(3, 6), sample_size=6, n_candidates=3, seed=1)
    out = sampler.generate([torch.tensor(q) for q in QUERIES], do_sample=True, **NO_EOS)
    assert len(seen) == 3 and all(len(texts) == 6 for texts in seen)
    for query, texts, best in zip(QUERIES, seen, out):
        expected = sorted(texts, key=last_token_id, reverse=True)[:3]
        assert [last_token_id(t) for t in best] == [last_token_id(t) for t in expected]
        assert all(b in texts for b in best)
        # Decoder-only: each scored text is the query followed by its continuation.
        assert all(t.split()[: len(query)] == tokenizer.convert_ids_to_tokens(query) for t in texts)


def test_each_query_gets_its_own_sampled_length(policy):
    sampler = BestOfNSampler(policy, make_tokenizer(), word_count_score, fixed_lengths(2, 7, 4), sample_size=3, n_candidates=3)
    out = sampler.generate(QUERIES, skip_special_tokens=False, do_sample=True, **NO_EOS)
    for query, length, texts in zip(QUERIES, (2, 7, 4), out):
        assert [len(t.split()) for t in texts] == [len(query) + length] * 3


def test_seed_makes_generation_reproducible(policy):
    def run():
        sampler = BestOfNSampler(policy, make_tokenizer(), word_count_score, LengthSampler(2, 8), sample_size=4, n_candidates=2, seed=123)
        return sampler.generate(QUERIES, do_sample=True)

    assert run() == run()


def test_generates_in_eval_mode_and_restores_the_mode(policy):
    seen_modes = []
    original = policy.pretrained_model.generate

    def spy(*args, **kwargs):
        seen_modes.append(policy.training)
        return original(*args, **kwargs)

    policy.pretrained_model.generate = spy
    policy.train()
    BestOfNSampler(policy, make_tokenizer(), word_count_score, LengthSampler(2, 3)).generate(QUERIES[0])
    assert seen_modes == [False] and policy.training


def test_generation_config_and_kwargs_reach_generate(policy):
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, suppress_tokens=[0, 1, 2])
    sampler = BestOfNSampler(policy, make_tokenizer(), word_count_score, fixed_lengths(5, 5), sample_size=3, n_candidates=3, generation_config=config)
    out = sampler.generate(QUERIES[1])[0]
    assert len(set(out)) == 1  # greedy from the config: all samples equal
    out = sampler.generate(QUERIES[1], do_sample=True, top_k=0)[0]
    assert len(out) == 3 and all(len(t.split()) == 10 for t in out)


def test_encoder_decoder_model():
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(make_t5(seed=2))
    tokenizer = make_tokenizer()
    sampler = BestOfNSampler(model, tokenizer, word_count_score, fixed_lengths(3, 5), sample_size=2, n_candidates=1)
    out = sampler.generate([QUERIES[0], QUERIES[1]], skip_special_tokens=False, do_sample=False, suppress_tokens=[1, 2])
    for query, length, texts in zip(QUERIES[:2], (3, 5), out):
        alone = model.pretrained_model.generate(torch.tensor([query]), max_new_tokens=length, do_sample=False, suppress_tokens=[1, 2])
        assert texts == [tokenizer.decode(alone[0])]


def test_bad_arguments_are_rejected(policy):
    tok = make_tokenizer()
    with pytest.raises(ValueError, match="tokenizer must be a PreTrainedTokenizer"):
        BestOfNSampler(policy, "gpt2", word_count_score, LengthSampler(1, 2))
    with pytest.raises(ValueError, match="model must be a PreTrainedModelWrapper .* got GPT2LMHeadModel"):
        BestOfNSampler(make_gpt2(), tok, word_count_score, LengthSampler(1, 2))
    with pytest.raises(ValueError, match="n_candidates=5, sample_size=4"):
        BestOfNSampler(policy, tok, word_count_score, LengthSampler(1, 2), sample_size=4, n_candidates=5)
    sampler = BestOfNSampler(policy, tok, word_count_score, LengthSampler(1, 2))
    with pytest.raises(ValueError, match="got a tensor of shape \\(1, 3\\)"):
        sampler.generate(torch.tensor([[1, 2, 3]]))
    with pytest.raises(TypeError, match="got a list of str"):
        sampler.generate(["a query"])
    with pytest.raises(ValueError, match="dtype torch.float32"):
        sampler.generate(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="got str"):
        sampler.generate("a query")
    bad_scores = BestOfNSampler(policy, tok, lambda texts: [1.0], LengthSampler(1, 2), sample_size=2)
    with pytest.raises(ValueError, match="got 1 scores for 2 texts"):
        bad_scores.generate(QUERIES[0])


def test_the_classic_docs_generation_config(policy):
    """The settings of classic's best-of-n docs, in a GenerationConfig and as keyword arguments."""
    from transformers import GenerationConfig

    tok = make_tokenizer()
    config = GenerationConfig(min_length=-1, top_k=0.0, top_p=1.0, do_sample=True, pad_token_id=tok.eos_token_id)
    before = config.to_dict()
    sampler = BestOfNSampler(policy, tok, word_count_score, LengthSampler(4, 16), generation_config=config, seed=0)
    out = sampler.generate([torch.tensor(q) for q in QUERIES], device="cpu", max_new_tokens=3)
    assert len(out) == 3 and all(len(texts) == 1 for texts in out)
    assert config.to_dict() == before  # the user's config is not changed by a call's settings
    kwargs = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True, "pad_token_id": tok.eos_token_id}
    plain = BestOfNSampler(policy, tok, word_count_score, LengthSampler(4, 16), sample_size=8, n_candidates=2)
    assert all(len(texts) == 2 for texts in plain.generate(QUERIES, **kwargs))
