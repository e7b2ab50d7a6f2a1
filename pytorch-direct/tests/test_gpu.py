"""GPU tests: every kernel path against torch's CPU index_select, with random data and poisoned outputs."""

import gc
import os
import subprocess
import sys

import pytest
import torch

import pytorch_direct as pd
from pytorch_direct import _auto, _features, _memory
from pytorch_direct._cell import Call, Cell

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.uint8, torch.bool, torch.float64]
GATHER_STRATEGIES = ["vector", "sorted", "naive", "dedupe", "staged", "dedupe_staged", "split", "auto"]
SCATTER_STRATEGIES = ["vector", "sorted", "naive", "staged", "auto"]
# Row widths in bytes: tiny, odd (47), not a multiple of 16 or 128 (400, 100, 12), big, and bigger than a warp pass.
ROW_BYTES = [1, 2, 3, 4, 8, 12, 16, 47, 64, 100, 128, 400, 512, 1000, 4096, 4100, 20000]


def random_table(rows, row_shape, dtype, generator=None):
    g = generator or torch.Generator().manual_seed(rows * 7 + len(row_shape))
    shape = (rows,) + tuple(row_shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)


def poison_cuda_allocator(nbytes=64 << 20):
    """Fills free blocks of the caching allocator with 0xFF so an unwritten output byte is visible: one large block
    (the large pool) and several of 512 KiB (the small pool serves allocations up to 1 MiB)."""
    blocks = [torch.full((nbytes,), 0xFF, dtype=torch.uint8, device="cuda")]
    blocks += [torch.full((512 << 10,), 0xFF, dtype=torch.uint8, device="cuda") for _ in range(4)]
    del blocks


def assert_same(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # Bitwise: gathers move bytes, so any difference (including NaN payloads) is a bug.
    assert torch.equal(out.cpu().contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8))


