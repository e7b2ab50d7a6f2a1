"""Bad input and faults: each raises a Python exception (OSError with errno where one exists) or is prevented,
and no read returns wrong data silently."""

import errno
import os

import pytest
import torch
from ssdtrain_testutil import mounted_tmpfs, random_tensor

import ssdtrain

# ---------------------------------------------------------------------------------------------- disk full


def test_cap_reached_raises_enospc_before_any_io(engine_factory, backend):
    engine = engine_factory(backend=backend, capacity_per_directory="1M", block_size="64K")
    h = engine.write(random_tensor(700_000)).result()
    with pytest.raises(OSError) as info:
        engine.write(random_tensor(700_000))
    assert info.value.errno == errno.ENOSPC
    assert "capacity_per_directory" in str(info.value)  # the message names the fix
    engine.free(h)
    h2 = engine.write(random_tensor(700_000, seed=1)).result()  # space came back
    assert torch.equal(engine.read(h2).result(), random_tensor(700_000, seed=1))


def test_small_tmpfs_full_at_growth(tmp_path, backend):
    with mounted_tmpfs(tmp_path / "small", "2m") as small:
        with ssdtrain.Engine([small], backend=backend, capacity_per_directory="64M", block_size="64K") as engine:
            ok = engine.write(random_tensor(1 << 20)).result()
            with pytest.raises(OSError) as info:
                engine.write(random_tensor(4 << 20))  # the file cannot grow: the file system is full
            assert info.value.errno == errno.ENOSPC
            assert torch.equal(engine.read(ok).result(), random_tensor(1 << 20))  # earlier data intact


def test_small_tmpfs_full_at_preallocation(tmp_path, backend):
    with mounted_tmpfs(tmp_path / "small", "1m") as small:
        with pytest.raises(OSError) as info:
            ssdtrain.Engine([small], backend=backend, capacity_per_directory="8M", preallocate_per_directory="8M")
        assert info.value.errno == errno.ENOSPC


@pytest.mark.parametrize("after", [0, 3 * 65536])
def test_injected_enospc_during_write(engine_factory, backend, after):
    engine = engine_factory(backend=backend, block_size="64K", _fault=("write", errno.ENOSPC, after))
    fut = engine.write(random_tensor(1 << 20))
    with pytest.raises(OSError) as info:
        fut.result(timeout=30)
    assert info.value.errno == errno.ENOSPC
    assert "write of handle" in str(info.value)
    # The handle exists but holds nothing valid: reading it raises rather than returning stale bytes.
    with pytest.raises(OSError) as info:
        engine.read(fut.handle).result(timeout=30)
    assert info.value.errno == errno.ENOSPC and "write failed" in str(info.value)
    assert engine.stats()["errors"] == 2


def test_injected_eio_during_read(engine_factory, backend):
    engine = engine_factory(backend=backend, block_size="64K", _fault=("read", errno.EIO, 5 * 65536))
    src = random_tensor(1 << 20)
    h = engine.write(src).result()
    out = torch.zeros(1 << 20, dtype=torch.uint8)
    with pytest.raises(OSError) as info:
        engine.read(h, out=out).result(timeout=30)
    assert info.value.errno == errno.EIO


def test_injected_eio_device_staged_path_unaligned(engine_factory, backend):
    # Unaligned host memory goes through staging buffers: errors there are reported the same way.
    engine = engine_factory(backend=backend, block_size="4K", staging_buffers=2, _fault=("write", errno.EIO, 8192))
    raw = torch.empty(100_001, dtype=torch.uint8)
    with pytest.raises(OSError) as info:
        engine.write(raw[1:]).result(timeout=30)
    assert info.value.errno == errno.EIO


# ---------------------------------------------------------------------------------------------- O_DIRECT


