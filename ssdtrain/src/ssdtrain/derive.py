"""Saved tensors that are cheap functions of other saved tensors, stored as recipes instead of bytes (the ``derive``
recompute choice).

Under autocast with fp32 weights a transformer block saves many tensors that elementwise ops make from tensors it
saves anyway: an RMSNorm saves its input, the normalised input (input x rsqrt) and the inverse root; each matrix
product after it saves its own bf16 cast of the norm's output (weight x normalised input); a gated MLP saves the
activation's output and the product fed to the down projection, both made from the two projections' outputs it saves
anyway. On a Llama-style block these are about half of what the block saves. Where the session clears autocast's
cache when the block returns, the casts of its weights (autocast's bf16 copies, saved by each projection) are recipes
too, made again from the parameters in backward.

``Deriver.derive(tensor)`` is called for each tensor a block saves (in pack order). It follows the tensor's autograd
node back through a few elementwise ops (multiply, SiLU, a dtype cast at the top, a view of the result) to tensors
this block saved already (real ones, whose values autograd keeps anyway) or parameters. Where every input is found, it
returns a ``Derived``: autograd holds the recipe, and the bytes of the tensor are freed when forward drops it. The
tensor's value is made again in backward, when autograd unpacks it. Results shared by several saved tensors (one
cast used by the query, key and value projections) are made once and held until the last of those is unpacked.

What the search decided for a block is recorded as a template (``Deriver`` says how) and replayed at the block's later
forwards, with each saved tensor checked against it, so that the search's Python runs once per block and plan rather
than for every saved tensor of every micro-batch.

A derive block may also move what it saves to a tier (``derive+host``, ``derive+nvme``): the recipes' inputs that moved
are held as the cache's tokens (``_Source``), not as tensors, so their device bytes go once their copy out is done;
the recipe unpacks them in backward (prefetched like any moved tensor) and makes its tensors from what came back.
The planner offers it beside whole-block recompute; ``UnitProfile.options`` gives the H100 rows that decided that.

The ops are recomputed by the same kernels on the same inputs, so the values are bitwise those of forward. A tensor
found through a node whose input was changed in place since it was saved is not derived; a saved input changed in
place after the recipe was made raises a clear error at unpack (autograd itself refuses such a graph).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from .entries import _param_derived
from .templates import CAST, MISS, Recipe, Template, TemplateOp

# Autograd node names of the elementwise ops a recipe may contain, with the forward they stand for.
_BINARY = {"MulBackward0": torch.mul}


def _alias(x: torch.Tensor) -> torch.Tensor:
    """A whole-range view (torch makes ``x[:, 0:]`` an alias): the same tensor, no kernel."""
    return x


_UNARY = {"SiluBackward0": F.silu, "AliasBackward0": _alias}
# What a saved tensor's own node may be, to have a recipe (an alias only inside one: Hugging Face's LM heads slice
# the hidden states by `logits_to_keep`, 0 meaning all of them, before the projection casts them).
_TOP = frozenset(_BINARY) | {"SiluBackward0", CAST}
# Host time per op made again in backward (the recipe's Python and a kernel launch), on top of its memory traffic:
# ~10 us measured on CPU with tiny tensors (where the host's time is all there is).
OP_HOST_S = 1e-5


class _Source:
    """A saved tensor a recipe reads that its block moved to a tier: the cache's token for it (the whole tensor),
    unpacked when the recipe is made in backward. A recipe holding the tensor itself would keep its device bytes
    through the rest of forward, and moving it would only add the copies."""

    __slots__ = ("token", "unpack", "shape", "dtype", "device")

    def __init__(self, token, unpack, t: torch.Tensor):
        self.token, self.unpack = token, unpack
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device

    def get(self) -> torch.Tensor:
        return self.unpack(self.token)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize


class _Op:
    """One recomputed op: its function, its inputs (tensors or other ``_Op``s) and what its result looks like. The
    result is held while something still needs it (`refs`: saved tensors not unpacked yet whose recipe ends here,
    and ops using it not made yet), so a result several need is made once and none is held longer."""

    __slots__ = ("fn", "inputs", "versions", "shape", "dtype", "device", "refs", "linked", "value", "cls", "srcs")

    def __init__(self, fn, inputs, versions, shape, dtype, device, cls=None, srcs=None):
        self.fn, self.inputs, self.versions = fn, inputs, versions
        self.shape, self.dtype, self.device = shape, dtype, device
        # What a template needs to replay it: its autograd node's class, and where each tensor input came from
        # (the position of a saved tensor in the block's sequence, or a parameter; None for an op).
        self.cls, self.srcs = cls, srcs
        self.refs = 0
        self.linked = False  # its inputs count it among their users (once a saved tensor's recipe reaches it)
        self.value = None

    def link(self) -> None:
        """A saved tensor's recipe reaches this op: count it as a user of its input ops (once)."""
        if self.linked:
            return
        self.linked = True
        for x in self.inputs:
            if isinstance(x, _Op):
                x.refs += 1
                x.link()

    def drop(self) -> None:
        """One user of this op's result is done with it."""
        self.refs = max(0, self.refs - 1)
        if self.refs == 0:
            self.value = None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    def ops(self) -> list[_Op]:
        """This op and every op it needs (each once)."""
        out, stack, seen = [], [self], set()
        while stack:
            op = stack.pop()
            if id(op) in seen:
                continue
            seen.add(id(op))
            out.append(op)
            stack.extend(i for i in op.inputs if isinstance(i, _Op))
        return out

    def traffic(self) -> int:
        """Bytes its kernel reads and writes."""
        if self.fn is _alias:
            return 0
        read = sum(i.nbytes if isinstance(i, _Op) else i.numel() * i.element_size() for i in self.inputs)
        return read + self.nbytes

    def compute(self) -> torch.Tensor:
        if self.value is not None:
            return self.value
        value = self._make_narrowed_product()
        if value is None:
            value = self.fn(*self._args())
        if value.shape != self.shape or value.dtype is not self.dtype or value.device != self.device:
            raise RuntimeError(
                f"ssdtrain: a derived tensor came back as {tuple(value.shape)} {value.dtype} on {value.device}, "
                f"expected {self.shape} {self.dtype} on {self.device}; plan the block 'keep' or 'recompute' "
                "(overrides=) and report this model"
            )
        self._drop_inputs()
        if self.refs > 0:
            self.value = value
        return value

    def _make_narrowed_product(self) -> torch.Tensor | None:
        """A cast to half precision of an fp32 product nothing else reads (an RMSNorm's weight times its normalised
        input, cast for the projection after it): made in one kernel, the product written straight in half
        precision, instead of a multiply writing fp32 and a cast reading it again (a third of a norm's recipe
        traffic, on a GPU: its kernels cast as they store; on CPU torch stages the product in fp32 and copies). torch
        computes the product in fp32 and rounds it to the output's dtype as the cast does, so the bits are the same
        (a GPU test checks). None where the pattern does not hold."""
        found = self.narrowed_product()
        if found is None:
            return None
        x, aliases = found
        if x.value is not None or x.refs != 1 or any(op.value is not None or op.refs != 1 for op in aliases):
            return None  # (the product or a view of it is needed by something else too)
        a, b = x._args()  # (the product's dtype is fp32: torch computes it in fp32 whatever the inputs' dtypes)
        out = torch.empty(x.shape, dtype=self.dtype, device=x.device)
        torch.mul(a, b, out=out)
        x._drop_inputs()
        for op in aliases:
            op._drop_inputs()
        return out

    def narrowed_product(self) -> tuple[_Op, list[_Op]] | None:
        """(the fp32 product, the whole-range views between) where this op casts such a product to half precision."""
        if self.dtype not in _HALF or len(self.inputs) != 1 or self.fn is not _CASTS.get(self.dtype):
            return None
        x, aliases = self.inputs[0], []
        while type(x) is _Op and x.fn is _alias:
            aliases.append(x)
            x = x.inputs[0]
        if type(x) is not _Op or x.fn is not torch.mul or x.dtype is not torch.float32:
            return None
        return x, aliases

    def _drop_inputs(self) -> None:
        for x in self.inputs:
            if type(x) is _Op:
                x.drop()  # made: this op needs its inputs no more

    def _args(self) -> list:
        args = []
        for x, version in zip(self.inputs, self.versions, strict=False):  # (same lengths: made together)
            if type(x) is _Op:
                args.append(x.compute())
                continue
            if type(x) is _Source:
                args.append(x.get())
                continue
            if version is not None and x._version != version:
                raise RuntimeError(
                    "ssdtrain: a tensor saved for backward was modified in place after it was saved "
                    f"(shape {tuple(x.shape)}, {x.dtype}); a block planned as 'derive' makes other saved tensors "
                    "from it again. Plan that block 'keep' or 'recompute' (overrides=), or avoid the in-place op"
                )
            args.append(x)
        return args


