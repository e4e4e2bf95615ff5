"""trl_lite.engines.vllm_logging: vLLM's level, the warnings it drops and keeps, the user's own level."""

import importlib.util
import logging
import os

import pytest
import torch

from trl_lite.engines import vllm_logging
from trl_lite.engines.vllm_logging import NOT_ACTIONABLE, configure_vllm_logging

FILTERED = sorted({entry.logger for entry in NOT_ACTIONABLE})
LOGGERS = ["vllm", *FILTERED]


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def clean_logging(monkeypatch):
    """No level chosen and no filter installed yet (an engine built earlier in this process may have done
    both); the loggers' filters and levels put back afterwards."""
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv(vllm_logging._CHOSEN_LEVEL, raising=False)
    saved = {name: (list(logging.getLogger(name).filters), logging.getLogger(name).level) for name in LOGGERS}
    for name in FILTERED:
        logger = logging.getLogger(name)
        logger.filters[:] = [f for f in logger.filters if not isinstance(f, vllm_logging._DropUnactionable)]
    yield
    for name, (filters, level) in saved.items():
        logging.getLogger(name).filters[:] = filters
        logging.getLogger(name).setLevel(level)


def passes(logger_name: str, message: str, *args, exc_info=None) -> bool:
    """Whether a WARNING record of `message` on `logger_name` gets past that logger's filters."""
    logger = logging.getLogger(logger_name)
    recorder = Recorder()
    logger.addHandler(recorder)
    try:
        logger.warning(message, *args, exc_info=exc_info)
    finally:
        logger.removeHandler(recorder)
    return bool(recorder.records)


def exception(message: str):
    try:
        raise ValueError(message)
    except ValueError as error:
        return (ValueError, error, error.__traceback__)


def test_default_level_is_warning_without_the_unactionable_warnings(clean_logging):
    configure_vllm_logging()
    configure_vllm_logging()  # a second engine changes nothing
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert logging.getLogger("vllm").level == logging.WARNING
    for name in FILTERED:
        assert sum(isinstance(f, vllm_logging._DropUnactionable) for f in logging.getLogger(name).filters) == 1

    worker = "vllm.v1.worker.cpu_worker"
    assert not passes(worker, "%s is not found in LD_PRELOAD. For best performance, ...", "libtcmalloc")
    assert not passes(worker, "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding")
    assert passes(worker, "sleep mode is not supported on CPU, ignore it.")  # not on the list: kept
    assert passes("vllm.engine.arg_utils", "Casting torch.float32 to torch.bfloat16.")
    assert passes("vllm.some.other.module", "The global random seed is set to 0.")  # listed for arg_utils only


def test_the_warmup_traceback_is_dropped_only_when_there_is_no_tokenizer(clean_logging):
    configure_vllm_logging()
    renderer = "vllm.renderers.base"
    no_tokenizer = exception("Tokenizer not available when `skip_tokenizer_init=True`")
    assert not passes(renderer, "Chat template warmup failed", exc_info=no_tokenizer)
    assert passes(renderer, "Chat template warmup failed", exc_info=exception("template syntax error"))
    assert passes(renderer, "Chat template warmup failed")


def test_only_float32_weights_rounded_into_a_16_bit_engine_are_dropped(clean_logging):
    configure_vllm_logging()
    utils = "vllm.model_executor.models.utils"
    message = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    assert not passes(utils, message, "model.norm.weight", torch.float32, torch.bfloat16)
    assert not passes(utils, message, "lm_head.weight", torch.float32, torch.float16)
    # Any other mismatch is not what the engine's dtype asked for: kept.
    assert passes(utils, message, "model.norm.weight", torch.float16, torch.bfloat16)
    assert passes(utils, message, "model.norm.weight", torch.bfloat16, torch.float16)
    assert passes(utils, message, "model.norm.weight", torch.float64, torch.float32)
    assert passes(utils, "Loaded an unexpected weight %s", "lm_head.weight")


def test_a_level_the_user_set_is_left_alone(clean_logging, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    configure_vllm_logging()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    assert passes("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD.", "libiomp")


def test_a_spawned_engine_process_applies_the_level_its_parent_chose(clean_logging, monkeypatch):
    # What a process vLLM spawns inherits from a parent that called configure_vllm_logging().
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv(vllm_logging._CHOSEN_LEVEL, "WARNING")
    configure_vllm_logging()
    assert not passes("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs.")


@pytest.mark.parametrize("entry", NOT_ACTIONABLE, ids=lambda entry: f"{entry.logger}:{entry.message[:30]}")
@pytest.mark.requires("vllm")
def test_every_dropped_warning_is_still_what_the_installed_vllm_logs(entry):
    # A vLLM upgrade that rewords or moves a message shows here, not as noise in users' output.
    source = open(importlib.util.find_spec(entry.logger).origin).read()
    assert entry.message in source
    assert entry.reason
