"""``run_episodes``: multi-turn episodes on the trainer's generation engine (docs/algorithm.md section 16).

Each turn, every live episode's whole sequence so far (query + response) goes to the engine in one
batched ``generate`` call (episodes whose remaining room is smaller than ``max_new_tokens`` in one
call per room size); finished episodes drop out. vLLM's prefix caching then serves the growing,
shared prefixes. The model's tokens are kept as sampled, with the engine's log-probs; tool and
environment messages are appended as the chat template's tokens for them (:class:`.ChatFormat`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import requests
import torch
from accelerate.utils import gather_object

from ..core.kept_sets import KeptSets
from ..engines import GenerationEngine, TransformersEngine, resolve_sampling_kwargs
from ..engines.generation import RolloutGeneration
from .chat import ChatFormat, parse_tool_calls
from .environments import (
    STEP,
    TOOLS,
    environment_factories,
    environment_reward,
    environment_step,
    prompt_label,
    read_prompt,
    reset_arguments,
    reset_environment,
    row_environment,
)
from .episodes import Episode
from .rewards import check_reward_funcs, score_episodes
from .setup import Setup, environment_setups, function_tools
from .tools import environment_tools, run_tool_calls

# Keyword arguments of generate() that run_episodes sets itself.
_OWN_KWARGS = {
    "num_return_sequences": "num_generations",
    "max_length": "max_new_tokens (per turn) and max_episode_tokens",
    "return_logprobs": "nothing: episodes always carry the engine's log-probs",
}
_next_group_id = 0  # group ids are unique across calls, so episodes of two calls never share a group


@dataclass
class _Engine:
    """The engine and what comes with it: the trainer's weight push, timers and processes, or none for a bare engine.

    ``collective``: every process must make the same ``generate`` calls (the transformers engine
    under ZeRO-3, a vLLM engine shared by a tensor-parallel group), so the processes agree on them.
    """

    engine: GenerationEngine
    tokenizer: object
    generate: Callable  # (queries, generation kwargs, batch size) -> (responses, log-probs)
    environment_timer: Callable
    context_length: int | None
    accelerator: object | None
    collective: bool
    awake: Callable = nullcontext  # holds a sleeping engine awake across the turns of one call


@dataclass(frozen=True)
class _Options:
    """The episode rules a caller may switch from TRL's: see ``run_episodes``' keywords of the same names."""

    max_turns: int
    max_episode_tokens: int | None
    answer_malformed_tool_calls: bool
    check_tool_arguments: bool


@dataclass
class _Live:
    """An episode being played: its sequence so far and what it has seen."""

    index: int
    label: str
    row: dict
    setup: Setup
    environment: object | None
    functions: dict[str, Callable]  # the plain tools and the environment's tool methods, by name
    messages: list[dict]
    prompt_length: int  # messages of the prompt (after reset); the rest is the completion
    rendered: str  # the text the next model turn continues: the conversation with its generation prompt
    query: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kept: list = field(default_factory=list)  # truncated sampling: per model turn its KeptSets (None: none), per answer its length
    reward: float | None = None
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False
    done: bool = False
    reward_sources: dict[str, float] = field(default_factory=dict)


def run_episodes(
    trainer,
    prompts: list,
    tools: list[Callable] | None = None,
    environment_factory: Callable | dict[str, Callable] | None = None,
    max_turns: int = 4,
    max_episode_tokens: int | None = None,
    num_generations: int = 1,
    *,
    reward_funcs: Callable | list[Callable] | None = None,
    reward_weights: list[float] | None = None,
    answer_malformed_tool_calls: bool = False,
    check_tool_arguments: bool = False,
    tokenizer=None,
    batch_size: int | None = None,
    **generation_kwargs,
) -> list[Episode]:
    """Play ``num_generations`` multi-turn episodes per prompt on the trainer's engine; one :class:`Episode` each.

    Episodes follow TRL's GRPOTrainer (an environment written for its ``environment_factory`` runs
    unchanged; docs/agents.md), except where a keyword below says otherwise.

    Args:
        trainer: a ``PPOTrainer`` (generation on its engine - transformers, colocated vLLM or a vLLM
            server - after the same weight push as ``trainer.generate``), or a bare ``GenerationEngine``
            (then pass ``tokenizer``).
        prompts: the rows, per prompt: a list of chat messages, or a dict (a dataset row) whose
            ``"prompt"`` holds them and whose other keys go to the environment's ``reset`` and to the
            reward functions. With an environment a row may leave ``"prompt"`` out (``reset`` writes the task).
        tools: plain functions (or ``async def`` ones) the model may call; each needs type hints and a
            Google-style docstring (its schema is transformers' ``get_json_schema``). They reach the
            model through the chat template (``apply_chat_template(..., tools=...)``); the model calls
            them Hermes-style, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
        environment_factory: called once per episode (no arguments), or a dict ``{name: factory}`` whose
            factory each row picks by its ``environment`` key; see :mod:`.environments` for TRL's
            protocol (tool methods, ``get_reward``) and step environments (``step(text)``).
        max_turns: model turns per episode at most; an episode still calling tools (or playing) at its
            last turn ends ``truncated``. The tool calls of that turn are not run (as in TRL); a step
            environment still judges it (its answer joins ``messages``, not the tokens).
        max_episode_tokens: response tokens (model, tool and template tokens) per episode at most;
            None: only the engine's context length bounds the query and response together.
        num_generations: episodes per prompt, consecutive in the result: a group for ``'rloo'``/``'grpo'``.
            Each plays its own environment's ``reset``, so the members of a group may start apart (a
            random board); the group is the prompt, not the tokens (``step_inputs`` gives its ``group_ids``).
        reward_funcs: TRL-style reward functions ``f(prompts, completions, completion_ids, **kwargs) ->
            list[float | None]`` (or ``async def``); ``kwargs`` hold ``environments`` (the episodes'
            environment instances, with an ``environment_factory``) and each row field other than
            ``prompt`` as a list over the episodes. ``prompts``: each episode's prompt messages (with
            reset's text); ``completions``: the messages after them.
        reward_weights: a weight per reward function (default 1 each).
        answer_malformed_tool_calls: a model turn with a malformed ``<tool_call>`` (not closed, not JSON,
            no name) is, by default, the episode's final answer, as in TRL; True sends the model an
            ``{'error': ...}`` tool message saying what is wrong and gives it another turn.
        check_tool_arguments: True checks each call's arguments against the tool's schema first (types,
            required and unknown names) and sends a mismatch back as an ``{'error': ...}`` tool message
            without calling the tool; by default the tool is called with the arguments as given, as in TRL.
        tokenizer: the tokenizer with the chat template; default the trainer's (or the engine's).
        batch_size: queries per ``generate`` chunk on the transformers engine; default all at once.
        generation_kwargs: ``generate`` keyword arguments of every turn; ``max_new_tokens`` (tokens of
            one model turn) is required. They sample from the engine's distribution (``PPOConfig.temperature``,
            ``top_k``, ...); a sampling kwarg that disagrees is refused. A turn stops at the template's end-of-turn
            token (and the tokenizer's EOS, and any ``eos_token_id`` given); a turn that ends at EOS ends the episode.

    A model turn without a tool call ends an episode with tools; a step environment's ``done`` ends
    one; without tools and environment an episode is one turn. A tool's result goes back as
    ``str(result)`` (a list of content blocks as it is); a failed call (unknown tool, an exception)
    as ``str({'error': message})``, counted in ``tool_errors``. Episode ``reward``: the weighted sum
    of the reward functions and the environment's reward (``get_reward()`` or the sum of ``step``
    rewards, weight 1) over the sources that scored it, as TRL's ``nansum``; NaN when none did (None
    or NaN from each), None when there is no source. An environment's exception fails the call
    (RuntimeError naming the episode and its prompt).
    """
    engine = _resolve_engine(trainer, tokenizer)
    _check_arguments(max_turns, max_episode_tokens, num_generations, batch_size)
    for name, value in (("answer_malformed_tool_calls", answer_malformed_tool_calls),
                        ("check_tool_arguments", check_tool_arguments)):  # fmt: skip
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}.")
    options = _Options(max_turns, max_episode_tokens, answer_malformed_tool_calls, check_tool_arguments)
    # The run's sampling (PPOConfig's, held by the engine): a kwarg that disagrees is refused here,
    # before any environment exists.
    kwargs = resolve_sampling_kwargs(_turn_kwargs(generation_kwargs, num_generations), engine.engine.sampling)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of chat prompts, got {prompts!r:.80}.")
    factories = environment_factories(environment_factory)
    read = [read_prompt(i, prompt, factories is not None) for i, prompt in enumerate(prompts)]
    names = [row_environment(i, row, factories) if factories else None for i, (_, row) in enumerate(read)]
    functions, schemas = function_tools(tools)
    funcs, weights = check_reward_funcs(reward_funcs, reward_weights)
    chat_probe = ChatFormat(engine.tokenizer)  # a tokenizer without a usable template fails before any environment exists

    environments = [
        factories[name]() if factories else None for name in names for _ in range(num_generations)
    ]  # fmt: skip
    setups = environment_setups(names, num_generations, environments, functions, schemas, chat_probe, engine.tokenizer)
    stops = _stop_ids(chat_probe, engine.tokenizer, kwargs)
    kwargs["eos_token_id"] = sorted(stops)

    routed = factories is not None and None not in factories
    live = _start_episodes(read, names, num_generations, environments, setups, functions, routed, engine)
    with engine.awake():  # a sleeping engine is woken (and its weights pushed) once for all turns
        for _ in range(max_turns):
            playing = [episode for episode in live if not episode.done]
            if not _any_process(engine, bool(playing)):
                break
            turns = _generate_turns(engine, playing, kwargs, max_episode_tokens, batch_size)
            with engine.environment_timer():
                for episode, (tokens, logprobs, kept) in zip(playing, turns):
                    episode.kept.append(kept)
                    _take_turn(episode, tokens, logprobs, stops, options, engine.context_length)
    with engine.environment_timer():
        _score(live, funcs, weights, has_environments=factories is not None)
    first_group = _reserve_group_ids(len(read))
    return [_episode(e, num_generations, first_group) for e in live]


def _score(live: list[_Live], funcs, weights, has_environments: bool) -> None:
    """Each episode's reward and reward sources (:func:`.rewards.score_episodes`), in place."""
    environment_rewards = []
    for episode in live:
        if episode.setup.kind == TOOLS:
            environment_rewards.append(environment_reward(episode.environment, episode.label))
        else:  # a step environment's summed rewards, or None without an environment
            environment_rewards.append(episode.reward)
    rewards, sources = score_episodes(
        funcs, weights,
        prompts=[e.messages[: e.prompt_length] for e in live],
        completions=[e.messages[e.prompt_length :] for e in live],
        completion_ids=[list(e.response) for e in live],
        rows=[e.row for e in live],
        environments=[e.environment for e in live] if has_environments else None,
        environment_rewards=environment_rewards,
    )  # fmt: skip
    for episode, reward, source in zip(live, rewards, sources):
        episode.reward, episode.reward_sources = reward, source


