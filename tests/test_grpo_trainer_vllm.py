"""GRPOTrainer with ``use_vllm=True`` (vllm_mode 'colocate', and 'server' on a ``python -m trl_lite.vllm_server``
subprocess; vLLM on the CPU): two generations of ``.train()`` through the engine. The second generation samples from
the weights the first update made (pushed once, before it), the engine's log-probs equal a float64 recomputation
with the weights each generation was sampled from and the trainer's own log-probs (TRL's ``sampling/*`` metrics),
and the logged metrics are those of the rows the engine returned. TRL's ``tools`` and ``environment_factory`` run their
multi-turn episodes on the colocated engine the same way (test_grpo_trainer_tools' successor models and Counter).

The tiny GPT-2 is 64 wide with 2 heads: vLLM's CPU attention needs a head size of at least 32.
"""

import copy

import pytest
import torch
from engine_checks import assert_sampled_rows_and_logprobs
from grpo_helpers import length_reward, trainer
from test_agents import add, make_chat_tokenizer, render_ids, successor_model
from test_grpo_trainer_tools import ADD_TURN, INCREMENT_TURN, Counter, Spy, even_ids
from test_grpo_trainer_tools import config as tools_config
from test_grpo_trainer_tools import dataset as tools_dataset
from test_vllm_server import launched_server
from tiny_models import make_gpt2
from transformers.utils import get_json_schema

from trl_lite import GRPOTrainer

import vllm  # noqa: F401  (a test dependency: without it this module fails, it is not skipped)

pytestmark = pytest.mark.xdist_group("vllm_engine")

EOS, K, NEW = 1, 4, 6
# The chat template's tokens between an assistant turn with a tool call and the next one, around the tool's answer.
TOOL_ANSWER = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_train_on_a_colocated_vllm_engine_samples_from_the_pushed_weights(tmp_path):
    _train_and_check(tmp_path, make_gpt2(seed=1, n_embd=64))


def test_train_on_a_vllm_server_samples_from_the_pushed_weights(tmp_path):
    lm = make_gpt2(seed=1, n_embd=64)
    lm.save_pretrained(tmp_path / "served")
    with launched_server(tmp_path / "served", tmp_path / "server.log", max_model_len=64) as (url, _):
        _train_and_check(tmp_path, lm, vllm_mode="server", vllm_server_base_url=url)


def train_recorded(grpo):
    """``grpo.train()`` with each step()'s ``(queries, responses, kwargs, policy it was sampled from, stats)`` and,
    per weight push, how many steps came before it; the engine is closed after."""
    ppo, steps, pushes = grpo.ppo, [], []
    step, push = ppo.step, ppo.generation.push

    def recording_step(queries, responses, scores, **kwargs):
        policy = copy.deepcopy(grpo.model).eval()  # the weights this generation was sampled from
        stats = step(queries, responses, scores, **kwargs)
        steps.append((queries, responses, kwargs, policy, stats))
        return stats

    def recording_push(named):
        pushes.append(len(steps))
        return push(named)

    ppo.step, ppo.generation.push = recording_step, recording_push
    try:
        grpo.train()
    finally:
        ppo.generation.close()
    return steps, pushes


