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
from .weight_sync import WeightVersion, named_policy_weights

__all__ = [
    "ColocatedVLLM", "GenerationEngine", "TransformersEngine", "VLLMEngine", "WeightVersion", "build_vllm_backend",
    "check_vllm_can_load", "eval_mode", "named_policy_weights", "require_vllm", "sampling_params", "trim_rows",
]  # fmt: skip
