"""Prefix sharing: packed passes that run a prompt once for the rows that share it.

The shared layout must give what the unshared packed pass gives: each row's log-probs and values against
a float64 reference that runs the row alone, and the whole step's statistics and updated weights against
``prefix_sharing=False`` (float32, relative 1e-5), for GRPO, RLOO and GAE, with prompts of different
lengths in one batch and a group whose responses have very different lengths.
"""

import numpy as np
import pytest
import torch
from devices import assert_close
from test_packing import assert_rows_equal_rows_alone
from tiny_models import VOCAB_SIZE, make_gpt2, make_gpt2_critic, make_qwen2, make_qwen2_critic, make_tokenizer

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.core import LOSS_TYPES
from trl_lite.trainer.memory.prefix_sharing import PrefixSharing, epoch_order, obstacle, prompt_ids

COMPARED = ("objective/kl", "objective/entropy", "ppo/loss/policy", "ppo/loss/total", "ppo/policy/entropy",
            "ppo/policy/approxkl", "ppo/policy/policykl", "ppo/policy/clipfrac", "ppo/policy/advantages_mean")  # fmt: skip


def grouped_batch(seed: int, group: int = 4, prompts=(3, 11), response_len=(1, 9)):
    """Two groups of ``group`` rows (prompt lengths ``prompts``), each sharing a query, plus one row of its own;
    the last row of the first group has a 1-token response and the one before it a long one."""
    g = torch.Generator().manual_seed(seed)
    queries, responses = [], []
    for prompt in prompts:
        query = torch.randint(3, VOCAB_SIZE, (prompt,), generator=g)
        for _ in range(group):
            queries.append(query.clone())
            n = int(torch.randint(response_len[0], response_len[1] + 1, (1,), generator=g))
            responses.append(torch.randint(3, VOCAB_SIZE, (n,), generator=g))
    responses[group - 2] = torch.randint(3, VOCAB_SIZE, (23,), generator=g)
    responses[group - 1] = responses[group - 1][:1]
    scores = [torch.randn((), generator=g) for _ in queries]
    return queries, responses, scores


# Every exactness test runs on GPT-2 (absolute positions) and on a tiny Qwen2 (rotary positions, 4 query heads
# sharing 2 key/value heads): the shared layout's positions and attention must hold for both.
ARCHITECTURES = {
    "gpt2": (lambda: make_gpt2(seed=2), lambda: make_gpt2_critic(seed=3), ["c_attn"]),
    "qwen2": (lambda: make_qwen2(seed=2, heads=4, kv_heads=2), lambda: make_qwen2_critic(seed=3), ["q_proj", "v_proj"]),
}


def lora_policy(arch="gpt2"):
    from peft import LoraConfig

    make_policy, _, targets = ARCHITECTURES[arch]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")
    return AutoModelForCausalLMWithValueHead.from_pretrained(make_policy(), peft_config=lora)


def make_trainer(prefix_sharing, model_factory=None, critic=False, arch="gpt2", **config_kwargs):
    config_kwargs.setdefault("batch_size", 8)
    config_kwargs.setdefault("mini_batch_size", 8)
    config = PPOConfig(learning_rate=0.1, prefix_sharing=prefix_sharing, seed=3, **config_kwargs)
    make_policy, make_critic, _ = ARCHITECTURES[arch]
    model = model_factory(arch) if model_factory else AutoModelForCausalLMWithValueHead.from_pretrained(make_policy())
    # SGD, the critic's too: the update is the gradient itself (Adam would turn gradients that are float32 noise - the
    # key bias's, zero in exact arithmetic - into full-size steps of either sign).
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    trainer_kwargs = {}
    if critic:
        value_model = make_critic()
        trainer_kwargs = {"value_model": value_model,
                          "critic_optimizer": torch.optim.SGD(value_model.parameters(), lr=config.learning_rate)}
    return PPOTrainer(config, model, tokenizer=make_tokenizer(), optimizer=optimizer, **trainer_kwargs)


def test_prompt_ids_find_equal_queries():
    q = [torch.tensor([1, 2]), torch.tensor([1, 2, 3]), torch.tensor([1, 2]), torch.tensor([1, 3]), torch.tensor([1, 2, 3])]
    assert prompt_ids(q) == (0, 1, 0, 3, 1)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_shared_pass_gives_each_row_its_own_logprobs_and_values(arch):
    trainer = make_trainer(True, arch=arch)
    queries, responses, _ = grouped_batch(0)
    rows = trainer.forward.make_rows(queries, responses, None)
    assert rows.prompt_ids == (0, 0, 0, 0, 4, 4, 4, 4)
    seen = []
    hook = trainer.model.pretrained_model.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    logprobs, ref_logprobs, values, _ = trainer.experience_maker.passes(rows)
    hook.remove()
    # Each prompt once per pass: 3 + 11 prompt tokens plus every response.
    assert seen and all(shape == torch.Size([1, 3 + 11 + sum(len(r) for r in responses)]) for shape in seen)
    total = sum(len(q) + len(r) for q, r in zip(queries, responses))
    assert trainer.forward.prefix.take_saving() == pytest.approx(3 * (3 + 11) / total)
    assert_rows_equal_rows_alone(trainer.model, queries, responses, logprobs, ref_logprobs, values)


