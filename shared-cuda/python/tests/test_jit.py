"""The NVRTC JIT loader: compile with no GPU, clear compile errors, disk cache, and (on a GPU) load and run."""

import os
import struct
import subprocess
import sys

import pytest

SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
"""


@pytest.fixture
def nvrtc(core, shared):
    if not shared.ensure_nvrtc(core):
        pytest.skip("NVRTC not found (pip install nvidia-cuda-nvrtc)")


@pytest.fixture
def cache_dir(tmp_path, shared):
    shared.set_jit_cache_dir(tmp_path / "jit")
    yield tmp_path / "jit"
    shared.set_jit_cache_dir(None)


@pytest.mark.parametrize("arch", [80, 90])
def test_compile_without_gpu(core, shared, nvrtc, cache_dir, arch):
    cubin = shared.compile_kernel_source(core, SAXPY, "saxpy.cu", arch=arch)
    assert cubin[:4] == b"\x7fELF"
    assert len(list(cache_dir.glob("*.cubin"))) == 1


def test_compile_error_names_line_and_log(core, shared, nvrtc, cache_dir):
    bad = 'extern "C" __global__ void k(float* x) {\n  x[0] = missing_symbol;\n}\n'
    with pytest.raises(core.CompileError) as info:
        shared.compile_kernel_source(core, bad, "bad.cu", arch=90)
    message = str(info.value)
    assert "bad.cu:2:   x[0] = missing_symbol;" in message
    assert "missing_symbol" in info.value.log
    assert not list(cache_dir.glob("*.cubin"))  # failures are not cached


def test_cache_key_depends_on_everything(core, nvrtc):
    key = core.jit_cache_key(SAXPY, 90, [])
    assert key == core.jit_cache_key(SAXPY, 90, [])
    assert key != core.jit_cache_key(SAXPY, 80, [])
    assert key != core.jit_cache_key(SAXPY, 90, ["-DFAST=1"])
    assert key != core.jit_cache_key(SAXPY + "\n", 90, [])


def test_disk_cache_survives_the_process(package, core, shared, nvrtc, tmp_path):
    env = dict(os.environ, SHARED_CUDA_JIT_CACHE_DIR=str(tmp_path))
    script = (
        f"import {package.__name__} as p\n"
        f"p._shared_cuda.compile_kernel_source(p._core, {SAXPY!r}, 'saxpy.cu', arch=90)\n"
        f"print(p._shared_cuda.jit_loader(p._core).stats())\n"
    )
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert "'compilations': 1" in first.stdout
    assert "'compilations': 0" in second.stdout and "'disk_hits': 1" in second.stdout


def test_damaged_cache_entry_is_rebuilt(core, shared, nvrtc, cache_dir):
    cubin = shared.compile_kernel_source(core, SAXPY, "saxpy.cu", arch=90)
    (entry,) = cache_dir.glob("*.cubin")
    entry.write_bytes(entry.read_bytes()[:200])  # e.g. a disk that filled up mid-write in another process
    shared.set_jit_cache_dir(cache_dir)  # a fresh loader, as a new process would have
    assert shared.compile_kernel_source(core, SAXPY, "saxpy.cu", arch=90) == cubin
    stats = shared.jit_loader(core).stats()
    assert stats["corrupt_entries"] == 1 and stats["compilations"] == 1
    shared.set_jit_cache_dir(cache_dir)
    assert shared.compile_kernel_source(core, SAXPY, "saxpy.cu", arch=90) == cubin
    assert shared.jit_loader(core).stats()["disk_hits"] == 1


def test_unwritable_cache_only_disables_caching(core, shared, nvrtc, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    shared.set_jit_cache_dir(blocker / "jit")
    try:
        assert shared.compile_kernel_source(core, SAXPY, "saxpy.cu", arch=90)[:4] == b"\x7fELF"
        assert shared.jit_loader(core).stats()["disk_errors"] == 1
    finally:
        shared.set_jit_cache_dir(None)


def test_missing_nvrtc_is_a_clear_error(package, tmp_path):
    script = (
        "import os, sys\n"
        f"import {package.__name__} as p\n"
        "p._shared_cuda.nvrtc_candidates = lambda core: ['/nonexistent/libnvrtc.so']\n"
        "p._core.nvrtc_available = lambda: False\n"
        "try:\n"
        "    p._shared_cuda.jit_loader(p._core)\n"
        "except p.UnavailableError as e:\n"
        "    print('UNAVAILABLE', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert "UNAVAILABLE" in out and "nvidia-cuda-nvrtc" in out


def test_kernel_signature_validation(shared):
    class FakeKernel:
        name = "k"

    with pytest.raises(ValueError, match="unknown parameter types"):
        shared.Kernel(FakeKernel(), "f32, pointer")
    kernel = shared.Kernel(FakeKernel(), "f32, ptr, i64")
    assert kernel.pack([1.5, 0x1000, 7]) == [struct.pack("f", 1.5), struct.pack("Q", 0x1000), struct.pack("q", 7)]

    class FakeCudaTensor:  # what the packer reads of a torch tensor
        is_cuda = True

        def data_ptr(self):
            return 0x2000

    assert kernel.pack([0.0, FakeCudaTensor(), -1])[1] == struct.pack("Q", 0x2000)
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="must be a CUDA tensor, got one on cpu"):
        kernel.pack([0.0, torch.zeros(1), 1])
    with pytest.raises(TypeError, match="takes 3 arguments"):
        kernel.pack([1.5])
    with pytest.raises(ValueError, match="grid/block"):
        shared._dim3([1, 0])


@pytest.mark.gpu
def test_compile_cache_load_run_on_gpu(core, shared, nvrtc, cache_dir):
    import torch

    kernel = shared.load_kernel(core, SAXPY, "saxpy", "f32, ptr, ptr, i64", name="saxpy.cu")
    n = (1 << 20) + 3
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    expected = 2.5 * x + y
    kernel((n + 255) // 256, 256, 2.5, x, y, n)
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)  # NVRTC fuses a*x+y into one FMA
    stats = shared.jit_loader(core).stats()
    assert stats["compilations"] == 1 and list(cache_dir.glob("*.cubin"))
    # The same source again: served from memory, no new compile.
    shared.load_kernel(core, SAXPY, "saxpy", "f32, ptr, ptr, i64", name="saxpy.cu")
    assert shared.jit_loader(core).stats()["memory_hits"] == 1
    with pytest.raises(ValueError, match="no kernel named"):
        shared.jit_loader(core).get(SAXPY, "saxpy.cu", 0, []).get_kernel("nope")


@pytest.mark.gpu
def test_cuda_error_from_a_real_launch(core, shared, nvrtc, cache_dir):
    kernel = shared.load_kernel(core, SAXPY, "saxpy", "f32, ptr, ptr, i64", name="saxpy.cu")
    launch_error = r"cuLaunchKernel\(saxpy, grid 1x1x1, block 4096x1x1.*CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(core.CudaError, match=launch_error):
        kernel(1, 4096, 1.0, 0, 0, 0)  # 4096 threads per block exceeds every GPU's limit
