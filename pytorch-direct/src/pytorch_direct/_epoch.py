"""One epoch of a :class:`~pytorch_direct.sampling.NeighborLoader`: the batches made in turn, ahead by the training
thread, or by the loader's threads (a sampler thread and an assembling thread when pipelined), handed over through
a queue and CUDA events. (``loader`` below is the NeighborLoader, from the layer above: not imported.)"""

from __future__ import annotations

import atexit
import collections
import contextlib
import queue
import threading
import time
import weakref
from typing import Any

import torch
from torch import Tensor

# Epochs whose loader thread may still run. Their threads are daemons: at interpreter exit Python stops a daemon
# thread where it next takes the interpreter lock, and one doing so inside torch's C++ (sampling, which releases it)
# aborted the process ("terminate called without an active exception"). So they are stopped before that (below).
_running: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_running_epochs() -> None:
    for epoch in list(_running):
        epoch.close()


class _Maker:
    """Makes an epoch's batches in order, on the loader's streams (if any); what the loader's threads hold (not the
    epoch the training thread iterates, so that an epoch left early is collected and stops its threads). A
    pipelined loader thread takes the sampled subgraphs from a sampler thread of its own."""

    def __init__(self, loader: Any, order: list[Tensor]) -> None:
        self.loader, self.order, self.stream, self.device = loader, order, loader._stream, loader.device
        # the stream training reads the batches on (its current stream when the epoch began): the batches' memory
        # is marked as used by it where they are made, not in the training thread (see Epoch.__next__)
        self.consumer = torch.cuda.current_stream(self.device) if self.stream is not None else None
        self.next = 0  # the next batch to sample
        self.batch_seeds: list[Tensor] = []  # per batch: its seeds and input ids on the device (made at the first)
        self.batch_ids: list[Tensor] = []
        self.finished = 0  # batches finished (pipelined)
        self.queue: queue.Queue | None = None
        self.stop = threading.Event()  # set by training: the epoch ends
        self.halt = threading.Event()  # set by the loader thread: its sampler thread ends

    def done(self) -> bool:
        return self.next >= len(self.order)

    def seeds(self) -> tuple[Tensor, Tensor]:
        """The next batch's seeds (global node ids) and input ids, on the loader's device."""
        if self.next == 0:  # the epoch's seeds on the device: made at once, on the stream that uses them
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                self.batch_seeds, self.batch_ids = self.loader.epoch_seeds(self.order)
        self.next += 1
        return self.batch_seeds[self.next - 1], self.batch_ids[self.next - 1]

    @staticmethod
    def attempt(make, *args):
        """``make(*args)``, or the exception it raised: a batch that fails is handed to training as its error, in
        its place, and the epoch goes on with the next batch (as PyG's loaders do after an error in a batch)."""
        try:
            return make(*args)
        except Exception as exc:
            return exc

    def make_one(self):
        """The next batch and the events that mark it made (None without a stream)."""
        seeds, input_id = self.seeds()
        return self._made_on(self.stream,
                             lambda: self.loader.finish(*self.loader.sample_seeds(seeds, input_id), self.stream))

    def _made_on(self, stream, make):
        """(``make()``'s batch, with ``prepare_when_ahead`` run on it, made on ``stream`` if any; the events that
        mark it made, or None without a stream)."""
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            batch = make()
            self.when_ahead(batch)
        if stream is None:
            return batch, None
        record_stream(batch, self.consumer)
        return batch, self.loader._ready_events(stream)

    def sample_one(self):
        """(the next batch's subgraph and input ids, the event marking them sampled or None): the sampler thread."""
        seeds, input_id = self.seeds()
        if self.stream is None:
            return self.loader.sample_seeds(seeds, input_id), None
        with torch.cuda.stream(self.stream):
            sampled = self.loader.sample_seeds(seeds, input_id)
        event = torch.cuda.Event()
        event.record(self.stream)
        return sampled, event

    def finish_one(self, sampled, event):
        """The batch of a subgraph from :meth:`sample_one` and the events that mark it made: the loader thread,
        on the loader's assembling stream, after the sampling."""
        stream = self.loader._assemble_stream
        if stream is not None:
            stream.wait_event(event)
            sub, input_id = sampled
            # made on the sampling stream, read on this one: not reused by the sampling stream before they are read
            for t in [input_id, *vars(sub).values()]:
                if isinstance(t, Tensor) and t.is_cuda:
                    t.record_stream(stream)
        return self._made_on(stream, lambda: self.loader.finish(*sampled, stream))

    def when_ahead(self, batch) -> None:
        """The loader's ``prepare_when_ahead`` on ``batch`` if this is a loader thread whose previous batch has not
        been taken yet (it would wait for training to take it anyway)."""
        work = self.loader.prepare_when_ahead
        if work is None or self.queue is None or not self.queue.full():
            return
        start = time.perf_counter()
        work(batch)
        stats = self.loader._stats
        stats.ahead_batches += 1
        stats.ahead_s += time.perf_counter() - start

    def produce(self) -> None:
        """The loader thread: makes batches into the queue until the epoch ends or training stops (pipelined: it
        assembles what its sampler thread samples)."""
        sampler = None
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            if not self.loader.pipeline:
                while not self.done() and not self.stop.is_set():
                    if not self.put(self.queue, self.attempt(self.make_one)):
                        return
                return
            samples: queue.Queue = queue.Queue(maxsize=1)
            sampler = threading.Thread(target=self.produce_samples, args=(samples,), name="pytorch-direct-sampler",
                                       daemon=True)
            sampler.start()
            while self.finished < len(self.order):
                item = self.take(samples)
                if item is None:  # training stopped the epoch
                    return
                if isinstance(item, BaseException) and not isinstance(item, Exception):
                    raise item
                if not isinstance(item, Exception):  # (an Exception: that batch's error, handed on in its place)
                    item = self.attempt(self.finish_one, *item)
                if not self.put(self.queue, item):
                    return
                # (an error raised in training gets a traceback that holds the epoch: held here while this thread
                # waits for the next sample, it would keep the epoch, and so this thread, from ending)
                del item
                self.finished += 1
        except BaseException as exc:  # handed to the training thread, which raises it (the thread has ended)
            self.put(self.queue, exc)
        finally:
            self.halt.set()
            if sampler is not None:
                sampler.join()

    def produce_samples(self, samples: queue.Queue) -> None:
        """The sampler thread of a pipelined loader: samples the batches in order into ``samples``."""
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            while not self.done() and not self.halt.is_set():
                if not self.put(samples, self.attempt(self.sample_one)):
                    return
        except BaseException as exc:  # handed to the loader thread, which raises it
            self.put(samples, exc)

    def put(self, into: queue.Queue, item) -> bool:
        """Queues ``item`` unless the epoch has ended; False when it has."""
        while not (self.stop.is_set() or (self.halt.is_set() and into is not self.queue)):
            try:
                into.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def take(self, source: queue.Queue):
        """The next item of ``source``, or None once training has stopped the epoch."""
        while not self.stop.is_set():
            try:
                return source.get(timeout=0.05)
            except queue.Empty:
                continue
        return None


