"""``torch.library`` custom ops around a whole hector layer, so ``torch.compile`` (``fullgraph=True``) sees one
opaque op per layer with a fake (meta) kernel, instead of tracing into graph preprocessing and kernel launches.

Eager calls do not use these ops (they go straight through :class:`hector.runtime.compiled._Apply`); a layer's
``forward`` switches to them while torch.compile traces it.

* ``hector::relational_layer(x, edge_index, edge_type, node_type, weights, layer_id) -> out`` runs the layer's
  forward program on its backend. In training mode the values the backward program reads are stashed, keyed by the
  call's input tensors (at most ``STASH_LIMIT`` calls are kept; an evicted call is recomputed in backward).
* ``hector::relational_layer_backward(grad, x, ..., needs) -> [grad_x, grad_weights...]`` runs the generated
  backward for the inputs that need a gradient (``needs``, as autograd says: the first layer's ``x`` usually does
  not), like the eager path; the others get an empty placeholder, which autograd receives as None.

``layer_id`` names the module in a process-wide registry of weak references (an int, so the op schema stays
tensor-only and torch.compile guards on it like on any constant).
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from typing import Any

import torch

from ..ir.core import Op
from ..runtime.backend import select

STASH_LIMIT = 16
_LAYERS: dict[int, weakref.ref] = {}
_ids = itertools.count(1)
_STASH: OrderedDict[tuple, tuple] = OrderedDict()


def register(layer: Any) -> int:
    layer_id = next(_ids)
    _LAYERS[layer_id] = weakref.ref(layer)
    return layer_id


def _layer(layer_id: int) -> Any:
    ref = _LAYERS.get(layer_id)
    layer = ref() if ref is not None else None
    if layer is None:
        raise RuntimeError(f"hector layer {layer_id} no longer exists")
    return layer


def _key(layer_id: int, x: torch.Tensor, edge_index: torch.Tensor, weights: list[torch.Tensor]) -> tuple:
    return (layer_id, x.data_ptr(), x._version, tuple(x.shape), edge_index.data_ptr(),
            tuple((w.data_ptr(), w._version) for w in weights))


def _setup(layer_id, x, edge_index, edge_type, node_type, weights):
    layer = _layer(layer_id)
    graph = layer.graph(x, edge_index, edge_type, node_type)
    compiled = layer.compiled(graph)
    names = [name for name in layer._tensors()]
    leaves = {layer.input_name: x, **dict(zip(names, weights, strict=True))}
    used = {name for _, name in compiled.leaf_names}
    return layer, graph, compiled, {k: v for k, v in leaves.items() if k in used}


@torch.library.custom_op("hector::relational_layer", mutates_args=())
def relational_layer(x: torch.Tensor, edge_index: torch.Tensor, edge_type: torch.Tensor,
                     node_type: torch.Tensor | None, weights: list[torch.Tensor], layer_id: int) -> torch.Tensor:
    layer, graph, compiled, leaves = _setup(layer_id, x, edge_index, edge_type, node_type, weights)
    training = layer.training
    saved = compiled.saved if training else ()
    plan = compiled.forward_lowered if training else compiled.inference_lowered
    backend = select(x.device, x.dtype)
    env = backend.run(plan, graph, leaves, keep=saved)
    out = env[compiled.forward.outputs[0]]
    if training:
        _STASH[_key(layer_id, x, edge_index, weights)] = (compiled, backend, {s: env[s] for s in saved})
        while len(_STASH) > STASH_LIMIT:
            _STASH.popitem(last=False)
    return out


@relational_layer.register_fake
def _(x, edge_index, edge_type, node_type, weights, layer_id):
    layer = _layer(layer_id)
    return x.new_empty((x.shape[0],) + layer.output_feature_shape())


@torch.library.custom_op("hector::relational_layer_backward", mutates_args=())
def relational_layer_backward(grad: torch.Tensor, x: torch.Tensor, edge_index: torch.Tensor,
                              edge_type: torch.Tensor, node_type: torch.Tensor | None, weights: list[torch.Tensor],
                              layer_id: int, needs: list[bool]) -> list[torch.Tensor]:
    layer, graph, compiled, leaves = _setup(layer_id, x, edge_index, edge_type, node_type, weights)
    hit = _STASH.pop(_key(layer_id, x, edge_index, weights), None)
    if hit is not None and hit[0] is compiled:
        _, backend, saved = hit
    else:  # evicted or never stashed: recompute the forward (like activation checkpointing)
        if any(n.op is Op.DROPOUT_MASK for n in compiled.forward.nodes):
            raise RuntimeError(f"{type(layer).__name__}: the forward values of this call were evicted (more than "
                               f"{STASH_LIMIT} compiled training calls before their backward) and a dropout mask "
                               "cannot be recomputed; run backward sooner or raise hector.nn._ops.STASH_LIMIT")
        backend = select(x.device, x.dtype)
        env = backend.run(compiled.forward_lowered, graph, leaves, keep=compiled.saved)
        saved = {s: env[s] for s in compiled.saved}
    names = [layer.input_name] + list(layer._tensors())
    tensors = [x] + list(weights)
    wanted = {n for n, need in zip(names, needs, strict=True) if need}
    wrt = [(op, name) for op, name in compiled.leaf_names if name in leaves and name in wanted]
    by_leaf: dict[str, torch.Tensor] = {}
    if wrt:
        bw, lowered = compiled.backward_for(wrt)
        bleaves = dict(saved)
        bleaves[f"grad:{compiled.forward.outputs[0]}"] = grad.contiguous()
        env = backend.run(lowered, graph, bleaves, keep=())
        by_leaf = {name: env[out] for (_, name), out in zip(bw.grads_of, bw.program.outputs, strict=True)}

    def grad_of(name: str, t: torch.Tensor, need: bool) -> torch.Tensor:
        if not need:
            return t.new_empty(0)  # (a placeholder: no gradient wanted)
        g = by_leaf.get(name)
        if g is None:  # the program does not read this leaf
            return torch.zeros_like(t)
        # a custom op's outputs may not alias each other: small gradients share the backend's zero-filled pool
        return g.clone() if g._base is not None else g

    return [grad_of(n, t, need) for n, t, need in zip(names, tensors, needs, strict=True)]


@relational_layer_backward.register_fake
def _(grad, x, edge_index, edge_type, node_type, weights, layer_id, needs):
    return [torch.empty_like(t) if need else t.new_empty(0) for t, need in zip([x, *weights], needs, strict=True)]


def _setup_context(ctx, inputs, output):
    x, edge_index, edge_type, node_type, weights, layer_id = inputs
    ctx.save_for_backward(x, edge_index, edge_type, *([node_type] if node_type is not None else []), *weights)
    ctx.has_node_type = node_type is not None
    ctx.layer_id = layer_id
    ctx.num_weights = len(weights)


def _backward(ctx, grad):
    saved = list(ctx.saved_tensors)
    x, edge_index, edge_type = saved[:3]
    node_type = saved[3] if ctx.has_node_type else None
    weights = saved[3 + int(ctx.has_node_type):]
    needs = [bool(ctx.needs_input_grad[0]), *(bool(n) for n in ctx.needs_input_grad[4])]
    grads = torch.ops.hector.relational_layer_backward(grad, x, edge_index, edge_type, node_type, weights,
                                                       ctx.layer_id, needs)
    grads = [g if need else None for g, need in zip(grads, needs, strict=True)]
    return grads[0], None, None, None, grads[1:], None


relational_layer.register_autograd(_backward, setup_context=_setup_context)

