"""``python -m ssdtrain info``: report the build, the I/O backends and what this machine offers."""

import sys

from . import __version__, _backend_lines, _core, _shared_cuda

sys.exit(_shared_cuda.main_info(_core, "ssdtrain", __version__, _backend_lines()))
