"""A GRPO rollout loop on colocated vLLM engines, one per process (generate -> score -> step).

    accelerate launch --config_file accelerate_configs/<name>.yaml --num_processes 2 \\
        tests/distributed/vllm_loop.py --base_model DIR --output_dir OUT [--peft | --lora_sync]

Every process runs its own engine on its own queries. After the loop every engine decodes fixed
queries greedily; rank 0 writes OUT/report.pt with every process's engine tokens, weights checksum
and number of weight pushes, and its full policy weights as a float64 transformers state dict (LoRA
merged by hand for --peft), which the test decodes greedily in a plain process (under ZeRO-3 any
transformers model built here would be partitioned). ``--lora_sync``: a LoRA adapter on every projection
of a saved Qwen2, pushed to the engines as an adapter (``vllm_lora_sync=True``); the report then also has
every process's bytes per push and the LoRA ids its engine holds.
"""

import argparse
import os

import torch
from common import finish, flat, full_named_parameters, gather_across_processes, is_zero3

from tiny_models import make_tokenizer

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

FIXED_QUERIES = [[5, 6, 7, 8], [10], [11, 12, 13], [20, 21]]
NEW_TOKENS = 6


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_model", required=True, help="directory of a saved GPT-2 (head size >= 32)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--peft", action="store_true", help="train a LoRA adapter on the policy")
    parser.add_argument("--lora_sync", action="store_true", help="a Qwen2 LoRA policy whose adapter the engine serves")
    return parser.parse_args()


def merged_state(trainer) -> dict:
    """The policy's full weights as a float64 transformers state dict, W + scaling * (B A)^T for each
    LoRA layer (computed here from the factors). Under ZeRO-3 every process must call it together."""
    named = full_named_parameters(trainer)  # value-head wrapper names
    prefix = "pretrained_model.base_model.model." if trainer.is_peft_model else "pretrained_model."
    state = {}
    for name, tensor in named.items():
        if name.startswith(prefix) and "lora_" not in name:
            state[name[len(prefix) :].replace(".base_layer.", ".")] = tensor
    if trainer.is_peft_model:
        peft_model = trainer.accelerator.unwrap_model(trainer.model).pretrained_model
        for module_name, module in peft_model.get_base_model().named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                a = named[f"{prefix}{module_name}.lora_A.default.weight"]
                b = named[f"{prefix}{module_name}.lora_B.default.weight"]
                delta = module.scaling["default"] * (b @ a)
                delta = delta.T if module.fan_in_fan_out else delta  # GPT-2's Conv1D stores W transposed
                state[f"{module_name}.weight"] = state[f"{module_name}.weight"] + delta
    return state


def main():
    args = parse_args()
    torch.manual_seed(0)
    if args.lora_sync:
        from peft import LoraConfig

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM")
        model = AutoModelForCausalLMWithValueHead.from_pretrained(args.base_model, peft_config=lora)
    elif args.peft:
        from peft import LoraConfig

        lora = LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn"], task_type="CAUSAL_LM", fan_in_fan_out=True)
        model = AutoModelForCausalLMWithValueHead.from_pretrained(args.base_model, peft_config=lora)
    else:
        model = AutoModelForCausalLMWithValueHead.from_pretrained(args.base_model)
    config = PPOConfig(
        batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=5e-2, advantage_estimator="grpo",
        num_samples_per_query=2, use_vllm=True, vllm_kv_cache_gb=1, vllm_max_model_len=64, vllm_dtype="float32", seed=0,
        vllm_lora_sync=True if args.lora_sync else None,
    )  # fmt: skip
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer())
    rank = trainer.accelerator.process_index
    pushes, push_bytes = [], [float(trainer.generation.last_push_bytes)]
    original = trainer.generation.push
    trainer.generation.push = lambda named: (pushes.append(1), original(named))[1]
    generator = torch.Generator().manual_seed(100 + rank)  # each process its own queries
    for _ in range(args.steps):
        queries = [torch.randint(3, 50, (int(n),), generator=generator) for n in torch.randint(2, 6, (2,), generator=generator)]
        responses = trainer.generate(queries, return_prompt=False, max_new_tokens=5, do_sample=True, num_return_sequences=2)
        rows = [queries[i // 2] for i in range(4)]
        scores = [torch.tensor(float(i % 2)) for i in range(4)]
        if pushes:
            push_bytes.append(float(trainer.generation.last_push_bytes))
        stats = trainer.step(rows, [r if len(r) else torch.tensor([3]) for r in responses], scores)
        assert stats["ppo/loss/policy"] == stats["ppo/loss/policy"]
    engine_tokens = trainer.generate([torch.tensor(q) for q in FIXED_QUERIES], return_prompt=False,
                                     max_new_tokens=NEW_TOKENS, do_sample=False)  # fmt: skip
    got = [r.tolist() for r in engine_tokens]
    state = merged_state(trainer)
    padded = torch.full((len(FIXED_QUERIES), NEW_TOKENS), -1.0)
    for i, row in enumerate(got):
        padded[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    device = trainer.accelerator.device
    report = {
        "tokens": gather_across_processes(padded, device),
        "weights": gather_across_processes(flat(full_named_parameters(trainer)).sum().reshape(1), device),
        "pushes": gather_across_processes(torch.tensor([float(len(pushes))]), device),
        "zero3": is_zero3(trainer),
        "push_bytes": gather_across_processes(torch.tensor(push_bytes + [float(trainer.generation.last_push_bytes)]),
                                              device),
        "adapter_ids": gather_across_processes(
            torch.tensor(sorted(trainer.generation.engine.backend.adapter_ids()) if args.lora_sync else [],
                         dtype=torch.float64), device,
        ),  # fmt: skip
        "state": state,
    }
    if rank == 0:
        torch.save(report, os.path.join(args.output_dir, "report.pt"))
    trainer.generation.close()
    finish(trainer)


if __name__ == "__main__":
    main()
