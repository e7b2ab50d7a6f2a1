"""The CUDA backend on a GPU: generated kernels against the reference backend (forward and gradients, all three
models, fp32/TF32/bf16/fp16/fp64), torch.compile, CUDA-graph capture, thousands of relations."""

import pytest
import torch
from conftest import half_storage_reference, hub_graph, make_graph, rel_err

import hector.nn as hn
from hector import config, datasets
from hector.runtime import backend as backend_mod

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device available", allow_module_level=True)


@pytest.fixture(autouse=True)
def exact_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    config.set_tf32(None)
    yield
    config.set_backend(None)
    config.set_tf32(None)


MODELS = {
    "rgcn": lambda d, r, t: hn.RGCNConv(d, d, r),
    "rgcn-bases": lambda d, r, t: hn.RGCNConv(d, d, r, num_bases=4, optimize="none"),
    "rgat": lambda d, r, t: hn.RGATConv(d, d // 4, r, heads=4),
    "rgat-shared": lambda d, r, t: hn.RGATConv(d, d // 4, r, heads=4, attention="shared"),
    "hgt": lambda d, r, t: hn.HGTConv(d, d, t, r, heads=4),
}


def _run(layer, x, ei, et, nt, backend):
    config.set_backend(backend)
    try:
        xg = x.clone().requires_grad_()
        out = layer(xg, ei, et, nt)
        w = torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(1))
        grads = torch.autograd.grad((out.float() * w).sum(), [xg] + list(layer.parameters()), allow_unused=True)
    finally:
        config.set_backend(None)
    return out, grads


def _twin(name="aifb", scale=0.3):
    twin = datasets.load(name, scale=scale, seed=0)
    return twin, twin.edge_index.cuda(), twin.edge_type.cuda(), twin.node_type.cuda()


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype,tf32,tol", [(torch.float32, False, 1e-4), (torch.float32, True, 1e-2),
                                            (torch.bfloat16, False, 5e-2), (torch.float16, False, 1e-2)])
def test_matches_reference(model, dtype, tf32, tol):
    twin, ei, et, nt = _twin()
    torch.manual_seed(0)
    ref = MODELS[model](64, twin.num_relations, twin.num_node_types).cuda().double()
    layer = MODELS[model](64, twin.num_relations, twin.num_node_types).cuda().to(dtype)
    layer.load_state_dict(ref.state_dict())
    x = twin.features(64).cuda()
    assert backend_mod.select(x.device, dtype).name == "cuda"
    a, ga = _run(ref, x.double(), ei, et, nt, "reference")
    # In 16-bit storage the bound is the larger of `tol` and twice the error torch ops make storing every value in
    # the same dtype as the kernels do (the reference backend in that mode): per-edge gradients below fp16's normal
    # range (6e-5) round alike in both. The reference's default for 16-bit programs (float32 inside, outputs
    # rounded) leaves that rounding out and would bound the kernels by an error they cannot have.
    same = None
    if dtype in (torch.float16, torch.bfloat16):
        with half_storage_reference():
            same = _run(layer, x.to(dtype), ei, et, nt, "reference")
    config.set_tf32(tf32)
    b, gb = _run(layer, x.to(dtype), ei, et, nt, "cuda")

    def bound(i):
        if same is None:
            return tol
        t = same[0] if i is None else same[1][i]
        v = a if i is None else ga[i]
        return max(tol, 2 * rel_err(t.double(), v))

    assert b.dtype == dtype and rel_err(b.double(), a) < bound(None), (rel_err(b.double(), a), bound(None))
    for i, ((name, _), u, v) in enumerate(zip([("x", None)] + list(ref.named_parameters()), gb, ga, strict=True)):
        if v is None:
            continue
        assert rel_err(u.double(), v) < bound(i), (name, rel_err(u.double(), v), bound(i))


def test_float64_gradcheck_rgat_and_hgt():
    ei, et, nt = make_graph(node_types=2)
    ei, et, nt = ei.cuda(), et.cuda(), nt.cuda()
    for layer in (hn.RGATConv(5, 3, 3, heads=2).double().cuda(), hn.HGTConv(5, 5, 2, 3, heads=1).double().cuda()):
        x = torch.randn(14, 5, dtype=torch.float64, device="cuda", requires_grad=True)
        assert torch.autograd.gradcheck(lambda x_, m=layer: m(x_, ei, et, nt), (x,), atol=1e-7, rtol=1e-5,
                                        nondet_tol=1e-12)


