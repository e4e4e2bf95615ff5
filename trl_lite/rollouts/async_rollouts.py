"""``AsyncRollouts``: the next batches are generated while ``step()`` trains on this one.

A producer thread runs the user's ``rollout_fn(data, generate)`` on each batch of a dataloader and
hands the results to the trainer's loop in order. Versions count completed ``step()`` calls
(``trainer.current_step``); every batch carries the version of the policy that generated it. The
bound: the trainer, having completed ``v`` steps, gets only batches of version ``>= v - max_staleness``;
the producer waits rather than run further ahead, and drops nothing. Training on such a batch is
docs/algorithm.md section 17: its ``generation_logprobs`` are the behaviour policy's, and truncated
importance sampling (turned on here unless the user opts out) corrects for the gap.

The producer is held by a condition on the newest published version: batch ``i`` may start once the
trainer has published (in ``next()``, between two steps) a version ``>= base + i - max_staleness``,
where ``base + i`` is the version the trainer will have when it takes batch ``i`` (one ``step()`` per
batch; ``base`` is re-anchored at every ``next()``, so a loop that skips a step never deadlocks, and
one that steps twice per batch is caught instead of silently training on staler data).
"""

from __future__ import annotations

import inspect
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import contextmanager

import torch

from ..trainer import PPOTrainer
from .producer_generation import LiveGeneration, PolicySnapshot, SnapshotGeneration

__all__ = ["AsyncRollouts", "RolloutGenerate"]

REQUIRED_KEYS = ("queries", "responses", "scores")


class _Stopped(BaseException):
    """Raised inside ``rollout_fn`` by ``generate`` once the rollouts are closed (not an ``Exception``,
    so that a ``rollout_fn`` catching ``Exception`` does not swallow it)."""


class RolloutGenerate:
    """The ``generate`` a ``rollout_fn`` gets: ``trainer.generate``'s arguments and results, on the
    policy of version :attr:`policy_version` (the same for every call within one batch).

    It also stands in for the trainer where rollout code takes one: ``run_episodes(generate, prompts,
    ...)`` (trl_lite.agents) plays its episodes on this version. It has what such code reads of a
    trainer: ``generate``, ``generation`` (the part whose engine it generates on), ``tokenizer``,
    ``accelerator`` and ``timed``.
    """

    def __init__(self, rollouts: AsyncRollouts):
        self._rollouts = rollouts
        self.policy_version: int | None = None
        trainer = rollouts.trainer
        self.generation = rollouts._generation.rollout_generation
        self.tokenizer, self.accelerator, self.timed = trainer.tokenizer, trainer.accelerator, trainer.timed

    def __call__(self, query_tensor, length_sampler=None, batch_size: int = 4, return_prompt: bool = True,
                 generate_ref_response: bool = False, remove_padding: bool = True, return_logprobs: bool = False,
                 **generation_kwargs):  # fmt: skip
        """See :meth:`PPOTrainer.generate`; ``generate_ref_response`` only with ``max_staleness=0``."""
        rollouts = self._rollouts
        with rollouts._engine_lock:
            if rollouts._closed:
                raise _Stopped
            return rollouts._generation.generate(
                query_tensor, length_sampler, batch_size, return_prompt, generate_ref_response, remove_padding,
                return_logprobs, **generation_kwargs,
            )  # fmt: skip

    generate = __call__


class _Produced:
    """One batch from the producer: step()'s arguments, the version that generated them, and the
    dataloader's position right after its data was drawn."""

    __slots__ = ("batch", "version", "position")

    def __init__(self, batch: dict, version: int, position):
        self.batch, self.version, self.position = batch, version, position


