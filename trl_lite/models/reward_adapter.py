"""Multi-adapter RL: a reward model's LoRA adapter and score head loaded beside the policy adapter.

A reward model trained as a PEFT sequence classifier (e.g. `GPT2ForSequenceClassification` with
`num_labels=1`, LoRA, and `modules_to_save=["score"]`) saves its adapter weights and its whole
score head in one adapter file. Loaded into the policy's `PeftModel` under a second adapter name,
the same base weights serve as policy (policy adapter on), reward model (reward adapter on, then the
score head on the last hidden states) and reference (every adapter off).
"""

import torch
from safetensors.torch import load_file
from torch import nn

# Adapter weight files, in the order they are looked for (safetensors first, as peft writes them).
_ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def check_reward_adapter_arguments(reward_adapter, reward_adapter_name) -> None:
    """Raise ValueError for a `reward_adapter` that is not a str, or an adapter name that is not one."""
    if not isinstance(reward_adapter, str):
        raise ValueError(
            "reward_adapter must be a str: a local directory or hub id of a reward model's PEFT adapter, "
            f"got {type(reward_adapter).__name__}"
        )
    if not isinstance(reward_adapter_name, str) or not reward_adapter_name:
        raise ValueError(f"reward_adapter_name must be a non-empty str, got {reward_adapter_name!r}")


def _score_tensors(state_dict: dict, head_names) -> dict:
    """The score head's tensors in an adapter state dict, keyed `weight`/`bias`.

    A key belongs to the head when the module that owns the parameter is named one of `head_names`
    (e.g. `base_model.model.score.weight`); the first name found wins.
    """
    for head_name in head_names:
        head = {}
        for key, value in state_dict.items():
            module, _, parameter = key.rpartition(".")
            if module.rpartition(".")[2] == head_name and parameter in ("weight", "bias"):
                head[parameter] = value
        if head:
            return head
    return {}


def load_score_head(adapter_weights_path: str, head_names, dtype: torch.dtype, device) -> nn.Linear:
    """A frozen `nn.Linear` holding the score head saved in a reward adapter's weight file.

    The head maps hidden states (..., H) to scores (..., num_labels); it has a bias only when the
    saved head has one.
    """
    if adapter_weights_path.endswith(".safetensors"):
        state_dict = load_file(adapter_weights_path, device="cpu")
    else:
        state_dict = torch.load(adapter_weights_path, map_location="cpu", weights_only=True)
    head = _score_tensors(state_dict, head_names)
    if "weight" not in head:
        raise ValueError(
            f"the reward adapter file {adapter_weights_path} holds no score head (no weight of a module named "
            f"one of {list(head_names)}); save the reward model with modules_to_save=['score']"
        )
    num_labels, hidden_size = head["weight"].shape
    score = nn.Linear(hidden_size, num_labels, bias="bias" in head)
    score.load_state_dict(head)
    score.requires_grad_(False)
    return score.to(device=device, dtype=dtype)


def adapter_weights_file(reward_adapter: str, resolve) -> str:
    """Path of the weight file of the adapter at `reward_adapter` (`resolve(filename)` finds a file or None)."""
    for filename in _ADAPTER_WEIGHT_FILES:
        path = resolve(filename)
        if path is not None:
            return path
    raise ValueError(
        f"reward_adapter={reward_adapter!r} holds none of {list(_ADAPTER_WEIGHT_FILES)}: "
        "pass the directory (or hub id) a PEFT reward model was saved to"
    )
