import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

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
