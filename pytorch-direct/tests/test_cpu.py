"""CPU tests: the whole API with CPU indices (what runs on machines without a GPU and in DataLoader workers)."""

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pytorch_direct as pd
from pytorch_direct import _config

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.uint8, torch.bool, torch.float64]


def random_table(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g,
                         dtype=torch.int64).to(dtype)


def plain(t):
    return t.as_subclass(torch.Tensor)


def same_bytes(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_shape", [(), (1,), (47,), (3, 5), (100,)])
def test_gather_matches_index_select(dtype, row_shape):
    table = random_table((300,) + row_shape, dtype)
    u = pd.unified(table, copy=True)
    idx = torch.randint(0, 300, (500,))
    for index in (idx, idx.int()):
        out = u[index]
        assert type(out) is torch.Tensor and out.device.type == "cpu"
        assert same_bytes(out, table.index_select(0, idx))
        assert same_bytes(pd.gather(u, index), table.index_select(0, idx))
        assert same_bytes(torch.index_select(u, 0, index), table.index_select(0, idx))


def test_bad_arguments():
    u = pd.unified(torch.randn(10, 3), copy=True)
    with pytest.raises(TypeError, match="int32 or int64"):
        pd.gather(u, torch.tensor([1.0]))
    with pytest.raises(TypeError, match="torch.Tensor"):
        pd.gather(u, [1, 2])
    with pytest.raises(ValueError, match="0-d"):
        pd.gather(pd.unified(torch.tensor(3.0), copy=True), torch.tensor([0]))
    with pytest.raises(ValueError, match="not contiguous"):
        pd.gather(plain(u).t(), torch.tensor([0]))
    with pytest.raises(ValueError, match="contiguous"):
        pd.unified(torch.randn(4, 4).t())
    with pytest.raises(TypeError, match="Tensor"):
        pd.unified([1, 2, 3])
    with pytest.raises(ValueError, match="shape"):
        pd.scatter_(u, torch.tensor([1]), torch.zeros(2, 3))
    with pytest.raises(TypeError, match="dtype"):
        pd.scatter_(u, torch.tensor([1]), torch.zeros(1, 3, dtype=torch.float64))
    with pytest.raises(IndexError, match="11"):
        pd.scatter_(u, torch.tensor([11]), torch.zeros(1, 3))
    with pytest.raises(IndexError, match="-1"):
        u.index_add_(0, torch.tensor([-1]), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="strategy"):
        pd.set_strategy("fastest")


def test_torch_entry_points_cpu():
    table = random_table((40, 6), torch.float32)
    u = pd.unified(table, copy=True)
    idx = torch.randint(0, 40, (4, 5))
    assert torch.equal(torch.nn.functional.embedding(idx, u), table[idx])
    gidx = torch.randint(0, 40, (7, 6))
    assert torch.equal(torch.gather(u, 0, gidx), torch.gather(table, 0, gidx))
    assert torch.equal(u.gather(0, gidx[:, :2]), table.gather(0, gidx[:, :2]))
    with pytest.raises(IndexError):
        torch.gather(u, 0, torch.full((1, 6), 40))
    with pytest.raises(NotImplementedError, match="requires grad"):
        torch.gather(pd.unified(table.clone(), copy=True).requires_grad_(), 0, gidx)
    # Everything else works as on a CPU tensor; results that alias the memory stay unified.
    assert pd.is_unified(u[3:9]) and pd.is_unified(u.view(-1)) and pd.is_unified(u[0])
    assert not pd.is_unified(u + 1) and torch.equal(u + 1, table + 1)
    assert torch.equal(u[2:4, 1:3], table[2:4, 1:3])
    assert repr(u).startswith("unified tensor(")


@pytest.mark.parametrize("write", ["setitem", "index_copy_", "scatter_"])
def test_row_writes_tell_autograd_the_table_changed(write):
    # the row writes go through the package's kernels, which torch does not see: the table's version counter stayed
    # as it was, so a backward that needed the values saved before the write silently used the new ones (torch's own
    # writes make it raise)
    table = random_table((12, 3), torch.float32)
    u = pd.unified(table, copy=True).requires_grad_()
    loss = (u * u).sum()  # (saves u for the backward)
    before = u._version
    with torch.no_grad():
        if write == "setitem":
            u[torch.tensor([1, 5])] = torch.zeros(2, 3)
        elif write == "index_copy_":
            u.index_copy_(0, torch.tensor([1]), torch.zeros(1, 3))
        else:
            pd.scatter_(u, torch.tensor([4], dtype=torch.int32), torch.zeros(1, 3))
    assert u._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_index_select_with_a_0d_index_keeps_the_dimension():
    # torch's index_select with a 0-d index gives one row of shape (1, ...); the redirected one gave the row alone
    table = random_table((40, 6), torch.float32)
    u = pd.unified(table, copy=True)
    for index in (torch.tensor(7), torch.tensor(7, dtype=torch.int32)):
        for got in (u.index_select(0, index), torch.index_select(u, 0, index)):
            assert got.shape == (1, 6) and torch.equal(got, table.index_select(0, index))


@pytest.mark.parametrize("dtype", DTYPES)
def test_writes_cpu(dtype):
    table = random_table((50, 7), dtype)
    ref = table.clone()
    u = pd.unified(table.clone(), copy=True)
    idx = torch.randperm(50)[:20]
    vals = random_table((20, 7), dtype, seed=1)
    pd.scatter_(u, idx, vals)
    ref[idx] = vals
    assert same_bytes(plain(u), ref)
    u[idx[:3]] = vals[:3]
    u.index_copy_(0, idx[3:6], vals[3:6])
    ref.index_copy_(0, idx[3:6], vals[3:6])
    assert same_bytes(plain(u), ref)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.bfloat16])
