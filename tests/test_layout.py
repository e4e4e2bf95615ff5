"""The package layout: classic import paths still lead to the moved parts, no package imports in a circle, and the
trainer's rooms import downward only (faces -> step -> memory/state -> layout -> the packages outside the trainer)."""

import ast
import importlib
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trl_lite"


@pytest.mark.parametrize(
    "old_path, name, home",
    [
        ("trl_lite.trainer.reward_trainer", "RewardTrainer", "trl_lite.trainer.reward.reward_trainer"),
        ("trl_lite.trainer.reward_config", "RewardConfig", "trl_lite.trainer.reward.reward_config"),
        ("trl_lite.trainer", "RewardDataCollatorWithPadding", "trl_lite.trainer.reward.reward_data"),
        ("trl_lite.trainer.ppo_trainer", "PPOTrainer", "trl_lite.trainer.ppo_trainer"),
        ("trl_lite.trainer.ppo_config", "PPOConfig", "trl_lite.trainer.ppo_config"),
        ("trl_lite.core", "logprobs_from_logits", "trl_lite.core.logprobs"),
        ("trl_lite.models", "AutoModelForCausalLMWithValueHead", "trl_lite.models.modeling_value_head"),
        ("trl_lite.engines", "RolloutGeneration", "trl_lite.engines.generation"),
    ],
)
def test_a_classic_import_path_gives_the_object_of_its_new_home(old_path, name, home):
    assert getattr(importlib.import_module(old_path), name) is getattr(importlib.import_module(home), name)


def test_every_public_name_of_the_package_imports_from_the_top():
    import trl_lite

    for name in trl_lite.__all__:
        assert getattr(trl_lite, name) is not None, name


def _imported_packages(path: Path) -> set[str]:
    """The top-level trl_lite packages (``trainer``, ``engines``, ...) a module imports, relative or absolute."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = list(parts[:-1])  # the package a module's relative imports start from (also for __init__)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = base + (node.module.split(".") if node.module else [])
        elif isinstance(node, ast.Import):
            target = node.names[0].name.split(".")
        else:
            continue
        if target[:1] == ["trl_lite"] and len(target) > 1:
            found.add(target[1])
    return found


def test_the_engines_import_nothing_of_the_packages_that_generate_through_them():
    users = {"trainer", "agents", "rollouts", "environment", "extras", "vllm_server"}
    for path in (PACKAGE / "engines").glob("*.py"):
        assert not _imported_packages(path) & users, path.name


def test_the_packages_below_the_trainer_never_import_it():
    for package in ("core", "models", "engines", "parallel"):
        for path in (PACKAGE / package).rglob("*.py"):
            assert "trainer" not in _imported_packages(path), path.relative_to(PACKAGE)


def test_the_trainer_imports_no_package_that_uses_it():
    # One exception: grpo/agents.py, TRL's GRPOTrainer(tools=..., environment_factory=...), plays its episodes with
    # agents.run_episodes - which imports nothing of the trainer (below), so no circle forms.
    for path in (PACKAGE / "trainer").rglob("*.py"):
        allowed = {"agents"} if path == PACKAGE / "trainer" / "grpo" / "agents.py" else set()
        assert not _imported_packages(path) & ({"agents", "rollouts", "environment", "extras"} - allowed), path.name


def test_agents_import_nothing_of_the_trainer():
    for path in (PACKAGE / "agents").glob("*.py"):
        assert "trainer" not in _imported_packages(path), path.name


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


# Every import path the README, docs/ and classic code write, with a name each must give.
DOCUMENTED_PATHS = [
    ("trl_lite", ["PPOConfig", "PPOTrainer", "AutoModelForCausalLMWithValueHead", "LengthSampler", "set_seed",
                  "create_reference_model", "RewardConfig", "RewardTrainer"]),
    ("trl_lite.trainer", ["PPOConfig", "PPOTrainer", "AdaptiveKLController", "FixedKLController", "RunningMoments",
                          "RewardConfig", "RewardTrainer", "RewardDataCollatorWithPadding", "NoDatasetWarning"]),
    ("trl_lite.trainer.ppo_config", ["PPOConfig"]),
    ("trl_lite.trainer.ppo_trainer", ["PPOTrainer"]),
    ("trl_lite.trainer.reward_config", ["RewardConfig"]),
    ("trl_lite.trainer.reward_trainer", ["RewardTrainer"]),
    ("trl_lite.core", ["logprobs_from_logits", "whiten", "masked_mean", "masked_whiten", "respond_to_batch",
                       "LengthSampler", "PPODecorators", "flatten_dict"]),
    ("trl_lite.models", ["AutoModelForCausalLMWithValueHead", "AutoModelForSeq2SeqLMWithValueHead",
                         "create_reference_model", "PreTrainedModelWrapper"]),
]


@pytest.mark.parametrize("path, names", DOCUMENTED_PATHS, ids=[path for path, _ in DOCUMENTED_PATHS])
def test_every_documented_import_path_gives_its_names(path, names):
    module = importlib.import_module(path)
    assert [name for name in names if not hasattr(module, name)] == []


# The trainer's rooms by layer: a module may import its own room and rooms of a deeper layer; only the faces
# (layer 0: the modules at the trainer's top and the trainers beside PPOTrainer) import one another.
ROOM_LAYERS = {"": 0, "classic": 0, "reward": 0, "grpo": 0, "step": 1, "memory": 2, "state": 2, "layout": 3}
TRAINER = PACKAGE / "trainer"


def _room(path: Path) -> str:
    inside = path.relative_to(TRAINER).parts
    return inside[0] if len(inside) > 1 else ""


def _trainer_imports(path: Path) -> set[tuple[str, ...]]:
    """The trl_lite modules (as dotted parts) a module of the trainer imports, relative imports resolved."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = list(parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = base + (node.module.split(".") if node.module else [])
            if node.module is None or target == ["trl_lite"]:  # `from . import module`, `from trl_lite import X`
                found |= {(*target, alias.name) for alias in node.names}
            else:
                found.add(tuple(target))
        elif isinstance(node, ast.Import):
            found |= {tuple(alias.name.split(".")) for alias in node.names}
    return {target for target in found if target[:1] == ("trl_lite",)}


