"""Mini-batches (sampled subgraph + gathered features) made on their own CUDA stream and handed to training, the way
PyG's ``NeighborLoader(num_workers=...)`` overlaps loading with compute, but in the training process: the sampler
and the features are read by the GPU, so there is nothing for worker processes to do that a CUDA stream cannot.

Three ways, the same batches in the same order (made by the same calls in the same order):

- ``ahead=0``: each batch is made when training asks for it (in turn).
- ``ahead=k``, ``thread=False``: the training thread makes batch ``i + k`` before it hands over batch ``i``. On a GPU
  this overlaps without a second thread: the host queues batch ``i + k``'s sampling and gather on the loader's
  stream, then queues step ``i`` on the training stream, and the GPU runs the gather while the host is busy with the
  step. (Without CUDA streams there is nothing to overlap; batches are then made in turn.)
- ``ahead=k``, ``thread=True``: a background thread makes up to ``k`` batches ahead. It competes with training for
  the interpreter lock, which costs a training step that is bound by Python on the host (RESULTS.md).

On a GPU every batch is made on the loader's stream: the sampler's host round trips then wait only for the batch's
own kernels, not for the training step still running on the training stream. A batch is handed over with an event
the training stream waits on (the host never waits for the GPU), and its tensors are marked as used by the
training stream so the caching allocator does not give their memory back to the loader's stream too early.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

import harness
from sampling import SampledSubgraph

MakeBatch = Callable[[Tensor, "harness.PhaseTimes"], tuple[SampledSubgraph, Tensor]]


class BatchLoader:
    """Iterates over ``(subgraph, features)`` for each entry of ``seed_batches``; ``make(seeds, timer)`` samples and
    gathers one batch, marking its phases on ``timer``.

    ``ahead`` and ``thread``: see the module docstring. On a GPU, or with a thread, the loader keeps its own timer,
    :attr:`loader_timer` (on a GPU: phases on the loader's stream), and ``timer`` gets a ``wait`` phase for the time
    training waited for the next batch; on the CPU in turn the phases go to ``timer``. Use as a context manager (or
    call :meth:`close`) so an exception in training stops the thread."""

    def __init__(self, make: MakeBatch, seed_batches: Sequence[Tensor], *, ahead: int, device: torch.device,
                 timer: harness.PhaseTimes, thread: bool = False, stream: torch.cuda.Stream | None = None) -> None:
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0 batches, got {ahead}")
        if thread and not ahead:
            raise ValueError("a loader thread needs ahead >= 1 batch to make")
        self.make, self.seed_batches, self.ahead, self.device, self.timer = make, seed_batches, ahead, device, timer
        self.thread = thread
        # (pass one stream to the loaders of a training run: the caching allocator keeps freed memory per stream,
        # so each new stream would start without any and strand what the previous one cached)
        self._stream = (stream or torch.cuda.Stream(device)) if device.type == "cuda" else None
        self.loader_timer = harness.PhaseTimes(device) if thread or self._stream is not None else timer
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[tuple[SampledSubgraph, Tensor]]:
        if self.thread:
            yield from self._from_thread()
            return
        if self._stream is None:  # the CPU: in turn
            for seeds in self.seed_batches:
                yield self.make(seeds, self.timer)
            return
        made: collections.deque = collections.deque()
        for seeds in self.seed_batches:
            made.append(self._make_on_stream(seeds))
            if len(made) > self.ahead:
                self.timer.phase("wait")
                yield self._hand_over(*made.popleft())
        while made:
            self.timer.phase("wait")
            yield self._hand_over(*made.popleft())

    def _from_thread(self) -> Iterator[tuple[SampledSubgraph, Tensor]]:
        self._queue = queue.Queue(maxsize=self.ahead)
        self._thread = threading.Thread(target=self._produce, name="batch-loader", daemon=True)
        self._thread.start()
        for _ in self.seed_batches:
            self.timer.phase("wait")
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise RuntimeError("making a mini-batch failed in the loader thread") from item
            yield self._hand_over(*item)
        self._thread.join()

    def _make_on_stream(self, seeds: Tensor) -> tuple[SampledSubgraph, Tensor, torch.cuda.Event | None]:
        """One batch made on the loader's stream (if any), and the event that marks it done."""
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            sub, x = self.make(seeds, self.loader_timer)
            self.loader_timer.stop()
            ready = None
            if self._stream is not None:
                ready = torch.cuda.Event()
                ready.record(self._stream)
        return sub, x, ready

    def _hand_over(self, sub: SampledSubgraph, x: Tensor, ready: torch.cuda.Event | None):
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for t in (sub.n_id, sub.edge_index, sub.edge_type, sub.e_id, sub.node_type, x):
                t.record_stream(stream)
        return sub, x

    def _produce(self) -> None:
        try:
            for seeds in self.seed_batches:
                if self._stop.is_set():
                    return
                if not self._put(self._make_on_stream(seeds)):
                    return
        except BaseException as exc:  # handed to the consumer, which raises it
            self._put(exc)

    def _put(self, item) -> bool:
        """Queue ``item`` unless the consumer has closed the loader; False when it has."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop the thread (if any) and wait for it; batches made but not taken are dropped."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

