"""The LM head in chunks of tokens (``core.lm_head``, ``PPOConfig.lm_head_chunk_size``, docs/memory.md).

Core: log-probs, entropy and their gradients (hidden, W, b) chunk by chunk against float64 autograd on a
plain ``log_softmax(z / T)``, at several temperatures; the full KL from both heads' inputs; the logits
functions' temperature; no ``(N, V)`` tensor is ever made; bf16 and autocast; the automatic rule.
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import trl_lite.core.lm_head as lm_head_module
from trl_lite import core

F32_TOL = 1e-5
PEAK_MEMORY_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "peak_memory.py"


def _inputs(dtype, rows=23, hidden_size=5, vocab=17, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, hidden_size, generator=g, dtype=torch.float64)).to(dtype).requires_grad_(True)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True) if bias else None
    labels = torch.randint(0, vocab, (rows,), generator=g)
    return hidden, weight, b, labels


def _plain(hidden, weight, bias, labels, temperature):
    """The textbook log-probs and entropy of ``softmax((h W^T + b) / T)``, float64 leaves with grad."""
    leaves = [t.detach().double().requires_grad_(True) if t is not None else None for t in (hidden, weight, bias)]
    h, w, b = leaves
    logits = h @ w.t() + (b if b is not None else 0.0)
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    return log_p.gather(-1, labels[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1), leaves


def _grads(lp, entropy, leaves, a, c):
    """Gradients of ``sum(a * lp + c * H)`` (a or c None: that output unused) for the non-None leaves."""
    total = sum((w * x.double()).sum() for w, x in ((a, lp), (c, entropy)) if w is not None)
    return torch.autograd.grad(total, [t for t in leaves if t is not None])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_head_matches_float64_autograd_of_the_plain_log_softmax(dtype, chunk, temperature, bias):
    hidden, weight, b, labels = _inputs(dtype, bias=bias, seed=1)
    g = torch.Generator().manual_seed(2)
    a, c = torch.randn(len(labels), generator=g, dtype=torch.float64), torch.randn(len(labels), generator=g, dtype=torch.float64)
    tol = 1e-12 if dtype == torch.float64 else F32_TOL
    leaves = [t for t in (hidden, weight, b) if t is not None]
    # The loss may use both outputs, only the log-probs, or only the entropy (its gradient then comes alone).
    for coefs in ((a, c), (a, None), (None, c)):
        lp, entropy = core.logprobs_and_entropy_from_hidden(hidden, weight, b, labels, chunk_size=chunk, temperature=temperature)
        assert lp.dtype == entropy.dtype == torch.promote_types(dtype, torch.float32)
        got = _grads(lp, entropy, leaves, *coefs)
        ref_lp, ref_entropy, ref_leaves = _plain(hidden, weight, b, labels, temperature)
        want = _grads(ref_lp, ref_entropy, ref_leaves, *coefs)
        torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=0, atol=tol)
        torch.testing.assert_close(entropy.double(), ref_entropy.detach(), rtol=0, atol=tol)
        for x, y in zip(got, want):
            assert x.dtype == dtype
            torch.testing.assert_close(x.double(), y, rtol=tol, atol=tol)
    with torch.no_grad():
        no_grad = core.logprobs_from_hidden(hidden, weight, b, labels, chunk_size=chunk, temperature=temperature)
    torch.testing.assert_close(no_grad.double(), ref_lp.detach(), rtol=0, atol=tol)


@pytest.mark.parametrize("chunk", [0, 1, 64])
def test_a_pass_of_no_tokens_gives_empty_outputs_and_zero_gradients(chunk):
    # A slice of a pass cut over more processes than its row has tokens holds no token at all.
    hidden, weight, b, labels = _inputs(torch.float32, bias=True, seed=3)
    hidden = hidden[:0].detach().requires_grad_()
    lp, entropy = core.logprobs_and_entropy_from_hidden(hidden, weight, b, labels[:0], chunk_size=chunk)
    assert lp.shape == entropy.shape == (0,)
    grads = torch.autograd.grad((lp.sum() + entropy.sum()), [hidden, weight, b], allow_unused=True)
    assert grads[0].shape == (0, weight.shape[1])
    assert all(g is None or not g.any() for g in grads[1:])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_buffer_head_and_logits_functions_take_the_temperature(temperature):
    hidden, weight, b, labels = _inputs(torch.float64, seed=3)
    g = torch.Generator().manual_seed(4)
    a, c = torch.randn(len(labels), generator=g, dtype=torch.float64), torch.randn(len(labels), generator=g, dtype=torch.float64)
    ref_lp, ref_entropy, ref_leaves = _plain(hidden, weight, b, labels, temperature)
    want = _grads(ref_lp, ref_entropy, ref_leaves, a, c)
    lp, entropy = core.logprobs_and_entropy_from_hidden(hidden, weight, b, labels, temperature=temperature)
    for x, y in zip(_grads(lp, entropy, (hidden, weight, b), a, c), want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    logits = (hidden @ weight.t() + b).detach().requires_grad_(True)
    lp, entropy = core.logprobs_and_entropy_from_logits(logits, labels, temperature=temperature)
    (grad_logits,) = _grads(lp, entropy, (logits,), a, c)
    ref_logits = logits.detach().clone().requires_grad_(True)
    log_p = torch.log_softmax(ref_logits / temperature, -1)
    (want_logits,) = _grads(log_p.gather(-1, labels[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1), (ref_logits,), a, c)
    torch.testing.assert_close(grad_logits, want_logits, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(core.logprobs_from_logits(logits, labels, temperature=temperature), ref_lp)
        torch.testing.assert_close(core.logprobs_from_logits(logits, labels, gather=False, temperature=temperature), log_p)
        torch.testing.assert_close(core.entropy_from_logits(logits, temperature=temperature), ref_entropy)
        torch.testing.assert_close(core.logprobs_from_hidden(hidden, weight, b, labels, temperature=temperature), ref_lp)


@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_full_kl_from_both_heads_inputs_matches_float64(temperature):
    # The reference may be another model of the same vocabulary: its own hidden size, head and bias.
    hidden, weight, b, _ = _inputs(torch.float32, rows=19, seed=5)
    ref_hidden, ref_weight, _, _ = _inputs(torch.float32, rows=19, hidden_size=8, bias=False, seed=6)
    with torch.no_grad():
        got = core.full_kl_from_hidden(hidden, weight, b, ref_hidden, ref_weight, None, 4, temperature)
        log_p = torch.log_softmax((hidden.double() @ weight.double().t() + b.double()) / temperature, -1)
        log_q = torch.log_softmax((ref_hidden.double() @ ref_weight.double().t()) / temperature, -1)
        want = (log_p.exp() * (log_p - log_q)).sum(-1)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=F32_TOL)
        assert want.min() > 0.1  # two different distributions: a wrong pairing would show
        logits_kl = core.full_kl_from_logits(hidden @ weight.t() + b, ref_hidden @ ref_weight.t(), temperature)
        torch.testing.assert_close(logits_kl.double(), want, rtol=0, atol=F32_TOL)


class _LargestOutput(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tokens_by_vocabulary_tensor_is_made_in_chunks():
    rows, vocab, hidden_size, chunk = 64, 50, 4, 8
    hidden, weight, b, labels = _inputs(torch.float32, rows, hidden_size, vocab, seed=7)
    ref_hidden = torch.randn(rows, hidden_size)

    def run(chunk_size):
        with _LargestOutput() as mode:
            lp, entropy = core.logprobs_and_entropy_from_hidden(hidden, weight, b, labels, chunk_size=chunk_size)
            (lp.sum() + entropy.sum()).backward()
            with torch.no_grad():
                core.logprobs_from_hidden(hidden, weight, b, labels, chunk_size=chunk_size)
                if chunk_size:
                    core.full_kl_from_hidden(hidden, weight, b, ref_hidden, weight, b, chunk_size)
        return mode.largest

    assert run(chunk) == chunk * vocab
    assert run(0) == rows * vocab  # the one-buffer path does hold (N, V): the check sees it


def test_bf16_head_and_autocast_in_chunks_match_the_one_buffer_head():
    # bf16 weights: the product in bf16 as the model computes it, then float32; gradients come back in bf16.
    hidden, weight, b, labels = _inputs(torch.bfloat16, rows=30, vocab=13, seed=8)
    lp, entropy = core.logprobs_and_entropy_from_hidden(hidden, weight, b, labels, chunk_size=7)
    with torch.no_grad():
        ref_logits = torch.nn.functional.linear(hidden, weight, b).double()
    ref_log_p = torch.log_softmax(ref_logits, -1)
    torch.testing.assert_close(lp.double(), ref_log_p.gather(-1, labels[:, None]).squeeze(-1), rtol=0, atol=F32_TOL)
    lp.sum().backward()
    ref_lp, _, ref_leaves = _plain(hidden, weight, b, labels, 1.0)
    for leaf, want in zip((hidden, weight, b), torch.autograd.grad(ref_lp.sum(), ref_leaves)):
        assert leaf.grad.dtype == torch.bfloat16
        # grad_W and grad_b add one bf16-rounded product per chunk (5 here), in float32: a few bf16 roundings.
        torch.testing.assert_close(leaf.grad.double(), want, rtol=2**-5, atol=6e-2)
    # Under autocast both paths run the head's products in bf16: same numbers up to bf16 rounding of the
    # gradient's partial sums (the chunks add theirs in float32).
    hidden, weight, _, labels = _inputs(torch.float32, rows=24, vocab=300, bias=False, seed=9)
    results = []
    for chunk in (0, 5):
        hidden.grad = weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, entropy = core.logprobs_and_entropy_from_hidden(hidden, weight, None, labels, chunk_size=chunk)
        (lp.sum() + 0.1 * entropy.sum()).backward()
        results.append((lp.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone()))
    (lp0, h0, gh0, gw0), (lp1, h1, gh1, gw1) = results
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=F32_TOL)
    torch.testing.assert_close(h1, h0, rtol=0, atol=F32_TOL)
    torch.testing.assert_close(gh1, gh0, rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(gw1, gw0, rtol=2**-7, atol=1e-3)
    with torch.no_grad():
        fp32 = core.logprobs_from_hidden(hidden, weight, None, labels, chunk_size=5)
    assert (fp32 - lp1).abs().max() > 1e-4  # autocast acted


def test_automatic_rule_keeps_one_buffer_while_small_and_chunks_above():
    vocab = 151_936
    row = 4 * vocab
    assert core.lm_head_chunk_size(10_000, vocab, "cpu", requested=0) == 0
    assert core.lm_head_chunk_size(3, vocab, "cpu", requested=64) == 64
    assert core.lm_head_chunk_size((256 << 20) // row, vocab, "cpu") == 0
    assert core.lm_head_chunk_size((256 << 20) // row + 1, vocab, "cpu") == (64 << 20) // row == 110
    assert core.lm_head_chunk_size((1 << 30) // row, vocab, "cuda") == 0
    assert core.lm_head_chunk_size(8192, vocab, "cuda") == (256 << 20) // row == 441
    assert core.lm_head_chunk_size(8192, vocab, "xpu") == 441  # other accelerators: the accelerator's numbers
    assert core.lm_head_chunk_size(10**9, 10**9, "cpu") == 1  # never 0 once chunked
    # A bf16 head's one buffer also casts its (N, V) gradient to bf16: 6 bytes a logit, not 4.
    tokens = (1 << 30) // row
    assert core.lm_head_chunk_size(tokens, vocab, "cuda", weight_dtype=torch.float32) == 0
    assert core.lm_head_chunk_size(tokens, vocab, "cuda", weight_dtype=torch.bfloat16) == 441
    assert core.lm_head_chunk_size(tokens * 4 // 6, vocab, "cuda", weight_dtype=torch.bfloat16) == 0


def test_rule_stays_chunked_after_a_back_off():
    # Issue 50: 3,000 tokens of a 152k vocabulary take chunks on CUDA; the back-off halves them to 1,500, whose
    # one buffer (0.91 GB) the rule used to pick - the bigger path, right after running out of memory.
    vocab = 151_936
    assert core.lm_head_chunk_size(3000, vocab, "cuda") == 441
    assert core.lm_head_chunk_size(1500, vocab, "cuda") == 0  # a step that never ran out keeps one buffer
    for tokens in (1500, 750, 100, 1):
        assert core.lm_head_chunk_size(tokens, vocab, "cuda", backed_off=True) == 441
        assert core.lm_head_chunk_size(tokens, vocab, "cpu", backed_off=True) == 110
    assert core.lm_head_chunk_size(1500, vocab, "cuda", requested=0, backed_off=True) == 0  # asked for: as given


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(chunk_size=-1), ValueError, r"chunk_size must be an int >= 0 \(0: one buffer\), got -1"),
        (dict(chunk_size=2.0), TypeError, r"chunk_size must be an int >= 0 .* got 2.0 \(float\)"),
        (dict(chunk_size=True), TypeError, r"chunk_size must be an int >= 0 .* got True \(bool\)"),
        (dict(temperature=0.0), ValueError, r"temperature must be a finite number > 0, got 0.0"),
        (dict(temperature=float("inf")), ValueError, r"temperature must be a finite number > 0, got inf"),
        (dict(temperature="1"), TypeError, r"temperature must be a finite number > 0, got '1' \(str\)"),
    ],
)
def test_bad_chunk_size_or_temperature_is_rejected(kwargs, error, match):
    hidden, weight, b, labels = _inputs(torch.float32, seed=10)
    with pytest.raises(error, match=match):
        core.logprobs_and_entropy_from_hidden(hidden, weight, b, labels, **kwargs)
    with torch.no_grad(), pytest.raises(error, match=match):
        core.logprobs_from_hidden(hidden, weight, b, labels, **kwargs)
    if "temperature" in kwargs:
        with pytest.raises(error, match=match):
            core.logprobs_from_logits(hidden @ weight.t(), labels, **kwargs)
    with pytest.raises(ValueError, match="chunk_size must be a positive int for full_kl_from_hidden, got 0"):
        core.full_kl_from_hidden(hidden, weight, b, hidden, weight, b, 0)


def test_chunk_buffers_are_the_logits_dtype_and_reused():
    # The forward and the backward each allocate one (C, V) work buffer, whatever the number of chunks.
    hidden, weight, b, labels = _inputs(torch.float32, rows=40, vocab=11, seed=11)
    calls = []
    real = lm_head_module._work_buffer

    def recording(n, chunk_size, w):
        buffer = real(n, chunk_size, w)
        calls.append((tuple(buffer.shape), buffer.dtype))
        return buffer

    lm_head_module._work_buffer = recording
    try:
        lp, _ = core.logprobs_and_entropy_from_hidden(hidden, weight, b, labels, chunk_size=3)
        lp.sum().backward()
    finally:
        lm_head_module._work_buffer = real
    assert calls == [((3, 11), torch.float32)] * 2  # forward and backward, 14 chunks each
    assert np.isfinite(hidden.grad.numpy()).all()


def _tensor_peak_mb(run) -> float:
    """The live tensor memory at the peak of ``run()``, counted from its start (the benchmarks' replay)."""
    spec = importlib.util.spec_from_file_location("peak_memory", PEAK_MEMORY_PATH)
    peak_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peak_memory)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return peak_memory.tensor_peak_mb(prof)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_backward_holds_no_weight_sized_temporary(dtype):
    # Issue 50, at its sizes: dW used to be summed in a float32 (V, H) buffer, each chunk adding a bf16 (V, H)
    # product, then cast: 43 MB against the one buffer's 15 MB. Now it is summed in the weight's gradient itself.
    rows, hidden_size, vocab = 256, 1024, 4096
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(rows, hidden_size, generator=g).div_(8).to(dtype).requires_grad_(True)
    weight = torch.randn(vocab, hidden_size, generator=g).div_(8).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    grad_mb = vocab * hidden_size * weight.element_size() / 2**20

    def step(chunk):
        def run():
            lp, entropy = core.logprobs_and_entropy_from_hidden(hidden, weight, None, labels, chunk_size=chunk)
            (lp.sum() + 0.1 * entropy.sum()).backward()

        hidden.grad = weight.grad = None
        return _tensor_peak_mb(run), weight.grad.clone()

    (one_peak, one_grad), (chunk_peak, chunk_grad) = step(0), step(32)
    assert chunk_peak < one_peak
    # Besides the gradient itself: the (32, V) work buffer and its cache-sized piece, the chunk's cast, grad_hidden.
    # A bfloat16 gradient is summed over the chunks in float32 (issue 59 item 2): that sum is twice its bytes.
    sum_mb = 2 * grad_mb if dtype == torch.bfloat16 else grad_mb
    assert chunk_peak < sum_mb + 3 * 32 * vocab * 4 / 2**20 + rows * hidden_size * 4 / 2**20
    ref_lp, ref_entropy, leaves = _plain(hidden, weight, None, labels, 1.0)
    (want,) = torch.autograd.grad(ref_lp.sum() + 0.1 * ref_entropy.sum(), leaves[1])
    assert chunk_grad.dtype == dtype
    # float32: summation order only. bf16: the product of bf16 inputs, 8 chunks summed in float32, one cast.
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-5, atol=2e-2)
    torch.testing.assert_close(chunk_grad.double(), want, **tol)
    torch.testing.assert_close(one_grad.double(), want, **tol)


