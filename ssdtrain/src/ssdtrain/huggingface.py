"""Hugging Face ``Trainer`` integration: one callback turns activation offload on for training steps only.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ssdtrain.OffloadCallback(budget=0.5)])

An ``offload()`` session is entered when a training step begins (``on_step_begin``: before the step's first
micro-batch) and left when it ends (``on_step_end``: after the optimizer step), so it covers every micro-batch of
gradient accumulation and nothing else: evaluation, prediction, generation, logging and checkpointing run after
``on_step_end``, outside any session. (Forwards under ``torch.no_grad()`` are never steps of a session anyway.) The
sessions reuse the model's plan, pinned host pool and NVMe engine from step to step (``ssdtrain.resources``).

A step that raises never reaches ``on_step_end``, and the Trainer has no event for the exception. So that the
session does not stay entered after ``train()`` has raised (its saved-tensor hooks on the thread's autograd stack,
its hooks on the model, its pinned buffers), the callback wraps the Trainer's ``train`` once, when it first meets
the Trainer: any exception leaving ``train()`` (from the forward, backward, gradient clipping, the optimizer or
learning-rate scheduler step, another callback, ...) closes the open session, then propagates unchanged. The
Trainer passes callbacks no reference to itself: the callback finds it on the stack, as the caller whose callback
handler holds it, at ``on_init_end`` (the end of the Trainer's ``__init__``, for a callback given to
``Trainer(callbacks=[...])``), else at ``on_train_begin`` (a callback added later with ``add_callback``), where the
wrapper can only cover the calls of ``train()`` after the one running. A session a failed step left open
otherwise is closed by the next step, the next ``train()`` or the next ``offload()`` on the model.

Importing this module imports transformers; ``ssdtrain.OffloadCallback`` does so on first use only.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .api import offload
from .session import OffloadSession

log = logging.getLogger("ssdtrain")

__all__ = ["OffloadCallback", "merge_stats"]


def merge_stats(total: dict, stats: dict) -> dict:
    """Add one session's ``stats()`` to a running total: counters add up, the rest (pool sizes, peaks) take the
    latest value."""
    for key, value in stats.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, dict)) or key in _LATEST:
            total[key] = value
        elif isinstance(value, dict):
            total[key] = merge_stats(dict(total.get(key) or {}), value)
        else:
            total[key] = total.get(key, 0) + value
    return total


_LATEST = {"host_pool", "nvme", "peak_device_saved_bytes", "recomputed_modules"}


class OffloadCallback(TrainerCallback):
    """Activation offload for the training steps of a ``transformers.Trainer``.

    ``budget`` and ``options`` are those of ``ssdtrain.offload()`` (e.g. ``budget=0.5``: half of keeping
    everything; ``min_bytes=``, ``host_memory=``, ``directories=``). After (or during) training: ``plan`` (the
    latest plan; ``print()`` it), ``stats()`` (counters summed over the training steps)."""

    def __init__(self, budget: int | float | str | None = None, **options: Any) -> None:
        self.budget = budget
        self.options = options
        self.session: OffloadSession | None = None  # the open session (inside a training step)
        self.last: OffloadSession | None = None
        self._totals: dict = {}
        # The Trainers whose train() closes this callback's session when an exception leaves it (see _guard_train).
        self._guarded: weakref.WeakSet = weakref.WeakSet()

    # ------------------------------------------------------------------------------------------- Trainer events
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._guard_train(self._calling_trainer())

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        self._close(abort=True)  # a session left open by an exception outside a guarded train() call
        self._guard_train(self._calling_trainer())  # (added after the Trainer was made: from the next train() on)

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if model is None:
            raise ValueError("ssdtrain.OffloadCallback: the Trainer passed no model to on_step_begin")
        self._close(abort=True)
        self.session = offload(model, self.budget, **self.options)
        self.session.__enter__()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._close()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._close()
        if self.last is not None:
            # Said once for the training, by its last step (the first steps profile by design: not worth a warning).
            self.last._warn_if_idle()

    # ------------------------------------------------------------------------------------------- results
    @property
    def plan(self):
        """The plan the latest training step ran under (None while the first steps profile)."""
        session = self.session or self.last
        return None if session is None else session.plan

    def stats(self) -> dict:
        """``session.stats()`` summed over every training step so far (see the README for the keys)."""
        totals = dict(self._totals)
        if self.session is not None:
            totals = merge_stats(totals, self.session.stats())
        return totals

    def _calling_trainer(self):
        """The Trainer whose callback handler is calling this callback now (found on the stack: the Trainer passes
        its callbacks no reference to itself), or None where the events are called otherwise (by hand)."""
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            handler = getattr(owner, "callback_handler", None)
            if callable(getattr(owner, "training_step", None)) and any(
                c is self for c in getattr(handler, "callbacks", ())
            ):
                return owner
            frame = frame.f_back
        return None

    def _guard_train(self, trainer: Any) -> None:
        """Wrap `trainer`'s ``train`` (an instance attribute, kept for the Trainer's life: the next call needs it too)
        so that an exception leaving it closes the open session at once, then propagates unchanged: the Trainer has
        no event for it, and whatever raised (a step's forward or backward, gradient clipping, the optimizer or the
        learning-rate scheduler, another callback) the whole loop runs inside ``train()``. (A retry of the loop inside
        ``train()``, as ``auto_find_batch_size`` does after running out of memory, is closed by ``on_train_begin``.)"""
        if trainer is None or trainer in self._guarded:
            return
        self._guarded.add(trainer)
        inner = trainer.train

        @functools.wraps(inner)
        def train(*args: Any, **kwargs: Any) -> Any:
            try:
                return inner(*args, **kwargs)
            except BaseException as error:
                self._failed(error)
                raise

        trainer.train = train

    def _failed(self, error: BaseException) -> None:
        """`error` is leaving ``train()``: close the step's session, if one is open, without hiding `error`."""
        if self.session is None:
            return
        why = f"{type(error).__name__} left trainer.train() during a training step"
        try:
            self._close(abort=True, why=why)
        except Exception as close_error:  # (the training's own exception is the one to see)
            note = f"ssdtrain: closing the training step's offload session failed too: {close_error!r}"
            log.error(note)
            if hasattr(error, "add_note"):
                error.add_note(note)

    def _close(
        self, abort: bool = False, why: str = "a training step ended without on_step_end (an exception?)"
    ) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        if abort:
            log.warning("ssdtrain: %s: its session is closed", why)
        session._quiet = True  # no "offloaded nothing" warning per step: on_train_end says it once, if at all
        session.close(abort=abort)
        session._quiet = False
        self._totals = merge_stats(self._totals, session.stats())
        self.last = session
