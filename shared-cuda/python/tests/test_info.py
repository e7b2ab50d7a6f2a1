"""`info` and the device query work on any machine, GPU or not, and agree with each other."""

import json
import subprocess
import sys


def test_device_query_never_raises(core):
    count = core.device_count()
    assert count >= 0
    assert core.cuda_available() == (count > 0)
    assert core.device_properties(-1) is None
    assert core.device_properties(count) is None
    assert core.driver_version() >= 0


def test_build_facts_are_consistent(core):
    compiled = core.compiled_with_cuda()
    assert compiled == bool(core.compiled_architectures())
    assert compiled == (core.compiled_runtime_version() > 0)


def test_info_dict(package):
    info = package.info()
    assert info["version"] == package.__version__
    assert info["cuda_compiled"] == package._core.compiled_with_cuda()
    assert len(info["gpus"]) == package._core.device_count()
    assert set(info["nvrtc"]) == {"available", "path", "version"}


def test_info_cli_text_and_json(package):
    module = package.__name__
    text = subprocess.run([sys.executable, "-m", module, "info"], capture_output=True, text=True, check=True).stdout
    assert package.__version__ in text
    assert "CUDA compiled:" in text and "NVRTC:" in text
    data = json.loads(
        subprocess.run([sys.executable, "-m", module, "info", "--json"], capture_output=True, text=True,
                       check=True).stdout
    )
    assert data["version"] == package.__version__


def test_gpu_seen_matches_torch(core):
    import pytest
    import torch

    if torch.cuda.is_available():
        assert core.device_count() == torch.cuda.device_count()
        props = core.device_properties(0)
        assert props["multiprocessors"] == torch.cuda.get_device_properties(0).multi_processor_count
    elif torch.version.cuda is not None:
        assert core.device_count() == 0  # a CUDA build of torch that sees no GPU: neither may we
    else:
        pytest.skip("torch is a CPU build: nothing to compare with")
