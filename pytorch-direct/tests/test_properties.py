"""Property tests (hypothesis) of the CPU path: random shapes, widths and index sets against torch's indexing."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")  # the GPU machine may not have it; the module is skipped there
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_cpu import plain, random_table, same_bytes  # noqa: E402

import pytorch_direct as pd  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 200), width=st.integers(1, 70), n=st.integers(0, 300),
       index_shape=st.sampled_from(["1d", "2d"]), seed=st.integers(0, 1000))
def test_gather_property(rows, width, n, index_shape, seed):
    table = random_table((rows, width), torch.uint8, seed)
    u = pd.unified(table, copy=True)
    idx = torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(seed))
    if index_shape == "2d" and n % 2 == 0:
        idx = idx.view(2, n // 2)
    assert same_bytes(u[idx], table[idx])


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 100), bad=st.one_of(st.integers(-(2**40), -1), st.integers(0, 2**40)))
def test_bounds_property(rows, bad):
    u = pd.unified(torch.arange(rows * 2.0).view(rows, 2), copy=True)
    idx = torch.tensor([0, bad])
    if 0 <= bad < rows:
        assert torch.equal(u[idx], plain(u)[idx])
    else:
        with pytest.raises(IndexError, match=str(bad)):
            u[idx]
