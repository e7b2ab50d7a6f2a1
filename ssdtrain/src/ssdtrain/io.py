"""Asynchronous tensor I/O to per-process files on NVMe: the engine the activation offload layer is built on.

    from ssdtrain.io import Engine

    with Engine(["/nvme0/tmp", "/nvme1/tmp"], capacity_per_directory="64G") as engine:
        fut = engine.write(tensor)              # returns at once; fut.handle names the stored bytes
        fut.wait()                              # or fut.done() to poll; fut.result() raises on failure
        back = engine.read(fut.handle).result() # a new tensor like the original (or read(handle, out=t))
        engine.free(fut.handle)

Writes and reads are futures (``Future``): ``done()`` polls, ``wait(timeout)`` blocks, ``result()`` blocks and
re-raises the failure (``OSError`` with errno: ENOSPC, EIO, ...; ``ChecksumError`` when stored data was corrupted),
``staged()`` says when a write no longer reads its source (for CUDA tensors: once the device-to-host copies are done,
so GPU memory can be reused before the disk write finishes), ``wait_stream(stream)`` orders a CUDA stream after the
transfer (a host wait; the engine's device copies are then complete). CUDA work is ordered against the caller's
stream or an event: a write starts after the work already queued on the current stream (which produces the tensor) or
after ``after=event``; a read into a CUDA tensor starts after the work queued on it. Completion is reported to the
host (``done``/``wait``); the engine's own device copies are finished by then, so any stream may use the data once the
future is done.

Tensors are kept alive by the engine until their transfer completes, so dropping the last reference to a tensor
while its write is in flight is safe.

Settings: each argument of ``Engine()`` left out comes from ``settings`` (the ``SSDTRAIN_IO_*`` environment
variables, read when ssdtrain is imported, overridden by ``configure()``); the README's "Settings" table lists them.
``CUFILE_ENV_PATH_JSON`` is cuFile's own variable: its config file (unset: ssdtrain writes one allowing
compatibility mode, see ``cufile_config()``).
"""

from __future__ import annotations

import errno as _errno
import glob
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _core
from .buffers import _huge_ranges, _is_huge, aligned_empty, huge_empty  # noqa: F401 - _huge_ranges: tests
from .config import _SETTING_TABLE, configure, defaults, parse_size, settings  # noqa: F401 - re-exported

__all__ = [
    "ChecksumError",
    "Engine",
    "Future",
    "Handle",
    "aligned_empty",
    "configure",
    "cufile_config",
    "defaults",
    "find_cufile",
    "huge_empty",
]


class ChecksumError(OSError):
    """Data read back does not match the checksum taken when it was written (errno EBADMSG)."""


def find_cufile() -> str:
    """Path of libcufile from the nvidia-cufile wheel, if installed; "" otherwise (the loader then searches)."""
    for base in sys.path:
        hits = glob.glob(os.path.join(base, "nvidia", "cu*", "lib", "libcufile.so*")) + glob.glob(
            os.path.join(base, "nvidia", "cufile", "lib", "libcufile.so*")
        )
        if hits:
            return sorted(hits)[0]
    return ""


def cufile_config() -> str:
    """The cufile.json cuFile reads (set CUFILE_ENV_PATH_JSON before the first gds engine or backends() call).

    Where CUFILE_ENV_PATH_JSON is unset, ssdtrain writes its own (in the temp directory, per user) that allows
    cuFile's compatibility mode (POSIX I/O inside cuFile where nvidia-fs is absent) and keeps cuFile's log out of
    the working directory, and points CUFILE_ENV_PATH_JSON at it. cuFile reads it once per process. Returns ""
    where it cannot be written (cuFile then uses its own defaults).
    """
    path = os.environ.get("CUFILE_ENV_PATH_JSON", "")
    if path:
        return path
    tmp = tempfile.gettempdir()
    path = os.path.join(tmp, f"ssdtrain-cufile-{os.getuid()}.json")
    text = json.dumps({"logging": {"dir": tmp, "level": "ERROR"}, "properties": {"allow_compat_mode": True}}, indent=1)
    try:
        with open(path) as f:
            current = f.read()
    except OSError:
        current = None
    if current != text:
        scratch = f"{path}.{os.getpid()}.{threading.get_ident()}"
        try:  # a fresh file (never through a planted link), then renamed over the old one
            fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(scratch, path)
        except OSError:
            return ""  # cuFile then uses its own defaults (/etc/cufile.json or built-in)
    os.environ["CUFILE_ENV_PATH_JSON"] = path
    return path