def _target_room(target: tuple[str, ...]) -> str | None:
    """The room of an imported trl_lite module; None for a package outside the trainer."""
    if target[1] != "trainer":
        outside = {p.name for p in PACKAGE.iterdir() if p.is_dir()} | {"__version__"}
        return None if target[1] in outside else ""  # a name of the whole package comes through the faces
    if len(target) == 2 or (TRAINER / f"{target[2]}.py").exists():
        return ""
    return target[2]


def _upward_imports() -> list[str]:
    upward = []
    for path in TRAINER.rglob("*.py"):
        room = _room(path)
        assert room in ROOM_LAYERS, f"{path.relative_to(PACKAGE)}: room {room!r} has no layer in ROOM_LAYERS"
        for target in _trainer_imports(path):
            to = _target_room(target)
            if to is None or to == room:
                continue
            assert to in ROOM_LAYERS, f"{path.relative_to(PACKAGE)} imports an unknown room {to!r}"
            if ROOM_LAYERS[to] < ROOM_LAYERS[room] or (ROOM_LAYERS[to] == ROOM_LAYERS[room] and ROOM_LAYERS[room] > 0):
                upward.append(f"{path.relative_to(PACKAGE).as_posix()} -> {'.'.join(target)}")
    return sorted(upward)


def test_the_trainer_rooms_import_downward_only():
    assert _upward_imports() == []


def test_the_rule_sees_upward_and_sideways_imports(tmp_path, monkeypatch):
    """The checker itself, on a made-up trainer: memory importing a face, step or state is caught; layout is not."""
    fake = tmp_path / "trl_lite" / "trainer"
    for room in ("memory", "step", "state", "layout"):
        (fake / room).mkdir(parents=True)
    (fake / "ppo_config.py").write_text("")
    (fake / "memory" / "bad.py").write_text(
        "from ..ppo_config import PPOConfig\nfrom ..step import forward\nfrom trl_lite.trainer.state.ema import E\n"
        "from ..layout.rows import Rows\nfrom ...core import masked_mean\nfrom trl_lite import PPOTrainer\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "trl_lite")
    monkeypatch.setattr(sys.modules[__name__], "TRAINER", fake)
    (tmp_path / "trl_lite" / "core").mkdir()
    assert _upward_imports() == [
        "trainer/memory/bad.py -> trl_lite.PPOTrainer",
        "trainer/memory/bad.py -> trl_lite.trainer.ppo_config",
        "trainer/memory/bad.py -> trl_lite.trainer.state.ema",
        "trainer/memory/bad.py -> trl_lite.trainer.step",
    ]


def test_no_room_of_the_trainer_holds_more_than_12_modules():
    rooms = {}
    for path in TRAINER.rglob("*.py"):
        if path.name != "__init__.py":
            rooms.setdefault(_room(path), []).append(path.name)
    assert {room: len(names) for room, names in rooms.items() if len(names) > 12} == {}


def test_every_room_says_what_it_holds_and_what_it_may_import():
    for init in TRAINER.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc, f"{init.relative_to(PACKAGE)} needs a docstring saying what it may import"


def test_the_architecture_page_names_every_module_and_room():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" and f"`{p.name}`" not in page and f"/{p.name}`" not in page]
    rooms = [f"trainer/{p.parent.name}/" for p in TRAINER.glob("*/__init__.py") if f"`trainer/{p.parent.name}/`" not in page]
    assert (missing, rooms) == ([], [])
