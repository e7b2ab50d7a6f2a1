"""A reused pool of host memory for offloaded activations (pinned where CUDA is present).

Pinning memory costs milliseconds per call (the driver locks every page), so pinning each saved tensor anew every
step (what ``save_on_cpu(pin_memory=True)`` asks torch's caching host allocator to do) is slow and keeps whatever it
pinned. Here memory comes in large chunks from ``huge_empty`` (2 MiB pages, pinned once, physically contiguous per
1 MiB so the NVMe tier moves it in place), carved into 4 KiB-aligned buffers. A freed buffer goes on a free list of
its size; activation sizes repeat every step, so after the first step every request is served from a free list.
``close()`` unpins and returns every chunk to the OS.
"""

from __future__ import annotations

import threading
import time

import torch

from .io import huge_empty

_ALIGN = 4096


def _round(nbytes: int) -> int:
    return max(_ALIGN, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)


class HostPool:
    """Host buffers (uint8 tensors) up to `limit` bytes in total, in chunks of `chunk_bytes` or more."""

    def __init__(self, limit: int, *, pinned: bool, chunk_bytes: int = 256 << 20):
        self.limit = int(limit)
        self.pinned = bool(pinned)
        self.chunk_bytes = int(chunk_bytes)
        self._lock = threading.RLock()
        self._chunks: list[torch.Tensor] = []
        self._tail: tuple[torch.Tensor, int] | None = None  # (chunk, next free offset)
        self._spare: list[torch.Tensor] = []  # chunks pinned ahead (reserve) and not carved yet
        self._free: dict[int, list[torch.Tensor]] = {}
        self._deferred: list[tuple[object, torch.Tensor]] = []  # (CUDA event, buffer): free once the event is done
        self.reserved = 0  # bytes of chunks
        self._in_use = 0  # bytes handed out (deferred releases included until their event is done)
        self.peak_in_use = 0
        self.grow_seconds = 0.0  # host time spent pinning new chunks (the host waits; the device may idle)
        self.closed = False

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of at least `nbytes` (use ``buf[:nbytes]``), or None when the limit is reached."""
        size = _round(nbytes)
        with self._lock:
            if self.closed:
                return None
            self._collect()
            buf = self._take_free(size)
            if buf is None:
                buf = self._carve(size)
            if buf is None:
                return None
            self._in_use += buf.numel()
            self.peak_in_use = max(self.peak_in_use, self._in_use)
            return buf

    def reserve(self, nbytes: int) -> None:
        """Pin chunks ahead until the pool holds `nbytes` (at most its limit) in all: a plan's moved bytes, pinned
        before its first step instead of during it (pinning holds the host back, and the device idles with it)."""
        with self._lock:
            target = min(int(nbytes), self.limit)
            while not self.closed and self.reserved < target:
                chunk = self._pin(min(self.chunk_bytes, self.limit - self.reserved))
                if chunk is None:
                    return
                self._spare.append(chunk)

    def release(self, buf: torch.Tensor, after=None) -> None:
        """Return `buf`; with `after` (a CUDA event), only once the copies recorded before it are done."""
        with self._lock:
            if self.closed:
                return
            if after is not None and not after.query():
                self._deferred.append((after, buf))
                return
            self._put(buf)

    def close(self) -> None:
        """Drop every chunk (unpinned when their last view dies). Buffers still held elsewhere stay valid."""
        with self._lock:
            self.closed = True
            self._chunks.clear()
            self._spare.clear()
            self._free.clear()
            self._deferred.clear()
            self._tail = None
            self.reserved = 0
            self._in_use = 0

    @property
    def in_use(self) -> int:
        """Bytes handed out and not yet returned (releases waiting for their copy are collected first)."""
        with self._lock:
            self._collect()
            return self._in_use

    def _put(self, buf: torch.Tensor) -> None:
        self._in_use -= buf.numel()
        self._free.setdefault(buf.numel(), []).append(buf)

    def _collect(self) -> None:
        if self._deferred:
            waiting = []
            for event, buf in self._deferred:
                if event.query():
                    self._put(buf)
                else:
                    waiting.append((event, buf))
            self._deferred = waiting

    def _take_free(self, size: int) -> torch.Tensor | None:
        exact = self._free.get(size)
        if exact:
            return exact.pop()
        # A somewhat larger free buffer beats a new chunk (shapes vary a little between steps, e.g. the last batch).
        for have in sorted(s for s, bufs in self._free.items() if bufs and size < s <= 2 * size):
            return self._free[have].pop()
        return None

    def _carve(self, size: int) -> torch.Tensor | None:
        if self._tail is not None:
            chunk, offset = self._tail
            if offset + size <= chunk.numel():
                self._tail = (chunk, offset + size)
                return chunk[offset : offset + size]
        spare = next((c for c in self._spare if c.numel() >= size), None)
        if spare is not None:
            self._spare.remove(spare)
            self._tail = (spare, size)
            return spare[:size]
        chunk_size = max(self.chunk_bytes, size)
        if self.reserved + chunk_size > self.limit:
            chunk_size = size  # the last bytes under the limit: exactly what is asked
            if self.reserved + chunk_size > self.limit:
                return None
        chunk = self._pin(chunk_size)
        if chunk is None:
            return None
        self._tail = (chunk, size)
        return chunk[:size]

    def _pin(self, chunk_size: int) -> torch.Tensor | None:
        """A new chunk of `chunk_size` bytes, counted in the pool, or None where the OS or the driver refused."""
        t0 = time.perf_counter()
        try:
            chunk = huge_empty((chunk_size,), torch.uint8, pin_memory=self.pinned)
        except (RuntimeError, MemoryError):
            return None  # the caller falls back to another tier
        finally:
            self.grow_seconds += time.perf_counter() - t0
        self._chunks.append(chunk)
        self.reserved += chunk_size
        return chunk
