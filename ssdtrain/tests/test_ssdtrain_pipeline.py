"""The staged block pipeline (staging buffers fewer and more than the queue depth, a tail that is not a block
multiple, reads of a handle while its write is in flight) and the raw io_uring transfer the benchmark's disk
ceiling is measured with. CUDA variants of the pipeline are in test_ssdtrain_gpu.py."""

import errno
import os

import pytest
import torch
from ssdtrain_testutil import random_tensor

import ssdtrain
from ssdtrain import _core

BLOCK = 64 << 10
# Many blocks plus a tail that is neither a block nor a page multiple.
NBYTES = 37 * BLOCK + 4099


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """The same bytes one byte off a page boundary: forced through the staging buffers on O_DIRECT files."""
    raw = torch.empty(t.numel() + 1, dtype=torch.uint8)
    return raw[1:].copy_(t)


@pytest.mark.parametrize(("staging", "depth"), [(1, 4), (3, 2), (6, 4), (40, 8)])
@pytest.mark.parametrize("checksum", [False, True])
def test_staged_round_trip_is_exact(engine_factory, backend, staging, depth, checksum):
    engine = engine_factory(
        backend=backend, block_size=BLOCK, staging_buffers=staging, queue_depth=depth, checksum=checksum
    )
    src = _unaligned(random_tensor(NBYTES, seed=staging * 7 + depth))
    handle = engine.write(src).result(timeout=60)
    for out in (_unaligned(torch.full((NBYTES,), 0x5A, dtype=torch.uint8)), ssdtrain.aligned_empty(NBYTES)):
        out.fill_(0x5A)  # poisoned: a block that moved nothing cannot pass
        engine.read(handle, out=out).result(timeout=60)
        mismatch = (out != src).nonzero()
        assert mismatch.numel() == 0, f"first wrong byte at {int(mismatch[0])} of {NBYTES}"
    assert engine.stats()["staged_copies"] >= 2 * 38
    engine.free(handle)


def test_reads_issued_while_the_write_is_in_flight(engine_factory, backend):
    engine = engine_factory(backend=backend, block_size=BLOCK, staging_buffers=4, queue_depth=4)
    sources = [_unaligned(random_tensor(NBYTES + i * 4097, seed=i)) for i in range(4)]
    writes = [engine.write(s) for s in sources]
    # Issued at once: each read is ordered after its handle's write inside the engine.
    reads = [engine.read(w.handle, out=_unaligned(torch.zeros_like(s))) for w, s in zip(writes, sources, strict=True)]
    for r, s in zip(reads, sources, strict=True):
        assert torch.equal(r.result(timeout=60), s)
    assert engine.stats()["errors"] == 0


@pytest.mark.parametrize("op", ["write", "read"])
def test_staged_block_failure_is_reported_and_buffers_come_back(engine_factory, backend, op):
    engine = engine_factory(
        backend=backend, block_size=BLOCK, staging_buffers=2, queue_depth=2, _fault=(op, errno.EIO, 5 * BLOCK)
    )
    src = _unaligned(random_tensor(NBYTES, seed=3))
    fut = engine.write(src)
    if op == "write":
        with pytest.raises(OSError) as info:
            fut.result(timeout=60)
    else:
        handle = fut.result(timeout=60)
        with pytest.raises(OSError) as info:
            engine.read(handle, out=_unaligned(torch.zeros_like(src))).result(timeout=60)
    assert info.value.errno == errno.EIO and "failed at byte" in str(info.value)
    # Every staging buffer went back: a later transfer through them gets its own failure, not a hang (a leaked
    # buffer would leave it waiting: TimeoutError, an OSError without EIO).
    small = _unaligned(random_tensor(3 * BLOCK + 5, seed=4))
    if op == "write":
        later = engine.write(small)
    else:
        later = engine.read(engine.write(small).result(timeout=10), out=_unaligned(torch.zeros_like(small)))
    with pytest.raises(OSError) as info:
        later.result(timeout=10)
    assert info.value.errno == errno.EIO


@pytest.mark.skipif(not _core.io_uring_status()["usable"], reason="io_uring not usable here")
def test_raw_transfer_round_trip(tmp_path):
    nbytes = 9 * BLOCK  # 2.25 requests of 256 KiB: the last one is short by design
    src, back = ssdtrain.aligned_empty(nbytes), ssdtrain.aligned_empty(nbytes)
    src.copy_(random_tensor(nbytes, seed=11))
    back.fill_(0x5A)
    path = tmp_path / "raw"
    flags = os.O_RDWR | os.O_CREAT
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError:  # a file system without O_DIRECT (tmpfs): the transfer still moves the same bytes
        fd = os.open(path, flags, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        seconds = _core.raw_transfer(fd, src.data_ptr(), nbytes, 256 << 10, 4, True)
        assert seconds > 0
        os.fsync(fd)
        _core.raw_transfer(fd, back.data_ptr(), nbytes, 256 << 10, 4, False)
        assert torch.equal(back, src)
        # Reading past the end of the file is a short read: an error, never a silently partial buffer. (The
        # buffer is held by a name: a temporary's memory would be freed before the call writes the file into it.)
        past_end = ssdtrain.aligned_empty(2 * nbytes)
        with pytest.raises(OSError) as info:
            _core.raw_transfer(fd, past_end.data_ptr(), 2 * nbytes, 256 << 10, 4, False)
        assert info.value.errno == errno.EIO and "raw read" in str(info.value)
    finally:
        os.close(fd)


@pytest.mark.skipif(not _core.io_uring_status()["usable"], reason="io_uring not usable here")
def test_raw_transfer_errors(tmp_path):
    buf = ssdtrain.aligned_empty(1 << 20)
    path = tmp_path / "ro"
    path.write_bytes(b"\0" * (1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as info:
            _core.raw_transfer(fd, buf.data_ptr(), 1 << 20, 1 << 20, 2, True)
        assert info.value.errno == errno.EBADF and "raw write" in str(info.value)
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="multiple of 4096"):
        _core.raw_transfer(0, buf.data_ptr(), 1 << 20, 1000, 2, False)
