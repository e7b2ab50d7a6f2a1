"""Probe P8 (benchmarks/RESULTS.md): the sync bounds check before the gather (check, wait, launch) against the
check overlapped with it (check, launch, wait for the check only), and pinned against managed tables, in one
process. Host us (until the call returns) and wall us (device synchronised after), median of 200, for 131072
indices into a 1 GiB table:

    python3 pytorch-direct/benchmarks/probes/probe_check.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gather as G  # noqa: E402

import pytorch_direct as pd  # noqa: E402
from pytorch_direct import _core, _kernels  # noqa: E402


def times(fn, n=200):
    host, wall = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wall.append(t2 - t0)
    return statistics.median(host) * 1e6, statistics.median(wall) * 1e6


def probe(memory, flat, rb, pattern, strategy):
    tab = G.view_rows(flat, 1 << 30, rb)
    utab = tab.as_subclass(pd.UnifiedTensor)
    rows, count = tab.shape[0], 131072
    idx = G.indices(pattern, count, rows, 7)
    out = torch.empty((count, rb), dtype=torch.uint8, device="cuda")
    plan = _kernels.Plan(strategy)
    stream = torch.cuda.current_stream().cuda_stream

    def start_finish():
        _core.index_bounds_start(idx.data_ptr(), 8, count, stream)
        _core.index_bounds_finish()

    fns = {
        "bounds (sync)": lambda: _core.index_bounds_cuda(idx.data_ptr(), 8, count, stream),
        "bounds start+finish": start_finish,
        "launch only": lambda: _kernels.gather_cuda(tab, rows, rb, idx, out, plan, 0, True),
        "check then launch": lambda: (_kernels.precheck(idx, rows),
                                      _kernels.gather_cuda(tab, rows, rb, idx, out, plan, 0, True)),
        "overlapped": lambda: _kernels.gather_cuda_checked(tab, rows, rb, idx, out, plan, 0),
        "pd.gather": lambda: pd.gather(utab, idx, strategy=strategy),
    }
    for f in fns.values():
        f()
    line = " | ".join(f"{k} {h:.0f}/{w:.0f}" for k, (h, w) in ((k, times(f)) for k, f in fns.items()))
    print(f"{memory} {rb}B {pattern} {strategy}: host/wall us: {line}", flush=True)


def profile_calls(memory):
    """Where pd.gather's host time goes beyond its check and kernel: cProfile of 300 calls (256 B rows, vector)."""
    import cProfile
    import pstats

    flat = pd.empty(1 << 30, dtype=torch.uint8, memory=memory).plain()
    utab = G.view_rows(flat, 1 << 30, 256).as_subclass(pd.UnifiedTensor)
    idx = G.indices("uniform", 131072, utab.shape[0], 7)
    pd.gather(utab, idx, strategy="vector")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        pd.gather(utab, idx, strategy="vector")
        torch.cuda.synchronize()
    prof.disable()
    print(f"== cProfile, {memory}, 300 calls of pd.gather (256 B x 131072, vector), each followed by a sync")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def main():
    if "--profile" in sys.argv:
        for memory in ("pinned", "managed"):
            profile_calls(memory)
        return
    for memory in ("pinned", "managed"):
        flat = pd.empty(1 << 30, dtype=torch.uint8, memory=memory).plain()
        for rb, pattern, strategy in ((64, "sorted", "vector"), (64, "uniform", "sorted"), (256, "uniform", "vector")):
            probe(memory, flat, rb, pattern, strategy)
        del flat

if __name__ == "__main__":
    main()
