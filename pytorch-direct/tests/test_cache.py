"""The GPU cache of hot rows (pd.cached): exact results, coherence after every kind of write, the byte budget, the
frequency estimates; on the CPU (a cache on the CPU serves CPU indices) and, marked gpu, on a GPU."""

import pytest
import torch
from test_cpu import random_table, same_bytes

import pytorch_direct as pd
from pytorch_direct import _cache, _core

ROWS = 500


def table_and_frequency(row_shape=(16,), dtype=torch.float32, seed=0):
    table = random_table((ROWS,) + row_shape, dtype, seed=seed)
    # Rows 0, 7, 14, ... are hot (a degree-like score), the others cold; a few zero (never cached).
    frequency = torch.ones(ROWS)
    frequency[::7] = 100.0
    frequency[3::50] = 0.0
    return table, pd.unified(table.clone(), copy=True), frequency


def budget_for(cached_rows, row_bytes, count=False):
    return ROWS * 4 * (2 if count else 1) + _cache.SLACK + cached_rows * (row_bytes + 8)


@pytest.mark.parametrize("dtype,row_shape", [(torch.float32, (16,)), (torch.uint8, (47,)), (torch.int64, ()),
                                             (torch.float16, (3, 5))])
def test_cached_gathers_are_exact(dtype, row_shape):
    table, u, frequency = table_and_frequency(row_shape, dtype)
    rb = u.plain()[0].numel() * u.element_size()
    cache = pd.cached(u, budget_for(40, rb), frequency=frequency, device="cpu")
    assert cache.capacity == 40 and cache.cached_rows == 40
    hot = set(range(0, ROWS, 7))
    assert set(cache.row_of_slot[: cache.cached_rows].tolist()) <= hot  # the highest scores
    g = torch.Generator().manual_seed(1)
    for idx in (torch.randint(0, ROWS, (3000,), generator=g), torch.arange(0, ROWS, 7), torch.tensor([3]),
                torch.randint(0, ROWS, (4, 9), generator=g, dtype=torch.int32), torch.empty(0, dtype=torch.int64)):
        for gather in (lambda i: u[i], lambda i: pd.gather(u, i), lambda i: u.index_select(0, i.reshape(-1))):
            got = gather(idx)
            assert same_bytes(got, table[idx.reshape(got.shape[: got.dim() - len(row_shape)]).long()])
    assert 0 < cache.hit_rate(torch.arange(ROWS)) < 0.2
    assert cache.hit_rate(torch.arange(0, ROWS, 7)) > 0.5


def test_the_cache_serves_hits_from_its_own_copy():
    # Poisoning the cached copy (not the table) shows which rows came from it: exactly the cached ones.
    table, u, frequency = table_and_frequency()
    cache = pd.cached(u, budget_for(30, 64), frequency=frequency, device="cpu")
    cache.rows_view()[: cache.cached_rows] = 0xFF  # (NaN floats)
    idx = torch.arange(ROWS)
    got = u[idx]
    from_cache = torch.isnan(got).all(1)
    assert torch.equal(from_cache, cache.slot_of_row >= 0) and int(from_cache.sum()) == 30
    assert torch.equal(got[~from_cache], table[~from_cache])
    cache.refresh()  # reads every cached row again from the table
    assert same_bytes(u[idx], table)