def test_ten_thousand_relations():
    g = torch.Generator().manual_seed(0)
    n, e, r = 5000, 60000, 10000
    ei = torch.randint(0, n, (2, e), generator=g).cuda()
    et = (torch.rand(e, generator=g) ** 3 * r).long().cuda()  # skewed: few big relations, many tiny or empty
    for make in (lambda: hn.RGCNConv(32, 32, r), lambda: hn.RGATConv(32, 8, r, heads=4)):
        torch.manual_seed(0)
        ref, layer = make().cuda().double(), make().cuda()
        layer.load_state_dict(ref.state_dict())
        x = torch.randn(n, 32, device="cuda")
        a, ga = _run(ref, x.double(), ei, et, None, "reference")
        b, gb = _run(layer, x, ei, et, None, "cuda")
        assert rel_err(b.double(), a) < 1e-4
        assert all(rel_err(u.double(), v) < 1e-4 for u, v in zip(gb, ga, strict=True) if v is not None)


def test_cuda_graph_capture_of_a_training_step():
    twin, ei, et, nt = _twin(scale=0.1)
    layer = hn.HGTConv(64, 64, twin.num_node_types, twin.num_relations, heads=4).cuda()
    x = twin.features(64).cuda().requires_grad_()
    params = [x] + list(layer.parameters())

    def step():
        out = layer(x, ei, et, nt)
        return torch.autograd.grad(out.pow(2).sum(), params)

    eager = step()  # warm-up: graph preprocessing, compilation
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):  # fails on any host synchronisation inside the step
        captured = step()
    cuda_graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager, strict=True):
        assert rel_err(a, b) < 1e-5


def test_torch_compile_fullgraph_on_gpu():
    twin, ei, et, nt = _twin(scale=0.1)
    torch.manual_seed(0)
    model = torch.nn.ModuleList([hn.RGATConv(64, 16, twin.num_relations, heads=4),
                                 hn.RGCNConv(64, 32, twin.num_relations)]).cuda()

    def f(x):
        return model[1](model[0](x, ei, et).relu(), ei, et)

    x = twin.features(64).cuda().requires_grad_()
    ref = f(x)
    ga = torch.autograd.grad(ref.sum(), [x] + list(model.parameters()))
    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True)(x)
    gb = torch.autograd.grad(out.sum(), [x] + list(model.parameters()))
    assert rel_err(out, ref) < 1e-5
    assert all(rel_err(u, v) < 1e-5 for u, v in zip(gb, ga, strict=True))


def test_unsupported_dtype_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setattr(backend_mod, "_warned", set())
    with pytest.warns(RuntimeWarning, match="float8"):
        assert backend_mod.select(torch.device("cuda"), torch.float8_e4m3fn) is backend_mod.REFERENCE


def _edge_case_graph(case):
    """Small graphs at the edges of the input space: one edge, no edges, most relations empty."""
    g = torch.Generator().manual_seed(0)
    n, r = 9, 6
    if case == "single-edge":
        ei, et = torch.tensor([[2], [5]]), torch.tensor([4])
    elif case == "no-edges":
        ei, et = torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    else:  # empty-relations: every edge in relation 1 or 5, relations 0, 2, 3, 4 empty; node 8 isolated
        ei = torch.randint(0, n - 1, (2, 40), generator=g)
        et = torch.where(torch.rand(40, generator=g) < 0.5, 1, 5)
    nt = torch.randint(0, 2, (n,), generator=g)
    return n, r, ei.cuda(), et.cuda(), nt.cuda()


@pytest.mark.parametrize("case", ["single-edge", "no-edges", "empty-relations"])
@pytest.mark.parametrize("model", list(MODELS))
def test_edge_case_graphs(model, case):
    n, r, ei, et, nt = _edge_case_graph(case)
    torch.manual_seed(0)
    ref = MODELS[model](16, r, 2).cuda().double()
    layer = MODELS[model](16, r, 2).cuda()
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(n, 16, device="cuda")
    a, ga = _run(ref, x.double(), ei, et, nt, "reference")
    b, gb = _run(layer, x, ei, et, nt, "cuda")
    assert torch.isfinite(b).all() and rel_err(b.double(), a) < 1e-4, rel_err(b.double(), a)
    for u, v in zip(gb, ga, strict=True):
        if v is not None:
            assert torch.isfinite(u).all() and rel_err(u.double(), v) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model", ["rgcn", "rgat", "rgat-shared", "hgt"])
