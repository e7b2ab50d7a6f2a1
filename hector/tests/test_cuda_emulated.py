"""The CUDA backend end to end on the CPU: generated kernels compiled as C++ with the emulator shim (every CUDA
thread a fiber; barriers, warp shuffles, shared memory and atomics as on a GPU), checked against the reference
backend: forward and gradients of every model, random programs, awkward graphs, dtypes."""

import contextlib

import pytest
import torch
from conftest import half_storage_reference, hub_graph, make_graph, rel_err
from emulation import EmulatedExecutor, compiler
from test_random_programs import F, R, T, bind, random_program

import hector
import hector.nn as hn
from hector.ir.core import Domain
from hector.passes import Options
from hector.runtime import backend as backend_mod
from hector.runtime import compiled as compiled_mod
from hector.runtime.compiled import apply, compile_program
from hector.runtime.cuda import CudaBackend, device_graph
from hector.runtime.graph import Graph, graph_for
from hector.runtime.reference import interpret

if compiler() is None:
    pytest.skip("no C++ compiler for the kernel emulator", allow_module_level=True)

EMULATED = CudaBackend(EmulatedExecutor())
_SELECT = compiled_mod.select  # the backend a CPU tensor really gets: the reference


@pytest.fixture
def emulated(monkeypatch):
    """Route every layer call through the CUDA backend on the emulator (see :func:`_on_reference` for the
    reference side of a comparison)."""
    monkeypatch.setattr(compiled_mod, "select", lambda device, dtype: EMULATED)
    return EMULATED


@contextlib.contextmanager
def _on_reference():
    """The reference backend for the calls and backward passes inside, under the ``emulated`` fixture: it routes
    float64 calls through the emulated kernels too, and a reference computed by the kernels under test would
    share their bugs (a weight gradient left at zero passed every layer comparison that way)."""
    emulated = compiled_mod.select
    compiled_mod.select = _SELECT
    try:
        yield
    finally:
        compiled_mod.select = emulated


def _grads(out, inputs, weight=None):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs, allow_unused=True)


def _reference_and_layer(name: str, ei, et, nt):
    """LAYERS[name] twice from one seed, float64 (the reference) and float32 with its weights; the node types when
    the layer is typed by them; a 17-node input x, its float64 copy xa, the reference's output a on it and the
    gradients ga of a weighted sum of a with respect to xa and the reference's parameters."""
    torch.manual_seed(0)
    ref = LAYERS[name]().double()
    layer = LAYERS[name]().float()
    layer.load_state_dict(ref.state_dict())
    typed = (nt, 2) if layer.num_node_types else (None, None)
    x = torch.randn(17, ref.in_channels, dtype=torch.float64)
    xa = x.clone().requires_grad_()
    with _on_reference():
        a = ref(xa, ei, et, typed[0])
        ga = _grads(a, [xa] + list(ref.parameters()))
    return ref, layer, typed, x, xa, a, ga


LAYERS = {
    "rgcn": lambda: hn.RGCNConv(6, 5, 3, num_bases=2),
    "rgcn-uncompacted": lambda: hn.RGCNConv(6, 5, 3, optimize="none"),
    "rgcn-compacted": lambda: hn.RGCNConv(6, 5, 3, optimize="all"),
    "rgat": lambda: hn.RGATConv(6, 3, 3, heads=2),
    "rgat-unoptimised": lambda: hn.RGATConv(6, 3, 3, heads=2, optimize="none"),
    "rgat-shared": lambda: hn.RGATConv(6, 3, 3, heads=2, attention="shared", concat=False, root_weight=True),
    "hgt": lambda: hn.HGTConv(6, 6, 2, 3, heads=2),
    "hgt-in-ne-out": lambda: hn.HGTConv(5, 6, 2, 3, heads=3, optimize="all"),
    "rgat-unfused": lambda: hn.RGATConv(6, 3, 3, heads=2, optimize=Options(fuse=False)),
    "hgt-unfused": lambda: hn.HGTConv(6, 6, 2, 3, heads=2, optimize=Options(fuse=False)),
    # both ways of summing by source and pair, whatever the cost model picks for the layers above
    "rgcn-atomic": lambda: hn.RGCNConv(6, 5, 3, optimize=Options(compact=True, reorder=False)),
    "rgcn-sorted": lambda: hn.RGCNConv(6, 5, 3, num_bases=2, optimize=Options(sorted_scatter=True)),
    "rgcn-uncompacted-sorted": lambda: hn.RGCNConv(6, 5, 3, optimize=Options(compact=False, sorted_scatter=True)),
    "rgat-atomic": lambda: hn.RGATConv(6, 3, 3, heads=2, optimize=Options()),
    "rgat-sorted": lambda: hn.RGATConv(6, 3, 3, heads=2, optimize=Options(sorted_scatter=True)),
    "rgat-shared-sorted": lambda: hn.RGATConv(6, 3, 3, heads=2, attention="shared", concat=False, root_weight=True,
                                              optimize=Options(sorted_scatter=True)),
    "hgt-atomic": lambda: hn.HGTConv(6, 6, 2, 3, heads=2, optimize=Options(compact=True, reorder=False)),
    "hgt-sorted": lambda: hn.HGTConv(6, 6, 2, 3, heads=2, optimize=Options(sorted_scatter=True)),
    "hgt-in-ne-out-sorted": lambda: hn.HGTConv(5, 6, 2, 3, heads=3, optimize=Options(sorted_scatter=True)),
}


