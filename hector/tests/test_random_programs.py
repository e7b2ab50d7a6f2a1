"""Random layer programs: every optimisation choice and the kernel plan compute what the unoptimised program
computes (checked against torch autograd through the reference interpreter), forward and backward."""

import random

import torch
from conftest import make_graph
from hypothesis import given, settings
from hypothesis import strategies as st

from hector.ir import Builder, Domain, Op
from hector.passes import Options
from hector.runtime.compiled import apply, compile_program
from hector.runtime.graph import Graph
from hector.runtime.reference import interpret

R, T, F = 3, 2, 4


def random_program(seed: int):
    rng = random.Random(seed)
    b = Builder(f"random{seed}")
    x = b.node_input("x", F)
    nodes, edges = [x], []
    count = 0

    def param(shape, by=()):
        nonlocal count
        count += 1
        return b.param(f"p{count}", shape, by=by)

    for _ in range(rng.randint(4, 12)):
        choice = rng.choice(["gather", "gather", "typed", "typed", "linear", "act", "binary", "scatter",
                             "softmax", "select", "ntype", "heads"])
        if choice == "gather" or not edges:
            edges.append(b.src(rng.choice(nodes)) if rng.random() < 0.6 else b.dst(rng.choice(nodes)))
        elif choice == "typed":
            by = rng.choice(["etype", "src_ntype", "dst_ntype"])
            edges.append(rng.choice(edges).linear(param((R if by == "etype" else T, F, F), by)))
        elif choice == "linear":
            pool = rng.choice([nodes, edges])
            pool.append(rng.choice(pool).linear(param((F, F))))
        elif choice == "act":
            pool = rng.choice([nodes, edges])
            v = rng.choice(pool)
            fn = rng.choice(["tanh", "sigmoid", "gelu", "leaky_relu", "exp"])
            pool.append((v * 0.3).tanh().exp() if fn == "exp" else (v.leaky_relu(0.1) if fn == "leaky_relu"
                                                                      else getattr(v, fn)()))
        elif choice == "binary":
            pool = rng.choice([nodes, edges])
            a, c = rng.choice(pool), rng.choice(pool)
            pool.append(rng.choice([a + c, a * c, a - c]))
        elif choice == "scatter":
            nodes.append(b.sum_to_dst(rng.choice(edges)))
        elif choice == "softmax":
            e = rng.choice(edges)
            alpha = b.edge_softmax(e.heads(2).dot(rng.choice(edges).heads(2)))  # (2,) scores
            edges.append((rng.choice(edges).heads(2) * alpha).flat())
        elif choice == "select":
            by = rng.choice(["etype", "src_ntype"])
            edges.append(rng.choice(edges) * param((R if by == "etype" else T, F), by))
        elif choice == "ntype":
            nodes.append(rng.choice(nodes).linear(param((T, F, F), "ntype")) + param((T, F), "ntype"))
        else:
            edges.append(rng.choice(edges).heads(2).linear(param((R, 2, 2, 2), "etype")).flat())
    out = b.sum_to_dst(edges[-1]) + nodes[-1]
    return b.build(out)


def bind(p, n, seed):
    g = torch.Generator().manual_seed(seed)
    leaves = {}
    for node in p.nodes:
        if node.op is Op.INPUT:
            leaves[node.attr("name")] = torch.randn((n,) + node.type.shape, generator=g, dtype=torch.float64)
        elif node.op is Op.PARAM:
            leaves[node.attr("name")] = 0.4 * torch.randn(node.type.shape, generator=g, dtype=torch.float64)
    return {k: v.requires_grad_() for k, v in leaves.items()}


GRAPH = None


def graph():
    global GRAPH
    if GRAPH is None:
        ei, et, nt = make_graph(node_types=T)
        GRAPH = Graph(ei, et, 14, R, nt, T)
    return GRAPH


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_random_program_all_optimisations_agree(seed):
    p, g = random_program(seed), graph()
    assert p.type_of(p.outputs[0]).domain is Domain.NODE
    leaves = bind(p, g.num_nodes, seed)
    names = list(leaves)
    w = torch.randn(g.num_nodes, F, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    ref = interpret(p, g, leaves)[p.outputs[0]]
    ref_grads = torch.autograd.grad((ref * w).sum(), [leaves[n] for n in names], allow_unused=True)
    from hector import config

    for opts, tile in ((Options(compact=False, reorder=False), None), (Options(compact=True, reorder=True), None),
                       (Options(compact=True, reorder=True, force_reorder=True, debug=True), 48)):
        config.set_tile_bytes(tile)  # 48 bytes: edge kernels run in tiles of a few edges
        try:
            out = apply(compile_program(p, opts), g, leaves)
        finally:
            config.set_tile_bytes(None)
        assert float((out - ref).detach().norm()) <= 1e-10 * float(ref.detach().norm()) + 1e-12, opts
        config.set_tile_bytes(tile)
        try:
            grads = torch.autograd.grad((out * w).sum(), [leaves[n] for n in names], allow_unused=True)
        finally:
            config.set_tile_bytes(None)
        for n, a, r in zip(names, grads, ref_grads, strict=True):
            if r is None:
                assert a is None or float(a.abs().max()) == 0.0, n
            else:
                # relative, with an absolute floor for gradients that are zero up to rounding (e.g. a param that
                # only shifts all scores of a softmax)
                assert a is not None and float((a - r).norm()) <= 1e-9 * float(r.norm()) + 1e-12, (n, opts)
