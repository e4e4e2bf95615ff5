"""What predicts: value-head wrappers around transformers/PEFT models, and reference-model creation."""

from .modeling_base import LAYER_PATTERNS, PreTrainedModelWrapper, create_reference_model
from .modeling_value_head import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, ValueHead

__all__ = [
    "LAYER_PATTERNS",
    "AutoModelForCausalLMWithValueHead",
    "AutoModelForSeq2SeqLMWithValueHead",
    "PreTrainedModelWrapper",
    "ValueHead",
    "create_reference_model",
]
