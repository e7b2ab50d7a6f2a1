"""A fixed kernel of the CUDA backend: it zero-fills a range of a call's temporaries' allocation.

A call run as launch batches (:meth:`hector.runtime.cuda.CudaBackend._batched`) places the zero-initialised
temporaries that do not fit its small pool (edge- and node-sized sums accumulated with atomics) at the head of its
one allocation for temporaries, and fills them with this kernel, the first launch of its first batch: a torch
``zeros`` each would be one more torch call (the interpreter lock released and taken again, on the host time a
mini-batch step is bound by) and one more launch per buffer.
"""

from .common import ModuleCode

KERNEL = "hector_zero_fill"
SIGNATURE = "ptr, i64"  # the range (8-byte aligned), its length in 8-byte words
BLOCK = 256  # threads per block; a launch takes at most eight blocks per multiprocessor (the kernel strides)

SOURCE = r"""// hector: zero fill of a range of a call's temporaries (runtime support, not generated)
typedef long long i64;

// words 8-byte words from p set to zero, grid-stride.
extern "C" __global__ void hector_zero_fill(unsigned long long* __restrict__ p, i64 words) {
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride) p[i] = 0ull;
}

#ifdef HECTOR_EMULATE  // entry point for the CPU emulator used by the tests
extern "C" void hector_emu_hector_zero_fill(void** a) {
  hector_zero_fill(*(unsigned long long**)a[0], *(i64*)a[1]);
}
#endif
"""

MODULE = ModuleCode(KERNEL, SOURCE, (), ())


__all__ = ["BLOCK", "KERNEL", "MODULE", "SIGNATURE", "SOURCE"]
