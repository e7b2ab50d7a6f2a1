import torch
from conftest import make_graph

import hector.nn as hn
from hector.cost import choose_options, estimate, peak_bytes
from hector.lower.kernels import materialized_bytes
from hector.runtime.graph import Graph
from hector.runtime.reference import run_lowered

R = 3


def hub_graph(unique_sources: bool):
    """200 edges; either every edge has its own (source, relation) pair, or 5 sources send all of them."""
    g = torch.Generator().manual_seed(0)
    n, e = 220, 200
    dst = torch.randint(0, n, (e,), generator=g)
    if unique_sources:
        src, et = torch.arange(e), torch.randint(0, R, (e,), generator=g)
    else:
        src, et = torch.randint(0, 5, (e,), generator=g), torch.zeros(e, dtype=torch.long)
    return Graph(torch.stack([src, dst]), et, n, R)


def test_cost_model_compacts_when_pairs_repeat_or_to_avoid_scatter_atomics(monkeypatch):
    """Compaction pays where (source, relation) pairs repeat (fewer GEMM rows); for RGCN it also replaces the
    scatter GEMM's atomic adds by a destination-centric sum in registers, which pays even without repeats at the
    measured atomic rate, and not when atomics are free."""
    from hector import cost

    hub, flat = hub_graph(False), hub_graph(True)
    assert hub.num_unique <= 5 and flat.num_unique == flat.num_edges
    assert choose_options(hn.RGCNConv(16, 16, R), hub).compact is True
    assert choose_options(hn.RGCNConv(16, 16, R), flat).compact is True
    monkeypatch.setattr(cost, "ATOMIC_RATE", float("inf"))
    assert choose_options(hn.RGCNConv(16, 16, R), hub).compact is True
    assert choose_options(hn.RGCNConv(16, 16, R), flat).compact is False


def test_atomic_adds_counted_for_scatter_epilogues_only():
    """The uncompacted RGCN forward scatters every edge's message row into its destination with atomics (edges x
    width adds); the compacted one sums by destination in a traversal (none)."""
    from hector.passes import Options

    g = hub_graph(True)
    m = hn.RGCNConv(16, 24, R).eval()
    plain = estimate(m.compiled(g, options=Options(compact=False, reorder=False)).inference_lowered, g.stats())
    compact = estimate(m.compiled(g, options=Options(compact=True, reorder=False)).inference_lowered, g.stats())
    assert plain.atomic_adds == g.num_edges * 24 and compact.atomic_adds == 0
    assert plain.seconds - compact.seconds > 0


def test_cost_model_reorders_rgat_attention():
    m = hn.RGATConv(16, 16, R, heads=2)
    assert choose_options(m, hub_graph(True)).reorder is True


def test_materialised_bytes_are_what_the_backend_materialises():
    ei, et, _ = make_graph()
    g = Graph(ei, et, 14, R)
    m = hn.RGATConv(5, 4, R, heads=2)
    compiled = m.compiled(g)
    lw = compiled.forward_lowered
    leaves = {"x": torch.randn(14, 5), **{k: v.detach() for k, v in m.named_parameters()}}
    env = run_lowered(lw, g, leaves)
    measured = sum(env[name].numel() * env[name].element_size() for name in lw.materialized
                   if lw.program.type_of(name).domain.value != "param")
    assert materialized_bytes(lw, g.stats()) == measured
    est = estimate(lw, g.stats())
    assert est.materialized_bytes == measured and est.flops > 0 and est.moved_bytes >= measured
    assert 0 < peak_bytes(lw, g.stats()) <= measured


def test_backend_frees_values_after_their_last_reader():
    ei, et, _ = make_graph()
    g = Graph(ei, et, 14, R)
    m = hn.RGATConv(5, 4, R, heads=2)
    lw = m.compiled(g).forward_lowered
    leaves = {"x": torch.randn(14, 5), **{k: v.detach() for k, v in m.named_parameters()}}
    kept_all = run_lowered(lw, g, leaves)
    lean = run_lowered(lw, g, leaves, keep=())
    intermediates = set(lw.materialized) - set(lw.program.outputs)
    assert intermediates and intermediates <= set(kept_all)
    assert not intermediates & set(lean)
    assert torch.equal(lean[lw.program.outputs[0]], kept_all[lw.program.outputs[0]])


