"""Run-time settings, from one table (``settings``).

Each setting has a ``HECTOR_*`` environment variable, read once when hector is imported (``settings.reload()``
reads them again), and a Python setter below that overrides it for the process (``None`` goes back to the
variable). An invalid value raises ``ValueError`` naming the variable and the valid values. The README's "Settings"
table lists them (a test keeps it in step with this table).
"""

from __future__ import annotations

import os

from ._shared_cuda import Setting, Settings, choice, integer, parse_bool, parse_text, parse_tristate

BACKENDS = ("auto", "reference", "cuda")

settings = Settings({
    "debug": Setting(
        "HECTOR_DEBUG", False, parse_bool, "run the IR verifier after every pass stage",
        "hector.config.set_debug", "`0`"),
    "tile_bytes": Setting(
        "HECTOR_REFERENCE_TILE_BYTES", 0, integer(1),
        "bytes per edge temporary when the reference backend runs an edge-parallel kernel tile by tile",
        "hector.config.set_tile_bytes", "1 MiB on CPU, 64 MiB on GPU"),
    "backend": Setting(
        "HECTOR_BACKEND", "auto", choice(*BACKENDS),
        "`auto`: generated CUDA kernels for tensors on a CUDA GPU (the reference backend, with a warning, where "
        "they cannot run: no NVRTC, an unsupported dtype or GPU); `reference`: torch ops always; `cuda`: generated "
        "kernels always (an error where they cannot run)", "hector.config.set_backend"),
    "dump_dir": Setting(
        "HECTOR_DUMP_DIR", "", parse_text, "write every generated CUDA module there as `<program>_<hash>.cu`",
        "hector.config.set_dump_dir", "unset (off)"),
    "tf32": Setting(
        "HECTOR_TF32", "auto", parse_tristate,
        "float32 GEMMs on tensor cores in TF32: `auto` follows PyTorch "
        "(`torch.backends.cuda.matmul.allow_tf32`), `on` always, `off` never (exact float32)",
        "hector.config.set_tf32"),
    "sorted_scatter": Setting(
        "HECTOR_SORTED_SCATTER", "off", parse_tristate,
        "sums into rows by source or (source, relation) pair: `off` atomic adds; `on` target-centric walks over a "
        "sorted layout (registers, each row written once); `auto` lets the cost model pick per graph. Off by "
        "default: on an H100 the sorted walks ran training steps at 0.48-0.94x the atomic plans' speed (am, "
        "fb15k), where the cost model predicted them faster. Applies to layers with "
        "`optimize=\"auto\"`/`\"memory\"`",
        "hector.config.set_sorted_scatter"),
    "split_degree": Setting(
        "HECTOR_SPLIT_DEGREE", 32, integer(0),
        "destination walks: a destination with more in-edges than this is walked by all the groups of a block at "
        "once, which combine their sums and softmax statistics in shared memory, so a few hub destinations do not "
        "bound the kernel; `0` walks every destination with one group",
        "hector.config.set_split_degree"),
    "launch_batches": Setting(
        "HECTOR_LAUNCH_BATCHES", True, parse_bool,
        "the CUDA backend runs a layer call whose temporaries take at most 32 MiB (small graphs, mini-batches), or "
        "whose buffers take at most `HECTOR_BATCH_EXTRA_MB` more than kernel by kernel at its peak (larger "
        "mini-batches), as batches of launches packed once per graph (one allocation for the temporaries, one "
        "shared-cuda call per batch, the call's buffer addresses patched in); `0` launches kernel by kernel from "
        "Python, each buffer allocated and released on its own (the path of larger calls)",
        "hector.config.set_launch_batches", "`1`"),
    "batch_extra_mb": Setting(
        "HECTOR_BATCH_EXTRA_MB", 128, integer(0),
        "MiB a batched call (see `HECTOR_LAUNCH_BATCHES`) whose temporaries take more than 32 MiB may hold at once "
        "beyond what kernel by kernel holds at its peak: its temporaries live until its end, where kernel by "
        "kernel releases each after its last reader, for a fraction of the host time (a mini-batch of 100K "
        "edges); `0` keeps such calls kernel by kernel",
        "hector.config.set_batch_extra_mb"),
})

