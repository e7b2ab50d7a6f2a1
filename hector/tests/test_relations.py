"""A mini-batch step's work does not grow with the number of relations the model has, only with the rows of the
batch (counted in torch operations, which per-relation Python loops would multiply; never timed), and the passes
over whole per-relation weights a step cannot avoid are not multiplied (no weight copies, one gradient buffer)."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from torch.utils._python_dispatch import TorchDispatchMode

import hector.nn as hn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from relations import CountOps  # noqa: E402

N, E = 400, 1500


def _ops(kind, relations):
    torch.manual_seed(0)
    layer = {"rgcn": lambda: hn.RGCNConv(8, 8, relations),
             "rgat": lambda: hn.RGATConv(8, 2, relations, heads=4, attention="shared"),
             "hgt": lambda: hn.HGTConv(8, 8, 3, relations, heads=2)}[kind]()
    g = torch.Generator().manual_seed(1)
    x, nt = torch.randn(N, 8), torch.randint(0, 3, (N,), generator=g)

    def batch():
        ei = torch.randint(0, N, (2, E), generator=g)
        return ei, (torch.rand(E, generator=g) ** 3 * relations).long()

    def step(ei, et):
        layer.zero_grad(set_to_none=True)
        layer(x, ei, et, nt).sum().backward()

    step(*batch())  # warm-up: tracing, the cost model's choice
    ei, et = batch()
    with CountOps() as counter:
        step(ei, et)
    return counter.count


@pytest.mark.parametrize("kind", ["rgcn", "rgat", "hgt"])
def test_step_operations_do_not_grow_with_relations(kind):
    few, many = _ops(kind, 20), _ops(kind, 20000)
    # the batch holds ~1,000 of the 20,000 relations: a per-relation loop would add thousands of operations
    assert many <= 1.5 * few + 50, (few, many)


# Layers whose training step at many relations once copied a whole per-relation weight: RGAT with attention shared
# by all relations (the gradient of q and k sums over every relation's weight), as the GNN benchmark builds it, and
# each model with both optimisations forced on (reordering composes weights per relation).
COPY_LAYERS = {
    "rgat-shared": lambda r, opt: hn.RGATConv(8, 4, r, heads=2, attention="shared", optimize=opt),
    "rgat": lambda r, opt: hn.RGATConv(8, 4, r, heads=2, optimize=opt),
    "rgcn": lambda r, opt: hn.RGCNConv(8, 8, r, optimize=opt),
    "hgt": lambda r, opt: hn.HGTConv(8, 8, 3, r, heads=2, optimize=opt),
}


def _copies(kind, relations, optimize, select=None):
    """Bytes copied in one training step of two stacked layers of ``relations`` relations (after a warm-up step),
    the largest copy, and the bytes of the largest per-relation parameter."""
    from hector.runtime import compiled as compiled_mod

    torch.manual_seed(0)
    layers = [COPY_LAYERS[kind](relations, optimize) for _ in range(2)]
    g = torch.Generator().manual_seed(2)
    n, e = 60, 240
    x, nt = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    u = torch.rand(e, generator=g)

    def step(ei, et):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        h = layers[0](x, ei, et, nt).relu()
        layers[1](h, ei, et, nt).square().sum().backward()

    batches = [(torch.randint(0, n, (2, e), generator=g), (u ** 2 * relations).long()) for _ in range(2)]
    saved = compiled_mod.select
    if select is not None:
        compiled_mod.select = select
    try:
        step(*batches[0])  # warm-up: tracing, the cost model's choice
        with CountOps() as counter:
            step(*batches[1])
    finally:
        compiled_mod.select = saved
    weight = max(p.numel() * p.element_size() for p in layers[0].parameters() if p.size(0) == relations)
    return counter, weight


def _assert_no_weight_copies(kind, optimize, many, select=None):
    few, _ = _copies(kind, 16, optimize, select)
    counter, weight = _copies(kind, many, optimize, select)
    # copies belong to the batch (its rows), so they do not grow with the relation count; a copy of a
    # per-relation weight (or of its gradient) would be as large as the weight
    assert counter.largest_copy < weight // 4, (counter.copies, weight)
    assert counter.copied_bytes <= few.copied_bytes + 4096, (few.copies, counter.copies)


@pytest.mark.parametrize("optimize", ["auto", "all"])
@pytest.mark.parametrize("kind", list(COPY_LAYERS))
def test_step_copies_no_per_relation_weight(kind, optimize):
    _assert_no_weight_copies(kind, optimize, 20000)


@pytest.mark.parametrize("kind", ["rgat-shared", "rgat"])
def test_cuda_backend_step_copies_no_per_relation_weight(kind):
    """The same through the CUDA backend (its generated kernels run by the CPU emulator), where long weight
    reductions run as torch.einsum."""
    from emulation import EmulatedExecutor, compiler

    from hector.runtime.cuda import CudaBackend

    if compiler() is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    backend = CudaBackend(EmulatedExecutor())
    _assert_no_weight_copies(kind, "all", 3000, lambda device, dtype: backend)


@pytest.mark.parametrize("equation,a,b", [("rio,rim->mo", (50, 6, 3), (50, 6, 7)), ("rim,mo->rio", (5, 6, 7), (7, 3)),
                                          ("rb,bio->rio", (9, 2), (2, 4, 5)), ("ab,b->a", (4, 3), (3,)),
                                          # long reductions, split in parts (a remainder part too), both output orders
                                          ("rio,rim->mo", (3001, 23, 3), (3001, 23, 5)),
                                          ("ri,ro->oi", (70001, 2), (70001, 3))])
def test_memory_order_einsum_is_einsum(equation, a, b):
    from hector.runtime.einsum import einsum, memory_order_equation

    g = torch.Generator().manual_seed(0)
    ta, tb = torch.randn(a, generator=g, dtype=torch.float64), torch.randn(b, generator=g, dtype=torch.float64)
    assert torch.allclose(einsum(equation, ta, tb), torch.einsum(equation, ta, tb), rtol=1e-12, atol=1e-12)
    renamed = memory_order_equation(equation)
    assert renamed.startswith("a") and len(set(renamed) - set(",->")) == len(set(equation) - set(",->"))


@pytest.mark.gpu
@pytest.mark.parametrize("optimize", ["auto", "all"])
def test_gnn_benchmark_layers_at_ten_thousand_relations_on_gpu(optimize):
    """The GNN benchmark's two layers (RGAT, attention shared by relations, 16 x 4 heads, inputs 128 then 64) at
    10,000 relations on the CUDA backend: gradients as the float64 reference's, and no copy of a weight in a step."""
    from hector import config

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device available")
    r, n, e = 10000, 20000, 150000
    g = torch.Generator().manual_seed(0)
    ei = torch.randint(0, n, (2, e), generator=g).cuda()
    et = (torch.rand(e, generator=g) * r).long().cuda()
    torch.manual_seed(0)
    layers = [hn.RGATConv(d, 16, r, heads=4, attention="shared", optimize=optimize) for d in (128, 64)]
    x = torch.randn(n, 128, device="cuda")
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for layer in layers:
            fp32 = layer.cuda()
            ref = hn.RGATConv(fp32.in_channels, 16, r, heads=4, attention="shared", optimize=optimize).cuda().double()
            ref.load_state_dict(fp32.state_dict())
            inp = x[:, :fp32.in_channels].contiguous()
            grads = []
            for module, backend, xin in ((ref, "reference", inp.double()), (fp32, "cuda", inp)):
                config.set_backend(backend)
                module(xin, ei, et).square().sum().backward()  # warm-up: compilation, the cost model's choice
                module.zero_grad(set_to_none=True)
                with CountOps() as counter:
                    module(xin, ei, et).square().sum().backward()
                grads.append([p.grad for p in module.parameters()])
            weight = fp32.weight.numel() * fp32.weight.element_size()
            assert counter.largest_copy < weight // 16, counter.copies
            for u, v in zip(grads[1], grads[0], strict=True):
                assert float((u.double() - v).norm() / v.norm()) < 1e-4
    finally:
        config.set_backend(None)
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


