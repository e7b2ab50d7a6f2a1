"""CUDA tensors through every backend: staging through pinned buffers (io_uring, threads) and cuFile (gds)."""

import errno
import gc

import pytest
import torch

import ssdtrain

pytestmark = pytest.mark.gpu


def gpu_backends():
    out = ["threads"]
    if ssdtrain._core.io_uring_status()["usable"]:
        out.append("io_uring")
    if torch.cuda.is_available() and ssdtrain.backends()["gds"]["usable"]:
        out.append("gds")
    return out


@pytest.fixture(params=gpu_backends())
def gpu_engine(request, tmp_path):
    engines = []

    def make(**kw):
        kw.setdefault("capacity_per_directory", "1G")
        e = ssdtrain.Engine([tmp_path], backend=request.param, **kw)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("nbytes", [1, 4097, (1 << 20) + 3, 37 << 20])
def test_cuda_round_trip(gpu_engine, nbytes, checksum):
    engine = gpu_engine(checksum=checksum)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    fut = engine.write(src)
    handle = fut.result(timeout=60)
    assert fut.staged()
    assert handle.device.type == "cuda"
    out = torch.full_like(src, 7)
    engine.read(handle, out=out).result(timeout=60)
    assert torch.equal(out, src)
    # Across memories: a CUDA tensor read back into host memory and the reverse.
    host = engine.read(handle, out=torch.empty(nbytes, dtype=torch.uint8)).result(timeout=60)
    assert torch.equal(host, src.cpu())
    h2 = engine.write(host).result(timeout=60)
    assert torch.equal(engine.read(h2, out=torch.empty_like(src)).result(timeout=60), src)


PIPE_BLOCK = 64 << 10
PIPE_BYTES = 37 * PIPE_BLOCK + 4099  # many blocks and a tail that is neither a block nor a page multiple


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize(("staging", "depth"), [(1, 2), (3, 2), (9, 4), (48, 32)])
def test_cuda_pipeline_is_exact(gpu_engine, staging, depth, checksum):
    """Device copies queued ahead of the disk (fewer, as many and more buffers than the copy lookahead)."""
    engine = gpu_engine(block_size=PIPE_BLOCK, staging_buffers=staging, queue_depth=depth, checksum=checksum)
    sources = [torch.randint(0, 256, (PIPE_BYTES + k * 4097,), dtype=torch.uint8, device="cuda") for k in range(3)]
    writes = [engine.write(s) for s in sources]
    # Reads issued while the writes run: ordered after them inside the engine.
    outs = [torch.full_like(s, 0x5A) for s in sources]
    reads = [engine.read(w.handle, out=o) for w, o in zip(writes, outs, strict=True)]
    for r, s in zip(reads, sources, strict=True):
        got = r.result(timeout=60)
        mismatch = (got != s).nonzero()
        assert mismatch.numel() == 0, f"first wrong byte at {int(mismatch[0])} of {s.numel()}"
    host = engine.read(writes[0].handle, out=torch.empty(PIPE_BYTES, dtype=torch.uint8)).result(timeout=60)
    assert torch.equal(host, sources[0].cpu())


def test_cuda_source_reusable_once_staged(gpu_engine):
    engine = gpu_engine(block_size=PIPE_BLOCK, staging_buffers=4, queue_depth=2)
    src = torch.randint(0, 256, (PIPE_BYTES,), dtype=torch.uint8, device="cuda")
    expected = src.clone()
    torch.cuda.synchronize()
    fut = engine.write(src)
    while not fut.staged():
        pass
    src.fill_(0)  # staged: the engine no longer reads it, so this cannot reach the stored bytes
    assert torch.equal(engine.read(fut.result(timeout=60)).result(timeout=60), expected)


def test_cuda_read_fault_returns_buffers(tmp_path):
    with ssdtrain.Engine(
        [tmp_path],
        backend="threads",
        capacity_per_directory="64M",
        block_size=PIPE_BLOCK,
        staging_buffers=2,
        queue_depth=2,
        _fault=("read", errno.EIO, 5 * PIPE_BLOCK),
    ) as engine:
        src = torch.randint(0, 256, (PIPE_BYTES,), dtype=torch.uint8, device="cuda")
        handle = engine.write(src).result(timeout=60)
        with pytest.raises(OSError) as info:
            engine.read(handle, out=torch.empty_like(src)).result(timeout=60)
        assert info.value.errno == errno.EIO
        # Both staging buffers came back: another write through them completes.
        again = engine.write(src).result(timeout=30)
        assert again.nbytes == PIPE_BYTES


