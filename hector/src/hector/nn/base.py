"""The base class that turns a layer written in the builder DSL into an ``nn.Module``."""

from __future__ import annotations

import contextlib
import math
import operator
import threading
from typing import Any

import torch
from torch import nn

from .. import config
from ..errors import GraphInputError
from ..ir.builder import Builder, Value
from ..ir.core import Program
from ..passes import Options
from ..runtime.compiled import Binding, CompiledLayer, apply_bound, binding, compile_program, prepare_apply
from ..runtime.graph import Graph, graph_for
from . import _ops

_COMPILE_LOCK = threading.RLock()


_UNSET = object()


def _same(previous: Any, value: Any) -> bool:
    """Whether a layer attribute set to ``value`` keeps the value it had (``previous``; ``_UNSET`` if none)."""
    if previous is value:
        return True
    try:
        return type(previous) is type(value) and bool(previous == value)
    except Exception:  # a value whose == is not a plain answer: treated as a change
        return False


class RelationalLayer(nn.Module):
    """Subclass, register parameters, and write :meth:`program`; ``forward`` does the rest.

    ``program(b)`` receives a :class:`~hector.ir.Builder` whose ``b.param(name, by=...)`` takes each
    parameter's shape from the module (parameters and buffers by attribute name) and must return the output node
    value. It is traced once per (training mode, optimisation choice); the passes, the generated backward and the
    kernel plan are cached on the module.

    Args:
        num_relations: R; edge types must lie in [0, R).
        num_node_types: T for layers typed by node type (None: node types unused).
        optimize: "auto" (the cost model picks compaction/reordering per graph for the least estimated time),
            "memory" (the same, for the least peak memory), "all", "none", or an :class:`~hector.passes.Options`.

    Shapes (``forward``): ``x`` [N, in_channels], ``edge_index`` [2, E] (row 0 source, row 1 destination) or a
    :class:`~hector.Graph`, ``edge_type`` [E], ``node_type`` [N] (required when there are several node types)
    -> [N, *output_feature_shape()].

    Mixed precision: under ``torch.autocast`` the layer runs in the autocast dtype (see :meth:`_leaves`).
    """

    input_name = "x"

    def __init__(self, num_relations: int, num_node_types: int | None = None, optimize: Any = "auto"):
        super().__init__()
        name = type(self).__name__
        self.num_relations = positive_int(name, "num_relations", num_relations)
        self.num_node_types = None if num_node_types is None else positive_int(name, "num_node_types", num_node_types)
        self.optimize = optimize
        self._compiled: dict[Any, CompiledLayer] = {}
        self._choices: dict[Any, Any] = {}  # the cost model's Options per graph size class (hector.cost)
        self._option_keys: dict[int, tuple[Options, tuple]] = {}  # id(Options) -> (it, its part of the cache key)
        # whether x needed a gradient at the last training call (None: no such call yet): what prepare() builds the
        # backward for when not told (the first layer of a model on fixed features never needs it, later ones do)
        self._input_grad_seen: bool | None = None
        self._layer_id = _ops.register(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.deepcopy and unpickling (torch.save/torch.load of a model) come through here with the original's id:
        # a copy registers under an id of its own, or the compiled op (which finds its layer by id) would run the
        # original (its mode, or an error once it is gone) and the per-graph caches keyed by id would mix the two
        super().__setstate__(state)
        self._layer_id = _ops.register(self)

    def __setattr__(self, name: str, value: Any) -> None:
        previous = self.__dict__.get(name, _UNSET)
        super().__setattr__(name, value)
        # a setting changed after the layer has traced its program (``conv.dropout = 0.1``, ``conv.negative_slope``):
        # the programs traced with the old value are dropped, and the layer takes a new id so that the per-graph
        # caches keyed by it (and a compiled graph, which guards on it) do not hand back the old program. Setting
        # the value it has (a schedule that sets ``dropout`` every epoch) keeps them: a new id re-plans every graph
        if (name[0] != "_" and name != "training" and not isinstance(value, (torch.Tensor, nn.Module))
                and not _same(previous, value)
                and (self.__dict__.get("_compiled") or "_output_shape" in self.__dict__)):
            self._compiled = {}
            self._option_keys = {}
            self.__dict__.pop("_output_shape", None)
            self._layer_id = _ops.register(self)

    # to implement
    def program(self, b: Builder) -> Value:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def in_channels_total(self) -> int:
        return self.in_channels  # type: ignore[attr-defined]

    # compilation
    def _tensors(self) -> dict[str, torch.Tensor]:
        # the module's own dicts (what named_parameters/named_buffers(recurse=False) walk, without their generator
        # and memo set): read on every call, eager or compiled
        out = {name: p for name, p in self._parameters.items() if p is not None}
        out.update({name: b for name, b in self._buffers.items() if b is not None})
        if "parametrizations" in self._modules:
            # torch.nn.utils.parametrize (weight_norm, orthogonal, spectral_norm, ...) moves a tensor out of
            # _parameters into parametrizations.<name>.original: the program reads its parametrized value,
            # computed here on each call (differentiable to the original), as PyG's layers read self.<name>
            for name in self._modules["parametrizations"]:
                out[name] = getattr(self, name)
        return out

    def trace(self, training: bool | None = None) -> Program:
        """The layer's program before optimisation (printable)."""
        b = Builder(type(self).__name__, {k: tuple(v.shape) for k, v in self._tensors().items()},
                    training=self.training if training is None else training)
        return b.build(self.program(b))

    def options_for(self, graph: Graph | None) -> Options:
        """The optimisation choice for ``graph``: fixed by ``optimize``, or the cost model's pick."""
        if isinstance(self.optimize, Options):
            return self.optimize
        if self.optimize == "none":
            return Options(compact=False, reorder=False)
        if self.optimize == "all":
            return Options(compact=True, reorder=True)
        if self.optimize not in ("auto", "memory"):
            raise ValueError(f"optimize must be 'auto', 'memory', 'all', 'none' or an Options, got {self.optimize!r}")
        if graph is None:
            return Options()
        from .. import config
        from ..cost import choose_options

        # the choice is kept on the graph for its next call (a full-graph loop asks the same each step); a
        # sync-free graph's statistics may still change when its pair count arrives, so it asks the cost model
        objective = "memory" if self.optimize == "memory" else "time"
        if graph.sync_free:
            return choose_options(self, graph, objective)
        return graph.cached(("options", self._layer_id, self.training, objective, config.sorted_scatter()),
                            lambda: choose_options(self, graph, objective))

    def compiled(self, graph: Graph | None = None, training: bool | None = None,
                 options: Options | None = None) -> CompiledLayer:
        training = self.training if training is None else training
        opts = self.options_for(graph) if options is None else options
        # the same Options object comes back for every call of a size class (the cost model's choice): its key
        # is kept with it, not rebuilt per call
        hit = self._option_keys.get(id(opts))
        if hit is not None and hit[0] is opts:
            opts_key = hit[1]
        else:
            rows_key = tuple(sorted((str(k), round(math.log2(max(v, 1.0)))) for k, v in (opts.rows or {}).items()))
            opts_key = (opts.compact, opts.reorder, opts.force_reorder, opts.fuse, opts.sorted_scatter, rows_key)
            if len(self._option_keys) > 64:
                self._option_keys.clear()
            self._option_keys[id(opts)] = (opts, opts_key)
        key = (training, *opts_key)
        compiled = self._compiled.get(key)
        if compiled is None:
            with _COMPILE_LOCK:  # a loader thread preparing graphs (prepare) may compile the same program
                compiled = self._compiled.get(key)
                if compiled is None:
                    compiled = self._compiled[key] = compile_program(self.trace(training), opts)
        return compiled

    def prepare(self, graph: Graph, *, dtype: torch.dtype | None = None, input_grad: bool | None = None) -> Graph:
        """Builds now everything this layer's first call on ``graph`` would build: the cost model's choice, the
        compiled program, and (on the CUDA backend) the graph's layout, constants and the launch plans of the
        forward and backward (sizes, grids, index bindings, tile schedules), so that a step on ``graph`` launches
        what a step on a graph used for many steps launches. Meant for the thread that makes mini-batches (see
        :func:`hector.prepare_graph`, which calls it for its ``layers``): thread-safe, and its device work runs
        on that thread's current CUDA stream.

        ``graph``: a :class:`~hector.Graph` (what :func:`hector.prepare_graph` returns). ``dtype``: the dtype the
        layer will run in (default: its parameters'; ``torch.bfloat16`` for a step under ``torch.autocast`` with
        bfloat16). ``input_grad``: whether ``x`` will need a gradient (True: a layer after another trainable
        one; False: the first layer on fixed features; None, the default: as at the layer's last training call,
        or both before its first; a wrong guess costs only the plan the step then builds itself). The layer's
        current mode (``train()`` / ``eval()``) decides between the training forward and backward and the inference
        forward. Returns ``graph``. Without effect on the reference backend beyond the cost model's choice and
        the compiled program (it builds its per-graph data on the call)."""
        if not isinstance(graph, Graph):
            raise GraphInputError(f"{type(self).__name__}.prepare takes a hector.Graph (from hector.prepare_graph), "
                                  f"got {type(graph).__name__}")
        if graph.num_relations != self.num_relations:
            raise GraphInputError(f"{type(self).__name__} has {self.num_relations} relations but the graph was made "
                                  f"with num_relations={graph.num_relations}; prepare it with the layer's count")
        if self.num_node_types is not None and graph.num_node_types != self.num_node_types:
            raise GraphInputError(f"{type(self).__name__} has {self.num_node_types} node types but the graph "
                                  f"{graph.num_node_types}; give prepare_graph node_type and num_node_types")
        tensors = self._tensors()
        param = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
        run_dtype = param if dtype is None else dtype
        if not run_dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {run_dtype}")

        def cast(t: torch.Tensor) -> torch.dtype:  # as _leaves casts under autocast
            return run_dtype if t.is_floating_point() and t.dtype != torch.float64 else t.dtype

        compiled = self.compiled(graph)
        used = {name for _, name in compiled.leaf_names}
        dtypes = {self.input_name: run_dtype}  # x in the parameters' dtype (or cast to the autocast one)
        dtypes.update({k: cast(v) if dtype is not None else v.dtype for k, v in tensors.items()})
        dtypes = {k: v for k, v in dtypes.items() if k in used}
        trained = frozenset([k for k, v in tensors.items() if v.requires_grad and k in used])
        if input_grad is None:  # a layer pickled before it kept the attribute has seen no call
            input_grad = getattr(self, "_input_grad_seen", None)
        variants = (False, True) if input_grad is None else (bool(input_grad),)
        grads = [trained | {self.input_name} if with_input else trained for with_input in variants]
        prepare_apply(compiled, graph, dtypes, self.training, grads)
        return graph

    # running
    def graph(self, x: torch.Tensor, edge_index: Any, edge_type: torch.Tensor | None,
              node_type: torch.Tensor | None = None) -> Graph:
        if isinstance(edge_index, Graph):
            self._check_graph(edge_index)
            return edge_index
        if edge_type is None:
            raise GraphInputError(f"{type(self).__name__} needs edge_type (one relation id per edge)")
        self._check_node_type(node_type)
        if self.num_node_types is None:
            # a layer not typed by node type never reads them; counting the types of a node_type given anyway
            # would read the device (its largest id) for every new graph
            node_type = None
        return graph_for(edge_index, edge_type, x.size(0), self.num_relations, node_type, self.num_node_types)

    def _check_graph(self, graph: Graph) -> None:
        """A :class:`~hector.Graph` given in place of ``edge_index`` was checked against its own counts: ids past
        the layer's (a graph made for a model with more relations or node types) would index past its weights, and
        a graph made without node types would run every node as type 0. Fewer types than the layer's are fine."""
        name = type(self).__name__
        if graph.num_relations > self.num_relations:
            raise GraphInputError(f"{name} has {self.num_relations} relations but the graph was made with "
                                  f"num_relations={graph.num_relations}; make it with the layer's count")
        if self.num_node_types is None:
            return
        if graph.num_node_types > self.num_node_types:
            raise GraphInputError(f"{name} has {self.num_node_types} node types but the graph was made with "
                                  f"{graph.num_node_types}; make it with the layer's count")
        if self.num_node_types > 1 and not graph.has_node_type:
            raise GraphInputError(f"{name} has {self.num_node_types} node types but the graph was made without "
                                  "node_type: give hector.prepare_graph (or Graph) node_type and num_node_types")

    def _check_node_type(self, node_type: torch.Tensor | None) -> None:
        if node_type is None and self.num_node_types is not None and self.num_node_types > 1:
            raise GraphInputError(f"{type(self).__name__} has {self.num_node_types} node types but got no node_type: "
                                  "pass node_type (one node-type id per node, [num_nodes]) as the fourth argument")

    def _check_x(self, x: Any) -> None:
        name = type(self).__name__
        if x is None or (isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() == 1):
            # PyG's RGCNConv(x=None or node indices): row x[j] of W_r is node j's message (trainable embeddings)
            got = "None" if x is None else f"node indices ({x.dtype} {list(x.shape)})"
            raise GraphInputError(f"{name}: x is {got}: PyG's featureless form (the weights' rows as trainable node "
                                  "embeddings) is not supported; hector's layers take features x [num_nodes, "
                                  "in_channels]. For PyG's result pass one-hot features: torch.eye(num_nodes) for "
                                  "x=None, torch.eye(in_channels)[x] for node indices x (dense: for large graphs "
                                  "learn features in an nn.Embedding instead)")
        if not isinstance(x, torch.Tensor):
            raise GraphInputError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise GraphInputError(f"{name}: x must be floating point, got {x.dtype}; convert with x.float()")
        if x.dim() != 2:
            raise GraphInputError(f"{name}: x must be [num_nodes, in_channels], got shape {tuple(x.shape)}")
        if x.size(0) == 0:
            raise GraphInputError(f"{name}: the graph is empty (x has no rows); a layer needs at least one node")
        if x.size(1) != self.in_channels_total:
            raise GraphInputError(f"{name}: x has {x.size(1)} features, the layer expects "
                                  f"in_channels={self.in_channels_total}")

    def _check_dtypes(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], autocast: bool = False) -> None:
        w = next((t for t in tensors.values() if t is not None and t.is_floating_point()), None)
        if w is not None and (w.dtype != x.dtype or w.device != x.device):
            if autocast and w.device == x.device:  # one of the two is float64, which autocast leaves as it is
                raise GraphInputError(f"{type(self).__name__}: under torch.autocast, x ({x.dtype}) and the layer's "
                                      f"parameters ({w.dtype} after the cast) differ: autocast casts float32, "
                                      "float16 and bfloat16 tensors but leaves float64 ones; give x and the layer "
                                      "one of those dtypes")
            raise GraphInputError(f"{type(self).__name__}: x is {x.dtype} on {x.device} but the layer's parameters "
                                  f"are {w.dtype} on {w.device}; use layer.to(x) or x.to(...), or run under "
                                  "torch.autocast")

    def _leaves(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], str | None]:
        """x and the layer's tensors as the backend gets them, and the device type whose autocast is on (None:
        off). Under ``torch.autocast`` the float32 (and the other non-float64 floating) tensors are cast to the
        autocast dtype with differentiable casts: the whole layer then runs in that dtype (the generated kernels
        store bf16/fp16 and accumulate in float32), gradients of float32 parameters come back in float32, and the
        output is in the autocast dtype, as for ``nn.Linear`` under autocast."""
        tensors = self._tensors()
        device_type = x.device.type
        if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)

            def cast(t: torch.Tensor) -> torch.Tensor:
                return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t

            x = cast(x)
            tensors = {k: cast(v) for k, v in tensors.items()}
            self._check_dtypes(x, tensors, autocast=True)
            return x, tensors, device_type
        self._check_dtypes(x, tensors)
        return x, tensors, None

    def output_feature_shape(self) -> tuple[int, ...]:
        """Per-node shape of the output (the program's output type), e.g. ``(64,)``."""
        if not hasattr(self, "_output_shape"):
            program = self.trace(False)
            self._output_shape = tuple(program.type_of(program.outputs[0]).shape)
        return self._output_shape

    def forward(self, x: torch.Tensor, edge_index: Any, edge_type: torch.Tensor | None = None,
                node_type: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [N, in_channels] (floating point), ``edge_index`` [2, E] (source row 0, destination row 1) or a
        :class:`~hector.Graph`, ``edge_type`` [E] relation ids in [0, R), ``node_type`` [N] node-type ids (layers
        typed by node type; ignored by a layer made without ``num_node_types``). Returns [N, out] in x's dtype
        (the autocast dtype under ``torch.autocast``)."""
        self._check_x(x)
        x, tensors, autocast_device = self._leaves(x)
        with torch.autocast(autocast_device, enabled=False) if autocast_device else contextlib.nullcontext():
            return self._run(x, tensors, edge_index, edge_type, node_type)

    def _run(self, x: torch.Tensor, tensors: dict[str, torch.Tensor], edge_index: Any,
             edge_type: torch.Tensor | None, node_type: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # torch.compile: the whole layer is one custom op with a fake kernel (no graph break)
            if isinstance(edge_index, Graph) or edge_type is None:
                raise GraphInputError(f"{type(self).__name__}: under torch.compile pass edge_index and edge_type "
                                      "tensors (not a hector.Graph)")
            self._check_node_type(node_type)
            return torch.ops.hector.relational_layer(x, edge_index, edge_type, node_type, list(tensors.values()),
                                                     self._layer_id)[0]
        if isinstance(edge_index, torch.Tensor) and edge_index.device != x.device:
            raise GraphInputError(f"edge_index is on {edge_index.device} but x on {x.device}")
        graph = self.graph(x, edge_index, edge_type, node_type)
        if graph.num_nodes != x.size(0):
            raise GraphInputError(f"x has {x.size(0)} rows but the graph has {graph.num_nodes} nodes")
        if self.training and torch.is_grad_enabled():
            self._input_grad_seen = x.requires_grad
        bound = self._binding(graph, tensors)
        input_name = self.input_name
        return apply_bound(bound, graph, [x if name == input_name else tensors[name] for name in bound.names])

    def _binding(self, graph: Graph, tensors: dict[str, torch.Tensor]) -> Binding:
        """The compiled program for ``graph`` with the order its call binds the tensors (a
        :class:`~hector.runtime.compiled.Binding`), kept on the graph per (layer, mode, optimisation setting, the
        setting the cost model reads, which tensors the layer has): a step on a graph it has seen does one lookup
        instead of asking the cost model's cache and the compiled programs again. Not kept on a ``sync_free``
        graph, whose statistics (and so the cost model's choice) may still change when its pair count arrives."""
        optimize = self.optimize
        key = ("binding", self._layer_id, self.training, optimize if isinstance(optimize, str) else id(optimize),
               config.sorted_scatter(), tuple(tensors))
        cache = graph._cache
        hit = cache.get(key)
        if hit is not None and hit[0] is optimize:
            return hit[1]
        compiled = self.compiled(graph)
        used = compiled.leaf_name_set
        names = tuple(name for _, name in compiled.leaf_names if name == self.input_name or name in tensors)
        if len(names) != len(used):
            missing = sorted(used - set(names))
            raise ValueError(f"no tensor bound to {missing}")
        bound = binding(compiled, names)
        if not graph.sync_free:
            cache[key] = (optimize, bound)
        return bound


def glorot_(t: torch.Tensor, fan_in: int, fan_out: int) -> torch.Tensor:
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    with torch.no_grad():
        return t.uniform_(-bound, bound)


def positive_int(layer: str, name: str, value: Any) -> int:
    """``value`` (a layer's size argument: a width, a count of relations, heads, bases) as an int >= 1, or a
    ``TypeError``/``ValueError`` that names ``layer``, the argument and the fix: a bad size would otherwise surface
    later as a bare error from inside ``torch.empty`` or the initialiser (a division by zero for ``heads=0``)."""
    if isinstance(value, tuple) and name == "in_channels":
        # PyG's bipartite form (x_src, x_dst): hector's program reads one x for both ends of every edge
        raise TypeError(f"{layer}: in_channels must be one int, got the tuple {value}: hector's layers take one "
                        "node set, x [N, in_channels], whose rows are both the sources and the destinations of the "
                        "edges (not PyG's bipartite pair (x_src, x_dst)); put both node sets in one x of one width "
                        "(destination ids offset by the number of source rows) and pass that width")
    try:
        if isinstance(value, bool):  # True would pass as 1
            raise TypeError
        number = operator.index(value)  # ints, numpy ints and integer 0-dim tensors; not 4.0 or "4"
    except TypeError:
        raise TypeError(f"{layer}: {name} must be an int, got {type(value).__name__} {value!r}; "
                        f"pass {name}=<positive int>") from None
    if number <= 0:
        fix = ("PyG's lazy width -1 is not supported: give the input width" if name == "in_channels" and number == -1
               else f"pass {name} >= 1")
        raise ValueError(f"{layer}: {name} must be a positive int, got {number}; {fix}")
    return number
