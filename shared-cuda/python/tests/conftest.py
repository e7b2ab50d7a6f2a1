"""Tests of the shared layer as each package exposes it.

The same tests run once per package (nox sets SHARED_CUDA_TEST_PACKAGE; by default every installed package is
tested), because each package compiles its own copy of the bindings.
"""

from __future__ import annotations

import importlib
import os

import pytest

ALL_PACKAGES = ["pytorch_direct", "hector", "ssdtrain"]


def _packages() -> list[str]:
    chosen = os.environ.get("SHARED_CUDA_TEST_PACKAGE")
    if chosen:
        return [chosen]
    return [name for name in ALL_PACKAGES if importlib.util.find_spec(name) is not None]


@pytest.fixture(params=_packages())
def package(request):
    return importlib.import_module(request.param)


@pytest.fixture
def core(package):
    return package._core


@pytest.fixture
def shared(package):
    return package._shared_cuda


def cuda_usable() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped where none is usable)")


def pytest_collection_modifyitems(config, items):
    if cuda_usable():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none usable here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
