"""Where saved activations can live: a tier is one object that both the planner and the tensor cache use.

A tier has a name (what ``Choice`` strings and ``print(plan)`` say), a capacity, the read and write rates of the
stage behind the device link (none for pinned host memory; the disk for NVMe), an order of tiers to fall back to
when it has no room (switched off or full), and the operations the cache needs: ``store`` (start moving an
activation's device bytes out) and ``copied_out`` (the device-to-host copy is done: go on, e.g. to disk). Bringing
bytes back is decided by where they are (a host buffer, a disk handle), not by the tier's name, so a new tier is one
new class registered in ``TIERS``.

    keep   the device itself: nothing moves
    host   the pinned host pool; falls back to NVMe, then to the device
    nvme   the I/O engine's files, staged through a pinned host buffer when the pool has one, else through the
           engine's own small pinned ring (the device bytes are then held until staged); falls back to the host
           pool, then to the device

The disk's rates are measured the first time a directory is used (a short O_DIRECT write and read through the
engine) and kept in a small JSON file under ``$XDG_CACHE_HOME/ssdtrain`` (else ``~/.cache/ssdtrain``), keyed by
directory and device, so later sessions plan with them at no cost.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass

import torch

from ._shared_cuda import cache_home
from .config import settings as io_settings
from .entries import OffloadError, OffloadWarning
from .io import Engine, huge_empty

log = logging.getLogger("ssdtrain")
_MIB = 1 << 20


@dataclass(frozen=True)
class TierSpec:
    """What the planner knows of a tier that moves bytes off the device (all rates in bytes per second)."""

    name: str
    capacity: int
    write_rate: float | None = None  # the stage behind the device link (None: the link alone, e.g. host memory)
    read_rate: float | None = None
    measured: bool = True  # False: the rates are assumptions (the plan text says so)


class Tier:
    """One place for saved activations. Subclasses set `name`, `fallback` and implement what differs."""

    name = ""
    resident = False  # the bytes stay on the device
    fallback: tuple[str, ...] = ()  # tiers tried, in order, when this one has no room (then the device)
    option = ""  # the offload() option that sizes this tier

    def capacity(self) -> int:
        return 0

    def no_room(self) -> str:
        """Why an activation planned for this tier did not go there, as the OffloadWarning and OffloadError say it:
        the tier is switched off or missing (no capacity at all), or it is full."""
        return f"the {self.name} tier has no room"

    def room_kind(self) -> str:
        """The key its fallbacks are counted under in ``stats()["fallbacks"]``: ``<tier>_off`` or ``<tier>_full``."""
        return f"{self.name}_off" if self.capacity() <= 0 else f"{self.name}_full"

    def spec(self) -> TierSpec:
        return TierSpec(self.name, self.capacity())

    def store(self, cache, entry) -> bool:
        """Start moving `entry.src` out of device memory; False if this tier has no room."""
        raise NotImplementedError

    def copied_out(self, cache, entry) -> None:
        """`entry.host` holds the bytes now (the device copy is released): go on to a further stage, if any."""

    def close(self, abort: bool) -> None:
        """Release what the tier holds (pinned memory, files, threads)."""


class DeviceTier(Tier):
    name = "keep"
    resident = True

    def store(self, cache, entry) -> bool:  # pragma: no cover - the cache never stores a resident tier
        return False


class HostTier(Tier):
    """The pinned host pool (`HostPool`); its rates are the device link's, which the planner has already."""

    name = "host"
    fallback = ("nvme",)
    option = "host_memory"

    def __init__(self, pool):
        self.pool = pool

    def capacity(self) -> int:
        return self.pool.limit

    def no_room(self) -> str:
        if self.capacity() <= 0:
            return "host memory is switched off (host_memory=0)"
        return "the host memory pool is full"

    def store(self, cache, entry) -> bool:
        buf = self.pool.allocate(entry.nbytes)
        if buf is None:
            return False
        cache.copy_out(entry, buf)
        return True

    def close(self, abort: bool) -> None:
        self.pool.close()


