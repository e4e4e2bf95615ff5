"""The statistics of ``step()`` (PPO_SPEC section 8), reduced over processes, and their logging.
:class:`~trl_lite.trainer.PPOTrainer` mixes it in.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import masked_mean, stats_to_np

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

    def _reduce_stats(self, stats: dict) -> dict:
        """Average scalar statistics over processes and concatenate the distributions; to numpy."""
        accelerator = self.accelerator
        device = self.current_device
        scalar_keys = [k for k in stats if k not in _DIST_STATS]
        scalars = torch.stack([torch.as_tensor(stats[k], dtype=torch.float32, device=device) for k in scalar_keys])
        dists = {k: stats[k].float().flatten().to(device) for k in _DIST_STATS if k in stats}
        if accelerator.num_processes > 1:
            scalars = accelerator.reduce(scalars, reduction="mean")
            for key, value in dists.items():
                padded = accelerator.pad_across_processes(value, dim=0, pad_index=float("nan"))
                gathered = accelerator.gather(padded)
                dists[key] = gathered[~torch.isnan(gathered)]
        out = dict(zip(scalar_keys, scalars.cpu().tolist()))
        out.update(stats_to_np(dists))
        return out



    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log=("query", "response")) -> None:
        """Send ``stats`` and reward statistics of this step to the accelerate trackers (main process)."""
        if self.config.log_with is None:
            return
        rewards = torch.stack([torch.as_tensor(r, dtype=torch.float32) for r in rewards]).to(self.current_device)
        rewards = self.accelerator.gather(rewards.reshape(-1))
        logs = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        logs["env/reward_mean"] = rewards.mean().item()
        logs["env/reward_std"] = rewards.std().item() if rewards.numel() > 1 else 0.0
        if self.config.log_with != "tensorboard":
            logs.update({k: v for k, v in stats.items() if isinstance(v, np.ndarray)})
            logs["env/reward_dist"] = rewards.cpu().numpy()
            if self.config.log_with == "wandb" and all(c in batch for c in columns_to_log):
                import wandb

                rows = [[*(batch[c][i] for c in columns_to_log), rewards[i].item()] for i in range(len(batch[columns_to_log[0]]))]
                logs["game_log"] = wandb.Table(columns=[*columns_to_log, "reward"], rows=rows)
        self.accelerator.log(logs, step=self.current_step)