def _two_steps(prefix_sharing, **config_kwargs):
    trainer = make_trainer(prefix_sharing, **config_kwargs)
    stats = [trainer.step(*grouped_batch(seed)) for seed in range(2)]
    return trainer, stats, {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


VALUE_KEYS = ("ppo/loss/value", "ppo/val/vpred", "ppo/returns/mean", "ppo/val/clipfrac")
GRPO = dict(advantage_estimator="grpo", num_samples_per_query=4)
CASES = {
    "grpo": GRPO,
    "rloo": dict(advantage_estimator="rloo", num_samples_per_query=4, ppo_epochs=2, mini_batch_size=4),
    "gae": dict(ppo_epochs=2),
    **{
        f"grpo-{loss}": dict(GRPO, loss_type=loss, max_response_length=32, ppo_epochs=2, mini_batch_size=4)
        for loss in LOSS_TYPES
    },
    "grpo-full-kl-in-loss-entropy": dict(GRPO, init_kl_coef=0.1, kl_penalty="full", entropy_coef=0.01),
    "gae-chunked-head": dict(ppo_epochs=2, lm_head_chunk_size=5),
    "gae-separate-critic": dict(critic=True, ppo_epochs=2),
    "gae-lora": dict(model_factory=lora_policy, ppo_epochs=2),
    "gae-gradient-checkpointing": dict(gradient_checkpointing=True, ppo_epochs=2, mini_batch_size=4),
    "grpo-token-budget": dict(GRPO, max_tokens_per_minibatch=40, ppo_epochs=2),
    "grpo-shuffle-by-prompt": dict(GRPO, shuffle_by_prompt=True, ppo_epochs=2, mini_batch_size=4),
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("name", list(CASES))
def test_step_with_shared_prompts_equals_the_unshared_step(name, arch):
    shared, shared_stats, shared_weights = _two_steps(True, arch=arch, **CASES[name])
    # The shared steps' epochs keep groups whole by default (shuffle_by_prompt None: True for a group estimator
    # whose training passes share): the unshared steps are given that order.
    plain_case = {"shuffle_by_prompt": shared.config.critic_free, **CASES[name]}
    plain, plain_stats, plain_weights = _two_steps(False, arch=arch, **plain_case)
    # With shuffle_by_prompt, mini-batches of 4 hold whole groups of 4.
    whole_groups = shared.config.mini_batch_size == 8 or plain.config.shuffle_by_prompt
    whole_batch_passes = whole_groups and shared.config.max_tokens_per_minibatch is None
    for seed, (got, want) in enumerate(zip(shared_stats, plain_stats)):
        assert got["prefix_sharing/tokens_saved_fraction"] > 0.1
        if whole_batch_passes:  # every pass (rollout and training, critic included) ran each prompt once per group
            queries, responses, _ = grouped_batch(seed)
            total = sum(len(q) + len(r) for q, r in zip(queries, responses))
            assert got["prefix_sharing/tokens_saved_fraction"] == pytest.approx(3 * (3 + 11) / total)
        assert want["prefix_sharing/tokens_saved_fraction"] == 0.0
        value_keys = () if shared.config.critic_free else VALUE_KEYS
        for key in COMPARED + value_keys:
            if key not in want:
                continue
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    model_factory = CASES[name].get("model_factory")
    initial = {key: p.detach() for key, p in make_trainer(False, model_factory, arch=arch).model.named_parameters()}
    largest = max((weight - initial[key]).abs().max() for key, weight in plain_weights.items())
    assert largest > 1e-3
    for key, weight in plain_weights.items():
        # The updates agree to float32 rounding, relative to the largest step.
        assert_close(shared_weights[key] - initial[key], weight - initial[key], rtol=1e-5, atol=1e-5 * largest)


def test_prefix_sharing_is_checked():
    with pytest.raises(TypeError, match="prefix_sharing must be None \\(automatic\\), True or False, got 'yes'"):
        PPOConfig(batch_size=8, mini_batch_size=8, prefix_sharing="yes")
    with pytest.raises(ValueError, match="prefix_sharing=True needs passes that can share a prompt, but this trainer.s passes are padded"):
        make_trainer(True, padding_free=False)


def test_sequence_parallelism_refuses_prefix_sharing():
    why_not = obstacle(pack=True, encoder_decoder=False, cut=True, not_attending=[])
    with pytest.raises(ValueError, match="prefix_sharing=True needs .*sequence parallelism"):
        PrefixSharing(True, why_not)
    assert not PrefixSharing(None, why_not).on  # automatic: simply off there
    with pytest.raises(ValueError, match="the packed passes of the reference do not attend per row"):
        PrefixSharing(True, obstacle(True, False, False, ["reference"]))


def test_the_automatic_rule_shares_where_it_saves_tokens():
    trainer = make_trainer(None)
    # Groups of 4 over prompts of 3 and 11 tokens and short responses: 3 of every 4 prompts are saved.
    queries, responses, _ = grouped_batch(0)
    assert trainer.forward.make_rows(queries, responses).prompt_ids is not None
    # Pairs sharing 2-token prompts before 9-token responses: under a quarter of the tokens saved, so off.
    queries, responses, _ = grouped_batch(0, group=2, prompts=(2, 2, 2, 2), response_len=(9, 9))
    responses = [r[:9] for r in responses]
    assert prompt_ids(queries) == (0, 0, 2, 2, 4, 4, 6, 6)
    assert trainer.forward.make_rows(queries, responses).prompt_ids is None
    # prefix_sharing=True shares them all the same; False never looks.
    assert make_trainer(True).forward.make_rows(queries, responses).prompt_ids == (0, 0, 2, 2, 4, 4, 6, 6)
    assert make_trainer(False).forward.make_rows(*grouped_batch(0)[:2]).prompt_ids is None


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_token_budget_counts_each_prompt_once_per_pass(arch):
    # Exactness under the budget against prefix_sharing=False: the "grpo-token-budget" case above.
    widths = {}
    for sharing in (True, False):
        trainer = make_trainer(sharing, arch=arch, **GRPO, max_tokens_per_minibatch=40, ppo_epochs=2)
        seen = widths[sharing] = []
        trainer.model.pretrained_model.base_model.register_forward_pre_hook(
            lambda module, args, kwargs, seen=seen: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
        )
        trainer.step(*grouped_batch(0))
    # No row is over the budget (at most 3 + 23 tokens), so every pass runs at most 40 tokens, and with each
    # prompt counted once a pass holds more rows: fewer passes than the rows' prompt + response tokens allow.
    assert max(widths[True]) <= 40 and max(widths[False]) <= 40
    assert len(widths[True]) < len(widths[False])
    # The budget is what the passes run: every policy pass of the shared step (rollout and 2 epochs) is full
    # enough that no two of them would fit in one.
    assert min(a + b for a, b in zip(widths[True], widths[True][1:])) > 40


def test_budget_units_hold_a_prompts_rows_in_runs_that_fit():
    trainer = make_trainer(True, max_tokens_per_minibatch=40)
    queries, responses, _ = grouped_batch(0)
    rows = trainer.forward.make_rows(queries, responses)
    costs = [len(q) + len(r) for q, r in zip(queries, responses)]
    units, unit_costs = trainer.forward.prefix.units(list(range(8)), costs, rows, 40)
    assert sorted(i for unit in units for i in unit) == list(range(8)) and len(units) < 8
    for unit, cost in zip(units, unit_costs):
        assert len({len(queries[i]) for i in unit}) == 1 and all(torch.equal(queries[i], queries[unit[0]]) for i in unit)
        assert cost == len(queries[unit[0]]) + sum(len(responses[i]) for i in unit) <= 40
    # A process that must make more passes than it has runs (another process needs them): its rows one by one.
    assert trainer.forward.prefix.units(list(range(8)), costs, rows, 40, len(units) + 1) == ([[i] for i in range(8)], costs)


def test_an_epoch_shuffle_by_prompt_permutes_whole_groups():
    prompts = (0, 0, 2, 3, 0, 2, 6, 3)  # prompt_ids: rows of one prompt need not be adjacent in the batch
    orders = []
    for seed in range(20):
        torch.manual_seed(seed)
        order = epoch_order(8, prompts)
        assert sorted(order) == list(range(8))
        for rows in ([0, 1, 4], [2, 5], [3, 7], [6]):  # each prompt's rows follow one another, in batch order
            at = order.index(rows[0])
            assert order[at : at + len(rows)] == rows
        orders.append(tuple(order))
    assert len(set(orders)) > 10  # the groups' order is drawn: 4! = 24 orders
    # Without it (the default), the row shuffle the learner always drew: the same random stream, so a resumed
    # run takes the same orders as before this option existed.
    torch.manual_seed(5)
    want = torch.randperm(8).tolist()
    torch.manual_seed(5)
    assert epoch_order(8, None) == want


def test_shuffle_by_prompt_keeps_each_group_in_one_training_pass():
    # Mini-batches of 4 over two groups of 4: a row shuffle splits the groups over the passes, the prompt
    # shuffle keeps each group in one, so every training pass runs its prompt once.
    saved = {}
    for by_prompt in (False, True):
        trainer = make_trainer(True, **GRPO, mini_batch_size=4, ppo_epochs=4, shuffle_by_prompt=by_prompt)
        passes = saved[by_prompt] = []
        train = trainer.learner.train

        def count(experience, train=train, passes=passes, prefix=trainer.forward.prefix):
            prefix.take_saving()  # the rollout passes' count
            result = train(experience)
            passes.append(prefix.take_saving())
            return result

        trainer.learner.train = count
        torch.manual_seed(0)
        trainer.step(*grouped_batch(0))
    queries, responses, _ = grouped_batch(0)
    total = sum(len(q) + len(r) for q, r in zip(queries, responses))
    assert saved[True] == [pytest.approx(3 * (3 + 11) / total)]
    assert saved[False][0] < saved[True][0] - 0.05
