"""trl_lite.agents on the transformers engine: the token layout of multi-turn episodes against the chat
template's own rendering, the engine's log-probs against a float64 recomputation, tools (plain functions
and TRL-style environment methods), step environments, every tool fault sent back to the model, every
bad input refused before anything runs, truncation, and the rows, groups and statistics step() gets.

The models are hand-built "successor" GPT-2s: one layer whose block is the identity (its output
projections zero, no position embeddings), and an untied LM head whose row for token j is the
layer-normed embedding of the token that should precede j. Greedy decoding then follows a fixed
successor map (after the generation prompt's newline: a tool call, an answer, ...), so every episode
is known in advance. With the head scaled down the model samples, and mostly still follows the map.
The tokenizer is a byte-level BPE trained in memory with ChatML special tokens and a Hermes-style
Jinja chat template (tool schemas in a system turn, tool results as <tool_response> in a user turn).
"""

import json

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from transformers.utils import get_json_schema

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.agents import (
    ChatFormat,
    Episode,
    completions_columns,
    episode_stats,
    parse_tool_calls,
    run_episodes,
    step_inputs,
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CORPUS = [
    "user assistant system tool tools name arguments add guess higher lower correct 0 1 2 3 4 5 6 7 8 9",
    '{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}}}',
    "<tool_response> </tool_response> Call a tool as # Tools",
]
# Model outputs that must be one token each (the successor model cannot repeat a token with two successors).
CALLS = {
    "add": '{"name": "add", "arguments": {"a": 2, "b": 3}}',
    "add_string_arguments": '{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}',
    "increment": '{"name": "increment", "arguments": {"by": 2}}',
    "unknown": '{"name": "subtract", "arguments": {"a": 2}}',
    "not_json": '{"name": "add", "arguments": {a: 2}',
    "no_name": '{"arguments": {"a": 2, "b": 3}}',
    "wrong_type": '{"name": "add", "arguments": {"a": "two", "b": 3}}',
    "missing": '{"name": "add", "arguments": {"a": 2}}',
    "extra": '{"name": "add", "arguments": {"a": 2, "b": 3, "c": 4}}',
    "raises": '{"name": "divide", "arguments": {"a": 2, "b": 0}}',
    # Calls of test_agents_trl's environments (written in TRL's documented style).
    "increment_step": '{"name": "increment", "arguments": {"step": 2}}',
    "increment_float": '{"name": "increment", "arguments": {"step": 1.0}}',
    "describe": '{"name": "describe", "arguments": {}}',
    "helper": '{"name": "helper", "arguments": {}}',
}
WORDS = ["GUESS_FIVE", "HELLO"]
N_EMBD = 64  # vLLM's CPU attention needs a head size of at least 32: 2 heads of 32
N_POSITIONS = 1024


def make_chat_tokenizer(eos: str = "<|im_end|>") -> PreTrainedTokenizerFast:
    """The byte-level BPE chat tokenizer, with every CALLS body and WORDS entry as an added token."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(_CORPUS * 5, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.add_tokens(list(CALLS.values()) + WORDS)
    return tokenizer


TOKENIZER = make_chat_tokenizer()


def token(text: str) -> int:
    ids = TOKENIZER(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, f"{text!r} is {len(ids)} tokens"
    return ids[0]


def turn(*pieces: str) -> dict[int, int]:
    """The successor map of a model whose every turn is ``pieces`` then <|im_end|>; a turn starts after the
    generation prompt's newline."""
    chain = [token("\n"), *(token(p) for p in pieces), token("<|im_end|>")]
    return dict(zip(chain[:-1], chain[1:]))


GUESS_MODEL_TURN = turn("GUESS_FIVE")


def successor_model(successors: dict[int, int], scale: float = 1.0, n_positions: int = N_POSITIONS,
                    n_embd: int = N_EMBD, seed: int = 0) -> GPT2LMHeadModel:  # fmt: skip
    """A GPT-2 whose greedy next token after token i is ``successors[i]`` (see the module docstring);
    ``scale`` < 1 softens the head so that sampling sometimes leaves the map."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(TOKENIZER), n_positions=n_positions, n_embd=n_embd, n_layer=1, n_head=2,
        tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        eos_token_id=TOKENIZER.eos_token_id, pad_token_id=TOKENIZER.pad_token_id, bos_token_id=TOKENIZER.eos_token_id,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        block = model.transformer.h[0]
        for projection in (block.attn.c_proj, block.mlp.c_proj):
            projection.weight.zero_()
            projection.bias.zero_()
        model.transformer.wpe.weight.zero_()
        normed = F.layer_norm(model.transformer.wte.weight, (n_embd,), eps=model.transformer.ln_f.eps)
        head = torch.zeros_like(model.lm_head.weight)
        for before, after in successors.items():
            head[after] += normed[before]
        model.lm_head.weight.copy_(head * scale)
    return model


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


class GuessGame:
    """A step environment: guess the secret; "higher"/"lower" until right (reward 1)."""

    def reset(self, secret: int) -> str:
        self.secret = secret
        self.guesses = []
        return " between 1 and 9"

    def step(self, text: str):
        self.guesses.append(text)
        guess = 5 if text == "GUESS_FIVE" else int(text)
        if guess == self.secret:
            return "correct", 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False


class Counter:
    """A TRL-style environment: its public method is a tool, get_reward the episode's reward."""

    def reset(self, start: int = 0, **row) -> None:
        self.count = start

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


USER = [{"role": "user", "content": "add 2 and 3"}]


def make_trainer(model, batch_size=2, **config):
    """A PPOTrainer on ``model``: GRPO on the plain model, or PPO (GAE) with a value head by default."""
    options = dict(batch_size=batch_size, mini_batch_size=batch_size, ppo_epochs=1, learning_rate=1e-3, seed=0)
    options.update(config)
    if options.get("advantage_estimator", "gae") == "gae":
        model = AutoModelForCausalLMWithValueHead.from_pretrained(model)
    return PPOTrainer(PPOConfig(**options), model, tokenizer=TOKENIZER)


@pytest.fixture(scope="module")
def tool_trainer():
    return make_trainer(successor_model(turn("<tool_call>", CALLS["add"], "</tool_call>")))


def render_ids(messages, tools=None, generation_prompt=False) -> list[int]:
    return TOKENIZER.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt)["input_ids"]


