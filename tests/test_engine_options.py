"""What each process's colocated vLLM engine is started with (trl_lite.engines.vllm_options),
without starting vLLM: the options rank r of N builds for several (rank, local rank, world, tensor
parallel) places, against vLLM's own layout of its tensor-parallel groups; the refusals; when the
engine sleeps; its dtype under mixed precision; and, with recording stand-ins, the order in which
a sleeping engine is woken, pushed, asked and put back to sleep, and the length check of a rollout.
"""

import types

import pytest
import torch
from tiny_models import make_gpt2, make_tokenizer

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.engines import (
    GenerationEngine,
    VLLMEngine,
    colocated_llm_options,
    engine_dtype,
    engine_placement,
    resolve_sleep_mode,
)
from trl_lite.engines.generation import RolloutGeneration
from trl_lite.trainer.step.timing import PhaseTimer


def _options(placement, **overrides):
    kwargs = dict(dtype="float32", max_model_len=64, enforce_eager=True, gpu_memory_utilization=0.3, seed=7,
                  enable_sleep_mode=False, on_gpu=False)  # fmt: skip
    kwargs.update(overrides)
    return colocated_llm_options("/engine", placement, **kwargs)


def test_one_process_on_cpu_starts_the_engine_as_before():
    placement = engine_placement(rank=0, local_rank=0, world_size=1, tensor_parallel_size=1)
    assert placement.executor is None and placement.env == {} and placement.groups == ((0,),)
    # The options a single CPU process used before engines had places, key for key.
    assert _options(placement) == {
        "model": "/engine", "skip_tokenizer_init": True, "load_format": "dummy", "dtype": "float32",
        "enforce_eager": True, "seed": 7, "max_model_len": 64, "tensor_parallel_size": 1,
        "enable_prefix_caching": True,  # vLLM 0.32's default, made explicit for multi-turn episodes
    }  # fmt: skip
    # Unset, the length is vLLM's -1: the model's context if one sequence of it fits, else the longest that does.
    assert _options(placement, max_model_len=None)["max_model_len"] == -1
    on_gpu = _options(placement, on_gpu=True, enable_sleep_mode=True, gpu_memory_utilization=0.45)
    assert on_gpu["gpu_memory_utilization"] == 0.45 and on_gpu["enable_sleep_mode"] is True
    assert "distributed_executor_backend" not in on_gpu


def _vllm_tensor_parallel_groups(world_size: int, tp: int) -> list:
    """vLLM 0.32's layout (distributed/parallel_state.py, initialize_model_parallel): the world as
    (external DP, DP=1, PP=1, PCP=1, TP), one group per row of the last dimension."""
    ranks = torch.arange(world_size).reshape(-1, 1, 1, 1, tp)
    return [tuple(group.tolist()) for group in ranks.view(-1, tp).unbind(0)]


@pytest.mark.parametrize(
    "rank, local_rank, world_size, tp",
    [(0, 0, 2, 1), (1, 1, 2, 1), (3, 3, 4, 2), (2, 2, 4, 4), (5, 1, 8, 2), (6, 2, 8, 4), (7, 7, 8, 8)],
)
def test_every_process_of_several_runs_its_part_on_its_own_device(rank, local_rank, world_size, tp):
    placement = engine_placement(rank, local_rank, world_size, tp)
    # vLLM's external launcher reads these: its worker goes to cuda:LOCAL_RANK, not to device 0.
    assert placement.executor == "external_launcher"
    assert placement.env == {"RANK": str(rank), "LOCAL_RANK": str(local_rank)}
    assert list(placement.groups) == _vllm_tensor_parallel_groups(world_size, tp)
    mine = next(i for i, group in enumerate(placement.groups) if rank in group)
    assert placement.group_index == mine and placement.groups[mine][placement.rank_in_group] == rank
    options = _options(placement, on_gpu=True)
    assert options["distributed_executor_backend"] == "external_launcher"
    assert options["tensor_parallel_size"] == tp
    # One seed per engine: equal within a group (its shards must sample alike), different across groups.
    assert options["seed"] == 7 + mine
    seeds = {_options(engine_placement(r, r % 4, world_size, tp))["seed"] for r in range(world_size)}
    assert len(seeds) == world_size // tp


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 0, 1, 2), "vllm_tensor_parallel_size=2 in colocate mode needs a multiple of 2 training processes"),
        ((2, 2, 3, 2), r"needs a multiple of 2 training processes .*got 3\. .*vllm_mode='server'"),
        ((2, 0, 2, 1), r"rank must be < world_size \(2\), got 2"),
        ((0, -1, 2, 1), "local_rank must be an int >= 0, got -1"),
        ((0, 0, 2, 0), "vllm_tensor_parallel_size must be an int >= 1, got 0"),
        ((0, 0, 2.0, 1), r"world_size must be an int >= 1, got 2\.0"),
    ],
)
def test_places_that_cannot_hold_an_engine_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        engine_placement(*args)


