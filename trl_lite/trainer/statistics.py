"""The statistics of ``step()`` (PPO_SPEC sections 8 and 14), reduced over processes, and their
logging, completions tables included. :class:`~trl_lite.trainer.PPOTrainer` mixes it in.
"""

from __future__ import annotations

import numpy as np
import torch
from accelerate.utils import gather_object

from ..core import ends_with_stop, groups_with_equal_scores, masked_mean, stats_to_np

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
_MAX_STATS = ("env/response_length/max", "rollout/logprob_diff/max")
# Fractions whose parts differ in size between processes: given as (numerator, denominator), summed
# over processes before dividing.
_RATIO_STATS = ("env/frac_groups_zero_std",)
# The key of the completions table, classic TRL's name for it.
_COMPLETIONS_KEY = "game_log"


def resolve_stop_token_ids(stop_token_id, tokenizer, model_config) -> tuple[int, ...]:
    """The EOS ids of PPO_SPEC section 14: ``(stop_token_id,)`` when set, else the tokenizer's
    ``eos_token_id``, else the model config's (which may list several); ``()`` when none is known."""
    if stop_token_id is not None:
        return (int(stop_token_id),)
    for source in (tokenizer, model_config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None and eos != []:
            return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


class StatisticsMixin:
    """Batch statistics of one step, their reduction over processes, and ``log_stats``."""

    @torch.no_grad()
    def _step_stats(self, rows, scores, kls, logprobs, ref_logprobs, non_score_reward, advantages, kl_coef) -> dict:
        """The batch statistics of PPO_SPEC section 8 (this process), as tensors."""
        mask = rows.action_mask
        kl_per_row = (kls * mask).sum(-1)
        is_action = mask.bool()
        query_len, response_len = rows.query_len.float(), rows.response_len.float()
        return {
            "objective/kl": kl_per_row.mean(),
            "objective/kl_dist": kl_per_row,
            "objective/logprobs": logprobs[is_action],
            "objective/ref_logprobs": ref_logprobs[is_action],
            "objective/kl_coef": torch.tensor(kl_coef),
            "objective/entropy": (-logprobs * mask).sum(-1).mean(),
            "ppo/mean_non_score_reward": masked_mean(non_score_reward, mask),
            "ppo/mean_scores": scores.mean(),
            "ppo/std_scores": scores.std() if len(scores) > 1 else torch.tensor(0.0),
            "ppo/policy/advantages": advantages[is_action],
            "tokens/queries_len_mean": query_len.mean(),
            "tokens/queries_len_std": query_len.std() if len(rows) > 1 else torch.tensor(0.0),
            "tokens/queries_dist": query_len,
            "tokens/responses_len_mean": response_len.mean(),
            "tokens/responses_len_std": response_len.std() if len(rows) > 1 else torch.tensor(0.0),
            "tokens/responses_dist": response_len,
        }

    def _ends_with_eos(self, responses) -> torch.Tensor | None:
        """Whether each response ends with EOS (section 14's, see :func:`resolve_stop_token_ids`):
        bool ``(B,)`` on the trainer's device, or None when no EOS id is known.

        Raises when ``missing_eos_penalty`` is set but no EOS id is known (called before any state changes).
        """
        config = self.config
        eos_ids = resolve_stop_token_ids(config.stop_token_id, self.tokenizer, self._unwrapped_model.config)
        if not eos_ids:
            if config.missing_eos_penalty is not None:
                raise ValueError(
                    f"missing_eos_penalty={config.missing_eos_penalty} needs an EOS token id, but stop_token_id is "
                    "None and neither the tokenizer nor the model config has an eos_token_id; set stop_token_id."
                )
            return None
        return ends_with_stop(responses, eos_ids).to(self.current_device)

    @torch.no_grad()
    def _rollout_stats(self, lengths, ends_with_eos, scores, groups) -> dict:
        """The rollout diagnostics of PPO_SPEC section 14 (this process), as tensors.

        ``lengths (B,)``: response tokens per row; ``ends_with_eos (B,)`` bool, or None when no EOS id
        is known (then no ``env/eos_fraction``); ``scores (B,)``: the shaped scores the advantages see;
        ``groups (B,)``: group ids of 'rloo'/'grpo', or None (then no ``env/frac_groups_zero_std``).
        """
        lengths = lengths.float()
        stats = {
            "env/response_length/mean": lengths.mean(),
            "env/response_length/min": lengths.min(),
            "env/response_length/max": lengths.max(),
        }
        if ends_with_eos is not None:
            stats["env/eos_fraction"] = ends_with_eos.float().mean()
        if groups is not None:
            equal = groups_with_equal_scores(scores, groups.to(scores.device)).float()
            stats["env/frac_groups_zero_std"] = torch.stack([equal.sum(), equal.new_tensor(float(equal.numel()))])
        return stats

    def _reduce_stats(self, stats: dict) -> dict:
        """Reduce the statistics of every process; to floats and numpy arrays.

        Scalars are averaged, except those of ``_MIN_STATS``/``_MAX_STATS`` (the extreme over
        processes) and ``_RATIO_STATS`` (numerators and denominators summed, then divided);
        the distributions of ``_DIST_STATS`` are concatenated.
        """
        accelerator = self.accelerator
        device = self.current_device
        scalar_keys = [k for k in stats if k not in _DIST_STATS and k not in _RATIO_STATS]
        ratio_keys = [k for k in _RATIO_STATS if k in stats]
        scalars = torch.stack([torch.as_tensor(stats[k], dtype=torch.float32, device=device) for k in scalar_keys])
        ratios = torch.stack([stats[k].to(device, torch.float32) for k in ratio_keys]) if ratio_keys else None
        dists = {k: stats[k].float().flatten().to(device) for k in _DIST_STATS if k in stats}
        if accelerator.num_processes > 1:
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
            if extreme.any():
                extremes = accelerator.reduce(scalars * sign, reduction="max") * sign
                scalars = torch.where(extreme, extremes, means)
            else:
                scalars = means
            for key, value in dists.items():
                padded = accelerator.pad_across_processes(value, dim=0, pad_index=float("nan"))
                gathered = accelerator.gather(padded)
                dists[key] = gathered[~torch.isnan(gathered)]
        out = dict(zip(scalar_keys, scalars.cpu().tolist()))
        if ratios is not None:
            out.update(zip(ratio_keys, (ratios[:, 0] / ratios[:, 1]).cpu().tolist()))
        out.update(stats_to_np(dists))
        return out

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log=("query", "response")) -> None:
        """Send ``stats`` and reward statistics of this step to the accelerate trackers (main process).

        With ``config.log_completions_every = N``, every N-th step (counted by ``step()``) also logs a
        table of ``columns_to_log`` of ``batch`` (one entry per row) and the rewards, with the rows of
        every process, as ``game_log``: markdown text to TensorBoard, a ``wandb.Table`` to W&B. With N
        None and ``log_with="wandb"`` W&B gets it every step (classic TRL's ``game_log``). Every
        process must call this when any does: the rows are gathered.
        """
        config = self.config
        if config.log_with is None:
            return
        every = config.log_completions_every
        table_due = self.current_step % every == 0 if every is not None else config.log_with == "wandb"
        if table_due:
            missing = [c for c in columns_to_log if c not in batch]
            if missing:
                raise ValueError(
                    f"columns_to_log {list(columns_to_log)} must be keys of batch for the completions table; "
                    f"missing {missing}, batch has {list(batch)}."
                )
        rewards = torch.stack([torch.as_tensor(r, dtype=torch.float32) for r in rewards]).to(self.current_device)
        rewards = self.accelerator.gather(rewards.reshape(-1))
        logs = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        logs["env/reward_mean"] = rewards.mean().item()
        logs["env/reward_std"] = rewards.std().item() if rewards.numel() > 1 else 0.0
        if config.log_with != "tensorboard":
            logs.update({k: v for k, v in stats.items() if isinstance(v, np.ndarray)})
            logs["env/reward_dist"] = rewards.cpu().numpy()
        self.accelerator.log(logs, step=self.current_step)
        if table_due:
            # Collective: every process sends its rows, in process order like the gathered rewards.
            columns = [gather_object([_cell(v) for v in batch[c]]) for c in columns_to_log]
            if self.accelerator.is_main_process:
                rows = [[*cells, reward] for cells, reward in zip(zip(*columns), rewards.cpu().tolist())]
                self._log_completions([*columns_to_log, "reward"], rows, to_tensorboard=every is not None)

    def _log_completions(self, header: list, rows: list, to_tensorboard: bool) -> None:
        """Write the completions table to the trackers: W&B as a table, TensorBoard (when asked) as text."""
        for tracker in self.accelerator.trackers:
            if tracker.name == "wandb":
                import wandb

                tracker.log({_COMPLETIONS_KEY: wandb.Table(columns=header, data=rows)}, step=self.current_step)
            elif tracker.name == "tensorboard" and to_tensorboard:
                tracker.writer.add_text(_COMPLETIONS_KEY, _markdown_table(header, rows), global_step=self.current_step)
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
