"""vLLM's own log output while trl_lite runs an engine: errors, and the warnings that change results.

vLLM logs through the ``vllm`` logger at ``VLLM_LOGGING_LEVEL`` (INFO unless set): some forty lines per
engine start, and a traceback from a chat-template warm-up that an engine without a tokenizer cannot
do. :func:`configure_vllm_logging`, called before trl_lite first imports vLLM for an engine (the colocated
engine, the server launcher and the engine processes it spawns), sets that level to WARNING and drops the
warnings of :data:`NOT_ACTIONABLE`: vLLM 0.32's notes on its own set-up, which change nothing that
trl_lite's use of the engine computes. A ``VLLM_LOGGING_LEVEL`` set by the user is left alone, and then
vLLM prints everything at that level (``VLLM_LOGGING_LEVEL=INFO`` shows the engine's set-up again).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import NamedTuple

# The level trl_lite chose, kept beside VLLM_LOGGING_LEVEL so that the processes vLLM spawns (which
# inherit both) tell it from a level the user set.
_CHOSEN_LEVEL = "TRL_LITE_VLLM_LOGGING_LEVEL"
DEFAULT_LEVEL = "WARNING"


class Unactionable(NamedTuple):
    """A vLLM warning that needs nothing from the user: the ``logger`` it comes from, how its message
    (the format string) starts, for a warning with a traceback, text its exception must contain, for a
    warning about one kind of layer, how the first argument of its message (the layer's class) ends, and
    for a warning about some values only, the accepted text of each argument by position (None: any)."""

    logger: str
    message: str
    reason: str
    exception: str | None = None
    argument_suffix: str | None = None
    arguments: tuple[tuple[str, ...] | None, ...] | None = None


NOT_ACTIONABLE = (
    Unactionable("vllm.engine.arg_utils", "The global random seed is set to",
                 "the colocated engine puts the trainer's random state back after it starts"),
    Unactionable("vllm.config.vllm", "Enforce eager set", "eager mode is vllm_enforce_eager's default"),
    Unactionable("vllm.config.vllm", "Inductor compilation was disabled by user settings", "follows from eager mode"),
    Unactionable("vllm.config.vllm", "Model Runner V2 requires Triton", "vLLM runs its V1 model runner instead"),
    Unactionable("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend",
                 "vLLM's CPU kernels do not need Triton"),
    Unactionable("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected",
                 "vLLM's CPU kernels do not need Triton"),
    Unactionable("vllm.platforms.cpu", "Reset SSM cache type to float32", "concerns state-space models only"),
    Unactionable("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD",
                 "speed advice for serving (vLLM's CPU install guide); VLLM_LOGGING_LEVEL=WARNING shows it"),
    Unactionable("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use",
                 "vLLM's CPU worker keeps its thread binding; the thread count stays what it was"),
    Unactionable("vllm.renderers.base", "Using None for EOS token id because tokenizer is not initialized",
                 "trl_lite sends its stop tokens with every request"),
    Unactionable("vllm.renderers.base", "Using None for BOS token id because tokenizer is not initialized",
                 "trl_lite sends token ids, BOS included"),
    Unactionable("vllm.entrypoints.anthropic.serving", "The chat template requires system-first ordering",
                 "concerns the server's /v1/messages chat endpoint, which trl_lite does not use"),
    # vLLM 0.32 warms the chat template up at every start and has no switch to skip it; without a
    # tokenizer (trl_lite's engines send token ids) there is nothing to warm up.
    Unactionable("vllm.renderers.base", "Chat template warmup failed", "no tokenizer, no chat template",
                 exception="skip_tokenizer_init"),
    # At every weight push of a rotary model (Qwen2, Llama, ...): vLLM's layer-wise reload counts the
    # rotary layer's cos/sin cache (a non-persistent buffer computed from the config, in no checkpoint
    # and not loadable by name) as a weight to load, finds none, and puts the cache it had back.
    Unactionable("vllm.model_executor.model_loader.reload.layerwise", "%s: Failed to load weights",
                 "the rotary cos/sin cache is computed from the config; the reload keeps it",
                 argument_suffix="RotaryEmbedding"),
    # At every weight push into a 16-bit engine (vllm_dtype 'bfloat16' or 'float16', or 'auto' under mixed
    # precision) from float32 parameters: one line per norm, embedding and head weight. The engine was asked
    # to run in that dtype; the rounding is the dtype's, and vLLM's start already logged the cast once.
    Unactionable("vllm.model_executor.models.utils", "Attempted to load weight %s with dtype %s into ",
                 "the trainer's float32 weights are rounded to the 16-bit dtype the engine was asked to run in",
                 arguments=(None, ("torch.float32",), ("torch.bfloat16", "torch.float16"))),
)


class _DropUnactionable(logging.Filter):
    """Drops the records of one logger that match an entry of :data:`NOT_ACTIONABLE`."""

    def __init__(self, entries: list[Unactionable]):
        super().__init__()
        self.entries = entries

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        error = str(record.exc_info[1]) if record.exc_info and record.exc_info[1] is not None else ""
        args = [str(arg) for arg in record.args] if isinstance(record.args, tuple) else []
        first = args[0] if args else ""
        return not any(
            message.startswith(entry.message)
            and (entry.exception is None or entry.exception in error)
            and (entry.argument_suffix is None or first.endswith(entry.argument_suffix))
            and (entry.arguments is None or _arguments_match(entry.arguments, args))
            for entry in self.entries
        )


def _arguments_match(accepted: tuple[tuple[str, ...] | None, ...], args: list[str]) -> bool:
    """Whether a message's arguments (as text) are, position by position, among those accepted."""
    return len(args) == len(accepted) and all(ok is None or arg in ok for ok, arg in zip(accepted, args))


def configure_vllm_logging() -> None:
    """Keep vLLM's logging to what a user must act on, unless the user set ``VLLM_LOGGING_LEVEL``.

    Call it before vLLM is imported (its import logs too); calling it again changes nothing.
    """
    level = os.environ.get("VLLM_LOGGING_LEVEL")
    if level is not None and level != os.environ.get(_CHOSEN_LEVEL):
        return
    # Read by vLLM at import and at every engine start, here and in the processes it spawns.
    os.environ["VLLM_LOGGING_LEVEL"] = os.environ[_CHOSEN_LEVEL] = DEFAULT_LEVEL
    logging.getLogger("vllm").setLevel(DEFAULT_LEVEL)  # in case vLLM was imported (and configured) already
    by_logger: dict[str, list[Unactionable]] = {}
    for entry in NOT_ACTIONABLE:
        by_logger.setdefault(entry.logger, []).append(entry)
    for name, entries in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropUnactionable) for f in logger.filters):
            logger.addFilter(_DropUnactionable(entries))
    # vLLM's kernel registry reads every attribute of torch.distributed, a deprecated one included.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.reduce_op` is deprecated", category=FutureWarning,
        module=r"vllm\.triton_utils",
    )  # fmt: skip
