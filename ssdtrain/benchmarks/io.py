"""Benchmark: ssdtrain's I/O engine against fio, dd and a plain multithreaded pread/pwrite loop, in the same run.

    python ssdtrain/benchmarks/io.py --dir /nvme/tmp                # full size: 64 MiB .. 1 GiB
    python ssdtrain/benchmarks/io.py --dir /tmp --quick             # seconds (the smoke test uses this)
    python ssdtrain/benchmarks/io.py --dir /nvme/tmp --csv out.csv
    python ssdtrain/benchmarks/io.py --dir /nvme/tmp --compare --sizes 256M,1G --rounds 5 --backends io_uring,threads

--compare runs only the same-run comparison the "engine >= 1.2x kvikio for GPU tensors" target is judged by: per
size, the engine (each of --backends), kvikio at each --kvikio-threads count and the disk's own rate ("ceiling":
``_core.raw_transfer``, O_DIRECT io_uring between the file and pinned huge-page host memory at the same block size
and queue depth, nothing else in the path) move the same bytes (GPU tensors where CUDA is available, host memory
otherwise); so does the engine with pinned huge-page host memory moved in place ("engine <backend> (host)"): the
main rows against it show what the staging copies cost, it against the ceiling what the engine's own machinery costs.
One warm-up round, then --rounds rounds, each contender writing then reading back, in an order rotated by one every
round so disk drift hits all alike. Every write is timed through an fsync of its file; every read is cold
the same way for all (fsync, then posix_fadvise DONTNEED on the file right before it; the engine and the ceiling
also use O_DIRECT); every read is compared with the source. Reported: median GB/s, min-max and the samples; against
kvikio's best thread count and the ceiling as a ratio of medians and as the range of per-round ratios.

Measured per backend (io_uring, threads, gds where a GPU is present) and per memory (see MEMORIES below): host
(torch's pinned tensor, default settings: copied through the staging buffers), host-huge (ssdtrain.huge_empty(),
moved in place), host-4k (torch's tensor moved from its own 4 KiB pages: stage_host=off), gpu (CUDA tensors):
  seqwrite / seqread  one tensor of each size, written then read back whole (block size and queue depth as given)
  randread            1 MiB handles read in random order with `--random-depth` in flight (random offsets in the
                      engine's file), compared with fio randread bs=1M at the same depth
References at the same block size, queue depth and O_DIRECT: fio (ioengine=io_uring), dd (8 MiB blocks,
oflag/iflag=direct), and `pthreads`: a Python loop of os.pwrite/os.preadv on `--threads` threads (O_DIRECT).
kvikio (RAPIDS, where importable and usable): ``CuFile.pwrite`` / ``pread`` of the same GPU tensors and pinned host
buffers at each of `--kvikio-threads` thread counts (``kvikio.defaults.set({"num_threads": n})``); its writes are
timed with the fsync after them (kvikio may write through the page cache: without it a write would time memory
copies), its reads are cold (the file's pages are dropped first with posix_fadvise DONTNEED).
Each number is the median of --repeat runs. "cpu s/GB" is process CPU time (all threads) per GB moved.
Targets: io_uring host <-> file >= 0.95x fio; gpu <-> file >= 0.9x the host path; the engine >= 1.2x kvikio's best
thread count for GPU tensors, write and read.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import mmap
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# "cpu s/GB" is process CPU time: torch's OpenMP workers spinning after the poisoning fill just before a timed read
# were counted as the engine's (1.7-2.0 s/GB for every 64 MiB host read, in place or staged, none for GPU
# reads). Passive waiting makes them sleep at once. Set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import ssdtrain

MiB = 1 << 20


def parse_sizes(text: str) -> list[int]:
    return [ssdtrain.io.parse_size(s) for s in text.split(",") if s]


def cpu_seconds(children: bool = False) -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def median_run(fn, repeat: int):
    """fn() -> (seconds, bytes, cpu_seconds); the run with the median time."""
    runs = sorted((fn() for _ in range(repeat)), key=lambda r: r[0])
    return runs[len(runs) // 2]


# ---------------------------------------------------------------------------------------------- evidence
# Whether bytes really reach the device inside the timed region, and in what request sizes: /proc/diskstats of the
# block device under --dir, sampled around every timed run (the machine should be otherwise idle).


class Disk:
    """The block device holding `path` (a partition's counters are its own), read from /proc/diskstats."""

    def __init__(self, path: str):
        path = os.path.realpath(path)
        st = os.stat(path)
        self.major, self.minor = os.major(st.st_dev), os.minor(st.st_dev)
        self.name = ""
        try:
            with open("/proc/diskstats") as f:
                for line in f:
                    parts = line.split()
                    if int(parts[0]) == self.major and int(parts[1]) == self.minor:
                        self.name = parts[2]
        except OSError:
            pass
        if not self.name:  # e.g. an overlay: take the device of the longest mount point above `path`
            best, device = "", ""
            try:
                with open("/proc/mounts") as f:
                    for line in f:
                        source, point = line.split()[:2]
                        inside = path.startswith(point.rstrip("/") + "/") or path == point
                        if inside and len(point) >= len(best):
                            best, device = point, source
            except OSError:
                pass
            if device.startswith("/dev/"):
                self.name = os.path.basename(os.path.realpath(device))

    def sample(self):
        """(read requests, bytes read, write requests, bytes written) so far, or None where unknown."""
        if not self.name:
            return None
        with open("/proc/diskstats") as f:
            for line in f:
                parts = line.split()
                if parts[2] == self.name:
                    return int(parts[3]), int(parts[5]) * 512, int(parts[7]), int(parts[9]) * 512
        return None

    def queue(self) -> str:
        """The request limits that decide how the block layer splits a request."""
        base = f"/sys/class/block/{self.name}" if self.name else f"/sys/dev/block/{self.major}:{self.minor}"
        if os.path.exists(base + "/partition"):
            base += "/.."
        out = []
        for key in (
            "max_segments",
            "max_segment_size",
            "max_sectors_kb",
            "max_hw_sectors_kb",
            "nr_requests",
            "scheduler",
        ):
            try:
                with open(f"{base}/queue/{key}") as f:
                    out.append(f"{key}={f.read().strip()}")
            except OSError:
                pass
        return " ".join(out)


DISK: Disk | None = None


def measured(fn):
    """Run fn() and return (seconds, cpu seconds, disk delta dict or None)."""
    before = DISK.sample() if DISK else None
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    after = DISK.sample() if DISK else None
    disk = None
    if before and after:
        disk = {k: a - b for k, a, b in zip(("rreq", "rbytes", "wreq", "wbytes"), after, before, strict=True)}
    return seconds, cpu, disk


def o_direct(fd: int) -> str:
    """'yes'/'no' from the file's open flags in /proc/self/fdinfo (O_DIRECT = 0o40000 on x86-64)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("flags:"):
                    return "yes" if int(line.split()[1], 8) & os.O_DIRECT else "NO"
    except OSError:
        pass
    return "unknown"


def segments_per_block(address: int, nbytes: int, block: int) -> str:
    """Physically contiguous runs per `block` bytes of [address, address+nbytes), from /proc/self/pagemap.

    A block whose 4 KiB pages are scattered reaches the device as that many segments; above the queue's
    max_segments the block layer splits the request. Needs root (page frame numbers read as 0 otherwise)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, count = address // page, (nbytes + page - 1) // page
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            raw = f.read(count * 8)
    except OSError as e:
        return f"unknown ({e.strerror})"
    frames = [int.from_bytes(raw[i : i + 8], "little") & ((1 << 55) - 1) for i in range(0, len(raw), 8)]
    if not any(frames):
        return (
            "unknown (no page frames: not root, or a driver mapping pagemap does not describe, e.g. "
            "cudaHostAlloc memory)"
        )
    per_block = block // page
    counts = []
    for b in range(0, len(frames), per_block):
        chunk = frames[b : b + per_block]
        counts.append(1 + sum(1 for x, y in zip(chunk[:-1], chunk[1:], strict=True) if y != x + 1))
    counts.sort()
    return f"avg {sum(counts) / len(counts):.1f}, max {counts[-1]} (over {len(counts)} blocks)"


# ---------------------------------------------------------------------------------------------- ssdtrain


def host_tensor(nbytes: int, huge: bool = False) -> torch.Tensor:
    if huge:
        try:
            t = ssdtrain.huge_empty(nbytes)
        except RuntimeError as e:  # pinning refused: still huge pages, pageable
            print(f"# huge_empty({nbytes}) could not pin ({e}); using pageable huge pages", flush=True)
            t = ssdtrain.huge_empty(nbytes, pin_memory=False)
    elif torch.cuda.is_available():
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        t = ssdtrain.aligned_empty(nbytes)
    t.random_(0, 256)
    return t


def make_engine(args, backend: str, stage_host: str = "auto") -> ssdtrain.Engine:
    capacity = max(args.sizes) * 2 + args.random_count * MiB + 256 * MiB
    return ssdtrain.Engine(
        [args.dir],
        backend=backend,
        capacity_per_directory=capacity,
        block_size=args.block_size,
        queue_depth=args.queue_depth,
        staging_buffers=args.staging_buffers,
        threads=args.engine_threads,
        checksum=args.checksum,
        stage_host=stage_host,
    )


# Memory kinds: host = torch's pinned tensor (page-aligned pageable where CUDA is absent) with the default
# stage_host=auto, i.e. copied through the engine's huge-page staging buffers; host-huge = ssdtrain.huge_empty()
# (pinned where CUDA is present), moved in place; host-4k = torch's tensor moved from its own scattered 4 KiB pages
# (stage_host=off, the engine's behaviour before 2026-11-21); gpu = CUDA tensor through the staging buffers or cuFile.
MEMORIES = ("host", "host-huge", "host-4k", "gpu")


def new_tensor(memory: str, nbytes: int, fill: bool = True) -> torch.Tensor:
    if memory in ("host", "host-4k"):
        return host_tensor(nbytes)
    if memory == "host-huge":
        return host_tensor(nbytes, huge=True)
    if fill:
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def same_file_fio(args, memory: str) -> bool:
    return memory == "host" and not args.no_references and shutil.which("fio") is not None


def engine_seq_rows(args, engine, backend: str, memory: str, size: int, describe: bool = False) -> list[dict]:
    """Sequential write then read of one tensor of `size` bytes, median of --repeat.

    With fio present (host memory), each engine run alternates with a fio run on the same blocks of the engine's own
    file ("fio-same"): the fairest reference on a disk whose speed depends on where and how recently data was written.
    """
    detail = engine.backend_detail
    sync = torch.cuda.synchronize if memory == "gpu" else (lambda: None)
    src, dst = new_tensor(memory, size), new_tensor(memory, size, fill=False)
    if describe and memory != "gpu":
        print(
            f"# {memory} {fmt_size(size)} tensor ({'pinned' if src.is_pinned() else 'pageable'}): segments per "
            f"{fmt_size(args.block_size)} block: {segments_per_block(src.data_ptr(), size, args.block_size)}",
            flush=True,
        )
    fio = same_file_fio(args, memory)
    handle_box = []
    runs = {"write": [], "read": [], "fio-write": [], "fio-read": []}

    def timed(kind, fn, nbytes):
        sync()
        seconds, cpu, disk = measured(lambda: (fn(), sync()))
        runs[kind].append((seconds, nbytes, cpu, disk))

    def write_once():
        if handle_box:
            engine.free(handle_box.pop())
        timed("write", lambda: handle_box.append(engine.write(src).result()), size)

    def read_once():
        dst.fill_(0x5A)  # poison: a read that moved nothing cannot pass the comparison below
        sync()
        timed("read", lambda: engine.read(handle_box[0], out=dst).result(), size)
        if not torch.equal(dst, src):
            raise RuntimeError(f"data mismatch after {backend}/{memory} read of {size} bytes")

    for _ in range(args.repeat):
        write_once()
        if fio:  # the extent allocator puts this tensor at offset 0 of an otherwise empty file
            runs["fio-write"].append(fio_once(engine_file(engine), "write", size, args.queue_depth, args.block_size))
    if fio:
        write_once()  # fio overwrote the blocks: store the tensor again before reading it back
        runs["write"].pop()
    for _ in range(args.repeat):
        read_once()
        if fio:
            runs["fio-read"].append(fio_once(engine_file(engine), "read", size, args.queue_depth, args.block_size))

    def median(kind):
        return sorted(runs[kind], key=lambda r: r[0])[len(runs[kind]) // 2]

    rows = []
    for op, kind in (("seqwrite", "write"), ("seqread", "read")):
        if fio:
            rows.append(row("fio-same", "io_uring", "host", op, size, args, median(f"fio-{kind}")))
        rows.append(row("ssdtrain", backend, memory, op, size, args, median(kind), detail))
    engine.free(handle_box.pop())
    return rows


def engine_random_rows(args, engine, backend: str, memory: str) -> list[dict]:
    """Random 1 MiB reads: many 1 MiB handles (random places in the file), read in shuffled order at a fixed depth."""
    sync = torch.cuda.synchronize if memory == "gpu" else (lambda: None)
    block = new_tensor(memory, MiB)
    handles = [f.result() for f in [engine.write(block) for _ in range(args.random_count)]]
    outs = [new_tensor(memory, MiB, fill=False) for _ in range(args.random_depth)]

    def random_once():
        order = handles[:]
        random.shuffle(order)
        sync()

        def go():
            inflight = []
            for i, h in enumerate(order):
                if len(inflight) == args.random_depth:
                    inflight.pop(0).result()
                inflight.append(engine.read(h, out=outs[i % args.random_depth]))
            for f in inflight:
                f.result()
            sync()

        seconds, cpu, disk = measured(go)
        return seconds, len(order) * MiB, cpu, disk

    rows = []
    runs, fio_runs = [], []
    for _ in range(args.repeat):
        runs.append(random_once())
        if same_file_fio(args, memory):  # the 1 MiB handles fill [0, random_count MiB) of the file, in order
            fio_runs.append(fio_once(engine_file(engine), "randread", args.random_count * MiB, args.random_depth, MiB))
    for tool, samples in (("fio-same", fio_runs), ("ssdtrain", runs)):
        if samples:
            r = row(
                tool,
                backend if tool == "ssdtrain" else "io_uring",
                memory,
                "randread",
                MiB,
                args,
                sorted(samples, key=lambda x: x[0])[len(samples) // 2],
                engine.backend_detail if tool == "ssdtrain" else "",
            )
            r["queue_depth"] = args.random_depth
            rows.append(r)
    for h in handles:
        engine.free(h)
    return rows


def row(tool, backend, memory, op, size, args, run, detail=""):
    seconds, nbytes, cpu = run[:3]
    disk = run[3] if len(run) > 3 else None
    moved = requests = ""
    if disk:
        key = "w" if "write" in op else "r"
        moved = round(disk[key + "bytes"] / nbytes, 3)
        requests = round(disk[key + "bytes"] / disk[key + "req"] / 1024) if disk[key + "req"] else 0
    return {
        "tool": tool,
        "backend": backend,
        "memory": memory,
        "op": op,
        "size": size,
        "block": args.block_size,
        "queue_depth": args.queue_depth,
        "seconds": seconds,
        "GBps": nbytes / seconds / 1e9,
        "cpu_s_per_GB": cpu / (nbytes / 1e9),
        "device_bytes_ratio": moved,
        "device_request_KiB": requests,
        "detail": detail,
    }


# ---------------------------------------------------------------------------------------------- references


def fio_once(path: str, rw: str, nbytes: int, depth: int, bs: int):
    """One fio job (io_uring, O_DIRECT) over [0, nbytes) of `path`: (seconds, bytes, cpu seconds)."""
    box = []
    _, _, disk = measured(
        lambda: box.append(
            subprocess.run(
                [
                    "fio",
                    "--name=bench",
                    f"--filename={path}",
                    f"--size={nbytes}",
                    f"--bs={bs}",
                    f"--rw={rw}",
                    f"--iodepth={depth}",
                    "--ioengine=io_uring",
                    "--direct=1",
                    "--numjobs=1",
                    "--output-format=json",
                ],
                check=True,
                capture_output=True,
                text=True,
            )
        )
    )
    job = json.loads(box[0].stdout)["jobs"][0]
    part = job["write" if "write" in rw else "read"]
    seconds = part["runtime"] / 1000
    return seconds, part["io_bytes"], (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds, disk


def engine_file(engine) -> str:
    """The engine's (nameless) file, as a path other processes can open: fio then moves the very same blocks."""
    return f"/proc/{os.getpid()}/fd/{engine.directories()[0]['fd']}"


def fio_rows(args, size: int | None) -> list[dict]:
    """fio write then read of `size` bytes (or, with size None, 1 MiB random reads) with the engine's settings."""
    if shutil.which("fio") is None:
        return []
    rows = []
    path = os.path.join(args.dir, "ssdtrain-bench.fio")
    if size is None:
        jobs = [("randread", "randread", args.random_count * MiB, args.random_depth, MiB)]
    else:
        jobs = [
            (op, rw, size, args.queue_depth, args.block_size) for op, rw in (("seqwrite", "write"), ("seqread", "read"))
        ]
    try:
        for op, rw, nbytes, depth, bs in jobs:

            def once(rw=rw, nbytes=nbytes, depth=depth, bs=bs):
                return fio_once(path, rw, nbytes, depth, bs)

            r = row(
                "fio", "io_uring", "host", op, nbytes if op != "randread" else bs, args, median_run(once, args.repeat)
            )
            r["queue_depth"], r["block"] = depth, bs
            rows.append(r)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return rows


def dd_rows(args, size: int) -> list[dict]:
    """dd with 8 MiB blocks and O_DIRECT: one request at a time, the simplest sequential reference."""
    if shutil.which("dd") is None:
        return []
    rows = []
    path = os.path.join(args.dir, "ssdtrain-bench.dd")
    bs = 8 * MiB
    count = max(1, size // bs)
    commands = (
        (
            "seqwrite",
            ["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}", "oflag=direct", "conv=notrunc"],
        ),
        ("seqread", ["dd", f"if={path}", "of=/dev/null", f"bs={bs}", f"count={count}", "iflag=direct"]),
    )
    try:
        for op, cmd in commands:

            def once(cmd=cmd):
                c0 = cpu_seconds(children=True)
                seconds, _, disk = measured(lambda: subprocess.run(cmd, check=True, capture_output=True))
                return seconds, count * bs, cpu_seconds(children=True) - c0, disk

            r = row("dd", "-", "host", op, size, args, median_run(once, args.repeat))
            r["block"], r["queue_depth"] = bs, 1
            rows.append(r)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return rows


def pthread_rows(args, size: int) -> list[dict]:
    """A plain loop: `threads` Python threads, each os.pwrite/os.preadv of block-size pieces (O_DIRECT)."""
    rows = []
    path = os.path.join(args.dir, "ssdtrain-bench.pthreads")
    nthreads, bs = args.threads, args.block_size
    blocks = size // bs
    buffers = [mmap.mmap(-1, bs) for _ in range(nthreads)]  # page aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)

    def run(write: bool):
        def worker(k):
            buf = buffers[k]
            for b in range(k, blocks, nthreads):
                if write:
                    os.pwrite(fd, buf, b * bs)
                else:
                    os.preadv(fd, [buf], b * bs)

        def go():
            threads = [threading.Thread(target=worker, args=(k,)) for k in range(nthreads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        seconds, cpu, disk = measured(go)
        return seconds, blocks * bs, cpu, disk

    try:
        os.posix_fallocate(fd, 0, size)
        for op, write in (("seqwrite", True), ("seqread", False)):
            r = row(
                "pthreads",
                f"{nthreads} threads",
                "host",
                op,
                size,
                args,
                median_run(lambda write=write: run(write), args.repeat),
            )
            r["queue_depth"] = nthreads
            rows.append(r)
    finally:
        os.close(fd)
        os.unlink(path)
    return rows


KVIKIO: dict = {}  # "module" or "reason", once per process


def load_kvikio():
    """(kvikio module, None) or (None, why it cannot be used here): never raises."""
    if not KVIKIO:
        try:
            import kvikio
            import kvikio.defaults

            KVIKIO["module"] = kvikio
        except Exception as e:  # noqa: BLE001 - any import failure only removes the kvikio rows
            KVIKIO["reason"] = f"not importable ({type(e).__name__}: {e})"[:200]
    return KVIKIO.get("module"), KVIKIO.get("reason")


def kvikio_rows(args, size: int, memories: list[str]) -> list[dict]:
    """kvikio's CuFile on the same sizes: GPU tensors and pinned host buffers, write (+ fsync) then cold read."""
    kvikio, _ = load_kvikio()
    if kvikio is None:
        return []
    rows = []
    path = os.path.join(args.dir, "ssdtrain-bench.kvikio")
    for memory in [m for m in ("gpu", "host") if m in memories]:
        try:
            rows += _kvikio_memory_rows(kvikio, args, size, memory, path)
        except Exception as e:  # noqa: BLE001 - kvikio unusable here (no driver, no GPU): said once, no rows
            KVIKIO.pop("module", None)
            KVIKIO["reason"] = f"unusable ({type(e).__name__}: {e})"[:200]
            print(f"# kvikio: {KVIKIO['reason']}", flush=True)
            break
        finally:
            if os.path.exists(path):
                os.unlink(path)
    return rows


def _kvikio_memory_rows(kvikio, args, size: int, memory: str, path: str) -> list[dict]:
    cuda = memory == "gpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    src, dst = new_tensor(memory, size), new_tensor(memory, size, fill=False)
    # CUDA tensors by the CUDA array interface; host memory by the buffer protocol.
    src_view, dst_view = (src, dst) if cuda else (src.numpy(), dst.numpy())
    with open(path, "wb"):
        pass
    f = kvikio.CuFile(path, "r+")
    try:
        f.pwrite(src_view).get()  # allocates the file's blocks: later writes overwrite them, like the engine's
        os.fsync(f.fileno())
        detail = f"compat_mode {kvikio.defaults.get('compat_mode')}, task_size {kvikio.defaults.get('task_size')}"

        def write():
            c0 = cpu_seconds()
            seconds, _, disk = measured(lambda: (f.pwrite(src_view).get(), os.fsync(f.fileno())))
            return seconds, size, cpu_seconds() - c0, disk

        def read():
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # cold: nothing from the page cache
            dst.fill_(0x5A)
            sync()
            c0 = cpu_seconds()
            seconds, _, disk = measured(lambda: (f.pread(dst_view).get(), sync()))
            if not torch.equal(dst, src):
                raise RuntimeError(f"kvikio {memory} read of {size} bytes returned other data")
            return seconds, size, cpu_seconds() - c0, disk

        rows = []
        for threads in args.kvikio_threads:
            kvikio.defaults.set({"num_threads": threads})
            for op, fn in (("seqwrite", write), ("seqread", read)):
                r = row("kvikio", f"{threads} thr", memory, op, size, args, median_run(fn, args.repeat), detail)
                r["queue_depth"] = threads
                rows.append(r)
        return rows
    finally:
        f.close()


# ---------------------------------------------------------------------------------------------- same-run comparison
# --compare: the engine, kvikio and the disk's own rate in interleaved rounds (see compare_main), the numbers the
# "engine >= 1.2x kvikio for GPU tensors" target is judged by.


def drop_cache(fd: int) -> None:
    """Make the next read of this file cold: dirty pages written out, then every cached page dropped."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class _Contender:
    """One way of moving `size` bytes between memory and a file: write() and read() each return
    (seconds, disk delta); the bytes read back are compared with the source outside the timed region."""

    name = ""
    backend = ""
    memory = ""
    detail = ""

    def close(self) -> None:
        pass


class _EngineContender(_Contender):
    def __init__(self, args, backend: str, memory: str, src, dst):
        self.engine = ssdtrain.Engine(
            [args.dir],
            backend=backend,
            capacity_per_directory=max(args.sizes) * 2 + 256 * MiB,
            preallocate_per_directory=max(args.sizes),  # file growth (fallocate) kept out of the timed writes
            block_size=args.block_size,
            queue_depth=args.queue_depth,
            staging_buffers=args.staging_buffers,
            threads=args.engine_threads,
        )
        self.backend = self.engine.backend_name
        self.name, self.memory, self.src, self.dst = f"engine {self.backend}", memory, src, dst
        if memory == "host-huge":
            self.name += " (host)"  # pinned huge pages moved in place: no device copy in the path
        self.fd = self.engine.directories()[0]["fd"]
        self.detail = self.engine.backend_detail
        self.handle = None
        self.sync = torch.cuda.synchronize if memory == "gpu" else (lambda: None)

    def write(self):
        if self.handle is not None:
            self.engine.free(self.handle)  # the next write reuses its extents: the same blocks each round
            self.handle = None
        box = []
        self.sync()
        seconds, _, disk = measured(lambda: (box.append(self.engine.write(self.src).result()), os.fsync(self.fd)))
        self.handle = box[0]
        return seconds, disk

    def read(self):
        self.dst.fill_(0x5A)  # poison: a read that moved nothing cannot pass the comparison
        drop_cache(self.fd)  # O_DIRECT already bypasses the page cache; the same step as every contender
        self.sync()
        seconds, _, disk = measured(lambda: (self.engine.read(self.handle, out=self.dst).result(), self.sync()))
        return seconds, disk

    def close(self):
        self.engine.close()


class _KvikioContender(_Contender):
    def __init__(self, kvikio, args, threads: int, memory: str, src, dst, path: str):
        self.kvikio, self.threads, self.path = kvikio, threads, path
        self.name, self.backend = f"kvikio {threads} thr", f"{threads} thr"
        self.memory, self.src, self.dst = memory, src, dst
        self.cuda = memory == "gpu"
        self.views = (src, dst) if self.cuda else (src.numpy(), dst.numpy())
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        with open(path, "wb"):
            pass
        self.file = kvikio.CuFile(path, "r+")
        self._threads()
        self.file.pwrite(self.views[0]).get()  # allocates the blocks: timed writes overwrite them, like the engine's
        os.fsync(self.file.fileno())
        self.detail = f"compat_mode {kvikio.defaults.get('compat_mode')}, task_size {kvikio.defaults.get('task_size')}"

    def _threads(self):
        self.kvikio.defaults.set({"num_threads": self.threads})  # outside the timed region: it may rebuild a pool

    def write(self):
        self._threads()
        self.sync()
        fd = self.file.fileno()
        seconds, _, disk = measured(lambda: (self.file.pwrite(self.views[0]).get(), os.fsync(fd)))
        return seconds, disk

    def read(self):
        self._threads()
        self.dst.fill_(0x5A)
        drop_cache(self.file.fileno())
        self.sync()
        seconds, _, disk = measured(lambda: (self.file.pread(self.views[1]).get(), self.sync()))
        return seconds, disk

    def close(self):
        self.file.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


class _CeilingContender(_Contender):
    """The disk alone: O_DIRECT io_uring between the file and pinned huge-page host memory, no GPU, no engine."""

    def __init__(self, args, size: int, path: str):
        self.name, self.backend, self.memory, self.path = "ceiling", "io_uring", "host-huge", path
        self.block, self.depth, self.size = args.block_size, args.queue_depth, size
        self.src, self.dst = host_tensor(size, huge=True), host_tensor(size, huge=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        try:
            self.fd, direct = os.open(path, flags | os.O_DIRECT, 0o600), "O_DIRECT"
        except OSError:  # a file system without O_DIRECT (tmpfs): said in the detail column
            self.fd, direct = os.open(path, flags, 0o600), "NO O_DIRECT (file system refused it)"
        os.posix_fallocate(self.fd, 0, size)
        pinned = "pinned" if self.src.is_pinned() else "pageable"
        self.detail = f"{direct}, {pinned} huge pages, block {fmt_size(self.block)}, depth {self.depth}"

    def write(self):
        seconds, _, disk = measured(
            lambda: (
                ssdtrain._core.raw_transfer(self.fd, self.src.data_ptr(), self.size, self.block, self.depth, True),
                os.fsync(self.fd),
            )
        )
        return seconds, disk

    def read(self):
        self.dst.fill_(0x5A)
        drop_cache(self.fd)
        seconds, _, disk = measured(
            lambda: ssdtrain._core.raw_transfer(self.fd, self.dst.data_ptr(), self.size, self.block, self.depth, False)
        )
        return seconds, disk

    def close(self):
        os.close(self.fd)
        if os.path.exists(self.path):
            os.unlink(self.path)


def _device_ratio(disk, key: str, nbytes: int):
    return round(disk[key + "bytes"] / nbytes, 3) if disk else ""


def _add_contenders(args, size: int, memory: str, backends: list[str], src, dst, contenders: list) -> None:
    """The engine per backend, kvikio per thread count, the ceiling, and the engine (first backend) moving pinned
    huge-page host memory in place: the ceiling's path with the engine's machinery in it. The main rows against it
    show what the staging copies cost (device copies for GPU tensors), it against the ceiling what the engine itself
    costs."""
    contenders += [_EngineContender(args, b, memory, src, dst) for b in backends]
    kvikio, reason = load_kvikio()
    if kvikio is not None:
        path = os.path.join(args.dir, "ssdtrain-bench.kvikio")
        created = []
        try:
            for threads in args.kvikio_threads:
                created.append(_KvikioContender(kvikio, args, threads, memory, src, dst, f"{path}.{threads}"))
        except Exception as e:  # noqa: BLE001 - kvikio unusable here (no driver, no GPU): said once, no rows
            KVIKIO.pop("module", None)
            KVIKIO["reason"] = f"unusable ({type(e).__name__}: {e})"[:200]
            print(f"# kvikio: {KVIKIO['reason']}", flush=True)
            for c in created:
                c.close()
            for leftover in glob.glob(path + ".*"):
                os.unlink(leftover)
            created = []
        contenders += created
    elif not KVIKIO.get("said"):
        print(f"# kvikio: no rows ({reason})", flush=True)
        KVIKIO["said"] = True
    ceiling = None
    if ssdtrain._core.io_uring_status()["usable"]:
        ceiling = _CeilingContender(args, size, os.path.join(args.dir, "ssdtrain-bench.ceiling"))
        contenders.append(ceiling)
    else:
        print("# ceiling: no rows (io_uring not usable here)", flush=True)
    if memory != "host-huge":
        if ceiling is not None:
            hsrc, hdst = ceiling.src, ceiling.dst
        else:
            hsrc, hdst = host_tensor(size, huge=True), host_tensor(size, huge=True)
        contenders.append(_EngineContender(args, backends[0], "host-huge", hsrc, hdst))


def compare_size(args, size: int, memory: str, backends: list[str], samples: list[dict]) -> None:
    """Every contender at one size: a warm-up round (not counted: first touches, thread pools, the engine's file
    growth), then --rounds rounds in which each contender writes (with fsync) and reads back cold, in an order
    rotated by one each round. Appends one dict per contender, op and round to `samples` as they are measured."""
    src = new_tensor(memory, size)
    dst = new_tensor(memory, size, fill=False)
    contenders: list[_Contender] = []
    try:
        _add_contenders(args, size, memory, backends, src, dst, contenders)
    except BaseException:
        for c in contenders:
            c.close()
        raise
    try:
        for rnd in range(args.rounds + 1):
            shift = rnd % len(contenders)
            for c in contenders[shift:] + contenders[:shift]:
                for op in ("seqwrite", "seqread"):
                    seconds, disk = c.write() if op == "seqwrite" else c.read()
                    if op == "seqread" and not torch.equal(c.dst, c.src):
                        raise RuntimeError(f"{c.name} {memory} read of {fmt_size(size)} returned other data")
                    if rnd == 0:
                        continue  # warm-up
                    samples.append(
                        {
                            "contender": c.name,
                            "backend": c.backend,
                            "memory": c.memory,
                            "op": op,
                            "size": size,
                            "round": rnd,
                            "GBps": size / seconds / 1e9,
                            "device_bytes_ratio": _device_ratio(disk, "w" if op == "seqwrite" else "r", size),
                            "detail": c.detail,
                        }
                    )
            if rnd:
                print(f"# {fmt_size(size)} round {rnd}/{args.rounds} done", flush=True)
    finally:
        for c in contenders:
            c.close()


def _median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def summarize(samples: list[dict], args) -> list[dict]:
    """Per size, op and contender: median GB/s and spread over rounds; against kvikio's best thread count (best
    median) and the ceiling, as a ratio of medians and as the range of per-round ratios (same round: the disk's
    drift between rounds cancels)."""
    rows = []
    groups: dict[tuple, list[dict]] = {}
    for s in samples:
        groups.setdefault((s["size"], s["op"], s["contender"]), []).append(s)
    for (size, op, name), runs in groups.items():
        rates = [r["GBps"] for r in runs]
        med = _median(rates)
        ratios = [r["device_bytes_ratio"] for r in runs if r["device_bytes_ratio"] != ""]
        rows.append(
            {
                "contender": name,
                "backend": runs[0]["backend"],
                "memory": runs[0]["memory"],
                "op": op,
                "size": size,
                "block": args.block_size,
                "queue_depth": args.queue_depth,
                "rounds": len(rates),
                "GBps": round(med, 4),
                "GBps_min": round(min(rates), 4),
                "GBps_max": round(max(rates), 4),
                "spread": round((max(rates) - min(rates)) / med, 3) if med else "",
                "samples_GBps": ";".join(f"{x:.3f}" for x in rates),
                "device_bytes_ratio": _median(ratios) if ratios else "",
                "vs_kvikio": "",
                "vs_kvikio_rounds": "",
                "vs_ceiling": "",
                "vs_ceiling_rounds": "",
                "detail": runs[0]["detail"],
                "_by_round": {r["round"]: r["GBps"] for r in runs},
            }
        )
    for row_ in rows:
        same = [r for r in rows if (r["size"], r["op"]) == (row_["size"], row_["op"])]
        kvik = [r for r in same if r["contender"].startswith("kvikio") and r["memory"] == row_["memory"]]
        best = max(kvik, key=lambda r: r["GBps"]) if kvik else None
        ceiling = next((r for r in same if r["contender"] == "ceiling"), None)
        for ref, key in ((best, "vs_kvikio"), (ceiling, "vs_ceiling")):
            if ref is None or ref is row_ or row_["contender"] == "ceiling":
                continue
            row_[key] = round(row_["GBps"] / ref["GBps"], 3)
            paired = [row_["_by_round"][k] / ref["_by_round"][k] for k in row_["_by_round"] if k in ref["_by_round"]]
            if paired:
                row_[key + "_rounds"] = f"{min(paired):.2f}-{max(paired):.2f}"
    for row_ in rows:
        del row_["_by_round"]

    def order(r):
        name = r["contender"]
        kind = 1 if name.startswith("kvikio") else 3 if name == "ceiling" else 2 if r["memory"] == "host-huge" else 0
        threads = int(r["backend"].split()[0]) if kind == 1 else 0
        return r["size"], r["op"] != "seqwrite", kind, threads, r["contender"]

    return sorted(rows, key=order)


def print_compare(rows: list[dict]) -> None:
    head = (
        f"{'size':>5} {'op':8} {'contender':16} {'memory':9} {'GB/s':>6} {'min-max':>11} {'n':>2} {'dev/x':>5} "
        f"{'vs kvikio':>9} {'(rounds)':>11} {'vs ceil':>7} {'(rounds)':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        vk = f"{r['vs_kvikio']:.2f}x" if r["vs_kvikio"] != "" else ""
        vc = f"{r['vs_ceiling']:.2f}x" if r["vs_ceiling"] != "" else ""
        print(
            f"{fmt_size(r['size']):>5} {r['op']:8} {r['contender']:16} {r['memory']:9} {r['GBps']:6.2f} "
            f"{r['GBps_min']:5.2f}-{r['GBps_max']:<5.2f} {r['rounds']:>2} {r['device_bytes_ratio']!s:>5} "
            f"{vk:>9} {r['vs_kvikio_rounds']:>11} {vc:>7} {r['vs_ceiling_rounds']:>11}"
        )
    print("# verdict: the engine (best backend by median) against kvikio's best thread count; target >= 1.2x")
    for size in sorted({r["size"] for r in rows}):
        for op in ("seqwrite", "seqread"):
            same = [r for r in rows if (r["size"], r["op"]) == (size, op)]
            kvik = [r for r in same if r["contender"].startswith("kvikio")]
            # The memory the target is about (GPU tensors where CUDA is present), not the in-place host row.
            ours = [r for r in same if r["contender"].startswith("engine") and r["memory"] != "host-huge"]
            ceiling = next((r for r in same if r["contender"] == "ceiling"), None)
            if not ours:
                continue
            e = max(ours, key=lambda r: r["GBps"])
            line = f"#   {e['memory']} {op} {fmt_size(size)}: {e['contender']} {e['GBps']:.2f} GB/s"
            if ceiling:
                line += f", {e['vs_ceiling']:.2f}x the disk's own rate ({ceiling['GBps']:.2f})"
            if kvik:
                k = max(kvik, key=lambda r: r["GBps"])
                ratio = e["GBps"] / k["GBps"]
                line += (
                    f"; {ratio:.2f}x {k['contender']} ({k['GBps']:.2f}, rounds {e['vs_kvikio_rounds']})"
                    f" -> {'MET' if ratio >= 1.2 else 'MISSED'}"
                )
                if ceiling and ceiling["GBps"] < 1.2 * k["GBps"]:
                    line += (
                        f" (the disk itself gives only {ceiling['GBps'] / k['GBps']:.2f}x kvikio here: 1.2x is above "
                        "what this disk allows)"
                    )
            print(line)
    low = [r for r in rows if r["device_bytes_ratio"] != "" and r["device_bytes_ratio"] < 0.95]
    if low:
        print(
            "# WARNING: the device moved < 95% of the bytes in the timed region for: "
            + ", ".join(f"{r['contender']} {r['op']} {fmt_size(r['size'])}" for r in low)
            + " (a cache answered, or the counters are not this disk's)"
        )


def compare_main(args, backends: list[str], memories: list[str]) -> int:
    memory = "gpu" if "gpu" in memories else "host"
    print(
        f"# same-run comparison: memory {memory}, {args.rounds} rounds (+1 warm-up) per size, contenders in rotated "
        "order; every write timed through an fsync of its file; every read cold: fsync then "
        "posix_fadvise(DONTNEED) on its file right before it (the engine and the ceiling also use O_DIRECT); "
        "dev/x = bytes the device moved / bytes asked (/proc/diskstats, median over rounds)",
        flush=True,
    )
    samples = []
    signal.signal(signal.SIGTERM, _stop)
    try:
        for size in args.sizes:
            compare_size(args, size, memory, backends, samples)
    except Stop as e:
        print(f"# stopped early ({e}): the table holds the rounds that finished", flush=True)
    if not samples:
        return 1
    rows = summarize(samples, args)
    print_compare(rows)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    return 0


# ---------------------------------------------------------------------------------------------- report


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'tool':9} {'backend':10} {'memory':11} {'op':9} {'size':>8} {'block':>6} {'qd':>3} {'GB/s':>7} "
        f"{'cpu s/GB':>8} {'dev/x':>6} {'req KiB':>7}  vs fio   vs host"
    )
    print(head)
    print("-" * len(head))
    fio = {(r["op"], r["size"]): r["GBps"] for r in rows if r["tool"] == "fio"}
    host = {
        (r["backend"], r["op"], r["size"]): r["GBps"] for r in rows if r["tool"] == "ssdtrain" and r["memory"] == "host"
    }
    last_same = None
    for r in rows:
        key = (r["op"], r["size"])
        if r["tool"] == "fio-same":
            last_same = r
        reference = fio.get(key)
        if (
            r["tool"] == "ssdtrain"
            and last_same is not None
            and (last_same["op"], last_same["size"]) == key
            and r["memory"] == "host"
        ):
            reference = last_same["GBps"]  # the same blocks, measured alternately with this engine
        vs_fio = f"{r['GBps'] / reference:6.2f}x" if r["tool"] == "ssdtrain" and reference else "       "
        h = host.get((r["backend"], r["op"], r["size"]))
        other = r["memory"] != "host" and r["tool"] == "ssdtrain"
        vs_host = f"{r['GBps'] / h:6.2f}x" if other and h else ""
        r["vs_fio"] = round(r["GBps"] / reference, 3) if r["tool"] == "ssdtrain" and reference else ""
        r["vs_host"] = round(r["GBps"] / h, 3) if other and h else ""
        print(
            f"{r['tool']:9} {r['backend']:10} {r['memory']:11} {r['op']:9} {fmt_size(r['size']):>8} "
            f"{fmt_size(r['block']):>6} {r['queue_depth']:>3} {r['GBps']:7.2f} {r['cpu_s_per_GB']:8.3f} "
            f"{r['device_bytes_ratio']!s:>6} {r['device_request_KiB']!s:>7}  {vs_fio} {vs_host}"
        )


def print_checks(rows: list[dict]) -> None:
    """Why GPU <-> file can run faster than host <-> file (1 MiB blocks split by the block layer), one line per
    backend/op/size."""
    print("# checks: per backend, op and size: GB/s (average device request KiB, device bytes / bytes asked)")
    groups: dict[tuple, dict] = {}
    for r in rows:
        if r["tool"] == "ssdtrain":
            groups.setdefault((r["backend"], r["op"], r["size"]), {})[r["memory"]] = r
    for (backend, op, size), by_memory in groups.items():
        parts = [
            f"{m} {r['GBps']:.2f} ({r['device_request_KiB']} KiB, {r['device_bytes_ratio']}x)"
            for m, r in by_memory.items()
        ]
        print(f"#   {backend:8} {op:8} {fmt_size(size):>5}: " + "; ".join(parts))
    mode_said = False
    for (backend, op, size), by_memory in groups.items():
        own = groups.get(("io_uring", op, size), {}).get("gpu")
        if backend == "gds" and "gpu" in by_memory and own:
            if not mode_said:
                print(f"# gds mode: {by_memory['gpu']['detail']}")
                mode_said = True
            print(
                f"# gds gpu {op} {fmt_size(size)}: {by_memory['gpu']['GBps']:.2f} GB/s = "
                f"{by_memory['gpu']['GBps'] / own['GBps']:.2f}x our own staging (io_uring gpu)"
            )
    kvik = [r for r in rows if r["tool"] == "kvikio"]
    if kvik:
        print("# kvikio (best thread count) against the engine (best backend), same sizes, same run:")
    for memory in ("gpu", "host"):
        for op in ("seqwrite", "seqread"):
            for size in sorted({r["size"] for r in kvik}):
                theirs = [r for r in kvik if (r["memory"], r["op"], r["size"]) == (memory, op, size)]
                ours = [
                    r
                    for r in rows
                    if r["tool"] == "ssdtrain" and (r["memory"], r["op"], r["size"]) == (memory, op, size)
                ]
                if theirs and ours:
                    k, e = max(theirs, key=lambda r: r["GBps"]), max(ours, key=lambda r: r["GBps"])
                    verdict = f" -> {'MET' if e['GBps'] >= 1.2 * k['GBps'] else 'MISSED'}" if memory == "gpu" else ""
                    print(
                        f"#   {memory} {op} {fmt_size(size)}: engine ({e['backend']}) {e['GBps']:.2f} GB/s, kvikio "
                        f"({k['backend']}) {k['GBps']:.2f} GB/s = {e['GBps'] / k['GBps']:.2f}x"
                        + (f" (target >= 1.2x){verdict}" if memory == "gpu" else "")
                    )
    if not kvik:
        print(f"# kvikio: no rows ({KVIKIO.get('reason') or 'not run'})")
    short = [
        r for r in rows if r["tool"] == "ssdtrain" and r["device_bytes_ratio"] != "" and r["device_bytes_ratio"] < 0.95
    ]
    if short:
        print(
            "# WARNING: the device moved less than 95% of the bytes in: "
            + ", ".join(f"{r['backend']}/{r['memory']}/{r['op']}/{fmt_size(r['size'])}" for r in short)
            + " (a cache answered, or other I/O ran at the same time)"
        )
    else:
        print(
            "# every ssdtrain row: the device moved >= 95% of the bytes inside the timed region (no cache "
            "answered; O_DIRECT in force)"
        )


def fmt_size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dir",
        default=os.environ.get("SSDTRAIN_IO_DIRS", tempfile.gettempdir()).split(os.pathsep)[0],
        help="directory on the disk to measure (not a tmpfs)",
    )
    p.add_argument("--sizes", default="64M,256M,1G", help="comma-separated tensor sizes")
    p.add_argument("--block-size", default="1M", help="bytes per request of the engine and the references (e.g. 1M)")
    p.add_argument("--queue-depth", type=int, default=32, help="requests in flight in the engine")
    p.add_argument(
        "--staging-buffers", type=int, default=None, help="pinned staging buffers of the engine (default: its own)"
    )
    p.add_argument("--engine-threads", type=int, default=4, help="driver threads of ssdtrain's engine")
    p.add_argument("--threads", type=int, default=8, help="threads of the plain pread/pwrite reference")
    p.add_argument("--random-count", type=int, default=1024, help="1 MiB random reads per run (0: skip)")
    p.add_argument("--random-depth", type=int, default=16, help="random reads in flight")
    p.add_argument("--backends", default="", help="comma-separated; default: every backend usable here")
    p.add_argument("--memory", default="", help="host,gpu (default: gpu too where CUDA is available)")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions per row (median kept)")
    p.add_argument("--checksum", action="store_true", help="also run the engine with crc32c checksums on every block")
    p.add_argument("--no-references", action="store_true", help="skip fio, dd, the pthreads loop and kvikio")
    p.add_argument("--kvikio-threads", default="1,4,16", help="kvikio thread counts to measure (best one compared)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="only the same-run comparison: the engine (--backends, default: its automatic choice), kvikio at each "
        "--kvikio-threads and the disk's own rate (O_DIRECT io_uring to pinned host memory) in interleaved rounds, "
        "GPU tensors where CUDA is available",
    )
    p.add_argument("--rounds", type=int, default=5, help="--compare: timed rounds per size (median and spread)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    p.add_argument("--csv", default="", help="write every row here")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeat, args.random_count, args.random_depth = "1M,4M", 1, 16, 4
        args.rounds = min(args.rounds, 3)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    args.sizes = parse_sizes(args.sizes)
    args.kvikio_threads = [int(t) for t in args.kvikio_threads.split(",") if t]
    args.block_size = ssdtrain.io.parse_size(args.block_size)
    need = (
        max(args.sizes) * (4 + len(args.kvikio_threads)) + 256 * MiB
        if args.compare
        else 3 * max(args.sizes) + args.random_count * MiB
    )
    if shutil.disk_usage(args.dir).free < need:
        raise SystemExit(f"not enough free space in {args.dir} for sizes up to {fmt_size(max(args.sizes))}")

    backends = (
        args.backends.split(",")
        if args.backends
        else (
            (["io_uring"] if ssdtrain._core.io_uring_status()["usable"] else [])
            + ["threads"]
            + (["gds"] if torch.cuda.is_available() and ssdtrain.backends()["gds"]["usable"] else [])
        )
    )
    memories = (
        args.memory.split(",") if args.memory else [m for m in MEMORIES if m != "gpu" or torch.cuda.is_available()]
    )
    for m in memories:
        if m not in MEMORIES:
            raise SystemExit(f"unknown memory {m!r}: use {', '.join(MEMORIES)}")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(
        f"# ssdtrain I/O benchmark: dir={args.dir} block={fmt_size(args.block_size)} qd={args.queue_depth} "
        f"repeat={args.repeat} cpus={os.cpu_count()} gpu={gpu}",
        flush=True,
    )
    global DISK
    DISK = Disk(args.dir)
    thp = ""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    print(f"# device {DISK.name or 'unknown'}: {DISK.queue()}; transparent huge pages: {thp}", flush=True)
    if args.compare:
        return compare_main(args, args.backends.split(",") if args.backends else ["auto"], memories)
    print(
        "# columns: dev/x = bytes the device moved in that direction during the timed run / bytes asked for "
        "(from /proc/diskstats; ~1.0 means the data really went to/came from the device, 0 means a cache "
        "answered); req KiB = average size of the device's requests (a 1M request split by the block layer shows "
        "less); vs host = this row / the same backend's 'host' row",
        flush=True,
    )

    # Per size, the references and every engine back to back, so drift in a shared disk's speed hits all alike.
    engines = {}
    for backend in backends:
        engines[backend, False] = make_engine(args, backend)
        if "host-4k" in memories and backend != "gds":  # gds moves host memory with the threads backend's code
            engines[backend, True] = make_engine(args, backend, stage_host="off")
    for (backend, _), engine in engines.items():
        st = engine.stats()
        flags = ", ".join(f"{d['path']}: O_DIRECT {o_direct(d['fd'])}" for d in engine.directories())
        print(
            f"# {backend} (stage_host={engine.settings['stage_host']}): {engine.backend_detail}; files: {flags}; "
            f"staging "
            f"buffer segments per {fmt_size(args.block_size)}: "
            f"{segments_per_block(st['staging_address'], st['staging_bytes'], args.block_size)}",
            flush=True,
        )
    rows = []
    try:
        measure_all(args, backends, memories, engines, rows)
    except Stop as e:  # timeout(1) sends SIGTERM: still report what was measured
        print(f"# stopped early ({e}): the table holds what was measured before", flush=True)
    for engine in engines.values():
        engine.close()
    if not rows:
        return 1
    print_table(rows)
    print_checks(rows)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    for failure in FAILURES:
        print(f"# FAILED {failure}")
    return 1 if FAILURES else 0


FAILURES: list[str] = []


class Stop(Exception):
    pass


def _stop(signum, frame):
    raise Stop(signal.Signals(signum).name)


def measure_all(args, backends, memories, engines, rows) -> None:
    signal.signal(signal.SIGTERM, _stop)
    for size in args.sizes:
        if not args.no_references:
            rows += fio_rows(args, size) + dd_rows(args, size) + pthread_rows(args, size)
            rows += kvikio_rows(args, size, memories)
        for backend in backends:
            for memory in memories:
                if (backend, memory == "host-4k") not in engines:
                    continue
                engine = engines[backend, memory == "host-4k"]
                try:
                    rows += engine_seq_rows(args, engine, backend, memory, size, backend == backends[0])
                except Exception as e:  # noqa: BLE001 - report it, measure the rest, exit non-zero at the end
                    FAILURES.append(f"{backend}/{memory}/{fmt_size(size)}: {type(e).__name__}: {e}")
                    print(f"# FAILED {FAILURES[-1]}", flush=True)
    if args.random_count:
        if not args.no_references:
            rows += fio_rows(args, None)
        for backend in backends:
            for memory in memories:
                if (backend, memory == "host-4k") not in engines:
                    continue
                try:
                    rows += engine_random_rows(args, engines[backend, memory == "host-4k"], backend, memory)
                except Exception as e:  # noqa: BLE001
                    FAILURES.append(f"{backend}/{memory}/randread: {type(e).__name__}: {e}")
                    print(f"# FAILED {FAILURES[-1]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