def expected_layout(episode: Episode, tools=None) -> tuple[list[int], list[int]]:
    """The response and mask the template gives: the whole conversation (the trailing answers of a turn cut
    by max_turns left out) rendered and tokenized at once, cut after the last assistant turn's <|im_end|>;
    mask 1 from each assistant turn's generation prompt to its <|im_end|>."""
    messages = list(episode.messages)
    while messages[-1]["role"] != "assistant":
        messages.pop()
    query = render_ids(messages[:1] if messages[0]["role"] == "user" else messages[:2], tools, True)
    full = render_ids(messages, tools)
    full = full[: len(full) - full[::-1].index(TOKENIZER.eos_token_id)]
    mask = [0] * len(full)
    for j, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(render_ids(messages[:j], tools, True))
            end = len(render_ids(messages[: j + 1], tools))
            end = start + render_ids(messages[: j + 1], tools)[start:end].index(TOKENIZER.eos_token_id) + 1
            mask[start:end] = [1] * (end - start)
    return full[len(query) :], mask[len(query) :]


# ----------------------------------------------------------------------------------------------
# Token layout
# ----------------------------------------------------------------------------------------------


def test_tool_episode_layout_is_the_templates_rendering_with_the_mask_on_model_tokens(tool_trainer):
    episodes = run_episodes(tool_trainer, [USER], tools=[add], max_turns=3, max_new_tokens=8, do_sample=False)
    (episode,) = episodes
    tools = [get_json_schema(add)]
    assert episode.query.tolist() == render_ids(USER, tools, True)
    assert episode.num_turns == 3 and episode.tool_calls == 2 and episode.tool_errors == 0
    assert episode.truncated and episode.reward is None  # still calling after max_turns; no environment
    # As in TRL, the calls of the last turn are not run.
    assert [m["role"] for m in episode.messages] == ["user"] + ["assistant", "tool"] * 2 + ["assistant"]
    assert [m["content"] for m in episode.messages[2::2]] == ["5", "5"]
    model_turn = [token("<tool_call>"), token(CALLS["add"]), token("</tool_call>"), token("<|im_end|>")]
    assert episode.response.tolist()[:4] == model_turn and episode.response.tolist()[-4:] == model_turn
    response, mask = expected_layout(episode, tools)
    assert episode.response.tolist() == response  # the model's tokens as sampled, the rest as rendered
    assert episode.response_mask.tolist() == mask
    assert episode.response_mask.sum() == 3 * len(model_turn)
    # The tokens between two model turns are the template's tool turn and generation prompt, nothing else.
    second_turn = episode.response_mask.tolist().index(1, 4)
    hole = episode.response[4:second_turn].tolist()
    rendered = TOKENIZER.decode(hole)
    assert rendered == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert episode.logprobs.shape == episode.response.shape and (episode.logprobs[episode.response_mask == 0] == 0).all()


