"""The deduplicating gather on the CPU: its index transformation, the CPU path with strategy="dedupe", gradients of
duplicated rows, and every GPU plan's orchestration run with CPU stand-ins for the kernel launch, the streams and
the pinned slots (the kernels themselves, device-side count included, are checked by tests/cpp/emulate_kernels.cpp).
"""

import contextlib

import pytest
import torch
from test_cpu import random_table, same_bytes

import pytorch_direct as pd
from pytorch_direct import _core, _kernels
from pytorch_direct._strategies import Plan, RowJob, run


@pytest.mark.parametrize("n,high", [(1, 5), (1000, 10), (5000, 100000), (4096, 1)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("checked", [True, False])
def test_dedupe_indices(n, high, dtype, checked):
    idx = torch.randint(0, high, (n,), dtype=dtype, generator=torch.Generator().manual_seed(n))
    unique, count, inverse = _kernels.dedupe_indices(idx, high, checked)
    u = int(count)
    assert count.shape == (1,) and inverse.shape == (n,)
    assert torch.equal(unique[:u].long(), torch.unique(idx).long())  # distinct, ascending
    assert torch.equal(unique[inverse].long(), idx.long())
    assert unique.dtype == (torch.int32 if checked else dtype)  # checked int64 keys sort as int32


def test_dedupe_indices_keep_wide_unchecked_values():
    # Unchecked indices are never narrowed: a bad int64 index must stay bad (and be reported), not wrap to a row.
    idx = torch.tensor([2**32 + 1, 1, 1])
    unique, count, inverse = _kernels.dedupe_indices(idx, 10, checked=False)
    assert int(count) == 2 and unique[1] == 2**32 + 1 and torch.equal(unique[inverse], idx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.bool, torch.float64])
@pytest.mark.parametrize("row_shape", [(), (47,), (3, 5), (64,)])
def test_dedupe_on_cpu_matches_indexing(dtype, row_shape):
    table = random_table((300,) + row_shape, dtype)
    u = pd.unified(table, copy=True)
    g = torch.Generator().manual_seed(5)
    for idx in (torch.randint(0, 20, (2000,), generator=g), torch.randint(0, 300, (7, 9), generator=g),
                torch.full((513,), 299), torch.tensor([4]), torch.empty(0, dtype=torch.int64)):
        for strategy in ("dedupe", "dedupe_staged"):
            assert same_bytes(pd.gather(u, idx, strategy=strategy), table[idx])


def test_dedupe_on_cpu_runs_on_torchs_threads_only(monkeypatch):
    # The package's threads poll for work after each call; torch's sort needs the same cores. The CPU dedupe path
    # therefore never hands work to the package's pool (it would fight torch's threads at every hand-over).
    def package_pool(*args, **kwargs):
        raise AssertionError("the package's thread pool was used by the CPU dedupe path")

    table = random_table((300, 16), torch.float32)
    u = pd.unified(table, copy=True)
    idx = torch.randint(0, 300, (5000,), generator=torch.Generator().manual_seed(1))
    for name in ("gather_host", "check_host_indices", "scatter_host"):
        monkeypatch.setattr(_core, name, package_pool)
    for strategy in ("dedupe", "dedupe_staged"):
        assert same_bytes(pd.gather(u, idx, strategy=strategy), table[idx])
    with pytest.raises(AssertionError, match="thread pool"):
        pd.gather(u, idx)  # (the default path does use it: the stand-in is live)


def test_dedupe_on_cpu_reports_the_bad_index():
    u = pd.unified(torch.randn(50, 4), copy=True)
    with pytest.raises(IndexError, match="index 50 at position 3"):
        pd.gather(u, torch.tensor([1, 1, 2, 50, 1]), strategy="dedupe")
    with pytest.raises(IndexError, match="-1"):
        pd.gather(u, torch.tensor([-1, 3]), strategy="dedupe")


def test_dedupe_gradients_sum_duplicates_into_the_host_gradient():
    table = torch.randn(40, 6, dtype=torch.float64)
    emb = pd.unified(table.clone(), copy=True).requires_grad_()
    idx = torch.tensor([[3, 3, 7], [3, 39, 7]])
    weight = torch.randn(2, 3, 6, dtype=torch.float64)
    (pd.gather(emb, idx, strategy="dedupe") * weight).sum().backward()
    ref = table.clone().requires_grad_()
    (ref[idx] * weight).sum().backward()
    assert pd.is_unified(emb.grad) and torch.allclose(emb.grad.plain(), ref.grad)
    assert torch.allclose(emb.grad.plain()[3], weight[0, 0] + weight[0, 1] + weight[1, 0])
    (pd.gather(emb, torch.full((100,), 5), strategy="dedupe") * 2).sum().backward()  # all identical
    assert torch.allclose(emb.grad.plain()[5], ref.grad[5] + 200)


def test_expand_rows_odd_widths():
    for rb in (1, 3, 6, 47, 64, 100):
        buf = torch.randint(0, 256, (9, rb), dtype=torch.uint8)
        inverse = torch.randint(0, 9, (40,))
        out = torch.empty(40 * rb, dtype=torch.uint8)
        _kernels.expand_rows(buf, inverse, out, rb)
        assert torch.equal(out.view(40, rb), buf[inverse])


# ---------------------------------------------------------------------------------------------------- plans


class _FakeStream:
    cuda_stream = 0

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


class _FakeEvent:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def cpu_stand_ins(monkeypatch):
    """Runs the GPU strategies' gathers on CPU tensors: the kernel launch becomes a loop that honours
    positions and the device-side count (and logs the rows it read), streams and events do nothing."""
    reads = []

    def launch(table, rows, rb, idx, out, positions, kind, max_sms, stream, device_count=None):
        n = idx.numel() if device_count is None else min(idx.numel(), int(device_count))
        src = table.reshape(-1).view(torch.uint8)[: rows * rb].view(rows, rb)
        dst = out.reshape(-1).view(torch.uint8)
        dst = dst[: dst.numel() // rb * rb].view(-1, rb)
        at = positions[:n] if positions is not None else torch.arange(n)
        dst[at] = src[idx[:n].long()]
        reads.append(n)

    slots = ([torch.empty(_kernels._Slots.BYTES, dtype=torch.uint8) for _ in range(_kernels._Slots.COUNT)],
             [_FakeEvent() for _ in range(_kernels._Slots.COUNT)])
    monkeypatch.setattr(_kernels, "launch_gather", launch)
    # The native staged pipeline's row copies without its DMA: the package's host gather into `dest`.
    monkeypatch.setattr(_kernels, "launch_gather_staged", lambda table, rows, rb, h, dest, stream: _core.gather_host(
        table.data_ptr(), rows, rb, h.data_ptr(), h.element_size(), h.numel(), 0, dest.data_ptr(), 0))
    monkeypatch.setattr(_kernels, "host_index", lambda idx: idx.clone())
    monkeypatch.setattr(_kernels._Slots, "get", classmethod(lambda cls, device: slots))
    monkeypatch.setattr(_kernels._Side, "get", classmethod(lambda cls, device: _FakeStream()))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _FakeStream())
    monkeypatch.setattr(_kernels, "raw_stream", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    return reads


@pytest.mark.parametrize("plan", [Plan("vector"), Plan("sorted"), Plan("dedupe"), Plan("staged"),
                                  Plan("dedupe_staged"), Plan("split", 0.3, "sorted"), Plan("split", 0.8, "vector"),
                                  Plan("split", 0.0), Plan("split", 1.0)])
@pytest.mark.parametrize("dtype,row_shape", [(torch.float32, (16,)), (torch.uint8, (47,)), (torch.int64, ())])
def test_gather_plans_with_cpu_stand_ins(cpu_stand_ins, plan, dtype, row_shape):
    table = random_table((500,) + row_shape, dtype)
    rows, rb = _kernels.row_layout(table)
    g = torch.Generator().manual_seed(2)
    for idx in (torch.randint(0, 40, (3000,), generator=g), torch.full((777,), 13), torch.tensor([499]),
                torch.randint(0, 500, (100,), generator=g, dtype=torch.int32)):
        out = torch.full((idx.numel(),) + row_shape, 0).to(dtype)
        cpu_stand_ins.clear()
        job = RowJob("gather", table, rows, rb, idx, out.view(idx.numel(), -1))
        run(job, plan, check_bounds=False, in_range=True)
        assert same_bytes(out, table[idx.long()]), (plan, idx[:5])
        if plan.strategy == "dedupe":
            assert cpu_stand_ins == [torch.unique(idx).numel()]  # each distinct row read once over "PCIe"
