"""Probe: why a managed table takes longer to make in a Python process than in C++.

``probe_managed_create.cu`` made 64 GiB of managed memory in 1.25-1.36x a 16-thread memset's time, while
``first_use.py`` measured ``pd.empty`` at 1.54-1.75x ``torch.empty`` + ``fill_`` in a Python process. This probe
runs, in one Python process and in this order (each freed before the next), the torch memset, the package's C++
allocation called directly (``_core.managed_memory``), the torch memset, ``pd.empty``, then the C++ allocation with
torch's intra-op threads set to 1 and then to the default again, each twice: which step costs the difference.

    python3 pytorch-direct/benchmarks/probes/probe_managed_python.py --gib 64
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

import pytorch_direct as pd
from pytorch_direct import _core


def timed(what: str, make, nbytes: int) -> None:
    gc.collect()
    t0 = time.perf_counter()
    t = make()
    made = time.perf_counter() - t0
    t0 = time.perf_counter()
    del t
    gc.collect()
    print(f"{what:44} made in {made:6.2f} s ({nbytes / made / 1e9:6.2f} GB/s), freed in "
          f"{time.perf_counter() - t0:5.2f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=64.0, help="size of each table and memset, GiB")
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30) >> 21 << 21
    pd.empty(1 << 20, dtype=torch.uint8)
    torch.zeros(1, device="cuda")
    threads = torch.get_num_threads()

    def memset():
        t = torch.empty(nbytes, dtype=torch.uint8)
        t.fill_(0)
        return t

    def core():
        return _core.managed_memory(nbytes)

    def core_one_thread():
        torch.set_num_threads(1)
        try:
            return _core.managed_memory(nbytes)
        finally:
            torch.set_num_threads(threads)

    steps = [("torch memset", memset), ("_core.managed_memory", core), ("torch memset", memset),
             ("pd.empty", lambda: pd.empty(nbytes, dtype=torch.uint8)),
             ("_core.managed_memory, torch threads 1", core_one_thread), ("_core.managed_memory", core),
             ("torch memset", memset), ("pd.empty", lambda: pd.empty(nbytes, dtype=torch.uint8)),
             ("_core.managed_memory, torch threads 1", core_one_thread), ("torch memset", memset)]
    print(f"# {nbytes / 2**30:.1f} GiB, torch threads {threads}", flush=True)
    for what, make in steps:
        timed(what, make, nbytes)


if __name__ == "__main__":
    main()
