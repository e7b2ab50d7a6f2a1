"""``OffloadSession``: the object ``ssdtrain.offload()`` (``ssdtrain.api``) returns, a context manager.

The session is an orchestrator of parts that each do one thing: ``hooks`` (module hooks and the call-depth
bookkeeping that says when a step starts), ``profiler`` (warm-up and profiled steps, the device's memory readings),
``planner`` (a pure decision from measurements), ``planning`` (plans kept per model; calibration by measured peaks),
``tiers`` (host pool, NVMe) and ``cache`` (the saved-tensor hooks that move activations between them), ``stats``;
``options`` checks what ``offload()`` is given.
The module hooks and the saved-tensor hooks are installed when the ``with`` block starts and removed when it ends;
checkpoint wrappers chosen by the plan are installed on the blocks and removed likewise.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import warnings
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from . import stats as _stats
from .cache import TensorCache
from .derive import elementwise_rate
from .entries import OffloadWarning
from .hooks import ModuleHooks
from .hostpool import HostPool
from .model import (
    Checkpointer,
    grad_bytes,
    is_compiled,
    is_compiled_block,
    model_structure,
    param_storage_ptrs,
)
from .options import default_host_limit, nvme_options, parse_budget, size_option, whole_number
from .planner import BudgetError, Choice, Plan, format_bytes, make_plan, replan
from .planning import Calibrator, ModelState, leanest_plan, state_of
from .profiler import Clock, DeviceMemory, PeakProbe, Profiler, measure_link, working_memory
from .resources import SharedTiers, resources_of
from .tiers import DeviceTier, HostTier, NvmeTier

log = logging.getLogger("ssdtrain")
_MIB = 1 << 20
_LINKS: dict[str, object] = {}  # device -> measured link Bandwidth (once per process)
# Model and block modules -> the session active on them (one at a time: a new one closes the other).
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

__all__ = ["OffloadSession"]


def _not_compiled(fn):
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def _saved_tensor_hook(fn, counters, name: str):
    """`fn` as a saved-tensor hook that TorchDynamo never traces, at the cost of a plain call where no compiled code
    runs. ``torch.compiler.disable``'s wrapper switches the frame evaluator off and on again around every call (~5 us
    of host time each, and autograd calls the hooks ~1,500 times a step on a Llama-style model). Here the hook's own
    frame is marked for TorchDynamo to skip, and it takes the disabled path only while a compiled region is running
    (an evaluation callback is installed), where the functions it calls would otherwise be traced.

    Each call's host time goes to ``counters[f"{name}_host_ns"]`` and ``counters[f"{name}_calls"]`` (``stats()``'s
    ``hook_host_seconds``): where a step is host-bound, this time is the device's too (two clock reads a call)."""
    time_key, calls_key = f"{name}_host_ns", f"{name}_calls"
    clock = time.perf_counter_ns
    disabled = _not_compiled(fn)
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # a torch without these: the wrapper everywhere, untimed
        return disabled

    def hook(x):
        t0 = clock()
        try:
            callback = get_eval_frame_callback()
            if callback is not None and callback is not False:
                return disabled(x)
            return fn(x)
        finally:
            counters[time_key] += clock() - t0
            counters[calls_key] += 1

    skip_code(hook.__code__)
    return hook


@functools.cache
def _casts_clearer():
    """What drops autocast's cached weight casts: host bookkeeping that a block hook traced by ``module.compile()``
    calls, so TorchDynamo must not trace it. Made at the first session, not at import: ``torch.compiler.disable``
    imports TorchDynamo (1.5-1.9 s on this project's CPU machine), which ``import ssdtrain`` alone (the tensor I/O
    API, ``python -m ssdtrain``) does not need."""
    return _not_compiled(torch.clear_autocast_cache)


def _made_from(plan: Plan) -> tuple:
    """What a given plan's adjustment for accumulation was made from: its choices, budget and window (the caller
    may change the first with ``plan.override()``)."""
    return (list(plan.choices), plan.budget, plan.window_units)


def _same_recompute(old: Plan | None, new: Plan | None) -> bool:
    """Whether two plans recompute the same blocks the same way and clear autocast's casts alike: what a block
    saves depends on those, not on where its tensors go."""
    if old is None or new is None:
        return False
    return old.clear_casts == new.clear_casts and [c.recompute for c in old.choices] == [
        c.recompute for c in new.choices
    ]