def test_writes_keep_the_cache_coherent():
    table, u, frequency = table_and_frequency()
    pd.cached(u, budget_for(60, 64), frequency=frequency, device="cpu")
    g = torch.Generator().manual_seed(2)
    ref = table.clone()
    everything = torch.arange(ROWS)

    def check():
        assert same_bytes(u[everything], ref)

    idx = torch.tensor([0, 7, 7, 8, 14, 499])  # cached and not, a duplicate
    vals = torch.randn(6, 16, generator=g)
    vals[2] = vals[1]  # (duplicates write the same row: one writer wins either way)
    u[idx] = vals
    ref[idx] = vals
    check()
    pd.scatter_(u, torch.tensor([21, 22]), torch.randn(2, 16, generator=g).clone())
    ref[21:23] = u.plain()[21:23]
    check()
    add = torch.randn(6, 16, generator=g)
    u.index_add_(0, idx, add)
    ref.index_add_(0, idx, add)
    check()
    pd.index_add_(u, torch.tensor([28, 28]), torch.ones(2, 16), alpha=0.5)
    ref[28] += 1.0
    check()
    u.index_copy_(0, torch.tensor([35]), torch.full((1, 16), 3.0))
    ref[35] = 3.0
    check()
    # In-place torch ops on the unified tensor (any element may change): the whole cache is read again.
    u.mul_(2)
    ref.mul_(2)
    check()
    u[5:50] = 0.25  # (a slice: torch's own __setitem__)
    ref[5:50] = 0.25
    check()
    u.plain()[42] = 9.0  # another alias: not seen until refresh() (documented)
    ref[42] = 9.0
    _cache.caches_in(u)[0].refresh()
    check()


@pytest.mark.parametrize("write", ["sgd_foreach", "sgd_fused", "adam_foreach", "adam_fused", "init_normal",
                                   "out_tuple"])
def test_optimizer_steps_and_init_keep_the_cache_coherent(write):
    # Multi-tensor optimizer steps (foreach=True, fused=True) write the table as one element of a list, and
    # torch.nn.init's functions pass it by keyword: the cache kept serving the rows as they were before the write.
    table, u, frequency = table_and_frequency()
    pd.cached(u, budget_for(60, 64), frequency=frequency, device="cpu")
    everything = torch.arange(ROWS)
    torch.manual_seed(3)
    if write.startswith(("sgd", "adam")):
        u.requires_grad_(True)
        kind, flavour = write.split("_")
        opt = (torch.optim.SGD if kind == "sgd" else torch.optim.Adam)([u], lr=0.5, **{flavour: True})
        (u[everything] * torch.randn(ROWS, 16)).sum().backward()
        opt.step()
        u.requires_grad_(False)
    elif write == "init_normal":
        torch.nn.init.normal_(u)
    else:
        torch.max(torch.randn(ROWS, 16, 2), dim=2, out=(u, torch.empty(ROWS, 16, dtype=torch.long)))
    assert not same_bytes(u.plain(), table), "the table was written"
    assert same_bytes(u[everything], u.plain())


def test_a_view_of_the_first_rows_checks_its_own_bounds():
    # a view of the cached table's first rows uses the cache; its CPU gathers checked the indices against the whole
    # table's rows, so view[idx] past the view returned a row of the table instead of raising
    table, u, frequency = table_and_frequency()
    pd.cached(u, budget_for(60, 64), frequency=frequency, device="cpu")
    view = u[:10]
    assert same_bytes(view[torch.tensor([9, 0, 7])], table[[9, 0, 7]])
    for bad in (10, 49, -1):
        with pytest.raises(IndexError, match=rf"index {bad} at position 1 is out of range for a table of 10 rows"):
            view[torch.tensor([7, bad])]
        with pytest.raises(IndexError, match="a table of 10 rows"):
            pd.gather(view, torch.tensor([bad], dtype=torch.int32))


def test_hit_rate_checks_its_indices_as_a_gather_does():
    # hit_rate(-1) wrapped to the last row and answered for it (1.0 where that row is cached)
    _, u, frequency = table_and_frequency()
    cache = pd.cached(u, budget_for(60, 64), frequency=frequency, device="cpu")
    assert cache.hit_rate(cache.row_of_slot[:1]) == 1.0
    for bad in (-1, ROWS):
        with pytest.raises(IndexError, match=f"index {bad} is out of range for a table of {ROWS} rows"):
            cache.hit_rate(torch.tensor([0, bad]))


