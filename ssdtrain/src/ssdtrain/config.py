"""The I/O engine's settings: one table of ``SSDTRAIN_IO_*`` environment variables (read when ssdtrain is imported),
``configure()`` to override them for the process and ``defaults()`` for what a new ``Engine()`` would use. The
README's "Settings" table is generated from this table (a test keeps them in step)."""

from __future__ import annotations

import os
import tempfile

from ._shared_cuda import (
    Setting,
    Settings,
    choice,
    integer,
    parse_bool,
    parse_size,
    parse_text,
    parse_tristate,
)

__all__ = ["configure", "defaults", "parse_size", "settings"]

_BACKENDS = ("auto", "io_uring", "gds", "threads")


def _directories(value) -> list[str]:
    """Folders from a list, one path, or text separated by ``os.pathsep``; none: the system's temp folder."""
    if isinstance(value, str):
        value = [p for p in value.split(os.pathsep) if p]
    elif isinstance(value, os.PathLike):
        value = [value]
    return [os.fspath(d) for d in value] or [tempfile.gettempdir()]


_SETTING_TABLE = {
    "backend": Setting(
        "SSDTRAIN_IO_BACKEND",
        "auto",
        choice(*_BACKENDS),
        "`auto`: gds where GPUDirect Storage is really present (nvidia-fs loaded), else io_uring if the kernel "
        "allows rings, else threads",
        "ssdtrain.configure(backend=)",
    ),
    "directories": Setting(
        "SSDTRAIN_IO_DIRS",
        lambda: [tempfile.gettempdir()],
        _directories,
        "folders for the per-process files, separated by `:`",
        "ssdtrain.configure(directories=)",
        "the system temp folder",
    ),
    "capacity_per_directory": Setting(
        "SSDTRAIN_IO_DIR_CAP",
        0,
        parse_size,
        "hard cap per folder in bytes (suffixes K, M, G, T); 0: 90% of the free space when the engine starts",
        "ssdtrain.configure(capacity_per_directory=)",
    ),
    "preallocate_per_directory": Setting(
        "SSDTRAIN_IO_PREALLOCATE",
        0,
        parse_size,
        "bytes reserved per folder at start (fallocate); files also grow in 256 MiB steps up to the cap",
        "ssdtrain.configure(preallocate_per_directory=)",
    ),
    "queue_depth": Setting(
        "SSDTRAIN_IO_QUEUE_DEPTH",
        32,
        integer(1),
        "I/O requests in flight (io_uring ring entries)",
        "ssdtrain.configure(queue_depth=)",
    ),
    "block_size": Setting(
        "SSDTRAIN_IO_BLOCK_SIZE",
        1 << 20,
        parse_size,
        "bytes per request; a multiple of 4096",
        "ssdtrain.configure(block_size=)",
        "`1M`",
    ),
    "direct": Setting(
        "SSDTRAIN_IO_DIRECT",
        "auto",
        parse_tristate,
        "O_DIRECT: `auto` uses it where the file system allows, `on` fails where it does not, `off`",
        "ssdtrain.configure(direct=)",
    ),
    "checksum": Setting(
        "SSDTRAIN_IO_CHECKSUM",
        False,
        parse_bool,
        "crc32c per block, verified on every read",
        "ssdtrain.configure(checksum=)",
        "`0`",
    ),
    "staging_buffers": Setting(
        "SSDTRAIN_IO_STAGING_BUFFERS",
        48,
        integer(1),
        "pinned staging buffers of one block each (CUDA tensors and unaligned host tensors pass through them); "
        "more than the queue depth, so the disk keeps a full queue while some buffers are in device copies",
        "ssdtrain.configure(staging_buffers=)",
    ),
    "stage_host": Setting(
        "SSDTRAIN_IO_STAGE_HOST",
        "auto",
        parse_tristate,
        "host tensors copied through the staging buffers (huge pages, registered with the ring) instead of moved "
        "from their own pages: a 1 MiB block of scattered 4 KiB pages is 256 segments, more than many devices take "
        "in one request (virtio-blk: 254), so the kernel splits it and bandwidth drops by up to half. `auto`: "
        "staged unless the tensor comes from `huge_empty()`. O_DIRECT files only",
        "ssdtrain.configure(stage_host=)",
    ),
    "threads": Setting(
        "SSDTRAIN_IO_THREADS",
        4,
        integer(1),
        "driver threads (and pread/pwrite or cuFile workers)",
        "ssdtrain.configure(threads=)",
    ),
    "cufile_library": Setting(
        "SSDTRAIN_CUFILE_LIBRARY",
        "",
        parse_text,
        "path of `libcufile.so.0` for the gds backend; unset: the system's, then the nvidia-cufile wheel's",
        "ssdtrain.configure(cufile_library=)",
        "unset",
    ),
}
settings = Settings(_SETTING_TABLE)


def configure(**values: object) -> None:
    """Set process-wide defaults for new engines (the setters mirroring the ``SSDTRAIN_IO_*`` variables).

    Keys: backend, directories, capacity_per_directory, preallocate_per_directory, queue_depth, block_size, direct,
    checksum, staging_buffers, stage_host, threads, cufile_library. ``None`` restores the environment/default value.
    Values are validated now, not at the next ``Engine()``.
    """
    for name, value in values.items():
        try:
            settings.set(name, value)
        except TypeError:
            raise TypeError(
                f"configure() got an unknown setting {name!r}; known: {', '.join(dict(settings))}"
            ) from None


def defaults() -> dict:
    """The settings a new Engine() would use: configure() overrides, then environment variables, then defaults."""
    return settings.as_dict()
