"""The statistics of ``step()`` (docs/algorithm.md sections 8 and 14), reduced over processes, and their
logging, completions tables included: the :class:`StepStatistics` part of ``PPOTrainer``.
"""

from __future__ import annotations

import numpy as np
import torch
from accelerate.utils import gather_object

from ...core import groups_with_equal_scores, masked_mean, stats_to_np
from .transfer import Selected, stack_scalars, to_host_together

# Statistics that are distributions (1-D arrays): concatenated over processes instead of averaged.
_DIST_STATS = (
    "objective/kl_dist",
    "objective/logprobs",
    "objective/ref_logprobs",
    "tokens/queries_dist",
    "tokens/responses_dist",
    "ppo/policy/advantages",
    "ppo/policy/ratio",
)
# Scalars whose value over processes is the smallest or largest of theirs, not the mean.
_MIN_STATS = ("env/response_length/min",)
_MAX_STATS = (
    "env/response_length/max", "rollout/logprob_diff/max", "rollout/staleness/max", "ppo/tokens_per_minibatch/max",
)  # fmt: skip
# Fractions whose parts differ in size between processes: given as (numerator, denominator), summed
# over processes before dividing.
_RATIO_STATS = ("env/frac_groups_zero_std",)
# The key of the completions table, classic TRL's name for it.
_COMPLETIONS_KEY = "game_log"


