"""The rows of `gpu_check.py` that start processes: ``suite`` (pytest), ``vllm-sleep``, ``deepspeed`` and ``fsdp2`` (workers
of `gpu_check.py --worker`), ``demo`` (examples/scripts/ppo_sentiment.py) and ``bench-step``, ``bench-loop``
(the benchmarks)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from gpu_check_common import REPO_ROOT, make_batch, make_trainer, run_process, worker_result

# The workers are this command line's hidden ``--worker`` path (`gpu_check.main`).
GPU_CHECK = str(Path(__file__).resolve().with_name("gpu_check.py"))
# Seconds per PPO step of the demo to reach: the same demo on 2 CPU cores (2026-11-26).
DEMO_TARGET_S = 0.36
DEMO_STEPS = 10
# DeepSpeed's bf16 step against the plain bf16 step: statistics within DEEPSPEED_STATS_RTOL (relative) plus
# DEEPSPEED_STATS_ATOL, and the two weight updates pointing the same way (cosine) and of the same size.
# bf16 keeps 8 bits of mantissa (relative rounding 2**-8 = 0.4%); ZeRO also holds the module's weights in
# bf16 where plain AMP keeps them in fp32, so the two steps differ by more than one rounding.
DEEPSPEED_STATS = ("ppo/loss/policy", "ppo/loss/value", "ppo/loss/total", "objective/entropy", "ppo/policy/approxkl")
DEEPSPEED_STATS_RTOL, DEEPSPEED_STATS_ATOL = 5e-2, 1e-2
DEEPSPEED_MIN_COSINE, DEEPSPEED_NORM_RTOL = 0.9, 0.2
DEEPSPEED_LEARNING_RATE = 1e-3  # an update well above bf16's rounding of the weights


def pytest_summary(output: str) -> str:
    """The counts of pytest's last summary line (``'3 failed, 510 passed'``), or ``'no summary'``."""
    counts = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", output)
    return ", ".join(f"{n} {what}" for n, what in counts) if counts else "no summary"


def check_suite(args) -> tuple[str, str]:
    command = [sys.executable, "-m", "pytest", "-q", "-m", "not cpu_only", "tests", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(max(1, min(12, (os.cpu_count() or 2) - 2))), "--dist", "loadgroup"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command += ["--timeout", "120"]
    command += shlex.split(args.suite_args)
    log, limit = args.output_dir / "suite.log", args.time_left()
    result = run_process(command, log, limit)
    if result is None:
        return "FAIL", f"cut after {limit:.0f} s (the time left): {pytest_summary(log.read_text())} (log: {log})"
    return ("PASS" if result.returncode == 0 else "FAIL"), f"{pytest_summary(result.stdout)} (log: {log})"


class MemorySampler(threading.Thread):
    """The most GPU memory in use (``total - free`` of ``torch.cuda.mem_get_info``, every 5 ms) while running."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = 0
        self._done = threading.Event()

    def run(self):
        while not self._done.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(0.005)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def vllm_worker(sleep: bool) -> dict:
    """One colocated engine with sleep mode ``sleep``: memory in use during ``step()``, and the largest
    difference between the engine's log-probs of its sampled tokens and the trained policy's, after a step."""
    in_use_before = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    trainer = make_trainer("no", sleep=sleep, use_vllm=True, vllm_dtype="float32", vllm_max_model_len=128)
    queries, _, scores = make_batch()
    responses = trainer.generate(queries, return_prompt=False, max_new_tokens=24, do_sample=True)
    sampler = MemorySampler()
    sampler.start()
    trainer.step(queries, [r if len(r) else torch.tensor([0]) for r in responses], scores)
    peak = sampler.stop()
    rows, logprobs = trainer.generate(
        queries, return_prompt=True, max_new_tokens=24, do_sample=True, return_logprobs=True
    )
    lm = trainer.accelerator.unwrap_model(trainer.model).pretrained_model.eval()
    worst = 0.0
    with torch.no_grad():
        for query, row, engine_logprobs in zip(queries, rows, logprobs):
            logits = lm(input_ids=row[None].to(lm.device)).logits[0].double().log_softmax(-1)
            response = row[len(query) :].to(lm.device)
            policy = logits[len(query) - 1 : len(row) - 1].gather(1, response[:, None])[:, 0]
            worst = max(worst, float((policy - engine_logprobs.to(lm.device).double()).abs().max()))
    total = torch.cuda.mem_get_info()[1]
    return {"peak_during_step": peak, "total": total, "worst_logprob_error": worst, "in_use_before": in_use_before,
            "utilization": trainer.config.vllm_gpu_memory_utilization}  # fmt: skip


def check_vllm_sleep(args) -> tuple[str, str]:
    results = {}
    for sleep in (True, False) if args.full else (True,):
        command = [sys.executable, GPU_CHECK, "--worker", "vllm-sleep-on" if sleep else "vllm-sleep-off"]
        log = args.output_dir / f"vllm_sleep_{'on' if sleep else 'off'}.log"
        results[sleep] = worker_result(run_process(command, log, args.time_left()))
        if results[sleep] is None:
            return "FAIL", f"the engine with sleep={sleep} failed or ran out of time (log: {log})"
    on, gib = results[True], 2**30
    share = on["utilization"] * on["total"]
    error = max(r["worst_logprob_error"] for r in results.values())
    if False in results:
        off = results[False]
        freed = off["peak_during_step"] - on["peak_during_step"]
        compared = f"{off['peak_during_step'] / gib:.1f} GiB without sleep mode"
    else:  # the default run: the engine's share against what the trainer alone had in use before it was built
        freed = share - (on["peak_during_step"] - on["in_use_before"])
        compared = f"{on['in_use_before'] / gib:.1f} GiB before the trainer was built"
    status = "PASS" if freed >= 0.5 * share and error < 1e-3 else "FAIL"
    return status, (
        f"GPU memory in use during step(): {on['peak_during_step'] / gib:.1f} GiB asleep, {compared} "
        f"(engine share {share / gib:.1f} GiB); engine log-probs vs policy after a step: max error {error:.1e}"
    )


# ----------------------------------------------------------------------------------------------
# deepspeed: one bf16 step under ZeRO-2 and ZeRO-3 (one process each) against the plain bf16 step.
# ----------------------------------------------------------------------------------------------
def _full_weights(trainer) -> dict[str, torch.Tensor]:
    """The policy's weights (and value head) as float32 CPU tensors; under ZeRO-3 gathered first."""
    from trl_lite.parallel.fsdp import is_sharded, unsharded

    model = trainer.accelerator.unwrap_model(trainer.model)
    gathered = None
    if trainer.accelerator.distributed_type.name == "DEEPSPEED":
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(model.parameters()))  # a no-op below ZeRO-3
    elif is_sharded(model):
        gathered = unsharded(model)  # FSDP2 (accelerate's): the DTensor shards gathered whole
    with gathered if gathered is not None else torch.no_grad():
        return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def step_worker(weights_path: Path) -> dict:
    """One bf16 step on the checks' batch: the compared statistics, and the weights before and after
    (written to ``weights_path``). Plain or DeepSpeed, as the launcher set up accelerate."""
    trainer = make_trainer("bf16", learning_rate=DEEPSPEED_LEARNING_RATE, max_grad_norm=1.0)
    before = _full_weights(trainer)
    stats = trainer.step(*make_batch())
    torch.save({"before": before, "after": _full_weights(trainer)}, weights_path)
    return {"stats": {key: float(stats[key]) for key in DEEPSPEED_STATS},
            "distributed_type": trainer.accelerator.distributed_type.name}  # fmt: skip


