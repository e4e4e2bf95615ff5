"""One GRPO generation: prompts -> ``num_generations`` completions each on the trainer's engine -> rewards -> the
inputs of ``PPOTrainer.step`` and TRL's metrics of the generation.

Rows no reward function scored (all ``None``) and, with ``mask_truncated_completions``, truncated completions are
dropped from the loss (a zero response mask); an unscored row's score is its group's NaN-aware mean, so it adds
nothing to the group's centred rewards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..step.transfer import to_host_together
from .prompts import completions_of, prompt_ids


@dataclass
class Generation:
    """What one generation hands to ``step()`` (``queries`` repeated per completion, on the host), and the host
    table of this process's rows that TRL's metrics are made from (:meth:`GRPORollout.metrics`)."""

    queries: list[torch.Tensor]
    responses: list[torch.Tensor]
    scores: list[torch.Tensor]
    response_masks: list[torch.Tensor] | None
    generation_logprobs: list[torch.Tensor] | None
    metric_rows: torch.Tensor
    table: dict[str, list] = field(default_factory=dict)

    @property
    def has_actions(self) -> bool:
        """Whether any completion is left in the loss (a step without one would have nothing to train on)."""
        masks = self.response_masks
        return masks is None or any(bool(m.any()) for m in masks)


class GRPORollout:
    """Makes :class:`Generation` s with a ``PPOTrainer`` (engine and accelerator), a tokenizer and the reward functions.

    ``num_generations``: completions per prompt; ``max_completion_length``: their most tokens; ``mask_truncated``:
    TRL's ``mask_truncated_completions``; ``logprobs``: whether ``step()`` gets the engine's log-probs (TIS);
    ``keep_table``: whether each generation keeps its texts and rewards for ``log_completions``.
    """

    def __init__(self, ppo_trainer, tokenizer, rewards, num_generations: int, max_completion_length: int,
                 mask_truncated: bool = False, logprobs: bool = False, chat_template_kwargs: dict | None = None,
                 keep_table: bool = False):  # fmt: skip
        self.ppo = ppo_trainer
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.num_generations = num_generations
        self.max_completion_length = max_completion_length
        self.mask_truncated = mask_truncated
        self.logprobs = logprobs
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.keep_table = keep_table

    def run(self, rows: list[dict], num_generations: int | None = None, **reward_kwargs) -> Generation:
        """Generate, decode and score ``num_generations`` (default: the run's) completions per row."""
        k = num_generations or self.num_generations
        prompts = [row["prompt"] for row in rows]
        queries = prompt_ids(self.tokenizer, prompts, self.chat_template_kwargs)
        out = self.ppo.generate(
            queries, return_prompt=False, batch_size=len(queries), return_logprobs=self.logprobs, do_sample=True,
            max_new_tokens=self.max_completion_length, num_return_sequences=k,
        )  # fmt: skip
        responses, engine_logprobs = (out[0], out[-1]) if self.logprobs else (out, None)
        responses = to_host_together(responses)  # one copy back for decoding and rewards, no read per row
        repeated = [p for p in prompts for _ in range(k)]
        columns = {key: [row[key] for row in rows for _ in range(k)] for key in rows[0] if key not in ("prompt", "completion", "completion_ids")}  # fmt: skip
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        completions = completions_of(prompts, texts)
        per_func = self.rewards(repeated, completions, [r.tolist() for r in responses], columns, **reward_kwargs)
        rewards = self.rewards.combine(per_func)
        eos = set(self.ppo._eos_ids)
        truncated = torch.tensor([len(r) == 0 or int(r[-1]) not in eos for r in responses])
        scores = _scores_for_step(rewards, k)
        dropped = torch.isnan(rewards) | (truncated if self.mask_truncated else torch.zeros_like(truncated))
        masks = [torch.full_like(r, 0 if drop else 1) for r, drop in zip(responses, dropped.tolist())] if dropped.any() else None
        metric_rows = _metric_rows(per_func, rewards, responses, truncated, queries, k)
        table = {}
        if self.keep_table:  # log_completions: the prompts and completions as text, with each function's reward
            table = {"prompt": [text for text in self.tokenizer.batch_decode(queries, skip_special_tokens=True) for _ in range(k)],
                     "completion": texts, **{name: per_func[:, j].tolist() for j, name in enumerate(self.rewards.names)}}  # fmt: skip
        return Generation([q for q in queries for _ in range(k)], responses, [torch.tensor(s) for s in scores.tolist()],
                          masks, engine_logprobs, metric_rows, table)  # fmt: skip

    def metrics(self, metric_rows: list[torch.Tensor], k: int) -> list[dict[str, float]]:
        """TRL's metrics of each generation of ``metric_rows`` (their :attr:`Generation.metric_rows`, all of one
        shape) over every process's rows: on several processes one gather of all of them (one device copy each
        way), on one none. ``k``: completions per prompt. Each dict also holds ``_tokens`` (prompt + completion)."""
        table = torch.stack(metric_rows, 1)  # (rows, generations, columns)
        accelerator = self.ppo.accelerator
        if accelerator.num_processes > 1:
            table = accelerator.gather(table.to(accelerator.device, non_blocking=True)).cpu()
        return [self._metrics(table[:, g].numpy(), k) for g in range(table.shape[1])]

    def _metrics(self, table, k: int) -> dict[str, float]:
        """TRL's metrics of one generation's ``(rows, 4 + functions)`` table of every process."""
        lengths, truncated, tokens, rewards, per_func = table[:, 0], table[:, 1] > 0, table[:, 2], table[:, 3], table[:, 4:]
        terminated = lengths[~truncated]
        metrics = {
            "completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(), "completions/clipped_ratio": truncated.mean(),
            "completions/mean_terminated_length": terminated.mean() if len(terminated) else 0.0,
            "completions/min_terminated_length": terminated.min() if len(terminated) else 0.0,
            "completions/max_terminated_length": terminated.max() if len(terminated) else 0.0,
        }  # fmt: skip
        for j, name in enumerate(self.rewards.names):
            metrics[f"rewards/{name}/mean"], metrics[f"rewards/{name}/std"] = _nan_mean_std(per_func[:, j])
        metrics["reward"], metrics["reward_std"] = _nan_mean_std(rewards)
        group_std = [_nan_mean_std(group)[1] for group in rewards.reshape(-1, k)]
        metrics["frac_reward_zero_std"] = sum(abs(std) < 1e-8 for std in group_std) / len(group_std)
        metrics = {name: float(value) for name, value in metrics.items()}
        metrics["_tokens"] = float(tokens.sum())
        return metrics


def _metric_rows(per_func, rewards, responses, truncated, queries, k) -> torch.Tensor:
    """This process's rows of a generation as one float64 host table ``(rows, 4 + functions)``: length, truncated,
    tokens (prompt + completion), reward, then each function's reward."""
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.float64)
    tokens = torch.tensor([len(q) for q in queries], dtype=torch.float64).repeat_interleave(k) + lengths
    return torch.cat([torch.stack([lengths, truncated.double(), tokens, rewards.double()], 1), per_func.double()], 1)


def _nan_mean_std(values: np.ndarray) -> tuple[float, float]:
    """Mean and unbiased standard deviation over the non-NaN values (NaN where there are too few)."""
    present = values[~np.isnan(values)]
    mean = present.mean() if len(present) else math.nan
    return mean, (math.sqrt(((present - mean) ** 2).sum() / (len(present) - 1)) if len(present) > 1 else math.nan)


def _scores_for_step(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """The rewards with each unscored (NaN) row set to its group's NaN-aware mean (0 for a group with none scored).
    Shape: ``(rows,) -> (rows,)``, rows in groups of ``k``."""
    grouped = rewards.view(-1, k)
    means = torch.nanmean(grouped, dim=1, keepdim=True).nan_to_num(0.0).expand_as(grouped)
    return torch.where(torch.isnan(grouped), means, grouped).reshape(-1)

