"""The reference backend: executes IR nodes with torch ops (CPU or GPU).

It is the fallback where no generated kernel exists and the correctness oracle for generated ones. ``REFERENCE``
gives every op its meaning (one entry per op); :func:`interpret` runs a program node by node (differentiable by
torch autograd, which tests use as an independent check of the generated backward); :func:`run_lowered` runs a
lowered program kernel by kernel, keeping only the values a kernel materialises, so its memory behaviour follows the
kernel plan.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..ir.core import GATHER_VIA, Domain, Node, Op, Program
from .einsum import einsum
from .graph import Graph


def _bcast(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Prefix broadcasting: append singleton dims so a [rows, H] tensor combines with [rows, H, D]."""
    return t.reshape(t.shape + (1,) * (ndim - t.dim())) if t.dim() < ndim else t


def _binary(op: Op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    nd = max(a.dim(), b.dim())
    a, b = _bcast(a, nd), _bcast(b, nd)
    if op is Op.ADD:
        return a + b
    if op is Op.SUB:
        return a - b
    return a * b


def _act(fn: str, x: torch.Tensor, slope: float) -> torch.Tensor:
    if fn == "exp":
        return torch.exp(x)
    if fn == "relu":
        return torch.relu(x)
    if fn == "leaky_relu":
        return torch.nn.functional.leaky_relu(x, slope)
    if fn == "sigmoid":
        return torch.sigmoid(x)
    if fn == "tanh":
        return torch.tanh(x)
    return torch.nn.functional.gelu(x)


def _act_grad(fn: str, a: torch.Tensor, dy: torch.Tensor, slope: float) -> torch.Tensor:
    """d act / d x times dy; ``a`` is the output y for exp/sigmoid/tanh and the input x otherwise."""
    if fn == "exp":
        return dy * a
    if fn == "sigmoid":
        return dy * a * (1 - a)
    if fn == "tanh":
        return dy * (1 - a * a)
    if fn == "relu":
        return dy * (a > 0).to(dy.dtype)
    if fn == "leaky_relu":
        return dy * torch.where(a > 0, torch.ones_like(a), torch.full_like(a, slope))
    cdf = 0.5 * (1 + torch.erf(a / math.sqrt(2)))
    pdf = torch.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)
    return dy * (cdf + a * pdf)


def _mm(x: torch.Tensor, w: torch.Tensor, head: bool, transpose: bool) -> torch.Tensor:
    if head:
        return torch.einsum("rho,hio->rhi" if transpose else "rhi,hio->rho", x, w)
    return x @ (w.t() if transpose else w)


def _mm_rows(x: torch.Tensor, w: torch.Tensor, head: bool, transpose: bool) -> torch.Tensor:
    """Row i times its own weight ``w[i]`` (a batched matmul over rows of small types)."""
    if head:
        return torch.einsum("rho,rhio->rhi" if transpose else "rhi,rhio->rho", x, w)
    return torch.bmm(x.unsqueeze(1), w.transpose(1, 2) if transpose else w).squeeze(1)


# Types with at least this many rows get one dense matmul each; the rows of all smaller types share batched
# matmuls with per-row weights, so the Python loop runs over at most rows / DENSE_ROWS types (not over every
# relation of a model with thousands).
DENSE_ROWS = 128


