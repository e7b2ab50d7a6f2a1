"""``strategy="auto"``: pick a gather/scatter strategy per call from a calibration measured once per machine.

The calibration times each strategy on a scratch pinned table for every row width in ROW_BYTES and every density
in DENSITIES (batch rows / table rows), and is cached as JSON under the cache directory, keyed by GPU name, PCI bus
id and package version. A call uses the cell nearest its row width (log scale) and density, picks the fastest
strategy there, and falls back to rules from the measured H200 facts when no calibration exists (calibrating never
happens implicitly inside CUDA graph capture or ``torch.compile`` tracing).
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

from . import _core
from ._config import settings

ROW_BYTES = (64, 128, 256, 512, 1024, 2048, 4096)
DENSITIES = (0.002, 0.016, 0.12)
GATHER_STRATEGIES = ("vector", "sorted", "staged", "split")
SCATTER_STRATEGIES = ("vector", "sorted", "staged")
# Below this many bytes a call is latency-bound: a kernel launch beats any host round trip.
SMALL_CALL_BYTES = 1 << 20
CALIBRATION_TABLE_BYTES = 1 << 30
STAGED_MAX_ROW_BYTES = 4 << 20  # the staging slot size in cpp/src/rows_host.cpp

_loaded: dict | None = None
_calibration_failed = False


def _key() -> str:
    return _device_key(max(_core.current_device(), 0))


@functools.cache
def _device_key(device: int) -> str:
    # Cached: device properties never change, and this runs on every "auto" call (also under graph capture).
    from . import __version__

    props = _core.device_properties(device) or {}
    name = str(props.get("name", "unknown")).replace(" ", "_").replace("/", "_")
    bus = str(props.get("pci_bus_id", "")).replace(":", "-")
    return f"calibration-{name}-{bus}-{__version__}.json"


def calibration_path() -> Path:
    if settings.calibration_file is not None:
        return settings.calibration_file
    return settings.cache_dir / _key()


def load() -> dict | None:
    """The calibration in use (None when there is none yet)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    path = calibration_path()
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if "gather" in data and "scatter" in data:
                _loaded = data
        except (OSError, ValueError):
            _loaded = None  # a broken cache is re-measured
    return _loaded


def set_table(data: dict | None) -> None:
    """Use this calibration (same format as the JSON file) for the rest of the process; None forgets it."""
    global _loaded
    _loaded = data


