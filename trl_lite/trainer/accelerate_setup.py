"""How the trainers set up processes and devices: the Accelerator, DeepSpeed's config and reference
engine, the default optimizer, and freeing the device cache. Used by ``PPOTrainer`` and ``RewardTrainer``.

The CPU fixes (gloo under DeepSpeed, ``cpu=True`` for data parallel) are those measured in the
project's ENVIRONMENT.md; everything else is plain accelerate.
"""

from __future__ import annotations

import atexit
import copy
import ctypes
import logging
import os
import threading
import time
import warnings
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, GradientAccumulationPlugin, InitProcessGroupKwargs, ProjectConfiguration

from ..parallel import fsdp
from .ppo_config import PPOConfig


class _NoGPUNotice(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU ... we were unable to detect it": accelerate and
    transformers import DeepSpeed, when installed, in runs that never use it, and on a machine without a
    GPU it logs that notice at import."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Setting accelerator to CPU.")


# At import: the first DeepSpeed import may come before any trainer (transformers' Trainer, a pipeline).
logging.getLogger("DeepSpeed").addFilter(_NoGPUNotice())


def launched_processes() -> int:
    """How many processes the launcher (``accelerate launch``, torchrun, DeepSpeed) started: ``WORLD_SIZE``, 1 without."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def settle_state_made_before(launched: int) -> None:
    """Drop a single-process accelerate state that a script made before the trainer under a launch of
    ``launched`` processes on a machine without CUDA, so that the trainer's Accelerator builds the group.

    Classic TRL's scripts make ``PartialState()`` (or ``Accelerator()``) first. Without CUDA accelerate then
    finds no backend: it still joins the launcher's process group (torch's default backend, or DeepSpeed's
    when ``ACCELERATE_USE_DEEPSPEED`` is set) but records one process, distributed type NO (DEEPSPEED under
    a DeepSpeed config), and every later Accelerator inherits that state. The state is a shared dict that
    every ``PartialState``/``AcceleratorState`` object reads, so after the reset the script's own objects
    report the rebuilt group too; the existing process group is reused (accelerate initialises one only
    where none exists). On a GPU accelerate makes the right state by itself and nothing is done here.
    """
    if launched <= 1 or torch.cuda.is_available() or not PartialState._shared_state:
        return
    state = PartialState()
    if state.num_processes == launched and state.distributed_type != DistributedType.NO:
        return
    made = f"{state.num_processes} process(es), distributed type {state.distributed_type}"
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() != launched:
        raise RuntimeError(
            f"accelerate's state, made before the trainer, holds {made}, and its process group has "
            f"{torch.distributed.get_world_size()} processes, but the launcher started WORLD_SIZE={launched}: the "
            "trainer cannot rebuild it. Build the trainer before any PartialState()/Accelerator(), or make them for "
            "the launch (without CUDA: PartialState(cpu=True) for plain data parallel, "
            "Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend='gloo')]) under DeepSpeed)."
        )
    warnings.warn(
        f"accelerate's state was made before the trainer with {made} although the launcher started {launched} "
        "processes (without CUDA accelerate finds no backend for PartialState()/Accelerator() made by the script); "
        f"the trainer rebuilds it as one group of {launched}. What the script did under the old state (e.g. "
        "local_main_process_first) ran on every process alone.",
        stacklevel=4,
    )
    AcceleratorState._reset_state(reset_partial_state=True)


def build_accelerator(config, sync_with_dataloader: bool = False, **defaults) -> Accelerator:
    """The trainer's Accelerator, with the CPU fixes of ENVIRONMENT.md for multi-process runs.

    ``config`` is any config with ``accelerator_kwargs``, ``project_kwargs``, ``log_with`` and
    ``gradient_accumulation_steps`` (``PPOConfig``, ``RewardConfig``). ``sync_with_dataloader``: whether
    the end of a prepared dataloader forces an optimizer step (``PPOTrainer.step()`` accumulates over its
    own mini-batches, so not there). ``defaults``: Accelerator arguments that ``accelerator_kwargs`` may
    override (e.g. ``mixed_precision``).

    Under DeepSpeed without CUDA the process group needs gloo; for plain data parallel without
    CUDA, ``cpu=True`` is what makes accelerate use MULTI_CPU with real DDP. A single-process state made
    before (see :func:`settle_state_made_before`) is rebuilt; an Accelerator with fewer processes than the
    launcher started raises ``RuntimeError``: each process would otherwise train alone on all its data.
    """
    kwargs = {**defaults, **config.accelerator_kwargs}
    handlers = list(kwargs.pop("kwargs_handlers", []))
    launched = launched_processes()
    settle_state_made_before(launched)
    multi_process = launched > 1
    use_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if not torch.cuda.is_available() and multi_process:
        if use_deepspeed:
            if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
                handlers.append(InitProcessGroupKwargs(backend="gloo"))
        else:
            kwargs.setdefault("cpu", True)
    project_config = ProjectConfiguration(**config.project_kwargs)
    accumulation = GradientAccumulationPlugin(
        num_steps=config.gradient_accumulation_steps, sync_with_dataloader=sync_with_dataloader
    )
    accelerator = Accelerator(
        log_with=config.log_with,
        gradient_accumulation_plugin=accumulation,
        project_config=project_config,
        kwargs_handlers=handlers,
        **kwargs,
    )
    if multi_process and accelerator.num_processes != launched:
        raise RuntimeError(
            f"accelerate set up {accelerator.num_processes} process(es) (distributed type "
            f"{accelerator.distributed_type}) but the launcher started WORLD_SIZE={launched}: every process would "
            "train alone on all of its data. Build the trainer before any PartialState()/Accelerator() of the "
            "script, or make those for the launch (accelerate's state is shared: the first one made decides)."
        )
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        unregister_zero3_config_when_init_off(accelerator.state.deepspeed_plugin)
    destroy_process_group_at_exit()
    return accelerator


_DESTROY_REGISTERED = []


def destroy_process_group_at_exit() -> None:
    """End torch's process groups when the interpreter exits, while it can still run Python (once per process),
    and let torch's collective worker threads finish with the interpreter before it finalizes.

    gloo runs collectives on C++ worker threads. A finished barrier holds the collectives queued before it, and
    the thread that ran it drops them after the waiting process has moved on; dropping them frees their tensors,
    and a tensor whose Python object the script has already let go needs the GIL to be freed. If the interpreter
    has begun finalizing by then, the thread cannot take the GIL, is unwound and the process aborts ("terminate
    called without an active exception", exit -6) although every result is written. ``destroy_process_group()``
    does not stop those threads while anything else holds the group (DeepSpeed's engine, its ZeRO-3 parameters
    and ``deepspeed.utils.groups`` do; so does a DDP module), so this runs whether or not the script ended the
    run itself (``accelerator.end_training()``; classic TRL's examples end after their last step without it).
    The handler is registered here, after torch's and accelerate's imports, so it runs before theirs.
    """
    if _DESTROY_REGISTERED or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    _DESTROY_REGISTERED.append(True)
    atexit.register(_end_process_groups)


def _end_process_groups() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    release_interpreter_to_native_threads()


def _foreign_thread_states() -> int:
    """How many threads hold a Python thread state without being ``threading`` threads: C++ threads that hold or
    wait for the GIL (pybind11 gives a thread a state for as long as it holds the GIL, waiting included)."""
    api = ctypes.pythonapi
    state = api.PyInterpreterState_ThreadHead(api.PyInterpreterState_Get())
    states = 0
    while state:  # under the GIL no state is deleted; one created meanwhile goes in front of the head read
        states += 1
        state = api.PyThreadState_Next(state)
    python = sum(1 for t in threading.enumerate() if not isinstance(t, threading._DummyThread))
    return states - python


def _gloo_workers_running() -> bool:
    """Whether one of torch's gloo worker threads (named ``pt_gloo_runloop``) is running or waiting for a CPU
    (Linux's /proc; False where it cannot be read): such a thread may be about to free a finished collective."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
        if name.startswith("pt_gloo") and state in "RD":
            return True
    return False


def release_interpreter_to_native_threads(settle_s: float = 0.02, limit_s: float = 5.0) -> None:
    """Hold the interpreter back from finalizing, with the GIL released, until no C++ thread holds or waits for
    the GIL and no gloo worker thread is running (see :func:`destroy_process_group_at_exit`): a worker whose
    barrier has just completed runs on to free what it held, and asks for the GIL (a thread state appears) or
    goes back to sleep. Both must have been seen quiet for ``settle_s``; ``limit_s`` bounds the wait (a C++
    thread that keeps a thread state for good is not waited on longer).
    """
    for name, restype, argtypes in (
        ("PyInterpreterState_Get", ctypes.c_void_p, []),
        ("PyInterpreterState_ThreadHead", ctypes.c_void_p, [ctypes.c_void_p]),
        ("PyThreadState_Next", ctypes.c_void_p, [ctypes.c_void_p]),
    ):
        getattr(ctypes.pythonapi, name).restype = restype
        getattr(ctypes.pythonapi, name).argtypes = argtypes
    start = quiet_since = time.monotonic()
    while (now := time.monotonic()) - quiet_since < settle_s and now - start < limit_s:
        if _foreign_thread_states() > 0 or _gloo_workers_running():
            quiet_since = now
        time.sleep(0.001)  # releases the GIL


def unregister_zero3_config_when_init_off(plugin) -> None:
    """Make ``plugin.zero3_init_context_manager(enable=False)`` load models whole, as its name says.

    accelerate 1.x's context manager turns ``zero3_init_flag`` off but then registers transformers' DeepSpeed
    config again (``set_deepspeed_weakref`` registers it whatever the flag), so under a ZeRO-3 config
    ``from_pretrained`` inside it still builds the model partitioned: classic TRL's ``ppo.py`` loads its reward
    classifier there and its forward fails. The instance's context manager is wrapped so that inside it the
    config is unregistered; leaving it registers the config again (accelerate's own exit). Idempotent.
    """
    if getattr(plugin.zero3_init_context_manager, "_trl_lite_unregisters", False):
        return
    accelerate_context = plugin.zero3_init_context_manager

    @contextmanager
    def zero3_init_context_manager(enable=False):
        with accelerate_context(enable=enable):
            if not plugin.zero3_init_flag:
                from transformers.integrations import unset_hf_deepspeed_config

                unset_hf_deepspeed_config()
            yield

    zero3_init_context_manager._trl_lite_unregisters = True
    plugin.zero3_init_context_manager = zero3_init_context_manager


def fill_deepspeed_config(accelerator: Accelerator, config: PPOConfig) -> None:
    """Set what DeepSpeed needs before ``prepare`` from a ``PPOConfig`` (see :func:`fill_deepspeed_batch_config`)."""
    fill_deepspeed_batch_config(
        accelerator, config.mini_batch_size, config.gradient_accumulation_steps, config.max_grad_norm
    )


def fill_deepspeed_batch_config(
    accelerator: Accelerator, micro_batch_size: int, gradient_accumulation_steps: int, max_grad_norm: float | None
) -> None:
    """Set what DeepSpeed needs before ``prepare``: micro-batch (rows per forward/backward pass and
    process), accumulation and clipping (None: off)."""
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    ds_config["train_micro_batch_size_per_gpu"] = micro_batch_size
    ds_config["gradient_accumulation_steps"] = gradient_accumulation_steps
    # accelerate replaces an unset ("auto") gradient_clipping with 1.0; 0.0 turns DeepSpeed's clipping off.
    ds_config["gradient_clipping"] = max_grad_norm if max_grad_norm is not None else 0.0
    if ds_config.get("zero_optimization", {}).get("stage") == 3:
        # save_pretrained gathers the full weights through accelerator.get_state_dict, which needs this.
        ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    ds_config["train_batch_size"] = micro_batch_size * gradient_accumulation_steps * accelerator.num_processes


# save_full_model's default: gather the state dict there (None is what DeepSpeed gives the
# processes that keep no consolidated copy).
GATHER = object()


def full_state_dict(accelerator: Accelerator, model) -> dict | None:
    """A prepared model's full state dict for saving (collective): gathered from FSDP2 or ZeRO-3 shards onto the
    main process (empty or None elsewhere), the model's own elsewhere."""
    return fsdp.full_state_dict(model) if fsdp.is_sharded(model) else accelerator.get_state_dict(model)


def save_full_model(
    accelerator: Accelerator, model, tokenizer, save_directory: str, state_dict=GATHER, plain: bool = False
) -> None:
    """``save_pretrained`` of a prepared model with its full weights (gathered under ZeRO-3) and of the
    tokenizer (if any), from the main process; every process must call it.

    ``state_dict``: already gathered (None on the processes where DeepSpeed keeps none), gathered
    here when not given; ``plain``: the wrapped transformers model alone (a policy given as a plain LM).
    """
    if state_dict is GATHER:
        state_dict = full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        if plain:
            base_state, _ = unwrapped._checkpoint_state_dicts(state_dict)
            unwrapped.pretrained_model.save_pretrained(save_directory, state_dict=base_state)
        else:
            unwrapped.save_pretrained(save_directory, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(save_directory)
    accelerator.wait_for_everyone()


def prepare_deepspeed_reference(ref_model, accelerator: Accelerator):
    """Wrap the reference as a DeepSpeed engine: sharded under ZeRO-3, replicated (stage 0) otherwise."""
    import deepspeed

    plugin = accelerator.state.deepspeed_plugin
    ds_config = copy.deepcopy(plugin.deepspeed_config)
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage != 3:
        ds_config["zero_optimization"] = {"stage": 0}
    ds_config.pop("optimizer", None)
    ds_config.pop("scheduler", None)
    # An engine without sequence-parallel groups counts every process (accelerate counts the policy's
    # data-parallel groups under sequence parallelism).
    ds_config["train_batch_size"] = (
        ds_config["train_micro_batch_size_per_gpu"] * ds_config["gradient_accumulation_steps"] * accelerator.num_processes
    )
    engine, *_ = deepspeed.initialize(model=ref_model, config=ds_config)
    engine.eval()
    return engine


def default_optimizer(model, learning_rate: float, weight_decay: float | None = None) -> torch.optim.Optimizer:
    """Adam over the trainable parameters, or AdamW (decoupled weight decay) when ``weight_decay`` is
    given; the fused implementation (one pass over each tensor per step instead of about ten) where
    PyTorch has it for every parameter."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    if weight_decay is None:
        return torch.optim.Adam(params, lr=learning_rate, fused=fused or None)
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, fused=fused or None)
