"""The loops both loop benchmarks run: workloads, the stand-in reward, and the loop on trl_lite.

`bench_loop.py` times them against plain transformers, `async_loop.py` under `AsyncRollouts`; both import
this module and neither imports the other at module level.
"""

import dataclasses
import time

import torch

import bench_step


@dataclasses.dataclass(frozen=True)
class LoopWorkload:
    """A loop: the model of a bench_step workload, its batch and PPO settings, a generation setting."""

    name: str
    model: bench_step.Workload
    generation_batch_size: int = 4  # queries per transformers generate call
    new_tokens: tuple = (16, 33)  # LengthSampler(16, 33): 16-32 new tokens, 24 on average
    samples_per_query: int = 1  # > 1: GRPO, the model.batch_size rows answer batch_size / k queries


LOOPS = {
    # The w1 model (2 x 128, GPT-2's vocabulary): quick.
    "tiny": LoopWorkload("loop-tiny", dataclasses.replace(bench_step.W1, name="loop-tiny")),
    # GPT-2 small with 24-token responses on average, as in the issue that asked for this benchmark.
    "small": LoopWorkload(
        "loop-small", dataclasses.replace(bench_step.W2, name="loop-small", batch_size=16, mini_batch_size=4)
    ),
    # GRPO on the w1 model: 8 queries x 8 samples = 64 rows, 4 mini-batches.
    "grpo": LoopWorkload(
        "loop-grpo", dataclasses.replace(bench_step.W1, name="loop-grpo", batch_size=64, mini_batch_size=16),
        samples_per_query=8,
    ),  # fmt: skip
    # For --async: the w1 model, batch 12, one optimizer step per PPO step, 48-token responses: on one core
    # each, the server's generation with its weight push and the trainer's step take about as long.
    "async": LoopWorkload(
        "loop-async",
        dataclasses.replace(bench_step.W1, name="loop-async", batch_size=12, mini_batch_size=12, ppo_epochs=1),
        new_tokens=(48, 49),
    ),  # fmt: skip
}


def reward_fn(responses: list) -> list:
    """A cheap stand-in reward: the share of even token ids in each response."""
    return [(r % 2 == 0).float().mean() for r in responses]


def sample_queries(workload: bench_step.Workload, iteration: int) -> list:
    """The iteration's queries: lengths and ids from a generator seeded by the iteration."""
    return bench_step.make_batch(dataclasses.replace(workload, seed=1000 + iteration))[0]


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

        from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

        w = loop.model
        lm = bench_step.make_lm(w, device, dtype)
        model = AutoModelForCausalLMWithValueHead.from_pretrained(lm).to(device=device, dtype=dtype)
        # generate() pads with the tokenizer's ids: a word-level tokenizer whose special ids are the model's.
        eos = w.vocab_size - 1
        word_level = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<|endoftext|>": eos}, unk_token="<unk>"))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
        k = loop.samples_per_query
        critic_free = dict(advantage_estimator="grpo", num_samples_per_query=k) if k > 1 else {}
        config = PPOConfig(
            batch_size=w.batch_size, mini_batch_size=w.mini_batch_size, ppo_epochs=w.ppo_epochs,
            learning_rate=bench_step.LEARNING_RATE, seed=w.seed, use_vllm=backend == "vllm", **critic_free,
            **config_options,
        )  # fmt: skip
        self.trainer = PPOTrainer(config, model, tokenizer=tokenizer)
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
