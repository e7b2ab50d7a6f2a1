"""The Python face of shared-cuda, installed into each package as ``<package>/_shared_cuda.py``.

One source file (``shared-cuda/python/_shared_cuda.py``) serves all three packages; each hands in its own compiled
``_core`` module. This layer owns what the C++ library must not know: where Python wheels put ``libnvrtc``, the
environment variables and their defaults, packing of JIT kernel arguments, and the ``info`` report.

Its own settings (``SETTINGS``: ``SHARED_CUDA_NVRTC_PATH``, ``SHARED_CUDA_JIT_CACHE_DIR``) are listed in the
repository README with their defaults and setters.

It also holds the one settings helper every package uses (:class:`Settings`, :class:`Setting` and the parsers):
a table of variables, each with its default, parser, meaning and Python setter; booleans spelled one way
(``0/1/true/false/on/off``, plus ``auto`` where a setting has it); an invalid value is a ``ValueError`` that names
the variable and the valid values.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import struct
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

NVRTC_PATH_ENV = "SHARED_CUDA_NVRTC_PATH"
JIT_CACHE_DIR_ENV = "SHARED_CUDA_JIT_CACHE_DIR"


# ---------------------------------------------------------------------------------------------------- TorchScript

_SCRIPT_LOCK = threading.Lock()


def script_once(fn: Callable[..., Any], cache: dict[str, Any], fallback: Any, log: logging.Logger,
                what: str) -> Any:
    """``fn`` compiled by TorchScript, once per process and kept in ``cache`` (the caller's, by function name), or
    ``fallback`` where TorchScript cannot compile it, with a warning on ``log`` that names ``what``. A function of
    plain torch ops called through TorchScript runs after a single release of the GIL, where the same ops called
    from Python hold it from one to the next."""
    hit = cache.get(fn.__name__)
    if hit is not None:
        return hit
    with _SCRIPT_LOCK:
        if fn.__name__ not in cache:
            import torch

            try:
                with warnings.catch_warnings():
                    # TorchScript is deprecated for models; for a function of plain torch ops it is the one way to
                    # run them after a single release of the GIL
                    warnings.simplefilter("ignore", DeprecationWarning)
                    cache[fn.__name__] = torch.jit.script(fn)
            except Exception as exc:  # a torch without TorchScript, or one that no longer compiles fn
                log.warning("%s did not compile under TorchScript (%s: %s); it runs as Python, holding the GIL for "
                            "each operation", what, type(exc).__name__, exc)
                cache[fn.__name__] = fallback
        return cache[fn.__name__]


# ----------------------------------------------------------------------------------------------------- settings

_TRUE = ("1", "true", "on")
_FALSE = ("0", "false", "off")


def parse_bool(value: Any) -> bool:
    """``True``/``False``, or text ``1/true/on`` and ``0/false/off`` (any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{value!r} is not a boolean: use one of {', '.join(_TRUE + _FALSE)}")


def parse_tristate(value: Any) -> str:
    """``"auto"``, ``"on"`` or ``"off"`` from ``auto``, a boolean, or its text (``1/true/on``, ``0/false/off``)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return "on" if parse_bool(value) else "off"
    except ValueError:
        raise ValueError(f"{value!r} is not valid: use auto, or one of {', '.join(_TRUE + _FALSE)}") from None


def choice(*choices: str) -> Callable[[Any], str]:
    """A parser that accepts one of ``choices`` (case-insensitive text)."""

    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return text

    parse.__doc__ = " | ".join(choices)
    return parse


def integer(minimum: int = 0) -> Callable[[Any], int]:
    """A parser for whole numbers >= ``minimum``."""

    def parse(value: Any) -> int:
        try:
            number = int(str(value).strip()) if not isinstance(value, int) else value
        except ValueError:
            raise ValueError(f"{value!r} is not a whole number (>= {minimum})") from None
        if isinstance(number, bool) or number < minimum:
            raise ValueError(f"{value!r} must be a whole number >= {minimum}")
        return number

    return parse


def parse_size(value: Any) -> int:
    """Bytes from an int or text such as ``"64G"``, ``"1M"``, ``"4096"`` (binary units; K, M, G, T)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"a size must be >= 0, got {value}")
        return value
    text = str(value).strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    for suffix, power in (("K", 10), ("M", 20), ("G", 30), ("T", 40)):
        if text.endswith(suffix):
            text, scale = text[:-1], 1 << power
            break
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"cannot read {value!r} as a size: use bytes or a number with K, M, G or T") from None
    if number < 0:
        raise ValueError(f"a size must be >= 0, got {value!r}")
    if scale == 1 and number != int(number):
        # 0.5 read as 0 bytes would switch a tier off silently (a budget takes fractions; a size does not)
        raise ValueError(f"a size in bytes must be a whole number, got {value!r}: pass bytes or a size such as '8GiB'")
    return int(number * scale)


