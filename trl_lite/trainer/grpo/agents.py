"""TRL 1.x's ``tools`` and ``environment_factory`` for ``GRPOTrainer``, played by :func:`trl_lite.agents.run_episodes`.

With either set, each completion is a multi-turn episode (docs/agents.md): the model's turn, the tool calls it
writes (Hermes-style ``<tool_call>`` blocks) run and their results appended as ``tool`` messages in the chat
template's tokens, the model's next turn, ... until a turn without a call, ``max_tool_calling_iterations`` tool
rounds, or ``max_completion_length`` tokens (model and tool tokens together). The completion is everything after
the prompt; only the model's own tokens are in the loss (the response mask is 0 on the template's and the tools').

``environment_factory`` (a callable, or ``{name: callable}`` routed by each row's ``environment`` column) makes one
environment per completion; ``reset(**row)`` may return text joined to the last prompt message, its public methods
are tools, and an optional ``get_reward()`` is one more reward source named after its class, weight 1 (TRL's rule).
Reward functions get the episode's prompt messages, its completion messages, the completion's token ids (tool
tokens included) and ``environments=`` (the completions' instances).

:class:`AgentRollouts` checks everything at construction - the tools (callable, a schema from type hints and a
docstring), each factory's product (probed once: ``reset`` and its methods' schemas), the chat template (it must
render tools) - so a bad argument fails before the trainer changes any state.
"""

from __future__ import annotations

import math
import sys

import torch

from ...agents import run_episodes
from ...agents.chat import ChatFormat
from ...agents.environments import TOOLS, environment_factories, environment_kind, environment_reward
from ...agents.setup import function_tools
from ...agents.tools import environment_tools, tool_schema


class AgentRollouts:
    """The run's tools and environments, checked, and the episodes of one generation.

    Args:
        tools: TRL's ``tools``: plain (or ``async def``) functions with type hints and a Google-style docstring.
        environment_factory: TRL's ``environment_factory``: a callable or a dict of them; None for none.
        max_tool_calling_iterations: tool rounds per completion at most (None: no limit but the token budget).
        tokenizer: the policy's tokenizer; its chat template must render tools and close assistant turns.
        chat_template_kwargs: GRPOConfig's; episodes render the template without extra arguments, so it must be empty.
    """

    def __init__(self, tools, environment_factory, max_tool_calling_iterations, tokenizer, chat_template_kwargs=None):
        if chat_template_kwargs:
            raise ValueError(f"chat_template_kwargs={chat_template_kwargs!r} is not supported with tools or "
                             "environment_factory (multi-turn episodes render the template as it is); leave it None.")  # fmt: skip
        self.functions, schemas = function_tools(tools)
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.factories = environment_factories(environment_factory)
        limit = max_tool_calling_iterations
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"max_tool_calling_iterations must be None or an int >= 0, got {limit!r}.")
        # TRL's iterations are tool rounds; run_episodes counts model turns (the last one's calls are not run).
        self.max_turns = sys.maxsize if limit is None else limit + 1
        self.reward_sources = []  # get_reward of each environment class that has one, as a TRL reward function
        for name, factory in (self.factories or {}).items():
            what = "environment_factory" if name is None else f"environment_factory[{name!r}]"
            try:
                probe = factory()
            except Exception as error:
                raise ValueError(f"{what}() raised {type(error).__name__}: {error}; it must make an environment "
                                 "with no arguments.") from error  # fmt: skip
            kind = environment_kind(probe, f"{what}()'s product")  # TypeError naming it without reset()
            if kind != TOOLS and self.functions:
                raise ValueError(f"tools cannot be combined with {what}()'s step environment (one with step(text)); "
                                 "give the tools to a TRL-style environment as methods.")  # fmt: skip
            for method_name, method in (environment_tools(probe) if kind == TOOLS else {}).items():
                if method_name in self.functions:
                    raise ValueError(f"{what}()'s method {method_name!r} has the name of one of tools; rename one.")
                schemas[method_name] = tool_schema(method, f"{what}()'s method {method_name!r}")
            known = [source.environment_type for source in self.reward_sources]
            if callable(getattr(probe, "get_reward", None)) and type(probe) not in known:
                self.reward_sources.append(EnvironmentReward(type(probe)))
        chat = ChatFormat(tokenizer, list(schemas.values()) or None)  # a template that cannot show the tools fails here
        eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        self.stop_ids = {chat.end_of_turn_id} | eos
        self.has_tools = bool(schemas)

    def check_dataset(self, dataset) -> None:
        """A sized dataset's first row: its ``prompt`` must be a conversation (the tools are shown by the template)."""
        if dataset is None or not hasattr(dataset, "__len__") or len(dataset) == 0:
            return
        prompt = dataset[0].get("prompt")
        if prompt is None and self.factories is not None:
            return  # the environment's reset() writes the task into an empty user message
        if not (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict) and "role" in prompt[0]):
            raise ValueError(
                f"tools and environment_factory need conversational prompts ([{{'role': 'user', 'content': ...}}]): the "
                f"chat template shows the tools to the model; train_dataset[0]['prompt'] is {prompt!r:.80}."
            )

    def episodes(self, ppo_trainer, rows: list[dict], num_generations: int, max_completion_length: int):
        """``num_generations`` episodes per row on the trainer's engine, consecutive per row (whole groups)."""
        return run_episodes(ppo_trainer, rows, tools=self.tools or None, environment_factory=self.environment_factory,
                            max_turns=self.max_turns, max_episode_tokens=max_completion_length,
                            num_generations=num_generations, max_new_tokens=max_completion_length, do_sample=True)  # fmt: skip

    def truncated(self, response: torch.Tensor) -> bool:
        """TRL's rule: a completion whose last token ends no turn (cut by the token budget)."""
        return len(response) == 0 or int(response[-1]) not in self.stop_ids


