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


def pytest_collection_modifyitems(config, items):
    """The multi-process tests launch 2 processes whose devices follow the machine's: on a machine with one GPU
    both would share it (NCCL refuses). They check CPU process groups (gloo), so they are ``cpu_only``."""
    for item in items:
        if item.path.name.startswith("test_distributed"):
            item.add_marker(pytest.mark.cpu_only)