@pytest.mark.parametrize("strategy", GATHER_STRATEGIES)
@pytest.mark.parametrize("row_bytes", ROW_BYTES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_row_widths(strategy, row_bytes, index_dtype):
    rows = 3000
    table = random_table(rows, (row_bytes,), torch.uint8)
    u = pd.unified(table, copy=True)
    idx = torch.randint(0, rows, (5000,), dtype=index_dtype)  # duplicates included
    poison_cuda_allocator()
    out = pd.gather(u, idx.cuda(), strategy=strategy)
    assert out.device.type == "cuda"
    assert_same(out, table.index_select(0, idx.long()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy", ["vector", "sorted", "dedupe", "staged"])
def test_gather_dtypes_and_nd(dtype, strategy):
    table = random_table(777, (3, 5), dtype)
    u = pd.unified(table, copy=True)
    idx = torch.randint(0, 777, (4, 33))
    poison_cuda_allocator()
    out = pd.gather(u, idx.cuda(), strategy=strategy)
    assert out.shape == (4, 33, 3, 5)
    assert_same(out, table[idx])


@pytest.mark.parametrize("offset", [0, 1, 3, 8, 13])
@pytest.mark.parametrize("row_bytes", [47, 400, 64, 1])
def test_gather_registered_unaligned_base(offset, row_bytes):
    # Registration in place of a tensor that starts at an odd address: kernels must narrow their loads.
    rows = 2001
    # The backing buffer owns whole pages (page-aligned, page-rounded): registration pins whole pages, and a heap
    # buffer would share its first/last page with unrelated torch allocations; a CUDA copy of one of those that
    # straddles the registered range's end fails with "invalid argument" (seen on the GPU machine for idx.cuda()).
    nbytes = offset + rows * row_bytes + 5
    backing = pd.empty(nbytes, dtype=torch.uint8, pin=False).as_subclass(torch.Tensor)
    backing.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    table = backing[offset:offset + rows * row_bytes].view(rows, row_bytes)
    u = pd.unified(table)  # copy=False: registers in place
    assert u.data_ptr() == table.data_ptr()
    idx = torch.randint(0, rows, (3000,))
    for strategy in ("vector", "sorted", "naive"):
        poison_cuda_allocator()
        assert_same(pd.gather(u, idx.cuda(), strategy=strategy), table[idx])
    # Registered in place: writes through the original are seen by the GPU.
    table[idx[0]] = 7
    assert torch.equal(u[idx[:1].cuda()].cpu(), table[idx[:1]])


def test_torch_entry_points():
    table = random_table(1000, (37,), torch.float32)
    u = pd.unified(table, copy=True)
    idx = torch.randint(0, 1000, (300,), device="cuda")
    ref = table[idx.cpu()]
    assert_same(u[idx], ref)
    assert_same(torch.index_select(u, 0, idx), ref)
    assert_same(u.index_select(0, idx.int()), ref)
    assert_same(torch.nn.functional.embedding(idx.view(10, 30), u), table[idx.cpu()].view(10, 30, 37))
    gidx = torch.randint(0, 1000, (50, 37), device="cuda")
    assert_same(torch.gather(u, 0, gidx), torch.gather(table, 0, gidx.cpu()))
    assert_same(u.gather(0, gidx[:, :5]), table.gather(0, gidx[:, :5].cpu()))
    # CPU indices: CPU result.
    assert u[idx.cpu()].device.type == "cpu"
    assert_same(u[idx.cpu()], ref)


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
@pytest.mark.parametrize("row_bytes", [1, 3, 47, 64, 400, 4096, 4100])
def test_scatter(strategy, row_bytes):
    rows = 2000
    table = random_table(rows, (row_bytes,), torch.uint8)
    ref = table.clone()
    u = pd.unified(table.clone(), copy=True)
    idx = torch.randperm(rows)[:700]  # unique: the result is defined
    vals = random_table(700, (row_bytes,), torch.uint8, torch.Generator().manual_seed(5))
    pd.scatter_(u, idx.cuda(), vals.cuda(), strategy=strategy)
    torch.cuda.synchronize()
    ref[idx] = vals
    assert_same(u.as_subclass(torch.Tensor), ref)


def needs_managed():
    if not _memory.managed_supported():
        pytest.skip("no concurrent managed access on this GPU")


@pytest.mark.parametrize("row_bytes", [1, 47, 400, 4100])
def test_managed_table_every_strategy(row_bytes):
    needs_managed()
    rows = 3000
    table = random_table(rows, (row_bytes,), torch.uint8)
    u = pd.unified(table, copy=True, memory="managed")
    assert _memory.host_kind(u.as_subclass(torch.Tensor)) == "managed"
    idx = torch.randint(0, rows, (5000,))
    for strategy in GATHER_STRATEGIES:
        poison_cuda_allocator()
        assert_same(pd.gather(u, idx.cuda(), strategy=strategy), table[idx])
    assert_same(u[idx], table[idx])  # CPU indices: the CPU reads it too
    ref = table.clone()
    where = torch.randperm(rows)[:700]
    for k, strategy in enumerate(SCATTER_STRATEGIES):
        vals = random_table(700, (row_bytes,), torch.uint8, torch.Generator().manual_seed(k))
        pd.scatter_(u, where.cuda(), vals.cuda(), strategy=strategy)
        torch.cuda.synchronize()
        ref[where] = vals
        assert_same(u.as_subclass(torch.Tensor), ref)
    # Registering a plain view of it in place reuses it (CUDA cannot register managed memory).
    plain = u.as_subclass(torch.Tensor)[10:20]
    assert pd.unified(plain).data_ptr() == plain.data_ptr()


def test_memory_kind_by_size_and_auto_cells(tmp_cache):
    needs_managed()
    with pytest.raises(MemoryError, match="does not fit"):  # 16 TiB: refused before a page is touched
        pd.empty(1 << 44, dtype=torch.uint8)
    small = pd.empty(1000, 64)
    assert _memory.host_kind(small.as_subclass(torch.Tensor)) == "pinned"
    big = pd.zeros(_memory.MANAGED_MIN_BYTES // 256, 64)  # float32: 256 B rows
    assert _memory.host_kind(big.as_subclass(torch.Tensor)) == "managed"
    assert _memory.host_kind(pd.empty(8, memory="managed").as_subclass(torch.Tensor)) == "managed"
    assert _memory.host_kind(pd.empty(1 << 26, memory="pinned").as_subclass(torch.Tensor)) == "pinned"
    rows = big.shape[0]
    with torch._C.DisableTorchFunctionSubclass():
        big[:: 997] = torch.arange(0, rows, 997, dtype=torch.float32).unsqueeze(1)
    idx = torch.arange(0, rows, 997, device="cuda")[torch.randperm((rows + 996) // 997, device="cuda")]
    _auto.reset()
    pd.set_auto_calibrate(True)
    try:
        got = pd.gather(big, idx)
    finally:
        pd.set_auto_calibrate(False)
    assert torch.equal(got[:, 0], idx.float())
    assert any(str(key).startswith("gather|m28|") for key in _auto.measured_cells())  # a cell of its own kind
    # A gradient through a managed table lands in the host gradient.
    emb = pd.unified(torch.zeros(500, 4), copy=True, memory="managed").requires_grad_()
    i = torch.tensor([3, 3, 499], device="cuda")
    emb[i].sum().backward()
    torch.cuda.synchronize()
    assert emb.grad.as_subclass(torch.Tensor)[3].tolist() == [2.0] * 4


def test_forked_child_reads_tables_of_each_kind():
    needs_managed()
    torch.cuda.init()
    code = r"""
import os, sys, torch, pytorch_direct as pd
kind = sys.argv[1]
u = pd.unified(torch.arange(3000.0).view(1000, 3), copy=True, memory=kind)
u[torch.tensor([1], device="cuda")]
pid = os.fork()
if pid == 0:
    try:
        got = u[torch.tensor([5, 999])]
        os._exit(0 if torch.equal(got, torch.arange(3000.0).view(1000, 3)[[5, 999]]) else 3)
    except Exception as e:
        print(f"{type(e).__name__}: {e}", flush=True)
        os._exit(4)
_, status = os.waitpid(pid, 0)
print("child", status, flush=True)
"""
    # Pinned memory is inherited; managed memory is not (reading it there was SIGSEGV, GPU run 46): an error that
    # names the fix instead.
    for kind, status, says in (("pinned", 0, ""), ("managed", 4 << 8, "memory='pinned'")):
        r = subprocess.run([sys.executable, "-c", code, kind], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"child {status}" in r.stdout and says in r.stdout, (kind, r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("memory", ["managed", "pinned"])
def test_copies_to_the_gpu(memory):
    if memory == "managed":
        needs_managed()
    ref = torch.randn(3001, 37)  # 444148 bytes: whole 4 KiB rows and a ragged tail
    u = pd.unified(ref, copy=True, memory=memory)
    for got in (u.cuda(), u.to("cuda"), u.to("cuda", non_blocking=True), u.cuda(0), u.to(device="cuda:0")):
        assert got.device.type == "cuda" and not pd.is_unified(got)
        assert_same(got, ref)
    assert_same(u[5:900].cuda(), ref[5:900])  # a contiguous slice
    assert_same(u.t().cuda(), ref.t())  # not contiguous: torch's copy
    assert torch.equal(u.to("cuda", torch.float64).cpu(), ref.double())  # another dtype: torch's copy
    dst = torch.empty(3001, 37, device="cuda")
    dst.copy_(u)
    assert_same(dst, ref)
    small = pd.unified(torch.arange(5, dtype=torch.int16), copy=True, memory=memory)
    assert_same(small.cuda(), torch.arange(5, dtype=torch.int16))
    # A blocking copy is done when it returns: the source may change right after.
    got = u.cuda()
    with torch._C.DisableTorchFunctionSubclass():
        u.zero_()
    assert_same(got, ref)
    # Autograd through the copy stays torch's.
    leaf = pd.unified(ref, copy=True, memory=memory).requires_grad_()
    leaf.cuda().sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(ref))


@pytest.mark.parametrize("dtype", DTYPES)
def test_writes_through_torch_api(dtype):
    table = random_table(500, (6,), dtype)
    ref = table.clone()
    u = pd.unified(table.clone(), copy=True)
    idx = torch.randperm(500)[:100]
    vals = random_table(100, (6,), dtype, torch.Generator().manual_seed(9))
    u[idx.cuda()] = vals.cuda()
    ref[idx] = vals
    torch.cuda.synchronize()
    assert_same(u.as_subclass(torch.Tensor), ref)
    idx2 = torch.randperm(500)[:50]
    vals2 = random_table(50, (6,), dtype, torch.Generator().manual_seed(10))
    u.index_copy_(0, idx2.cuda(), vals2.cuda())
    ref.index_copy_(0, idx2, vals2)
    torch.cuda.synchronize()
    assert_same(u.as_subclass(torch.Tensor), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16])
def test_index_add_duplicates(dtype):
    table = random_table(300, (9,), dtype)
    if not dtype.is_floating_point:
        table = table // 4  # far from the limits: the sums must not overflow
    ref = table.clone().double() if dtype.is_floating_point else table.clone()
    u = pd.unified(table.clone(), copy=True)
    idx = torch.randint(0, 30, (2000,))  # many duplicates
    vals = random_table(2000, (9,), dtype, torch.Generator().manual_seed(3))
    if not dtype.is_floating_point:
        vals = vals % 100
    u.index_add_(0, idx.cuda(), vals.cuda())
    torch.cuda.synchronize()
    ref.index_add_(0, idx, vals.to(ref.dtype))
    got = u.as_subclass(torch.Tensor)
    if dtype.is_floating_point:
        err = (got.double() - ref).norm() / ref.norm()
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5)
    else:
        assert torch.equal(got, ref)


def test_index_add_alpha_and_function():
    table = torch.randn(100, 4, dtype=torch.float64)
    u = pd.unified(table.clone(), copy=True)
    idx = torch.tensor([3, 3, 5])
    vals = torch.randn(3, 4, dtype=torch.float64)
    pd.index_add_(u, idx.cuda(), vals.cuda(), alpha=-2.0)
    torch.cuda.synchronize()
    assert torch.allclose(u.as_subclass(torch.Tensor), table.index_add(0, idx, vals, alpha=-2.0))


@pytest.mark.parametrize("bad", [-1, 100, 2**40])
@pytest.mark.parametrize("strategy", ["vector", "sorted", "naive", "dedupe", "staged", "dedupe_staged", "split",
                                      "auto"])
def test_bounds_sync(bad, strategy):
    table = torch.randn(100, 8)
    u = pd.unified(table.clone(), copy=True)
    idx = torch.tensor([1, 2, bad, 4], device="cuda")
    with pytest.raises(IndexError, match=str(bad)):
        pd.gather(u, idx, strategy=strategy)
    # The gather checked while it ran (device plans): its kernels' record of the row is not raised again.
    good = idx.clamp(0, 99)
    assert_same(pd.gather(u, good, strategy=strategy), table[good.cpu()])
    big = torch.randint(0, 100, (300_001,), device="cuda")
    big[150_000] = bad
    with pytest.raises(IndexError, match=str(bad)):
        pd.gather(u, big, strategy=strategy)
    pd.check_errors()  # nothing pending
    with pytest.raises(IndexError):
        pd.scatter_(u, idx, torch.zeros(4, 8, device="cuda"), strategy=strategy)
    torch.cuda.synchronize()
    assert torch.equal(u.as_subclass(torch.Tensor), table)  # nothing written
    with pytest.raises(IndexError):
        u.index_add_(0, idx, torch.ones(4, 8, device="cuda"))
    assert torch.equal(u.as_subclass(torch.Tensor), table)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("count", [1, 31, 257, 2048 * 8 + 3, 5_000_003])
def test_index_bounds_kernel(dtype, count):
    """The sync-mode check's reduction (one block, several, more than its block cap), against torch: the extremes
    planted at the first, a middle and the last position, negative and above-int32 values included."""
    from pytorch_direct import _core

    g = torch.Generator(device="cuda").manual_seed(count)
    high = 2**31 - 1 if dtype == torch.int32 else 2**40
    idx = torch.randint(-1000, 1000, (count,), device="cuda", generator=g, dtype=torch.int64).to(dtype)
    for lo_at, hi_at in ((0, count - 1), (count - 1, count // 2), (count // 2, 0)):
        probe = idx.clone()
        probe[hi_at] = high
        probe[lo_at] = -high
        expected = tuple(int(v) for v in torch.aminmax(probe))
        stream = torch.cuda.current_stream().cuda_stream
        assert _core.index_bounds_cuda(probe.data_ptr(), probe.element_size(), count, stream) == expected


def test_index_bounds_from_threads_at_once():
    """Each thread has its own scratch: checks on two threads and streams at once do not mix up their results."""
    import threading

    from pytorch_direct import _kernels

    errors = []

    def worker(k):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                idx = torch.arange(k, k + 100_000, device="cuda")
                for _ in range(50):
                    _kernels.precheck(idx, k + 100_000)  # in range: must not raise
                    with pytest.raises(IndexError, match=str(k + 99_999)):
                        _kernels.precheck(idx, k + 99_999)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k * 10_000_000,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_bounds_async_device_check():
    table = torch.randn(100, 8)
    u = pd.unified(table.clone(), copy=True)
    pd.set_bounds_check("async")
    try:
        idx = torch.tensor([1, 2, 10**9, 4], device="cuda")
        out = pd.gather(u, idx, strategy="vector")  # no raise here: the kernel skips the row, no memory fault
        torch.cuda.synchronize()
        assert torch.equal(out[[0, 1, 3]].cpu(), table[[1, 2, 4]])
        with pytest.raises(IndexError, match=str(10**9)):
            pd.check_errors()
        pd.check_errors()  # cleared
        pd.scatter_(u, torch.tensor([-5], device="cuda"), torch.zeros(1, 8, device="cuda"), strategy="vector")
        torch.cuda.synchronize()
        with pytest.raises(IndexError):
            pd.gather(u, torch.tensor([0], device="cuda"))  # the next call reports it
        assert torch.equal(u.as_subclass(torch.Tensor), table)
    finally:
        pd.set_bounds_check("sync")


def test_bad_inputs():
    u = pd.unified(torch.randn(10, 4), copy=True)
    with pytest.raises(TypeError, match="int32 or int64"):
        pd.gather(u, torch.tensor([1.0], device="cuda"))
    plain = torch.randn(10, 4)
    with pytest.raises(ValueError, match="pinned or registered"):
        pd.gather(plain, torch.tensor([1], device="cuda"))
    with pytest.raises(ValueError, match="host memory"):
        pd.gather(torch.randn(10, 4, device="cuda"), torch.tensor([1], device="cuda"))
    with pytest.raises(ValueError, match="CPU tensor"):
        pd.unified(torch.randn(3, device="cuda"))


def test_autograd_host_gradient():
    table = torch.randn(50, 6)
    emb = pd.unified(table.clone(), copy=True).requires_grad_()
    idx = torch.tensor([[1, 2, 2], [7, 1, 49]], device="cuda")
    weight = torch.randn(2, 3, 6, device="cuda")
    out = torch.nn.functional.embedding(idx, emb)
    assert out.requires_grad and out.device.type == "cuda"
    (out * weight).sum().backward()
    ref = table.clone().requires_grad_()
    (torch.nn.functional.embedding(idx.cpu(), ref) * weight.cpu()).sum().backward()
    torch.cuda.synchronize()
    assert pd.is_unified(emb.grad)
    assert torch.allclose(emb.grad.as_subclass(torch.Tensor), ref.grad, atol=1e-6)
    # A second step accumulates.
    (emb[idx.view(-1)] * 2).sum().backward()
    torch.cuda.synchronize()
    extra = torch.zeros_like(ref.grad).index_add_(0, idx.view(-1).cpu(), torch.full((6, 6), 2.0))
    assert torch.allclose(emb.grad.as_subclass(torch.Tensor), ref.grad + extra, atol=1e-6)


def test_embedding_padding_idx_gradient():
    emb = pd.unified(torch.randn(10, 3), copy=True).requires_grad_()
    idx = torch.tensor([0, 1, 1, 2], device="cuda")
    torch.nn.functional.embedding(idx, emb, padding_idx=1).sum().backward()
    torch.cuda.synchronize()
    g = emb.grad.as_subclass(torch.Tensor)
    assert torch.equal(g[1], torch.zeros(3)) and torch.equal(g[0], torch.ones(3)) and torch.equal(g[2], torch.ones(3))


def test_torch_compile_fullgraph():
    table = torch.randn(1000, 16)
    u = pd.unified(table, copy=True).plain()  # the plain-tensor route (test_compile.py covers the subclass)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def f(idx):
        return pd.gather(u, idx, strategy="sorted").sum(dim=1) * 2

    idx = torch.randint(0, 1000, (256,), device="cuda")
    assert torch.allclose(f(idx).cpu(), table[idx.cpu()].sum(dim=1) * 2, atol=1e-5)
    idx2 = torch.randint(0, 1000, (300,), device="cuda")
    assert torch.allclose(f(idx2).cpu(), table[idx2.cpu()].sum(dim=1) * 2, atol=1e-5)


def test_torch_compile_takes_the_unified_tensor():
    # The unified tensor itself goes into the compiled function (no .plain()): every row operation with CUDA indices
    # under the default (inductor) backend gives eager's results; the reads compile, the writes run eagerly (a graph
    # break: run G wrote into a pageable copy of the table when inductor traced them).
    table = random_table(1000, (16,), torch.float32)
    u, ref = pd.unified(table, copy=True), pd.unified(table, copy=True)
    gidx = torch.randint(0, 1000, (64, 16), device="cuda")
    torch._dynamo.reset()

    def step(t, idx, values):
        rows = t[idx] + torch.nn.functional.embedding(idx.view(4, -1), t).view(idx.numel(), -1)
        rows = rows + t.index_select(0, idx) + pd.gather(t, idx, strategy="sorted") + torch.gather(t, 0, gidx).sum()
        t[idx] = values
        t.index_add_(0, idx, values, alpha=2)
        return rows.relu().sum(dim=1), t[idx]

    compiled = torch.compile(step)
    for n in (256, 300):  # a second length: the recompiled graph has a dynamic index length
        idx = torch.randperm(1000, device="cuda")[:n]  # distinct rows: the writes do not depend on their order
        values = torch.randn(n, 16, device="cuda")
        out, expected = compiled(u, idx, values), step(ref, idx, values)
        torch.cuda.synchronize()
        for a, b in zip(out, expected, strict=True):
            assert a.device.type == "cuda" and torch.allclose(a, b, atol=1e-4)
        assert torch.equal(u.as_subclass(torch.Tensor), ref.as_subclass(torch.Tensor))


def test_torch_compile_gradient_reaches_the_host_table():
    table = torch.randn(500, 8)
    emb = pd.unified(table.clone(), copy=True).requires_grad_()
    ref = pd.unified(table.clone(), copy=True).requires_grad_()
    idx = torch.randint(0, 500, (4, 64), device="cuda")
    weight = torch.randn(4, 64, 8, device="cuda")
    torch._dynamo.reset()

    def loss(t, i):
        rows = torch.nn.functional.embedding(i, t, padding_idx=0)
        return (rows * weight).sum() + (t[i.flatten()] ** 2).sum()

    compiled = torch.compile(loss, fullgraph=True)
    for _ in range(2):  # the second backward accumulates
        compiled(emb, idx).backward()
        loss(ref, idx).backward()
        torch.cuda.synchronize()
        assert pd.is_unified(emb.grad) and emb.grad.device.type == "cpu"
        assert torch.allclose(emb.grad.as_subclass(torch.Tensor), ref.grad.as_subclass(torch.Tensor), atol=1e-4)


@pytest.mark.parametrize("strategy", ["vector", "sorted", "dedupe", "auto"])
def test_cuda_graph_capture(strategy):
    table = torch.randn(5000, 64)
    u = pd.unified(table, copy=True)
    idx = torch.randint(0, 5000, (4096,), device="cuda")
    out = pd.gather(u, idx, strategy=strategy)  # warm-up outside capture (allocations, lazy init)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pd.gather(u, idx, strategy=strategy)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pd.gather(u, idx, strategy=strategy)
    for _ in range(3):
        idx.copy_(torch.randint(0, 5000, (4096,), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert_same(out, table[idx.cpu()])


@pytest.mark.parametrize("max_sms", [1, 3])
def test_sm_cap(max_sms):
    table = torch.randn(20000, 100)
    u = pd.unified(table, copy=True)
    idx = torch.randint(0, 20000, (30000,), device="cuda")
    assert_same(pd.gather(u, idx, max_sms=max_sms), table[idx.cpu()])
    vals = torch.randn(30000, 100, device="cuda")
    uniq = torch.randperm(20000, device="cuda")[:5000]
    pd.scatter_(u, uniq, vals[:5000], max_sms=max_sms, strategy="vector")
    torch.cuda.synchronize()
    assert_same(u.as_subclass(torch.Tensor)[uniq.cpu()], vals[:5000].cpu())


def test_over_2_31_elements():
    # 2^31 + 2^20 one-byte elements (> 2 GiB): offsets past 2^31 need 64-bit math in every kernel.
    rows, width = (2**31 + 2**20) // 64, 64
    u = pd.empty(rows, width, dtype=torch.uint8)
    plain = u.as_subclass(torch.Tensor)
    idx = torch.tensor([0, rows - 1, rows // 2, 2**31 // 64 + 5, rows - 2], dtype=torch.int64)
    vals = torch.randint(0, 256, (5, width), dtype=torch.uint8)
    plain[idx] = vals
    for strategy in ("vector", "sorted", "naive", "staged"):
        assert torch.equal(pd.gather(u, idx.cuda(), strategy=strategy).cpu(), vals)
    # int32 indices into a table whose byte offsets exceed 2^31.
    assert torch.equal(pd.gather(u, idx.int().cuda()).cpu(), vals)
    new = torch.randint(0, 256, (5, width), dtype=torch.uint8)
    pd.scatter_(u, idx.cuda(), new.cuda(), strategy="vector")
    torch.cuda.synchronize()
    assert torch.equal(plain[idx], new)
    del u, plain
    gc.collect()


def test_lifetime_registration():
    base = pd._core.registered_bytes()
    x = torch.randn(4096, 64)
    u = pd.unified(x)
    assert pd._core.registered_bytes() > base
    view = u[100:200]
    assert pd.is_unified(view)
    del u, x
    gc.collect()
    idx = torch.tensor([0, 99], device="cuda")
    got = pd.gather(view, idx)  # still registered: the view keeps it alive
    assert got.shape == (2, 64)
    # Repeated and overlapping registrations are safe.
    y = torch.randn(1000, 8)
    a, b = pd.unified(y), pd.unified(y[10:500])
    assert torch.equal(b[torch.tensor([0], device="cuda")].cpu(), y[10:11])
    del a, b, view, got
    gc.collect()
    assert pd._core.registered_bytes() == base


def test_from_file(tmp_path):
    table = torch.randn(3000, 47 // 1).to(torch.float32)
    path = tmp_path / "rows.bin"
    table.numpy().tofile(path)
    u = pd.from_file(path, (3000, 47), torch.float32)
    idx = torch.randint(0, 3000, (500,), device="cuda")
    assert_same(u[idx], table[idx.cpu()])
    w = pd.from_file(path, (3000, 47), torch.float32, writable=True)
    w[torch.tensor([5], device="cuda")] = torch.zeros(1, 47, device="cuda")
    torch.cuda.synchronize()
    del w
    gc.collect()
    on_disk = torch.from_file(str(path), size=3000 * 47, dtype=torch.float32).view(3000, 47)
    assert torch.equal(on_disk[5], torch.zeros(47))


def test_shared_memory_two_attachments():
    name = f"pytorch_direct-test-{os.getpid()}"
    a = pd.shared_memory(name, (100, 5), torch.float32, create=True)
    try:
        b = pd.shared_memory(name, (100, 5), torch.float32, create=False)
        with torch._C.DisableTorchFunctionSubclass():
            a.copy_(torch.arange(500.0).view(100, 5))
        assert torch.equal(b[torch.tensor([3], device="cuda")].cpu(), torch.arange(15.0, 20.0).view(1, 5))
    finally:
        pd.unlink_shared_memory(name)


def test_forked_dataloader_workers_after_cuda_init():
    # CUDA is initialised in this process; forked workers must gather on the CPU without touching CUDA.
    torch.cuda.init()
    code = r"""
import torch, pytorch_direct as pd
table = torch.randn(1000, 7)
u = pd.unified(table, copy=True)
u[torch.tensor([1], device="cuda")]
class DS(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i): return u[torch.tensor([i, 999 - i])]
dl = torch.utils.data.DataLoader(DS(), batch_size=8, num_workers=2, multiprocessing_context="fork")
for k, batch in enumerate(dl):
    for j in range(8):
        i = k * 8 + j
        assert torch.equal(batch[j], table[[i, 999 - i]]), i
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_pyg_neighbor_loader_on_gpu():
    pytest.importorskip("torch_geometric")
    from torch_geometric.loader import NeighborLoader

    from pytorch_direct.pyg import UnifiedFeatureStore, make_graph_store

    n = 2000
    x = torch.randn(n, 33)
    edge_index = torch.randint(0, n, (2, 20000))
    fs = UnifiedFeatureStore(device="cuda")
    fs.put_tensor(x, group_name=None, attr_name="x", index=None)
    gs = make_graph_store(edge_index, num_nodes=n)
    from torch_geometric.loader.utils import filter_custom_store

    node = torch.randint(0, n, (70,))
    data = filter_custom_store(fs, gs, node, edge_index[0, :10], edge_index[1, :10], None)
    assert data.x.device.type == "cuda" and torch.equal(data.x.cpu(), x[node])
    import importlib.util

    if not any(importlib.util.find_spec(m) is not None for m in ("pyg_lib", "torch_sparse")):
        pytest.skip("NeighborLoader needs pyg-lib or torch-sparse (not installed); the feature path was checked")
    loader = NeighborLoader((fs, gs), num_neighbors=[5, 5], batch_size=64, input_nodes=torch.arange(256))
    seen = 0
    for batch in loader:
        assert batch.x.device.type == "cuda"
        assert torch.equal(batch.x.cpu(), x[batch.n_id])
        seen += 1
    assert seen == 4


def test_calibration_and_auto(tmp_cache):

    table = pd.unified(random_table(1 << 16, (256,), torch.uint8), copy=True)  # 16 MiB
    before = table.plain().clone()
    _auto.reset()
    try:
        cells = pd.calibrate(table=table, counts=[1 << 12, 1 << 15])
        assert torch.equal(table.plain(), before)  # measured with reads only
        assert len(cells) >= 4 and all(m.gbps[m.best] > 0 for m in cells.values())
        assert set(cells) <= {str(k) for k in _auto.measured_cells()}
        _auto.reset()
        assert set(cells) <= {str(k) for k in _auto.measured_cells()}  # read back from this machine's cache file
        idx = torch.randint(0, 1 << 16, (1 << 15,), device="cuda")
        call = Call("gather", 1 << 24, 1 << 16, 256, 1 << 15)
        decision, _, _ = _auto.choose(call, idx, capturing=False)
        assert decision.source == "measured"
        assert_same(pd.gather(table, idx), before[idx.cpu()])
    finally:
        _auto.reset()


def test_auto_measures_on_the_first_call_of_each_kind(tmp_cache):
    # Default settings: the first call of a kind measures the candidates on itself (correct result, bounded time)
    # and stores the cell; the next call runs the stored choice.
    import time

    from pytorch_direct import _decide

    table = random_table(1 << 18, (64,), torch.uint8)  # 16 MiB of 64 B rows
    u = pd.unified(table, copy=True)
    _auto.reset()
    pd.set_auto_calibrate(True)
    try:
        # Different counts: one kind of call each (a kind re-samples its index features every RECHECK_EVERY calls).
        for pattern, count in (("uniform", 1 << 16), ("zipf", 1 << 14)):
            idx = _features.synthetic_indices(pattern, count, 1 << 18, torch.Generator("cuda").manual_seed(1))
            poison_cuda_allocator()
            start = time.perf_counter()
            out = pd.gather(u, idx)
            torch.cuda.synchronize()
            assert time.perf_counter() - start < 2.5
            assert_same(out, table[idx.cpu()])
            features, _, _ = _features.index_features(idx, 1 << 18, 64)
            key = Cell(Call("gather", 1 << 24, 1 << 18, 64, count), features).key
            cell = _auto.measured_cells()[key]
            assert cell.best == _decide.pick(cell.gbps) and len(cell.gbps) >= 3
            if pattern == "zipf":
                assert "dedupe" in cell.gbps and "dedupe_staged" in cell.gbps
            assert_same(pd.gather(u, idx), table[idx.cpu()])
        assert _auto.cache_path().exists()
    finally:
        pd.set_auto_calibrate(False)
        _auto.reset()


@pytest.mark.parametrize("strategy", ["dedupe", "dedupe_staged"])
def test_dedupe_identical_and_empty_indices_and_gradients(strategy):
    table = random_table(1000, (33,), torch.float32)
    u = pd.unified(table, copy=True)
    for idx in (torch.full((70000,), 999, device="cuda"), torch.empty(0, dtype=torch.int64, device="cuda"),
                torch.randint(0, 3, (5, 7), device="cuda", dtype=torch.int32)):
        poison_cuda_allocator()
        assert_same(pd.gather(u, idx, strategy=strategy), table[idx.long().cpu()])
    emb = pd.unified(table.clone(), copy=True).requires_grad_()
    idx = torch.randint(0, 20, (4000,), device="cuda")
    weight = torch.randn(4000, 33, device="cuda")
    (pd.gather(emb, idx, strategy=strategy) * weight).sum().backward()
    torch.cuda.synchronize()
    ref = torch.zeros(1000, 33).index_add_(0, idx.cpu(), weight.cpu())
    assert torch.allclose(emb.grad.plain(), ref, atol=1e-4)


def test_memory_pinned_by_torch_is_accepted():
    # Not created by pytorch_direct: the driver is asked whether the GPU can read it.
    table = torch.randn(1000, 24).pin_memory()
    idx = torch.randint(0, 1000, (700,), device="cuda")
    assert_same(pd.gather(table, idx, strategy="vector"), table[idx.cpu()])
    assert_same(pd.gather(table[100:300], idx % 200), table[100:300][(idx % 200).cpu()])
    u = pd.unified(table)  # already pinned: wrapped, not registered again
    assert u.data_ptr() == table.data_ptr()
    assert_same(u[idx], table[idx.cpu()])


def test_empty_index_and_zero_width_rows():
    u = pd.unified(torch.randn(10, 4), copy=True)
    out = pd.gather(u, torch.empty(0, dtype=torch.int64, device="cuda"))
    assert out.shape == (0, 4) and out.device.type == "cuda"
    z = pd.zeros(10, 0)
    assert pd.gather(z, torch.tensor([1, 2], device="cuda")).shape == (2, 0)
    with pytest.raises(IndexError):
        pd.gather(z, torch.tensor([10], device="cuda"))


def test_sm_cap_setting():
    table = torch.randn(3000, 64)
    u = pd.unified(table, copy=True)
    pd.set_max_sms(2)
    try:
        idx = torch.randint(0, 3000, (5000,), device="cuda")
        assert_same(pd.gather(u, idx, strategy="vector"), table[idx.cpu()])
    finally:
        pd.set_max_sms(0)


SHARE_GPU_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import pytorch_direct as pd

def work(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ref = torch.arange(4000.0).view(1000, 4)
    u = pd.share(ref.clone() if rank == 0 else None)
    idx = torch.randint(0, 1000, (300,), device="cuda")
    assert torch.equal(u[idx].cpu(), ref[idx.cpu()]), rank     # each process registered the shared pages
    dist.barrier()
    if rank == 1:
        u[torch.tensor([7], device="cuda")] = torch.full((1, 4), -3.0, device="cuda")
        torch.cuda.synchronize()
    dist.barrier()
    assert torch.equal(u[torch.tensor([7], device="cuda")].cpu(), torch.full((1, 4), -3.0)), rank
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(work, args=(2, int(sys.argv[1])), nprocs=2)
    print("ok")
"""


def test_share_across_processes_gpu(tmp_path):
    script = tmp_path / "share_gpu.py"
    script.write_text(SHARE_GPU_SCRIPT)
    port = 30500 + os.getpid() % 1000
    r = subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=45)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
