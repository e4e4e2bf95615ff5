"""GRPOTrainer with TRL 1.x's ``tools`` and ``environment_factory`` (trl_lite.trainer.grpo.agents on run_episodes):
a tool called from a completion, its result in the conversation and out of the loss (the response mask against the
chat template's own rendering, the update against a float64 gradient of the masked loss), what the reward functions
see, TRL's ``tools/*`` metrics, an environment_factory trained end to end with ``.train()`` (with and without a
dataset, ``get_reward`` as a reward source), a bit-identical resume, and every bad argument refused before any
state changes.

The models are test_agents' successor GPT-2s: greedy (or, at full scale, near-certain) turns are known in advance;
softened (``scale=0.16``) they sample, and call the tool in some completions only.
"""

import pytest
import torch
from datasets import Dataset
from test_agents import CALLS, TOKENIZER, add, expected_layout, make_chat_tokenizer, render_ids, successor_model, turn
from transformers.utils import get_json_schema

from trl_lite import GRPOConfig, GRPOTrainer

ADD_TURN = turn("<tool_call>", CALLS["add"], "</tool_call>")
INCREMENT_TURN = turn("<tool_call>", CALLS["increment"], "</tool_call>")
PROMPTS = [[{"role": "user", "content": "add 2 and 3"}], [{"role": "user", "content": "add 4 and 5"}]]

def config(tmp_path, **overrides) -> GRPOConfig:
    """2 prompts x 4 completions of at most 40 tokens a generation, one optimizer step each."""
    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=40,
                  max_steps=2, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                  disable_tqdm=True, seed=3, max_tool_calling_iterations=1)  # fmt: skip
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)

def dataset(**columns) -> Dataset:
    return Dataset.from_dict({"prompt": PROMPTS, **columns})

def even_ids(prompts, completions, completion_ids, **kwargs):
    """The share of even token ids: varies within the groups of a sampling model."""
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]

class Spy:
    """Records what each reward function call got, and each step() call's inputs."""

    def __init__(self, trainer=None):
        self.rewards, self.steps = [], []
        if trainer is not None:
            step = trainer.ppo.step

            def recorded(*args, **kwargs):
                self.steps.append((args, kwargs))
                return step(*args, **kwargs)

            trainer.ppo.step = recorded

    def reward(self, prompts, completions, completion_ids, **kwargs):
        self.rewards.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs))
        return [1.0] * len(prompts)

class Counter:
    """A TRL-style environment: ``increment`` is its tool, ``get_reward`` its reward, the start from the row."""

    def reset(self, start: int = 0, **row) -> str:
        self.count = start
        return f" (start at {start})"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count)

def environment_trainer(output_dir, **overrides) -> GRPOTrainer:
    """A sampling model calling Counter's tool in some completions, 3 optimizer steps with a checkpoint each (the
    resume tests, test_grpo_trainer_resume.py, in this process and in a killed one)."""
    model = successor_model(INCREMENT_TURN, scale=0.16, seed=1)
    kwargs = dict(max_steps=3, save_strategy="steps", save_steps=1, max_completion_length=24)
    args = config(output_dir, **{**kwargs, **overrides})
    return GRPOTrainer(model, reward_funcs=[even_ids], args=args, train_dataset=dataset(start=[3, 1]),
                       processing_class=make_chat_tokenizer(), environment_factory=Counter)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Tools
# ----------------------------------------------------------------------------------------------

