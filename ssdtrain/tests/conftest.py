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


@pytest.fixture(autouse=True)
def _disk_rate_cache(tmp_path_factory, monkeypatch):
    """Measured disk rates go to a per-run cache directory, never the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