def test_the_byte_budget_is_respected():
    u = pd.unified(torch.randn(ROWS, 16), copy=True)
    for budget, count in ((budget_for(1, 64), False), (budget_for(100, 64) + 50, False), (10**9, False),
                          (budget_for(33, 64, count=True), True)):
        cache = pd.cached(u, budget, frequency=torch.rand(ROWS) + 0.1, count=count, device="cpu")
        assert cache.bytes <= budget and cache.stats()["bytes"] == cache.bytes
        assert cache.capacity == min(ROWS, (budget - ROWS * 4 * (2 if count else 1) - _cache.SLACK) // 72)
        cache.release()
        assert _cache.cache_for(u, ROWS, 64) is None
    with pytest.raises(ValueError, match="too small"):
        pd.cached(u, budget_for(0, 64), frequency=torch.ones(ROWS), device="cpu")


def test_bad_arguments_say_the_fix():
    u = pd.unified(torch.randn(ROWS, 4), copy=True)
    with pytest.raises(ValueError, match="frequency= .* or count=True"):
        pd.cached(u, 1 << 20, device="cpu")
    with pytest.raises(ValueError, match="positive number of bytes"):
        pd.cached(u, 0, count=True, device="cpu")
    with pytest.raises(ValueError, match="one number per table row"):
        pd.cached(u, 1 << 20, frequency=torch.ones(3), device="cpu")
    cache = pd.cached(u, 1 << 20, count=True, device="cpu")
    with pytest.raises(ValueError, match="has a cache already"):
        pd.cached(u, 1 << 20, count=True, device="cpu")
    with pytest.raises(ValueError, match="count=True"):
        pd.cached(pd.unified(torch.randn(10, 4), copy=True), 1 << 20, frequency=torch.ones(10),
                  device="cpu").refill()
    with pytest.raises(TypeError, match="int32 or int64"):
        cache.hit_rate(torch.tensor([1.0]))
    with pytest.raises(IndexError, match="out of range"):
        u[torch.tensor([0, ROWS])]


@pytest.mark.skipif(pd.cuda_usable(), reason="(a usable GPU takes the cache)")
def test_a_cache_on_a_gpu_without_one_says_so():
    # device="cuda" where no GPU is usable failed inside torch ("AssertionError: Torch not compiled with CUDA
    # enabled" on a CPU build of torch), naming neither the argument nor the fix
    u = pd.unified(torch.randn(ROWS, 4), copy=True)
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(RuntimeError, match=r"cached\(device='cuda(:\d)?'\): no usable CUDA GPU .*device='cpu'"):
            pd.cached(u, 1 << 20, frequency=torch.ones(ROWS), device=device)
    assert _cache.cache_for(u, ROWS, 16) is None


def test_a_released_cache_says_so_when_filled_again():
    # after release(), fill()/refill() did nothing but warn that "every frequency is 0 or less" (untrue), and
    # hit_rate() failed inside torch ("index is out of bounds for dimension with size 0")
    _, u, frequency = table_and_frequency()
    cache = pd.cached(u, budget_for(60, 64), frequency=frequency, device="cpu")
    cache.release()
    calls = (lambda: cache.fill(frequency), lambda: cache.refill(frequency), lambda: cache.hit_rate(torch.tensor([0])))
    for call in calls:
        with pytest.raises(RuntimeError, match=r"on a released cache: .* make a new one with pytorch_direct.cached"):
            call()
    assert cache.bytes == 0 and _cache.cache_for(u, ROWS, 64) is None
    assert pd.cached(u, budget_for(60, 64), frequency=frequency, device="cpu").cached_rows == 60


def test_counting_and_refill_from_counts():
    table, u, _ = table_and_frequency()
    cache = pd.cached(u, budget_for(10, 64, count=True), count=True, device="cpu")
    assert cache.cached_rows == 0  # nothing known yet: every row from the table
    hot = torch.tensor([3, 17, 17, 99, 250, 251, 252, 253, 254, 255, 256, 400])
    for _ in range(3):
        assert same_bytes(u[hot], table[hot])
    assert int(cache.counts[17]) == 6 and int(cache.counts[3]) == 3 and int(cache.counts[0]) == 0
    cache.refill()
    assert cache.cached_rows == 10 and 17 in cache.row_of_slot.tolist()
    assert float(cache.counts[17]) == 3.0  # halved: later calls weigh as much as all earlier ones
    assert same_bytes(u[hot], table[hot]) and cache.hit_rate(hot) >= 10 / 12


def test_counting_a_large_call_adds_a_bounded_weighted_sample(monkeypatch):
    # A call of more than COUNT_SAMPLE rows adds COUNT_SAMPLE atomic counts, not one per index (on a skewed stream
    # those wait for each other on the hot rows), weighted so that the counts stay in gathered rows; successive calls
    # sample other positions of the batch; the hottest rows still come out on top.
    monkeypatch.setattr(_cache, "COUNT_SAMPLE", 64)
    table, u, _ = table_and_frequency()
    cache = pd.cached(u, budget_for(5, 64, count=True), count=True, device="cpu")
    added = []
    real = torch.Tensor.index_add_

    class Spy(torch.Tensor):
        pass

    def spy(self, dim, index, source, alpha=1):
        added.append(index.numel())
        return real(self, dim, index, source, alpha=alpha)

    monkeypatch.setattr(cache, "counts", cache.counts.as_subclass(Spy))
    monkeypatch.setattr(Spy, "index_add_", spy)
    g = torch.Generator().manual_seed(3)
    hot = torch.tensor([11, 22, 33, 44, 55])
    batch = torch.cat([hot.repeat(200), torch.randint(0, ROWS, (1000,), generator=g)])
    batch = batch[torch.randperm(batch.numel(), generator=g)]  # 2000 rows: over the sample size
    for _ in range(4):
        assert same_bytes(u[batch], table[batch])
    assert added == [64] * 4
    assert float(cache.counts.sum()) == pytest.approx(4 * 2000)
    sample, weight, offset = _cache.count_sample(batch, 0)
    assert sample.numel() == 64 and weight == 2000 / 64 and torch.equal(sample, batch[::31][:64])
    assert torch.equal(_cache.count_sample(batch, offset)[0], batch[1::31][:64])
    small = torch.tensor([1, 2, 2])
    assert _cache.count_sample(small, 5) == (small, 1.0, 5)  # small calls: every index, weight 1
    cache.refill()
    assert set(cache.row_of_slot[: cache.cached_rows].tolist()) == set(hot.tolist())


def test_a_pass_that_saw_few_rows_is_topped_up_to_the_budget(caplog):
    # A pre-sampling pass saw 5 rows; the other 35 slots go to the highest degrees among the rest, never twice to a
    # row, within the same byte budget; the log says what filled it; gathers stay exact and coherent after writes.
    table, u, degree = table_and_frequency()
    seen = torch.zeros(ROWS)
    seen[[1, 2, 3, 4, 7]] = 5.0  # row 7 is also among the highest degrees
    budget = budget_for(40, 64)
    with caplog.at_level("INFO", logger="pytorch_direct"):
        cache = pd.cached(u, budget, frequency=seen, top_up=degree, device="cpu")
    assert "5 from the frequency" in caplog.text and "35 from the top-up" in caplog.text
    assert cache.stats()["filled_from"] == {"frequency": 5, "top_up": 35}
    assert cache.cached_rows == cache.capacity == 40 and cache.bytes <= budget
    held = cache.row_of_slot[: cache.cached_rows].tolist()
    assert len(set(held)) == 40 and {1, 2, 3, 4, 7} <= set(held)
    assert set(held) - {1, 2, 3, 4} <= set(range(0, ROWS, 7))  # the rest: the highest degrees
    assert held == sorted(held)  # slots in address order
    everything = torch.arange(ROWS)
    assert same_bytes(u[everything], table)
    assert cache.hit_rate(torch.arange(0, ROWS, 7)) > 0.45
    idx, vals = torch.tensor([1, 14, 15]), torch.randn(3, 16)
    u[idx] = vals
    table[idx] = vals
    assert same_bytes(u[everything], table)
    # Without a top-up the same pass fills 5 slots (and says so).
    cache.release()
    with caplog.at_level("INFO", logger="pytorch_direct"):
        alone = pd.cached(u, budget, frequency=seen, device="cpu")
    assert alone.cached_rows == 5 and alone.stats()["filled_from"] == {"frequency": 5, "top_up": 0}
    assert "filled with 5 rows of the 40 it has room for: 5 from the frequency, 0 from the top-up" in caplog.text


def test_counts_are_topped_up_at_every_refill():
    # count=True with a top-up starts filled from the top-up; refill() takes the counted rows first, then tops up.
    table, u, degree = table_and_frequency()
    given = degree.clone()
    budget = budget_for(20, 64, count=True)
    cache = pd.cached(u, budget, count=True, top_up=degree, device="cpu")
    assert cache.cached_rows == 20 and cache.stats()["filled_from"] == {"frequency": 0, "top_up": 20}
    hot = torch.tensor([3, 5, 5, 6])
    assert same_bytes(u[hot], table[hot])
    cache.refill()
    assert cache.stats()["filled_from"] == {"frequency": 3, "top_up": 17}
    assert {3, 5, 6} <= set(cache.row_of_slot[:20].tolist()) and cache.bytes <= budget
    assert torch.equal(degree, given) and torch.equal(cache.top_up, given)  # neither changed by the fills
    cache.refill()  # (the same top-up again: the highest degrees still fill the rest)
    assert cache.stats()["filled_from"]["top_up"] == 17
    assert same_bytes(u[torch.arange(ROWS)], table)
    with pytest.raises(ValueError, match="top_up must be a tensor with one number per table row"):
        cache.set_top_up(torch.ones(3))


def test_a_fill_with_no_positive_score_says_the_cache_is_empty():
    table, u, _ = table_and_frequency()
    with pytest.warns(UserWarning, match="filled with no rows"):
        cache = pd.cached(u, budget_for(10, 64), frequency=torch.zeros(ROWS), device="cpu")
    assert cache.cached_rows == 0
    idx = torch.arange(ROWS)
    assert same_bytes(u[idx], table[idx])  # every row from the table


def test_nan_scores_rank_lowest_and_are_never_cached():
    # topk ranks NaN above every number: a frequency with NaN rows (a ratio such as hits / visits, 0 / 0 for rows
    # never visited) filled the cache with those rows first, in place of the hottest ones (gathers stayed exact)
    table, u, frequency = table_and_frequency()
    nan_rows = torch.tensor([r for r in range(1, ROWS, 10) if r % 7])  # (none of the hot rows 0, 7, 14, ...)
    frequency[nan_rows] = float("nan")
    given = frequency.clone()
    cache = pd.cached(u, budget_for(40, 64), frequency=frequency, device="cpu")
    held = set(cache.row_of_slot[: cache.cached_rows].tolist())
    assert cache.cached_rows == 40 and held <= set(range(0, ROWS, 7))  # the highest scores, as without the NaN
    assert not held & set(nan_rows.tolist())
    assert torch.equal(frequency.isnan(), given.isnan())  # the caller's tensor is left as it was
    # a top-up with NaN scores fills the rest from its numbers only
    seen = torch.zeros(ROWS)
    seen[[2, 4]] = 1.0
    degree = torch.full((ROWS,), float("nan"))
    degree[[5, 6, 8]] = 3.0
    cache.release()
    cache = pd.cached(u, budget_for(40, 64), frequency=seen, top_up=degree, device="cpu")
    assert set(cache.row_of_slot[: cache.cached_rows].tolist()) == {2, 4, 5, 6, 8}
    assert cache.stats()["filled_from"] == {"frequency": 2, "top_up": 3}
    idx = torch.arange(ROWS)
    assert same_bytes(u[idx], table[idx])
    cache.release()
    with pytest.warns(UserWarning, match=r"filled with no rows \(every frequency is 0 or less, or NaN\)"):
        pd.cached(u, budget_for(10, 64), frequency=torch.full((ROWS,), float("nan")), device="cpu")


def test_count_rows_is_a_sampling_pass():
    batches = [torch.tensor([1, 2, 2]), torch.tensor([[2, 9]]), torch.tensor([], dtype=torch.int64)]
    counts = pd.count_rows(batches, 10)
    assert counts.tolist() == [0, 1, 3, 0, 0, 0, 0, 0, 0, 1]
    with pytest.raises(IndexError):
        pd.count_rows([torch.tensor([10])], 10)
    with pytest.raises(ValueError, match="at least one batch"):
        pd.count_rows([], 10)


def test_a_cache_lives_as_long_as_its_table_and_forced_strategies_skip_it(monkeypatch):
    table, u, frequency = table_and_frequency()
    pd.cached(u, budget_for(30, 64), frequency=frequency, device="cpu")  # (return value dropped)
    cache = _cache.cache_for(u, ROWS, 64)
    assert cache is not None and cache.rows_view()[: cache.cached_rows].numel() > 0
    assert _cache.cache_for(u.plain()[:100], 100, 64) is cache  # a view of the first rows reads it too
    assert _cache.cache_for(u.plain()[1:], ROWS - 1, 64) is None  # another start: another table
    cache.rows_view()[: cache.cached_rows] = 0xFF
    idx = torch.arange(0, ROWS, 7)
    assert torch.isnan(pd.gather(u, idx)).any()  # auto reads the cache ...
    assert same_bytes(pd.gather(u, idx, strategy="vector"), table[idx])  # ... forced strategies the table only
    del cache, u
    import gc

    gc.collect()
    assert not _cache._CACHES  # gone with the table


def test_cached_gathers_compile():
    table, u, frequency = table_and_frequency()
    pd.cached(u, budget_for(40, 64), frequency=frequency, device="cpu")
    fn = torch.compile(lambda t, i: torch.nn.functional.embedding(i, t) * 2, fullgraph=True, backend="aot_eager")
    idx = torch.randint(0, ROWS, (100,))
    assert torch.equal(fn(u, idx), table[idx] * 2)


def test_float_indices_raise_the_clear_error():
    u = pd.unified(torch.randn(10, 4), copy=True)
    for bad in (torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64)):
        for call in (lambda i: u[i], lambda i: pd.gather(u, i), lambda i: u.index_select(0, i),
                     lambda i: torch.nn.functional.embedding(i, u)):
            with pytest.raises(TypeError, match="row indices must be int32 or int64"):
                call(bad)
    assert torch.equal(u[torch.tensor([True] * 5 + [False] * 5)], u.plain()[:5])  # CPU masks: torch's own


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("row_shape,dtype", [((64,), torch.float32), ((47,), torch.uint8), ((256,), torch.float32),
                                             ((3,), torch.int16)])
