"""What the session needs to know about a model: its repeated blocks (the units), their cheap submodules, the
signature of a call (plans are kept per input shape), and checkpoint wrappers it installs and removes."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

# The ops whose outputs selective recompute keeps (what they cost to run again is most of a block's time: matrix
# products and attention); everything else in the block (norms, activations, elementwise code, casts, copies) is
# run again in backward from those and the block's inputs.
_COMPUTE_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "_grouped_mm",
    "convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


@functools.lru_cache(maxsize=1)
def compute_ops() -> frozenset:
    """The aten op packets selective recompute saves (those this torch build has)."""
    return frozenset(getattr(torch.ops.aten, n) for n in _COMPUTE_OPS if hasattr(torch.ops.aten, n))


def is_compute_op(func) -> bool:
    return getattr(func, "overloadpacket", func) in compute_ops()


def _selective_policy(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if is_compute_op(func) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """``context_fn`` for ``torch.utils.checkpoint``: keep the outputs of matrix products and attention, recompute
    the rest (torch's selective activation checkpointing)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


def find_blocks(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]]:
    """The repeated blocks of `model`, the units a session plans: the blocks of every list :func:`find_block_groups`
    finds, one list after the other. Returns (container names joined by ", ", [(name, module)]); ("", []) for a
    model without repeated blocks (its top-level children are then the units, never recomputed)."""
    groups = find_block_groups(model)
    return ", ".join(name for name, _ in groups), [block for _, blocks in groups for block in blocks]


def find_block_groups(model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """The lists of repeated blocks of `model`, as (container name, [(name, module)]) in the model's registration
    order. A list is a ModuleList/Sequential with >= 2 children of one class. The one holding the most parameters
    is always one (GPT-2's ``transformer.h``, Llama's ``model.layers``, BERT's ``encoder.layer``); so is every
    other list with at least a quarter of its parameters that neither holds it nor lies inside it: T5's and BART's
    encoder and decoder layers, which a single list would leave the encoder's activations to the stem, a unit that
    can only move whole and never be recomputed. (A list inside a block, such as a mixture of experts, is part of
    its block.)"""
    found = []  # (parameters, registration order, container name, blocks)
    for order, (name, module) in enumerate(model.named_modules()):
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2:
            continue
        classes = [type(c) for _, c in children]
        cls = max(set(classes), key=classes.count)
        same = [(f"{name}.{n}" if name else n, c) for n, c in children if type(c) is cls]
        if len(same) < 2:
            continue
        weight = sum(p.numel() for _, c in same for p in c.parameters()) + len(same)
        found.append((weight, order, name, same))
    if not found:
        return []
    # heaviest first; among equals, the first registered (as before there were several lists)
    found.sort(key=lambda f: (-f[0], f[1]))
    chosen = [found[0]]
    for candidate in found[1:]:
        if 4 * candidate[0] >= found[0][0] and not any(_nested(candidate[2], c[2]) for c in chosen):
            chosen.append(candidate)
    chosen.sort(key=lambda f: f[1])
    return [(name, same) for _, _, name, same in chosen]


def _nested(a: str, b: str) -> bool:
    """Whether the modules named `a` and `b` are the same or one lies inside the other ("" is the model)."""
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def group_firsts(blocks: list[tuple[str, nn.Module]]) -> list[int]:
    """For the units of a session (0: the stem, 1..len(blocks): the blocks, then the head), the unit of the first
    block of each block's list (0 for the stem and head): what profiling measures on one block of a list holds for
    the blocks of that list, not for another list's (a decoder block's cross-attention saves more than an encoder
    block)."""
    firsts = [0]
    container = None
    for unit, (name, _) in enumerate(blocks, start=1):
        parent = name.rpartition(".")[0]
        if parent != container:
            container, first = parent, unit
        firsts.append(first)
    return firsts + [0]


def _elementwise(module: nn.Module) -> bool:
    """Parameter-free (activation functions, other elementwise code) or with 1-D parameters only (normalisation
    layers: their per-feature weights and biases): work of a few passes over the activations, no matrix product."""
    return all(p.dim() <= 1 for p in module.parameters())


def cheap_modules(block: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """The outermost elementwise submodules of a block: activation functions, normalisation layers (an RMSNorm in
    fp32 under autocast saves several fp32 copies of its input) and other parameter-free code."""
    found = []

    def visit(module, name):
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}"
            if _elementwise(child):
                if not isinstance(child, (nn.Dropout, nn.Identity)) and type(child).forward is not nn.Module.forward:
                    found.append((full, child))
            else:
                visit(child, full)

    visit(block, prefix)
    return found


def autocast_state() -> tuple:
    """The autocast regions a call runs in, as (device type, dtype) pairs: under autocast a model saves other
    tensors (bf16 copies of activations, casts of its weights) than without, so it gets its own plan."""
    state = []
    for device_type in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(device_type):
                state.append((device_type, torch.get_autocast_dtype(device_type)))
        except (RuntimeError, TypeError, AttributeError):  # a torch without per-device queries: not told apart
            pass
    return tuple(state)


def signature(args, kwargs) -> tuple:
    """Shapes, dtypes and devices of a call's tensors (and the types of the rest), and the autocast state: one
    plan per signature."""

    def sig(x):
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), x.dtype, x.device.type)
        if isinstance(x, (list, tuple)):
            return tuple(sig(v) for v in x)
        if isinstance(x, dict):
            return tuple((k, sig(v)) for k, v in sorted(x.items(), key=lambda kv: str(kv[0])))
        return type(x).__name__

    return sig(args), sig(kwargs), autocast_state()