def test_autocast_on_gpu_runs_generated_kernels(model, dtype):
    """torch.autocast on CUDA: float32 layer and input, the generated kernels run in the autocast dtype (no
    fallback to the reference backend), output in that dtype, within 5e-2 of the float64 layer."""
    import warnings

    twin, ei, et, nt = _twin()
    torch.manual_seed(0)
    layer = MODELS[model](64, twin.num_relations, twin.num_node_types).cuda()
    ref = MODELS[model](64, twin.num_relations, twin.num_node_types).cuda().double()
    ref.load_state_dict(layer.state_dict())
    x = twin.features(64).cuda()
    a, ga = _run(ref, x.double(), ei, et, nt, "reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.set_backend("cuda")
        try:
            xg = x.clone().requires_grad_()
            with torch.autocast("cuda", dtype=dtype):
                out = layer(xg, ei, et, nt)
            w = torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(1))
            gb = torch.autograd.grad((out.float() * w).sum(), [xg] + list(layer.parameters()), allow_unused=True)
        finally:
            config.set_backend(None)
    assert not [w for w in caught if "falling back" in str(w.message)], "the CUDA backend did not run"
    assert out.dtype == dtype
    assert rel_err(out.double(), a) < 5e-2
    for u, v in zip(gb, ga, strict=True):
        if v is not None:
            assert u.dtype == torch.float32 and rel_err(u.double(), v) < 5e-2


@pytest.mark.parametrize("model", ["rgcn", "rgat", "hgt"])
def test_new_edge_index_step_has_no_host_synchronisation(model):
    """A training step on a new ``Graph(..., sync_free=True)``: validation (device-side
    assertions), the unique (source, relation) pairs, the destination order, tile schedules and the cost model's
    statistics never wait for the GPU. Its result equals the step on a prepared copy of the same graph (UNIQUE
    rows padded to the edge count there, sized exactly here)."""
    import hector

    twin, ei, et, nt = _twin(scale=0.1)
    torch.manual_seed(0)
    layer = MODELS[model](64, twin.num_relations, twin.num_node_types).cuda()
    x = twin.features(64).cuda().requires_grad_()
    typed = (nt, twin.num_node_types) if model == "hgt" else (None, None)
    def graph():
        return hector.Graph(ei.clone(), et.clone(), twin.num_nodes, twin.num_relations, *typed, sync_free=True)

    for _ in range(2):  # compile the modules; the pair ratio of this size class reaches the host
        layer(x, graph()).sum().backward()
        torch.cuda.synchronize()
    params = [x] + list(layer.parameters())
    fresh = graph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x, fresh)
        grads = torch.autograd.grad(out.sum(), params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    prepared = hector.prepare_graph(ei.clone(), et.clone(), twin.num_nodes, twin.num_relations, *typed)
    assert layer.options_for(prepared) == layer.options_for(fresh), \
        "the estimated pair count picks what the exact count picks"
    out_p = layer(x, prepared)
    grads_p = torch.autograd.grad(out_p.sum(), params)
    assert rel_err(out.double(), out_p.double()) < 1e-5
    for g, gp in zip(grads, grads_p, strict=True):
        assert rel_err(g.double(), gp.double()) < 1e-5


@pytest.mark.parametrize("model", ["rgcn", "rgat", "hgt"])
def test_prepared_graph_step_has_no_host_synchronisation(model):
    """After hector.prepare_graph (validation and the unique-pair count read the device), a training step on a new
    graph (its device layout, tile schedules and degree constants built on first use) never waits for the GPU."""
    import hector

    twin, ei, et, nt = _twin(scale=0.1)
    torch.manual_seed(0)
    layer = MODELS[model](64, twin.num_relations, twin.num_node_types).cuda()
    x = twin.features(64).cuda().requires_grad_()
    layer(x, ei, et, nt).sum().backward()  # compile the modules, pick the options for this size class
    ei2, et2 = ei.clone(), et.clone()  # a new graph, same size class
    typed = (nt, twin.num_node_types) if model == "hgt" else (None, None)
    hector.prepare_graph(ei2, et2, twin.num_nodes, twin.num_relations, *typed)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x, ei2, et2, typed[0])
        grads = torch.autograd.grad(out.sum(), [x] + list(layer.parameters()))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("model", ["rgcn", "rgat", "hgt"])