def test_cuda_dtypes(gpu_engine):
    engine = gpu_engine()
    t = torch.randn(33, 65, dtype=torch.bfloat16, device="cuda")
    back = engine.read(engine.write(t).handle).result(timeout=60)
    assert back.device == t.device and back.dtype == t.dtype and torch.equal(back, t)


def test_write_waits_for_the_producing_stream(gpu_engine):
    engine = gpu_engine()
    side = torch.cuda.Stream()
    t = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # the fill below lands long after write() returns on the host
        t.fill_(42)
        fut = engine.write(t)  # ordered after the fill on `side` (the current stream here)
    assert torch.equal(engine.read(fut.handle).result(timeout=60), torch.full_like(t, 42))


def test_write_after_event(gpu_engine):
    engine = gpu_engine()
    side = torch.cuda.Stream()
    t = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    ready = torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        t.fill_(17)
        ready.record()
    fut = engine.write(t, after=ready)  # the current stream knows nothing of `side`: the event orders the copy
    assert torch.equal(engine.read(fut.handle).result(timeout=60), torch.full_like(t, 17))
    with pytest.raises(ValueError, match="not both"):
        engine.write(t, stream=side, after=ready)


def test_read_waits_for_pending_work_on_destination(gpu_engine):
    engine = gpu_engine()
    src = torch.full((4 << 20,), 5, dtype=torch.uint8, device="cuda")
    h = engine.write(src).result(timeout=60)
    out = torch.zeros_like(src)
    torch.cuda._sleep(200_000_000)
    out.fill_(9)  # queued before the read: the read's copies must land after it
    fut = engine.read(h, out=out)
    fut.wait_stream()
    assert torch.equal(out, src)


def test_cuda_tensor_freed_while_write_in_flight(gpu_engine):
    engine = gpu_engine(staging_buffers=1, block_size="64K", queue_depth=2)
    src = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, device="cuda")
    expected = src.clone()
    fut = engine.write(src)
    del src
    gc.collect()
    junk = torch.full((16 << 20,), 1, dtype=torch.uint8, device="cuda")  # would reuse the freed block
    assert torch.equal(engine.read(fut.handle).result(timeout=60), expected)
    del junk


def test_cuda_checksum_mismatch(gpu_engine):
    engine = gpu_engine(checksum=True, block_size="64K")
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    h = engine.write(src).result(timeout=60)
    engine._corrupt_for_test(h, offset=123_456, nbytes=2)
    with pytest.raises(ssdtrain.ChecksumError):
        engine.read(h, out=torch.empty_like(src)).result(timeout=60)


def test_cuda_write_fault(tmp_path):
    with ssdtrain.Engine(
        [tmp_path],
        backend="threads",
        capacity_per_directory="64M",
        block_size="64K",
        _fault=("write", errno.EIO, 65536),
    ) as engine:
        fut = engine.write(torch.ones(1 << 20, dtype=torch.uint8, device="cuda"))
        with pytest.raises(OSError) as info:
            fut.result(timeout=60)
        assert info.value.errno == errno.EIO


def test_gds_reports_mode(tmp_path):
    if not ssdtrain.backends()["gds"]["usable"]:
        pytest.skip(f"cuFile not usable: {ssdtrain.backends()['gds']['detail']}")
    with ssdtrain.Engine([tmp_path], backend="gds", capacity_per_directory="64M") as engine:
        detail = engine.backend_detail
        assert ("compatibility mode" in detail) or ("GPUDirect Storage" in detail) or ("staged" in detail), detail


def test_huge_empty_pinned_round_trip(gpu_engine):
    engine = gpu_engine()
    nbytes = (3 << 20) + 4096
    # Two honest outcomes: pinned memory that torch sees as pinned, or a RuntimeError naming the cause. Never a
    # tensor that silently is not pinned (run E3 on an H200 got one: only the aligned middle of the storage was
    # registered, and torch checks the storage's base address).
    try:
        src = ssdtrain.huge_empty(nbytes)
    except RuntimeError as e:
        assert "pin" in str(e) and "cudaHostRegister" in str(e), e
        src = ssdtrain.huge_empty(nbytes, pin_memory=False)
    else:
        assert src.is_pinned()  # registered with CUDA: device copies from it run at full speed
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda"), non_blocking=False)
    h = engine.write(src).result(timeout=60)
    out = ssdtrain.huge_empty(nbytes, pin_memory=src.is_pinned())
    out.fill_(0x5A)
    engine.read(h, out=out).result(timeout=60)
    assert torch.equal(out, src)
    if engine.directories()[0]["direct"]:
        assert engine.stats()["staged_copies"] == 0  # physically contiguous: moved in place, no copies
    gpu = engine.read(h, out=torch.empty(nbytes, dtype=torch.uint8, device="cuda")).result(timeout=60)
    assert torch.equal(gpu.cpu(), src)