def test_logprobs_at_model_tokens_equal_a_float64_recomputation_and_step_takes_the_rows():
    model = successor_model(turn("<tool_call>", CALLS["add"], "</tool_call>"), scale=0.16, seed=1)
    trainer = make_trainer(model, batch_size=4, advantage_estimator="grpo", num_samples_per_query=2)
    model64 = successor_model({}, n_positions=N_POSITIONS).double().eval()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    prompts = [USER, [{"role": "user", "content": "add 4 and 5"}]]
    episodes = run_episodes(trainer, prompts, tools=[add], max_turns=3, num_generations=2, max_new_tokens=6,
                            do_sample=True, top_k=0)  # fmt: skip
    assert [e.prompt_index for e in episodes] == [0, 0, 1, 1]
    holes = 0
    worst = 0.0
    for episode in episodes:
        sequence = torch.cat([episode.query, episode.response])
        with torch.no_grad():
            logits = model64(input_ids=sequence[None]).logits[0, len(episode.query) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, episode.response[:, None]).squeeze(1)
        actions = episode.response_mask.bool()
        worst = max(worst, float((episode.logprobs.double() - expected)[actions].abs().max()))
        holes += int((~actions).sum())
        assert len(episode.query) + len(episode.response) <= N_POSITIONS
    assert worst < 1e-4
    assert holes > 0  # some episodes called the tool: there are template tokens to skip
    inputs = step_inputs(episodes)
    assert inputs["group_ids"] == [0, 0, 1, 1]
    stats = trainer.step(**inputs, scores=[torch.tensor(float(i % 2)) for i in range(4)])
    assert stats["rollout/logprob_diff/max"] < 1e-4  # the engine's log-probs are the policy's at every action
    assert stats["time/rollout/generate"] > 0 and stats["time/rollout/environment"] >= 0


# ----------------------------------------------------------------------------------------------
# Environments
# ----------------------------------------------------------------------------------------------


def test_step_environment_plays_until_done_and_sums_its_rewards():
    trainer = make_trainer(successor_model(turn("GUESS_FIVE")))
    prompts = [{"prompt": [{"role": "user", "content": "guess"}], "secret": s} for s in (5, 7)]
    right, wrong = run_episodes(trainer, prompts, environment_factory=GuessGame, max_turns=3, max_new_tokens=4)
    assert right.messages[0]["content"] == "guess between 1 and 9"  # reset's text joins the last user message
    assert right.query.tolist() == render_ids(right.messages[:1], generation_prompt=True)
    assert (right.num_turns, right.reward, right.truncated) == (1, 1.0, False)
    assert right.response.tolist() == [token("GUESS_FIVE"), token("<|im_end|>")]
    assert right.messages[-1] == {"role": "user", "content": "correct"}  # kept in the conversation, not in tokens
    assert (wrong.num_turns, wrong.reward, wrong.truncated) == (3, 0.0, True)
    assert wrong.environment.guesses == ["GUESS_FIVE"] * 3 and wrong.environment is not right.environment
    assert [m["content"] for m in wrong.messages[2::2]] == ["higher"] * 3
    response, mask = expected_layout(wrong)
    assert wrong.response.tolist() == response and wrong.response_mask.tolist() == mask
    assert right.tool_calls == wrong.tool_calls == 0


def test_trl_environment_methods_are_tools_and_get_reward_is_the_reward():
    trainer = make_trainer(successor_model(turn("<tool_call>", CALLS["increment"], "</tool_call>")))
    prompts = [{"prompt": USER, "start": 10}, {"prompt": USER, "start": 0}]
    episodes = run_episodes(trainer, prompts, environment_factory=Counter, max_turns=2, max_new_tokens=8)
    assert [e.reward for e in episodes] == [12.0, 2.0]  # one increment(by=2) from each start: turn 2's call is not run
    assert [m["content"] for m in episodes[0].messages if m["role"] == "tool"] == ["12"]
    tools = [get_json_schema(Counter().increment)]
    assert episodes[0].query.tolist() == render_ids(USER, tools, True)  # the method's schema reaches the model
    response, mask = expected_layout(episodes[0], tools)
    assert episodes[0].response.tolist() == response and episodes[0].response_mask.tolist() == mask


