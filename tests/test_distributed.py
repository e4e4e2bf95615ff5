"""PPOTrainer on 2 processes (CPU, gloo) under the shipped accelerate configs.

Each test launches a script of `tests/distributed/` with `accelerate launch --config_file
accelerate_configs/<name>.yaml --num_processes 2` and checks what the processes report: that they
really formed one group (DeepSpeed engine or DDP, world size 2), that after training every process
holds the same weights, KL coefficient and score moments (compared with `torch.distributed`
itself, not accelerate), that the statistics the controllers use cover all processes, that the
saved directory loads on one process, and that 2 processes x 4 rows take the same step as
1 process x 8 rows. The tests run one after the other in one pytest-xdist worker.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import make_gpt2
from trl_lite import AutoModelForCausalLMWithValueHead

pytestmark = pytest.mark.xdist_group("distributed")

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "distributed"
ROLLOUT_STEPS = 3
PER_PROCESS_BATCH = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(config: str | Path, script: Path, *args: str, num_processes: int = 2) -> subprocess.CompletedProcess:
    """Run `script` under `accelerate launch` with `accelerate_configs/<config>.yaml` (or the config file `config`
    given as a Path); fail with its output, else return the finished process."""
    config_file = config if isinstance(config, Path) else REPO / "accelerate_configs" / f"{config}.yaml"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(config_file),
        "--num_processes", str(num_processes),
        "--main_process_port", str(_free_port()),
        str(script), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-8000:]}"
    return result


@pytest.fixture(scope="module", autouse=True)
def deepspeed_cpu_collectives():
    """Build DeepSpeed's shared-memory collective op for CPU runs here, once, before any launch.

    DeepSpeed compiles it on first use (about a minute of CPU, then cached under
    ~/.cache/torch_extensions); done here it stays out of the launched runs and their timeout.
    """
    if not torch.cuda.is_available():
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()


# 256 wide: the largest matrices exceed DeepSpeed's stage3_param_persistence_threshold (1e5 elements),
# so ZeRO-3 really partitions them; smaller parameters stay whole on every process.
BASE_MODEL = {"seed": 0, "n_embd": 256}


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base_gpt2")
    make_gpt2(**BASE_MODEL).save_pretrained(path)
    return path


def _named_parameters(model) -> dict:
    return {name: p.detach().to(torch.float64) for name, p in model.named_parameters()}


def _adaptive_kl(init: float, kls: list, target: float, horizon: float, n: int) -> list:
    """The coefficients of the adaptive controller before each step and after the last."""
    coefs = [init]
    for kl in kls:
        error = min(max(kl / target - 1.0, -0.2), 0.2)
        coefs.append(coefs[-1] * (1.0 + error * n / horizon))
    return coefs


ROLLOUTS = {
    "zero2": ("deepspeed_zero2", []),
    "zero2-peft": ("deepspeed_zero2", ["--peft"]),
    "zero3-shared-layers": ("deepspeed_zero3", ["--num_shared_layers", "1"]),
    "ddp": ("multi_gpu", []),
}


@pytest.mark.parametrize("case", list(ROLLOUTS))
def test_rollout_loop_keeps_processes_in_step_and_saves(case, base_model_dir, tmp_path):
    config, extra = ROLLOUTS[case]
    launch(config, SCRIPTS / "rollout_loop.py", "--base_model", str(base_model_dir), "--output_dir", str(tmp_path), *extra)
    report = torch.load(tmp_path / "report.pt")

    # One real group of 2: a DeepSpeed engine or DDP, not two processes each training alone.
    assert report["world_size"] == report["num_processes"] == 2
    expected_wrapper = "DistributedDataParallel" if config == "multi_gpu" else "DeepSpeedEngine"
    assert report["model_class"] == expected_wrapper
    if config != "multi_gpu" and "--peft" not in extra:
        assert report["ref_class"] == "DeepSpeedEngine"
    if config == "deepspeed_zero3":
        assert report["partitioned_parameters"] > 0
    # Before the first update the policy equals the reference: the reference pass is right.
    assert abs(report["kl_per_step"][0]) < 1e-5

    # Every process holds the same weights, KL coefficient, score moments and statistics.
    weights = report["weights_per_rank"]
    assert (weights[0] - weights[1]).abs().max().item() == 0.0
    assert torch.equal(report["scalars_per_rank"][0], report["scalars_per_rank"][1])

    # The score moments cover the scores of both processes, and the adaptive KL update used the
    # KL of both processes with n = batch_size * num_processes.
    kl_value, running_mean, running_std, running_count = report["scalars_per_rank"][0][:4].tolist()
    all_scores = torch.cat(report["scores_per_step"]).double()
    assert running_count == len(all_scores) == ROLLOUT_STEPS * PER_PROCESS_BATCH * 2
    assert running_mean == pytest.approx(all_scores.mean().item(), abs=1e-9)
    assert running_std == pytest.approx(all_scores.std().item(), abs=1e-9)
    coefs = _adaptive_kl(0.2, report["kl_per_step"], target=0.1, horizon=100, n=PER_PROCESS_BATCH * 2)
    assert report["kl_coef_per_step"] == pytest.approx(coefs[:-1], rel=1e-6)
    assert kl_value == pytest.approx(coefs[-1], rel=1e-6)
    assert kl_value != 0.2

    # The saved directory loads on one process with the full trained weights and value head.
    loaded = _named_parameters(AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "model")))
    trained = report["named_parameters"]
    assert sorted(loaded) == sorted(trained)
    assert max((loaded[k] - trained[k]).abs().max().item() for k in trained) == 0.0

    # Training moved the trainable weights and left the frozen ones alone.
    base = _named_parameters(AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(**BASE_MODEL)))
    if "--peft" in extra:
        lora_b = [k for k in trained if "lora_B" in k]
        assert lora_b and all(trained[k].abs().max() > 0 for k in lora_b)  # LoRA B starts at zero
        frozen = [k for k in trained if "lora" not in k and not k.startswith("v_head.")]
        base_name = {k: k.replace("base_model.model.", "").replace(".base_layer", "") for k in frozen}
        assert all(torch.equal(trained[k], base[base_name[k]]) for k in frozen)
    else:
        last_layer = "pretrained_model.transformer.h.1.mlp.c_fc.weight"
        assert (trained[last_layer] - base[last_layer]).abs().max() > 1e-4
    if "--num_shared_layers" in extra:
        # Layers shared with the reference (embeddings and block 0) are frozen in the policy too.
        shared = ("pretrained_model.transformer.wte.", "pretrained_model.transformer.wpe.", "pretrained_model.transformer.h.0.")
        assert all(torch.equal(trained[k], base[k]) for k in trained if k.startswith(shared))


def test_two_processes_take_the_step_of_one_process_on_the_global_batch(tmp_path):
    """ZeRO-2, 2 processes x 4 rows vs 1 process x 8 rows: the same optimizer step (fp32, SGD)."""
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir()
    one.mkdir()
    launch("deepspeed_zero2", SCRIPTS / "equivalence_step.py", "--output_dir", str(two))
    launch("single_gpu", SCRIPTS / "equivalence_step.py", "--output_dir", str(one), num_processes=1)
    a, b = torch.load(two / "result.pt"), torch.load(one / "result.pt")

    weights_a, weights_b = a["named_parameters"], b["named_parameters"]
    assert sorted(weights_a) == sorted(weights_b)
    max_diff = max((weights_a[k] - weights_b[k]).abs().max().item() for k in weights_a)
    assert max_diff <= 1e-4, f"max abs weight difference {max_diff:.3g}"
    assert a["kl_coef"] == pytest.approx(b["kl_coef"], rel=1e-6)
    for key in ("objective/kl", "ppo/mean_scores", "ppo/loss/policy", "ppo/loss/value", "ppo/policy/approxkl"):
        assert a["stats"][key] == pytest.approx(b["stats"][key], rel=1e-4, abs=1e-6), key


def _global_token_mean_runs(runs: dict, tmp_path) -> dict:
    """``{name: (accelerate config, processes, script args)}`` -> each run's ``result.pt`` of
    ``global_token_mean_step.py``."""
    results = {}
    for name, (config, processes, args) in runs.items():
        out = tmp_path / name
        out.mkdir()
        launch(config, SCRIPTS / "global_token_mean_step.py", "--output_dir", str(out), *args, num_processes=processes)
        results[name] = torch.load(out / "result.pt")
    return results


def test_global_token_mean_takes_the_same_step_on_two_processes_as_on_one(tmp_path):
    """loss_type='global_token_mean' (and the entropy bonus) with unequal token counts per process: DDP and
    ZeRO-3 (2 x mini-batch 2 x accumulation 2) and ZeRO-2 (2 x mini-batch 4) take the step of 1 process
    on all 8 rows (SGD)."""
    runs = {
        "one": ("single_gpu", 1, ("--mini_batch_size", "8")),
        "ddp": ("multi_gpu", 2, ("--mini_batch_size", "2", "--gradient_accumulation_steps", "2")),
        "zero2": ("deepspeed_zero2", 2, ("--mini_batch_size", "4")),
        "zero3": ("deepspeed_zero3", 2, ("--mini_batch_size", "2", "--gradient_accumulation_steps", "2")),
    }
    results = _global_token_mean_runs(runs, tmp_path)
    start = {k: p.detach().to(torch.float64) for k, p in make_gpt2(seed=0).named_parameters()}
    want = results["one"]["named_parameters"]
    assert max((want[k] - start[k]).abs().max().item() for k in want) > 1e-3  # the step moved the weights
    for name in ("ddp", "zero2", "zero3"):
        got = results[name]["named_parameters"]
        assert sorted(got) == sorted(want)
        max_diff = max((got[k] - want[k]).abs().max().item() for k in want)
        assert max_diff <= 1e-5, f"{name}: max abs weight difference {max_diff:.3g}"
        assert results[name]["loss"] == pytest.approx(results["one"]["loss"], rel=1e-4, abs=1e-6), name


def test_token_budget_passes_line_up_and_take_the_step_of_one_process(tmp_path):
    """max_tokens_per_minibatch=16 with global_token_mean on 2 processes whose rows alone would take 2 and 3
    passes (the script checks): under ZeRO-2, ZeRO-3 and DDP both make 3 passes (rollout and training), nothing
    hangs, and the step is the one
    of 1 process on all 8 rows in one mini-batch without a budget (docs/algorithm.md section 18)."""
    split = ("--mini_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_tokens_per_minibatch", "16")
    runs = {"one": ("single_gpu", 1, ("--mini_batch_size", "8")), "zero2": ("deepspeed_zero2", 2, split),
            "zero3": ("deepspeed_zero3", 2, split), "ddp": ("multi_gpu", 2, split)}  # fmt: skip
    results = _global_token_mean_runs(runs, tmp_path)
    want = results["one"]["named_parameters"]
    for name in ("zero2", "zero3", "ddp"):
        assert results[name]["minibatches"] == 3, name
        got = results[name]["named_parameters"]
        max_diff = max((got[k] - want[k]).abs().max().item() for k in want)
        assert max_diff <= 1e-5, f"{name}: max abs weight difference {max_diff:.3g}"
        assert results[name]["loss"] == pytest.approx(results["one"]["loss"], rel=1e-4, abs=1e-6), name


def test_sentiment_example_trains_and_saves_under_zero3(tmp_path):
    """The demo, shortened, under ZeRO-3 on 2 processes: it trains, logs every step and saves a loadable policy."""
    launch(
        "deepspeed_zero3",
        REPO / "examples" / "scripts" / "ppo_sentiment.py",
        "--steps", "2", "--batch_size", "4", "--mini_batch_size", "2", "--generation_batch_size", "4",
        "--sft_steps", "5", "--reward_model_steps", "5", "--num_samples", "2", "--output_dir", str(tmp_path),
    )  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]

    tuned = _named_parameters(AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "model")))
    sft = _named_parameters(AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "offline_models" / "sft_model")))
    changed = [k for k in tuned if not k.startswith("v_head.") and not torch.equal(tuned[k], sft[k])]
    assert changed, "PPO did not change the policy's weights"


@pytest.mark.parametrize("config", ["deepspeed_zero2", "deepspeed_zero3", "multi_gpu"])
def test_a_nonfinite_gradient_on_one_process_skips_the_update_on_all(config, base_model_dir, tmp_path):
    # DeepSpeed checks and skips inside its own step; the trainer must still count and warn.
    launch(config, SCRIPTS / "nonfinite_gradient.py", "--base_model", str(base_model_dir), "--output_dir", str(tmp_path))
    seen = json.loads((tmp_path / "report.json").read_text())
    for rank, (skipped, warned, changed, nonfinite, skipped2, warned2, changed2, nonfinite2) in enumerate(seen):
        assert (skipped, warned, changed, nonfinite) == (1, 1, 0, 0), (rank, seen)
        assert (skipped2, warned2, nonfinite2) == (0, 0, 0) and changed2 > 0, (rank, seen)
