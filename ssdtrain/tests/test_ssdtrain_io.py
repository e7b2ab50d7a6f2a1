"""Round trips through every CPU-usable backend, in every alignment and size class, and the Future API."""

import errno
import gc
import os
import subprocess
import sys
import threading

import pytest
import torch
from ssdtrain_testutil import random_tensor

import ssdtrain

SIZES = [1, 100, 4095, 4096, 4097, 65536 + 3, (1 << 20) - 1, 1 << 20, (3 << 20) + 17, 9 << 20]


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("alignment", ["aligned", "unaligned"])
def test_round_trip_sizes(engine_factory, backend, nbytes, alignment):
    engine = engine_factory(backend=backend, checksum=True)
    src = random_tensor(nbytes, seed=nbytes)
    if alignment == "aligned":
        aligned = ssdtrain.aligned_empty(nbytes)
        aligned.copy_(src)
        src = aligned
    else:
        raw = torch.empty(nbytes + 1, dtype=torch.uint8)
        src = raw[1:].copy_(src)
    fut = engine.write(src)
    handle = fut.result(timeout=30)
    assert handle.nbytes == nbytes
    out = torch.full((nbytes,), 7, dtype=torch.uint8)  # poisoned
    got = engine.read(handle, out=out).result(timeout=30)
    assert got is out
    assert torch.equal(out, src)
    # And into an aligned buffer, which takes the direct path on O_DIRECT files.
    back = engine.read(handle).result(timeout=30)
    assert back.dtype == src.dtype and back.shape == src.shape and torch.equal(back, src)
    engine.free(handle)


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_dtypes_and_shapes(engine_factory, backend, direct):
    engine = engine_factory(backend=backend, direct=direct)
    tensors = [
        torch.randn(3, 5, 7, dtype=torch.float32),
        torch.randn(1000, dtype=torch.float64),
        torch.randn(64, 33, dtype=torch.bfloat16),
        torch.randint(-(2**40), 2**40, (999,), dtype=torch.int64),
        torch.rand(17) > 0.5,
    ]
    futures = [engine.write(t) for t in tensors]
    reads = [engine.read(f.handle) for f in futures]  # issued before the writes finished: ordered after them
    for t, r in zip(tensors, reads, strict=True):
        back = r.result(timeout=30)
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back, t)


def test_many_concurrent_transfers(engine_factory, backend):
    engine = engine_factory(backend=backend, queue_depth=16, staging_buffers=4, block_size="64K")
    tensors = [random_tensor(n, seed=n) for n in range(1000, 400_000, 13_337)]
    writes = [engine.write(t) for t in tensors]
    reads = [engine.read(w.handle) for w in reversed(writes)]
    for t, r in zip(reversed(tensors), reads, strict=True):
        assert torch.equal(r.result(timeout=60), t)
    stats = engine.stats()
    assert stats["write_ops"] == len(tensors) and stats["read_ops"] == len(tensors)
    assert stats["errors"] == 0
    assert stats["peak_inflight_blocks"] >= 1
    assert 1 <= stats["peak_queue_depth"] <= 16  # the ring (or the worker pool) never holds more than its depth
    assert stats["queue_depth_in_use"] == 0