def parse_path(value: Any) -> Path | None:
    """A path (``~`` expanded); empty text means none."""
    if value is None:
        return None
    text = os.fspath(value) if isinstance(value, os.PathLike) else str(value).strip()
    return Path(text).expanduser() if text else None


def parse_text(value: Any) -> str:
    return os.fspath(value) if isinstance(value, os.PathLike) else str(value).strip()


def cache_home() -> Path:
    """``$XDG_CACHE_HOME`` when set, else ``~/.cache``: the root of every package's default cache folder."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


@dataclass(frozen=True)
class Setting:
    """One run-time setting: its environment variable, default, parser and meaning.

    ``default`` is what applies when the variable is unset or empty: a value, or a callable that computes it when
    the settings are read (e.g. a folder under ``$XDG_CACHE_HOME``). ``setter`` names the public Python function
    that mirrors it, for the docs.
    """

    env: str
    default: Any
    parse: Callable[[Any], Any]
    doc: str
    setter: str = ""
    default_text: str = ""
    empty_is_value: bool = False  # a variable set to "" means "off" (parsed), not "use the default"

    def default_value(self) -> Any:
        return self.default() if callable(self.default) else self.default

    def from_environment(self) -> Any:
        raw = os.environ.get(self.env)
        if raw is None or (not raw.strip() and not self.empty_is_value):
            return self.default_value()
        return self.parse_value(raw, source=f"{self.env}={raw!r}")

    def parse_value(self, value: Any, source: str) -> Any:
        try:
            return self.parse(value)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None


class Settings:
    """The run-time settings of one package, from one table.

    Each value is, in order: what its Python setter gave (``set(name, value)``; ``None`` clears it), else its
    environment variable as read when the package was imported (``reload()`` reads the environment again), else
    its default. Values are validated when read from the environment and when set, never later. The value in
    force is kept as a plain attribute, so reading a setting on a hot path costs an attribute lookup.
    """

    def __init__(self, table: dict[str, Setting]) -> None:
        self._table = dict(table)
        self._overrides: dict[str, Any] = {}
        self._environment: dict[str, Any] = {}
        self._given: set[str] = set()
        self.reload()

    def reload(self) -> None:
        """Read every variable from the environment again (setters keep precedence)."""
        self._environment = {name: s.from_environment() for name, s in self._table.items()}
        self._given = {name for name, s in self._table.items() if os.environ.get(s.env, "").strip()}
        for name in self._table:
            self._resolve(name)

    def _resolve(self, name: str) -> None:
        self.__dict__[name] = self._overrides[name] if name in self._overrides else self._environment[name]

    def source(self, name: str) -> str:
        """Where the value in force comes from: ``"setter"``, ``"environment"`` or ``"default"``."""
        if name not in self._table:
            raise TypeError(f"unknown setting {name!r}; known: {', '.join(self._table)}")
        return "setter" if name in self._overrides else "environment" if name in self._given else "default"

    def __getattr__(self, name: str) -> Any:  # only reached for names that are not settings
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"no setting {name!r}; known: {', '.join(self._table)}")

    def set(self, name: str, value: Any) -> None:
        """Override a setting for this process (``None``: back to the environment variable or the default)."""
        if name not in self._table:
            raise TypeError(f"unknown setting {name!r}; known: {', '.join(self._table)}")
        if value is None:
            self._overrides.pop(name, None)
        else:
            self._overrides[name] = self._table[name].parse_value(value, source=name)
        self._resolve(name)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._table}

    def __iter__(self) -> Iterator[tuple[str, Setting]]:
        return iter(self._table.items())

    def markdown(self) -> str:
        """The settings table for a README: variable, default, Python setter, meaning."""
        rows = ["| variable | default | Python setter | meaning |", "|---|---|---|---|"]
        for s in self._table.values():
            default = s.default_text or (f"`{s.default}`" if not callable(s.default) else "computed")
            rows.append(f"| `{s.env}` | {default} | {f'`{s.setter}`' if s.setter else ''} | {s.doc} |")
        return "\n".join(rows)


SETTINGS = Settings({
    "nvrtc_path": Setting(NVRTC_PATH_ENV, "", parse_text, "a `libnvrtc.so` to try first (then the CUDA toolkit, the "
                          "loader's search path, the `nvidia-cuda-nvrtc` wheel)", "set_nvrtc_path", "unset"),
    "jit_cache_dir": Setting(JIT_CACHE_DIR_ENV, lambda: str(cache_home() / "shared_cuda" / "jit"), parse_text,
                             "where compiled kernels are cached; empty disables the disk cache", "set_jit_cache_dir",
                             "`$XDG_CACHE_HOME/shared_cuda/jit` (else `~/.cache/...`)", empty_is_value=True),
})
"""shared-cuda's own settings (one copy per package that installs this file: set them through that package's
``_shared_cuda``)."""

# ----------------------------------------------------------------------------------------------------- NVRTC


def _wheel_nvrtc_candidates() -> list[str]:
    """libnvrtc files shipped by the nvidia-cuda-nvrtc wheels (CUDA 13 and CUDA 12 layouts)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for root in spec.submodule_search_locations:
        for sub in ("cu13/lib", "cuda_nvrtc/lib"):
            folder = Path(root) / sub
            if folder.is_dir():
                found += sorted(str(p) for p in folder.glob("libnvrtc.so*") if "builtins" not in p.name)
    return found


