"""``PPOConfig``: every hyperparameter of a PPO run, with the classic names and defaults, validated once."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from .config_checks import validate_config


def _default_exp_name() -> str:
    return os.path.splitext(os.path.basename(sys.argv[0]))[0] or "trl_lite"


@dataclass
class PPOConfig:
    """Configuration of :class:`~trl_lite.PPOTrainer` (the classic ``trl.PPOConfig`` fields).

    Every field classic TRL 0.11.4 had keeps its name and default (``tests/test_config_classic_defaults.py``
    lists classic's values).

    Batch sizes are per process: ``batch_size`` triplets go into each ``step()`` call, split
    into mini-batches of ``mini_batch_size`` rows; ``gradient_accumulation_steps`` mini-batches
    make one optimizer step (``backward_batch_size`` rows).
    """

    # Run bookkeeping
    exp_name: str = field(default_factory=_default_exp_name, metadata={"help": "Name of this experiment."})
    seed: int = field(default=0, metadata={"help": "Seed for python, numpy and torch."})
    log_with: str | None = field(
        default=None, metadata={"help": "Tracker for accelerate: 'wandb', 'tensorboard', 'all' or None."}
    )
    task_name: str | None = field(default=None, metadata={"help": "Name of the task, logged with the run."})
    # The three names below are only logged by the trainer; the classic scripts (examples/classic/ppo.py) load
    # them, so their defaults are classic's: `python ppo.py` with no flags runs classic's IMDB sentiment task.
    model_name: str | None = field(
        default="gpt2", metadata={"help": "Model the scripts load (hub name or local directory), logged with the run."}
    )
    query_dataset: str | None = field(
        default="stanfordnlp/imdb", metadata={"help": "Query dataset the scripts load, logged with the run."}
    )
    reward_model: str | None = field(
        default="sentiment-analysis:lvwerra/distilbert-imdb",
        metadata={"help": "'task:model' of the scripts' reward pipeline, logged with the run."},
    )
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Worker processes for dataset preprocessing in scripts (classic field)."}
    )
    remove_unused_columns: bool = field(
        default=True, metadata={"help": "Drop dataset columns the collator does not use (classic field; see docs)."}
    )
    tracker_kwargs: dict[str, Any] = field(default_factory=dict, metadata={"help": "kwargs for init_trackers."})
    accelerator_kwargs: dict[str, Any] = field(default_factory=dict, metadata={"help": "kwargs for Accelerator."})
    project_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "kwargs for accelerate's ProjectConfiguration (e.g. logging_dir)."}
    )
    tracker_project_name: str = field(default="trl", metadata={"help": "Project name for the trackers."})
    push_to_hub_if_best_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Accepted for compatibility; trl_lite never pushes on its own."}
    )
    # Schedule
    steps: int = field(default=20000, metadata={"help": "Number of training steps (used by scripts)."})
    learning_rate: float = field(default=1.41e-5, metadata={"help": "Adam learning rate."})
    critic_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Adam learning rate of the separate critic (PPOTrainer's value_model); None: learning_rate."},
    )
    # KL control
    adap_kl_ctrl: bool = field(default=True, metadata={"help": "Adaptive KL control (Ziegler et al.) or fixed."})
    init_kl_coef: float = field(default=0.2, metadata={"help": "Initial KL penalty coefficient."})
    kl_penalty: str = field(
        default="kl", metadata={"help": "KL estimator: 'kl' (lp-ref), 'abs', 'mse' (0.5*(lp-ref)^2) or 'full'."}
    )
    target: float = field(default=6.0, metadata={"help": "Target KL for the adaptive controller."})
    horizon: float = field(default=10000.0, metadata={"help": "Horizon of the adaptive controller."})
    compute_reference_kl: bool = field(
        default=False,
        metadata={"help": "Measure the KL to the reference (objective/kl, objective/kl_dist, objective/ref_logprobs) "
                  "also when init_kl_coef=0, where the KL cannot change the step: then no reference pass runs, "
                  "PPOTrainer(ref_model=None) builds no frozen copy, and those statistics are NaN (not measured). "
                  "True builds and runs the reference anyway (docs/algorithm.md sections 3 and 8)."},
    )
    # Advantages and losses
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the policy ratio."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value prediction."})
    vf_coef: float = field(
        default=0.1,
        metadata={
            "help": "Weight of the value loss of the shared value head (a separate critic takes vf_loss alone; "
            "ignored by critic-free estimators)."
        },
    )
    ptx_coef: float = field(
        default=0.0,
        metadata={"help": "Weight of the language-modelling loss on step()'s ptx_inputs added to the policy's loss (PTX)."},
    )
    ema_decay: float | None = field(
        default=None,
        metadata={"help": "Keep an exponential moving average of the policy with this decay in (0, 1) (trainer.ema_model)."},
    )
    # Critic-free advantages (docs/algorithm.md section 12)
    advantage_estimator: str = field(
        default="gae",
        metadata={
            "help": "'gae' (value head or critic), or critic-free: 'rloo' (leave-one-out group baseline), "
            "'grpo' (group-normalised scores) or 'reinforce_pp' (whitened discounted returns, REINFORCE++). "
            "Critic-free estimators run no value head and report no value statistics."
        },
    )
    num_samples_per_query: int = field(
        default=1,
        metadata={
            "help": "Responses per query: without step(group_ids=...), consecutive runs of this many rows form "
            "one group for 'rloo' and 'grpo'. batch_size must be a multiple of it (groups stay in one process)."
        },
    )
    kl_in_reward: bool | None = field(
        default=None,
        metadata={
            "help": "KL penalty in the per-token reward (True) or as kl_coef * k3 in the loss (False). None: "
            "the estimator's default, False for 'grpo' and True otherwise."
        },
    )
    grpo_scale_rewards: bool = field(
        default=True, metadata={"help": "'grpo': divide by the group's score std (False: only subtract the mean)."}
    )
    grpo_std_scope: str = field(
        default="group",
        metadata={"help": "'grpo' with grpo_scale_rewards: the std divided by, of each group's scores ('group') or "
                  "of the whole batch's on every process ('batch', TRL's scale_rewards='batch')."},
    )
    grpo_std_eps: float = field(
        default=1e-6, metadata={"help": "'grpo': added to the group's score std before dividing (TRL's GRPOTrainer: 1e-4)."}
    )
    # Policy-loss variants (docs/algorithm.md section 13); every default reproduces section 6
    cliprange_high: float | None = field(
        default=None,
        metadata={"help": "Upper clip range of the ratio, clamp(r, 1 - cliprange, 1 + cliprange_high) (DAPO's "
                  "clip-higher). None: cliprange."},
    )
    dual_clip: float | None = field(
        default=None,
        metadata={"help": "Dual-clip constant c > 1: where A < 0 the per-token loss is at most -c * A. None: off."},
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "'token' (PPO), 'sequence' (GSPO: one ratio per row, exp of the masked mean log-ratio) or "
                  "'sequence_sum' (TRL's RLOO: one ratio per row, exp of the masked summed log-ratio)."},
    )
    loss_type: str = field(
        default="token_mean",
        metadata={"help": "Aggregation of per-token losses: 'token_mean' (section 6), 'seq_mean_token_mean' (GRPO), "
                  "'seq_mean_token_sum_norm' (Dr. GRPO, needs max_response_length) or 'global_token_mean' (DAPO: "
                  "every action token of the backward batch on all processes weighs the same). TRL's names "
                  "'bnpo', 'grpo', 'dr_grpo', 'dapo' are accepted and stored as these."},
    )
    max_response_length: int | None = field(
        default=None,
        metadata={"help": "Longest response of the run, in tokens: the constant of 'seq_mean_token_sum_norm' and "
                  "L_max of the overlong penalty."},
    )
    entropy_coef: float = field(
        default=0.0, metadata={"help": "Entropy bonus: loss -= entropy_coef * agg(entropy of the action tokens)."}
    )
    seq_mean_all_rows: bool = field(
        default=False,
        metadata={"help": "'seq_mean_token_mean': the mean over every row of the mini-batch, a row without action "
                  "tokens counting 0 (TRL 1.x's GRPO and RLOO); False: over the rows with one."},
    )
    entropy_token_mean: bool = field(
        default=False,
        metadata={"help": "The entropy bonus's agg is the mini-batch's token mean whatever loss_type (TRL 1.x "
                  "GRPOTrainer's); False: loss_type's aggregation."},
    )
    # Rollout score shaping (docs/algorithm.md section 14), before section 2
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtract this from the score of a row whose response does not end with the EOS token."},
    )
    stop_token_id: int | None = field(
        default=None, metadata={"help": "The EOS token of missing_eos_penalty and env/eos_fraction; None: the tokenizer's."}
    )
    overlong_buffer_len: int | None = field(
        default=None,
        metadata={"help": "DAPO's soft overlong penalty: responses longer than max_response_length - this many "
                  "tokens lose up to overlong_penalty_factor, linearly. None: off."},
    )
    overlong_penalty_factor: float = field(
        default=1.0, metadata={"help": "The largest overlong penalty (reached at max_response_length)."}
    )
    # Rollouts from another engine (docs/algorithm.md section 15)
    importance_sampling_correction: str | None = field(
        default=None,
        metadata={"help": "'tis': multiply each token's policy loss by min(exp(lp_old - lp_gen), "
                  "importance_sampling_cap) when step() gets generation_logprobs. None: off."},
    )
    importance_sampling_cap: float = field(default=2.0, metadata={"help": "Cap of the TIS weight."})
    # Sampling temperature (docs/temperature.md)
    temperature: float = field(
        default=1.0,
        metadata={"help": "The sampling temperature: every engine samples at it (a different temperature kwarg is "
                  "refused; the model's generation_config's is overridden with a warning); the policy's log-probs, "
                  "entropy and KL terms in every pass, and the engines' generation_logprobs, are taken under "
                  "logits / temperature, the reference's at the same temperature. 1.0: scores under the raw logits."},
    )
    # What else shapes the sampling distribution; the defaults are off (docs/temperature.md)
    top_k: int = field(default=0, metadata={"help": "Sample from the k most likely tokens only. 0: off."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling: the smallest set of tokens holding this "
                                                        "probability. 1.0: off."})
    min_p: float = field(default=0.0, metadata={"help": "Drop tokens below min_p times the most likely one's "
                                                        "probability. 0.0: off."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "transformers' repetition penalty. 1.0: off."})
    # Generation engine
    use_vllm: bool = field(
        default=False,
        metadata={"help": "Generate with vLLM (trainer.generate), pushing the policy's weights into the engine "
                  "before the first generate after each step() that changed them."},
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={"help": "'colocate': an engine inside every training process, on its own queries; 'server': "
                  "one engine in its own process (python -m trl_lite.vllm_server), reached at vllm_server_url."},
    )
    vllm_server_url: str = field(
        default="http://127.0.0.1:8000", metadata={"help": "Base URL of the vLLM server (vllm_mode='server')."}
    )
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={"help": "Seconds to wait for the server to answer before raising an error naming the URL."},
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "Fraction of the GPU's memory the colocated engine may take (weights + KV cache)."}
    )
    vllm_kv_cache_gb: float | None = field(
        default=None,
        metadata={"help": "KV-cache size in GiB of a colocated engine on the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE). "
                  "None: 2 GiB."},
    )
    vllm_dtype: str = field(
        default="auto",
        metadata={"help": "Engine dtype: 'float32', 'bfloat16', 'float16' or 'auto': the policy's parameter dtype; "
                  "under mixed precision the first 16-bit dtype of the policy's parameters and config, else the "
                  "autocast dtype (never float32)."},
    )
    vllm_max_model_len: int | None = field(
        default=None,
        metadata={"help": "Longest prompt + response of the colocated engine. None: the model's context if one "
                  "sequence fits the KV cache, else the longest that fits; a longer rollout raises ValueError."},
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "Processes per colocated engine: consecutive ranks share one engine, one shard each; "
                  "must divide the number of processes."},
    )
    vllm_enforce_eager: bool = field(
        default=True, metadata={"help": "Run the engine without CUDA graphs / compilation (faster start)."}
    )
    vllm_lora_sync: bool | None = field(
        default=None,
        metadata={"help": "A PEFT LoRA policy on vLLM: the engine serves the adapter, takes the base weights once and "
                  "after each update only the adapter (in server mode the server needs --max-lora-rank). None: on "
                  "where vLLM can serve the adapter, else the merged model is pushed (the reason is warned once); "
                  "True: on, or ValueError with the reason; False: always push the merged model."},
    )
    vllm_enable_sleep_mode: bool | None = field(
        default=None,
        metadata={"help": "Colocated engine: release its weights and KV cache (vLLM sleep level 2) after each "
                  "generate; the next generate wakes it and pushes the weights again, so step() runs without the "
                  "engine's memory. None: on wherever vLLM has sleep mode (CUDA, ROCm, XPU), off on CPU; True where "
                  "vLLM has none raises ValueError."},
    )
    # Logging
    log_completions_every: int | None = field(
        default=None,
        metadata={"help": "Every this many steps, log_stats writes a table of queries, responses and rewards to "
                  "the trackers (TensorBoard as text, W&B as a table). None: W&B only, every step (classic "
                  "TRL's game_log)."},
    )
    # Batching
    batch_size: int = field(default=128, metadata={"help": "Triplets per step() call, per process."})
    forward_batch_size: int | None = field(
        default=None, metadata={"help": "Deprecated alias of mini_batch_size, kept for old scripts."}
    )
    mini_batch_size: int = field(default=128, metadata={"help": "Rows per forward/backward pass."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Mini-batches per optimizer step."})
    max_tokens_per_minibatch: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of one forward/backward pass (prompt + response tokens). None: mini-batches of "
            "mini_batch_size rows. A number: the rows of each backward batch (mini_batch_size * "
            "gradient_accumulation_steps rows, one optimizer step) go into as few balanced passes as fit it, "
            "and every loss is taken over the whole backward batch, so the update does not depend on the split; "
            "a row longer than the budget gets a pass of its own. Also bounds the rollout's passes."
        },
    )
    oom_backoff: bool = field(
        default=True,
        metadata={
            "help": "When a rollout or training pass raises torch.OutOfMemoryError, free what it held, halve the "
            "token budget (the failed pass's tokens when none was set) and redo that backward batch (or rollout) "
            "in smaller passes: the update is the one the whole pass would have given (docs/out_of_memory.md). "
            "On by default: it costs nothing until a pass fails, and a failure otherwise ends the run and loses "
            "its rollouts. The smaller budget stays for the run, is saved in checkpoints and reported as "
            "memory/max_tokens_per_minibatch (memory/oom_retries counts the failures). False: the error ends the step."
        },
    )
    world_size: int | None = field(default=None, metadata={"help": "Set by the trainer: number of processes."})
    ppo_epochs: int = field(default=4, metadata={"help": "Optimisation epochs over each batch."})
    max_grad_norm: float | None = field(default=None, metadata={"help": "Clip the global gradient norm to this."})
    optimize_cuda_cache: bool | None = field(default=None, metadata={"help": "Deprecated alias of optimize_device_cache."})
    optimize_device_cache: bool = field(default=False, metadata={"help": "Free the device cache after each step."})
    early_stopping: bool = field(default=False, metadata={"help": "Stop the epochs when policykl > 1.5 target_kl."})
    target_kl: float = field(default=1.0, metadata={"help": "KL target of early stopping."})
    compare_steps: int = field(default=1, metadata={"help": "Accepted for compatibility (hub pushes only)."})
    ratio_threshold: float = field(default=10.0, metadata={"help": "Skip mini-batches whose mean ratio exceeds this."})
    # Score shaping
    use_score_scaling: bool = field(default=False, metadata={"help": "Divide scores by their running std."})
    use_score_norm: bool = field(default=False, metadata={"help": "With score scaling, also subtract the running mean."})
    score_clip: float | None = field(default=None, metadata={"help": "Clip scores to [-score_clip, score_clip]."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten rewards (without shifting) before GAE."})
    # Memory
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Enable gradient checkpointing."})
    disable_dropout: bool = field(
        default=False,
        metadata={
            "help": "Set every dropout of the policy, reference, critic and value head to 0 when the trainer is built "
            "(TRL 1.x's name). Off by default: classic TRL never changed the model's dropout, and a step of a model "
            "with dropout then gives classic TRL's numbers; on CUDA attention dropout keeps the training passes off "
            "the varlen kernel (docs/gpu_path.md)."
        },
    )
    keep_freed_cpu_memory: bool = field(
        default=True,
        metadata={
            "help": "When training on CPU under Linux/glibc, keep memory freed between mini-batches mapped in "
            "the process instead of returning it to the OS (a process-wide malloc setting, see "
            "trl_lite.trainer.memory.cpu_memory): saves the kernel's page faults on every vocabulary-sized tensor, "
            "about a fifth of a step on the w1 benchmark. Resident memory stays at its peak. A process of a "
            "sequence-parallel group keeps only blocks up to 8 MiB outside the rollout, with one malloc arena "
            "(docs/sequence_parallel.md, 'Resident memory'). A process started with MALLOC_MMAP_THRESHOLD_ keeps "
            "that setting. Also makes CPU steps reuse one LM-head logits buffer, kept between steps."
        },
    )
    lm_head_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per chunk of the fused LM head's log-probs, entropy and full KL (forward and backward, "
            "the logits recomputed in the backward): no (tokens x vocabulary) tensor is kept, the largest is "
            "(chunk x vocabulary). None: automatic - one buffer while a pass's float32 (tokens x vocabulary) "
            "logits fit 256 MiB on CPU / 1 GiB on an accelerator (faster: no recomputation), else chunks of "
            "64 MiB / 256 MiB of logits, and chunks for good after an out-of-memory back-off (see docs/memory.md). "
            "0: always one buffer. A positive int: chunks of that many tokens. Steps report the path taken as "
            "memory/lm_head_chunk_size (tokens per chunk; 0: one buffer; -1: the model's own logits)."
        },
    )
    # Speed
    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Padding-free (packed) forward passes in step(): each mini-batch's rows concatenated into one "
            "sequence with per-row position ids and attention that never crosses rows, so no padding token is "
            "computed; same results as padded passes. None: packed where the models support it (decoder-only "
            "transformers models whose attention mask comes from transformers.masking_utils), padded elsewhere; "
            "True: packed, and an error at construction when a model cannot pack; False: padded."
        },
    )
    prefix_sharing: bool | None = field(
        default=None,
        metadata={
            "help": "Shared-prefix packed passes: rows whose query tokens are identical (GRPO/RLOO groups, equal "
            "queries in a GAE batch) run their prompt once per pass, each response attending to it; same results "
            "as without (docs/prefix_sharing.md). None: automatic - on for a step when the passes it will run (their "
            "split and order) save at least a quarter of their tokens, and never in the training passes of a model "
            "with dropout above 0 (disable_dropout=False: a group would share one dropout mask over its prompt); "
            "True: always where rows share a prompt (an error at construction when the passes cannot share: padded "
            "passes, sequence parallelism; a warning under dropout); False: off. Steps report "
            "prefix_sharing/tokens_saved_fraction."
        },
    )
    shuffle_by_prompt: bool | None = field(
        default=None,
        metadata={
            "help": "The epoch shuffle of step()'s learner permutes prompts, not rows: the rows with identical "
            "query tokens (a GRPO/RLOO group) stay together in the order of the batch, so with mini_batch_size a "
            "multiple of the group size each group trains in one mini-batch and its training passes can run the "
            "prompt once (prefix_sharing). False: a shuffle of the rows, as classic TRL. None (automatic): True for a "
            "step of a critic-free (group) estimator whose training passes share prompts, else False "
            "(docs/prefix_sharing.md)."
        },
    )
    # Set by the trainer
    is_encoder_decoder: bool | None = field(default=None, metadata={"help": "Set by the trainer."})
    is_peft_model: bool | None = field(default=None, metadata={"help": "Set by the trainer."})
    backward_batch_size: int | None = field(
        default=None, metadata={"help": "Derived: mini_batch_size * gradient_accumulation_steps."}
    )
    global_backward_batch_size: int | None = field(default=None, metadata={"help": "Set by the trainer."})
    global_batch_size: int | None = field(default=None, metadata={"help": "Set by the trainer."})

    def __post_init__(self):
        if self.forward_batch_size is not None:
            self.mini_batch_size = self.forward_batch_size
        if self.optimize_cuda_cache is not None:
            self.optimize_device_cache = self.optimize_cuda_cache
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the first bad field, its value and what is accepted;
        then derive ``backward_batch_size`` (the checks live in ``config_checks.py``)."""
        validate_config(self)

    @property
    def critic_free(self) -> bool:
        """Whether the advantage estimator needs no values (every estimator but 'gae')."""
        return self.advantage_estimator != "gae"

    @property
    def kl_in_reward_resolved(self) -> bool:
        """``kl_in_reward``, or the estimator's default when it is None (False for 'grpo', else True)."""
        if self.kl_in_reward is not None:
            return self.kl_in_reward
        return self.advantage_estimator != "grpo"
