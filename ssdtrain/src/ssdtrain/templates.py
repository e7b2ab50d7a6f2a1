"""Templates of the ``derive`` choice's recipes: what the search (``ssdtrain.derive.Deriver``) decided for each
tensor one block saved, in pack order, replayed at the block's later forwards with each saved tensor checked."""

from __future__ import annotations

from typing import Any

CAST = "ToCopyBackward0"  # autograd's node of a dtype cast (autocast's): shared by source, not by node
MISS = object()  # a replay found this position differs from its template


class TemplateOp:
    """One op of a recorded recipe (a template's): its autograd node's class, its function, its inputs (an int: the
    position of a saved tensor in the block's sequence; a ``TemplateOp``; a weak reference to a parameter), the
    shape and dtype each saved input had, its result's shape, dtype and device, and its index in the template's op
    table (one ``_Op`` a step)."""

    __slots__ = ("cls", "fn", "inputs", "metas", "shape", "dtype", "device", "idx", "cast")

    def __init__(self, op: Any, inputs: list, metas: list, idx: int):  # op: a derive._Op (derive imports this)
        self.cls, self.fn, self.inputs, self.metas = op.cls, op.fn, inputs, metas
        self.shape, self.dtype, self.device = op.shape, op.dtype, op.device
        self.idx = idx
        self.cast = op.cls is not None and op.cls.__name__ == CAST  # shared by source, not by node


class Template:
    """What the general path decided for each tensor one block saved, in pack order: ``None`` (no grad_fn), a
    class (a real saved tensor whose node has that class) or a ``Recipe``. Replayed by position in later steps."""

    __slots__ = ("records", "n_ops")

    def __init__(self):
        self.records: list = []
        self.n_ops = 0


class Recipe:
    __slots__ = ("cls", "view", "top", "shape", "dtype", "device", "cast")

    def __init__(self, cls, view, top, base, cast):
        self.cls, self.view, self.top = cls, view, top
        self.shape, self.dtype, self.device = base.shape, base.dtype, base.device
        self.cast = cast  # True/False where the recipe's structure decides it; None: ask _param_derived each time
