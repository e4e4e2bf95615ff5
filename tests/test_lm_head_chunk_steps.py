"""``step()`` with the LM head in chunks (``PPOConfig.lm_head_chunk_size``, docs/memory.md, docs/algorithm.md
section 21): chunked steps take the float64 reference's updates for GAE and GRPO, every ``loss_type``, the
entropy bonus and the KL in the loss; the classic float32 reference with ``kl_penalty="full"`` and PTX; and
chunked and one-buffer steps agree with each other (statistics and update) with head biases, tied
embeddings, gradient checkpointing, a token budget, PEFT and bf16 autocast. The statistic
``memory/lm_head_chunk_size`` names the path each step took.
"""

import copy
import warnings

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from devices import on_cpu
from test_objectives import CASES, _build_pair, compared_statistics, step_both
from test_step_reference import assert_stats_close, assert_weights_close, make_batch, make_pair
from tiny_models import make_gpt2, make_qwen2, make_t5, make_tokenizer, random_batch

import trl_lite.core.lm_head as lm_head_module
import trl_lite.trainer.step.forward as forward_module
from trl_lite import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.trainer.memory.oom_backoff import PassOutOfMemory

CHUNK = 3  # tokens: every pass of these batches spans several chunks


@pytest.fixture
def one_buffer_path_forbidden(monkeypatch):
    """Fail any pass that builds the ``(N, V)`` logits buffer of the one-buffer head or the full KL's logits."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a (tokens x vocabulary) logits buffer was built in a chunked step")

    monkeypatch.setattr(lm_head_module, "_lm_head_logits", forbidden)
    monkeypatch.setattr(forward_module, "full_kl_from_logits", forbidden)


# GAE and GRPO, every loss_type, the entropy bonus, the KL in the loss, TIS, the sequence-level ratio.
FLOAT64_CASES = [
    "sgd_defaults_gae", "gspo_grpo_kl_in_loss", "seq_mean_token_mean_reinforce_pp", "dr_grpo_sum_norm",
    "global_token_mean_grad_accum_gae", "entropy_bonus_fused_gae", "everything_rloo_grad_accum",
]  # fmt: skip


def assert_two_steps_match_float64(case: dict, trainer_options: dict, reference_options: dict | None = None,
                                   also_compared: tuple = ()) -> list:
    """Two steps of the trainer (``case`` plus ``trainer_options``) and of the float64 reference (``case`` plus
    ``reference_options``): the loss statistics (and ``also_compared``) and the SGD updates agree to float32
    rounding. Returns the ``(got, want)`` statistics of each step."""
    trainer, plain, config, critic_free = _build_pair(case, trainer_options, reference_options)
    initial = {k: v.detach().double().clone() for k, v in plain.model.state_dict().items()}
    steps = []
    for step in range(2):
        got, want, _, _ = step_both(trainer, plain, config, case, step)
        compared = compared_statistics(config)
        for key in compared + also_compared:
            np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=2e-5, atol=2e-6, err_msg=key)
        steps.append((got, want))
    module = trainer.model.pretrained_model if critic_free else trainer.accelerator.unwrap_model(trainer.model)
    got_weights = on_cpu(module.state_dict())
    for key, want_value in plain.model.state_dict().items():
        update = want_value - initial[key]
        error = (got_weights[key].double() - want_value).norm()
        assert error <= 1e-4 * update.norm() + 1e-6, f"{key}: error {error:.3g}, update {update.norm():.3g}"
    return steps


@pytest.mark.parametrize("name", FLOAT64_CASES)
def test_chunked_steps_match_the_float64_reference(name, one_buffer_path_forbidden):
    for got, _ in assert_two_steps_match_float64(CASES[name], {"lm_head_chunk_size": CHUNK}):
        assert got["memory/lm_head_chunk_size"] == CHUNK


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_full_kl_and_ptx_match_the_classic_reference(temperature, one_buffer_path_forbidden):
    """kl_penalty="full" from both models' head inputs, chunk by chunk, and the PTX loss in chunks: the classic
    float32 reference's statistics and Adam updates over two steps; at temperature 0.7 the KL under z / T and
    the PTX loss (language modelling) at temperature 1 (docs/algorithm.md section 20)."""
    config = dict(kl_penalty="full", adap_kl_ctrl=False, ptx_coef=0.5, lm_head_chunk_size=CHUNK, temperature=temperature)
    trainer, plain = make_pair(config)
    for step in range(2):
        queries, responses, scores, _ = make_batch(step)
        ptx = random_batch(len(queries), seed=50 + step, query_len=(3, 7))[0]
        torch.manual_seed(1000 + step)
        got = trainer.step(queries, responses, scores, ptx_inputs=ptx)
        torch.manual_seed(1000 + step)
        want = plain.step(queries, responses, scores, ptx_inputs=ptx)
        assert_stats_close(got, want)
        np.testing.assert_allclose(got["ppo/loss/ptx"], want["ppo/loss/ptx"], rtol=1e-5, atol=1e-6)
        assert got["memory/lm_head_chunk_size"] == CHUNK
    assert_weights_close(trainer, plain)
    assert want["objective/kl"] != 0.0


def _reset_accelerate_state():
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _with_head_bias(lm):
    """``lm`` with an untied LM head that has a bias (GPT-2's has none and is tied to the embedding)."""
    head = lm.get_output_embeddings()
    new = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        new.weight.copy_(head.weight)
        new.bias.copy_(0.3 * torch.randn(head.out_features, generator=torch.Generator().manual_seed(4)))
    lm.lm_head = new
    lm.config.tie_word_embeddings = False
    return lm


def _lora(lm):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0))


