"""Time `PPOTrainer.step()` on named workloads next to the compute floor of the same work.

The floor is a hand-written PPO step on plain transformers that does only the model work no PPO
step can avoid: a policy and a reference forward without grad over the batch, then, for each of
`ppo_epochs` epochs, forward + backward + Adam step per mini-batch, with the LM head applied only
where a response token is predicted and every mini-batch padded to its own longest row. It uses
the cheapest forms of that work that stock PyTorch offers (fused Adam, a cache-sized chunked
log-softmax, glibc keeping freed memory - applied when the floor is built, where the trainer applies
`PPOConfig.keep_freed_cpu_memory` to itself), so the comparison measures overhead, not different
kernels or allocator settings.

Each (workload, method) runs in a fresh subprocess so that peak memory is measured alone:
see `benchmarks/README.md` for how time, tokens/s and peak memory are defined.

Usage:
    python benchmarks/bench_step.py [--workloads w1 w2 sweep] [--steps 3] [--warmup 1]
        [--device cpu|cuda] [--dtype fp32|bf16] [--methods step floor floor-packed] [--threads N]
        [--peak-gflops G] [--output benchmarks/RESULTS.md]
"""

import argparse
import copy
import ctypes
import dataclasses
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULT_MARKER = "BENCH_RESULT "
METHODS = ("step", "step-padded", "floor")
# Methods only some workloads have, never run by default: "step-every-pass" (grpo-beta0) forces both passes;
# "step-one-buffer" (the value-head workloads) is "step" with lm_head_chunk_size=0, the LM head's path before
# issue 42: one (tokens x vocabulary) buffer per pass, whatever its size.
EXTRA_METHODS = ("step-every-pass", "step-one-buffer")
# The critic-free workloads (`shared_prefix`) stepped with PPOConfig.prefix_sharing True, False and None (automatic):
# docs/prefix_sharing.md. They report the share of the step's tokens the passes ran (`tokens run`).
PREFIX_METHODS = {"step-prefix-on": True, "step-prefix-off": False, "step-prefix-auto": None}
# The floor over packed mini-batches with the trainer's packed attention (one varlen kernel call per
# layer on CUDA): "step vs floor-packed" compares the same attention on both sides. Default on CUDA.
PACKED_FLOOR = "floor-packed"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Classic PPO defaults (the same values PPOConfig uses), written here so the floor needs no trl_lite.
LEARNING_RATE = 1.41e-5
KL_COEF = 0.2
GAMMA = 1.0
LAM = 0.95
CLIPRANGE = 0.2
CLIPRANGE_VALUE = 0.2
VF_COEF = 0.1


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark shape: a random-init GPT-2 and a PPO batch of random token ids."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    batch_size: int
    mini_batch_size: int
    ppo_epochs: int
    query_len: tuple = (8, 16)
    response_len: tuple = (16, 32)
    vocab_size: int = 50257
    seed: int = 0
    # PPOConfig fields of the trainer's runs, as JSON (the objective workloads: docs/algorithm.md sections 13-15);
    # "generation_logprobs": true passes step() engine log-probs (the policy's own, shifted by 0.05).
    options: str = "{}"


W1 = Workload("w1", n_layer=2, n_embd=128, n_head=2, batch_size=16, mini_batch_size=4, ppo_epochs=4)
# w1 with each option of docs/algorithm.md sections 13-15: what the option costs per step.
OBJECTIVE_OPTIONS = {
    "clip-higher": {"cliprange_high": 0.28},
    "dual-clip": {"dual_clip": 3.0},
    "gspo": {"importance_sampling_level": "sequence"},
    "seq-mean-token-mean": {"loss_type": "seq_mean_token_mean"},
    "dr-grpo": {"loss_type": "seq_mean_token_sum_norm", "max_response_length": 32},
    "global-token-mean": {"loss_type": "global_token_mean"},
    "entropy-bonus": {"entropy_coef": 0.01},
    "shaping": {"missing_eos_penalty": 1.0, "max_response_length": 32, "overlong_buffer_len": 8},
    "tis": {"importance_sampling_correction": "tis", "generation_logprobs": True},
}
W2 = Workload("w2", n_layer=12, n_embd=768, n_head=12, batch_size=8, mini_batch_size=4, ppo_epochs=2)