def _compare(make, ei, et, nt, n, dtype, tol):
    torch.manual_seed(0)
    ref = make().double()
    layer = make().to(dtype)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(n, ref.in_channels, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.to(dtype).requires_grad_()
    with _on_reference():
        a = ref(xa, ei, et, nt)
        ga = _grads(a, [xa] + list(ref.parameters()))
    b = layer(xb, ei, et, nt)
    assert b.dtype == dtype and rel_err(b.double(), a) < tol
    gb = _grads(b, [xb] + list(layer.parameters()))
    for (name, _), u, v in zip([("x", None)] + list(ref.named_parameters()), gb, ga, strict=True):
        if v is None:  # unused parameter (e.g. HGT's skip gate when in != out)
            assert u is None, name
            continue
        assert u is not None and u.dtype == dtype, name
        assert rel_err(u.double(), v) < tol, (name, rel_err(u.double(), v))


@pytest.mark.parametrize("name", list(LAYERS))
def test_layers_match_reference(emulated, name):
    ei, et, nt = make_graph(num_nodes=17, num_edges=90, node_types=2, seed=3)
    _compare(LAYERS[name], ei, et, nt, 17, torch.float32, 1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_dtypes(emulated, dtype, tol):
    ei, et, nt = make_graph(num_nodes=15, num_edges=70, node_types=2, seed=4)
    for name in ("rgat", "hgt"):
        _compare(LAYERS[name], ei, et, nt, 15, dtype, tol)


def test_wide_features_skewed_degrees(emulated):
    """Odd widths above a warp, one destination with most in-edges, empty relations."""
    g = torch.Generator().manual_seed(5)
    n, e = 40, 400
    src = torch.randint(0, n, (e,), generator=g)
    dst = torch.where(torch.rand(e, generator=g) < 0.6, torch.tensor(7), torch.randint(0, n, (e,), generator=g))
    et = torch.randint(0, 3, (e,), generator=g) * 2  # relations 1, 3, 5 stay empty
    ei = torch.stack([src, dst])
    nt = torch.randint(0, 3, (n,), generator=g)
    _compare(lambda: hn.RGATConv(37, 19, 6, heads=3), ei, et, nt, n, torch.float32, 1e-5)
    _compare(lambda: hn.HGTConv(70, 70, 3, 6, heads=2), ei, et, nt, n, torch.float32, 1e-5)


def _hub_graph():
    """300 nodes: one destination with 400 in-edges, 40 with 10-60, the rest 0-5; relations 1, 3, 5 empty."""
    return hub_graph(300, 6, 40, (10, 60), 123, 400, 3, seed=8)


SPLIT_LAYERS = {
    "rgat": lambda: hn.RGATConv(16, 8, 6, heads=3),  # 24-wide rows: groups of 32, eight to a block
    "rgat-narrow": lambda: hn.RGATConv(8, 2, 6, heads=2),  # 4-wide rows: groups of 4, 64 to a block
    "rgat-sorted": lambda: hn.RGATConv(16, 8, 6, heads=3, optimize=Options(sorted_scatter=True)),
    "hgt": lambda: hn.HGTConv(16, 16, 3, 6, heads=2),
    "rgcn": lambda: hn.RGCNConv(16, 16, 6),
}


@pytest.mark.parametrize("name", list(SPLIT_LAYERS))
# bf16: the bound; a 400-edge hub's bf16 rows alone give 3.5e-2 on q's gradient, split or not
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_split_heavy_destinations(monkeypatch, name, dtype, tol):
    """Destinations with more in-edges than the split degree are walked by a whole block (partial sums and softmax
    statistics combined in shared memory): hubs, chunks of the heaviest-first order that are all heavy, one that
    turns light half way, grid-stride rounds after the heavy ones (one emulated multiprocessor: fewer blocks than
    chunks), empty relations, several heads; forward and gradients match the float64 reference."""
    from hector import config

    backend = CudaBackend(EmulatedExecutor(multiprocessors=1))
    monkeypatch.setattr(compiled_mod, "select", lambda device, dtype: backend)
    config.set_split_degree(8)
    try:
        ei, et, nt, n = _hub_graph()
        _compare(SPLIT_LAYERS[name], ei, et, nt, n, dtype, tol)
        split = [k.name for _, plan in backend._plans.values() for k in plan.module.kernels
                 if not k.torch_op and "split_buf" in plan.module.source.split(f" {k.name}(")[1].split("extern")[0]]
        assert split, "a destination walk split its heavy destinations"
        assert set(split) & set(backend.executor.launches)
    finally:
        config.set_split_degree(None)


def test_split_degree_zero_keeps_one_group_per_destination():
    """The split degree is a codegen option: 0 emits no split walk."""
    from hector.codegen import CodegenOptions, layer_modules

    ei, et, nt, n = _hub_graph()
    compiled = SPLIT_LAYERS["rgat"]().train().compiled(Graph(ei, et, n, 6))
    for degree, expect in ((0, False), (8, True)):
        mods = layer_modules(compiled, "f32", CodegenOptions(split_degree=degree))
        assert any("split_buf" in m.source for m in mods.values()) is expect, degree
    # 300-wide sums: the float32 partial states fit in shared memory beside the scratch, float64 ones do not (that
    # kernel keeps one group per destination, and says nothing of splitting)
    wide = hn.RGCNConv(8, 300, 6).train().compiled(Graph(ei, et, n, 6))
    for dtype, expect in (("f32", True), ("f64", False)):
        forward = layer_modules(wide, dtype, CodegenOptions(split_degree=8))["forward"]
        walks = [forward.source.split(f" {k.name}(")[1].split("extern")[0] for k in forward.kernels
                 if k.spec.kind == "traversal" and k.spec.space == "edge"]
        assert walks and all(("split_buf" in w and "e += parts" in w) is expect for w in walks), dtype


@pytest.mark.parametrize("case", ["single-edge", "no-edges", "self-loops", "isolated"])
def test_awkward_graphs(emulated, case):
    n = 6
    if case == "single-edge":
        ei, et = torch.tensor([[2], [4]]), torch.tensor([1])
    elif case == "no-edges":
        ei, et = torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    elif case == "self-loops":
        ei, et = torch.tensor([[1, 1, 3, 3], [1, 1, 3, 3]]), torch.tensor([0, 2, 0, 0])
    else:
        ei, et = torch.tensor([[0, 1, 2], [1, 2, 0]]), torch.tensor([0, 1, 2])
    nt = torch.tensor([0, 1, 0, 1, 0, 1])
    for name in ("rgcn", "rgat", "hgt"):
        _compare(LAYERS[name], ei, et, nt, n, torch.float32, 1e-5)


def test_many_relations(emulated):
    """600 relations, most with one or two edges (the GPU test goes to 10,000)."""
    g = torch.Generator().manual_seed(6)
    n, e, r = 200, 900, 600
    ei = torch.randint(0, n, (2, e), generator=g)
    et = torch.randint(0, r, (e,), generator=g)
    _compare(lambda: hn.RGCNConv(4, 4, r), ei, et, None, n, torch.float32, 1e-5)
    _compare(lambda: hn.RGATConv(4, 2, r, heads=2), ei, et, None, n, torch.float32, 1e-5)
    # the gradients of weights shared by all relations (PyG's attention, the bases) sum over the relations: those
    # weight-only einsums run as torch.einsum, not as a generated loop of r x features terms per thread
    for make in (lambda: hn.RGATConv(4, 2, r, heads=2, attention="shared"), lambda: hn.RGCNConv(4, 4, r, num_bases=3)):
        _compare(make, ei, et, None, n, torch.float32, 1e-5)
        _compare(make, ei, et, None, n, torch.float16, 5e-3)


def test_half_precision_error_is_that_of_half_storage():
    """In fp16 the generated kernels round every value they store: their gradient error is about that of torch
    ops storing values in fp16 (the bound the GPU test uses, at most twice it), and well above that of the
    reference's default float32-inside mode, which cannot serve as their bound."""
    from hector import datasets

    twin = datasets.load("aifb", scale=0.3, seed=0)
    ei, et, nt = twin.edge_index, twin.edge_type, twin.node_type
    torch.manual_seed(0)
    ref = hn.RGATConv(64, 16, twin.num_relations, heads=4).double()
    layer = hn.RGATConv(64, 16, twin.num_relations, heads=4).half()
    layer.load_state_dict(ref.state_dict())
    x = twin.features(64)

    def grads(module, dtype):
        xg = x.to(dtype).requires_grad_()
        out = module(xg, ei, et, nt)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        return torch.autograd.grad((out.double() * w).sum(), [xg] + list(module.parameters()))

    exact = grads(ref, torch.float64)
    wide = grads(layer, torch.float16)
    with half_storage_reference():
        stored = grads(layer, torch.float16)
    compiled_mod.select, select = (lambda device, dtype: EMULATED), compiled_mod.select
    try:
        kernels = grads(layer, torch.float16)
    finally:
        compiled_mod.select = select
    for name, e, w, s_, k in zip(["x"] + [n for n, _ in ref.named_parameters()], exact, wide, stored, kernels,
                                 strict=True):
        err = rel_err(k.double(), e)
        assert err < max(1e-2, 2 * rel_err(s_.double(), e)), (name, err, rel_err(s_.double(), e))
        if name in ("q", "k", "weight"):
            assert err > 2 * rel_err(w.double(), e), (name, err, rel_err(w.double(), e))


def test_long_weight_reductions_run_as_torch_einsum():
    """A weight-only einsum whose outputs each sum more than SERIAL_TERMS terms has no generated kernel (one thread
    per output would walk them serially: milliseconds at thousands of relations), short ones keep theirs."""
    from hector.codegen import layer_modules
    from hector.codegen.param import SERIAL_TERMS

    def param_kernels(relations):
        layer = hn.RGATConv(16, 4, relations, heads=4, attention="shared", optimize="all")
        ei, et, _ = make_graph(num_nodes=30, num_edges=200, node_types=1, seed=7)
        compiled = layer.compiled(Graph(ei, et % relations, 30, relations), training=True)
        back = layer_modules(compiled)["backward"]
        return [(k.torch_op, k.launch.kind) for k in back.kernels if k.spec.kind == "param"]

    assert 16 * 2 <= SERIAL_TERMS < 16 * 1000
    few, many = param_kernels(2), param_kernels(1000)
    assert ("einsum", "torch") not in few and ("", "elements") in few
    assert ("einsum", "torch") in many


@pytest.mark.parametrize("seed", [11, 222, 3333, 44444, 555555, 6, 77, 888])
def test_random_programs(emulated, seed):
    """Random layer programs (the generator of test_random_programs): generated kernels agree with the reference
    interpreter under torch autograd, with and without compaction/reordering."""
    ei, et, nt = make_graph(node_types=T, seed=seed % 7)
    g = Graph(ei, et, 14, R, nt, T)
    p = random_program(seed)
    leaves = bind(p, g.num_nodes, seed)
    names = list(leaves)
    ref = interpret(p, g, leaves)[p.outputs[0]]
    ref_grads = _grads(ref, [leaves[n] for n in names])
    for opts in (Options(compact=False, reorder=False), Options(compact=True, reorder=True, force_reorder=True),
                 Options(compact=False, reorder=False, sorted_scatter=True),
                 Options(compact=True, reorder=True, force_reorder=True, sorted_scatter=True)):
        out = apply(compile_program(p, opts), g, leaves)
        assert rel_err(out, ref) < 1e-11, opts
        grads = _grads(out, [leaves[n] for n in names])
        for n, a, r in zip(names, grads, ref_grads, strict=True):
            if r is None:
                assert a is None or float(a.abs().max()) == 0.0, n
            else:
                assert float((a - r).norm()) <= 1e-10 * float(r.norm()) + 1e-12, (n, opts)
    _ = F


def test_selection_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setattr(backend_mod, "_cuda_backend", CudaBackend(EmulatedExecutor(arch=60)))
    monkeypatch.setattr(backend_mod, "_warned", set())
    from hector import config

    with pytest.warns(RuntimeWarning, match="sm_60"):
        assert backend_mod.select(torch.device("cuda"), torch.float32) is backend_mod.REFERENCE
    config.set_backend("cuda")
    try:
        with pytest.raises(ValueError, match="sm_60"):
            backend_mod.select(torch.device("cuda"), torch.float32)
        with pytest.raises(ValueError, match="CUDA device"):
            backend_mod.select(torch.device("cpu"), torch.float32)
    finally:
        config.set_backend(None)
    monkeypatch.setattr(backend_mod, "_cuda_backend", CudaBackend(EmulatedExecutor(arch=90)))
    with pytest.warns(RuntimeWarning, match="float8"):
        assert backend_mod.select(torch.device("cuda"), torch.float8_e4m3fn) is backend_mod.REFERENCE
    assert backend_mod.select(torch.device("cpu"), torch.float32) is backend_mod.REFERENCE


def test_inference_keeps_nothing(emulated):
    ei, et, nt = make_graph(node_types=2)
    layer = LAYERS["hgt"]().eval()
    with torch.no_grad():
        out = layer(torch.randn(14, 6), ei, et, nt)
    assert out.shape == (14, 6) and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype,tf32,tol", [(torch.bfloat16, False, 3e-2), (torch.float16, False, 5e-3),
                                            (torch.float32, True, 5e-3), (torch.float32, False, 1e-5)])
