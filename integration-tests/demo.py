"""The toolkit's demo on built-in synthetic data: GPU where there is one, otherwise the CPU.

Run it with `python3 -m nox -s demo` (or `python integration-tests/demo.py` once the packages are installed).
Each step prints what it did and how long it took; `--tiny` shrinks every size (used by the tests).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import hector
import pytorch_direct
import ssdtrain

PACKAGES = (pytorch_direct, hector, ssdtrain)


def step(title: str):
    print(f"\n=== {title}", flush=True)
    return time.perf_counter()


def done(start: float, what: str) -> None:
    print(f"    {what} ({(time.perf_counter() - start) * 1e3:.1f} ms)", flush=True)


def report_builds() -> None:
    start = step("builds and machine")
    for package in PACKAGES:
        print(package._shared_cuda.format_info(package.info()))
    done(start, "three packages imported and reported")


def jit_kernel(device: torch.device, n: int) -> None:
    """Compile a kernel with NVRTC through the shared JIT loader; on a GPU, load and run it and check the result."""
    start = step("NVRTC JIT: compile, cache, load, run")
    core, shared = hector._core, hector._shared_cuda
    if not shared.ensure_nvrtc(core):
        print("    NVRTC not found: skipped (pip install nvidia-cuda-nvrtc)")
        return
    source = r"""
extern "C" __global__ void scale_add(float a, const float* x, float* y, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
"""
    if device.type != "cuda":
        cubin = shared.compile_kernel_source(core, source, "scale_add.cu", arch=90)
        done(start, f"compiled for sm_90 on the CPU: {len(cubin)} byte cubin (no GPU to run it)")
        return
    kernel = shared.load_kernel(core, source, "scale_add", "f32, ptr, ptr, i64", name="scale_add.cu")
    x = torch.randn(n, device=device)
    y = torch.randn(n, device=device)
    expected = 3.0 * x + y
    kernel((n + 255) // 256, 256, 3.0, x, y, n)
    torch.cuda.synchronize()
    # NVRTC contracts a*x+y into one fused multiply-add; torch rounds twice: allow one rounding of difference.
    error = ((y - expected).abs() / expected.abs().clamp_min(1.0)).max().item()
    if error > 1e-6:
        raise SystemExit(f"JIT kernel result is wrong: max relative error {error:.3g}")
    done(start, f"ran on {torch.cuda.get_device_name()} over {n} elements, max relative error {error:.2g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes (seconds on a CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"demo on {device} (torch {torch.__version__})")
    report_builds()
    jit_kernel(device, n=1 << (12 if args.tiny else 24))
    print("\ndemo finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