def _weight_tile(core: tuple[int, ...], itemsize: int, device_type: str) -> int:
    """Rows per batched per-row-weight matmul: the gathered weights take at most 8 reference tiles of memory."""
    from .. import config

    return max(1, 8 * config.tile_bytes(device_type) // max(1, math.prod(core) * itemsize))


def _chunks(graph: Graph, domain: Domain, by: tuple[str, ...], step: int, wstep: int):
    """(rows, t): the segment chunks of ``graph.segment_chunks`` cut into pieces of at most ``step`` rows (and
    ``wstep`` rows where each row reads its own weight)."""
    for rows, t in graph.segment_chunks(domain, by, DENSE_ROWS):
        size = step if isinstance(t, int) else min(step, wstep)
        for a in range(0, rows.numel(), size):
            yield rows[a:a + size], (t if isinstance(t, int) else t[a:a + size])


def _segment_mm(x: torch.Tensor, wflat: torch.Tensor, t: Any, head: bool, transpose: bool) -> torch.Tensor:
    if isinstance(t, int):
        return _mm(x, wflat[t], head, transpose)
    return _mm_rows(x, wflat.index_select(0, t), head, transpose)


def _linear(node: Node, x: torch.Tensor, w: torch.Tensor, wtype, xdomain: Domain, graph: Graph,
            row_index: torch.Tensor | None = None) -> torch.Tensor:
    """Row i times W[type(i)]. With ``row_index``, row i of the operand is ``x[row_index[i]]`` (a fused gather:
    only one chunk's rows are gathered at a time)."""
    by = wtype.by
    core = w.shape[len(by):]
    head, transpose = len(core) == 3, bool(node.attr("transpose"))
    if not by:
        return _mm(x if row_index is None else x.index_select(0, row_index), w, head, transpose)
    # Segmented GEMM: rows grouped by type, one dense matmul per large type (no per-row weight copies), the rows
    # of small types in batched matmuls with per-row weights.
    wflat = w.reshape(-1, *core)
    dout = core[-2] if transpose else core[-1]
    n = x.size(0) if row_index is None else row_index.numel()
    out = x.new_empty((n,) + ((core[0], dout) if head else (dout,)))
    wstep = _weight_tile(core, w.element_size(), graph.device.type)
    for rows, t in _chunks(graph, xdomain, by, n or 1, wstep):
        src = rows if row_index is None else row_index.index_select(0, rows)
        out[rows] = _segment_mm(x.index_select(0, src), wflat, t, head, transpose)
    return out


def _outer_sum(node: Node, x: torch.Tensor, dy: torch.Tensor, xdomain: Domain, graph: Graph) -> torch.Tensor:
    by, shape = tuple(node.attr("by", ())), tuple(node.attr("shape"))
    core = shape[len(by):]
    eq = "rhi,rho->hio" if len(core) == 3 else "ri,ro->io"
    if not by:
        return torch.einsum(eq, x, dy)
    out = x.new_zeros((math.prod(shape[:len(by)]),) + core)
    per_row = "rhi,rho->rhio" if len(core) == 3 else "ri,ro->rio"
    wstep = _weight_tile(core, x.element_size(), graph.device.type)
    for rows, t in _chunks(graph, xdomain, by, max(1, x.size(0)), wstep):
        if isinstance(t, int):
            out[t] += torch.einsum(eq, x[rows], dy[rows])
        else:
            out.index_add_(0, t, torch.einsum(per_row, x[rows], dy[rows]))
    return out.reshape(shape)


def _edge_softmax(s: torch.Tensor, graph: Graph) -> torch.Tensor:
    n = graph.num_nodes
    idx = graph.dst.reshape((-1,) + (1,) * (s.dim() - 1)).expand_as(s)
    # Subtract each destination's max so exp never overflows (no gradient flows through the max: it cancels).
    m = torch.full((n,) + s.shape[1:], -math.inf, dtype=s.dtype, device=s.device)
    m = m.scatter_reduce(0, idx, s.detach(), "amax", include_self=True)
    e = torch.exp(s - m.index_select(0, graph.dst))
    z = torch.zeros_like(m).index_add_(0, graph.dst, e)
    return e / z.index_select(0, graph.dst)


def _ref_dropout_mask(node, args, types, graph, leaf, dtype):
    p = node.attr("p")
    rows = graph.num_rows(Domain(node.attr("domain")))
    keep = torch.rand((rows,) + tuple(node.attr("shape")), dtype=dtype, device=graph.device) >= p
    return keep.to(dtype) / (1.0 - p)


def _ref_scatter_add(node, args, types, graph, leaf, dtype):
    rows = graph.num_rows(GATHER_VIA[node.attr("via")][0])
    x = args[0]
    return x.new_zeros((rows,) + x.shape[1:]).index_add_(0, graph.gather_index(node.attr("via")), x)


def _ref_select(node, args, types, graph, leaf, dtype):
    p, by = args[0], types[0].by
    domain = Domain(node.attr("domain"))
    rows = graph.num_rows(domain)
    if not by:
        return p.unsqueeze(0).expand((rows,) + p.shape)
    core = p.shape[len(by):]
    return p.reshape((-1,) + core).index_select(0, graph.combined_index(domain, by))


def _ref_select_sum(node, args, types, graph, leaf, dtype):
    by, shape = tuple(node.attr("by", ())), tuple(node.attr("shape"))
    dy = args[0]
    if not by:
        return dy.sum(0)
    core = shape[len(by):]
    out = dy.new_zeros((math.prod(shape[:len(by)]),) + core)
    return out.index_add_(0, graph.combined_index(types[0].domain, by), dy).reshape(shape)


def _ref_reduce_last(node, args, types, graph, leaf, dtype):
    x = args[0]
    keep = 1 + len(node.attr("shape"))
    return x.sum(dim=tuple(range(keep, x.dim()))) if x.dim() > keep else x


def _ref_expand(node, args, types, graph, leaf, dtype):
    x = args[0]
    shape = (x.size(0),) + tuple(node.attr("shape"))
    return _bcast(x, len(shape)).expand(shape).contiguous()


def _ref_reshape(node, args, types, graph, leaf, dtype):
    x = args[0]
    if types[0].domain is Domain.PARAM:  # params carry their full shape
        return x.reshape(tuple(node.attr("shape")))
    return x.reshape((x.size(0),) + tuple(node.attr("shape")))


def _ref_leaf(node, args, types, graph, leaf, dtype):
    return leaf[node.attr("name")]


# The meaning of every op in torch: (node, args, arg types, graph, leaf bindings, dtype) -> tensor. One entry per
# op (tests/test_opdefs.py checks none is missing); the op's type rule, derivative and cost are in hector.ir.opdefs.
REFERENCE: dict[Op, Any] = {
    Op.INPUT: _ref_leaf,
    Op.PARAM: _ref_leaf,
    Op.SAVED: _ref_leaf,
    Op.GRAPH: lambda node, args, types, graph, leaf, dtype: graph.graph_const(node.attr("kind"), dtype),
    Op.DROPOUT_MASK: _ref_dropout_mask,
    Op.GATHER: lambda node, args, types, graph, leaf, dtype: args[0].index_select(
        0, graph.gather_index(node.attr("via"))),
    Op.SCATTER_ADD: _ref_scatter_add,
    Op.LINEAR: lambda node, args, types, graph, leaf, dtype: _linear(node, args[0], args[1], types[1],
                                                                    types[0].domain, graph),
    Op.OUTER_SUM: lambda node, args, types, graph, leaf, dtype: _outer_sum(node, args[0], args[1], types[0].domain,
                                                                          graph),
    Op.SELECT: _ref_select,
    Op.SELECT_SUM: _ref_select_sum,
    Op.EINSUM: lambda node, args, types, graph, leaf, dtype: einsum(node.attr("equation"), args[0], args[1]),
    Op.ADD: lambda node, args, types, graph, leaf, dtype: _binary(Op.ADD, args[0], args[1]),
    Op.SUB: lambda node, args, types, graph, leaf, dtype: _binary(Op.SUB, args[0], args[1]),
    Op.MUL: lambda node, args, types, graph, leaf, dtype: _binary(Op.MUL, args[0], args[1]),
    Op.NEG: lambda node, args, types, graph, leaf, dtype: -args[0],
    Op.SCALE: lambda node, args, types, graph, leaf, dtype: args[0] * node.attr("c"),
    Op.ACT: lambda node, args, types, graph, leaf, dtype: _act(node.attr("fn"), args[0], node.attr("slope", 0.0)),
    Op.ACT_GRAD: lambda node, args, types, graph, leaf, dtype: _act_grad(node.attr("fn"), args[0], args[1],
                                                                        node.attr("slope", 0.0)),
    Op.INNER: lambda node, args, types, graph, leaf, dtype: (args[0] * args[1]).sum(-1),
    Op.REDUCE_LAST: _ref_reduce_last,
    Op.EXPAND: _ref_expand,
    Op.RESHAPE: _ref_reshape,
    Op.CONCAT: lambda node, args, types, graph, leaf, dtype: torch.cat([args[0], args[1]], dim=-1),
    Op.SLICE: lambda node, args, types, graph, leaf, dtype: args[0][..., node.attr("start"):node.attr("stop")],
    Op.EDGE_SOFTMAX: lambda node, args, types, graph, leaf, dtype: _edge_softmax(args[0], graph),
}


def eval_node(node: Node, args: list[torch.Tensor], types: list, graph: Graph, leaf: Mapping[str, Any],
              dtype: torch.dtype) -> torch.Tensor:
    """The meaning of one op (its :data:`REFERENCE` entry). ``types`` are the argument types; ``leaf`` resolves
    INPUT/PARAM/SAVED names."""
    return REFERENCE[node.op](node, args, types, graph, leaf, dtype)


def interpret(program: Program, graph: Graph, leaves: Mapping[str, Any], dtype: torch.dtype | None = None,
              env: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Run every node in order; returns all values by name (differentiable by torch autograd)."""
    if dtype is None:
        dtype = next((t.dtype for t in leaves.values() if torch.is_tensor(t) and t.is_floating_point()),
                     torch.float32)
    env = {} if env is None else env
    for node in program.nodes:
        if node.name in env:
            continue
        args = [env[a] for a in node.args]
        types = [program.by_name[a].type for a in node.args]
        env[node.name] = eval_node(node, args, types, graph, leaves, dtype)
    return env


_HALF = (torch.bfloat16, torch.float16)


def _no_autocast(device: torch.device) -> Any:
    """Autocast off while the reference backend runs: its torch ops must keep the program's dtypes (autocast would
    run matmuls in bf16 and exp or sums in float32, and mix them)."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def run_lowered(lowered, graph: Graph, leaves: Mapping[str, Any], dtype: torch.dtype | None = None,
                keep: Any = None) -> dict[str, torch.Tensor]:
    """Run a lowered program kernel by kernel. Values a kernel does not materialise are dropped when it ends, and
    materialised values are dropped after their last reader unless they are outputs or in ``keep`` (None: keep
    everything), so peak memory follows the kernel plan (up to torch's temporaries inside a kernel).

    Half-precision programs (bfloat16 or float16 leaves) compute in float32, as the generated kernels accumulate,
    and return their outputs in the half dtype; kept values stay in float32."""
    floats = [t.dtype for t in leaves.values() if torch.is_tensor(t) and t.is_floating_point()]
    half = next((d for d in floats if d in _HALF), None)
    with _no_autocast(graph.device):
        if half is None or dtype is not None:
            return _run_lowered(lowered, graph, leaves, dtype, keep)
        wide = {k: v.float() if torch.is_tensor(v) and v.dtype in _HALF else v for k, v in leaves.items()}
        env = _run_lowered(lowered, graph, wide, torch.float32, keep)
        for name in lowered.program.outputs:
            env[name] = env[name].to(half)
        return env


