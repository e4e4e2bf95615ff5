"""Two packed PPO steps whose batches are chosen per data-parallel group, for sequence-parallel comparisons.

    accelerate launch --config_file accelerate_configs/deepspeed_sequence_parallel.yaml --num_processes 2 \\
        tests/distributed/sequence_parallel_step.py --estimator {gae,grpo} --output_dir OUT
    python tests/distributed/sequence_parallel_step.py --estimator gae --output_dir OUT   # the 1-process reference

Group ``g`` (process rank // sp_size; every process is a group of its own without sequence parallelism)
takes batch ``g``: 4 rows of very different lengths - one of 2 tokens, one of 31 that any pass cuts across
slices - in mini-batches of 2 rows, 2 epochs, response masks. The optimizer is SGD (its update is linear in
the gradient). Rank 0 writes OUT/result.pt: the full weights after the steps, the statistics of both steps,
the sequence-parallel size, the longest and the summed token slices its policy's embedding saw, and the
responses every process sampled for its group's queries from a seed of its own (``generate()``), the
queries each process's engine generated for, and the trailing shapes of the pieces the group gathered.
"""

import argparse
import os
import warnings

import torch
import torch.distributed as dist
from common import finish, full_named_parameters

from tiny_models import VOCAB_SIZE, make_gpt2, make_gpt2_critic, make_qwen2, make_tokenizer
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, set_seed
from trl_lite.core.kept_sets import KeptSets
from trl_lite.parallel import sequence_parallel, sequence_parallel_size

# (query, response) tokens of each row of each group's batch; rows 2k and 2k + 1 share their query (one
# GRPO group of num_samples_per_query=2).
ROW_SHAPES = (((1, 30), (1, 1), (6, 9), (6, 17)), ((5, 4), (5, 28), (2, 12), (2, 1)))