# Each case: the model, the config, whether step() gets PTX rows. Compared: chunked against one buffer.
PAIR_CASES = {
    "gae_full_kl_ptx_entropy_bonus": (make_gpt2, dict(kl_penalty="full", entropy_coef=0.05, ptx_coef=0.5), True),
    "grpo_kl_in_loss_token_budget": (
        make_gpt2, dict(advantage_estimator="grpo", num_samples_per_query=4, max_tokens_per_minibatch=12,
                        gradient_accumulation_steps=2), False,
    ),  # fmt: skip
    "gradient_checkpointing_dapo": (make_gpt2, dict(gradient_checkpointing=True, loss_type="dapo"), False),
    "head_bias_full_kl": (lambda: _with_head_bias(make_gpt2()), dict(kl_penalty="full", entropy_coef=0.05), False),
    "qwen2_tied_embeddings_grpo": (make_qwen2, dict(advantage_estimator="grpo", num_samples_per_query=4), False),
    "peft_rloo_full_kl_entropy_bonus": (
        lambda: _lora(make_gpt2()), dict(advantage_estimator="rloo", num_samples_per_query=4, kl_penalty="full",
                                         entropy_coef=0.05), False,
    ),  # fmt: skip
    "bf16_autocast_ptx": (make_gpt2, dict(accelerator_kwargs={"mixed_precision": "bf16"}, ptx_coef=0.5), True),
}


def _trainer(model_fn, options: dict, chunk: int):
    _reset_accelerate_state()
    lm = model_fn()
    base = dict(batch_size=8, mini_batch_size=2, ppo_epochs=2, learning_rate=0.03, init_kl_coef=0.3, seed=0)
    config = PPOConfig(**{**base, **options, "lm_head_chunk_size": chunk})
    peft = hasattr(lm, "peft_config")
    policy = lm if peft or config.critic_free else AutoModelForCausalLMWithValueHead.from_pretrained(lm)
    torch.manual_seed(7)
    if not peft:
        ref = copy.deepcopy(policy)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.05 * torch.randn_like(p))
    # SGD: Adam would turn float32 rounding noise of near-zero gradients into full steps of +-lr.
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=config.learning_rate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PPOTrainer(config, policy, ref_model=None if peft else ref, tokenizer=make_tokenizer(), optimizer=optimizer)