class EnvironmentReward:
    """An environment class's ``get_reward()`` as a TRL reward function (TRL names it after the class): the value
    of each completion whose environment is of exactly that class, None (not scored) for the others."""

    def __init__(self, environment_type: type):
        self.environment_type = environment_type
        self.__name__ = environment_type.__name__

    def __call__(self, environments=None, **kwargs) -> list[float | None]:
        values = [environment_reward(env, f"completion {i}") if type(env) is self.environment_type else None
                  for i, env in enumerate(environments)]  # fmt: skip
        return [None if value is None or math.isnan(value) else value for value in values]


def with_environment_rewards(sources: list[EnvironmentReward], reward_funcs, reward_weights, processing_classes):
    """TRL's rule: each environment ``get_reward`` is one more reward function (weight 1, no tokenizer) after the
    given ones, which may then be None. Returns ``(reward_funcs, reward_weights, reward_processing_classes)``."""
    if not sources:
        return reward_funcs, reward_weights, processing_classes
    given = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if reward_weights is not None:
        if len(reward_weights) != len(given):
            raise ValueError(f"reward_weights must hold one weight per reward function ({len(given)}; the environments' "
                             f"get_reward weighs 1), got {len(reward_weights)}: {reward_weights}.")  # fmt: skip
        reward_weights = list(reward_weights) + [1.0] * len(sources)
    if isinstance(processing_classes, (list, tuple)):
        processing_classes = list(processing_classes) + [None] * len(sources)
    return given + list(sources), reward_weights, processing_classes


def environment_rows(environment_factory, args) -> list[dict]:
    """TRL's placeholder dataset when ``train_dataset`` is None: the environment writes each task in ``reset()``
    (into an empty user message); one generation's rows, repeated for ``max_steps`` optimizer steps."""
    if environment_factory is None:
        raise ValueError("train_dataset is required (a datasets.Dataset or IterableDataset with a 'prompt' column) "
                         "unless an environment_factory writes the tasks.")  # fmt: skip
    if isinstance(environment_factory, dict):
        raise ValueError("a dict environment_factory needs a train_dataset with an 'environment' column naming each "
                         "row's environment; pass one, or a single factory.")  # fmt: skip
    if args.max_steps <= 0:
        raise ValueError("without a train_dataset (the environment writes the tasks) max_steps must be > 0, got "
                         f"max_steps={args.max_steps}.")  # fmt: skip
    return [{"prompt": [{"role": "user", "content": ""}]} for _ in range(args.generation_batch_size // args.num_generations)]
