import pytest

from hector.errors import DSLTypeError, IRVerificationError
from hector.ir import Builder, Domain, Node, Op, Program, VType, make_attrs, verify


def rgat_like(b: Builder):
    x = b.node_input("x", 4)
    w = b.param("W", (3, 4, 6), by="etype")
    a = b.param("a", (3, 6, 2), by="etype")
    h = b.src(x).linear(w)
    s = b.edge_softmax((b.dst(x).linear(w).linear(a) + h.linear(a)).leaky_relu(0.2))
    return b.build(b.sum_to_dst(h.heads(2) * s).flat())


def test_builder_types_every_value():
    p = rgat_like(Builder("t"))
    assert verify(p) is p
    types = {n.name: n.type for n in p.nodes}
    out = p.node(p.outputs[0])
    assert out.type == VType(Domain.NODE, (6,))
    assert any(t.domain is Domain.EDGE and t.shape == (2, 3) for t in types.values())


def test_printer_shows_ops_types_and_return():
    text = str(rgat_like(Builder("rgat")))
    assert text.startswith("program rgat {")
    assert "edge_softmax" in text and "gather" in text and "via='src'" in text
    assert "param[3,4,6] by etype" in text
    assert text.rstrip().endswith("}") and "return %" in text


@pytest.mark.parametrize("case, match", [
    ("node_plus_edge", "different domains.*src\\(x\\)/dst\\(x\\)"),
    ("bad_linear", "do not fit weight"),
    ("bad_index", "not defined on node rows"),
    ("softmax_on_nodes", "edge softmax normalises edge scores"),
    ("bad_heads", "cannot split 5 features into 2 heads"),
    ("edge_output", "must be node values"),
    ("bad_broadcast", "do not broadcast"),
    ("unknown_param", "no shape given"),
    ("dot_shapes", "inner product needs equal"),
    ("const_add", "only scaling by a constant"),
])
def test_dsl_type_errors_name_the_problem(case, match):
    b = Builder("bad")
    x = b.node_input("x", 5)
    with pytest.raises(DSLTypeError, match=match):
        if case == "node_plus_edge":
            _ = x + b.src(x)
        elif case == "bad_linear":
            x.linear(b.param("W", (4, 6)))
        elif case == "bad_index":
            x.linear(b.param("W", (3, 5, 6), by="etype"))
        elif case == "softmax_on_nodes":
            b.edge_softmax(x)
        elif case == "bad_heads":
            x.heads(2)
        elif case == "edge_output":
            b.build(b.src(x))
        elif case == "bad_broadcast":
            _ = b.src(x) * b.src(x).linear(b.param("W", (5, 3)))
        elif case == "unknown_param":
            b.param("nope")
        elif case == "dot_shapes":
            b.src(x).dot(b.src(x).linear(b.param("W", (5, 3))))
        elif case == "const_add":
            _ = x + 1.0


def test_dsl_rejects_values_of_other_programs_and_truth_tests():
    b1, b2 = Builder("a"), Builder("b")
    x1, x2 = b1.node_input("x", 3), b2.node_input("x", 3)
    with pytest.raises(DSLTypeError, match="not a value of this program"):
        _ = x1 + x2
    with pytest.raises(DSLTypeError, match="no truth value"):
        bool(x1)


def _prog(nodes, outputs=("y",)):
    return Program("bad", tuple(nodes), tuple(outputs))


X = Node("x", Op.INPUT, (), make_attrs(name="x", domain="node", shape=(4,)), VType(Domain.NODE, (4,)))
W = Node("w", Op.PARAM, (), make_attrs(name="w", shape=(4, 2), by=()), VType(Domain.PARAM, (4, 2)))


@pytest.mark.parametrize("nodes, outputs, match", [
    ([Node("y", Op.NEG, ("x",), (), VType(Domain.NODE, (4,))), X], ("y",), "uses %x before it is defined"),
    ([X, X], ("x",), "defined twice"),
    ([X, Node("y", Op.ADD, ("x",), (), VType(Domain.NODE, (4,)))], ("y",), "takes 2 argument"),
    ([X, Node("y", Op.GATHER, ("x",), (), VType(Domain.EDGE, (4,)))], ("y",), "missing attribute 'via'"),
    ([X, Node("y", Op.NEG, ("x",), (), VType(Domain.EDGE, (4,)))], ("y",), "stored type .* differs"),
    ([X, Node("y", Op.NEG, ("x",), (), None)], ("y",), "has no type"),
    ([X, W, Node("y", Op.LINEAR, ("w", "x"), make_attrs(transpose=False), VType(Domain.NODE, (2,)))], ("y",),
     "type error"),
    ([X], ("z",), "returns %z, which is not defined"),
    ([X], (), "returns nothing"),
    ([X, Node("y", Op.SCATTER_ADD, ("x",), make_attrs(via="dst"), VType(Domain.NODE, (4,)))], ("y",),
     "reads edge rows"),
])
def test_verifier_rejects_malformed_ir(nodes, outputs, match):
    with pytest.raises(IRVerificationError, match=match):
        verify(_prog(nodes, outputs))


def test_nodes_are_immutable():
    with pytest.raises(AttributeError):
        X.name = "z"  # type: ignore[misc]


def test_user_names_never_collide_with_temporaries():
    b = Builder("names")
    x = b.node_input("x", 3)
    y = x.relu()  # a temporary named like "v1"
    w = b.param(y.name, (3, 3))  # a param whose user-chosen name equals it
    p = b.build(y.linear(w))
    assert verify(p) is p and len({n.name for n in p.nodes}) == len(p.nodes)
    with pytest.raises(DSLTypeError, match="inputs and params are bound by name"):
        b.param("x", (3, 3))
