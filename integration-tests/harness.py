"""What the end-to-end training scripts share: the process set-up (one process, or one per GPU under torchrun),
timers that respect CUDA's asynchrony, progress bars, memory readings and the results file.

Multi-process runs use torch.distributed only: ``torchrun --nproc-per-node=N script.py ...`` sets RANK, WORLD_SIZE
and LOCAL_RANK; :func:`start` then joins the process group (NCCL with GPUs, gloo on the CPU) and gives each process
its own GPU (``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Process:
    """This process's place in the job and the device it trains on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over all processes (the values themselves on one process)."""
        if not self.distributed:
            return list(values)
        # NCCL reduces CUDA tensors only; gloo CPU tensors.
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def max(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every process."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def print(self, *args, **kwargs) -> None:
        """print on rank 0 only (every process computes the same report)."""
        if self.main:
            print(*args, **kwargs, flush=True)


def choose_device(name: str) -> torch.device:
    """``auto``: the GPU when one is usable, else the CPU. A named CUDA device without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: no usable CUDA GPU here (torch {torch.__version__}); use --device cpu")
    return device


def start(device_name: str = "auto") -> Process:
    """Set up this process: alone, or as one rank of a torchrun job (environment RANK/WORLD_SIZE/LOCAL_RANK)."""
    device = choose_device(device_name)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Process(0, 1, 0, device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
                             f"start at most that many processes per node (--nproc-per-node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    # A generous timeout: rank 0 may spend minutes building a large data set while the others wait.
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30),
                            device_id=device if device.type == "cuda" else None)
    return Process(rank, world_size, local_rank, device)


def finish(proc: Process) -> None:
    if proc.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """Wall-clock seconds after the device has finished the work queued so far."""
    synchronize(device)
    return time.perf_counter()


class PhaseTimes:
    """Accumulated time per phase of a training step (sample / gather / compute ...) without host synchronisation:
    on CUDA, events recorded on the current stream (read once, at :meth:`totals`); on the CPU, perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, object, object]] = []
        self._open: tuple[str, object] | None = None
        self._cpu: dict[str, float] = {}

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def phase(self, name: str) -> None:
        """Close the open phase (if any) and open ``name``."""
        mark = self._mark()
        self._close(mark)
        self._open = (name, mark)

    def stop(self) -> None:
        self._close(self._mark())
        self._open = None

    def _close(self, mark) -> None:
        if self._open is None:
            return
        name, begin = self._open
        if self.cuda:
            self._marks.append((name, begin, mark))
        else:
            self._cpu[name] = self._cpu.get(name, 0.0) + (mark - begin)

    def totals(self) -> dict[str, float]:
        """Seconds per phase (synchronises on CUDA)."""
        out = dict(self._cpu)
        if self._marks:
            self._marks[-1][2].synchronize()
            for name, begin, end in self._marks:
                out[name] = out.get(name, 0.0) + begin.elapsed_time(end) / 1000.0
        return out


def progress(total: int, desc: str, enabled: bool):
    """A progress bar on stderr (tqdm) where stderr is a terminal; nothing in logs, pipes, or on ranks other than 0
    (a bar redrawn into a file is thousands of lines of carriage returns)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled or not sys.stderr.isatty(), file=sys.stderr, leave=False,
                dynamic_ncols=True, mininterval=0.5)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    """Peak bytes allocated by torch on ``device`` since the last reset (None on the CPU: not tracked there)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def host_shared_memory_bytes() -> int | None:
    """Bytes in use in /dev/shm, where POSIX shared memory (and so ``pytorch_direct.shared_memory``) lives; an
    unlinked file still counts there while a process maps it. Else /proc/meminfo's Shmem, or None where neither can
    be read. /dev/shm first: Shmem also counts every other process's and driver's shared memory, and on a GPU
    machine it grew by 2.08 copies of a table that two processes mapped once (its growth there is noise of several
    MiB per second)."""
    try:
        return shutil.disk_usage("/dev/shm").used
    except OSError:
        pass
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    match = re.search(r"^Shmem:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"20GiB"``, ``"512M"``, ``"1.5g"`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 20GiB, 512MiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def export_trace(prof, path: str) -> None:
    """A finished torch profiler's timeline as a Chrome trace (gzipped where ``path`` ends in ``.gz``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(path)


def write_json(path: str | os.PathLike | None, data: dict) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def cpu_model() -> str:
    """The host processor's model name (Linux's /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def python_probe_ms(repeats: int = 5) -> float:
    """Milliseconds of a fixed piece of single-threaded Python (the best of ``repeats``): how fast this host runs
    the interpreter alone. Recorded beside every result because the toolkit's GNN epoch is bound by the host: on
    one day three H100 machines ran the same epoch in 0.70, 1.17 and 1.27 s while PyG's GPU-bound epoch took
    2.68-2.71 s on each. It does not explain that spread by itself (the 1.27 s machine probed 13.0 ms, as fast as
    a 2-core CPU machine here): the time went to the training thread's CPU time per step, 2x on the slow ones."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        table: dict[int, int] = {}
        for i in range(100_000):
            table[i & 1023] = table.get(i & 1023, 0) + i
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def describe_host(env: dict) -> str:
    """One line for a report's header from :func:`environment`'s dict: the processor, its cores, the Python probe."""
    return (f"host: {env['cpu_model']}, {env['cpus']} cores, Python probe {env['python_probe_ms']:.1f} ms "
            "(lower is faster)")


def environment() -> dict:
    """The software and machine a result was measured on."""
    info = {"torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "cpu_model": cpu_model(), "python_probe_ms": round(python_probe_ms(), 2)}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpus"] = torch.cuda.device_count()
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info