def test_memory_objective_picks_the_lowest_peak():
    from hector.cost import rows_for
    from hector.passes import Options

    for g in (hub_graph(False), hub_graph(True)):
        m = hn.RGATConv(16, 4, R, heads=4).eval()
        stats = g.stats()
        peaks = {}
        for compact in (False, True):
            for reorder in (False, True):
                opts = Options(compact=compact, reorder=reorder, rows=rows_for(stats))
                peaks[(compact, reorder)] = peak_bytes(m.compiled(None, options=opts).inference_lowered, stats)
        choice = choose_options(m, g, "memory")
        assert peaks[(choice.compact, choice.reorder)] == min(peaks.values())


def test_choice_is_made_once_per_size_class(monkeypatch):
    """Mini-batches of similar size share one decision (no cost model, no lowering per batch)."""
    import hector.cost as cost

    calls = []
    real = cost.training_estimate
    monkeypatch.setattr(cost, "training_estimate", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = hn.RGATConv(8, 4, R, heads=2)

    def batch(seed, n=300, e=1400):
        g = torch.Generator().manual_seed(seed)
        return Graph(torch.randint(0, n, (2, e), generator=g), torch.randint(0, R, (e,), generator=g), n, R)

    a, b = batch(0), batch(1)
    assert cost.size_class(a.stats()) == cost.size_class(b.stats())
    first = choose_options(m, a)
    assert calls, "the first graph is estimated"
    done = len(calls)
    assert choose_options(m, b) == first and len(calls) == done  # same size class: kept
    choose_options(m, batch(2, n=3000, e=10000))  # 10x larger: decided anew
    assert len(calls) > done


class _Stats:
    """A graph known only by its statistics (the cost model reads nothing else)."""

    def __init__(self, **stats):
        self.stats = stats

    def size_stats(self):
        return self.stats


AM = dict(num_nodes=881680, num_edges=5668682, num_unique=2267472, num_relations=108, num_node_types=7)


def test_sorted_scatter_chosen_where_it_removes_atomics(monkeypatch):
    """Training plans sum gradients by source and pair: the sorted plan has no atomic adds at all and is picked at
    the measured atomic rate; inference plans have none to remove (ties keep the atomic plan); the setting forces
    either way. With free atomics the choice follows the bytes: RGCN's sorted plan still wins (its sum into pairs
    joins the kernel computing the summed edge values, no per-edge temporary), RGAT's loses (its GEMM rows are
    written once more)."""
    from hector import config, cost
    from hector.cost import training_estimate

    g = _Stats(**AM)
    # Off by default (measured slower on an H100 than the estimate said): the atomic plan.
    assert config.sorted_scatter() == "off" and not choose_options(hn.RGCNConv(64, 64, 108).train(), g).sorted_scatter
    config.set_sorted_scatter("auto")
    for make in (lambda: hn.RGCNConv(64, 64, 108), lambda: hn.RGATConv(64, 16, 108, heads=4),
                 lambda: hn.HGTConv(64, 64, 7, 108, heads=4)):
        layer = make().train()
        chosen = choose_options(layer, g)
        assert chosen.sorted_scatter, type(layer).__name__
        est = training_estimate(layer.compiled(None, options=chosen), g.stats)
        assert est.atomic_adds == 0 and est.traversal_atomic_adds == 0, type(layer).__name__
        atomic = training_estimate(layer.compiled(None, options=cost.replace(chosen, sorted_scatter=False)), g.stats)
        assert atomic.atomic_adds + atomic.traversal_atomic_adds > 0
        layer.eval()
        assert not choose_options(layer, g).sorted_scatter
    layer = hn.RGCNConv(64, 64, 108).train()
    try:
        config.set_sorted_scatter("off")
        assert not choose_options(layer, g).sorted_scatter
        config.set_sorted_scatter("on")
        assert choose_options(hn.RGCNConv(64, 64, 108).eval(), g).sorted_scatter
        monkeypatch.setattr(cost, "ATOMIC_RATE", float("inf"))
        config.set_sorted_scatter("auto")
        assert choose_options(hn.RGCNConv(64, 64, 108).train(), g).sorted_scatter
        assert not choose_options(hn.RGATConv(64, 16, 108, heads=4).train(), g).sorted_scatter
    finally:
        config.set_sorted_scatter(None)
