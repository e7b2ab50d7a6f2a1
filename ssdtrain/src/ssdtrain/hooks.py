"""The module hooks a session installs, and the call-depth bookkeeping that says when a training step starts.

A step starts at the model's outermost forward, or, for blocks called without the model's own forward (a custom
loop over ``model.layers``), when the blocks start over. The forward hooks are registered with ``always_call``:
they run when a forward raises too, so an exception (caught inside the session or not) never leaves the depth
counters behind, and the next forward starts a step as usual. Blocks re-run by a checkpoint during backward (Hugging
Face's gradient checkpointing calls the layer again) are no new step, and neither are forwards that save nothing
for backward (under ``torch.no_grad()`` or ``torch.inference_mode()``: evaluation, generation), which the hooks
leave alone entirely: they are not counted, not profiled and get no plan.
"""

from __future__ import annotations

import sys

import torch

from .model import signature

_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)  # (looked up once: the hooks run per block)


def _in_backward() -> bool:
    return _GRAPH_TASK is not None and _GRAPH_TASK() != -1


_CALL_CODE = torch.nn.Module._call_impl.__code__


def _running(module) -> bool:
    """Is `module`'s forward running further up the stack, beyond the call whose pre hook asks (its first)?"""
    calls = 0
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_CODE and frame.f_locals.get("self") is module:
            calls += 1
            if calls == 2:
                return True
        frame = frame.f_back
    return False


def _failed(output) -> bool:
    """Called from a forward hook: did the forward raise (the hook runs in torch's exception handler)?"""
    return output is None and sys.exc_info()[1] is not None


class ModuleHooks:
    """Forward pre/post hooks on the model and its blocks, reporting to `listener`:

    ``start_step(signature)``, ``forward_done(failed)``, ``forward_interrupted(tracked)``,
    ``block_started(unit, args)``, ``block_done(unit)`` and its ``steps`` (steps started so far)."""

    def __init__(self, listener):
        self.listener = listener
        self.depth = 0  # nesting of the model's forward
        self.block_depth = 0
        self.last_started = 0  # the last block whose forward began this step
        self.untracked = 0  # nesting of a forward that saves nothing for backward (no_grad: evaluation, generation)
        self._handles: list = []

    def install(self, root, blocks, with_blocks: bool) -> None:
        self._handles.append(root.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._handles.append(root.register_forward_hook(self._root_post, always_call=True))
        if with_blocks:
            for i, block in enumerate(blocks, start=1):
                self._handles.append(block.register_forward_pre_hook(self._block_pre(i)))
                self._handles.append(block.register_forward_hook(self._block_post(i), always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.reset()

    def reset(self) -> None:
        self.depth = 0
        self.block_depth = 0
        self.last_started = 0
        self.untracked = 0

    def _root_pre(self, module, args, kwargs):
        if (self.depth or self.untracked) and not _running(module):
            # The last forward never came back through the post hooks: torch runs always_call hooks for an
            # Exception only, not for a KeyboardInterrupt (Ctrl-C). Without this, every later forward would count
            # as nested in that one: no step started again, and saved-tensor hooks paused for a block stayed off.
            tracked = self.depth > 0  # (an interrupted forward under no_grad was no step: nothing to end)
            self.reset()
            self.listener.forward_interrupted(tracked)
        if self.untracked or (self.depth == 0 and not torch.is_grad_enabled()):
            self.untracked += 1
            return
        self.depth += 1
        if self.depth == 1:
            self.last_started = 0
            self.block_depth = 0
            self.listener.start_step(signature(args, kwargs))

    def _root_post(self, module, args, output):
        if self.untracked:
            self.untracked -= 1
            return
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            self.listener.forward_done(_failed(output))

    def _block_pre(self, unit: int):
        def hook(module, args):
            if _in_backward() or self.untracked or not torch.is_grad_enabled():
                return
            if self.depth == 0 and self.block_depth == 0 and (self.listener.steps == 0 or unit <= self.last_started):
                self.listener.start_step(("blocks", signature(args, {})))
            self.last_started = unit
            self.block_depth += 1
            self.listener.block_started(unit, args)

        return hook

    def _block_post(self, unit: int):
        def hook(module, args, output):
            if _in_backward() or self.untracked or not torch.is_grad_enabled():
                return
            self.block_depth = max(0, self.block_depth - 1)
            self.listener.block_done(unit)

        return hook
