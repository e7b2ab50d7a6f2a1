"""Generated backward programs: checked against finite differences (gradcheck) and against torch autograd run
through the reference interpreter of the same forward program."""

import pytest
import torch
from conftest import make_graph, rel_err

from hector.ir import Builder, Op
from hector.passes import Options, differentiate
from hector.runtime.compiled import apply, compile_program
from hector.runtime.graph import Graph
from hector.runtime.reference import interpret

R, T = 3, 2
ACTS = ["exp", "relu", "leaky_relu", "sigmoid", "tanh", "gelu"]


def _act(v, fn):
    return v.leaky_relu(0.1) if fn == "leaky_relu" else getattr(v, fn)()


def prog_attention(fn):
    b = Builder(f"att_{fn}")
    x = b.node_input("x", 4)
    w = b.einsum("rb,bio->rio", b.param("comp", (R, 2)), b.param("basis", (2, 4, 6)), by="etype")
    hs = b.src(x).linear(w)
    hd = b.dst(x).linear(b.param("Wd", (R, 4, 6), by="etype"))
    cat = hs.concat(hd).heads(2)  # (2, 6)
    m = cat.linear(b.param("Wh", (R, 2, 6, 3), by="etype"))  # per-head typed map -> (2, 3)
    score = _act(m.dot(b.dst(x.linear(b.param("P", (4, 6)))).heads(2)), fn)  # (2,)
    alpha = b.edge_softmax(score * b.select(b.param("p", (R, 2), by="etype"), hs) - score / 3.0)
    msg = (m * alpha).flat() * b.graph_const("inv_deg_dst_rel")
    out = b.sum_to_dst(msg) + x.linear(b.param("root", (4, 6))) + b.param("bias", (6,))
    return b.build(out)


def prog_node_types():
    b = Builder("ntypes")
    x = b.node_input("x", 4)
    k = (x.linear(b.param("Wk", (T, 4, 4), by="ntype")) + b.param("bk", (T, 4), by="ntype")).heads(2)
    ke = b.src(k).linear(b.param("Wr", (R, 2, 2, 2), by="etype"))
    e = ke * b.select(b.param("s", (T, 2), by="src_ntype"), ke) + (-b.dst(k))
    y = b.sum_to_dst(e).flat().sigmoid()
    g = b.select(b.param("gate", (T,), by="ntype"), x).tanh()
    return b.build(x + g * (y.linear(b.param("Wo", (T, 4, 4), by="ntype")) - x))


def bind(p, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for node in p.nodes:
        if node.op is Op.INPUT:
            out[node.attr("name")] = torch.randn((n,) + node.type.shape, generator=g, dtype=torch.float64)
        elif node.op is Op.PARAM:
            out[node.attr("name")] = 0.5 * torch.randn(node.type.shape, generator=g, dtype=torch.float64)
    return out


def graph_with_types():
    ei, et, nt = make_graph(node_types=T)
    return Graph(ei, et, 14, R, nt, T)


CASES = [pytest.param(lambda fn=fn: prog_attention(fn), id=f"attention-{fn}") for fn in ACTS] + [
    pytest.param(prog_node_types, id="node-types")]
OPTS = [Options(compact=False, reorder=False), Options(compact=True, reorder=True, force_reorder=True)]


@pytest.mark.parametrize("make", CASES)
@pytest.mark.parametrize("opts", OPTS, ids=["plain", "optimised"])
def test_generated_backward_gradcheck(make, opts):
    p, graph = make(), graph_with_types()
    leaves = bind(p, graph.num_nodes)
    compiled = compile_program(p, opts)
    names = list(leaves)

    def f(*ts):
        return apply(compiled, graph, dict(zip(names, ts, strict=True)))

    inputs = tuple(leaves[n].requires_grad_() for n in names)
    assert torch.autograd.gradcheck(f, inputs, atol=1e-7, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("make", CASES)
def test_generated_backward_matches_torch_autograd_of_interpreter(make):
    p, graph = make(), graph_with_types()
    leaves = {k: v.requires_grad_() for k, v in bind(p, graph.num_nodes, seed=1).items()}
    names = list(leaves)
    weights = torch.randn(graph.num_nodes, p.type_of(p.outputs[0]).shape[0], dtype=torch.float64)
    ref = interpret(p, graph, leaves)[p.outputs[0]]
    ref_grads = torch.autograd.grad((ref * weights).sum(), [leaves[n] for n in names])
    out = apply(compile_program(p, Options()), graph, leaves)
    grads = torch.autograd.grad((out * weights).sum(), [leaves[n] for n in names])
    assert rel_err(out, ref) < 1e-12
    for n, a, b in zip(names, grads, ref_grads, strict=True):
        assert rel_err(a, b) < 1e-10, n


def test_backward_is_generated_per_needed_gradient():
    p = prog_attention("tanh")
    compiled = compile_program(p, Options())
    only_x, _ = compiled.backward_for([(Op.INPUT, "x")])
    everything = compiled.full_backward
    assert only_x.grads_of == ((Op.INPUT, "x"),)
    assert only_x.program.count(Op.OUTER_SUM) == 0  # no weight gradients computed
    assert everything.program.count(Op.OUTER_SUM) > 0
    assert len(only_x.program.nodes) < len(everything.program.nodes)


def test_backward_is_optimised_by_the_same_passes():
    from hector.ir import Domain

    p = prog_attention("relu")
    raw = differentiate(p).program
    opt = compile_program(p, Options(compact=False, reorder=False)).full_backward.program

    def duplicates(prog):
        keys = [(n.op, n.args, n.attrs) for n in prog.nodes if n.op is not Op.DROPOUT_MASK]
        return len(keys) - len(set(keys))

    def edge_work(prog):
        return sum(1 for n in prog.nodes if n.type.domain is Domain.EDGE and n.op not in (Op.GATHER, Op.SELECT))

    assert duplicates(opt) == 0
    assert edge_work(opt) <= edge_work(raw)
    live = set(opt.outputs)
    for n in reversed(opt.nodes):
        if n.name in live:
            live.update(n.args)
    assert live >= {n.name for n in opt.nodes}  # no dead code


def test_saved_values_exclude_gathers():
    compiled = compile_program(prog_attention("exp"), Options())
    fwd = compiled.forward
    assert compiled.saved and all(fwd.node(s).op not in (Op.GATHER, Op.SELECT) for s in compiled.saved)
    assert set(compiled.saved) <= {n.name for n in fwd.nodes}


def test_differentiate_rejects_unknown_leaves():
    with pytest.raises(ValueError, match="not leaves"):
        differentiate(prog_node_types(), [(Op.PARAM, "nope")])
