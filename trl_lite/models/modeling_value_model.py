"""A separate critic: a sequence-classification model (e.g. a reward model) read at every position.

DeepSpeed-Chat and OpenRLHF initialise the critic from the reward model: the same backbone and the
same one-output score head, applied to each position's last hidden state instead of the last
token's only. :class:`ValueModel` does exactly that for a transformers
``AutoModelForSequenceClassification`` with ``num_labels=1`` (or a PEFT model around one); the
classifier's own forward is not used, since it pools a single position, and no LM head exists.
"""

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification

from .modeling_base import PreTrainedModelWrapper


class ValueModel(PreTrainedModelWrapper):
    """Per-position values from a decoder-only sequence-classification model with one label.

    ``model(input_ids, attention_mask=..., position_ids=...)`` returns values ``(B, S)`` in float32:
    the model's ``score`` head (a ``Linear(H, 1)``) on each last hidden state of its base model.
    ``from_pretrained`` loads a reward model directory (``peft_config`` adds an adapter);
    ``save_pretrained`` writes a transformers sequence-classification checkpoint.
    """

    transformers_parent_class = AutoModelForSequenceClassification
    supported_modules = ()

    def __init__(self, pretrained_model):
        super().__init__(pretrained_model)
        model = self.transformers_model
        num_labels = getattr(self.config, "num_labels", None)
        if num_labels != 1:
            raise ValueError(
                f"value_model must have one output (num_labels=1) to give one value per position, got "
                f"num_labels={num_labels} ({type(model).__name__}); load it with num_labels=1"
            )
        if self.is_encoder_decoder or not isinstance(getattr(model, "score", None), nn.Module):
            raise ValueError(
                "value_model must be a decoder-only AutoModelForSequenceClassification with a `score` head "
                f"(GPT-2, Llama, Mistral, Qwen, ...), got {type(model).__name__}"
            )
        if self.is_peft_model and self.pretrained_model.active_peft_config.is_prompt_learning:
            raise ValueError("value_model: prompt-learning adapters are not supported (they act in the PEFT forward)")
        backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
        if not isinstance(backbone, nn.Module) or backbone is model:
            raise ValueError(f"value_model: cannot find the base model of {type(model).__name__}")

    def forward(self, input_ids=None, attention_mask=None, **kwargs) -> torch.Tensor:
        """Values ``(B, S)`` (float32) from input_ids, attention_mask ``(B, S)``; other kwargs
        (position_ids, ...) go to the base model."""
        model = self.transformers_model
        backbone = getattr(model, model.base_model_prefix)
        kwargs.setdefault("use_cache", False)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        return model.score(hidden).squeeze(-1).float()


def as_value_model(model) -> ValueModel:
    """``model`` as a :class:`ValueModel`: itself, or a transformers/PEFT classifier wrapped."""
    if isinstance(model, ValueModel):
        return model
    return ValueModel(model)