def sweep_workloads() -> list:
    """The w1 model as batch size doubles (4 mini-batches each), then as response length doubles."""
    by_batch = [
        dataclasses.replace(W1, name=f"sweep-b{b}", batch_size=b, mini_batch_size=b // 4) for b in (4, 8, 16, 32)
    ]
    by_length = [dataclasses.replace(W1, name=f"sweep-r{r}", response_len=(r // 2, r)) for r in (16, 32, 64, 128)]
    return by_batch + by_length


# --- w3 and achieved FLOP/s (issue 16) ---------------------------------------------------------
# GPT-2 small with the length spread of real RLHF responses: padding each mini-batch to its longest
# row makes a large share of the body's work padding, which the packed step does not compute.
W3 = Workload(
    "w3", n_layer=12, n_embd=768, n_head=12, batch_size=16, mini_batch_size=4, ppo_epochs=2,
    query_len=(16, 64), response_len=(16, 256),
)  # fmt: skip


# --- long: rows of very different lengths, in passes by token budget (issue 36) --------------------
@dataclasses.dataclass(frozen=True)
class LongWorkload(Workload):
    """`Workload` whose rows `long_rows` (spread through the batch) get responses drawn from `long_len`:
    a few long rows among many short ones, the case a token budget is for (docs/algorithm.md section 18)."""

    long_rows: int = 4
    long_len: tuple = (4096, 8192)


def long_workloads(scale: int = 1) -> list:
    """GPT-2 small (12 layers; ``scale > 1``: 2 layers, every length divided by ``scale``), 16 rows of responses
    256-8192 tokens, 4 of them 4096-8192 long, one PPO epoch, one optimizer step (16 rows of accumulation):

    - `-rows4`, `-rows1`: the row split, 4 rows and 1 row per pass;
    - `-budget`: passes of at most `T` = the longest possible row's tokens (`max_tokens_per_minibatch`);
    - `-one-pass`: a step over one row of `T` tokens: the peak of one pass of the budget, the reference
      the budget's peak is held to (within 1.25x).
    """
    name = "long" if scale == 1 else f"long-small{scale}"
    query, short, long = (16 // scale, 64 // scale), (256 // scale, 1024 // scale), (4096 // scale, 8192 // scale)
    budget = query[1] + long[1]
    base = LongWorkload(
        name, n_layer=12 if scale == 1 else 2, n_embd=768, n_head=12, batch_size=16, mini_batch_size=4, ppo_epochs=1,
        query_len=query, response_len=short, long_len=long,
    )  # fmt: skip

    def variant(suffix: str, mini_batch_size: int, **options):
        options = {"gradient_accumulation_steps": base.batch_size // mini_batch_size, **options}
        return dataclasses.replace(base, name=f"{name}-{suffix}", mini_batch_size=mini_batch_size, options=json.dumps(options))

    one_pass = dataclasses.replace(
        base, name=f"{name}-one-pass", batch_size=1, mini_batch_size=1, long_rows=1, query_len=(query[1], query[1]),
        long_len=(long[1], long[1]),
    )  # fmt: skip
    return [
        variant("rows4", mini_batch_size=4),
        variant("rows1", mini_batch_size=1),
        variant("budget", mini_batch_size=4, max_tokens_per_minibatch=budget),
        one_pass,
    ]


def needed_flops(workload: Workload) -> float:
    """Floating-point operations of the model work one PPO step on the workload's batch needs.

    Per row of T = query + response tokens, R of them response tokens, a forward needs
    2 W T per layer for its matrix products of W weights (`layer_matmul_weights`: 12 d^2 for GPT-2;
    2 FLOPs per multiply-add), 2 d T(T+1) per layer for causal attention (Q K^T and the weighted sum of V,
    each over the T(T+1)/2 pairs a token may see: no padding, no other rows), 2 d V R for the LM head
    at the R positions that predict a response token, and 2 d T for the value head. A backward costs
    twice its forward. The step is a policy and a reference forward without grad, then
    `ppo_epochs` x (forward + backward) of the policy. Embedding look-ups, layer norms, softmax and
    the optimizer are left out (linear in the parameter or token count, a few percent here).
    """
    d, layers, vocab = workload.n_embd, workload.n_layer, workload.vocab_size
    queries, responses, _ = make_batch(workload)
    per_token = 2 * layer_matmul_weights(workload)
    forward = 0.0
    for q, r in zip(queries, responses):
        t, n = len(q) + len(r), len(r)
        forward += layers * (per_token * t + 2 * d * t * (t + 1)) + 2 * d * vocab * n + 2 * d * t
    return forward * (2 + 3 * workload.ppo_epochs)


def layer_matmul_weights(workload: Workload) -> int:
    """Weights of one layer's matrix products (each token multiplies each once): GPT-2's 12 d^2
    (QKV 3 d^2, output projection d^2, MLP 8 d^2); a Qwen2 layer's query and output projections
    2 d^2, key and value projections onto its grouped heads 2 d (d / heads x kv_heads), and gated
    MLP 3 d x intermediate."""
    d = workload.n_embd
    if isinstance(workload, Qwen2Workload):
        kv_dim = d // workload.n_head * workload.n_kv_head
        return 2 * d * d + 2 * d * kv_dim + 3 * d * workload.intermediate_size
    return 12 * d * d


def matmul_peak_gflops(seconds: float = 2.0) -> float:
    """This machine's fp32 matrix-product rate now (GFLOP/s): the best of repeated 1536^3 products.

    The best run is the estimate: on a shared machine other work only ever slows a run down.
    """
    a, b = torch.randn(1536, 1536), torch.randn(1536, 1536)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * 1536**3 / (time.perf_counter() - t0) / 1e9)
    return best


# --- end of w3 block ------------------------------------------------------------------------------

# --- w4: a 0.5B-class model at GPU scale (issue 33) -----------------------------------------------
@dataclasses.dataclass(frozen=True)
class Qwen2Workload(Workload):
    """A workload on a random-init Qwen2 (grouped key/value heads, gated MLP, tied embeddings).

    ``n_kv_head``: key/value heads; ``intermediate_size``: the MLP's width; ``response_spread``:
    "log-uniform" draws response lengths with a uniform logarithm (many short responses, a few long
    ones, as sampled RLHF responses are spread), "uniform" as the GPT-2 workloads.
    """

    n_kv_head: int = 2
    intermediate_size: int = 4864
    response_spread: str = "log-uniform"


# Qwen2-0.5B's shape (its config, built locally: no weights are downloaded); 64 rows per step. Its
# numbers come from a GPU (bf16 weights): never run it full-size on a CPU.
W4 = Qwen2Workload(
    "w4", n_layer=24, n_embd=896, n_head=14, n_kv_head=2, intermediate_size=4864, vocab_size=151936,
    batch_size=64, mini_batch_size=16, ppo_epochs=2, query_len=(64, 256), response_len=(64, 1024),
)  # fmt: skip
# The dense bf16 peak of an H100 SXM (TFLOP/s x 1000): the default "x peak" (MFU) reference on CUDA.
H100_BF16_PEAK_GFLOPS = 989_000.0


def make_qwen2(workload: Qwen2Workload, device: str, dtype: torch.dtype):
    """A random-init Qwen2ForCausalLM of the workload's shape, without dropout."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    last_id = workload.vocab_size - 1
    config = Qwen2Config(
        vocab_size=workload.vocab_size, hidden_size=workload.n_embd, intermediate_size=workload.intermediate_size,
        num_hidden_layers=workload.n_layer, num_attention_heads=workload.n_head,
        num_key_value_heads=workload.n_kv_head, tie_word_embeddings=True, rms_norm_eps=1e-6, attention_dropout=0.0,
        max_position_embeddings=max(2048, workload.query_len[1] + workload.response_len[1]),
        bos_token_id=last_id, eos_token_id=last_id, pad_token_id=last_id,
    )  # fmt: skip
    torch.manual_seed(workload.seed)
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype)


# --- end of w4 block ------------------------------------------------------------------------------

# --- vocab: the LM head dominates (issue 42) ------------------------------------------------------
# Qwen2's vocabulary on a 2-layer model of hidden size 64 with long responses: a pass's float32
# (tokens x vocabulary) logits (about 1.2 GB for its one mini-batch of 2 rows of up to 1024 response tokens) dwarf
# the model, its gradients and Adam state, so "step" (the default: chunks above 256 MiB on CPU) against
# "step-one-buffer" measures what the chunked head saves and costs.
VOCAB = Qwen2Workload(
    "vocab", n_layer=2, n_embd=64, n_head=2, n_kv_head=1, intermediate_size=128, vocab_size=151936,
    batch_size=2, mini_batch_size=2, ppo_epochs=1, query_len=(16, 32), response_len=(512, 1024),
    response_spread="uniform",
)  # fmt: skip
# --- end of vocab block ---------------------------------------------------------------------------

# --- smollm2: a real pretrained model (issue 51) --------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SmolLM2Workload(Qwen2Workload):
    """SmolLM2-135M-Instruct's real weights (a Llama: Qwen2's layer shape, so its FLOP count), float32, built by
    benchmarks/smollm2_workload.py; the shape fields must match its config. Token ids are random, as elsewhere."""

    pretrained: str = "SmolLM2-135M-Instruct"


# 8 rows of 24-40 + 24-40 tokens in mini-batches of 4, 2 PPO epochs (w2's batch plan, so two updates per
# mini-batch row): about 10-20 s a step on this machine's CPU, and the rollout passes weigh as in classic runs.
SMOLLM2 = SmolLM2Workload(
    "smollm2", n_layer=30, n_embd=576, n_head=9, n_kv_head=3, intermediate_size=1536, vocab_size=49152,
    batch_size=8, mini_batch_size=4, ppo_epochs=2, query_len=(24, 40), response_len=(24, 40), response_spread="uniform",
)  # fmt: skip
# --- end of smollm2 block -------------------------------------------------------------------------

WORKLOAD_GROUPS = {"w1": lambda: [W1], "w2": lambda: [W2], "w3": lambda: [W3], "w4": lambda: [W4], "sweep": sweep_workloads}
WORKLOAD_GROUPS["vocab"] = lambda: [VOCAB]
WORKLOAD_GROUPS["smollm2"] = lambda: [SMOLLM2]
WORKLOAD_GROUPS["long"] = long_workloads
# `long` at 1/16 of its lengths and 2 layers: what a shared 2-core CPU measures in minutes (same width and vocabulary).
WORKLOAD_GROUPS["long-small"] = lambda: long_workloads(scale=16)
WORKLOAD_GROUPS["objectives"] = lambda: [W1] + [
    dataclasses.replace(W1, name=f"w1-{name}", options=json.dumps(options)) for name, options in OBJECTIVE_OPTIONS.items()
]


def make_batch(workload: Workload) -> tuple:
    """Random queries, responses and scores with lengths drawn uniformly from the workload's ranges.

    Token ids avoid the last id, which is the pad / end-of-text id of the model config.
    Returns lists of `batch_size` 1-D LongTensors (queries, responses) and 0-d float tensors (scores).
    """
    if isinstance(workload, CriticFreeWorkload):
        return grouped_batch(workload)
    g = torch.Generator().manual_seed(workload.seed)
    queries, responses, scores = [], [], []
    # LongWorkload: rows every batch_size // long_rows apart take the long lengths.
    long_every = workload.batch_size // workload.long_rows if getattr(workload, "long_rows", 0) else 0
    for i in range(workload.batch_size):
        lengths = workload.long_len if long_every and i % long_every == long_every - 1 else workload.response_len
        lq = int(torch.randint(workload.query_len[0], workload.query_len[1] + 1, (1,), generator=g))
        low, high = lengths
        if getattr(workload, "response_spread", "uniform") == "log-uniform":
            lr = round(low * (high / low) ** float(torch.rand((), generator=g)))
        else:
            lr = int(torch.randint(low, high + 1, (1,), generator=g))
        queries.append(torch.randint(0, workload.vocab_size - 1, (lq,), generator=g))
        responses.append(torch.randint(0, workload.vocab_size - 1, (lr,), generator=g))
        scores.append(torch.randn((), generator=g))
    return queries, responses, scores


def make_lm(workload: Workload, device: str, dtype: torch.dtype):
    """A random-init GPT2LMHeadModel (or Qwen2ForCausalLM for a `Qwen2Workload`) of the workload's size,
    without dropout (same model for both methods)."""
    last_id = workload.vocab_size - 1
    if isinstance(workload, SmolLM2Workload):
        from smollm2_workload import make_smollm2  # benchmarks/, the script's own directory

        return make_smollm2(workload, device, dtype)
    if isinstance(workload, Qwen2Workload):
        return make_qwen2(workload, device, dtype)
    config = GPT2Config(
        vocab_size=workload.vocab_size,
        n_positions=max(1024, workload.query_len[1] + max(workload.response_len[1], getattr(workload, "long_len", (0, 0))[1])),
        n_embd=workload.n_embd,
        n_layer=workload.n_layer,
        n_head=workload.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=last_id,
        eos_token_id=last_id,
        pad_token_id=last_id,
    )
    torch.manual_seed(workload.seed)
    return GPT2LMHeadModel(config).to(device=device, dtype=dtype)


def pack_rows(queries: list, responses: list, rows: list, pad_id: int, device: str) -> dict:
    """Right-pad `query + response` of the given rows to their own longest row.

    Shapes, with n = len(rows), L = longest query+response, K = longest response:
    input_ids, attention_mask (n, L); positions (n, K) index of the token that predicts response
    token k; targets (n, K) response token k; mask (n, K) 1 where k < len(response).
    """
    seqs = [torch.cat([queries[i], responses[i]]) for i in rows]
    q_lens = torch.tensor([len(queries[i]) for i in rows])
    r_lens = torch.tensor([len(responses[i]) for i in rows])
    longest, k_max = max(len(s) for s in seqs), int(r_lens.max())
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for j, s in enumerate(seqs):
        input_ids[j, : len(s)] = s
        attention_mask[j, : len(s)] = 1
    k = torch.arange(k_max).unsqueeze(0)
    mask = k < r_lens.unsqueeze(1)
    # Padded slots point at the last response-predicting position of their row: valid, and masked out.
    positions = q_lens.unsqueeze(1) - 1 + torch.minimum(k, r_lens.unsqueeze(1) - 1)
    targets = input_ids.gather(1, positions + 1)
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, positions=positions, targets=targets, mask=mask)
    return {name: t.to(device) for name, t in batch.items()}


# Rows of the (n, V) logits per log-softmax call: about 2 MiB of float32 on CPU, which stays in
# cache (the fused kernel is then about twice as fast as on the whole tensor); large on GPUs.
def rows_per_chunk(z: torch.Tensor) -> int:
    return max(1, (2 << 20 if z.device.type == "cpu" else 256 << 20) // (4 * z.shape[-1]))


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, buffer=None) -> torch.Tensor:
    """`hidden @ weight.T` (N, V) in float32, written into the first N rows of `buffer` (R >= N, V).

    The floor reuses one buffer for every pass (see `FloorPPO.step`); without one, a fresh tensor.
    """
    if buffer is None:
        buffer = torch.empty((len(hidden), weight.shape[0]), device=hidden.device)
    out = buffer[: len(hidden)]
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.mm(hidden, weight.t(), out=out)
    return out.copy_(hidden @ weight.t())


class HeadLogProb(torch.autograd.Function):
    """`log softmax(hidden W^T)[target]`, the LM head and the log-softmax in one buffer.

    The logits buffer turns into the softmax a cache-sized chunk at a time; the backward makes the
    gradient of the logits in place in it (`(onehot - softmax) * grad`), then the two products of
    the head's backward. Shapes: hidden (N, H), weight (V, H), target (N,) -> (N,).
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, buffer):
        z = head_logits(hidden, weight, buffer)
        chosen = z.new_empty(len(z))
        step = rows_per_chunk(z)
        work = z.new_empty((min(step, len(z)), z.shape[1]))
        for start in range(0, len(z), step):
            rows = slice(start, start + step)  # slices are views: no copy of the chunk
            log_p = torch.log_softmax(z[rows], -1, out=work[: len(z[rows])])
            chosen[rows] = log_p.gather(-1, target[rows, None])[:, 0]
            torch.exp(log_p, out=z[rows])
        ctx.save_for_backward(hidden, weight, z, target)
        return chosen

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, softmax, target = ctx.saved_tensors
        grad = grad[:, None]
        grad_z = softmax.mul_(-grad).scatter_add_(-1, target[:, None], grad).to(weight.dtype)
        return grad_z @ weight, grad_z.t() @ hidden, None, None


def head_logprob_no_grad(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, buffer=None):
    """`log softmax(hidden W^T)[target]` without grad, the log-softmax a cache-sized chunk at a time. -> (N,)"""
    z = head_logits(hidden, weight, buffer)
    step = rows_per_chunk(z)
    chunks = [
        torch.log_softmax(z[start : start + step], -1).gather(-1, target[start : start + step, None])[:, 0]
        for start in range(0, len(z), step)
    ]
    return torch.cat(chunks)


def response_logprobs(lm, batch: dict, v_head=None, buffer=None) -> tuple:
    """Log-probs (and values) of the response tokens, with the LM head only where a token is predicted.

    Shapes: log-probs (n, K) = gathered logit - logsumexp over the vocabulary, 0 past each
    response; values (n, K) or None. The LM head sees only the N = mask.sum() hidden states that
    predict a response token, not the padding of shorter responses.
    """
    # No key/value cache: building one is work that a training forward does not need.
    inputs = batch.get("model_inputs") or dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    hidden = lm.base_model(**inputs, use_cache=False).last_hidden_state
    mask = batch["mask"]
    # A packed batch is one row (1, N_total) shared by the n rows of `positions`.
    hidden = hidden.expand(mask.shape[0], -1, -1)
    index = batch["positions"].unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    picked = hidden.gather(1, index)  # (n, K, H)
    h, weight, targets = picked[mask], lm.lm_head.weight, batch["targets"][mask]  # h: (N, H)
    if torch.is_grad_enabled():
        chosen = HeadLogProb.apply(h, weight, targets, buffer)
    else:
        chosen = head_logprob_no_grad(h, weight, targets, buffer)
    logprobs = torch.zeros(mask.shape, device=chosen.device).masked_scatter(mask, chosen)
    values = v_head(picked).squeeze(-1) if v_head is not None else None
    return logprobs, values


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the entries where `mask` is 1."""
    return (x * mask).sum() / mask.sum()


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> tuple:
    """Advantages (whitened over the mask) and returns; inputs (B, K) in response-token order."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    next_value = next_adv = torch.zeros_like(rewards[:, 0])
    for k in reversed(range(rewards.shape[1])):
        delta = rewards[:, k] + GAMMA * next_value - values[:, k]
        advantages[:, k] = delta + GAMMA * LAM * next_adv
        next_value, next_adv = values[:, k], advantages[:, k]
    returns = advantages + values
    mean = masked_mean(advantages, mask)
    var = masked_mean((advantages - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)
    return (advantages - mean) * torch.rsqrt(var + 1e-8) * mask, returns


def keep_freed_heap() -> None:
    """Make glibc keep freed blocks of up to 32 MiB for reuse (Linux with glibc; elsewhere nothing).

    The same two mallopt settings `PPOConfig.keep_freed_cpu_memory` makes the trainer apply when it
    is constructed, written here so the floor needs no trl_lite. The floor applies them at the same
    point, once its models are built: applied at process start instead, the memory freed while
    building would stay resident, count in the baseline of the peak and be reused for free.
    """
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: glibc's largest accepted value on 64-bit systems
        mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: never trim the heap


class FloorPPO:
    """The unavoidable model work of one PPO step, hand-written on a plain GPT2LMHeadModel."""

    def __init__(self, lm, mini_batch_size: int, ppo_epochs: int):
        self.lm = lm.train()
        self.ref = copy.deepcopy(lm).eval().requires_grad_(False)
        param = next(lm.parameters())
        self.v_head = nn.Linear(lm.config.hidden_size, 1).to(device=param.device, dtype=param.dtype)
        if param.device.type == "cpu":  # as the trainer: on CPU, after its models, before its optimizer
            keep_freed_heap()
        self.optimizer = torch.optim.Adam([*lm.parameters(), *self.v_head.parameters()], lr=LEARNING_RATE, fused=True)
        self.mini_batch_size = mini_batch_size
        self.ppo_epochs = ppo_epochs
        self.pad_id = lm.config.pad_token_id
        self.device = param.device
        self.buffer = None

    def _pack(self, queries, responses, rows):
        return pack_rows(queries, responses, rows, self.pad_id, self.device)

    @torch.no_grad()
    def _rollout(self, queries, responses, scores) -> dict:
        """Old log-probs, values, advantages and returns, each (B, K_max) in response-token order."""
        n, k_max = len(queries), max(len(r) for r in responses)
        old = {key: torch.zeros(n, k_max, device=self.device) for key in ("logprobs", "ref", "values", "mask")}
        for start in range(0, n, self.mini_batch_size):
            rows = list(range(start, min(start + self.mini_batch_size, n)))
            batch = self._pack(queries, responses, rows)
            logprobs, values = response_logprobs(self.lm, batch, self.v_head, self.buffer)
            values = self._values(batch, values)
            ref, _ = response_logprobs(self.ref, batch, buffer=self.buffer)
            k = batch["mask"].shape[1]
            for key, t in (("logprobs", logprobs), ("ref", ref), ("values", values), ("mask", batch["mask"])):
                old[key][start : start + len(rows), :k] = t
        mask = old["mask"]
        rewards = -KL_COEF * (old["logprobs"] - old["ref"]) * mask
        last = torch.tensor([len(r) - 1 for r in responses], device=self.device)
        rewards[torch.arange(n, device=self.device), last] += torch.stack(scores).to(self.device).float()
        old["advantages"], old["returns"] = gae(rewards, old["values"], mask)
        return old

    def _train_minibatch(self, queries, responses, rows, old: dict):
        """One forward + backward + Adam step on the clipped PPO loss of the given rows."""
        batch = self._pack(queries, responses, rows)
        mask = batch["mask"]
        index = torch.tensor(rows, device=self.device)
        take = {key: t[index, : mask.shape[1]] for key, t in old.items()}
        logprobs, values = response_logprobs(self.lm, batch, self.v_head, self.buffer)
        values = self._values(batch, values)
        ratio = torch.exp(logprobs.float() - take["logprobs"])
        adv = take["advantages"]
        pg_loss = masked_mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - CLIPRANGE, 1 + CLIPRANGE)), mask)
        v_old, ret = take["values"], take["returns"]
        v_clip = torch.clamp(values.float(), v_old - CLIPRANGE_VALUE, v_old + CLIPRANGE_VALUE)
        vf_loss = 0.5 * masked_mean(torch.max((values.float() - ret) ** 2, (v_clip - ret) ** 2), mask)
        self._update(pg_loss, vf_loss)

    def _values(self, batch: dict, values: torch.Tensor) -> torch.Tensor:
        """The values of a pass: here the policy's value head's (a separate critic replaces this)."""
        return values

    def _update(self, pg_loss: torch.Tensor, vf_loss: torch.Tensor) -> None:
        (pg_loss + VF_COEF * vf_loss).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, queries: list, responses: list, scores: list) -> None:
        """One PPO step: rollout forward passes, then `ppo_epochs` shuffled passes over mini-batches."""
        # One LM-head buffer for every pass, with the rows of the largest possible mini-batch and kept
        # between steps: no vocabulary-sized block is freed and allocated again (the trainer does the
        # same on CPU), so the glibc heap does not fragment.
        rows = sum(sorted((len(r) for r in responses), reverse=True)[: self.mini_batch_size])
        if self.buffer is None or len(self.buffer) < rows:
            self.buffer = None
            self.buffer = torch.empty((rows, self.lm.config.vocab_size), device=self.device)
        old = self._rollout(queries, responses, scores)
        n = len(queries)
        for _ in range(self.ppo_epochs):
            order = torch.randperm(n).tolist()
            for start in range(0, n, self.mini_batch_size):
                self._train_minibatch(queries, responses, order[start : start + self.mini_batch_size], old)


