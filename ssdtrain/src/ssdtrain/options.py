"""What ``offload()`` is given, checked when it is called: the budget, the host pool limit, the NVMe tier.

A wrong directory or size fails at ``offload()``, not at the first step that would use it.
"""

from __future__ import annotations

import logging
import math
import operator
import os
from collections.abc import Sequence

from .config import settings as io_settings
from .io import parse_size
from .planner import format_bytes
from .tiers import check_directories, default_directories, free_space

log = logging.getLogger("ssdtrain")
_DEFAULT_HOST_LIMIT: int | None = None


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def default_host_limit() -> int:
    """Half the RAM available when it is first asked for in this process (then fixed, so plans stay reusable)."""
    global _DEFAULT_HOST_LIMIT
    if _DEFAULT_HOST_LIMIT is None:
        _DEFAULT_HOST_LIMIT = _host_available() // 2
    return _DEFAULT_HOST_LIMIT


def size_option(name: str, value) -> int:
    """Bytes from option `name`'s value (bytes or a size such as ``"8GiB"``); its error names the option."""
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(f"ssdtrain: {name}={value!r}: {e}") from None


def parse_budget(budget: int | float | str | None) -> tuple[int | None, float | None]:
    """(bytes or None, fraction or None) from what the user passed."""
    if budget is None:
        return None, None
    if isinstance(budget, bool):
        raise TypeError("budget must be bytes, a size such as '20GiB', a float in (0, 1] or None, not a bool")
    if isinstance(budget, float) and not math.isfinite(budget):
        raise ValueError(f"budget must be bytes, a size such as '20GiB' or a float in (0, 1], got {budget!r}")
    if isinstance(budget, float) and budget <= 1:
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget!r}")
        return None, budget
    if isinstance(budget, float) and not budget.is_integer():
        raise ValueError(
            f"budget={budget!r}: a float above 1 is bytes, and this is no whole number of bytes; a fraction of keep's "
            "predicted peak is a float in (0, 1] (budget=0.5), a size is bytes or a string such as '20GiB'"
        )
    value = parse_size(int(budget) if isinstance(budget, float) else budget)
    if value <= 0:
        raise ValueError(f"budget must be positive (bytes or a size such as '20GiB'), got {budget!r}")
    return value, None


def nvme_options(
    directories: str | os.PathLike | Sequence[str | os.PathLike] | None, nvme_memory: int | str | None
) -> tuple[list[str], int, str | None]:
    """The NVMe directories and byte limit, checked now: a wrong directory or size fails at offload(); and, where
    the limit is 0, why (switched off, or the default directory is not usable), for the warnings of activations
    that overrides send to the tier anyway."""
    given = directories is not None or io_settings.source("directories") != "default"
    if directories is None:
        dirs = default_directories()
    else:
        d = directories
        dirs = [os.fspath(x) for x in ([d] if isinstance(d, (str, os.PathLike)) else d)]
    if not dirs:
        raise ValueError("directories= is empty: pass at least one directory, or nvme_memory=0 for no NVMe tier")
    limit = size_option("nvme_memory", nvme_memory) if nvme_memory is not None else None
    if limit == 0:
        return dirs, 0, "the NVMe tier is switched off (nvme_memory=0)"
    try:
        check_directories(dirs)
    except OSError as e:
        if given or limit is not None:
            raise
        log.warning("ssdtrain: no NVMe tier: %s", e)  # the default temp dir: train on without NVMe, said once
        return dirs, 0, f"there is no NVMe tier: {(e.strerror or str(e)).removeprefix('ssdtrain: ')}"
    free = free_space(dirs)
    if limit is None:
        return dirs, int(free * 0.9), None
    if limit > free:
        raise ValueError(
            f"ssdtrain: nvme_memory={format_bytes(limit)} is more than the free space of {', '.join(dirs)} "
            f"({format_bytes(free)}): pass nvme_memory <= {free} bytes, free space, or add directories"
        )
    return dirs, limit, None


def whole_number(name: str, value, minimum: int) -> int:
    """`value` as an int of at least `minimum`, or an error naming the option (never a comparison error later)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a whole number >= {minimum}, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