@pytest.mark.parametrize("name", list(PAIR_CASES))
def test_chunked_and_one_buffer_steps_agree(name):
    model_fn, options, with_ptx = PAIR_CASES[name]
    bf16 = "accelerator_kwargs" in options
    results = []
    try:
        for chunk in (0, CHUNK):
            trainer = _trainer(model_fn, options, chunk)
            stats = []
            for step in range(2):
                queries, responses, scores, _ = make_batch(step)
                if options.get("num_samples_per_query"):
                    queries = [queries[(i // 4) * 4] for i in range(len(queries))]
                ptx = random_batch(len(queries), seed=50 + step, query_len=(3, 7))[0] if with_ptx else None
                torch.manual_seed(1000 + step)
                stats.append(trainer.step(queries, responses, scores, ptx_inputs=ptx))
            model = trainer.accelerator.unwrap_model(trainer.model)
            weights = {k: v.detach().float().clone() for k, v in model.named_parameters() if v.requires_grad}
            results.append((stats, on_cpu(weights)))
    finally:
        _reset_accelerate_state()
    (one_buffer, one_weights), (chunked, chunked_weights) = results
    rtol, atol = (2e-2, 2e-3) if bf16 else (2e-5, 2e-6)
    for want, got in zip(one_buffer, chunked):
        assert want["memory/lm_head_chunk_size"] == 0 and got["memory/lm_head_chunk_size"] == CHUNK
        numeric = [k for k, v in want.items() if np.ndim(v) == 0 and k != "memory/lm_head_chunk_size"]
        numeric = [k for k in numeric if not k.startswith("time/")]
        assert "ppo/policy/entropy" in numeric and "objective/kl" in numeric
        for key in numeric:
            np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=atol, err_msg=key)
    moved = 0.0
    for key, want_value in one_weights.items():
        error = (chunked_weights[key] - want_value).norm() / want_value.norm().clamp(min=1e-12)
        assert error <= (1e-2 if bf16 else 2e-5), f"{key}: relative L2 error {error:.2e}"
        moved = max(moved, float(want_value.norm()))
    assert moved > 0


def test_default_is_one_buffer_while_small_and_chunks_above(monkeypatch):
    """None (the default): these tiny passes keep one buffer; with the one-buffer limit lowered, the same
    step takes the automatic chunks and the statistic says so."""
    batch = random_batch(4, seed=1)
    trainer = _trainer(make_gpt2, dict(batch_size=4, ppo_epochs=1), None)
    assert trainer.step(*batch)["memory/lm_head_chunk_size"] == 0
    vocab = make_gpt2().config.vocab_size
    monkeypatch.setattr(lm_head_module, "_ONE_BUFFER_BYTES", {"cpu": 0, "cuda": 0})
    monkeypatch.setattr(lm_head_module, "_CHUNK_BYTES", {"cpu": 4 * vocab * 5, "cuda": 4 * vocab * 5})
    trainer = _trainer(make_gpt2, dict(batch_size=4, ppo_epochs=1, keep_freed_cpu_memory=True), None)
    assert trainer.step(*batch)["memory/lm_head_chunk_size"] == 5
    assert trainer.forward._logits_buffer is None  # chunked passes made no (N, V) buffer to keep either


def test_a_step_after_a_back_off_stays_chunked(monkeypatch):
    """Issue 50: a back-off halves the passes' tokens; the automatic rule then picked one (N, V) buffer again - the
    bigger path, right after running out of memory. Once backed off, every pass of every step takes chunks."""
    batch = random_batch(4, seed=1)
    vocab = make_gpt2().config.vocab_size
    monkeypatch.setattr(lm_head_module, "_CHUNK_BYTES", {"cpu": 4 * vocab * 5, "cuda": 4 * vocab * 5})
    trainer = _trainer(make_gpt2, dict(batch_size=4, ppo_epochs=1, max_tokens_per_minibatch=64), None)
    assert trainer.step(*batch)["memory/lm_head_chunk_size"] == 0  # small passes: one buffer
    with pytest.warns(UserWarning, match="Out of memory"), pytest.raises(PassOutOfMemory):
        trainer.forward.memory.back_off(64, single_row=False)  # what a pass out of memory does
    assert trainer.forward.memory.budget == 32
    seen = []
    real = lm_head_module.linear_head

    def recording(hidden, weight, bias, labels, chunk_size=0, *args):
        seen.append(chunk_size)
        return real(hidden, weight, bias, labels, chunk_size, *args)

    monkeypatch.setattr(forward_module, "linear_head", recording)
    assert trainer.step(*batch)["memory/lm_head_chunk_size"] == 5
    assert seen and set(seen) == {5}


def test_a_model_without_a_linear_head_says_why_once_and_keeps_its_logits():
    # T5 rescales its head's input: the model's own logits are used, as without chunks.
    _reset_accelerate_state()
    config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=1, lm_head_chunk_size=CHUNK)
    trainer = PPOTrainer(config, AutoModelForSeq2SeqLMWithValueHead.from_pretrained(make_t5()), tokenizer=make_tokenizer())
    queries, responses, scores, _ = make_batch(0, encoder_decoder=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            stats = trainer.step(queries[:4], responses[:4], scores[:4])
    said = [w for w in caught if "lm_head_chunk_size=3 does not apply" in str(w.message)]
    assert len(said) == 1 and "encoder-decoder" in str(said[0].message)
    assert stats["memory/lm_head_chunk_size"] == -1 and np.isfinite(stats["ppo/loss/total"])  # -1: its own logits


@pytest.mark.parametrize(
    "value, error, match",
    [
        (-1, ValueError, r"lm_head_chunk_size must be None \(automatic\), 0 \(one buffer\) or a positive int .* got -1"),
        (2.5, TypeError, r"lm_head_chunk_size must be None .* got 2.5 \(float\)"),
        (True, TypeError, r"lm_head_chunk_size must be None .* got True \(bool\)"),
    ],
)
def test_bad_lm_head_chunk_size_is_rejected(value, error, match):
    with pytest.raises(error, match=match):
        PPOConfig(lm_head_chunk_size=value)


def test_bench_step_one_buffer_method_and_vocab_workload(monkeypatch):
    """benchmarks/bench_step.py: "step-one-buffer" is "step" with lm_head_chunk_size=0, for value-head workloads
    only; the vocab workload's one mini-batch is large enough that the default takes chunks on CPU and CUDA."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import step_methods
    import step_workloads

    tiny = step_workloads.Workload("tiny", n_layer=1, n_embd=16, n_head=2, batch_size=2, mini_batch_size=2, ppo_epochs=1,
                                   query_len=(2, 3), response_len=(2, 3), vocab_size=31)  # fmt: skip
    for method, chunk in (("step", None), ("step-one-buffer", 0)):
        _reset_accelerate_state()
        assert step_methods.make_step_fn(method, tiny, "cpu", torch.float32).__self__.config.lm_head_chunk_size == chunk
    _reset_accelerate_state()
    with pytest.raises(ValueError, match="'step-one-buffer' exists for the value-head workloads, not 'grpo-w1'"):
        step_methods.make_step_fn("step-one-buffer", step_workloads.GRPO_W1, "cpu", torch.float32)
    # w1 and w3: whatever rows a step draws, every pass fits the CPU's one buffer - the default is today's path.
    for workload in (step_workloads.W1, step_workloads.W3):
        most_slots = workload.mini_batch_size * workload.response_len[1]
        assert lm_head_module.lm_head_chunk_size(most_slots, workload.vocab_size, "cpu") == 0
    vocab = step_workloads.VOCAB
    assert vocab.vocab_size == 151_936 and vocab.batch_size == vocab.mini_batch_size
    fewest_slots = vocab.batch_size * vocab.response_len[0]
    assert lm_head_module.lm_head_chunk_size(fewest_slots, vocab.vocab_size, "cpu") > 0
    assert lm_head_module.lm_head_chunk_size(fewest_slots, vocab.vocab_size, "cuda") == 0  # 0.6 GB fits a GPU's buffer