def tensor_storages(values) -> dict[int, int]:
    """{storage address: bytes} of the plain tensors in `values` (nested lists, tuples, dicts)."""
    out = {}

    def walk(x):
        if isinstance(x, torch.Tensor):
            if x.layout == torch.strided and x.device.type in ("cpu", "cuda"):
                s = x.untyped_storage()
                out[s.data_ptr()] = s.nbytes()
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    walk(values)
    return out


def is_compiled(model: nn.Module) -> bool:
    return type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod")


def is_compiled_block(block: nn.Module) -> bool:
    """The block's forward is torch.compile'd on its own (``block.forward = torch.compile(block.forward)`` or
    ``block.compile()``): regional compilation."""
    forward_compiled = hasattr(block.forward, "_torchdynamo_orig_callable")
    return forward_compiled or getattr(block, "_compiled_call_impl", None) is not None


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local data: the shard of a DTensor (FSDP2's ``fully_shard``, tensor parallelism), else itself."""
    local = getattr(p, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else p


def param_storage_ptrs(model: nn.Module) -> set[int]:
    """Storage addresses of the model's parameters (their local shards under FSDP2). A parameter without data of
    its own here (a DTensor wrapper, a meta or freed storage) has none: parameters are also recognised by type and
    by their autograd node when saved, so nothing depends on this set alone."""
    ptrs = set()
    for p in model.parameters():
        try:
            ptr = local_tensor(p).untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        if ptr:
            ptrs.add(ptr)
    return ptrs


def param_bytes(modules) -> int:
    """Bytes of the gradients of the trainable parameters of `modules` (each parameter once)."""
    seen = set()
    total = 0
    for m in modules:
        for p in m.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                local = local_tensor(p)  # a sharded parameter's gradient is sharded too
                total += local.numel() * local.element_size()
    return total


def hf_settings(model: nn.Module) -> tuple[list, bool]:
    """(the Hugging Face configs `model` holds, each once: an encoder-decoder's decoder has its own copy; whether a
    module's own gradient checkpointing is on), in one pass over the modules. Both are read from the modules'
    instance attributes, where transformers sets them (``self.config = config``; ``gradient_checkpointing = True``
    by ``gradient_checkpointing_enable()``, whose class default is False), not through ``getattr``: every module
    without the attribute would go through ``nn.Module.__getattr__`` and its AttributeError: two such scans took
    2.1 ms of host time per session on a Llama-2-7B structure (423 modules) and 5.5 ms on 70B (1047), this pass
    0.45 ms and 1.2 ms."""
    configs: dict[int, object] = {}
    checkpointing = False
    for m in model.modules():
        attrs = vars(m)
        config = attrs.get("config")
        if config is not None:
            configs.setdefault(id(config), config)
        checkpointing = checkpointing or attrs.get("gradient_checkpointing") is True
    return list(configs.values()), checkpointing


@dataclass(frozen=True)
class ModelStructure:
    """What a session reads off a model's modules at ``offload()``: the units, their cheap submodules, gradient bytes
    per unit, whether blocks share parameters, the Hugging Face configs and checkpointing flag. See
    :func:`model_structure`."""

    container: str  # the block lists' names, joined by ", " ("": no repeated blocks; `blocks` are the children)
    blocks: tuple[tuple[str, nn.Module], ...]
    cheap: tuple[tuple[tuple[str, nn.Module], ...], ...]  # per block: cheap_modules (none where compiled)
    unit_grads: tuple[int, ...]  # per unit (stem, blocks, head): gradient bytes
    shares_params: bool  # a block's parameter is also used elsewhere (tied or shared weights)
    hf_configs: tuple
    checkpointing: bool  # the model's own (Hugging Face) gradient checkpointing is on


# model -> (key, weak references to the objects the key names by id, ModelStructure); weak keys, as the plans'
# _STATES. Weak references: strong ones to the model's modules would keep the model alive through its own entry.
_STRUCTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _structure_key(model: nn.Module) -> tuple[tuple, list]:
    """Everything a ModelStructure depends on, in one pass over the modules' own dicts: each module (identity, an
    instance ``forward`` such as a compiled or checkpointed one, a torch.compile'd call, the checkpointing flag,
    the config) and each parameter (identity, requires_grad, dtype, local shape). Returns (the key, the objects it
    names by id): while all of those are alive, no other object has their ids."""
    key: list = []
    named: list = []
    for m in model.modules():
        attrs = vars(m)
        forward, compiled, config = attrs.get("forward"), attrs.get("_compiled_call_impl"), attrs.get("config")
        named += (m, forward, compiled, config)
        key.append((id(m), id(forward), id(compiled), attrs.get("gradient_checkpointing") is True, id(config)))
        for p in attrs.get("_parameters", {}).values():
            if p is not None:
                local = local_tensor(p)
                named.append(p)
                key.append((id(p), p.requires_grad, local.dtype, tuple(local.shape)))
    return tuple(key), named


def _weak(objects: list) -> list:
    refs = []
    for obj in objects:
        if obj is not None:
            try:
                refs.append(weakref.ref(obj))
            except TypeError:  # no weak references to it: held, so that its id stays its own
                refs.append(lambda obj=obj: obj)
    return refs


def model_structure(model: nn.Module) -> ModelStructure:
    """The model's structure, read once and reused while the model is unchanged: a session per micro-batch (the
    Trainer callback, a context per step or forward) would otherwise read it again each time. On a Llama-2-7B
    structure on a 2-core CPU, opening and closing a session took 10-12 ms reading it each time, ~3 ms reusing it
    (``benchmarks/host_cost.py``'s ``open ms``); checking that it is unchanged is one pass over the modules and
    parameters."""
    key, named = _structure_key(model)
    known = _STRUCTURES.get(model)
    if known is not None and known[0] == key and all(ref() is not None for ref in known[1]):
        return known[2]
    structure = _read_structure(model)
    _STRUCTURES[model] = (key, _weak(named), structure)
    return structure


def _read_structure(model: nn.Module) -> ModelStructure:
    container, blocks = find_blocks(model)
    if not blocks:
        container, blocks = "", list(model.named_children())
    # No cheap candidates inside a block whose forward is compiled (torch.compile(block.forward)): module hooks
    # would run inside the compiled graph, and the compiler fuses such elementwise code anyway.
    cheap = tuple(
        () if (not container or hasattr(m.forward, "_torchdynamo_orig_callable")) else tuple(cheap_modules(m, n))
        for n, m in blocks
    )
    # Gradient bytes per unit: each block's parameters; everything else (embeddings, head) in the head, whose
    # backward runs first.
    per_block = [param_bytes([m]) for _, m in blocks]
    rest = max(0, param_bytes([model]) - sum(per_block))
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    shares = any(uses.get(id(p), 0) > 1 for _, block in blocks for p in block.parameters())
    configs, checkpointing = hf_settings(model)
    return ModelStructure(
        container=container,
        blocks=tuple(blocks),
        cheap=cheap,
        unit_grads=(0, *per_block, rest),
        shares_params=shares,
        hf_configs=tuple(configs),
        checkpointing=checkpointing,
    )


def grad_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the gradients backward will allocate: trainable parameters whose ``.grad`` is None now, bytes of
    the gradients held now), in one pass over the parameters: a step starts with this (host time per micro-batch)."""
    missing = held = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        if g is None:
            missing += local_tensor(p).numel() * p.element_size()
        else:
            held += local_tensor(g).numel() * g.element_size()
    return missing, held


class Checkpointer:
    """Wraps modules' forward in ``torch.utils.checkpoint`` (non-reentrant: RNG state replayed, inputs saved
    through the saved-tensor hooks) and takes the wrappers off again."""

    def __init__(self):
        self._wrapped: dict[int, tuple[nn.Module, object]] = {}

    def __len__(self) -> int:
        return len(self._wrapped)

    def wrap(self, module: nn.Module, when=None, selective: bool = False) -> None:
        """Checkpoint `module`, always or when `when()` says so at call time; `selective`: keep the outputs of its
        matrix products and attention (``selective_context``), recompute only the rest."""
        if id(module) in self._wrapped:
            return
        had = module.__dict__.get("forward")
        original = module.forward

        def forward(*args, **kwargs):
            if not torch.is_grad_enabled() or (when is not None and not when()):
                return original(*args, **kwargs)
            if selective:
                return torch.utils.checkpoint.checkpoint(
                    original, *args, use_reentrant=False, context_fn=selective_context, **kwargs
                )
            return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)

        module.forward = forward
        self._wrapped[id(module)] = (module, had)

    def unwrap_all(self) -> None:
        for module, had in self._wrapped.values():
            if had is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = had
        self._wrapped.clear()
