"""Completions tables in ``log_stats`` (``log_completions_every``): TensorBoard text read back from
the event files, W&B tables, and classic TRL's per-step W&B ``game_log``.

wandb is not a dependency: the W&B tests put a small stand-in ``wandb`` module in ``sys.modules``
and let accelerate's own ``WandBTracker`` drive it, so what reaches ``wandb.Table`` and ``run.log``
is what a real run would get.
"""

import glob
import sys
import types

import pytest
import torch
from accelerate import tracking
from accelerate.utils import LoggerType
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tiny_models import make_gpt2, make_tokenizer, random_batch

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

QUERIES = ["the movie | was", "a film", "this story\nis", "i loved"]
RESPONSES = ["good", "very bad", "too long", "it"]
REWARDS = [0.5, -1.25, 2.0, 0.125]


def make_trainer(tmp_path, **config_kwargs):
    config = PPOConfig(
        batch_size=4, mini_batch_size=2, ppo_epochs=1, learning_rate=1e-3,
        project_kwargs={"logging_dir": str(tmp_path)}, **config_kwargs,
    )  # fmt: skip
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    return PPOTrainer(config, model, tokenizer=make_tokenizer())


def run_steps(trainer, steps, columns_to_log=("query", "response"), batch=None):
    """``steps`` rounds of step() and log_stats on one fixed batch."""
    queries, responses, _ = random_batch(4)
    rewards = [torch.tensor(r) for r in REWARDS]
    batch = batch or {"query": QUERIES, "response": RESPONSES}
    for _ in range(steps):
        stats = trainer.step(queries, responses, rewards)
        trainer.log_stats(stats, batch, rewards, columns_to_log=columns_to_log)


def tensorboard_texts(log_dir) -> dict:
    """Every text summary of the event files under ``log_dir`` (the run's and its hparams'): tag -> [(step, text)]."""
    texts = {}
    for path in glob.glob(str(log_dir / "**" / "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(path, size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            texts.setdefault(tag, []).extend((e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag))
    return texts


def table_rows(text: str) -> list:
    """The cells of a markdown table's body, escapes undone."""
    lines = text.split("\n")[2:]
    rows = []
    for line in lines:
        cells = line.strip()[1:-1].replace("\\|", "\0").split("|")
        rows.append([c.strip().replace("\0", "|").replace("<br>", "\n") for c in cells])
    return rows


def test_tensorboard_gets_the_completions_table_every_n_steps(tmp_path):
    trainer = make_trainer(tmp_path, log_with="tensorboard", log_completions_every=2)
    run_steps(trainer, 4)
    trainer.accelerator.end_training()
    texts = tensorboard_texts(tmp_path)
    (tag,) = [t for t in texts if t.startswith("game_log")]
    assert [step for step, _ in texts[tag]] == [2, 4]
    text = texts[tag][0][1]
    assert text.split("\n")[0] == "| query | response | reward |"
    assert table_rows(text) == [[q, r, f"{w:g}"] for q, r, w in zip(QUERIES, RESPONSES, REWARDS)]


def test_tensorboard_gets_no_table_without_log_completions_every(tmp_path):
    trainer = make_trainer(tmp_path, log_with="tensorboard")
    run_steps(trainer, 2)
    trainer.accelerator.end_training()
    assert not [t for t in tensorboard_texts(tmp_path) if t.startswith("game_log")]


class FakeWandb(types.ModuleType):
    """The part of wandb that accelerate's WandBTracker and log_stats use; records every run.log call."""

    def __init__(self):
        super().__init__("wandb")
        self.logged = []
        self.config = types.SimpleNamespace(update=lambda values, allow_val_change=False: None)
        fake = self

        class Table:
            def __init__(self, columns=None, data=None):
                self.columns, self.data = columns, data

        class Run:
            def log(self, values, step=None, **kwargs):
                fake.logged.append((step, values))

            def finish(self):
                pass

        self.Table = Table
        self.run = Run()

    def init(self, project=None, **kwargs):
        return self.run


@pytest.fixture
def fake_wandb(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    # accelerate lists the installed trackers once, at import.
    monkeypatch.setattr(tracking, "_available_trackers", [LoggerType.TENSORBOARD, LoggerType.WANDB])
    return fake


def wandb_tables(fake) -> list:
    return [(step, values["game_log"]) for step, values in fake.logged if "game_log" in values]


def test_all_trackers_get_the_table_every_n_steps(tmp_path, fake_wandb):
    trainer = make_trainer(tmp_path, log_with="all", log_completions_every=3)
    assert {t.name for t in trainer.accelerator.trackers} == {"tensorboard", "wandb"}
    run_steps(trainer, 3)
    trainer.accelerator.end_training()
    ((step, table),) = wandb_tables(fake_wandb)
    assert step == 3
    assert table.columns == ["query", "response", "reward"]
    assert table.data == [[q, r, w] for q, r, w in zip(QUERIES, RESPONSES, REWARDS)]
    # The statistics went to W&B too, at every step.
    assert [step for step, values in fake_wandb.logged if "env/reward_mean" in values] == [1, 2, 3]
    texts = tensorboard_texts(tmp_path)
    ((_, [(tb_step, text)]),) = [(t, v) for t, v in texts.items() if t.startswith("game_log")]
    assert tb_step == 3 and table_rows(text)[1] == [QUERIES[1], RESPONSES[1], "-1.25"]


def test_wandb_keeps_the_classic_game_log_of_every_step(tmp_path, fake_wandb):
    trainer = make_trainer(tmp_path, log_with="wandb")
    ref_rewards = [torch.tensor(-r) for r in REWARDS]
    batch = {"query": QUERIES, "response": RESPONSES, "ref_rewards": ref_rewards}
    run_steps(trainer, 2, columns_to_log=["query", "response", "ref_rewards"], batch=batch)
    tables = wandb_tables(fake_wandb)
    assert [step for step, _ in tables] == [1, 2]
    assert tables[0][1].columns == ["query", "response", "ref_rewards", "reward"]
    # One-element tensors become numbers in the table.
    assert tables[0][1].data == [[q, r, -w, w] for q, r, w in zip(QUERIES, RESPONSES, REWARDS)]


def test_missing_columns_raise_before_anything_is_logged(tmp_path, fake_wandb):
    trainer = make_trainer(tmp_path, log_with="wandb", log_completions_every=1)
    queries, responses, _ = random_batch(4)
    rewards = [torch.tensor(r) for r in REWARDS]
    stats = trainer.step(queries, responses, rewards)
    with pytest.raises(ValueError, match=r"columns_to_log \['query', 'response'\] must be keys of batch.*"
                                         r"missing \['response'\], batch has \['query'\]"):  # fmt: skip
        trainer.log_stats(stats, {"query": QUERIES}, rewards)
    assert fake_wandb.logged == []