@pytest.mark.parametrize("mode,dtype,tol", [("on", torch.float32, 1e-4), ("off", torch.float32, 1e-4),
                                            ("on", torch.bfloat16, 5e-2)],
                         ids=["centric-fp32", "atomic-fp32", "centric-bf16"])
def test_sorted_scatter_matches_reference(model, mode, dtype, tol):
    """Sums by source and pair as target-centric walks over sorted layouts (``on``) or with atomics (``off``):
    forward and every gradient against the float64 reference, on a skewed twin; and a step on a new prepared
    graph (its sorted layouts built on first use) never waits for the GPU."""
    import hector

    twin, ei, et, nt = _twin(scale=0.05)
    torch.manual_seed(0)
    make = MODELS[model]
    ref = make(64, twin.num_relations, twin.num_node_types).cuda().double()
    layer = make(64, twin.num_relations, twin.num_node_types).cuda().to(dtype)
    layer.load_state_dict(ref.state_dict())
    typed = (nt, twin.num_node_types) if model == "hgt" else (None, None)
    x = twin.features(64).cuda()
    config.set_sorted_scatter(mode)
    try:
        assert layer.options_for(hector.Graph(ei, et, twin.num_nodes, twin.num_relations, *typed)).sorted_scatter \
            == (mode == "on")
        a, ga = _run(ref, x.double(), ei, et, nt, "reference")
        same = None
        if dtype is torch.bfloat16:
            with half_storage_reference():
                same = _run(layer, x.to(dtype), ei, et, nt, "reference")
        b, gb = _run(layer, x.to(dtype), ei, et, nt, "cuda")
        for i, (u, v) in enumerate(zip((b,) + tuple(gb), (a,) + tuple(ga), strict=True)):
            if v is None:
                continue
            bound = tol if same is None else max(tol, 2 * rel_err(((same[0],) + tuple(same[1]))[i].double(), v))
            assert rel_err(u.double(), v) < bound, (i, rel_err(u.double(), v), bound)
        ei2, et2 = ei.clone(), et.clone()
        hector.prepare_graph(ei2, et2, twin.num_nodes, twin.num_relations, *typed)
        xg = x.to(dtype).requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = layer(xg, ei2, et2, typed[0])
            grads = torch.autograd.grad(out.float().sum(), [xg] + list(layer.parameters()), allow_unused=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(torch.isfinite(g).all() for g in grads if g is not None)
    finally:
        config.set_sorted_scatter(None)


@pytest.mark.parametrize("model", ["rgat-shared", "hgt"])
def test_torch_compile_inductor_step_does_what_an_eager_step_does(model, monkeypatch):
    """A training step under torch.compile (inductor) on the GPU: after the first steps it never waits for the GPU
    (sync debug mode "error"), runs the backend's forward and backward programs exactly as an eager step does (no
    forward recomputed in backward, no graph prepared again), and gives eager's output and gradients."""
    from hector.nn import _ops
    from hector.runtime import compiled as compiled_mod

    twin, ei, et, nt = _twin(scale=0.05)
    torch.manual_seed(0)
    layer = MODELS[model](64, twin.num_relations, twin.num_node_types).cuda()
    x = twin.features(64).cuda().requires_grad_()
    params = list(layer.parameters())
    runs: list[str] = []
    real_select = compiled_mod.select

    def counting_select(device, dtype):
        backend = real_select(device, dtype)

        class Counting:
            name = backend.name

            def run(self, lowered, graph, leaves, keep=None, **kwargs):
                runs.append(lowered.program.name)
                return backend.run(lowered, graph, leaves, keep, **kwargs)

        return Counting()

    monkeypatch.setattr(compiled_mod, "select", counting_select)
    monkeypatch.setattr(_ops, "select", counting_select)

    def step(fn):
        out = fn(x)
        return [out] + list(torch.autograd.grad(out.pow(2).sum(), [x] + params))

    eager = step(lambda h: layer(h, ei, et, nt))
    runs.clear()
    step(lambda h: layer(h, ei, et, nt))
    eager_runs = sorted(runs)
    torch._dynamo.reset()
    compiled = torch.compile(lambda h: layer(h, ei, et, nt), fullgraph=True, backend="inductor")
    for _ in range(2):
        step(compiled)
    torch.cuda.synchronize()
    runs.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step(compiled)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch._dynamo.reset()
    assert sorted(runs) == eager_runs, "a compiled step ran other programs than an eager one"
    for a, b in zip(got, eager, strict=True):
        assert rel_err(a, b) < 1e-4


@pytest.mark.xfail(strict=True, reason="CUDA-graph replay of hector layers is not supported yet: the forward values "
                   "kept for backward are not outputs of the compiled graph (cudagraph trees require every live tensor "
                   "of their pool to be one), and the edge tensors copied into static buffers make a new graph "
                   "prepared during capture (a host-to-device copy from pageable memory, seen on an H100)")
@pytest.mark.parametrize("model", ["rgcn", "hgt"])
def test_torch_compile_cudagraphs_training_step(model):
    """A compiled training step replayed as CUDA graphs (dynamo's ``cudagraphs`` backend: the cudagraph trees of
    ``mode="reduce-overhead"`` without inductor's compile time; hector's kernels are captured with torch's, no
    host synchronisation): the replayed steps' output and gradients equal eager's."""
    twin, ei, et, nt = _twin(scale=0.05)
    torch.manual_seed(0)
    layer = MODELS[model](64, twin.num_relations, twin.num_node_types).cuda()
    x = twin.features(64).cuda()
    params = list(layer.parameters())

    def step(fn):
        xg = x.clone().requires_grad_()
        out = fn(xg)
        grads = torch.autograd.grad(out.pow(2).sum(), [xg] + params)
        return [out.detach().clone()] + [g.detach().clone() for g in grads]

    eager = step(lambda h: layer(h, ei, et, nt))
    torch._dynamo.reset()
    graphed = torch.compile(lambda h: layer(h, ei, et, nt), fullgraph=True, backend="cudagraphs")
    for _ in range(4):  # warm-up, recording, replays
        got = step(graphed)
    torch._dynamo.reset()
    for a, b in zip(got, eager, strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("model", ["rgcn", "rgat", "hgt"])
def test_graphs_prepared_with_layers_in_a_loader_thread(model):
    """A loader thread on a CUDA stream of its own prepares each batch's graph with its layer
    (``prepare_graph(..., layers=...)``: layout, constants, launch plans) while the training thread runs steps on
    the graphs made before: each step builds no launch plan, and its output and gradients equal those of the same
    layer on an unprepared graph; destination-sorted batches (the sampler's order) skip the sort and give the
    results of the same edges sorted again (up to the order of atomic adds). A step on a prepared graph never waits
    for the GPU (checked after the thread, as the sync debug mode is process-wide and preparing does wait)."""
    import queue
    import threading

    import hector
    from hector.runtime.cuda import device_graph

    twin, ei, et, nt = _twin(scale=0.05)
    torch.manual_seed(0)
    layer = MODELS[model](64, twin.num_relations, twin.num_node_types).cuda()
    x = twin.features(64).cuda()
    typed = (nt, twin.num_node_types) if model == "hgt" else (None, None)
    order = torch.sort(ei[1], stable=True).indices
    sorted_batch = (ei[:, order].contiguous(), et[order].contiguous())
    layer(x, ei, et, nt).sum().backward()  # compile the modules, pick the options for this size class

    def step(graph):
        xg = x.clone().requires_grad_()
        out = layer(xg, graph)
        return [out] + list(torch.autograd.grad(out.sum(), [xg] + list(layer.parameters())))

    def plans(graph):
        return len(device_graph(graph).calls)

    expected = step(hector.Graph(ei, et, twin.num_nodes, twin.num_relations, *typed))
    expected_sorted = step(hector.Graph(*sorted_batch, twin.num_nodes, twin.num_relations, *typed,
                                        sorted_by_destination=False))
    ready: queue.Queue = queue.Queue(maxsize=2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    failures = []

    def loader():
        try:
            with torch.cuda.stream(side):
                for i in range(6):
                    batch = tuple(t.clone() for t in (sorted_batch if i % 2 else (ei, et)))
                    graph = hector.prepare_graph(*batch, twin.num_nodes, twin.num_relations, *typed, layers=layer)
                    done = torch.cuda.Event()
                    done.record(side)
                    ready.put((i % 2 == 1, graph, done))
        except Exception as e:  # handed to the training thread, which fails the test with it
            failures.append(e)
        ready.put(None)

    thread = threading.Thread(target=loader, daemon=True)  # a failed step leaves it blocked, not the process
    thread.start()
    steps = 0
    while (item := ready.get()) is not None:
        is_sorted, graph, done = item
        torch.cuda.current_stream().wait_event(done)
        graph.record_stream(torch.cuda.current_stream())
        assert graph.dst_sorted == is_sorted and (device_graph(graph).order is None) == is_sorted
        count = plans(graph)
        got = step(graph)
        assert plans(graph) == count, "the step built a launch plan of its own"
        for a, b in zip(got, expected_sorted if is_sorted else expected, strict=True):
            assert rel_err(a.double(), b.double()) < 1e-5
        steps += 1
    thread.join()
    assert not failures and steps == 6
    graph = hector.prepare_graph(*(t.clone() for t in sorted_batch), twin.num_nodes, twin.num_relations, *typed,
                                 layers=layer)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step(graph)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(g).all() for g in got)


def test_new_graph_waits_for_the_gpu_once():
    """Preparing a new mini-batch graph on the GPU (``prepare_graph`` with the layers of a two-layer model) waits
    for the device once: the ids' check, the destinations' order and the unique-pair count come in one transfer;
    the layout and the launch plans wait for nothing, and the step on the graph gives the reference's output for
    graph after graph with other relations present."""
    import warnings

    import hector

    torch.manual_seed(0)
    make = [lambda: hn.RGATConv(32, 8, 500, heads=4, attention="shared") for _ in range(2)]
    model = torch.nn.ModuleList([m() for m in make]).cuda()
    ref = torch.nn.ModuleList([m() for m in make]).double()
    ref.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        n, e = 3000 + 500 * step, 12000 - 1000 * step
        ei = torch.randint(0, n, (2, e), generator=g)
        et = (torch.rand(e, generator=g) ** (1 + step) * 500).long()
        x = torch.randn(n, 32, generator=g)
        eic, etc, xc = ei.cuda(), et.cuda(), x.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                graph = hector.prepare_graph(eic, etc, n, 500, layers=model)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
        # the one read; torch.unique, which the pair count came from before, waited a second time
        assert len(syncs) == 1, [str(w.message) for w in caught]
        out = model[1](torch.relu(model[0](xc, graph)), graph)
        with torch.no_grad():
            expect = ref[1](torch.relu(ref[0](x.double(), ei, et)), ei, et)
        assert rel_err(out.double().cpu(), expect) < 1e-4, step


def _hub_graph():
    """5,000 nodes: one destination with 3,000 in-edges, 60 with 150-600, the rest 0-19 (the heaviest-first order
    then has chunks all heavy, one heavy in part, then light ones); relations 1, 3, 5, 7 empty."""
    ei, et, nt, n = hub_graph(5000, 20, 60, (150, 600), 4321, 3000, 4, seed=9)
    return ei.cuda(), et.cuda(), nt.cuda(), n


@pytest.mark.parametrize("model", ["rgcn", "rgat", "hgt"])
@pytest.mark.parametrize("degree,dtype,tol", [(0, torch.float32, 1e-4), (16, torch.float32, 1e-4),
                                              (128, torch.float32, 1e-4), (128, torch.bfloat16, 5e-2)],
                         ids=["deg0-fp32", "deg16-fp32", "deg128-fp32", "deg128-bf16"])
def test_split_heavy_destinations_match_reference(model, degree, dtype, tol):
    """Destination walks that split their heavy destinations over a block (``HECTOR_SPLIT_DEGREE``; 0: never):
    forward and every gradient against the float64 reference on a graph with hub destinations."""
    ei, et, nt, n = _hub_graph()
    torch.manual_seed(0)
    ref = MODELS[model](64, 8, 3).cuda().double()
    layer = MODELS[model](64, 8, 3).cuda().to(dtype)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(n, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    a, ga = _run(ref, x.double(), ei, et, nt, "reference")
    same = None
    if dtype is torch.bfloat16:
        with half_storage_reference():
            same = _run(layer, x.to(dtype), ei, et, nt, "reference")
    config.set_split_degree(degree)
    try:
        b, gb = _run(layer, x.to(dtype), ei, et, nt, "cuda")
    finally:
        config.set_split_degree(None)
    for i, (u, v) in enumerate(zip((b,) + tuple(gb), (a,) + tuple(ga), strict=True)):
        if v is None:
            continue
        bound = tol if same is None else max(tol, 2 * rel_err(((same[0],) + tuple(same[1]))[i].double(), v))
        assert rel_err(u.double(), v) < bound, (i, rel_err(u.double(), v), bound)


@pytest.mark.parametrize("model", ["rgcn", "rgat", "hgt"])
def test_launch_batches_match_kernel_by_kernel_on_two_graphs(model, monkeypatch):
    """Calls run as launch batches packed once per graph (shared-cuda launch lists, buffer addresses patched per
    call) give what the kernel-by-kernel path gives, on two graphs of different sizes used in turn with weights
    changed between steps; both match the float64 reference."""
    import hector
    from hector.runtime.cuda import device_graph

    graphs = []
    for seed, (n, e) in enumerate(((300, 2_000), (520, 4_100))):
        ei, et, nt = (t.cuda() for t in make_graph(num_nodes=n, num_edges=e, num_relations=5, node_types=3,
                                                   seed=30 + seed))
        graphs.append((n, hector.prepare_graph(ei, et, n, 5, nt, 3), nt))
    torch.manual_seed(0)
    ref = MODELS[model](32, 5, 3).cuda().double()
    layer = MODELS[model](32, 5, 3).cuda()
    for step in range(4):
        n, graph, nt = graphs[step % 2]
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(-1.1).add_(0.05)
        layer.load_state_dict(ref.state_dict())
        x = torch.randn(n, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        a, ga = _run(ref, x.double(), graph, None, nt, "reference")
        results = []
        for batches in (True, False):
            monkeypatch.setattr(config.settings, "launch_batches", batches)
            out, grads = _run(layer, x, graph, None, nt, "cuda")
            records = [r for r in device_graph(graph).calls.values() if (r.batched is not None) == batches]
            assert len(records) >= 2, (batches, step)
            assert rel_err(out.double(), a) < 1e-4, (batches, step)
            for u, v in zip(grads, ga, strict=True):
                assert (u is None) == (v is None)
                if v is not None:
                    assert rel_err(u.double(), v) < 1e-4, (batches, step)
            results.append(out)
        assert rel_err(results[0].double(), results[1].double()) < 1e-5, step


@pytest.mark.parametrize("model", ["rgcn", "rgat", "hgt"])
def test_new_edge_index_each_step_matches_persistent_and_frees_earlier_graphs(model):
    """A mini-batch loop on the GPU: new ``edge_index`` / ``edge_type`` tensors each step (copies of one graph, the
    earlier ones dropped). Each step gives the persistent graph's output and gradients (within 1e-4: the same
    layout and kernels, atomics may add in another order) and the float64 reference's; the GPU memory held after
    the steps does not grow with their number (the graphs of dropped tensors and their device layouts are freed,
    not kept for the next fifteen steps: the caching allocator hands each step the memory of the one before)."""
    twin, ei, et, nt = _twin("aifb", 0.3)
    torch.manual_seed(0)
    layer = MODELS[model](32, twin.num_relations, twin.num_node_types).cuda()
    ref = MODELS[model](32, twin.num_relations, twin.num_node_types).double()
    ref.load_state_dict({k: v.double().cpu() for k, v in layer.state_dict().items()})
    x = torch.randn(twin.num_nodes, 32, device="cuda")
    persistent = _run(layer, x, ei, et, nt, "cuda")
    expect = ref(x.double().cpu(), ei.cpu(), et.cpu(), nt.cpu())
    assert rel_err(persistent[0].double().cpu(), expect) < 1e-4
    held = []
    for _ in range(8):
        got = _run(layer, x, ei.clone(), et.clone(), nt.clone(), "cuda")
        for u, v in zip((got[0], *got[1]), (persistent[0], *persistent[1]), strict=True):
            assert (u is None) == (v is None)
            if v is not None:
                assert rel_err(u.double(), v.double()) < 1e-4
        del got
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    # one graph's layout may still be held (the last step's, until the next lookup); sixteen were before
    assert held[-1] <= held[1] + (1 << 20), held


def test_executor_stream_is_the_current_stream():
    """The executor's stream handle (torch's raw getter) is the current stream's, on the default stream, inside a
    side stream's context and on another current device."""
    from hector.runtime.cuda import JitExecutor

    executor = JitExecutor()
    assert executor.stream() == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert executor.stream() == side.cuda_stream == torch.cuda.current_stream().cuda_stream
    assert executor.stream() == torch.cuda.current_stream().cuda_stream
    if torch.cuda.device_count() > 1:
        with torch.cuda.device(1):
            assert executor.stream() == torch.cuda.current_stream().cuda_stream
