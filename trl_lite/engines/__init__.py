"""What generates: one interface (:class:`GenerationEngine`), a transformers and a vLLM implementation.

A peer of the trainers, not a part of one: the PPO trainer, ``agents``, ``rollouts``, ``environment``,
``extras`` and the vLLM server all generate through this package, and it imports nothing of theirs.
``generation.py`` (:class:`RolloutGeneration`: the policy's engine, the reference's, and when to push
weights) lives here for the same reason: four packages besides the trainer hold one, and it reads the
config's fields without importing the trainer.
"""

from .base import GenerationEngine, trim_rows
from .generation import RolloutGeneration, build_generation
from .temperature import Sampling, check_vllm_logprobs, resolve_sampling_kwargs, vllm_logprobs_mode
from .transformers_engine import TransformersEngine, eval_mode
from .vllm_engine import (
    ColocatedVLLM,
    VLLMEngine,
    build_vllm_backend,
    check_vllm_can_load,
    require_vllm,
    sampling_params,
)
from .vllm_options import EnginePlacement, colocated_llm_options, engine_dtype, engine_placement, resolve_sleep_mode
from .weight_sync import WeightVersion, named_policy_weights

__all__ = [
    "ColocatedVLLM", "EnginePlacement", "GenerationEngine", "RolloutGeneration", "Sampling", "TransformersEngine",
    "VLLMEngine",
    "WeightVersion", "build_generation", "build_vllm_backend", "check_vllm_can_load", "check_vllm_logprobs",
    "colocated_llm_options", "engine_dtype", "engine_placement", "eval_mode", "named_policy_weights", "require_vllm",
    "resolve_sampling_kwargs", "resolve_sleep_mode", "sampling_params", "trim_rows", "vllm_logprobs_mode",
]  # fmt: skip
