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

The ops are recomputed by the same kernels on the same inputs, so the values are bitwise those of forward. A tensor
found through a node whose input was changed in place since it was saved is not derived; a saved input changed in
place after the recipe was made raises a clear error at unpack (autograd itself refuses such a graph).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from .entries import _param_derived

# Autograd node names of the elementwise ops a recipe may contain, with the forward they stand for.
_BINARY = {"MulBackward0": torch.mul}
_UNARY = {"SiluBackward0": F.silu}
_CAST = "ToCopyBackward0"
_TOP = frozenset(_BINARY) | frozenset(_UNARY) | {_CAST}  # what a saved tensor's own node may be, to have a recipe
# Host time per op made again in backward (the recipe's Python and a kernel launch), on top of its memory traffic:
# ~10 us measured on CPU with tiny tensors (where the host's time is all there is).
OP_HOST_S = 1e-5


class _Op:
    """One recomputed op: its function, its inputs (tensors or other ``_Op``s) and what its result looks like. The
    result is held while something still needs it (`refs`: saved tensors not unpacked yet whose recipe ends here,
    and ops using it not made yet), so a result several need is made once and none is held longer."""

    __slots__ = ("fn", "inputs", "versions", "shape", "dtype", "device", "refs", "linked", "value")

    def __init__(self, fn, inputs, versions, shape, dtype, device):
        self.fn, self.inputs, self.versions = fn, inputs, versions
        self.shape, self.dtype, self.device = shape, dtype, device
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
        read = sum(i.nbytes if isinstance(i, _Op) else i.numel() * i.element_size() for i in self.inputs)
        return read + self.nbytes

    def compute(self) -> torch.Tensor:
        if self.value is not None:
            return self.value
        args = []
        for x, version in zip(self.inputs, self.versions, strict=True):
            if isinstance(x, _Op):
                args.append(x.compute())
                continue
            if version is not None and x._version != version:
                raise RuntimeError(
                    "ssdtrain: a tensor saved for backward was modified in place after it was saved "
                    f"(shape {tuple(x.shape)}, {x.dtype}); a block planned as 'derive' makes other saved tensors "
                    "from it again. Plan that block 'keep' or 'recompute' (overrides=), or avoid the in-place op"
                )
            args.append(x)
        value = self.fn(*args)
        if tuple(value.shape) != self.shape or value.dtype != self.dtype or value.device != self.device:
            raise RuntimeError(
                f"ssdtrain: a derived tensor came back as {tuple(value.shape)} {value.dtype} on {value.device}, "
                f"expected {self.shape} {self.dtype} on {self.device}; plan the block 'keep' or 'recompute' "
                "(overrides=) and report this model"
            )
        for x in self.inputs:
            if isinstance(x, _Op):
                x.drop()  # made: this op needs its inputs no more
        if self.refs > 0:
            self.value = value
        return value


class Derived:
    """What autograd holds for a derived saved tensor: the op making its storage's tensor, and its view of it."""

    __slots__ = ("op", "size", "stride", "offset", "unit", "cast", "__weakref__")

    def __init__(self, op: _Op, t: torch.Tensor, base: torch.Tensor, unit: int, cast: bool = False):
        self.op = op
        self.cast = cast  # a cast of a parameter (autocast's bf16 weight)
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
        if tuple(self.size) == tuple(value.shape) and tuple(self.stride) == value.stride() and self.offset == 0:
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


def _node_key(node, nr: int) -> tuple[int, int]:
    return (id(node), nr)


