"""Property test: random sizes, source/destination alignments and block sizes round-trip exactly."""

import pytest
import torch
from ssdtrain_testutil import random_tensor

hypothesis = pytest.importorskip("hypothesis")  # the test extra has it; a bare GPU machine may not
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    nbytes=st.integers(1, 3 << 20),
    offset=st.integers(0, 4095),
    block_kib=st.sampled_from([4, 64, 256, 1024]),
    seed=st.integers(0, 2**31),
)
def test_round_trip_property(engine_factory, nbytes, offset, block_kib, seed):
    # One engine per block size, reused across examples (engine creation costs a ring and buffers).
    engine = _cached_engine(engine_factory, block_kib)
    raw = torch.empty(nbytes + offset, dtype=torch.uint8)
    src = raw[offset:].copy_(random_tensor(nbytes, seed))
    handle = engine.write(src).result(timeout=30)
    raw_out = torch.empty(nbytes + 4096, dtype=torch.uint8)
    out = raw_out[(seed % 4096) : (seed % 4096) + nbytes].fill_(0xA5)
    engine.read(handle, out=out).result(timeout=30)
    assert torch.equal(out, src)
    engine.free(handle)


_engines = {}


def _cached_engine(factory, block_kib):
    key = (id(factory), block_kib)
    if key not in _engines:
        _engines.clear()
        _engines[key] = factory(block_size=block_kib * 1024, checksum=True, queue_depth=8, staging_buffers=4)
    return _engines[key]
