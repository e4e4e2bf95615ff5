"""GRPO's reward functions as TRL 1.x takes them: callables ``f(prompts, completions, completion_ids, **columns)
-> list[float | None]`` (async ones too), sequence-classification models or their paths, a mix, with weights.

:class:`RewardFunctions` calls each on a generation batch and returns a ``(rows, functions)`` float tensor
with NaN where a function returned ``None``; every output is checked (a raise, a wrong length, a value that is
no number) and the error names the function, the row and what it returned - before the trainer changes any weight.
``combine`` is TRL's rule: the weighted NaN-aware sum, NaN for a row no function scored.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from .prompts import is_conversational


class RewardFunctions:
    """The run's reward functions, their names (TRL's: ``__name__``, or the model's name) and weights.

    ``reward_funcs``: one or a list of callables / ``PreTrainedModel``s / model paths. ``reward_weights``: None
    (all 1.0) or one float per function. ``reward_processing_classes``: None, one tokenizer or a list with one entry
    per function (None where the function is a callable, or to load the model's own tokenizer).
    """

    def __init__(self, reward_funcs, reward_weights=None, reward_processing_classes=None, model_init_kwargs=None,
                 chat_template_kwargs=None):  # fmt: skip
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs must hold at least one reward function or model, got an empty list.")
        self.funcs = [self._load(f, i, model_init_kwargs or {}) for i, f in enumerate(funcs)]
        self.names = [_name(f) for f in self.funcs]
        if reward_weights is None:
            reward_weights = [1.0] * len(self.funcs)
        if len(reward_weights) != len(self.funcs):
            raise ValueError(f"reward_weights must hold one weight per reward function ({len(self.funcs)}), got "
                             f"{len(reward_weights)}: {reward_weights}.")  # fmt: skip
        self.weights = torch.tensor([float(w) for w in reward_weights], dtype=torch.float32)
        self.processing_classes = self._processing_classes(reward_processing_classes)
        self.chat_template_kwargs = chat_template_kwargs or {}

    @staticmethod
    def _load(func, index: int, model_init_kwargs: dict):
        if isinstance(func, str):
            return AutoModelForSequenceClassification.from_pretrained(func, num_labels=1, **model_init_kwargs).eval()
        if isinstance(func, PreTrainedModel):
            return func.eval()
        if not callable(func):
            raise TypeError(f"reward_funcs[{index}] must be a callable, a PreTrainedModel or a model path, got "
                            f"{type(func).__name__}.")  # fmt: skip
        return func

    def _processing_classes(self, given) -> list:
        given = given if isinstance(given, (list, tuple)) else [given] * len(self.funcs)
        if len(given) != len(self.funcs):
            raise ValueError(f"reward_processing_classes must hold one entry per reward function ({len(self.funcs)}), "
                             f"got {len(given)}.")  # fmt: skip
        classes = []
        for func, tokenizer in zip(self.funcs, given):
            if isinstance(func, PreTrainedModel):
                tokenizer = tokenizer or AutoTokenizer.from_pretrained(func.config._name_or_path)
                if tokenizer.pad_token_id is None:
                    tokenizer.pad_token = tokenizer.eos_token
                func.config.pad_token_id = tokenizer.pad_token_id
            classes.append(tokenizer if isinstance(func, PreTrainedModel) else None)
        return classes

    def to(self, device) -> RewardFunctions:
        """Move the reward models to ``device``."""
        for func in self.funcs:
            if isinstance(func, PreTrainedModel):
                func.to(device)
        return self

    def __call__(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict,
                 **extra) -> torch.Tensor:  # fmt: skip
        """The rewards of each row by each function: ``(rows, functions)`` float32, NaN where one returned None.

        ``columns``: the dataset's other columns, one value per row, passed as keyword arguments (``extra`` too:
        TRL's ``trainer_state``, ``log_extra`` and ``log_metric``).
        """
        rows = len(prompts)
        out = torch.full((rows, len(self.funcs)), math.nan, dtype=torch.float32)
        kwargs = {**columns, **extra}
        pending = {}
        for j, func in enumerate(self.funcs):
            if isinstance(func, PreTrainedModel):
                out[:, j] = self._model_rewards(func, self.processing_classes[j], prompts, completions)
            elif inspect.iscoroutinefunction(func):
                pending[j] = func
            else:
                values = self._run(j, lambda f=func: f(prompts=prompts, completions=completions,
                                                       completion_ids=completion_ids, **kwargs))  # fmt: skip
                out[:, j] = self._checked(j, values, rows)
        if pending:
            async def gather():
                return await asyncio.gather(*(
                    f(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
                    for f in pending.values()
                ), return_exceptions=True)  # fmt: skip

            for j, values in zip(pending, asyncio.run(gather())):
                if isinstance(values, Exception):
                    raise self._raised(j, values) from values
                out[:, j] = self._checked(j, values, rows)
        return out

    def _run(self, j: int, call):
        try:
            return call()
        except Exception as error:
            raise self._raised(j, error) from error

    def _raised(self, j: int, error: Exception) -> RuntimeError:
        return RuntimeError(f"reward function {self.names[j]!r} (reward_funcs[{j}]) raised {type(error).__name__}: {error}")

    def _checked(self, j: int, values, rows: int) -> torch.Tensor:
        """``values`` as a float tensor, None as NaN; ``ValueError``/``TypeError`` naming the function and row."""
        name = f"reward function {self.names[j]!r} (reward_funcs[{j}])"
        if not isinstance(values, (list, tuple)) and not (isinstance(values, torch.Tensor) and values.ndim == 1):
            raise TypeError(f"{name} must return a list of {rows} floats (or None), got {type(values).__name__}: {values!r}.")
        if len(values) != rows:
            raise ValueError(f"{name} must return one reward per completion ({rows}), got {len(values)}: {values!r}.")
        result = []
        for row, value in enumerate(values):
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if value is None:
                result.append(math.nan)
            elif isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
                result.append(float(value))
            else:
                raise ValueError(f"{name} returned {value!r} for row {row}: a reward must be a finite number or None.")
        return torch.tensor(result, dtype=torch.float32)

    @torch.no_grad()
    def _model_rewards(self, model, tokenizer, prompts: list, completions: list) -> torch.Tensor:
        """A sequence classifier's first logit on prompt + completion (the chat template for conversations)."""
        if is_conversational(prompts[0]):
            texts = [tokenizer.apply_chat_template(p + c, tokenize=False, **self.chat_template_kwargs)
                     for p, c in zip(prompts, completions)]  # fmt: skip
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        device = next(model.parameters()).device
        return model(**{k: v.to(device) for k, v in inputs.items()}).logits[:, 0].float().cpu()

    def combine(self, per_func: torch.Tensor) -> torch.Tensor:
        """TRL's rule: ``sum_j w_j r_j`` over the functions that scored the row (NaN counts as absent), NaN for a
        row that no function scored. Shape: ``(rows, functions) -> (rows,)``."""
        rewards = (per_func * self.weights.unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(per_func).all(dim=1)] = math.nan
        return rewards


class RewardLog:
    """What reward functions log during one generation through TRL's keyword arguments: ``log_extra(column,
    values)`` (columns of the completions table, one value per completion) and ``log_metric(name, value)`` (a
    scalar; the generation's value is the mean of what was logged under the name on every process)."""

    def __init__(self):
        self.columns: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values) -> None:
        self.columns.setdefault(str(column), []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def kwargs(self) -> dict:
        """The keyword arguments that TRL 1.x passes to every reward function."""
        return {"log_extra": self.log_extra, "log_metric": self.log_metric}

    def sums(self) -> dict[str, tuple[float, int]]:
        """Per metric name: the sum and the count of the values logged on this process."""
        return {name: (sum(values), len(values)) for name, values in self.metrics.items()}


def mean_logged_metrics(per_process: list[dict[str, tuple[float, int]]]) -> dict[str, float]:
    """One generation's logged metrics over processes (each its :meth:`RewardLog.sums`): total / count per name."""
    totals: dict[str, list[float]] = {}
    for sums in per_process:
        for name, (total, count) in sums.items():
            entry = totals.setdefault(name, [0.0, 0])
            entry[0] += total
            entry[1] += count
    return {name: total / count for name, (total, count) in sorted(totals.items()) if count}


def _name(func) -> str:
    if isinstance(func, PreTrainedModel):
        return func.config._name_or_path.rstrip("/").split("/")[-1]
    return getattr(func, "__name__", type(func).__name__)
