"""Mini-batches (sampled subgraph + gathered features) made on their own CUDA stream and handed to training, the way
PyG's ``NeighborLoader(num_workers=...)`` overlaps loading with compute, but in the training process: the sampler
and the features are read by the GPU, so there is nothing for worker processes to do that a CUDA stream cannot.

With ``ahead=0`` each batch is made in the caller's thread when it is asked for (in turn). On a GPU it is made on
the loader's stream: the sampler's host round trips then wait only for the batch's own kernels, not for the
previous training step, which is still running on the training stream (the host queues a step and moves on). With
``ahead=k >= 1`` a background thread makes up to ``k`` batches ahead on that stream. Either way a batch is handed
over with an event the training stream waits on (the host never waits for the GPU), and its tensors are marked as
used by the training stream so the caching allocator does not give their memory back to the loader's stream too
early. Batches come out in the order of ``seed_batches``, made by the same calls in the same order either way, so
training sees the very same batches.
"""

from __future__ import annotations

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

    On a GPU the loader keeps its own timer, :attr:`loader_timer` (phases on the loader's stream), and ``timer``
    gets a ``wait`` phase for the time the training stream waited for the next batch; on the CPU (no streams, in
    turn) the phases go to ``timer``. Use as a context manager (or call :meth:`close`) so an exception in training
    stops the thread."""

    def __init__(self, make: MakeBatch, seed_batches: Sequence[Tensor], *, ahead: int, device: torch.device,
                 timer: harness.PhaseTimes) -> None:
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0 batches, got {ahead}")
        self.make, self.seed_batches, self.ahead, self.device, self.timer = make, seed_batches, ahead, device, timer
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.loader_timer = harness.PhaseTimes(device) if ahead or self._stream is not None else timer
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[tuple[SampledSubgraph, Tensor]]:
        if not self.ahead:
            for seeds in self.seed_batches:
                if self._stream is None:
                    yield self.make(seeds, self.timer)
                    continue
                self.timer.phase("wait")
                yield self._hand_over(*self._make_on_stream(seeds))
            return
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