class PackedFloorPPO(FloorPPO):
    """The floor over packed mini-batches: each mini-batch is one row ``(1, N_total)`` of its rows'
    tokens with position ids restarting per row, so no padding token is computed, and attends within
    each row through trl_lite's packed attention - one varlen kernel call per layer on CUDA, sdpa per
    row elsewhere: the attention of the packed step, so the two differ by overhead only."""

    def _pack(self, queries, responses, rows):
        from trl_lite.models.packed_attention import ROW_LENGTHS, rows_mask
        from trl_lite.models.varlen_attention import packed_rows

        seqs = [torch.cat([queries[i], responses[i]]) for i in rows]
        lengths = [len(s) for s in seqs]
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        q_lens = torch.tensor([len(queries[i]) for i in rows])
        r_lens = torch.tensor([len(responses[i]) for i in rows])
        k = torch.arange(int(r_lens.max())).unsqueeze(0)
        mask = k < r_lens.unsqueeze(1)
        # Padded slots point at the last response-predicting position of their row: valid, and masked out.
        positions = (starts + q_lens - 1).unsqueeze(1) + torch.minimum(k, r_lens.unsqueeze(1) - 1)
        input_ids = torch.cat(seqs)
        batch = {"positions": positions, "targets": input_ids[positions + 1], "mask": mask}
        batch = {name: t.to(self.device) for name, t in batch.items()}
        attention = packed_rows(lengths, self.device)
        batch["model_inputs"] = {
            "input_ids": input_ids.unsqueeze(0).to(self.device),
            "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(self.device),
            ROW_LENGTHS: attention,
        }
        mask_4d = rows_mask(attention, self.device)
        if mask_4d is not None:
            batch["model_inputs"]["attention_mask"] = mask_4d
        return batch

    def step(self, queries: list, responses: list, scores: list) -> None:
        from trl_lite.models.packed_attention import attend_per_row

        with attend_per_row([self.lm, self.ref]):
            super().step(queries, responses, scores)


