"""torch.compile of models with hector layers: one custom op per layer (fake kernels), no graph breaks."""

import shutil

import pytest
import torch
from conftest import make_graph, rel_err

import hector.nn as hn
from hector.nn import _ops


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = hn.RGATConv(6, 3, 3, heads=2)
        self.b = hn.HGTConv(6, 6, 2, 3, heads=2)
        self.c = hn.RGCNConv(6, 4, 3, num_bases=2)

    def forward(self, x, ei, et, nt):
        h = self.a(x, ei, et).relu()
        h = self.b(h, ei, et, nt)
        return self.c(h, ei, et)


def _check(backend):
    torch.manual_seed(0)
    ei, et, nt = make_graph(node_types=2)
    net = Net()
    x = torch.randn(14, 6, requires_grad=True)
    ref = net(x, ei, et, nt)
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), [x] + list(net.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True, backend=backend)  # fullgraph: a graph break is an error
    out = compiled(x, ei, et, nt)
    grads = torch.autograd.grad(out.pow(2).sum(), [x] + list(net.parameters()))
    assert rel_err(out, ref) < 1e-6
    for a, b in zip(grads, ref_grads, strict=True):
        assert rel_err(a, b) < 1e-6
    net.eval()
    with torch.no_grad():
        assert rel_err(compiled(x, ei, et, nt), net(x, ei, et, nt)) < 1e-6
    return net, compiled, (x, ei, et, nt)


def test_compile_fullgraph_aot_eager():
    _check("aot_eager")


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_compile_fullgraph_inductor():
    _check("inductor")


def test_backward_recomputes_an_evicted_forward(monkeypatch):
    monkeypatch.setattr(_ops, "STASH_LIMIT", 0)  # nothing kept: backward recomputes the forward values
    _check("aot_eager")


def test_custom_op_fake_kernel():
    """The fake kernel gives the output shape without running anything (opcheck covers schema and fakes)."""
    layer = hn.RGATConv(6, 3, 3, heads=2)
    ei, et, _ = make_graph()
    x = torch.randn(14, 6)
    args = (x, ei, et, None, list(layer._tensors().values()), layer._layer_id)
    torch.library.opcheck(torch.ops.hector.relational_layer, args,
                          test_utils=("test_schema", "test_faketensor"))
    assert layer.output_feature_shape() == (6,)


@pytest.mark.parametrize("x_grad", [True, False])
def test_compiled_training_steps_do_no_extra_work(monkeypatch, x_grad):
    """What would make a compiled model slower than eager, checked over several training steps of a model with
    all three layers: one graph and no graph break (dynamo's explain), no recompilation after the first step, no
    graph prepared again per call, no forward recomputed in backward (the stash hits), and the same backend runs
    (forward and backward programs, in the same number) as an eager step; with input features that need no
    gradient (``x_grad=False``, a first layer), no gradient of them computed either."""
    from torch._dynamo.utils import counters

    from hector.runtime import compiled as compiled_mod
    from hector.runtime import graph as graph_mod

    torch.manual_seed(0)
    ei, et, nt = make_graph(node_types=2)
    net = Net()
    x = torch.randn(14, 6, requires_grad=x_grad)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(net)(x, ei, et, nt)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    runs: list[str] = []
    made = [0]
    real_select, real_init = compiled_mod.select, graph_mod.Graph.__init__

    def counting_select(device, dtype):
        backend = real_select(device, dtype)

        class Counting:
            name = backend.name

            def run(self, lowered, graph, leaves, keep=None, **kwargs):
                runs.append((lowered.program.name, len(lowered.kernels)))
                return backend.run(lowered, graph, leaves, keep, **kwargs)

        return Counting()

    def counting_init(self, *args, **kwargs):
        made[0] += 1
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(compiled_mod, "select", counting_select)
    monkeypatch.setattr(_ops, "select", counting_select)
    monkeypatch.setattr(graph_mod.Graph, "__init__", counting_init)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")

    def steps(model, n):
        for _ in range(n):
            model(x, ei, et, nt).pow(2).sum().backward()

    steps(compiled, 2)  # traces, compiles, prepares the graph once
    frames = counters["stats"]["unique_graphs"]
    runs.clear()
    made[0] = 0
    steps(compiled, 3)
    assert counters["stats"]["unique_graphs"] == frames and not counters["recompiles"], "recompiled per call"
    assert made[0] == 0, "the graph was prepared again in a compiled step"
    compiled_runs = list(runs)
    runs.clear()
    steps(net, 3)
    assert sorted(compiled_runs) == sorted(runs), "a compiled step ran other programs than an eager one (a forward " \
        "recomputed in backward?)"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_new_graph_of_the_same_shape_neither_breaks_nor_recompiles(backend):
    """A compiled model called with a new graph of the same shape each step (new edge_index / edge_type /
    node_type tensors, as a mini-batch loop of fixed-size batches passes): one graph, no graph break, no
    recompilation after the first call, and each call's output and gradients are those of an eager call on its
    own graph (the graph is not reused from an earlier call)."""
    if backend == "inductor" and shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor needs a C++ compiler")
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(14, 6, requires_grad=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(net, fullgraph=True, backend=backend)
    for seed in range(4):
        ei, et, nt = make_graph(node_types=2, seed=seed)
        out = compiled(x, ei, et, nt)
        grads = torch.autograd.grad(out.pow(2).sum(), [x] + list(net.parameters()))
        ref = net(x, ei, et, nt)
        ref_grads = torch.autograd.grad(ref.pow(2).sum(), [x] + list(net.parameters()))
        assert rel_err(out, ref) < 1e-6, f"graph {seed}"
        for a, b in zip(grads, ref_grads, strict=True):
            assert rel_err(a, b) < 1e-6, f"graph {seed}"
    assert counters["stats"]["unique_graphs"] == 1, "a new graph of the same shape compiled again"
    assert not counters["recompiles"], f"recompiled: {dict(counters['recompiles'])}"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"


def test_each_call_backward_uses_its_own_forward_values():
    """A layer applied twice in one compiled step (weight sharing) with attention dropout, on the same graph: each
    call's backward uses its own dropout mask. The compiled step draws the masks in the order an eager step does,
    so with the same seed its gradients equal eager's; a backward finding the other call's forward values would
    not, nor would one recomputing the forward."""
    ei, et, nt = make_graph(node_types=2)
    torch.manual_seed(0)
    layer = hn.HGTConv(6, 6, 2, 3, heads=2, dropout=0.5)
    x = torch.randn(14, 6, requires_grad=True)

    def model(h):
        return layer(h, ei, et, nt) * 2.0 + layer(h.tanh(), ei, et, nt).sigmoid()

    def step(fn):
        torch.manual_seed(1)
        out = fn(x)
        return [out] + list(torch.autograd.grad(out.pow(2).sum(), [x] + list(layer.parameters())))

    ref = step(model)
    torch._dynamo.reset()
    got = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) < 1e-6
    assert not _ops._STASH, "a compiled training call's forward values outlived its backward"