def test_sleep_mode_is_on_where_vllm_has_it_and_refused_where_it_does_not():
    assert resolve_sleep_mode(None, available=True, platform="cuda") is True
    assert resolve_sleep_mode(None, available=False, platform="cpu") is False
    assert resolve_sleep_mode(False, available=True, platform="cuda") is False
    assert resolve_sleep_mode(True, available=True, platform="cuda") is True
    unavailable = r"vllm_enable_sleep_mode=True, but vLLM has no sleep mode on this platform \(cpu\)"
    with pytest.raises(ValueError, match=unavailable):
        resolve_sleep_mode(True, available=False, platform="cpu")
    with pytest.raises(TypeError, match="vllm_enable_sleep_mode must be None, True or False, got 'yes'"):
        resolve_sleep_mode("yes", available=True, platform="cuda")


@pytest.mark.cpu_only  # vLLM has sleep mode on a GPU
def test_a_trainer_asking_for_sleep_mode_on_this_cpu_is_refused_before_an_engine_starts():
    config = PPOConfig(batch_size=2, mini_batch_size=1, use_vllm=True, vllm_enable_sleep_mode=True)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(n_embd=64))
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode=True, but vLLM has no sleep mode"):
        PPOTrainer(config, model, tokenizer=make_tokenizer())


@pytest.mark.parametrize(
    "vllm_dtype, policy, mixed_precision, config_dtype, expected",
    [
        ("auto", torch.float32, "no", None, "float32"),  # no autocast: the trained model's own dtype
        ("auto", torch.bfloat16, None, None, "bfloat16"),
        ("auto", torch.float32, "bf16", None, "bfloat16"),  # fp32 master weights under AMP: never fp32
        ("auto", torch.float32, "bf16", torch.float16, "float16"),  # the checkpoint's 16-bit dtype
        ("auto", torch.float32, "bf16", "bfloat16", "bfloat16"),
        ("auto", torch.bfloat16, "fp16", None, "bfloat16"),  # bf16 weights stay bf16
        ("auto", torch.float32, "fp16", torch.float32, "float16"),
        ("auto", torch.float32, "fp8", None, "bfloat16"),
        ("float32", torch.bfloat16, "bf16", None, "float32"),  # a named dtype is used as given
    ],
)
def test_the_engine_runs_in_sixteen_bits_under_mixed_precision(vllm_dtype, policy, mixed_precision, config_dtype,
                                                                 expected):  # fmt: skip
    assert engine_dtype(vllm_dtype, policy, mixed_precision, config_dtype) == expected


class RecordingEngine(GenerationEngine):
    """An engine with its own weights that records what is asked of it, in order."""

    needs_weight_sync = True

    def __init__(self, calls: list, sleeps: bool):
        self.calls = calls
        self._sleeps = sleeps

    @property
    def sleeps(self):
        return self._sleeps

    def sleep(self):
        self.calls.append("sleep")

    def wake_up(self, tags):
        self.calls.append("wake:" + ",".join(tags))

    def load_weights(self, named_tensors):
        self.calls.append("push:" + ",".join(name for name, _ in named_tensors))

    def generate(self, queries, generation_kwargs, length_sampler, batch_size, return_prompt, remove_padding,
                 return_logprobs):  # fmt: skip
        self.calls.append("generate")
        return [q.clone() for q in queries], None

    def generate_one(self, query, generation_kwargs, return_prompt):
        self.calls.append("generate_one")
        return query[None]


def _generation(sleeps: bool):
    """A RolloutGeneration over a recording engine; its policy version is ``generation.version.version``."""
    calls = []
    engine = RecordingEngine(calls, sleeps)
    timer = PhaseTimer("cpu")
    version = types.SimpleNamespace(version=0)
    generation = RolloutGeneration(engine, engine, timer, lambda: iter([("w", torch.zeros(1))]), version)
    return generation, calls, timer


