"""``python -m pytorch_direct info``: report the build and what this machine offers."""

import sys

from . import __version__, _core, _shared_cuda

sys.exit(_shared_cuda.main_info(_core, "pytorch-direct", __version__))
