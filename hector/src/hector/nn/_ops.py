"""``torch.library`` ops around a whole hector layer, so ``torch.compile`` (``fullgraph=True``) sees one opaque op
per layer with a fake (meta) kernel, instead of tracing into graph preprocessing and kernel launches.

Eager calls do not use these ops (they go straight through :class:`hector.runtime.compiled._Apply`); a layer's
``forward`` switches to them while torch.compile traces it.

* ``hector::relational_layer(x, edge_index, edge_type, node_type, weights, layer_id) -> (out, token)`` runs the
  layer's forward program on its backend. In training mode the values the backward program reads are stashed under
  the address of ``token``, a one-byte tensor of this call that autograd keeps for the backward op (found with one
  lookup, whatever the number of weights; two live calls never share an entry). An entry lives as long as its token
  (autograd keeps the token until the call's backward has run, or for every backward with ``retain_graph=True``),
  so a call whose backward never comes (its autograd graph freed) drops its entry with its token. Beyond
  ``STASH_LIMIT`` entries the oldest whose forward can be recomputed is evicted (recomputed in backward, like
  activation checkpointing); a call with a dropout mask, which cannot be recomputed, is never evicted (a model of
  many layers with dropout, or micro-batches summed before one backward). In eval mode nothing is kept (a backward,
  if any, recomputes the forward).
  (AOTAutograd merges identical calls in one graph: a layer with dropout applied twice to the very same tensors
  gets one mask for both under torch.compile, where eager draws two.)
* ``hector::relational_layer_backward(grad, token, x, ..., needs) -> [grad_x, grad_weights...]`` runs the
  generated backward for the inputs that need a gradient (``needs``, as autograd says: the first layer's ``x``
  usually does not), like the eager path; the others get an empty placeholder, which autograd receives as None.

``layer_id`` names the module in a process-wide registry of weak references (an int, so the op schema stays
tensor-only and torch.compile guards on it like on any constant).
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..ir.core import Op
from ..runtime.backend import select

STASH_LIMIT = 16
_LAYERS: dict[int, weakref.ref] = {}
_ids = itertools.count(1)
# forward values kept for the backward op, keyed by the address of the forward's token (see the module docstring)
_STASH: OrderedDict[int, tuple] = OrderedDict()


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


def _setup(layer: Any, x, edge_index, edge_type, node_type, weights):
    """(graph, binding, leaf names in the op's order, the leaves the program reads) of one call."""
    graph = layer.graph(x, edge_index, edge_type, node_type)
    names = (layer.input_name, *layer._tensors())
    by_name = dict(zip(names, (x, *weights), strict=True))
    bound = layer._binding(graph, by_name)
    return graph, bound, names, {name: by_name[name] for name in bound.names}


def _forward(x: torch.Tensor, edge_index: torch.Tensor, edge_type: torch.Tensor, node_type: torch.Tensor | None,
             weights: list[torch.Tensor], layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    layer = _layer(layer_id)
    graph, bound, names, leaves = _setup(layer, x, edge_index, edge_type, node_type, weights)
    compiled = bound.compiled
    training = layer.training
    saved = compiled.saved if training else ()
    plan = compiled.forward_lowered if training else compiled.inference_lowered
    backend = select(x.device, x.dtype)
    env = backend.run(plan, graph, leaves, keep=saved)
    out = env[bound.outputs[0]]
    token = torch.empty(1, dtype=torch.uint8, device=x.device)
    if training:
        # everything the backward op needs besides its arguments, so that it resolves nothing again
        key = token.data_ptr()
        # the entry gives its values back when its token dies (after the call's last backward, or with its graph
        # when no backward comes); it holds the weak reference, so an evicted entry takes its callback with it
        drop = weakref.ref(token, lambda _, key=key: _STASH.pop(key, None))
        _STASH[key] = (bound, graph, names, backend, {s: env[s] for s in saved}, drop)
        if len(_STASH) > STASH_LIMIT:
            _evict()
    return out, token


def _recomputable(compiled: Any) -> bool:
    """Whether a call's forward values can be made again in backward: not when it draws a dropout mask."""
    return not any(n.op is Op.DROPOUT_MASK for n in compiled.forward.nodes)


def _evict() -> None:
    """Drops the oldest entries that backward can recompute until at most ``STASH_LIMIT`` remain (or none is
    left to drop): an entry with a dropout mask stays until its token dies. (Its program is read here, on the
    rare call past the limit, not on every call's forward.)"""
    excess = len(_STASH) - STASH_LIMIT
    for key in [k for k, entry in _STASH.items() if _recomputable(entry[0].compiled)][:max(excess, 0)]:
        _STASH.pop(key, None)


def _forward_fake(x, edge_index, edge_type, node_type, weights, layer_id):
    # the same shapes in training and eval mode: a compiled graph is not specialised on the layer's mode. The
    # shape comes from tracing the layer's program, which reads its tensors' shapes: a parametrized tensor
    # (torch.nn.utils.parametrize) is computed from the layer's real parameters, which fake mode would refuse
    with unset_fake_temporarily():
        shape = _layer(layer_id).output_feature_shape()
    return x.new_empty((x.shape[0],) + shape), x.new_empty(1, dtype=torch.uint8)


def _backward_op(grad: torch.Tensor, token: torch.Tensor, x: torch.Tensor, edge_index: torch.Tensor,
                 edge_type: torch.Tensor, node_type: torch.Tensor | None, weights: list[torch.Tensor], layer_id: int,
                 needs: list[bool]) -> list[torch.Tensor]:
    # not popped: a second backward of the same graph (retain_graph=True) finds the values again; the entry goes
    # with its token, which autograd releases after the last backward that may need it
    hit = _STASH.get(token.data_ptr())
    if hit is not None:
        bound, graph, names, backend, saved, _ = hit
    else:  # evicted or never stashed: recompute the forward (like activation checkpointing)
        layer = _layer(layer_id)
        graph, bound, names, leaves = _setup(layer, x, edge_index, edge_type, node_type, weights)
        compiled = bound.compiled
        if not _recomputable(compiled):
            raise RuntimeError(f"{type(layer).__name__}: the forward values of this call were not kept (a call made "
                               "in eval mode, then differentiated in training mode?) and its dropout mask cannot "
                               "be recomputed; run the forward in the mode of its backward")
        backend = select(x.device, x.dtype)
        env = backend.run(compiled.forward_lowered, graph, leaves, keep=compiled.saved)
        saved = {s: env[s] for s in compiled.saved}
    wanted = {n for n, need in zip(names, needs, strict=True) if need}
    hit = bound.backward(tuple(name in wanted for name in bound.names))
    by_leaf: dict[str, torch.Tensor] = {}
    if hit is not None:
        lowered, places = hit
        bleaves = dict(saved)
        bleaves[f"grad:{bound.outputs[0]}"] = grad if grad.is_contiguous() else grad.contiguous()
        env = backend.run(lowered, graph, bleaves, keep=(), contiguous=True)  # saved values: made contiguous
        by_leaf = {bound.names[position]: env[out] for out, position in places}
    grads = []
    for name, t, need in zip(names, (x, *weights), needs, strict=True):
        if not need:
            grads.append(t.new_empty(0))  # (a placeholder: no gradient wanted)
            continue
        g = by_leaf.get(name)
        # small gradients come as disjoint views of the backend's one zero-filled buffer of this call, as an eager
        # step hands them to autograd: they share a storage but never overlap, and nothing writes into them in
        # place but their own accumulation (a copy of each would be one more launch per gradient: twelve per HGT
        # step)
        grads.append(torch.zeros_like(t) if g is None else g)  # (None: the program does not read this leaf)
    return grads


def _backward_fake(grad, token, x, edge_index, edge_type, node_type, weights, layer_id, needs):
    return [torch.empty_like(t) if need else t.new_empty(0) for t, need in zip([x, *weights], needs, strict=True)]


def _setup_context(ctx, inputs, output):
    x, edge_index, edge_type, node_type, weights, layer_id = inputs
    ctx.save_for_backward(output[1], x, edge_index, edge_type, *([node_type] if node_type is not None else []),
                          *weights)
    ctx.has_node_type = node_type is not None
    ctx.layer_id = layer_id


def _backward(ctx, grad, _token_grad):
    token, x, edge_index, edge_type, *rest = ctx.saved_tensors
    node_type = rest[0] if ctx.has_node_type else None
    weights = rest[int(ctx.has_node_type):]
    needs = [bool(ctx.needs_input_grad[0]), *(bool(n) for n in ctx.needs_input_grad[4])]
    grads = relational_layer_backward(grad, token, x, edge_index, edge_type, node_type, weights, ctx.layer_id, needs)
    grads = [g if need else None for g, need in zip(grads, needs, strict=True)]
    return grads[0], None, None, None, grads[1:], None


# Defined with torch.library's low-level API rather than ``torch.library.custom_op``: the dispatcher calls the
# Python kernel directly, without custom_op's per-call wrappers (argument flattening, alias checks, a
# dynamo-disabled frame), which a compiled step on a small graph pays in host time.
_LIB = torch.library.Library("hector", "DEF")
_LIB.define("relational_layer(Tensor x, Tensor edge_index, Tensor edge_type, Tensor? node_type, Tensor[] weights, "
            "int layer_id) -> (Tensor, Tensor)")
_LIB.define("relational_layer_backward(Tensor grad, Tensor token, Tensor x, Tensor edge_index, Tensor edge_type, "
            "Tensor? node_type, Tensor[] weights, int layer_id, bool[] needs) -> Tensor[]")
_LIB.impl("relational_layer", _forward, "CompositeExplicitAutograd")
_LIB.impl("relational_layer_backward", _backward_op, "CompositeExplicitAutograd")
torch.library.register_fake("hector::relational_layer", _forward_fake, lib=_LIB)
torch.library.register_fake("hector::relational_layer_backward", _backward_fake, lib=_LIB)
torch.library.register_autograd("hector::relational_layer", _backward, setup_context=_setup_context, lib=_LIB)
relational_layer = torch.ops.hector.relational_layer.default
relational_layer_backward = torch.ops.hector.relational_layer_backward.default