def _time(fn, repeats: int) -> float:
    """Best-of wall time of one call, synchronised around each (as the benchmark measures): one noisy run must not
    decide the strategy for a whole cell."""
    fn()  # warm-up
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(*, table_bytes: int = CALIBRATION_TABLE_BYTES, table=None, repeats: int = 3, save: bool = True,
              verbose: bool = False) -> dict:
    """Measure every strategy on this machine (a few seconds) and cache the result; returns the table.

    By default a scratch pinned table of ``table_bytes`` is allocated; pass ``table`` (a unified tensor whose
    contents may be overwritten: scatters are measured too) to measure on that memory instead, e.g. a table as
    large as the one the job uses (GPU address translation makes very large tables slower for small rows)."""
    from . import _memory, _ops

    if not _memory.cuda_usable():
        raise _core.UnavailableError("calibration needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    if table is not None:
        with torch._C.DisableTorchFunctionSubclass():
            scratch = table.detach().reshape(-1).view(torch.uint8)
        table_bytes = scratch.numel()
    else:
        scratch = _memory.empty(table_bytes, dtype=torch.uint8)
        with torch._C.DisableTorchFunctionSubclass():
            scratch.fill_(1)
    result: dict = {"device": torch.cuda.get_device_name(device), "table_bytes": table_bytes,
                    "row_bytes": list(ROW_BYTES), "densities": list(DENSITIES), "gather": {}, "scatter": {}}
    previous = _loaded
    try:
        result["host_gather"] = _measure_host_gather(scratch, table_bytes, repeats)
        set_table(result)  # the staged measurements below use the engine measured faster
        generator = torch.Generator(device=device).manual_seed(0)
        for rb in ROW_BYTES:
            rows = table_bytes // rb
            with torch._C.DisableTorchFunctionSubclass():
                table = scratch[: rows * rb].view(rows, rb)
            for density in DENSITIES:
                n = max(1, int(rows * density))
                index = torch.randint(0, rows, (n,), device=device, generator=generator)
                out = torch.empty((n, rb), dtype=torch.uint8, device=device)
                cell = f"{rb}:{density}"
                result["gather"][cell] = {}
                result["scatter"][cell] = {}
                for s in GATHER_STRATEGIES:
                    if s == "split":
                        set_table(result)  # split_fraction reads this cell's vector/sorted/staged numbers
                    seconds = _time(functools.partial(_ops.gather_impl, table, index, s, 0), repeats)
                    result["gather"][cell][s] = n * rb / seconds / 1e9
                for s in SCATTER_STRATEGIES:
                    seconds = _time(functools.partial(_ops.scatter_impl, table, index, out, s, 0), repeats)
                    result["scatter"][cell][s] = n * rb / seconds / 1e9
                if verbose:
                    print(f"calibrate {cell}: gather {result['gather'][cell]} scatter {result['scatter'][cell]}")
    except BaseException:
        set_table(previous)  # a failed calibration leaves no partial table in use
        raise
    del scratch
    if save:
        path = calibration_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
                json.dump(result, f, indent=1)
            os.replace(f.name, path)  # atomic: concurrent processes never read half a file
        except OSError:
            pass  # an unwritable cache only costs a re-measurement next time
    set_table(result)
    return result


def _measure_host_gather(scratch, table_bytes: int, repeats: int) -> dict:
    """Host-only gather bandwidth (GB/s, summed over small, medium and 1 KiB rows at 0.2 % density of the table) of
    the package's threads and of torch's ``index_select`` (torch's OpenMP threads), and the faster one ("engine"),
    which the staged strategy then uses. Which is faster depends on the machine (core count, virtualisation, how
    the two thread pools share the cores), so it is measured, not assumed."""
    totals = {"native": 0.0, "torch": 0.0}
    for rb in (64, 256, 1024):
        rows = table_bytes // rb
        n = max(1, int(rows * 0.002))
        with torch._C.DisableTorchFunctionSubclass():
            table = scratch[: rows * rb].view(rows, rb)
            index = torch.randint(0, rows, (n,))
            out = torch.empty((n, rb), dtype=torch.uint8, pin_memory=True)
            native = functools.partial(_core.gather_host, table.data_ptr(), rows, rb, index.data_ptr(), 8, n, 0,
                                       out.data_ptr(), settings.threads)
            for engine, fn in (("native", native),
                               ("torch", functools.partial(torch.index_select, table, 0, index, out=out))):
                seconds = _time(fn, repeats)
                totals[engine] += n * rb / seconds / 1e9
    totals["engine"] = "torch" if totals["torch"] >= totals["native"] else "native"
    return totals


def host_gather_engine() -> str:
    """The staged gather's host gather: "torch" (``index_select``) unless the calibration measured the package's
    own threads faster on this machine."""
    data = load()
    host = (data or {}).get("host_gather") or {}
    return "native" if host.get("engine") == "native" else "torch"


def _nearest(values, x: float, log: bool) -> float:
    key = (lambda v: abs(math.log(v) - math.log(x))) if log else (lambda v: abs(v - x))
    return min(values, key=key)


def _cell(data: dict, op: str, row_bytes: int, density: float) -> dict | None:
    rb = _nearest(data["row_bytes"], row_bytes, log=True)
    d = _nearest(data["densities"], max(density, 1e-9), log=True)
    return data[op].get(f"{rb}:{d}")


def _rules(op: str, row_bytes: int, density: float) -> str:
    """Without a calibration: sorted indices cost a sort but make host reads sequential, which pays on every
    measured row width at densities >= ~1%; at very low density small rows go to the CPU gather (21-25 GB/s
    measured vs 4-7 GB/s for the kernel on 128 B rows)."""
    if op == "gather" and row_bytes <= 256 and density < 0.005:
        return "staged"
    return "sorted" if row_bytes < 4096 else "vector"


# A host strategy (staged, split) must beat the best kernel by this factor to be chosen: host strategies vary more
# from call to call (they share the CPU with the caller's threads), and a kernel leaves the CPU free.
HOST_MARGIN = 1.1


def _best(cell: dict) -> str:
    kernels = {s: v for s, v in cell.items() if s not in ("staged", "split")}
    hosts = {s: v for s, v in cell.items() if s in ("staged", "split")}
    best_kernel = max(kernels, key=kernels.get) if kernels else None
    best_host = max(hosts, key=hosts.get) if hosts else None
    if best_host is None or (best_kernel is not None and cell[best_host] < HOST_MARGIN * cell[best_kernel]):
        return best_kernel
    return best_host


def choose(op: str, row_bytes: int, count: int, rows: int, *, capturing: bool = False) -> str:
    """The strategy for one call (never one that needs the host inside CUDA graph capture)."""
    density = count / max(rows, 1)
    if count * row_bytes < SMALL_CALL_BYTES:
        return "vector"
    data = load()
    global _calibration_failed
    if (data is None and settings.auto_calibrate and not _calibration_failed and not capturing
            and not torch.compiler.is_compiling()):
        try:
            data = calibrate()
        except Exception as e:  # noqa: BLE001 - a failed calibration must not fail the gather; rules take over
            _calibration_failed = True  # once per process: retrying on every call would cost seconds each time
            warnings.warn(f"pytorch_direct: calibration failed ({type(e).__name__}: {e}); 'auto' uses built-in "
                          "rules. Run pytorch_direct.calibrate() to see the error", RuntimeWarning, stacklevel=3)
            data = None
    if data is None:
        choice = _rules(op, row_bytes, density)
    else:
        cell = _cell(data, op, row_bytes, density) or {}
        choice = _best(cell) if cell else _rules(op, row_bytes, density)
    # Host strategies are impossible under capture, and their 4 MiB staging slots cannot hold wider rows.
    if choice in ("staged", "split") and (capturing or row_bytes > STAGED_MAX_ROW_BYTES):
        choice = "sorted"
    return choice


def split_fraction(row_bytes: int, count: int, rows: int) -> float:
    """Share of rows the kernel takes in a split gather: proportional to the measured bandwidths, so both halves
    finish together (they share the link, so this is a first-order guess)."""
    data = load()
    if data is None:
        return 0.5
    cell = _cell(data, "gather", row_bytes, count / max(rows, 1)) or {}
    gpu = max(cell.get("vector", 0.0), cell.get("sorted", 0.0))
    cpu = cell.get("staged", 0.0)
    return gpu / (gpu + cpu) if gpu + cpu > 0 else 0.5


def split_kernel(row_bytes: int, count: int, rows: int) -> str:
    """The kernel strategy for the GPU share of a split gather: the faster of ``vector`` and ``sorted`` in the
    calibration (sorting pays for random indices at >= ~1 % density; without a calibration: ``vector``)."""
    data = load()
    if data is None:
        return "vector"
    cell = _cell(data, "gather", row_bytes, count / max(rows, 1)) or {}
    return "sorted" if cell.get("sorted", 0.0) > cell.get("vector", 0.0) else "vector"
