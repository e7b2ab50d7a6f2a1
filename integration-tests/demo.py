"""The toolkit's demo: two whole training runs, each beside the plain PyTorch / PyG way on the same data.

1. GNN (pytorch-direct + hector): a 2-layer RGAT trained on mini-batches of a synthetic heterogeneous graph whose
   feature table lives in host memory. Toolkit: the GPU gathers each batch's rows from host memory itself
   (pytorch-direct) and hector's compiled layers run the model. Plain way: the CPU gathers the rows and copies them,
   PyG's RGATConv runs the model.
2. LLM (ssdtrain): a GPT-2-style model trained with its activations offloaded under a memory budget, beside
   keeping every activation on the device; on a GPU, at a batch 1.5x the largest the plain way fits.

Sizes: ``tiny`` on a CPU-only machine (a correctness run: the speed figures mean little there), ``small`` on a GPU.
The report is printed and, with the plots (loss curves, GNN epoch time, LLM memory vs step time) and CSV files,
written to ``--out`` (default ``integration-tests/demo-output``).

    python3 -m nox -s demo                                  # from a fresh clone
    python3 integration-tests/demo.py --size tiny           # once the three packages are installed
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def report_builds() -> None:
    import hector
    import pytorch_direct
    import ssdtrain

    for package in (pytorch_direct, hector, ssdtrain):
        print(package._shared_cuda.format_info(package.info()))


def run_script(script: str, args: list[str], timeout: float) -> float:
    """Run one training script in a fresh process (its output shown as it comes); return its wall time."""
    command = [sys.executable, str(HERE / script), *args]
    print(f"\n$ {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(command, timeout=timeout, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{script} failed with exit code {result.returncode} (its output is above)")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    gpu = torch.cuda.is_available()
    parser.add_argument("--size", choices=("tiny", "small", "large"), default="small" if gpu else "tiny",
                        help="default: small with a GPU, tiny without")
    parser.add_argument("--out", default=str(HERE / "demo-output"), help="folder for the report, plots and CSV")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed per script")
    parser.add_argument("--no-progress", action="store_true", help='no progress bars')
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    print(f"demo at size {args.size} on {'the GPU' if gpu else 'the CPU'} (torch {torch.__version__})")
    report_builds()
    common = ["--size", args.size] + (["--no-progress"] if args.no_progress else [])
    seconds = {
        "gnn": run_script("gnn_train.py", [*common, "--json", str(out / "gnn.json")], args.timeout),
        "llm": run_script("llm_train.py", [*common, "--json", str(out / "llm.json")], args.timeout),
    }

    import report

    print("\n" + "=" * 100 + "\nREPORT: the toolkit against the plain way\n")
    print(report.report([out / "gnn.json"], [out / "llm.json"], out))
    if not gpu:
        print("\n(CPU run at a tiny size: it checks that everything trains and agrees; the speed-ups the toolkit is "
              "for need a GPU -- see integration-tests/RESULTS.md)")
    print(f"\ndemo finished in {seconds['gnn'] + seconds['llm']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
