"""``import pytorch_direct`` initialises no CUDA and loads neither the CUDA driver nor NVRTC: both wait for the first
call that needs them. Checked in a fresh interpreter (CPU builds too: there the libraries are never there to load).

torch's CUDA wheels preload NVRTC themselves in ``import torch`` (``torch._load_global_deps``, a workaround for
cuDNN and cuSPARSE finding the wrong copy), so the check is on what ``import pytorch_direct`` adds after
``import torch``; where torch loaded no NVRTC, none may be mapped at all.
"""

import json
import subprocess
import sys

PROBE = r"""
import json, sys

def mapped():
    try:
        maps = open("/proc/self/maps").read()
    except OSError:  # (not Linux: nothing to compare)
        return None
    return sorted(lib for lib in ("libnvrtc", "libcuda.so") if lib in maps)

import torch
before = mapped()
import pytorch_direct
after = mapped()
print(json.dumps({"initialized": torch.cuda.is_initialized(), "before": before, "after": after,
                  "modules": sorted(m for m in sys.modules if m.startswith("torch._dynamo"))}))
"""


def probe() -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_touches_no_cuda_and_loads_no_nvrtc():
    got = probe()
    assert got["initialized"] is False, "import pytorch_direct initialised CUDA in torch"
    if got["before"] is not None:
        added = sorted(set(got["after"]) - set(got["before"]))
        assert added == [], f"import pytorch_direct loaded {added} (mapped after import torch: {got['before']})"
        if "libnvrtc" not in got["before"]:
            assert "libnvrtc" not in got["after"]
        assert "libcuda.so" not in got["after"] or "libcuda.so" in got["before"]
    # (torch.compile's machinery is imported on first use, not at import: ~1.5 s of the import otherwise)
    assert got["modules"] == [], got["modules"]
