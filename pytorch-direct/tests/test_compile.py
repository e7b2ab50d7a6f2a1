"""torch.compile of functions that take a unified tensor: fullgraph (no graph break), the same results as eager,
gradients that reach the host-resident table.grad, and no recompilation or leak from the compile alias."""

import gc
import os
import shutil
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

import pytorch_direct as pd

ROWS, WIDTH = 100, 8
# Inductor's CPU backend compiles C++ (aot_eager does not).
needs_cxx = pytest.mark.skipif(not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")),
                               reason="no C++ compiler on PATH: inductor's CPU backend needs one")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def random_table(seed=0, rows=ROWS, width=WIDTH):
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


def indices(n, seed=1, high=ROWS):
    return torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(seed))


def plain(t):
    return t.as_subclass(torch.Tensor)


def graph_breaks(fn, *args):
    explained = torch._dynamo.explain(fn)(*args)
    torch._dynamo.reset()
    return explained.graph_count, explained.graph_break_count


def test_base_of_a_unified_tensor_is_its_plain_owner():
    # The root cause of the RecursionError under torch.compile: reading _base returned a fresh unified view whose
    # _base was again a fresh view, an endless chain that Dynamo walks when it wraps a graph input.
    u = pd.unified(random_table(), copy=True)
    base = u._base
    assert type(base) is torch.Tensor and base._base is None
    assert base.untyped_storage().data_ptr() == plain(u).untyped_storage().data_ptr()
    assert pd.is_unified(u[2:5]) and pd.is_unified(u.view(-1))  # other aliases stay unified, as before


GIDX = torch.randint(0, ROWS, (5, WIDTH), generator=torch.Generator().manual_seed(2))
READS = {
    "getitem": lambda t, i: t[i] * 2,
    "getitem_2d_index": lambda t, i: t[i.view(4, 4)].sum(-1),
    "index_select": lambda t, i: t.index_select(0, i) + 1,
    "torch_index_select": lambda t, i: torch.index_select(t, 0, i.int()) + 1,
    "embedding": lambda t, i: F.embedding(i.view(4, 4), t) * 3,
    "embedding_padding_idx": lambda t, i: F.embedding(i, t, padding_idx=-1),
    "torch_gather_dim0": lambda t, i: torch.gather(t, 0, GIDX) + 1,
    "tensor_gather_dim0": lambda t, i: t.gather(0, GIDX[:, :3]),
    "pd_gather": lambda t, i: pd.gather(t, i) * 2,
    "plain_inside": lambda t, i: pd.gather(t.plain(), i) + t.plain()[i],
    "with_other_ops": lambda t, i: t[i] + t.sum(0) + t[2:5].mean() + t.shape[0],
}


@pytest.mark.parametrize("name", sorted(READS))
def test_reads_compile_fullgraph_like_eager(name):
    fn = READS[name]
    table = random_table()
    u = pd.unified(table, copy=True)
    idx = indices(16)
    assert graph_breaks(fn, u, idx) == (1, 0)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(u, idx)
    ref = fn(u, idx)
    assert type(out) is torch.Tensor and torch.equal(out, ref)
    if name != "plain_inside":
        assert torch.equal(fn(table, idx), ref)  # and eager on the unified tensor is torch's own result
    idx2 = indices(16, seed=3)  # same shapes, new values: no recompile needed, still right
    assert torch.equal(compiled(u, idx2), fn(u, idx2))


def _setitem(t, i, v):
    t[i] = v
    t[i[:2]] = 0.5  # a Python scalar
    return t.sum()


def _index_copy(t, i, v):
    t.index_copy_(0, i, v)
    return t[i].sum()


def _index_add(t, i, v):
    t.index_add_(0, i, v, alpha=2)
    return t.sum(1)


def _pd_writes(t, i, v):
    pd.scatter_(t, i, v)
    pd.index_add_(t, i.flip(0), v, alpha=0.5)
    return None