@pytest.mark.parametrize(
    ("call", "check", "expected"),
    [
        ("add_string_arguments", False, "5"),
        ("unknown", False, "{'error': 'Tool subtract not found.'}"),
        # No schema check by default: the tool runs with the arguments as given, Python's error goes back.
        ("wrong_type", False, """{'error': 'can only concatenate str (not "int") to str'}"""),
        ("missing", False, """{'error': "add() missing 1 required positional argument: 'b'"}"""),
        ("extra", False, """{'error': "add() got an unexpected keyword argument 'c'"}"""),
        ("raises", False, "{'error': 'division by zero'}"),
        ("wrong_type", True, """{'error': 'add: argument \\'a\\' must be integer, got "two".'}"""),
        ("missing", True, """{'error': "add: missing required argument(s) ['b']."}"""),
        ("extra", True, """{'error': "add: unknown argument(s) ['c']; the arguments are ['a', 'b']."}"""),
    ],
)
def test_every_tool_fault_goes_back_to_the_model_as_trls_error_and_is_counted(call, check, expected):
    trainer = make_trainer(successor_model(turn("<tool_call>", CALLS[call], "</tool_call>")))
    (episode,) = run_episodes(trainer, [USER], tools=[add, divide], max_turns=2, max_new_tokens=8,
                              check_tool_arguments=check)  # fmt: skip
    replies = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert replies == [expected]
    assert episode.num_turns == 2 and episode.tool_calls == 1  # the episode went on after the fault
    assert episode.tool_errors == (0 if call == "add_string_arguments" else 1)
    tools = [get_json_schema(add), get_json_schema(divide)]
    response, mask = expected_layout(episode, tools)
    assert episode.response.tolist() == response and episode.response_mask.tolist() == mask


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ("not_json", "{'error': 'the tool call is not valid JSON"),
        ("no_name", "{'error': 'the tool call has no tool name"),
        ("unclosed", "{'error': '<tool_call> without </tool_call>'}"),
    ],
)
def test_a_malformed_call_is_the_final_answer_or_with_answer_malformed_tool_calls_an_error(call, expected):
    pieces = ("<tool_call>", CALLS["add"]) if call == "unclosed" else ("<tool_call>", CALLS[call], "</tool_call>")
    trainer = make_trainer(successor_model(turn(*pieces)))
    (episode,) = run_episodes(trainer, [USER], tools=[add], max_turns=3, max_new_tokens=8)
    assert (episode.num_turns, episode.tool_calls, episode.tool_errors, episode.truncated) == (1, 0, 0, False)
    assert [m["role"] for m in episode.messages] == ["user", "assistant"]
    (episode,) = run_episodes(trainer, [USER], tools=[add], max_turns=3, max_new_tokens=8,
                              answer_malformed_tool_calls=True)  # fmt: skip
    assert (episode.num_turns, episode.tool_calls, episode.tool_errors, episode.truncated) == (3, 2, 2, True)
    assert episode.messages[2]["role"] == "tool" and episode.messages[2]["content"].startswith(expected)
    response, mask = expected_layout(episode, [get_json_schema(add)])
    assert episode.response.tolist() == response and episode.response_mask.tolist() == mask


def test_text_without_a_call_ends_the_episode():
    trainer = make_trainer(successor_model(turn("HELLO")))
    (episode,) = run_episodes(trainer, [USER], tools=[add], max_turns=3, max_new_tokens=8)
    assert (episode.num_turns, episode.tool_calls, episode.truncated) == (1, 0, False)
    assert episode.messages[-1] == {"role": "assistant", "content": "HELLO"}


def test_an_eos_other_than_the_end_of_turn_token_ends_the_episode():
    tokenizer = make_chat_tokenizer(eos="<|endoftext|>")
    model = successor_model(turn("<tool_call>", CALLS["add"], "</tool_call>"))
    with torch.no_grad():  # after </tool_call> the model writes <|endoftext|> instead of <|im_end|>
        model.lm_head.weight[token("<|endoftext|>")] = model.lm_head.weight[token("<|im_end|>")]
        model.lm_head.weight[token("<|im_end|>")] = 0
    trainer = PPOTrainer(PPOConfig(batch_size=1, mini_batch_size=1, advantage_estimator="grpo"), model, tokenizer=tokenizer)
    (episode,) = run_episodes(trainer, [USER], tools=[add], max_turns=3, max_new_tokens=8)
    assert episode.response[-1] == tokenizer.eos_token_id and episode.num_turns == 1
    assert episode.tool_calls == 0 and not episode.truncated


