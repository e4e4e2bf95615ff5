"""Host-device syncs of a step made by trl_lite itself, counted on the CPU.

On a GPU every read of a device value from Python (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``)
waits for the queued kernels. This counts such reads whose caller is trl_lite's code while the experience
is made and while the learner trains: one per mini-batch (the skip guard, a collective decision) and one per
optimizer step (the gradients' finiteness after clipping), nothing per row or per token. Reads inside
transformers are not counted here (``make gpu-check`` measures every sync on a GPU).

A second test counts the whole step's traffic (trainer/step/transfer.py lists its budget): the batch's rows go
to the device in one buffer and none on its own, and the statistics come back in one copy.
"""

import collections
import os
import sys
import warnings

import pytest
import torch
from tiny_models import make_gpt2, make_tokenizer, random_batch

import trl_lite
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

PACKAGE_DIR = os.path.dirname(trl_lite.__file__)
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


@pytest.fixture
def count_reads(monkeypatch):
    """Count the device reads of ``READS`` whose immediate caller is a trl_lite module, by caller."""
    counts = collections.Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE_DIR):
                counts[(_name, os.path.relpath(caller, PACKAGE_DIR), sys._getframe(1).f_lineno)] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def _by_site(counts) -> dict:
    by_site = collections.Counter()
    for (name, module, _), n in counts.items():
        by_site[(name, module)] += n
    return dict(by_site)


def _prompt_reads(trainer) -> dict:
    """The one read of the user's host query tokens in a step, to find rows that share a prompt (where the
    trainer looks for them: automatic or on prefix sharing over packed passes, or a shuffle by prompt)."""
    looks = trainer.forward.prefix.looks
    return {("tolist", "trainer/memory/prefix_sharing.py"): 1} if looks else {}


def _host_reads(trainer) -> int:
    """``.tolist()`` of host tensors in a step (no device read on a GPU): the epoch permutations drawn by
    ``torch.randperm`` and the query tokens of :func:`_prompt_reads`."""
    return trainer.config.ppo_epochs + sum(_prompt_reads(trainer).values())


