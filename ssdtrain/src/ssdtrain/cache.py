"""The tensor cache behind ``saved_tensors_hooks``: what autograd saves goes to a tier and comes back for backward.

``pack(tensor)`` (called by autograd when an op saves a tensor for backward) either returns the tensor itself
(kept on its device: parameters and their casts/transposes, small tensors, units the plan keeps) or a ``_Saved``
token naming an ``_Entry``: the bytes of the tensor's *storage*. Views of one storage saved several times (q, k, v
split from one projection; a reshape of a saved input) share one entry, stored once and rebuilt with their own
offset, shape and strides on unpack; a kept storage saved by two ops is counted once too. An entry is handed to a
tier (``ssdtrain.tiers``: pinned host memory, NVMe through the I/O engine), which queues the copy; the unit's queued
copies start together on a side stream as the next unit begins (``enter_unit``), so forward compute never waits for
them and the host pays for one stream switch per unit, not per tensor; its GPU memory is released as soon as the copy
is done. A tier without room
passes the entry on along its fallback order (host -> NVMe -> device; NVMe -> host -> device).

``unpack(token)`` returns the data: the original if it is still on the device (a copy in flight is forwarded, never
re-read), else the prefetched copy (the current stream waits on an event, not the host), else a copy issued right
there (a *miss*). Prefetching restores the next units in reverse order when backward
reaches a unit. An entry's memory and disk space return to the pool the moment autograd drops the last token
(``retain_graph=False`` drops it right after the node that used it).

On CPU tensors the same code runs with synchronous copies (no streams), so every path is tested without a GPU.

This module is the front (what to store, what to bring back when); the copies themselves are its base class
``Transfers`` (``ssdtrain.transfers``), and the stored records are ``ssdtrain.entries``.
"""

from __future__ import annotations

import collections
import time
import weakref

import torch

from .derive import Derived, Deriver
from .entries import OffloadError, OffloadWarning, _Entry, _param_derived, _Saved, _storage_ref
from .transfers import Transfers

__all__ = ["OffloadError", "OffloadWarning", "TensorCache"]

_STRIDED = torch.strided


