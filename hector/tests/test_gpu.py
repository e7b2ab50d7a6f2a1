"""The reference backend on a GPU: same values and gradients as on the CPU."""

import pytest
import torch
from conftest import make_graph, rel_err

import hector.nn as hn

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device available", allow_module_level=True)

R = 3


@pytest.mark.parametrize("make", [
    lambda: hn.RGCNConv(5, 4, R, num_bases=2),
    lambda: hn.RGATConv(5, 3, R, heads=2),
    lambda: hn.RGATConv(5, 3, R, heads=2, attention="shared", concat=False),
    lambda: hn.HGTConv(5, 5, 2, R, heads=1),
], ids=["rgcn", "rgat", "rgat-shared", "hgt"])
def test_cuda_matches_cpu(make):
    ei, et, nt = make_graph(node_types=2)
    x = torch.randn(14, 5, dtype=torch.float64)
    cpu = make().double()
    gpu = make().double().cuda()
    gpu.load_state_dict(cpu.state_dict())
    xc, xg = x.clone().requires_grad_(), x.cuda().requires_grad_()
    a = cpu(xc, ei, et, nt)
    b = gpu(xg, ei.cuda(), et.cuda(), nt.cuda())
    assert b.is_cuda and rel_err(b.cpu(), a) < 1e-10
    ga = torch.autograd.grad(a.pow(2).sum(), [xc] + list(cpu.parameters()), allow_unused=True)
    gb = torch.autograd.grad(b.pow(2).sum(), [xg] + list(gpu.parameters()), allow_unused=True)
    for u, v in zip(ga, gb, strict=True):
        if u is not None:
            assert rel_err(v.cpu(), u) < 1e-10


def test_cuda_gradcheck_rgat():
    from torch.func import functional_call

    ei, et, _ = make_graph()
    m = hn.RGATConv(5, 3, R, heads=2).double().cuda()
    names = [n for n, _ in m.named_parameters()]
    ei, et = ei.cuda(), et.cuda()

    def f(x, *ps):
        return functional_call(m, dict(zip(names, ps, strict=True)), (x, ei, et))

    inputs = (torch.randn(14, 5, dtype=torch.float64, device="cuda", requires_grad=True),) + tuple(
        p.detach().clone().requires_grad_() for p in m.parameters())
    # Scatter-adds on CUDA use atomics, so two backward passes sum in different orders: allow float64 rounding.
    assert torch.autograd.gradcheck(f, inputs, atol=1e-7, rtol=1e-5, fast_mode=True, nondet_tol=1e-12)