def test_index_add_other_dtypes_cpu(dtype):
    table = random_table((20, 3), dtype) // 4 if not dtype.is_floating_point else random_table((20, 3), dtype)
    u = pd.unified(table.clone(), copy=True)
    idx = torch.tensor([1, 1, 5])
    vals = torch.ones(3, 3, dtype=dtype)
    u.index_add_(0, idx, vals)
    assert torch.equal(plain(u), table.index_add(0, idx, vals))
    if not dtype.is_floating_point:
        with pytest.raises(ValueError, match="alpha"):
            pd.index_add_(u, idx, vals, alpha=0.5)


def test_index_add_duplicates_cpu():
    table = torch.randn(20, 3, dtype=torch.float64)
    u = pd.unified(table.clone(), copy=True)
    idx = torch.tensor([1, 1, 1, 5, 19, 5])
    vals = torch.randn(6, 3, dtype=torch.float64)
    pd.index_add_(u, idx, vals, alpha=0.5)
    assert torch.allclose(plain(u), table.index_add(0, idx, vals, alpha=0.5))


def test_unified_in_place_shares_memory_and_lifetime():
    x = torch.randn(100, 4)
    u = pd.unified(x)
    assert u.data_ptr() == x.data_ptr()
    x[3] = 42.0
    assert torch.equal(u[torch.tensor([3])], torch.full((1, 4), 42.0))
    assert pd.unified(u) is u
    c = pd.unified(x, copy=True)
    assert c.data_ptr() != x.data_ptr() and torch.equal(plain(c), x)
    v = u[10:20]
    del u, x, c
    gc.collect()
    assert v.shape == (10, 4) and float(v[torch.tensor([0])].abs().sum()) >= 0  # memory still alive


def test_empty_zeros_shapes():
    z = pd.zeros(3, 4, dtype=torch.int16)
    assert pd.is_unified(z) and z.shape == (3, 4) and z.dtype == torch.int16 and int(plain(z).abs().sum()) == 0
    assert pd.zeros((2, 2)).shape == (2, 2)
    assert pd.empty(0, 5).shape == (0, 5)
    assert pd.zeros(5, dtype=torch.bool).dtype == torch.bool
    with pytest.raises(ValueError):
        pd.empty(-1)