class AsyncRollouts:
    """Batches for ``trainer.step(**batch)`` from a background producer, at most ``max_staleness`` versions old.

    ::

        with AsyncRollouts(trainer, trainer.dataloader, rollout_fn, max_staleness=1) as rollouts:
            for batch in rollouts:              # step()'s keyword arguments plus "policy_version"
                stats = trainer.step(**batch)

    Args:
        trainer: a single-process :class:`PPOTrainer`; call ``step()`` once per batch taken.
        dataloader: any iterable of data batches (``trainer.dataloader`` or your own). Iterated by the
            producer only; ``trainer.dataloader``'s checkpointed position is the last batch the loop took.
        rollout_fn: ``rollout_fn(data, generate) -> dict`` with ``queries``, ``responses``, ``scores``
            and any other ``step()`` argument (with ``max_staleness > 0`` and the correction on,
            ``generation_logprobs`` too: ``generate(..., return_logprobs=True)``). Runs on the producer
            thread; ``generate`` (a :class:`RolloutGenerate`) takes ``trainer.generate``'s arguments.
        max_staleness: versions a batch may lag behind the trainer when it is taken. 0 is the
            synchronous loop (same tokens and weights), the producer running only while the loop waits.
        off_policy_correction: with ``max_staleness > 0``, set ``trainer.config.importance_sampling_correction
            = "tis"`` while the rollouts are open if it is None (truncated importance sampling,
            docs/algorithm.md sections 15 and 17); False keeps it off, with a warning.
        num_epochs: passes over ``dataloader``; None: repeat until :meth:`close`.
        timeout: seconds ``next()`` waits for a batch and :meth:`close` for the producer to stop.

    Statistics (in the next ``step()``'s, through the trainer's timer): ``time/rollout/wait`` (the
    loop waiting for a batch), ``time/rollout/producer_idle`` (the producer held by the bound), with
    ``max_staleness > 0`` ``time/rollout/weight_snapshot`` (copying the weights between steps) and the
    producer's ``time/rollout/generate`` and ``time/rollout/weight_sync``. ``step(policy_version=...)``
    reports ``rollout/staleness/mean|max``.
    """

    def __init__(self, trainer: PPOTrainer, dataloader, rollout_fn: Callable, max_staleness: int = 1, *,
                 off_policy_correction: bool = True, num_epochs: int | None = 1, timeout: float = 600.0):  # fmt: skip
        _check_arguments(trainer, dataloader, rollout_fn, max_staleness, off_policy_correction, num_epochs, timeout)
        self.trainer = trainer
        self.dataloader = dataloader
        self.rollout_fn = rollout_fn
        self.max_staleness = max_staleness
        self.num_epochs = num_epochs
        self.timeout = float(timeout)
        self._step_arguments = set(inspect.signature(trainer.step).parameters) - {"policy_version"}
        self._generation = SnapshotGeneration(trainer) if max_staleness > 0 else LiveGeneration(trainer)
        self._generate = RolloutGenerate(self)
        self._engine_lock = threading.Lock()
        self._cond = threading.Condition()
        # Shared with the producer, under self._cond:
        self._published: PolicySnapshot = self._generation.snapshot_in_use
        self._base: int | None = None  # version the trainer has when it takes batch i: base + i
        self._ready: deque[_Produced] = deque()
        self._error: BaseException | None = None
        self._finished = False
        self._closed = False
        self._drawn = 0  # data batches the producer took from the dataloader
        # The loop's side:
        self._consumed = 0
        self._start_position = _position(dataloader)
        self._consumed_position = self._start_position

        config = trainer.config
        self._restore_correction = False
        if max_staleness > 0 and config.importance_sampling_correction is None:
            if off_policy_correction:
                config.importance_sampling_correction = "tis"
                self._restore_correction = True
            else:
                warnings.warn(
                    f"off_policy_correction=False with max_staleness={max_staleness}: batches generated by older "
                    "policies train without importance-sampling correction (docs/algorithm.md section 17).",
                    UserWarning,
                    stacklevel=2,
                )
        self._require_logprobs = max_staleness > 0 and config.importance_sampling_correction is not None
        self._view = None
        if dataloader is trainer.dataloader:
            self._view = trainer.dataloader = _ConsumedPositionView(dataloader, self)
        self._threads = torch.get_num_threads()
        self._producer = threading.Thread(target=self._produce, name="AsyncRollouts-producer", daemon=True)
        self._producer.start()

    # ------------------------------------------------------------------------------------------
    # The trainer's side
    # ------------------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> dict:
        """The next batch: ``step()``'s keyword arguments plus ``"policy_version"`` (an int)."""
        if self._closed:
            raise StopIteration
        self._publish()
        with self.trainer.timed("rollout/wait"):
            produced = self._take()
        if produced is None:
            self.close()
            raise StopIteration
        staleness = self.trainer.current_step - produced.version
        if staleness > self.max_staleness:
            self.close()
            raise RuntimeError(
                f"a batch of policy version {produced.version} reached the trainer at version "
                f"{self.trainer.current_step}, beyond max_staleness={self.max_staleness}: step() ran more than once "
                "per batch (or the trainer's step count changed otherwise). Call trainer.step() once per batch."
            )
        self._consumed += 1
        self._consumed_position = produced.position
        return {**produced.batch, "policy_version": produced.version}

    def _publish(self) -> None:
        """Make the trainer's current version available to the producer (a weight copy if it is new),
        and anchor the version at which the next batches will be taken."""
        version = self.trainer.current_step
        snapshot = self._generation.snapshot() if version != self._published.version else None
        with self._cond:
            if snapshot is not None:
                self._published = snapshot
            self._base = version - self._consumed
            self._cond.notify_all()

    def _take(self) -> _Produced | None:
        """The next produced batch; None at the end of the data; raises the producer's error or on timeout."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while not self._ready and self._error is None and not self._finished:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            error, finished = self._error, self._finished
            ready = self._ready.popleft() if self._ready and error is None else None
        if error is not None:
            self.close()
            raise error
        if ready is None and not finished:
            self.close()
            raise TimeoutError(
                f"AsyncRollouts: no batch from the producer within timeout={self.timeout:g} s (rollout_fn is "
                f"still running on batch {self._consumed}); the rollouts are closed."
            )
        return ready

    @contextmanager
    def paused(self):
        """Hold the producer between two engine calls, so that ``trainer.generate`` may use the engine (an
        evaluation during the run). The producer pushes its own weights again afterwards."""
        with self._engine_lock, self._generation.paused():
            yield

    def state_dict(self) -> dict:
        """The dataloader's ``state_dict()`` right after the data of the last batch the loop took (before
        any batch: at construction). Loaded into the dataloader, a new run regenerates every batch
        that was in flight; ``trainer.save_checkpoint`` records it for ``trainer.dataloader``."""
        if self._start_position is None:
            raise TypeError(
                f"state_dict() needs a dataloader with state_dict() (trainer.dataloader has one); got "
                f"{type(self.dataloader).__name__}."
            )
        return self._consumed_position

    def close(self) -> None:
        """Stop the producer (waiting up to ``timeout`` seconds for its current engine call or rollout_fn
        step), give ``trainer.dataloader`` and ``importance_sampling_correction`` back as they were, and
        leave the dataloader after the last batch the loop took. Safe to call more than once."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._producer.join(self.timeout)
        stopped = not self._producer.is_alive()
        if not stopped:
            warnings.warn(
                f"AsyncRollouts.close(): the producer is still inside rollout_fn after {self.timeout:g} s; it stops at "
                "its next generate call or when rollout_fn returns. Until then it may still use the engine.",
                RuntimeWarning,
                stacklevel=2,
            )
        if self._view is not None:
            self.trainer.dataloader = self._view.loader
        if self._restore_correction:
            self.trainer.config.importance_sampling_correction = None
        if stopped:
            with self._engine_lock:
                self._generation.close()
            # A pass the producer left unfinished (or batches it drew that the loop never took): rewind.
            interrupted = self._drawn > 0 and not (self._finished and self._drawn == self._consumed)
            if interrupted and callable(getattr(self.dataloader, "load_state_dict", None)):
                self.dataloader.load_state_dict(self._consumed_position)

    def __enter__(self) -> AsyncRollouts:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    # The producer's side (its own thread)
    # ------------------------------------------------------------------------------------------
    def _produce(self) -> None:
        # OpenMP's thread count is per thread; vLLM's CPU attention checks it against torch's setting.
        torch.set_num_threads(self._threads)
        data_batches = self._data()
        index = 0
        try:
            while True:
                snapshot = self._wait_for_turn(index)
                if snapshot is None:
                    return
                data = next(data_batches, _END)
                if data is _END:
                    break
                self._drawn += 1
                position = _position(self.dataloader)
                self._generation.use(snapshot)
                self._generate.policy_version = snapshot.version
                batch = self._check_batch(self.rollout_fn(data, self._generate), index)
                with self._cond:
                    self._ready.append(_Produced(batch, snapshot.version, position))
                    self._cond.notify_all()
                index += 1
            with self._cond:
                self._finished = True
                self._cond.notify_all()
        except _Stopped:
            return
        except BaseException as error:  # noqa: BLE001 - every failure must reach the loop, or it would wait forever
            error.add_note(f"(raised on the AsyncRollouts producer thread, in batch {index}'s rollout)")
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _data(self):
        """The dataloader's batches over ``num_epochs`` passes (endless for None; ends at an empty pass)."""
        epoch = 0
        while self.num_epochs is None or epoch < self.num_epochs:
            empty = True
            for data in self.dataloader:
                empty = False
                yield data
            if empty:
                return
            epoch += 1

    def _wait_for_turn(self, index: int) -> PolicySnapshot | None:
        """The newest snapshot once batch ``index`` may start; None when closed."""
        with self.trainer.timed("rollout/producer_idle"), self._cond:
            while not self._closed and not self._may_start(index):
                self._cond.wait()
            return None if self._closed else self._published

    def _may_start(self, index: int) -> bool:
        """Whether batch ``index`` may start on the newest snapshot (under ``self._cond``)."""
        return self._base is not None and self._published.version >= self._base + index - self.max_staleness

    def _check_batch(self, batch, index: int) -> dict:
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"rollout_fn must return a dict of step() arguments; batch {index} gave {type(batch).__name__}."
            )
        missing = [key for key in REQUIRED_KEYS if key not in batch]
        unknown = sorted(set(batch) - self._step_arguments)
        if missing or unknown:
            raise ValueError(
                f"rollout_fn's dict for batch {index} must hold {list(REQUIRED_KEYS)} and step()'s other arguments "
                f"only ({sorted(self._step_arguments)}); missing {missing}, unknown {unknown}"
                + (" (AsyncRollouts adds policy_version itself)" if "policy_version" in batch else "") + "."
            )  # fmt: skip
        if self._require_logprobs and batch.get("generation_logprobs") is None:
            raise ValueError(
                f"rollout_fn returned no generation_logprobs for batch {index}: with max_staleness="
                f"{self.max_staleness} the importance-sampling correction needs them. Generate with "
                "generate(..., return_logprobs=True) and return them, or pass off_policy_correction=False."
            )
        batch = dict(batch)
        if "kept_sets" not in batch:  # truncated sampling: the sets the producer's engine recorded for these rows
            batch["kept_sets"] = self._generation.rollout_generation.records.take(batch["queries"], batch["responses"])
        return batch