class OffloadSession:
    """The object ``offload()`` returns; use it as a context manager. See the module docstring."""

    # Device bytes profiling may keep on a CPU "device" (tests lower it to exercise checkpointed profiling).
    _cpu_profile_allowance = float("inf")
    CALIBRATIONS = 3  # peak checks per plan lineage: a step-to-step spread of ~0.5 GiB (H100) needs a third
    CALIBRATION_PASSES = 2  # steps in a row within the prediction before a plan is trusted

    @property
    def settling_steps(self) -> int:
        """The most steps before a plan settles: profiling, peak calibrations and passes, the steps whose forwards
        are timed before the times are checked, and the timing checks (the time rescale, each link halving and the
        charge for moves: each a new plan, checked over two steps). Benchmarks time the steps after these."""
        timing = 1 + Calibrator.LINK_HALVINGS + 1
        timed = Calibrator.TIMED_STEPS - 1
        return self.profile_steps + self.CALIBRATIONS + self.CALIBRATION_PASSES + timed + 2 * timing

    def __init__(
        self,
        model: nn.Module,
        budget: int | float | str | None = None,
        *,
        plan: Plan | None = None,
        overrides: dict | None = None,
        host_memory: int | str | None = None,
        nvme_memory: int | str | None = None,
        directories: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        min_bytes: int | str | None = None,
        prefetch_units: int | None = None,
        on_full: str = "fallback",
        profile_steps: int | None = None,
        verbose: bool = False,
        _state: ModelState | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"offload() needs an nn.Module, got {type(model).__name__}")
        if on_full not in ("fallback", "raise"):
            raise ValueError(f"on_full must be 'fallback' or 'raise', got {on_full!r}")
        if prefetch_units is not None:
            whole_number("prefetch_units", prefetch_units, 1)
        if profile_steps is not None:
            whole_number("profile_steps", profile_steps, 1)
        # Held weakly: a closed session whose last step is still to be finished is kept by the model's state until
        # the model's next step (ModelState.unfinished), and must not keep the model alive.
        self._model = weakref.ref(model)
        self._clear_casts = _casts_clearer()
        self.budget, self.budget_fraction = parse_budget(budget)
        self.overrides = dict(overrides or {})
        for value in self.overrides.values():
            Choice.parse(value)  # fail now on a typo
        # None: 1 MiB, or with plan= the min_bytes its profile was taken with: smaller tensors are kept on the device
        # unmeasured, so a plan run under another min_bytes would keep (or move) bytes its prediction never saw.
        planned_min = getattr(plan, "min_bytes", None) if isinstance(plan, Plan) else None
        if min_bytes is None:
            min_bytes = planned_min if planned_min is not None else "1M"
        self.min_bytes = size_option("min_bytes", min_bytes)
        if planned_min is not None and self.min_bytes != planned_min:
            raise ValueError(
                f"offload(plan=...) with min_bytes={self.min_bytes}: the plan was profiled with "
                f"min_bytes={planned_min}, and its predictions hold only for that; leave min_bytes= out (the plan's is "
                "used) or make the plan with this one"
            )
        # None: 2, or with plan= the window the plan was made for (its prediction is for that one).
        planned_window = plan.window_units if isinstance(plan, Plan) else 2
        self.prefetch_units = int(prefetch_units if prefetch_units is not None else planned_window)
        self.profile_steps = int(profile_steps if profile_steps is not None else 2)
        self.verbose = verbose
        self.on_full = on_full
        # (Not checked against the machine's RAM: where memory grows as it is used, MemTotal reads far less than
        # such a machine can pin.)
        self.host_limit = size_option("host_memory", host_memory) if host_memory is not None else default_host_limit()
        self.directories, self.nvme_limit, self.nvme_off = nvme_options(directories, nvme_memory)
        # The NVMe tier asked for by name (directories= or a size): a session that never writes there says so.
        self._nvme_asked = self.nvme_limit > 0 and (directories is not None or nvme_memory is not None)
        # The model's tiers are shared by sessions with the same limits *as given*: the default NVMe limit follows
        # the free space, which the engine's own files change. (An NVMe tier that is off is one per reason.)
        nvme_key = self.nvme_limit if nvme_memory is not None or self.nvme_limit == 0 else "free"
        self._tiers_key = (self.host_limit, tuple(self.directories), nvme_key, self.nvme_off)
        self._key_options = (
            (self.budget, self.budget_fraction),
            host_memory,
            nvme_memory,
            tuple(self.directories),
            tuple(sorted((k, str(Choice.parse(v))) for k, v in self.overrides.items())),
            self.min_bytes,
            self.prefetch_units,
        )

        self.compiled = is_compiled(model)
        inner = model._orig_mod if self.compiled else model
        structure = model_structure(inner)
        self.container = structure.container
        self.blocks = list(structure.blocks)
        self.unit_names = ["<stem>"] + [n for n, _ in self.blocks] + ["<head>"]
        self._caller_plan = plan  # plan= as given: what its adjustment for accumulation is remembered by
        if plan is not None:
            self._check_plan(plan)
            self._check_plan_options(plan, profile_steps)
            plan = self._with_window(plan)
            # An earlier session around this model adjusted this plan for accumulation: start with that one (a
            # session per step would otherwise apply the given plan, then the adjusted one, in every step).
            plan = self._adjusted(plan) or plan
        self.given_plan = plan
        unknown = sorted(set(self.overrides) - set(self.unit_names))
        if unknown and not self.compiled:  # (a compiled model's units are named when its profile is taken)
            raise KeyError(
                f"overrides name unknown units {unknown}; units: {', '.join(self.unit_names)} (checked at offload(), "
                "not after the profiling steps)"
            )
        self.cheap = [list(c) for c in structure.cheap]
        self.device = next((p.device for p in inner.parameters()), torch.device("cpu"))
        cuda = self.device.type == "cuda"
        self.memory = DeviceMemory(self.device)
        self.state = _state if _state is not None else (state_of(model) if plan is None else ModelState())
        self.plan: Plan | None = None
        # The pinned pool, the NVMe engine and the side streams belong to the model: every session around it with
        # the same limits reuses them (a session per step must not pin memory again every step).
        self.resources = resources_of(model)
        self.cache = TensorCache(min_bytes=self.min_bytes, tiers={}, on_full=on_full)
        self._bind_shared()
        self.cache.tier_of = self._tier_of
        clock = Clock(cuda)
        self.profiler = Profiler(
            self.unit_names, self.blocks, self.cheap, self.container, self.compiled, self.min_bytes, clock
        )
        self.probe = PeakProbe(self.memory)
        self.profiler.on_head_done = self.probe.head_done
        self.calibrator = Calibrator(
            self.memory,
            clock=clock,
            late=self._late_unpacks,
            waits=self._link_waits,
            limit=self.CALIBRATIONS,
            verbose=verbose,
            passes=self.CALIBRATION_PASSES,
            timed=self.state.timed,
        )
        self.cache.on_backward = self._backward_began
        self.hooks = ModuleHooks(self)
        self.checkpoints = Checkpointer()
        self.steps = 0
        self.profiled = 0
        self.planned_steps = 0  # steps run under a plan
        self._recomputed = 0  # modules the current plan checkpoints
        self._recomputed_any = False
        self._saved_hooks = None
        # Units the plan runs with ssdtrain's saved-tensor hooks off (see _bare), and whether they are off now.
        self._bare_units: frozenset[int] = frozenset()
        self._hooks_paused = False
        self._restore_cache: list = []  # the Hugging Face configs whose use_cache the session turned off
        self._entered = False
        self._closed = False
        self._packs = 0
        self._order_bounds: list[int] = []
        self._grads_at_profile = 0
        self._warm = None  # (device base, kept) of a warm-up step, for the profiled step's allowance
        self._warm_excess = 0
        self._unit_grads = list(structure.unit_grads)
        # Autocast caches the casts of the weights (bf16 copies of fp32 parameters) until its region ends: a
        # recomputed block saves none of them, yet the cache would hold them through the rest of the forward (on a
        # Llama-style model under full recompute, 1.3 GiB at the head). The cache is cleared when a recomputed
        # block returns, unless a block's parameter is used elsewhere too (shared or tied weights): there a later
        # user of the weight would cast it again, a copy no profile saw.
        self.clear_casts = not structure.shares_params
        # The Hugging Face configs (use_cache is off while the session is active) and the model's own checkpointing
        # flag: one pass over the modules for both.
        self._hf_configs = list(structure.hf_configs)
        if structure.checkpointing:
            self._warn_model_checkpoints()
        self.cache.deriver.derive_casts = self.clear_casts
        self._cast_units: frozenset[int] = frozenset()
        self._derive_units: frozenset[int] = frozenset()  # blocks the plan derives (their recipes have templates)
        self._released = False
        self._active_on: list[nn.Module] = []  # the modules _ACTIVE maps to this session (while entered)
        self._quiet = False  # plan(): its steps only profile

    @property
    def model(self) -> nn.Module:
        return self._model()

    def _check_plan(self, plan) -> None:
        """`plan=` must be a Plan made for this model's units: its choices are applied by unit position, so another
        model's plan would recompute or move the wrong blocks (or fail mid-forward)."""
        if not isinstance(plan, Plan):
            raise TypeError(f"plan= takes a Plan (from ssdtrain.plan() or session.plan), got {type(plan).__name__}")
        if self.compiled:  # a compiled model's units are slices of its saved-tensor order, not named blocks
            return
        names = [u.name for u in plan.units]
        # The same blocks under a wrapper (DDP's `module.`) or without one are the same units.
        same = len(names) == len(self.unit_names) and all(
            a == b or a.endswith("." + b) or b.endswith("." + a) for a, b in zip(names, self.unit_names, strict=True)
        )
        if not same:
            raise ValueError(
                f"plan= was made for other units ({plan.model}: {', '.join(names)}), not this model's "
                f"({', '.join(self.unit_names)}): make its plan with ssdtrain.plan(model, ...) on this model, or "
                "pass overrides= instead"
            )

    def _check_plan_options(self, plan: Plan, profile_steps: int | None) -> None:
        """A given plan is used as is, so a budget= other than the plan's own, overrides=, or profile_steps= (no
        step is profiled) would be ignored without a word (a plan made for 80 MiB run under budget=10 MiB): refuse
        them, naming the call that works. (min_bytes= is checked where it is read; prefetch_units= applies, see
        _with_window; the tiers' limits and on_full= are the session's own and apply as given.)"""
        if self.budget_fraction is not None:
            same_budget = self.budget_fraction == plan.budget_fraction
        else:  # bytes, or None (nothing asked): a plan for a fraction of keep's peak was made for another budget
            same_budget = self.budget is None or (plan.budget_fraction is None and self.budget == plan.budget)
        if not same_budget:
            shown = format_bytes(self.budget) if self.budget is not None else f"{self.budget_fraction} x keep's peak"
            raise ValueError(
                f"offload(plan=...) uses the plan as is, and it was made for budget "
                f"{format_bytes(plan.budget) if plan.budget is not None else 'None (the fastest plan)'}: "
                f"budget={shown} would be ignored. Pass plan=plan.replan(budget=...) to plan the same "
                "measurements for that budget (BudgetError if none fits), or leave budget= out"
            )
        if self.overrides:
            raise ValueError(
                "offload(plan=...) uses the plan's choices as they are: overrides= would be ignored. Apply them "
                "to the plan (plan.override('unit', 'choice') for each, then plan=plan), or pass overrides= "
                "without plan="
            )
        if profile_steps is not None:
            raise ValueError(
                f"offload(plan=...) profiles no step (the plan's measurements are used): profile_steps={profile_steps} "
                "would be ignored. Leave it out, or pass it to ssdtrain.plan(model, step_fn, profile_steps=...) "
                "where the plan is made"
            )

    def _with_window(self, plan: Plan) -> Plan:
        """The given plan with prefetch_units= as its prefetch window where another one than the plan's was given
        (a copy: the caller's plan is unchanged). How far ahead backward restores moved units is the session's to
        set, not one of the plan's choices, so the choices run as they are under the new window; their predicted
        peak may grow with it, which is said where it passes the plan's budget."""
        if self.prefetch_units == plan.window_units:
            return plan
        new = plan.with_window(self.prefetch_units)
        peak = new.prediction.peak
        if new.budget is not None and peak > new.budget:
            warnings.warn(
                f"ssdtrain: offload(plan=..., prefetch_units={self.prefetch_units}): with that window the plan's "
                f"predicted activation peak {format_bytes(peak)} is above its budget {format_bytes(new.budget)} "
                f"(made for prefetch_units={plan.window_units}); pass a smaller prefetch_units, or leave it out",
                OffloadWarning,
                stacklevel=4,
            )
        return new

    def _bind_shared(self) -> None:
        """Take the model's tiers for this session's limits (new ones if it has none, or other ones)."""
        key = self._tiers_key + (self.device.type == "cuda",)
        self.shared = self.resources.get(key, lambda: self._make_shared(key))
        self.pool = self.shared.pool
        self.nvme = self.shared.nvme
        self.nvme_limit = self.nvme.limit
        self.tiers = {"keep": DeviceTier(), "host": HostTier(self.pool), "nvme": self.nvme}
        self.cache.tiers = self.tiers
        self.cache.pool = self.pool
        self.cache.stream_source = self.shared.side_streams

    def _make_shared(self, key) -> SharedTiers:
        cuda = self.device.type == "cuda"
        pool = HostPool(self.host_limit, pinned=cuda)
        nvme = NvmeTier(
            pool,
            self.directories,
            self.nvme_limit,
            probe_bytes=64 * _MIB if cuda else 8 * _MIB,
            pinned=cuda,
            off_reason=self.nvme_off,
        )
        return SharedTiers(key, pool, nvme)

    def _warn_model_checkpoints(self) -> None:
        """A Hugging Face model whose own activation checkpointing is on (``gradient_checkpointing_enable()``, or the
        Trainer's ``gradient_checkpointing=True``) recomputes every block whatever the plan: its blocks save only
        their inputs, so the plan can only move those, and a budget below that peak is refused. Said once per model,
        at ``offload()``: with it on, ssdtrain mostly does nothing. (Read from the modules' own flag, which every
        transformers version sets, not its deprecated properties: ``hf_settings``.)"""
        if "model checkpointing" in self.state.warned:
            return
        self.state.warned.add("model checkpointing")
        warnings.warn(
            "ssdtrain: the model's own gradient checkpointing is on, so it recomputes every block whatever the plan "
            "(its blocks save only their inputs: ssdtrain can move only those, and a budget below that peak is "
            "refused). Turn it off (model.activation_checkpointing_disable(); before transformers 5, "
            "model.gradient_checkpointing_disable(); or gradient_checkpointing=False in the Trainer's arguments) "
            "and let the budget decide what to keep, move or recompute",
            OffloadWarning,
            stacklevel=4,
        )

    def _plan_key(self, signature):
        return (signature, self._key_options)

    # ----------------------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> OffloadSession:
        if self._entered:
            raise RuntimeError("this offload session is already active; create a new one with ssdtrain.offload()")
        if self._closed:
            raise RuntimeError("this offload session is closed; create a new one with ssdtrain.offload()")
        if self.model is None:
            raise RuntimeError(
                "the model given to ssdtrain.offload() no longer exists: the session holds it weakly, and nothing else "
                "referenced it (as in offload(build_model())); keep the model in a variable and pass that"
            )
        inner = self.model._orig_mod if self.compiled else self.model
        modules = [inner] + [b for _, b in self.blocks]
        others = {id(o): o for o in (_ACTIVE.get(m) for m in modules) if o is not None}
        for other in others.values():
            # Both sessions' hooks and checkpoint wrappers would be on the model at once, and taken off in an order
            # that leaves a stale wrapper on a block after both ended.
            warnings.warn(
                "ssdtrain: another offload session was still active on this model (an outer offload(), or one "
                "left open by an exception in a training step): it is closed now, as one session at a time works "
                "on a model (its saved activations stay valid). ssdtrain.OffloadCallback enters its own session "
                "for each training step: do not wrap trainer.train() in offload() too",
                OffloadWarning,
                stacklevel=2,
            )
            other.close()
        for m in modules:
            _ACTIVE[m] = self
        self._active_on = modules
        self._entered = True
        if self.shared.closed or self.shared.retired:  # released since offload() was called
            self._bind_shared()
        self.shared.acquire()
        self.cache.param_storages = param_storage_ptrs(self.model)
        # A Hugging Face model would append each block's keys and values to a KV cache, and a recomputed block
        # would append them again (attention then sees the keys twice): training needs no cache, so it is off while
        # the session is active (what transformers itself does under gradient checkpointing). Every config in the
        # model: an encoder-decoder's decoder has its own copy of the config (T5), read by the decoder alone.
        for config in self._hf_configs:
            if getattr(config, "use_cache", False) is True:
                config.use_cache = False
                self._restore_cache.append(config)
        self.hooks.install(self.model, [b for _, b in self.blocks], with_blocks=not self.compiled)
        # The hooks are host-side bookkeeping, never code to compile. Called from a torch.compile'd block while a
        # dispatch mode was active, TorchDynamo traced them as frames of their own, guarded on the cache's counters
        # and recompiled them for almost every saved tensor (steps 100x slower on CPU).
        c = self.cache.counters
        pack = _saved_tensor_hook(self.cache.pack, c, "pack")
        unpack = _saved_tensor_hook(self.cache.unpack, c, "unpack")
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=exc_type is not None)

    def close(self, abort: bool = False) -> None:
        """Remove every hook and wrapper. With `abort` (an exception left the ``with`` block) every stored
        activation, pinned buffer, NVMe file and I/O thread is released at once; otherwise they go as backward
        uses the activations still saved (all at once if none is left)."""
        if self._closed:
            return
        self._closed = True
        for m in self._active_on:
            if _ACTIVE.get(m) is self:
                del _ACTIVE[m]
        self._active_on = []
        try:
            if self._saved_hooks is not None:
                if not self._hooks_paused:  # (paused: off autograd's stack already)
                    self._saved_hooks.__exit__(None, None, None)
                self._hooks_paused = False
                self._saved_hooks = None
            self.hooks.remove()
            self.checkpoints.unwrap_all()
            for config in self._restore_cache:
                config.use_cache = True
            self._restore_cache = []
            if abort:
                self.calibrator.cancel()
            elif self.calibrator.checking or self.profiler.pending is not None:
                # The step under check, or the measured step, ended with this session (a session per step or per
                # forward): the model's next step, in whatever session, finishes it (_finish_previous), as one
                # session would at its next step.
                self.state.unfinished = self
        finally:
            self.profiler.stop()
            self.cache.observer = None
            self.cache.derive_unit = None
            self.cache.derive_kept = frozenset()
            self.cache.on_idle = self._release_tiers
            if abort:
                # An exception left the session: everything goes at once (the next session makes new tiers).
                self.resources.drop(self.shared)
            self.cache.close(abort=abort)
            if abort or self.cache.live_entries() == 0:
                self._release_tiers()
        if not abort and not self._quiet:
            self._warn_if_idle()
            self._warn_if_nvme_unused()

    def _release_tiers(self) -> None:
        """This session no longer needs the model's tiers (closed, and no activation of it is still saved)."""
        if self._released or not self._entered:
            return
        self._released = True
        self.shared.release_user()

    def _warn_if_idle(self) -> None:
        """A session that was asked to offload (a budget, a tier override) and moved and recomputed nothing."""
        asked = self.budget is not None or self.budget_fraction is not None
        asked = asked or any(Choice.parse(v) != Choice() for v in self.overrides.values())
        c = self.cache.counters
        if not asked or c["bytes_to_host"] + c["bytes_to_nvme"] > 0 or self._recomputed_any:
            return
        if any(k.startswith("fallback_") for k in c):
            return  # no tier had room (off or full): said already, by the fallback's own warning
        plan = self.plan or self.state.latest
        if self.planned_steps == 0:
            reason = (
                f"it ended after {self.steps} forward(s) while still profiling (profile_steps={self.profile_steps}: "
                "warm-ups, then one measured step, before a plan); the next forward around this model, in this or "
                "a new session, continues from there"
            )
        elif plan is not None and all(c == Choice() for c in plan.choices):
            reason = (
                f"the plan keeps everything: its predicted activation peak {format_bytes(plan.prediction.peak)} fits "
                f"the budget {format_bytes(plan.budget)}"
            )
        elif plan is not None and all(c.tier == "keep" for c in plan.choices):
            reason = (
                "the plan moves no unit, and its recompute choices "
                f"({', '.join(sorted({str(c) for c in plan.choices if c != Choice()}))}) found nothing to recompute "
                "in their blocks"
            )
        else:
            reason = (
                f"no saved tensor of a unit the plan moves reached min_bytes={self.min_bytes} (kept: "
                f"{c['kept_tensors']} tensors, {format_bytes(c['kept_bytes'])})"
            )
        if reason.split(":")[0] in self.state.warned:
            return
        self.state.warned.add(reason.split(":")[0])
        warnings.warn(f"ssdtrain: this session offloaded nothing: {reason}", OffloadWarning, stacklevel=3)

    def _warn_if_nvme_unused(self) -> None:
        """NVMe directories or room given by name, and a planned session that moved activations wrote none there
        (the plan found host memory faster, or enough). Said once per model."""
        c = self.cache.counters
        if not self._nvme_asked or self.planned_steps == 0 or c["bytes_to_nvme"] > 0 or c["bytes_to_host"] == 0:
            return
        key = "nvme unused"
        if key in self.state.warned:
            return
        self.state.warned.add(key)
        warnings.warn(
            f"ssdtrain: the NVMe tier you gave ({', '.join(self.directories)}) was never written: the plan keeps "
            f"every moved activation in host memory (host_memory={format_bytes(self.host_limit)}), which is faster. "
            "To use the disk, pass a smaller host_memory= or overrides={'<block>': 'nvme'}; to silence this, leave "
            "out directories= and nvme_memory=",
            OffloadWarning,
            stacklevel=3,
        )

    # ----------------------------------------------------------------------------------------------- hooks
    def start_step(self, signature: tuple) -> None:
        """A new step begins (the model's outermost forward, or the blocks starting over)."""
        # What this step starts with is seen before a profile's plan is made: the step that first holds every
        # gradient (gradient accumulation) may be the one right after the profiled step, and that plan is for it.
        grads, held = grad_bytes(self.model)
        held = 0 if grads else held
        if grads:
            self.state.grads_missing = True
        elif held:
            self.state.grads_held = True
        self._finish_previous()
        if self.profiler.pending is not None:
            self._finish_profile()
        self.steps += 1
        self.state.steps += 1
        self._packs = 0
        self.cache.unit = 0
        self.cache.reset_step()
        new = self.calibrator.finish(self.state.steps)
        if new is not None:
            self.state.replace(self.plan, new)
        if self._warm is not None:
            base, kept = self._warm
            self._warm = None
            self._warm_excess = max(0, self.memory.max_allocated() - base - kept)
        plan = self.given_plan or self.state.plans.get(self._plan_key(signature))
        if plan is None and signature[0] == "blocks" and self.state.latest is not None:
            plan = self.state.latest  # a step through the blocks alone: the plan of the model's last shape
        if plan is not None:
            if self.state.grads_missing and self.state.grads_held and plan.grads and not plan.held_grads:
                plan = self._for_held_grads(plan)
            if plan is not self.plan:
                self._apply(plan)
            self.profiler.stop()
            self.planned_steps += 1
            self.calibrator.start(plan, grads > 0, given=plan is self.given_plan, held=held)
            return
        self._begin_profiling(signature, grads)

    def _finish_previous(self) -> None:
        """Finish the last step of an earlier session around the model that closed before it could, here, at the
        model's next step, as a single session finishes a step at its next one: with a session per step (the
        Trainer callback's, torchtune's) or per forward (backward after the ``with`` block, so after the session
        closed), the measured step's profile becomes a plan once its backward's peaks were read and this step's
        held gradients seen (accumulation), and a step's peak check is judged by the peak read when its backward
        ended. A check whose backward never ended (no peak was read) is dropped: the memory's peak now holds
        whatever ran since."""
        previous, self.state.unfinished = self.state.unfinished, None
        if previous is None:
            return
        if previous.profiler.pending is not None:
            previous._finish_profile()
        calibrator = previous.calibrator
        if calibrator.checking and not calibrator.measured:
            calibrator.cancel()
        if calibrator.checking:
            new = calibrator.finish(self.state.steps + 1)  # its step was the model's last
            if new is not None:
                self.state.replace(previous.plan, new)

    def _for_held_grads(self, plan: Plan) -> Plan:
        """Gradient accumulation began after `plan` was made: its steps hold every gradient throughout, so the same
        measurements are planned again for that, once. The new plan takes the old one's place (in the model's plans,
        or as this session's given plan and for later sessions with the same plan=; the caller's Plan is unchanged),
        so later steps find it: otherwise every step would plan again and apply a new plan, losing the derive
        templates each time.

        The budget holds as before: a profiled plan that no longer fits its budget= raises BudgetError here, at the
        first accumulation step (as at the first plan); a given plan (plan=) is run as the user has it, so its
        leanest form is used with an OffloadWarning (as plan.override does)."""
        given = plan is self.given_plan
        if given and (new := self._adjusted(plan)) is not None:
            self.given_plan = new
            return new
        held = format_bytes(sum(u.grad_bytes for u in plan.units))
        cause = f"gradient accumulation began after the plan was made (steps start with every gradient held, {held})"
        try:
            new = replan(plan, held_grads=True)
        except BudgetError as e:
            if not given:
                raise BudgetError(f"ssdtrain: {cause}: {str(e).removeprefix('ssdtrain: ')}", e.minimum) from None
            new = leanest_plan(plan, held_grads=True)
            warnings.warn(
                f"ssdtrain: offload(plan=...): {cause}: no plan fits its budget {format_bytes(plan.budget)} with them; "
                f"training goes on with the leanest (predicted activation peak {format_bytes(new.prediction.peak)}, "
                "over the budget). Pass plan=plan.replan(budget=...) with a larger budget, or reduce the batch",
                OffloadWarning,
                stacklevel=5,
            )
        if given:
            self.given_plan = new
            state_of(self.model).adjusted[id(self._caller_plan)] = (self._caller_plan, _made_from(plan), new)
        else:
            self.state.replace(plan, new)
        line = (
            f"ssdtrain: {cause}: plan for {plan.model} made again for it: predicted activation peak "
            f"{format_bytes(new.prediction.peak)} (was {format_bytes(plan.prediction.peak)})"
        )
        self._say(line)
        if new.budget is None and not new.fits:
            warnings.warn(f"ssdtrain: {new.notes[-1]}; reduce the batch", OffloadWarning, stacklevel=5)
        return new

    def _adjusted(self, plan: Plan) -> Plan | None:
        """`plan` (this session's given plan) as a session around this model adjusted it for gradients held through
        accumulation (``_for_held_grads``), while the caller's plan is still the one it was made from; else None."""
        remembered = state_of(self.model).adjusted.get(id(self._caller_plan))
        if remembered is None:
            return None
        caller, then, new = remembered
        return new if caller is self._caller_plan and then == _made_from(plan) else None

    def _say(self, line: str) -> None:
        """A plan made or made again: logged, and printed with verbose=True."""
        log.info(line)
        if self.verbose:
            print(line, file=sys.stderr)

    def _begin_profiling(self, signature, grads: int) -> None:
        """No plan for this input shape yet: warm up (first-call costs, pool growth), then profile one step."""
        self._apply(None)
        done = self.state.warmups.get(signature, 0)
        warmup = done + 1 < self.profile_steps
        allowance = self._cpu_profile_allowance
        if self.memory.can_measure():
            # A warm-up step keeps nothing it can move or recompute: blocks after the first are checkpointed and
            # saved tensors go to host memory, so its peak (the head's logits and their gradients, which no plan
            # removes) is at most what full recompute needs, whatever the batch. The measured step then keeps
            # what leaves that peak's working memory free, half the free memory at most.
            free = self.memory.free()
            allowance = 0 if warmup else max(0, min(free // 2, free - int(1.25 * self._warm_excess)))
            limit = 1 << 30 if self.budget is None else max(256 * _MIB, min(1 << 30, self.budget // 4))
            self.cache.max_inflight = limit
        else:
            self.cache.max_inflight = float("inf")
        self.profiler.begin(signature, allowance)
        if self.container and not self.compiled:
            firsts = self.profiler.firsts
            for i, (_, block) in enumerate(self.blocks, start=1):
                if firsts[i] != i:  # (the first block of each list is measured, never checkpointed)
                    self.checkpoints.wrap(block, when=self.profiler.checkpoint_when(i))
        if warmup:
            self.state.warmups[signature] = done + 1
            if self.memory.can_measure():
                self._warm = (self.memory.allocated(), 0)
                self.memory.reset_peak()
            return
        self.profiled += 1
        profile = self.profiler.measure()
        self.cache.observer = profile.record
        if self.container and not self.compiled:
            # Which saved tensors of each block and of the head a recipe could make again (measured, none made).
            self.cache.deriver.observe = True
            self.cache.derive_unit = lambda unit: unit >= 1
        self._grads_at_profile = grads
        if self.memory.can_measure():
            # Working memory (temporaries never saved) = this step's peaks (forward, the head's backward, the
            # blocks' backward) minus what was saved at most. The peak statistics of torch.cuda are reset for
            # each (documented).
            self.probe.start()
            self.cache.peak_gpu_saved_bytes = self.cache.gpu_saved_bytes

    def forward_done(self, failed: bool) -> None:
        # Forward ends here; what is saved after it (a loss computed outside the model) still counts, in the
        # head, until the next step or plan() finishes the profile.
        if self.profiler.profile is not None and self.profiler.pending is None and self.memory.can_measure():
            self.probe.forward_done()
        self.profiler.forward_done(failed)
        self.calibrator.forward_done()
        head = len(self.unit_names) - 1
        if head in self._cast_units and self.plan is not None:
            # A derived head makes its weight casts again in backward: autocast's cache must not hold them through
            # it (a backward run inside the autocast region).
            self._clear_casts()
        self.cache.enter_unit(head)
        self.cache.launch_copies_out()
        self.cache.deriver.reset()
        self.cache.poll()

    def forward_interrupted(self, tracked: bool) -> None:
        """The last forward ended without its post hooks (a KeyboardInterrupt): end it as a failed one (`tracked`:
        it was a step's, not one under no_grad)."""
        if self._hooks_paused:
            self._resume_hooks()
        if tracked:
            self.forward_done(failed=True)

    def block_started(self, unit: int, args: tuple) -> None:
        self.cache.enter_unit(unit)
        if unit in self._bare_units:
            self._pause_hooks()
        # Recipes reach back to tensors saved by this block only; its template is replayed where it has one (a
        # block the plan derives: others need no template).
        self.cache.deriver.reset(("in", unit) if unit in self._derive_units else None)
        if self.plan is None:
            self.profiler.block_started(unit, args)

    def block_done(self, unit: int) -> None:
        if self._hooks_paused:
            self._resume_hooks()
        # What is saved after a block is its own, after the last block the head's (its template's key all the same).
        owner = unit if unit < len(self.blocks) else len(self.unit_names) - 1
        self.cache.deriver.reset(("after", unit) if owner in self._derive_units else None)
        if self.plan is None:
            self.profiler.block_done(unit)
            if self.clear_casts and unit in self.profiler.checkpointed:
                self._clear_casts()  # as under a plan: the measured working memory holds no stale casts
        elif unit in self._cast_units:
            # A recomputed block's weight casts are used by nothing after it (its backward casts again): the plan
            # counts them only while it runs (see __init__).
            self._clear_casts()
        # Tensors saved between blocks belong to the block before; after the last block, to the head.
        self.cache.enter_unit(unit if unit < len(self.blocks) else len(self.unit_names) - 1)
        if unit == len(self.blocks) and self.plan is not None and self.plan.drain_at_head:
            self.cache.finish_copies_out()  # (see Plan.drain_at_head)

    def _pause_hooks(self) -> None:
        """Take ssdtrain's saved-tensor hooks off autograd's stack while a bare unit runs forward (only where they
        are on top: hooks a user or a checkpoint pushed inside the session stay as they are)."""
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        hooks = self._saved_hooks
        if hooks is None or self._hooks_paused or top is None:
            return
        current = top(True)
        if current is None or current[0] is not hooks.pack_hook:
            return
        hooks.__exit__(None, None, None)
        self._hooks_paused = True
        self.cache.counters["bare_unit_forwards"] += 1

    def _resume_hooks(self) -> None:
        self._hooks_paused = False
        if self._saved_hooks is not None:
            self._saved_hooks.__enter__()

    def _order_unit(self) -> int:
        """Compiled models: no hooks run inside the compiled graph, so units are slices of the pack order."""
        self._packs += 1
        for i, start in enumerate(self._order_bounds):
            if self._packs <= start:
                return max(0, i)
        return len(self._order_bounds)

    def _tier_of(self, unit: int, nbytes: int) -> str:
        if self.compiled and self.plan is not None and self._order_bounds:
            unit = self._order_unit()
        if self.plan is None:
            return self.profiler.tier(nbytes) if self.profiler.active else "keep"
        return self.plan.choices[min(unit, len(self.plan.choices) - 1)].tier

    def _late_unpacks(self) -> tuple[int, int, float | None]:
        """(moved bytes late or not prefetched, moved bytes unpacked, seconds the device waited for them) so far:
        the calibrator's measure of copies back that did not keep up (the wait on CUDA only: read from events,
        after the step's end synchronised the device)."""
        c = self.cache.counters
        wait = self.cache.read_waits() if self.device.type == "cuda" else None
        return c["late_bytes"] + c["missed_bytes"], c["unpacked_moved_bytes"], wait

    def _link_waits(self) -> float:
        """Seconds waited so far for copies out (the in-flight bound and the drain before the head: the device's
        compute stream waits, read from CUDA events, once the last of those waits has ended) and for pinning new
        host memory (the host). Calibration takes them out of the measured forward to find its compute: a forward
        that waited for the link did not compute. (It is not all of the error: where the host paces the device,
        its own time is in the measure too, so the calibrator takes the least of two steps' measures.)"""
        self.cache.read_device_waits(block=True)
        c = self.cache.counters
        return (c["throttle_ns"] + c["head_drain_ns"]) / 1e9 + self.pool.grow_seconds

    def _backward_began(self) -> None:
        """A step's backward began (its first unpack): the step's peaks are read when backward ends, through the
        engine's final callback, not when the next step begins (the optimizer's step runs in between)."""
        if not self.calibrator.checking and self.probe.finished:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        except RuntimeError:  # not inside the autograd engine: the next step's start reads the peaks, as before
            pass

    def _backward_ended(self) -> None:
        self.calibrator.backward_done()
        self.probe.finish()  # the measured step's last reading (nothing when no step is measured)

    # ----------------------------------------------------------------------------------------------- plans
    def _finish_profile(self) -> None:
        profile = self.profiler.take()
        self.cache.observer = None
        self.cache.derive_unit = None
        if profile is None:
            return
        if any(profile.derive_traffic):
            self.profiler.derive_rate = elementwise_rate(self.device)
        units = self.profiler.units(profile, self._unit_grads)
        working = (0, 0, 0)
        if self.memory.can_measure():
            self.probe.finish()
            saved = self.profiler.kept + sum(profile.small) + sum(profile.pinned) + self.cache.peak_gpu_saved_bytes
            head = units[-1]
            head_saved = head.saved_bytes + head.small_bytes + head.pinned_bytes
            missing = self._grads_at_profile > 0
            grads = (self._unit_grads[-1], self._unit_grads[-2] if len(self._unit_grads) > 2 else 0, 0)
            grads = grads if missing else (0, 0, 0)
            recomputed = max(
                (
                    units[self.profiler.firsts[i]].saved_bytes + units[self.profiler.firsts[i]].small_bytes
                    for i in self.profiler.checkpointed
                ),
                default=0,
            )
            fwd, hd, blk = working_memory(self.probe, saved, head_saved, grads, recomputed)
            working = (fwd or 0, hd or 0, blk or 0)
        plan = self._make_plan(units, working)
        self.state.plans[self._plan_key(self.profiler.signature)] = plan
        self.state.latest = plan
        p, k = plan.prediction, plan.keep_prediction
        counts = {}
        for c in plan.choices:
            counts[str(c)] = counts.get(str(c), 0) + 1
        mix = ", ".join(f"{v} {key}" for key, v in sorted(counts.items()))
        line = (
            f"ssdtrain: plan for {plan.model} ({mix}): predicted activation peak {p.peak / 2**30:.2f} GiB "
            f"(keep: {k.peak / 2**30:.2f} GiB), forward+backward {p.seconds / k.seconds:.2f}x keep's; "
            "print(session.plan) for details"
        )
        self._say(line)
        if not plan.fits:
            warnings.warn(f"ssdtrain: {plan.notes[-1]}; reduce the batch", OffloadWarning, stacklevel=4)

    def _make_plan(self, units, working: tuple[int, int, int]) -> Plan:
        """`working`: the measured (forward, head's backward, a block's backward) working memory."""
        key = str(self.device)
        if key not in _LINKS:
            _LINKS[key] = measure_link(self.device)
        tiers = {name: t.spec() for name, t in self.tiers.items() if not t.resident}
        speed_target = None
        if self.budget is None and self.budget_fraction is None and self.memory.can_measure():
            speed_target = int(self.memory.free() * 0.85)
        plan = make_plan(
            type(self.model._orig_mod if self.compiled else self.model).__name__,
            units,
            _LINKS[key],
            self.budget,
            tiers=tiers,
            block_container=self.container,
            overrides=self.overrides,
            window_units=self.prefetch_units,
            speed_target=speed_target,
            working_bytes=working[1],
            forward_working=working[0],
            block_working=working[2],
            async_copies=self.device.type == "cuda",
            grads=self.state.grads_missing,
            held_grads=self.state.grads_missing and self.state.grads_held,
            budget_fraction=self.budget_fraction,
            clear_casts=self.clear_casts,
            drain_at_head=self.device.type == "cuda" and not self.compiled,
        )
        plan.compiled_blocks = any(is_compiled_block(m) for _, m in self.blocks)
        plan.min_bytes = self.min_bytes
        if self.compiled:
            plan.order_bounds = list(self.profiler.order_bounds)
            plan.notes.append(
                "torch.compile'd model: units are slices of the saved-tensor order (no module hooks "
                "run inside a compiled graph), so recompute is not planned; host/NVMe tiers apply"
            )
        return plan

    def _apply(self, plan: Plan | None) -> None:
        self.checkpoints.unwrap_all()
        self._recomputed = 0
        if not _same_recompute(self.plan, plan):
            # Templates were recorded under the last plan: where it recomputed other blocks (or cleared other
            # casts), blocks may save other tensors. Under the same recompute choices they still apply.
            self.cache.deriver.clear_templates()
        self.plan = plan
        self._cast_units = frozenset()
        self._bare_units = frozenset()
        self.cache.derive_unit = None
        self.cache.derive_kept = frozenset()
        self._derive_units = frozenset()
        self.cache.deriver.observe = False
        if plan is None:
            self.cache.window_bytes = 1 << 30
            self.cache.window_units = 1 << 30
            self.cache.keeps_unit = None
            self.cache.hold_head = None
            return
        if self.compiled:
            self._order_bounds = list(plan.order_bounds)
        for i, (u, c) in enumerate(zip(plan.units, plan.choices, strict=True)):
            if c.recompute != "none" and u.kind == "block" and not self.compiled:
                block = self.blocks[i - 1][1]
                if c.recompute == "full":
                    self.checkpoints.wrap(block)
                elif c.recompute == "selective":
                    self.checkpoints.wrap(block, selective=True)
                elif c.recompute == "cheap":
                    for name, module in self.cheap[i - 1]:
                        if name.removeprefix(u.name + ".") in u.cheap_modules:
                            self.checkpoints.wrap(module)
        # Units the plan keeps whole skip the per-tensor bookkeeping in pack (not for a compiled model: its units are
        # counted in pack order, every pack included).
        kept = [c.tier == "keep" for c in plan.choices]
        self.cache.keeps_unit = None if self.compiled else (lambda unit: kept[min(unit, len(kept) - 1)])
        pairs = zip(plan.units, plan.choices, strict=True)
        derive = [c.recompute == "derive" and u.kind in ("block", "head") for u, c in pairs]
        if any(derive) and not self.compiled:
            self.cache.derive_unit = lambda unit: derive[min(unit, len(derive) - 1)]
            self.cache.derive_kept = frozenset(i for i, d in enumerate(derive) if d and kept[i])
            self._derive_units = frozenset(i for i, d in enumerate(derive) if d)
        self._recomputed = len(self.checkpoints)
        self._bare_units = self._bare(plan)
        if plan.clear_casts and self.clear_casts and not self.compiled:
            self._cast_units = frozenset(
                i
                for i, (u, c) in enumerate(zip(plan.units, plan.choices, strict=True))
                if (u.kind == "block" and c.recompute in ("full", "selective", "derive"))
                or (u.kind == "head" and c.recompute == "derive")
            )
        self._recomputed_any = self._recomputed_any or self._recomputed > 0 or any(derive)
        # The planner's bound on moved bytes held on the device, prefetched in backward and in flight in forward.
        self.cache.window_bytes = plan.window_bytes
        self.cache.window_units = plan.window_units
        # Compiled models' units are slices of the pack order: the head is still the last one.
        self.cache.hold_head = len(plan.units) - 1 if plan.hold_head else None
        # Copies out in flight in forward before compute waits for them: the window, or more where the peak has room.
        inflight = max(plan.window_bytes, plan.inflight_bytes)
        self.cache.max_inflight = inflight if self.device.type == "cuda" else float("inf")
        if self.device.type == "cuda":
            self._pin_ahead(plan)

    def _pin_ahead(self, plan: Plan) -> None:
        """Pin `plan`'s host bytes now, not chunk by chunk as its first step copies out: pinning holds the host back
        and the device idles with it, and that step's forward is the one calibration times as compute. A quarter
        more for the chunks' unused tails. Once per plan and pool: a session per micro-batch applies the same plan
        each time, and its prediction is a pass over the units."""
        if self.shared.pinned_for is plan:
            return
        self.shared.pinned_for = plan
        moved = plan.prediction.host_bytes
        if moved:
            self.pool.reserve(moved + moved // 4)

    def _bare(self, plan: Plan) -> frozenset[int]:
        """Blocks whose forward runs without ssdtrain's saved-tensor hooks: blocks the plan keeps whole (no recompute,
        nothing moved) with no moved unit below them. Python hooks cost the host ~1-3 us per saved tensor even where
        they decide nothing, and a host-bound step pays that on the device. A kept unit's unpacks matter only to
        move the prefetch window to the units below, so a unit with a moved one below keeps its hooks (its data
        would be restored on demand, not ahead of backward). Never the stem or head: the head's first unpack
        starts the step's backward bookkeeping; nor for a compiled model (no block hooks)."""
        if self.compiled or not self.container:
            return frozenset()
        bare = set()
        moved_below = False
        for i, (u, c) in enumerate(zip(plan.units, plan.choices, strict=True)):
            if u.kind == "block" and c == Choice() and not moved_below:
                bare.add(i)
            if c.tier != "keep":
                moved_below = True
        return frozenset(bare)

    # ----------------------------------------------------------------------------------------------- facts
    def stats(self) -> dict:
        """Counters since the session started: bytes per tier, prefetch hits, forwards, misses, stalls, fallbacks,
        the host pool and the NVMe engine."""
        return _stats.session_stats(self)