def _resolve_engine(trainer, tokenizer) -> _Engine:
    generation = getattr(trainer, "generation", None)
    if isinstance(generation, RolloutGeneration):
        tokenizer = tokenizer if tokenizer is not None else trainer.tokenizer
        engine, accelerator = generation.engine, trainer.accelerator

        def generate(queries, kwargs, batch_size):
            """``trainer.generate`` (pushes and wakes first, timed), with its sampler's kept sets (taken, for step())."""
            responses, logprobs = trainer.generate(queries, batch_size=batch_size, return_prompt=False,
                                                   return_logprobs=True, **kwargs)  # fmt: skip
            return responses, logprobs, generation.records.take(queries, responses)

        environment_timer = lambda: trainer.timed("rollout/environment")  # noqa: E731
    elif isinstance(trainer, GenerationEngine):
        engine, accelerator = trainer, getattr(trainer, "accelerator", None)
        tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        environment_timer = nullcontext

        def generate(queries, kwargs, batch_size):
            return (*engine.generate(queries, kwargs, None, batch_size, False, True, True), engine.take_kept_sets())

    else:
        raise TypeError(
            f"trainer must be a PPOTrainer or a GenerationEngine (trl_lite.engines), got {type(trainer).__name__}."
        )
    if tokenizer is None:
        raise ValueError("run_episodes needs a tokenizer with a chat template: the trainer has none; pass tokenizer=.")
    if getattr(engine, "is_encoder_decoder", False):
        raise ValueError("run_episodes needs a decoder-only model: a chat conversation grows as one token sequence.")
    placement = getattr(getattr(engine, "backend", None), "placement", None)
    collective = accelerator is not None and accelerator.num_processes > 1 and (
        (isinstance(engine, TransformersEngine) and engine.is_zero3)
        or (placement is not None and placement.tensor_parallel_size > 1)
    )  # fmt: skip
    awake = generation.awake if isinstance(generation, RolloutGeneration) else nullcontext
    return _Engine(engine, tokenizer, generate, environment_timer, _context_length(engine), accelerator, collective, awake)


