"""Helpers shared by the multi-process scripts that `tests/test_distributed.py` launches.

The scripts run under `accelerate launch`, one copy per process; these helpers read full weights
(gathering ZeRO-3 shards) and compare values across processes with `torch.distributed` itself,
so that a run whose processes silently never talk to each other cannot pass.
"""

import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist

from trl_lite.parallel.fsdp import is_sharded, unsharded

# tests/ holds tiny_models.py, the model and tokenizer fixtures.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def is_zero3(trainer) -> bool:
    """Whether the trainer's policy is partitioned by DeepSpeed ZeRO stage 3."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def full_named_parameters(trainer, model=None) -> dict:
    """Every parameter of ``model`` (default: the unwrapped policy, value head included) as a float64
    CPU copy, by name.

    Under ZeRO-3 the shards are gathered for the copy; every process must call this together.
    """
    model = trainer.accelerator.unwrap_model(trainer.model) if model is None else model
    params = list(model.parameters())
    if is_zero3(trainer):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    elif is_sharded(model):
        gathered = unsharded(model)  # FSDP2: the units gathered whole
    else:
        gathered = nullcontext()
    with gathered:
        return {name: p.detach().to("cpu", torch.float64).clone() for name, p in model.named_parameters()}


def gather_across_processes(value: torch.Tensor, device) -> list:
    """`value` (same shape on every process) from every process, with `torch.distributed.all_gather`.

    `device` is the process's accelerator device (NCCL gathers only GPU tensors); returns CPU float64 tensors.
    """
    value = value.detach().to(device, torch.float64).contiguous()
    out = [torch.zeros_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(out, value)
    return [v.cpu() for v in out]


def flat(named: dict) -> torch.Tensor:
    """The tensors of `named` concatenated in sorted-name order: a 1-D float64 vector."""
    return torch.cat([named[name].flatten() for name in sorted(named)])


def finish(trainer) -> None:
    """Wait for every process and end the run (accelerate's `end_training` destroys the process group); the
    interpreter then exits normally and the launcher checks each process's exit status."""
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
