"""Colocated vLLM with vllm_tensor_parallel_size=2 over 2 processes: one engine, half of it on each.

    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml --num_processes 2 \\
        tests/distributed/vllm_tensor_parallel.py --base_model DIR --output_dir OUT

Each process asks its own queries (rank 0 three, rank 1 one: the group answers the union and each
keeps its own rows), greedily, before and after one GRPO step (the push reaches both shards).
Rank 0 writes OUT/report.pt: every process's rows (before, after), their queries, its engine shard
(vLLM's tensor-parallel rank and size), and the policy's weights after the step as a float64
transformers state dict, which the test decodes in a plain process.
"""

import argparse
import os

import torch
from common import finish, full_named_parameters

from tiny_models import make_tokenizer
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

QUERIES = {0: [[5, 6, 7, 8], [10], [11, 12, 13]], 1: [[20, 21]]}
NEW_TOKENS = 6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_model", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = PPOConfig(
        batch_size=4, mini_batch_size=2, ppo_epochs=1, learning_rate=5e-2, advantage_estimator="grpo",
        num_samples_per_query=2, use_vllm=True, vllm_kv_cache_gb=1, vllm_max_model_len=64, vllm_dtype="float32",
        vllm_tensor_parallel_size=2, seed=0,
    )  # fmt: skip
    model = AutoModelForCausalLMWithValueHead.from_pretrained(args.base_model)
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer())
    rank = trainer.accelerator.process_index
    queries = [torch.tensor(q) for q in QUERIES[rank]]

    def greedy_rows():
        rows = trainer.generate(queries, return_prompt=False, max_new_tokens=NEW_TOKENS, do_sample=False)
        return [r.tolist() for r in rows]

    before = greedy_rows()
    prompts = [torch.tensor([30 + rank, 31]), torch.tensor([32, 33, 34])]
    responses = trainer.generate(prompts, return_prompt=False, max_new_tokens=4, do_sample=True, num_return_sequences=2)
    rows = [prompts[i // 2] for i in range(4)]
    scores = [torch.tensor(float(i % 2)) for i in range(4)]
    trainer.step(rows, [r if len(r) else torch.tensor([3]) for r in responses], scores)
    after = greedy_rows()
    state = {name.removeprefix("pretrained_model."): t for name, t in full_named_parameters(trainer).items()
             if name.startswith("pretrained_model.")}  # fmt: skip
    shard = (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
    everyone = [None, None]
    mine = {"queries": QUERIES[rank], "before": before, "after": after, "shard": shard}
    torch.distributed.all_gather_object(everyone, mine)
    if rank == 0:
        torch.save({"processes": everyone, "state": state}, os.path.join(args.output_dir, "report.pt"))
    trainer.generation.close()
    finish(trainer)


if __name__ == "__main__":
    main()
