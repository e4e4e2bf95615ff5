"""What each training process's colocated vLLM engine is started with, as pure functions of the
process's place in the training world and the ``PPOConfig.vllm_*`` fields: what rank r of N would
build can be checked without starting vLLM or owning N devices.

Placement. A process alone keeps vLLM's own single-process executor. Under N processes (``accelerate
launch``) every engine uses vLLM's external-launcher executor, vLLM's set-up for engines inside
processes that someone else started: it reads ``RANK`` and ``LOCAL_RANK``, puts its worker on device
``cuda:LOCAL_RANK``, and builds its parallel groups over the training world that already exists.
With ``vllm_tensor_parallel_size = T`` the consecutive ranks ``g*T .. g*T+T-1`` run engine ``g``
together (vLLM lays its tensor-parallel groups out this way): each holds a 1/T shard, all of them
generate for the union of their prompts, with one seed per group. Without the external launcher,
every process's engine would land on device ``cuda`` (GPU 0), and with T > 1 vLLM would spawn
worker processes that the trainer cannot push weights into.

Memory. Sleep mode (vLLM's level 2: weights and KV cache released, the buffers kept) frees the
engine's share of the GPU between rollouts; vLLM has it on CUDA, ROCm and XPU, not on CPU.
``vllm_max_model_len=None`` starts the engine with vLLM's ``-1``: the model's full context if one
sequence of it fits in the engine's KV cache, else the longest that fits (instead of refusing to
start); the engine then refuses a rollout longer than that (see :class:`~.vllm_engine.VLLMEngine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# accelerate's mixed_precision -> the autocast dtype its forward passes run in.
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
_HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class EnginePlacement:
    """One training process's share of the colocated engines.

    ``groups``: the tensor-parallel groups, each a tuple of ranks that run one engine together;
    ``executor``: vLLM's ``distributed_executor_backend`` (None: vLLM's single-process default);
    ``env``: the environment variables that executor reads, set before the engine starts.
    """

    rank: int
    world_size: int
    tensor_parallel_size: int
    executor: str | None
    groups: tuple[tuple[int, ...], ...]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def group_index(self) -> int:
        """Which engine this process runs (a part of)."""
        return self.rank // self.tensor_parallel_size

    @property
    def rank_in_group(self) -> int:
        return self.rank % self.tensor_parallel_size


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


def engine_placement(rank: int, local_rank: int, world_size: int, tensor_parallel_size: int) -> EnginePlacement:
    """Where the colocated engine of process ``rank`` (of ``world_size``) runs.

    ``local_rank``: the index of the process's own device on its machine (``cuda:local_rank``);
    ``tensor_parallel_size``: processes per engine, which must divide ``world_size``.
    """
    _check_int("world_size", world_size, 1)
    _check_int("rank", rank, 0)
    _check_int("local_rank", local_rank, 0)
    _check_int("vllm_tensor_parallel_size", tensor_parallel_size, 1)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size ({world_size}), got {rank}.")
    if world_size % tensor_parallel_size:
        raise ValueError(
            f"vllm_tensor_parallel_size={tensor_parallel_size} in colocate mode needs a multiple of "
            f"{tensor_parallel_size} training processes (each engine is run by that many consecutive processes, "
            f"one device each); got {world_size}. Launch a multiple of it (accelerate launch --num_processes), "
            "or run the engine on devices of its own with vllm_mode='server'."
        )
    groups = tuple(
        tuple(range(start, start + tensor_parallel_size)) for start in range(0, world_size, tensor_parallel_size)
    )
    if world_size == 1:
        return EnginePlacement(rank, world_size, tensor_parallel_size, None, groups)
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank)}
    return EnginePlacement(rank, world_size, tensor_parallel_size, "external_launcher", groups, env)


def colocated_llm_options(model_dir: str, placement: EnginePlacement, *, dtype: str, max_model_len: int | None,
                          enforce_eager: bool, gpu_memory_utilization: float, seed: int, enable_sleep_mode: bool,
                          on_gpu: bool, max_lora_rank: int | None = None,
                          logprobs_mode: str = "raw_logprobs") -> dict:  # fmt: skip
    """The ``vllm.LLM`` keyword arguments of the engine ``placement`` describes.

    The engine starts without weights (``load_format='dummy'``; the trainer pushes them) and without
    a tokenizer (token ids in and out). ``seed``: the run's seed; the engine's is ``seed`` plus its
    group index, so that the processes of one engine sample alike and different engines do not.
    ``gpu_memory_utilization`` is passed on a GPU only (on CPU the KV cache is sized by
    ``VLLM_CPU_KVCACHE_SPACE``). ``max_lora_rank``: serve one LoRA adapter of up to that rank (the
    policy's, :mod:`.lora_sync`); None: no LoRA. ``logprobs_mode``: vLLM's, passed when not its default
    ``'raw_logprobs'`` (:func:`~.temperature.vllm_logprobs_mode`).
    """
    options = dict(
        model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype=dtype, enforce_eager=enforce_eager,
        seed=seed + placement.group_index, max_model_len=-1 if max_model_len is None else max_model_len,
        tensor_parallel_size=placement.tensor_parallel_size,
        # The prompts of multi-turn episodes grow by a turn each call: their shared prefixes are cached.
        enable_prefix_caching=True,
    )  # fmt: skip
    if on_gpu:
        options["gpu_memory_utilization"] = gpu_memory_utilization
    if placement.executor is not None:
        options["distributed_executor_backend"] = placement.executor
    if enable_sleep_mode:
        options["enable_sleep_mode"] = True
    if logprobs_mode != "raw_logprobs":
        options["logprobs_mode"] = logprobs_mode
    if max_lora_rank is not None:
        # One adapter slot, on the device and in the CPU cache: a new version evicts the old one.
        options.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1, max_cpu_loras=1)
    return options


def resolve_sleep_mode(requested: bool | None, available: bool, platform: str) -> bool:
    """Whether the colocated engine sleeps between rollouts.

    ``requested``: ``PPOConfig.vllm_enable_sleep_mode`` (None: wherever vLLM has sleep mode);
    ``available``: whether vLLM has it on this ``platform`` (a name for the error message).
    """
    if requested is None:
        return available
    if not isinstance(requested, bool):
        raise TypeError(f"vllm_enable_sleep_mode must be None, True or False, got {requested!r}.")
    if requested and not available:
        raise ValueError(
            f"vllm_enable_sleep_mode=True, but vLLM has no sleep mode on this platform ({platform}): it has one on "
            "CUDA, ROCm and XPU GPUs. Leave it None (on wherever vLLM has it) or set False."
        )
    return requested


def engine_dtype(vllm_dtype: str, policy_dtype: torch.dtype, mixed_precision: str | None,
                 config_dtype: torch.dtype | str | None = None) -> str:  # fmt: skip
    """The engine's torch dtype name for ``PPOConfig.vllm_dtype``.

    A named dtype is used as given. ``'auto'``: without mixed precision, the policy's parameter dtype
    (the engine samples from the model being trained); under accelerate's ``mixed_precision``
    (``'bf16'``, ``'fp16'``, ``'fp8'``), where the policy computes in 16 bits, the first 16-bit dtype of
    the policy's parameters and its config's (the checkpoint's) ``dtype``, else the autocast dtype -
    never float32.
    """
    if vllm_dtype != "auto":
        return vllm_dtype
    autocast = _AUTOCAST_DTYPES.get(mixed_precision or "no")
    if autocast is None:
        return str(policy_dtype).removeprefix("torch.")
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    chosen = next((d for d in (policy_dtype, config_dtype) if d in _HALF_DTYPES), autocast)
    return str(chosen).removeprefix("torch.")
