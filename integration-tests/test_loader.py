"""BatchLoader: batches in order, the same with and without the thread, errors raised in the consumer, no thread
left behind when training stops early."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import harness
from loader import BatchLoader
from sampling import SampledSubgraph

CPU = torch.device("cpu")


def fake_make(log: list):
    def make(seeds, timer):
        timer.phase("sample")
        log.append((threading.current_thread().name, int(seeds[0])))
        n = seeds.numel()
        empty = dict(dtype=torch.long, device=seeds.device)
        sub = SampledSubgraph(seeds.clone(), torch.zeros(2, 0, **empty), torch.zeros(0, **empty),
                              torch.zeros(0, **empty), torch.zeros(n, **empty), n)
        timer.phase("gather")
        return sub, seeds.float()[:, None] * 2

    return make


@pytest.mark.parametrize("ahead,thread", [(0, False), (1, False), (1, True), (3, True)])
def test_batches_come_in_order(ahead, thread):
    log = []
    batches = [torch.arange(i * 4, i * 4 + 4) for i in range(7)]
    timer = harness.PhaseTimes(CPU)
    with BatchLoader(fake_make(log), batches, ahead=ahead, thread=thread, device=CPU, timer=timer) as loader:
        got = [(sub.n_id.tolist(), x[:, 0].tolist()) for sub, x in loader]
    assert got == [(b.tolist(), (b * 2).float().tolist()) for b in batches]
    assert [first for _, first in log] == [int(b[0]) for b in batches]
    made_by = {name for name, _ in log}
    assert made_by == ({"batch-loader"} if thread else {threading.current_thread().name})
    phases = (loader.loader_timer if thread else timer).totals()  # (on the CPU without a thread: in turn)
    assert {"sample", "gather"} <= set(phases)
    if thread:
        assert "wait" in timer.totals()


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [1, 2])
def test_the_training_thread_makes_batches_ahead_on_the_gpu(ahead):
    """Without a thread, batch i + ahead is made (on the loader's stream) before batch i is handed to training."""
    gpu = torch.device("cuda")
    log, events = [], []
    batches = [torch.arange(i * 4, i * 4 + 4, device=gpu) for i in range(6)]
    timer = harness.PhaseTimes(gpu)
    with BatchLoader(fake_make(log), batches, ahead=ahead, device=gpu, timer=timer) as loader:
        for sub, x in loader:
            events.append(("train", int(sub.n_id[0]), len(log)))
            assert torch.equal(x[:, 0], sub.n_id.float() * 2)
    for _, first, made in events:
        assert made == min(len(batches), first // 4 + 1 + ahead), events
    assert {"sample", "gather"} <= set(loader.loader_timer.totals()) and "wait" in timer.totals()


def test_a_thread_needs_batches_to_make():
    with pytest.raises(ValueError, match="ahead >= 1"):
        BatchLoader(fake_make([]), [], ahead=0, thread=True, device=CPU, timer=harness.PhaseTimes(CPU))


def test_error_in_the_loader_thread_is_raised_in_training():
    def make(seeds, timer):
        if int(seeds[0]) == 8:
            raise IndexError("node id out of range")
        return fake_make([])(seeds, timer)

    batches = [torch.arange(i * 4, i * 4 + 4) for i in range(4)]
    loader = BatchLoader(make, batches, ahead=1, thread=True, device=CPU, timer=harness.PhaseTimes(CPU))
    seen = []
    with pytest.raises(RuntimeError, match="loader thread") as info, loader:
        for sub, _ in loader:
            seen.append(int(sub.n_id[0]))
    assert seen == [0, 4]
    assert isinstance(info.value.__cause__, IndexError)
    assert loader._thread is None


def test_stopping_early_ends_the_thread():
    def slow(seeds, timer):
        time.sleep(0.01)
        return fake_make([])(seeds, timer)

    batches = [torch.arange(i, i + 1) for i in range(50)]
    before = threading.active_count()
    with pytest.raises(KeyError), BatchLoader(slow, batches, ahead=2, thread=True, device=CPU,
                                               timer=harness.PhaseTimes(CPU)) as loader:
        for i, _ in enumerate(loader):
            if i == 3:
                raise KeyError("training failed")
    assert threading.active_count() == before


def test_negative_ahead_is_refused():
    with pytest.raises(ValueError, match="ahead must be >= 0"):
        BatchLoader(fake_make([]), [], ahead=-1, device=CPU, timer=harness.PhaseTimes(CPU))