def test_tensor_core_gemms(emulated, dtype, tf32, tol):
    """Widths >= 16 run the segment GEMMs on tensor cores (wmma) for bf16/f16, and for f32 when TF32 is on;
    exact f32 (TF32 off) stays on CUDA cores and matches to 1e-5. Widths that are not multiples of 16 pad."""
    from hector import config

    ei, et, nt = make_graph(num_nodes=30, num_edges=200, node_types=2, seed=8)
    config.set_tf32(tf32)
    try:
        _compare(lambda: hn.RGCNConv(40, 24, 3, optimize="none"), ei, et, nt, 30, dtype, tol)
        _compare(lambda: hn.RGATConv(32, 16, 3, heads=2), ei, et, nt, 30, dtype, tol)
        _compare(lambda: hn.HGTConv(32, 32, 2, 3, heads=2), ei, et, nt, 30, dtype, tol)
    finally:
        config.set_tf32(None)
    from hector.codegen import CodegenOptions, layer_modules
    from hector.runtime.cuda import DTYPE_KEY

    layer = hn.RGCNConv(40, 24, 3, optimize="none")
    source = layer_modules(layer.compiled(Graph(ei, et, 30, 3, nt, 2)), DTYPE_KEY[dtype],
                           CodegenOptions(tf32=tf32, arch=90))["forward"].source
    assert ("hw_mma(acc" in source) == (dtype != torch.float32 or tf32)