@pytest.mark.parametrize("strategy", ["auto", "cached", "cached_sorted"])
def test_gpu_cached_gathers_are_exact(row_shape, dtype, strategy):
    table, u, frequency = table_and_frequency(row_shape, dtype, seed=3)
    rb = u.plain()[0].numel() * u.element_size()
    cache = pd.cached(u, budget_for(100, rb), frequency=frequency.cuda())
    assert cache.device.type == "cuda" and cache.bytes <= budget_for(100, rb)
    g = torch.Generator(device="cuda").manual_seed(0)
    for idx in (torch.randint(0, ROWS, (20000,), device="cuda", generator=g), torch.arange(ROWS, device="cuda"),
                torch.randint(0, ROWS, (7, 9), device="cuda", generator=g, dtype=torch.int32)):
        got = pd.gather(u, idx, strategy=strategy)
        assert same_bytes(got.cpu(), table[idx.long().cpu()])
    cache.rows_view()[: cache.cached_rows] = 0  # hits come from the device copy
    idx = torch.arange(0, ROWS, 7, device="cuda")
    if dtype == torch.float32:
        zero_rows = int((pd.gather(u, idx, strategy=strategy) == 0).all(1).sum())
        assert zero_rows == round(cache.hit_rate(idx) * idx.numel()) > 0
    cache.refresh()
    assert same_bytes(pd.gather(u, idx, strategy=strategy).cpu(), table[idx.cpu()])
    with pytest.raises(IndexError, match="out of range"):
        pd.gather(u, torch.tensor([0, ROWS], device="cuda"), strategy=strategy)
    cache.release()


