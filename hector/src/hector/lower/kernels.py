"""Lowering: fuse an optimised program into kernel specifications, the contract with the CUDA code generator.

Two kernel families (as in Hector):

* **GEMM-like** -- one per ``linear`` / ``outer_sum``: rows grouped by their type index (segment GEMM), the A
  operand read through a gather index when it is a gathered value (no per-edge copy), and the result optionally
  scattered (summed) into its destination rows when that is its only use.
* **Traversal-like** -- maximal runs of elementwise / inner-product / reduction ops over one iteration space:
  edge-parallel (destination-centric when it reduces by destination: edge softmax and aggregation fuse, and
  per-destination epilogue ops join), node-parallel, or pair-parallel (compacted values).

Plus small **param** kernels for weight-only ops (composed weights of reordering, basis decomposition).

Gathers and per-row param reads (``select``) are never materialised: each kernel that uses one reads through the
index. A value is *materialised* when another kernel reads it, when it is a program output, or when the backward
program keeps it; :func:`materialized_bytes` counts exactly those, which is what the cost model reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..ir.core import GATHER_VIA, Domain, Op, OpKind, Program

_VIRTUAL = (Op.GATHER, Op.SELECT)
_LEAVES = (Op.INPUT, Op.PARAM, Op.SAVED, Op.GRAPH)


@dataclass(frozen=True)
class Kernel:
    """One kernel of a lowered program."""

    name: str
    kind: str  # "gemm" | "traversal" | "param" | "rng"
    space: str  # iteration space: "edge" | "node" | "unique" | "param"
    nodes: tuple[str, ...]  # IR nodes evaluated, in order (virtual reads included)
    inputs: tuple[str, ...]  # materialised values (or leaves) read
    outputs: tuple[str, ...]  # values materialised
    layout: str
    detail: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        d = ", ".join(f"{k}={v}" for k, v in self.detail)
        return (f"{self.name} [{self.kind}/{self.space}] out={list(self.outputs)} in={list(self.inputs)}\n"
                f"    layout: {self.layout}" + (f"\n    {d}" if d else ""))


@dataclass(frozen=True)
class Lowered:
    program: Program
    kernels: tuple[Kernel, ...]
    materialized: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        return "\n".join(k.describe() for k in self.kernels)

    def count(self, kind: str) -> int:
        return sum(1 for k in self.kernels if k.kind == kind)


class _Group:
    def __init__(self, space: str):
        self.space = space
        self.nodes: list[str] = []
        self.post_dst: set[str] = set()  # node values reduced by destination inside this group
        self.final: set[str] = set()  # reduced by another key (atomics): usable only after the kernel
        self.reduces_dst = False
        self.atomics = False


def _space(domain: Domain) -> str:
    return {Domain.EDGE: "edge", Domain.NODE: "node", Domain.UNIQUE: "unique", Domain.PARAM: "param"}[domain]


def lower(program: Program, keep: Iterable[str] = (), fuse: bool = True, sorted_scatter: bool = False) -> Lowered:
    """Fuse ``program`` into kernels; values in ``keep`` (e.g. saved for backward) are materialised.
    ``fuse=False`` (ablation) gives every traversal op its own kernel and fuses no GEMM epilogue.

    ``sorted_scatter=True`` plans sums into rows without atomics: a GEMM's result is written row by row (no
    scatter epilogue) and summed by a traversal; a traversal with no reduction by destination that sums into rows
    by another index (edge -> source, edge -> pair, pair -> source) runs *target-centric* (detail ``centric``):
    one group of threads per target row walks that row's rows in an order sorted by the index, sums them in
    registers and writes the target row once. Edge values summed into their pair join the kernel that computes
    them (no per-edge temporary)."""
    p = _schedule(program)
    keep = set(keep) | set(p.outputs)
    virtual = {n.name for n in p.nodes if _is_virtual(n) and n.name not in keep}
    owner: dict[str, int] = {}  # node -> index of the group/kernel that computes it
    groups: list[Any] = []  # _Group or finished Kernel-like dicts, in execution order
    cur: _Group | None = None
    cur_idx = -1
    fused_scatter: dict[str, str] = {}  # scatter node -> linear node it was fused into

    def close():
        nonlocal cur, cur_idx
        cur, cur_idx = None, -1

    def open_group(space: str) -> None:
        nonlocal cur, cur_idx
        cur = _Group(space)
        groups.append(cur)
        cur_idx = len(groups) - 1

    def source(name: str) -> tuple[str, str | None]:
        """Look through virtual reads: (producing value, via of the last gather or None)."""
        n = p.node(name)
        via = None
        while n.name in virtual and n.op in (Op.GATHER, Op.RESHAPE):
            if n.op is Op.GATHER:
                via = n.attr("via") if via is None else via
            n = p.node(n.args[0])
        return n.name, via

    def arg_ok(arg: str, node_domain: Domain, op: Op) -> bool:
        """May a node of ``node_domain`` in the current group read ``arg``?"""
        n = p.node(arg)
        if n.op in _LEAVES or n.op is Op.SELECT:
            return True
        if n.name in virtual and n.op is Op.RESHAPE:  # a view: what matters is where its rows come from
            return arg_ok(n.args[0], node_domain, op)
        if n.op is Op.GATHER:
            src, via = source(arg)
            if owner.get(src) != cur_idx:
                return True  # reads a materialised value through an index
            return via == "dst" and src in cur.post_dst  # same destination: still in registers
        if owner.get(arg) != cur_idx:
            return True
        if arg in cur.final:
            return False
        t = p.type_of(arg)
        if t.domain is node_domain:
            return node_domain is not Domain.NODE or cur.space != "edge" or arg in cur.post_dst
        if op is Op.SCATTER_ADD and sorted_scatter and node_domain is Domain.UNIQUE and t.domain is Domain.EDGE:
            return True  # edge -> pair sum: the pair-centric walk sums it in registers
        return op is Op.SCATTER_ADD and node_domain is Domain.NODE  # edge -> dst reduction

    for n in p.nodes:
        if n.op in _LEAVES or n.name in virtual or n.name in fused_scatter:
            continue
        t = n.type
        if n.op is Op.DROPOUT_MASK:
            groups.append(dict(kind="rng", space=_space(t.domain), nodes=[n.name], layout="counter-based RNG, "
                               "one draw per element (kept for backward)"))
            owner[n.name] = len(groups) - 1
            continue
        if n.op in (Op.LINEAR, Op.OUTER_SUM):
            close()
            x = n.args[0]
            xsrc, xvia = source(x)
            wname = n.args[1]
            wt = p.type_of(wname) if n.op is Op.LINEAR else n.type
            by = wt.by
            users = p.users[n.name]
            scatter = scale = None
            if fuse and not sorted_scatter and n.op is Op.LINEAR and len(users) == 1 and users[0] != "<output>" \
                    and n.name not in keep:
                u = p.node(users[0])
                if u.op is Op.MUL and u.name not in keep and u.args[0] != u.args[1]:
                    # row-scale epilogue (e.g. RGCN's 1/|N_r(i)|), then a scatter: gather -> matmul -> scale -> sum
                    other = u.args[1] if u.args[0] == n.name else u.args[0]
                    u_users = p.users[u.name]
                    # (the scale's sources must already be computed: the GEMM may not wait for a later kernel)
                    if _row_read(p, other, virtual, owner) and len(u_users) == 1 and u_users[0] != "<output>" \
                            and p.node(u_users[0]).op is Op.SCATTER_ADD:
                        scale, scatter = u, p.node(u_users[0])
                elif u.op is Op.SCATTER_ADD:
                    scatter = u
            for m in (scale, scatter):
                if m is not None:
                    fused_scatter[m.name] = n.name
            rows = p.type_of(x).domain
            core = wt.shape[len(by):]
            layout = (f"{rows.value} rows grouped by {'x'.join(by)} (segment GEMM, one weight per segment)"
                      if by else f"{rows.value} rows, one shared weight (dense GEMM)")
            if xvia:
                layout += f"; A rows gathered via {xvia}"
            if scale is not None:
                layout += f"; C rows scaled by %{scale.args[1] if scale.args[0] == n.name else scale.args[0]}"
            if scatter is not None:
                layout += f"; C rows summed into {GATHER_VIA[scatter.attr('via')][0].value} rows via " \
                          f"{scatter.attr('via')} (atomic epilogue)"
            if n.op is Op.OUTER_SUM:
                layout = f"{rows.value} rows grouped by {'x'.join(by) or 'nothing'}; per segment C += A^T B " \
                         "(weight gradient)"
            detail = dict(op=n.op.value, by=by, a=xsrc, a_via=xvia, b=source(n.args[1])[0],
                          transpose=bool(n.attr("transpose")), weight_core=core)
            nodes = [n.name] + [m.name for m in (scale, scatter) if m is not None]
            groups.append(dict(kind="gemm", space=_space(rows), nodes=nodes, layout=layout, detail=detail))
            for m in nodes:
                owner[m] = len(groups) - 1
            continue
        into = _accumulate_into(p, n, keep, groups, owner) if fuse else None
        if into is not None:
            # a weight gradient summed from two parts: the outer sum adds its tiles into the other part's buffer
            x, y = into
            g = groups[owner[x]]
            g["nodes"].append(n.name)
            g["detail"] = dict(g["detail"], accumulate=y)
            g["layout"] += f"; accumulated into %{y} (no zero-filled buffer, no separate sum)"
            owner[n.name] = owner[x]
            continue
        if t.domain is Domain.PARAM and n.op is not Op.SELECT_SUM:
            if cur is not None and any(owner.get(source(a)[0]) == cur_idx for a in n.args):
                close()
            groups.append(dict(kind="param", space="param", nodes=[n.name], layout="weights only (once per call)"))
            owner[n.name] = len(groups) - 1
            continue
        # traversal op
        dom = t.domain if t.domain is not Domain.PARAM else p.type_of(n.args[0]).domain  # select_sum reads rows
        space = _space(dom)
        if n.op is Op.SCATTER_ADD:
            space = _space(p.type_of(n.args[0]).domain)
        # node-wise args seen through views (a reshape of a reduced value is that value)
        srcs = [source(a)[0] if t.domain is Domain.NODE else a for a in n.args]
        joinable = fuse and cur is not None and all(arg_ok(a, t.domain, n.op) for a in n.args) and (
            cur.space == space or (cur.space == "edge" and t.domain is Domain.NODE
                                   and all(owner.get(a) == cur_idx or p.node(a).op in _LEAVES
                                           or p.node(a).op is Op.SELECT for a in srcs)))
        if joinable and t.domain is Domain.NODE and n.op is not Op.SCATTER_ADD and cur.space == "edge":
            joinable = any(a in cur.post_dst for a in srcs)
        if joinable and sorted_scatter and cur.space == "edge":
            # a destination walk and a walk by another index cannot be one kernel: keep the sum by source or pair
            # atomic-free in a kernel of its own (its operand written once) rather than atomic in the dst walk
            by_dst = n.op is Op.EDGE_SOFTMAX or (n.op is Op.SCATTER_ADD and n.attr("via") == "dst")
            by_other = n.op is Op.SCATTER_ADD and n.attr("via") != "dst"
            joinable = not ((by_other and cur.reduces_dst) or (by_dst and _atomic_vias(p, cur) - {"dst"}))
        if not joinable:
            close()
            open_group(space)
        cur.nodes.append(n.name)
        owner[n.name] = cur_idx
        if n.op is Op.SCATTER_ADD and n.attr("via") == "dst":
            cur.post_dst.add(n.name)
            cur.reduces_dst = True
        elif n.op is Op.SCATTER_ADD or n.op is Op.SELECT_SUM:
            cur.final.add(n.name)
            cur.atomics = True
        elif n.op is Op.EDGE_SOFTMAX:
            cur.reduces_dst = True
        elif t.domain is Domain.NODE and cur.space == "edge":
            cur.post_dst.add(n.name)

    order = _toposort(p, groups, owner, virtual)
    # outputs: values read by another kernel, returned, or kept
    kernels: list[Kernel] = []
    users = p.users
    for idx in order:
        g = groups[idx]
        if isinstance(g, _Group):
            kind, space, names = "traversal", g.space, list(g.nodes)
            if g.space == "edge" and g.reduces_dst:
                layout = ("edge-parallel, destination-centric (CSC: each block walks one destination's in-edges; "
                          "softmax and sum by destination without atomics)")
            elif g.space == "edge":
                layout = "edge-parallel, any edge order"
            else:
                layout = f"{g.space}-parallel"
            detail = {}
            centric = _centric(p, g) if sorted_scatter and not g.reduces_dst else None
            if centric is not None:
                detail["centric"] = centric
                target = GATHER_VIA[centric][0].value
                layout = (f"{target}-centric over {g.space} rows sorted by {centric} (each group walks one {target} "
                          f"row's {g.space} rows, sums by {centric} in registers, writes the row once)")
            if g.atomics and (centric is None or _atomic_vias(p, g) - {centric} or _has_select_sum(p, g)):
                layout += "; atomic scatter for reductions by source / pair / type"
        else:
            kind, space, names, layout = g["kind"], g["space"], list(g["nodes"]), g["layout"]
            detail = g.get("detail", {})
        members = set(names)
        outputs = [m for m in names if m in keep or any(u != "<output>" and owner.get(u) != idx
                                                         and u not in virtual for u in users[m])
                   or any(u != "<output>" and u in virtual and _virtual_escapes(p, u, owner, idx, virtual)
                          for u in users[m])]
        if kind == "gemm" and len(names) > 1:  # a fused epilogue's result is what the GEMM writes
            outputs = [names[-1]] if names[-1] in outputs or names[-1] in keep else outputs
        # Bring in the virtual reads this kernel needs, in dependency order.
        ordered: list[str] = []
        reads: list[str] = []

        for m in names:
            for a in p.node(m).args:
                _need(p, a, members, ordered, reads, virtual)
            ordered.append(m)
        kernels.append(Kernel(f"k{idx}_{kind}", kind, space, tuple(ordered), tuple(reads), tuple(outputs), layout,
                              tuple(sorted(detail.items()))))
    materialized = tuple(o for k in kernels for o in k.outputs)
    return Lowered(p, tuple(kernels), materialized)


# ops whose param-domain result is a buffer of the call's own, in the accumulation dtype (weight-only kernels, weight
# gradients, and sums of them: a param kernel's or an earlier accumulation's)
_OWN_PARAM_BUFFER = (Op.EINSUM, Op.OUTER_SUM, Op.ADD)


def _accumulate_into(p: Program, n: Any, keep: set[str], groups: list, owner: Mapping[str, int]) \
        -> tuple[str, str] | None:
    """For ``n`` = ``add(x, y)`` of two weight-sized values where ``x`` is a weight gradient's outer sum read by
    nothing else and ``y`` a buffer computed earlier in the call and read by nothing else: (x, y), so that the outer
    sum's kernel adds its tiles into ``y``'s buffer and that buffer becomes ``n``. A gradient of a weight used twice
    (e.g. RGAT's source and destination projections, or a reordered composition) otherwise costs a zero fill and a
    separate elementwise sum of the whole per-relation weight per step, which at thousands of relations is more
    traffic than the batch's own. None where the pattern does not hold."""
    if n.op is not Op.ADD or n.type.domain is not Domain.PARAM or n.args[0] == n.args[1]:
        return None
    users = p.users
    for x, y in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
        nx, ny = p.node(x), p.node(y)
        if nx.op is not Op.OUTER_SUM or ny.op not in _OWN_PARAM_BUFFER or x in keep or y in keep:
            continue
        if users[x] != [n.name] or users[y] != [n.name] or nx.type != n.type or ny.type != n.type:
            continue
        g = groups[owner[x]] if x in owner else None
        if isinstance(g, dict) and g["nodes"] == [x] and "accumulate" not in g.get("detail", {}) and y in owner:
            return x, y
    return None


def _atomic_vias(p: Program, g: _Group) -> set[str]:
    """Indices by which a traversal group sums into rows with atomics (not by its destination walk)."""
    return {p.node(m).attr("via") for m in g.final if p.node(m).op is Op.SCATTER_ADD}


def _has_select_sum(p: Program, g: _Group) -> bool:
    return any(p.node(m).op is Op.SELECT_SUM for m in g.final)


def _centric(p: Program, g: _Group) -> str | None:
    """The index a target-centric walk of the group follows: the one its largest atomic sums go through."""
    sizes: dict[str, int] = {}
    for m in g.final:
        n = p.node(m)
        if n.op is Op.SCATTER_ADD and n.attr("via") != "dst":
            sizes[n.attr("via")] = sizes.get(n.attr("via"), 0) + n.type.numel
    return max(sizes, key=lambda v: (sizes[v], v)) if sizes else None


def _schedule(p: Program) -> Program:
    """Reorder nodes (dependencies kept) so GEMMs and weight ops run as early as their inputs allow. Traversal
    ops then sit next to each other and fuse: e.g. the message GEMM no longer splits edge softmax from the
    aggregation that consumes it."""
    early = (Op.LINEAR, Op.OUTER_SUM, Op.EINSUM, Op.INPUT, Op.PARAM, Op.SAVED, Op.GRAPH)
    index = {n.name: i for i, n in enumerate(p.nodes)}
    waiting = {n.name: len(set(n.args)) for n in p.nodes}
    users: dict[str, set[str]] = {n.name: set() for n in p.nodes}
    for n in p.nodes:
        for a in set(n.args):
            users[a].add(n.name)
    ready = [n.name for n in p.nodes if waiting[n.name] == 0]
    order: list[str] = []
    while ready:
        ready.sort(key=lambda m: (p.node(m).op not in early and not (p.node(m).op is Op.RESHAPE
                                                                   and p.node(m).type.domain is Domain.PARAM),
                                  index[m]))
        m = ready.pop(0)
        order.append(m)
        for u in users[m]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    return p.with_nodes([p.node(m) for m in order])


def _row_read(p: Program, name: str, virtual: set[str], owner: Mapping[str, int]) -> bool:
    """Can a kernel read ``name`` row by row without computing anything: a leaf, or views/gathers of leaves and of
    values already computed by earlier kernels?"""
    n = p.node(name)
    if n.op in _LEAVES:
        return True
    if name not in virtual:
        return name in owner
    return all(_row_read(p, a, virtual, owner) for a in n.args)


def _is_virtual(n) -> bool:
    """Gathers, per-row param reads and reshapes (views) are evaluated inside each kernel that uses them."""
    return n.op in _VIRTUAL or (n.op is Op.RESHAPE and n.type.domain is not Domain.PARAM)


def _need(p: Program, a: str, members: set[str], ordered: list[str], reads: list[str], virtual: set[str]) -> None:
    """Record that a kernel reads ``a``: virtual reads are evaluated inside it, anything else is an input."""
    node = p.node(a)
    if a in virtual:
        for b in node.args:
            _need(p, b, members, ordered, reads, virtual)
        if a not in ordered:
            ordered.append(a)
    elif a not in members and a not in reads:
        reads.append(a)


def _toposort(p: Program, groups: list, owner: Mapping[str, int], virtual: set[str]) -> list[int]:
    """Kernel order: dependencies first, otherwise creation order (independent weight kernels move early)."""
    deps: list[set[int]] = []
    for idx, g in enumerate(groups):
        names = g.nodes if isinstance(g, _Group) else g["nodes"]
        d: set[int] = set()
        stack = [a for m in names for a in p.node(m).args]
        while stack:
            a = stack.pop()
            if a in virtual:
                stack.extend(p.node(a).args)
            elif a in owner and owner[a] != idx:
                d.add(owner[a])
        deps.append(d)
    done: list[int] = []
    placed: set[int] = set()
    while len(done) < len(groups):
        for idx in range(len(groups)):
            if idx not in placed and deps[idx] <= placed:
                done.append(idx)
                placed.add(idx)
                break
        else:  # pragma: no cover - fusion only merges along program order, so no cycle can form
            raise AssertionError("cyclic kernel dependencies")
    return done


def _virtual_escapes(p: Program, name: str, owner: Mapping[str, int], idx: int, virtual: set[str]) -> bool:
    """Does a virtual read of a value from kernel ``idx`` get used by another kernel?"""
    for u in p.users[name]:
        if u == "<output>":
            return True
        if u in virtual:
            if _virtual_escapes(p, u, owner, idx, virtual):
                return True
        elif owner.get(u) != idx:
            return True
    return False


def row_count(domain: Domain, stats: Mapping[str, int]) -> int:
    return {Domain.NODE: stats["num_nodes"], Domain.EDGE: stats["num_edges"], Domain.UNIQUE: stats["num_unique"],
            Domain.PARAM: 1}[domain]


def value_bytes(p: Program, name: str, stats: Mapping[str, int], itemsize: int = 4) -> int:
    t = p.type_of(name)
    return row_count(t.domain, stats) * t.numel * itemsize


def materialized_bytes(lowered: Lowered, stats: Mapping[str, int], itemsize: int = 4,
                       include_params: bool = False) -> int:
    """Bytes written to memory by the kernels' outputs (row values; params too if asked)."""
    total = 0
    for name in lowered.materialized:
        t = lowered.program.type_of(name)
        if t.domain is Domain.PARAM and not include_params:
            continue
        total += value_bytes(lowered.program, name, stats, itemsize)
    return total


__all__ = ["Kernel", "Lowered", "OpKind", "lower", "materialized_bytes", "row_count", "value_bytes"]