def _context_length(engine: GenerationEngine) -> int | None:
    """The most tokens (prompt and generated) the engine's model takes, when it can be known."""
    if isinstance(engine, TransformersEngine):
        with engine.model_context() as model:
            unwrapped = engine.accelerator.unwrap_model(model)
        config = getattr(unwrapped, "pretrained_model", unwrapped).config
        for name in ("max_position_embeddings", "n_positions", "n_ctx"):
            if isinstance(getattr(config, name, None), int):
                return getattr(config, name)
        return None
    backend = getattr(engine, "backend", None)
    if getattr(backend, "max_model_len", None) is not None:  # a colocated vLLM
        return int(backend.max_model_len)
    if hasattr(backend, "base_url"):  # a vLLM server: its OpenAI model card says
        cards = requests.get(f"{backend.base_url}/v1/models", timeout=backend.timeout).json()["data"]
        return int(cards[0]["max_model_len"])
    return None


def _check_arguments(max_turns, max_episode_tokens, num_generations, batch_size) -> None:
    for name, value, allow_none in (
        ("max_turns", max_turns, False), ("max_episode_tokens", max_episode_tokens, True),
        ("num_generations", num_generations, False), ("batch_size", batch_size, True),
    ):  # fmt: skip
        if value is None and allow_none:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1{' or None' if allow_none else ''}, got {value!r}.")