class _WeightBuffers(TorchDispatchMode):
    """Counts the new tensors of ``numel`` elements (allocated, filled or computed; views and in-place results
    excluded) while active."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count, self.ops = numel, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == self.numel:
            storages = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            if out.untyped_storage().data_ptr() in storages:  # a view or an in-place result: no new tensor
                return out
            self.count += 1
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("compact,reorder", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("attention", ["shared", "per_relation"])
def test_weight_gradient_is_one_buffer(attention, compact, reorder):
    """RGAT's weight enters twice (source and destination projections, or a reordered composition): its gradient is
    built in one weight-sized buffer per step on the CUDA backend (emulated), not in two parts summed by a third."""
    from emulation import EmulatedExecutor, compiler

    from hector.passes import Options
    from hector.runtime import compiled as compiled_mod
    from hector.runtime.cuda import CudaBackend

    if compiler() is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    backend = CudaBackend(EmulatedExecutor())
    r = 1500  # a weight of 1.5 MB: above the size the backend carves from its pool of small buffers
    torch.manual_seed(0)
    layer = hn.RGATConv(16, 8, r, heads=2, attention=attention, optimize=Options(compact=compact, reorder=reorder))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 16, generator=g)
    ei, et = torch.randint(0, 50, (2, 200), generator=g), torch.randint(0, r, (200,), generator=g)
    saved = compiled_mod.select
    compiled_mod.select = lambda device, dtype: backend
    try:
        layer(x, ei, et).square().sum().backward()  # warm-up: compilation
        layer.zero_grad(set_to_none=True)
        out = layer(x, ei, et)
        with _WeightBuffers(layer.weight.numel()) as counter:
            out.square().sum().backward()
    finally:
        compiled_mod.select = saved
    assert counter.count == 1, counter.ops
    ref = hn.RGATConv(16, 8, r, heads=2, attention=attention, optimize="none").double()
    ref.load_state_dict(layer.state_dict())
    ref(x.double(), ei, et).square().sum().backward()
    assert rel_err(layer.weight.grad.double(), ref.weight.grad) < 1e-5
