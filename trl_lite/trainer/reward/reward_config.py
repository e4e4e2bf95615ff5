"""``RewardConfig``: every setting of a reward-model run, named as in transformers' ``TrainingArguments``
and classic TRL's ``RewardConfig``, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import SchedulerType

from ..config_checks import _check_float, _check_log_with, _check_positive_float, _check_positive_int

TRUNCATION_MODES = ("drop", "keep_end", "error")


@dataclass
class RewardConfig:
    """Configuration of :class:`~trl_lite.RewardTrainer`.

    Batch sizes are per process: each optimizer step sees ``per_device_train_batch_size *
    gradient_accumulation_steps * num_processes`` pairs. Steps count optimizer steps.
    """

    # Run bookkeeping
    output_dir: str = field(default="reward_model", metadata={"help": "Where save_model and checkpoints write."})
    seed: int = field(default=0, metadata={"help": "Seed for python, numpy and torch (model init, shuffling)."})
    log_with: str | None = field(
        default=None, metadata={"help": "Tracker for accelerate: 'wandb', 'tensorboard', 'all' or None."}
    )
    tracker_project_name: str = field(default="trl", metadata={"help": "Project name for the trackers."})
    tracker_kwargs: dict[str, Any] = field(default_factory=dict, metadata={"help": "kwargs for init_trackers."})
    accelerator_kwargs: dict[str, Any] = field(default_factory=dict, metadata={"help": "kwargs for Accelerator."})
    project_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "kwargs for accelerate's ProjectConfiguration (e.g. logging_dir)."}
    )
    disable_tqdm: bool = field(default=False, metadata={"help": "Hide the progress bar."})
    # Schedule
    num_train_epochs: int = field(default=1, metadata={"help": "Passes over the training pairs."})
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps to run; > 0 overrides num_train_epochs."})
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak learning rate of AdamW."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW's decoupled weight decay."})
    lr_scheduler_type: str = field(
        default="linear", metadata={"help": "A transformers scheduler name: linear, cosine, constant, ..."}
    )
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps; overrides warmup_ratio when > 0."})
    warmup_ratio: float = field(default=0.0, metadata={"help": "Warm-up as a fraction of all steps."})
    max_grad_norm: float | None = field(default=1.0, metadata={"help": "Clip the global gradient norm; None: off."})
    # Batching
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Pairs per forward pass and process."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Pairs per evaluation pass and process."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Forward passes per optimizer step."})
    dataloader_drop_last: bool = field(default=False, metadata={"help": "Drop each epoch's last incomplete batch."})
    # Logging, evaluation and checkpoints (in optimizer steps)
    logging_steps: int = field(default=10, metadata={"help": "Log training metrics every this many steps."})
    eval_steps: int | None = field(
        default=None, metadata={"help": "Evaluate every this many steps; None: at the end of every epoch."}
    )
    save_steps: int = field(
        default=0, metadata={"help": "Write OUTPUT_DIR/checkpoint every this many steps; 0: never."}
    )
    # Precision and memory
    bf16: bool = field(default=False, metadata={"help": "bfloat16 mixed precision (autocast), on CPU or GPU."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Enable gradient checkpointing."})
    # Data and loss
    max_length: int | None = field(
        default=512, metadata={"help": "Longest chosen or rejected sequence, in tokens (prompt included)."}
    )
    truncation_mode: str = field(
        default="drop",
        metadata={
            "help": "Pairs with a side longer than max_length: 'drop' them, 'keep_end' (cut tokens from the "
            "start, so the answer's end, where the reward is read, stays), or 'error'. Counted and warned."
        },
    )
    center_rewards_coefficient: float | None = field(
        default=None, metadata={"help": "Weight of (r_chosen + r_rejected)^2 in the loss; None: off."}
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for tokenizing the data."})
    # Set by the trainer
    world_size: int | None = field(default=None, metadata={"help": "Set by the trainer: number of processes."})

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the first bad field, its value and what is accepted."""
        for name in ("num_train_epochs", "per_device_train_batch_size", "per_device_eval_batch_size",
                     "gradient_accumulation_steps", "logging_steps"):
            _check_positive_int(name, getattr(self, name))  # fmt: skip
        for name in ("max_steps", "warmup_steps", "save_steps", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(f"max_steps must be a positive int, or -1 to use num_train_epochs; got {self.max_steps}.")
        for name in ("warmup_steps", "save_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)}.")
        for name in ("eval_steps", "max_length", "dataset_num_proc"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        _check_positive_float("learning_rate", self.learning_rate)
        _check_float("weight_decay", self.weight_decay, minimum=0.0)
        _check_float("warmup_ratio", self.warmup_ratio, minimum=0.0, maximum=1.0)
        for name in ("max_grad_norm", "center_rewards_coefficient"):
            if getattr(self, name) is not None:
                _check_positive_float(name, getattr(self, name))
        schedulers = [s.value for s in SchedulerType]
        if self.lr_scheduler_type not in schedulers:
            raise ValueError(f"lr_scheduler_type must be one of {schedulers}, got {self.lr_scheduler_type!r}.")
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {self.truncation_mode!r}.")
        _check_log_with(self.log_with)
        for name in ("bf16", "gradient_checkpointing", "dataloader_drop_last", "disable_tqdm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise TypeError(f"output_dir must be a non-empty str, got {self.output_dir!r}.")
        for name in ("tracker_kwargs", "accelerator_kwargs", "project_kwargs"):
            if not isinstance(getattr(self, name), dict):
                raise TypeError(f"{name} must be a dict, got {type(getattr(self, name)).__name__}.")
        if self.bf16 and self.accelerator_kwargs.get("mixed_precision", "bf16") != "bf16":
            raise ValueError(
                f"bf16=True conflicts with accelerator_kwargs['mixed_precision']="
                f"{self.accelerator_kwargs['mixed_precision']!r}; set one of them."
            )
