"""Exponential moving average of the policy's weights (docs/algorithm.md section 11), as DeepSpeed-Chat and
OpenRLHF keep for evaluation: ``ema = decay * ema + (1 - decay) * policy`` after every policy
optimizer step, in float32 accumulators.

Under DeepSpeed ZeRO-3 each process holds only its partition of every parameter (``ds_tensor``):
the average is kept of those partitions, where they live, and gathered only to be saved.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ...models.modeling_base import _WRAPPED_PREFIX as WRAPPED_PREFIX


def _is_partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_tensor")


class PolicyEMA:
    """The moving average of the trainable parameters of ``model`` (the unwrapped policy).

    Frozen parameters never change, so their average is themselves: only trainable ones are
    tracked. Without ZeRO-3, :attr:`model` is a float32 copy of the policy whose trainable
    parameters are the accumulators (usable for generation and evaluation). Under ZeRO-3 the
    accumulators are float32 copies of this process's partitions and :attr:`model` is None.
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.policy = model
        names = {param: name for name, param in model.named_parameters()}  # tied parameters once
        self.names = [names[p] for p in self._sources()]
        self.partitioned = any(_is_partitioned(p) for p in model.parameters())
        if self.partitioned:
            self.model = None
            self.shadow = [_local(p).detach().float().clone() for p in self._sources()]
        else:
            self.model = copy.deepcopy(model).float().eval().requires_grad_(False)
            by_name = dict(self.model.named_parameters())
            self.shadow = [by_name[name] for name in self.names]

    def _sources(self) -> list[torch.Tensor]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    @torch.no_grad()
    def update(self) -> None:
        """``ema = decay * ema + (1 - decay) * policy`` for every tracked parameter (this process's part)."""
        sources = [_local(p).float() for p in self._sources()]
        torch._foreach_mul_(self.shadow, self.decay)
        torch._foreach_add_(self.shadow, sources, alpha=1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This process's accumulators, keyed by parameter name (partitions under ZeRO-3)."""
        return {f"ema.{name}": t.detach().clone() for name, t in zip(self.names, self.shadow)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.names if f"ema.{name}" not in state]
        if missing:
            raise ValueError(f"the checkpoint holds no EMA for {missing[:3]} (saved without ema_decay?)")
        for name, t in zip(self.names, self.shadow):
            t.copy_(state[f"ema.{name}"])

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every tracked parameter's full average by name (gathered over processes under ZeRO-3:
        every process must call this)."""
        out = {}
        for name, param, shadow in zip(self.names, self._sources(), self.shadow):
            out[name] = _gather_partition(param, shadow) if self.partitioned else shadow.detach()
        return out


    def averaged_state_dict(self, state_dict: dict) -> dict:
        """The policy's full ``state_dict`` (as its wrapper saves it) with every trainable parameter replaced
        by its average, in the parameter's dtype; tied names share their parameter's average. Under ZeRO-3
        every process must call this (a gather); ``state_dict`` may then be None off the main process,
        and None is returned there.

        The wrapper's ``state_dict`` keys may lack the ``pretrained_model.`` of its parameter names.
        """
        averages = self.full_parameters()
        if state_dict is None:
            return None
        out = dict(state_dict)
        names_of = {}
        for name, param in self.policy.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(param), []).append(name)
        for name, param in self.policy.named_parameters():
            if name not in averages:
                continue
            for alias in names_of[id(param)]:
                for key in (alias, alias.removeprefix(WRAPPED_PREFIX)):
                    if key in out:
                        out[key] = averages[name].to(out[key].dtype)
        return out


def _local(param: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``param``: its ZeRO-3 partition, or the parameter itself."""
    return param.ds_tensor if _is_partitioned(param) else param


def _gather_partition(param: torch.Tensor, partition: torch.Tensor) -> torch.Tensor:
    """The full tensor of ``param``'s shape from every process's flat partition (padded to equal size)."""
    parts = [torch.empty_like(partition) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, partition.contiguous())
    return torch.cat(parts)[: param.ds_numel].view(param.ds_shape)