def test_a_tool_call_runs_its_result_joins_the_conversation_and_is_out_of_the_loss(tmp_path):
    spy = Spy()
    trainer = GRPOTrainer(successor_model(ADD_TURN), reward_funcs=[spy.reward], args=config(tmp_path, max_steps=1),
                          train_dataset=dataset(target=[5, 9]), processing_class=make_chat_tokenizer(), tools=[add])  # fmt: skip
    steps = Spy(trainer).steps
    trainer.train()
    (seen,) = spy.rewards
    schema = [get_json_schema(add)]
    # every completion: the call, add's result as a tool message, the call again (TRL: not run after the last round)
    call = {"role": "assistant", "content": f"<tool_call>{CALLS['add']}</tool_call>"}
    assert seen["completions"][0] == [call, {"role": "tool", "name": "add", "content": "5"}, call]
    assert sorted(map(str, seen["prompts"])) == sorted(map(str, [p for p in PROMPTS for _ in range(4)]))
    assert seen["target"] == [5] * 4 + [9] * 4 or seen["target"] == [9] * 4 + [5] * 4
    (args, kwargs) = steps[0]
    queries, responses = args[0], args[1]
    for i, (query, response, mask) in enumerate(zip(queries, responses, kwargs["response_masks"])):
        assert seen["completion_ids"][i] == response.tolist()  # tool tokens included, as TRL's completion_ids
        assert query.tolist() == render_ids(seen["prompts"][i], schema, True)  # the schema reaches the model
        episode = type("E", (), {"messages": seen["prompts"][i] + seen["completions"][i]})
        want_response, want_mask = expected_layout(episode, schema)  # the template's rendering, all at once
        assert response.tolist() == want_response and mask.tolist() == want_mask
        hole = TOKENIZER.decode(response[mask == 0])
        assert hole == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert kwargs["group_ids"] == [0, 0, 0, 0, 1, 1, 1, 1]
    logs = trainer.state.log_history[0]
    assert logs["tools/call_frequency"] == 1.0 and logs["tools/failure_frequency"] == 0.0
    assert logs["completions/mean_length"] == 8.0  # the model's tokens only (two turns of 4), as TRL
    assert logs["completions/clipped_ratio"] == 0.0

def test_failed_calls_are_counted_and_no_limit_runs_until_the_token_budget(tmp_path):
    def subtract(a: int, b: int) -> int:
        """Subtract.

        Args:
            a: first
            b: second
        """
        raise RuntimeError("never called")

    spy = Spy()
    model = successor_model(turn("<tool_call>", CALLS["raises"], "</tool_call>"))

    def divide(a: int, b: int) -> float:
        """Divide a by b.

        Args:
            a: the dividend
            b: the divisor
        """
        return a / b

    trainer = GRPOTrainer(model, reward_funcs=[spy.reward], processing_class=make_chat_tokenizer(),
                          args=config(tmp_path, max_steps=1, max_tool_calling_iterations=None, max_completion_length=200),
                          train_dataset=dataset(), tools=[divide, subtract])  # fmt: skip
    trainer.train()
    completion = spy.rewards[0]["completions"][0]
    tool_messages = [m for m in completion if m["role"] == "tool"]
    assert tool_messages and all(m["content"] == "{'error': 'division by zero'}" for m in tool_messages)
    logs = trainer.state.log_history[0]
    assert logs["tools/failure_frequency"] == 1.0
    assert logs["tools/call_frequency"] == len(tool_messages)  # the same in every completion
    assert len(tool_messages) > 2  # no iteration limit: only max_completion_length (200 tokens) ended it
    assert 200 - 30 < max(len(ids) for ids in spy.rewards[0]["completion_ids"]) <= 200

def test_the_update_equals_a_float64_gradient_of_the_loss_over_the_models_tokens_only(tmp_path):
    model = successor_model(ADD_TURN, scale=0.12, seed=1)
    model64 = successor_model({}).double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    spy = Spy()

    def reward(prompts, completions, completion_ids, **kwargs):
        spy.reward(prompts, completions, completion_ids, **kwargs)
        return even_ids(prompts, completions, completion_ids)

    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    args = config(tmp_path, max_steps=1, loss_type="dapo", scale_rewards="none", max_grad_norm=0.0,
                  max_completion_length=48, max_tool_calling_iterations=2)  # fmt: skip
    trainer = GRPOTrainer(model, reward_funcs=[reward], args=args, train_dataset=dataset(), optimizers=(sgd, None),
                          processing_class=make_chat_tokenizer(), tools=[add])  # fmt: skip
    steps = Spy(trainer).steps
    trainer.train()
    (positional, kwargs) = steps[0]
    queries, responses, scores = positional
    masks = kwargs["response_masks"]
    assert any(bool((m == 0).any()) for m in masks)  # some completions called the tool: tool tokens to skip
    rewards = torch.tensor([float(s) for s in scores], dtype=torch.float64)
    advantages = rewards - rewards.view(2, 4).mean(1).repeat_interleave(4)

    def reference_gradient(use_mask: bool) -> dict:
        model64.zero_grad()
        total, count = 0.0, 0
        for query, response, mask, advantage in zip(queries, responses, masks, advantages):
            sequence = torch.cat([query, response])
            logits = model64(input_ids=sequence[None]).logits[0, len(query) - 1 : -1]
            logps = torch.log_softmax(logits, -1).gather(1, response[:, None]).squeeze(1)
            weight = mask.double() if use_mask else torch.ones_like(logps)
            total = total - advantage * (logps * weight).sum()  # the ratio's gradient at ratio 1 is logp's
            count += int(weight.sum())
        (total / count).backward()
        return {k: p.grad.clone() for k, p in model64.named_parameters() if p.grad is not None}

    want = reference_gradient(use_mask=True)
    unmasked = reference_gradient(use_mask=False)
    after = dict(model.named_parameters())
    for name in ("lm_head.weight", "transformer.wte.weight"):
        got = (before[name] - after[name].detach()).double()  # SGD, lr 1: the gradient
        scale = want[name].abs().max()
        assert (got - want[name]).abs().max() < 1e-4 * scale + 1e-7, name
        assert (unmasked[name] - want[name]).abs().max() > 1e-2 * scale, name  # the mask matters here

