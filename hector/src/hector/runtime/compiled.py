"""Compiling a layer program (passes, autodiff, lowering) and running it under torch autograd."""

from __future__ import annotations

import functools
import operator
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
_IS_CONTIGUOUS = operator.methodcaller("is_contiguous")


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
    _bindings: dict[tuple[str, ...], Any] = field(default_factory=dict)  # leaf names -> Binding
    # (the backend's prepare, leaf dtypes, training, gradient sets) -> the (program, leaf dtypes, keep) it prepares
    _prepares: dict[tuple, tuple] = field(default_factory=dict)

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


class Binding:
    """How a call of ``compiled`` binds its tensors (leaf names in the order the call passes them): resolved once per
    (compiled layer, names) instead of on every call and every backward, with the backward program, its lowering and
    where each of its gradients goes for each set of inputs autograd wants a gradient for."""

    __slots__ = ("compiled", "names", "keys", "outputs", "leaf_names", "_backwards")

    def __init__(self, compiled: CompiledLayer, names: tuple[str, ...]):
        self.compiled = compiled
        self.names = names
        leaf_names = compiled.leaf_names
        self.keys = tuple((Op.INPUT if (Op.INPUT, n) in leaf_names else Op.PARAM, n) for n in names)
        self.outputs = tuple(compiled.forward.outputs)
        # the backward's leaves: the forward's saved values, then the gradients of its outputs (by these names)
        self.leaf_names = tuple(compiled.saved) + tuple(f"grad:{o}" for o in self.outputs)
        self._backwards: dict[tuple[bool, ...], tuple[Lowered, tuple[tuple[str, int], ...]] | None] = {}

    def backward(self, needs: tuple[bool, ...]) -> tuple[Lowered, tuple[tuple[str, int], ...]] | None:
        """The lowered backward for the inputs flagged in ``needs`` (one flag per name) and, per gradient it makes,
        (its value name, the input's position); None when no input needs one. Its leaves are bound by
        :attr:`leaf_names`."""
        hit = self._backwards.get(needs)
        if hit is not None or needs in self._backwards:
            return hit
        wanted = [k for k, need in zip(self.keys, needs, strict=True) if need]
        if not wanted:
            self._backwards[needs] = None
            return None
        bw, lowered = self.compiled.backward_for(wanted)
        position = {key: i for i, key in enumerate(self.keys)}
        places = tuple((name, position[key]) for key, name in zip(bw.grads_of, bw.program.outputs, strict=True)
                       if key in position)
        self._backwards[needs] = hit = (lowered, places)
        return hit


def binding(compiled: CompiledLayer, names: tuple[str, ...]) -> Binding:
    """The :class:`Binding` of ``compiled`` for tensors passed in the order of ``names`` (made once)."""
    hit = compiled._bindings.get(names)
    if hit is None:
        missing = [name for _, name in compiled.leaf_names if name not in names]
        if missing:
            raise ValueError(f"no tensor bound to {missing}")
        with _LOCK:
            hit = compiled._bindings.setdefault(names, Binding(compiled, names))
    return hit


class _Apply(torch.autograd.Function):
    """Forward: run the lowered forward program. Backward: run the generated backward program."""

    @staticmethod
    def forward(ctx: Any, bound: Binding, graph: Graph, training: bool, *tensors: torch.Tensor):
        compiled = bound.compiled
        graph.check_ids_unchanged()
        if graph.sync_free:
            graph.known_unique_count()  # a pair count that has reached the host settles the backend's layout
        # without a backward to come (inference), nothing is kept beyond the outputs
        saved = compiled.saved if training else ()
        plan = compiled.forward_lowered if training else compiled.inference_lowered
        backend: Backend = select(tensors[0].device, tensors[0].dtype)
        env = backend.run(plan, graph, dict(zip(bound.names, tensors, strict=True)), keep=saved)
        ctx.backend, ctx.bound, ctx.graph = backend, bound, graph
        ctx.save_for_backward(*[env[s] for s in saved])
        outs = bound.outputs
        return env[outs[0]] if len(outs) == 1 else tuple(env[o] for o in outs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor):
        # the generated backward is not itself differentiated: under create_graph=True (grad mode on), the
        # outputs are marked as once_differentiable marks them; otherwise grad mode is already off, and
        # once_differentiable's no_grad block (a few Python calls on every backward) is left out
        if torch.is_grad_enabled():
            return _once_differentiable_backward(ctx, *grad_outputs)
        return _backward(ctx, *grad_outputs)