def _modified(t: torch.Tensor, version: int) -> RuntimeError:
    """Autograd's own error for a saved tensor modified in place after it was saved (autograd does not check
    versions of tensors that went through saved-tensor hooks, so the cache checks those it returns as they are)."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} instead "
        "(checked by ssdtrain, as autograd does without saved-tensor hooks). Hint: the operation that modified it "
        "ran after the tensor was saved for backward; use its out-of-place form (x = x.add(y), not x.add_(y)), or "
        "clone the tensor before modifying it"
    )


class TensorCache(Transfers):
    """Pack/unpack for saved tensors over tiers (``ssdtrain.tiers``). Driven by the session (units, plan, steps)."""

    def __init__(self, *, min_bytes: int, tiers: dict, on_full: str = "fallback"):
        super().__init__(tiers=tiers, on_full=on_full)
        self.min_bytes = int(min_bytes)
        self.unit = 0  # the unit now running forward (set by the session's module hooks)
        self.tier_of = lambda unit, nbytes: "keep"  # the plan's tier name for a unit, set by the session
        self.keeps_unit = None  # unit -> True when the plan keeps all it saves (set by the session; None: ask tier_of)
        self.window_bytes = 1 << 30  # prefetched-but-unused bytes allowed on the device
        self.window_units = 1 << 30  # units below the one in backward that may be prefetched
        # The head's unit, where the plan has the head's backward run with no block below it prefetched (its peak
        # is the step's); None: prefetch as usual.
        self.hold_head: int | None = None
        self.param_storages: set[int] = set()
        # Units whose saved elementwise results are stored as recipes (unit -> True; set by the session, None: none),
        # and the units a profiled step measures recipes for (the same; None: none).
        self.derive_unit = None
        self.deriver = Deriver()
        self.derive_kept: frozenset[int] = frozenset()  # units the plan derives and keeps (a shorter path in pack)
        self.observer = None  # profile recorder: observer(unit, key, nbytes, kind)
        self.on_backward = None  # called at the first unpack of a step's backward (inside the autograd engine)
        self.on_idle = None  # called once no entry is left after close(): the session releases the tiers
        # key -> weak reference to its entry (dedup). A plain dict, pruned each step: a WeakValueDictionary's
        # Python-level get and set cost more than the rest of a moved tensor's bookkeeping in pack.
        self._live: dict[tuple, weakref.ref] = {}
        self._kept: dict[tuple, tuple] = {}  # key -> (storage ref, version): kept storages of this step (dedup)
        # id() of a saved tensor pack returned as it is -> (its unit or None, its version then). The unit: its
        # unpack tells where backward is, which drives the prefetch. The version: autograd checks a saved tensor's
        # version only where no saved-tensor hooks are on, so unpack does it instead (a tensor modified in place
        # after it was saved would give wrong gradients, where plain PyTorch raises). Every path of pack that
        # returns the tensor itself records it, so an id here is the tensor's own (it is alive until autograd has
        # unpacked it), never a dead tensor's. Ids, not storage addresses: one dict store per kept tensor, cheap
        # enough for the fast path below.
        self._kept_unit: dict[int, tuple[int | None, int]] = {}
        self._by_unit: dict[int, list] = collections.defaultdict(list)  # unit -> weakrefs to entries
        self._prefetched: set[int] = set()  # units whose restore was issued this backward
        self._retry: set[int] = set()  # prefetched units with entries whose copy out was still running then
        self._prefetched_bytes = 0
        # Windows (unit, lowest unit) whose every unit was prefetched this backward: a _prefetch_from call for one
        # has nothing to do until a unit needs a retry (units stay prefetched all backward). Unpack calls it for
        # every saved tensor, with backward's units interleaved (a block's backward unpacks tensors the block after
        # it saved): a set, not the last window only.
        self._covered: set[tuple[int, int]] = set()
        self._blocked: tuple | None = None  # the last prefetch call the window stopped, with what could unblock it
        self._shared: set[tuple[int, int]] = set()  # (unit, id(entry)): an entry of an earlier unit saved here too
        self._waits: list[tuple] = []  # (compute reached the unpack, copy back done) CUDA events not yet read
        self._backward_started = False
        self._entries = 0  # entries not yet released
        self.closed = False
        self.aborted = False

    def enter_unit(self, unit: int) -> None:
        """Forward moves on to `unit` (the session's module hooks): the copies out the unit before queued start,
        and those finished give their device bytes back (once per unit, not per saved tensor: the planner counts
        copies out as held until the end of the unit in which they finish)."""
        if unit != self.unit:
            self.launch_copies_out()
            if self._pending or self._writing:
                self.poll()
        self.unit = unit

    def reset_step(self) -> None:
        self.launch_copies_out()
        with self.lock:
            self._live = {key: ref for key, ref in self._live.items() if ref() is not None}
            for unit in list(self._by_unit):
                alive = [r for r in self._by_unit[unit] if r() is not None]
                if alive:
                    self._by_unit[unit] = alive
                else:
                    del self._by_unit[unit]
            self._kept.clear()
            self._kept_unit.clear()
            self._prefetched.clear()
            self._covered.clear()
            self._blocked = None
            self._retry.clear()
            self._shared.clear()
            self._prefetched_bytes = 0
            self._backward_started = False
        self.read_waits()
        self.read_device_waits()

    def _seen_kept(self, key, storage, version) -> bool:
        """True if this storage (span) was kept or counted already this step: saved by a second op."""
        known = self._kept.get(key)
        if known is not None:
            ref, v = known
            if v == version and ref is not None and ref() is storage:
                return True
        self._kept[key] = (_storage_ref(storage), version)
        return False

    # ----------------------------------------------------------------------------------------------- pack
    def pack(self, t: torch.Tensor):
        unit = self.unit
        if unit in self.derive_kept and self.observer is None:
            # A unit the plan derives and keeps: a recipe (replayed from the block's template where it has one), or
            # kept as it is; the checks of the general path below in their cheapest form (a host-bound step pays
            # each microsecond here on the device too).
            if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
                return self._as_is(t)
            if self.aborted or t.layout is not _STRIDED or not (t.is_cuda or t.is_cpu) or t.numel() == 0:
                return self._as_is(t)
            derived = self.deriver.derive(t, unit)
            if derived is not None:
                self.counters["derived_tensors"] += 1
                return derived
            self.counters["kept_tensors"] += 1
            return self._keep(t, unit)
        # (each asked once per call: see the host-bound note below)
        derives = self.derive_unit is not None and self.derive_unit(unit)
        keeps = self.keeps_unit is not None and self.observer is None and self.keeps_unit(unit)
        if keeps and not derives:
            # A unit the plan keeps whole: nothing to decide, not even what kind of tensor this is (most saved
            # tensors of a plan that moves only a few units; autograd calls pack for every one of them, and on a
            # host-bound step each microsecond here is the device's too). Its unpack still moves the prefetch
            # window: a moved unit under kept ones is restored before backward reaches it, not on demand there.
            self.counters["kept_tensors"] += 1
            return self._keep(t, unit)
        if self.aborted or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            return self._as_is(t)
        if not (t.is_cuda or t.is_cpu) or t.numel() == 0:
            return self._as_is(t)
        if derives:
            derived = self.deriver.derive(t, unit)
            if derived is not None:
                if not self.deriver.observe:
                    self.counters["derived_tensors"] += 1
                    return derived
                if self.observer is not None:
                    self._observe_derived(t, derived)
        if keeps:
            # A kept unit's tensor that no recipe makes (a derive unit's): kept, as above.
            self.counters["kept_tensors"] += 1
            return self._keep(t, unit)
        with self.lock:
            esize = t.element_size()
            if type(t) is torch.nn.Parameter:  # (its type is Tensor or Parameter: checked above)
                self.counters["kept_param_tensors"] += 1
                return self._as_is(t)
            storage = t.untyped_storage()
            sptr = storage.data_ptr()
            if sptr in self.param_storages:
                self.counters["kept_param_tensors"] += 1
                return self._as_is(t)
            if _param_derived(t):
                # A cast of a parameter (autocast's bf16 weight) is new device memory, held until backward uses
                # it: never moved (it is re-created each step anyway), but counted by the planner.
                self.counters["kept_param_tensors"] += 1
                key = (t.device.type, t.device.index, sptr, 0, storage.nbytes())
                if self.observer is not None and not self._seen_kept(key, storage, t._version):
                    self.observer(self.unit, key, storage.nbytes(), "param_copy")
                return self._as_is(t)
            if t.is_contiguous():
                span = t.numel()  # (what the sum below gives for a contiguous tensor, for less host time)
            else:
                span = 1 + sum((s - 1) * st for s, st in zip(t.size(), t.stride(), strict=True) if s > 0)
                if min(t.stride(), default=0) < 0:
                    return self._as_is(t)
            span_bytes = span * esize
            whole = 2 * span_bytes >= storage.nbytes()
            base = 0 if whole else t.storage_offset() * esize
            length = storage.nbytes() if whole else span_bytes
            device = t.device
            key = (device.type, device.index, sptr, base, length)
            ref = self._live.get(key)
            entry = ref() if ref is not None else None
            if entry is not None and entry.storage_alive() and entry.version == t._version:
                self.counters["dedup_views"] += 1
                if self.observer is not None:
                    self.observer(unit, key, 0, "view")
                if entry.unit != unit and (unit, id(entry)) not in self._shared:
                    # One tensor saved by several units (a model's rotary cos/sin, passed to every block): backward
                    # reaches the last of them first, so that unit's prefetch brings it back, not a miss there.
                    self._shared.add((unit, id(entry)))
                    entry.shared = True
                    self._by_unit[unit].append(weakref.ref(entry))
                saved = _Saved.of(t, entry, base)
                if derives:
                    self._moved_for_recipes(t, entry, saved)
                return saved
            if self._seen_kept(key, storage, t._version):
                # Kept already (a second op saving the same tensor): the same bytes, counted once.
                self.counters["dedup_views"] += 1
                if self.observer is not None:
                    self.observer(unit, key, 0, "view")
                return self._as_is(t)
            small = length < self.min_bytes
            if self.observer is not None:
                self.observer(unit, key, length, "small" if small else "saved")
            tier = self.tiers.get("keep") if small else self.tiers.get(self.tier_of(unit, length))
            if tier is None or tier.resident:
                self.counters["kept_bytes"] += length
                self.counters["kept_tensors"] += 1
                return self._keep(t, unit)
            self._kept.pop(key, None)  # stored, not kept: the entry dedups its views from here on
            src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, base, (length,), (1,))
            entry = _Entry(self, key, unit, length, device, tier, src, t, storage)
            self._account(length)  # on the device until its copy out is done
            try:
                stored = self._store(entry)
            except BaseException:
                entry.released = True  # never stored: what it took goes back now
                if entry.src is not None:  # (a synchronous copy out gave the device bytes back already)
                    self._account(-length)
                if entry.host is not None and self.pool is not None:
                    self.pool.release(entry.host, after=entry.d2h)
                    entry.host = None
                raise
            if not stored:
                entry.released = True  # nothing to give back: it never left the device
                self._account(-length)
                self.counters["kept_bytes"] += length
                self.counters["kept_tensors"] += 1
                return self._as_is(t)  # no room anywhere: kept on the device (warned)
            self._entries += 1
            ref = weakref.ref(entry)
            self._live[key] = ref
            self._by_unit[unit].append(ref)
            self.counters["packed_tensors"] += 1
            self.counters[f"bytes_to_{entry.tier.name}"] += entry.nbytes
            saved = _Saved.of(t, entry, base)
            if derives:
                self._moved_for_recipes(t, entry, saved)
            if self._backward_started:
                self.launch_copies_out()  # (saved in backward, by a recomputed block: no unit begins after it)
            self._throttle()
            return saved

    def _moved_for_recipes(self, t: torch.Tensor, entry: _Entry, saved: _Saved) -> None:
        """`t`, saved by a block planned `derive` with a tier (`derive+host`), went to that tier: the block's later
        recipes read it through a token for the whole tensor (their inputs), so that they do not hold its device
        bytes. Where the entry holds only a part of the storage of the tensor `t` views, none: a recipe reading
        that tensor holds it on the device (exact, but those bytes are not freed)."""
        whole = t._base if t._base is not None else t
        if whole is t:
            token = saved
        elif entry.key[3] == 0 and entry.nbytes == whole.untyped_storage().nbytes():
            token = _Saved.of(whole, entry, 0)
        else:
            return
        self.deriver.moved(whole, token, self.unpack)

    def _as_is(self, t):
        """`t` is saved as it is, outside any unit: its version is recorded for unpack's check."""
        return self._keep(t, None)

    def _keep(self, t, unit):
        """What autograd holds for a tensor kept as it is (`unit`: its unit, None: outside any): a detached alias
        (the same storage and version counter) where `t` has a grad_fn. `t` itself would be a reference cycle
        for an output its own op saves (the node holds the tensor, the tensor its node, inside autograd where
        Python's gc cannot see it), so a graph dropped without backward (a forward whose loss is not used, a
        backward that raised) would never be freed, nor the activations it moved (pinned buffers, NVMe space).
        Its id and version are recorded for unpack's check and prefetch window. In a block whose saved tensors
        recipes may start from (derive, and a profiled step measuring them) the deriver makes the alias: its
        recipes find those tensors through weak references, which must follow the alias autograd holds."""
        if t.grad_fn is not None:
            if self.derive_unit is not None and self.derive_unit(self.unit):
                t = self.deriver.hold(t)
            else:
                t = t.detach()
        self._kept_unit[id(t)] = (unit, t._version)
        return t

    def _observe_derived(self, t: torch.Tensor, derived: Derived) -> None:
        """A profiled step: record that `t`'s storage has a recipe (once per storage) and what it costs."""
        storage = t.untyped_storage()
        key = (t.device.type, t.device.index, storage.data_ptr(), 0, storage.nbytes())
        if storage.nbytes() < self.min_bytes or self._seen_kept(("derived",) + key, storage, t._version):
            return
        traffic, ops = self.deriver.cost(derived)
        # A parameter's cast: its bytes are counted as the unit's casts ("param_copy"), only its cost here.
        nbytes = 0 if derived.cast else storage.nbytes()
        self.observer(self.unit, key, nbytes, "derivable", traffic=traffic, ops=ops)

    # ----------------------------------------------------------------------------------------------- unpack
    def unpack(self, saved):
        if isinstance(saved, Derived):
            if not self._backward_started:
                with self.lock:
                    self._begin_backward()
                    self._prefetch_from(self._backward_top())
            elif self._by_unit:
                with self.lock:
                    self._prefetch_from(saved.unit)
            return saved.materialize()
        if not isinstance(saved, _Saved):
            known = self._kept_unit.get(id(saved))
            if known is not None and known[1] != saved._version:
                raise _modified(saved, known[1])
            if not self._backward_started:  # backward began with a kept tensor: prefetch from the last unit down
                with self.lock:
                    self._begin_backward()
                    self._prefetch_from(self._backward_top())
            elif self._by_unit and known is not None and known[0] is not None:
                # A kept activation of a unit: backward has reached it, so the units below it are due (kept
                # units move the prefetch window like moved ones).
                with self.lock:
                    self._prefetch_from(known[0])
            return saved
        entry = saved.entry
        with self.lock:
            # This entry first, then the poll: a poll first would free its device bytes the moment their copy out
            # finished and force a copy back of the same bytes (a miss) where they can be used in place.
            data = self._device_bytes(entry)
            if self._backward_started:
                self.poll()
            else:
                self._begin_backward()
            if not entry.shared:
                # A shared entry's own unit is the earliest that saved it, not where backward is: prefetching from
                # there would hold that unit's bytes on the device through the rest of backward.
                self._prefetch_from(entry.unit)
        out = torch.empty(0, dtype=saved.dtype, device=entry.device).set_(
            data.untyped_storage(),
            data.storage_offset() // saved.dtype.itemsize + saved.offset,
            saved.size,
            saved.stride,
        )
        return saved.view_bits(out) if saved.bits else out

    def _begin_backward(self) -> None:
        """At the first unpack of a backward: the copies out still running (the forward's last offloaded units) give
        their device bytes back before backward allocates, the compute stream waiting for them on the device
        (``_wait_on_device``). Otherwise they stay referenced until some later unpack polls: on GPT-2 at
        save_on_cpu's memory (H200) four blocks' inputs, 256 MiB, were still held at the head's backward, where the
        step peaks. The GPU still has the forward's last layers queued when backward begins, so the wait should
        not leave it idle: measured step times stayed within 1.5 % of those without this wait."""
        self._backward_started = True
        if self.on_backward is not None:
            self.on_backward()
        self._throttle(limit=0, counter="backward_start")
        self.poll()

    def _device_bytes(self, entry: _Entry) -> torch.Tensor:
        first = not entry.unpacked
        entry.unpacked = True
        if first:
            self.counters["unpacked_moved_bytes"] += entry.nbytes
        if first and entry.restored is not None:
            self._prefetched_bytes -= entry.nbytes
        if entry.src is not None:
            self.counters["forwarded"] += first
            return entry.src
        original = entry.alive_original()
        if original is not None and original.device == entry.device:
            self.counters["forwarded"] += first
            storage = original.untyped_storage()
            base = entry.key[3]
            return torch.empty(0, dtype=torch.uint8, device=entry.device).set_(storage, base, (entry.nbytes,), (1,))
        stream = torch.cuda.current_stream(entry.device) if entry.device.type == "cuda" else None
        if self.aborted:
            raise OffloadError(
                "ssdtrain: this activation was released when its offload session closed after an "
                "error; run forward again inside a new session"
            )
        if entry.lost is not None:
            raise OffloadError(
                f"ssdtrain: an activation was lost: its NVMe write failed ({entry.lost}) after the "
                "device copy was released; gradients cannot be computed for this step"
            ) from entry.lost
        reached = None
        if entry.restored is None:
            self.counters["misses"] += first
            if first:
                # Why it was not prefetched: its unit was never reached, or it was still being copied out (or its
                # original was still alive) when the unit was prefetched, and no longer is now.
                self.counters[f"miss_{entry.skipped or 'not_reached'}"] += 1
                self.counters["missed_bytes"] += entry.nbytes
            if first and stream is not None:
                reached = self._device_mark(stream)  # the copy runs on the compute stream: all of it is waited for
            self._restore([entry], stream)
        else:
            self.counters["prefetch_hits"] += first
        if entry.read is not None:
            fut = entry.read
            if not fut.done():
                self.counters["stalls"] += 1
                t0 = time.perf_counter()
                fut.wait()
                self.counters["stall_ns"] += int((time.perf_counter() - t0) * 1e9)
            error = fut.exception()
            entry.read = None
            if error is not None:
                entry.restored = None
                raise OffloadError(
                    f"ssdtrain: reading an activation back from NVMe failed ({error}); gradients "
                    "cannot be computed for this step"
                ) from error
            self._free_handle(entry)
        if stream is not None:
            handle = stream.cuda_stream
            if entry.ready_on == handle:
                # Unpacked before on this stream (one stored span serves several saved tensors): the stream waits
                # for the copy and the allocator knows it uses the bytes already; both again would be host time
                # for nothing (backward unpacks ~2 saved tensors per moved span).
                return entry.restored
            if entry.h2d is not None:
                if first and reached is None and not entry.h2d.query():
                    # Not done when the host got here. The host runs ahead of the device, so this alone is no
                    # stall: the device's own wait is read from the two events once both are done (read_waits).
                    self.counters["late_prefetch"] += 1
                    self.counters["late_bytes"] += entry.nbytes
                    reached = self._device_mark(stream)
                if reached is not None:
                    self._waits.append((reached, entry.h2d))
                stream.wait_event(entry.h2d)  # on the device: the host does not wait
            entry.restored.record_stream(stream)
            entry.ready_on = handle
        return entry.restored

    @staticmethod
    def _device_mark(stream):
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def read_waits(self) -> float:
        """Seconds the device's compute waited, in total so far, for copies back that were late or missed (from
        the CUDA events of each: compute reaching the unpack, the copy done); pairs not yet done are read later."""
        if self._waits:
            with self.lock:
                still = []
                for reached, done in self._waits:
                    try:
                        if not (reached.query() and done.query()):
                            still.append((reached, done))
                            continue
                        waited = reached.elapsed_time(done)
                    except RuntimeError:  # an event not recorded or not timed (NVMe reads): nothing to read
                        continue
                    self.counters["prefetch_wait_ns"] += max(0, int(waited * 1e6))
                self._waits = still[-4096:]
        return self.counters["prefetch_wait_ns"] / 1e9

    def _backward_top(self) -> int:
        """The unit backward begins in, where the window starts: the last unit forward ran (the head, under the
        session's hooks), so that a moved unit below kept ones is restored when backward comes within the window of
        it, as the plan predicts. Starting at the highest moved unit instead held its bytes through the head's
        backward, the step's peak (on an H100, Llama-style 16 x 2048, 384 MiB over the predicted peak). Where
        forward's units are unknown (a compiled model's) or lie below the moved ones: the highest moved unit."""
        return max(self.unit, max(self._by_unit, default=-1), self.hold_head or -1)

    def _prefetch_from(self, unit: int) -> None:
        """Restore `unit` and the `window_units` units before it (backward order), whole units, while what is
        prefetched and not yet used plus the next unit stays within the window (one unit at least): the planner's
        bound on the bytes held ahead of backward."""
        lowest = max(0, unit - self.window_units)
        if self.hold_head is not None and unit >= self.hold_head:
            lowest = unit  # the head's backward: nothing below it yet
        if not self._retry:
            if (unit, lowest) in self._covered:
                return  # (every unit of this window was prefetched already: most unpacks of a step end here)
            if self._blocked is not None and self._blocked == self._window_state(unit, lowest):
                # The window stopped this same call before, and nothing that could let the next unit in has
                # changed since. Backward stays in one unit for many unpacks while the window is full.
                return
        u = unit
        while u >= lowest and self._prefetched_bytes < self.window_bytes:
            if u not in self._prefetched or u in self._retry:
                need = self._unit_pending_bytes(u)
                if need and self._prefetched_bytes and self._prefetched_bytes + need > self.window_bytes:
                    self._blocked = None if self._retry else self._window_state(unit, lowest)
                    return
                self._prefetched.add(u)
                self._prefetch_unit(u)
            u -= 1
        if u < lowest:
            self._covered.add((unit, lowest))

    def _window_state(self, unit: int, lowest: int) -> tuple:
        """What a prefetch call stopped by the window depends on: the window asked for, the prefetched bytes not
        yet used (a first unpack uses some), the entries alive (a release) and the moved bytes unpacked (one
        restored on demand). A unit's bytes that grow (a copy out done) leave it stopped."""
        return (unit, lowest, self._prefetched_bytes, self._entries, self.counters["unpacked_moved_bytes"])

    def _unit_pending_bytes(self, unit: int) -> int:
        """Bytes of `unit` a prefetch would restore now."""
        total = 0
        for r in self._by_unit.get(unit, []):
            e = r()
            if e is not None and e.restored is None and not e.unpacked and e.src is None and e.lost is None:
                total += e.nbytes
        return total

    def _prefetch_unit(self, unit: int) -> None:
        refs = self._by_unit.get(unit, [])
        alive = [e for e in (r() for r in refs) if e is not None]
        self._by_unit[unit] = [weakref.ref(e) for e in alive]
        self._retry.discard(unit)
        due = []
        for entry in reversed(alive):
            if entry.restored is not None or entry.unpacked:
                continue
            if entry.src is not None:
                # Still being copied out (the host runs ahead of the device): used in place if that is still so
                # when backward needs it, else restored by a later prefetch call (the unit is tried again).
                entry.skipped = "in_flight"
                self._retry.add(unit)
                continue
            if entry.alive_original() is not None or entry.lost is not None:
                entry.skipped = "alive" if entry.lost is None else None
                continue
            if entry.skipped == "in_flight":
                self.counters["prefetch_retried"] += 1
            entry.skipped = None
            due.append(entry)
            self._prefetched_bytes += entry.nbytes
        # No wait for the compute stream: the buffers come from the prefetch stream's own pool, and unpack records
        # the compute stream on each, so the allocator reuses it only after backward is done with it.
        for device in {e.device for e in due}:
            stream = self._side_streams(device)[1] if device.type == "cuda" else None
            self._restore([e for e in due if e.device == device], stream)

    # ----------------------------------------------------------------------------------------------- release
    def _release(self, entry: _Entry) -> None:
        """The last token of `entry` is gone: give back its host buffer, disk space and device copy."""
        with self.lock:
            if entry.released:
                return
            entry.released = True
            self._entries -= 1
            if entry.read is not None:
                entry.read.wait()  # the engine is still filling `restored`: let it finish before the memory goes
                entry.read = None
            if entry.restored is not None:
                self._account(-entry.nbytes)
                if not entry.unpacked:
                    self._prefetched_bytes -= entry.nbytes
            entry.restored = None
            if entry.host is not None and self.pool is not None:
                self.pool.release(entry.host, after=entry.h2d or entry.d2h)
                entry.host = None
            if entry.handle is not None and self.engine is not None and entry.write is None:
                try:
                    self.engine.free(entry.handle)
                except (ValueError, RuntimeError):
                    pass  # engine closed: its files are gone already
                entry.handle = None
            if self.closed and self._entries == 0 and self.on_idle is not None:
                idle, self.on_idle = self.on_idle, None
                idle()

    def close(self, abort: bool) -> None:
        """Stop: with `abort`, every stored activation is dropped (tokens still held raise OffloadError)."""
        with self.lock:
            self.closed = True
            self.aborted = self.aborted or abort
            try:
                self.drain()
            finally:
                if abort:
                    for refs in self._by_unit.values():
                        for r in refs:
                            e = r()
                            if e is not None:
                                self._release(e)
                                e.src = None
                    self._by_unit.clear()
                    self._live.clear()
                    self._queued.clear()
                    self._pending.clear()
                    self._writing.clear()
                    self._inflight_bytes = 0
                    self._direct_bytes = 0
                    self.gpu_saved_bytes = 0
                self._kept.clear()

    def live_entries(self) -> int:
        """Stored activations not yet released (autograd still holds them)."""
        return self._entries