def quiet_trainer(*args, trainer_class=None, **kwargs):
    """`PPOTrainer(*args, **kwargs)` (or `trainer_class`) without the no-dataset warning: the benchmarks batch
    their own rows for step()."""
    from trl_lite import NoDatasetWarning, PPOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoDatasetWarning)
        return (trainer_class or PPOTrainer)(*args, **kwargs)


def make_step_fn(method: str, workload: Workload, device: str, dtype: torch.dtype):
    """Build the models for `method` and return a function `(queries, responses, scores) -> None`."""
    # Any workload named grpo-beta0* (the tests' smaller one too) is stepped like grpo-beta0.
    if workload.name.startswith(GRPO_BETA0.name):
        return make_grpo_beta0_step_fn(method, workload, device, dtype)
    if method == "step-every-pass":
        raise ValueError(f"method {method!r} applies to the grpo-beta0 workload, not {workload.name!r}")
    if method in PREFIX_METHODS and getattr(workload, "advantage_estimator", "gae") == "gae":
        raise ValueError(f"method {method!r} applies to the critic-free workloads (shared_prefix), not {workload.name!r}")
    one_buffer_unsupported = isinstance(workload, CriticFreeWorkload) or workload.name in CRITIC_WORKLOADS
    if method == "step-one-buffer" and one_buffer_unsupported:
        raise ValueError(f"method {method!r} exists for the value-head workloads, not {workload.name!r}")
    if method == PACKED_FLOOR and not packed_floor_supported(workload):
        raise ValueError(f"method {PACKED_FLOOR!r} exists for the value-head workloads, not {workload.name!r}")
    if isinstance(workload, CriticFreeWorkload) and workload.advantage_estimator != "gae":
        return make_critic_free_step_fn(method, workload, device, dtype)
    if workload.name in CRITIC_WORKLOADS:
        return make_critic_step_fn(method, workload, device, dtype)
    lm = make_lm(workload, device, dtype)
    if method == "floor":
        return FloorPPO(lm, workload.mini_batch_size, workload.ppo_epochs).step
    if method == PACKED_FLOOR:
        return PackedFloorPPO(lm, workload.mini_batch_size, workload.ppo_epochs).step
    # Imported here so that `--methods floor` runs without trl_lite.
    from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig

    ref_lm = copy.deepcopy(lm)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(lm).to(device=device, dtype=dtype)
    ref_model = AutoModelForCausalLMWithValueHead.from_pretrained(ref_lm).to(device=device, dtype=dtype)
    options = json.loads(workload.options)
    with_generation_logprobs = options.pop("generation_logprobs", False)
    if method == "step-one-buffer":
        options["lm_head_chunk_size"] = 0
    config = PPOConfig(
        batch_size=workload.batch_size,
        mini_batch_size=workload.mini_batch_size,
        ppo_epochs=workload.ppo_epochs,
        learning_rate=LEARNING_RATE,
        seed=workload.seed,
        # "step": the default (packed mini-batches for GPT-2); "step-padded": every mini-batch padded.
        padding_free=False if method == "step-padded" else None,
        **options,
    )
    trainer = quiet_trainer(config, model, ref_model, tokenizer=None)
    if not with_generation_logprobs:
        return trainer.step

    generation = []

    def step_with_engine_logprobs(queries, responses, scores):
        # Stand-in engine log-probs, made once (untimed work of the first call): what the rollout pass
        # computes, shifted, so that TIS weights vary.
        if not generation:
            with torch.no_grad():
                logprobs = trainer.experience_maker.passes(trainer.forward.make_rows(queries, responses, None))[0]
            generation.extend(logprobs[i, : len(r)].cpu() - 0.05 for i, r in enumerate(responses))
        return trainer.step(queries, responses, scores, generation_logprobs=generation)

    return step_with_engine_logprobs


