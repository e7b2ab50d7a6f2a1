"""Helpers shared by ssdtrain's tests (a unique module name: the monorepo runs all packages' tests together)."""

import contextlib
import shutil
import subprocess

import pytest
import torch


@contextlib.contextmanager
def mounted_tmpfs(path, size: str, options: str = ""):
    """A small tmpfs at `path` (needs CAP_SYS_ADMIN); skips the test where mounting is refused."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command here; the fault-injection tests cover this case")
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",{options}" if options else "")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({result.stderr.strip() or result.returncode}); "
            "the fault-injection tests cover this case"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def random_tensor(nbytes: int, seed: int = 0, dtype=torch.uint8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype)
