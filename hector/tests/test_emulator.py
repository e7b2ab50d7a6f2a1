"""The kernel emulator itself (tests/emulation.py, emulator/): block barriers, shared memory and warp shuffles behave as
on a GPU across several blocks."""

from types import SimpleNamespace

import pytest
import torch
from emulation import EmulatedExecutor, compiler

if compiler() is None:
    pytest.skip("no C++ compiler for the kernel emulator", allow_module_level=True)

SOURCE = r"""
__global__ void mirror(float* out) {
  __shared__ float s[64];
  const unsigned t = threadIdx.x;
  s[t] = (float)(t + 100 * blockIdx.x);
  __syncthreads();
  float v = s[63 - t];
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[blockIdx.x * 64 + t] = v;
}
extern "C" void hector_emu_mirror(void** a) { mirror(*(float**)a[0]); }
"""


def test_barriers_shared_memory_and_shuffles_across_blocks():
    ex = EmulatedExecutor()
    handle = ex.load(SimpleNamespace(source=SOURCE), "emulator_selftest.cu")
    out = torch.full((3 * 64,), float("nan"))
    ex.launch(ex.kernel(handle, "mirror", "ptr", 0), (3, 1), 64, [out], 0, 0)
    t = torch.arange(64)
    expected = torch.cat([(63 - t) + (63 - (t ^ 1)) + 200.0 * b for b in range(3)]).float()
    assert torch.equal(out, expected)