# ---------------------------------------------------------------------------------------------
# Critic-free workloads (docs/algorithm.md section 12): GRPO on a plain causal LM, against GAE on the same batch
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CriticFreeWorkload(Workload):
    """A workload whose rows come in groups of `num_samples_per_query` sharing a query, stepped with
    `advantage_estimator` ("gae": the value-head trainer and `FloorPPO`, as the other workloads)."""

    num_samples_per_query: int = 4
    advantage_estimator: str = "grpo"


GRPO_W1 = CriticFreeWorkload("grpo-w1", n_layer=2, n_embd=128, n_head=2, batch_size=16, mini_batch_size=4, ppo_epochs=4)
# The same batch stepped with GAE and a value head: the time a critic costs.
GAE_W1_GROUPED = dataclasses.replace(GRPO_W1, name="gae-w1-grouped", advantage_estimator="gae")
WORKLOAD_GROUPS["critic_free"] = lambda: [GRPO_W1, GAE_W1_GROUPED]


def grouped_batch(workload: CriticFreeWorkload) -> tuple:
    """`make_batch` of the plain workload, with the query of each group's first row given to the whole group."""
    queries, responses, scores = make_batch(Workload(**{f.name: getattr(workload, f.name) for f in dataclasses.fields(Workload)}))
    k = workload.num_samples_per_query
    return [queries[i - i % k] for i in range(len(queries))], responses, scores


