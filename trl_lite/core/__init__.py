"""Pure tensor functions of PPO for language models, and the classic helpers of ``trl.core``.

Nothing here holds state or knows about devices, processes or models; every function is tested
against an independent float64 reference in ``tests/test_core.py``. Section numbers refer to
``docs/algorithm.md``. Shape names: ``B`` rows, ``L`` positions of a per-token tensor (the ``T = S - 1``
next-token positions of the spec, or any sub-range of them), ``V`` vocabulary.

- :mod:`.logprobs`: log-probs and entropy from logits, or fused with a linear LM head;
- :mod:`.masked`: masked mean, variance and whitening;
- :mod:`.ppo`: KL estimators, KL-shaped rewards, GAE, the clipped policy and value losses and the
  policy-loss variants of section 13 (importance ratio levels, clip-higher, dual clip, loss aggregation);
- :mod:`.reward`: the pairwise ranking loss of reward models and its statistics;
- :mod:`.advantages`: the critic-free estimators (RLOO, GRPO, REINFORCE++) and the k3 KL term;
- :mod:`.shaping`: the rollout's score shaping of section 14 (missing-EOS and overlong penalties) and
  the equal-score groups of its diagnostics;
- :mod:`.utils`: statistics dicts, ``LengthSampler``, ``set_seed``;
- :mod:`.classic`: the other public helpers of classic ``trl.core`` (``whiten``, ``respond_to_batch``,
  ``top_k_top_p_filtering``, ``convert_to_scalar``, ``PPODecorators``, ...).
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    discounted_returns,
    grpo_advantages,
    k3_kl,
    rloo_advantages,
    sequence_to_tokens,
)
from .classic import (
    PPODecorators,
    add_suffix,
    average_torch_dicts,
    build_bert_batch_from_txt,
    convert_to_scalar,
    listify_batch,
    pad_to_size,
    randn_tensor,
    respond_to_batch,
    top_k_top_p_filtering,
    whiten,
)
from .lm_head import full_kl_from_hidden, lm_head_chunk_size
from .logprobs import (
    entropy_from_logits,
    full_kl_from_logits,
    logprobs_and_entropy_from_hidden,
    logprobs_and_entropy_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
)
from .masked import clip_by_value, masked_mean, masked_var, masked_whiten
from .ppo import (
    IMPORTANCE_SAMPLING_LEVELS,
    KL_PENALTIES,
    LOSS_TYPE_ALIASES,
    LOSS_TYPES,
    aggregate_loss,
    clipped_surrogate,
    compute_gae,
    compute_kl_rewards,
    importance_ratio,
    kl_estimate,
    last_index,
    ppo_policy_loss,
    ppo_value_loss,
    truncated_importance_weights,
)
from .reward import pairwise_ranking_loss, preference_stats
from .shaping import ends_with_stop, groups_with_equal_scores, missing_eos_penalty, overlong_penalty, shape_scores
from .utils import WANDB_PADDING, LengthSampler, flatten_dict, set_seed, stack_dicts, stats_to_np

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "IMPORTANCE_SAMPLING_LEVELS",
    "KL_PENALTIES",
    "LOSS_TYPES",
    "LOSS_TYPE_ALIASES",
    "LengthSampler",
    "PPODecorators",
    "WANDB_PADDING",
    "add_suffix",
    "aggregate_loss",
    "average_torch_dicts",
    "build_bert_batch_from_txt",
    "clip_by_value",
    "clipped_surrogate",
    "compute_gae",
    "compute_kl_rewards",
    "convert_to_scalar",
    "discounted_returns",
    "ends_with_stop",
    "entropy_from_logits",
    "flatten_dict",
    "full_kl_from_hidden",
    "full_kl_from_logits",
    "grpo_advantages",
    "groups_with_equal_scores",
    "k3_kl",
    "importance_ratio",
    "kl_estimate",
    "last_index",
    "listify_batch",
    "lm_head_chunk_size",
    "logprobs_and_entropy_from_hidden",
    "logprobs_and_entropy_from_logits",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "missing_eos_penalty",
    "overlong_penalty",
    "pad_to_size",
    "pairwise_ranking_loss",
    "ppo_policy_loss",
    "ppo_value_loss",
    "preference_stats",
    "randn_tensor",
    "respond_to_batch",
    "rloo_advantages",
    "sequence_to_tokens",
    "set_seed",
    "shape_scores",
    "stack_dicts",
    "stats_to_np",
    "top_k_top_p_filtering",
    "truncated_importance_weights",
    "whiten",
]
