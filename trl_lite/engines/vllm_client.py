"""The vLLM backend of ``vllm_mode='server'``: a client of ``python -m trl_lite.vllm_server``.

Generation goes to vLLM's token-in/token-out endpoint, one request per prompt, sent concurrently
so that the server batches them. A weight push is vLLM's RL update sequence: ``/pause`` (running
requests finish, caches computed with the old weights are dropped), ``/start_weight_update``, one
``/update_weights`` per chunk of tensors (the launcher's ``trl_lite_http`` weight-transfer
backend), ``/finish_weight_update`` and ``/resume``. A chunk is a safetensors file when the server
can read this machine's files (the handshake checks: same machine, shared temporary directory),
else its bytes, base64 in the JSON body - which costs several times longer (encoding, decoding and
copies through vLLM's processes).

A LoRA policy's adapter (:mod:`.lora_sync`; the server launched with ``--max-lora-rank``) travels
as a PEFT adapter directory written in that shared directory and loaded with vLLM's
``/v1/load_lora_adapter`` under a new name per version; the previous version is unloaded, and
generation requests name the current one.

Every request has ``timeout`` seconds to answer: a server that is gone or stuck raises an error
naming its URL, never a hang.
"""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property

import requests
import torch
from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file

from .lora_sync import write_peft_adapter

# The launcher's weight-transfer backend and the chunk encoding both sides agree on.
WEIGHT_TRANSFER_BACKEND = "trl_lite_http"
WEIGHT_TRANSFER_PROTOCOL = "trl_lite-safetensors-chunks/1"  # a file path or base64 bytes per chunk