WRITES = {"setitem": _setitem, "index_copy_": _index_copy, "index_add_": _index_add, "pd_writes": _pd_writes}


@pytest.mark.parametrize("name", sorted(WRITES))
def test_writes_run_eagerly_inside_compile(name):
    # Writes are a graph break (they run eagerly, in place): never a functionalized copy of the table. With
    # fullgraph=True compiling them fails loudly instead.
    fn = WRITES[name]
    idx = torch.tensor([3, 17, 3, 99, 0, 42])  # a duplicate: index_add_ sums it, the others keep one writer
    if name in ("setitem", "index_copy_", "pd_writes"):
        idx = torch.tensor([3, 17, 64, 99, 0, 42])  # one writer per row: the result does not depend on the order
    v = torch.randn(idx.numel(), WIDTH)
    with pytest.raises(Exception, match="(?i)disable|skip"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(pd.unified(random_table(), copy=True), idx, v)
    torch._dynamo.reset()
    u = pd.unified(random_table(), copy=True)
    ref = pd.unified(random_table(), copy=True)
    compiled = torch.compile(fn, backend="aot_eager")
    for _ in range(2):
        out, expected = compiled(u, idx, v), fn(ref, idx, v)
        assert (out is None and expected is None) or torch.allclose(out, expected, atol=1e-5)
        assert torch.equal(plain(u), plain(ref))


@needs_cxx
def test_inductor_reads_and_writes():
    # One function, the default backend: the reads compile to the custom ops, the writes run eagerly in between.
    def step(t, i, v):
        rows = t[i] + F.embedding(i.view(2, -1), t).view(i.numel(), -1) + torch.gather(t, 0, GIDX).sum()
        t[i] = v
        t.index_add_(0, i, v)
        return rows.relu().sum(1), t.index_select(0, i)

    table = random_table()
    u, ref = pd.unified(table, copy=True), pd.unified(table, copy=True)
    compiled = torch.compile(step)
    for n, seed in [(8, 1), (12, 2)]:  # a second size: the recompiled graph has a dynamic index length
        idx = torch.randperm(ROWS, generator=torch.Generator().manual_seed(seed))[:n]
        v = torch.randn(n, WIDTH)
        out, expected = compiled(u, idx, v), step(ref, idx, v)
        for a, b in zip(out, expected, strict=True):
            assert torch.allclose(a, b, atol=1e-5)
        assert torch.equal(plain(u), plain(ref))


def _loss(t, i, w):
    rows = F.embedding(i, t, padding_idx=2)  # row 2 gets no gradient from this term (torch's dense one agrees)
    return (rows * w).sum() + (t[i.flatten()] ** 2).sum() + 0.01 * t.pow(2).sum()  # the last one: a dense gradient


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=needs_cxx)])
def test_gradient_reaches_the_host_table_like_eager(backend):
    table = random_table()
    idx = torch.tensor([[1, 2, 2], [99, 1, 0]])
    w = torch.randn(2, 3, WIDTH)
    emb = pd.unified(table.clone(), copy=True).requires_grad_()
    ref = pd.unified(table.clone(), copy=True).requires_grad_()
    dense = table.clone().requires_grad_()
    compiled = torch.compile(_loss, fullgraph=True, backend=backend)
    for step in range(2):  # the second backward accumulates into the existing .grad
        out = compiled(emb, idx, w)
        assert out.requires_grad
        out.backward()
        _loss(ref, idx, w).backward()
        _loss(dense, idx, w).backward()
        assert pd.is_unified(emb.grad) and pd.is_unified(ref.grad), step
        assert torch.allclose(plain(emb.grad), plain(ref.grad), atol=1e-5), step
        assert torch.allclose(plain(emb.grad), dense.grad, atol=1e-5), step
    torch.optim.SGD([emb], lr=0.1).step()  # the optimizer sees the host-resident gradient as in eager
    assert torch.allclose(plain(emb).detach(), table - 0.1 * dense.grad, atol=1e-5)