def _trainer_and_batch(config):
    """A trainer of ``config`` on a tiny GPT-2 and a checked batch of 8 random rows for it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PPOTrainer(config, AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2()), tokenizer=make_tokenizer())
    return trainer, trainer._check_step_inputs(*random_batch(8), None, None, None, None, None)


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("gradient_accumulation_steps", [1, 2])
def test_one_sync_per_minibatch_and_one_per_update(count_reads, padding_free, gradient_accumulation_steps):
    config = PPOConfig(batch_size=8, mini_batch_size=2, ppo_epochs=2, max_grad_norm=1.0, padding_free=padding_free,
                       gradient_accumulation_steps=gradient_accumulation_steps)  # fmt: skip
    trainer, batch = _trainer_and_batch(config)
    count_reads.clear()
    experience = trainer.experience_maker.make(batch)
    # Making the experience reads nothing back per mini-batch or per row (single process: no reductions), but
    # the user's host query tokens, once, to find rows that share a prompt.
    assert _by_site(count_reads) == _prompt_reads(trainer), dict(count_reads)
    trainer.learner.train(experience)
    minibatches = config.ppo_epochs * config.batch_size // config.mini_batch_size
    updates = minibatches // gradient_accumulation_steps
    # Per epoch one more .tolist(): the permutation, drawn on the host by torch.randperm (no device read).
    assert _by_site(count_reads) == {("tolist", "trainer/step/learner.py"): minibatches, ("item", "trainer/step/learner.py"): updates,
                                     ("tolist", "trainer/memory/prefix_sharing.py"): _host_reads(trainer)}  # fmt: skip


def _user_tensors(batch):
    return [*batch.queries, *batch.responses, *batch.scores]


@pytest.mark.parametrize("padding_free", [False, True])
def test_a_step_moves_its_batch_in_one_copy_and_reads_its_statistics_back_in_one(monkeypatch, padding_free):
    """The sync budget of trainer/step/transfer.py, counted by site over a whole step without its input checks:
    per mini-batch the skip guard, per update the gradients' finiteness, per step one copy back. Reads of
    the host copy are free (host memory on a GPU too) and not counted; nor are host lists' ``.tolist()``."""
    from trl_lite.trainer.step import statistics
    from trl_lite.trainer.step import transfer

    config = PPOConfig(batch_size=8, mini_batch_size=2, ppo_epochs=2, max_grad_norm=1.0, padding_free=padding_free)
    trainer, batch = _trainer_and_batch(config)
    user = {id(t) for t in _user_tensors(batch)}
    host_copies, packs, moves, reads = set(), [], [], collections.Counter()

    def to_host_together(tensors):
        out = transfer_to_host(tensors)
        host_copies.update(t.untyped_storage().data_ptr() for t in out)
        return out

    transfer_to_host, pack = transfer.to_host_together, transfer._pack
    monkeypatch.setattr(statistics, "to_host_together", to_host_together)
    monkeypatch.setattr(transfer, "_pack", lambda tensors: packs.append(len(tensors)) or pack(tensors))
    for name in (*READS, "cpu", "numpy", "to", "cuda"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE_DIR) and self.untyped_storage().data_ptr() not in host_copies:
                site = (_name, os.path.relpath(caller, PACKAGE_DIR))
                if _name in ("to", "cuda"):
                    if id(self) in user:  # a user's row moved on its own: one copy (and sync) per row on a GPU
                        moves.append(site)
                else:
                    reads[site] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    experience = trainer.experience_maker.make(batch)
    train_stats, _ = trainer.learner.train(experience)
    before = dict(reads)
    stats = trainer.statistics.step_stats(experience, train_stats)
    assert stats["objective/kl_dist"].shape == (8,) and isinstance(stats["ppo/mean_scores"], float)
    # One buffer per step for the rows (8 queries, 8 responses, the scores, whether each ends with EOS)
    # and one for the host scalars of the statistics; no row moved on its own.
    assert packs == [8 + 8 + 1 + 1, 1] and moves == []
    minibatches = config.ppo_epochs * config.batch_size // config.mini_batch_size
    train_reads = {("tolist", "trainer/step/learner.py"): minibatches, ("item", "trainer/step/learner.py"): minibatches,
                   ("tolist", "trainer/memory/prefix_sharing.py"): _host_reads(trainer)}  # fmt: skip
    assert before == train_reads
    assert reads == {**train_reads, ("cpu", "trainer/step/transfer.py"): 1}
    # The budget: at most 2 per training mini-batch (the permutations and the query tokens are host reads).
    assert (sum(before.values()) - _host_reads(trainer)) / minibatches <= 2


@pytest.mark.parametrize("options", [{}, {"gradient_accumulation_steps": 2}, {"use_score_scaling": True, "early_stopping": True}])
def test_sync_budget_covers_every_read_of_a_step(count_reads, options):
    """``sync_budget`` (what ``make gpu-check``'s sync row compares with) against the reads of trl_lite's
    own code in a step on the CPU: equal, but the host reads of :func:`_host_reads`."""
    from trl_lite.trainer.step.transfer import sync_budget

    config = PPOConfig(batch_size=8, mini_batch_size=2, ppo_epochs=2, max_grad_norm=1.0, target_kl=1e9, **options)
    trainer, batch = _trainer_and_batch(config)
    count_reads.clear()
    experience = trainer.experience_maker.make(batch)
    trainer.statistics.step_stats(experience, trainer.learner.train(experience)[0])
    reads = sum(count_reads.values()) - _host_reads(trainer)
    budget = sync_budget(config)
    # The statistics' copy back is a .cpu() (not in READS): counted here by the budget, not by the reads.
    assert reads + 1 == budget["total"]
    assert budget["per_minibatch"] <= 2 and budget["minibatches"] == 8


def test_the_input_checks_read_the_host_once_per_kind_of_input_whatever_the_rows(count_reads):
    from trl_lite.trainer.step_inputs import validate_generation_logprobs, validate_step_inputs

    counts = []
    for rows in (8, 16):
        queries, responses, scores = random_batch(rows)
        masks = [(torch.arange(len(r)) % 2) for r in responses]
        count_reads.clear()
        validate_step_inputs(queries, responses, scores, masks, batch_size=rows, vocab_size=100, is_encoder_decoder=False)
        validate_generation_logprobs([-torch.rand(len(r)) for r in responses], responses)
        counts.append(dict(count_reads))
    # queries, responses, scores, masks, their action count, generation log-probs: one read each.
    assert counts[0] == counts[1] and sum(counts[0].values()) == 6