def test_eval_mode_with_gradients_after_training_compiles():
    """A model compiled in training mode, then switched to eval mode with gradients still on (saliency, input
    gradients): the compiled graph (not specialised on the mode; inductor checks each op's output shapes against
    its fake kernel's) runs the eval program, and backward, finding no kept forward values, recomputes them:
    eager's gradients."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor needs a C++ compiler")
    torch.manual_seed(0)
    ei, et, nt = make_graph(node_types=2)
    net = Net()
    x = torch.randn(14, 6, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True, backend="inductor")
    compiled(x, ei, et, nt).sum().backward()
    net.eval()
    got = torch.autograd.grad(compiled(x, ei, et, nt).pow(2).sum(), x)[0]
    ref = torch.autograd.grad(net(x, ei, et, nt).pow(2).sum(), x)[0]
    assert rel_err(got, ref) < 1e-6
    assert not _ops._STASH


def test_copied_and_unpickled_layers_compile_as_themselves():
    """copy.deepcopy of a model (an EMA or evaluation copy) and torch.save / torch.load: the compiled op finds the
    copy, not the original, so a copy in eval mode runs without dropout while the original trains, and a copy
    outlives its original."""
    import copy
    import gc
    import io

    ei, et, _ = make_graph()
    torch.manual_seed(0)
    original = hn.RGATConv(6, 3, 3, heads=2, dropout=0.5)
    x = torch.randn(14, 6)
    copied = copy.deepcopy(original).eval()
    torch._dynamo.reset()
    compiled = torch.compile(lambda h: copied(h, ei, et), fullgraph=True, backend="aot_eager")
    assert rel_err(compiled(x), copied(x, ei, et)) < 1e-6  # the original's mode would drop half the attention

    buffer = io.BytesIO()
    torch.save(copied, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    expected = copied(x, ei, et)
    del original, compiled
    gc.collect()
    torch._dynamo.reset()
    compiled = torch.compile(lambda h: loaded(h, ei, et), fullgraph=True, backend="aot_eager")
    assert rel_err(compiled(x), expected) < 1e-6


def test_more_dropout_calls_than_the_stash_limit_before_backward(monkeypatch):
    """Compiled training calls with attention dropout that outnumber STASH_LIMIT before their backward (a deep
    model, or micro-batches summed before one backward): their masks cannot be recomputed, so they are not
    evicted; the step gives eager's gradients and keeps nothing after its backward."""
    monkeypatch.setattr(_ops, "STASH_LIMIT", 2)
    ei, et, _ = make_graph()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([hn.RGATConv(6, 3, 3, heads=2, dropout=0.3) for _ in range(4)])
    x = torch.randn(14, 6, requires_grad=True)

    def model(h):
        for layer in layers:
            h = layer(h, ei, et).tanh()
        return h

    def step(fn):
        torch.manual_seed(1)
        loss = sum(fn(x * (i + 1)).pow(2).sum() for i in range(2))  # two micro-batches, one backward
        return [loss] + list(torch.autograd.grad(loss, [x] + list(layers.parameters())))

    ref = step(model)
    torch._dynamo.reset()
    got = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) < 1e-6
    assert not _ops._STASH


def test_second_backward_with_retain_graph_reuses_the_forward_values():
    """backward(retain_graph=True) then backward again on a compiled graph with attention dropout: the second
    backward finds the same forward values (the same mask) instead of failing to recompute them, and the
    gradients accumulate to twice the first's, as eager's do."""
    ei, et, _ = make_graph()
    torch.manual_seed(0)
    layer = hn.RGATConv(6, 3, 3, heads=2, dropout=0.3)
    x = torch.randn(14, 6)
    torch._dynamo.reset()
    compiled = torch.compile(lambda h: layer(h, ei, et), fullgraph=True, backend="aot_eager")
    loss = compiled(x).pow(2).sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in layer.parameters()]
    loss.backward()
    for p, g in zip(layer.parameters(), first, strict=True):
        assert rel_err(p.grad, 2 * g) < 1e-6
    del loss
    assert not _ops._STASH
