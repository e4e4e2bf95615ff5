"""The workloads of `bench_step.py`: their shapes, batches and models, and the FLOPs a step on them needs.

A workload is a model shape (a random-init GPT-2 or Qwen2, or SmolLM2's real weights) and a PPO batch of random
token ids; `WORKLOAD_GROUPS` holds the groups `--workloads` names. Nothing here needs trl_lite.
"""

import copy
import dataclasses
import json
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


# ---------------------------------------------------------------------------------------------
# Critic-free workloads (docs/algorithm.md section 12): GRPO on a plain causal LM, against GAE on the same batch
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CriticFreeWorkload(Workload):
    """A workload whose rows come in groups of `num_samples_per_query` sharing a query, stepped with
    `advantage_estimator` ("gae": the value-head trainer and `FloorPPO`, as the other workloads)."""

    num_samples_per_query: int = 4
    advantage_estimator: str = "grpo"
    gradient_accumulation_steps: int = 1


GRPO_W1 = CriticFreeWorkload("grpo-w1", n_layer=2, n_embd=128, n_head=2, batch_size=16, mini_batch_size=4, ppo_epochs=4)
# The same batch stepped with GAE and a value head: the time a critic costs.
GAE_W1_GROUPED = dataclasses.replace(GRPO_W1, name="gae-w1-grouped", advantage_estimator="gae")
WORKLOAD_GROUPS["critic_free"] = lambda: [GRPO_W1, GAE_W1_GROUPED]


def grouped_batch(workload: CriticFreeWorkload) -> tuple:
    """`make_batch` of the plain workload, with the query of each group's first row given to the whole group."""
    queries, responses, scores = make_batch(Workload(**{f.name: getattr(workload, f.name) for f in dataclasses.fields(Workload)}))
    k = workload.num_samples_per_query
    return [queries[i - i % k] for i in range(len(queries))], responses, scores


# Prefix sharing (issue 52): 4 prompts of 512 tokens, G = 8 responses of 32-96, one pass per mini-batch of the whole
# batch (every pass holds whole groups). `short-pairs`: G = 2 and 16-token prompts, where sharing saves about 10%
# of the tokens, under the automatic rule's 25% (`step-prefix-auto` takes the unshared path; it must cost <= 1.05x).
SHARED_PREFIX = CriticFreeWorkload(
    "shared-prefix", n_layer=4, n_embd=256, n_head=4, batch_size=32, mini_batch_size=32, ppo_epochs=2,
    query_len=(512, 512), response_len=(32, 96), vocab_size=8192, num_samples_per_query=8,
)  # fmt: skip
SHORT_PAIRS = dataclasses.replace(SHARED_PREFIX, name="short-pairs", query_len=(16, 16), num_samples_per_query=2)
# The same batch trained in mini-batches of 8 rows, 4 accumulated per optimizer step, one epoch (issue 59): the passes
# share only what a mini-batch holds, so the epoch's order decides the saving (shuffle_by_prompt, automatic: by prompt).
SHARED_PREFIX_MB8 = dataclasses.replace(SHARED_PREFIX, name="shared-prefix-mb8", mini_batch_size=8,
                                        gradient_accumulation_steps=4, ppo_epochs=1)  # fmt: skip
WORKLOAD_GROUPS["shared_prefix"] = lambda: [SHARED_PREFIX, SHARED_PREFIX_MB8, SHORT_PAIRS]


# ---------------------------------------------------------------------------------------------
# grpo-beta0 (docs/algorithm.md section 3): GRPO with the KL at 0 and one optimizer step per batch, where
# step() runs no pass without grad; the method "step-every-pass" forces both passes (the path before RolloutPlan)
# ---------------------------------------------------------------------------------------------
GRPO_BETA0 = CriticFreeWorkload(
    "grpo-beta0", n_layer=2, n_embd=128, n_head=2, batch_size=16, mini_batch_size=4, ppo_epochs=1,
    options=json.dumps({"gradient_accumulation_steps": 4, "init_kl_coef": 0.0, "adap_kl_ctrl": False}),
)  # fmt: skip
WORKLOAD_GROUPS["grpo-beta0"] = lambda: [GRPO_BETA0]


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