def test_no_recompile_for_another_table_and_no_leak():
    counter = CompileCounter()
    compiled = torch.compile(lambda t, i: t[i].sum(1) + t.sum(), fullgraph=True, backend=counter)
    idx = indices(6)
    for seed in range(3):
        table = random_table(seed)
        assert torch.allclose(compiled(pd.unified(table, copy=True), idx), table[idx].sum(1) + table.sum())
    assert counter.frame_count == 1
    for requires_grad in (False, True):
        u = pd.unified(random_table(), copy=True).requires_grad_(requires_grad)
        out = compiled(u, idx)
        if requires_grad:  # (CompileCounter runs the graph eagerly: the custom op's own autograd, on the alias)
            out.sum().backward()
            expected = torch.full((ROWS, WIDTH), float(idx.numel())).index_add_(0, idx, torch.ones(idx.numel(), WIDTH))
            assert pd.is_unified(u.grad) and torch.equal(plain(u.grad), expected)
        alive = weakref.ref(u)
        del u, out
        gc.collect()
        assert alive() is None, requires_grad  # the alias the compiled graph reads holds no reference to it
    assert counter.frame_count == 2  # one recompile, for the table that requires grad (its alias does too)


def test_module_holding_the_table():
    class Model(torch.nn.Module):
        def __init__(self, table):
            super().__init__()
            self.table = table
            self.register_buffer("features", pd.unified(table * 2, copy=True))
            self.linear = torch.nn.Linear(WIDTH, 3)

        def forward(self, idx):
            return self.linear(F.embedding(idx, self.table) + self.features[idx])

    model = Model(pd.unified(random_table(), copy=True))
    idx = indices(10).view(2, 5)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(idx), model(idx), atol=1e-6)
    assert pd.is_unified(model.table) and pd.is_unified(model.features)


def test_bad_index_raises_when_compiled():
    u = pd.unified(random_table(), copy=True)
    compiled = torch.compile(lambda t, i: t[i], fullgraph=True, backend="aot_eager")
    compiled(u, torch.tensor([1, 2]))
    with pytest.raises(IndexError, match="index 100"):
        compiled(u, torch.tensor([1, ROWS]))
    gathered = torch.compile(lambda t, i: torch.gather(t, 0, i), fullgraph=True, backend="aot_eager")
    gathered(u, GIDX)
    with pytest.raises(IndexError):  # reported as -1: the compiled torch.gather does not name the bad row
        gathered(u, torch.full_like(GIDX, ROWS))


def test_results_of_other_ops_are_plain_aliases_when_compiled():
    # Inside a compiled function only the row operations are redirected; a slice comes back as a plain tensor
    # that still aliases the table's memory.
    u = pd.unified(random_table(), copy=True)
    rows = torch.compile(lambda t: t[10:20], fullgraph=True, backend="aot_eager")(u)
    assert type(rows) is torch.Tensor and torch.equal(rows, plain(u)[10:20])
    rows[0] = 7.0
    assert torch.equal(plain(u)[10], torch.full((WIDTH,), 7.0))


def test_view_of_a_table_that_requires_grad_is_refused():
    # Its compile alias would be a leaf of its own: gradients would reach neither the view nor the table.
    view = pd.unified(random_table(), copy=True).requires_grad_()[10:20]
    with pytest.raises(torch._dynamo.exc.Unsupported, match="view of a unified tensor that requires grad"):
        torch.compile(lambda t, i: t[i].sum(), fullgraph=True, backend="aot_eager")(view, torch.tensor([1]))
    # Without fullgraph Dynamo falls back to eager, which refuses the gather the same way.
    with pytest.raises(NotImplementedError, match="view of a unified tensor that requires grad"):
        torch.compile(lambda t, i: t[i].sum(), backend="aot_eager")(view, torch.tensor([1]))