class Deriver:
    """Finds recipes for the tensors one block saves (``reset()`` at each block's start and end). `depth`: the
    most ops followed back from a saved tensor."""

    def __init__(self, depth: int = 4):
        self.depth = depth
        # Only measuring (a profiled step): recipes hold no tensors, as they are never made.
        self.observe = False
        # Parameters' casts (autocast's bf16 weights) as recipes too: only where the session clears autocast's cache
        # when the block returns (the cache would hold them otherwise); made again in backward from the parameter.
        self.derive_casts = False
        self._counted: set[int] = set()  # ids of ops whose cost ``cost`` reported already (this block)
        # (id(node), output) -> (node, what it is: weakref to a saved tensor or an _Op, its version when saved).
        # The node is held so that its id is not reused while the entry lives; entries live for one block.
        self._seen: dict[tuple[int, int], tuple] = {}
        # (id(node), output, dtype) -> (node, its op): an op built once per node, so that results shared by several
        # saved tensors (one cast feeding three projections) are made once.
        self._built: dict[tuple, tuple] = {}

    def reset(self) -> None:
        self._seen.clear()
        self._built.clear()
        self._counted.clear()

    def _leaf(self, node, nr: int):
        """A tensor or op standing for output `nr` of `node`, from what this block saved, or a parameter."""
        found = self._seen.get((id(node), nr))
        if found is not None:
            what, version = found[1], found[2]
            if isinstance(what, _Op):
                return what, None
            t = what()
            if t is None or t._version != version:
                return None
            return t, version
        if type(node).__name__ == "AccumulateGrad":
            # A parameter: its version is not checked, since a sharded model's parameter is gathered again (written
            # in place) before the block's backward, where the recipe uses it.
            return node.variable, None
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
        name = type(node).__name__
        if name not in _BINARY and name not in _UNARY and (name != _CAST or dtype is None):
            return None  # (most saved tensors: decided before looking at the inputs, the host's time counts)
        # (Written for the host's time: this runs for each candidate saved tensor of a derive block, every step.)
        values, versions = [], []
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
            else:
                values.append(got[0])
                versions.append(got[1])
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
            return _Op(_BINARY[name], values, versions, shape, dtype, device)
        if name in _UNARY and len(values) == 1:
            return _Op(_UNARY[name], values, versions, values[0].shape, values[0].dtype, device)
        if name == _CAST and len(values) == 1 and dtype is not None:
            # Autocast casts a tensor again for each op using it (query, key and value projections): one op each
            # source and dtype.
            key = ("cast", id(values[0]), dtype)
            built = self._built.get(key)
            if built is None:
                # (Held so that its id stays its own; not while only measuring: a tensor to be moved is freed.)
                built = (
                    None if self.observe else values[0],
                    _Op(lambda x, d=dtype: x.to(d), values, versions, values[0].shape, dtype, device),
                )
                self._built[key] = built
            return built[1]
        return None

    def derive(self, t: torch.Tensor, unit: int = 0) -> Derived | None:
        """A recipe for saved tensor `t`, or None (then `t` counts as saved for later recipes)."""
        base = t._base if t._base is not None else t
        node = base.grad_fn
        if node is None:
            return None
        nr = base.output_nr
        key = (id(node), nr)
        if type(node).__name__ not in _TOP:
            # Not made by an op a recipe contains (most saved tensors): a real saved tensor, a leaf for later
            # recipes, decided without building anything (the host's time per saved tensor counts).
            if key not in self._seen:
                self._seen[key] = (node, weakref.ref(base), base._version)
            return None
        found = self._seen.get(key)
        if found is not None and isinstance(found[1], _Op):
            op = found[1]
        elif found is not None:
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
                self._seen[key] = (node, weakref.ref(base), base._version)
                return None
            self._seen[key] = (node, op, None)
        cast = _param_derived(t)
        if cast and not self.derive_casts:
            return None  # held by autocast's cache through the forward anyway
        return Derived(op, t, base, unit, cast)

    def cost(self, d: Derived) -> tuple[int, int]:
        """(bytes read and written, ops) of the ops `d` needs that no earlier call this block reported."""
        total = ops = 0
        for o in d.op.ops():
            if id(o) not in self._counted:
                self._counted.add(id(o))
                total += o.traffic()
                ops += 1
        return total, ops


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