def test_weight_gradient_tiles_sized_to_the_graph(emulated):
    """Weight-gradient tiles grow with the rows per multiprocessor (one atomic flush per tile): 9,000 edges on the
    emulator's 2 multiprocessors give 512-row tiles, which must sum to the same gradients."""
    g = torch.Generator().manual_seed(7)
    n, e = 3000, 9000
    ei = torch.randint(0, n, (2, e), generator=g)
    et = (torch.rand(e, generator=g) ** 2 * 3).long()  # skewed: one relation holds most edges
    dg = device_graph(Graph(ei, et, n, 3))
    assert dg.tile_rows(Domain.EDGE, 0, 2) == 512 and dg.tile_rows(Domain.EDGE, 64, 2) == 64
    _compare(lambda: hn.RGCNConv(4, 3, 3, optimize="none"), ei, et, None, n, torch.float32, 1e-5)


@pytest.mark.parametrize("name", ["rgcn-compacted", "rgat", "rgat-unfused", "hgt", "hgt-in-ne-out", "rgcn-sorted",
                                  "rgat-sorted", "hgt-sorted"])
def test_graph_prepared_without_host_reads_matches_reference(emulated, monkeypatch, name):
    """A ``sync_free`` graph (what a layer makes of new tensors on a GPU): the unique (source, relation) pairs are
    found on the device, the compacted rows padded to the edge count, and the kernels stop at the pair count held
    on the device. Forward and gradients equal the reference's with every padding row poisoned (NaN), on the
    first (padded) call and on the next, once the count has reached the host and the layout has settled."""
    import math

    real_allocate = EMULATED._allocate

    def poisoned(shape, dtype, zero, device):
        t = real_allocate(shape, dtype, zero, device)
        return t.fill_(math.nan) if not zero and t.is_floating_point() else t

    monkeypatch.setattr(EMULATED, "_allocate", poisoned)
    ei, et, nt = make_graph(num_nodes=17, num_edges=90, node_types=2, seed=5)
    ref, layer, typed, x, xa, a, ga = _reference_and_layer(name, ei, et, nt)
    mixed = Graph(ei, et, 17, 3, *typed, sync_free=True)
    graph = Graph(ei, et, 17, 3, *typed, sync_free=True)
    # padded forward and backward; the same graph settled; a padded forward whose backward runs settled
    for call, g in enumerate((graph, graph, mixed)):
        xb = x.float().requires_grad_()
        b = layer(xb, g)
        dg = device_graph(g)
        if call != 1:
            assert dg.padded and dg.rows(Domain.UNIQUE) == 90, "sized by the edge count before the count is known"
        else:
            assert not dg.padded and dg.rows(Domain.UNIQUE) == g.num_unique < 90
        assert rel_err(b.double(), a) < 1e-5, call
        if call == 2:
            assert g.known_unique_count() is not None and not device_graph(g).padded
        gb = _grads(b, [xb] + list(layer.parameters()))
        for u, v in zip(gb, ga, strict=True):
            assert (u is None) == (v is None)
            if v is not None:
                assert rel_err(u.double(), v) < 1e-5, call