def nvrtc_candidates(core: ModuleType) -> list[str]:
    """Every place NVRTC is looked for, in order."""
    explicit = SETTINGS.nvrtc_path
    return ([explicit] if explicit else []) + list(core.default_nvrtc_candidates()) + _wheel_nvrtc_candidates()


def set_nvrtc_path(path: str | os.PathLike[str] | None) -> None:
    """Use this libnvrtc first (mirrors ``SHARED_CUDA_NVRTC_PATH``; None: back to it); takes effect before NVRTC's
    first use."""
    SETTINGS.set("nvrtc_path", path)


def ensure_nvrtc(core: ModuleType) -> bool:
    """Load NVRTC if it can be found; return whether it is available. Never raises."""
    if not core.nvrtc_available():
        core.load_nvrtc(nvrtc_candidates(core))
    return bool(core.nvrtc_available())


# ----------------------------------------------------------------------------------------------------- JIT


def jit_cache_dir() -> str:
    """The JIT cache directory in force ("" when disk caching is off)."""
    return SETTINGS.jit_cache_dir


def set_jit_cache_dir(path: str | os.PathLike[str] | None) -> None:
    """Cache compiled kernels in ``path`` ("" disables the disk cache; None: back to ``SHARED_CUDA_JIT_CACHE_DIR``
    or the default)."""
    SETTINGS.set("jit_cache_dir", path)
    _loader.cache_clear()


@functools.cache
def _loader(core: ModuleType, directory: str) -> Any:
    return core.JitLoader(directory)


def jit_loader(core: ModuleType) -> Any:
    """The process-wide loader for the current cache directory (compiles, caches, loads)."""
    if not ensure_nvrtc(core):
        raise core.UnavailableError(
            "NVRTC (libnvrtc) was not found: install the CUDA toolkit or `pip install nvidia-cuda-nvrtc`, "
            f"or set {NVRTC_PATH_ENV} to the path of libnvrtc.so"
        )
    return _loader(core, jit_cache_dir())


# struct codes for kernel parameters; "ptr" takes an int address or anything with .data_ptr() (a torch.Tensor).
_ARG_FORMATS = {"ptr": "Q", "i32": "i", "u32": "I", "i64": "q", "u64": "Q", "f32": "f", "f64": "d"}
_PACKERS = {kind: struct.Struct(code).pack for kind, code in _ARG_FORMATS.items()}


class Kernel:
    """A compiled kernel with a declared signature, e.g. ``Kernel(k, "f32, ptr, ptr, i64")``.

    Call it as ``kernel(grid, block, *args, shared_memory=0, stream=None)``; ``stream`` defaults to PyTorch's current
    CUDA stream, so launches order with the surrounding torch work.
    """

    def __init__(self, kernel: Any, signature: str) -> None:
        self._kernel = kernel
        self.signature = [part.strip() for part in signature.split(",") if part.strip()]
        unknown = [p for p in self.signature if p not in _ARG_FORMATS]
        if unknown:
            raise ValueError(f"unknown parameter types {unknown} in signature; use {sorted(_ARG_FORMATS)}")
        # (is a pointer, packer) per parameter, resolved once: packing runs on every launch, and a hector layer
        # launches dozens of kernels per step from the host thread that bounds it
        self._packers = [(kind == "ptr", _PACKERS[kind]) for kind in self.signature]

    @property
    def name(self) -> str:
        return self._kernel.name

    def pack(self, args: Sequence[Any]) -> list[bytes]:
        if len(args) != len(self.signature):
            raise TypeError(f"kernel {self.name} takes {len(self.signature)} arguments ({', '.join(self.signature)}), "
                            f"got {len(args)}")
        packed = []
        for (is_pointer, pack), value in zip(self._packers, args, strict=True):
            if is_pointer and not isinstance(value, int) and hasattr(value, "data_ptr"):
                if not _on_cuda(value):
                    raise ValueError(f"kernel {self.name}: a pointer argument must be a CUDA tensor, got one on "
                                     f"{value.device}")
                value = value.data_ptr()
            packed.append(pack(value))
        return packed

    def __call__(self, grid: int | Sequence[int], block: int | Sequence[int], *args: Any, shared_memory: int = 0,
                 stream: int | Any | None = None) -> None:
        self._kernel.launch(_dim3(grid), _dim3(block), shared_memory, _stream_address(stream), self.pack(args))