class VLLMServerClient:
    """Generates on, and pushes weights to, a vLLM server started with ``python -m trl_lite.vllm_server``.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        timeout: seconds each request may take, and how long construction waits for the server
            to come up (a server started together with the trainer needs its start-up time).
        chunk_bytes: weight bytes per ``/update_weights`` request (a larger tensor goes alone).
        max_concurrency: generation requests in flight at once.
    """

    def __init__(self, base_url: str, timeout: float, chunk_bytes: int = 64 << 20, max_concurrency: int = 64):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}.")
        for name, value in (("timeout", timeout), ("chunk_bytes", chunk_bytes), ("max_concurrency", max_concurrency)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}.")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.chunk_bytes = int(chunk_bytes)
        self.max_concurrency = int(max_concurrency)
        self._session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=self.max_concurrency)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._pushes = 0
        self._adapter = None  # (name, directory) of the adapter generation runs with
        self._adapter_versions = 0
        self._wait_until_up()
        self.shared_dir = self._handshake()

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                if self._session.get(f"{self.base_url}/health", timeout=max(0.1, min(5.0, remaining))).ok:
                    return
            except requests.RequestException:
                pass  # not up yet: connection refused, or still starting
            if time.monotonic() + 1.0 > deadline:
                raise ConnectionError(
                    f"no vLLM server answered at {self.base_url} within {self.timeout:g} s (vllm_server_timeout). "
                    "Start one with `python -m trl_lite.vllm_server --model <dir> --port <port>` "
                    "or fix vllm_server_url."
                )
            time.sleep(1.0)

    def _handshake(self) -> str | None:
        """Agree on how chunks travel; returns the directory of chunk files the server reads, or None
        (chunks inline). A server started without the trl_lite_http backend (plain ``vllm serve``,
        NCCL) refuses both offers."""
        shared_dir = tempfile.mkdtemp(prefix="trl_lite_weights_")
        token = secrets.token_hex(16)
        self._write_probe(os.path.join(shared_dir, "probe"), token)
        offer = {"protocol": WEIGHT_TRANSFER_PROTOCOL, "shared_dir": shared_dir, "probe_token": token}
        try:
            # A refusal is an exception in the server, after which it drops the connection: use a new one.
            self._post("/init_weight_transfer_engine", what="a shared-directory handshake", json={"init_info": offer},
                       headers={"Connection": "close"})  # fmt: skip
            return shared_dir
        except RuntimeError:  # another machine (or container): its files are not ours
            shutil.rmtree(shared_dir, ignore_errors=True)
        self._post("/init_weight_transfer_engine", json={"init_info": {"protocol": WEIGHT_TRANSFER_PROTOCOL}},
                   what="the weight-transfer handshake (is it `python -m trl_lite.vllm_server`?)")  # fmt: skip
        return None

    @staticmethod
    def _write_probe(path: str, token: str) -> None:
        with open(path, "w") as f:
            f.write(token)

    def _post(self, path: str, what: str, **kwargs) -> dict:
        url = f"{self.base_url}{path}"
        try:
            response = self._session.post(url, timeout=self.timeout, **kwargs)
        except requests.Timeout as error:
            raise TimeoutError(
                f"the vLLM server at {self.base_url} did not answer {path} ({what}) within {self.timeout:g} s "
                "(vllm_server_timeout)."
            ) from error
        except requests.ConnectionError as error:
            raise ConnectionError(f"lost the vLLM server at {self.base_url} during {path} ({what}): {error}") from error
        if not response.ok:
            raise RuntimeError(
                f"the vLLM server at {url} refused {what}: HTTP {response.status_code}: {response.text[:2000]}"
            )
        # JSON, except vLLM's adapter endpoints, which answer in plain text.
        return response.json() if "json" in response.headers.get("content-type", "") else {}

    def generate(self, prompts: list[list[int]], sampling_params: list[dict]) -> list[list[tuple]]:
        """Per prompt its ``n`` completions as ``(token ids, log-probs of exactly those tokens or None)``.

        ``sampling_params``: one dict of ``vllm.SamplingParams`` arguments per prompt (JSON values).
        """

        def one(prompt, params):
            request = {"token_ids": prompt, "sampling_params": params}
            if self._adapter is not None:
                request["model"] = self._adapter[0]
            body = self._post("/inference/v1/generate", what="generate", json=request)
            answers = []
            for choice in sorted(body["choices"], key=lambda c: c["index"]):
                tokens = list(choice["token_ids"])
                logprobs = None
                if params.get("logprobs") is not None:
                    steps = (choice.get("logprobs") or {}).get("content") or []
                    if [s["token_id"] for s in steps] != tokens:
                        raise RuntimeError(
                            f"the vLLM server at {self.base_url} returned log-probs that do not match its tokens."
                        )
                    logprobs = [s["logprob"] for s in steps]
                answers.append((tokens, logprobs))
            return answers

        if len(prompts) != len(sampling_params):
            raise ValueError(
                f"sampling_params must hold one dict per prompt: {len(prompts)} prompts, {len(sampling_params)} dicts."
            )
        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=min(len(prompts), self.max_concurrency)) as pool:
            return list(pool.map(one, prompts, sampling_params))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the served weights (transformers ``state_dict`` names), chunk by chunk; generation
        waits meanwhile. Tensors are copied as they are read (safe for ZeRO-3's one-at-a-time gathers)."""
        self._post("/pause", what="pausing for a weight push", params={"mode": "wait"})
        try:
            self._post("/start_weight_update", what="a weight push")
            for index, chunk in enumerate(self._chunks(named_tensors)):
                self._send_chunk(index, chunk)
            self._pushes += 1
            self._post("/finish_weight_update", what="a weight push", json={"weight_version": str(self._pushes)})
        finally:
            self._post("/resume", what="resuming after a weight push")

    def _send_chunk(self, index: int, chunk: dict[str, torch.Tensor]) -> None:
        if self.shared_dir is not None:
            path = os.path.join(self.shared_dir, f"chunk-{index}.safetensors")
            save_file(chunk, path)
            try:
                self._post("/update_weights", what="a weight chunk", json={"update_info": {"path": path}})
            finally:
                os.remove(path)
            return
        payload = base64.b64encode(save_safetensors(chunk)).decode("ascii")
        # Written by hand: base64 needs no escaping, and json.dumps would scan every character.
        body = '{"update_info": {"safetensors_base64": "' + payload + '"}}'
        self._post("/update_weights", what="a weight chunk", data=body, headers={"Content-Type": "application/json"})

    def _chunks(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        chunk, size = {}, 0
        for name, tensor in named_tensors:
            # A copy: safetensors refuses tensors sharing memory (tied embeddings), and a ZeRO-3
            # gather is released once the iterator moves on.
            chunk[name] = tensor.detach().to("cpu", copy=True).contiguous()
            size += chunk[name].numel() * chunk[name].element_size()
            if size >= self.chunk_bytes:
                yield chunk
                chunk, size = {}, 0
        if chunk:
            yield chunk

    def _server_config(self) -> dict:
        """The server's vLLM configuration (``/server_info``, JSON)."""
        url = f"{self.base_url}/server_info"
        try:
            response = self._session.get(url, params={"config_format": "json"}, timeout=self.timeout)
        except requests.RequestException as error:
            raise ConnectionError(f"lost the vLLM server at {self.base_url} during /server_info: {error}") from error
        if not response.ok:
            raise RuntimeError(f"the vLLM server at {url} refused its configuration: HTTP {response.status_code}.")
        return response.json().get("vllm_config") or {}

    def max_lora_rank(self) -> int | None:
        """The largest adapter rank the server serves; None when it was launched without LoRA."""
        lora = self._server_config().get("lora_config")
        return None if not lora else int(lora["max_lora_rank"])

    @cached_property
    def logprobs_mode(self) -> str:
        """What the server's log-probs are (vLLM's ``--logprobs-mode``, fixed at its launch; docs/temperature.md)."""
        return (self._server_config().get("model_config") or {}).get("logprobs_mode", "raw_logprobs")

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config) -> None:
        """Load a new adapter version (PEFT names, ``LoraConfig``) from the shared directory under a new
        name, then unload the previous one; generation waits meanwhile."""
        if self.shared_dir is None:
            raise RuntimeError(f"the vLLM server at {self.base_url} cannot read this machine's files: no adapter push.")
        self._adapter_versions += 1
        name = f"trl_lite-policy-{self._adapter_versions}"
        directory = os.path.join(self.shared_dir, f"adapter-{self._adapter_versions}")
        write_peft_adapter(directory, named_tensors, config)
        self._post("/pause", what="pausing for an adapter push", params={"mode": "wait"})
        try:
            body = {"lora_name": name, "lora_path": directory}
            self._post("/v1/load_lora_adapter", what="an adapter push", json=body)
            previous, self._adapter = self._adapter, (name, directory)
            if previous is not None:
                self._post("/v1/unload_lora_adapter", what="unloading the previous adapter",
                           json={"lora_name": previous[0]})  # fmt: skip
                shutil.rmtree(previous[1], ignore_errors=True)
        finally:
            self._post("/resume", what="resuming after an adapter push")

    def close(self) -> None:
        """Close the connections; the server keeps running (it is the user's process)."""
        self._session.close()
        if self.shared_dir is not None:
            shutil.rmtree(self.shared_dir, ignore_errors=True)


__all__ = ["VLLMServerClient", "WEIGHT_TRANSFER_BACKEND", "WEIGHT_TRANSFER_PROTOCOL"]
