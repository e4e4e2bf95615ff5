"""The package layout: classic import paths still lead to the moved parts, and no package imports in a circle."""

import ast
import importlib
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


def test_the_trainer_imports_no_package_that_uses_it():
    for path in (PACKAGE / "trainer").rglob("*.py"):
        assert not _imported_packages(path) & {"agents", "rollouts", "environment", "extras"}, path.name


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
