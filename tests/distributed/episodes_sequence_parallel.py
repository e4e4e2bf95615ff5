"""Truncated sampling under sequence parallelism: run_episodes (multi-turn, a tool) then step(), twice.

    accelerate launch --config_file accelerate_configs/deepspeed_sequence_parallel.yaml --num_processes 2 \\
        tests/distributed/episodes_sequence_parallel.py --base_model DIR --output_dir OUT
    python tests/distributed/episodes_sequence_parallel.py --base_model DIR --output_dir OUT2 \\
        --replay_from OUT/result.pt     # the 1-process reference: steps the group's episodes over their kept sets

``DIR`` holds test_agents' sampling successor model that calls ``add`` in some turns. The 2 processes form one
sequence-parallel group; each samples from a seed of its own, so only the group's generate (each process a share of
a turn's queries, gathered, or the first process's for fewer queries than processes) gives them the same episodes,
and the kept sets the sampler used travel with them. Each round plays 2 prompts x 2 episodes at top-k 5 / top-p 0.9
(T 0.7) and steps on them with ``step_inputs(episodes)`` (its ``kept_sets``, none on the tool's tokens). The
reference steps the same rows over the same sets passed explicitly; the mini-batch order is seeded alike.

``--own_sets_only 1`` is the negative control: each process keeps only the sets of the rows it sampled itself (what
records taken per process, not gathered, would give) and writes what the first step() said.

Rank 0 writes OUT/result.pt: every process's episodes per round (responses, masks, kept sets as lists), whether step()
re-derived any set, how many queries each engine call of each process got, the statistics of both steps, the full
weights after them, and what ``AsyncRollouts`` said when built on this trainer.
"""

import argparse
import os
import warnings

import torch
import torch.distributed as dist
from common import finish, full_named_parameters
from test_agents import TOKENIZER, add
from transformers import AutoModelForCausalLM

from trl_lite import PPOConfig, PPOTrainer, set_seed
from trl_lite.agents import run_episodes, step_inputs
from trl_lite.core.kept_sets import KeptSets
from trl_lite.parallel import sequence_parallel_size
from trl_lite.rollouts import AsyncRollouts

ROUNDS = 2
PROMPTS = [[{"role": "user", "content": "add 2 and 3"}], [{"role": "user", "content": "add 4 and 5"}]]


def as_lists(kept) -> tuple | None:
    return None if kept is None else (kept.offsets.tolist(), kept.ids.tolist())


def from_lists(kept) -> KeptSets | None:
    if kept is None:
        return None
    return KeptSets(torch.tensor(kept[0]), torch.tensor(kept[1], dtype=torch.int32), len(kept[0]) - 1)


def gathered(value, trainer) -> list:
    if trainer.accelerator.num_processes == 1:
        return [value]
    out = [None] * trainer.accelerator.num_processes
    dist.all_gather_object(out, value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--replay_from", default=None, help="a 2-process run's result.pt: step its episodes instead")
    parser.add_argument("--own_sets_only", type=int, choices=(0, 1), default=0,
                        help="each process keeps only the sets of the rows it sampled itself (records per process, "
                        "not gathered): the first step() must refuse, and its message is written")  # fmt: skip
    args = parser.parse_args()
    config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=0.05, padding_free=True,
                       advantage_estimator="grpo", num_samples_per_query=2, top_k=5, top_p=0.9, temperature=0.7,
                       prefix_sharing=False, shuffle_by_prompt=False, seed=0)  # fmt: skip
    set_seed(0)  # the value head the trainer adds starts alike in every run
    policy, reference = (AutoModelForCausalLM.from_pretrained(args.base_model) for _ in range(2))
    trainer = PPOTrainer(config, policy, ref_model=reference, tokenizer=TOKENIZER,
                         optimizer=torch.optim.SGD(policy.parameters(), lr=config.learning_rate))  # fmt: skip
    rank, sp_size = trainer.accelerator.process_index, sequence_parallel_size(trainer.accelerator)
    async_refusal = None
    if trainer.accelerator.num_processes > 1:  # the asynchronous producer: refused, so it never runs in a group
        try:
            AsyncRollouts(trainer, [None], lambda data, generate: {}, max_staleness=0).close()
        except ValueError as error:
            async_refusal = str(error)
    source = torch.load(args.replay_from, weights_only=False) if args.replay_from else None

    engine, engine_calls = trainer.generation.engine, []
    engine_generate = engine.generate
    engine.generate = lambda queries, *rest: engine_calls.append(len(queries)) or engine_generate(queries, *rest)
    torch.manual_seed(100 + rank)  # a seed of each process's own: the group's generate must make one sampling
    rounds, stats, rederived = [], [], False
    for step in range(ROUNDS):
        if source is None:
            episodes = run_episodes(trainer, PROMPTS, tools=[add], max_turns=2, max_episode_tokens=48,
                                    num_generations=2, max_new_tokens=12, do_sample=True)  # fmt: skip
            inputs = step_inputs(episodes)
            inputs["scores"] = [torch.tensor(float(e.tool_calls) + 0.1 * i) for i, e in enumerate(episodes)]
        else:
            played = source["rounds"][step][0]  # the group's first process's episodes
            inputs = {"queries": [torch.tensor(q) for q in played["queries"]],
                      "responses": [torch.tensor(r) for r in played["responses"]],
                      "response_masks": [torch.tensor(m) for m in played["masks"]],
                      "scores": [torch.tensor(s) for s in played["scores"]], "group_ids": played["group_ids"],
                      "kept_sets": [from_lists(k) for k in played["kept"]]}  # fmt: skip
        inputs.pop("generation_logprobs", None)
        if args.own_sets_only:  # what per-process records would give: no record of the other process's rows
            own = trainer.sequence.own_share(list(range(len(inputs["kept_sets"]))))
            inputs["kept_sets"] = [k if i in own else None for i, k in enumerate(inputs["kept_sets"])]
            try:
                trainer.step(**inputs)
                refusal = None
            except ValueError as error:
                refusal = str(error)
            if rank == 0:
                torch.save({"refusal": refusal}, os.path.join(args.output_dir, "result.pt"))
            finish(trainer)
            return
        mine = {"queries": [q.tolist() for q in inputs["queries"]],
                "responses": [r.tolist() for r in inputs["responses"]],
                "masks": [m.tolist() for m in inputs["response_masks"]], "scores": [float(s) for s in inputs["scores"]],
                "group_ids": inputs["group_ids"], "kept": [as_lists(k) for k in inputs["kept_sets"]]}  # fmt: skip
        rounds.append(gathered(mine, trainer))
        state = torch.random.get_rng_state()
        torch.manual_seed(step)  # the mini-batch order: the same in the group's first process and the reference
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = trainer.step(**inputs)
        torch.random.set_rng_state(state)
        rederived = rederived or any("re-derived" in str(w.message) for w in caught)
        stats.append({k: v for k, v in result.items() if not k.startswith("time/")})
    engine.generate = engine_generate
    calls, rederived_everywhere = gathered(engine_calls, trainer), gathered(rederived, trainer)
    named = full_named_parameters(trainer)
    if rank == 0:
        torch.save({"sp_size": sp_size, "num_processes": trainer.accelerator.num_processes, "rounds": rounds,
                    "rederived": rederived_everywhere, "engine_calls": calls, "stats": stats,
                    "named_parameters": named, "async_refusal": async_refusal},
                   os.path.join(args.output_dir, "result.pt"))  # fmt: skip
    if trainer.accelerator.num_processes > 1:
        finish(trainer)


if __name__ == "__main__":
    main()