@pytest.mark.gpu
def test_gpu_writes_keep_the_cache_coherent():
    table, u, frequency = table_and_frequency((32,), torch.float32, seed=4)
    pd.cached(u, budget_for(80, 128), frequency=frequency.cuda())
    ref = table.clone()
    everything = torch.arange(ROWS, device="cuda")
    for k, strategy in enumerate(("vector", "sorted", "staged", "auto")):
        idx = torch.tensor([0, 7, 7, 8, 14 + k, 499], device="cuda")
        vals = torch.randn(6, 32, device="cuda")
        vals[2] = vals[1]
        pd.scatter_(u, idx, vals, strategy=strategy)
        ref[idx.cpu()] = vals.cpu()
        assert same_bytes(pd.gather(u, everything).cpu(), ref)
    add = torch.randn(6, 32, device="cuda")
    idx = torch.tensor([0, 0, 21, 22, 300, 7], device="cuda")
    u.index_add_(0, idx, add)
    ref.index_add_(0, idx.cpu(), add.cpu())
    assert torch.allclose(pd.gather(u, everything).cpu(), ref, atol=1e-6)
    u[torch.tensor([42])] = torch.ones(1, 32)  # CPU indices on a GPU cache
    ref[42] = 1.0
    assert torch.allclose(pd.gather(u, everything).cpu(), ref, atol=1e-6)


