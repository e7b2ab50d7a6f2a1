"""The unified tensor as a PyTorch user handles it on the CPU, compared with a plain tensor given the same calls:
copies, writes with wrong arguments, edge-case tables."""

import copy

import pytest
import torch

import pytorch_direct as pd


def plain(t):
    return t.as_subclass(torch.Tensor)


def test_deepcopy_gives_a_new_unified_table():
    base = torch.randn(10, 4)
    u = pd.unified(base.clone(), copy=True)
    c = copy.deepcopy(u)
    assert type(c) is pd.UnifiedTensor and c.data_ptr() != u.data_ptr()
    assert torch.equal(plain(c), base)
    assert torch.equal(plain(c[torch.tensor([3, 1])]), base[[3, 1]])
    c[torch.tensor([0])] = torch.zeros(1, 4)
    assert torch.equal(plain(u), base)  # the copy owns its memory

    g = pd.unified(base.clone(), copy=True).requires_grad_()
    g[torch.tensor([2, 2])].sum().backward()
    gc = copy.deepcopy(g)
    assert gc.requires_grad and gc.is_leaf and torch.equal(plain(gc.grad), plain(g.grad))


def test_deepcopy_of_a_module_holding_unified_tables():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            table = pd.unified(torch.randn(10, 4), copy=True)
            self.register_buffer("table", table)
            self.register_buffer("tail", table[5:])  # a view: its copy stays a view of the table's copy
            self.emb = torch.nn.Parameter(pd.unified(torch.randn(10, 4), copy=True))

        def forward(self, i):
            return self.table[i] + self.emb[i]

    m = M()
    c = copy.deepcopy(m)
    i = torch.tensor([1, 7])
    assert type(c.table) is pd.UnifiedTensor and c.table.data_ptr() != m.table.data_ptr()
    assert c.tail.data_ptr() == c.table[5:].data_ptr()
    assert [n for n, _ in c.named_parameters()] == ["emb"]
    assert torch.equal(c(i), m(i))


@pytest.mark.parametrize("shape", [(0, 4), (0,)])
def test_table_of_no_rows(shape):
    u = pd.zeros(*shape)
    none = torch.tensor([], dtype=torch.long)
    assert u[none].shape == torch.zeros(shape)[none].shape
    row = (1,) + shape[1:]
    for call in (lambda: u[torch.tensor([0])], lambda: pd.gather(u, torch.tensor([0])),
                 lambda: u.index_select(0, torch.tensor([0])),
                 lambda: u.__setitem__(torch.tensor([0]), torch.ones(row)),
                 lambda: pd.scatter_(u, torch.tensor([0]), torch.ones(row)),
                 lambda: u.index_add_(0, torch.tensor([0]), torch.ones(row))):
        with pytest.raises(IndexError, match="out of range for a table of 0 rows"):
            call()


def test_writes_that_autograd_cannot_record_raise():
    # torch raises for an in-place write into a leaf that requires grad, and records one whose values require
    # grad; the package's writes have no backward, so both raise instead of losing the gradients silently.
    idx = torch.tensor([1, 3])
    values = torch.randn(2, 4, requires_grad=True)
    table = pd.unified(torch.randn(10, 4), copy=True)
    before = plain(table).clone()
    writes = [lambda t, v: t.__setitem__(idx, v), lambda t, v: t.index_copy_(0, idx, v),
              lambda t, v: t.index_add_(0, idx, v), lambda t, v: pd.scatter_(t, idx, v),
              lambda t, v: pd.index_add_(t, idx, v)]
    for write in writes:
        with pytest.raises(NotImplementedError, match="not recorded by autograd"):
            write(table, values)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            write(table.detach().requires_grad_(), values.detach())
    assert torch.equal(plain(table), before)
    leaf = table.detach().requires_grad_()
    with torch.no_grad():  # what optimizers do
        for write in writes:
            write(table, values)
            write(leaf, values)
    assert not torch.equal(plain(table), before)


@pytest.mark.parametrize("values", [torch.ones(2, 4, dtype=torch.float64), torch.tensor(7),
                                    torch.ones(2, 4, dtype=torch.bool),
                                    torch.full((2, 4), 1 + 2j, dtype=torch.complex64)],
                         ids=["float64", "0d int64", "bool", "complex64"])
