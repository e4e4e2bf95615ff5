"""``RewardTrainer``: a reward model trained from preference pairs, on accelerate like ``PPOTrainer``.

The model is any transformers ``AutoModelForSequenceClassification`` with ``num_labels=1``; a
sequence's reward is the model's own pooled score, ``logits[:, 0]``. For decoder-only models (GPT-2,
Llama, ...) transformers pools at the last token that is not padding: the end of the answer, where
the model has read the whole prompt and answer, as DeepSpeed-Chat's reward model reads it.
Encoders (BERT, DistilBERT) pool at their first token, which attends to the whole text. The
trainer reads that same pooled score rather than one of its own so that the saved model gives,
in a transformers ``pipeline`` or as a PPO critic, exactly the reward it was trained to give.
Position ids follow the attention mask, so left or right padding gives a pair the same reward.

One forward pass per batch scores the chosen and the rejected answers together (``(2P, S)``); the
loss is :func:`trl_lite.core.pairwise_ranking_loss`. Process and device set-up is shared with
``PPOTrainer`` (:mod:`.accelerate_setup`); data checks and the collator are in :mod:`.reward_data`.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import asdict

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_scheduler

from ... import core
from ...core import flatten_dict, pairwise_ranking_loss, preference_stats
from ..accelerate_setup import build_accelerator, default_optimizer, fill_deepspeed_batch_config, save_full_model
from ..state.checkpointing import Checkpointer
from ..state.resumable_loader import ResumableLoader
from .reward_config import RewardConfig
from .reward_data import RewardDataCollatorWithPadding, prepare_pairs

# Per-pair sums kept between logging steps: loss, correct, chosen reward, rejected reward, pairs.
_SUMS = ("loss", "accuracy", "rewards/chosen", "rewards/rejected", "pairs")


class RewardTrainer:
    """Trains a scalar reward model on chosen/rejected pairs (classic TRL's ``RewardTrainer`` API).

    ``save_checkpoint(path)``/``load_checkpoint(path)`` (or ``train(resume_from_checkpoint=path)``)
    continue a run exactly: weights, optimizer, scheduler, step and epoch, the dataloader's position,
    the metrics of the current logging window and every process's RNG states.

    Args:
        model: a transformers ``PreTrainedModel`` for sequence classification with ``num_labels=1``
            (``AutoModelForSequenceClassification.from_pretrained(name, num_labels=1)``), or a PEFT model
            of one.
        args: the run's :class:`RewardConfig`.
        data_collator: default :class:`RewardDataCollatorWithPadding` over ``tokenizer``.
        train_dataset, eval_dataset: ``datasets.Dataset`` or lists of dicts with ``chosen``/``rejected``
            texts (optionally ``prompt``) or ``input_ids_chosen``/``input_ids_rejected``; optional
            ``margin``. Checked and tokenized once (see :func:`.reward_data.prepare_pairs`); what was
            dropped or cut is in ``trainer.data_report``.
        tokenizer: tokenizes texts and pads batches; saved with the model.
        optimizers: ``(optimizer, lr_scheduler)``; default AdamW and ``get_scheduler(lr_scheduler_type)``
            over the run's optimizer steps. The scheduler is stepped once per optimizer step.
        peft_config: a ``peft`` config (``task_type="SEQ_CLS"``) to train adapters instead of all weights.
    """

    def __init__(
        self,
        model: PreTrainedModel | None = None,
        args: RewardConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        optimizers: tuple = (None, None),
        peft_config=None,
    ):
        args = RewardConfig() if args is None else args
        _check_constructor_args(model, args, data_collator, train_dataset, tokenizer, optimizers, peft_config)
        self.args = args
        self.accelerator = build_accelerator(
            args, sync_with_dataloader=True, **({"mixed_precision": "bf16"} if args.bf16 else {})
        )
        args.world_size = self.accelerator.num_processes
        base = _base_model(model)
        pad_token_id = base.config.pad_token_id
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id
        vocab_size = base.get_input_embeddings().num_embeddings
        self.data_report = {}
        with self.accelerator.main_process_first():
            prepared = {}
            for name, data in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
                if data is not None:
                    prepared[name] = prepare_pairs(
                        data, tokenizer, args.max_length, args.truncation_mode, pad_token_id, vocab_size,
                        name=name, num_proc=args.dataset_num_proc,
                    )  # fmt: skip
                    self.data_report[name.removesuffix("_dataset")] = prepared[name].report
        self.train_dataset = prepared["train_dataset"].dataset
        self.eval_dataset = prepared["eval_dataset"].dataset if eval_dataset is not None else None

        core.set_seed(args.seed)
        if base.config.pad_token_id is None:
            base.config.pad_token_id = pad_token_id
        if base.config.problem_type is None:
            # A reward is a real number: a transformers pipeline then returns it as is, without a sigmoid.
            base.config.problem_type = "regression"
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        self.is_peft_model = _is_peft_model(model)
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            if self.is_peft_model:
                # Frozen embeddings give the checkpointed blocks inputs without grad; the adapters need it.
                model.enable_input_require_grads()
        self.tokenizer = tokenizer
        self.data_collator = data_collator or RewardDataCollatorWithPadding(tokenizer)
        self._pass_position_ids = "position_ids" in inspect.signature(base.forward).parameters

        optimizer, lr_scheduler = optimizers
        optimizer = optimizer or default_optimizer(model, args.learning_rate, weight_decay=args.weight_decay)
        self._data_generator = torch.Generator().manual_seed(args.seed)
        train_loader = DataLoader(
            self.train_dataset,
            batch_size=args.per_device_train_batch_size,
            collate_fn=self.data_collator,
            shuffle=True,
            drop_last=args.dataloader_drop_last,
            generator=self._data_generator,
        )
        self.is_deepspeed_enabled = getattr(self.accelerator.state, "deepspeed_plugin", None) is not None
        if self.is_deepspeed_enabled:
            fill_deepspeed_batch_config(
                self.accelerator, args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_grad_norm
            )
        self.model, self.optimizer, train_loader = self.accelerator.prepare(model, optimizer, train_loader)
        self.train_dataloader = ResumableLoader(train_loader, self._data_generator)
        if len(train_loader) == 0:
            raise ValueError(
                f"train_dataset has {len(self.train_dataset)} pairs: no batch of per_device_train_batch_size="
                f"{args.per_device_train_batch_size} per process with dataloader_drop_last=True."
            )
        self.eval_dataloader = self._eval_loader(self.eval_dataset) if self.eval_dataset is not None else None

        self.steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
        self.max_steps = args.max_steps if args.max_steps > 0 else args.num_train_epochs * self.steps_per_epoch
        if lr_scheduler is None:
            warmup = args.warmup_steps or math.ceil(args.warmup_ratio * self.max_steps)
            # Built on the optimizer the user would step, not on accelerate's wrapper: accelerate's prepared
            # scheduler steps once per process per call, which would change the schedule with the process count.
            lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer, warmup, self.max_steps)
        self.lr_scheduler = lr_scheduler
        self.accelerator.register_for_checkpointing(self.lr_scheduler)

        self.global_step = 0
        self.epoch = 0
        self.log_history: list[dict] = []
        device = self.accelerator.device
        self._window = torch.zeros(len(_SUMS), dtype=torch.float64, device=device)  # since the last log
        self._totals = torch.zeros(len(_SUMS), dtype=torch.float64, device=device)  # since the run started
        self._grad_norm = None
        if args.log_with is not None:
            self.accelerator.init_trackers(
                args.tracker_project_name,
                config={k: v for k, v in flatten_dict(asdict(args)).items() if isinstance(v, (int, float, str, bool))},
                init_kwargs=args.tracker_kwargs,
            )

    # ------------------------------------------------------------------------------------------
    # Rewards and loss
    # ------------------------------------------------------------------------------------------
    def compute_rewards(self, model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewards of the chosen and the rejected sequences of a collated batch, in one forward pass.

        Shape: ``input_ids_*``/``attention_mask_*`` ``(P, S)`` -> two ``(P,)`` tensors (at least float32)
        on the accelerator's device. The inputs may sit on the CPU (a collator's output) or on that device:
        the concatenated batch is moved once.
        """
        device = self.accelerator.device
        input_ids = torch.cat([inputs["input_ids_chosen"], inputs["input_ids_rejected"]]).to(device)
        attention_mask = torch.cat([inputs["attention_mask_chosen"], inputs["attention_mask_rejected"]]).to(device)
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self._pass_position_ids:
            # Positions count real tokens only, so a left-padded sequence is read as an unpadded one.
            kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        rewards = model(**kwargs).logits[:, 0]  # (2P,)
        # Half-precision scores are compared in float32; float64 models keep float64.
        rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
        pairs = inputs["input_ids_chosen"].shape[0]
        return rewards[:pairs], rewards[pairs:]

    def _pair_losses(self, model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-pair losses, chosen and rejected rewards, all ``(P,)``."""
        chosen, rejected = self.compute_rewards(model, inputs)
        margin = inputs.get("margin")
        margin = margin.to(chosen.device) if isinstance(margin, torch.Tensor) else margin
        losses = pairwise_ranking_loss(chosen, rejected, margin, self.args.center_rewards_coefficient)
        return losses, chosen, rejected

    def compute_loss(self, model, inputs: dict, return_outputs: bool = False):
        """Mean pairwise ranking loss of a batch; with ``return_outputs``, also the rewards (classic API)."""
        losses, chosen, rejected = self._pair_losses(model, inputs)
        if return_outputs:
            return losses.mean(), {"rewards_chosen": chosen, "rewards_rejected": rejected}
        return losses.mean()

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | None = None) -> dict:
        """Run to ``max_steps`` optimizer steps (from a checkpoint if given); logs, evaluates and saves
        checkpoints as configured. Returns ``global_step`` and the run's mean loss and accuracy."""
        args, accelerator = self.args, self.accelerator
        if resume_from_checkpoint is not None:
            self.load_checkpoint(resume_from_checkpoint)
        self.model.train()
        progress = tqdm(
            total=self.max_steps,
            initial=self.global_step,
            desc="reward model",
            disable=args.disable_tqdm or not accelerator.is_main_process,
        )
        while self.global_step < self.max_steps:
            for batch in self.train_dataloader:
                self._train_batch(batch)
                if not accelerator.sync_gradients:
                    continue
                self.global_step += 1
                progress.update(1)
                if self.global_step % args.logging_steps == 0:
                    progress.set_postfix(self._log_window(), refresh=False)
                if args.eval_steps and self.global_step % args.eval_steps == 0 and self.eval_dataloader is not None:
                    self.evaluate()
                if args.save_steps and self.global_step % args.save_steps == 0:
                    self.save_checkpoint(os.path.join(args.output_dir, "checkpoint"))
                if self.global_step >= self.max_steps:
                    break
            # The pass is over when the loader ran out (position back to 0) or stopped at its last batch.
            if self.train_dataloader.state_dict()["served"] in (0, len(self.train_dataloader)):
                self.epoch += 1
                if args.eval_steps is None and self.eval_dataloader is not None:
                    self.evaluate()
        if self._window[-1] > 0:
            self._log_window()
        progress.close()
        totals = self.accelerator.reduce(self._totals.clone(), reduction="sum")
        return {
            "global_step": self.global_step,
            "train_loss": float(totals[0] / totals[-1]),
            "train_accuracy": float(totals[1] / totals[-1]),
        }

    def _train_batch(self, batch: dict) -> None:
        """Forward, backward and, at the end of an accumulation window, clip and step."""
        args, accelerator = self.args, self.accelerator
        with accelerator.accumulate(self.model):
            losses, chosen, rejected = self._pair_losses(self.model, batch)
            accelerator.backward(losses.mean())
            if accelerator.sync_gradients:
                if args.max_grad_norm is not None or self.is_deepspeed_enabled:
                    # Under DeepSpeed the engine clips inside its step; this returns its norm.
                    norm = accelerator.clip_grad_norm_(self.model.parameters(), args.max_grad_norm or math.inf)
                    self._grad_norm = float(norm) if norm is not None else None
            self.optimizer.step()
            self.optimizer.zero_grad()
            if accelerator.sync_gradients:
                self.lr_scheduler.step()
        stats = preference_stats(chosen.detach(), rejected.detach())
        pairs = float(losses.shape[0])
        sums = torch.stack([
            losses.detach().sum().double(),
            stats["accuracy"].double() * pairs,
            stats["rewards/chosen"].double() * pairs,
            stats["rewards/rejected"].double() * pairs,
            torch.tensor(pairs, dtype=torch.float64, device=losses.device),
        ])  # fmt: skip
        self._window += sums
        self._totals += sums

    def _log_window(self) -> dict:
        """Log the means over every process's pairs since the last log; returns them."""
        sums = self.accelerator.reduce(self._window.clone(), reduction="sum")
        self._window.zero_()
        loss, correct, chosen, rejected, pairs = sums.tolist()
        logs = {
            "loss": loss / pairs,
            "accuracy": correct / pairs,
            "rewards/chosen": chosen / pairs,
            "rewards/rejected": rejected / pairs,
            "rewards/margins": (chosen - rejected) / pairs,
            "learning_rate": self.lr_scheduler.get_last_lr()[0],
            "epoch": self._epoch_progress(),
        }
        if self._grad_norm is not None:
            logs["grad_norm"] = self._grad_norm
        self._record(logs)
        return {"loss": f"{logs['loss']:.3f}", "accuracy": f"{logs['accuracy']:.2f}"}

    def _epoch_progress(self) -> float:
        """Passes over the training data so far, counted in optimizer steps."""
        return self.global_step / self.steps_per_epoch

    def _record(self, logs: dict) -> None:
        self.log_history.append({**logs, "step": self.global_step})
        if self.args.log_with is not None:
            self.accelerator.log(logs, step=self.global_step)

    # ------------------------------------------------------------------------------------------
    # Evaluation
    # ------------------------------------------------------------------------------------------
    def _eval_loader(self, dataset):
        loader = DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, collate_fn=self.data_collator)
        return self.accelerator.prepare_data_loader(loader)

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict:
        """Loss, accuracy, mean chosen and rejected reward and margin over every pair of the eval set.

        ``eval_dataset`` (same forms as at construction) replaces the trainer's for this call. The
        metrics are logged and returned with keys ``<prefix>_loss``, ``<prefix>_accuracy``, ...
        """
        if eval_dataset is not None:
            base = _base_model(self.accelerator.unwrap_model(self.model))
            prepared = prepare_pairs(
                eval_dataset, self.tokenizer, self.args.max_length, self.args.truncation_mode,
                base.config.pad_token_id, base.get_input_embeddings().num_embeddings, name="eval_dataset",
            )  # fmt: skip
            loader = self._eval_loader(prepared.dataset)
        elif self.eval_dataloader is not None:
            loader = self.eval_dataloader
        else:
            raise ValueError("evaluate() needs an eval_dataset: none was given here or to the trainer.")
        was_training = self.model.training
        self.model.eval()
        chosen, rejected, margins = [], [], []
        for batch in loader:
            c, r = self.compute_rewards(self.model, batch)
            # gather_for_metrics drops the rows accelerate repeated to give every process a full batch.
            c, r = self.accelerator.gather_for_metrics((c, r))
            chosen.append(c)
            rejected.append(r)
            if "margin" in batch:
                margins.append(self.accelerator.gather_for_metrics(batch["margin"]))
        self.model.train(was_training)
        chosen, rejected = torch.cat(chosen).double(), torch.cat(rejected).double()
        margin = torch.cat(margins).double() if margins else None
        losses = pairwise_ranking_loss(chosen, rejected, margin, self.args.center_rewards_coefficient)
        stats = {"loss": losses.mean(), **preference_stats(chosen, rejected)}
        metrics = {f"{metric_key_prefix}_{k}": float(v) for k, v in stats.items()}
        self._record({**metrics, "epoch": self._epoch_progress()})
        return metrics

    # ------------------------------------------------------------------------------------------
    # Saving
    # ------------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str) -> None:
        """Save the model (full weights, also under ZeRO-3; the adapter for a PEFT model) and the tokenizer.

        The directory loads with ``AutoModelForSequenceClassification.from_pretrained`` and in a
        ``pipeline("text-classification")``, which returns the raw reward (the config's ``problem_type``
        is ``"regression"``).
        """
        save_full_model(self.accelerator, self.model, self.tokenizer, save_directory)

    def save_model(self, output_dir: str | None = None) -> None:
        """Classic name of :meth:`save_pretrained`; ``output_dir`` defaults to ``args.output_dir``."""
        self.save_pretrained(output_dir or self.args.output_dir)

    # ------------------------------------------------------------------------------------------
    # Checkpoint and resume (the mechanism is in .checkpointing)
    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Write a checkpoint to ``path`` (every process calls it); see :class:`.checkpointing.Checkpointer`."""
        # The metric sums are per process but only the main process writes the trainer's state:
        # it saves the sums over all processes (a collective, so here, before the main-only part).
        self._global_sums = self.accelerator.reduce(torch.stack([self._window, self._totals]), reduction="sum")
        Checkpointer(self.accelerator).save(path, self._checkpoint_state())

    def load_checkpoint(self, path: str) -> None:
        """Continue from a checkpoint written by :meth:`save_checkpoint` (same number of processes)."""
        state, _ = Checkpointer(self.accelerator).load(path)
        self._load_checkpoint_state(state)

    def _checkpoint_state(self) -> dict:
        """The trainer's counters that accelerate's state does not hold (JSON-serialisable)."""
        return {
            "global_step": self.global_step,
            "epoch": self.epoch,
            "max_steps": self.max_steps,
            "log_history": self.log_history,
            "window": self._global_sums[0].tolist(),
            "totals": self._global_sums[1].tolist(),
            "grad_norm": self._grad_norm,
            "dataloader": self.train_dataloader.state_dict(),
        }

    def _load_checkpoint_state(self, state: dict) -> None:
        if state["max_steps"] != self.max_steps:
            raise ValueError(
                f"the checkpoint's run has {state['max_steps']} optimizer steps, this trainer {self.max_steps}: "
                "resume with the same data, batch sizes, epochs and max_steps."
            )
        self.global_step = state["global_step"]
        self.epoch = state["epoch"]
        self.log_history = state["log_history"]
        # The saved sums cover every process: the main process takes them, the others start from zero,
        # so the next logged means (sums over processes) are those of the uninterrupted run.
        own = 1.0 if self.accelerator.is_main_process else 0.0
        device = self.accelerator.device
        self._window = own * torch.tensor(state["window"], dtype=torch.float64, device=device)
        self._totals = own * torch.tensor(state["totals"], dtype=torch.float64, device=device)
        self._grad_norm = state["grad_norm"]
        self.train_dataloader.load_state_dict(state["dataloader"])


def _is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _base_model(model) -> PreTrainedModel:
    """The transformers model under a PEFT wrapper (or ``model`` itself)."""
    return model.get_base_model() if _is_peft_model(model) else model


def _check_constructor_args(model, args, data_collator, train_dataset, tokenizer, optimizers, peft_config) -> None:
    if not isinstance(args, RewardConfig):
        raise TypeError(f"args must be a RewardConfig, got {type(args).__name__}.")
    args.validate()  # fields may have been changed after the config was built
    base = _base_model(model)
    if not isinstance(base, PreTrainedModel):
        raise TypeError(
            "model must be a transformers sequence-classification model with num_labels=1 "
            f"(AutoModelForSequenceClassification.from_pretrained(name, num_labels=1)), got {type(model).__name__}."
        )
    if base.config.num_labels != 1:
        raise ValueError(
            f"model must have num_labels=1 (one scalar reward per sequence), got num_labels={base.config.num_labels}."
        )
    if train_dataset is None:
        raise ValueError("train_dataset is required: preference pairs to train on.")
    if base.config.pad_token_id is None and getattr(tokenizer, "pad_token_id", None) is None:
        raise ValueError(
            "model.config.pad_token_id and tokenizer.pad_token_id are both None: set a padding token "
            "(for GPT-2-like tokenizers, tokenizer.pad_token = tokenizer.eos_token)."
        )
    if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"tokenizer must be a transformers tokenizer or None, got {type(tokenizer).__name__}.")
    if tokenizer is None and data_collator is None:
        raise ValueError("pass tokenizer= (it pads the batches), or a data_collator that pads them.")
    if data_collator is not None and not callable(data_collator):
        raise TypeError(f"data_collator must be callable, got {type(data_collator).__name__}.")
    if not (isinstance(optimizers, tuple) and len(optimizers) == 2):
        raise TypeError(f"optimizers must be a tuple (optimizer or None, lr_scheduler or None), got {optimizers!r}.")
    optimizer, lr_scheduler = optimizers
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizers[0] must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}.")
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
        raise TypeError(f"optimizers[1] must be a torch LR scheduler or None, got {type(lr_scheduler).__name__}.")
    if peft_config is not None:
        if _is_peft_model(model):
            raise ValueError("model is already a PEFT model; pass peft_config=None or the plain transformers model.")
        task_type = str(getattr(peft_config, "task_type", None))
        if not task_type.endswith("SEQ_CLS"):
            raise ValueError(
                f"peft_config.task_type must be 'SEQ_CLS' (so the new score head is trained and saved), got {task_type!r}."
            )
