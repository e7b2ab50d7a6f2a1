import os

import pytest
import torch

# Calibration is measured by its own test (and the benchmark); elsewhere "auto" uses the built-in rules so that
# tests stay fast and do not depend on timing.
os.environ.setdefault("PYTORCH_DIRECT_AUTO_CALIBRATE", "0")


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    import pytorch_direct

    if not pytorch_direct.cuda_usable():
        return "pytorch_direct was built without CUDA kernels or sees no device"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    import pytorch_direct
    from pytorch_direct import _config

    old = _config.settings.cache_dir
    pytorch_direct.set_cache_dir(tmp_path / "cache")
    yield tmp_path / "cache"
    pytorch_direct.set_cache_dir(old)
