"""One colocated vLLM engine split over two training processes (vllm_tensor_parallel_size=2, vLLM's
external launcher, on this CPU): each process holds one shard, the two answer the union of their
prompts (3 and 1 queries) and each gets back its own rows, and the weight push reaches both shards -
the rows equal greedy decoding in float64 transformers of the weights before and after a step."""

from pathlib import Path

import pytest
import torch
from test_distributed import REPO, base_model_dir, deepspeed_cpu_collectives, launch  # noqa: F401  (fixtures)
from test_distributed_vllm import greedy  # 6 new tokens, stopped after EOS
from transformers import GPT2LMHeadModel

# Two processes on one machine: two devices, which a one-GPU machine lacks.
pytestmark = [pytest.mark.xdist_group("distributed"), pytest.mark.cpu_only]

SCRIPT = REPO / "tests" / "distributed" / "vllm_tensor_parallel.py"
# vLLM-CPU names the shared memory of a tensor-parallel group after the group alone (the same name in
# every external-launcher run) and leaves it behind when the processes end; one left by an earlier run
# makes the next fail ("create shm in SHMManager failed. errno: 17"). GPUs use NCCL instead.
SHARED_MEMORY = [Path("/dev/shm") / f"-tp:0-[0-1]-cpushm_{rank}" for rank in (0, 1)]


@pytest.fixture
def fresh_shared_memory():
    for path in SHARED_MEMORY:
        path.unlink(missing_ok=True)
    yield
    for path in SHARED_MEMORY:
        path.unlink(missing_ok=True)


def test_a_tensor_parallel_engine_answers_each_process_and_takes_the_pushed_weights(base_model_dir, tmp_path,
                                                                                   fresh_shared_memory):
    launch("deepspeed_zero2", SCRIPT, "--base_model", str(base_model_dir), "--output_dir", str(tmp_path))
    report = torch.load(tmp_path / "report.pt")
    initial = GPT2LMHeadModel.from_pretrained(base_model_dir).double().eval()
    trained = GPT2LMHeadModel.from_pretrained(base_model_dir).double().eval()
    missing, unexpected = trained.load_state_dict(report["state"], strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    processes = report["processes"]
    assert [p["shard"] for p in processes] == [(0, 2), (1, 2)]  # one engine, half on each process
    assert [len(p["queries"]) for p in processes] == [3, 1]
    for process in processes:
        assert process["before"] == [greedy(initial, q) for q in process["queries"]]
        assert process["after"] == [greedy(trained, q) for q in process["queries"]]
    assert any(p["before"] != p["after"] for p in processes)  # the step changed what greedy decoding says