def resolve_stop_token_ids(stop_token_id, tokenizer, model_config) -> tuple[int, ...]:
    """The EOS ids of docs/algorithm.md section 14: ``(stop_token_id,)`` when set, else the tokenizer's
    ``eos_token_id``, else the model config's (which may list several); ``()`` when none is known."""
    if stop_token_id is not None:
        return (int(stop_token_id),)
    for source in (tokenizer, model_config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None and eos != []:
            return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


class StepStatistics:
    """The statistics part of ``PPOTrainer``: a step's batch statistics (docs/algorithm.md sections 8 and
    14), their reduction over processes, and ``log_stats``.

    Args:
        config: the trainer's :class:`PPOConfig`.
        accelerator: the run's accelerator (reductions, gathers, trackers).
        sequence: the trainer's sequence-parallel part (:class:`~trl_lite.parallel.SequenceParallel`, whose
            group's processes hold the same rows, or :class:`~trl_lite.parallel.NoSequenceParallel`).
    """

    def __init__(self, config, accelerator, sequence):
        self.config = config
        self.accelerator = accelerator
        self.sequence = sequence
        self.device = accelerator.device

    def step_stats(self, experience, train_stats: dict) -> dict:
        """Every statistic of one step, reduced over processes: floats and 1-D numpy arrays.

        ``experience``: the step's :class:`~.experience.Experience`; ``train_stats``: the learner's.
        """
        stats = self.batch_stats(experience)
        stats.update(self.rollout_stats(experience))
        stats.update(train_stats)
        stats.update(experience.gap_stats)
        if not self.config.critic_free:
            stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
        out = self.reduce(stats)
        if experience.kls is None:
            # No reference pass ran (docs/algorithm.md section 8): the KL statistics keep their keys, NaN.
            # Filled after the reduction, so that every process gives the same shapes without a collective.
            rows = self.global_rows
            out["objective/kl"] = float("nan")
            out["objective/kl_dist"] = np.full(rows, np.nan, dtype=np.float32)
            out["objective/ref_logprobs"] = np.full_like(out["objective/logprobs"], np.nan)
        return out

    @torch.no_grad()
    def batch_stats(self, experience) -> dict:
        """The batch statistics of section 8 (this process), as tensors."""
        rows, mask = experience.rows, experience.action_mask
        is_action = mask.bool()
        scores = experience.scores
        query_len, response_len = rows.query_len.float(), rows.response_len.float()
        kl = {}
        if experience.kls is not None:  # else not measured: see step_stats
            kl_per_row = (experience.kls * mask).sum(-1)
            kl = {
                "objective/kl": kl_per_row.mean(),
                "objective/kl_dist": kl_per_row,
                "objective/ref_logprobs": Selected(experience.ref_logprobs, is_action),
            }
        return {
            **kl,
            "objective/logprobs": Selected(experience.logprobs, is_action),
            "objective/kl_coef": torch.tensor(experience.kl_coef),
            "objective/entropy": (-experience.logprobs * mask).sum(-1).mean(),
            "ppo/mean_non_score_reward": masked_mean(experience.non_score_reward, mask),
            # NaN: an unscored row ('grpo'/'rloo'), left out of both
            "ppo/mean_scores": scores.nanmean(),
            "ppo/std_scores": _nan_std(scores) if len(scores) > 1 else torch.tensor(0.0),
            "ppo/policy/advantages": Selected(experience.advantages, is_action),
            "tokens/queries_len_mean": query_len.mean(),
            "tokens/queries_len_std": query_len.std() if len(rows) > 1 else torch.tensor(0.0),
            "tokens/queries_dist": query_len,
            "tokens/responses_len_mean": response_len.mean(),
            "tokens/responses_len_std": response_len.std() if len(rows) > 1 else torch.tensor(0.0),
            "tokens/responses_dist": response_len,
        }

    @torch.no_grad()
    def rollout_stats(self, experience) -> dict:
        """The rollout diagnostics of section 14 (this process), as tensors.

        ``env/eos_fraction`` when an EOS id is known; ``env/frac_groups_zero_std`` (numerator and
        denominator, divided after the reduction) for 'rloo'/'grpo'. The scores are the shaped ones
        the advantages see. ``rollout/staleness/mean|max`` when the batch came with its ``policy_version``.
        """
        lengths = experience.rows.response_len.float()
        stats = {
            "env/response_length/mean": lengths.mean(),
            "env/response_length/min": lengths.min(),
            "env/response_length/max": lengths.max(),
        }
        if experience.ends_with_eos is not None:
            stats["env/eos_fraction"] = experience.ends_with_eos.float().mean()
        if experience.staleness is not None:
            stats["rollout/staleness/mean"] = experience.staleness.mean()
            stats["rollout/staleness/max"] = experience.staleness.max()
        if experience.groups is not None:
            scores = experience.scores
            # The ids came dense with the batch's one copy and the count as a host int: nothing read back here.
            equal = groups_with_equal_scores(scores, experience.groups, experience.num_groups).float()
            stats["env/frac_groups_zero_std"] = torch.stack([equal.sum(), equal.new_full((), float(equal.numel()))])
        return stats

    def reduce(self, stats: dict) -> dict:
        """Reduce the statistics of every process; to floats and numpy arrays.

        Scalars are averaged, except those of ``_MIN_STATS``/``_MAX_STATS`` (the extreme over
        processes) and ``_RATIO_STATS`` (numerators and denominators summed, then divided);
        the distributions of ``_DIST_STATS`` are concatenated. Everything comes back to the host in
        one copy (:func:`~.transfer.to_host_together`), the step's one statistics sync.
        """
        accelerator = self.accelerator
        device = self.device
        scalar_keys = [k for k in stats if k not in _DIST_STATS and k not in _RATIO_STATS]
        ratio_keys = [k for k in _RATIO_STATS if k in stats]
        scalars = stack_scalars([stats[k] for k in scalar_keys], device)
        ratios = torch.stack([stats[k].to(device, torch.float32) for k in ratio_keys]) if ratio_keys else None
        dists = {k: stats[k] for k in _DIST_STATS if k in stats}
        if accelerator.num_processes > 1:
            dists = {k: (v.values[v.mask] if isinstance(v, Selected) else v).float().flatten().to(device)
                     for k, v in dists.items()}  # fmt: skip
            # One summed reduction for means and ratio parts, one max reduction for the extremes
            # (a minimum is the negated maximum of the negated values).
            n_scalars = len(scalar_keys)
            parts = [scalars] + ([ratios.flatten()] if ratios is not None else [])
            summed = accelerator.reduce(torch.cat(parts), reduction="sum")
            means = summed[:n_scalars] / accelerator.num_processes
            if ratios is not None:
                ratios = summed[n_scalars:].reshape(ratios.shape)
            sign = torch.tensor([-1.0 if k in _MIN_STATS else 1.0 for k in scalar_keys], device=device)
            extreme = torch.tensor([k in _MIN_STATS or k in _MAX_STATS for k in scalar_keys], device=device)
            if any(k in _MIN_STATS or k in _MAX_STATS for k in scalar_keys):
                extremes = accelerator.reduce(scalars * sign, reduction="max") * sign
                scalars = torch.where(extreme, extremes, means)
            else:
                scalars = means
            for key, value in dists.items():
                padded = accelerator.pad_across_processes(value, dim=0, pad_index=float("nan"))
                gathered = self.one_per_group(accelerator.gather(padded))
                dists[key] = gathered[~torch.isnan(gathered)]
        ratio_values = ratios[:, 0] / ratios[:, 1] if ratios is not None else scalars.new_zeros(0)
        parts = [scalars, ratio_values]
        for value in dists.values():
            pair = (value.values, value.mask) if isinstance(value, Selected) else (value,)
            parts += [t.float().flatten().to(device) for t in pair]
        host = iter(part.numpy() for part in to_host_together(parts))
        out = dict(zip(scalar_keys, next(host).tolist()))
        out.update(zip(ratio_keys, next(host).tolist()))
        distributions = {}
        for key, value in dists.items():
            distributions[key] = next(host)
            if isinstance(value, Selected):
                distributions[key] = distributions[key][next(host).astype(bool)]
        out.update(stats_to_np(distributions))
        return out

    @property
    def global_rows(self) -> int:
        """Rows of one step over all processes: ``batch_size`` per data-parallel group (a sequence-parallel
        group's processes share theirs)."""
        return self.config.batch_size * (self.accelerator.num_processes // self.sequence.size)

    def one_per_group(self, gathered: torch.Tensor) -> torch.Tensor:
        """Of a gather of equal pieces from every process, the pieces of the first process of each
        sequence-parallel group (its other processes hold the same rows); all of them without one."""
        return self.sequence.one_per_group(gathered, self.accelerator.num_processes)

    def log(self, step: int, stats: dict, batch: dict, rewards, columns_to_log=("query", "response")) -> None:
        """Send ``stats`` and reward statistics of this step to the accelerate trackers (main process).

        With ``config.log_completions_every = N``, every N-th step (counted by ``step()``) also logs a
        table of ``columns_to_log`` of ``batch`` (one entry per row) and the rewards, with the rows of
        every process, as ``game_log``: markdown text to TensorBoard, a ``wandb.Table`` to W&B. With N
        None and ``log_with="wandb"`` W&B gets it every step (classic TRL's ``game_log``). ``step``: the
        trainer's step counter. Every process must call this when any does: the rows are gathered.
        """
        config = self.config
        if config.log_with is None:
            return
        every = config.log_completions_every
        table_due = step % every == 0 if every is not None else config.log_with == "wandb"
        if table_due:
            missing = [c for c in columns_to_log if c not in batch]
            if missing:
                raise ValueError(
                    f"columns_to_log {list(columns_to_log)} must be keys of batch for the completions table; "
                    f"missing {missing}, batch has {list(batch)}."
                )
        rewards = torch.stack([torch.as_tensor(r, dtype=torch.float32) for r in rewards]).to(self.device)
        # Gathered on the device, then read back once.
        rewards = self.one_per_group(self.accelerator.gather(rewards.reshape(-1))).cpu()
        logs = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        logs["env/reward_mean"] = rewards.mean().item()
        logs["env/reward_std"] = rewards.std().item() if rewards.numel() > 1 else 0.0
        if config.log_with != "tensorboard":
            # An array that was not measured (all NaN, docs/algorithm.md section 8) makes no histogram.
            logs.update({k: v for k, v in stats.items() if isinstance(v, np.ndarray) and not (v.size and np.isnan(v).all())})
            logs["env/reward_dist"] = rewards.numpy()
        self.accelerator.log(logs, step=step)
        if table_due:
            # Collective: every process sends its rows, in process order like the gathered rewards.
            columns = [gather_object([_cell(v) for v in batch[c]]) for c in columns_to_log]
            if self.accelerator.is_main_process:
                rows = [[*cells, reward] for cells, reward in zip(zip(*columns), rewards.tolist())]
                self._log_completions(step, [*columns_to_log, "reward"], rows, to_tensorboard=every is not None)

    def _log_completions(self, step: int, header: list, rows: list, to_tensorboard: bool) -> None:
        """Write the completions table to the trackers: W&B as a table, TensorBoard (when asked) as text."""
        for tracker in self.accelerator.trackers:
            if tracker.name == "wandb":
                import wandb

                tracker.log({_COMPLETIONS_KEY: wandb.Table(columns=header, data=rows)}, step=step)
            elif tracker.name == "tensorboard" and to_tensorboard:
                tracker.writer.add_text(_COMPLETIONS_KEY, _markdown_table(header, rows), global_step=step)
                tracker.writer.flush()


def _markdown_table(header: list, rows: list) -> str:
    """A markdown table (TensorBoard's text plugin renders it); ``|`` and line breaks in cells are escaped."""

    def text(value) -> str:
        value = f"{value:.6g}" if isinstance(value, float) else str(value)
        return value.replace("|", "\\|").replace("\r\n", "<br>").replace("\n", "<br>")

    lines = ["| " + " | ".join(text(h) for h in header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(text(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value):
    """A table cell as a plain Python value: one-element tensors and arrays as numbers, others as lists."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (np.ndarray, np.generic)):
        return value.item() if value.size == 1 else value.tolist()
    return value


def _nan_std(values: torch.Tensor) -> torch.Tensor:
    """The unbiased std of the non-NaN ``values`` (NaN with fewer than 2), without a read of the host."""
    scored = ~torch.isnan(values)
    centred = torch.where(scored, values - values.nanmean(), torch.zeros_like(values))
    return ((centred**2).sum() / (scored.sum() - 1)).sqrt()
