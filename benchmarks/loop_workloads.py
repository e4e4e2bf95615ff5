"""The loops both loop benchmarks run: workloads, the stand-in reward, and the loop on trl_lite.

`bench_loop.py` times them against plain transformers, `async_loop.py` under `AsyncRollouts`; both import
this module and neither imports the other at module level.
"""

import dataclasses
import time

import torch

import step_floors
import step_methods
import step_workloads


@dataclasses.dataclass(frozen=True)
class LoopWorkload:
    """A loop: the model of a bench_step workload, its batch and PPO settings, a generation setting."""

    name: str
    model: step_workloads.Workload
    generation_batch_size: int = 4  # queries per transformers generate call
    new_tokens: tuple = (16, 33)  # LengthSampler(16, 33): 16-32 new tokens, 24 on average
    samples_per_query: int = 1  # > 1: GRPO, the model.batch_size rows answer batch_size / k queries


LOOPS = {
    # The w1 model (2 x 128, GPT-2's vocabulary): quick.
    "tiny": LoopWorkload("loop-tiny", dataclasses.replace(step_workloads.W1, name="loop-tiny")),
    # GPT-2 small with 24-token responses on average, as in the issue that asked for this benchmark.
    "small": LoopWorkload(
        "loop-small", dataclasses.replace(step_workloads.W2, name="loop-small", batch_size=16, mini_batch_size=4)
    ),
    # GRPO on the w1 model: 8 queries x 8 samples = 64 rows, 4 mini-batches.
    "grpo": LoopWorkload(
        "loop-grpo", dataclasses.replace(step_workloads.W1, name="loop-grpo", batch_size=64, mini_batch_size=16),
        samples_per_query=8,
    ),  # fmt: skip
    # For --async: the w1 model, batch 12, one optimizer step per PPO step, 48-token responses: on one core
    # each, the server's generation with its weight push and the trainer's step take about as long.
    "async": LoopWorkload(
        "loop-async",
        dataclasses.replace(step_workloads.W1, name="loop-async", batch_size=12, mini_batch_size=12, ppo_epochs=1),
        new_tokens=(48, 49),
    ),  # fmt: skip
}


def reward_fn(responses: list) -> list:
    """A cheap stand-in reward: the share of even token ids in each response."""
    return [(r % 2 == 0).float().mean() for r in responses]


def sample_queries(workload: step_workloads.Workload, iteration: int) -> list:
    """The iteration's queries: lengths and ids from a generator seeded by the iteration."""
    return step_workloads.make_batch(dataclasses.replace(workload, seed=1000 + iteration))[0]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# Generation settings: classic TRL's pure sampling, or (--greedy) greedy decoding, deterministic.
SAMPLING = dict(do_sample=True, top_k=0, top_p=1.0)
GREEDY = dict(do_sample=False)


class FixedLength:
    """A length sampler that always draws ``n`` (--greedy: every chunk generates the same number of tokens)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self) -> int:
        return self.n


def length_sampler(loop: LoopWorkload, greedy: bool):
    """The loop's ``LengthSampler`` - or, with ``greedy``, a fixed length: the sampler's mean."""
    from trl_lite import LengthSampler  # the same sampler class in both loops, so both draw the same lengths

    return FixedLength(sum(loop.new_tokens) // 2) if greedy else LengthSampler(*loop.new_tokens)


class TrlLoop:
    """The loop on trl_lite, as a user writes it; ``backend='vllm'``: generation on a colocated vLLM engine
    (or a server: ``config_options`` are further PPOConfig fields)."""

    def __init__(self, loop: LoopWorkload, device: str, dtype: torch.dtype, greedy: bool = False,
                 backend: str = "transformers", **config_options):  # fmt: skip
        from transformers import PreTrainedTokenizerFast
        from tokenizers import Tokenizer, models

        from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig

        w = loop.model
        lm = step_workloads.make_lm(w, device, dtype)
        model = AutoModelForCausalLMWithValueHead.from_pretrained(lm).to(device=device, dtype=dtype)
        # generate() pads with the tokenizer's ids: a word-level tokenizer whose special ids are the model's.
        eos = w.vocab_size - 1
        word_level = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<|endoftext|>": eos}, unk_token="<unk>"))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
        k = loop.samples_per_query
        critic_free = dict(advantage_estimator="grpo", num_samples_per_query=k) if k > 1 else {}
        config = PPOConfig(
            batch_size=w.batch_size, mini_batch_size=w.mini_batch_size, ppo_epochs=w.ppo_epochs,
            learning_rate=step_floors.LEARNING_RATE, seed=w.seed, use_vllm=backend == "vllm", **critic_free,
            **config_options,
        )  # fmt: skip
        self.trainer = step_methods.quiet_trainer(config, model, tokenizer=tokenizer)
        self.sampler = length_sampler(loop, greedy)
        self.settings = GREEDY if greedy else SAMPLING
        if k > 1:
            self.settings = dict(self.settings, num_return_sequences=k)
        self.loop, self.device, self.backend = loop, device, backend

    def iteration(self, queries: list) -> dict:
        """One iteration on ``queries`` (``batch_size`` of them; GRPO: every k-th, each answered k times)."""
        trainer, times, k = self.trainer, {}, self.loop.samples_per_query
        asked = queries[::k]
        engine_logprobs = self.backend == "vllm"
        t0 = time.perf_counter()
        out = trainer.generate(
            asked, length_sampler=self.sampler, batch_size=self.loop.generation_batch_size, return_prompt=False,
            return_logprobs=engine_logprobs, **self.settings,
        )  # fmt: skip
        responses, logprobs = out if engine_logprobs else (out, None)
        with trainer.timed("rollout/reward"):
            scores = reward_fn(responses)
        sync(self.device)
        t1 = time.perf_counter()
        rows = [query for query in asked for _ in range(k)]
        stats = trainer.step(rows, responses, scores, generation_logprobs=logprobs)
        sync(self.device)
        t2 = time.perf_counter()
        times.update(
            generate=stats["time/rollout/generate"], weight_sync=stats.get("time/rollout/weight_sync", 0.0),
            reward=stats["time/rollout/reward"], step=t2 - t1, total=t2 - t0,
        )  # fmt: skip
        times["new_tokens"] = sum(len(r) for r in responses)
        return times


# --peft: a Qwen2-0.5B-shaped policy (random weights from its config) with a rank-16 LoRA adapter on every
# attention and MLP projection, on vLLM, its adapter pushed (vllm_lora_sync) or the merged model.
QWEN2_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)  # fmt: skip
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def qwen2_model(layers: int, device: str = "cpu", seed: int = 0):
    """A Qwen2 of the Qwen2-0.5B shape with ``layers`` of its decoder layers (24: the whole model), random
    weights; ``device='meta'`` builds it without memory (for counting bytes)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**dict(QWEN2_05B, num_hidden_layers=layers), bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    with torch.device(device):
        lm = Qwen2ForCausalLM(config)
    lm.config.architectures = ["Qwen2ForCausalLM"]
    return lm