def test_a_table_larger_than_the_host_is_a_memory_error_naming_its_size(monkeypatch):
    # Pageable tables (a CPU-only machine, pin=False) were allocated unchecked: a size past what the host has raised
    # "MemoryError: std::bad_alloc" (no size, no fix), or got the process killed by the OOM killer once touched;
    # a size past the address space raised a TypeError from the bindings.
    from pytorch_direct import _memory

    monkeypatch.setattr(_memory, "available_host_bytes", lambda: 1 << 20)
    makers = [lambda: pd.empty(1 << 19, 4, pin=False), lambda: pd.zeros(3 << 18, dtype=torch.float64, pin=False)]
    if not pd.cuda_usable():  # (else pinned memory, which cudaHostAlloc refuses by itself)
        makers.append(lambda: pd.unified(torch.zeros(1 << 19, dtype=torch.int32), copy=True))
    for make in makers:
        with pytest.raises(MemoryError, match=r"unified tensor of (2|6|8)\.00 MiB does not fit in the 1\.00 MiB .*"
                                              r"use a smaller table"):
            make()
    monkeypatch.setattr(_memory, "available_host_bytes", lambda: None)  # unknown: the allocation itself fails
    with pytest.raises(MemoryError, match=r"unified tensor of 1024\.00 TiB \(shape \(1125899906842624,\), "
                                          r"torch\.uint8\) failed .*free host memory"):
        pd.empty(1 << 50, dtype=torch.uint8, pin=False)
    assert pd.empty(1 << 10, pin=False).shape == (1 << 10,)


def test_memory_kind_choice(monkeypatch):
    from pytorch_direct import _memory

    big, small = _memory.MANAGED_MIN_BYTES, _memory.MANAGED_MIN_BYTES - 1
    monkeypatch.setattr(_memory, "_MANAGED", True)
    assert _memory.memory_kind(big, "auto") == "managed"
    assert _memory.memory_kind(small, "auto") == "pinned"  # small: fork-readable pinned memory
    assert _memory.memory_kind(small, "managed") == "managed"
    assert _memory.memory_kind(big, "pinned") == "pinned"
    monkeypatch.setattr(_memory, "_MANAGED", False)  # a GPU without concurrent managed access
    assert _memory.memory_kind(big, "auto") == "pinned"
    with pytest.raises(ValueError, match="memory must be one of"):
        _memory.memory_kind(big, "unified")
    with pytest.raises(ValueError, match="memory must be one of"):
        pd.empty(4, memory="host")
    with pytest.raises(ValueError, match="needs copy=True"):
        pd.unified(torch.zeros(4), memory="managed")
    # A managed table larger than the host's available memory is refused before anything is touched.
    assert _memory.available_host_bytes() > 0  # (Linux)
    monkeypatch.setattr(_memory, "available_host_bytes", lambda: 1 << 20)
    with pytest.raises(MemoryError, match="does not fit"):
        _memory.check_host_room(2 << 20)
    _memory.check_host_room(1 << 20)
    monkeypatch.setattr(_memory, "available_host_bytes", lambda: None)  # unknown: no check
    _memory.check_host_room(1 << 50)
    # A forked process cannot read managed memory: the row operations say so (here faked: no GPU).
    t = pd.zeros(6, 2)
    monkeypatch.setattr(_memory, "forked", True)
    monkeypatch.setattr(_memory, "host_kind", lambda _: "managed")
    with pytest.raises(RuntimeError, match="forked process"):
        t[torch.tensor([1])]
    monkeypatch.setattr(_memory, "host_kind", lambda _: "pinned")
    assert t[torch.tensor([1])].shape == (1, 2)
    monkeypatch.setattr(_memory, "forked", False)
    # On a CPU-only machine every kind is ordinary memory that the CPU path reads.
    if not pd.cuda_usable():
        t = pd.zeros(3, 2, memory="managed")
        assert torch.equal(t[torch.tensor([2, 0])], torch.zeros(2, 2))


