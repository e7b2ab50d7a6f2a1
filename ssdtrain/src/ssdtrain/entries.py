"""What the tensor cache stores for a saved activation, and the errors it raises.

An ``_Entry`` is the bytes of one span of a storage (views of one storage saved several times share it): where
those bytes are now (device, host buffer, NVMe handle, restored copy) and which transfer is in flight. A ``_Saved``
token is what autograd holds instead of the tensor: the entry, and the view to rebuild from it. The entry asks its
cache to give back its memory when the last token goes (``__del__``). ``_param_derived`` tells a parameter's cast or
view (never moved) from an activation.
"""

from __future__ import annotations

import weakref

import torch

# Autograd nodes through which a parameter only changes dtype or layout (AMP's casts, Linear's weight.t(), views).
_PARAM_VIEW_NODES = frozenset(
    {
        "ToCopyBackward0",
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "ExpandBackward0",
        "AsStridedBackward0",
        "SliceBackward0",
        "AliasBackward0",
        "DetachBackward0",
        "CloneBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "UnsqueezeBackward0",
    }
)


class OffloadError(RuntimeError):
    """A saved activation cannot be given back (its NVMe write or read failed, or its session was aborted)."""


class OffloadWarning(UserWarning):
    """A tier ran out of room and ssdtrain fell back to another one (the result stays exact)."""


def _param_derived(t: torch.Tensor) -> bool:
    node = t.grad_fn
    for _ in range(4):
        if node is None:
            return False
        name = type(node).__name__
        if name == "AccumulateGrad":
            return True
        if name not in _PARAM_VIEW_NODES:
            return False
        nxt = [n for n, _ in node.next_functions if n is not None]
        if len(nxt) != 1:
            return False
        node = nxt[0]
    return False


class _Entry:
    """One stored span of a storage: where its bytes are now and what to release when the last token goes."""

    __slots__ = (
        "cache",
        "key",
        "unit",
        "nbytes",
        "device",
        "tier",
        "src",
        "ref",
        "sref",
        "version",
        "host",
        "d2h",
        "handle",
        "write",
        "read",
        "restored",
        "h2d",
        "ready_on",
        "unpacked",
        "lost",
        "skipped",
        "released",
        "shared",
        "__weakref__",
    )

    def __init__(self, cache, key, unit, nbytes, device, tier, src, original, storage):
        self.cache = cache
        self.key = key
        self.unit = unit
        self.nbytes = nbytes
        self.device = device
        self.tier = tier
        self.src = src  # device bytes, held until the copy out is done (then forwarded instead of re-read)
        self.ref = weakref.ref(original)
        self.sref = _storage_ref(storage)
        self.version = original._version
        self.host = None  # host buffer (uint8, pool) holding the bytes
        self.d2h = None  # event: copy out done
        self.handle = None  # NVMe handle
        self.write = None  # NVMe write future in flight
        self.read = None  # NVMe read future in flight (into `restored`)
        self.restored = None  # device bytes brought back
        self.h2d = None  # event: restored is complete
        self.ready_on = None  # the stream (handle) that already waits for `restored` and is recorded on it
        self.unpacked = False
        self.lost = None  # the error that destroyed the only copy
        self.skipped = None  # why prefetching its unit left it alone ("in_flight", "alive"), for miss counters
        self.released = False
        self.shared = False  # saved by later units too (their prefetch restores it; its unpack drives no window)

    def storage_alive(self) -> bool:
        """The stored storage still exists (so equal data pointers mean the same memory, not a reused address)."""
        return self.src is not None or self.ref() is not None or (self.sref is not None and self.sref() is not None)

    def alive_original(self):
        t = self.ref()
        if t is not None and t._version == self.version:
            return t
        return None

    def __del__(self):
        try:
            self.cache._release(self)
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to give back any more
            pass


def _storage_ref(storage):
    try:
        return weakref.ref(storage)
    except TypeError:  # torch builds whose storages take no weak references: the tensor's reference decides
        return None


class _Saved:
    """What autograd holds for an offloaded tensor: the entry and the view to rebuild from it.

    `bits` keeps a lazy view's flags, which live on the tensor, not in its storage's bytes: 1, a conjugate view
    (``c.conj()`` of a complex tensor), 2, a negative view (``c.conj().imag``). A view rebuilt without them would
    read the bytes as they are stored: the complex conjugate, or the negation, of the values saved."""

    __slots__ = ("entry", "dtype", "offset", "size", "stride", "bits")

    def __init__(self, entry, dtype, offset, size, stride, bits=0):
        self.entry, self.dtype, self.offset, self.size, self.stride = entry, dtype, offset, size, stride
        self.bits = bits

    @classmethod
    def of(cls, t: torch.Tensor, entry, base: int) -> _Saved:
        """The token for `t`, a view of `entry`'s bytes, which begin `base` bytes into its storage."""
        esize = t.element_size()
        bits = (1 if t.is_conj() else 0) | (2 if t.is_neg() else 0)
        return cls(entry, t.dtype, (t.storage_offset() * esize - base) // esize, t.size(), t.stride(), bits)

    def view_bits(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (the rebuilt view) with this token's lazy view flags set again."""
        if self.bits & 2:
            t = torch._neg_view(t)
        if self.bits & 1:
            t = t.conj()
        return t
