"""Hugging Face ``Trainer`` integration: one callback turns activation offload on for training steps only.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ssdtrain.OffloadCallback(budget=0.5)])
    trainer.add_callback(ssdtrain.OffloadCallback(budget=0.5))  # (or so, before train())

An ``offload()`` session is entered around each micro-batch's forward and backward: the callback wraps the
Trainer's ``training_step`` when training begins (``on_train_begin``) and each call runs in a session of its own.
Evaluation, prediction, generation, logging, checkpointing, gradient clipping and the optimizer's step run outside
any session. (Forwards under ``torch.no_grad()`` are never steps of a session anyway.) The sessions reuse the
model's plan, pinned host pool and NVMe engine (``ssdtrain.resources``), and each finishes the last one's step
(its profile, its peak check), so they plan and calibrate as one session would.

A step that raises never reaches ``on_step_end``, and the Trainer has no event for the exception. An exception from
the forward or backward leaves ``training_step`` through the wrapper, which closes the session (its saved-tensor
hooks on the thread's autograd stack, its hooks on the model, its pinned buffers) before the exception propagates,
unchanged; anywhere else in the step (gradient clipping, the optimizer or learning-rate scheduler step, another
callback) no session is open. This works however the callback was added: ``on_train_begin`` comes before the
first micro-batch of every ``train()`` call, where a wrapper of ``train`` itself, made at ``on_init_end``, guarded
only a callback given to the constructor. The Trainer passes callbacks no reference to itself: the callback finds
it on the stack, as the caller whose callback handler holds it. Where events are called otherwise (by hand, no
Trainer on the stack), a session is entered at ``on_step_begin`` and left at ``on_step_end``, and one a failed step
left open is closed by the next step, the next ``train()`` or the next ``offload()`` on the model.

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
        # The Trainers whose training_step runs in this callback's sessions (see _wrap_training_step); while one
        # was found for the training running now, the step events open no session.
        self._wrapped: weakref.WeakSet = weakref.WeakSet()
        self._by_events = True

    # ------------------------------------------------------------------------------------------- Trainer events
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        self._close(abort=True)  # a session left open by a failed step of event-driven training
        trainer = self._calling_trainer()
        self._by_events = trainer is None
        if trainer is not None:
            self._wrap_training_step(trainer)

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if not self._by_events:
            return  # (the Trainer's training_step opens the sessions)
        if model is None:
            raise ValueError("ssdtrain.OffloadCallback: the Trainer passed no model to on_step_begin")
        self._open(model)

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

    def _wrap_training_step(self, trainer: Any) -> None:
        """Wrap `trainer`'s ``training_step`` (an instance attribute, kept for the Trainer's life: later ``train()``
        calls need it too) so that each call, a micro-batch's forward and backward, runs in a session of its own,
        closed when it returns or raises. The Trainer looks the method up for every micro-batch, so the wrapper
        made here, inside ``train()``, applies from this call's first step on. A wrapper outlives its callback's
        removal (``trainer.pop_callback``): it then runs the step alone."""
        if trainer in self._wrapped:
            return
        self._wrapped.add(trainer)
        inner = trainer.training_step

        @functools.wraps(inner)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            if not any(c is self for c in trainer.callback_handler.callbacks):
                return inner(*args, **kwargs)
            self._open(trainer.callback_handler.model)
            try:
                result = inner(*args, **kwargs)
            except BaseException as error:
                self._failed(error)
                raise
            self._close()
            return result

        trainer.training_step = training_step

    def _open(self, model: torch.nn.Module) -> None:
        self._close(abort=True)  # (one a failed step left open)
        self.session = offload(model, self.budget, **self.options)
        self.session.__enter__()

    def _failed(self, error: BaseException) -> None:
        """`error` is leaving a training step: close its session without hiding `error`."""
        if self.session is None:
            return
        why = f"{type(error).__name__} left a training step"
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
