"""Settings read from ``HECTOR_*`` environment variables, each mirrored by a Python setter (the setter wins).

* ``HECTOR_DEBUG`` (default off): run the IR verifier after every pass stage.
* ``HECTOR_REFERENCE_TILE_BYTES`` (default 1 MiB on CPU, 64 MiB on GPU): bytes per edge temporary when the
  reference backend runs an edge-parallel kernel tile by tile.
* ``HECTOR_BACKEND`` (default ``auto``): ``auto`` runs generated CUDA kernels for tensors on a CUDA GPU (falling
  back to the reference backend, with a warning, where it cannot: no NVRTC, an unsupported dtype or GPU),
  ``reference`` always uses torch ops, ``cuda`` always uses generated kernels (an error where it cannot).
* ``HECTOR_DUMP_DIR`` (default unset): write every generated CUDA module there as ``<program>_<hash>.cu``.
* ``HECTOR_TF32`` (default ``auto``): float32 GEMMs on tensor cores in TF32. ``auto`` follows PyTorch
  (``torch.backends.cuda.matmul.allow_tf32``, i.e. ``torch.set_float32_matmul_precision("high")``); ``1`` always,
  ``0`` never (exact float32 on CUDA cores).
"""

from __future__ import annotations

import os

_debug: bool | None = None
_tile_bytes: int | None = None
_backend: str | None = None
_dump_dir: str | None = None
_tf32: str | None = None
BACKENDS = ("auto", "reference", "cuda")


def debug() -> bool:
    if _debug is not None:
        return _debug
    return os.environ.get("HECTOR_DEBUG", "") not in ("", "0")


def set_debug(on: bool | None) -> None:
    """Force the verifier on/off between pass stages (None: follow HECTOR_DEBUG)."""
    global _debug
    _debug = on


def tile_bytes(device_type: str = "cpu") -> int:
    if _tile_bytes is not None:
        return _tile_bytes
    env = os.environ.get("HECTOR_REFERENCE_TILE_BYTES")
    if env:
        value = int(env)
        if value <= 0:
            raise ValueError(f"HECTOR_REFERENCE_TILE_BYTES must be a positive byte count, got {env!r}")
        return value
    return 64 << 20 if device_type == "cuda" else 1 << 20


def set_tile_bytes(nbytes: int | None) -> None:
    """Bytes per edge temporary in tiled reference execution (None: follow HECTOR_REFERENCE_TILE_BYTES)."""
    global _tile_bytes
    if nbytes is not None and int(nbytes) <= 0:
        raise ValueError(f"tile bytes must be positive, got {nbytes}")
    _tile_bytes = None if nbytes is None else int(nbytes)


def backend() -> str:
    """The backend setting: "auto", "reference" or "cuda"."""
    value = _backend if _backend is not None else os.environ.get("HECTOR_BACKEND", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"HECTOR_BACKEND must be one of {BACKENDS}, got {value!r}")
    return value


def set_backend(name: str | None) -> None:
    """Choose the backend ("auto", "reference", "cuda"; None: follow HECTOR_BACKEND)."""
    global _backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def dump_dir() -> str:
    """Folder the generated CUDA sources are written to ("" when off)."""
    return _dump_dir if _dump_dir is not None else os.environ.get("HECTOR_DUMP_DIR", "")


def set_dump_dir(path: str | os.PathLike | None) -> None:
    """Write generated CUDA modules into ``path`` ("" turns it off, None follows HECTOR_DUMP_DIR)."""
    global _dump_dir
    _dump_dir = None if path is None else os.fspath(path)


def tf32() -> bool:
    """Whether float32 GEMMs may run in TF32 on tensor cores."""
    value = _tf32 if _tf32 is not None else os.environ.get("HECTOR_TF32", "auto").strip().lower() or "auto"
    if value in ("1", "true", "on"):
        return True
    if value in ("0", "false", "off"):
        return False
    if value != "auto":
        raise ValueError(f"HECTOR_TF32 must be auto, 0 or 1, got {value!r}")
    import torch

    return bool(torch.backends.cuda.matmul.allow_tf32)


def set_tf32(mode: bool | str | None) -> None:
    """True/False force TF32 on/off for float32 GEMMs; "auto" follows PyTorch; None follows HECTOR_TF32."""
    global _tf32
    _tf32 = None if mode is None else ("1" if mode is True else "0" if mode is False else str(mode))