# ----------------------------------------------------------------------------------------------
# environment_factory
# ----------------------------------------------------------------------------------------------

def test_an_environment_factory_trains_end_to_end_with_get_reward_as_a_reward_source(tmp_path):
    spy = Spy()
    made = []

    def factory():
        made.append(Counter())
        return made[-1]

    model = successor_model(INCREMENT_TURN, scale=0.1, seed=2)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = GRPOTrainer(model, reward_funcs=[spy.reward], args=config(tmp_path, max_steps=2, reward_weights=[0.5]),
                          train_dataset=dataset(start=[10, 0]), processing_class=make_chat_tokenizer(),
                          environment_factory=factory)  # fmt: skip
    assert trainer.reward_func_names == ["reward", "Counter"] and len(made) == 1  # one probe instance
    assert trainer.reward_funcs.weights.tolist() == [0.5, 1.0]
    output = trainer.train()
    assert output.global_step == 2 and len(made) == 1 + 2 * 8  # one fresh environment per completion
    seen = spy.rewards[0]
    environments = seen["environments"]
    assert [type(e) for e in environments] == [Counter] * 8 and len({id(e) for e in environments}) == 8
    for prompt, completion, environment in zip(seen["prompts"], seen["completions"], environments):
        start = int(prompt[-1]["content"].split("start at ")[1].rstrip(")"))  # reset's text joins the prompt
        counts = [int(m["content"]) for m in completion if m["role"] == "tool" and m["content"].isdigit()]
        assert environment.count == (counts[-1] if counts else start)  # the tool's results are its state
    logs = trainer.state.log_history
    counts = [e.count for e in environments]
    assert logs[0]["rewards/Counter/mean"] == pytest.approx(sum(counts) / 8)
    assert logs[0]["reward"] == pytest.approx(0.5 + sum(counts) / 8)  # 0.5 x 1.0 + get_reward
    assert "tools/call_frequency" in logs[0] and "tools/failure_frequency" in logs[0]
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())

def test_without_a_dataset_the_environment_writes_the_task_and_owns_the_reward(tmp_path):
    class Task(Counter):
        def reset(self, **row) -> str:
            assert row == {"prompt": [{"role": "user", "content": ""}]}
            self.count = 0
            return "add to the counter"

    trainer = GRPOTrainer(successor_model(INCREMENT_TURN), args=config(tmp_path, max_steps=1),
                          processing_class=make_chat_tokenizer(), environment_factory=Task)  # fmt: skip
    trainer.train()
    logs = trainer.state.log_history[0]
    assert trainer.reward_func_names == ["Task"] and logs["rewards/Task/mean"] == 2.0  # one increment(by=2)
    with pytest.raises(ValueError, match="max_steps must be > 0"):
        GRPOTrainer(successor_model(INCREMENT_TURN), args=config(tmp_path, max_steps=-1, num_train_epochs=1),
                    processing_class=make_chat_tokenizer(), environment_factory=Task)  # fmt: skip