# --- Every synchronising operation of a step, counted at torch's dispatcher -------------------------------
#
# On the CPU there is no device to wait for, so "would be a sync on a GPU" is defined by what a tensor is:
# a *device tensor* is a model parameter or buffer, a tensor moved with ``.to(<device>)`` / created by
# ``torch.tensor``/``torch.as_tensor`` with a ``device=``, or the output of any operation that reads one.
# Everything else (the user's host inputs, ``torch.randperm``'s permutation, a host copy made by ``.cpu()``)
# is host memory on a GPU machine too. Counted, on device tensors only: the aten operations whose result
# size or value the host must wait for (``_local_scalar_dense`` - every ``.item()``, ``int()``, ``bool()`` -
# ``nonzero``, the ``unique`` family, ``masked_select``, ``equal``, indexing with a boolean mask,
# ``repeat_interleave`` without ``output_size``), ``.tolist()``, ``.cpu()`` and ``.numpy()``; and the
# blocking host-to-device copies (``.to(device)`` of a host tensor without ``non_blocking``, ``torch.tensor``
# with a ``device=``) outside trl_lite's one-copy helpers (transfer.py, rows.to_device, the varlen offsets),
# which pin and copy without blocking on CUDA.

import inspect  # noqa: E402

from test_varlen_attention import reference_varlen_attn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from trl_lite.models import varlen_attention  # noqa: E402
from trl_lite.models.varlen_attention import VarlenKernel  # noqa: E402

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "_unique", "_unique2", "unique_dim", "unique_consecutive",
             "masked_select", "equal"}  # fmt: skip
_ONE_COPY_SITES = ("trainer/step/transfer.py", "trainer/layout/rows.py", "models/varlen_attention.py")
_MARK = "_trl_lite_test_on_device"


def _on_device(value) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, _MARK, False)


def _mark(value):
    if isinstance(value, torch.Tensor):
        setattr(value, _MARK, True)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _mark(item)
    return value


