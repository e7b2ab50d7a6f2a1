"""Layer 0: run-time settings, from one table (``settings``).

Each setting has an environment variable, read once when the package is imported (``settings.reload()`` reads
them again), and a Python setter that overrides it for the process. An invalid value raises ``ValueError`` naming
the variable and the valid values. The README's "Settings" table lists them (a test keeps it in step with the table
below). Strategy names belong to the strategy registry (``_strategies``), which checks ``PYTORCH_DIRECT_STRATEGY``
when it is imported and holds :func:`set_strategy`.
"""

from __future__ import annotations

import os

from ._shared_cuda import Setting, Settings, cache_home, choice, integer, parse_bool, parse_path

BOUNDS_CHECKS = ("sync", "async")
SAMPLERS = ("kernels", "torch")


def parse_strategy_name(value: object) -> str:
    """A strategy name as text; the registry (``_strategies``, a higher layer) checks that it exists."""
    return str(value).strip().lower()

settings = Settings({
    "strategy": Setting(
        "PYTORCH_DIRECT_STRATEGY", "auto", parse_strategy_name,
        "gather/scatter strategy for calls that pass none: `auto` or a name in `pd.STRATEGIES` (checked by the "
        "strategy registry at import)", "pd.set_strategy"),
    "bounds_check": Setting(
        "PYTORCH_DIRECT_BOUNDS_CHECK", "sync", choice(*BOUNDS_CHECKS),
        "`sync`: an out-of-range index raises `IndexError` at the call (one host sync per call with CUDA indices); "
        "`async`: no host sync, a bad index is skipped on the device and raised at the next call or "
        "`check_errors()`", "pd.set_bounds_check"),
    "threads": Setting(
        "PYTORCH_DIRECT_THREADS", 0, integer(0),
        "the package's CPU threads (gathers with CPU indices, staged plans); 0: all cores", "pd.set_threads"),
    "host_spin_us": Setting(
        "PYTORCH_DIRECT_HOST_SPIN_US", 200, integer(0),
        "how long idle package threads poll for the next call's work before they sleep (waking a sleeping thread "
        "costs tens of microseconds on a virtual machine: back-to-back staged gathers of small rows ran "
        "1.13-1.41x faster with 200 than with 0); 0: sleep at once", "pd.set_host_spin_us"),
    "max_sms": Setting(
        "PYTORCH_DIRECT_MAX_SMS", 0, integer(0),
        "SMs a gather/scatter kernel may occupy, so it can overlap training kernels; 0: no cap", "pd.set_max_sms"),
    "sampler": Setting(
        "PYTORCH_DIRECT_SAMPLER", "kernels", choice(*SAMPLERS),
        "how `NeighborSampler` samples on a GPU: `kernels`, the package's CUDA kernels (a few launches and one "
        "host round trip per hop); `torch`, a chain of torch operations in TorchScript (the CPU's path)",
        "pd.set_sampler"),
    "cache_dir": Setting(
        "PYTORCH_DIRECT_CACHE_DIR", lambda: cache_home() / "pytorch_direct", parse_path,
        "where `auto`'s per-machine measurements are stored", "pd.set_cache_dir",
        "`$XDG_CACHE_HOME/pytorch_direct` (else `~/.cache/...`)"),
    "auto_calibrate": Setting(
        "PYTORCH_DIRECT_AUTO_CALIBRATE", True, parse_bool,
        "whether the first `auto` call of each kind measures the candidate strategies on itself (at most 2 s per "
        "process, cached on disk); off: cached measurements or built-in rules", "pd.set_auto_calibrate", "`1`"),
    "calibration_file": Setting(
        "PYTORCH_DIRECT_CALIBRATION", None, parse_path,
        "a measurements file (JSON) to use, and add to, instead of the cached one", "pd.set_calibration", "unset"),
})


def set_bounds_check(mode: str) -> None:
    """``sync`` or ``async``; mirrors ``PYTORCH_DIRECT_BOUNDS_CHECK``."""
    settings.set("bounds_check", mode)


def set_threads(threads: int) -> None:
    """CPU threads for host gathers (0: all cores); mirrors ``PYTORCH_DIRECT_THREADS``."""
    settings.set("threads", threads)


def set_host_spin_us(microseconds: int) -> None:
    """How long idle package threads poll for work before sleeping (0: at once); mirrors
    ``PYTORCH_DIRECT_HOST_SPIN_US``."""
    settings.set("host_spin_us", microseconds)


def set_max_sms(max_sms: int) -> None:
    """Cap on the SMs a gather/scatter kernel occupies (0: no cap); mirrors ``PYTORCH_DIRECT_MAX_SMS``."""
    settings.set("max_sms", max_sms)


def set_cache_dir(path: str | os.PathLike) -> None:
    """Directory of the per-machine calibration cache; mirrors ``PYTORCH_DIRECT_CACHE_DIR``."""
    settings.set("cache_dir", path)


def set_calibration(path: str | os.PathLike | None) -> None:
    """Use this measurements JSON file (None: back to the variable, else the cached file); mirrors
    ``PYTORCH_DIRECT_CALIBRATION``."""
    settings.set("calibration_file", path)


def set_auto_calibrate(enabled: bool) -> None:
    """Whether ``auto`` may measure strategies on its first calls; mirrors ``PYTORCH_DIRECT_AUTO_CALIBRATE``."""
    settings.set("auto_calibrate", enabled)


def set_sampler(name: str | None) -> None:
    """``kernels`` or ``torch`` (None: back to the variable); mirrors ``PYTORCH_DIRECT_SAMPLER``. Applies to samplers
    made afterwards (a ``NeighborSampler``'s ``kernels`` attribute switches one already made)."""
    settings.set("sampler", name)
