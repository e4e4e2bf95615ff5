"""Per-process memory of the sharded models and the time of a PPO step: 1 process against FSDP2 and DeepSpeed ZeRO-3
on 2 processes, on the CPU (docs/scale_out.md).

The workload: a GPT-2 shape (``--layers`` layers, ``--width`` wide, ``--heads`` heads, a ``--vocab``-token vocabulary,
random weights, fp32) with a value head and a created reference model; one global batch of 8 rows (``--query`` +
``--response`` tokens), split over the processes, one mini-batch per process, 1 PPO epoch, Adam. Each run takes
``--steps`` steps on the same batch after one warm-up step; the time is their mean.

Memory, per process, from the tensors' own storage (each storage counted once): the policy's parameters, its
gradients (read in the optimizer's step pre-hook, where they are whole), its optimizer state (after the step), and
the reference's parameters. Under FSDP2 a parameter's storage is this process's shard (``DTensor.to_local()``); under
ZeRO-3 it is DeepSpeed's partition (``param.ds_tensor``), and the optimizer state is that of DeepSpeed's fp32
partitions (its gradient partitions live in DeepSpeed's flat buffers: not counted, "-"). The 1-process run uses
``--threads`` torch threads; each of the 2 processes gets half.

Usage:
    python benchmarks/bench_fsdp.py [--layers 4] [--width 256] [--heads 4] [--vocab 2048] [--steps 2]
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULT_MARKER = "BENCH_RESULT "
RUNS = (("1 process", "single_gpu", 1), ("FSDP2", "fsdp2", 2), ("ZeRO-3", "deepspeed_zero3", 2))


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _param_bytes(model) -> int:
    return _storage_bytes(getattr(p, "ds_tensor", p) for p in model.parameters())


def _optimizer_state_bytes(optimizer) -> int:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    inner = getattr(inner, "optimizer", inner)  # DeepSpeed's ZeRO optimizer: the torch optimizer of its partitions
    return _storage_bytes(v for state in inner.state.values() for v in state.values() if torch.is_tensor(v))


def worker(args) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, set_seed

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, args.threads // world))
    per_process = 8 // world
    set_seed(0)
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.query + args.response + 8, n_embd=args.width,
                        n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = AutoModelForCausalLMWithValueHead.from_pretrained(GPT2LMHeadModel(config))
    ppo = PPOConfig(batch_size=per_process, mini_batch_size=per_process, ppo_epochs=1, learning_rate=1e-5, seed=0)
    trainer = PPOTrainer(ppo, model)
    g = torch.Generator().manual_seed(rank)
    queries = [torch.randint(3, args.vocab, (args.query,), generator=g) for _ in range(per_process)]
    responses = [torch.randint(3, args.vocab, (args.response,), generator=g) for _ in range(per_process)]
    scores = [torch.randn((), generator=g) for _ in range(per_process)]
    grads = {}
    policy = trainer.accelerator.unwrap_model(trainer.model)
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if not hasattr(inner, "optimizer"):  # not DeepSpeed: the torch optimizer holds the gradients at its step
        inner.register_step_pre_hook(
            lambda *_: grads.update(bytes=_storage_bytes(p.grad for p in policy.parameters()))
        )
    trainer.step(queries, responses, scores)  # warm-up
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.step(queries, responses, scores)
    seconds = (time.perf_counter() - start) / args.steps
    reference = trainer.ref_model.module if hasattr(trainer.ref_model, "module") else trainer.ref_model
    result = {"rank": rank, "step_s": seconds, "params": _param_bytes(policy), "grads": grads.get("bytes"),
              "optimizer": _optimizer_state_bytes(trainer.optimizer), "reference": _param_bytes(reference)}  # fmt: skip
    print(RESULT_MARKER + json.dumps(result), flush=True)
    trainer.accelerator.end_training()  # the trainer's exit handler then lets gloo's workers finish (docs/scale_out.md)


def launch(config: str, processes: int, argv: list[str]) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO_ROOT / "accelerate_configs" / f"{config}.yaml"), "--num_processes", str(processes),
           "--main_process_port", str(port), __file__, "--worker", *argv]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{out.stderr[-4000:]}")
    # The processes share one stdout: their lines may run into each other.
    found = re.findall(RESULT_MARKER + r"(\{[^}]*\})", out.stdout)
    return sorted((json.loads(text) for text in found), key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--query", type=int, default=32)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    argv = [a for a in sys.argv[1:] if a != "--worker"]
    print("| run | process | policy params (MB) | grads (MB) | optimizer state (MB) | reference params (MB) | "
          "params+grads+optimizer / 1 process | step (s) |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = None
    for name, config, processes in RUNS:
        for r in launch(config, processes, argv):
            total = r["params"] + (r["grads"] or 0) + r["optimizer"]
            base = total if base is None else base
            known = r["grads"] is not None
            grads, ratio = (f"{r['grads'] / 1e6:.2f}", f"{total / base:.3f}") if known else ("-", "-")
            print(f"| {name} | {r['rank']} | {r['params'] / 1e6:.2f} | {grads} | {r['optimizer'] / 1e6:.2f} | "
                  f"{r['reference'] / 1e6:.2f} | {ratio} | {r['step_s']:.2f} |")  # fmt: skip
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