def _run_lowered(lowered, graph: Graph, leaves: Mapping[str, Any], dtype: torch.dtype | None,
                 keep: Any) -> dict[str, torch.Tensor]:
    program = lowered.program
    if dtype is None:
        dtype = next((t.dtype for t in leaves.values() if torch.is_tensor(t) and t.is_floating_point()),
                     torch.float32)
    env: dict[str, torch.Tensor] = {}
    last_use: dict[str, int] = {}
    if keep is not None:
        keep = set(keep) | set(program.outputs)
        for i, kernel in enumerate(lowered.kernels):
            for name in kernel.inputs:
                last_use[name] = i
    for node in program.nodes:  # leaves are bindings, not kernels
        if node.op in (Op.INPUT, Op.PARAM, Op.SAVED, Op.GRAPH):
            env[node.name] = eval_node(node, [], [], graph, leaves, dtype)
    for i, kernel in enumerate(lowered.kernels):
        if keep is not None and i:
            for name in [n for n, last in last_use.items() if last == i - 1 and n not in keep]:
                env.pop(name, None)
        if kernel.kind == "gemm" and program.by_name[kernel.nodes[-1]].op is Op.SCATTER_ADD:
            _run_gemm_scatter(program, kernel, graph, env, leaves, dtype)
            continue
        if _chunkable(program, kernel) and graph.num_edges > tile_rows(program, kernel, graph, dtype):
            _run_chunked(program, kernel, graph, env, leaves, dtype, tile_rows(program, kernel, graph, dtype))
            continue
        local: dict[str, torch.Tensor] = {}
        fused = _fused_gather(program, kernel)
        for name in kernel.nodes:
            node = program.by_name[name]
            if name in fused:  # the GEMM reads through the index instead
                continue
            if kernel.kind == "gemm" and node.op is Op.LINEAR and node.args[0] in fused:
                gather = program.by_name[node.args[0]]
                x = local[gather.args[0]] if gather.args[0] in local else env[gather.args[0]]
                w = local[node.args[1]] if node.args[1] in local else env[node.args[1]]
                local[name] = _linear(node, x, w, program.by_name[node.args[1]].type, gather.type.domain, graph,
                                      graph.gather_index(gather.attr("via")))
                continue
            args = [local[a] if a in local else env[a] for a in node.args]
            types = [program.by_name[a].type for a in node.args]
            local[name] = eval_node(node, args, types, graph, leaves, dtype)
        for name in kernel.outputs:
            env[name] = local[name]
        del local
    if keep is not None:
        leaves_ = {n.name for n in program.nodes if n.op in (Op.INPUT, Op.PARAM, Op.SAVED, Op.GRAPH)}
        for name in [n for n in env if n not in keep and n not in leaves_]:
            del env[name]
    return env


