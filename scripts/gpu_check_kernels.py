"""The rows of `gpu_check.py` that run in its own process and look at what reaches the GPU's kernels:
``bf16-step`` (the LM head's matrix products in bf16), ``syncs`` (host-device synchronisations per training
mini-batch) and ``gqa`` (varlen attention with grouped key/value heads)."""

from __future__ import annotations

import os
import re
import warnings
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_check_common import REPO_ROOT, VOCAB_SIZE, make_batch, make_trainer, shared_trainer

_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}
# Host-device synchronisations allowed per training mini-batch of a step (the row fails above).
SYNC_BUDGET = 2
GQA_RTOL = 1e-2  # the gqa row: unrepeated and repeated K/V calls agree to a few bf16 roundings


class MatmulDtypes(TorchDispatchMode):
    """Records ``(op, operand dtypes)`` of every matrix product (``mm``, ``addmm``, ``bmm``, ``baddbmm``)
    one of whose operands has a dimension of size ``dim``, as the ops reach the kernels (after autocast)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.seen: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _MATMULS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(a.dim() >= 2 and self.dim in a.shape for a in tensors):
                dtypes = tuple(str(a.dtype).removeprefix("torch.") for a in tensors)
                self.seen.append((func.overloadpacket.__name__, dtypes))
        return func(*args, **(kwargs or {}))


def sync_sites(records) -> Counter:
    """Synchronisation warnings (``warnings.catch_warnings(record=True)`` entries) by ``file:line``;
    other warnings are left out."""
    return Counter(
        f"{os.path.relpath(r.filename, REPO_ROOT)}:{r.lineno}"
        for r in records
        if "synchronizing" in str(r.message).lower()
    )


def sync_verdict(total: int, minibatches: int, per_step: int = 0, budget: int = SYNC_BUDGET) -> tuple[str, float]:
    """``("PASS" or "FAIL", syncs per training mini-batch)``: the ``per_step`` syncs a step makes once
    (``trl_lite.trainer.step.transfer.sync_budget``) set aside, FAIL above ``budget`` per mini-batch."""
    per_minibatch = (total - per_step) / minibatches
    return ("PASS" if per_minibatch <= budget else "FAIL"), per_minibatch


def check_bf16_step(args) -> tuple[str, str]:
    trainer = shared_trainer()
    queries, responses, scores = make_batch()
    trainer.step(queries, responses, scores)  # warm-up: one-time initialisations out of the profile
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
        with torch.profiler.profile(activities=activities) as profile, MatmulDtypes(VOCAB_SIZE) as matmuls:
            trainer.step(queries, responses, scores)
    kernels = Counter()
    for event in profile.key_averages():
        on_gpu = event.device_type == torch.autograd.DeviceType.CUDA
        if on_gpu and re.search(r"gemm|nvjet|xmma|cutlass", event.key, re.IGNORECASE):
            kernels[event.key[:60]] += event.count
    not_bf16 = [(op, dtypes) for op, dtypes in matmuls.seen if set(dtypes) != {"bfloat16"}]
    status = "PASS" if matmuls.seen and not not_bf16 else "FAIL"
    detail = f"{len(matmuls.seen)} LM-head products, {len(not_bf16)} not in bf16"
    detail += f" (e.g. {not_bf16[0][0]} {not_bf16[0][1]})" if not_bf16 else ""
    return status, detail + "; GEMM kernels: " + ", ".join(f"{k} x{n}" for k, n in kernels.most_common(4))


def step_syncs(trainer, batch) -> Counter:
    """The synchronisation warnings of one ``trainer.step(*batch)`` after a warm-up step, by source line."""
    trainer.step(*batch)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.step(*batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sync_sites(records)


def check_syncs(args) -> tuple[str, str]:
    from trl_lite.trainer.step.transfer import sync_budget

    runs = {
        "GAE": (shared_trainer(), make_batch()),
        "GRPO": (make_trainer("bf16", advantage_estimator="grpo", num_samples_per_query=2), make_batch(group_size=2)),
    }
    details, failed = [], False
    for name, (trainer, batch) in runs.items():
        sites = step_syncs(trainer, batch)
        budget = sync_budget(trainer.config)  # the syncs trl_lite lists for this config, host inputs
        total = sum(sites.values())
        status, per_minibatch = sync_verdict(total, budget["minibatches"], budget["per_step"])
        failed |= status == "FAIL"
        where = ", ".join(f"{site} x{n}" for site, n in sites.most_common(8))
        details.append(
            f"{name}: {per_minibatch:.1f} per training mini-batch (budget {SYNC_BUDGET}): {total} in one step of "
            f"{budget['minibatches']} mini-batches, {budget['per_step']} of them once per step (listed: "
            f"{budget['total']}); {where or 'none'}"
        )
    return ("FAIL" if failed else "PASS"), "; ".join(details)


def gqa_agreement(device: str = "cuda") -> list[float] | str:
    """One varlen call of 8 query heads over 2 key/value heads (bf16) with the 2 heads unrepeated and with them
    repeated: the largest difference of the output and of the gradients of q, k, v, each relative to the
    largest entry of the repeated call's; or, where the kernel refuses unrepeated heads, its error."""
    from trl_lite.models.varlen_attention import KERNEL, _keywords, packed_rows

    g = torch.Generator(device=device).manual_seed(0)
    rows = packed_rows((37, 5, 64, 19), device)
    shapes = ((rows.total, 8, 64), (rows.total, 2, 64), (rows.total, 2, 64))
    q, k, v = (torch.randn(s, generator=g, device=device, dtype=torch.bfloat16).requires_grad_() for s in shapes)
    keywords = _keywords(KERNEL.function)
    causal = {"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True}
    offsets = (rows.cu_seqlens, rows.cu_seqlens, rows.max_length, rows.max_length)

    def call(repeat: bool):
        key, value = (t.repeat_interleave(4, dim=1) if repeat else t for t in (k, v))
        grouped = {"enable_gqa": True} if not repeat and "enable_gqa" in keywords else {}
        out = KERNEL.function(q, key, value, *offsets, **causal, **grouped)
        return (out, *torch.autograd.grad(out.float().square().sum(), (q, k, v)))

    repeated = call(True)
    try:
        unrepeated = call(False)
    except RuntimeError as error:
        return str(error)
    return [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(unrepeated, repeated)]


def check_gqa(args) -> tuple[str, str]:
    from trl_lite.models.varlen_attention import KERNEL

    if KERNEL.function is None:
        return "SKIP", f"torch {torch.__version__} has no varlen_attn"
    diffs = gqa_agreement()
    if isinstance(diffs, str):
        return "INFO", f"the kernel refuses unrepeated K/V ({diffs[:120]}): the trainer repeats them"
    # bf16 rounding, and the K/V gradients sum a group's 4 query heads in another order.
    status = "PASS" if max(diffs) <= GQA_RTOL else "FAIL"
    names = ("output", "grad q", "grad k", "grad v")
    return status, f"unrepeated vs repeated K/V, max |difference| / max |entry| (PASS <= {GQA_RTOL}): " + ", ".join(
        f"{n} {d:.1e}" for n, d in zip(names, diffs)
    )