def test_tmpfs_directory_works(backend):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm tmpfs here")
    # Linux >= 6.6 tmpfs accepts O_DIRECT; older ones refuse it and auto falls back to buffered I/O. Either way works.
    with ssdtrain.Engine(["/dev/shm"], backend=backend, capacity_per_directory="16M") as engine:
        src = random_tensor(300_001)
        assert torch.equal(engine.read(engine.write(src).handle).result(), src)


def test_file_system_without_o_direct_and_direct_on_raises(tmp_path, backend):
    with pytest.raises(OSError) as info:
        ssdtrain.Engine([tmp_path], backend=backend, capacity_per_directory="16M", direct="on", _fault=("direct", 0, 0))
    assert info.value.errno == errno.EINVAL
    assert "O_DIRECT" in str(info.value) and "direct='auto'" in str(info.value)


def test_file_system_without_o_direct_falls_back_in_auto(tmp_path, backend):
    with ssdtrain.Engine(
        [tmp_path], backend=backend, capacity_per_directory="16M", direct="auto", _fault=("direct", 0, 0)
    ) as engine:
        assert engine.directories()[0]["direct"] is False
        raw = torch.empty(300_002, dtype=torch.uint8)
        src = raw[2:].copy_(random_tensor(300_000))
        assert torch.equal(engine.read(engine.write(src).handle).result(), src)


# ---------------------------------------------------------------------------------------------- directories


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="create it"):
        ssdtrain.Engine([tmp_path / "nope"], capacity_per_directory="1M")


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError):
        ssdtrain.Engine([f], capacity_per_directory="1M")


def test_missing_directory_reported_by_core(tmp_path):
    # The C++ store checks too (a directory removed between the Python check and the open).
    cfg = ssdtrain._core.EngineConfig()
    cfg.directories = [str(tmp_path / "gone")]
    cfg.capacity_per_directory = 1 << 20
    with pytest.raises(FileNotFoundError):
        ssdtrain._core.Engine(cfg)


def test_read_only_directory(tmp_path):
    with mounted_tmpfs(tmp_path / "ro", "1m", "ro") as ro:
        with pytest.raises(OSError) as info:
            ssdtrain.Engine([ro], capacity_per_directory="1M")
        assert info.value.errno in (errno.EROFS, errno.EACCES)
        assert "writable directory" in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_unwritable_directory(tmp_path):
    d = tmp_path / "locked"
    d.mkdir(mode=0o500)
    with pytest.raises(PermissionError):
        ssdtrain.Engine([d], capacity_per_directory="1M")


# ---------------------------------------------------------------------------------------------- handles


def test_unknown_freed_and_foreign_handles(engine_factory, backend):
    engine = engine_factory(backend=backend)
    other = engine_factory(backend=backend)
    h = engine.write(random_tensor(1000)).result()
    engine.free(h)
    with pytest.raises(ValueError, match="already freed"):
        engine.read(h)
    with pytest.raises(ValueError, match="already freed"):
        engine.free(h)
    forged = ssdtrain.Handle(999, 1000, (1000,), torch.uint8, torch.device("cpu"), False, h._engine_id)
    with pytest.raises(ValueError, match="no write returned"):
        engine.read(forged)
    foreign = other.write(random_tensor(1000)).result()
    with pytest.raises(ValueError, match="another Engine"):
        engine.read(foreign)
    with pytest.raises(TypeError):
        engine.read(3)