def _turn_kwargs(generation_kwargs: dict, num_generations: int) -> dict:
    kwargs = dict(generation_kwargs)
    for name, instead in _OWN_KWARGS.items():
        if name in kwargs:
            raise ValueError(f"run_episodes sets {name} itself; drop it from the generation kwargs (use {instead}).")
    max_new = kwargs.get("max_new_tokens")
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise ValueError(
            f"run_episodes needs max_new_tokens (the most tokens of one model turn) as an int >= 1, got {max_new!r}."
        )
    if num_generations > 1 and not kwargs.get("do_sample"):
        raise ValueError(
            f"num_generations={num_generations} with greedy decoding would play {num_generations} equal episodes per "
            "prompt; pass do_sample=True."
        )
    return kwargs


def _stop_ids(chat: ChatFormat, tokenizer, kwargs: dict) -> set[int]:
    """The end-of-turn token, the tokenizer's EOS and any ``eos_token_id`` given: a model turn stops at each."""
    stops = {chat.end_of_turn_id}
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    extra = kwargs.get("eos_token_id")
    if extra is not None:
        stops.update(int(t) for t in (extra if isinstance(extra, (list, tuple)) else [extra]))
    return stops


def _start_episodes(read, names, k: int, environments, setups, functions, routed: bool, engine: _Engine) -> list[_Live]:
    """Reset each episode's own environment and render its query; the ``k`` episodes of a prompt may
    start apart (each ``reset`` may give other text)."""
    live = []
    for p, ((messages, row), name) in enumerate(zip(read, names)):
        setup = setups[name]
        for g in range(k):
            index = p * k + g
            label = f"episode {index} of {prompt_label(p, messages)}"
            own = [dict(m) for m in messages]
            environment = environments[index]
            available = dict(functions)
            if environment is not None:
                reset_environment(environment, label, own, reset_arguments(row, setup.kind, routed))
                if setup.kind == TOOLS:
                    available.update(environment_tools(environment))
            query, rendered = setup.chat.query(own)
            if engine.context_length is not None and len(query) >= engine.context_length:
                raise ValueError(
                    f"{label} renders to {len(query)} tokens; the engine's context length is "
                    f"{engine.context_length}, which leaves no room for a response."
                )
            reward = 0.0 if setup.kind == STEP else None
            live.append(
                _Live(index, label, row, setup, environment, available, own, len(own), rendered, query, reward=reward)
            )
    return live


def _any_process(engine: _Engine, playing: bool) -> bool:
    """Whether this process - or, for a collective engine, any process - still plays an episode."""
    if not engine.collective:
        return playing
    accelerator = engine.accelerator
    flags = accelerator.gather(torch.tensor([float(playing)], device=accelerator.device))
    return bool(flags.max() > 0)


def _room(episode: _Live, max_episode_tokens: int | None, context_length: int | None) -> int:
    """Tokens the episode may still add (model and template tokens together)."""
    room = []
    if max_episode_tokens is not None:
        room.append(max_episode_tokens - len(episode.response))
    if context_length is not None:
        room.append(context_length - len(episode.query) - len(episode.response))
    return min(room) if room else 1 << 62