class _DeviceSyncCounter(TorchDispatchMode):
    """Counts, by kind, the operations of the block that synchronise on a GPU (see above)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.sites = collections.Counter()
        self.paused = False

    def add(self, kind: str) -> None:
        """Count one ``kind`` at its nearest trl_lite frame (named in a failure's message)."""
        if self.paused:
            return
        self.counts[kind] += 1
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith(PACKAGE_DIR):
            frame = frame.f_back
        where = f"{os.path.relpath(frame.f_code.co_filename, PACKAGE_DIR)}:{frame.f_lineno}" if frame else "outside"
        self.sites[(kind, where)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        on_device = any(_on_device(t) for t in inputs)
        name = func._schema.name.split("::")[-1]
        if on_device:
            if name in _SYNC_OPS:
                self.add(name)
            elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
            ):
                self.add("boolean index")
            elif name == "repeat_interleave" and kwargs.get("output_size") is None:
                self.add("repeat_interleave")
        out = func(*args, **kwargs)
        return _mark(out) if on_device else out


def _caller_is_a_one_copy_site() -> bool:
    caller = sys._getframe(2).f_code.co_filename
    return caller.startswith(PACKAGE_DIR) and os.path.relpath(caller, PACKAGE_DIR) in _ONE_COPY_SITES


@pytest.fixture
def count_device_syncs(monkeypatch):
    """A function ``run(trainer, fn)``: ``fn()`` with the trainer's models on the "device", returning its
    result and the Counter of synchronising operations by kind."""
    counter = _DeviceSyncCounter()

    def host_read(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if not _on_device(self):
                return original(self, *args, **kwargs)
            counter.add(name)
            with torch.utils._python_dispatch._disable_current_modes():
                out = original(self, *args, **kwargs)
                # A host copy: on a GPU a new tensor in host memory (on the CPU .cpu() may return self).
                return out.clone() if name == "cpu" else out

        monkeypatch.setattr(torch.Tensor, name, read)

    for name in ("tolist", "cpu", "numpy"):
        host_read(name)
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        targets = [a for a in (*args, kwargs.get("device")) if isinstance(a, (torch.device, str))]
        out = original_to(self, *args, **kwargs)
        if targets and not _on_device(self):
            if not kwargs.get("non_blocking") and not _caller_is_a_one_copy_site():
                counter.add("blocking copy to the device")
            _mark(out)
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    original_new_tensor = torch.Tensor.new_tensor

    def new_tensor(self, data, *args, **kwargs):
        out = original_new_tensor(self, data, *args, **kwargs)
        if _on_device(self) and not _on_device(data):  # host data copied to the device, blocking
            counter.add("blocking copy to the device")
            _mark(out)
        return out

    monkeypatch.setattr(torch.Tensor, "new_tensor", new_tensor)
    for factory in ("tensor", "as_tensor"):
        original = getattr(torch, factory)

        def make(data, *args, _original=original, **kwargs):
            out = _original(data, *args, **kwargs)
            if kwargs.get("device") is not None and not _on_device(data):
                if not _caller_is_a_one_copy_site():
                    counter.add("blocking copy to the device")
                _mark(out)
            return out

        monkeypatch.setattr(torch, factory, make)

    def kernel(query, key, value, *args, **kwargs):
        """The CPU stand-in of the varlen kernel: its own reads are no part of the step (one CUDA call)."""
        counter.paused = True
        try:
            with torch.utils._python_dispatch._disable_current_modes():
                out = reference_varlen_attn(query, key, value, *args, **kwargs)
        finally:
            counter.paused = False
        return _mark(out)

    kernel.__signature__ = inspect.signature(reference_varlen_attn)
    # The packed passes take the CUDA path: one kernel call per layer, and the placeholder mask that keeps
    # transformers from reading the rows back (rows_mask).
    monkeypatch.setattr(varlen_attention, "KERNEL", VarlenKernel(kernel, frozenset({"cpu"}), frozenset({torch.float32})))

    def run(trainer, fn):
        for model in (trainer.model, trainer.ref_model, trainer.critic):
            if model is not None:
                for tensor in (*model.parameters(), *model.buffers()):
                    _mark(tensor)
        counter.counts.clear()
        counter.sites.clear()
        with counter:
            out = fn()
        return out, collections.Counter(counter.counts), dict(counter.sites)

    return run


_ESTIMATORS = {
    "gae": {},
    "grpo": {"advantage_estimator": "grpo", "num_samples_per_query": 2},
    "rloo": {"advantage_estimator": "rloo", "num_samples_per_query": 2},
    "reinforce_pp": {"advantage_estimator": "reinforce_pp"},
}
_OPTIONS = {
    "plain": {},
    "token budget": {"max_tokens_per_minibatch": 10},  # passes smaller than the mini-batches
    "score scaling": {"use_score_scaling": True, "use_score_norm": True},
}


# The CPU's stand-in for a device; on a GPU the syncs row of scripts/gpu_check.py counts the real ones.
@pytest.mark.cpu_only
@pytest.mark.parametrize("options", list(_OPTIONS))
@pytest.mark.parametrize("estimator", list(_ESTIMATORS))
def test_every_synchronising_operation_of_a_step_is_in_the_sync_budget(count_device_syncs, estimator, options):
    """Every sync of ``step()`` counted at the dispatcher equals :func:`sync_budget`'s list: at most 2 per
    training mini-batch plus 1 per step (the statistics' copy back), score scaling included."""
    from trl_lite.trainer.step.transfer import sync_budget

    config = PPOConfig(batch_size=8, mini_batch_size=2, ppo_epochs=2, max_grad_norm=1.0, **_ESTIMATORS[estimator],
                       **_OPTIONS[options])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PPOTrainer(config, AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2()), tokenizer=make_tokenizer())
    queries, responses, scores = random_batch(8)
    if config.num_samples_per_query > 1:
        queries = [queries[i - i % 2] for i in range(8)]
    stats, counts, sites = count_device_syncs(trainer, lambda: trainer.step(queries, responses, scores))
    budget = sync_budget(config)
    # Passes under a token budget take the place of mini-batches: the skip guard runs once per pass.
    passes = round(stats["ppo/minibatches"]) if options == "token budget" else budget["minibatches"]
    expected = budget["per_step"] + round(budget["per_minibatch"] * passes)
    if options == "token budget":  # one finiteness check per optimizer update: one per backward batch
        assert passes > budget["minibatches"]  # the budget splits some mini-batches
        expected = budget["per_step"] + passes + budget["minibatches"]
    assert sum(counts.values()) == expected, "\n".join(f"{k}: {n}" for k, n in sorted(sites.items()))
    assert set(counts) <= {"_local_scalar_dense", "tolist", "cpu"}, sites
    assert sum(counts.values()) <= 2 * passes + 1


# --- One GRPOTrainer iteration: what the trainer adds to its step ------------------------------------------


@pytest.mark.cpu_only
def test_a_grpo_trainer_iteration_adds_one_copy_of_the_completions_to_its_step(count_device_syncs, tmp_path):
    """``GRPOTrainer.train()`` for one generation, counted at the dispatcher as above: the trainer's own code
    (``trainer/grpo/``) reads nothing of the device; its one addition is the completions' copy back to the host
    for decoding and the reward functions (one ``.cpu()`` in transfer.py beside the step's statistics copy), not
    one read per completion. On one process the generation metrics need no device at all. (Prefix sharing off:
    the CPU stand-in of the varlen kernel above takes equal query and key lengths only.)"""
    import dataclasses

    from grpo_helpers import config, dataset, length_reward, tokenizer

    from trl_lite import GRPOTrainer
    from trl_lite.trainer.grpo.config_mapping import to_ppo_config

    class WithoutPrefixSharing(GRPOTrainer):
        to_ppo_config = staticmethod(lambda args, n: dataclasses.replace(to_ppo_config(args, n), prefix_sharing=False))

    grpo = WithoutPrefixSharing(make_gpt2(), [length_reward], args=config(tmp_path, max_steps=1, gradient_checkpointing=False),
                                train_dataset=dataset(), processing_class=tokenizer())  # fmt: skip
    _, counts, sites = count_device_syncs(grpo.ppo, grpo.train)
    assert {site: n for site, n in sites.items() if "trainer/grpo/" in site[1]} == {}, sites
    copies = {site: n for site, n in sites.items() if site[0] == "cpu"}
    assert list(copies.values()) == [2] and next(iter(copies))[1].startswith("trainer/step/transfer.py"), sites


def test_the_generation_metrics_are_made_once_per_log_not_per_generation(tmp_path):
    """With ``logging_steps=2`` four generations make their metrics in two calls (one gather each on several
    processes), and the logs are the same as when every generation's metrics are made at once."""
    from grpo_helpers import length_reward
    from grpo_helpers import trainer as grpo_trainer

    runs = []
    for logging_steps in (2, 1):
        grpo = grpo_trainer(tmp_path / str(logging_steps), reward_funcs=(length_reward,), max_steps=4,
                            logging_steps=logging_steps, gradient_checkpointing=False)  # fmt: skip
        calls, metrics = [], grpo.rollout.metrics
        grpo.rollout.metrics = lambda rows, k: calls.append(len(rows)) or metrics(rows, k)
        grpo.train()
        runs.append((calls, grpo.state.log_history, grpo.state.num_input_tokens_seen))
    (calls2, logs2, tokens2), (calls1, logs1, tokens1) = runs
    assert calls2 == [2, 2] and calls1 == [1, 1, 1, 1] and tokens2 == tokens1
    for logged in logs2:  # a window's mean equals the mean of its generations' logs
        window = [entry for entry in logs1 if logged["step"] - 2 < entry["step"] <= logged["step"]]
        for name in ("reward", "reward_std", "completions/mean_length", "rewards/length_reward/mean"):
            assert logged[name] == pytest.approx(sum(entry[name] for entry in window) / 2), name
        assert logged["num_tokens"] == window[-1]["num_tokens"]
