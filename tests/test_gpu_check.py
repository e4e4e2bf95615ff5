"""scripts/gpu_check.py (`make gpu-check`) on a machine without a GPU: it refuses in one line with
exit status 2, and the parts of its checks that need no GPU are right - the dtype of the LM head's
matrix products as they reach the kernels, the sync warnings by source line and their budget, pytest's
summary, the arguments, ``--list``, the rows skipped for a missing package or a spent time budget, the
table printed row by row, the demo's seconds per step, the comparison of a DeepSpeed step with the plain
one, the processes a cut row leaves. And tests/conftest.py's rule for tests that need vLLM or nbformat on
a GPU machine without them."""

import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))  # gpu_check.py and its modules import each other by name
import gpu_check_common  # noqa: E402
import gpu_check_kernels  # noqa: E402
import gpu_check_processes  # noqa: E402

_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_without_a_gpu_it_refuses_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine that has one
    result = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check needs a CUDA GPU")
    assert "torch.cuda.is_available() is False" in lines[0]


def test_the_lm_head_products_are_seen_with_the_dtypes_the_kernels_get():
    torch.manual_seed(0)
    head, other = torch.nn.Linear(16, 101), torch.nn.Linear(16, 16)
    hidden = torch.randn(6, 16, requires_grad=True)
    with gpu_check_kernels.MatmulDtypes(101) as autocast_products:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head(other(hidden))
        logits.float().logsumexp(-1).sum().backward()
    # Forward addmm, then the two backward products of the head (input and weight gradients);
    # the 16 x 16 layer has no dimension of 101 and is not counted.
    assert [op for op, _ in autocast_products.seen] == ["addmm", "mm", "mm"]
    assert all(set(dtypes) == {"bfloat16"} for _, dtypes in autocast_products.seen)
    with gpu_check_kernels.MatmulDtypes(101) as plain_products:
        head(hidden).sum().backward()
    assert len(plain_products.seen) == 3 and all(set(d) == {"float32"} for _, d in plain_products.seen)


def test_sync_warnings_are_counted_by_source_line_and_other_warnings_left_out():
    def record(message, path, line):
        return warnings.WarningMessage(UserWarning(message), UserWarning, str(REPO / path), line)

    records = [
        record("called a synchronizing CUDA operation", "trl_lite/trainer/step/learner.py", 40),
        record("called a synchronizing CUDA operation", "trl_lite/trainer/step/learner.py", 40),
        record("Called a synchronizing CUDA operation", "trl_lite/core/stats.py", 7),
        record("PPOTrainer got no dataset", "trl_lite/trainer/ppo_trainer.py", 1),
    ]
    assert gpu_check_kernels.sync_sites(records) == {"trl_lite/trainer/step/learner.py:40": 2, "trl_lite/core/stats.py:7": 1}


def test_the_summary_and_the_table():
    output = "....F.\n=== 1 failed, 512 passed, 3 deselected in 301.2s ===\n"
    assert gpu_check_processes.pytest_summary(output) == "1 failed, 512 passed, 3 deselected"
    assert gpu_check_processes.pytest_summary("ImportError") == "no summary"
    table = gpu_check.format_table([("syncs", "INFO", "a|b"), ("suite", "PASS", "513 passed")])
    assert table.splitlines() == [
        "| check | result | detail |", "|---|---|---|", "| syncs | INFO | a/b |", "| suite | PASS | 513 passed |",
    ]  # fmt: skip


