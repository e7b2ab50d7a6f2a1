"""Layer 0: run-time settings. Each reads an environment variable once at import and has a setter that overrides it.

``PYTORCH_DIRECT_STRATEGY`` (default ``auto``; :func:`set_strategy`)
    gather/scatter strategy when a call passes none.
``PYTORCH_DIRECT_BOUNDS_CHECK`` (default ``sync``; :func:`set_bounds_check`)
    ``sync``: raise ``IndexError`` at the call (costs one host sync per call with CUDA indices); ``async``: no host
    sync, a bad index is skipped on the device and raised at the next call or :func:`check_errors`.
``PYTORCH_DIRECT_THREADS`` (default ``0``, all cores; :func:`set_threads`)
    The package's CPU threads: gathers with CPU indices, staged scatters, and staged gathers of rows up to 256 B or
    wider than 8 MiB (other staged gathers use torch's ``index_select``, i.e. torch's threads,
    ``torch.set_num_threads``).
``PYTORCH_DIRECT_HOST_SPIN_US`` (default ``200``; :func:`set_host_spin_us`)
    How long the package's idle CPU threads poll for the next call's work before they sleep (yielding the core to
    any other runnable thread meanwhile). Waking a sleeping thread costs tens of microseconds on a virtual machine;
    on an H200 host, staged gathers of 131072 rows of 47-128 B called back to back ran 1.13-1.41x faster with 200
    than with 0 (uniform, zipf0.8 and sorted indices). ``0``: sleep at once (no busy CPU after a call).
``PYTORCH_DIRECT_MAX_SMS`` (default ``0``, no cap; :func:`set_max_sms`)
    SMs a gather/scatter kernel may occupy, so it can overlap with training kernels.
``PYTORCH_DIRECT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/pytorch_direct``, or ``~/.cache/pytorch_direct`` where
``XDG_CACHE_HOME`` is unset; :func:`set_cache_dir`)
    where the per-machine measurements of ``auto`` are stored.
``PYTORCH_DIRECT_AUTO_CALIBRATE`` (default ``1``; :func:`set_auto_calibrate`)
    ``1``: the first ``auto`` call of each kind (table size, row width, count, index order and duplicates) measures
    the candidate strategies on itself, at most 2 s per process in all, and the choice is cached on disk; ``0``:
    ``auto`` uses cached measurements or, without them, built-in rules.
``PYTORCH_DIRECT_CALIBRATION`` (unset by default; :func:`set_calibration`)
    path of a measurements file (JSON) to use, and add to, instead of the cached one.

The strategy names are the strategy registry's (``_strategies``), which checks ``PYTORCH_DIRECT_STRATEGY`` when it
is imported and holds :func:`set_strategy`.
"""

from __future__ import annotations

import os
from pathlib import Path

BOUNDS_CHECKS = ("sync", "async")


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default).strip() or default


def _parse_int(name: str, default: int) -> int:
    raw = _env(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; unset it or set a number such as {default}") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be >= 0")
    return value


class _Settings:
    def __init__(self) -> None:
        self.strategy = _env("PYTORCH_DIRECT_STRATEGY", "auto")  # (checked by the strategy registry)
        self.bounds_check = _check_choice(
            "PYTORCH_DIRECT_BOUNDS_CHECK", _env("PYTORCH_DIRECT_BOUNDS_CHECK", "sync"), BOUNDS_CHECKS
        )
        self.threads = _parse_int("PYTORCH_DIRECT_THREADS", 0)
        self.max_sms = _parse_int("PYTORCH_DIRECT_MAX_SMS", 0)
        self.host_spin_us = _parse_int("PYTORCH_DIRECT_HOST_SPIN_US", 200)
        cache_home = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
        self.cache_dir = Path(_env("PYTORCH_DIRECT_CACHE_DIR", str(Path(cache_home) / "pytorch_direct"))).expanduser()
        auto = _env("PYTORCH_DIRECT_AUTO_CALIBRATE", "1")
        self.auto_calibrate = _check_choice("PYTORCH_DIRECT_AUTO_CALIBRATE", auto, ("0", "1")) == "1"
        calibration = os.environ.get("PYTORCH_DIRECT_CALIBRATION", "").strip()
        self.calibration_file = Path(calibration).expanduser() if calibration else None


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{what}={value!r} is not one of {', '.join(choices)}")
    return value


settings = _Settings()


def set_bounds_check(mode: str) -> None:
    """``sync`` or ``async``; mirrors ``PYTORCH_DIRECT_BOUNDS_CHECK`` (see the module docs)."""
    settings.bounds_check = _check_choice("bounds_check", mode, BOUNDS_CHECKS)


def set_threads(threads: int) -> None:
    """CPU threads for host gathers (0: all cores); mirrors ``PYTORCH_DIRECT_THREADS``."""
    if int(threads) < 0:
        raise ValueError("threads must be >= 0 (0 means all cores)")
    settings.threads = int(threads)


def set_host_spin_us(microseconds: int) -> None:
    """How long idle package threads poll for work before sleeping (0: at once); mirrors
    ``PYTORCH_DIRECT_HOST_SPIN_US``."""
    if int(microseconds) < 0:
        raise ValueError("host_spin_us must be >= 0 (0 means the threads sleep as soon as they are idle)")
    settings.host_spin_us = int(microseconds)


def set_max_sms(max_sms: int) -> None:
    """Cap on the SMs a gather/scatter kernel occupies (0: no cap); mirrors ``PYTORCH_DIRECT_MAX_SMS``."""
    if int(max_sms) < 0:
        raise ValueError("max_sms must be >= 0 (0 means no cap)")
    settings.max_sms = int(max_sms)


def set_cache_dir(path: str | os.PathLike) -> None:
    """Directory of the per-machine calibration cache; mirrors ``PYTORCH_DIRECT_CACHE_DIR``."""
    settings.cache_dir = Path(path).expanduser()


def set_calibration(path: str | os.PathLike | None) -> None:
    """Use this measurements JSON file (None: the cached one); mirrors ``PYTORCH_DIRECT_CALIBRATION``."""
    settings.calibration_file = Path(path).expanduser() if path is not None else None


def set_auto_calibrate(enabled: bool) -> None:
    """Whether ``auto`` may measure strategies on its first calls; mirrors ``PYTORCH_DIRECT_AUTO_CALIBRATE``."""
    settings.auto_calibrate = bool(enabled)