def test_setitem_values_of_another_dtype_raise_as_torch(values):
    idx = torch.tensor([1, 3])
    table = pd.unified(torch.randn(10, 4), copy=True)
    before = plain(table).clone()
    with pytest.raises(RuntimeError, match="dtypes match"):
        plain(table).clone()[idx] = values
    with pytest.raises(RuntimeError, match="dtypes match"):
        table[idx] = values
    assert torch.equal(plain(table), before)
    table[idx] = 5  # a Python number takes the table's dtype, as in torch


@pytest.mark.parametrize("shape", [(1, 2, 4), (1, 1, 4), (4,), (2, 1), (), (3, 4), (2, 1, 4), (2, 5)])
def test_setitem_broadcasts_values_as_torch(shape):
    idx = torch.tensor([1, 3])
    values = torch.arange(float(torch.Size(shape).numel())).view(shape)
    ref = torch.randn(10, 4)
    table = pd.unified(ref.clone(), copy=True)
    try:
        ref[idx] = values
    except RuntimeError as e:
        assert "shape mismatch" in str(e)
        with pytest.raises(RuntimeError, match="shape mismatch"):
            table[idx] = values
    else:
        table[idx] = values
    assert torch.equal(plain(table), ref)


def test_index_add_on_a_bool_table_matches_torch():
    g = torch.Generator().manual_seed(0)
    table = torch.rand(20, 3, generator=g) < 0.3
    idx = torch.randint(0, 20, (50,), generator=g)
    values = torch.rand(50, 3, generator=g) < 0.2
    u = pd.unified(table.clone(), copy=True)
    u.index_add_(0, idx, values)
    assert torch.equal(plain(u), table.clone().index_add_(0, idx, values))
    u = pd.unified(table.clone(), copy=True)
    pd.index_add_(u, idx, values)
    assert torch.equal(plain(u), table.clone().index_add_(0, idx, values))


@pytest.mark.parametrize("method", ["index_copy_", "index_add_"])
def test_index_copy_and_index_add_take_a_vector_index_as_torch(method):
    idx = torch.tensor([[1, 2], [3, 4]])
    source = torch.randn(4, 4)
    table = pd.unified(torch.randn(10, 4), copy=True)
    before = plain(table).clone()
    with pytest.raises(IndexError):
        getattr(before.clone(), method)(0, idx, source)
    with pytest.raises(IndexError, match="vector"):
        getattr(table, method)(0, idx, source)
    assert torch.equal(plain(table), before)
    for index, rows in ((torch.tensor(3), source[:1]), (idx.view(-1), source)):  # 0-d and 1-D, as torch
        ref = getattr(before.clone(), method)(0, index, rows)
        assert torch.equal(plain(getattr(pd.unified(before.clone(), copy=True), method)(0, index, rows)), ref)


@pytest.mark.parametrize("view", ["columns", "transposed"])
def test_rows_of_a_non_contiguous_view_with_cpu_indices_as_torch(view):
    def make(t):
        return t[:, 1:3] if view == "columns" else t.t()

    base = torch.randn(6, 6)
    idx = torch.tensor([4, 0, 4])
    u = pd.unified(base.clone(), copy=True)
    ref = base.clone()
    assert torch.equal(plain(make(u)[idx]), make(ref)[idx])
    assert torch.equal(plain(make(u).index_select(0, idx)), make(ref).index_select(0, idx))
    embedding = torch.nn.functional.embedding
    assert torch.equal(plain(embedding(idx, make(u))), embedding(idx, make(ref)))
    rows = torch.randn(3, make(ref).shape[1])
    make(u)[idx[:2]] = rows[:2]
    make(ref)[idx[:2]] = rows[:2]
    make(u).index_add_(0, idx, rows)
    make(ref).index_add_(0, idx, rows)
    make(u).index_copy_(0, idx[1:], rows[1:])
    make(ref).index_copy_(0, idx[1:], rows[1:])
    assert torch.equal(plain(u), ref)


