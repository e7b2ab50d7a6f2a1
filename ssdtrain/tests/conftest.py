import contextlib
import subprocess

import pytest
import torch

import ssdtrain
from ssdtrain import _core

IO_URING = _core.io_uring_status()
CPU_BACKENDS = ["threads"] + (["io_uring"] if IO_URING["usable"] else [])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU usable here (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=CPU_BACKENDS)
def backend(request):
    return request.param


@contextlib.contextmanager
def mounted_tmpfs(path, size: str, options: str = ""):
    """A small tmpfs at `path` (needs CAP_SYS_ADMIN); skips the test where mounting is refused."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",{options}" if options else "")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or result.returncode}); "
                    "the fault-injection tests cover this case")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def engine_factory(tmp_path):
    engines = []

    def make(**kw):
        kw.setdefault("capacity_per_directory", "256M")
        directories = kw.pop("directories", [str(tmp_path)])
        e = ssdtrain.Engine(directories, **kw)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()


def random_tensor(nbytes: int, seed: int = 0, dtype=torch.uint8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype)