def _train_and_check(tmp_path, lm, **vllm):
    """Two generations of ``.train()`` on the engine ``vllm`` configures; the checks of the module docstring."""
    grpo = trainer(tmp_path / "out", model=lm, reward_funcs=(length_reward,), max_steps=2, max_completion_length=NEW,
                   use_vllm=True, vllm_importance_sampling_mode="token_truncate", vllm_max_model_length=64,
                   gradient_checkpointing=False, **vllm)  # fmt: skip
    ppo = grpo.ppo
    assert ppo.config.use_vllm and ppo.config.importance_sampling_correction == "tis"
    assert ppo.config.vllm_mode == vllm.get("vllm_mode", "colocate")
    steps, pushes = train_recorded(grpo)
    assert len(steps) == 2 and pushes == [1]  # the first update pushed once, before the second generation
    steps = [(queries, responses, kwargs["generation_logprobs"], policy, stats)
             for queries, responses, kwargs, policy, stats in steps]  # fmt: skip
    for queries, responses, logprobs, policy, _ in steps:
        rows = [torch.cat([q, r]) for q, r in zip(queries, responses)]
        assert_sampled_rows_and_logprobs(rows, logprobs, policy, queries[::K], K, NEW, EOS)
    # the second generation's log-probs are the updated policy's, not the initial one's
    queries, responses, logprobs, _, _ = steps[1]
    initial = steps[0][3]
    rows = [torch.cat([q, r]) for q, r in zip(queries, responses)]
    with pytest.raises(AssertionError):
        assert_sampled_rows_and_logprobs(rows, logprobs, initial, queries[::K], K, NEW, EOS)

    # TRL's metrics: the engine's log-probs against the trainer's, and the completions the engine returned
    for (_, responses, _, _, stats), logged in zip(steps, grpo.state.log_history):
        assert logged["sampling/sampling_logp_difference/max"] == pytest.approx(stats["rollout/logprob_diff/max"])
        assert 0 <= logged["sampling/sampling_logp_difference/mean"] <= logged["sampling/sampling_logp_difference/max"] < 1e-4
        assert logged["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
        assert logged["completions/mean_length"] == pytest.approx(sum(len(r) for r in responses) / len(responses))
        lengths_reward = [0.1 * len(r) + sum(int(t) % 2 == 0 for t in r) / max(len(r), 1) for r in responses]
        assert logged["reward"] == pytest.approx(sum(lengths_reward) / len(responses), rel=1e-6)
    assert grpo.state.global_step == 2


@pytest.mark.parametrize("agents", ["tools", "environment"])
def test_tool_and_environment_episodes_train_on_a_colocated_vllm_engine(tmp_path, agents):
    """TRL's ``tools`` / ``environment_factory`` with ``use_vllm=True`` (colocate): two generations of episodes on the
    engine, the second on the weights the first update pushed; every completion's tokens and response mask are the chat
    template's own rendering of its messages, the engine's log-probs of the model's tokens equal a float64
    recomputation with the weights each generation was sampled from, and the tool metrics and the environments'
    rewards are those of the episodes the engine played."""
    # the head scaled so that about half the turns follow the tool-calling map (rewards differ within a group)
    lm = successor_model(ADD_TURN if agents == "tools" else INCREMENT_TURN, scale=0.12, seed=1)
    spy = Spy()
    args = tools_config(tmp_path, max_steps=2, use_vllm=True, vllm_max_model_length=512,
                        vllm_importance_sampling_mode="token_truncate", gradient_checkpointing=False)  # fmt: skip
    kwargs = {"tools": [add]} if agents == "tools" else {"environment_factory": Counter}
    grpo = GRPOTrainer(lm, reward_funcs=[spy.reward, even_ids], args=args, train_dataset=tools_dataset(start=[3, 1]),
                       processing_class=make_chat_tokenizer(), **kwargs)  # fmt: skip
    ppo = grpo.ppo
    assert ppo.config.use_vllm and ppo.config.importance_sampling_correction == "tis"
    steps, pushes = train_recorded(grpo)
    assert len(steps) == len(spy.rewards) == 2 and pushes == [1]
    schema = [get_json_schema(add if agents == "tools" else Counter().increment)]
    tokenizer, calls_per_generation, answered = make_chat_tokenizer(), [], 0
    for (queries, responses, kwargs, policy, _), seen, logged in zip(steps, spy.rewards, grpo.state.log_history):
        masks, logprobs = kwargs["response_masks"], kwargs["generation_logprobs"]
        policy64 = successor_model({}).double().eval()
        policy64.load_state_dict({k: v.double() for k, v in policy.state_dict().items()})
        calls = 0
        for i, (query, response, mask, row_logprobs) in enumerate(zip(queries, responses, masks, logprobs)):
            assert query.tolist() == render_ids(seen["prompts"][i], schema, True)
            # the tokens out of the loss are exactly the template's rendering of the tool's answers that the model read
            # (an answer that leaves no room for another model token ends the episode without its tokens)
            completion = seen["completions"][i]
            calls += sum(m["role"] == "tool" for m in completion)
            read = [m["content"] for m, after in zip(completion, completion[1:]) if m["role"] == "tool"]
            want_hole = "".join(TOOL_ANSWER.format(content) for content in read)
            answered += bool(read)
            assert tokenizer.decode(response[mask == 0]) == want_hole
            with torch.no_grad():
                logits = policy64(input_ids=torch.cat([query, response])[None]).logits[0, len(query) - 1 : -1]
            want = torch.log_softmax(logits, -1).gather(1, response[:, None]).squeeze(1)
            assert (row_logprobs.double() - want)[mask.bool()].abs().max() < 1e-4
        calls_per_generation.append(calls)
        assert logged["tools/call_frequency"] == pytest.approx(calls / 8)
        assert logged["sampling/sampling_logp_difference/max"] < 1e-4
        if agents == "environment":  # Counter's reward: its start plus what increment added
            got = [env.get_reward() for env in seen["environments"]]
            assert logged["rewards/Counter/mean"] == pytest.approx(sum(got) / 8)
    assert 0 < calls_per_generation[0] < 8  # some completions called the tool, some did not
    assert answered > 0  # and some read its answer: tool tokens out of the loss
    # the second generation was sampled from the updated weights: the first policy's log-probs differ
    queries, responses, kwargs, _, _ = steps[1]
    first64 = successor_model({}).double().eval()
    first64.load_state_dict({k: v.double() for k, v in steps[0][3].state_dict().items()})
    with torch.no_grad():
        logits = first64(input_ids=torch.cat([queries[0], responses[0]])[None]).logits[0, len(queries[0]) - 1 : -1]
    stale = torch.log_softmax(logits, -1).gather(1, responses[0][:, None]).squeeze(1)
    assert (kwargs["generation_logprobs"][0].double() - stale)[kwargs["response_masks"][0].bool()].abs().max() > 1e-4