def test_from_file_writable_through_pinned_copy(tmp_path, monkeypatch):
    # The CUDA path of writable=True (a pinned copy written back), with pageable memory standing in for pinned.
    from pytorch_direct import _create

    data = torch.randint(0, 256, (16 + 64 * 47,), dtype=torch.uint8)
    path = tmp_path / "rows.bin"
    data.numpy().tofile(path)
    monkeypatch.setattr(_create, "cuda_usable", lambda: True)
    real_empty = _create.empty
    monkeypatch.setattr(_create, "empty", lambda *s, dtype: real_empty(*s, dtype=dtype, pin=False))

    def on_disk():
        return torch.from_file(str(path), size=16 + 64 * 47, dtype=torch.uint8)[16:].view(64, 47)

    w = pd.from_file(path, (64, 47), torch.uint8, offset=16, writable=True)
    assert torch.equal(w.plain(), data[16:].view(64, 47))
    w[torch.tensor([3])] = torch.full((1, 47), 7, dtype=torch.uint8)
    assert not torch.equal(on_disk()[3], torch.full((47,), 7, dtype=torch.uint8))  # not written back yet
    pd.flush(w)
    assert torch.equal(on_disk()[3], torch.full((47,), 7, dtype=torch.uint8))
    w[torch.tensor([4])] = torch.full((1, 47), 9, dtype=torch.uint8)
    del w
    gc.collect()
    assert torch.equal(on_disk()[4], torch.full((47,), 9, dtype=torch.uint8))  # written back when collected
    assert torch.equal(on_disk()[5], data[16:].view(64, 47)[5])


def test_from_file(tmp_path):
    table = random_table((64, 47), torch.uint8)
    path = tmp_path / "t.bin"
    path.write_bytes(b"\x00" * 16 + table.numpy().tobytes())
    u = pd.from_file(path, (64, 47), torch.uint8, offset=16)
    assert torch.equal(u[torch.arange(64)], table)
    w = pd.from_file(path, (64, 47), torch.uint8, offset=16, writable=True)
    w[torch.tensor([0])] = torch.zeros(1, 47, dtype=torch.uint8)
    del w
    gc.collect()
    assert path.read_bytes()[16:16 + 47] == b"\x00" * 47
    with pytest.raises(ValueError, match="needs"):
        pd.from_file(path, (65, 47), torch.uint8, offset=16)
    with pytest.raises(FileNotFoundError):
        pd.from_file(tmp_path / "missing.bin", (1,), torch.uint8)


def test_autograd_host_gradient_cpu():
    table = torch.randn(30, 4)
    emb = pd.unified(table.clone(), copy=True).requires_grad_()
    idx = torch.tensor([[1, 2, 2], [29, 1, 0]])
    w = torch.randn(2, 3, 4)
    (torch.nn.functional.embedding(idx, emb) * w).sum().backward()
    ref = table.clone().requires_grad_()
    (torch.nn.functional.embedding(idx, ref) * w).sum().backward()
    assert pd.is_unified(emb.grad)
    assert torch.allclose(plain(emb.grad), ref.grad, atol=1e-6)
    with pytest.raises(NotImplementedError, match="leaf"):
        emb[5:][torch.tensor([0])]
    # An optimizer step on the host table works as on any CPU parameter.
    opt = torch.optim.SGD([emb], lr=0.1)
    opt.step()
    assert torch.allclose(plain(emb).detach(), table - 0.1 * ref.grad, atol=1e-6)


def test_torch_compile_fullgraph_cpu():
    table = torch.randn(100, 8)
    u = pd.unified(table, copy=True).plain()  # the plain-tensor route (test_compile.py covers the subclass)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(idx):
        return pd.gather(u, idx) * 2 + torch.ops.pytorch_direct.gather(u, idx)

    idx = torch.randint(0, 100, (16,))
    assert torch.allclose(f(idx), table[idx] * 3)