def batch(group: int, step: int):
    g = torch.Generator().manual_seed(1000 * group + step)
    queries = [torch.randint(3, VOCAB_SIZE, (q,), generator=g) for q, _ in ROW_SHAPES[group][::2]]
    queries = [q for q in queries for _ in range(2)]
    responses = [torch.randint(3, VOCAB_SIZE, (r,), generator=g) for _, r in ROW_SHAPES[group]]
    scores = [torch.randn((), generator=g) for _ in queries]
    masks = [(torch.rand(len(r), generator=g) > 0.2).long() for r in responses]
    return queries, responses, scores, masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--estimator", choices=("gae", "grpo"), required=True)
    parser.add_argument("--loss_type", default="token_mean")
    parser.add_argument("--ptx", type=int, choices=(0, 1), default=0, help="add a PTX loss (ptx_coef 0.5)")
    parser.add_argument("--gradient_checkpointing", type=int, choices=(0, 1), default=0)
    parser.add_argument("--max_tokens", type=int, default=None, help="max_tokens_per_minibatch (a budget per group)")
    parser.add_argument("--kl_penalty", default="kl", help="full: the exact KL of the whole vocabulary")
    parser.add_argument("--critic", type=int, choices=(0, 1), default=0, help="a separate critic (GPT-2 classifier)")
    parser.add_argument("--lm_head_chunk_size", type=int, default=None, help="tokens per chunk of the LM head")
    parser.add_argument("--peft", type=int, choices=(0, 1), default=0,
                        help="train a LoRA adapter on the projections; the reference is the base model")
    parser.add_argument("--model", choices=("gpt2", "gpt2_4_heads", "qwen2", "qwen2_4_heads"), default="gpt2",
                        help="qwen2: rotary positions, 2 query heads sharing 1 key/value head (4 sharing 2)")  # fmt: skip
    parser.add_argument("--different_rows", type=int, choices=(0, 1), default=0,
                        help="give every process but the group's first other scores (step() must refuse them)")
    parser.add_argument("--padded_pass", type=int, choices=(0, 1), default=0,
                        help="after the steps, generate greedily for 2 queries (a padded pass, not cut)")
    parser.add_argument("--top_k", type=int, default=0, help="truncated sampling (scored over kept sets), at T 0.7")
    parser.add_argument("--top_p", type=float, default=1.0, help="truncated sampling, at T 0.7")
    parser.add_argument("--replay", type=int, choices=(0, 1), default=0,
                        help="truncated: first a step on the generated rows, over the kept sets the group recorded")
    parser.add_argument("--replay_from", default=None,
                        help="a --replay run's result.pt: step its generated rows over its kept sets instead")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    grpo = args.estimator == "grpo"
    config = PPOConfig(
        batch_size=4,
        mini_batch_size=2,
        ppo_epochs=2,
        learning_rate=0.05,
        padding_free=True,
        advantage_estimator=args.estimator,
        num_samples_per_query=2 if grpo else 1,
        loss_type=args.loss_type,
        ptx_coef=0.5 if args.ptx else 0.0,
        gradient_checkpointing=bool(args.gradient_checkpointing),
        max_tokens_per_minibatch=args.max_tokens,
        max_response_length=32 if args.loss_type == "seq_mean_token_sum_norm" else None,
        lm_head_chunk_size=args.lm_head_chunk_size,
        kl_penalty=args.kl_penalty,
        top_k=args.top_k,
        top_p=args.top_p,
        temperature=0.7 if args.top_k or args.top_p < 1.0 else 1.0,
        seed=0,
    )
    set_seed(0)
    if args.model.startswith("qwen2"):
        lm = make_qwen2(seed=0, **({"heads": 4, "kv_heads": 2} if "4" in args.model else {}))
    else:
        lm = make_gpt2(seed=0, n_head=4 if "4" in args.model else 2)
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                                 task_type="CAUSAL_LM")  # fmt: skip
    model = AutoModelForCausalLMWithValueHead.from_pretrained(lm, peft_config=peft_config)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=config.learning_rate)
    critic = make_gpt2_critic(seed=1) if args.critic else None
    critic_optimizer = torch.optim.SGD(critic.parameters(), lr=0.02) if args.critic else None
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer("left"), optimizer=optimizer, value_model=critic,
                         critic_optimizer=critic_optimizer)  # fmt: skip
    sp_size = sequence_parallel_size(trainer.accelerator)
    # One sequence-parallel part, the trainer's, in every part that cuts, shares or counts the group's rows.
    parts = (trainer.forward, trainer.learner, trainer.experience_maker, trainer.statistics, trainer.generation)
    assert all(part.sequence is trainer.sequence for part in parts) and trainer.sequence.size == sp_size
    assert trainer.sequence.cuts == (sp_size > 1)
    group = trainer.accelerator.process_index // sp_size

    # Every process samples from a seed of its own; generate() gives the processes of a group the group's
    # responses, each process generating a share of the queries.
    engine, generated_queries = trainer.generation.engine, []
    engine_generate = engine.generate
    engine.generate = lambda queries, *args: generated_queries.append(len(queries)) or engine_generate(queries, *args)
    torch.manual_seed(100 + trainer.accelerator.process_index)
    generated = trainer.generate(batch(group, 0)[0], do_sample=True, max_new_tokens=6, batch_size=2)
    engine.generate = engine_generate
    generations = [[r.tolist() for r in generated]]
    generated_queries = [generated_queries]
    if trainer.accelerator.num_processes > 1:
        generations = [None] * trainer.accelerator.num_processes
        dist.all_gather_object(generations, [r.tolist() for r in generated])
        mine, generated_queries = generated_queries[0], [None] * trainer.accelerator.num_processes
        dist.all_gather_object(generated_queries, mine)
    # The group's first process draws the mini-batch order of the 1-process run; the others' generators are their
    # own (as accelerate's set_seed(device_specific=True) or a sampler of their own leaves them): the group must
    # train in its first process's order.
    torch.manual_seed(0)
    if trainer.accelerator.process_index % sp_size:
        torch.rand(trainer.accelerator.process_index)

    # Truncated sampling: a step on the group's generated rows, replaying the kept sets its processes recorded while
    # sampling (gathered with the responses); the reference steps the same rows over the same sets, passed explicitly.
    replay = None
    if args.replay or args.replay_from:
        queries, scores = batch(group, 0)[0], [torch.tensor(float(i)) for i in range(4)]
        if args.replay_from:
            source = torch.load(args.replay_from, weights_only=False)["replay"]
            rows = [torch.tensor(r) for r in source["responses"]]
            kept = [KeptSets(torch.tensor(o), torch.tensor(i, dtype=torch.int32), len(o) - 1) for o, i in source["kept"]]
        else:
            rows = [row[len(query) :] for query, row in zip(queries, generated)]  # generate() returned the prompts
            kept = trainer.generation.records.take(queries, rows)
        assert kept is not None and all(k is not None for k in kept)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            replayed = trainer.step(queries, rows, scores, kept_sets=kept)
        kept_lists = [(k.offsets.tolist(), k.ids.tolist()) for k in kept]
        every = [kept_lists]
        if trainer.accelerator.num_processes > 1:
            every = [None] * trainer.accelerator.num_processes
            dist.all_gather_object(every, kept_lists)
        replay = {"responses": [r.tolist() for r in rows], "kept": kept_lists, "same_on_every_process": all(
                  e == kept_lists for e in every), "rederived": any("re-derived" in str(w.message) for w in caught),
                  "stats": {k: v for k, v in replayed.items() if not k.startswith("time/")}}  # fmt: skip

    # The trailing shape of every piece the group gathers (trl_lite's gathers of per-slot and per-token results).
    gathered_shapes = set()
    gather = sequence_parallel._GatherPieces.apply
    sequence_parallel._GatherPieces.apply = lambda piece, *rest: gathered_shapes.add(tuple(piece.shape[1:])) or gather(
        piece, *rest
    )
    seen = []
    embedding = trainer.forward.unwrapped(trainer.model).pretrained_model.get_input_embeddings()
    embedding.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape[1]))
    stats = []
    for step in range(2):
        queries, responses, scores, masks = batch(group, step)
        if args.different_rows and trainer.accelerator.process_index % sp_size:
            scores = [score + 1 for score in scores]  # a mistake the group must refuse: its members' rows differ
        ptx = [torch.cat((q, r)) for q, r in zip(queries, responses)] if args.ptx else None
        stats.append(trainer.step(queries, responses, scores, response_masks=masks, ptx_inputs=ptx))

    # A padded pass after the cut ones: greedy generation of fewer queries than processes (each process generates
    # them all, with a padding mask).
    greedy = None
    if args.padded_pass:
        greedy = [r.tolist() for r in trainer.generate(batch(group, 0)[0][::2], max_new_tokens=3, batch_size=2,
                                                        do_sample=False)]
    named = full_named_parameters(trainer)
    if args.critic:
        critic_model = trainer.accelerator.unwrap_model(trainer.critic).pretrained_model
        named.update({f"critic.{k}": v for k, v in full_named_parameters(trainer, critic_model).items()})
    if trainer.accelerator.process_index == 0:
        result = {
            "sp_size": sp_size,
            "num_processes": trainer.accelerator.num_processes,
            "named_parameters": named,
            "stats": [{k: v for k, v in s.items() if not k.startswith("time/")} for s in stats],
            "longest_slice": max(seen),
            "tokens_seen": sum(seen),
            "generations": generations,
            "generated_queries": generated_queries,
            "gathered_shapes": sorted(gathered_shapes),
            "greedy": greedy,
            "replay": replay,
        }
        torch.save(result, os.path.join(args.output_dir, "result.pt"))
    if trainer.accelerator.num_processes > 1:
        finish(trainer)


if __name__ == "__main__":
    main()