def update_agreement(plain: dict, other: dict) -> tuple[float, float]:
    """``(cosine, norm ratio)`` of two steps' weight updates (``after - before`` over every tensor at once),
    from dicts ``{"before": {name: tensor}, "after": {name: tensor}}`` with the same names."""
    names = sorted(plain["after"])
    plain_update = torch.cat([(plain["after"][n] - plain["before"][n]).double().flatten() for n in names])
    other_update = torch.cat([(other["after"][n] - other["before"][n]).double().flatten() for n in names])
    cosine = float(torch.nn.functional.cosine_similarity(plain_update, other_update, dim=0))
    return cosine, float(other_update.norm() / plain_update.norm().clamp(min=1e-30))


def compare_steps(plain_stats: dict, stats: dict, cosine: float, norm_ratio: float) -> list[str]:
    """What differs beyond bf16 tolerance between a step and the plain step (empty when they agree)."""
    problems = [
        f"{key} {stats[key]:.4g} vs {plain_stats[key]:.4g}"
        for key in DEEPSPEED_STATS
        if not abs(stats[key] - plain_stats[key]) <= DEEPSPEED_STATS_ATOL + DEEPSPEED_STATS_RTOL * abs(plain_stats[key])
    ]
    if not cosine >= DEEPSPEED_MIN_COSINE:
        problems.append(f"update cosine {cosine:.3f} < {DEEPSPEED_MIN_COSINE}")
    if not abs(norm_ratio - 1) <= DEEPSPEED_NORM_RTOL:
        problems.append(f"update norm ratio {norm_ratio:.3f}")
    return problems


def check_deepspeed(args) -> tuple[str, str]:
    return check_launched_steps(args, ("deepspeed_zero2",) * args.full + ("deepspeed_zero3",), "DEEPSPEED")


def check_fsdp2(args) -> tuple[str, str]:
    """accelerate's own FSDP2 (accelerate_configs/fsdp2.yaml, one process, bf16): one step = the plain step."""
    return check_launched_steps(args, ("fsdp2",), "FSDP")