def test_custom_ops_registered_with_fake_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = torch.empty(10, 3, 2)
        i = torch.empty(4, 5, dtype=torch.int64)
        assert torch.ops.pytorch_direct.gather(t, i).shape == (4, 5, 3, 2)
    torch.library.opcheck(torch.ops.pytorch_direct.gather.default,
                          (pd.unified(torch.randn(10, 3), copy=True).as_subclass(torch.Tensor),
                           torch.tensor([1, 2])), test_utils=("test_schema", "test_faketensor"))


@pytest.fixture
def env_settings(monkeypatch):
    """Settings re-read from the environment inside a test; the process's own again after it."""

    def read():
        _config.settings.reload()
        return _config.settings

    yield read
    monkeypatch.undo()
    _config.settings.reload()


def test_settings_and_env(monkeypatch, env_settings):
    monkeypatch.setenv("PYTORCH_DIRECT_STRATEGY", "sorted")
    monkeypatch.setenv("PYTORCH_DIRECT_THREADS", "3")
    s = env_settings()
    assert s.strategy == "sorted" and s.threads == 3
    monkeypatch.setenv("PYTORCH_DIRECT_THREADS", "many")
    with pytest.raises(ValueError, match="PYTORCH_DIRECT_THREADS"):
        env_settings()
    monkeypatch.setenv("PYTORCH_DIRECT_THREADS", "0")
    monkeypatch.setenv("PYTORCH_DIRECT_BOUNDS_CHECK", "never")
    with pytest.raises(ValueError, match="PYTORCH_DIRECT_BOUNDS_CHECK.*sync"):
        env_settings()
    monkeypatch.setenv("PYTORCH_DIRECT_BOUNDS_CHECK", "sync")
    for text, value in (("off", False), ("FALSE", False), ("0", False), ("on", True), ("1", True)):
        monkeypatch.setenv("PYTORCH_DIRECT_AUTO_CALIBRATE", text)
        assert env_settings().auto_calibrate is value
    monkeypatch.setenv("PYTORCH_DIRECT_AUTO_CALIBRATE", "yes please")
    with pytest.raises(ValueError, match="PYTORCH_DIRECT_AUTO_CALIBRATE.*true"):
        env_settings()
    monkeypatch.delenv("PYTORCH_DIRECT_AUTO_CALIBRATE")
    monkeypatch.delenv("PYTORCH_DIRECT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    assert env_settings().cache_dir == Path("/somewhere/cache/pytorch_direct")
    pd.set_threads(2)
    try:
        u = pd.unified(torch.randn(1000, 3), copy=True)
        assert torch.equal(u[torch.arange(1000)], plain(u))
    finally:
        pd.set_threads(0)


def test_host_spin_setting(monkeypatch, env_settings):
    assert env_settings().host_spin_us == 200
    monkeypatch.setenv("PYTORCH_DIRECT_HOST_SPIN_US", "0")
    assert env_settings().host_spin_us == 0
    monkeypatch.setenv("PYTORCH_DIRECT_HOST_SPIN_US", "-5")
    with pytest.raises(ValueError, match="PYTORCH_DIRECT_HOST_SPIN_US"):
        env_settings()
    monkeypatch.undo()
    env_settings()
    with pytest.raises(ValueError, match="host_spin_us"):
        pd.set_host_spin_us(-1)
    table = random_table((5000, 7), torch.float32)
    u = pd.unified(table, copy=True)
    idx = torch.randint(0, 5000, (20000,))
    try:
        for spin in (0, 5000, 200):  # the pool takes each setting; host gathers stay right across the changes
            pd.set_host_spin_us(spin)
            for _ in range(3):
                assert torch.equal(u[idx], table[idx])
    finally:
        pd.set_host_spin_us(200)


def _worker_read(table):
    return table


def test_forked_dataloader_workers():
    table = random_table((200, 5), torch.float32)
    u = pd.unified(table, copy=True)
    u[torch.tensor([0])]  # the parent's thread pool exists before the fork

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return u[torch.tensor([i, 199 - i])]

    dl = torch.utils.data.DataLoader(DS(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    got = torch.cat(list(dl))
    ref = torch.stack([table[[i, 199 - i]] for i in range(32)])
    assert torch.equal(got, ref)


def test_shared_memory_cpu():
    name = f"pytorch_direct-cpu-test-{os.getpid()}"
    a = pd.shared_memory(name, (10, 3), torch.float32, create=True)
    try:
        with pytest.raises(FileExistsError):
            pd.shared_memory(name, (10, 3), torch.float32, create=True)
        with pytest.raises(ValueError, match="bytes"):
            pd.shared_memory(name, (11, 3), torch.float32, create=False)
        b = pd.shared_memory(name, (10, 3), torch.float32, create=False)
        b[torch.tensor([4])] = torch.ones(1, 3)
        assert torch.equal(a[torch.tensor([4])], torch.ones(1, 3))
        assert b.data_ptr() == a.data_ptr()  # one mapping (and registration) per process
        c = pd.shared_memory(name, (30,), torch.float32, create=False)  # same bytes, another shape
        assert pd.is_unified(c) and c.data_ptr() == a.data_ptr() and c.shape == (30,)
        del a, b, c
        gc.collect()
        d = pd.shared_memory(name, (10, 3), torch.float32, create=False)  # mapped again once all were dropped
        assert torch.equal(d[torch.tensor([4])], torch.ones(1, 3))
    finally:
        pd.unlink_shared_memory(name)
    with pytest.raises(FileNotFoundError):
        pd.shared_memory(name, (10, 3), torch.float32, create=False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        pd.share(torch.zeros(2))


def test_shared_memory_larger_than_dev_shm_is_a_memory_error(monkeypatch):
    # a segment is a file in /dev/shm whose pages are taken when first written: one larger than the room there (64 MiB
    # in a Docker container by default) was created, and the process writing it died of SIGBUS, with no Python error
    from pytorch_direct import _sharing

    assert _sharing.free_bytes(_sharing.SHM_DIR) > 0  # (Linux)
    name = f"pytorch_direct-cpu-test-room-{os.getpid()}"
    monkeypatch.setattr(_sharing, "free_bytes", lambda directory: 1 << 20)
    with pytest.raises(MemoryError, match=r"needs 2\.00 MiB .* but /dev/shm has 1\.00 MiB free: enlarge it .*shm-size"):
        pd.shared_memory(name, (1 << 19,), torch.float32, create=True)
    assert not os.path.exists(os.path.join(_sharing.SHM_DIR, name))
    try:
        assert pd.shared_memory(name, (1 << 18,), torch.float32, create=True).shape == (1 << 18,)  # 1 MiB: fits
    finally:
        pd.unlink_shared_memory(name)


SHARE_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import pytorch_direct as pd

def work(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.arange(60.0).view(20, 3) if rank == 0 else None
    u = pd.share(t)
    assert torch.equal(u[torch.tensor([19, 0])], torch.arange(60.0).view(20, 3)[[19, 0]])
    dist.barrier()
    if rank == 1:
        u[torch.tensor([5])] = torch.full((1, 3), -1.0)   # one copy: every process sees the write
    dist.barrier()
    assert torch.equal(u[torch.tensor([5])], torch.full((1, 3), -1.0)), rank
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(work, args=(3, int(sys.argv[1])), nprocs=3)
    print("ok")
"""


def test_share_across_processes(tmp_path):
    script = tmp_path / "share.py"
    script.write_text(SHARE_SCRIPT)
    port = 29500 + os.getpid() % 1000
    before = set(os.listdir("/dev/shm"))
    r = subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
    leftover = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("pytorch_direct")}
    assert not leftover  # names are unlinked once everyone attached


def _has_sampler():
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("pyg_lib", "torch_sparse"))


def test_pyg_feature_store_cpu():
    pytest.importorskip("torch_geometric")
    from torch_geometric.loader import NeighborLoader

    from pytorch_direct.pyg import UnifiedFeatureStore, make_graph_store

    n = 300
    x = torch.randn(n, 9)
    y = torch.randint(0, 5, (n,))
    edge_index = torch.randint(0, n, (2, 2000))
    fs = UnifiedFeatureStore(device="cpu")
    fs.put_tensor(x, group_name=None, attr_name="x", index=None)
    fs.put_tensor(y, group_name=None, attr_name="y", index=None)
    assert pd.is_unified(fs.get_tensor(group_name=None, attr_name="x", index=None))
    gs = make_graph_store(edge_index, num_nodes=n)
    # The loader's feature path (what NeighborLoader calls per batch), without needing a sampler backend.
    from torch_geometric.loader.utils import filter_custom_store

    node = torch.randint(0, n, (50,))
    data = filter_custom_store(fs, gs, node, edge_index[0, :10], edge_index[1, :10], None)
    assert torch.equal(data.x, x[node]) and torch.equal(data.y, y[node])
    if not _has_sampler():
        pytest.skip("NeighborLoader needs pyg-lib or torch-sparse (not installed); the feature path was checked")
    loader = NeighborLoader((fs, gs), num_neighbors=[4, 4], batch_size=32, input_nodes=torch.arange(96))
    batches = list(loader)
    assert len(batches) == 3
    for b in batches:
        assert torch.equal(b.x, x[b.n_id]) and torch.equal(b.y, y[b.n_id])


def test_info_cli():
    r = subprocess.run([sys.executable, "-m", "pytorch_direct", "info"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "pytorch-direct" in r.stdout
    assert "kernels_compiled" in pd.info()
    assert pd.info()["large_tables"] in ("pageable (no GPU)", "managed", "pinned (no concurrent managed access)")


def test_over_2_31_elements_cpu():
    # 2^31 + 2^20 one-byte elements; only the pages written are ever touched, so this costs little memory.
    rows, width = (2**31 + 2**20) // 64, 64
    u = pd.empty(rows, width, dtype=torch.uint8, pin=False)
    idx = torch.tensor([0, rows - 1, 2**31 // 64 + 5, rows // 2])
    vals = torch.randint(0, 256, (4, width), dtype=torch.uint8)
    pd.scatter_(u, idx, vals)
    assert torch.equal(u[idx], vals) and torch.equal(u[idx.int()], vals)
    assert torch.equal(plain(u)[idx], vals)


def test_readme_first_example_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, re.S)[0].replace("1_000_000", "10_000")
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["rows"].shape == (4096, 128)


class _FakeEvent:
    """Stands in for torch.cuda.Event in the emulated staged gather: records which slot copies were ordered."""

    def __init__(self):
        self.recorded = 0

    def record(self, stream=None):
        self.recorded += 1

    def synchronize(self):
        pass


@pytest.mark.parametrize("shape,dtype", [((5000, 16), torch.float32), ((3000,), torch.int64),
                                         ((700, 3, 5), torch.bfloat16), ((900, 47), torch.uint8),
                                         ((40, 30_000), torch.uint8), ((600, 7), torch.bool)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_staged_torch_engine_emulated(monkeypatch, shape, dtype, index_dtype):
    # The staged gather's chunk loop (torch index_select into pinned slots, copy per chunk), run on the CPU with
    # CPU stand-ins for the slots, events and stream: every row lands in order, across chunk and slot boundaries.
    import contextlib

    from pytorch_direct import _kernels

    monkeypatch.setattr(_kernels, "NATIVE_STAGED_MAX_ROW", 0)  # every width through this engine
    monkeypatch.setattr(_kernels._Slots, "BYTES", 1 << 16)  # many chunks, slots reused
    slots = ([torch.empty(1 << 16, dtype=torch.uint8) for _ in range(_kernels._Slots.COUNT)],
             [_FakeEvent() for _ in range(_kernels._Slots.COUNT)])
    monkeypatch.setattr(_kernels._Slots, "get", classmethod(lambda cls, device: slots))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    table = (torch.rand(shape) * 100).to(dtype)
    rows, rb = _kernels.row_layout(table)
    idx = torch.randint(0, rows, (4321,), dtype=index_dtype)
    out = torch.empty((idx.numel(),) + tuple(shape[1:]), dtype=dtype)
    _kernels.gather_staged(table, rows, rb, idx, out, None)
    assert torch.equal(out, table[idx.long()])
    chunks = list(_kernels._Slots.chunks(idx.numel(), rb))
    assert sum(e.recorded for e in slots[1]) == len(chunks)  # one copy per chunk
    bad = idx.clone()
    bad[3000] = rows
    with pytest.raises(IndexError, match=f"index {rows} at position 3000"):
        _kernels.gather_staged(table, rows, rb, bad, out, None)


@pytest.mark.parametrize("count,row_bytes", [(0, 64), (1, 64), (100_000, 64), (3_000, 4096), (5, 3 << 20),
                                             (7, 9 << 20)])
def test_staged_chunk_schedule(count, row_bytes):
    # Chunks cover the rows in order with no gap, each fills at most one slot (BYTES) unless a single row is wider
    # (the caller sends such rows elsewhere), and holds at least one row.
    from pytorch_direct import _kernels

    chunks = list(_kernels._Slots.chunks(count, row_bytes))
    assert [s for s, _ in chunks] == ([0] + [e for _, e in chunks[:-1]] if count else [])
    assert (chunks[-1][1] if chunks else 0) == count
    assert all(e > s for s, e in chunks)
    assert all((e - s) * row_bytes <= max(_kernels._Slots.BYTES, row_bytes) for s, e in chunks)
    assert len(chunks) == -(-count // max(1, _kernels._Slots.BYTES // row_bytes))


def test_eager_calls_skip_the_dispatcher(monkeypatch):
    # A plain eager call runs the implementation directly; autograd, dispatch modes (fake tensors, export) and the
    # profiler still see the custom op.
    from torch.utils._python_dispatch import TorchDispatchMode

    from pytorch_direct import _ops

    table = pd.unified(torch.randn(50, 4), copy=True)
    idx = torch.tensor([3, 1, 3])
    calls = []
    real = _ops.gather_op
    monkeypatch.setattr(_ops, "gather_op", lambda *a, **k: calls.append("op") or real(*a, **k))
    assert torch.equal(pd.gather(table, idx), table.plain()[idx])
    assert torch.equal(table[idx], table.plain()[idx])
    assert calls == []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        pd.gather(table, idx)
    assert "op" in calls and "pytorch_direct.gather.default" in calls
    calls.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        pd.gather(table, idx)
    assert calls == ["op"]
    calls.clear()
    table.requires_grad_(True)
    rows = pd.gather(table, idx)
    assert calls == ["op"] and rows.grad_fn is not None
    with torch.no_grad():
        assert pd.gather(table, idx).grad_fn is None
    assert calls == ["op"]


def test_unified_feature_store_gathers_through_the_cache():
    # (Here, not in test_cache.py: importing torch_geometric replaces torch.index_select, after which
    # torch.compile of torch.index_select on a unified tensor fails; test_compile.py runs before this module.)
    pytest.importorskip("torch_geometric")
    from pytorch_direct.pyg import UnifiedFeatureStore

    x = torch.randn(500, 8)
    fs = UnifiedFeatureStore(device="cpu")
    fs.put_tensor(x, group_name=None, attr_name="x", index=None)
    table = fs.get_tensor(group_name=None, attr_name="x", index=None)
    cache = pd.cached(table, 500 * 4 + 16 + 50 * 40, frequency=torch.arange(500, 0, -1).float(), device="cpu")
    idx = torch.tensor([0, 1, 2, 499])
    assert torch.equal(fs.get_tensor(group_name=None, attr_name="x", index=idx), x[idx])
    assert cache.hit_rate(idx) == 0.75
    fs.put_tensor(torch.zeros(2, 8), group_name=None, attr_name="x", index=torch.tensor([0, 499]))  # row updates
    assert torch.equal(fs.get_tensor(group_name=None, attr_name="x", index=idx)[[0, 3]], torch.zeros(2, 8))
