"""What predicts: value-head wrappers around transformers/PEFT models, the separate critic, and reference-model creation."""

from .modeling_base import PreTrainedModelWrapper
from .reference import LAYER_PATTERNS, create_reference_model
from .modeling_value_head import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, ValueHead
from .modeling_value_model import ValueModel, as_value_model

__all__ = [
    "LAYER_PATTERNS",
    "AutoModelForCausalLMWithValueHead",
    "AutoModelForSeq2SeqLMWithValueHead",
    "PreTrainedModelWrapper",
    "ValueHead",
    "ValueModel",
    "as_value_model",
    "create_reference_model",
]