def _on_cuda(value: Any) -> bool:
    """Whether a pointer argument with .data_ptr() lies on a CUDA device (torch's is_cuda is the cheap test)."""
    cuda = getattr(value, "is_cuda", None)
    if cuda is not None:
        return bool(cuda)
    device = getattr(value, "device", None)
    return device is None or device.type == "cuda"


def _dim3(value: int | Sequence[int]) -> list[int]:
    dims = [value] if isinstance(value, int) else list(value)
    if not 1 <= len(dims) <= 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"grid/block must be 1 to 3 positive integers, got {value!r}")
    return [int(d) for d in dims] + [1] * (3 - len(dims))


def _stream_address(stream: int | Any | None) -> int:
    if stream is None:
        import torch

        return torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else 0
    if isinstance(stream, int):
        return stream
    return int(stream.cuda_stream)  # a torch.cuda.Stream


def compile_kernel_source(core: ModuleType, source: str, name: str = "kernel.cu", *, arch: int | None = None,
                          flags: Sequence[str] = ()) -> bytes:
    """Compile CUDA C++ to a cubin (no GPU needed when ``arch`` is given, e.g. 90). Cached on disk."""
    loader = jit_loader(core)
    return loader.get_cubin(source, name, int(arch or core.current_architecture()), list(flags))


def load_kernel(core: ModuleType, source: str, kernel_name: str, signature: str, *, name: str = "kernel.cu",
                flags: Sequence[str] = ()) -> Kernel:
    """Compile (or fetch from the caches) for the current GPU, load, and return the kernel ``kernel_name``."""
    module = jit_loader(core).get(source, name, 0, list(flags))
    return Kernel(module.get_kernel(kernel_name), signature)


# ----------------------------------------------------------------------------------------------------- info


def build_info(core: ModuleType, package: str, version: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
    """What this build of ``package`` has and what this machine offers; never raises."""
    info: dict[str, Any] = {"package": package, "version": version}
    info["cuda_compiled"] = bool(core.compiled_with_cuda())
    info["cuda_architectures"] = core.compiled_architectures()
    info["cuda_runtime_version"] = core.compiled_runtime_version()
    info["driver_version"] = core.driver_version()
    info["gpus"] = [core.device_properties(i) for i in range(core.device_count())]
    info["nvrtc"] = {"available": ensure_nvrtc(core), "path": core.nvrtc_path(), "version": core.nvrtc_version()}
    info["jit_cache_dir"] = jit_cache_dir()
    try:
        import torch

        info["torch"] = f"{torch.__version__} (CUDA {'yes' if torch.cuda.is_available() else 'no'})"
    except ImportError:
        info["torch"] = "not installed"
    info["backends"] = dict(extra or {})
    return info


def _version_text(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}" if v else "none"


def format_info(info: dict[str, Any]) -> str:
    lines = [f"{info['package']} {info['version']}"]
    if info["cuda_compiled"]:
        cuda = f"yes (runtime {_version_text(info['cuda_runtime_version'])}, sm {info['cuda_architectures']})"
    else:
        cuda = "no (CPU-only build)"
    rows = [("CUDA compiled", cuda), ("CUDA driver", _version_text(info["driver_version"]))]
    if info["gpus"]:
        for gpu in info["gpus"]:
            major, minor = gpu["compute_capability"]
            rows.append((f"GPU {gpu['index']}", f"{gpu['name']} (sm_{major}{minor}, {gpu['multiprocessors']} SMs, "
                                                f"{gpu['total_memory'] / 2**30:.0f} GiB)"))
    else:
        rows.append(("GPUs", "none seen"))
    nvrtc = info["nvrtc"]
    rows.append(("NVRTC", f"{_version_text(nvrtc['version'])} at {nvrtc['path']}" if nvrtc["available"]
                 else "not found (pip install nvidia-cuda-nvrtc, or set SHARED_CUDA_NVRTC_PATH)"))
    rows.append(("JIT cache", info["jit_cache_dir"] or "off"))
    rows.append(("torch", info["torch"]))
    rows += list(info["backends"].items())
    width = max(len(k) for k, _ in rows) + 1
    lines += [f"  {k + ':':<{width}} {v}" for k, v in rows]
    return "\n".join(lines)


def main_info(core: ModuleType, package: str, version: str, extra: dict[str, str] | None = None,
              argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m <package> info [--json]``."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog=f"python -m {package.replace('-', '_')}")
    sub = parser.add_subparsers(dest="command", required=True)
    info_parser = sub.add_parser("info", help="report the build (CUDA, architectures) and what this machine offers")
    info_parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    info = build_info(core, package, version, extra)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0
