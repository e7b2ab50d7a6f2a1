"""Layer 5: the cell store: this machine's measurements (``Measurement`` per ``CellKey``) in memory and in a JSON
file under the cache directory (``PYTORCH_DIRECT_CACHE_DIR``, else ``$XDG_CACHE_HOME/pytorch_direct``, else
``~/.cache/pytorch_direct``; ``PYTORCH_DIRECT_CALIBRATION`` names a file instead), one file per machine, GPU and
package version. Processes merge their measurements into the file; a missing, unreadable or foreign file only
costs measuring again."""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

from . import _core
from ._cell import CellKey, Measurement
from ._config import settings

FORMAT = 4  # 4: typed keys with the cache class; 3: table classes name the memory kind


def _machine_key(device: int) -> str:
    from importlib.metadata import version  # (not from the package root: it sits above this layer)

    props = _core.device_properties(device) or {}
    name = str(props.get("name", "unknown")).replace(" ", "_").replace("/", "_")
    bus = str(props.get("pci_bus_id", "")).replace(":", "-")
    return f"{name}-{bus}-{os.cpu_count()}cpu-{version('pytorch-direct')}"


@functools.cache
def _cached_machine_key(device: int) -> str:
    return _machine_key(device)  # device properties never change; this runs on every cache access


def path() -> Path:
    """The file holding this machine's measurements (``PYTORCH_DIRECT_CALIBRATION`` overrides it)."""
    if settings.calibration_file is not None:
        return settings.calibration_file
    return settings.cache_dir / f"decisions-{_cached_machine_key(max(_core.current_device(), 0))}.json"


def read(file: Path) -> dict[CellKey, Measurement]:
    """The measurements in `file`; entries that do not parse are left out (measured again)."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or a broken file
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("cells"), dict):
        return {}
    found = {}
    for key, entry in data["cells"].items():
        try:
            m = Measurement.from_json(key, entry)
        except (ValueError, KeyError, TypeError):
            continue
        found[m.key] = m
    return found


def write(file: Path, measurements: dict[CellKey, Measurement]) -> None:
    """Merges `measurements` into `file` (other processes may have added theirs) with an atomic replace."""
    try:
        merged = {str(k): m.to_json() for k, m in read(file).items()}
        merged.update({str(k): m.to_json() for k, m in measurements.items()})
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=file.parent, delete=False, suffix=".tmp") as f:
            json.dump({"format": FORMAT, "cells": merged}, f, indent=1)
        os.replace(f.name, file)
    except OSError:
        pass  # an unwritable cache only costs measuring again in the next process


class CellStore:
    """The measurements in use: read from :func:`path` on first use (and again when the settings that name the file
    change), added to by :meth:`record`. ``version`` changes whenever they do, so that decisions kept per call kind
    are made again."""

    def __init__(self) -> None:
        self._cells: dict[CellKey, Measurement] | None = None
        self._path: Path | None = None
        self._where: tuple | None = None
        self.version = 0

    def cells(self) -> dict[CellKey, Measurement]:
        where = (settings.calibration_file, settings.cache_dir, _core.current_device())  # what path() reads
        if self._cells is None or where != self._where:
            self._where, self._path = where, path()
            self._cells = read(self._path)
            self.version += 1
        return self._cells

    def record(self, measurements: dict[CellKey, Measurement], save: bool = True) -> None:
        self.cells().update(measurements)
        self.version += 1
        if save:
            write(self._path, measurements)

    def delete_file(self) -> None:
        try:
            path().unlink()
        except OSError:
            pass