def test_reads_from_several_threads(engine_factory, backend):
    engine = engine_factory(backend=backend)
    tensors = [random_tensor(200_000 + i, seed=i) for i in range(8)]
    handles = [engine.write(t).result() for t in tensors]
    errors = []

    def worker(i):
        try:
            for _ in range(5):
                assert torch.equal(engine.read(handles[i]).result(timeout=30), tensors[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_future_api(engine_factory, backend):
    engine = engine_factory(backend=backend)
    src = random_tensor(5 << 20)
    fut = engine.write(src)
    assert isinstance(fut.handle, ssdtrain.Handle)
    assert fut.wait(timeout=30) is True
    assert fut.done() and fut.staged()
    assert fut.exception() is None
    assert fut.seconds > 0
    assert fut.nbytes == src.numel()
    read = engine.read(fut.handle)
    read.wait_stream()  # CPU: just waits and raises
    assert read.done() and torch.equal(read.result(), src)


def test_extents_are_reused_across_steps(engine_factory, backend):
    engine = engine_factory(backend=backend, block_size="64K")
    sizes = [300_000, 1_000_000, 70_000, 2_500_000]
    for step in range(6):
        futs = [engine.write(random_tensor(n, seed=step + n)) for n in sizes]
        handles = [f.result() for f in futs]
        for h in handles:
            engine.free(h)
        if step == 0:
            first = engine.stats()["file_bytes"]
    stats = engine.stats()
    assert stats["bytes_in_use"] == 0 and stats["live_handles"] == 0
    assert stats["file_bytes"] == first  # steady state: no growth after the first step


def test_striping_over_directories(tmp_path, backend):
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for d in dirs:
        d.mkdir()
    with ssdtrain.Engine(
        dirs, backend=backend, capacity_per_directory="64M", block_size="64K", stripe_threshold="256K", checksum=True
    ) as engine:
        big = random_tensor(3_000_001, seed=3)
        handle = engine.write(big).result()
        used = [d["bytes_in_use"] for d in engine.directories()]
        assert all(u > 0 for u in used), used  # one large tensor spans every directory
        assert torch.equal(engine.read(handle).result(), big)
        small = [engine.write(random_tensor(10_000, seed=i)).result() for i in range(3)]
        assert len({engine.directories()[i]["path"] for i in range(3)}) == 3
        assert all(d["bytes_in_use"] > used[i] for i, d in enumerate(engine.directories()))  # round robin
        for h in small + [handle]:
            engine.free(h)
        assert all(d["bytes_in_use"] == 0 for d in engine.directories())


def test_files_are_anonymous(tmp_path, backend):
    with ssdtrain.Engine([tmp_path], backend=backend, capacity_per_directory="16M") as engine:
        engine.write(random_tensor(100_000)).result()
        assert engine.directories()[0]["tmpfile"] is True  # ext4/xfs/tmpfs have O_TMPFILE
        assert list(tmp_path.iterdir()) == []  # nothing named: nothing left after a crash


def test_tensor_freed_while_write_in_flight(engine_factory, backend):
    engine = engine_factory(backend=backend, queue_depth=2, staging_buffers=1, block_size="4K")
    src = random_tensor(4 << 20, seed=11)
    expected = src.clone()
    fut = engine.write(src)
    del src
    gc.collect()
    # The engine holds the tensor until the write completes, so its memory cannot be reused meanwhile.
    torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
    assert torch.equal(engine.read(fut.handle).result(timeout=60), expected)


def test_free_while_transfers_run(engine_factory, backend):
    engine = engine_factory(backend=backend, block_size="4K", queue_depth=2)
    src = random_tensor(2 << 20, seed=5)
    fut = engine.write(src)
    read = engine.read(fut.handle)
    engine.free(fut.handle)  # space returns after the write and read finish
    assert torch.equal(read.result(timeout=60), src)
    engine.drain()
    assert engine.stats()["bytes_in_use"] == 0


def test_telemetry(engine_factory, backend):
    engine = engine_factory(backend=backend, block_size="64K")
    src = random_tensor(1_000_000)
    h = engine.write(src).result()
    engine.read(h).result()
    s = engine.stats()
    assert s["bytes_written"] == 1_000_000 and s["bytes_read"] == 1_000_000
    assert s["write_ops"] == 1 and s["read_ops"] == 1
    assert s["disk_bytes_written"] >= 1_000_000 and s["disk_bytes_written"] % 4096 == 0
    assert s["write_blocks"] >= 16 and s["read_blocks"] >= 16  # 1 MB in 64 KiB blocks
    assert s["write_bandwidth_gbps"] > 0 and s["read_bandwidth_gbps"] > 0
    assert s["inflight_blocks"] == 0 and s["peak_inflight_blocks"] >= 1
    assert s["wait_seconds"] >= 0 and s["bytes_in_use"] >= 1_000_000


def test_backend_reports(engine_factory, backend):
    engine = engine_factory(backend=backend)
    assert engine.backend_name == backend
    assert engine.backend_detail
    if backend == "io_uring":
        assert "fixed files yes" in engine.backend_detail


def test_auto_backend_picks_io_uring_when_usable(engine_factory):
    engine = engine_factory(backend="auto")
    expected = "io_uring" if ssdtrain._core.io_uring_status()["usable"] else "threads"
    assert engine.backend_name == expected


def test_crc32c_known_values():
    assert ssdtrain._core.crc32c(b"123456789") == 0xE3069283
    assert ssdtrain._core.crc32c(b"") == 0
    data = bytes(range(256)) * 1000  # long enough for the 3-stream hardware path
    whole = ssdtrain._core.crc32c(data)
    assert ssdtrain._core.crc32c(data[100_000:], ssdtrain._core.crc32c(data[:100_000])) == whole


def test_io_uring_built_and_usable_where_liburing_is_installed():
    # CI installs liburing-dev: this fails (rather than silently skipping the io_uring tests) if the build missed it.
    try:
        found = subprocess.run(["pkg-config", "--exists", "liburing"], check=False).returncode == 0
    except FileNotFoundError:
        pytest.skip("no pkg-config here")
    if not found:
        pytest.skip("liburing-dev is not installed")
    status = ssdtrain._core.io_uring_status()
    assert status["compiled"], status
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            disabled = int(f.read())
    except OSError:
        disabled = 0
    if disabled:
        pytest.skip(f"io_uring disabled by sysctl (kernel.io_uring_disabled={disabled})")
    assert status["usable"], status


def test_info_cli_reports_backends():
    out = subprocess.run([sys.executable, "-m", "ssdtrain", "info"], capture_output=True, text=True, check=True).stdout
    for name in ("io_uring:", "gds:", "threads:", "selected:"):
        assert name in out


def test_info_reports_backends():
    lines = ssdtrain._backend_lines()
    assert {"io_uring", "gds", "threads"} <= set(lines)
    assert ssdtrain.backends()["io_uring"]["compiled"] in (True, False)


@pytest.mark.parametrize("nbytes", [4096, (1 << 20) + 4096, (3 << 20) + 17])
@pytest.mark.parametrize(
    ("memory", "stage_host", "staged"),
    [
        ("torch", "auto", True),  # scattered 4 KiB pages: copied through the huge-page staging buffers
        ("torch", "off", False),  # moved from its own pages (page-aligned whole pages)
        ("torch", "on", True),
        ("huge", "auto", False),  # huge_empty(): physically contiguous already, moved in place
        ("huge", "on", True),
    ],
)
def test_stage_host_paths(engine_factory, backend, nbytes, memory, stage_host, staged):
    engine = engine_factory(backend=backend, stage_host=stage_host, checksum=True)
    direct = engine.directories()[0]["direct"]
    src = ssdtrain.huge_empty(nbytes, pin_memory=False) if memory == "huge" else ssdtrain.aligned_empty(nbytes)
    src.copy_(random_tensor(nbytes, seed=nbytes + 1))
    handle = engine.write(src).result(timeout=30)
    out = ssdtrain.huge_empty(nbytes, pin_memory=False) if memory == "huge" else ssdtrain.aligned_empty(nbytes)
    out.fill_(0x5A)  # poisoned
    engine.read(handle, out=out).result(timeout=30)
    assert torch.equal(out, src)
    whole_pages = nbytes // 4096
    copies = engine.stats()["staged_copies"]
    if staged and direct:
        assert copies >= 2 * (nbytes // (1 << 20))  # every block of both directions went through a buffer
        assert copies >= 2
    else:
        # Only a partial last page is staged (O_DIRECT needs whole pages); without O_DIRECT nothing is.
        assert copies == (0 if nbytes == whole_pages * 4096 or not direct else 2)
    assert ("host tensors staged" in engine.backend_detail) == (stage_host == "on")


def test_huge_empty_is_aligned_and_tracked():
    from ssdtrain import io

    t = ssdtrain.huge_empty((3, 1 << 20), dtype=torch.float32, pin_memory=False)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32
    assert t.data_ptr() % (2 << 20) == 0
    assert io._is_huge(t.data_ptr(), t.numel() * 4)
    view = t[1]
    del t
    gc.collect()
    assert io._is_huge(view.data_ptr(), view.numel() * 4)  # a view keeps the memory (and its tracking) alive
    address = view.data_ptr()
    del view
    gc.collect()
    assert not io._is_huge(address, 4)
    with pytest.raises(ValueError, match="stage_host"):
        ssdtrain.configure(stage_host="sometimes")


def test_cufile_config_allows_compat_mode(monkeypatch, tmp_path):
    import json

    monkeypatch.delenv("CUFILE_ENV_PATH_JSON", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    path = ssdtrain.cufile_config()
    assert path.startswith(str(tmp_path)) and os.environ["CUFILE_ENV_PATH_JSON"] == path
    with open(path) as f:
        config = json.load(f)
    assert config["properties"]["allow_compat_mode"] is True
    assert config["logging"]["dir"] == str(tmp_path)  # cuFile's log does not land in the working directory
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", "/etc/mine.json")
    assert ssdtrain.cufile_config() == "/etc/mine.json"  # the user's own config wins


def test_add_done_callback(engine_factory, backend):
    engine = engine_factory(backend=backend, block_size="64K")
    src = random_tensor(8 << 20, seed=5)
    seen = []
    done = threading.Event()
    fut = engine.write(src)
    fut.add_done_callback(lambda f: (seen.append((f.done(), threading.current_thread().name)), done.set()))
    assert done.wait(30)
    assert seen[0][0] is True
    later = []
    fut.add_done_callback(lambda f: later.append(threading.current_thread().name))  # already done: runs here
    assert later == [threading.current_thread().name]
    # A failed transfer calls back too, and the callback sees the failure.
    failing = engine_factory(backend=backend, block_size="4K", _fault=("write", errno.EIO, 0))
    errors = []
    got = threading.Event()
    bad = failing.write(src)
    bad.add_done_callback(lambda f: (errors.append(f.exception()), got.set()))
    assert got.wait(30)
    assert isinstance(errors[0], OSError) and errors[0].errno == errno.EIO
    with pytest.raises(TypeError):
        fut.add_done_callback(42)


class _FinishesBetweenReads:
    """A transfer that reads as not done twice (add_done_callback's check, then the callback thread's first look)
    and as done from then on: the moment a real transfer finishing under load hits between two reads."""

    def __init__(self):
        self.reads = 0

    def done(self):
        self.reads += 1
        return self.reads > 2

    def wait(self, timeout=None):  # (not a read: the callback thread ignores what it returns)
        threading.Event().wait(timeout or 0)
        return self.reads > 2


def test_a_callback_is_called_when_its_transfer_finishes_between_two_reads():
    # The callback thread read done() twice per pending transfer (once to fire, once to keep waiting): a transfer
    # finishing between the two was in neither list and its callback was never called (test_add_done_callback
    # waited 30 s for it on the 2-core CI machine).
    from ssdtrain import io as ssd_io

    fired = threading.Event()
    ssd_io.Future(_FinishesBetweenReads(), None, None).add_done_callback(lambda f: fired.set())
    assert fired.wait(10)


def test_add_done_callback_error_is_reported(engine_factory, monkeypatch):
    engine = engine_factory(backend="threads")
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    fut = engine.write(random_tensor(4096, seed=1))
    fut.result(timeout=30)
    fut.add_done_callback(lambda f: 1 / 0)
    assert len(reports) == 1 and isinstance(reports[0].exc_value, ZeroDivisionError)


class _DoneAfterFirstRead:
    """A transfer that reads as not done once (add_done_callback's check), then as done: its callback runs on the
    callback thread."""

    def __init__(self):
        self.reads = 0

    def done(self):
        self.reads += 1
        return self.reads > 1

    def wait(self, timeout=None):
        return self.reads > 1


def test_a_callback_raising_system_exit_leaves_the_callback_thread_working(monkeypatch):
    # A callback raising a BaseException that is no Exception (sys.exit() in it) ended the callback thread: every
    # later callback of the process was silently never called.
    from ssdtrain import io as ssd_io

    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    first = threading.Event()

    def exits(f):
        first.set()
        raise SystemExit("exit from a callback")

    ssd_io.Future(_DoneAfterFirstRead(), None, None).add_done_callback(exits)
    assert first.wait(10)
    fired = threading.Event()
    ssd_io.Future(_DoneAfterFirstRead(), None, None).add_done_callback(lambda f: fired.set())
    assert fired.wait(10)
    assert any(isinstance(r.exc_value, SystemExit) for r in reports)