def qwen2_lora_policy(layers: int, rank: int = 16, device: str = "cpu", seed: int = 0):
    """:func:`qwen2_model` with a LoRA adapter of ``rank`` on every attention and MLP projection (PEFT)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(qwen2_model(layers, device, seed), lora)


def push_bytes(peft_model) -> dict:
    """Bytes one push moves: the merged model (every tensor of the transformers state, the tied LM head
    twice, as pushed) and the adapter alone; counted from the tensors the pushes would send."""
    from trl_lite.engines import named_policy_weights
    from trl_lite.engines.lora_sync import adapter_spec, named_adapter_weights

    spec, reason = adapter_spec(peft_model, ["Qwen2ForCausalLM"])
    if spec is None:
        raise ValueError(f"the benchmark's adapter should be servable: {reason}")

    def size(named):
        return sum(t.numel() * t.element_size() for _, t in named)

    return {"merged": size(named_policy_weights(peft_model)), "adapter": size(named_adapter_weights(peft_model, spec))}


class PeftLoop:
    """A GRPO loop (``queries`` queries x ``samples`` samples, ``new_tokens`` sampled tokens) on vLLM with a
    LoRA policy; ``lora_sync``: ``PPOConfig.vllm_lora_sync`` (True: the adapter, False: the merged model);
    ``config_options``: further PPOConfig fields (server mode)."""

    def __init__(self, layers: int, lora_sync: bool, queries: int = 4, samples: int = 2, new_tokens: int = 16,
                 **config_options):  # fmt: skip
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig

        model = AutoModelForCausalLMWithValueHead.from_pretrained(qwen2_lora_policy(layers))
        word_level = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>", pad_token="<eos>")
        config = PPOConfig(
            batch_size=queries * samples, mini_batch_size=queries * samples, ppo_epochs=1, learning_rate=1e-3,
            advantage_estimator="grpo", num_samples_per_query=samples, use_vllm=True, vllm_lora_sync=lora_sync,
            vllm_dtype="float32", vllm_max_model_len=128, vllm_kv_cache_gb=1, **config_options,
        )  # fmt: skip
        self.trainer = step_methods.quiet_trainer(config, model, tokenizer=tokenizer)
        self.queries, self.samples, self.new_tokens = queries, samples, new_tokens

    def iteration(self, iteration: int) -> dict:
        """Generate (after the push of the previous step's update), reward, step; seconds and push bytes."""
        generator = torch.Generator().manual_seed(1000 + iteration)
        asked = [torch.randint(2, 50000, (8,), generator=generator) for _ in range(self.queries)]
        trainer = self.trainer
        t0 = time.perf_counter()
        responses, logprobs = trainer.generate(
            asked, return_prompt=False, do_sample=True, top_k=0, max_new_tokens=self.new_tokens, eos_token_id=[],
            num_return_sequences=self.samples, return_logprobs=True,
        )  # fmt: skip
        scores = reward_fn(responses)
        rows = [query for query in asked for _ in range(self.samples)]
        stats = trainer.step(rows, responses, scores, generation_logprobs=logprobs)
        total = time.perf_counter() - t0
        return {
            "weight_sync": stats.get("time/rollout/weight_sync", 0.0), "push_bytes": trainer.generation.last_push_bytes,
            "generate": stats["time/rollout/generate"], "total": total,
        }  # fmt: skip
