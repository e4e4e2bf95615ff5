"""Server mode on the loopback address: ``python -m trl_lite.vllm_server`` started as a subprocess with
a saved tiny GPT-2 (64 wide, 2 heads: vLLM's CPU attention needs a head size of at least 32), a
trainer with ``vllm_mode='server'`` generating on it - greedy tokens equal transformers' before and
after steps (the HTTP weight push works, once and lazily), sampled log-probs equal a float64
recomputation - weight chunks as files (same machine) or inline (a server that cannot read our files),
and errors naming the URL for a server that is not there, stuck, or lost.

Not covered here (needs GPUs): vLLM's NCCL weight transfer, which the trainer does not use (pushes
go over HTTP on every machine), and a server on a GPU.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
import torch
from engine_checks import assert_sampled_rows_and_logprobs
from tiny_models import make_gpt2, make_tokenizer

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.engines import VLLMEngine, named_policy_weights
from trl_lite.engines.vllm_client import VLLMServerClient
from trl_lite.vllm_server import parse_args, vllm_serve_args

# One worker runs the module in file order: one server, started once, lost in the last test.
pytestmark = pytest.mark.xdist_group("vllm_server")

EOS = 1
QUERIES = [torch.tensor(q) for q in ([5, 6, 7, 8, 9], [10], [11, 12, 13], [14, 15], [16, 17, 18, 19], [20, 21])]
STARTUP_LIMIT_S = 600  # a fresh vLLM server on 2 busy cores took about a minute


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served_gpt2")
    make_gpt2(seed=1, n_embd=64).save_pretrained(path)
    return path


@contextlib.contextmanager
def launched_server(model_dir, log, max_model_len: int, launcher_args: tuple[str, ...] = (),
                    serve_args: tuple[str, ...] = ()):  # fmt: skip
    """``python -m trl_lite.vllm_server`` on ``model_dir`` (and ``launcher_args``; ``serve_args`` after ``--``) in
    its own session (its engine processes die with it), its output in ``log``; yields ``(url, process)`` once it
    answers ``/health``, and stops it after."""
    port = free_port()
    command = [sys.executable, "-m", "trl_lite.vllm_server", "--model", str(model_dir), "--port", str(port),
               "--kv-cache-gb", "1", *launcher_args, "--", "--max-model-len", str(max_model_len), *serve_args]  # fmt: skip
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_LIMIT_S
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"the launcher exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the launcher did not come up in {STARTUP_LIMIT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url, process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """The launcher on the saved model; yields (url, process)."""
    with launched_server(model_dir, tmp_path_factory.mktemp("server_log") / "server.log", 64) as running:
        yield running


@pytest.fixture(scope="module")
def trainer(server):
    url, _ = server
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=2, n_embd=64))  # not the served weights
    config = PPOConfig(
        batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=5e-2, advantage_estimator="grpo",
        num_samples_per_query=2, use_vllm=True, vllm_mode="server", vllm_server_url=url, vllm_server_timeout=120,
    )  # fmt: skip
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer())
    # Pushes of many requests (about one tensor each): vLLM's layer-wise reload must span them.
    trainer.generation.engine.backend.chunk_bytes = 1 << 12
    yield trainer
    trainer.generation.close()


def transformers_greedy(lm, query, max_new_tokens):
    """Greedy tokens of ``lm`` for one query, one token at a time, stopped after EOS."""
    tokens = query.tolist()
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens.append(int(lm(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
            if tokens[-1] == EOS:
                break
    return tokens[len(query) :]


def test_launcher_serves_the_saved_dtype_on_loopback_and_passes_the_rest_to_vllm(model_dir, tmp_path):
    args, extra = parse_args(["--model", str(model_dir), "--", "--max-model-len", "64", "--seed", "3"])
    command = vllm_serve_args(args, extra)
    assert command[command.index("--dtype") + 1] == "float32"  # vLLM's own 'auto' would pick bfloat16 on CPU
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[-4:] == ["--max-model-len", "64", "--seed", "3"]
    assert "--enforce-eager" in command and "--skip-tokenizer-init" in command
    half = make_gpt2(seed=0, n_embd=64).to(torch.bfloat16)
    half.save_pretrained(tmp_path)
    command = vllm_serve_args(*parse_args(["--model", str(tmp_path), "--no-enforce-eager", "--dtype", "auto"]))
    assert command[command.index("--dtype") + 1] == "bfloat16" and "--enforce-eager" not in command
    with pytest.raises(SystemExit):
        parse_args(["--model", str(model_dir), "--kv-cache-gb", "0"])


def test_client_refuses_bad_arguments_before_connecting():
    with pytest.raises(ValueError, match="base_url must be an http"):
        VLLMServerClient("127.0.0.1:8000", 5)
    with pytest.raises(ValueError, match="timeout must be a positive number, got 0"):
        VLLMServerClient("http://127.0.0.1:8000", 0)


def test_no_server_at_the_url_raises_an_error_naming_it():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=f"no vLLM server answered at {url} within 2 s"):
        VLLMServerClient(url, 2)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=0, n_embd=64))
    config = PPOConfig(batch_size=2, mini_batch_size=2, use_vllm=True, vllm_mode="server", vllm_server_url=url,
                       vllm_server_timeout=2)  # fmt: skip
    with pytest.raises(ConnectionError, match=url):
        PPOTrainer(config, model, tokenizer=make_tokenizer())


def test_greedy_equals_transformers_before_and_after_steps_and_weights_are_pushed_once(trainer):
    lm = trainer.model.pretrained_model.eval()
    before = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=8, do_sample=False)
    # The trainer pushed its own weights at start: the server's saved model (seed 1) is not what it serves.
    assert [r.tolist() for r in before] == [transformers_greedy(lm, q, 8) for q in QUERIES]
    for step in range(2):
        queries = [QUERIES[i] for i in (0, 0, 2, 2)]
        responses = trainer.generate(queries[::2], return_prompt=False, max_new_tokens=6, do_sample=True,
                                     num_return_sequences=2, seed=step)  # fmt: skip
        scores = [torch.tensor(float(i % 2)) for i in range(4)]  # unequal within each group: a real update
        stats = trainer.step(queries, [r if len(r) else torch.tensor([3]) for r in responses], scores)
        assert ("time/rollout/weight_sync" in stats) == (step == 1)  # the push before step 1's generate
    after = trainer.generate(QUERIES, return_prompt=False, max_new_tokens=8, do_sample=False)
    assert [r.tolist() for r in after] == [transformers_greedy(lm, q, 8) for q in QUERIES]
    assert [r.tolist() for r in after] != [r.tolist() for r in before]  # the steps changed the policy


def test_sampled_rows_and_their_logprobs_match_a_float64_recomputation(trainer):
    lm = trainer.model.pretrained_model.eval()
    k, new = 3, 10
    rows, logprobs = trainer.generate(QUERIES, return_prompt=True, max_new_tokens=new, do_sample=True,
                                      temperature=1.0, top_k=0, num_return_sequences=k, return_logprobs=True)  # fmt: skip
    assert_sampled_rows_and_logprobs(rows, logprobs, lm, QUERIES, k, new, EOS)


def test_a_server_that_cannot_read_our_files_gets_the_chunks_inline(server, trainer, monkeypatch):
    url, _ = server
    lm = trainer.model.pretrained_model.eval()
    assert trainer.generation.engine.backend.shared_dir is not None  # same machine: the trainer sends files

    def foreign_probe(path, token):  # what the server finds at that path is not what we sent
        with open(path, "w") as f:
            f.write("another machine's file")

    monkeypatch.setattr(VLLMServerClient, "_write_probe", staticmethod(foreign_probe))
    client = VLLMServerClient(url, 60, chunk_bytes=1 << 12)
    assert client.shared_dir is None
    changed = type(lm)(lm.config).eval()
    torch.manual_seed(0)  # a change that moves the greedy rows, whatever ran before in this process
    changed.load_state_dict({name: t + 0.05 * torch.randn_like(t) for name, t in lm.state_dict().items()})
    engine = VLLMEngine(client, EOS, 0, lm.generation_config)
    try:
        engine.load_weights(named_policy_weights(changed))
        rows, _ = engine.generate(QUERIES, {"max_new_tokens": 8, "do_sample": False}, None, 1, False, True, False)
        assert [r.tolist() for r in rows] == [transformers_greedy(changed, q, 8) for q in QUERIES]
        assert [r.tolist() for r in rows] != [transformers_greedy(lm, q, 8) for q in QUERIES]
    finally:
        engine.load_weights(named_policy_weights(lm))  # the trainer's weights back, for the tests after this one
        client.close()


def test_the_handshake_refuses_another_weight_encoding(server):
    url, _ = server
    client = VLLMServerClient(url, 30)
    with pytest.raises(RuntimeError, match=f"the vLLM server at {url}/init_weight_transfer_engine refused"):
        client._post("/init_weight_transfer_engine", what="a handshake", json={"init_info": {"protocol": "nccl"}})
    client.close()


def test_a_stuck_server_raises_a_timeout_naming_its_url(server):
    url, process = server
    client = VLLMServerClient(url, 3)
    os.kill(process.pid, signal.SIGSTOP)  # the API server stops answering; connections still open
    try:
        with pytest.raises(TimeoutError, match=f"the vLLM server at {url} did not answer /inference/v1/generate"):
            client.generate([[5, 6]], [{"max_tokens": 2, "temperature": 0.0, "detokenize": False}])
    finally:
        os.kill(process.pid, signal.SIGCONT)
        client.close()


def test_a_lost_server_raises_an_error_naming_its_url(server, trainer):
    """Last: stops the module's server."""
    url, process = server
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=120)
    with pytest.raises(ConnectionError, match=f"lost the vLLM server at {url}"):
        trainer.generate(QUERIES[:2], max_new_tokens=2, do_sample=False)
