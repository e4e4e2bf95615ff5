"""TextEnvironment, TextHistory and StringStoppingCriteria with classic behaviour, on a tiny GPT-2.

End-to-end runs use real ``generate`` calls whose tokens are dictated by a logits processor (a
scripted policy), so the environment's parsing, tool calls, stopping, padding and masks are checked
on known transcripts.
"""

import pytest
import torch
from tiny_models import make_gpt2, make_tokenizer
from transformers import LogitsProcessor, LogitsProcessorList

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, TextEnvironment, TextHistory
from trl_lite.environment import StringStoppingCriteria

TAGS = ["<request>", "<call>", "<response>", "<submit>", "<Echo>", "<Count>", "<Boom>", "<Nope>"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = make_tokenizer()
    tok.add_tokens(TAGS)
    return tok


@pytest.fixture
def model(tokenizer):
    gpt2 = make_gpt2(seed=3, dropout=0.5)
    gpt2.resize_token_embeddings(len(tokenizer))
    return AutoModelForCausalLMWithValueHead.from_pretrained(gpt2)


def echo(text):
    return text.strip()


class Count:
    def __call__(self, text):
        return " ".join(["very"] * len(text.split()))


def boom(text):
    raise RuntimeError("no such movie")


class Scripted(LogitsProcessor):
    """Forces each row to continue with its transcript (the tokens after its query, tool responses included)."""

    def __init__(self, tokenizer, transcripts: dict):
        self.pad = tokenizer.pad_token_id
        self.eos = tokenizer.eos_token_id
        self.scripts = {tuple(tokenizer(q).input_ids): tokenizer(t).input_ids for q, t in transcripts.items()}
        self.modes = []

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        for row, ids in enumerate(input_ids.tolist()):
            ids = ids[next(i for i, t in enumerate(ids) if t != self.pad):]
            query = next(q for q in self.scripts if tuple(ids[: len(q)]) == q)
            script = self.scripts[query]
            position = len(ids) - len(query)
            forced[row, script[position] if position < len(script) else self.eos] = 0.0
        return forced


def make_env(model, tokenizer, transcripts, reward_fn=None, **kwargs):
    scripted = Scripted(tokenizer, transcripts)
    generation_kwargs = {"do_sample": False, "max_new_tokens": 12, "logits_processor": LogitsProcessorList([scripted]), "pad_token_id": 0}
    env = TextEnvironment(
        model, tokenizer, kwargs.pop("tools", {"Echo": echo, "Count": Count(), "Boom": boom}),
        reward_fn or (lambda texts, **kw: [float(len(t.split())) for t in texts]), kwargs.pop("prompt", "the "),
        generation_kwargs=generation_kwargs, **kwargs,
    )
    return env


# ----------------------------------------------------------------------------------------------
# StringStoppingCriteria
# ----------------------------------------------------------------------------------------------


def test_string_stopping_criteria_stops_each_row_and_counts_its_tokens(tokenizer):
    ids = {w: tokenizer.convert_tokens_to_ids(w) for w in ["good", "bad", "<call>", "<submit>"]}
    criteria = StringStoppingCriteria(["<call>", "<submit>"], tokenizer)
    prompt = torch.tensor([[ids["good"], ids["<call>"]], [ids["bad"], ids["bad"]]])  # a stop string in a prompt does not count
    steps = [[ids["good"], ids["bad"]], [ids["<call>"], ids["good"]], [ids["bad"], ids["good"]], [ids["good"], ids["<submit>"]]]
    seq, results = prompt, []
    for new in steps:
        seq = torch.cat([seq, torch.tensor(new).unsqueeze(1)], dim=1)
        results.append(criteria(seq, None).tolist())
    assert results == [[False, False], [True, False], [True, False], [True, True]]
    assert criteria.generated_tokens == [2, 4]
    assert criteria.first_call  # every row stopped: ready for the next generate call
    with pytest.raises(ValueError, match="non-empty list of strings"):
        StringStoppingCriteria("<call>", tokenizer)


# ----------------------------------------------------------------------------------------------
# TextHistory
# ----------------------------------------------------------------------------------------------


def test_text_history_segments_masks_and_split():
    history = TextHistory("the movie", torch.tensor([5, 6]), system=True)
    history.append_segment(" was good", torch.tensor([7, 8]), system=False)
    history.append_segment("<response>", torch.tensor([9]), system=True)
    history.append_segment(" fine", torch.tensor([10]), system=False)
    assert history.text == "the movie was good<response> fine"
    assert history.text_spans == [(0, 9), (9, 18), (18, 28), (28, 33)]
    assert history.token_spans == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert history.system_spans == [True, False, True, False]
    assert history.last_text_segment == " fine"
    query, response, mask = history.split_query_response_tokens()
    assert query.tolist() == [5, 6] and response.tolist() == [7, 8, 9, 10] and mask.tolist() == [1, 1, 0, 1]
    assert not history.completed and history.reward == 0.0
    history.complete(truncated=True)
    assert history.completed and history.truncated
    with pytest.raises(ValueError, match="non-empty text and tokens, got 0 characters and 1 tokens"):
        history.append_segment("", torch.tensor([1]))
    with pytest.raises(ValueError, match="got 3 characters and 0 tokens"):
        history.append_segment("abc", torch.tensor([], dtype=torch.long))


def test_show_text_tokens_and_legend(capsys, tokenizer):
    ids = tokenizer("the movie").input_ids
    history = TextHistory("the movie", torch.tensor(ids))
    history.append_segment(" good", torch.tensor(tokenizer(" good").input_ids), system=False)
    history.reward = 1.5
    history.show_text(show_legend=True)
    out = capsys.readouterr().out
    assert "the movie good" in out and "Reward: 1.5" in out and "Colour Legend" in out and "Model" in out
    history.show_tokens(tokenizer)
    out = capsys.readouterr().out
    assert "the movie good" in out and "Reward: 1.5" in out


# ----------------------------------------------------------------------------------------------
# Parsing, tool calls and end checks
# ----------------------------------------------------------------------------------------------


def test_parse_tool_call(model, tokenizer):
    env = make_env(model, tokenizer, {})
    assert env.parse_tool_call("so <request><Echo>the movie<call> and") == ("Echo", "the movie")
    assert env.parse_tool_call("<request><Echo>a>b<call>") == ("Echo", "a>b")
    assert env.parse_tool_call("<request> <Echo> two\nlines <call>") == ("Echo", " two\nlines ")
    assert env.parse_tool_call("<request>no tool<call>") == (None, None)
    assert env.parse_tool_call("<request><Echo>never called") == (None, None)
    assert env.parse_tool_call("nothing") == (None, None)


@pytest.mark.parametrize(
    "segment,expected",
    [
        ("<request><Echo>good movie<call>", "good movie"),
        ("<request><Count>good movie<call>", "very very"),
        ("<request><Boom>good<call>", "Tool error: no such movie"),
        ("<request><Nope>good<call>", "Unknown tool Nope."),
        ("<request>good<call>", "Unknown tool call: <request>good<call>"),
    ],
)
def test_step_answers_a_request_with_a_system_segment(model, tokenizer, segment, expected):
    env = make_env(model, tokenizer, {})
    history = TextHistory("the", torch.tensor(tokenizer("the").input_ids))
    history.append_segment(segment, torch.tensor(tokenizer(segment).input_ids), system=False)
    env.step(history)
    assert history.last_text_segment == expected + "<response>"
    assert history.system_spans[-1] is True and not history.completed
    _, _, mask = history.split_query_response_tokens()
    n_tool = len(tokenizer(expected + "<response>", add_special_tokens=False).input_ids)
    assert mask.tolist() == [1] * (len(mask) - n_tool) + [0] * n_tool


def test_long_tool_responses_are_cut(model, tokenizer):
    env = make_env(model, tokenizer, {}, max_tool_reponse=12)  # classic's spelling
    assert env.max_tool_response == 12
    history = TextHistory("the", torch.tensor(tokenizer("the").input_ids))
    history.append_segment("<request><Echo>good bad fine dull<call>", torch.tensor([5]), system=False)
    env.step(history)
    assert history.last_text_segment == "good bad ...<response>"


def test_task_end_check(model, tokenizer):
    env = make_env(model, tokenizer, {}, max_length=6)
    def history_with(segment, system=False):
        h = TextHistory("the", torch.tensor([3]))
        h.append_segment(segment, torch.tensor(tokenizer(segment).input_ids), system=system)
        return h
    assert env.task_end_check(history_with("good <submit>")) == (False, True)
    assert env.task_end_check(history_with("good <eos>")) == (False, True)
    assert env.task_end_check(history_with("<request><Echo>good<call>")) == (False, False)
    assert env.task_end_check(history_with("good bad")) == (False, True)  # a model turn without a call ends
    assert env.task_end_check(history_with("good bad", system=True), model_turn=False) == (False, False)
    assert env.task_end_check(history_with("<request><Echo>a b c d e f<call>")) == (True, True)


# ----------------------------------------------------------------------------------------------
# Whole episodes
# ----------------------------------------------------------------------------------------------


def test_run_gives_step_inputs_with_tool_output_masked(model, tokenizer):
    transcripts = {
        "the movie": "<request><Echo>good film<call>good film<response>it was good<submit>",
        "the plot": "so <request><Count>a b c<call>very very very<response>bad<submit>",
        "the end": "great<submit>",
    }
    seen = {}

    def reward_fn(texts, bonus):
        seen["texts"] = texts
        return [len(t) + bonus for t in texts]

    env = make_env(model, tokenizer, transcripts, reward_fn=reward_fn)
    model.train()
    queries, responses, masks, rewards, histories = env.run(["movie", "plot", "end"], bonus=100)
    assert model.training  # generation ran in eval mode and the mode came back
    for i, (task, transcript) in enumerate(transcripts.items()):
        assert queries[i].tolist() == tokenizer(task).input_ids
        assert responses[i].tolist() == tokenizer(transcript).input_ids
        assert histories[i].completed and not histories[i].truncated
    # The tool's text (and its <response> tag) has mask 0, everything the model wrote mask 1.
    tool_part = tokenizer("good film<response>").input_ids
    assert masks[0].tolist() == [1] * 5 + [0] * len(tool_part) + [1] * 4
    assert masks[1].tolist() == [1] * 7 + [0] * 4 + [1] * 2
    assert masks[2].tolist() == [1, 1]
    assert seen["texts"] == [h.last_text_segment for h in histories]
    assert rewards == [len(t) + 100 for t in seen["texts"]] == [h.reward for h in histories]


def test_max_turns_and_truncation(model, tokenizer):
    # The model keeps calling tools; two turns are allowed.
    loop = "<request><Echo>good<call>good<response>" * 4
    env = make_env(model, tokenizer, {"the movie": loop}, max_turns=2)
    _, responses, masks, _, histories = env.run(["movie"])
    one_turn = len(tokenizer("<request><Echo>good<call>good<response>").input_ids)
    assert len(responses[0]) == 2 * one_turn and not histories[0].completed
    env = make_env(model, tokenizer, {"the movie": loop}, max_turns=4, max_length=12)
    _, responses, _, _, histories = env.run(["movie"])
    assert histories[0].completed and histories[0].truncated and len(responses[0]) == 2 * one_turn


def test_generation_is_deterministic_with_dropout_in_train_mode(model, tokenizer):
    """The unscripted greedy run gives the same tokens twice although the model is in train mode with dropout 0.5."""
    env = TextEnvironment(model, tokenizer, [echo, Count()], lambda texts: [0.0] * len(texts), "the ",
                          generation_kwargs={"do_sample": False, "max_new_tokens": 6, "pad_token_id": 0})
    assert set(env.tools) == {"echo", "Count"}
    model.train()
    first = env.run(["movie", "plot good"])[1]
    second = env.run(["movie", "plot good"])[1]
    assert [r.tolist() for r in first] == [r.tolist() for r in second]
    assert model.training


def test_bad_arguments(model, tokenizer):
    with pytest.raises(ValueError, match="got None for reward_fn"):
        TextEnvironment(model, tokenizer, {}, None)
    with pytest.raises(TypeError, match="tools\\['calc'\\] must be a callable"):
        TextEnvironment(model, tokenizer, {"calc": "not callable"}, lambda t: t)
    with pytest.raises(ValueError, match="max_tool_response must be at least 4"):
        TextEnvironment(model, tokenizer, {}, lambda t: t, max_tool_response=2)
    env = make_env(model, tokenizer, {"the movie": "good<submit>"}, reward_fn=lambda texts: [1.0])
    with pytest.raises(ValueError, match="one reward per episode: got 1 for 2"):
        env.run(["movie", "movie"])


# ----------------------------------------------------------------------------------------------
# On the trainer's generation engine
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["trainer", "engine"])
def test_on_the_trainers_engine_the_classic_results(model, tokenizer, target):
    """TextEnvironment(trainer) (or a bare engine) generates on the engine and cuts each turn after its stop
    string: the same queries, responses, masks, rewards and histories as on the model itself."""
    transcripts = {
        "the movie": "<request><Echo>good film<call>good film<response>it was good<submit>",
        "the plot": "so <request><Count>a b c<call>very very very<response>bad<submit>",
        "the end": "great<submit>",
        "the story": "<request><Echo>" + "good " * 10,  # cut by max_new_tokens: the turn never ends
    }
    tasks = ["movie", "plot", "end", "story"]
    classic = make_env(model, tokenizer, transcripts, max_turns=3).run(tasks)
    trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=4), model, tokenizer=tokenizer)
    env = make_env(trainer if target == "trainer" else trainer.generation.engine, tokenizer, transcripts, max_turns=3)
    assert env.is_encoder_decoder is False and env.current_device == trainer.accelerator.device
    engine, calls = trainer.generation.engine, []
    original = engine.generate
    engine.generate = lambda *args: calls.append(len(args[0])) or original(*args)
    model.train()
    on_engine = env.run(tasks)
    assert model.training
    for expected, got in zip(classic[:3], on_engine[:3]):
        assert [t.tolist() for t in got] == [t.tolist() for t in expected]
    assert on_engine[3] == classic[3]
    assert [h.text for h in on_engine[4]] == [h.text for h in classic[4]]
    assert [(h.completed, h.truncated) for h in on_engine[4]] == [(h.completed, h.truncated) for h in classic[4]]
    assert on_engine[1][0].tolist() == tokenizer(transcripts["the movie"]).input_ids  # the scripts did run
    assert calls == [4, 2]  # a turn for all four tasks, then for the two that called a tool