def check_launched_steps(args, configs: tuple[str, ...], distributed_type: str) -> tuple[str, str]:
    """The bf16 step under each accelerate config of ``configs`` (one process) against the plain step (run once per
    output directory: a later row reads the plain step an earlier one wrote)."""
    runs = {}
    for name in ("plain", *configs):
        weights = args.output_dir / f"step_{name}.pt"
        if name == "plain" and (args.output_dir / "step_plain.json").exists() and weights.exists():
            runs[name] = (json.loads((args.output_dir / "step_plain.json").read_text()), torch.load(weights))
            continue
        command = [sys.executable, GPU_CHECK, "--worker", "step", "--worker-output", str(weights)]
        if name != "plain":
            launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                        "--config_file", str(REPO_ROOT / "accelerate_configs" / f"{name}.yaml"),
                        "--mixed_precision", "bf16"]  # fmt: skip
            command = launcher + command[1:]
        log = args.output_dir / f"step_{name}.log"
        result = worker_result(run_process(command, log, args.time_left()))
        if result is None:
            return "FAIL", f"the {name} step failed or ran out of time (log: {log})"
        if name != "plain" and result["distributed_type"] != distributed_type:
            return "FAIL", f"the {name} run was not under {distributed_type} ({result['distributed_type']}; log: {log})"
        runs[name] = (result["stats"], torch.load(weights))
        if name == "plain":
            (args.output_dir / "step_plain.json").write_text(json.dumps(result["stats"]))
    plain_stats, plain_weights = runs.pop("plain")
    details, failed = [], False
    for name, (stats, weights) in runs.items():
        cosine, ratio = update_agreement(plain_weights, weights)
        problems = compare_steps(plain_stats, stats, cosine, ratio)
        failed |= bool(problems)
        summary = f"loss/total {stats['ppo/loss/total']:.4f} (plain {plain_stats['ppo/loss/total']:.4f}), "
        summary += f"update cosine {cosine:.3f}, norm ratio {ratio:.3f}"
        details.append(f"{name.removeprefix('deepspeed_')}: {summary}" + (f"; {'; '.join(problems)}" if problems else ""))
    return ("FAIL" if failed else "PASS"), "; ".join(details)


# ----------------------------------------------------------------------------------------------
# demo, benchmarks
# ----------------------------------------------------------------------------------------------
def demo_seconds_per_step(records: list[dict], warmup: int = 2) -> float:
    """Median seconds per PPO step of the demo's ``metrics.jsonl`` records after ``warmup`` steps:
    ``time/ppo/total`` (the step) plus every timed rollout phase (``time/rollout/*``: generation, ...)."""
    seconds = [
        record["time/ppo/total"] + sum(v for k, v in record.items() if k.startswith("time/rollout/"))
        for record in records[warmup:]
    ]
    if not seconds:
        raise ValueError(f"the demo wrote {len(records)} steps, more than warmup={warmup} are needed")
    return statistics.median(seconds)


def check_demo(args) -> tuple[str, str]:
    output = args.output_dir / "demo"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
               "--config_file", str(REPO_ROOT / "accelerate_configs" / "single_gpu.yaml"), "--mixed_precision", "bf16",
               "examples/scripts/ppo_sentiment.py", "--steps", str(DEMO_STEPS), "--output_dir", str(output),
               "--disable_dropout", "True"]  # fmt: skip
    log = args.output_dir / "demo.log"
    result = run_process(command, log, args.time_left())
    metrics = output / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if result is None or result.returncode != 0 or len(records) < DEMO_STEPS:
        return "FAIL", f"the demo failed or ran out of time after {len(records)} steps (log: {log})"
    seconds = demo_seconds_per_step(records)
    rewards = [round(r["env/reward_mean"], 2) for r in records if "env/reward_mean" in r]
    status = "PASS" if seconds < DEMO_TARGET_S else "FAIL"
    return status, (
        f"{seconds:.3f} s per PPO step (target < {DEMO_TARGET_S}); reward mean first/last 3 steps "
        f"{rewards[:3]} / {rewards[-3:]} (metrics: {metrics})"
    )


def _bench(script: str, extra: list[str], args) -> tuple[str, str]:
    output = args.output_dir / f"{Path(script).stem}.md"
    command = [sys.executable, script, "--device", "cuda", *extra, "--output", str(output)]
    log = args.output_dir / f"{Path(script).stem}.log"
    result = run_process(command, log, args.time_left())
    if result is None or result.returncode != 0:
        code = "ran out of time" if result is None else f"exited {result.returncode}"
        return "FAIL", f"{' '.join(command[1:])} {code} (log: {log})"
    return "PASS", f"{' '.join(command[1:])}: table in {output}"


def bench_step_args(full: bool) -> list[str]:
    return ["--workloads", "w1", "w2", "w3", "--steps", "5", "--warmup", "2"] if full else [
        "--workloads", "w1", "--steps", "1", "--warmup", "1"]  # fmt: skip


def bench_loop_args(full: bool) -> list[str]:
    return ["--iterations", "3", "--warmup", "1"] if full else ["--iterations", "1", "--warmup", "1"]