@pytest.mark.parametrize("where", ["reset", "step", "get_reward"])
def test_an_environment_that_raises_fails_the_call_naming_the_episode_and_prompt(where):
    class Broken(GuessGame):
        def reset(self, secret):
            if where == "reset" and secret == 7:
                raise KeyError("no secret")
            return super().reset(secret)

        def step(self, text):
            if where == "step":
                raise OSError("board lost")
            return super().step(text)

    if where == "get_reward":
        Broken = type("Broken", (Counter,), {"get_reward": lambda self: 1 / 0})
    trainer = make_trainer(successor_model(turn("<tool_call>", CALLS["increment"], "</tool_call>")))
    prompts = [{"prompt": USER, "secret": 5}, {"prompt": [{"role": "user", "content": "guess"}], "secret": 7}]
    if where == "get_reward":
        prompts = [{"prompt": USER}, {"prompt": [{"role": "user", "content": "guess"}]}]
    message = {
        "reset": "episode 1 of prompts\\[1\\] \\('guess'\\): the environment's reset\\(\\) raised KeyError",
        "step": "episode 0 of prompts\\[0\\] \\('add 2 and 3'\\): the environment's step\\(\\) raised OSError: board lost",
        "get_reward": "episode 0 of prompts\\[0\\] \\('add 2 and 3'\\): the environment's get_reward\\(\\) raised ZeroDiv",
    }[where]
    with pytest.raises(RuntimeError, match=message):
        run_episodes(trainer, prompts, environment_factory=Broken, max_turns=2, max_new_tokens=8)


@pytest.mark.parametrize(
    ("answer", "error", "message"),
    [
        (("higher", 0.0), TypeError, "must return \\(observation, reward, done\\)"),
        ((3, 0.0, False), TypeError, "observation must be a str or None, got int"),
        (("higher", "0", False), TypeError, "reward must be a finite number, got '0'"),
        (("higher", float("nan"), False), TypeError, "reward must be a finite number, got nan"),
        ((None, 0.0, False), ValueError, "done=False without an observation"),
    ],
)
def test_a_malformed_step_answer_is_refused(answer, error, message):
    class Bad(GuessGame):
        def step(self, text):
            return answer

    trainer = make_trainer(successor_model(turn("GUESS_FIVE")))
    with pytest.raises(error, match=message):
        run_episodes(trainer, [{"prompt": USER, "secret": 1}], environment_factory=Bad, max_new_tokens=4)


# ----------------------------------------------------------------------------------------------
# Truncation and lengths
# ----------------------------------------------------------------------------------------------


def test_max_episode_tokens_and_max_new_tokens_truncate(tool_trainer):
    # Room for the first turn (4 tokens) but not for the tool turn the template adds after it.
    (episode,) = run_episodes(tool_trainer, [USER], tools=[add], max_turns=4, max_episode_tokens=10, max_new_tokens=8)
    assert (episode.num_turns, episode.tool_calls, episode.truncated) == (1, 1, True)
    assert len(episode.response) == 4 and episode.response_mask.tolist() == [1, 1, 1, 1]
    assert episode.messages[-1]["role"] == "tool"  # the call ran; the model never reads its answer
    # A turn cut by the episode's room, or by max_new_tokens, is unfinished: the episode ends.
    for limits in ({"max_episode_tokens": 2, "max_new_tokens": 8}, {"max_new_tokens": 3}):
        (episode,) = run_episodes(tool_trainer, [USER], tools=[add], **limits)
        assert episode.response.tolist() == [token("<tool_call>"), token(CALLS["add"]), token("</tool_call>")][: len(episode.response)]
        assert episode.truncated and episode.tool_calls == 0 and episode.num_turns == 1
    (episode,) = run_episodes(tool_trainer, [USER], tools=[add], max_turns=3, max_episode_tokens=200, max_new_tokens=8)
    assert len(episode.response) <= 200 and episode.num_turns == 3