_END = object()


class _ConsumedPositionView:
    """``trainer.dataloader`` while an :class:`AsyncRollouts` draws from it: checkpoints record the
    position of the last batch the loop took, not the producer's; iterating it or loading a position
    meanwhile would pull data from under the producer, and is refused."""

    def __init__(self, loader, rollouts: AsyncRollouts):
        self.loader = loader
        self._rollouts = rollouts

    def state_dict(self) -> dict:
        return self._rollouts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        raise RuntimeError(
            "trainer.dataloader is in use by an open AsyncRollouts: close it before loading a checkpoint."
        )

    def __iter__(self):
        raise RuntimeError("trainer.dataloader is in use by an open AsyncRollouts: iterate the AsyncRollouts instead.")

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)


def _position(dataloader):
    return dataloader.state_dict() if callable(getattr(dataloader, "state_dict", None)) else None


def _check_arguments(trainer, dataloader, rollout_fn, max_staleness, off_policy_correction, num_epochs,
                     timeout) -> None:  # fmt: skip
    if not isinstance(trainer, PPOTrainer):
        raise TypeError(f"trainer must be a PPOTrainer, got {type(trainer).__name__}.")
    if trainer.accelerator.num_processes > 1:
        raise ValueError(
            f"AsyncRollouts runs in a single process; this trainer has {trainer.accelerator.num_processes} "
            "(accelerate launch). Use the synchronous loop there."
        )
    if not hasattr(dataloader, "__iter__"):
        raise TypeError(f"dataloader must be an iterable of data batches, got {type(dataloader).__name__}.")
    if not callable(rollout_fn):
        raise TypeError(f"rollout_fn must be callable as rollout_fn(data, generate), got {type(rollout_fn).__name__}.")
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}.")
    if not isinstance(off_policy_correction, bool):
        raise TypeError(f"off_policy_correction must be a bool, got {off_policy_correction!r}.")
    if num_epochs is not None and (isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1):
        raise ValueError(f"num_epochs must be an int >= 1 or None (repeat until close()), got {num_epochs!r}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    if max_staleness == 0:
        return
    engine = trainer.generation.engine
    if engine.sleeps:
        raise ValueError(
            f"max_staleness={max_staleness} needs an engine that stays awake while step() runs; this one sleeps "
            "between rollouts (vllm_enable_sleep_mode). Turn sleep mode off or use max_staleness=0."
        )
    if not engine.needs_weight_sync and trainer.is_deepspeed_enabled:
        raise ValueError(
            f"max_staleness={max_staleness} with the transformers engine generates on a copy of the policy, which "
            "is not built under DeepSpeed; use vLLM (use_vllm=True) or max_staleness=0."
        )