def _fused_gather(program: Program, kernel) -> set[str]:
    """Gathers feeding only this GEMM kernel's linear map as its row operand: executed inside the GEMM."""
    if kernel.kind != "gemm":
        return set()
    out = set()
    members = set(kernel.nodes)
    for name in kernel.nodes:
        node = program.by_name[name]
        if node.op is Op.LINEAR:
            a = program.by_name[node.args[0]]
            users = [u for u in program.users[a.name] if u in members]
            if a.op is Op.GATHER and users == [name] and program.by_name[a.args[0]].op is not Op.GATHER:
                out.add(a.name)
    return out


def tile_rows(program: Program, kernel, graph: Graph, dtype: torch.dtype) -> int:
    """Edges per tile when the reference backend runs an edge-parallel kernel in tiles: each edge temporary
    takes at most HECTOR_REFERENCE_TILE_BYTES (default 1 MiB on CPU, 64 MiB on GPU, where launches cost more)."""
    from .. import config

    budget = config.tile_bytes(graph.device.type)
    width = max((program.by_name[n].type.numel for n in kernel.nodes
                 if program.by_name[n].type.domain is Domain.EDGE), default=1)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, budget // max(1, width * itemsize))


def _chunkable(program: Program, kernel) -> bool:
    """Edge-parallel kernels run tile by tile (the way the CUDA kernel walks edges), so an edge temporary takes one
    tile of memory instead of E rows. Excluded: kernels that read, per edge, a node value reduced inside the same
    kernel (the CUDA kernel does that destination-centric; the reference runs such kernels whole)."""
    if kernel.kind != "traversal" or kernel.space != "edge":
        return False
    # values computed per edge or from per-edge values; a gather may read anything else (materialised inputs and
    # views of them) but not these
    inside: set[str] = set()
    for name in kernel.nodes:
        n = program.by_name[name]
        if n.type.domain is Domain.EDGE or n.op in (Op.SCATTER_ADD, Op.SELECT_SUM) or \
                any(a in inside for a in n.args):
            inside.add(name)
    for name in kernel.nodes:
        n = program.by_name[name]
        dom = n.type.domain
        if (dom is Domain.UNIQUE and n.op is not Op.RESHAPE) or (dom is Domain.PARAM and n.op is not Op.SELECT_SUM):
            return False
        if n.op in (Op.SCATTER_ADD, Op.SELECT_SUM) and program.by_name[n.args[0]].type.domain is not Domain.EDGE:
            return False
        if n.op is Op.GATHER and (dom is not Domain.EDGE or n.args[0] in inside):
            return False
    return True