class CriticFreeFloor(FloorPPO):
    """The unavoidable model work of one GRPO step: the policy and reference forwards without grad,
    then forward + backward + Adam per mini-batch on the clipped loss plus `KL_COEF * k3`. No value head."""

    def __init__(self, lm, mini_batch_size: int, ppo_epochs: int, num_samples_per_query: int):
        super().__init__(lm, mini_batch_size, ppo_epochs)
        self.v_head = None
        self.optimizer = torch.optim.Adam(lm.parameters(), lr=LEARNING_RATE, fused=True)
        self.k = num_samples_per_query

    @torch.no_grad()
    def _rollout(self, queries, responses, scores) -> dict:
        """Old and reference log-probs, mask and GRPO advantages, each (B, K_max) in response-token order."""
        n, k_max = len(queries), max(len(r) for r in responses)
        old = {key: torch.zeros(n, k_max, device=self.device) for key in ("logprobs", "ref", "mask")}
        for start in range(0, n, self.mini_batch_size):
            rows = list(range(start, min(start + self.mini_batch_size, n)))
            batch = self._pack(queries, responses, rows)
            logprobs, _ = response_logprobs(self.lm, batch, buffer=self.buffer)
            ref, _ = response_logprobs(self.ref, batch, buffer=self.buffer)
            k = batch["mask"].shape[1]
            for key, t in (("logprobs", logprobs), ("ref", ref), ("mask", batch["mask"])):
                old[key][start : start + len(rows), :k] = t
        groups = torch.stack(scores).to(self.device).float().view(-1, self.k)
        advantages = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)
        old["advantages"] = advantages.reshape(-1, 1) * old["mask"]
        return old

    def _train_minibatch(self, queries, responses, rows, old: dict):
        batch = self._pack(queries, responses, rows)
        mask = batch["mask"]
        index = torch.tensor(rows, device=self.device)
        take = {key: t[index, : mask.shape[1]] for key, t in old.items()}
        logprobs, _ = response_logprobs(self.lm, batch, buffer=self.buffer)
        ratio = torch.exp(logprobs.float() - take["logprobs"])
        adv = take["advantages"]
        pg_loss = masked_mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - CLIPRANGE, 1 + CLIPRANGE)), mask)
        log_ratio = take["ref"] - logprobs.float()
        k3 = torch.exp(log_ratio) - log_ratio - 1
        (pg_loss + KL_COEF * masked_mean(k3, mask)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def make_critic_free_step_fn(method: str, workload: CriticFreeWorkload, device: str, dtype: torch.dtype):
    """`make_step_fn` for a critic-free workload: `PPOTrainer` on the plain model, or `CriticFreeFloor`."""
    lm = make_lm(workload, device, dtype)
    if method == "floor":
        return CriticFreeFloor(lm, workload.mini_batch_size, workload.ppo_epochs, workload.num_samples_per_query).step
    from trl_lite import PPOConfig

    config = PPOConfig(
        batch_size=workload.batch_size,
        mini_batch_size=workload.mini_batch_size,
        ppo_epochs=workload.ppo_epochs,
        learning_rate=LEARNING_RATE,
        init_kl_coef=KL_COEF,
        adap_kl_ctrl=False,
        advantage_estimator=workload.advantage_estimator,
        num_samples_per_query=workload.num_samples_per_query,
        seed=workload.seed,
        padding_free=False if method == "step-padded" else None,
        **({"prefix_sharing": PREFIX_METHODS[method]} if method in PREFIX_METHODS else {}),
    )
    trainer = quiet_trainer(config, lm, copy.deepcopy(lm), tokenizer=None)
    if method not in PREFIX_METHODS:
        return trainer.step
    last = {}

    def step(queries, responses, scores):
        last.update(trainer.step(queries, responses, scores))

    # The share of the prompt + response tokens of the last step's passes that ran (1: no prompt shared).
    step.extras = lambda: {"tokens_run": 1 - float(last["prefix_sharing/tokens_saved_fraction"])}
    return step


# Prefix sharing (issue 52): 4 prompts of 512 tokens, G = 8 responses of 32-96, one pass per mini-batch of the whole
# batch (every pass holds whole groups). `short-pairs`: G = 2 and 16-token prompts, where sharing saves about 10%
# of the tokens, under the automatic rule's 25% (`step-prefix-auto` takes the unshared path; it must cost <= 1.05x).
SHARED_PREFIX = CriticFreeWorkload(
    "shared-prefix", n_layer=4, n_embd=256, n_head=4, batch_size=32, mini_batch_size=32, ppo_epochs=2,
    query_len=(512, 512), response_len=(32, 96), vocab_size=8192, num_samples_per_query=8,
)  # fmt: skip
SHORT_PAIRS = dataclasses.replace(SHARED_PREFIX, name="short-pairs", query_len=(16, 16), num_samples_per_query=2)
WORKLOAD_GROUPS["shared_prefix"] = lambda: [SHARED_PREFIX, SHORT_PAIRS]


# ---------------------------------------------------------------------------------------------
# grpo-beta0 (docs/algorithm.md section 3): GRPO with the KL at 0 and one optimizer step per batch, where
# step() runs no pass without grad; the method "step-every-pass" forces both passes (the path before RolloutPlan)
# ---------------------------------------------------------------------------------------------
GRPO_BETA0 = CriticFreeWorkload(
    "grpo-beta0", n_layer=2, n_embd=128, n_head=2, batch_size=16, mini_batch_size=4, ppo_epochs=1,
    options=json.dumps({"gradient_accumulation_steps": 4, "init_kl_coef": 0.0, "adap_kl_ctrl": False}),
)  # fmt: skip
WORKLOAD_GROUPS["grpo-beta0"] = lambda: [GRPO_BETA0]


class OnPolicyFloor(CriticFreeFloor):
    """The unavoidable model work of the `grpo-beta0` step: no pass without grad; forward + backward per
    mini-batch with `lp_old = lp` detached, gradients accumulated over the batch, one Adam step."""

    def step(self, queries: list, responses: list, scores: list) -> None:
        rows = sum(sorted((len(r) for r in responses), reverse=True)[: self.mini_batch_size])
        if self.buffer is None or len(self.buffer) < rows:
            self.buffer = None
            self.buffer = torch.empty((rows, self.lm.config.vocab_size), device=self.device)
        n = len(queries)
        groups = torch.stack(scores).to(self.device).float().view(-1, self.k)
        advantages = ((groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)).reshape(-1)
        order = torch.randperm(n).tolist()
        for start in range(0, n, self.mini_batch_size):
            rows = order[start : start + self.mini_batch_size]
            batch = self._pack(queries, responses, rows)
            mask = batch["mask"]
            logprobs, _ = response_logprobs(self.lm, batch, buffer=self.buffer)
            ratio = torch.exp(logprobs.float() - logprobs.detach().float())
            adv = advantages[torch.tensor(rows, device=self.device)].unsqueeze(1)
            pg_loss = masked_mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - CLIPRANGE, 1 + CLIPRANGE)), mask)
            (pg_loss * self.mini_batch_size / n).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def make_grpo_beta0_step_fn(method: str, workload: CriticFreeWorkload, device: str, dtype: torch.dtype):
    """`make_step_fn` for `grpo-beta0`: `PPOTrainer` on the plain model (`ref_model=None`), with both passes
    forced for `step-every-pass`, or `OnPolicyFloor`. The trainer's step function reports `extras()`:
    the passes without grad per step (measured: the model bodies' calls without grad, per mini-batch of
    rows) and the parameter bytes of the reference copy the trainer made (MB)."""
    lm = make_lm(workload, device, dtype)
    if method == "floor":
        return OnPolicyFloor(lm, workload.mini_batch_size, 1, workload.num_samples_per_query).step
    from trl_lite import PPOConfig, PPOTrainer
    from trl_lite.trainer.rollout_plan import EVERY_PASS

    config = PPOConfig(
        batch_size=workload.batch_size, mini_batch_size=workload.mini_batch_size, ppo_epochs=workload.ppo_epochs,
        learning_rate=LEARNING_RATE, advantage_estimator=workload.advantage_estimator,
        num_samples_per_query=workload.num_samples_per_query, seed=workload.seed,
        padding_free=False if method == "step-padded" else None, **json.loads(workload.options),
    )  # fmt: skip
    trainer_class = PPOTrainer
    if method == "step-every-pass":
        trainer_class = type("EveryPassTrainer", (PPOTrainer,), {"plan_rollout": staticmethod(lambda c: EVERY_PASS)})
    trainer = quiet_trainer(config, lm, ref_model=None, tokenizer=None, trainer_class=trainer_class)
    reference = trainer.ref_model
    calls, steps = [], []
    for model in [lm] + ([reference.pretrained_model] if reference is not None else []):
        model.transformer.register_forward_pre_hook(lambda m, a: None if torch.is_grad_enabled() else calls.append(1))

    def step(queries, responses, scores):
        steps.append(1)
        return trainer.step(queries, responses, scores)

    def extras() -> dict:
        params = {id(p): p for p in reference.parameters()}.values() if reference is not None else ()
        chunks = -(-workload.batch_size // workload.mini_batch_size)
        return {
            "rollout_passes": len(calls) / max(len(steps), 1) / chunks,
            "reference_mb": sum(p.numel() * p.element_size() for p in params) / 2**20,
        }

    step.extras = extras
    return step


class PeakMemory:
    """Peak memory growth, in MB, from `start()` to `peak_mb()`.

    CUDA: torch's peak allocated bytes. CPU on Linux: the kernel's resident-set high-water mark
    (VmHWM), reset to the current RSS at `start()`; elsewhere ru_maxrss growth (a lower bound).
    """

    def __init__(self, device: str):
        self.device = device
        self.baseline = 0.0
        self.read_peak = None

    def start(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated() / 2**20
            self.read_peak = lambda: torch.cuda.max_memory_allocated() / 2**20
        elif self._reset_hwm():
            self.baseline = self._proc_status_mb("VmRSS")
            self.read_peak = lambda: self._proc_status_mb("VmHWM")
        else:
            self.baseline = self._maxrss_mb()
            self.read_peak = self._maxrss_mb

    def peak_mb(self) -> float:
        return self.read_peak() - self.baseline

    @staticmethod
    def _reset_hwm() -> bool:
        """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)."""
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            return False
        return True

    @staticmethod
    def _proc_status_mb(field: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"{field} not found in /proc/self/status")

    @staticmethod
    def _maxrss_mb() -> float:
        # ru_maxrss is in kilobytes on Linux and in bytes on macOS.
        scale = 2**20 if sys.platform == "darwin" else 2**10
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def tensor_peak_mb(prof: torch.profiler.profile) -> float:
    """Highest sum of live CPU tensor bytes during a profiled region, counted from its start, in MB.

    Replays, by address, the allocations and frees that `profile_memory=True` records (a free of a tensor made
    before the region subtracts its size). The profiler records only the threads it follows: a tensor whose
    last reference a collective's worker thread drops (gloo's, under several processes) is freed unrecorded.
    A later allocation at the same address proves that free, so the earlier tensor stops counting there;
    one freed unrecorded whose address is not reused counts to the end (the result is an upper bound).
    """
    allocations, events = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while events:
        event = events.pop()
        events.extend(event.children)
        if event.tag == torch._C._profiler._EventType.Allocation and event.extra_fields.device.type == "cpu":
            allocations.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    live, total, peak = {}, 0, 0
    for _, ptr, nbytes in sorted(allocations):
        if nbytes > 0:
            total += nbytes - live.get(ptr, 0)
            live[ptr] = nbytes
            peak = max(peak, total)
        else:
            total -= live.pop(ptr, -nbytes)
    return peak / 2**20


class StepRunner:
    """One method on one workload in this process: built once, then run one step at a time."""

    def __init__(self, workload: Workload, method: str, device: str, dtype: str):
        self.device = device
        self.step_fn = make_step_fn(method, workload, device, DTYPES[dtype])
        self.batch = make_batch(workload)
        torch.manual_seed(workload.seed)
        self.memory = PeakMemory(device)
        self.memory.start()

    def run_one(self) -> float:
        """Wall-clock seconds of one step on the workload's batch."""
        _sync(self.device)
        t0 = time.perf_counter()
        self.step_fn(*self.batch)
        _sync(self.device)
        return time.perf_counter() - t0

    def finish(self) -> dict:
        """Peak memory growth since the models were built (MB), the torch thread count and what the step
        function reports of itself (its `extras()`, e.g. `grpo-beta0`'s passes per step)."""
        extras = self.step_fn.extras() if hasattr(self.step_fn, "extras") else {}
        return {"peak_mb": self.memory.peak_mb(), "threads": torch.get_num_threads(), **extras}

    def first_step_tensor_peak_mb(self) -> float:
        """Run the first step, untimed; return the live tensor memory at its peak, counted from its start.

        CPU: torch's memory profiler, whose own records take resident memory: so this runs in a
        process of its own, never in one whose resident peak is read. CUDA: the allocator's peak,
        which counts tensors only.
        """
        if self.device == "cuda":
            self.step_fn(*self.batch)
            return self.memory.peak_mb()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step_fn(*self.batch)
        return tensor_peak_mb(prof)


class WorkerProcess:
    """A `StepRunner` in a fresh Python process, driven line by line over its stdin.

    Protocol: the worker prints one marked line when built, then one per command: `step` (its
    time), `profile` (the first step's tensor peak) or `finish` (peak memory, then it exits). Its
    stderr goes to a temporary file so that a chatty library cannot fill a pipe and block it.
    """

    def __init__(self, workload: Workload, method: str, device: str, dtype: str):
        self.label = f"{workload.name}/{method}"
        spec = dict(workload=dataclasses.asdict(workload), method=method, device=device, dtype=dtype)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        self.stderr = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env
        )

    def request(self, command: str = None) -> dict:
        """Send `command` (if any) and return the worker's next marked reply."""
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(RESULT_MARKER):
                return json.loads(line[len(RESULT_MARKER) :])
        self.proc.wait()
        self.stderr.seek(0)
        raise RuntimeError(
            f"benchmark worker {self.label} failed (exit {self.proc.returncode}):\n{self.stderr.read()[-4000:]}"
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.stderr):
            stream.close()


def worker_main(spec_json: str) -> None:
    """Entry point of a measuring subprocess: build, then answer `step`, `profile`, `finish` lines."""
    spec = json.loads(spec_json)
    fields = spec.pop("workload")
    kind = (
        CriticFreeWorkload if "advantage_estimator" in fields else LongWorkload if "long_rows" in fields
        else SmolLM2Workload if "pretrained" in fields else Qwen2Workload if "n_kv_head" in fields else Workload
    )  # fmt: skip
    workload = kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    runner = StepRunner(workload, **spec)
    print(RESULT_MARKER + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "step":
            reply = {"time_s": runner.run_one()}
        elif command == "profile":
            reply = {"tensor_peak_mb": runner.first_step_tensor_peak_mb()}
        elif command == "finish":
            print(RESULT_MARKER + json.dumps(runner.finish()), flush=True)
            return
        else:
            raise ValueError(f"unknown worker command {command!r}; expected 'step', 'profile' or 'finish'")
        print(RESULT_MARKER + json.dumps(reply), flush=True)


def first_step_tensor_peak(workload: Workload, method: str, device: str, dtype: str) -> float:
    """The tensor peak (MB) of the first step of `method`, in a process used for nothing else."""
    worker = WorkerProcess(workload, method, device, dtype)
    try:
        worker.request()
        return worker.request("profile")["tensor_peak_mb"]
    finally:
        worker.close()


def measure_workload(
    workload: Workload, methods, steps: int, warmup: int, device: str, dtype: str, tensor_peak: bool = True
) -> list:
    """Time every method on `workload`, one process each, taking turns step by step.

    Taking turns (and swapping who goes first every round) lets every method see the same machine
    load, which matters on a shared machine. The tensor peaks come from separate processes first.
    Returns one result dict per method.
    """
    tensor_peaks = {method: first_step_tensor_peak(workload, method, device, dtype) for method in methods if tensor_peak}
    workers = {method: WorkerProcess(workload, method, device, dtype) for method in methods}
    try:
        for worker in workers.values():
            worker.request()
        times = {method: [] for method in methods}
        for i in range(warmup + steps):
            for method in methods if i % 2 == 0 else reversed(methods):
                seconds = workers[method].request("step")["time_s"]
                if i >= warmup:
                    times[method].append(seconds)
        finals = {method: worker.request("finish") for method, worker in workers.items()}
    finally:
        for worker in workers.values():
            worker.close()
    queries, responses, _ = make_batch(workload)
    tokens = sum(len(q) + len(r) for q, r in zip(queries, responses))
    flops = needed_flops(workload)
    results = []
    for method in methods:
        median = statistics.median(times[method])
        result = {"workload": workload.name, "method": method, "times_s": times[method], "median_s": median}
        result.update(min_s=min(times[method]), tokens_per_s=tokens / median)
        if method in tensor_peaks:
            result["tensor_peak_mb"] = tensor_peaks[method]
        result["gflops_per_s"] = flops / min(times[method]) / 1e9
        result["tflops_per_s"] = result["gflops_per_s"] / 1e3
        results.append({**result, **finals[method]})
    return results


def packed_floor_supported(workload: Workload) -> bool:
    """Whether `floor-packed` exists for `workload`: the value-head PPO workloads (not the critic or critic-free ones)."""
    return not isinstance(workload, CriticFreeWorkload) and workload.name not in CRITIC_WORKLOADS


def methods_for(workload: Workload, methods) -> list:
    """`methods` that exist for `workload` (`floor-packed` is left out where it does not)."""
    return [m for m in methods if m != PACKED_FLOOR or packed_floor_supported(workload)]


def run_benchmark(
    workloads: list, methods=METHODS, steps: int = 3, warmup: int = 1, device="cpu", dtype="fp32", peak_gflops=None,
    tensor_peak: bool = True,
):  # fmt: skip
    """Measure every workload with every method; returns the result dicts in order.

    With ``peak_gflops`` each result also gets ``peak_fraction``: its achieved FLOP/s over that peak.
    """
    results = []
    for workload in workloads:
        for result in measure_workload(workload, methods_for(workload, methods), steps, warmup, device, dtype, tensor_peak):
            if peak_gflops:
                result["peak_fraction"] = result["gflops_per_s"] / peak_gflops
            print(
                f"{workload.name:>10} {result['method']:>11}: median {result['median_s']:.4f} s "
                f"(steps {', '.join(f'{t:.3f}' for t in result['times_s'])}), peak {result['peak_mb']:.1f} MB, "
                f"tensor peak {result.get('tensor_peak_mb', float('nan')):.1f} MB",
                flush=True,
            )
            results.append(result)
    return results


# (result key, column title, number format, whether a ratio-to-floor column follows)
TABLE_COLUMNS = (
    ("median_s", "median s", ".4f", True),
    ("min_s", "min s", ".4f", True),
    ("tokens_per_s", "tokens/s", ".0f", False),
    ("gflops_per_s", "GFLOP/s", ".1f", False),
    ("tflops_per_s", "TFLOP/s", ".2f", False),
    ("peak_fraction", "MFU (x peak)", ".3f", False),
    ("peak_mb", "peak MB", ".1f", True),
    ("tensor_peak_mb", "tensor peak MB", ".1f", True),
    ("rollout_passes", "passes w/o grad per step", ".1f", False),
    ("reference_mb", "reference copy MB", ".1f", False),
    ("tokens_run", "tokens run (x all)", ".2f", False),
)


def format_table(results: list) -> str:
    """A markdown table: one row per (workload, method), ratios against the floor of the same workload."""
    floors = {r["workload"]: r for r in results if r["method"] == "floor"}
    # With the packed floor measured: the median time over it too (the same attention on both sides).
    packed_floors = {r["workload"]: r for r in results if r["method"] == PACKED_FLOOR}
    titles, aligns = ["workload", "method"], ["---", "---"]
    for _, title, _, with_ratio in TABLE_COLUMNS:
        titles += [title, "x floor"] if with_ratio else [title]
        aligns += ["---:", "---:"] if with_ratio else ["---:"]
    if packed_floors:
        titles, aligns = titles + ["median x floor-packed"], aligns + ["---:"]
    # With prefix sharing off measured: time and tensor peak over it (docs/prefix_sharing.md).
    unshared = {r["workload"]: r for r in results if r["method"] == "step-prefix-off"}
    if unshared:
        titles, aligns = titles + ["median x prefix-off", "tensor peak x prefix-off"], aligns + ["---:", "---:"]
    lines = ["| " + " | ".join(titles) + " |", "| " + " | ".join(aligns) + " |"]
    for r in results:
        floor = floors.get(r["workload"])
        cells = [r["workload"], r["method"]]
        for key, _, fmt, with_ratio in TABLE_COLUMNS:
            cells.append(format(r[key], fmt) if key in r else "-")
            if with_ratio:
                cells.append(f"{r[key] / floor[key]:.2f}" if floor and floor.get(key) and key in r else "-")
        if packed_floors:
            packed = packed_floors.get(r["workload"])
            cells.append(f"{r['median_s'] / packed['median_s']:.2f}" if packed else "-")
        if unshared:
            off = unshared.get(r["workload"])
            cells += [f"{r[k] / off[k]:.2f}" if off and off.get(k) and k in r else "-" for k in ("median_s", "tensor_peak_mb")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe_workloads(workloads: list) -> str:
    """One markdown bullet per workload with its shapes."""
    def model(w: Workload) -> str:
        if isinstance(w, SmolLM2Workload):
            return f"{w.pretrained}, real weights ({w.n_layer} x {w.n_embd}, {w.n_head} heads over {w.n_kv_head} key/value heads)"
        if isinstance(w, Qwen2Workload):
            return (f"Qwen2 {w.n_layer} x {w.n_embd} ({w.n_head} heads over {w.n_kv_head} key/value heads, "
                    f"MLP {w.intermediate_size}, tied embeddings)")  # fmt: skip
        return f"GPT-2 {w.n_layer} x {w.n_embd} ({w.n_head} heads)"

    return "\n".join(
        f"- `{w.name}`: {model(w)}, vocabulary {w.vocab_size}, "
        f"batch {w.batch_size}, mini-batch {w.mini_batch_size}, {w.ppo_epochs} PPO epochs, "
        f"queries {w.query_len[0]}-{w.query_len[1]}, responses {w.response_len[0]}-{w.response_len[1]} tokens"
        + (f", {w.long_rows} of {w.long_len[0]}-{w.long_len[1]}" if isinstance(w, LongWorkload) else "")
        + (f" ({w.response_spread})" if isinstance(w, Qwen2Workload) else "")
        + (f", {w.options}" if w.options != "{}" else "")
        for w in workloads
    )


def machine_description(device: str) -> str:
    """CPU model, core count, torch threads and library versions (and the GPU when on CUDA)."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    parts = [
        f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        "load average at start " + " ".join(f"{x:.2f}" for x in os.getloadavg()),
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}",
    ]
    if device == "cuda":
        parts.insert(0, f"GPU {torch.cuda.get_device_name()}")
    return "; ".join(parts)


def write_results(path: Path, heading: str, body: str) -> None:
    """Replace the `## heading` section of the markdown file at `path` with `body`, keeping other sections."""
    title = "# trl_lite benchmark results\n\nWritten by `benchmarks/bench_step.py`; do not edit by hand.\n"
    sections = {}
    if path.exists():
        for chunk in path.read_text().split("\n## ")[1:]:
            name, _, rest = chunk.partition("\n")
            sections[name.strip()] = rest.strip()
    sections[heading] = body.strip()
    text = title + "".join(f"\n## {name}\n\n{content}\n" for name, content in sections.items())
    path.write_text(text)


def _int_at_least(minimum: int):
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text}")
        return value

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["w1", "w2", "sweep"], choices=sorted(WORKLOAD_GROUPS))
    parser.add_argument(
        "--methods", nargs="+", default=None, choices=(*METHODS, PACKED_FLOOR, *EXTRA_METHODS, *PREFIX_METHODS),
        help=f"default: {' '.join(METHODS)}, and {PACKED_FLOOR} on cuda",
    )  # fmt: skip
    parser.add_argument("--steps", type=_int_at_least(1), default=3, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=_int_at_least(0), default=1, help="untimed steps before timing")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: fp32 on cpu, bf16 on cuda")
    parser.add_argument(
        "--threads", type=_int_at_least(1), default=None, help="torch intra-op threads (default: torch's own)"
    )
    parser.add_argument(
        "--peak-gflops", type=float, default=None,
        help="the machine's matrix-product peak for the MFU ('x peak') column (default: measured at start on CPU "
        "in fp32; on cuda the dense bf16 peak of an H100 SXM, 989 TFLOP/s)",
    )  # fmt: skip
    parser.add_argument(
        "--no-tensor-peak", action="store_true",
        help="skip the profiled first step per method (its tensor peak): one step less per method, for slow workloads",
    )  # fmt: skip
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "benchmarks" / "RESULTS.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not args.worker and not torch.cuda.is_available():
        parser.error("--device cuda was given but torch.cuda.is_available() is False")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.methods = args.methods or [*METHODS, *([PACKED_FLOOR] if args.device == "cuda" else [])]
    return args


# ----------------------------------------------------------------------------------------------
# Separate critic (docs/algorithm.md section 9): the policy without a value head, and a critic of the same
# size - a GPT-2 backbone and a one-output score head, no LM head - with its own Adam.
# ----------------------------------------------------------------------------------------------
CRITIC_WORKLOADS = {"critic": dataclasses.replace(W1, name="critic")}
WORKLOAD_GROUPS["critic"] = lambda: list(CRITIC_WORKLOADS.values())


def make_critic(lm, device: str, dtype: torch.dtype):
    """A `GPT2ForSequenceClassification` (num_labels=1) whose backbone starts as a copy of `lm`'s."""
    from transformers import GPT2ForSequenceClassification

    config = copy.deepcopy(lm.config)
    config.num_labels = 1
    torch.manual_seed(1)
    critic = GPT2ForSequenceClassification(config)
    critic.transformer.load_state_dict(lm.transformer.state_dict())
    return critic.to(device=device, dtype=dtype)


class FloorCriticPPO(FloorPPO):
    """The floor with a separate critic: the policy's loss and the critic's value loss each backward
    into their own model, each model stepped by its own fused Adam."""

    def __init__(self, lm, critic, mini_batch_size: int, ppo_epochs: int):
        super().__init__(lm, mini_batch_size, ppo_epochs)
        self.v_head = None
        self.critic = critic.train()
        self.optimizer = torch.optim.Adam(lm.parameters(), lr=LEARNING_RATE, fused=True)
        self.critic_optimizer = torch.optim.Adam(critic.parameters(), lr=LEARNING_RATE, fused=True)

    def _values(self, batch: dict, values) -> torch.Tensor:
        """The critic's score head on its backbone's hidden states at the response positions. (n, K)"""
        inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        hidden = self.critic.transformer(**inputs).last_hidden_state
        index = batch["positions"].unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        return self.critic.score(hidden.gather(1, index)).squeeze(-1)

    def _update(self, pg_loss: torch.Tensor, vf_loss: torch.Tensor) -> None:
        pg_loss.backward()
        vf_loss.backward()
        for optimizer in (self.optimizer, self.critic_optimizer):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def make_critic_step_fn(method: str, workload: Workload, device: str, dtype: torch.dtype):
    """`make_step_fn` for the critic workloads: a plain causal-LM policy and a sequence-classification critic."""
    lm = make_lm(workload, device, dtype)
    critic = make_critic(lm, device, dtype)
    if method == "floor":
        return FloorCriticPPO(lm, critic, workload.mini_batch_size, workload.ppo_epochs).step
    from trl_lite import PPOConfig

    config = PPOConfig(
        batch_size=workload.batch_size, mini_batch_size=workload.mini_batch_size, ppo_epochs=workload.ppo_epochs,
        learning_rate=LEARNING_RATE, seed=workload.seed,
    )  # fmt: skip
    return quiet_trainer(config, lm, copy.deepcopy(lm), tokenizer=None, value_model=critic).step


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return
    if args.threads is not None:
        # The workers inherit the environment; torch reads OMP_NUM_THREADS when it starts.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    workloads = [w for group in args.workloads for w in WORKLOAD_GROUPS[group]()]
    machine = machine_description(args.device)
    peak = args.peak_gflops
    source = "given"
    if peak is None and args.device == "cpu" and args.dtype == "fp32":
        peak, source = matmul_peak_gflops(), "measured at start: best 1536^3 fp32 product"
    elif peak is None and args.device == "cuda":
        peak, source = H100_BF16_PEAK_GFLOPS, "dense bf16 peak of an H100 SXM, the default on cuda"
    if peak:
        machine += f"; matmul peak {peak:.0f} GFLOP/s ({source})"
    print(f"machine: {machine}", flush=True)
    results = run_benchmark(workloads, args.methods, args.steps, args.warmup, args.device, args.dtype, peak, not args.no_tensor_peak)
    table = format_table(results)
    print(table)
    settings = (
        f"{args.steps} timed steps after {args.warmup} warm-up; load average at end "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + f"; {time.strftime('%Y-%m-%d')}"
    )
    body = f"Machine: {machine}\n\n{settings}\n\n{describe_workloads(workloads)}\n\n{table}"
    heading = f"{args.device} {args.dtype}: {' '.join(args.workloads)}"
    if args.threads is not None:
        heading += f", torch threads {args.threads}"
    write_results(args.output, heading, body)
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
