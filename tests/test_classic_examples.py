"""Classic TRL 0.11 examples, ported by changing the import (examples/classic/), run offline.

Each runs in a subprocess (scripts) or a kernel (notebooks) on tiny local stand-ins for the hub
models and datasets it names, built here: a word-level tokenizer, a 2-layer GPT-2, GPT-2 sequence
classifiers as reward models, a reward LoRA adapter, and small json datasets with the columns the
classic code reads. Runs are 1 to 4 PPO steps; each test checks the number of steps the run took
and, where the example saves its model, that the saved model loads and was trained.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient
from peft import LoraConfig, get_peft_model
from tiny_models import SPECIAL, WORDS
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
CLASSIC = ROOT / "examples" / "classic"


def _tokenizer(padding_side="right"):
    """A word-level tokenizer that also splits punctuation: a control string like `[negative]` is
    several tokens, as with GPT-2's tokenizer (the control notebook concatenates them)."""
    vocab = {token: i for i, token in enumerate([*SPECIAL, *WORDS, "[", "]", "negative", "neutral", "positive"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side=padding_side,
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids
    )  # fmt: skip


def _config(**overrides):
    tokenizer = _tokenizer()
    config = dict(vocab_size=len(tokenizer), n_positions=256, n_embd=32, n_layer=2, n_head=2)
    config.update(bos_token_id=1, eos_token_id=1, pad_token_id=0, **overrides)
    return GPT2Config(**config)


def _save(model, path, padding_side="right"):
    model.save_pretrained(path)
    _tokenizer(padding_side).save_pretrained(path)
    return str(path)


def _review(rng, words):
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Local stand-ins for every hub model and dataset the classic examples name."""
    root = tmp_path_factory.mktemp("classic_assets")
    rng = random.Random(0)
    torch.manual_seed(0)
    labels = {"id2label": {0: "NEGATIVE", 1: "POSITIVE"}, "label2id": {"NEGATIVE": 0, "POSITIVE": 1}}
    assets = {
        # lvwerra/gpt2-imdb: a causal LM with its tokenizer.
        "policy": _save(GPT2LMHeadModel(_config()), root / "gpt2-imdb"),
        # lvwerra/distilbert-imdb: a sentiment classifier with NEGATIVE/POSITIVE labels.
        "sentiment": _save(GPT2ForSequenceClassification(_config(num_labels=2, **labels)), root / "distilbert-imdb"),
        # The stack-exchange reward model: one score per text.
        "stack_rm": _save(GPT2ForSequenceClassification(_config(num_labels=1)), root / "stack-rm"),
    }
    # stanfordnlp/imdb: reviews of 100-150 words (over 500 characters) with labels.
    imdb = [{"text": _review(rng, rng.randint(100, 150)), "label": i % 2} for i in range(16)]
    _jsonl(root / "imdb" / "train.jsonl", imdb)
    assets["imdb"] = str(root / "imdb")
    # Anthropic/hh-rlhf: 800 rows so that its first 1% (the example's split) is one batch of 8.
    _jsonl(root / "hh-rlhf" / "train.jsonl", [{"chosen": _review(rng, 16), "rejected": _review(rng, 16)} for _ in range(800)])
    assets["hh"] = str(root / "hh-rlhf")
    # lvwerra/stack-exchange-paired, data_dir="data/rl".
    questions = [{"qid": i, "question": _review(rng, 12), "response_j": "", "response_k": ""} for i in range(8)]
    _jsonl(root / "stack-exchange-paired" / "data" / "rl" / "train.jsonl", questions)
    assets["stack"] = str(root / "stack-exchange-paired")
    # trl-lib/llama-7b-hh-rm-adapter: a LoRA reward adapter with a two-label score head, on the
    # multi-adapter base model (left padding: the example reads the score at the last position).
    base = _save(GPT2LMHeadModel(_config()), root / "llama-base", padding_side="left")
    reward = GPT2ForSequenceClassification.from_pretrained(base, num_labels=2)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="SEQ_CLS", modules_to_save=["score"])
    reward = get_peft_model(reward, lora)
    with torch.no_grad():
        for name, param in reward.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    reward.save_pretrained(root / "rm-adapter")
    assets.update(multi_base=base, rm_adapter=str(root / "rm-adapter"))
    return assets


def example_env(**extra) -> dict:
    """Offline, one thread, this worktree's trl_lite first; `extra` adds the examples' own variables."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.update(MPLBACKEND="Agg", WANDB_DISABLED="true")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run_example(path: Path, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, str(path), *args], cwd=cwd, env=env or example_env(), capture_output=True, text=True
    )
    assert result.returncode == 0, f"{path.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.mark.parametrize("peft", [[], ["--use_peft", "True", "--lora_r", "4"]], ids=["full", "peft"])
def test_ppo_script(assets, tmp_path, peft):
    """examples/scripts/ppo.py: 16 reviews, batches of 4: four steps, each with policy and reference responses."""
    args = ["--model_name", assets["policy"], "--query_dataset", assets["imdb"]]
    args += ["--reward_model", f"sentiment-analysis:{assets['sentiment']}", "--batch_size", "4", "--mini_batch_size", "2"]
    result = run_example(CLASSIC / "ppo.py", *args, *peft, cwd=tmp_path)
    assert "4/4" in result.stderr


def trained_away_from(saved, initial) -> float:
    """Largest absolute difference between the parameters of two value-head models of the same shape."""
    initial = dict(initial.named_parameters())
    return max((p - initial[name]).abs().max().item() for name, p in saved.named_parameters() if name in initial)


def test_ppo_multi_adapter_script(assets, tmp_path):
    """examples/scripts/ppo_multi_adapter.py: the reward adapter scores, the policy adapter learns (one step)."""
    args = ["--model_name", assets["multi_base"], "--dataset_name", assets["hh"], "--rm_adapter", assets["rm_adapter"]]
    result = run_example(CLASSIC / "ppo_multi_adapter.py", *args, "--use_safetensors", "True", "--load_in_4bit", "False", cwd=tmp_path)
    assert "1it [" in result.stderr and "2it [" not in result.stderr  # 800 rows, train[:1%]: one batch of 8


def test_stack_llama_rl_training_script(assets, tmp_path):
    """stack_llama rl_training.py: 8 questions, batches of 4, steps=8: two steps, the second one saved."""
    args = ["--model_name", assets["policy"], "--tokenizer_name", assets["policy"], "--reward_model_name", assets["stack_rm"]]
    args += ["--dataset_name", assets["stack"], "--max_train_samples", "8", "--num_proc", "1", "--load_in_8bit", "False"]
    args += ["--batch_size", "4", "--mini_batch_size", "2", "--gradient_accumulation_steps", "1", "--steps", "8"]
    args += ["--output_max_length", "36", "--save_freq", "1", "--output_dir", f"{tmp_path}/"]
    run_example(CLASSIC / "stack_llama" / "rl_training.py", *args, cwd=tmp_path)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1"]
    from trl_lite import AutoModelForCausalLMWithValueHead

    saved = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "step_1"))
    lora_b = [p for name, p in saved.named_parameters() if "lora_B" in name]
    assert lora_b and max(p.abs().max().item() for p in lora_b) > 0  # LoRA B starts at zero