class NvmeTier(Tier):
    """Files of the I/O engine in `directories` (created on first use), at most `limit` bytes."""

    name = "nvme"
    fallback = ("host",)
    option = "nvme_memory"

    def __init__(
        self,
        pool,
        directories: list[str],
        limit: int,
        *,
        probe_bytes: int,
        pinned: bool,
        off_reason: str | None = None,
    ):
        self.pool = pool
        self.directories = directories
        self.limit = int(limit)
        # why the tier has no bytes at all, where it has none (None: nvme_memory=0)
        self.off_reason = off_reason
        self.probe_bytes = probe_bytes
        self.pinned = pinned
        self.engine: Engine | None = None
        self.engine_factory = self._make_engine  # tests swap in an engine with injected faults
        self._rates: tuple[float, float] | None = None
        self.final_stats: dict | None = None

    def capacity(self) -> int:
        return self.limit

    def no_room(self) -> str:
        if self.capacity() > 0:
            return "the NVMe tier is full"
        return self.off_reason or "the NVMe tier is switched off (nvme_memory=0)"

    def rates(self) -> tuple[float, float]:
        """(write, read) bytes/s of the slowest directory: measured once per directory, cached on disk. The probe
        takes at most the tier's share of each directory (a small directory or `nvme_memory` is measured with what
        it has: a probe larger than the tier would fail where the tier itself works)."""
        if self._rates is None:
            probe = max(4096, min(self.probe_bytes, self.limit // len(self.directories)))
            measured = [disk_rates(d, probe, pinned=self.pinned) for d in self.directories]
            # Tensors of four blocks or more are striped over all directories: their rates add up.
            self._rates = (sum(w for w, _ in measured), sum(r for _, r in measured))
        return self._rates

    def spec(self) -> TierSpec:
        if self.limit <= 0:
            return TierSpec(self.name, 0)
        try:
            write, read = self.rates()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            # The disk filled up since offload() checked it: train on without the tier, loudly (never a crash
            # after the profiling steps for a tier the plan may not even need).
            self.limit = 0
            self.off_reason = f"the NVMe tier is off: {', '.join(self.directories)} had no room for it"
            warnings.warn(
                f"ssdtrain: no NVMe tier: {', '.join(self.directories)} has no room for it ({e}); planning without "
                "it: free space there, pass directories= with room, or nvme_memory=0 to silence this",
                OffloadWarning,
                stacklevel=2,
            )
            return TierSpec(self.name, 0)
        return TierSpec(self.name, self.limit, write, read)

    def _make_engine(self) -> Engine:
        return Engine(self.directories, capacity_per_directory=max(4096, self.limit // len(self.directories)))

    def get_engine(self) -> Engine | None:
        if self.engine is None and self.limit > 0:
            self.engine = self.engine_factory()
        return self.engine

    def store(self, cache, entry) -> bool:
        engine = self.get_engine()
        if engine is None:
            return False
        buf = self.pool.allocate(entry.nbytes)
        if buf is not None:  # through a host buffer: the device bytes go at link speed, the disk write follows
            cache.copy_out(entry, buf)
            return True
        # No host buffer (the pool is full, or host memory is off): the engine stages the device bytes through its
        # own pinned buffers.
        try:
            write = engine.write(entry.src)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            return False
        cache.writing(entry, write)
        return True

    def copied_out(self, cache, entry) -> None:
        engine = self.get_engine()
        try:
            write = engine.write(entry.host[: entry.nbytes])
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            if cache.on_full == "raise":
                raise OffloadError(
                    f"ssdtrain: {self.no_room()} ({', '.join(self.directories)}: {e.strerror}): pass nvme_memory= "
                    "larger or directories= with more room, free space there, or on_full='fallback'"
                ) from e
            # No room on disk: the bytes stay in the host buffer they are in.
            entry.tier = cache.tiers["host"]
            cache.fell_back(self, entry.tier, "nvme_full")  # (the disk is full, whatever the limit says)
            return
        cache.writing(entry, write)

    def stats(self) -> dict | None:
        if self.engine is None:
            return self.final_stats
        s = self.engine.stats()
        keys = ("bytes_written", "bytes_read", "write_bandwidth_gbps", "read_bandwidth_gbps", "errors", "live_handles")
        return {k: s[k] for k in keys if k in s}

    def close(self, abort: bool) -> None:
        if self.engine is not None:
            self.final_stats = self.stats()
            self.engine.close()
            self.engine = None


TIERS: dict[str, type[Tier]] = {"keep": DeviceTier, "host": HostTier, "nvme": NvmeTier}
TIER_NAMES = tuple(TIERS)


# --------------------------------------------------------------------------------------------------- directories
def default_directories() -> list[str]:
    """``SSDTRAIN_IO_DIRS`` / ``configure(directories=)``, else the system temp folder."""
    return list(io_settings.directories)


def check_directories(directories: list[str]) -> None:
    """Raise an OSError naming the fix for a directory that is missing, not a directory, or not writable."""
    for d in directories:
        if not os.path.exists(d):
            raise FileNotFoundError(
                errno.ENOENT,
                f"ssdtrain: the NVMe directory {d!r} does not exist: create it, pass directories= with an existing "
                "one, or nvme_memory=0 to train without the NVMe tier",
                d,
            )
        if not os.path.isdir(d):
            raise NotADirectoryError(
                errno.ENOTDIR, f"ssdtrain: the NVMe directory {d!r} is not a directory: pass a directory", d
            )
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(
                errno.EACCES,
                f"ssdtrain: the NVMe directory {d!r} is not writable by this process: fix its permissions, pass "
                "directories= with a writable one, or nvme_memory=0 to train without the NVMe tier",
                d,
            )


def free_space(directories: list[str]) -> int:
    return sum(shutil.disk_usage(d).free for d in directories)


# --------------------------------------------------------------------------------------------------- disk rates
def cache_dir() -> str:
    return str(cache_home() / "ssdtrain")


def _rates_file() -> str:
    return os.path.join(cache_dir(), "disk-rates.json")


def _disk_key(directory: str) -> str:
    real = os.path.realpath(directory)
    return f"{real}@{os.stat(real).st_dev}"


def _load_rates() -> dict:
    try:
        with open(_rates_file()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def disk_rates(directory: str, nbytes: int = 64 * _MIB, *, pinned: bool = False) -> tuple[float, float]:
    """(write, read) bytes/s of `directory`'s disk through the I/O engine (O_DIRECT where the file system allows),
    measured with `nbytes` the first time and cached per directory and device under ``cache_dir()``."""
    key = _disk_key(directory)
    known = _load_rates().get(key)
    nbytes = max(4096, nbytes // 4096 * 4096)
    # A rate measured with fewer bytes (a small tier's probe) does not stand for a larger probe's.
    if known and known.get("write", 0) > 0 and known.get("read", 0) > 0 and known.get("bytes", nbytes) >= nbytes:
        return float(known["write"]), float(known["read"])
    buf = huge_empty((nbytes,), torch.uint8, pin_memory=pinned)
    buf.fill_(0x5A)
    with Engine([directory], capacity_per_directory=nbytes) as engine:
        engine.free(engine.write(buf).result())  # the first write grows the file: not timed; the next reuses it
        t0 = time.perf_counter()
        handle = engine.write(buf).result()
        t1 = time.perf_counter()
        engine.read(handle, out=buf).result()
        t2 = time.perf_counter()
        direct = all(d.get("direct", False) for d in engine.directories())
    write, read = nbytes / max(t1 - t0, 1e-6), nbytes / max(t2 - t1, 1e-6)
    log.info(
        "ssdtrain: disk of %s: write %.2f GB/s, read %.2f GB/s (%d MiB%s)",
        directory,
        write / 1e9,
        read / 1e9,
        nbytes // _MIB,
        "" if direct else ", buffered: the file system refused O_DIRECT",
    )
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        data = _load_rates()
        data[key] = {"write": write, "read": read, "bytes": nbytes, "direct": direct, "time": time.time()}
        tmp = f"{_rates_file()}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, _rates_file())
    except OSError as e:  # a read-only home: measured again next time, which costs a fraction of a second
        log.warning("ssdtrain: cannot cache the disk rates in %s (%s)", cache_dir(), e)
    return write, read
