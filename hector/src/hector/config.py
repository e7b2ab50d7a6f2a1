"""Settings read from ``HECTOR_*`` environment variables, each mirrored by a Python setter (the setter wins).

* ``HECTOR_DEBUG`` (default off): run the IR verifier after every pass stage.
* ``HECTOR_REFERENCE_TILE_BYTES`` (default 1 MiB on CPU, 64 MiB on GPU): bytes per edge temporary when the
  reference backend runs an edge-parallel kernel tile by tile.
"""

from __future__ import annotations

import os

_debug: bool | None = None
_tile_bytes: int | None = None


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
