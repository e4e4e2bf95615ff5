"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for a launch under an accelerate FSDP config (docs/scale_out.md).

On GPUs accelerate applies FSDP2 itself (``fsdp_version: 2``). On a machine without GPUs accelerate 1.x drops the
FSDP plugin and would wrap the model in DDP without a word (shared/ENVIRONMENT.md); there :class:`CPUSharding`
applies the same sharding on a gloo device mesh: ``fully_shard`` on every transformer block (the config's
``fsdp_transformer_layer_cls_to_wrap``, else the model's own ``_no_split_modules``) and on the root, so that
parameters, gradients and optimizer states are ``DTensor`` shards as under accelerate's FSDP2.

The trainer asks this module, and nothing else, about FSDP2: :func:`cpu_sharding` (the part that shards when
accelerate does not; it offers accelerate's ``prepare``/``prepare_model`` and saves and loads the sharded checkpoint,
:class:`ShardedCheckpoint`: ``torch.distributed.checkpoint`` of the models and optimizers), :func:`is_sharded`,
:func:`keep_roots_gathered`, :func:`resharding` (the reference's passes), :func:`unsharded` (whole weights for a
call: generation, the weight push) and :func:`full_state_dict` (``save_pretrained``).

The root module's parameters (embeddings, final norm, LM head, value head) stay unsharded from its forward until
its backward (FSDP2's default for a root, :func:`keep_root_gathered`): the trainer's fused LM head, applied after the
model's forward, reads the whole head weight there, and its gradient is reduce-scattered with the root's.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .sequence_parallel import sequence_parallel_size

WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "NO_WRAP")


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class FSDP2Settings:
    """What an accelerate FSDP config asks for (its ``FSDP_*`` environment, as ``accelerate launch`` sets it).

    ``block_classes``: class names of the modules sharded as units of their own (empty: every
    ``_no_split_modules`` class of the model); ``wrap_policy``: ``TRANSFORMER_BASED_WRAP`` or ``NO_WRAP`` (the
    root alone); ``reshard_after_forward``: free each block's gathered weights after its forward.
    """

    reshard_after_forward: bool = True
    wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    block_classes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.wrap_policy not in WRAP_POLICIES:
            raise ValueError(f"fsdp_auto_wrap_policy={self.wrap_policy!r} is not supported by trl_lite's FSDP2 path; "
                             f"accepted: {', '.join(WRAP_POLICIES)}.")  # fmt: skip


def fsdp_settings() -> FSDP2Settings | None:
    """The launch's FSDP2 settings, or None when it is not an FSDP launch. An FSDP launch of version 1 raises
    ``ValueError``: trl_lite's passes are built and tested on FSDP2 (``fsdp_version: 2``) only."""
    if not _flag("ACCELERATE_USE_FSDP", "false"):
        return None
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ValueError(f"the accelerate config asks for FSDP version {version} (fsdp_version); trl_lite supports "
                         "FSDP2 only: set fsdp_version: 2 (accelerate_configs/fsdp2.yaml).")  # fmt: skip
    classes = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    return FSDP2Settings(
        reshard_after_forward=_flag("FSDP_RESHARD_AFTER_FORWARD", "true"),
        wrap_policy=os.environ.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP").upper(),
        block_classes=tuple(c.strip() for c in classes.split(",") if c.strip()),
    )


def cpu_sharding(accelerator) -> CPUSharding | None:
    """The part that applies FSDP2 where accelerate does not: an FSDP launch of several processes without CUDA.
    None otherwise (no FSDP config, one process, or GPUs, where accelerate's own FSDP2 runs). An FSDP launch with
    sequence parallelism raises ``ValueError``."""
    settings = fsdp_settings()
    if settings is not None and sequence_parallel_size(accelerator) > 1:
        raise ValueError(f"sequence parallelism (parallelism_config sp_size={sequence_parallel_size(accelerator)}) is not "
                         "supported with FSDP2 here: it runs under DeepSpeed (accelerate_configs/"
                         "deepspeed_sequence_parallel.yaml, docs/sequence_parallel.md).")  # fmt: skip
    if settings is None or accelerator.num_processes <= 1 or torch.cuda.is_available():
        return None
    warnings.warn(
        f"The accelerate config asks for FSDP, which accelerate does not apply without GPUs (it would run plain DDP); "
        f"trl_lite applies FSDP2 itself: fully_shard on a gloo device mesh of {accelerator.num_processes} CPU "
        f"processes, per transformer block and on the root ({settings.wrap_policy}, reshard_after_forward="
        f"{settings.reshard_after_forward}).",
        stacklevel=3,
    )
    return CPUSharding(settings, accelerator)


class CPUSharding:
    """``fully_shard`` of the trainer's models on a CPU device mesh, with the optimizers moved onto the shards.

    Offers accelerate's ``prepare`` / ``prepare_model`` so the trainer calls one or the other alike: models (each
    with the optimizer that follows it in the call) are sharded here, everything else (dataloaders, schedulers) is
    prepared by ``accelerator``. The optimizers stay the user's own objects (accelerate never sees them:
    :class:`ShardedCheckpoint` saves them).
    """

    def __init__(self, settings: FSDP2Settings, accelerator):
        from torch.distributed.device_mesh import init_device_mesh

        processes = accelerator.num_processes
        if not dist.is_initialized() or dist.get_world_size() != processes:
            raise RuntimeError(f"FSDP2 on the CPU needs the launcher's process group of {processes} processes; "
                               "build the trainer under accelerate launch.")  # fmt: skip
        self.settings = settings
        self.accelerator = accelerator
        self.mesh = init_device_mesh("cpu", (processes,))
        self.trained = {}  # the models sharded with an optimizer, for the checkpoint

    def save(self, directory: str) -> None:
        """The trained models and their optimizers, sharded into ``directory`` (:class:`ShardedCheckpoint`)."""
        ShardedCheckpoint(**self.trained).save(directory)

    def load(self, directory: str) -> None:
        ShardedCheckpoint(**self.trained).load(directory)

    def prepare(self, *objects):
        """As ``accelerator.prepare``: the same objects back, models sharded with the optimizer after each."""
        out = list(objects)
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.nn.Module):
                follows = objects[i + 1] if i + 1 < len(objects) else None
                self.shard(obj, follows if isinstance(follows, torch.optim.Optimizer) else None)
            elif not isinstance(obj, torch.optim.Optimizer):
                out[i] = self.accelerator.prepare(obj)
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: torch.nn.Module, evaluation_mode: bool = False) -> torch.nn.Module:
        """As ``accelerator.prepare_model``: ``model`` sharded (in evaluation mode when asked)."""
        self.shard(model)
        return model.eval() if evaluation_mode else model

    def shard(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> torch.nn.Module:
        """Shard ``model`` in place (blocks, then the root) and point ``optimizer`` (no state yet) at the shards:
        ``fully_shard`` replaces every parameter with a ``DTensor`` parameter."""
        from torch.distributed.fsdp import fully_shard

        if is_sharded(model):
            raise ValueError(f"{type(model).__name__} holds layers already sharded with another model (a reference made "
                             "with num_shared_layers): FSDP2 shards each model on its own; leave num_shared_layers=None.")
        names = {id(p): name for name, p in model.named_parameters()}
        if optimizer is not None:
            _check_optimizer(optimizer, names)
        if self.settings.wrap_policy == "TRANSFORMER_BASED_WRAP":
            wanted = set(self.settings.block_classes) or _no_split_classes(model)
            blocks = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
            if not blocks:
                raise ValueError(f"fsdp_transformer_layer_cls_to_wrap={sorted(wanted)} names no module of "
                                 f"{type(model).__name__}; name its transformer block class.")  # fmt: skip
            for block in blocks:
                fully_shard(block, mesh=self.mesh, reshard_after_forward=self.settings.reshard_after_forward)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=self.settings.reshard_after_forward)
        keep_root_gathered(model)
        if optimizer is not None:
            self.trained[f"model_{len(self.trained)}"] = (model, optimizer)  # policy first, then the critic
            params = dict(model.named_parameters())
            for group in optimizer.param_groups:
                group["params"] = [params[names[id(p)]] for p in group["params"]]
        return model