@pytest.mark.parametrize("name", ["rgcn-sorted", "rgcn-uncompacted-sorted", "rgat-sorted", "hgt-sorted"])
def test_sorted_scatter_writes_rows_without_atomics(emulated, name):
    """With sorted scatter no generated kernel sums into node, edge or pair rows with atomics (only weight
    gradients, which are per-tile flushes, keep them), every sum by source or pair runs as a target-centric walk,
    and no row output needs the zero fill atomics need. Forward and gradients match the float64 reference (the
    layer tests above)."""
    from hector.codegen import layer_modules

    layer = LAYERS[name]().train()
    compiled = layer.compiled(None, options=layer.optimize)
    mods = layer_modules(compiled)
    centric = [k for m in mods.values() for k in m.kernels if dict(k.spec.detail).get("centric")]
    assert centric, "the backward sums by source or pair"
    for module in mods.values():
        for kc in module.kernels:
            for out in kc.outputs:
                domain = compiled.forward.type_of(out.name).domain if out.name in compiled.forward.by_name else \
                    compiled.full_backward.program.type_of(out.name).domain
                assert not out.zero or domain is Domain.PARAM, (kc.name, out.name)
            if kc.spec.kind == "gemm":
                assert "atomicAdd" not in module.source.split(f" {kc.name}(")[1].split("extern")[0] or \
                    kc.spec.detail and dict(kc.spec.detail)["op"] == "outer_sum", kc.name
    ei, et, nt = make_graph(num_nodes=17, num_edges=90, node_types=2, seed=3)
    EMULATED.executor.launches.clear()
    _compare(LAYERS[name], ei, et, nt, 17, torch.float32, 1e-5)
    assert {k.name for k in centric} & set(EMULATED.executor.launches), "the centric kernels ran"
    _compare(LAYERS[name], ei, et, nt, 17, torch.bfloat16, 3e-2)  # bf16 rows written once from float32 sums


def _launch_plans(graph: Graph) -> int:
    """Launch plans (call records) the CUDA backend holds for ``graph`` (built by a call or by preparing it)."""
    return len(device_graph(graph).calls)


@pytest.mark.parametrize("name", ["rgcn", "rgat", "hgt", "rgcn-sorted", "hgt-in-ne-out"])
def test_prepared_graph_builds_every_plan_ahead(emulated, name):
    """``hector.prepare_graph(..., layers=...)`` builds the launch plans a training step on the graph needs: before
    the layer's first training call, the forward that keeps values and the backward with and without x's
    gradient; after it, the backward that call used (the first layer of a model never needs x's gradient, the
    others always do). Where x's need changed, the step builds the one plan missing; forward and gradients equal
    the reference's every time."""
    import hector

    ei, et, nt = make_graph(num_nodes=17, num_edges=90, node_types=2, seed=7)
    ref, layer, typed, x, xa, a, ga = _reference_and_layer(name, ei, et, nt)
    # (x needs a gradient, launch plans prepared at least, plans the step adds)
    for x_grad, prepared, added in ((True, 3, 0), (False, 2, 1), (False, 2, 0), (True, 2, 1)):
        graph = hector.prepare_graph(ei.clone(), et.clone(), 17, 3, *typed, layers=[layer])
        plans = _launch_plans(graph)
        assert plans >= prepared
        xb = x.float().requires_grad_(x_grad)
        b = layer(xb, graph)
        assert rel_err(b.double(), a) < 1e-5
        inputs = ([xb] if x_grad else []) + list(layer.parameters())
        gb = _grads(b, inputs)
        assert _launch_plans(graph) == plans + added, (x_grad, plans, _launch_plans(graph))
        for u, v in zip(gb, ga if x_grad else ga[1:], strict=True):
            assert (u is None) == (v is None)
            if v is not None:
                assert rel_err(u.double(), v) < 1e-5
    graph = hector.prepare_graph(ei.clone(), et.clone(), 17, 3, *typed, layers=[layer], input_grad=None)
    assert _launch_plans(graph) == plans, "input_grad=None follows the last training call"


