"""Compiling a layer program (passes, autodiff, lowering) and running it under torch autograd."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ir.core import Op, Program
from ..lower.kernels import Lowered, lower
from ..passes import Backward, Options, differentiate, optimize, optimize_backward
from .backend import Backend, select
from .graph import Graph

_LOCK = threading.RLock()


@dataclass
class CompiledLayer:
    """A forward program, its lowering, and backward programs generated on demand per set of needed grads."""

    source: Program
    forward: Program
    options: Options
    full_backward: Backward
    forward_lowered: Lowered
    inference_lowered: Lowered  # the same program planned with nothing kept for a backward pass
    full_backward_lowered: Lowered  # the backward for every leaf, lowered once (the cost model reads it)
    _backward: dict[frozenset, tuple[Backward, Lowered]] = field(default_factory=dict)

    @functools.cached_property
    def leaf_names(self) -> tuple[tuple[Op, str], ...]:
        # read several times per layer call (the forward program never changes)
        return tuple((n.op, n.attr("name")) for n in self.forward.nodes if n.op in (Op.INPUT, Op.PARAM))

    @functools.cached_property
    def leaf_name_set(self) -> frozenset[str]:
        """The names of :attr:`leaf_names` (what a call binds: inputs and params the program reads)."""
        return frozenset(name for _, name in self.leaf_names)

    @functools.cached_property
    def saved(self) -> tuple[str, ...]:
        # read on every training call; the backward program never changes
        return self.full_backward.saved

    def backward_for(self, wrt: Iterable[tuple[Op, str]]) -> tuple[Backward, Lowered]:
        key = frozenset(wrt)
        hit = self._backward.get(key)
        if hit is not None:
            return hit
        with _LOCK:  # a loader thread preparing graphs may ask for the same backward
            if key not in self._backward:
                bw = differentiate(self.forward, key)
                prog = optimize_backward(bw.program, self.options)
                bw = Backward(prog, bw.grads_of)
                how = dict(fuse=self.options.fuse, sorted_scatter=self.options.sorted_scatter)
                self._backward[key] = (bw, lower(prog, **how))
            return self._backward[key]


def compile_program(program: Program, options: Options | None = None) -> CompiledLayer:
    options = Options() if options is None else options
    fwd = optimize(program, options)
    bw = differentiate(fwd)
    bw = Backward(optimize_backward(bw.program, options), bw.grads_of)
    how = dict(fuse=options.fuse, sorted_scatter=options.sorted_scatter)
    return CompiledLayer(program, fwd, options, bw, lower(fwd, keep=bw.saved, **how), lower(fwd, **how),
                         lower(bw.program, **how))


class _Apply(torch.autograd.Function):
    """Forward: run the lowered forward program. Backward: run the generated backward program."""

    @staticmethod
    def forward(ctx: Any, compiled: CompiledLayer, graph: Graph, names: tuple, training: bool,
                *tensors: torch.Tensor):
        leaves = dict(zip(names, tensors, strict=True))
        if graph.sync_free:
            graph.known_unique_count()  # a pair count that has reached the host settles the backend's layout
        # without a backward to come (inference), nothing is kept beyond the outputs
        saved = compiled.saved if training else ()
        plan = compiled.forward_lowered if training else compiled.inference_lowered
        backend: Backend = select(tensors[0].device, tensors[0].dtype)
        env = backend.run(plan, graph, leaves, keep=saved)
        ctx.backend = backend
        outs = tuple(env[o] for o in compiled.forward.outputs)
        ctx.compiled, ctx.graph, ctx.names = compiled, graph, names
        ctx.saved_names = tuple(saved)
        ctx.save_for_backward(*[env[s] for s in ctx.saved_names])
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    @torch.autograd.function.once_differentiable  # the generated backward is not itself differentiated
    def backward(ctx: Any, *grad_outputs: torch.Tensor):
        compiled: CompiledLayer = ctx.compiled
        leaf_keys = [(Op.INPUT if (Op.INPUT, n) in compiled.leaf_names else Op.PARAM, n) for n in ctx.names]
        wanted = [k for k, need in zip(leaf_keys, ctx.needs_input_grad[4:], strict=True) if need]
        if not wanted:
            return (None, None, None, None) + (None,) * len(ctx.names)
        bw, lowered = compiled.backward_for(wanted)
        leaves: dict[str, torch.Tensor] = dict(zip(ctx.saved_names, ctx.saved_tensors, strict=True))
        for o, g in zip(compiled.forward.outputs, grad_outputs, strict=True):
            leaves[f"grad:{o}"] = g.contiguous()
        env = ctx.backend.run(lowered, ctx.graph, leaves, keep=())
        by_leaf = {key: env[name] for key, name in zip(bw.grads_of, bw.program.outputs, strict=True)}
        grads = tuple(by_leaf.get(k) for k in leaf_keys)
        return (None, None, None, None) + grads


def prepare_apply(compiled: CompiledLayer, graph: Graph, dtypes: Mapping[str, torch.dtype], training: bool,
                  grads: Iterable[frozenset[str]] = ()) -> bool:
    """Builds now, on the calling thread's current stream, what :func:`apply` of ``compiled`` on ``graph`` with
    leaves of these ``dtypes`` (leaf name -> dtype, in the layer's order) builds on its first call: the backend's
    layout of the graph and its launch plans, for the forward (``training``: the one that keeps values for a
    backward) and for the backward of each set of leaf names in ``grads`` (the leaves that will want a
    gradient). Returns False where the backend builds nothing ahead (the reference backend)."""
    names = tuple(name for _, name in compiled.leaf_names if name in dtypes)
    leaves = {name: dtypes[name] for name in names}
    backend = select(graph.device, leaves[names[0]])
    if getattr(backend, "prepare", None) is None:
        return False
    # a loader thread's current device need not be the graph's (each thread starts on the first GPU): modules
    # are loaded and kernels queued on the graph's device, on that thread's current stream there
    with torch.cuda.device(graph.device) if graph.device.type == "cuda" else contextlib.nullcontext():
        _prepare_on(backend.prepare, compiled, graph, leaves, training, grads)
    return True


def _prepare_on(prepare: Any, compiled: CompiledLayer, graph: Graph, leaves: dict[str, torch.dtype],
                training: bool, grads: Iterable[frozenset[str]]) -> None:
    saved = compiled.saved if training else ()
    plan = compiled.forward_lowered if training else compiled.inference_lowered
    env = prepare(plan, graph, leaves, keep=saved)
    if training:
        # the backward's leaves in the order its call binds them: the saved values, then the output gradients
        bw_leaves = {name: env[name] for name in saved}
        bw_leaves.update((f"grad:{o}", env[o]) for o in compiled.forward.outputs)
        for wanted in grads:
            keys = [key for key in compiled.leaf_names if key[1] in wanted and key[1] in leaves]
            if keys:
                prepare(compiled.backward_for(keys)[1], graph, bw_leaves, keep=())


def apply(compiled: CompiledLayer, graph: Graph, leaves: dict[str, torch.Tensor]):
    """Run ``compiled`` on ``graph`` with leaves bound by name (inputs and params); differentiable."""
    names = tuple(name for _, name in compiled.leaf_names if name in leaves)
    missing = [name for _, name in compiled.leaf_names if name not in leaves]
    if missing:
        raise ValueError(f"no tensor bound to {missing}")
    tensors = [leaves[n] for n in names]
    training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return _Apply.apply(compiled, graph, names, training, *tensors)