def _backward(ctx: Any, *grad_outputs: torch.Tensor):
    bound: Binding = ctx.bound
    ctx.graph.check_ids_unchanged()  # the ids the forward ran on, not ids written into them since
    grads: list[Any] = [None] * (3 + len(bound.names))
    hit = bound.backward(ctx.needs_input_grad[3:])
    if hit is None:
        return tuple(grads)
    lowered, places = hit
    if all(map(_IS_CONTIGUOUS, grad_outputs)):
        leaves = dict(zip(bound.leaf_names, ctx.saved_tensors + grad_outputs, strict=True))
    else:
        leaves = dict(zip(bound.leaf_names, ctx.saved_tensors + tuple(
            g if g.is_contiguous() else g.contiguous() for g in grad_outputs), strict=True))
    # the saved values are values the forward made (contiguous), the output gradients made contiguous above
    env = ctx.backend.run(lowered, ctx.graph, leaves, keep=(), contiguous=True)
    for name, position in places:
        grads[3 + position] = env[name]
    return tuple(grads)


_once_differentiable_backward = torch.autograd.function.once_differentiable(_backward)
# torch's own apply of an autograd Function, below the Python classmethod Function.apply: that one, without
# functorch transforms active, only unwraps functorch's dead wrappers (a generator over every argument: a dozen
# Python calls per layer call) before calling this
_FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Apply)


def prepare_apply(compiled: CompiledLayer, graph: Graph, dtypes: Mapping[str, torch.dtype], training: bool,
                  grads: Iterable[frozenset[str]] = ()) -> bool:
    """Builds now, on the calling thread's current stream, what :func:`apply` of ``compiled`` on ``graph`` with
    leaves of these ``dtypes`` (leaf name -> dtype, in the layer's order) builds on its first call: the backend's
    layout of the graph and its launch plans, for the forward (``training``: the one that keeps values for a
    backward) and for the backward of each set of leaf names in ``grads`` (the leaves that will want a
    gradient). Returns False where the backend builds nothing ahead (the reference backend)."""
    names = [name for _, name in compiled.leaf_names if name in dtypes]
    leaves = {name: dtypes[name] for name in names}
    backend = select(graph.device, leaves[names[0]])
    if getattr(backend, "prepare", None) is None:
        return False
    # a loader thread's current device need not be the graph's (each thread starts on the first GPU): modules
    # are loaded and kernels queued on the graph's device, on that thread's current stream there
    if graph.device.type == "cuda":
        with torch.cuda.device(graph.device):
            _prepare_on(backend.prepare, compiled, graph, leaves, training, grads)
    else:
        _prepare_on(backend.prepare, compiled, graph, leaves, training, grads)
    return True


def _prepare_on(prepare: Any, compiled: CompiledLayer, graph: Graph, leaves: dict[str, torch.dtype],
                training: bool, grads: Iterable[frozenset[str]]) -> None:
    # the programs to prepare and their leaves' dtypes are the same on every graph: worked out on the first, then
    # each prepared in turn (a loader thread prepares every mini-batch this way)
    grads = tuple(grads)
    key = (getattr(prepare, "__func__", prepare), tuple(leaves.items()), training, grads)
    recipe = compiled._prepares.get(key)
    if recipe is not None:
        for lowered, dtypes, keep in recipe:
            prepare(lowered, graph, dtypes, keep=keep)
        return
    saved = compiled.saved if training else ()
    plan = compiled.forward_lowered if training else compiled.inference_lowered
    recipe = [(plan, leaves, saved)]
    env = prepare(plan, graph, leaves, keep=saved)
    if training:
        # the backward's leaves in the order its call binds them: the saved values, then the output gradients
        bw_leaves = {name: env[name] for name in saved}
        bw_leaves.update((f"grad:{o}", env[o]) for o in compiled.forward.outputs)
        for wanted in grads:
            keys = [key for key in compiled.leaf_names if key[1] in wanted and key[1] in leaves]
            if keys:
                lowered = compiled.backward_for(keys)[1]
                recipe.append((lowered, bw_leaves, ()))
                prepare(lowered, graph, bw_leaves, keep=())
    with _LOCK:
        if len(compiled._prepares) > 64:  # dtypes and settings since changed: forgotten, rebuilt if seen again
            compiled._prepares.clear()
        compiled._prepares[key] = tuple(recipe)


def apply(compiled: CompiledLayer, graph: Graph, leaves: dict[str, torch.Tensor]):
    """Run ``compiled`` on ``graph`` with leaves bound by name (inputs and params); differentiable."""
    names = tuple(name for _, name in compiled.leaf_names if name in leaves)
    return apply_bound(binding(compiled, names), graph, [leaves[n] for n in names])


def apply_bound(bound: Binding, graph: Graph, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]):
    """:func:`apply` with the tensors given in the order of ``bound.names`` (the call the layers make)."""
    training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if torch._C._are_functorch_transforms_active():
        # torch.func's transforms need an autograd.Function written for them (a separate setup_context, the values
        # kept for backward returned as outputs); _Apply keeps them on ctx, and torch's own error names only that
        raise NotImplementedError("hector's layers do not run under torch.func transforms (grad, vmap, jacrev, "
                                  "...): take gradients with torch.autograd.grad or loss.backward() (with "
                                  "torch.func.functional_call for parameters passed as arguments)")
    return _FUNCTION_APPLY(bound, graph, training, *tensors)