def test_consecutive_graphs_with_other_relations_are_exact(monkeypatch):
    """Mini-batches one after another, each a new graph with other relations present (and other sizes), prepared
    with the layers of a two-layer model: every step's output and gradients equal the float64 reference backend's
    (nothing bound to one graph's plans, grids or tile schedules reaches the next)."""
    import hector

    torch.manual_seed(0)
    make = [lambda: hn.RGATConv(6, 3, 40, heads=2, attention="shared"), lambda: hn.RGATConv(6, 3, 40, heads=2,
                                                                                             attention="shared")]
    ref, model = [m().double() for m in make], [m() for m in make]
    for r, m in zip(ref, model, strict=True):
        m.load_state_dict(r.state_dict())

    def forward(layers, x, edges, et):
        h = torch.nn.functional.elu(layers[0](x, edges, et))
        return layers[1](h, edges, et)

    for seed, (n, e, present) in enumerate([(17, 60, [0, 1, 2]), (23, 40, [39]), (11, 90, [5, 6, 7, 8, 30]),
                                            (17, 60, [0, 1, 2, 3, 4, 5])]):
        g = torch.Generator().manual_seed(100 + seed)
        ei = torch.randint(0, n, (2, e), generator=g)
        et = torch.tensor(present)[torch.randint(0, len(present), (e,), generator=g)]
        x = torch.randn(n, 6, dtype=torch.float64, generator=g)
        xa = x.clone().requires_grad_()
        a = forward(ref, xa, ei, et)  # the reference backend: no CUDA tensors here
        ga = _grads(a, [xa] + [p for r in ref for p in r.parameters()])
        with monkeypatch.context() as m:
            m.setattr(compiled_mod, "select", lambda device, dtype: EMULATED)
            graph = hector.prepare_graph(ei, et, n, 40, layers=model)
            xb = x.float().requires_grad_()
            b = forward(model, xb, graph, et)
            gb = _grads(b, [xb] + [p for layer in model for p in layer.parameters()])
        assert rel_err(b.double(), a) < 1e-5, seed
        for u, v in zip(gb, ga, strict=True):
            assert rel_err(u.double(), v) < 1e-4, seed


def test_prepared_graph_under_autocast(emulated):
    """Prepared for bfloat16 (``dtype=``), the graph's step under ``torch.autocast`` builds no plan of its own."""
    import hector

    ei, et, nt = make_graph(num_nodes=17, num_edges=90, seed=8)
    torch.manual_seed(0)
    layer = LAYERS["rgat"]()
    graph = hector.prepare_graph(ei, et, 17, 3, layers=layer, dtype=torch.bfloat16, input_grad=False)
    plans = _launch_plans(graph)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(17, 6), graph)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and _launch_plans(graph) == plans
    unprepared = hector.Graph(ei, et, 17, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out2 = layer(torch.randn(17, 6), unprepared)
    out2.float().sum().backward()
    assert _launch_plans(unprepared) == plans, "the same plans as those prepared"


def test_prepare_graph_in_a_loader_thread(emulated):
    """Graphs prepared by a loader thread while the training thread runs steps on the graphs made before: every
    step's output equals the reference's (nothing shared is half-built while the other thread reads it)."""
    import queue
    import threading

    import hector

    torch.manual_seed(0)
    layer = LAYERS["rgat"]()
    ref = LAYERS["rgat"]().double()
    ref.load_state_dict(layer.state_dict())
    graphs = [make_graph(num_nodes=17, num_edges=60 + 5 * i, seed=20 + i) for i in range(6)]
    xs = [torch.randn(17, 6, dtype=torch.float64) for _ in graphs]
    with _on_reference():  # (before the loader thread starts: the backend choice is process-wide)
        expected = [ref(x, ei, et) for x, (ei, et, _) in zip(xs, graphs, strict=True)]
    ready: queue.Queue = queue.Queue(maxsize=2)
    failures = []

    def loader():
        try:
            for ei, et, _ in graphs:
                ready.put((ei, et, hector.prepare_graph(ei, et, 17, 3, layers=layer)))
        except Exception as e:  # handed to the training thread, which fails the test with it
            failures.append(e)
        ready.put(None)

    thread = threading.Thread(target=loader, daemon=True)  # a failed step leaves it blocked, not the process
    thread.start()
    steps = 0
    while (item := ready.get()) is not None:
        ei, et, graph = item
        out = layer(xs[steps].float(), graph)
        out.sum().backward()
        assert rel_err(out.double(), expected[steps]) < 1e-5
        steps += 1
    thread.join()
    assert not failures and steps == len(graphs)


@pytest.mark.parametrize("name", ["rgcn", "rgat", "hgt", "rgat-sorted"])
def test_destination_sorted_edges_skip_the_sort(emulated, name):
    """Edges already in destination order (a sampler's CSC order): found with the id check, or promised by
    ``sorted_by_destination=True``, the backend keeps them as they are (no sort, no gathers), and the forward and
    gradients equal those of the same graph sorted again (``False``: sorted by destination and relation, so the
    sums within a destination may add in another order: equal to rounding) and the reference's. Shuffled edges
    are found unsorted and sorted as before."""
    ei, et, nt = make_graph(num_nodes=17, num_edges=90, node_types=2, seed=9)
    order = torch.sort(ei[1], stable=True).indices
    ei, et = ei[:, order], et[order]
    ref, layer, typed, x, xa, a, ga = _reference_and_layer(name, ei, et, nt)
    results = {}
    for hint in (None, True, False):
        graph = Graph(ei, et, 17, 3, *typed, sorted_by_destination=hint)
        assert graph.dst_sorted == (hint is not False)
        assert (device_graph(graph).order is None) == (hint is not False)
        xb = x.float().requires_grad_()
        b = layer(xb, graph)
        results[hint] = (b,) + _grads(b, [xb] + list(layer.parameters()))
    for u, v, w in zip(results[None], results[True], results[False], strict=True):
        assert (u is None) == (v is None) == (w is None)
        if v is not None:
            assert torch.equal(u, v)
            assert rel_err(w.double(), v.double()) < 1e-5
    for u, v in zip(results[None][1:], ga, strict=True):
        if v is not None:
            assert rel_err(u.double(), v) < 1e-5
    assert rel_err(results[None][0].double(), a) < 1e-5
    shuffled = torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(1))
    unsorted = Graph(ei[:, shuffled], et[shuffled], 17, 3, *typed)
    assert not unsorted.dst_sorted and device_graph(unsorted).order is not None