def test_wrong_output_size_and_layout(engine_factory):
    engine = engine_factory()
    h = engine.write(random_tensor(4096)).result()
    with pytest.raises(ValueError, match="bytes"):
        engine.read(h, out=torch.empty(4095, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        engine.read(h, out=torch.empty(128, 64, dtype=torch.uint8).t())
    # Same byte size, another dtype: allowed (bytes are bytes).
    assert engine.read(h, out=torch.empty(1024, dtype=torch.float32)).result().numel() == 1024


def test_bad_inputs(engine_factory):
    engine = engine_factory()
    with pytest.raises(ValueError, match="empty"):
        engine.write(torch.empty(0))
    with pytest.raises(ValueError, match="contiguous"):
        engine.write(torch.randn(8, 8).t())
    with pytest.raises(TypeError):
        engine.write([1, 2, 3])
    with pytest.raises(ValueError, match="multiple of 4096"):
        ssdtrain.Engine(block_size=1000)
    with pytest.raises(ValueError, match="backend.*is not one of auto, io_uring"):
        ssdtrain.Engine(backend="spdk")
    with pytest.raises(ValueError, match="direct"):
        ssdtrain.Engine(direct="maybe")


def test_closed_engine(engine_factory):
    engine = engine_factory()
    h = engine.write(random_tensor(10)).result()
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.read(h)


def test_gds_without_gpu_is_unavailable(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ssdtrain.UnavailableError, match="gds"):
        ssdtrain.Engine([tmp_path], backend="gds", capacity_per_directory="1M")


@pytest.fixture
def env_settings(monkeypatch):
    """Re-read the I/O settings from the environment inside a test; the process's own again after it."""

    def read():
        ssdtrain.settings.reload()
        return ssdtrain.defaults()

    yield read
    monkeypatch.undo()
    ssdtrain.settings.reload()


def test_env_settings(monkeypatch, tmp_path, env_settings):
    monkeypatch.setenv("SSDTRAIN_IO_BACKEND", "threads")
    monkeypatch.setenv("SSDTRAIN_IO_DIRS", f"{tmp_path}")
    monkeypatch.setenv("SSDTRAIN_IO_DIR_CAP", "8M")
    monkeypatch.setenv("SSDTRAIN_IO_BLOCK_SIZE", "128K")
    d = env_settings()
    assert d["backend"] == "threads" and d["directories"] == [str(tmp_path)]
    assert d["capacity_per_directory"] == 8 << 20 and d["block_size"] == 128 << 10
    with ssdtrain.Engine() as engine:
        assert engine.backend_name == "threads"
        assert engine.directories()[0]["capacity"] == 8 << 20
    ssdtrain.configure(backend="auto", block_size="64K")
    try:
        assert ssdtrain.defaults()["backend"] == "auto" and ssdtrain.defaults()["block_size"] == 65536
    finally:
        ssdtrain.configure(backend=None, block_size=None)
    assert ssdtrain.defaults()["backend"] == "threads"
    monkeypatch.setenv("SSDTRAIN_IO_QUEUE_DEPTH", "zero")
    with pytest.raises(ValueError, match="SSDTRAIN_IO_QUEUE_DEPTH"):
        env_settings()
    monkeypatch.setenv("SSDTRAIN_IO_QUEUE_DEPTH", "8")
    monkeypatch.setenv("SSDTRAIN_IO_CHECKSUM", "on")
    monkeypatch.setenv("SSDTRAIN_IO_DIRECT", "0")
    d = env_settings()
    assert d["checksum"] is True and d["direct"] == "off" and d["queue_depth"] == 8
    monkeypatch.setenv("SSDTRAIN_IO_DIRECT", "sometimes")
    with pytest.raises(ValueError, match="SSDTRAIN_IO_DIRECT.*auto"):
        env_settings()
    with pytest.raises(TypeError, match="unknown setting"):
        ssdtrain.configure(speed="fast")


# ---------------------------------------------------------------------------------------------- checksums


@pytest.mark.parametrize("aligned", [True, False])
def test_checksum_mismatch_raises(engine_factory, backend, aligned):
    engine = engine_factory(backend=backend, checksum=True, block_size="64K")
    src = random_tensor(300_000, seed=9)
    h = engine.write(src).result()
    engine._corrupt_for_test(h, offset=200_000, nbytes=3)
    out = ssdtrain.aligned_empty(300_000) if aligned else torch.empty(300_001, dtype=torch.uint8)[1:]
    with pytest.raises(ssdtrain.ChecksumError) as info:
        engine.read(h, out=out).result(timeout=30)
    assert info.value.errno == errno.EBADMSG and "corrupt" in str(info.value)
    assert engine.stats()["checksum_failures"] == 1