def keep_roots_gathered(*models) -> bool:
    """:func:`keep_root_gathered` for each sharded one of ``models`` (None allowed); whether the first is sharded."""
    for model in models:
        if is_sharded(model):
            keep_root_gathered(model)
    return is_sharded(models[0])


def keep_root_gathered(model: torch.nn.Module) -> None:
    """Keep the root unit of an FSDP2 ``model`` gathered from its forward to its backward (FSDP2's own default for
    a root, which an explicit ``reshard_after_forward=True`` - accelerate's - turns off): the trainer applies the
    LM head (a root parameter) after the model's forward and needs its whole weight there, with the gradient
    reduce-scattered in the root's backward. The root is decided here, before any forward."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_reshard_after_forward(False, recurse=False)
        _lazy_init(model)


def _check_optimizer(optimizer, names: dict) -> None:
    if optimizer.state:
        raise ValueError("an optimizer that has already stepped cannot be moved onto FSDP2 shards; pass a fresh one.")
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not one of the model's; FSDP2 shards the "
                                 "model's parameters only: build the optimizer over model.parameters().")  # fmt: skip


def _no_split_classes(model: torch.nn.Module) -> set[str]:
    classes: set[str] = set()
    for module in model.modules():
        classes.update(getattr(module, "_no_split_modules", None) or ())
    return classes


def _fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module | None) -> bool:
    """Whether ``model`` (or a module in it) is sharded by FSDP2."""
    if model is None:
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or bool(_fsdp_modules(model))


@contextmanager
def unsharded(model: torch.nn.Module):
    """Every FSDP2 unit of ``model`` gathered whole for the block (generation, the weight push), resharded after.

    Collective: every process enters it together. Inside, the units' forward hooks neither gather nor free, so a
    process may run any number of forwards (generation of its own queries) without the others.
    """
    modules = _fsdp_modules(model)
    if not modules:
        yield model
        return
    _lazy_init(modules[0])
    groups = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
    kept = [g.post_forward_mesh_info for g in groups]
    for group in groups:
        group.post_forward_mesh_info = None  # no free after a forward inside the block (nor a gather at the next)
    for module in modules:
        module.unshard()
    try:
        yield model
    finally:
        for module in modules:
            module.reshard()
        for group, info in zip(groups, kept):
            group.post_forward_mesh_info = info


def _lazy_init(root) -> None:
    # FSDP2 decides its root at the first forward, which must go through the root: a forward of an inner part
    # (the transformers model's generate under a value-head wrapper) would otherwise be taken for the root.
    root._get_fsdp_state()._lazy_init()


def reshard(model: torch.nn.Module | None) -> None:
    """Free every gathered FSDP2 unit of ``model`` (the root stays gathered after a forward without grad)."""
    if model is not None:
        for module in _fsdp_modules(model):
            module.reshard()


def resharding(reference_factory):
    """``reference_factory`` (a context-manager factory yielding the reference module) whose context frees the
    gathered root of a frozen FSDP2 reference on exit: a root stays gathered after its forward (for the LM head
    applied after it), and a reference, which never runs a backward, would otherwise keep its whole root."""

    @contextmanager
    def context():
        with reference_factory() as module:
            yield module
        if is_sharded(module) and not any(p.requires_grad for p in module.parameters()):
            reshard(module)

    return context


def full_state_dict(model: torch.nn.Module) -> dict:
    """The full (unsharded) ``model.state_dict()`` of an FSDP2 ``model`` on the main process, on the CPU; ``{}``
    elsewhere. Collective. (The model's own ``state_dict``, so a value-head wrapper gives its own names.)"""
    from torch.distributed.tensor import DTensor

    main = dist.get_rank() == 0
    with unsharded(model):
        state = {}
        for name, tensor in model.state_dict().items():
            tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # every process joins
            if main:
                state[name] = tensor.detach().to("cpu", copy=True)
    return state


class ShardedCheckpoint:
    """The sharded models and their optimizers through ``torch.distributed.checkpoint``: each process writes and
    reads its own shards (``directory/fsdp2``). A model is saved as its own ``state_dict()`` (``DTensor`` shards,
    the model's names), an optimizer as its per-parameter state by parameter name (following the shards) and its
    ``param_groups`` settings (learning rate as the scheduler left it). Collective."""

    SUBDIR = "fsdp2"

    def __init__(self, **pairs):
        self.pairs = {name: pair for name, pair in pairs.items() if pair[0] is not None}  # name -> (model, optimizer)

    def _state(self) -> dict:
        state = {}
        for name, (model, optimizer) in self.pairs.items():
            reshard(model)  # a root still gathered after a forward would give whole tensors
            names = {id(p): n for n, p in model.named_parameters()}
            params = [p for group in optimizer.param_groups for p in group["params"]]
            state[name] = {
                "model": model.state_dict(),
                "optimizer": {names[id(p)]: optimizer.state[p] for p in params if p in optimizer.state},
                "groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
            }
        return state

    def save(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=os.path.join(directory, self.SUBDIR))

    def load(self, directory: str) -> None:
        """Read the shards into the models' parameters and the optimizers' states, in place."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        for _, optimizer in self.pairs.values():
            _init_optim_state(optimizer)  # the state tensors to load into (a step at learning rate 0)
        state = self._state()
        dcp.load(state, checkpoint_id=os.path.join(directory, self.SUBDIR))
        for name, (_, optimizer) in self.pairs.items():
            for group, saved in zip(optimizer.param_groups, state[name]["groups"]):
                group.update(saved)