@pytest.mark.gpu
def test_gpu_cached_gather_in_a_cuda_graph_and_compiled():
    table, u, frequency = table_and_frequency((64,), torch.float32, seed=5)
    cache = pd.cached(u, budget_for(100, 256), frequency=frequency.cuda(), count=False)
    idx = torch.randint(0, ROWS, (4096,), device="cuda")
    pd.set_bounds_check("async")
    try:
        pd.gather(u, idx)  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = pd.gather(u, idx)
        graph.replay()
        torch.cuda.synchronize()
        assert same_bytes(out.cpu(), table[idx.cpu()])
        u[torch.tensor([0, 7], device="cuda")] = torch.zeros(2, 64, device="cuda")  # a cached row changes ...
        table[[0, 7]] = 0
        idx.copy_(torch.tensor([0, 7] * 2048, device="cuda"))
        graph.replay()  # ... and the replayed graph reads the refreshed copy
        torch.cuda.synchronize()
        assert same_bytes(out.cpu(), table[idx.cpu()])
    finally:
        pd.set_bounds_check("sync")
    fn = torch.compile(lambda t, i: t[i] + 1, fullgraph=True)
    assert torch.allclose(fn(u, idx).cpu(), table[idx.cpu()] + 1)
    assert cache.cached_rows > 0


