"""`bench_loop.py --async`: loop throughput with `AsyncRollouts` for several `max_staleness`, one vLLM server.

The server runs on core 1 (`taskset -c 1 python -m trl_lite.vllm_server ...`), this process - the
trainer, and the producer thread, which mostly waits on HTTP - on core 0, with one torch thread in
each: generation and training then run on separate devices, as with a server on a GPU of its own.

For each `max_staleness` a fresh trainer from the same seed (server mode, its weights pushed at start)
runs `warmup + iterations` steps on the same batches: the loop's queries, responses of exactly the
workload's length (`min_new_tokens = max_new_tokens`, sampled with the classic settings), the engine's
log-probs, and `bench_loop`'s reward. `max_staleness=0` is the synchronous loop; rounds take the
settings in rotated order, so that each sees the same machine load on average. Throughput is timed
iterations over the wall-clock time from the end of the last warm-up step to the end of the last step.
"""

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import requests
import torch

from loop_workloads import SAMPLING, LoopWorkload, TrlLoop, reward_fn, sample_queries

SERVER_START_LIMIT_S = 900  # a fresh server on one busy core


@contextlib.contextmanager
def pinned_server(loop: LoopWorkload, core: int, dtype: torch.dtype):
    """A vLLM server for the loop's model, in its own session, pinned to ``core``; yields its URL."""
    import step_workloads

    with tempfile.TemporaryDirectory(prefix="bench_async_") as model_dir:
        step_workloads.make_lm(loop.model, "cpu", dtype).save_pretrained(model_dir)
        max_len = loop.model.query_len[1] + loop.new_tokens[1] + 8
        with served(model_dir, max_len, core) as url:
            yield url


@contextlib.contextmanager
def served(model_dir: str, max_len: int, core: int | None = None, launcher_args: tuple[str, ...] = ()):
    """``python -m trl_lite.vllm_server`` on ``model_dir`` (with ``launcher_args``) in its own session,
    pinned to ``core`` with one thread (None: unpinned); yields its URL once it answers, stops it after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "trl_lite.vllm_server", "--model", model_dir, "--port", str(port),
               "--kv-cache-gb", "1", *launcher_args, "--", "--max-model-len", str(max_len)]  # fmt: skip
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
        env["OMP_NUM_THREADS"] = "1"
    with open(os.path.join(model_dir, "server.log"), "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + SERVER_START_LIMIT_S
            while True:
                if process.poll() is not None:
                    log.flush()
                    with open(log.name) as written:
                        tail = written.read()[-3000:]
                    raise RuntimeError(f"the vLLM server exited with {process.returncode}:\n{tail}")
                with contextlib.suppress(requests.RequestException):
                    if requests.get(f"{url}/health", timeout=2).ok:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the vLLM server did not come up in {SERVER_START_LIMIT_S} s")
                time.sleep(1)
            yield url
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def run_one(loop: LoopWorkload, url: str, max_staleness: int, iterations: int, warmup: int, dtype) -> dict:
    """One run: per timed iteration its phase times, and the run's throughput (iterations per second)."""
    from trl_lite.rollouts import AsyncRollouts

    trainer = TrlLoop(loop, "cpu", dtype, backend="vllm", vllm_mode="server", vllm_server_url=url,
                      vllm_server_timeout=600).trainer  # fmt: skip
    k, tokens = loop.samples_per_query, sum(loop.new_tokens) // 2
    settings = dict(SAMPLING, max_new_tokens=tokens, min_new_tokens=tokens)
    if k > 1:
        settings["num_return_sequences"] = k

    def rollout_fn(queries, generate):
        asked = queries[::k]
        responses, logprobs = generate(asked, return_prompt=False, return_logprobs=True, **settings)
        with generate.timed("rollout/reward"):
            scores = reward_fn(responses)
        rows = [query for query in asked for _ in range(k)]
        return {"queries": rows, "responses": responses, "scores": scores, "generation_logprobs": logprobs}

    data = [sample_queries(loop.model, i) for i in range(warmup + iterations)]
    phases = []
    try:
        with AsyncRollouts(trainer, data, rollout_fn, max_staleness=max_staleness) as rollouts:
            start = time.perf_counter()
            for i, batch in enumerate(rollouts):
                t = time.perf_counter()
                stats = trainer.step(**batch)
                end = time.perf_counter()
                if i == warmup - 1:
                    start = end
                if i >= warmup:
                    phases.append({
                        "step": end - t, "wait": stats["time/rollout/wait"],
                        "generate": stats.get("time/rollout/generate", 0.0),
                        "weight push": stats.get("time/rollout/weight_sync", 0.0),
                        "snapshot": stats.get("time/rollout/weight_snapshot", 0.0),
                        "producer idle": stats.get("time/rollout/producer_idle", 0.0),
                        "staleness": stats["rollout/staleness/mean"],
                    })  # fmt: skip
    finally:
        trainer.generation.close()
    return {"throughput": iterations / (end - start), "phases": phases}


PHASES = ("step", "wait", "generate", "weight push", "snapshot", "producer idle", "staleness")


def pin_trainer(core: int = 0) -> None:
    """This process (the trainer, the producer thread) on ``core`` alone, with one torch thread."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


def run(loop: LoopWorkload, staleness: list[int], iterations: int, warmup: int, rounds: int,
        dtype: torch.dtype) -> dict:  # fmt: skip
    """Every ``max_staleness`` in ``staleness``, ``rounds`` times in rotated order, on a server pinned to core 1
    (call :func:`pin_trainer` first)."""
    results = {s: [] for s in staleness}
    with pinned_server(loop, core=1, dtype=dtype) as url:
        for r in range(rounds):
            for s in staleness[r % len(staleness) :] + staleness[: r % len(staleness)]:
                result = run_one(loop, url, s, iterations, warmup, dtype)
                print(f"round {r} max_staleness {s}: {result['throughput']:.3f} iterations/s", flush=True)
                results[s].append(result)
    return results


def format_table(loop_name: str, results: dict) -> str:
    """Median throughput over rounds (and x that of max_staleness 0), median seconds per phase."""
    base = statistics.median(r["throughput"] for r in results[min(results)])
    lines = [
        "| loop | max_staleness | iterations/s | x synchronous | s/iteration | "
        + " | ".join(f"{p} s" if p != "staleness" else p for p in PHASES) + " |",
        "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in PHASES) + " |",
    ]
    for s, runs in results.items():
        throughput = statistics.median(r["throughput"] for r in runs)
        phases = [p for r in runs for p in r["phases"]]
        cells = [loop_name, str(s), f"{throughput:.3f}", f"{throughput / base:.2f}", f"{1 / throughput:.3f}"]
        cells += [f"{statistics.median(p[name] for p in phases):.3f}" for name in PHASES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
