"""One GRPO generation: prompts -> ``num_generations`` completions each on the trainer's engine -> rewards -> the
inputs of ``PPOTrainer.step`` and TRL's metrics of the generation.

A row no reward function scored (all ``None``) goes to ``step()`` with a NaN score: it stays in the loss with
advantage 0 and is left out of its group's mean and std (TRL 1.x's rule, docs/algorithm_objectives.md section 12).
With ``mask_truncated_completions``, truncated completions are dropped from the loss (a zero response mask). With TRL's ``tools`` / ``environment_factory`` each completion is a
multi-turn episode (:mod:`.agents`): the tool and template tokens are out of the loss and out of the lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..step.transfer import to_host_together
from .prompts import completions_of, prompt_ids
from .rewards import RewardLog


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
    group_ids: list[int] | None = None  # multi-turn episodes: a group is its prompt (its members' queries may differ)
    kept_sets: list | None = None  # multi-turn episodes under truncated sampling: their samplers' kept sets
    reward_metrics: dict = field(default_factory=dict)  # log_metric: name -> (sum, count) on this process

    @property
    def has_actions(self) -> bool:
        """Whether any completion is left in the loss (a step without one would have nothing to train on)."""
        masks = self.response_masks
        return masks is None or any(bool(m.any()) for m in masks)


@dataclass
class Sampled:
    """The completions of one generation before scoring, one entry per completion (``k`` consecutive per row).

    ``model_masks``: 1 on the tokens the model sampled (None: all of them); ``prompts``/``completions``: what the
    reward functions get; ``texts``: the completions as text (the completions table); ``tool_counts``: tool calls
    and failed calls per completion, or None without tools."""

    queries: list[torch.Tensor]
    responses: list[torch.Tensor]
    logprobs: list[torch.Tensor] | None
    model_masks: list[torch.Tensor] | None
    prompts: list
    completions: list
    texts: list[str]
    truncated: torch.Tensor
    reward_kwargs: dict = field(default_factory=dict)
    tool_counts: tuple[torch.Tensor, torch.Tensor] | None = None
    kept_sets: list | None = None  # episodes' (docs/truncated_sampling.md); single-turn: step() finds the engine's


class GRPORollout:
    """Makes :class:`Generation` s with a ``PPOTrainer`` (engine and accelerator), a tokenizer and the reward functions.

    ``num_generations``: completions per prompt; ``max_completion_length``: their most tokens; ``mask_truncated``:
    TRL's ``mask_truncated_completions``; ``logprobs``: whether ``step()`` gets the engine's log-probs (TIS);
    ``keep_table``: whether each generation keeps its texts and rewards for ``log_completions``; ``agents``: an
    :class:`.agents.AgentRollouts` (TRL's ``tools`` / ``environment_factory``) or None for single-turn completions;
    ``batch_scale``: TRL's ``scale_rewards="batch"``, whose ``frac_reward_zero_std`` is whether the whole
    generation's rewards have no spread (1 or 0).
    """

    def __init__(self, ppo_trainer, tokenizer, rewards, num_generations: int, max_completion_length: int,
                 mask_truncated: bool = False, logprobs: bool = False, chat_template_kwargs: dict | None = None,
                 keep_table: bool = False, agents=None, batch_scale: bool = False):  # fmt: skip
        self.ppo = ppo_trainer
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.num_generations = num_generations
        self.max_completion_length = max_completion_length
        self.mask_truncated = mask_truncated
        self.logprobs = logprobs
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.keep_table = keep_table
        self.agents = agents
        self.batch_scale = batch_scale

    def run(self, rows: list[dict], num_generations: int | None = None, **reward_kwargs) -> Generation:
        """Generate, decode and score ``num_generations`` (default: the run's) completions per row."""
        k = num_generations or self.num_generations
        sampled = self._episodes(rows, k) if self.agents is not None else self._sample(rows, k)
        responses = sampled.responses
        columns = {key: [row[key] for row in rows for _ in range(k)] for key in rows[0] if key not in ("prompt", "completion", "completion_ids")}  # fmt: skip
        log = RewardLog()
        per_func = self.rewards(sampled.prompts, sampled.completions, [r.tolist() for r in responses], columns,
                                **sampled.reward_kwargs, **log.kwargs(), **reward_kwargs)  # fmt: skip
        rewards = self.rewards.combine(per_func)  # NaN: unscored, out of its group's baseline, advantage 0 (TRL's)
        truncated = sampled.truncated
        dropped = truncated if self.mask_truncated else torch.zeros_like(truncated)
        masks = sampled.model_masks
        if dropped.any():
            masks = [(m if m is not None else torch.ones_like(r)) * (0 if drop else 1)
                     for r, m, drop in zip(responses, masks or [None] * len(responses), dropped.tolist())]  # fmt: skip
        metric_rows = _metric_rows(per_func, rewards, sampled)
        table = {}
        if self.keep_table:  # log_completions: the prompts and completions as text, with each function's reward
            table = {"prompt": self.tokenizer.batch_decode(sampled.queries, skip_special_tokens=True),
                     "completion": sampled.texts, **{name: per_func[:, j].tolist() for j, name in enumerate(self.rewards.names)},
                     **log.columns}  # fmt: skip
        group_ids = [i // k for i in range(len(responses))] if self.agents is not None else None
        return Generation(sampled.queries, responses, [torch.tensor(s) for s in rewards.tolist()], masks,
                          sampled.logprobs, metric_rows, table, group_ids, sampled.kept_sets, log.sums())  # fmt: skip

    def _sample(self, rows: list[dict], k: int) -> Sampled:
        """One ``generate`` call: ``k`` single-turn completions per row."""
        prompts = [row["prompt"] for row in rows]
        queries = prompt_ids(self.tokenizer, prompts, self.chat_template_kwargs)
        out = self.ppo.generate(
            queries, return_prompt=False, batch_size=len(queries), return_logprobs=self.logprobs, do_sample=True,
            max_new_tokens=self.max_completion_length, num_return_sequences=k,
        )  # fmt: skip
        responses, engine_logprobs = (out[0], out[-1]) if self.logprobs else (out, None)
        responses = to_host_together(responses)  # one copy back for decoding and rewards, no read per row
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        eos = set(self.ppo._eos_ids)
        truncated = torch.tensor([len(r) == 0 or int(r[-1]) not in eos for r in responses])
        return Sampled([q for q in queries for _ in range(k)], responses, engine_logprobs, None,
                       [p for p in prompts for _ in range(k)], completions_of(prompts, texts), texts, truncated)  # fmt: skip

    def _episodes(self, rows: list[dict], k: int) -> Sampled:
        """Multi-turn episodes (TRL's ``tools`` / ``environment_factory``, :mod:`.agents`): ``k`` per row."""
        episodes = self.agents.episodes(self.ppo, rows, k, self.max_completion_length)
        prompts = [e.messages[: e.prompt_length] for e in episodes]
        completions = [e.messages[e.prompt_length :] for e in episodes]
        texts = ["\n".join(f"{m['role']}: {m['content']}" for m in completion) for completion in completions]
        truncated = torch.tensor([self.agents.truncated(e.response) for e in episodes])
        environments = {"environments": [e.environment for e in episodes]} if self.agents.factories is not None else {}
        tool_counts = None
        if self.agents.has_tools:
            tool_counts = (torch.tensor([float(e.tool_calls) for e in episodes]),
                           torch.tensor([float(e.tool_errors) for e in episodes]))  # fmt: skip
        return Sampled([e.query for e in episodes], [e.response for e in episodes],
                       [e.logprobs for e in episodes] if self.logprobs else None, [e.response_mask for e in episodes],
                       prompts, completions, texts, truncated, environments, tool_counts,
                       [e.kept_sets for e in episodes])  # fmt: skip

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
        """TRL's metrics of one generation's table (:func:`_metric_rows`) of every process."""
        functions = len(self.rewards.names)
        lengths, truncated, tokens, rewards = table[:, 0], table[:, 1] > 0, table[:, 2], table[:, 3]
        per_func = table[:, 4 : 4 + functions]
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
        if self.batch_scale:  # TRL: the std the advantages were divided by, the batch's
            group_std = [metrics["reward_std"]]
        metrics["frac_reward_zero_std"] = sum(abs(std) < 1e-8 for std in group_std) / len(group_std)
        if table.shape[1] > 4 + functions:  # tool counts; TRL's: calls per completion, failed calls per call
            calls, failures = table[:, 4 + functions].sum(), table[:, 5 + functions].sum()
            metrics["tools/call_frequency"] = calls / len(table)
            metrics["tools/failure_frequency"] = failures / calls if calls > 0 else 0.0
        metrics = {name: float(value) for name, value in metrics.items()}
        metrics["_tokens"] = float(tokens.sum())
        return metrics


def _metric_rows(per_func, rewards, sampled: Sampled) -> torch.Tensor:
    """This process's rows of a generation as one float64 host table ``(rows, 4 + functions [+ 2])``: length,
    truncated, tokens (prompt + completion), reward, each function's reward [, tool calls and failed calls]. Lengths
    and tokens count the model's own tokens (TRL: not the tools')."""
    masks = sampled.model_masks
    counted = [float(m.sum()) for m in masks] if masks is not None else [len(r) for r in sampled.responses]
    lengths = torch.tensor(counted, dtype=torch.float64)
    tokens = torch.tensor([len(q) for q in sampled.queries], dtype=torch.float64) + lengths
    columns = [torch.stack([lengths, sampled.truncated.double(), tokens, rewards.double()], 1), per_func.double()]
    if sampled.tool_counts is not None:
        columns.append(torch.stack(sampled.tool_counts, 1).double())
    return torch.cat(columns, 1)


def _nan_mean_std(values: np.ndarray) -> tuple[float, float]:
    """Mean and unbiased standard deviation over the non-NaN values (NaN where there are too few)."""
    present = values[~np.isnan(values)]
    mean = present.mean() if len(present) else math.nan
    return mean, (math.sqrt(((present - mean) ** 2).sum() / (len(present) - 1)) if len(present) > 1 else math.nan)