def test_call_head_runs_the_pass_inside_the_module_call_and_puts_its_forward_back():
    """What ZeRO-3 relies on (``lm_head_module.call_head``): the module's forward pre/post hooks run around the
    pass, whose outputs the post hook sees (it wraps them for the backward's gather), and the module's forward
    (its class's, or an instance forward set before) is the same afterwards."""
    head = torch.nn.Linear(4, 6)
    seen = []
    head.register_forward_pre_hook(lambda module, args: seen.append(("pre", module.weight.shape)))
    head.register_forward_hook(lambda module, args, output: seen.append(("post", output)))
    hidden, targets = torch.randn(5, 4), torch.tensor([0, 5, 2, 2, 1])

    def head_pass(x):
        seen.append(("pass", x))
        return core.logprobs_from_logits(x @ head.weight.t() + head.bias, targets), None

    logprobs, _ = lm_head_module.call_head(head, head_pass, hidden)
    assert [what for what, _ in seen] == ["pre", "pass", "post"] and seen[1][1] is hidden
    assert seen[2][1][0] is logprobs
    want = torch.log_softmax(hidden.double() @ head.weight.double().t() + head.bias.double(), -1)[range(5), targets]
    torch.testing.assert_close(logprobs.double(), want, rtol=0, atol=1e-6)
    assert "forward" not in head.__dict__ and torch.equal(head(hidden), hidden @ head.weight.t() + head.bias)
    own = head.forward = lambda x: x  # an instance forward (accelerate's hooks set one) comes back too
    lm_head_module.call_head(head, head_pass, hidden)
    assert head.__dict__["forward"] is own
