"""Runs hector's generated CUDA on the CPU: the module is compiled as C++ with ``emulator/shim.hpp``, linked against
the scheduler ``emulator/runtime.cpp`` (every CUDA thread a fiber; barriers, shuffles and shared memory as on a GPU;
built once per cache) and launched through ctypes on CPU tensors.

``CudaBackend(executor=EmulatedExecutor())`` then runs the whole CUDA backend (device graph, plans, launches,
bindings) on CPU tensors, so its results can be compared with the reference backend without a GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from hector.runtime.cuda import Slot

SHIM = Path(__file__).resolve().parent / "emulator" / "shim.hpp"
RUNTIME = SHIM.with_name("runtime.cpp")
_CACHE = Path(os.environ.get("HECTOR_EMULATOR_CACHE", Path(tempfile.gettempdir()) / "hector_emulator"))
# One emulated launch at a time in the process: the scheduler's state (runtime.cpp) is process-wide, and a ctypes
# call lets another Python thread (a loader preparing graphs, another executor) launch meanwhile, as it may on a GPU.
_LAUNCH_LOCK = threading.Lock()
_RUNTIME: tuple[Path, ctypes.CDLL] | None = None


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


def _build(cmd: list[str], out: Path, what: str) -> None:
    """Run the compiler into a file of this process, then move it into place (concurrent processes may share the
    cache)."""
    tmp = out.with_name(f"{out.stem}.{os.getpid()}{out.suffix}")
    done = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"emulated build of {what} failed:\n{done.stderr[-6000:]}")
    os.replace(tmp, out)


def runtime() -> tuple[Path, ctypes.CDLL]:
    """The scheduler library (built on first use, cached by the hash of its sources) and its handle."""
    global _RUNTIME
    if _RUNTIME is None:
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler to build the emulated kernels")
        key = hashlib.sha256((SHIM.read_text() + RUNTIME.read_text()).encode()).hexdigest()[:20]
        _CACHE.mkdir(parents=True, exist_ok=True)
        lib = _CACHE / f"runtime-{key}.so"
        if not lib.exists():
            _build([cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-w", "-DHECTOR_EMULATE", f"-I{SHIM.parent}",
                    str(RUNTIME)], lib, "the emulator runtime")
        handle = ctypes.CDLL(str(lib))
        handle.hector_emu_launch.restype = ctypes.c_int
        handle.hector_emu_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p]
        _RUNTIME = (lib, handle)
    return _RUNTIME


class EmulatedExecutor:
    """Executor for :class:`hector.runtime.cuda.CudaBackend` that runs kernels on the CPU."""

    def __init__(self, multiprocessors: int = 2, arch: int = 90):
        self.multiprocessors = multiprocessors
        self.arch = arch
        self.launches: list[str] = []

    def load(self, module, filename: str):
        rt, _ = runtime()
        # the runtime's name holds the hash of the shim and the scheduler: a module is rebuilt when either changes
        key = hashlib.sha256((rt.name + module.source).encode()).hexdigest()[:20]
        lib = _CACHE / f"{key}.so"
        if not lib.exists():
            src = _CACHE / f"{key}.{os.getpid()}.cpp"  # this process's: another may be writing the same module
            src.write_text(module.source)
            # linked against the runtime by its path: loading the module loads the process's one scheduler
            try:
                _build([compiler(), "-std=c++17", "-O1", "-shared", "-fPIC", "-w", "-DHECTOR_EMULATE", "-include",
                        str(SHIM), "-x", "c++", str(src), "-x", "none", str(rt)], lib, filename)
            finally:
                src.unlink(missing_ok=True)
        return ctypes.CDLL(str(lib))

    def kernel(self, handle, name: str, signature: str, smem: int):
        stub = getattr(handle, f"hector_emu_{name}")
        return (handle, ctypes.cast(stub, ctypes.c_void_p), name, [s.strip() for s in signature.split(",")])

    def launch(self, kernel, grid, block, args, smem, stream) -> None:
        _, _, name, sig = kernel
        for kind, value in zip(sig, args, strict=True):
            if kind == "ptr":
                assert isinstance(value, torch.Tensor) and value.device.type == "cpu", name
        self._launch(kernel, grid, block, [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in args], smem)

    def batch(self, launches):
        """As the GPU executor's: the launches kept as given, a template of the instances :meth:`instantiate`
        makes; each per-call pointer (a ``(base, offset)`` tuple) resolved at launch."""
        for kernel, _, _, _, args in launches:
            for kind, value in zip(kernel[3], args, strict=True):
                assert kind == "ptr" or not isinstance(value, (torch.Tensor, tuple)), kernel[2]
                if isinstance(value, torch.Tensor):
                    assert value.device.type == "cpu", kernel[2]
        return list(launches)

    def instantiate(self, batch, values):
        """As the GPU executor's: each :class:`~hector.runtime.cuda.Slot` (an argument, a patched pointer's offset,
        a grid's x) replaced by its value; a grid never empty."""
        def number(v):
            return values[v.index] if type(v) is Slot else v

        out = []
        for kernel, (x, y), block, smem, args in batch:
            x = number(x)
            assert x > 0, (kernel[2], "an empty grid")
            out.append((kernel, (x, y), block, smem,
                        [(v[0], number(v[1])) if type(v) is tuple else number(v) for v in args]))
        return out

    def launch_batch(self, batch, bases, stream) -> None:
        for kernel, grid, block, smem, args in batch:
            raw = [bases[v[0]] + v[1] if type(v) is tuple else
                   v.data_ptr() if isinstance(v, torch.Tensor) else v for v in args]
            self._launch(kernel, grid, block, raw, smem)

    def _launch(self, kernel, grid, block, args, smem) -> None:
        _, stub, name, sig = kernel
        self.launches.append(name)
        holders = []
        for kind, value in zip(sig, args, strict=True):
            if kind == "ptr":
                holders.append(ctypes.c_void_p(int(value)))
            else:
                holders.append(ctypes.c_longlong(int(value)))
        array = (ctypes.c_void_p * max(1, len(holders)))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p)
                                                            for h in holders])
        launch = runtime()[1].hector_emu_launch
        gx, gy = grid
        with _LAUNCH_LOCK:
            rc = launch(stub, gx, gy, 1, block, 1, 1, smem, ctypes.cast(array, ctypes.c_void_p))
        if rc != 0:
            raise RuntimeError(f"emulated kernel {name} failed (code {rc})")

    def stream(self) -> int:
        return 0

    def properties(self, device) -> dict:
        return {"multiprocessors": self.multiprocessors, "arch": self.arch}
