"""Score shaping of the rollout and its diagnostics (docs/algorithm.md section 14): the pure functions of
``trl_lite.core.shaping`` against per-row Python references, and their place in ``step()``.

The last test launches 2 processes (tests/distributed/rollout_stats.py) to check the statistics'
reduction over processes and the gathered completions table.
"""

import math

import numpy as np
import pytest
import torch
from test_completions_logging import table_rows, tensorboard_texts
from test_distributed import SCRIPTS, launch
from tiny_models import make_gpt2, make_tokenizer, random_batch

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.core import (
    ends_with_stop,
    groups_with_equal_scores,
    missing_eos_penalty,
    overlong_penalty,
    shape_scores,
)
from trl_lite.trainer.step.statistics import resolve_stop_token_ids

EOS = 1  # the tiny tokenizer's <eos>


def reference_overlong(length: int, max_len: int, buffer: int, factor: float) -> float:
    """docs/algorithm.md section 14, case by case."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return (max_len - buffer - length) / buffer * factor
    return -factor


def reference_shaped(scores, responses, stop_ids, eos_penalty, max_len, buffer, factor) -> list:
    """Section 14 row by row in float64: the missing-EOS penalty, then the overlong penalty."""
    out = []
    for score, response in zip(scores, responses):
        value = float(score)
        if eos_penalty is not None and not (len(response) > 0 and int(response[-1]) in stop_ids):
            value -= eos_penalty
        if buffer is not None:
            value += reference_overlong(len(response), max_len, buffer, factor)
        out.append(value)
    return out


def responses_with_eos(batch_size, seed=0, every=2):
    """A random batch whose responses ``0, every, 2*every, ...`` end with <eos>."""
    queries, responses, scores = random_batch(batch_size, seed=seed)
    responses = [torch.cat([r[:-1], torch.tensor([EOS])]) if i % every == 0 else r for i, r in enumerate(responses)]
    return queries, responses, scores


# ---------------------------------------------------------------------------------------------
# The pure functions
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stop", [1, [1], [4, 7], (1, 9, 12)])
def test_ends_with_stop_matches_the_last_token_of_each_row(stop):
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, 14, (int(n),), generator=g) for n in torch.randint(0, 5, (60,), generator=g)]
    ids = {stop} if isinstance(stop, int) else set(stop)
    want = [len(r) > 0 and int(r[-1]) in ids for r in responses]
    assert any(want) and not all(want)
    got = ends_with_stop(responses, stop)
    assert got.dtype == torch.bool and got.tolist() == want


@pytest.mark.parametrize("bad", [[], "1", 1.0, [1, None], True])
def test_ends_with_stop_rejects_a_bad_stop_token_ids(bad):
    with pytest.raises(TypeError, match="stop_token_ids must be an int or a non-empty sequence of ints"):
        ends_with_stop([torch.tensor([1, 2])], bad)


def test_missing_eos_penalty_subtracts_where_the_row_has_no_eos():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(50, generator=g, dtype=torch.float64)
    ends = torch.rand(50, generator=g) < 0.4
    got = missing_eos_penalty(scores, ends, 0.75)
    want = [s - 0.75 if not e else s for s, e in zip(scores.tolist(), ends.tolist())]
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match=r"ends_with_eos must be a bool tensor of the scores' shape \(50,\)"):
        missing_eos_penalty(scores, ends.float(), 1.0)
    with pytest.raises(ValueError, match=r"got torch.bool of shape \(49,\)"):
        missing_eos_penalty(scores, ends[:-1], 1.0)


@pytest.mark.parametrize("max_len,buffer,factor", [(16, 4, 1.0), (10, 10, 0.5), (7, 1, 2.0), (32, 12, 0.0)])
def test_overlong_penalty_matches_the_piecewise_definition(max_len, buffer, factor):
    lengths = torch.arange(0, max_len + 6)
    got = overlong_penalty(lengths, max_len, buffer, factor)
    want = [reference_overlong(n, max_len, buffer, factor) for n in lengths.tolist()]
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-6, atol=1e-6)
    got64 = overlong_penalty(lengths.double(), max_len, buffer, factor)
    assert got64.dtype == torch.float64
    np.testing.assert_allclose(got64.numpy(), want, rtol=0, atol=1e-14)


@pytest.mark.parametrize(
    "buffer,factor,match",
    [(0, 1.0, r"buffer_len must be in \[1, max_response_length=8\], got 0"),
     (9, 1.0, r"buffer_len must be in \[1, max_response_length=8\], got 9"),
     (4, -0.1, "penalty_factor must be >= 0, got -0.1")],
)  # fmt: skip
def test_overlong_penalty_rejects_bad_parameters(buffer, factor, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty(torch.tensor([3]), 8, buffer, factor)


def test_shape_scores_applies_both_penalties_like_the_row_reference():
    g = torch.Generator().manual_seed(2)
    responses = [torch.randint(0, 6, (int(n),), generator=g) for n in torch.randint(1, 14, (40,), generator=g)]
    scores = torch.randn(40, generator=g, dtype=torch.float64)
    lengths = torch.tensor([len(r) for r in responses])
    ends = ends_with_stop(responses, [EOS, 5])
    got = shape_scores(scores, lengths, ends, 0.3, max_response_length=10, overlong_buffer_len=4,
                       overlong_penalty_factor=1.5)  # fmt: skip
    want = reference_shaped(scores, responses, {EOS, 5}, 0.3, 10, 4, 1.5)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-14)
    # With both penalties off the scores come back as they are.
    assert shape_scores(scores, lengths, None) is scores
    with pytest.raises(ValueError, match="missing_eos needs ends_with_eos"):
        shape_scores(scores, lengths, None, missing_eos=1.0)
    with pytest.raises(ValueError, match="overlong_buffer_len needs max_response_length"):
        shape_scores(scores, lengths, ends, overlong_buffer_len=2)


def test_groups_with_equal_scores_matches_a_brute_force_check():
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([7, 3, 7, 3, 11, 11, 11, 20, 20, 5, 5, 5])
    scores = torch.randint(0, 2, (12,), generator=g).double()
    scores[ids == 11] = 0.25  # one group certainly equal
    scores[9], scores[10] = 1.0, 0.0  # one certainly not
    want = [len({float(scores[i]) for i in range(12) if ids[i] == gid}) == 1 for gid in sorted(set(ids.tolist()))]
    assert any(want) and not all(want)
    assert groups_with_equal_scores(scores, ids).tolist() == want
    # The trainer's layout: ids dense in order of value, with their count (nothing read back on a GPU).
    values = sorted(set(ids.tolist()))
    dense = torch.tensor([values.index(i) for i in ids.tolist()])
    assert groups_with_equal_scores(scores, dense, num_groups=len(values)).tolist() == want
    with pytest.raises(ValueError, match=r"group_ids must hold one id per score, shape \(12,\), got \(11,\)"):
        groups_with_equal_scores(scores, ids[:-1])


def test_resolve_stop_token_ids_prefers_stop_token_id_then_tokenizer_then_model_config():
    class Holder:
        def __init__(self, eos):
            self.eos_token_id = eos

    assert resolve_stop_token_ids(9, Holder(1), Holder(2)) == (9,)
    assert resolve_stop_token_ids(None, Holder(1), Holder(2)) == (1,)
    assert resolve_stop_token_ids(None, Holder(None), Holder([2, 5])) == (2, 5)
    assert resolve_stop_token_ids(None, None, Holder(None)) == ()


# ---------------------------------------------------------------------------------------------
# In step()
# ---------------------------------------------------------------------------------------------
def make_trainer(batch_size=8, mini_batch_size=4, model=None, tokenizer=None, **config_kwargs):
    config_kwargs.setdefault("learning_rate", 1e-3)
    config_kwargs.setdefault("ppo_epochs", 1)
    config = PPOConfig(batch_size=batch_size, mini_batch_size=mini_batch_size, **config_kwargs)
    model = model if model is not None else AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    return PPOTrainer(config, model, tokenizer=tokenizer or make_tokenizer())


SHAPING = dict(missing_eos_penalty=0.5, max_response_length=8, overlong_buffer_len=4, overlong_penalty_factor=2.0)


def test_step_reports_the_mean_of_the_shaped_scores():
    queries, responses, scores = responses_with_eos(8, every=3)
    stats = make_trainer(**SHAPING).step(queries, responses, scores)
    want = reference_shaped(scores, responses, {EOS}, 0.5, 8, 4, 2.0)
    assert want != [float(s) for s in scores]
    assert stats["ppo/mean_scores"] == pytest.approx(np.mean(want), rel=1e-6, abs=1e-6)
    assert stats["ppo/std_scores"] == pytest.approx(np.std(want, ddof=1), rel=1e-5)


def test_shaping_comes_before_score_clipping():
    queries, responses, scores = responses_with_eos(8, every=2)
    stats = make_trainer(missing_eos_penalty=3.0, score_clip=1.0).step(queries, responses, scores)
    want = np.clip(reference_shaped(scores, responses, {EOS}, 3.0, None, None, 1.0), -1.0, 1.0)
    assert stats["ppo/mean_scores"] == pytest.approx(want.mean(), rel=1e-6, abs=1e-6)


def test_stop_token_id_replaces_the_tokenizers_eos():
    queries, responses, scores = random_batch(8, seed=4)
    stop = int(responses[0][-1])
    stats = make_trainer(missing_eos_penalty=1.0, stop_token_id=stop).step(queries, responses, scores)
    want = reference_shaped(scores, responses, {stop}, 1.0, None, None, 1.0)
    assert stats["ppo/mean_scores"] == pytest.approx(np.mean(want), rel=1e-6, abs=1e-6)
    assert stats["env/eos_fraction"] == pytest.approx(np.mean([int(r[-1]) == stop for r in responses]))


def test_rloo_advantages_see_the_shaped_scores():
    # With a zero KL coefficient an RLOO advantage is the shaped score minus its group's other mean.
    queries, responses, scores = responses_with_eos(8, seed=5, every=3)
    queries = [queries[(i // 4) * 4] for i in range(8)]
    trainer = make_trainer(model=make_gpt2(), advantage_estimator="rloo", num_samples_per_query=4,
                           init_kl_coef=0.0, adap_kl_ctrl=False, **SHAPING)  # fmt: skip
    stats = trainer.step(queries, responses, scores)
    shaped = reference_shaped(scores, responses, {EOS}, 0.5, 8, 4, 2.0)
    want = []
    for i, response in enumerate(responses):
        others = [shaped[j] for j in range((i // 4) * 4, (i // 4) * 4 + 4) if j != i]
        want += [shaped[i] - sum(others) / 3] * len(response)
    np.testing.assert_allclose(stats["ppo/policy/advantages"], want, rtol=1e-5, atol=1e-5)


def test_env_statistics_match_the_batch():
    queries, responses, scores = responses_with_eos(8, seed=6, every=4)
    stats = make_trainer().step(queries, responses, scores)
    lengths = [len(r) for r in responses]
    assert stats["env/response_length/mean"] == pytest.approx(sum(lengths) / 8)
    assert stats["env/response_length/min"] == min(lengths)
    assert stats["env/response_length/max"] == max(lengths)
    assert min(lengths) < max(lengths)
    assert stats["env/eos_fraction"] == pytest.approx(2 / 8)
    assert "env/frac_groups_zero_std" not in stats  # GAE has no groups


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_frac_groups_zero_std_counts_groups_with_equal_shaped_scores(estimator):
    queries, responses, _ = random_batch(8, seed=7)
    group_ids = [3, 9, 3, 9, 0, 0, 5, 5]
    for i, j in ((0, 2), (1, 3), (4, 5), (6, 7)):
        queries[j] = queries[i]
    # Groups 3 and 5 have equal raw scores; group 5's second row ends with EOS, so only group 3
    # stays equal once the missing-EOS penalty applies; groups 9 and 0 differ from the start.
    scores = [0.5, 1.0, 0.5, 2.0, -1.0, 1.0, 0.25, 0.25]
    responses = [r if i != 7 else torch.cat([r, torch.tensor([EOS])]) for i, r in enumerate(responses)]
    base = dict(model=make_gpt2(), advantage_estimator=estimator)
    plain = make_trainer(**base).step(queries, responses, [torch.tensor(s) for s in scores], group_ids=group_ids)
    assert plain["env/frac_groups_zero_std"] == pytest.approx(2 / 4)
    shaped = make_trainer(missing_eos_penalty=1.0, **base).step(
        queries, responses, [torch.tensor(s) for s in scores], group_ids=group_ids
    )
    assert shaped["env/frac_groups_zero_std"] == pytest.approx(1 / 4)


def test_penalties_that_never_bind_leave_the_step_unchanged():
    # Every response ends with EOS and is shorter than L_max - W: the shaped run is the default run.
    queries, responses, scores = random_batch(8, seed=8, response_len=(2, 3))
    responses = [torch.cat([r, torch.tensor([EOS])]) for r in responses]
    runs = []
    for kwargs in ({}, SHAPING):
        trainer = make_trainer(**kwargs)
        torch.manual_seed(11)
        stats = trainer.step(queries, responses, scores)
        runs.append((stats, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}))
    (stats_a, weights_a), (stats_b, weights_b) = runs
    for name, value in weights_a.items():
        assert torch.equal(value, weights_b[name]), name
    assert stats_a["ppo/mean_scores"] == stats_b["ppo/mean_scores"]
    assert stats_a["ppo/loss/total"] == stats_b["ppo/loss/total"]


def test_missing_eos_penalty_without_an_eos_id_raises_before_any_change():
    tokenizer = make_tokenizer()
    tokenizer.eos_token = None
    gpt2 = make_gpt2()
    gpt2.config.eos_token_id = None
    model = AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)
    # At construction ...
    with pytest.raises(ValueError, match="missing_eos_penalty=1.0 needs an EOS token id.*set stop_token_id"):
        make_trainer(model=model, tokenizer=tokenizer, missing_eos_penalty=1.0)
    # ... and in step() when the field was set afterwards.
    trainer = make_trainer(model=model, tokenizer=tokenizer, use_score_scaling=True)
    trainer.config.missing_eos_penalty = 1.0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match="missing_eos_penalty=1.0 needs an EOS token id.*set stop_token_id"):
        trainer.step(*random_batch(8))
    assert trainer.current_step == 0 and trainer.running.count == 0
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name
    # Without the penalty the step runs and reports no EOS fraction (there is no EOS to count).
    trainer.config.missing_eos_penalty = None
    stats = trainer.step(*random_batch(8))
    assert "env/eos_fraction" not in stats and math.isfinite(stats["env/response_length/mean"])


# ---------------------------------------------------------------------------------------------
# Over 2 processes
# ---------------------------------------------------------------------------------------------
@pytest.mark.xdist_group("distributed")
def test_statistics_and_completions_cover_the_rows_of_both_processes(tmp_path):
    launch("multi_gpu", SCRIPTS / "rollout_stats.py", "--output_dir", str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["stats"] == ranks[1]["stats"]
    stats = ranks[0]["stats"]
    lengths = ranks[0]["lengths"] + ranks[1]["lengths"]
    assert stats["env/response_length/min"] == min(lengths) == min(ranks[0]["lengths"])
    assert stats["env/response_length/max"] == max(lengths) == max(ranks[1]["lengths"])
    assert stats["env/response_length/mean"] == pytest.approx(np.mean(lengths))
    assert stats["env/eos_fraction"] == pytest.approx(np.mean(ranks[0]["ends_with_eos"] + ranks[1]["ends_with_eos"]))
    # Equal-score groups counted over all groups: 1 of 4 on rank 0, 2 of 2 on rank 1.
    equal = total = 0
    for rank in ranks:
        k, scores = rank["group"], rank["scores"]
        groups = [scores[i : i + k] for i in range(0, len(scores), k)]
        equal += sum(len(set(g)) == 1 for g in groups)
        total += len(groups)
    assert (equal, total) == (3, 6)
    assert stats["env/frac_groups_zero_std"] == pytest.approx(equal / total)
    # Rank 0's completions table holds the rows of both processes, in process order.
    texts = tensorboard_texts(tmp_path / "tb")
    ((_, [(step, text)]),) = [(t, v) for t, v in texts.items() if t.startswith("game_log")]
    rows = table_rows(text)
    assert step == 1 and [row[:2] for row in rows] == [[f"q{r}-{i}", f"r{r}-{i}"] for r in range(2) for i in range(8)]
    assert [float(row[2]) for row in rows] == ranks[0]["scores"] + ranks[1]["scores"]