class Derived:
    """What autograd holds for a derived saved tensor: the op making its storage's tensor, and its view of it."""

    __slots__ = ("op", "size", "stride", "offset", "unit", "cast", "__weakref__")

    def __init__(self, op: _Op, t: torch.Tensor, base: torch.Tensor, unit: int, cast: bool = False):
        self.op = op
        self.cast = cast  # a cast of a parameter (autocast's bf16 weight)
        if t is base:  # the op's own result (contiguous, checked when the recipe was found): no view to rebuild
            self.size = None
        else:
            self.size, self.stride = t.size(), t.stride()
            self.offset = t.storage_offset() - base.storage_offset()
        self.unit = unit
        op.refs += 1
        op.link()

    def materialize(self) -> torch.Tensor:
        value = self.op.compute()
        self.op.drop()
        if not value.is_contiguous():  # the saved tensor's base was contiguous (its view is rebuilt on that layout)
            value = value.contiguous()
        if self.size is None or (self.size == value.shape and self.stride == value.stride() and self.offset == 0):
            return value
        return value.as_strided(self.size, self.stride, value.storage_offset() + self.offset)


class _Meta:
    """What the cost of an op needs of an input tensor, without holding its memory (a profiled step)."""

    __slots__ = ("_numel", "_size")

    def __init__(self, t: torch.Tensor):
        self._numel, self._size = t.numel(), t.element_size()

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._size


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    """The broadcast shape of `a` and `b`, or None (torch's own helper costs the host ~50 us a call)."""
    if a == b:
        return a
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b, strict=True):
        if x != y and x != 1 and y != 1:
            return None
        out.append(y if x == 1 else x)
    return tuple(out)