def _run_chunked(program: Program, kernel, graph: Graph, env: dict, leaves: Mapping[str, Any],
                 dtype: torch.dtype, step: int) -> None:
    """Tiles over edges, in phases split at each edge softmax (which needs whole destinations: it runs on the
    full [E, heads] scores between phases). Node-wise epilogue ops run once after the last phase."""
    by = program.by_name
    edge_part = [m for m in kernel.nodes if by[m].type.domain is Domain.EDGE or by[m].op in (Op.SCATTER_ADD,
                                                                                              Op.SELECT_SUM)]
    # non-edge nodes: views of materialised inputs (once, before the tiles) or node-wise work on reductions
    pre, epilogue, dependent = [], [], set(edge_part)
    for m in kernel.nodes:
        if m in dependent:
            continue
        if any(a in dependent for a in by[m].args):
            epilogue.append(m)
            dependent.add(m)
        else:
            pre.append(m)
    phases: list[list[str]] = [[]]
    for m in edge_part:
        if by[m].op is Op.EDGE_SOFTMAX:
            phases.append([m])  # the softmax opens the next phase
            phases.append([])
        else:
            phases[-1].append(m)
    phase_of = {m: i for i, ph in enumerate(phases) for m in ph}
    keep = {m for m in kernel.outputs if by[m].type.domain is Domain.EDGE}
    for m in kernel.nodes:
        for a in by[m].args:
            if a in phase_of and (phase_of.get(m, len(phases)) != phase_of[a] or by[m].op is Op.EDGE_SOFTMAX):
                keep.add(a)
    acc: dict[str, torch.Tensor] = {}
    for name in pre:
        n = by[name]
        acc[name] = eval_node(n, [acc[a] if a in acc else env[a] for a in n.args], [by[a].type for a in n.args],
                              graph, leaves, dtype)
    num_edges = graph.num_edges
    for phase in phases:
        if len(phase) == 1 and by[phase[0]].op is Op.EDGE_SOFTMAX:
            soft = phase[0]
            acc[soft] = _edge_softmax(acc[by[soft].args[0]] if by[soft].args[0] in acc else env[by[soft].args[0]],
                                      graph)
            continue
        for start in range(0, num_edges, step):
            sl = slice(start, min(start + step, num_edges))
            local: dict[str, torch.Tensor] = {}

            def arg(name: str, local: dict = local, sl: slice = sl) -> torch.Tensor:
                if name in local:
                    return local[name]
                t = acc[name] if name in acc else env[name]
                return t[sl] if by[name].type.domain is Domain.EDGE else t

            for name in phase:
                n = by[name]
                at = n.attr
                if n.op is Op.GATHER:
                    local[name] = arg(n.args[0]).index_select(0, graph.gather_index(at("via"))[sl])
                elif n.op is Op.SELECT:
                    p, pby = arg(n.args[0]), by[n.args[0]].type.by
                    if not pby:
                        local[name] = p.unsqueeze(0).expand((sl.stop - sl.start,) + p.shape)
                    else:
                        local[name] = p.reshape((-1,) + p.shape[len(pby):]).index_select(
                            0, graph.combined_index(Domain.EDGE, pby)[sl])
                elif n.op is Op.SCATTER_ADD:
                    x = arg(n.args[0])
                    if name not in acc:
                        acc[name] = x.new_zeros((graph.num_rows(GATHER_VIA[at("via")][0]),) + x.shape[1:])
                    acc[name].index_add_(0, graph.gather_index(at("via"))[sl], x)
                elif n.op is Op.SELECT_SUM:
                    x, sby, shape = arg(n.args[0]), tuple(at("by", ())), tuple(at("shape"))
                    if name not in acc:
                        acc[name] = x.new_zeros(shape)
                    if not sby:
                        acc[name] += x.sum(0)
                    else:
                        acc[name].view((-1,) + shape[len(sby):]).index_add_(
                            0, graph.combined_index(Domain.EDGE, sby)[sl], x)
                else:
                    types = [by[x].type for x in n.args]
                    local[name] = eval_node(n, [arg(x) for x in n.args], types, graph, leaves, dtype)
                if name in keep and name in local:
                    if name not in acc:
                        acc[name] = local[name].new_empty((num_edges,) + local[name].shape[1:])
                    acc[name][sl] = local[name]
            del local
    for name in epilogue:  # node-wise work on the reduced values
        n = by[name]
        args = [acc[a] if a in acc else env[a] for a in n.args]
        acc[name] = eval_node(n, args, [by[a].type for a in n.args], graph, leaves, dtype)
    for name in kernel.outputs:
        env[name] = acc[name]