class Epoch:
    """One pass over a loader's batches: made in turn, ahead by the training thread, or by a background thread
    (see :class:`NeighborLoader`)."""

    def __init__(self, loader: Any, order: list[Tensor]) -> None:
        self.prefetch = loader.prefetch
        self.stats = loader._stats
        self.device = loader.device
        self.total = len(order)
        self._threaded = bool(loader.thread)
        self._maker = _Maker(loader, order)
        self._handed = 0
        self._made: collections.deque = collections.deque()
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._thread: threading.Thread | None = None
        if loader._stream is not None:
            # the loader's streams read what the training stream made (input nodes, the sampler's id map, tables)
            for stream in (loader._stream, loader._gather_stream, loader._assemble_stream):
                if stream is not None:
                    stream.wait_stream(torch.cuda.current_stream(self.device))
        if loader.thread:
            self._maker.queue = queue.Queue(maxsize=loader.prefetch)
            self._thread = threading.Thread(target=self._maker.produce, name="pytorch-direct-loader", daemon=True)
            self._thread.start()
            _running.add(self)

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self.total - self._handed

    def __next__(self):
        if self._handed >= self.total:
            self.close()
            raise StopIteration
        if self._threaded and self._maker.stop.is_set():
            # (its loader thread is gone, and the batches it had made were dropped; a thread for this epoch
            # beside the new epoch's would share their sampler, which is not thread-safe)
            raise RuntimeError("this NeighborLoader epoch was ended before its last batch (a new epoch began with "
                               "iter(loader), or the loader thread stopped): a loader with a loader thread makes one "
                               "epoch at a time; start a new epoch with iter(loader)")
        begin = time.perf_counter()
        cuda = self.device.type == "cuda"
        mark = stream = None
        if cuda:  # (the training stream, looked up once for the events and waits below)
            stream = torch.cuda.current_stream(self.device)
            mark = torch.cuda.Event(enable_timing=True)
            mark.record(stream)
        if self._thread is not None:
            item = self._maker.queue.get()
        elif not self.prefetch:
            item = self._maker.attempt(self._maker.make_one)
        else:
            while not self._maker.done() and len(self._made) <= self.prefetch:
                self._made.append(self._maker.attempt(self._maker.make_one))
            item = self._made.popleft()
        if isinstance(item, BaseException):
            # the failed batch takes its place in the epoch: the next call hands the batch after it
            self._handed += 1
            if not isinstance(item, Exception):  # (one that ends the loader thread)
                self.close()
            try:
                raise item
            finally:  # (else the error's traceback holds this frame, which holds the error and this epoch: a
                del item  # cycle that would keep the epoch and its loader thread until the garbage collector runs)
        batch, ready = item
        if ready is not None:
            for event in ready:
                stream.wait_event(event)
            if stream != self._maker.consumer:  # (training moved to another stream during the epoch)
                record_stream(batch, stream)
        if cuda:
            done = torch.cuda.Event(enable_timing=True)
            done.record(stream)
            self._events.append((mark, done))
        else:
            self.stats.wait_s += time.perf_counter() - begin
        self.stats.host_wait_s += time.perf_counter() - begin
        self.stats.batches += 1
        self._handed += 1
        return batch

    def read_events(self) -> None:
        """Adds the training stream's waits measured so far to the stats (synchronises on the last one)."""
        if not self._events:
            return
        self._events[-1][1].synchronize()
        self.stats.wait_s += sum(a.elapsed_time(b) for a, b in self._events) / 1000.0
        self._events.clear()

    def close(self) -> None:
        """Stops the loader thread (batches made but not taken are dropped)."""
        self._maker.stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with contextlib.suppress(Exception):
            self.read_events()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def record_stream(batch, stream: torch.cuda.Stream) -> None:
    """Marks every CUDA tensor of ``batch`` (and any attribute with a ``record_stream`` method) as used by
    ``stream``, so the caching allocator does not give their memory back to the loader's stream too early."""
    stores = getattr(batch, "stores", None)
    values = [v for store in stores for v in store.values()] if stores is not None else [batch]
    for v in values:
        if isinstance(v, Tensor):
            if v.is_cuda:
                v.record_stream(stream)
        elif callable(getattr(v, "record_stream", None)):
            v.record_stream(stream)