class Deriver:
    """Finds recipes for the tensors one block saves (``reset()`` at each block's start and end). `depth`: the
    most ops followed back from a saved tensor.

    The general path follows autograd's nodes back from each saved tensor (Python work per tensor, on the host's
    critical path of a host-bound step). Where ``reset`` is given a key (the session's: a block's forward, or what
    it saves after it), what that path decided is recorded as a template, and later segments with the same key
    replay it by position: a real saved tensor costs a class check, a recipe a walk that checks each node's class
    and that its inputs are this step's saved tensors (same nodes, unchanged versions, same shapes) or the same
    parameters, then builds the ops without searching. The first position that differs (another branch, another
    shape) hands the segment back to the general path, with what replay found so far, and the key's template is
    recorded again at its next segment. Counters: ``replayed`` and ``general`` recipes, ``misses`` (replays given
    back)."""

    def __init__(self, depth: int = 4):
        self.depth = depth
        # Only measuring (a profiled step): recipes hold no tensors, as they are never made.
        self.observe = False
        # Parameters' casts (autocast's bf16 weights) as recipes too: only where the session clears autocast's cache
        # when the block returns (the cache would hold them otherwise); made again in backward from the parameter.
        self.derive_casts = False
        self._counted: set[int] = set()  # ids of ops whose cost ``cost`` reported already (this block)
        # (id(node), output) -> (node, what it is: weakref to a saved tensor or an _Op, its version when saved, its
        # position). The node is held so that its id is not reused while the entry lives; entries live for one block.
        self._seen: dict[tuple[int, int], tuple] = {}
        # (id(node), output, dtype) -> (node, its op): an op built once per node, so that results shared by several
        # saved tensors (one cast feeding three projections) are made once.
        self._built: dict[tuple, tuple] = {}
        self.templates: dict = {}  # reset key -> Template
        self.counters = {"replayed": 0, "general": 0, "misses": 0}
        self._key = None
        self._pos = 0  # position of the next saved tensor in this segment
        self._recording: Template | None = None
        self._memo: dict[int, TemplateOp] = {}  # id(_Op) -> its TemplateOp (while recording)
        self._tpl: Template | None = None  # replaying this one
        self._r_nodes: list = []  # per position: its node (or None), output, weakref, version; per op: its _Op
        self._r_nr: list = []
        self._r_ref: list = []
        self._r_ver: list = []
        self._r_pop: list = []  # per position: the _Op of a derived one
        self._ops: list = []
        self._op_nodes: list = []
        # position -> _Source: saved tensors of this segment that the cache moved to a tier (see ``moved``);
        # recipes read them through the tier.
        self._moved: dict[int, _Source] = {}

    def clear_templates(self) -> None:
        """Forget every template (a new plan: its blocks may save other tensors)."""
        self.reset()
        self.templates.clear()

    def reset(self, key=None) -> None:
        """A new segment (a block starts or returns): recipes reach back only to tensors saved in it. `key` names
        the segment for templates (None: the general path only)."""
        if self._recording is not None and not self.observe:
            self.templates[self._key] = self._recording
        self._recording = None
        self._tpl = None
        self._memo.clear()
        self._seen.clear()
        self._built.clear()
        self._counted.clear()
        self._moved.clear()
        self._key = key
        self._pos = 0
        if self._r_nodes:  # (nodes and ops of the last segment: nothing of a step is held past it)
            self._r_nodes = self._r_nr = self._r_ref = self._r_ver = self._r_pop = self._ops = self._op_nodes = []
        if key is None or self.observe:
            return
        tpl = self.templates.get(key)
        if tpl is None:
            self._recording = Template()
            return
        self._tpl = tpl
        n = len(tpl.records)
        self._r_nodes, self._r_nr, self._r_ref = [None] * n, [None] * n, [None] * n
        self._r_ver, self._r_pop = [None] * n, [None] * n
        self._ops, self._op_nodes = [None] * tpl.n_ops, [None] * tpl.n_ops

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        """What autograd should hold for `t`, a saved tensor of this segment kept as it is: a detached alias of its
        base (the same storage and version counter), viewed as `t`. `t` itself would be a reference cycle for an
        output its own op saves (softmax, tanh: the node holds the tensor, the tensor its node, inside autograd where
        gc cannot see it), so a graph dropped without backward would never be freed. Where this segment recorded
        `t`'s base for later recipes, the record now points to the alias: a weak reference to the original would
        die as soon as forward drops it, the alias lives as long as autograd holds what this returns."""
        base = t._base if t._base is not None else t
        node = base.grad_fn
        if node is None:
            return t  # (no node to hold it: no cycle)
        alias = None
        p = self._pos - 1  # (the last tensor derive() was given: the caller keeps it because derive() said None)
        if self._tpl is not None and 0 <= p < len(self._r_nodes) and self._r_nodes[p] is node:
            held = self._r_ref[p]() if self._r_ref[p] is not None else None
            if held is base:
                alias = base.detach()
                self._r_ref[p] = weakref.ref(alias)
            elif held is not None:
                alias = held  # a view of the same base held already
        else:
            key = (id(node), base.output_nr)
            found = self._seen.get(key)
            held = found[1]() if found is not None and type(found[1]) is weakref.ref else None
            if held is base:
                alias = base.detach()
                self._seen[key] = (node, weakref.ref(alias), found[2], found[3])
            elif held is not None:
                alias = held
        if alias is None:
            return t.detach()  # no recipe of this segment can reach it
        if t is base:
            return alias
        return alias.as_strided(t.size(), t.stride(), t.storage_offset())

    def moved(self, t: torch.Tensor, token, unpack) -> None:
        """The saved tensor ``derive()`` was last given (kept out of recipes) went to a tier: ``token`` is the
        cache's token for it (``unpack(token)`` brings it back), ``t`` the tensor itself, not a view (the recipes'
        inputs are whole tensors). Later recipes of this segment read it through the token."""
        self._moved[self._pos - 1] = _Source(token, unpack, t)

    # ------------------------------------------------------------------------------------------- replay
    def derive(self, t: torch.Tensor, unit: int = 0) -> Derived | None:
        """A recipe for saved tensor `t`, or None (then `t` counts as saved for later recipes)."""
        tpl = self._tpl
        if tpl is not None:
            p = self._pos
            if p < len(tpl.records):
                got = self._replay(t, tpl.records[p], p, unit)
                if got is not MISS:
                    self._pos = p + 1
                    return got
            self._give_back()
        got = self._general(t, unit)
        self._pos += 1
        return got

    def _replay(self, t: torch.Tensor, rec, p: int, unit: int):
        base = t._base
        view = base is not None
        if not view:
            base = t
        node = base.grad_fn
        if rec is None:
            if node is not None:
                return MISS
            self._r_nodes[p] = None
            return None
        if type(rec) is not Recipe:
            if type(node) is not rec:
                return MISS
            self._r_nodes[p] = node
            self._r_nr[p] = base.output_nr
            self._r_ref[p] = weakref.ref(base)
            self._r_ver[p] = base._version
            self._r_pop[p] = None
            return None
        if (
            type(node) is not rec.cls
            or rec.view != view
            or base.dtype != rec.dtype
            or base.shape != rec.shape
            or base.output_nr != 0
            or base.device != rec.device
            or not base.is_contiguous()
        ):
            return MISS
        op = self._replay_op(rec.top, node)
        if op is None:
            return MISS
        self._r_nodes[p] = node
        self._r_nr[p] = 0
        self._r_pop[p] = op
        cast = rec.cast
        if not self.derive_casts and (cast is None or view):
            # Whether `t` is a parameter's cast decides only here (where casts are not derived): a view's chain
            # down to its base is not part of the template. (Elsewhere the flag only informs a profiled step.)
            cast = _param_derived(t)
        if cast and not self.derive_casts:
            return None
        self.counters["replayed"] += 1
        return Derived(op, t, base, unit, cast)

    def _replay_op(self, top: TemplateOp, node):
        """The op `top` stands for at `node` this step, or None where the graph differs from the template's."""
        if type(node) is not top.cls:
            return None
        built = self._ops[top.idx]
        if built is not None and not top.cast:
            return built if self._op_nodes[top.idx] is node else None
        nf = node.next_functions
        if len(nf) != len(top.inputs):
            return None
        values, versions = [], []
        for (n, k), src, meta in zip(nf, top.inputs, top.metas, strict=True):
            if type(src) is int:
                if n is not self._r_nodes[src] or k != self._r_nr[src] or self._r_pop[src] is not None:
                    return None
                moved = self._moved.get(src)
                if moved is not None:  # (its token holds what was saved, also once forward dropped the tensor)
                    x = moved
                    if x.shape != meta[0] or x.dtype != meta[1]:
                        return None
                    values.append(x)
                    versions.append(None)
                    continue
                x = self._r_ref[src]()
                if x is None or x._version != self._r_ver[src] or x.shape != meta[0] or x.dtype != meta[1]:
                    return None
                values.append(x)
                versions.append(self._r_ver[src])
            elif type(src) is TemplateOp:
                if n is None or k != 0:
                    return None
                op = self._replay_op(src, n)
                if op is None:
                    return None
                values.append(op)
                versions.append(None)
            else:  # a parameter, held weakly (its version unchecked, as on the general path)
                param = src()
                if param is None or getattr(n, "variable", None) is not param:
                    return None
                values.append(param)
                versions.append(None)
        if built is not None:
            return built  # a cast of the same source: made once
        op = _Op(top.fn, values, versions, top.shape, top.dtype, top.device)
        self._ops[top.idx] = op
        self._op_nodes[top.idx] = node
        return op

    def _give_back(self) -> None:
        """This segment differs from its template: what replay found so far goes to the general path's tables, and
        the key's template is recorded again at its next segment."""
        self.counters["misses"] += 1
        self.templates.pop(self._key, None)
        self._tpl = None
        for p in range(self._pos):
            node = self._r_nodes[p]
            if node is None:
                continue
            key = (id(node), self._r_nr[p])
            op = self._r_pop[p]
            if op is not None:
                self._seen[key] = (node, op, None, p)
            elif key not in self._seen:
                self._seen[key] = (node, self._r_ref[p], self._r_ver[p], p)

    # ------------------------------------------------------------------------------------------- general path
    def _record(self, rec) -> None:
        if self._recording is not None:
            self._recording.records.append(rec)

    def _template_op(self, op: _Op) -> TemplateOp | None:
        top = self._memo.get(id(op))
        if top is not None:
            return top
        if op.cls is None or op.srcs is None:
            return None
        inputs, metas = [], []
        for x, src in zip(op.inputs, op.srcs, strict=True):
            if isinstance(x, _Op):
                sub = self._template_op(x)
                if sub is None:
                    return None
                inputs.append(sub)
                metas.append(None)
            elif type(src) is int:
                inputs.append(src)
                metas.append((x.shape, x.dtype))
            else:  # a parameter: weakly (a template outlives no parameter, e.g. one a sharded model swaps)
                inputs.append(weakref.ref(src))
                metas.append(None)
        top = TemplateOp(op, inputs, metas, self._recording.n_ops)
        self._recording.n_ops += 1
        self._memo[id(op)] = top
        return top

    def _record_recipe(self, t, base, node, op, view: bool, cast: bool) -> None:
        if self._recording is None:
            return
        top = self._template_op(op)
        if top is None:
            self._recording = None  # (cannot happen: every op of a recorded segment has its sources)
            return
        # Where the recipe's structure decides whether `t` is a parameter's cast, the replay need not ask again.
        static = None
        if not view:
            if top.cls.__name__ != CAST:
                static = False
            elif len(top.inputs) == 1 and type(top.inputs[0]) is TemplateOp:
                static = False
            elif len(top.inputs) == 1 and type(top.inputs[0]) is weakref.ref:
                static = True  # a parameter's cast
        self._recording.records.append(Recipe(type(node), view, top, base, cast if static is None else static))

    def _leaf(self, node, nr: int):
        """A tensor or op standing for output `nr` of `node`, from what this block saved, or a parameter: (value,
        version, source)."""
        found = self._seen.get((id(node), nr))
        if found is not None:
            what, version = found[1], found[2]
            if isinstance(what, _Op):
                return what, None, None
            moved = self._moved.get(found[3])
            if moved is not None:  # (its token holds what was saved, also once forward dropped the tensor)
                return moved, None, found[3]
            t = what()
            if t is None or t._version != version:
                return None
            return t, version, found[3]
        if type(node).__name__ == "AccumulateGrad":
            # A parameter: its version is not checked, since a sharded model's parameter is gathered again (written
            # in place) before the block's backward, where the recipe uses it.
            v = node.variable
            return v, None, v
        return None

    def _build(self, node, nr: int, depth: int, dtype=None):
        """The op making output `nr` of `node` (`dtype`: the result's dtype, known for the saved tensor itself)."""
        if node is None or nr != 0:
            return None
        key = (id(node), nr, dtype)
        built = self._built.get(key)
        if built is not None:
            return built[1]
        op = self._make(node, depth, dtype)
        if op is not None and self.observe:
            op.inputs = [x if isinstance(x, _Op) else _Meta(x) for x in op.inputs]
        self._built[key] = (node, op)
        return op

    def _make(self, node, depth: int, dtype):
        cls = type(node)
        name = cls.__name__
        if name not in _BINARY and name not in _UNARY and (name != CAST or dtype is None):
            return None  # (most saved tensors: decided before looking at the inputs, the host's time counts)
        # (Written for the host's time: this runs for each candidate saved tensor of a derive block, every step.)
        values, versions, srcs = [], [], []
        for n, k in node.next_functions:
            if n is None:
                return None  # an input without gradient: its value is not reachable from the node
            got = self._leaf(n, k)
            if got is None:
                if depth <= 0:
                    return None
                op = self._build(n, k, depth - 1)
                if op is None:
                    return None
                values.append(op)
                versions.append(None)
                srcs.append(None)
            else:
                values.append(got[0])
                versions.append(got[1])
                srcs.append(got[2])
        device = values[0].device
        for v in values[1:]:
            if v.device != device:
                return None
        if name in _BINARY and len(values) == 2:
            a, b = values
            sa, sb = a.shape, b.shape
            shape = _broadcast(sa, sb)
            if shape is None or len(sa) == 0 or len(sb) == 0:
                return None  # (a 0-dim operand takes no part in type promotion: its result's dtype is not known)
            dtype = a.dtype if a.dtype == b.dtype else torch.promote_types(a.dtype, b.dtype)
            return _Op(_BINARY[name], values, versions, shape, dtype, device, cls, srcs)
        if name in _UNARY and len(values) == 1:
            return _Op(_UNARY[name], values, versions, values[0].shape, values[0].dtype, device, cls, srcs)
        if name == CAST and len(values) == 1 and dtype is not None:
            # Autocast casts a tensor again for each op using it (query, key and value projections): one op each
            # source and dtype.
            key = ("cast", id(values[0]), dtype)
            built = self._built.get(key)
            if built is None:
                # (Held so that its id stays its own; not while only measuring: a tensor to be moved is freed.)
                built = (
                    None if self.observe else values[0],
                    _Op(_cast_to(dtype), values, versions, values[0].shape, dtype, device, cls, srcs),
                )
                self._built[key] = built
            return built[1]
        return None

    def _general(self, t: torch.Tensor, unit: int) -> Derived | None:
        base = t._base if t._base is not None else t
        view = base is not t
        node = base.grad_fn
        if node is None:
            self._record(None)
            return None
        nr = base.output_nr
        key = (id(node), nr)
        if type(node).__name__ not in _TOP:
            # Not made by an op a recipe contains (most saved tensors): a real saved tensor, a leaf for later
            # recipes, decided without building anything (the host's time per saved tensor counts).
            if key not in self._seen:
                self._seen[key] = (node, weakref.ref(base), base._version, self._pos)
            self._record(type(node))
            return None
        found = self._seen.get(key)
        if found is not None and isinstance(found[1], _Op):
            op = found[1]
        elif found is not None:
            self._record(type(node))
            return None
        else:
            op = self._build(node, nr, self.depth, dtype=base.dtype)
            if (
                op is None
                or op.shape != base.shape
                or op.dtype != base.dtype
                or op.device != base.device
                or not base.is_contiguous()
            ):
                self._seen[key] = (node, weakref.ref(base), base._version, self._pos)
                self._record(type(node))
                return None
            self._seen[key] = (node, op, None, self._pos)
        cast = _param_derived(t)
        self._record_recipe(t, base, node, op, view, cast)
        if cast and not self.derive_casts:
            return None  # held by autocast's cache through the forward anyway
        if not self.observe:
            self.counters["general"] += 1
        return Derived(op, t, base, unit, cast)

    def cost(self, d: Derived) -> tuple[int, int]:
        """(bytes read and written, ops) of the ops `d` needs that no earlier call this block reported."""
        total = ops = 0
        for o in d.op.ops():
            if id(o) not in self._counted:
                self._counted.add(id(o))
                total += o.traffic()
                ops += 1
                found = o.narrowed_product()
                if found is not None:  # one multiply writing half precision: the fp32 product is never written
                    total -= 2 * found[0].nbytes
                    ops -= 1
        return total, ops


_CASTS: dict = {}
_HALF = (torch.bfloat16, torch.float16)


def _cast_to(dtype):
    """One function per dtype (a template's op replays it)."""
    fn = _CASTS.get(dtype)
    if fn is None:
        fn = _CASTS[dtype] = lambda x, d=dtype: x.to(d)
    return fn


_RATES: dict[str, float] = {}


def elementwise_rate(device: torch.device) -> float:
    """Bytes per second an elementwise kernel moves on `device` (read + write, one timed multiply; measured once)."""
    key = str(device)
    if key in _RATES:
        return _RATES[key]
    n = (1 << 25) if device.type == "cuda" else (1 << 20)
    a = torch.ones(n, device=device)
    b = torch.empty_like(a)
    torch.mul(a, a, out=b)  # warm-up
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(4):
            torch.mul(a, a, out=b)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 4
    else:
        import time

        t0 = time.perf_counter()
        for _ in range(4):
            torch.mul(a, a, out=b)
        seconds = (time.perf_counter() - t0) / 4
    _RATES[key] = 2 * n * a.element_size() / max(seconds, 1e-9)
    return _RATES[key]
