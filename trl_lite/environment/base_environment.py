"""Text environments: a language model that calls tools in ``<request><Tool>...<call>`` form, turn by turn.

An episode starts from ``prompt + task``. Each turn the model generates until it writes ``<call>``
(a tool request) or ``<submit>`` (its answer); a request is answered by the tool, and the answer is
appended with ``<response>``. The :class:`TextHistory` of an episode gives what ``PPOTrainer.step``
takes: the query tokens, the response tokens, and a response mask that is 1 on model tokens and 0
on tool output, so the tool's text is not trained on.

Given a ``PPOTrainer`` (or a generation engine) instead of a model, the turns are generated on the
trainer's engine - transformers or vLLM - after its weight push, and each turn is cut after the
token that completed ``<call>`` or ``<submit>``: with greedy decoding the episodes are those of the
model itself. For chat models with tools and environments see :mod:`trl_lite.agents`.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.utils import is_rich_available

from ..engines import GenerationEngine
from ..engines.generation import RolloutGeneration, eval_mode


class StringStoppingCriteria(StoppingCriteria):
    """Stops each generated row once its new text contains one of ``stop_strings``.

    ``generated_tokens[i]`` is the number of new tokens of row ``i`` up to and including the one
    that completed a stop string (all new tokens when none did). One instance serves one
    ``generate`` call: it starts counting at the first call it sees after it was made or after every
    row stopped.
    """

    def __init__(self, stop_strings: Sequence[str], tokenizer):
        if isinstance(stop_strings, str) or not stop_strings:
            raise ValueError(f"stop_strings must be a non-empty list of strings, got {stop_strings!r}.")
        self.stop_strings = list(stop_strings)
        self.tokenizer = tokenizer
        self.first_call = True

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        """Per row: has its generated text (the columns added since the first call) a stop string? Shape ``(B,)``."""
        if self.first_call:
            # The first call sees the prompt plus one new token.
            self.start_length = input_ids.shape[-1] - 1
            self.generated_tokens = [1] * input_ids.shape[0]
            self.done = [False] * input_ids.shape[0]
            self.first_call = False
        open_rows = [i for i, finished in enumerate(self.done) if not finished]
        texts = self.tokenizer.batch_decode(input_ids[open_rows, self.start_length :])
        for row, text in zip(open_rows, texts):
            if any(stop in text for stop in self.stop_strings):
                self.done[row] = True
            else:
                self.generated_tokens[row] += 1
        if all(self.done):
            self.first_call = True
        return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)


class TextHistory:
    """The text and tokens of one episode, segment by segment, with who wrote each segment.

    System segments (the prompt and task, tool responses) get token mask 0, model segments mask 1.
    ``reward`` is set by :meth:`TextEnvironment.compute_reward`.
    """

    def __init__(self, text: str, tokens: torch.Tensor, system: bool = True):
        self.system_spans: list[bool] = []
        self.text_spans: list[tuple[int, int]] = []
        self.token_spans: list[tuple[int, int]] = []
        self.token_masks = torch.tensor([], dtype=torch.long, device=tokens.device)
        self.text = ""
        self.tokens = torch.tensor([], dtype=torch.long, device=tokens.device)
        self.completed = False
        self.truncated = False
        self.reward = 0.0

        self.prompt_color = "black on grey85"
        self.system_color = "black on cyan3"
        self.model_color = "black on deep_sky_blue1"
        self.reward_color = "black on plum1"

        self.append_segment(text, tokens, system=system)

    def append_segment(self, text: str, tokens: torch.Tensor, system: bool = True) -> None:
        """Add a segment: its text, its 1-D tokens, and whether the environment (True) or the model wrote it."""
        if len(text) == 0 or len(tokens) == 0:
            raise ValueError(f"TextHistory.append_segment needs non-empty text and tokens, got {len(text)} characters and {len(tokens)} tokens.")
        if tokens.ndim != 1:
            raise ValueError(f"TextHistory.append_segment needs 1-D tokens, got shape {tuple(tokens.shape)}.")
        start = len(self.text)
        self.text += text
        self.text_spans.append((start, len(self.text)))
        self.system_spans.append(system)

        start = len(self.tokens)
        self.tokens = torch.cat((self.tokens, tokens.to(self.tokens.device, torch.long)))
        mask = torch.zeros_like(tokens) if system else torch.ones_like(tokens)
        self.token_masks = torch.cat((self.token_masks, mask.to(self.token_masks.device, torch.long)))
        self.token_spans.append((start, len(self.tokens)))

    def complete(self, truncated: bool = False) -> None:
        """Mark the episode finished (``truncated`` when it hit the environment's ``max_length``)."""
        self.completed = True
        self.truncated = truncated

    @property
    def last_text_segment(self) -> str:
        start, end = self.text_spans[-1]
        return self.text[start:end]

    def split_query_response_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(query, response, mask)``: the first segment's tokens, all later tokens, and their 0/1 mask (1 = model)."""
        split = self.token_spans[0][1]
        return self.tokens[:split], self.tokens[split:], self.token_masks[split:]

    def _rich(self, what: str):
        """rich's ``Console`` and ``Text``, or None (with a warning) when rich is not installed."""
        if not is_rich_available():
            warnings.warn(f"Install rich (`pip install rich`) to display {what}.", stacklevel=3)
            return None
        from rich.console import Console
        from rich.text import Text

        return Console(), Text

    def show_text(self, show_legend: bool = False) -> None:
        """Display the episode's text with rich, coloured by who wrote each segment, and its reward."""
        rich = self._rich("text")
        if rich is None:
            return
        console, Text = rich
        text = Text(self.text)
        for index, (start, end) in enumerate(self.text_spans):
            color = self.prompt_color if index == 0 else self.system_color if self.system_spans[index] else self.model_color
            text.stylize(color, start, end)
        text.append(f"\n\nReward: {self.reward}", style=self.reward_color)
        console.print(text)
        if show_legend:
            self.show_colour_legend()

    def show_tokens(self, tokenizer, show_legend: bool = False) -> None:
        """Display the episode's tokens with rich, coloured as in :meth:`show_text`."""
        rich = self._rich("tokens")
        if rich is None:
            return
        console, Text = rich
        text = Text()
        prompt_end = self.token_spans[0][1]
        for index, (token, mask) in enumerate(zip(self.tokens.tolist(), self.token_masks.tolist())):
            color = self.prompt_color if index < prompt_end else self.model_color if mask else self.system_color
            text.append(tokenizer.convert_ids_to_tokens(token), style=color)
            text.append(" ")
        text.append(f"\n\nReward: {self.reward}", style=self.reward_color)
        console.print(text)
        if show_legend:
            self.show_colour_legend()

    def show_colour_legend(self) -> None:
        """Display which colour marks the prompt, the system, the model and the reward."""
        rich = self._rich("the colour legend")
        if rich is None:
            return
        console, Text = rich
        text = Text("\n\n(Colour Legend: ")
        for index, (name, color) in enumerate(
            [("Prompt", self.prompt_color), ("System", self.system_color), ("Model", self.model_color), ("Reward", self.reward_color)]
        ):
            text.append("|" if index else "")
            text.append(name, style=color)
        text.append(")")
        console.print(text)


def _tool_name(tool) -> str:
    """A tool's name in ``<request><Name>``: a function's ``__name__``, else its class name (classic)."""
    return getattr(tool, "__name__", None) or type(tool).__name__


class TextEnvironment:
    """Runs a model on tasks, turn by turn, letting it call tools, and scores the episodes.

    Args:
        model: a value-head wrapper (or the model ``PPOTrainer`` prepared), used for ``generate``; or a
            ``PPOTrainer``, whose engine generates (vLLM with ``use_vllm=True``); or a ``GenerationEngine``.
        tokenizer: its tokenizer.
        tools: ``{name: callable}`` or a list of callables (named by ``__name__``, or class name for
            callable objects); each maps the request text to a response text (``str -> str``).
        reward_fn: ``(last text segments, **reward_kwargs) -> rewards``, one per episode.
        prompt: text put before every task (``""`` when None).
        max_turns: model turns per episode at most.
        max_tool_response: tool responses longer than this many characters are cut and end in ``...``.
        max_length: an episode whose tokens exceed this many ends, marked truncated.
        generation_kwargs: passed to ``generate``; a ``stopping_criteria`` in it is replaced (on a
            model). On an engine they go to the engine (which refuses what it cannot map) and
            ``max_new_tokens`` bounds each turn.
        max_tool_reponse: classic's spelling of ``max_tool_response``, accepted as a keyword.
    """

    def __init__(
        self,
        model=None,
        tokenizer=None,
        tools: Mapping[str, Callable[[str], str]] | Sequence[Callable[[str], str]] | None = None,
        reward_fn: Callable | None = None,
        prompt: str | None = None,
        max_turns: int = 4,
        max_tool_response: int = 100,
        max_length: int | None = None,
        generation_kwargs: dict | None = None,
        *,
        max_tool_reponse: int | None = None,
    ):
        if model is None or tokenizer is None or reward_fn is None:
            raise ValueError("TextEnvironment needs a model, a tokenizer and a reward_fn; got None for " + ", ".join(
                name for name, value in (("model", model), ("tokenizer", tokenizer), ("reward_fn", reward_fn)) if value is None))
        tools = {} if tools is None else tools
        tools = dict(tools) if isinstance(tools, Mapping) else {_tool_name(tool): tool for tool in tools}
        for name, tool in tools.items():
            if not callable(tool):
                raise TypeError(f"tools[{name!r}] must be a callable str -> str, got {type(tool).__name__}.")
        if max_tool_reponse is not None:
            max_tool_response = max_tool_reponse
        if max_tool_response < 4:
            raise ValueError(f"max_tool_response must be at least 4 characters (room for '...'), got {max_tool_response}.")
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}.")

        self.model = model
        self.tokenizer = tokenizer
        self.tools = tools
        self.reward_fn = reward_fn
        self.prompt = prompt or ""
        self.max_turns = max_turns
        self.max_tool_response = max_tool_response
        self.max_length = max_length
        self.generation_kwargs = dict(generation_kwargs or {})
        self.request_token = "<request>"
        self.call_token = "<call>"
        self.response_token = "<response>"
        self.submit_token = "<submit>"
        if isinstance(getattr(model, "generation", None), RolloutGeneration):  # a PPOTrainer
            self._engine_generate = lambda queries, batch_size: model.generate(
                queries, batch_size=batch_size, return_prompt=False, **self.generation_kwargs
            )
            self.is_encoder_decoder = model.is_encoder_decoder
            self.current_device = model.accelerator.device
        elif isinstance(model, GenerationEngine):
            self._engine_generate = lambda queries, batch_size: model.generate(
                queries, dict(self.generation_kwargs), None, batch_size, False, True, False
            )[0]
            self.is_encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
            accelerator = getattr(model, "accelerator", None)
            self.current_device = accelerator.device if accelerator is not None else torch.device("cpu")
        else:
            self._engine_generate = None
            unwrapped = extract_model_from_parallel(model)
            self.is_encoder_decoder = bool(getattr(unwrapped, "is_encoder_decoder", False))
            self.current_device = next(unwrapped.parameters()).device

    def _encode(self, text: str, add_special_tokens: bool = True) -> torch.Tensor:
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens).input_ids[0]
        return ids.to(self.current_device)

    def run(self, queries: Sequence[str], **rewards_kwargs):
        """Run one episode per task; return ``queries, responses, masks, rewards, histories`` (lists, one entry per task).

        ``queries[i]`` (tokens of prompt + task), ``responses[i]`` and ``masks[i]`` are what
        ``PPOTrainer.step(queries, responses, rewards, masks)`` takes; their tensors sit on ``current_device``
        (the trainer's accelerator device, or the model's), as classic TRL's.
        """
        texts = [self.prompt + task for task in queries]
        histories = [TextHistory(text, self._encode(text), system=True) for text in texts]
        turns = 0
        while any(not history.completed for history in histories) and turns < self.max_turns:
            histories = self.generate(histories)
            histories = self.tasks_end_check(histories)
            histories = [self.step(history) for history in histories]
            histories = self.tasks_end_check(histories, model_turn=False)
            turns += 1
        self.compute_reward(histories, **rewards_kwargs)
        queries, responses, masks = map(list, zip(*[history.split_query_response_tokens() for history in histories]))
        rewards = [history.reward for history in histories]
        return queries, responses, masks, rewards, histories

    def step(self, history: TextHistory) -> TextHistory:
        """Answer the tool request of the history's last segment (unless the episode ended)."""
        truncated, ended = self.task_end_check(history)
        if ended:
            history.complete(truncated=truncated)
        if history.completed:
            return history

        tool, query = self.parse_tool_call(history.last_text_segment)
        if tool is None or query is None:
            response = f"Unknown tool call: {history.last_text_segment}"
        elif tool not in self.tools:
            response = f"Unknown tool {tool}."
        else:
            try:
                response = str(self.tools[tool](query))
            except Exception as error:  # a tool's failure is the model's feedback, not the run's end
                response = f"Tool error: {error}"
        if len(response) > self.max_tool_response:
            response = response[: self.max_tool_response - 3] + "..."
        text = response + self.response_token
        history.append_segment(text, self._encode(text, add_special_tokens=False), system=True)
        return history

    def parse_tool_call(self, text: str) -> tuple[str | None, str | None]:
        """``"...<request><Tool>query<call>..."`` -> ``("Tool", "query")``; ``(None, None)`` when absent."""
        request = re.search(f"(?<={re.escape(self.request_token)}).*?(?={re.escape(self.call_token)})", text, re.DOTALL)
        if request is None:
            return None, None
        name = re.search(r"<(.*?)>", request.group())
        if name is None:
            return None, None
        return name.group(1), request.group()[name.end():]

    def compute_reward(self, histories: list[TextHistory], **reward_kwargs) -> list[TextHistory]:
        """Set each history's ``reward`` from ``reward_fn`` applied to the histories' last segments."""
        rewards = self.reward_fn([history.last_text_segment for history in histories], **reward_kwargs)
        if len(rewards) != len(histories):
            raise ValueError(f"reward_fn must return one reward per episode: got {len(rewards)} for {len(histories)} episodes.")
        for history, reward in zip(histories, rewards):
            history.reward = reward
        return histories

    def generate(self, histories: list[TextHistory]) -> list[TextHistory]:
        """Let the model write its next segment in every unfinished history."""
        active = [i for i, history in enumerate(histories) if not history.completed]
        responses = self._generate_batched([histories[i].tokens for i in active])
        texts = self.tokenizer.batch_decode(responses)
        for i, text, tokens in zip(active, texts, responses):
            histories[i].append_segment(text, tokens, system=False)
        return histories

    def tasks_end_check(self, histories: list[TextHistory], model_turn: bool = True) -> list[TextHistory]:
        """Mark every history that :meth:`task_end_check` finds finished as completed."""
        for history in histories:
            if not history.completed:
                truncated, ended = self.task_end_check(history, model_turn=model_turn)
                if ended:
                    history.complete(truncated=truncated)
        return histories

    def task_end_check(self, history: TextHistory, model_turn: bool = True) -> tuple[bool, bool]:
        """``(truncated, ended)``: too long, end of text, a submitted answer, or (after a model turn) no tool call."""
        if history.completed:
            return False, False
        if self.max_length is not None and len(history.tokens) > self.max_length:
            return True, True
        eos = self.tokenizer.eos_token
        if eos and eos in history.text:
            return False, True
        last = history.last_text_segment
        if self.submit_token in last:
            return False, True
        called = self.request_token in last and self.call_token in last
        return False, model_turn and not called

    def _generate_batched(self, query_tensors: list[torch.Tensor], batch_size: int = 16, pad_to_multiple_of: int | None = None):
        """New tokens of each query, up to and including the one that wrote ``<call>`` or ``<submit>``.

        Decoder-only queries are left-padded so new tokens start at one column. Runs in eval mode
        (every submodule's mode is restored after). Tokens after an end-of-sequence token are padding and
        are dropped.
        """
        if self._engine_generate is not None:
            return self._generate_on_engine(query_tensors, batch_size)
        model = extract_model_from_parallel(self.model)
        eos_id = self.tokenizer.eos_token_id
        padding_side = self.tokenizer.padding_side
        if not self.is_encoder_decoder:
            self.tokenizer.padding_side = "left"
        outputs = []
        try:
            for start in range(0, len(query_tensors), batch_size):
                batch = query_tensors[start : start + batch_size]
                padded = self.tokenizer.pad(
                    {"input_ids": batch, "attention_mask": [torch.ones_like(q) for q in batch]},
                    padding=True, pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt",
                ).to(self.current_device)
                stopping = StringStoppingCriteria([self.call_token, self.submit_token], self.tokenizer)
                kwargs = {**self.generation_kwargs, "stopping_criteria": StoppingCriteriaList([stopping])}
                with eval_mode(model), torch.no_grad():
                    generations = model.generate(**padded, **kwargs)
                # Decoder-only output = prompt columns + new tokens; encoder-decoder output = start token + new tokens.
                first_new = 1 if self.is_encoder_decoder else padded["input_ids"].shape[1]
                for row, count in enumerate(stopping.generated_tokens):
                    new = generations[row, first_new : first_new + count]
                    if eos_id is not None and (new == eos_id).any():
                        new = new[: int((new == eos_id).nonzero()[0]) + 1]
                    outputs.append(new)
        finally:
            self.tokenizer.padding_side = padding_side
        return outputs

    def _generate_on_engine(self, query_tensors: list[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
        """:meth:`_generate_batched` on the engine: every query's tokens up to its first EOS, cut after the
        token whose text completed ``<call>`` or ``<submit>`` (where the stopping criteria would have stopped)."""
        responses = self._engine_generate(list(query_tensors), batch_size)
        return [response[: self._stop_length(response)] for response in responses]

    def _stop_length(self, tokens: torch.Tensor) -> int:
        """Tokens up to and including the one after which the decoded text first holds a stop string."""
        stops = (self.call_token, self.submit_token)
        if not any(stop in self.tokenizer.decode(tokens) for stop in stops):
            return len(tokens)
        return next(n for n in range(1, len(tokens) + 1) if any(stop in self.tokenizer.decode(tokens[:n]) for stop in stops))
