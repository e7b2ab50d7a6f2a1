"""A mini-batch step's work does not grow with the number of relations the model has, only with the rows of the
batch (counted in torch operations, which per-relation Python loops would multiply; never timed)."""

import sys
from pathlib import Path

import pytest
import torch

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