def test_a_dict_factory_routes_each_row_by_its_environment_column_and_evaluate_plays_episodes_too(tmp_path, capsys):
    class Adder(Counter):
        def get_reward(self) -> float:
            return 100.0 + self.count

    spy = Spy()
    rows = Dataset.from_dict({"prompt": PROMPTS, "environment": ["count", "add"], "start": [1, 2]})
    trainer = GRPOTrainer(successor_model(INCREMENT_TURN), reward_funcs=[spy.reward],
                          args=config(tmp_path, max_steps=1, log_completions=True), train_dataset=rows, eval_dataset=rows,
                          processing_class=make_chat_tokenizer(), environment_factory={"count": Counter, "add": Adder})  # fmt: skip
    assert trainer.reward_func_names == ["reward", "Counter", "Adder"]
    trainer.train()
    seen = spy.rewards[0]
    for name, environment in zip(seen["environment"], seen["environments"]):
        assert type(environment) is {"count": Counter, "add": Adder}[name]
        assert environment.count == {"count": 1, "add": 2}[name] + 2  # reset got the row's start (not 'environment')
    logs = trainer.state.log_history[0]
    assert logs["rewards/Counter/mean"] == 3.0 and logs["rewards/Adder/mean"] == 104.0  # each scores its own rows
    assert logs["reward"] == pytest.approx(1.0 + (3.0 + 104.0) / 2)
    assert "tool: 3" in capsys.readouterr().out  # log_completions prints the conversation
    results = trainer.evaluate()
    assert results["eval_tools/call_frequency"] == 1.0 and results["eval_rewards/Adder/mean"] == 104.0


# ----------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------

def no_hints(a, b):
    """Add.

    Args:
        a: first
        b: second
    """
    return a + b

class NoReset:
    def increment(self, by: int) -> int:
        """Add.

        Args:
            by: how much
        """
        return by

class UntypedMethod(Counter):
    def decrement(self, by):
        """Subtract.

        Args:
            by: how much
        """
        return by

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(tools=[add, "add"]), TypeError, r"tools\[1\] must be a function"),
    (dict(tools=add), TypeError, "tools must be a list"),
    (dict(tools=[no_hints]), ValueError, r"tools\[0\] \(no_hints\) needs a JSON schema"),
    (dict(environment_factory=NoReset), TypeError, r"environment_factory\(\)'s product \(NoReset\) has no reset"),
    (dict(environment_factory=UntypedMethod), ValueError, r"environment_factory\(\)'s method 'decrement' needs a JSON"),
    (dict(environment_factory={"a": Counter, "b": 3}), TypeError, r"environment_factory\['b'\] must be callable"),
    (dict(environment_factory=42), TypeError, "environment_factory must be callable"),
    (dict(tools=[add], processing_class="plain"), ValueError, "chat_template ignores tools"),
    (dict(tools=[add], train_dataset=Dataset.from_dict({"prompt": ["add 2 and 3", "x"]})), ValueError,
     "need conversational prompts"),
    (dict(tools=[add], reward_funcs=None), ValueError, "reward_funcs is required"),
    (dict(tools=[add], args={"chat_template_kwargs": {"enable_thinking": False}}), ValueError,
     "chat_template_kwargs=.* is not supported with tools"),
])  # fmt: skip
def test_bad_tools_and_environments_are_refused_naming_the_argument_before_any_state_changes(tmp_path, kwargs, error, match):
    model = successor_model(ADD_TURN)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokenizer = make_chat_tokenizer()
    if kwargs.get("processing_class") == "plain":
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    kwargs = {"reward_funcs": [even_ids], "train_dataset": dataset(), **kwargs, "processing_class": tokenizer}
    args = config(tmp_path, **kwargs.pop("args", {}))
    with pytest.raises(error, match=match):
        GRPOTrainer(model, args=args, **kwargs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "checkpoint-1").exists()

def test_max_tool_calling_iterations_is_honoured_and_checked(tmp_path):
    assert config(tmp_path, max_tool_calling_iterations=3).max_tool_calling_iterations == 3
    with pytest.raises(ValueError, match="max_tool_calling_iterations must be None or an int >= 0, got -1"):
        GRPOTrainer(successor_model(ADD_TURN), reward_funcs=[even_ids], args=config(tmp_path, max_tool_calling_iterations=-1),
                    train_dataset=dataset(), processing_class=make_chat_tokenizer(), tools=[add])  # fmt: skip
