"""One GRPO generation: prompts -> ``num_generations`` completions each on the trainer's engine -> rewards -> the
inputs of ``PPOTrainer.step`` and TRL's metrics of the generation.

Rows no reward function scored (all ``None``) and, with ``mask_truncated_completions``, truncated completions are
dropped from the loss (a zero response mask); an unscored row's score is its group's NaN-aware mean, so it adds
nothing to the group's centred rewards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .prompts import completions_of, prompt_ids


@dataclass
class Generation:
    """What one generation hands to ``step()`` (``queries`` repeated per completion), and its metrics."""

    queries: list[torch.Tensor]
    responses: list[torch.Tensor]
    scores: list[torch.Tensor]
    response_masks: list[torch.Tensor] | None
    generation_logprobs: list[torch.Tensor] | None
    metrics: dict[str, float]
    table: dict[str, list] = field(default_factory=dict)

    @property
    def has_actions(self) -> bool:
        """Whether any completion is left in the loss (a step without one would have nothing to train on)."""
        masks = self.response_masks
        return masks is None or any(bool(m.any()) for m in masks)


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased standard deviation over the non-NaN values (NaN with fewer than two). ``(..., n) -> (...)``."""
    values = values if dim is not None else values.reshape(-1)
    dim = -1 if dim is None else dim
    present = ~torch.isnan(values)
    count = present.sum(dim).to(values.dtype)
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    squares = torch.where(present, (values - mean) ** 2, torch.zeros_like(values)).sum(dim)
    return torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.full_like(squares, float("nan"))).sqrt()


class GRPORollout:
    """Makes :class:`Generation` s with a ``PPOTrainer`` (engine and accelerator), a tokenizer and the reward functions.

    ``num_generations``: completions per prompt; ``max_completion_length``: their most tokens; ``mask_truncated``:
    TRL's ``mask_truncated_completions``; ``logprobs``: whether ``step()`` gets the engine's log-probs (TIS).
    """

    def __init__(self, ppo_trainer, tokenizer, rewards, num_generations: int, max_completion_length: int,
                 mask_truncated: bool = False, logprobs: bool = False, chat_template_kwargs: dict | None = None):  # fmt: skip
        self.ppo = ppo_trainer
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.num_generations = num_generations
        self.max_completion_length = max_completion_length
        self.mask_truncated = mask_truncated
        self.logprobs = logprobs
        self.chat_template_kwargs = chat_template_kwargs or {}

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
        metrics = self._metrics(per_func, rewards, responses, truncated, queries, k)
        table = {"prompt": [self.tokenizer.decode(q, skip_special_tokens=True) for q in queries for _ in range(k)],
                 "completion": texts, **{name: per_func[:, j].tolist() for j, name in enumerate(self.rewards.names)}}  # fmt: skip
        return Generation([q for q in queries for _ in range(k)], responses, [torch.tensor(s) for s in scores.tolist()],
                          masks, engine_logprobs, metrics, table)  # fmt: skip

    def _metrics(self, per_func, rewards, responses, truncated, queries, k) -> dict[str, float]:
        """TRL's generation metrics over every process's rows."""
        gather = self.ppo.accelerator.gather
        device = self.ppo.accelerator.device
        lengths = gather(torch.tensor([len(r) for r in responses], device=device)).float().cpu()
        truncated = gather(truncated.to(device)).cpu()
        per_func = gather(per_func.to(device)).cpu()
        rewards = gather(rewards.to(device)).cpu()
        tokens = gather(torch.tensor(sum(len(q) for q in queries) * k + int(lengths.sum()), device=device)).sum()
        terminated = lengths[~truncated]
        metrics = {
            "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.float().mean().item(),
            "completions/mean_terminated_length": terminated.mean().item() if len(terminated) else 0.0,
            "completions/min_terminated_length": terminated.min().item() if len(terminated) else 0.0,
            "completions/max_terminated_length": terminated.max().item() if len(terminated) else 0.0,
        }  # fmt: skip
        for j, name in enumerate(self.rewards.names):
            metrics[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, j]).item()
            metrics[f"rewards/{name}/std"] = nanstd(per_func[:, j]).item()
        metrics["reward"] = torch.nanmean(rewards).item()
        metrics["reward_std"] = nanstd(rewards).item()
        group_std = nanstd(rewards.view(-1, k), dim=1)
        metrics["frac_reward_zero_std"] = torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item()
        metrics["_tokens"] = float(tokens)
        return metrics


def _scores_for_step(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """The rewards with each unscored (NaN) row set to its group's NaN-aware mean (0 for a group with none scored).
    Shape: ``(rows,) -> (rows,)``, rows in groups of ``k``."""
    grouped = rewards.view(-1, k)
    means = torch.nanmean(grouped, dim=1, keepdim=True).nan_to_num(0.0).expand_as(grouped)
    return torch.where(torch.isnan(grouped), means, grouped).reshape(-1)