def _call_records(graph: Graph) -> list:
    """The CUDA backend's call records on ``graph`` (see CudaBackend._call)."""
    return list(device_graph(graph).calls.values())


@pytest.mark.parametrize("name", ["rgcn", "rgat", "hgt", "rgat-shared"])
def test_call_records_never_stale(emulated, name, monkeypatch):
    """A step replays what was packed for its graph (kernels, graph arguments, offsets in one allocation) and
    patches only the addresses of its own buffers: a layer used on two graphs of different sizes in turn, with its
    weights changed in place and replaced between steps, must match the reference at every step, as must the same
    steps run kernel by kernel (each buffer of its own: the records' batched form off)."""
    import hector

    torch.manual_seed(0)
    ref = LAYERS[name]().double()
    graphs = []
    for seed, (n, e) in enumerate(((17, 90), (29, 200))):
        ei, et, nt = make_graph(num_nodes=n, num_edges=e, node_types=2, seed=11 + seed)
        typed = (nt, 2) if ref.num_node_types else (None, None)
        graphs.append((n, hector.prepare_graph(ei, et, n, 3, *typed), (ei, et, typed[0])))
    outputs = {}
    for batched in (True, False):
        if not batched:  # the setting is a part of a record's key: the same graphs get records of the other kind
            monkeypatch.setattr(hector.config.settings, "launch_batches", False)
        torch.manual_seed(0)
        ref = LAYERS[name]().double()  # the same weights in both passes
        layer = LAYERS[name]().float()
        layer.load_state_dict(ref.state_dict())
        for step in range(6):
            n, graph, (ei, et, nt) = graphs[step % 2]
            with torch.no_grad():  # new weights each step: in place, and (every third step) new tensors
                for p in ref.parameters():
                    p.mul_(-1.1).add_(0.05)
            if step % 3 == 2:
                layer.load_state_dict(ref.state_dict())
            else:
                with torch.no_grad():
                    for p, q in zip(layer.parameters(), ref.parameters(), strict=True):
                        p.copy_(q)
            x = torch.randn(n, ref.in_channels, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            xa, xb = x.clone().requires_grad_(), x.float().requires_grad_()
            with _on_reference():
                a = ref(xa, ei, et, nt)
                ga = _grads(a, [xa] + list(ref.parameters()))
            b = layer(xb, graph)
            assert rel_err(b.double(), a) < 1e-5, (batched, step)
            gb = _grads(b, [xb] + list(layer.parameters()))
            for u, v in zip(gb, ga, strict=True):
                assert (u is None) == (v is None)
                if v is not None:
                    assert rel_err(u.double(), v) < 1e-5, (batched, step)
            outputs.setdefault(step, []).append(b.detach())
            records = [r for r in _call_records(graph) if (r.batched is not None) == batched]
            assert len(records) >= 2, (batched, step)  # the forward and the backward of this kind
    for step, (u, v) in outputs.items():
        assert torch.equal(u, v), f"step {step}: the batched and kernel-by-kernel paths differ"


def test_dropout_masks_in_launch_batches(emulated, monkeypatch):
    """A dropout mask is a torch op between two launch batches: the kernels after it read the mask torch made,
    as on the kernel-by-kernel path (the same seed, the same masks: the same output and gradients)."""
    ei, et, nt = make_graph(num_nodes=17, num_edges=90, node_types=2, seed=5)
    torch.manual_seed(0)
    layer = hn.HGTConv(6, 6, 2, 3, heads=2, dropout=0.5).train()
    x = torch.randn(17, 6)
    results = []
    for batches in (True, False):
        monkeypatch.setattr(hector.config.settings, "launch_batches", batches)
        torch.manual_seed(1)
        xb = x.clone().requires_grad_()
        out = layer(xb, ei, et, nt)
        results.append((out.detach(), *_grads(out, [xb] + list(layer.parameters()))))
    graph = hector.prepare_graph(ei, et, 17, 3, nt, 2)
    assert any(r.batched is not None and any(kind == 2 for kind, _ in r.batched.program)
               for r in _call_records(graph)), "a batched call drew a dropout mask"
    for u, v in zip(*results, strict=True):
        assert (u is None) == (v is None)
        if u is not None:
            assert rel_err(u.double(), v.double()) < 1e-6
    layer.eval()
    assert rel_err(results[0][0].double(), layer(x, ei, et, nt).detach().double()) > 1e-2, "dropout applied"


@pytest.mark.parametrize("name", ["rgcn", "rgat", "hgt", "rgcn-sorted", "rgat-sorted", "hgt-sorted"])
def test_new_edge_index_each_call_matches_the_persistent_graph(emulated, name):
    """A mini-batch loop's calls: new ``edge_index`` / ``edge_type`` tensors each call (copies of one graph, so
    the results can be compared), the earlier ones dropped. Each call prepares its graph anew (the
    (destination, relation) order, the relational mean's normaliser from it, the destinations by degree made on
    first use) and gives the forward and gradients of the call on one persistent graph, bit for bit (the same
    layout, the same kernels), and those of the float64 reference; the graphs of dropped tensors are freed."""
    import weakref

    ei, et, nt = make_graph(num_nodes=17, num_edges=90, node_types=2, seed=4)
    ref, layer, typed, x, xa, a, ga = _reference_and_layer(name, ei, et, nt)

    def step(edge_index, edge_type):
        xb = x.float().requires_grad_()
        b = layer(xb, edge_index, edge_type, typed[0])
        return (b,) + _grads(b, [xb] + list(layer.parameters()))

    persistent = step(ei, et)
    assert rel_err(persistent[0].double(), a) < 1e-5
    for u, v in zip(persistent[1:], ga, strict=True):
        if v is not None:
            assert rel_err(u.double(), v) < 1e-5
    graphs = []
    for _ in range(3):
        ei2, et2 = ei.clone(), et.clone()
        got = step(ei2, et2)
        for u, v in zip(got, persistent, strict=True):
            assert (u is None) == (v is None)
            if v is not None:
                assert torch.equal(u, v)
        graph = graph_for(ei2, et2, 17, 3, *typed)
        assert graph is not graph_for(ei, et, 17, 3, *typed)
        graphs.append(weakref.ref(graph))
        del ei2, et2, graph
    assert [g() is None for g in graphs] == [True, True, False]


class _PoisonedEmpty:
    """``torch`` for the CUDA backend's module, but every ``empty`` comes filled with 0xFF bytes (NaN as float): a
    buffer a kernel accumulates into without its zero fill shows."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        if t.dtype == torch.uint8:
            return t.fill_(255)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)


@pytest.mark.parametrize("pool", ["none", "own", "merged"])
@pytest.mark.parametrize("name", ["rgcn", "rgat", "hgt", "rgat-shared"])
def test_zero_filled_temporaries_in_launch_batches(emulated, name, pool, monkeypatch):
    """A batched call's zero-initialised buffers are zero-filled by the fill kernel (hector.codegen.fill) launched
    first: those too large for its pool at the head of its one allocation for temporaries, and its pool, in an
    allocation of its own or (a small call's) after its temporaries in theirs. With every new allocation poisoned,
    forward and gradients still match the reference: with no buffer in the pool (``none``), with the pool in an
    allocation of its own (``own``) and in the temporaries' (``merged``); and the batched records launch the fill
    kernel."""
    from hector.codegen import fill
    from hector.runtime import cuda as cuda_mod

    if pool == "none":
        monkeypatch.setattr(cuda_mod, "_POOL_ITEM_BYTES", 0)
    elif pool == "own":
        monkeypatch.setattr(cuda_mod, "_POOL_MERGE_BYTES", -1)
    monkeypatch.setattr(cuda_mod, "torch", _PoisonedEmpty())
    ei, et, nt = make_graph(num_nodes=17, num_edges=90, node_types=2, seed=3)
    ref, layer, typed, x, xa, a, ga = _reference_and_layer(name, ei, et, nt)
    graph = hector.prepare_graph(ei, et, 17, 3, *typed)
    xb = x.float().requires_grad_()
    b = layer(xb, graph)
    assert rel_err(b.double(), a) < 1e-5
    gb = _grads(b, [xb] + list(layer.parameters()))
    for u, v in zip(gb, ga, strict=True):
        assert (u is None) == (v is None)
        if v is not None:
            assert rel_err(u.double(), v) < 1e-5
    fills = [r for r in _call_records(graph) if r.batched is not None and any(
        kind == 0 and any(k[2] == fill.KERNEL for k, *_ in item) for kind, item in r.batched.program)]
    assert fills, "a batched call zero-filled its temporaries with the fill kernel"
    pooled = [r.batched for r in _call_records(graph)
              if r.batched is not None and (r.batched.pool_bytes or r.batched.pool_at >= 0)]
    if pool == "none":
        assert not pooled
    else:
        assert pooled and all((b.pool_at >= 0) == (pool == "merged") for b in pooled), pool