def test_the_row_is_printed_as_soon_as_its_check_ends(monkeypatch, capsys, tmp_path):
    """With a GPU pretended: each row's line is out before the next check starts; a row whose package
    is missing is skipped with the reason, a crashing check is a failed row, and the exit status is 1."""
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None if name == "deepspeed" else True)
    printed_before = {}

    def check(name, result):
        def run(args):
            printed_before[name] = capsys.readouterr().out
            if result is None:
                raise RuntimeError("boom")
            return result, f"{name} detail"

        return run

    monkeypatch.setattr(gpu_check, "CHECK_FUNCTIONS", {
        "device": check("device", "INFO"), "syncs": check("syncs", "PASS"), "demo": check("demo", None),
        "deepspeed": check("deepspeed", "PASS"),
    })  # fmt: skip
    code = gpu_check.main(["--only", "device", "syncs", "deepspeed", "demo", "--output-dir", str(tmp_path)])
    rest = capsys.readouterr().out
    assert code == 1
    assert printed_before["device"].splitlines() == gpu_check.TABLE_HEADER.splitlines()
    assert printed_before["syncs"].startswith("| device | INFO | device detail (0 s) |")
    assert "deepspeed" not in printed_before  # skipped: never called
    assert "| deepspeed | SKIP | needs deepspeed, not installed in " in printed_before["demo"]
    assert rest.startswith("| demo | FAIL | RuntimeError: boom (0 s) |")
    assert "RuntimeError: boom" in (tmp_path / "demo.traceback").read_text()
    table = (tmp_path / "gpu_check.md").read_text().splitlines()
    assert [line.split(" | ")[:2] for line in table[2:]] == [
        ["| device", "INFO"], ["| syncs", "PASS"], ["| deepspeed", "SKIP"], ["| demo", "FAIL"],
    ]  # fmt: skip


def test_the_worker_rows_start_gpu_check_py_itself(monkeypatch, tmp_path):
    """The vllm-sleep and deepspeed rows live in gpu_check_processes.py but start their workers as
    ``gpu_check.py --worker ...``: the one script whose command line answers ``--worker``."""
    commands = []
    monkeypatch.setattr(gpu_check_processes, "run_process", lambda command, log, timeout: commands.append(command))
    args = gpu_check.parse_args(["--full", "--output-dir", str(tmp_path)])
    args.time_left = lambda: 60.0
    assert gpu_check_processes.check_vllm_sleep(args)[0] == "FAIL"  # no worker answered
    assert gpu_check_processes.check_deepspeed(args)[0] == "FAIL"
    assert [command[1] for command in commands] == [str(SCRIPT)] * 2
    assert [gpu_check.parse_args(command[2:]).worker for command in commands] == ["vllm-sleep-on", "step"]