def test_index_add_with_a_complex_alpha_as_torch():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(8, 3, dtype=torch.complex64, generator=g)
    idx = torch.tensor([1, 5, 1])
    values = torch.randn(3, 3, dtype=torch.complex64, generator=g)
    u = pd.unified(table.clone(), copy=True)
    u.index_add_(0, idx, values, alpha=0.5 - 2j)
    assert torch.allclose(plain(u), table.clone().index_add_(0, idx, values, alpha=0.5 - 2j))


@pytest.mark.parametrize("factory", ["empty", "zeros"])
def test_factories_take_dtype_none_as_torch(factory):
    t = getattr(pd, factory)(3, 2, dtype=None)
    assert type(t) is pd.UnifiedTensor and t.dtype == getattr(torch, factory)(3, 2, dtype=None).dtype
    assert getattr(pd, factory)(3, 2).dtype == torch.float32  # the documented default stays


def test_index_copy_of_a_0d_source_into_a_1d_table_as_torch():
    for index in (torch.tensor([3]), torch.tensor(3)):
        u = pd.zeros(5)
        u.index_copy_(0, index, torch.tensor(7.0))
        assert torch.equal(plain(u), torch.zeros(5).index_copy_(0, index, torch.tensor(7.0)))


def test_format_of_an_element_as_torch():
    base = torch.randn(4, 3)
    u = pd.unified(base.clone(), copy=True)
    assert type(u[2, 1]) is pd.UnifiedTensor
    assert f"{u[2, 1]:.3f}" == f"{base[2, 1]:.3f}"
    assert format(u[2, 1]) == format(base[2, 1])
    assert f"{u}" == str(u) and str(u).startswith("unified tensor(")


@pytest.mark.parametrize("copy_", [False, True])
def test_unified_keeps_requires_grad_as_torchs_copies_do(copy_):
    # torch's copies and moves keep requires_grad: t.to(torch.float64), t.to("cpu", copy=True), t.pin_memory() (in
    # torch's derivatives.yaml, "_pin_memory(Tensor self, Device? device=None)": "self: grad"). unified() dropped
    # it: a table made from a tensor that requires grad gave rows that did not, and so trained nothing, silently.
    t = torch.randn(8, 4, requires_grad=True)
    assert t.to(torch.float64).requires_grad and t.to("cpu", copy=True).requires_grad
    u = pd.unified(t, copy=copy_)
    assert type(u) is pd.UnifiedTensor and u.requires_grad
    assert (u.data_ptr() == t.data_ptr()) == (not copy_)
    # a leaf whose gradient is its own host-resident .grad (not a dense gradient sent back to t)
    assert u.is_leaf
    u[torch.tensor([1, 3, 3])].sum().backward()
    expected = torch.zeros(8, 4)
    expected[1], expected[3] = 1, 2
    assert torch.equal(plain(u.grad), expected) and t.grad is None
    before = t.detach().clone()
    torch.optim.SGD([u], lr=1.0).step()
    assert torch.equal(plain(u).detach(), before - expected if copy_ else t.detach())
    assert torch.equal(t.detach(), before if copy_ else before - expected), "copy=False shares t's memory"
    again = pd.unified(u, copy=True)  # (a copy of a unified table that requires grad)
    assert again.requires_grad and again.is_leaf and again.grad is None
    # as torch's: nothing to keep without requires_grad, and nothing recorded under no_grad
    assert not pd.unified(t.detach(), copy=copy_).requires_grad
    with torch.no_grad():
        assert not t.to(torch.float64).requires_grad
        assert not pd.unified(t, copy=copy_).requires_grad


def test_unified_of_a_tensor_with_autograd_history_says_the_fix():
    # t.to(...) of a non-leaf sends gradients on through t's graph; a unified table cannot (its gradient stays in its
    # own .grad), so cutting the graph silently is refused
    w = torch.randn(8, 4, requires_grad=True)
    for copy_ in (False, True):
        with pytest.raises(RuntimeError, match=r"MulBackward0.*t\.detach\(\)"):
            pd.unified(w * 2, copy=copy_)
        with torch.no_grad():
            assert not pd.unified(w * 2, copy=copy_).requires_grad
