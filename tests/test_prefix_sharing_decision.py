"""Where prefix sharing runs: one decider (``trainer.forward.prefix``) for every step and pass.

- The out-of-memory back-off counts a pass as it ran (a shared prompt once) and never redoes an identical pass.
- Under dropout in train mode (``disable_dropout=False``) the automatic setting keeps the training passes unshared
  (a group would share one dropout mask over its prompt); ``True`` shares them and warns once.
- The automatic rule estimates the saving of the passes the step will run (their split and order), and a group
  estimator's epochs keep groups whole by default when the training passes share (``shuffle_by_prompt=None``).
- An attention layer that drops the row-lengths keyword reads the rows from the pass's mask on the CPU too.
"""

import inspect
import warnings

import pytest
import torch
from oom_injection import InjectedOutOfMemory
from test_packing import assert_rows_equal_rows_alone
from test_prefix_sharing import ARCHITECTURES, GRPO, grouped_batch, make_trainer
from tiny_models import VOCAB_SIZE, make_gpt2, make_tokenizer

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.models.packed_attention import ROW_LENGTHS
from trl_lite.trainer.memory.oom_backoff import next_budget
from trl_lite.trainer.step.forward import ForwardPass


# ------------------------------------------------------------------------------------------
# The back-off counts a pass as it runs
# ------------------------------------------------------------------------------------------
def _one_prompt_batch():
    """8 rows sharing one 100-token prompt, 10-token responses: 180 tokens shared, 880 unshared."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB_SIZE, (100,), generator=g)
    responses = [torch.randint(3, VOCAB_SIZE, (10,), generator=g) for _ in range(8)]
    return [prompt.clone() for _ in range(8)], responses, [torch.randn((), generator=g) for _ in range(8)]


def _backoff_trainer(sharing):
    config = PPOConfig(batch_size=8, mini_batch_size=8, ppo_epochs=1, learning_rate=0.1, seed=0,
                       advantage_estimator="grpo", num_samples_per_query=8, prefix_sharing=sharing)  # fmt: skip
    model = make_gpt2(seed=0)
    return PPOTrainer(config, model, tokenizer=make_tokenizer(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("sharing", [True, False])
def test_the_back_off_halves_the_pass_that_ran_and_never_redoes_it(sharing):
    trainer = _backoff_trainer(sharing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with InjectedOutOfMemory(trainer.model, max_tokens=150) as injected:  # a device that holds 150 tokens
            stats = trainer.step(*_one_prompt_batch())
    messages = [str(w.message) for w in caught if str(w.message).startswith("Out of memory")]
    if sharing:
        # The shared pass ran 100 + 8 x 10 tokens: the budget halves that, and no redo is the same pass again.
        assert injected.seen == [180] + [110] * 8
        assert messages == ["Out of memory in a pass of 180 tokens as it ran (token budget None): redoing it with "
                            "max_tokens_per_minibatch=90, kept for the rest of the run."]  # fmt: skip
    else:
        assert injected.seen == [880, 440, 220] + [110] * 8
        assert [m.split(" as it ran")[0] for m in messages] == [f"Out of memory in a pass of {n} tokens" for n in (880, 440, 220)]
    assert len(set(map(tuple, _runs(injected.seen)))) == len(_runs(injected.seen))  # no pass size tried twice in a row
    assert stats["memory/oom_retries"] == len(messages)
    # The step is the one without the failure.
    plain = _backoff_trainer(sharing)
    plain.step(*_one_prompt_batch())
    for (name, got), want in zip(trainer.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def _runs(seen):
    """The failed passes' sizes followed by the size that worked: each failure's tokens."""
    return [[n] for n in seen if n > 150]


def test_the_next_budget_is_below_the_pass_that_failed():
    assert next_budget(None, 180) == 90  # no budget: half the pass as it ran
    assert next_budget(1000, 600) == 500  # half the budget holds no pass like the failed one
    assert next_budget(1000, 400) == 200  # a pass of at most half the budget: half the pass instead
    assert next_budget(440, 180) == 90


# ------------------------------------------------------------------------------------------
# Dropout
# ------------------------------------------------------------------------------------------
def _dropout_policy(arch="gpt2"):
    return AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=2, dropout=0.1))


def _rollout_and_training_saving(trainer, seed=0):
    """The shares of tokens the rollout passes and the training passes of one step saved."""
    saved, train = [], trainer.learner.train

    def count(experience):
        saved.append(trainer.forward.prefix.take_saving())  # the rollout passes'
        result = train(experience)
        saved.append(trainer.forward.prefix.take_saving())
        return result

    trainer.learner.train = count
    trainer.step(*grouped_batch(seed))
    return saved


def _whole_groups_saving(seed=0):
    queries, responses, _ = grouped_batch(seed)
    return 3 * (3 + 11) / sum(len(q) + len(r) for q, r in zip(queries, responses))


@pytest.mark.parametrize("disable_dropout", [False, True])
def test_automatic_sharing_keeps_training_passes_unshared_under_dropout(disable_dropout):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(None, _dropout_policy, **GRPO, mini_batch_size=4, ppo_epochs=2,
                               disable_dropout=disable_dropout)  # fmt: skip
        rollout, training = _rollout_and_training_saving(trainer)
    assert not [w for w in caught if "prefix_sharing" in str(w.message)]  # the automatic setting does not warn
    assert rollout == pytest.approx(_whole_groups_saving())  # eval mode: no dropout, the rollout shares
    if disable_dropout:  # no dropout left: the training passes share, groups whole (shuffle_by_prompt automatic)
        assert training == pytest.approx(_whole_groups_saving())
    else:  # train mode draws dropout masks: each row its own, as unshared
        assert training == 0.0


def test_sharing_forced_under_dropout_warns_once_and_shares():
    with pytest.warns(UserWarning, match="prefix_sharing=True with dropout") as record:
        trainer = make_trainer(True, _dropout_policy, **GRPO, mini_batch_size=4, ppo_epochs=2, shuffle_by_prompt=True)
        rollout, training = _rollout_and_training_saving(trainer)
        trainer.step(*grouped_batch(1))
    assert sum("prefix_sharing=True with dropout" in str(w.message) for w in record) == 1
    assert rollout == training == pytest.approx(_whole_groups_saving())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(True, **GRPO)
    assert not [w for w in caught if "prefix_sharing" in str(w.message)]  # no dropout: no warning


# ------------------------------------------------------------------------------------------
# The automatic rule and the epoch order
# ------------------------------------------------------------------------------------------
def test_the_automatic_rule_counts_the_passes_the_step_runs():
    queries, responses, _ = grouped_batch(0)
    # GRPO, mini-batches of 4 in the automatic order (whole groups): every pass saves its group's prompt 3 times.
    trainer = make_trainer(None, **GRPO, mini_batch_size=4)
    rows = trainer.forward.make_rows(queries, responses)
    assert trainer.forward.prefix.estimated_saving(rows, (0,) * 4 + (4,) * 4) == pytest.approx(_whole_groups_saving())
    assert rows.prompt_ids is not None
    # The same batch in passes of one row (GAE, mini_batch_size 1): no pass holds two rows of a prompt, nothing is
    # saved, and the rule stays off - where the whole step taken as one pass would save over a quarter.
    trainer = make_trainer(None, batch_size=8, mini_batch_size=1)
    assert _whole_groups_saving() > 0.25
    rows = trainer.forward.make_rows(queries, responses)
    assert trainer.forward.prefix.estimated_saving(rows, (0,) * 4 + (4,) * 4) == 0.0
    assert rows.prompt_ids is None
    # GAE in passes of 2 rows from a row shuffle: the training passes save what random pairs of rows share.
    trainer = make_trainer(None, batch_size=8, mini_batch_size=2)
    estimate = trainer.forward.prefix.estimated_saving(trainer.forward.make_rows(queries, responses), (0,) * 4 + (4,) * 4)
    assert 0 < estimate < _whole_groups_saving()


def test_a_group_estimator_keeps_groups_whole_by_default_where_its_passes_share():
    prompts = {}
    for name, options in {
        "grpo": dict(GRPO, prefix_sharing=None),
        "grpo-unshared": dict(GRPO, prefix_sharing=False),
        "grpo-row-shuffle": dict(GRPO, prefix_sharing=None, shuffle_by_prompt=False),
        "gae": dict(prefix_sharing=None),
    }.items():
        trainer = make_trainer(options.pop("prefix_sharing"), **options, mini_batch_size=4, ppo_epochs=4)
        assert trainer.config.shuffle_by_prompt is options.get("shuffle_by_prompt")
        train = trainer.learner.train
        trainer.learner.train = lambda experience, train=train, name=name: (prompts.setdefault(name, experience.prompts), train(experience))[1]
        if name == "grpo":
            _, training = _rollout_and_training_saving(trainer)
            assert training == pytest.approx(_whole_groups_saving())  # every training pass runs whole groups
        else:
            trainer.step(*grouped_batch(0))
    assert prompts == {"grpo": (0,) * 4 + (4,) * 4, "grpo-unshared": None, "grpo-row-shuffle": None, "gae": None}


def test_the_forward_part_defaults_to_the_configs_automatic_sharing():
    default = inspect.signature(ForwardPass.__init__).parameters["prefix_sharing"].default
    assert default is None and PPOConfig(batch_size=8, mini_batch_size=8).prefix_sharing is None


# ------------------------------------------------------------------------------------------
# Row lengths on the CPU
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_attention_that_drops_the_row_lengths_still_attends_per_row(arch):
    trainer = make_trainer(True, arch=arch)
    for module in trainer.model.pretrained_model.modules():
        if type(module).__name__.endswith("Attention"):
            forward = module.forward
            module.forward = lambda *args, _forward=forward, **kwargs: _forward(
                *args, **{k: v for k, v in kwargs.items() if k != ROW_LENGTHS}
            )
    queries, responses, _ = grouped_batch(0)
    rows = trainer.forward.make_rows(queries, responses, None)
    assert rows.prompt_ids is not None
    logprobs, ref_logprobs, values, _ = trainer.experience_maker.passes(rows)
    assert_rows_equal_rows_alone(trainer.model, queries, responses, logprobs, ref_logprobs, values)