def test_rows_are_skipped_once_the_time_budget_is_spent(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    calls = []

    def slow(args):
        calls.append(args.time_left())
        time.sleep(0.3)
        return "PASS", "ran"

    monkeypatch.setattr(gpu_check, "MIN_ROW_SECONDS", 1.0)
    monkeypatch.setattr(gpu_check, "CHECK_FUNCTIONS", {"device": slow, "syncs": slow})
    code = gpu_check.main(["--only", "device", "syncs", "--budget", "1.2", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and len(calls) == 1 and 1.0 < calls[0] <= 1.2
    assert "| syncs | SKIP | the time budget of 1 s is spent" in out


def test_arguments_and_the_budget():
    assert gpu_check.parse_args([]).budget == 360 and gpu_check.parse_args([]).full is False
    assert gpu_check.parse_args(["--full"]).budget is None
    assert gpu_check.parse_args(["--full", "--budget", "900"]).budget == 900
    assert gpu_check.parse_args(["--only", "suite", "demo"]).only == ["suite", "demo"]
    for bad in (["--budget", "0"], ["--only", "nothing"], ["--skip", "gpu"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)
    assert gpu_check_processes.bench_step_args(False) == ["--workloads", "w1", "--steps", "1", "--warmup", "1"]
    assert gpu_check_processes.bench_step_args(True)[:4] == ["--workloads", "w1", "w2", "w3"]


def test_list_prints_every_row_with_its_needs_and_time_without_a_gpu():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(SCRIPT), "--list"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:-1]] == list(gpu_check.CHECKS)
    by_row = {line.split()[0]: line for line in lines[1:-1]}
    assert " deepspeed " in by_row["deepspeed"] and " vllm " in by_row["vllm-sleep"]
    assert " datasets, matplotlib " in by_row["demo"] and " 20s " in by_row["bench-step"]
    full = subprocess.run([sys.executable, str(SCRIPT), "--list", "--full"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120).stdout  # fmt: skip
    assert " 300s " in next(line for line in full.splitlines() if line.startswith("bench-step"))
    # The default run, every row at its time with every package present (vLLM and DeepSpeed too), keeps
    # within the 6-minute budget.
    assert sum(row.seconds for row in gpu_check.ROWS) <= 360


def test_skip_reasons_name_the_missing_packages():
    row = gpu_check.ROW_BY_NAME["demo"]
    assert gpu_check.skip_reason(row, find_spec=lambda name: object()) is None
    reason = gpu_check.skip_reason(row, find_spec=lambda name: None)
    assert reason == f"needs datasets, matplotlib, not installed in {sys.executable}"
    assert gpu_check.missing_packages(gpu_check.OPTIONAL_PACKAGES, lambda n: None if n in ("vllm", "nbformat") else 1) == [
        "vllm", "nbformat"]  # fmt: skip


def test_the_sync_budget_is_per_training_minibatch():
    assert gpu_check_kernels.sync_verdict(50, 2) == ("FAIL", 25.0)  # the H100 run of 2026-11-26
    assert gpu_check_kernels.sync_verdict(4, 2) == ("PASS", 2.0)
    assert gpu_check_kernels.sync_verdict(5, 2) == ("FAIL", 2.5)
    assert gpu_check_kernels.sync_verdict(5, 2, per_step=1) == ("PASS", 2.0)  # a step's own sync set aside
    assert gpu_check_kernels.sync_verdict(50, 2, per_step=1) == ("FAIL", 24.5)


def test_demo_seconds_per_step_is_the_median_after_the_warmup_steps():
    records = [{"time/ppo/total": t, "time/rollout/generate": g, "time/rollout/reward": 0.01, "time/ppo/forward_pass": 9}
               for t, g in ((5.0, 1.0), (4.0, 1.0), (0.2, 0.1), (0.3, 0.05), (0.25, 0.1))]  # fmt: skip
    assert gpu_check_processes.demo_seconds_per_step(records) == pytest.approx(0.36)  # 0.31, 0.36, 0.36
    with pytest.raises(ValueError, match="the demo wrote 2 steps"):
        gpu_check_processes.demo_seconds_per_step(records[:2])


def test_a_deepspeed_step_agrees_with_the_plain_one_within_bf16_tolerance():
    g = torch.Generator().manual_seed(0)
    before = {"w": 0.02 * torch.randn(64, 64, generator=g), "b": 0.02 * torch.randn(64, generator=g)}  # GPT-2's init
    update = {k: 1e-3 * torch.randn(v.shape, generator=g) for k, v in before.items()}
    plain = {"before": before, "after": {k: before[k] + update[k] for k in before}}
    # bf16 weights: the same update, both ends rounded to bf16.
    rounded = {side: {k: v.bfloat16().float() for k, v in plain[side].items()} for side in ("before", "after")}
    cosine, ratio = gpu_check_processes.update_agreement(plain, rounded)
    assert cosine > 0.95 and abs(ratio - 1) < 0.1
    stats = {key: 1.0 for key in gpu_check_processes.DEEPSPEED_STATS}
    assert gpu_check_processes.compare_steps(stats, {**stats, "ppo/loss/total": 1.04}, cosine, ratio) == []
    problems = gpu_check_processes.compare_steps(stats, {**stats, "ppo/loss/total": 1.2}, cosine, ratio)
    assert problems == ["ppo/loss/total 1.2 vs 1"]
    flipped = {"before": before, "after": {k: before[k] - update[k] for k in before}}
    cosine, ratio = gpu_check_processes.update_agreement(plain, flipped)
    assert cosine == pytest.approx(-1) and gpu_check_processes.compare_steps(stats, stats, cosine, ratio) == [
        f"update cosine {cosine:.3f} < {gpu_check_processes.DEEPSPEED_MIN_COSINE}"]  # fmt: skip


def test_a_row_cut_at_its_time_limit_leaves_no_process_behind(tmp_path):
    child = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '60'], start_new_session=True); "
             "print(p.pid, flush=True); time.sleep(60)")  # fmt: skip
    log = tmp_path / "cut.log"
    assert gpu_check_common.run_process([sys.executable, "-c", child], log, timeout=3) is None
    grandchild = int(log.read_text().split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # killed; then reaped by init
        stat = Path(f"/proc/{grandchild}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the grandchild {grandchild} of a cut row is still running")
    done = gpu_check_common.run_process([sys.executable, "-c", "print('hi')"], log, timeout=60)
    assert done.returncode == 0 and log.read_text() == "hi\n"
    assert gpu_check_common.worker_result(subprocess.CompletedProcess([], 0, gpu_check_common.WORKER_MARKER + json.dumps({"a": 1}), ""))


def test_on_a_gpu_machine_without_vllm_its_tests_are_skipped_with_the_reason(tmp_path):
    """tests/conftest.py's rule, on a pretended GPU machine whose vLLM import fails: a test module importing
    vLLM at its top and a test marked ``requires("vllm")`` are skipped with the reason, not failed."""
    shadow = tmp_path / "shadow" / "vllm"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'vllm\'", name="vllm")\n')
    env = {**os.environ, "TRL_LITE_PRETEND_GPU_WITHOUT": "vllm",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "shadow"), str(REPO)])}  # fmt: skip
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_vllm_server.py",
               "tests/test_engine_options.py::test_the_server_launcher_documents_vllms_memory_and_eager_defaults"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 skipped" in result.stdout and "failed" not in result.stdout and "error" not in result.stdout
    assert result.stdout.count("needs vllm, which is not installed in this Python (a GPU machine") == 2
    # Without the pretence (a CPU machine), a missing vLLM stays an error.
    env.pop("TRL_LITE_PRETEND_GPU_WITHOUT")
    result = subprocess.run(command[:7] + ["tests/test_vllm_server.py"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode != 0 and "1 error" in result.stdout


def test_the_grpo_batch_of_the_sync_row_holds_groups_of_one_query():
    queries, responses, scores = gpu_check_common.make_batch(group_size=2)
    assert len(queries) == len(responses) == len(scores) == 8
    for i in range(0, 8, 2):
        assert torch.equal(queries[i], queries[i + 1])
    assert not torch.equal(queries[0], queries[2])
    plain = gpu_check_common.make_batch()
    assert len({len(q) for q in plain[0]}) > 1  # distinct queries by default


@pytest.mark.parametrize("takes_unrepeated", [True, False])
def test_the_gqa_row_compares_unrepeated_and_repeated_calls(monkeypatch, takes_unrepeated):
    """The gqa row's comparison, run on the CPU with the stand-in kernels of test_varlen_attention: torch 2.11's
    signature takes the unrepeated heads (both calls agree to bf16 rounding), 2.10's refuses them (the error)."""
    from test_varlen_attention import reference_varlen_attn_210, reference_varlen_attn_211

    from trl_lite.models import varlen_attention
    from trl_lite.models.varlen_attention import VarlenKernel

    kernel = reference_varlen_attn_211 if takes_unrepeated else reference_varlen_attn_210
    monkeypatch.setattr(varlen_attention, "KERNEL", VarlenKernel(kernel, frozenset({"cpu"}), frozenset({torch.bfloat16})))
    result = gpu_check_kernels.gqa_agreement("cpu")
    if takes_unrepeated:
        assert len(result) == 4 and max(result) <= gpu_check_kernels.GQA_RTOL
    else:
        assert "number of heads in key/value" in result