_DEFAULT_TILE_BYTES = {"cuda": 64 << 20, "cpu": 1 << 20}


def debug() -> bool:
    return settings.debug


def set_debug(on: bool | None) -> None:
    """Force the verifier on/off between pass stages (None: follow HECTOR_DEBUG)."""
    settings.set("debug", on)


def tile_bytes(device_type: str = "cpu") -> int:
    """Bytes per edge temporary in tiled reference execution on this device type."""
    return settings.tile_bytes or _DEFAULT_TILE_BYTES.get(device_type, 1 << 20)


def set_tile_bytes(nbytes: int | None) -> None:
    """Bytes per edge temporary in tiled reference execution (None: follow HECTOR_REFERENCE_TILE_BYTES)."""
    settings.set("tile_bytes", nbytes)


def backend() -> str:
    """The backend setting: "auto", "reference" or "cuda"."""
    return settings.backend


def set_backend(name: str | None) -> None:
    """Choose the backend ("auto", "reference", "cuda"; None: follow HECTOR_BACKEND)."""
    settings.set("backend", name)


def dump_dir() -> str:
    """Folder the generated CUDA sources are written to ("" when off)."""
    return settings.dump_dir


def set_dump_dir(path: str | os.PathLike | None) -> None:
    """Write generated CUDA modules into ``path`` (None: follow HECTOR_DUMP_DIR)."""
    settings.set("dump_dir", path)


def tf32() -> bool:
    """Whether float32 GEMMs may run in TF32 on tensor cores."""
    mode = settings.tf32
    if mode != "auto":
        return mode == "on"
    import torch

    # torch's own getter: the attribute goes through a Python __getattr__ ten times slower, and every layer call
    # reads this setting (a part of the key of the kernels it runs)
    getter = getattr(torch._C, "_get_cublas_allow_tf32", None)
    return bool(getter() if getter is not None else torch.backends.cuda.matmul.allow_tf32)


def set_tf32(mode: bool | str | None) -> None:
    """True/False force TF32 on/off for float32 GEMMs; "auto" follows PyTorch; None follows HECTOR_TF32."""
    settings.set("tf32", mode)


def sorted_scatter() -> str:
    """The sorted-scatter setting: "auto", "on" or "off"."""
    return settings.sorted_scatter


def set_sorted_scatter(mode: bool | str | None) -> None:
    """True/False force sorted (atomic-free) sums by source and pair on/off; "auto" lets the cost model choose per
    graph; None follows HECTOR_SORTED_SCATTER."""
    settings.set("sorted_scatter", mode)


def split_degree() -> int:
    """In-degree above which a destination walk splits a destination over all the groups of a block (0: never)."""
    return settings.split_degree


def set_split_degree(degree: int | None) -> None:
    """Split destinations with more in-edges than ``degree`` over a block's groups (0: never; None: follow
    HECTOR_SPLIT_DEGREE)."""
    settings.set("split_degree", degree)


def launch_batches() -> bool:
    """Whether the CUDA backend runs small calls as batches of launches packed once (see the setting)."""
    return settings.launch_batches


def set_launch_batches(on: bool | None) -> None:
    """True/False: small calls as batches of launches packed once, or kernel by kernel (None: follow
    HECTOR_LAUNCH_BATCHES)."""
    settings.set("launch_batches", on)


def batch_extra_mb() -> int:
    """MiB a batched call past 32 MiB of temporaries may hold beyond the kernel-by-kernel path (see the setting)."""
    return settings.batch_extra_mb


def set_batch_extra_mb(mb: int | None) -> None:
    """MiB a batched call past 32 MiB of temporaries may hold beyond the kernel-by-kernel path's peak (None: follow
    HECTOR_BATCH_EXTRA_MB)."""
    settings.set("batch_extra_mb", mb)