def _generate_turns(engine: _Engine, playing: list[_Live], kwargs: dict, max_episode_tokens, batch_size):
    """Each playing episode's next model turn: ``(token ids, log-probs)`` of what the engine sampled, cut
    after the first stop token. One ``generate`` call per distinct ``max_new_tokens`` (the turn's
    limit, lowered where the episode's room is smaller); every process makes the same calls when the
    engine's calls are collective."""
    budgets = [min(kwargs["max_new_tokens"], _room(e, max_episode_tokens, engine.context_length)) for e in playing]
    sizes = set(budgets)
    if engine.collective:
        sizes = set(gather_object(sorted(sizes)))
    stops = set(kwargs["eos_token_id"])
    turns = [None] * len(playing)
    for size in sorted(sizes):
        rows = [i for i, budget in enumerate(budgets) if budget == size]
        if not rows and not engine.collective:
            continue
        # Built on the CPU: the engine moves each padded chunk in one copy (not one copy per row).
        queries = [torch.tensor(playing[i].query + playing[i].response) for i in rows]
        responses, logprobs, kept = engine.generate(queries, {**kwargs, "max_new_tokens": size},
                                                    batch_size or max(len(queries), 1))  # fmt: skip
        for i, tokens, lps, sets in zip(rows, responses, logprobs, kept or [None] * len(rows)):
            tokens = tokens.tolist()
            end = next((t + 1 for t, token in enumerate(tokens) if token in stops), len(tokens))
            turns[i] = (tokens[:end], lps[:end].tolist(), None if sets is None else sets.first(end))
    return turns


def _take_turn(episode: _Live, tokens, logprobs, stops, options: _Options, context_length) -> None:
    """Append a model turn; answer it (tools or the step environment); append the template's tokens for
    the answer and the next generation prompt, unless the episode ends here."""
    chat = episode.setup.chat
    episode.response += tokens
    episode.mask += [1] * len(tokens)
    episode.logprobs += logprobs
    episode.num_turns += 1
    ended = bool(tokens) and tokens[-1] in stops
    text = chat.decode(tokens[:-1] if ended else tokens)
    episode.messages.append({"role": "assistant", "content": text})
    if not ended:  # cut at max_new_tokens or the episode's room: the turn is unfinished
        episode.truncated = episode.done = True
        return
    if tokens[-1] != chat.end_of_turn_id:  # EOS: the model ended the conversation
        episode.done = True
        return
    answer = _answer(episode, text, options)
    if answer is None:
        episode.done = True
        return
    if episode.num_turns == options.max_turns:  # a step environment judged the last turn; the model never reads it
        episode.messages += answer
        episode.truncated = episode.done = True
        return
    ids, rendered = chat.continuation(episode.rendered, episode.messages, answer)
    episode.messages += answer
    # Room for the added tokens and at least one more model token.
    if _room(episode, options.max_episode_tokens, context_length) < len(ids) + 1:
        episode.truncated = episode.done = True
        return
    episode.response += ids
    episode.kept.append(len(ids))  # the template's and the answer's tokens: no actions, no sets
    episode.mask += [0] * len(ids)
    episode.logprobs += [0.0] * len(ids)
    episode.rendered = rendered


def _answer(episode: _Live, text: str, options: _Options) -> list[dict] | None:
    """The messages that answer a model turn, or None when the episode ends with it."""
    if episode.setup.kind == STEP:
        observation, reward, done = environment_step(episode.environment, episode.label, text)
        episode.reward += reward
        if done:
            if observation:
                episode.messages.append({"role": "user", "content": observation})
            return None
        return [{"role": "user", "content": observation}]
    if not episode.setup.schemas:
        return None
    calls = parse_tool_calls(text)
    if not calls or (not options.answer_malformed_tool_calls and any(call.error for call in calls)):
        return None  # no call, or (as in TRL) a malformed one: the text is the final answer
    if episode.num_turns == options.max_turns:  # as in TRL, the calls of the last turn are not run
        episode.truncated = True
        return None
    answers = run_tool_calls(calls, episode.setup.schemas, episode.functions, options.check_tool_arguments)
    episode.tool_calls += len(answers)
    episode.tool_errors += sum(failed for _, failed in answers)
    return [message for message, _ in answers]


def _reserve_group_ids(count: int) -> int:
    """The first of ``count`` group ids no earlier call used."""
    global _next_group_id
    first, _next_group_id = _next_group_id, _next_group_id + count
    return first


def _episode(live: _Live, k: int, first_group: int) -> Episode:
    return Episode(
        query=torch.tensor(live.query, dtype=torch.long),
        response=torch.tensor(live.response, dtype=torch.long),
        response_mask=torch.tensor(live.mask, dtype=torch.long),
        logprobs=torch.tensor(live.logprobs, dtype=torch.float32),
        kept_sets=None if any(kept is None for kept in live.kept) else KeptSets.joined(live.kept),
        reward=live.reward,
        num_turns=live.num_turns,
        tool_calls=live.tool_calls,
        tool_errors=live.tool_errors,
        truncated=live.truncated,
        messages=live.messages,
        prompt_index=live.index // k,
        group_id=first_group + live.index // k,
        environment=live.environment,
        reward_sources=live.reward_sources,
        prompt_length=live.prompt_length,
    )