def _rows_of(program: Program, name: str, rows: torch.Tensor, graph: Graph, env: Mapping[str, torch.Tensor],
             leaves: Mapping[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The given rows of a leaf or a chain of views/gathers, without building the whole value."""
    n = program.by_name[name]
    if name in env:
        t = env[name]
        return t if n.type.domain is Domain.PARAM else t.index_select(0, rows)
    if n.op is Op.GATHER:
        src = program.by_name[n.args[0]]
        full = env[src.name] if src.name in env else eval_node(
            src, [env[a] for a in src.args], [program.by_name[a].type for a in src.args], graph, leaves, dtype)
        return full.index_select(0, graph.gather_index(n.attr("via")).index_select(0, rows))
    if n.op is Op.SELECT:
        p, pby = env[n.args[0]], program.by_name[n.args[0]].type.by
        if not pby:
            return p.unsqueeze(0).expand((rows.numel(),) + p.shape)
        return p.reshape((-1,) + p.shape[len(pby):]).index_select(
            0, graph.combined_index(n.type.domain, pby).index_select(0, rows))
    if n.op is Op.RESHAPE:
        return _rows_of(program, n.args[0], rows, graph, env, leaves, dtype).reshape(
            (rows.numel(),) + tuple(n.attr("shape")))
    raise AssertionError(f"{name} is not a row read")  # pragma: no cover - lowering only fuses row reads


def _run_gemm_scatter(program: Program, kernel, graph: Graph, env: dict, leaves: Mapping[str, Any],
                      dtype: torch.dtype) -> None:
    """gather -> segment matmul -> [scale] -> scatter, one segment tile at a time: no per-row result is ever
    materialised, as in the CUDA GEMM kernel with a scatter epilogue."""
    by = program.by_name
    lin = next(by[m] for m in kernel.nodes if by[m].op is Op.LINEAR)
    scatter = by[kernel.nodes[-1]]
    scale = next((by[m] for m in kernel.nodes if by[m].op is Op.MUL), None)
    x_node = by[lin.args[0]]
    if x_node.op is Op.GATHER and x_node.name not in env:
        table = env[x_node.args[0]] if x_node.args[0] in env else None
        row_index = graph.gather_index(x_node.attr("via"))
    else:
        table, row_index = None, None
    domain = lin.type.domain
    w, wtype = env[lin.args[1]], by[lin.args[1]].type
    core = w.shape[len(wtype.by):]
    head, transpose = len(core) == 3, bool(lin.attr("transpose"))
    wflat = w.reshape((-1,) + core)
    width = max(1, by[scatter.name].type.numel)
    from .. import config

    step = max(1, config.tile_bytes(graph.device.type) // (width * torch.empty((), dtype=dtype).element_size()))
    wstep = _weight_tile(core, w.element_size(), graph.device.type)
    target = graph.num_rows(GATHER_VIA[scatter.attr("via")][0])
    out = None
    scatter_index = graph.gather_index(scatter.attr("via"))
    for rows, t in _chunks(graph, domain, wtype.by, step, wstep):
        if table is not None:
            xr = table.index_select(0, row_index.index_select(0, rows))
        else:
            xr = _rows_of(program, x_node.name, rows, graph, env, leaves, dtype)
        y = _segment_mm(xr, wflat, t, head, transpose)
        if scale is not None:
            other = scale.args[1] if scale.args[0] == lin.name else scale.args[0]
            s_rows = _rows_of(program, other, rows, graph, env, leaves, dtype)
            y = _binary(Op.MUL, y, s_rows) if scale.args[0] == lin.name else _binary(Op.MUL, s_rows, y)
        if out is None:
            out = y.new_zeros((target,) + y.shape[1:])
        out.index_add_(0, scatter_index.index_select(0, rows), y)
    if out is None:  # no rows at all
        out = torch.zeros((target,) + by[scatter.name].type.shape, dtype=dtype, device=graph.device)
    env[scatter.name] = out
