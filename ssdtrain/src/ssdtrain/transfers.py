"""Moving stored entries' bytes: the copy out to a host buffer, NVMe writes, and the copy back (restore).

``Transfers`` is the base of ``TensorCache`` (``ssdtrain.cache``), which decides what to store and when to bring it
back; this part carries it out. ``_store()`` hands an entry to its tier, else along the tier's fallback order; the
tier's ``store()`` calls ``copy_out()`` or ``writing()``. ``copy_out()`` only queues the entry: the cache launches
the queued copies once per unit (``launch_copies_out()``, as the next unit begins, and wherever something waits for
them), because issuing a copy on a side stream costs the host far more than the copy's own launch (on an H100 host,
line-profiled: 137 us per copy, of which the stream switch and the wait for the compute stream took 70 us and the
copy 12 us), and a host-bound eager step pays that on the device too. ``poll()`` advances what finished without
waiting (releasing device bytes, handing host copies on to disk); ``_throttle()`` bounds the device bytes still
waiting to leave; ``_restore()`` issues the copy back on a stream (None: CPU, synchronous).

Where something must wait for copies out (the in-flight bound, the drain before the head, backward's start), the
compute stream waits for them on the device (``_wait_on_device``), not the host: their device bytes go back to the
allocator at once, because only the compute stream's later kernels can reuse them, and those run after the wait. A
host that waited instead would fall behind the device it feeds: in a host-bound eager step (the host's launches
pace the device) every millisecond the host waits is a millisecond the device idles afterwards. An entry released
this way stays in the pending queue until ``poll()`` sees its copy done (a disk write of its host buffer starts
only then), and a copy back waits for its copy out on the device. The state of the
transfers in flight and the byte accounting (``gpu_saved_bytes``) live here, with the counters and warnings both
parts report through.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import warnings

import torch

from .entries import OffloadError, OffloadWarning, _Entry


class Transfers:
    """Copies out, NVMe writes and restores of entries over tiers (``ssdtrain.tiers``); see the module docstring."""

    def __init__(self, *, tiers: dict, on_full: str = "fallback"):
        self.tiers = tiers  # name -> Tier
        self.pool = tiers["host"].pool if "host" in tiers else None
        self.on_full = on_full
        self.lock = threading.RLock()
        self.max_inflight = float("inf")  # device bytes waiting for their copy out before pack waits
        self._queued: list[_Entry] = []  # entries with a host buffer whose copy out is not launched yet
        self._pending: collections.deque = collections.deque()  # entries whose copy out is in flight, FIFO
        self._writing: list[_Entry] = []  # entries whose NVMe write is in flight
        self._inflight_bytes = 0  # device bytes waiting to leave (queued, or copying out and not yet released)
        self._direct_bytes = 0  # device bytes of direct NVMe writes not yet staged
        # (the compute stream reached a wait for copies out, the wait ended, counter): CUDA events not yet read
        self._device_waits: list[tuple] = []
        self._streams: dict[int, tuple] = {}
        self.stream_source = None  # index -> (copy out, prefetch) streams shared by the model's sessions
        self._warned: set[str] = set()
        self.counters = collections.Counter()
        self.gpu_saved_bytes = 0  # offloadable bytes now on the device (kept + in flight + restored)
        self.peak_gpu_saved_bytes = 0

    @property
    def engine(self):
        """The NVMe tier's I/O engine, once created."""
        nvme = self.tiers.get("nvme")
        return None if nvme is None else nvme.engine

    # ----------------------------------------------------------------------------------------------- helpers
    def _side_streams(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        if self.stream_source is not None:
            return self.stream_source(index)
        s = self._streams.get(index)
        if s is None:
            s = self._streams[index] = (torch.cuda.Stream(device=index), torch.cuda.Stream(device=index))
        return s  # (copy out, prefetch)

    def _warn(self, kind: str, message: str) -> None:
        self.counters[f"fallback_{kind}"] += 1
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(
                f"ssdtrain: {message} (further cases are counted in session.stats(), not repeated)",
                OffloadWarning,
                stacklevel=5,
            )

    def fell_back(self, tier, to, kind: str | None = None) -> None:
        """`tier` had no room for an activation, which went to `to` (a tier, or None: the device). `kind`: the
        counter's key (default: the tier's, which says whether it is switched off or full)."""
        where = "keeping activations on the device" if to is None or to.resident else _WHERE[to.name]
        self._warn(kind or tier.room_kind(), f"{tier.no_room()}: {where}")

    def _account(self, delta: int) -> None:
        self.gpu_saved_bytes += delta
        self.peak_gpu_saved_bytes = max(self.peak_gpu_saved_bytes, self.gpu_saved_bytes)

    # ----------------------------------------------------------------------------------------------- store
    def _store(self, entry: _Entry) -> bool:
        """Hand `entry` to its tier, else along the tier's fallback order; False if it must stay on the device."""
        planned = entry.tier
        if not planned.resident:
            if planned.store(self, entry):
                return True  # (the usual case, first: pack pays for each line here)
            if self.on_full == "raise":
                if planned.capacity() > 0:
                    fix = f"({planned.capacity()} bytes): pass {planned.option}= larger, or on_full='fallback'"
                else:  # (a tier that is off: the plan's overrides send activations to it)
                    fix = "but the plan sends activations there: give it room, or on_full='fallback'"
                raise OffloadError(f"ssdtrain: {planned.no_room()} {fix}")
        for name in planned.fallback:
            tier = self.tiers.get(name)
            if tier is None or name == planned.name or tier.resident:
                continue
            entry.tier = tier
            if tier.store(self, entry):
                self.fell_back(planned, tier)
                return True
        entry.tier = planned
        self.fell_back(planned, None)
        return False

    def copy_out(self, entry: _Entry, buf: torch.Tensor) -> None:
        """Queue the copy of `entry`'s device bytes into the host buffer `buf` (a tier's store()); it starts at the
        next ``launch_copies_out()``. Its device bytes count as waiting to leave from here on."""
        entry.host = buf
        self._queued.append(entry)
        self._inflight_bytes += entry.nbytes

    def launch_copies_out(self) -> None:
        """Start the queued copies out. On a GPU: one wait for the compute stream (the copies start after every op
        issued so far, among them the ones that produced the queued tensors), one switch to the copy stream and one
        event for all of them. On CPU the copies are done here, synchronously. An entry released while queued (its
        pack raised after the tier queued it; the queue holds every other entry alive) is not copied: that pack gave
        its device bytes and host buffer back already."""
        if not self._queued:
            return
        with self.lock:
            queued, self._queued = self._queued, []
            by_device: dict[torch.device, list[_Entry]] = {}
            for entry in queued:
                if entry.released or entry.host is None:
                    self._inflight_bytes -= entry.nbytes
                    entry.src = None
                    continue
                by_device.setdefault(entry.device, []).append(entry)
            for device, entries in by_device.items():
                if device.type == "cuda":
                    self._launch_on_stream(device, entries)
                else:
                    self._copy_now(entries)

    def _launch_on_stream(self, device: torch.device, entries: list[_Entry]) -> None:
        out_stream, _ = self._side_streams(device)
        out_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(out_stream):
            for entry in entries:
                entry.host[: entry.nbytes].copy_(entry.src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(out_stream)
        for entry in entries:
            entry.d2h = done
        self._pending.extend(entries)

    def _copy_now(self, entries: list[_Entry]) -> None:
        error = None
        for entry in entries:
            entry.host[: entry.nbytes].copy_(entry.src)
            entry.src = None
            self._inflight_bytes -= entry.nbytes
            self._account(-entry.nbytes)
            try:
                entry.tier.copied_out(self, entry)
            except Exception as e:  # (a full disk with on_full='raise': the bytes stay in the host buffer)
                error = error or e
        if error is not None:
            raise error  # the first one, once every copy is through: none is left queued

    def writing(self, entry: _Entry, write) -> None:
        """`write` (an engine future) stores `entry`'s bytes on disk (from its host buffer, or staged from the
        device bytes by the engine when it has none: those device bytes count as in flight until staged)."""
        entry.write = write
        entry.handle = write.handle
        self._writing.append(entry)
        if entry.host is None and entry.src is not None and entry.device.type == "cuda":
            self._direct_bytes += entry.nbytes

    def _throttle(self, limit: float | None = None, counter: str = "throttle") -> None:
        """Device bytes waiting to leave (copies out, direct NVMe writes not yet staged) stay within
        `max_inflight` (or `limit`): the compute stream waits on the device for the oldest copies out, whose bytes
        are given back now (``_wait_on_device``); a direct NVMe write not yet staged is waited for by the host (the
        engine stages it from the host's side). The waits are counted as ``<counter>_waits``; their time as
        ``<counter>_ns`` (the device's, read from CUDA events by ``read_device_waits``; the host's for NVMe)."""
        limit = self.max_inflight if limit is None else limit
        if self._inflight_bytes + self._direct_bytes <= limit:
            return
        self.launch_copies_out()  # (what waits for copies out must have them started)
        self.poll()  # (copies done already give their bytes back without any wait)
        excess = self._inflight_bytes + self._direct_bytes - limit
        if excess > 0 and self._pending:
            count, freed = 0, 0
            for entry in self._pending:
                count += 1
                freed += entry.nbytes if entry.src is not None else 0
                if freed >= excess:
                    break
            if freed:
                self._wait_on_device(count, counter)
        while self._inflight_bytes + self._direct_bytes > limit:
            direct = next((e for e in self._writing if e.host is None and e.src is not None), None)
            if direct is None:
                break
            t0 = time.perf_counter()
            direct.write.wait()
            self.counters[f"{counter}_waits"] += 1
            self.counters[f"{counter}_ns"] += int((time.perf_counter() - t0) * 1e9)
            self.poll()

    def _wait_on_device(self, count: int, counter: str) -> None:
        """The compute stream of each device waits, on the device, for the copies out of the first `count` pending
        entries (one copy stream per device: its last event there covers those before it), and their device bytes
        go back to the allocator now (see the module docstring). The wait's own time is read later from two
        events around it (``read_device_waits``)."""
        with self.lock:
            entries = list(itertools.islice(self._pending, count))
            last = {entry.device: entry.d2h for entry in entries}  # (each device's latest copy event)
            for device, done in last.items():
                stream = torch.cuda.current_stream(device)
                reached = torch.cuda.Event(enable_timing=True)
                reached.record(stream)
                stream.wait_event(done)
                ended = torch.cuda.Event(enable_timing=True)
                ended.record(stream)
                self._device_waits.append((reached, ended, counter))
                self.counters[f"{counter}_waits"] += 1
            for entry in entries:
                if entry.src is not None:
                    entry.src = None
                    self._inflight_bytes -= entry.nbytes
                    self._account(-entry.nbytes)

    def read_device_waits(self, block: bool = False) -> None:
        """Add the device's waits for copies out (``_wait_on_device``) that have ended to their counters
        (``<counter>_ns``); with `block`, the host waits for the last of them to end first (calibration reads the
        waits of a checked forward as it ends)."""
        if not self._device_waits:
            return
        with self.lock:
            if block:
                self._device_waits[-1][1].synchronize()
            still = []
            for reached, ended, counter in self._device_waits:
                if not ended.query():
                    still.append((reached, ended, counter))
                    continue
                waited = reached.elapsed_time(ended)
                self.counters[f"{counter}_ns"] += max(0, int(waited * 1e6))
            self._device_waits = still

    def finish_copies_out(self) -> None:
        """Every copy out still in flight (and direct NVMe write not yet staged) gives its device bytes back now,
        the compute stream waiting for the copies on the device. The session calls it as the last block's forward
        returns: the host runs ahead of the device, so without it the allocator still counts the last moved blocks'
        bytes while the head makes its logits (the forward's peak), long after their copies are done on the device.
        The wait costs the device nothing where the copies finish before the blocks already launched do (the planner
        predicts it: ``drain_at_head``)."""
        self._throttle(limit=0, counter="head_drain")

    # ----------------------------------------------------------------------------------------------- progress
    def poll(self) -> None:
        """Advance transfers that finished (no waiting): release device memory, send host copies to disk."""
        with self.lock:
            while self._pending and self._pending[0].d2h.query():
                entry = self._pending.popleft()
                entry.d2h = None  # done: a copy back need not wait for it
                if entry.src is not None:  # (else given back already: the compute stream waited for it)
                    entry.src = None
                    self._inflight_bytes -= entry.nbytes
                    self._account(-entry.nbytes)
                entry.tier.copied_out(self, entry)
            if self._writing:
                still = []
                for entry in self._writing:
                    if entry.write.done():
                        self._write_done(entry)
                    elif entry.host is None and entry.src is not None and entry.write.staged():
                        entry.src = None  # direct write: the device bytes are no longer read
                        self._account(-entry.nbytes)
                        self._direct_done(entry)
                        still.append(entry)
                    else:
                        still.append(entry)
                self._writing = still

    def _direct_done(self, entry: _Entry) -> None:
        if entry.device.type == "cuda":
            self._direct_bytes = max(0, self._direct_bytes - entry.nbytes)

    def _write_done(self, entry: _Entry) -> None:
        error = entry.write.exception()
        entry.write = None
        if error is None:
            if entry.host is not None and entry.restored is not None:
                # Already brought back before the write finished: the disk copy is not needed. On CPU the
                # restored bytes *are* the host buffer, which then stays with the entry.
                if entry.device.type == "cuda":
                    self.pool.release(entry.host, after=entry.h2d)
                    entry.host = None
                self._free_handle(entry)
            elif entry.host is not None:
                self.pool.release(entry.host)
                entry.host = None
            if entry.src is not None:
                entry.src = None
                self._account(-entry.nbytes)
                self._direct_done(entry)
            return
        # The disk refused the bytes: keep whatever copy still exists, or remember that they are lost.
        handle, entry.handle = entry.handle, None
        if handle is not None:
            self.engine.free(handle)
        if entry.host is None and entry.src is not None:
            self._direct_done(entry)  # kept on the device from here: no longer waiting to leave
        if entry.host is not None or entry.src is not None:
            entry.tier = self.tiers["host"] if entry.host is not None else self.tiers["keep"]
            self._warn(
                "nvme_error",
                f"an NVMe write failed ({error}): keeping the activation in "
                f"{'host memory' if entry.host is not None else 'device memory'}",
            )
        else:
            entry.lost = error

    # ----------------------------------------------------------------------------------------------- restore
    def _restore(self, entries: list[_Entry], stream) -> None:
        """Issue the copies back of `entries` on `stream` (None: CPU) under one switch to that stream (it cost the
        host 35 us each, the copy itself 12), each with its own event (unpack waits for its own bytes only)."""
        if stream is None:
            for entry in entries:
                self._restore_now(entry)
            return
        with torch.cuda.stream(stream):
            waited = None
            for entry in entries:
                if entry.d2h is not None and entry.d2h is not waited:
                    # Its copy out may still run (its bytes were given back on the device: _wait_on_device): the
                    # copy back follows it on the device, not the host.
                    stream.wait_event(entry.d2h)
                    waited = entry.d2h
                out = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)
                if entry.host is not None:
                    out.copy_(entry.host[: entry.nbytes], non_blocking=True)
                    entry.h2d = torch.cuda.Event(enable_timing=True)  # a late one's wait is timed (read_waits)
                    entry.h2d.record(stream)
                    if entry.write is None:  # the host copy is no longer needed once this copy is done
                        self.pool.release(entry.host, after=entry.h2d)
                        entry.host = None
                        self._free_handle(entry)
                else:
                    entry.read = self.engine.read(entry.handle, out=out, stream=stream)
                entry.restored = out
                entry.ready_on = None
                self._account(entry.nbytes)
                self.counters["bytes_restored"] += entry.nbytes

    def _restore_now(self, entry: _Entry) -> None:
        """CPU: the restored bytes are the host buffer itself, or a disk read into a new one."""
        if entry.host is not None:
            entry.restored = entry.host[: entry.nbytes]
        else:
            buf = self.pool.allocate(entry.nbytes) if self.pool is not None else None
            out = buf[: entry.nbytes] if buf is not None else torch.empty(entry.nbytes, dtype=torch.uint8)
            entry.read = self.engine.read(entry.handle, out=out)
            entry.restored = out
            entry.host = buf
        self._account(entry.nbytes)
        self.counters["bytes_restored"] += entry.nbytes

    def _free_handle(self, entry: _Entry) -> None:
        if entry.handle is not None and entry.write is None and self.engine is not None:
            self.engine.free(entry.handle)
            entry.handle = None

    def drain(self) -> None:
        """Wait for every copy out and NVMe write (used before closing)."""
        with self.lock:
            self.launch_copies_out()
            for entry in list(self._pending):
                entry.d2h.synchronize()
            for entry in list(self._writing):
                entry.write.wait()
            self.poll()


_WHERE = {"host": "keeping activations in host memory", "nvme": "moving activations to NVMe directly"}
