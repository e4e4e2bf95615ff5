"""The methods `bench_step.py` times: `make_step_fn` builds the models of one method on one workload and
returns its step function - `PPOTrainer.step` in some configuration (`step`, `step-padded`, ...) or a floor's
step (`floor`, `floor-packed`) - with the critic-free, `grpo-beta0` and separate-critic variants."""

import copy
import json
import warnings

import torch

from step_floors import (
    KL_COEF, LEARNING_RATE, CriticFreeFloor, FloorCriticPPO, FloorPPO, OnPolicyFloor, PackedFloorPPO,
)  # fmt: skip
from step_workloads import CRITIC_WORKLOADS, GRPO_BETA0, CriticFreeWorkload, Workload, make_critic, make_lm

METHODS = ("step", "step-padded", "floor")
# Methods only some workloads have, never run by default: "step-every-pass" (grpo-beta0) forces both passes;
# "step-one-buffer" (the value-head workloads) is "step" with lm_head_chunk_size=0, the LM head's path before
# issue 42: one (tokens x vocabulary) buffer per pass, whatever its size.
EXTRA_METHODS = ("step-every-pass", "step-one-buffer")
# The critic-free workloads (`shared_prefix`) stepped with PPOConfig.prefix_sharing True, False and None (automatic):
# docs/prefix_sharing.md. They report the share of the step's tokens the passes ran (`tokens run`).
PREFIX_METHODS = {"step-prefix-on": True, "step-prefix-off": False, "step-prefix-auto": None}
# The floor over packed mini-batches with the trainer's packed attention (one varlen kernel call per
# layer on CUDA): "step vs floor-packed" compares the same attention on both sides. Default on CUDA.
PACKED_FLOOR = "floor-packed"


def quiet_trainer(*args, trainer_class=None, **kwargs):
    """`PPOTrainer(*args, **kwargs)` (or `trainer_class`) without the no-dataset warning: the benchmarks batch
    their own rows for step()."""
    from trl_lite import NoDatasetWarning, PPOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoDatasetWarning)
        return (trainer_class or PPOTrainer)(*args, **kwargs)


def make_step_fn(method: str, workload: Workload, device: str, dtype: torch.dtype):
    """Build the models for `method` and return a function `(queries, responses, scores) -> None`."""
    # Any workload named grpo-beta0* (the tests' smaller one too) is stepped like grpo-beta0.
    if workload.name.startswith(GRPO_BETA0.name):
        return make_grpo_beta0_step_fn(method, workload, device, dtype)
    if method == "step-every-pass":
        raise ValueError(f"method {method!r} applies to the grpo-beta0 workload, not {workload.name!r}")
    if method in PREFIX_METHODS and getattr(workload, "advantage_estimator", "gae") == "gae":
        raise ValueError(f"method {method!r} applies to the critic-free workloads (shared_prefix), not {workload.name!r}")
    one_buffer_unsupported = isinstance(workload, CriticFreeWorkload) or workload.name in CRITIC_WORKLOADS
    if method == "step-one-buffer" and one_buffer_unsupported:
        raise ValueError(f"method {method!r} exists for the value-head workloads, not {workload.name!r}")
    if method == PACKED_FLOOR and not packed_floor_supported(workload):
        raise ValueError(f"method {PACKED_FLOOR!r} exists for the value-head workloads, not {workload.name!r}")
    if isinstance(workload, CriticFreeWorkload) and workload.advantage_estimator != "gae":
        return make_critic_free_step_fn(method, workload, device, dtype)
    if workload.name in CRITIC_WORKLOADS:
        return make_critic_step_fn(method, workload, device, dtype)
    lm = make_lm(workload, device, dtype)
    if method == "floor":
        return FloorPPO(lm, workload.mini_batch_size, workload.ppo_epochs).step
    if method == PACKED_FLOOR:
        return PackedFloorPPO(lm, workload.mini_batch_size, workload.ppo_epochs).step
    # Imported here so that `--methods floor` runs without trl_lite.
    from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig

    ref_lm = copy.deepcopy(lm)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(lm).to(device=device, dtype=dtype)
    ref_model = AutoModelForCausalLMWithValueHead.from_pretrained(ref_lm).to(device=device, dtype=dtype)
    options = json.loads(workload.options)
    with_generation_logprobs = options.pop("generation_logprobs", False)
    if method == "step-one-buffer":
        options["lm_head_chunk_size"] = 0
    config = PPOConfig(
        batch_size=workload.batch_size,
        mini_batch_size=workload.mini_batch_size,
        ppo_epochs=workload.ppo_epochs,
        learning_rate=LEARNING_RATE,
        seed=workload.seed,
        # "step": the default (packed mini-batches for GPT-2); "step-padded": every mini-batch padded.
        padding_free=False if method == "step-padded" else None,
        **options,
    )
    trainer = quiet_trainer(config, model, ref_model, tokenizer=None)
    if not with_generation_logprobs:
        return trainer.step

    generation = []

    def step_with_engine_logprobs(queries, responses, scores):
        # Stand-in engine log-probs, made once (untimed work of the first call): what the rollout pass
        # computes, shifted, so that TIS weights vary.
        if not generation:
            with torch.no_grad():
                logprobs = trainer.experience_maker.passes(trainer.forward.make_rows(queries, responses, None))[0]
            generation.extend(logprobs[i, : len(r)].cpu() - 0.05 for i, r in enumerate(responses))
        return trainer.step(queries, responses, scores, generation_logprobs=generation)

    return step_with_engine_logprobs