@pytest.mark.gpu
def test_gpu_counting_of_a_large_skewed_call_is_sampled_and_finds_the_hot_rows():
    table, u, _ = table_and_frequency((16,), torch.float32, seed=7)
    cache = pd.cached(u, budget_for(3, 64, count=True), count=True)
    g = torch.Generator().manual_seed(8)
    n = 3 * _cache.COUNT_SAMPLE + 5
    idx = torch.where(torch.rand(n, generator=g) < 0.6, torch.tensor([9, 99, 199])[torch.randint(0, 3, (n,),
                      generator=g)], torch.randint(0, ROWS, (n,), generator=g)).cuda()
    for _ in range(3):
        assert same_bytes(u[idx].cpu(), table[idx.cpu()])
    assert float(cache.counts.sum()) == pytest.approx(3 * n, rel=1e-4)
    cache.refill()
    assert set(cache.row_of_slot[:3].tolist()) == {9, 99, 199}
    assert same_bytes(u[idx].cpu(), table[idx.cpu()])


@pytest.mark.gpu
def test_gpu_counting_cache_and_float_index_error():
    table, u, _ = table_and_frequency((16,), torch.float32, seed=6)
    cache = pd.cached(u, budget_for(2, 64, count=True), count=True)
    hot = torch.tensor([5, 6, 7] * 100 + [300], device="cuda")
    assert same_bytes(u[hot].cpu(), table[hot.cpu()])
    cache.refill()
    assert cache.capacity == 2 and cache.hit_rate(hot) == pytest.approx(200 / 301)
    assert same_bytes(u[hot].cpu(), table[hot.cpu()])
    with pytest.raises(TypeError, match="row indices must be int32 or int64"):
        u[torch.tensor([1.0], device="cuda")]
    assert _core.kernels_compiled()