def test_the_context_length_is_never_exceeded():
    query_length = len(render_ids(USER, [get_json_schema(add)], True))
    model = successor_model(turn("<tool_call>", CALLS["add"], "</tool_call>"), n_positions=query_length + 40)
    trainer = make_trainer(model)
    (episode,) = run_episodes(trainer, [USER], tools=[add], max_turns=4, max_new_tokens=30)
    assert episode.truncated and episode.num_turns == 2  # a second tool turn would not fit after the second call
    assert len(episode.query) + len(episode.response) <= query_length + 40
    model = successor_model(turn("GUESS_FIVE"), n_positions=query_length + 5)
    trainer = make_trainer(model)
    (episode,) = run_episodes(trainer, [USER], tools=[add], max_new_tokens=30)  # 30 new tokens would not fit
    assert len(episode.query) + len(episode.response) <= query_length + 5 and episode.num_turns == 1
    long_prompt = [{"role": "user", "content": "add 2 and 3 " * 40}]
    with pytest.raises(ValueError, match="prompts\\[0\\] .* renders to [0-9]+ tokens; the engine's context length is"):
        run_episodes(trainer, [long_prompt], tools=[add], max_new_tokens=4)


# ----------------------------------------------------------------------------------------------
# Rows, groups, statistics
# ----------------------------------------------------------------------------------------------


def test_step_inputs_groups_and_statistics(tool_trainer):
    first = run_episodes(tool_trainer, [USER, USER], tools=[add], max_turns=2, num_generations=2, max_new_tokens=8,
                         do_sample=True)  # fmt: skip
    second = run_episodes(tool_trainer, [USER], tools=[add], max_turns=1, num_generations=2, max_new_tokens=8,
                          do_sample=True)  # fmt: skip
    inputs = step_inputs(first + second)
    assert inputs["group_ids"] == [0, 0, 1, 1, 2, 2]  # a group per prompt per call, never merged across calls
    assert [q.tolist() for q in inputs["queries"]] == [e.query.tolist() for e in first + second]
    assert inputs["response_masks"][0] is first[0].response_mask
    assert step_inputs(run_episodes(tool_trainer, [USER, USER], tools=[add], max_new_tokens=8))["group_ids"] is None
    stats = episode_stats(first + second)
    assert stats == {
        "env/turns/mean": 10 / 6, "env/turns/max": 2.0, "env/tool_calls/mean": 4 / 6,
        "env/tool_error_fraction": 0.0, "env/truncated_fraction": 1.0,
    }  # fmt: skip
    columns = completions_columns(second)
    assert columns["num_turns"] == [1, 1] and columns["truncated"] == [True, True]
    assert columns["conversation"][0].startswith("user: add 2 and 3\nassistant: <tool_call>")
    with pytest.raises(ValueError, match="episodes must be a non-empty list"):
        step_inputs([])
    with pytest.raises(TypeError, match="episodes\\[1\\] must be an Episode"):
        episode_stats([first[0], "x"])


def test_error_fraction_counts_failed_calls_over_calls():
    trainer = make_trainer(successor_model(turn("<tool_call>", CALLS["missing"], "</tool_call>")))
    failing = run_episodes(trainer, [USER], tools=[add], max_turns=2, max_new_tokens=8)
    trainer = make_trainer(successor_model(turn("<tool_call>", CALLS["add"], "</tool_call>")))
    working = run_episodes(trainer, [USER], tools=[add], max_turns=2, max_new_tokens=8)
    assert episode_stats(failing + working)["env/tool_error_fraction"] == 0.5


def test_completions_table_with_each_conversation_reaches_tensorboard(tmp_path):
    from test_completions_logging import table_rows, tensorboard_texts

    model = successor_model(turn("<tool_call>", CALLS["add"], "</tool_call>"))
    trainer = make_trainer(model, log_with="tensorboard", log_completions_every=1,
                           project_kwargs={"logging_dir": str(tmp_path)})  # fmt: skip
    episodes = run_episodes(trainer, [USER, USER], tools=[add], max_turns=2, max_new_tokens=8)
    scores = [torch.tensor(1.0), torch.tensor(0.0)]
    stats = trainer.step(**step_inputs(episodes), scores=scores)
    trainer.log_stats({**stats, **episode_stats(episodes)}, completions_columns(episodes), scores,
                      columns_to_log=("conversation", "num_turns"))  # fmt: skip
    trainer.accelerator.end_training()
    (text,) = [t for tag, entries in tensorboard_texts(tmp_path).items() for _, t in entries if tag.startswith("game_log")]
    assert text.split("\n")[0] == "| conversation | num_turns | reward |"
    rows = table_rows(text)
    assert [row[0] for row in rows] == [e.conversation for e in episodes] and [row[1] for row in rows] == ["2", "2"]