@dataclass
class _Unraisable:
    """What sys.unraisablehook expects (the fields of sys.UnraisableHookArgs)."""

    exc_value: BaseException
    err_msg: str
    object: object
    exc_type: type = field(init=False)
    exc_traceback: object = field(init=False)

    def __post_init__(self):
        self.exc_type = type(self.exc_value)
        self.exc_traceback = self.exc_value.__traceback__


@dataclass(frozen=True)
class Handle:
    """Names bytes stored by an Engine, with what is needed to rebuild the tensor."""

    id: int
    nbytes: int
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    pinned: bool = False
    _engine_id: int = field(default=0, repr=False, compare=False)


class _Notifier:
    """Runs add_done_callback() callbacks: one daemon thread per process, started on first use.

    It waits on the oldest pending transfer in short slices and then fires every callback whose transfer is done,
    so a callback runs within a few milliseconds of completion and no engine thread ever runs Python code."""

    _instance: _Notifier | None = None
    _lock = threading.Lock()

    def __init__(self):
        self._pending: list[tuple[Future, object]] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="ssdtrain-callbacks", daemon=True).start()

    @classmethod
    def get(cls) -> _Notifier:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def add(self, future: Future, fn) -> None:
        with self._cv:
            self._pending.append((future, fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    self._cv.wait()
                oldest = self._pending[0][0]
            oldest._op.wait(0.005)
            with self._cv:
                # done() read once per entry: a transfer finishing between two reads would be in neither list
                # and its callback never called
                ready, waiting = [], []
                for entry in self._pending:
                    (ready if entry[0].done() else waiting).append(entry)
                self._pending = waiting
            for f, fn in ready:
                # Any exception, SystemExit included: one escaping here would end this thread, and every later
                # callback of the process would silently never be called.
                f._call(fn, catch=BaseException)


class Future:
    """An asynchronous write or read. Thread-safe to poll and wait from any thread."""

    def __init__(self, op: Any, keep: object, value: object) -> None:
        self._op = op
        self._keep = keep  # the tensor(s) the transfer reads or fills: alive until it completes
        self._value = value

    def add_done_callback(self, fn: Callable[[Future], object]) -> None:
        """Call ``fn(future)`` once the transfer is done (successfully or not; use ``fn``'s ``exception()``).

        Runs at once in this thread when already done, else on ssdtrain's callback thread shortly after completion
        (never on an engine thread, so a slow callback cannot stall I/O). An exception raised by ``fn`` goes to
        ``sys.unraisablehook`` (printed by default), as it has no caller to reach.
        """
        if not callable(fn):
            raise TypeError(f"add_done_callback needs a callable, got {type(fn).__name__}")
        if self.done():
            self._call(fn)
        else:
            _Notifier.get().add(self, fn)

    def _call(self, fn, catch: type[BaseException] = Exception) -> None:
        try:
            fn(self)
        except catch as e:  # noqa: BLE001 - reported through the interpreter's hook for such errors
            sys.unraisablehook(_Unraisable(e, f"ssdtrain: exception in the done callback {fn!r}", fn))

    def done(self) -> bool:
        """True when the transfer finished (successfully or not); never blocks."""
        return self._op.done()

    def staged(self) -> bool:
        """For a write: the source tensor is no longer read (it may be reused or freed). True once done()."""
        return self._op.staged()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or `timeout` seconds pass; returns done(). Does not raise the transfer's error."""
        if timeout is None:
            # Short slices, so Ctrl-C reaches Python while waiting (each slice returns as soon as the op is done).
            done = self._op.wait(0.25)
            while not done:
                done = self._op.wait(0.25)
        else:
            done = self._op.wait(max(0.0, float(timeout)))
        if done:
            self._keep = None
        return done

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The failure (None on success); raises TimeoutError if not done within `timeout`."""
        if not self.wait(timeout):
            raise TimeoutError(f"transfer not finished after {timeout} s")
        try:
            self._op.get()
        except OSError as e:
            return _checksum_error(e)
        except Exception as e:  # noqa: BLE001 - returned, not swallowed
            return e
        return None

    def result(self, timeout: float | None = None) -> object:
        """Wait, then return the Handle (write) or the destination tensor (read); raise the failure if any."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._value

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make work queued on `stream` (any stream) after this call see the transfer's data; raise its failure.

        The wait is on the host: the engine's own device copies are complete when the transfer is, so once this
        returns every stream may use the data. There is no device-side (non-blocking) wait: both designs tried, a
        ``cuStreamWaitValue32`` on a flag and a host function blocking the caller's stream, hung on an H200
        (benchmarks/RESULTS.md), because the engine's CUDA calls can wait for that stream.
        """
        del stream  # any stream: see above
        self.result()

    @property
    def nbytes(self) -> int:
        return self._op.bytes

    @property
    def seconds(self) -> float:
        """Submission to completion, 0.0 while running."""
        return self._op.seconds


class WriteFuture(Future):
    @property
    def handle(self) -> Handle:
        """The handle is valid at once: reads issued before the write finishes are ordered after it."""
        return self._value


def _checksum_error(e: OSError) -> OSError:
    if e.errno == _errno.EBADMSG:
        return ChecksumError(e.errno, e.strerror)
    return e


_side_streams: dict[int, torch.cuda.Stream] = {}


def _stream_address(device: torch.device, stream, after) -> int:
    """The CUDA stream the engine orders its copies after: `stream` (default: current), or a side stream waiting
    for the event `after`."""
    if device.type != "cuda":
        if after is not None:
            after.synchronize()  # host memory filled by an async device copy: wait for it here
        return 0
    if after is not None:
        if stream is not None:
            raise ValueError("pass stream= or after=, not both")
        index = device.index if device.index is not None else torch.cuda.current_device()
        side = _side_streams.get(index)
        if side is None:
            side = _side_streams[index] = torch.cuda.Stream(device=index)
        side.wait_event(after)
        stream = side
    stream = stream if stream is not None else torch.cuda.current_stream(device)
    return int(stream.cuda_stream)


_engine_ids = iter(range(1, 1 << 62))


class Engine:
    """Per-process files in one or more directories, and asynchronous tensor writes and reads to them.

    Arguments default to configure()/SSDTRAIN_IO_* settings (see the module docstring). ``backend_name`` and
    ``backend_detail`` say what was chosen (e.g. whether io_uring buffers are registered, cuFile compat mode).
    """

    def __init__(
        self,
        directories: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        *,
        capacity_per_directory: int | str | None = None,
        preallocate_per_directory: int | str | None = None,
        backend: str | None = None,
        queue_depth: int | None = None,
        block_size: int | str | None = None,
        direct: bool | str | None = None,
        checksum: bool | None = None,
        staging_buffers: int | None = None,
        stage_host: bool | str | None = None,
        threads: int | None = None,
        cufile_library: str | None = None,
        stripe_threshold: int | str | None = None,
        _fault: tuple[str, int, int] | None = None,
    ) -> None:
        given = {
            "directories": directories,
            "capacity_per_directory": capacity_per_directory,
            "preallocate_per_directory": preallocate_per_directory,
            "backend": backend,
            "queue_depth": queue_depth,
            "block_size": block_size,
            "direct": direct,
            "checksum": checksum,
            "staging_buffers": staging_buffers,
            "stage_host": stage_host,
            "threads": threads,
            "cufile_library": cufile_library,
        }
        values = defaults()
        for name, value in given.items():
            if value is not None:
                values[name] = _SETTING_TABLE[name].parse_value(value, source=name)
        block = values["block_size"]
        if block < 4096 or block % 4096:
            raise ValueError(f"block_size must be a positive multiple of 4096, got {block}")
        for d in values["directories"]:
            if not os.path.isdir(d):
                reason = "does not exist" if not os.path.exists(d) else "is not a directory"
                code = _errno.ENOENT if not os.path.exists(d) else _errno.ENOTDIR
                raise OSError(code, f"ssdtrain: I/O directory {d!r} {reason}: create it or pass another one", d)
        cap = values["capacity_per_directory"]
        if cap == 0:
            # 90% of the smallest free space, so the engine cannot fill a disk shared with checkpoints and logs.
            cap = min(shutil.disk_usage(d).free for d in values["directories"]) * 9 // 10
            cap = max(cap // 4096 * 4096, 4096)
        cfg = _core.EngineConfig()
        cfg.directories = values["directories"]
        cfg.capacity_per_directory = cap
        cfg.preallocate_per_directory = values["preallocate_per_directory"]
        cfg.backend = values["backend"]
        cfg.queue_depth = values["queue_depth"]
        cfg.block_size = block
        cfg.direct = values["direct"]
        cfg.checksum = values["checksum"]
        cfg.staging_buffers = values["staging_buffers"]
        cfg.stage_host = values["stage_host"] == "on"
        cfg.threads = values["threads"]
        cfg.cufile_library = values["cufile_library"] or find_cufile()
        if values["backend"] in ("gds", "auto"):
            cufile_config()  # before cuFile is first loaded: it reads its config once
        if stripe_threshold is not None:
            cfg.stripe_threshold = parse_size(stripe_threshold)
        if _fault is not None:
            op, code, after = _fault
            fault = _core.FaultSpec()
            fault.op, fault.error, fault.after_bytes = op, int(code), int(after)
            cfg.fault = fault
        self.settings = dict(values, capacity_per_directory=cap)
        self._engine = _core.Engine(cfg)
        self._id = next(_engine_ids)
        self._inflight: list[Future] = []
        self._lock = threading.Lock()

    # -------------------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Wait for every transfer, then release the files (their space returns to the file system at once)."""
        engine = self.__dict__.pop("_engine", None)
        if engine is not None:
            engine.drain()
            self._inflight.clear()
            del engine

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran (or the engine was garbage-collected)."""
        return "_engine" not in self.__dict__

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _core(self):
        engine = self.__dict__.get("_engine")
        if engine is None:
            raise RuntimeError("this ssdtrain Engine is closed; create a new one")
        return engine

    def _track(self, future: Future) -> None:
        with self._lock:
            self._inflight = [f for f in self._inflight if not f.done()]
            self._inflight.append(future)

    # -------------------------------------------------------------------------------------------- transfers
    def write(
        self, tensor: torch.Tensor, *, stream: torch.cuda.Stream | None = None, after: torch.cuda.Event | None = None
    ) -> WriteFuture:
        """Start writing a contiguous CPU or CUDA tensor; the returned future's ``handle`` is usable at once.

        For CUDA tensors the copy starts after the work queued so far on `stream` (default: the current stream), or
        after the CUDA event `after` (recorded where the tensor is produced; for a CPU tensor filled by an async
        device copy, the event is waited for on the host before submitting). Running out of space raises
        ``OSError(ENOSPC)`` here, before anything is written.
        """
        engine = self._core()
        tensor = _check_tensor(tensor, "write")
        nbytes = tensor.numel() * tensor.element_size()
        device = tensor.device
        pinned = device.type == "cpu" and tensor.is_pinned()
        address = _stream_address(device, stream, after)
        hid, op = engine.write(tensor.data_ptr(), nbytes, _device_index(device), address, self._stage(tensor, nbytes))
        handle = Handle(hid, nbytes, tuple(tensor.shape), tensor.dtype, device, pinned, self._id)
        future = WriteFuture(op, tensor, handle)
        self._track(future)
        return future

    def read(
        self,
        handle: Handle,
        out: torch.Tensor | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
        after: torch.cuda.Event | None = None,
    ) -> Future:
        """Start reading `handle` into `out` (default: a new tensor like the one written, on the same device).

        `out` must be contiguous with exactly the handle's byte size (any dtype/shape). The read is ordered after
        the handle's write, and for a CUDA `out` after the work queued on `stream` (default: current) or after the
        event `after`, so it never overwrites data still being read there. Reading a freed or foreign handle
        raises ValueError.
        """
        engine = self._core()
        if not isinstance(handle, Handle):
            raise TypeError(f"read() needs a Handle from this engine's write(), got {type(handle).__name__}")
        if handle._engine_id != self._id:
            raise ValueError(f"handle {handle.id} was written by another Engine; read it there")
        if out is None:
            if handle.device.type == "cpu":
                out = (
                    torch.empty(handle.shape, dtype=handle.dtype, pin_memory=True)
                    if handle.pinned
                    else aligned_empty(handle.shape, handle.dtype)
                )
            else:
                out = torch.empty(handle.shape, dtype=handle.dtype, device=handle.device)
        out = _check_tensor(out, "read into", writable=True)
        nbytes = out.numel() * out.element_size()
        if nbytes != handle.nbytes:
            raise ValueError(
                f"out has {nbytes} bytes but handle {handle.id} holds {handle.nbytes}: pass a tensor "
                f"of shape {handle.shape} and dtype {handle.dtype} (or any of the same byte size)"
            )
        device = out.device
        address = _stream_address(device, stream, after)
        op = engine.read(handle.id, out.data_ptr(), nbytes, _device_index(device), address, self._stage(out, nbytes))
        future = Future(op, out, out)
        self._track(future)
        return future

    def _stage(self, tensor: torch.Tensor, nbytes: int) -> int:
        """1: copy this host tensor through the staging buffers; 0: move it from its own pages."""
        mode = self.settings["stage_host"]
        if tensor.device.type != "cpu" or mode == "off":
            return 0
        return 0 if mode == "auto" and _is_huge(tensor.data_ptr(), nbytes) else 1

    def free(self, handle: Handle) -> None:
        """Give the handle's space back. Transfers still using it finish first; later reads raise ValueError."""
        engine = self._core()
        if not isinstance(handle, Handle) or handle._engine_id != self._id:
            raise ValueError(f"{handle!r} is not a handle of this engine")
        engine.free(handle.id)

    def drain(self) -> None:
        """Block until every transfer in flight has finished."""
        self._core().drain()
        with self._lock:
            self._inflight = [f for f in self._inflight if not f.done()]

    # -------------------------------------------------------------------------------------------- facts
    @property
    def backend_name(self) -> str:
        return self._core().backend()

    @property
    def backend_detail(self) -> str:
        return self._core().backend_detail()

    def directories(self) -> list[dict]:
        """Per directory: path, tmpfile (O_TMPFILE used), direct (O_DIRECT), file_bytes, bytes_in_use, capacity."""
        return self._core().directories()

    def stats(self) -> dict:
        """Telemetry: bytes/ops/blocks per direction, achieved bandwidth (GB/s over the time transfers of that
        direction were in flight), queue depth in use and its peak (requests inside the ring / being moved by
        workers; ``inflight_blocks`` also counts requests still queued for it), time callers waited, total bytes
        the device was asked to write (SSD endurance), errors and checksum failures, space in use."""
        s = self._core().stats()
        for kind in ("write", "read"):
            active = s[f"{kind}_active_ns"]
            moved = s["bytes_written" if kind == "write" else "bytes_read"]
            s[f"{kind}_bandwidth_gbps"] = moved / active if active else 0.0
        s["wait_seconds"] = s["wait_ns"] / 1e9
        s["live_handles"] = self._core().live_handles()
        return s

    def _corrupt_for_test(self, handle: Handle, offset: int = 0, nbytes: int = 1) -> None:
        """Flip stored bytes behind the engine's back (tests of checksum verification)."""
        self._core().corrupt_for_test(handle.id, offset, nbytes)


def _device_index(device: torch.device) -> int:
    if device.type == "cpu":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def _check_tensor(tensor, action: str, writable: bool = False) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"cannot {action} a {type(tensor).__name__}: pass a torch.Tensor")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot {action} a tensor on {tensor.device}: only CPU and CUDA tensors are supported")
    if not tensor.is_contiguous():
        raise ValueError(f"cannot {action} a non-contiguous tensor: call .contiguous() first")
    if tensor.numel() == 0:
        raise ValueError(f"cannot {action} an empty tensor")
    if writable and tensor.requires_grad and tensor.is_leaf:
        raise ValueError("cannot read into a leaf tensor that requires grad: pass a tensor without requires_grad")
    return tensor