def _readme_block(marker):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if marker in b)


def test_readme_cache_example_runs(capsys):
    scope: dict = {}
    exec(compile(_readme_block("pd.cached(table, gpu_bytes="), "README.md", "exec"), scope)
    cache = scope["cache"]
    assert cache.cached_rows > 0 and cache.bytes <= cache.budget == 4 << 20
    assert "rows cached" in capsys.readouterr().out


def test_readme_how_to_add_a_strategy_example_works(monkeypatch):
    from pytorch_direct import _decide, _kernels, _strategies
    from pytorch_direct._cell import Call, Cell, Features

    monkeypatch.setattr(_strategies, "REGISTRY", dict(_strategies.REGISTRY))
    monkeypatch.setattr(_decide, "REGISTRY", _strategies.REGISTRY)
    scope = dict(vars(_strategies))
    exec(compile(_readme_block("class Reversed(Strategy)"), "README.md", "exec"), scope)
    assert "reversed" in _strategies.REGISTRY and _strategies.Plan("reversed").kind.runs_on == "device"
    call = Call("gather", 1 << 34, 1 << 26, 256, 1 << 20)
    assert "reversed" in _decide.candidates(Cell(call, Features(0.5, 0.0, 0.0)))

    def launch(table, rows, rb, idx, out, positions, kernel, max_sms, stream, device_count=None):
        out.view(torch.uint8).view(-1, rb)[positions] = table.reshape(-1).view(torch.uint8).view(rows, rb)[idx]

    monkeypatch.setattr(_kernels, "launch_gather", launch)
    monkeypatch.setattr(_kernels, "raw_stream", lambda device: 0)
    table = torch.randn(50, 16)
    idx = torch.tensor([3, 1, 49, 3])
    out = torch.empty(4, 16)
    job = _strategies.RowJob("gather", table, 50, 64, idx, out)
    _strategies.run(job, _strategies.Plan("reversed"), check_bounds=False, in_range=True)
    assert torch.equal(out, table[idx])


def test_indices_on_another_device_than_the_cache_warn_once_and_read_host_memory():
    """A cache that serves nothing says so: indices on another device than the cache (CPU indices, a GPU cache)
    read every row from host memory. On this CPU the cache's device is set to a GPU's to take that path."""
    import warnings

    table, u, frequency = table_and_frequency()
    cache = pd.cached(u, budget_for(60, 64), frequency=frequency, device="cpu")
    cache.device = torch.device("cuda", 0)  # (what a cache made on a GPU holds)
    idx = torch.randint(0, ROWS, (300,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert same_bytes(pd.gather(u, idx), table[idx])
            assert same_bytes(u[idx], table[idx])
    bypassed = [str(w.message) for w in caught if "serves none" in str(w.message)]
    assert len(bypassed) == 1 and "cuda:0" in bypassed[0] and "idx.to('cuda:0')" in bypassed[0]
    cache.release()