def packed_floor_supported(workload: Workload) -> bool:
    """Whether `floor-packed` exists for `workload`: the value-head PPO workloads (not the critic or critic-free ones)."""
    return not isinstance(workload, CriticFreeWorkload) and workload.name not in CRITIC_WORKLOADS


def methods_for(workload: Workload, methods) -> list:
    """`methods` that exist for `workload` (`floor-packed` is left out where it does not)."""
    return [m for m in methods if m != PACKED_FLOOR or packed_floor_supported(workload)]


def make_critic_free_step_fn(method: str, workload: CriticFreeWorkload, device: str, dtype: torch.dtype):
    """`make_step_fn` for a critic-free workload: `PPOTrainer` on the plain model, or `CriticFreeFloor`."""
    lm = make_lm(workload, device, dtype)
    if method == "floor":
        return CriticFreeFloor(lm, workload.mini_batch_size, workload.ppo_epochs, workload.num_samples_per_query).step
    from trl_lite import PPOConfig

    config = PPOConfig(
        batch_size=workload.batch_size,
        mini_batch_size=workload.mini_batch_size,
        gradient_accumulation_steps=workload.gradient_accumulation_steps,
        ppo_epochs=workload.ppo_epochs,
        learning_rate=LEARNING_RATE,
        init_kl_coef=KL_COEF,
        adap_kl_ctrl=False,
        advantage_estimator=workload.advantage_estimator,
        num_samples_per_query=workload.num_samples_per_query,
        seed=workload.seed,
        padding_free=False if method == "step-padded" else None,
        **({"prefix_sharing": PREFIX_METHODS[method]} if method in PREFIX_METHODS else {}),
    )
    trainer = quiet_trainer(config, lm, copy.deepcopy(lm), tokenizer=None)
    if method not in PREFIX_METHODS:
        return trainer.step
    last = {}

    def step(queries, responses, scores):
        last.update(trainer.step(queries, responses, scores))

    # The share of the prompt + response tokens of the last step's passes that ran (1: no prompt shared).
    step.extras = lambda: {"tokens_run": 1 - float(last["prefix_sharing/tokens_saved_fraction"])}
    return step


def make_grpo_beta0_step_fn(method: str, workload: CriticFreeWorkload, device: str, dtype: torch.dtype):
    """`make_step_fn` for `grpo-beta0`: `PPOTrainer` on the plain model (`ref_model=None`), with both passes
    forced for `step-every-pass`, or `OnPolicyFloor`. The trainer's step function reports `extras()`:
    the passes without grad per step (measured: the model bodies' calls without grad, per mini-batch of
    rows) and the parameter bytes of the reference copy the trainer made (MB)."""
    lm = make_lm(workload, device, dtype)
    if method == "floor":
        return OnPolicyFloor(lm, workload.mini_batch_size, 1, workload.num_samples_per_query).step
    from trl_lite import PPOConfig, PPOTrainer
    from trl_lite.trainer.step.rollout_plan import EVERY_PASS

    config = PPOConfig(
        batch_size=workload.batch_size, mini_batch_size=workload.mini_batch_size, ppo_epochs=workload.ppo_epochs,
        learning_rate=LEARNING_RATE, advantage_estimator=workload.advantage_estimator,
        num_samples_per_query=workload.num_samples_per_query, seed=workload.seed,
        padding_free=False if method == "step-padded" else None, **json.loads(workload.options),
    )  # fmt: skip
    trainer_class = PPOTrainer
    if method == "step-every-pass":
        trainer_class = type("EveryPassTrainer", (PPOTrainer,), {"plan_rollout": staticmethod(lambda c: EVERY_PASS)})
    trainer = quiet_trainer(config, lm, ref_model=None, tokenizer=None, trainer_class=trainer_class)
    reference = trainer.ref_model
    calls, steps = [], []
    for model in [lm] + ([reference.pretrained_model] if reference is not None else []):
        model.transformer.register_forward_pre_hook(lambda m, a: None if torch.is_grad_enabled() else calls.append(1))

    def step(queries, responses, scores):
        steps.append(1)
        return trainer.step(queries, responses, scores)

    def extras() -> dict:
        params = {id(p): p for p in reference.parameters()}.values() if reference is not None else ()
        chunks = -(-workload.batch_size // workload.mini_batch_size)
        return {
            "rollout_passes": len(calls) / max(len(steps), 1) / chunks,
            "reference_mb": sum(p.numel() * p.element_size() for p in params) / 2**20,
        }

    step.extras = extras
    return step


def make_critic_step_fn(method: str, workload: Workload, device: str, dtype: torch.dtype):
    """`make_step_fn` for the critic workloads: a plain causal-LM policy and a sequence-classification critic."""
    lm = make_lm(workload, device, dtype)
    critic = make_critic(lm, device, dtype)
    if method == "floor":
        return FloorCriticPPO(lm, critic, workload.mini_batch_size, workload.ppo_epochs).step
    from trl_lite import PPOConfig

    config = PPOConfig(
        batch_size=workload.batch_size, mini_batch_size=workload.mini_batch_size, ppo_epochs=workload.ppo_epochs,
        learning_rate=LEARNING_RATE, seed=workload.seed,
    )  # fmt: skip
    return quiet_trainer(config, lm, copy.deepcopy(lm), tokenizer=None, value_model=critic).step