def run_notebook(path: Path, tmp_path: Path, monkeypatch, **env) -> str:
    """Execute a notebook in a kernel started from this interpreter; return the text of its outputs."""
    spec_dir = tmp_path / "kernels" / "trl-lite-classic"
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"], "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps({**spec, "display_name": "trl_lite tests"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    for key, value in example_env(**env).items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="trl-lite-classic", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            texts.append(output.get("text", "") + str(output.get("data", {}).get("text/plain", "")))
    return "\n".join(texts)


def notebook_env(assets, output_dir) -> dict:
    return dict(
        GPT2_IMDB=assets["policy"], DISTILBERT_IMDB=assets["sentiment"], IMDB_DATASET=assets["imdb"], LOG_WITH="",
        PPO_BATCH_SIZE="8", PPO_MINI_BATCH_SIZE="4", OUTPUT_DIR=str(output_dir), PUSH_TO_HUB="0",
    )  # fmt: skip


def test_gpt2_sentiment_notebook(assets, tmp_path, monkeypatch):
    from trl_lite import AutoModelForCausalLMWithValueHead

    output_dir = tmp_path / "gpt2-imdb-pos-v2"
    text = run_notebook(CLASSIC / "notebooks" / "gpt2-sentiment.ipynb", tmp_path, monkeypatch, **notebook_env(assets, output_dir))
    assert "2/2" in text  # 16 reviews, batches of 8
    assert "rewards (before)" in text and "rewards (after)" in text and "median:" in text
    saved = AutoModelForCausalLMWithValueHead.from_pretrained(str(output_dir))
    assert trained_away_from(saved, AutoModelForCausalLMWithValueHead.from_pretrained(assets["policy"])) > 0


def test_gpt2_sentiment_control_notebook(assets, tmp_path, monkeypatch):
    from trl_lite import AutoModelForCausalLMWithValueHead

    output_dir = tmp_path / "gpt2-imdb-ctrl"
    text = run_notebook(
        CLASSIC / "notebooks" / "gpt2-sentiment-control.ipynb", tmp_path, monkeypatch, **notebook_env(assets, output_dir)
    )
    # Two progress bars (passes) over 16 reviews in batches of 8, both finished.
    assert text.count("| 0/2 [") == 2 and "| 2/2 [" in text and "| 3/" not in text
    # pos_logit_to_reward on logits 4, -4 and 0 for the tasks negative, neutral, positive.
    for rewards in ("tensor([-4., -4.,  4.])", "tensor([ 4., -4., -4.])", "tensor([-0., 4., 0.])"):
        assert rewards in text
    saved = AutoModelForCausalLMWithValueHead.from_pretrained(str(output_dir))
    assert trained_away_from(saved, AutoModelForCausalLMWithValueHead.from_pretrained(assets["policy"])) > 0
