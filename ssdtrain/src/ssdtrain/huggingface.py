"""Hugging Face ``Trainer`` integration: one callback turns activation offload on for training steps only.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ssdtrain.OffloadCallback(budget=0.5)])

An ``offload()`` session is entered when a training step begins (``on_step_begin``: before the step's first
micro-batch) and left when it ends (``on_step_end``: after the optimizer step), so it covers every micro-batch of
gradient accumulation and nothing else: evaluation, prediction, generation, logging and checkpointing run after
``on_step_end``, outside any session. (Forwards under ``torch.no_grad()`` are never steps of a session anyway.) The
sessions reuse the model's plan, pinned host pool and NVMe engine from step to step (``ssdtrain.resources``).

A step that raises never reaches ``on_step_end``, and the Trainer has no event for the exception. So that the
session does not stay entered after ``train()`` has raised (its saved-tensor hooks on the thread's autograd stack,
its hooks on the model), the callback wraps, while it trains, what the step calls: the model's forward, the
Trainer's ``training_step`` (forward, loss and backward) and its optimizer's ``step`` (one wrapper each, put back at
the end). An exception leaving one of them (out of memory in forward, backward or the optimizer's first step, a bad
batch) closes the session before it propagates. The Trainer passes callbacks no reference to itself: the callback
finds it at ``on_train_begin`` as the caller whose callback handler holds it. An exception raised elsewhere in a
step (gradient clipping, the learning-rate scheduler, another callback) leaves its session to be closed by the next
step, the next ``train()``, or the next ``offload()`` on the model.

Importing this module imports transformers; ``ssdtrain.OffloadCallback`` does so on first use only.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable
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
        self._guarded_model: torch.nn.Module | None = None  # the model whose forward is guarded (once a training)
        self._put_back: list[Callable[[], None]] = []  # what puts each guarded method back (the end of a training)

    # ------------------------------------------------------------------------------------------- Trainer events
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        self._close(abort=True)  # a session left open by a step that raised in an earlier train() call
        self._unguard()
        trainer = self._calling_trainer()
        if trainer is not None:
            # What a step calls after its forward, where an exception would otherwise leave the session entered.
            self._guard(trainer, "training_step", "the training step raised (in its forward, loss or backward)")
            if getattr(trainer, "optimizer", None) is not None:
                self._guard(trainer.optimizer, "step", "the optimizer step raised")

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
        if self._guarded_model is not model:
            # One wrapper for the whole training, not one per step: a new function object each step would fail
            # torch.compile's guards on ``forward`` and recompile every step. (Closed from inside the forward, where
            # removing the model's hooks is safe: a forward hook that closed it would remove hooks while torch runs
            # through them.)
            self._guarded_model = model
            self._guard(model, "forward", "the training step's forward raised")
        self.session = offload(model, self.budget, **self.options)
        self.session.__enter__()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._close()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._close()
        self._unguard()
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

    def _guard(self, owner: Any, name: str, why: str) -> None:
        """Wrap ``owner.<name>`` (an instance attribute, put back by ``_unguard``) so that an exception leaving it
        closes the step's session at once, before it propagates: the Trainer has no event for it."""
        had = name in vars(owner)
        inner = getattr(owner, name)

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return inner(*args, **kwargs)
            except BaseException:
                if self.session is not None:
                    self._close(abort=True, why=why)
                    self._unguard()  # (train() is ending with this exception: on_train_end will not run)
                raise

        def put_back() -> None:
            if vars(owner).get(name) is guarded:  # (unless something replaced it since)
                if had:
                    setattr(owner, name, inner)
                else:
                    delattr(owner, name)

        if had and isinstance(inner, types.FunctionType):
            # Another library's wrapper set on the object: its marks stay visible on this one (torch's LR scheduler
            # marks the optimizer's step it wrapped, and warns at every scheduler step where the mark is gone).
            guarded.__dict__.update(vars(inner))
        setattr(owner, name, guarded)
        self._put_back.append(put_back)

    def _unguard(self) -> None:
        """Put every guarded method back (the end of a training, or of a step that raised)."""
        put_back, self._put_back = self._put_back, []
        self._guarded_model = None
        for undo in reversed(put_back):
            undo()

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
