"""The expensive things a session uses, kept per model so that a session per step or per forward reuses them.

Pinning host memory costs milliseconds per call and an I/O engine starts threads and opens files, so the pinned
host pool, the NVMe tier (its engine and files) and the CUDA side streams (the caching allocator keeps blocks per
stream: new streams every step would strand the blocks of the old ones) belong to the model, not to one
``offload()`` context. They are created by the first session that needs them and handed to every later session
around the same model with the same limits; sessions asking for other limits get new ones, and the old ones close
once no session uses them any more.

They are released when the model is garbage-collected, on ``ssdtrain.release(model)``, or when an exception
leaves a session (which releases everything at once): in each case as soon as no activation saved by a session
still needs them (a backward after the ``with`` block), at once otherwise.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .hostpool import HostPool
from .tiers import NvmeTier


class SharedTiers:
    """A host pool, an NVMe tier and side streams used by the sessions around one model."""

    def __init__(self, key: tuple, pool: HostPool, nvme: NvmeTier):
        self.key = key
        self.pool = pool
        self.nvme = nvme
        self.streams: dict[int, tuple] = {}  # device index -> (copy out, prefetch)
        self.pinned_for = None  # the plan whose host bytes the pool was last grown to (Session._pin_ahead)
        self.users = 0  # sessions open, or closed with activations still saved
        self.retired = False  # replaced or released: close once unused
        self.closed = False
        self._lock = threading.Lock()

    def side_streams(self, index: int):
        with self._lock:
            s = self.streams.get(index)
            if s is None:
                s = self.streams[index] = (torch.cuda.Stream(device=index), torch.cuda.Stream(device=index))
            return s

    def acquire(self) -> SharedTiers:
        with self._lock:
            self.users += 1
        return self

    def release_user(self) -> None:
        with self._lock:
            self.users = max(0, self.users - 1)
            close = self.retired and self.users == 0
        if close:
            self.close()

    def retire(self) -> None:
        """No new session gets these; they close once the sessions using them are done."""
        with self._lock:
            self.retired = True
            close = self.users == 0
        if close:
            self.close()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.nvme.close(abort=True)
        self.pool.close()
        self.streams.clear()


class ModelResources:
    """The current ``SharedTiers`` of one model (see the module docstring)."""

    def __init__(self):
        self.current: SharedTiers | None = None

    def get(self, key: tuple, make) -> SharedTiers:
        """The model's tiers for `key` (host limit, pinned, NVMe directories and limit), made by `make()` if the
        model has none or other ones (those retire)."""
        cur = self.current
        if cur is not None and (cur.key != key or cur.closed or cur.retired):
            cur.retire()
            cur = None
        if cur is None:
            cur = self.current = make()
        return cur

    def drop(self, tiers: SharedTiers | None = None) -> None:
        """Retire the current tiers (or `tiers`, if they are the current ones)."""
        cur = self.current
        if cur is not None and (tiers is None or tiers is cur):
            self.current = None
            cur.retire()


_RESOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _finalize(resources: ModelResources) -> None:
    resources.drop()


def resources_of(model) -> ModelResources:
    res = _RESOURCES.get(model)
    if res is None:
        res = _RESOURCES[model] = ModelResources()
        # The model's garbage collection retires them (closed at once, or when the last saved activation goes).
        # Not at interpreter exit: the process's end frees pinned memory, threads and the nameless files anyway.
        weakref.finalize(model, _finalize, res).atexit = False
    return res


def release(model: torch.nn.Module) -> bool:
    """Release what sessions around `model` keep between steps: the pinned host pool (unpinned and freed), the
    NVMe engine (threads, files) and the side streams; at once, or when the last activation still saved by a
    session around it is used. Plans are kept (they are small): the next session reuses them and makes new tiers.
    Returns whether there was anything to release."""
    res = _RESOURCES.get(model)
    if res is None or res.current is None:
        return False
    res.drop()
    return True
