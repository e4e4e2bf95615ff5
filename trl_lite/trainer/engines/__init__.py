"""Generation engines: one interface (:class:`GenerationEngine`), a transformers and a vLLM implementation."""

from .base import GenerationEngine, trim_rows
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
    "ColocatedVLLM", "EnginePlacement", "GenerationEngine", "TransformersEngine", "VLLMEngine", "WeightVersion",
    "build_vllm_backend", "check_vllm_can_load", "colocated_llm_options", "engine_dtype", "engine_placement",
    "eval_mode", "named_policy_weights", "require_vllm", "resolve_sleep_mode", "sampling_params", "trim_rows",
]  # fmt: skip