def test_a_sleeping_engine_is_woken_pushed_asked_and_put_back_to_sleep_around_every_rollout():
    generation, calls, timer = _generation(sleeps=True)
    assert calls == ["sleep"]  # started with placeholder weights: asleep until the first rollout
    query = [torch.tensor([5, 6])]
    rollout = ["wake:weights", "push:w", "wake:kv_cache", "generate", "sleep"]
    generation.generate(query, max_new_tokens=2)
    assert calls[1:] == rollout
    assert set(timer.pop()) == {"time/rollout/weight_sync", "time/rollout/generate"}
    # Level-2 sleep drops the weights: the next rollout pushes again, even without a policy update.
    generation.generate(query, max_new_tokens=2)
    generation.generate(query[0], max_new_tokens=2)
    assert calls[6:] == rollout + rollout[:3] + ["generate_one", "sleep"]
    generation.sync_weights()  # asleep: nothing to push into
    generation.version.version += 1
    generation.sync_weights()
    assert len(calls) == 16


def test_the_engine_goes_back_to_sleep_when_a_rollout_fails():
    generation, calls, _ = _generation(sleeps=True)
    with pytest.raises(TypeError, match="return_logprobs must be a bool"):
        generation.generate([torch.tensor([5])], return_logprobs="yes")
    assert calls == ["sleep"]  # refused before waking anything

    def broken(*args):
        calls.append("generate")
        raise RuntimeError("engine failure")

    generation.engine.generate = broken
    with pytest.raises(RuntimeError, match="engine failure"):
        generation.generate([torch.tensor([5])], max_new_tokens=2)
    assert calls == ["sleep", "wake:weights", "push:w", "wake:kv_cache", "generate", "sleep"]


def test_awake_holds_a_sleeping_engine_awake_across_the_rollouts_inside_it():
    generation, calls, _ = _generation(sleeps=True)
    query = [torch.tensor([5, 6])]
    with generation.awake():  # e.g. the turns of trl_lite.agents.run_episodes
        generation.generate(query, max_new_tokens=2)
        generation.generate(query, max_new_tokens=2)
    assert calls == ["sleep", "wake:weights", "push:w", "wake:kv_cache", "generate", "generate", "sleep"]
    generation.generate(query, max_new_tokens=2)  # outside: woken and put back to sleep again
    assert calls[7:] == ["wake:weights", "push:w", "wake:kv_cache", "generate", "sleep"]


def test_an_engine_that_does_not_sleep_is_pushed_once_per_policy_change():
    generation, calls, _ = _generation(sleeps=False)
    assert calls == ["push:w"]
    generation.generate([torch.tensor([5, 6])], max_new_tokens=2)
    generation.generate([torch.tensor([5, 6])], max_new_tokens=2)
    assert calls == ["push:w", "generate", "generate"]
    generation.version.version += 1
    generation.generate([torch.tensor([5, 6])], max_new_tokens=2)
    assert calls[3:] == ["push:w", "generate"]


class LengthBackend:
    """A vLLM backend stand-in holding ``max_model_len`` tokens per sequence; answers with token 3."""

    max_model_len = 16

    def generate(self, prompts, sampling_params):
        return [[([3] * p["max_tokens"], None)] * p["n"] for p in sampling_params]


def test_a_rollout_longer_than_the_engine_holds_is_refused_instead_of_cut_short():
    engine = VLLMEngine(LengthBackend(), eos_token_id=1, pad_token_id=0)
    queries = [torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7, 8, 9])]
    rows, _ = engine.generate(queries, {"max_new_tokens": 11, "do_sample": False}, None, 2, False, True, False)
    assert [len(r) for r in rows] == [11, 11]  # 5 + 11 = 16 fits exactly
    with pytest.raises(ValueError, match=r"query 1 has 5 tokens and asks for up to 12 new ones, 17 in all; .*"
                                         r"max_model_len=16 .*Set vllm_max_model_len"):  # fmt: skip
        engine.generate(queries, {"max_new_tokens": 12, "do_sample": False}, None, 2, False, True, False)


@pytest.mark.requires("vllm")
def test_the_server_launcher_documents_vllms_memory_and_eager_defaults(capsys):
    import dataclasses

    from vllm.config import CacheConfig

    from trl_lite import vllm_server

    default = next(f.default for f in dataclasses.fields(CacheConfig) if f.name == "gpu_memory_utilization")
    share = getattr(default, "default", default)  # a pydantic FieldInfo in vLLM 0.32
    with pytest.raises(SystemExit):
        vllm_server.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for documented in (f"--gpu-memory-utilization {share}", "--max-model-len N", "-1 for the longest that fits",
                       "--enforce-eager is on"):  # fmt: skip
        assert documented in help_text
    docstring = " ".join(vllm_server.__doc__.split()).replace("``", "")
    assert f"--gpu-memory-utilization {share}" in docstring and "--max-model-len N" in docstring
    args, extra = vllm_server.parse_args(["--model", "m"])
    assert args.enforce_eager is True and args.kv_cache_gb is None and extra == []
