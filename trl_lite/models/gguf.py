"""Models loaded from GGUF files (`from_pretrained(dir, gguf_file=...)`) as ordinary float models.

transformers reads a GGUF file through its GGUF "quantizer". Unless the `kernels` package gives it
packed matmul kernels, it de-quantises every weight into a float tensor, yet keeps the quantizer and
the `quantization_config` on the model - and then refuses `save_pretrained` ("quantized with
QuantizationMethod.GGUF and is not serializable") and marks the model as not trainable. A policy tuned
from such a model must save as an ordinary float checkpoint, so the wrappers drop that quantizer once
every weight is a float tensor.
"""

from transformers.utils.quantization_config import QuantizationMethod


def is_gguf_quantized(model) -> bool:
    """True when `model` (a transformers model) still carries the quantizer of a GGUF load."""
    quantizer = getattr(model, "hf_quantizer", None)
    config = getattr(quantizer, "quantization_config", None)
    return getattr(config, "quant_method", None) == QuantizationMethod.GGUF


def drop_gguf_quantizer(model) -> None:
    """Make a model loaded from a GGUF file (a transformers model, or a PEFT model of one) an ordinary
    float model: its quantizer and `config.quantization_config` go, so it trains and `save_pretrained`
    writes float weights.

    Does nothing for other models. Raises ValueError when some weight is still packed in GGUF blocks
    (loaded with GGUF kernels, `GgufConfig(dequantize=False)`): those layers cannot train.
    """
    if hasattr(model, "get_base_model"):  # a PEFT model: the quantizer sits on the model it adapts
        model = model.get_base_model()
    if not is_gguf_quantized(model):
        return
    packed = [name for name, param in model.named_parameters() if not param.is_floating_point()]
    if packed:
        raise ValueError(
            f"the model loaded from a GGUF file keeps {len(packed)} weights packed in GGUF blocks (e.g. {packed[0]}), "
            "which cannot be trained or saved as float weights; load it de-quantised: "
            "from_pretrained(..., gguf_file=..., quantization_config=GgufConfig(dequantize=True))"
        )
    # The quantizer's own clean-up: it removes `hf_quantizer`, `config.quantization_config`,
    # `quantization_method` and sets `is_quantized = False`, as transformers does for de-quantised loads.
    model.hf_quantizer.remove_quantization_config(model)
