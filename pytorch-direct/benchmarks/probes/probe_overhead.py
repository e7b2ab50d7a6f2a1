"""Probe P5 (benchmarks/RESULTS.md): where a pd.gather call loses time against the same plan timed inside auto's
measuring (run M: 47 B / 1 GiB / uniform: sorted measured 11.75 GB/s inside the first call, 9.41 as a forced
column). One process, variants alternated; wall (sync before and after) and GPU time (events) per variant; a
profiler table; then the host cost of each step of the eager path. Needs a GPU and ~1 GiB of pinned memory:

    python3 pytorch-direct/benchmarks/probes/probe_overhead.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gather as G  # noqa: E402

import pytorch_direct as pd  # noqa: E402
from pytorch_direct import _kernels, _ops, _strategy  # noqa: E402

CELLS = ((47, "uniform", "sorted"), (47, "uniform", "staged"), (64, "sorted", "vector"), (256, "uniform", "sorted"))


def gpu_us(fn, n=10):
    """GPU time of one call (events around it), best of n."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(n):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3)
    return best


def host_us(fn, n=10):
    """Host time until the call returns, best of n."""
    best = float("inf")
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return best * 1e6


def probe_cell(flat, rb, pattern, strategy):
    tab = G.view_rows(flat, 1 << 30, rb)
    utab = tab.as_subclass(pd.UnifiedTensor)
    rows, count = tab.shape[0], 131072
    idx = G.indices(pattern, count, rows, G.cell_seed(1, rb, pattern, count))
    plan = _kernels.Plan(strategy)
    shape = (count,) + tuple(tab.shape[1:])
    out = torch.empty(shape, dtype=tab.dtype, device="cuda")

    def internal():  # what auto's measuring times: the check and the plan, into one output
        _kernels.precheck_for(plan, idx, rows)
        _kernels.gather_cuda(tab, rows, rb, idx, out.view(count, -1), plan, 0, True)

    def internal_alloc():
        o = torch.empty(shape, dtype=tab.dtype, device="cuda")
        _kernels.precheck_for(plan, idx, rows)
        _kernels.gather_cuda(tab, rows, rb, idx, o.view(count, -1), plan, 0, True)
        return o

    def no_check():
        _kernels.gather_cuda(tab, rows, rb, idx, out.view(count, -1), plan, 0, True)

    fns = {"public": lambda: pd.gather(utab, idx, strategy=strategy),
           "impl": lambda: _ops.gather_impl(utab, idx, strategy, 0),
           "internal_alloc": internal_alloc, "internal": internal, "no_check": no_check}
    res = {k: [] for k in fns}
    for rnd in range(4):
        for k in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            res[k].append(G.best_of(fns[k], 2))
    nbytes = count * rb
    call = _strategy.Call("gather", 1 << 30, rows, rb, count)
    features, _, _ = _strategy.index_features(idx, rows, rb)

    def run(p):
        _ops._steady_check(p, idx, rows, True)
        _kernels.gather_cuda(tab, rows, rb, idx, out.view(count, -1), p, 0, True)

    _, cell = _strategy.measure(call, features, (strategy,), run, budget_s=10, save=False)
    line = " ".join(f"{k}={nbytes / statistics.median(v) / 1e9:.2f}" for k, v in res.items())
    print(f"{rb}B/{pattern}/{strategy}: best_of GB/s {line} | measure()={cell['gbps'][strategy]:.2f}", flush=True)
    line = " ".join(f"{k}={gpu_us(f):.0f}/{host_us(f):.0f}" for k, f in fns.items())
    print(f"   GPU us (events) / host us (call return) min of 10: {line}", flush=True)
    if rb == 47 and strategy == "sorted":
        from torch.profiler import ProfilerActivity, profile

        for k in ("public", "internal"):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fns[k]()
                torch.cuda.synchronize()
            print(f"== profile {k} (20 calls)")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18))


def us(fn, n=2000):
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def disabled():
    with torch._C.DisableTorchFunctionSubclass():
        pass


def probe_steps(flat):
    """Host cost of each step of gather_impl's Python on this host (us per call, mean of 2000)."""
    tab = G.view_rows(flat, 1 << 30, 64)
    utab = tab.as_subclass(pd.UnifiedTensor)
    idx = G.indices("uniform", 131072, tab.shape[0], 1)
    rows = tab.shape[0]
    steps = {
        "DisableTorchFunctionSubclass": disabled,
        "check_table(subclass)": lambda: _ops.check_table(utab),
        "check_table(plain)": lambda: _ops.check_table(tab),
        "row_layout": lambda: _kernels.row_layout(tab),
        "torch.empty cuda": lambda: torch.empty((131072, 64), dtype=torch.uint8, device=idx.device),
        "contiguous().view(-1)": lambda: idx.contiguous().view(-1),
        "index.device.type": lambda: idx.device.type,
        "table_for_device": lambda: _kernels.table_for_device(tab, 0),
        "raise_pending": _kernels.raise_pending_device_error,
        "capturing": _kernels.capturing,
        "Call()": lambda: _strategy.Call("gather", 1 << 30, 100, 64, 131072),
        "Plan()": lambda: _kernels.Plan("sorted"),
        "current_stream": lambda: torch.cuda.current_stream().cuda_stream,
        "current_device": torch.cuda.current_device,
        "use_dispatcher": lambda: _ops.use_dispatcher(tab, idx),
        "precheck (sync)": lambda: _kernels.precheck(idx, tab.shape[0]),
        "choose (cached)": lambda: _strategy.choose(_strategy.Call("gather", 1 << 30, rows, 64, 131072), idx,
                                                    capturing=False),
    }
    print("host us per step: " + " ".join(f"{k}={us(f):.1f}" for k, f in steps.items()), flush=True)


def main():
    flat = pd.empty(1 << 30, dtype=torch.uint8).plain()
    print(f"# {torch.cuda.get_device_name()} bounds {pd._config.settings.bounds_check}", flush=True)
    for cell in CELLS:
        probe_cell(flat, *cell)
    probe_steps(flat)


if __name__ == "__main__":
    main()