# ----------------------------------------------------------------------------------------------
# A bare engine
# ----------------------------------------------------------------------------------------------


def test_a_bare_engine_plays_the_same_episodes(tool_trainer):
    engine = tool_trainer.generation.engine
    on_trainer = run_episodes(tool_trainer, [USER], tools=[add], max_turns=2, max_new_tokens=8)
    on_engine = run_episodes(engine, [USER], tools=[add], max_turns=2, max_new_tokens=8, tokenizer=TOKENIZER)
    assert on_engine[0].response.tolist() == on_trainer[0].response.tolist()
    assert on_engine[0].response_mask.tolist() == on_trainer[0].response_mask.tolist()


# ----------------------------------------------------------------------------------------------
# Bad input: refused before any environment is made or anything generated
# ----------------------------------------------------------------------------------------------


def no_docstring(a: int) -> int:
    return a


class Clash(Counter):
    def add(self, a: int) -> int:
        """Clash with the add tool.

        Args:
            a: a number
        """
        return a


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"trainer": "model"}, TypeError, "trainer must be a PPOTrainer or a GenerationEngine .*, got str"),
        ({"prompts": []}, ValueError, "prompts must be a non-empty list"),
        ({"prompts": ["add 2 and 3"]}, TypeError, "prompts\\[0\\] must be a non-empty list of chat messages"),
        ({"prompts": [[{"role": "user"}]]}, TypeError, "prompts\\[0\\]\\[0\\] must be a chat message"),
        ({"prompts": [{"messages": USER}], "environment_factory": None}, ValueError,
         "prompts\\[0\\] is a dict without a 'prompt' key"),
        ({"tools": add}, TypeError, "tools must be a list of functions, got function"),
        ({"tools": [add, 3]}, TypeError, "tools\\[1\\] must be a function, got int"),
        ({"tools": [no_docstring]}, ValueError, "tools\\[0\\] \\(no_docstring\\) needs a JSON schema"),
        ({"tools": [add, add]}, ValueError, "tools\\[1\\] is named 'add' like an earlier tool"),
        ({"max_turns": 0}, ValueError, "max_turns must be an int >= 1, got 0"),
        ({"max_episode_tokens": 0}, ValueError, "max_episode_tokens must be an int >= 1 or None, got 0"),
        ({"num_generations": 1.5}, ValueError, "num_generations must be an int >= 1, got 1.5"),
        ({"batch_size": 0}, ValueError, "batch_size must be an int >= 1 or None, got 0"),
        ({"max_new_tokens": None}, ValueError, "needs max_new_tokens .* got None"),
        ({"num_return_sequences": 2}, ValueError, "sets num_return_sequences itself; .*use num_generations"),
        ({"max_length": 99}, ValueError, "sets max_length itself"),
        ({"num_generations": 2}, ValueError, "num_generations=2 with greedy decoding .* pass do_sample=True"),
        ({"environment_factory": 3}, TypeError, "environment_factory must be callable .* or a dict of them"),
        ({"environment_factory": {"counter": 3}}, TypeError, "environment_factory\\['counter'\\] must be callable"),
        ({"prompts": [{"prompt": USER, "environment": "chess"}], "environment_factory": {"counter": Counter}},
         ValueError, "prompts\\[0\\] has environment='chess', which names none .* one of \\['counter'\\]"),
        ({"prompts": [USER], "environment_factory": {"counter": Counter}}, ValueError,
         "prompts\\[0\\] has no 'environment' key, which names none"),
        ({"reward_weights": [1.0]}, ValueError, "reward_weights=\\[1.0\\] was given without reward_funcs"),
        ({"reward_funcs": [len, 3]}, TypeError, "reward_funcs\\[1\\] must be a function"),
        ({"reward_funcs": [len], "reward_weights": [1, 2]}, ValueError, "reward_weights must be a list of 1 finite"),
        ({"answer_malformed_tool_calls": 1}, TypeError, "answer_malformed_tool_calls must be a bool, got 1"),
        ({"check_tool_arguments": "yes"}, TypeError, "check_tool_arguments must be a bool, got 'yes'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tool_trainer, arguments, error, message):
    made = []

    def factory():
        made.append(1)
        return Counter()

    call = {"trainer": tool_trainer, "prompts": [USER], "tools": [add], "environment_factory": factory,
            "max_new_tokens": 8}  # fmt: skip
    call.update(arguments)
    if call["tools"] == [add] and "environment_factory" not in arguments:
        call["tools"] = None  # the environment's tool only
    with pytest.raises(error, match=message):
        run_episodes(call.pop("trainer"), call.pop("prompts"), **call)
    assert made == []


def test_environment_protocol_errors():
    trainer = make_trainer(successor_model(turn("GUESS_FIVE")))
    with pytest.raises(TypeError, match="environment_factory\\(\\) #0 \\(object\\) has no reset\\(\\) method"):
        run_episodes(trainer, [USER], environment_factory=object, max_new_tokens=4)
    with pytest.raises(ValueError, match="tools cannot be combined with a step environment"):
        run_episodes(trainer, [{"prompt": USER, "secret": 1}], tools=[add], environment_factory=GuessGame,
                     max_new_tokens=4)  # fmt: skip
    with pytest.raises(ValueError, match="the environment's method 'add' has the name of one of tools"):
        run_episodes(trainer, [USER], tools=[add], environment_factory=Clash, max_new_tokens=4)
    kinds = iter([Counter(), GuessGame()])
    with pytest.raises(TypeError, match="step environments and TRL-style ones in one call"):
        run_episodes(trainer, [USER, USER], environment_factory=lambda: next(kinds), max_new_tokens=4)

    with pytest.raises(TypeError, match="reset\\(\\) must return a str, a list of content blocks or None, got int"):
        run_episodes(trainer, [USER], environment_factory=type("R", (Counter,), {"reset": lambda self, **row: 3}),
                     max_new_tokens=4)  # fmt: skip


def test_templates_that_cannot_carry_an_episode_are_refused():
    model = successor_model(turn("<tool_call>", CALLS["add"], "</tool_call>"))
    trainer = make_trainer(model)
    plain = make_chat_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="has no chat_template"):
        run_episodes(trainer, [USER], tokenizer=plain, max_new_tokens=4)
    no_tools = make_chat_tokenizer()
    no_tools.chat_template = CHAT_TEMPLATE.replace("{%- if tools %}", "{%- if false %}")
    with pytest.raises(ValueError, match="ignores tools"):
        run_episodes(trainer, [USER], tools=[add], tokenizer=no_tools, max_new_tokens=4)
    open_ended = make_chat_tokenizer()
    open_ended.chat_template = CHAT_TEMPLATE.replace("message.content + '<|im_end|>\\n'", "message.content + '\\n'")
    with pytest.raises(ValueError, match="closes an assistant turn with '\\\\n', whose first token"):
        run_episodes(trainer, [USER], tokenizer=open_ended, max_new_tokens=4)
    # A template that drops earlier assistant turns' tool calls once the conversation goes on (as some
    # strip earlier reasoning) cannot be extended token by token.
    forgetful = make_chat_tokenizer()
    forgetful.chat_template = CHAT_TEMPLATE.replace(
        "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content",
        "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content if loop.last or message.role != "
        "'assistant' else '')",
    )
    with pytest.raises(ValueError, match="re-renders earlier turns when \\['tool'\\] messages follow them"):
        run_episodes(trainer, [USER], tools=[add], tokenizer=forgetful, max_turns=2, max_new_tokens=8)


def test_parse_tool_calls():
    text = 'I will add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> and <tool_call>{"name": "x"}</tool_call>'
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1}, None), ("x", {}, None)]
    assert parse_tool_calls("no call") == []
    assert parse_tool_calls('<tool_call>\n{"name": "a", "arguments": "{\\"b\\": 1}"}\n</tool_call>')[0].arguments == {"b": 1}
    (call,) = parse_tool_calls('<tool_call>{"name": "a", "arguments": [1]}</tool_call>')
    assert call.error == "the arguments of 'a' are not an object; expected {\"name\": \"<tool>\", \"arguments\": {...}}"
    assert parse_tool_calls("<tool_call>[1, 2]</tool_call>")[0].error.startswith("the tool call has no tool name")
    assert json.loads(CALLS["add"])["arguments"] == {"a": 2, "b": 3}


def test_chat_format_finds_the_end_of_turn_token():
    chat = ChatFormat(TOKENIZER, [get_json_schema(add)])
    assert chat.end_of_turn_id == token("<|im_end|>") and chat.end_of_turn_text == "<|im_end|>"
