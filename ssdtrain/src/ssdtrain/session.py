"""``ssdtrain.offload(model, budget=...)``: saved activations to host RAM / NVMe / recompute under a memory budget.

    with ssdtrain.offload(model, budget="20GiB") as session:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step(); optimizer.zero_grad()
    print(session.plan)       # per-layer keep / host / nvme / recompute, predicted step time and peak
    print(session.stats())    # bytes per tier, prefetch hits, stalls, fallbacks

The first forward of each input shape is a *profiling* step: every activation worth moving goes to pinned host
memory (throttled so that the step fits in little device memory), while the session measures each unit's forward
time and saved bytes. From the next forward on the session runs the plan made from that profile. The module hooks
that attribute saved tensors to layers and the saved-tensor hooks are installed when the ``with`` block starts and
removed when it ends; checkpoint wrappers chosen by the plan are installed on the blocks and removed likewise.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
import weakref

import torch
from torch import nn

from .cache import OffloadWarning, TensorCache
from .hostpool import HostPool
from .io import Engine, huge_empty, parse_size
from .io import settings as io_settings
from .planner import Bandwidth, BudgetError, Choice, Plan, UnitProfile, format_bytes, make_plan

_MIB = 1 << 20
_PLAN_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: Plan}


# --------------------------------------------------------------------------------------------------- model structure
def find_blocks(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]]:
    """The repeated blocks of `model`: the ModuleList/Sequential holding the most parameters in >= 2 children of
    one class (GPT-2's ``transformer.h``, Llama's ``model.layers``, BERT's ``encoder.layer``). Without one, the
    model's top-level children are the units (never recomputed). Returns (container name, [(name, module)])."""
    best = None
    for name, module in model.named_modules():
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
        if best is None or weight > best[0]:
            best = (weight, name, same)
    if best is None:
        return "", []
    return best[1], best[2]


def _cheap_modules(block: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """The outermost parameter-free submodules of a block (activation functions and other elementwise code)."""
    found = []

    def visit(module, name):
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}"
            if next(child.parameters(), None) is None:
                if not isinstance(child, (nn.Dropout, nn.Identity)) and type(child).forward is not nn.Module.forward:
                    found.append((full, child))
            else:
                visit(child, full)

    visit(block, prefix)
    return found


def _signature(args, kwargs) -> tuple:
    def sig(x):
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), x.dtype, x.device.type)
        if isinstance(x, (list, tuple)):
            return tuple(sig(v) for v in x)
        if isinstance(x, dict):
            return tuple((k, sig(v)) for k, v in sorted(x.items(), key=lambda kv: str(kv[0])))
        return type(x).__name__

    return sig(args), sig(kwargs)


def _tensor_storages(values) -> dict[int, int]:
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


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _device_free(device: torch.device) -> int:
    """Bytes torch can still allocate: free on the device plus what its caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _compiled(model: nn.Module) -> bool:
    return type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod")


# --------------------------------------------------------------------------------------------------- timing
class _Clock:
    """Marks on the device's timeline (CUDA events) or the host's (CPU); seconds between marks after sync()."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1e3
        return b - a


class _Profile:
    """What one step measured: per unit, saved bytes by storage, small bytes, inputs, time; per cheap module, the
    storages saved inside it and its inputs."""

    def __init__(self, n_units: int, clock: _Clock):
        self.clock = clock
        self.saved = [dict() for _ in range(n_units)]  # unit -> {sptr: bytes}
        self.small = [0] * n_units
        self.tensors = [0] * n_units
        self.inputs = [dict() for _ in range(n_units)]
        self.marks = [[] for _ in range(n_units)]  # (start, end) pairs
        self.cheap_inside: dict[str, dict[int, int]] = {}
        self.cheap_inputs: dict[str, dict[int, int]] = {}
        self.cheap_marks: dict[str, list] = {}
        self.cheap_unit: dict[str, int] = {}
        self.cheap_stack: list[str] = []
        self.order: list[tuple[int, int]] = []  # (unit, bytes) in pack order (compiled models)
        self.count = 0
        self.address: dict[int, int] = {}  # sequence number -> storage address when saved

    def record(self, unit: int, key, nbytes: int, kind: str) -> None:
        sptr = key[2]
        if kind == "view":
            return
        self.tensors[unit] += 1
        if kind == "small":
            self.small[unit] += nbytes
            return
        # Keyed by a sequence number, not the address: the allocator reuses the address of a storage freed after
        # its copy out for the next one, and those are different activations.
        self.count += 1
        self.saved[unit][self.count] = nbytes
        self.address[self.count] = sptr
        self.order.append((unit, nbytes))
        if self.cheap_stack:
            self.cheap_inside.setdefault(self.cheap_stack[-1], {})[self.count] = nbytes


# --------------------------------------------------------------------------------------------------- session
class OffloadSession:
    """The object ``offload()`` returns; use it as a context manager. See the module docstring."""

    # Device bytes profiling may keep on a CPU "device" (tests lower it to exercise checkpointed profiling).
    _cpu_profile_allowance = float("inf")

    def __init__(
        self,
        model: nn.Module,
        budget=None,
        *,
        plan: Plan | None = None,
        overrides: dict | None = None,
        host_memory=None,
        nvme_memory=None,
        directories=None,
        min_bytes="1M",
        prefetch_units: int = 2,
        on_full: str = "fallback",
        profile_steps: int = 2,
        verbose: bool = True,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"offload() needs an nn.Module, got {type(model).__name__}")
        if on_full not in ("fallback", "raise"):
            raise ValueError(f"on_full must be 'fallback' or 'raise', got {on_full!r}")
        if prefetch_units < 1:
            raise ValueError(f"prefetch_units must be >= 1, got {prefetch_units}")
        self.model = model
        self.budget = None if budget is None else parse_size(budget)
        if self.budget is not None and self.budget <= 0:
            raise ValueError(f"budget must be positive (bytes or a size such as '20GiB'), got {budget!r}")
        self.given_plan = plan
        self.overrides = dict(overrides or {})
        for value in self.overrides.values():
            Choice.parse(value)  # fail now on a typo
        self.min_bytes = parse_size(min_bytes)
        self.prefetch_units = int(prefetch_units)
        if profile_steps < 1:
            raise ValueError(f"profile_steps must be >= 1, got {profile_steps}")
        self.profile_steps = int(profile_steps)
        self._warmups: dict = {}  # signature -> warm-up steps done
        self.verbose = verbose
        self.on_full = on_full
        self.directories = directories
        self.host_limit = parse_size(host_memory) if host_memory is not None else _host_available() // 2
        self.nvme_limit = parse_size(nvme_memory) if nvme_memory is not None else None

        self.compiled = _compiled(model)
        inner = model._orig_mod if self.compiled else model
        self.container, blocks = find_blocks(inner)
        if not blocks:
            blocks = [(n, m) for n, m in inner.named_children()]
            self.container = ""
        self.blocks = blocks
        self.unit_names = ["<stem>"] + [n for n, _ in blocks] + ["<head>"]
        # No cheap candidates inside a block whose forward is compiled (torch.compile(block.forward)): module hooks
        # would run inside the compiled graph, and the compiler fuses such elementwise code anyway.
        self.cheap = [
            [] if (not self.container or hasattr(m.forward, "_torchdynamo_orig_callable")) else _cheap_modules(m, n)
            for n, m in blocks
        ]

        self.plan: Plan | None = None
        self._plans: dict = _PLAN_CACHE.setdefault(model, {}) if plan is None else {}
        self._profile: _Profile | None = None
        self._profile_units = None
        self._pending_profile = None
        self._handles: list = []
        self._cheap_hooks: list = []
        self._restore_cache = None  # a Hugging Face config whose use_cache the session turned off
        self._wrapped: dict[int, tuple[nn.Module, object]] = {}
        self._hooks_ctx = None
        self._depth = 0
        self._block_depth = 0
        self._last_block = 0
        self._last_started = 0
        self._order_bounds: list[int] = []  # compiled models: pack index where each pseudo-unit starts
        self._packs = 0
        self._steps = 0
        self._profiled = 0
        self._entered = False
        self._closed = False
        self._bandwidth: Bandwidth | None = None
        self._profile_kept = 0
        self._profile_seen = 0
        self._block_seen_start = 0
        self._first_block_bytes = None
        self._profile_checkpointed: set[int] = set()
        self._profile_allowance = 0
        self._mem_base = 0
        self._final_engine_stats = None
        self._latest_plan: Plan | None = None
        self._peak_check = None
        self._recomputed = 0  # modules the current plan checkpoints
        self.device = next((p.device for p in inner.parameters()), torch.device("cpu"))
        cuda = self.device.type == "cuda"
        self._clock = _Clock(cuda)
        self.pool = HostPool(self.host_limit, pinned=cuda)
        self.cache = TensorCache(
            min_bytes=self.min_bytes, pool=self.pool, engine_factory=self._make_engine, on_full=on_full
        )
        self.cache.tier_of = self._tier_of

    # ----------------------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> OffloadSession:
        if self._entered:
            raise RuntimeError("this offload session is already active; create a new one with ssdtrain.offload()")
        if self._closed:
            raise RuntimeError("this offload session is closed; create a new one with ssdtrain.offload()")
        self._entered = True
        self.cache.param_storages = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        # A Hugging Face model would append each block's keys and values to a KV cache, and a recomputed block
        # would append them again (attention then sees the keys twice): training needs no cache, so it is off while
        # the session is active (what transformers itself does under gradient checkpointing).
        inner = self.model._orig_mod if self.compiled else self.model
        for m in (inner, getattr(inner, "module", None)):  # DDP wraps the model in .module
            config = getattr(m, "config", None)
            if config is not None and getattr(config, "use_cache", False) is True:
                config.use_cache = False
                self._restore_cache = config
                break
        root = self.model
        self._handles.append(root.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._handles.append(root.register_forward_hook(self._root_post))
        if not self.compiled:
            for i, (_, block) in enumerate(self.blocks):
                self._handles.append(block.register_forward_pre_hook(self._block_pre(i + 1)))
                self._handles.append(block.register_forward_hook(self._block_post(i + 1)))
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self.cache.pack, self.cache.unpack)
        self._hooks_ctx.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=exc_type is not None)

    def close(self, abort: bool = False) -> None:
        """Remove every hook and wrapper. With `abort` (an exception left the ``with`` block) every stored
        activation, pinned buffer, NVMe file and I/O thread is released at once."""
        if self._closed:
            return
        self._closed = True
        if self._hooks_ctx is not None:
            self._hooks_ctx.__exit__(None, None, None)
            self._hooks_ctx = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._remove_cheap_hooks()
        self._unwrap_all()
        if self._restore_cache is not None:
            self._restore_cache.use_cache = True
            self._restore_cache = None
        self.cache.close(abort=abort)
        if abort or self.cache.live_entries() == 0:
            self.pool.close()
            if self.cache.engine is not None:
                self._final_engine_stats = self._engine_stats()
                self.cache.engine.close()
                self.cache.engine = None
        # Otherwise activations saved in this session are still waiting for backward: their memory goes back as
        # backward uses them, and the pool and files go when the last one does.

    # ----------------------------------------------------------------------------------------------- hooks
    def _root_pre(self, module, args, kwargs):
        self._depth += 1
        if self._depth > 1:
            return
        self._start_step(_signature(args, kwargs))

    def _root_post(self, module, args, output):
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._profile is not None and self._pending_profile is None:
            # Forward ends here; what is saved after it (a loss computed outside the model) still counts, in
            # the head, until the next step or plan() finishes the profile.
            self._profile_end = self._clock.mark()
            self._pending_profile = self._profile
        self.cache.unit = len(self.unit_names) - 1
        self.cache.poll()

    def _block_pre(self, unit: int):
        def hook(module, args):
            if unit == 1 and self.plan is None:
                self._block_seen_start = self._profile_seen
            if self._depth == 0 and self._block_depth == 0 and (self._steps == 0 or unit <= self._last_started):
                # Blocks called without the model's own forward (e.g. a custom loop over model.layers): a new step
                # begins when the blocks start over.
                self._start_step(("blocks", _signature(args, {})))
            self._last_started = unit
            self._block_depth += 1
            self.cache.unit = unit
            if self._profile is not None:
                self._profile.marks[unit].append([self._clock.mark(), None])
                self._profile.inputs[unit].update(_tensor_storages(args))

        return hook

    def _block_post(self, unit: int):
        def hook(module, args, output):
            self._block_depth = max(0, self._block_depth - 1)
            self._last_block = unit
            if unit == 1 and self.plan is None:
                self._first_block_bytes = self._profile_seen - self._block_seen_start
            if self._profile is not None and self._profile.marks[unit]:
                self._profile.marks[unit][-1][1] = self._clock.mark()
            # Tensors saved between blocks belong to the block before; after the last block, to the head.
            self.cache.unit = unit if unit < len(self.blocks) else len(self.unit_names) - 1

        return hook

    def _cheap_pre(self, name: str):
        def hook(module, args):
            p = self._profile
            if p is not None and self._pending_profile is None:  # forward only: not a recompute in backward
                p.cheap_stack.append(name)
                p.cheap_inputs.setdefault(name, {}).update(_tensor_storages(args))
                p.cheap_marks.setdefault(name, []).append([self._clock.mark(), None])

        return hook

    def _cheap_post(self, name: str):
        def hook(module, args, output):
            p = self._profile
            if p is not None and self._pending_profile is None and p.cheap_stack:
                p.cheap_stack.pop()
                p.cheap_marks[name][-1][1] = self._clock.mark()

        return hook

    def _order_unit(self) -> int:
        """Compiled models: no hooks run inside the compiled graph, so units are slices of the pack order."""
        self._packs += 1
        for i, start in enumerate(self._order_bounds):
            if self._packs <= start:
                return max(0, i)
        return len(self._order_bounds)

    def _profile_checkpoint(self, unit: int):
        def decide() -> bool:
            if (
                self._first_block_bytes is None
                or self._profile_kept + self._first_block_bytes <= self._profile_allowance
            ):
                return False
            self._profile_checkpointed.add(unit)
            return True

        return decide

    def _tier_of(self, unit: int, nbytes: int) -> str:
        if self.compiled and self.plan is not None and self._order_bounds:
            unit = self._order_unit()
        if self.plan is None:
            self._profile_seen += nbytes
            # Profiling: keep on the device what fits in the allowance (fast, clean timings), the rest to host.
            if self._profile_kept + nbytes <= self._profile_allowance:
                self._profile_kept += nbytes
                return "keep"
            return "host"
        return self.plan.choices[min(unit, len(self.plan.choices) - 1)].tier

    # ----------------------------------------------------------------------------------------------- steps
    def _start_step(self, signature) -> None:
        if self._pending_profile is not None:
            self._finish_profile()
        self._steps += 1
        self._last_started = 0
        self._packs = 0
        self._last_block = 0
        self._block_depth = 0
        self.cache.unit = 0
        self.cache.reset_step()
        self._check_peak(signature)
        plan = self.given_plan or self._plans.get((signature, self._plan_key()))
        if plan is None and signature[0] == "blocks" and self._latest_plan is not None:
            plan = self._latest_plan  # a step through the blocks alone: the plan of the model's last shape
        if plan is not None:
            if plan is not self.plan:
                self._apply(plan)
            self._start_peak_check(signature, plan)
            return
        # No plan for this input shape yet: warm up (first-call costs, pool growth), then profile one step.
        self._signature = signature
        self._apply(None)
        cuda = self.device.type == "cuda"
        limit = 1 << 30 if self.budget is None else max(256 * _MIB, min(1 << 30, self.budget // 4))
        self.cache.max_inflight = limit if cuda else float("inf")
        self._profile_kept = 0
        self._profile_seen = 0
        self._first_block_bytes = None
        self._profile_checkpointed = set()
        self._profile_allowance = self._cpu_profile_allowance
        if cuda:
            # Half the free device memory, whatever the budget: profiling must not run out of memory, and what
            # it keeps it measures without detours (throttled copies would distort the timings).
            self._profile_allowance = _device_free(self.device) // 2
        if self.container and not self.compiled:
            # Blocks after the first are checkpointed while profiling once keeping them would pass the allowance:
            # repeated blocks save the same bytes, so the first one's count stands for them, and the profiling
            # step needs little device memory and no host traffic.
            for i, (_, block) in enumerate(self.blocks[1:], start=2):
                self._wrap(block, when=self._profile_checkpoint(i))
        done = self._warmups.get(signature, 0)
        if done + 1 < self.profile_steps:
            self._warmups[signature] = done + 1
            return
        self._profiled += 1
        self._profile = _Profile(len(self.unit_names), self._clock)
        self.cache.observer = self._profile.record
        if cuda:
            # Working memory (temporaries never saved) = this step's peak minus what was saved at most. The peak
            # statistics of torch.cuda are reset for it (documented).
            torch.cuda.synchronize(self.device)
            self._mem_base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.cache.peak_gpu_saved_bytes = self.cache.gpu_saved_bytes
        self._profile_start = self._clock.mark()
        if not self.compiled:
            for block_cheap in self.cheap:
                for name, module in block_cheap:
                    self._cheap_hooks.append(module.register_forward_pre_hook(self._cheap_pre(name)))
                    self._cheap_hooks.append(module.register_forward_hook(self._cheap_post(name)))

    # Calibration: the first steps of a plan made here are measured (torch.cuda's peak statistic, reset for it);
    # a peak above the prediction (temporaries the profile could not see) or far below it corrects the plan's
    # working memory and the same measurements are planned again, at most CALIBRATIONS times per shape.
    CALIBRATIONS = 2

    def _start_peak_check(self, signature, plan: Plan) -> None:
        self._peak_check = None
        if (
            plan is self.given_plan
            or not self._can_measure_peak()
            or (plan.budget is None and plan.speed_target is None)
        ):
            return
        if len(plan.calibrations) >= self.CALIBRATIONS or getattr(plan, "_verified", False):
            return
        self._peak_check = (signature, plan, self._memory_allocated())
        self._reset_peak()

    def _check_peak(self, signature) -> None:
        check, self._peak_check = self._peak_check, None
        if check is None:
            return
        old_signature, plan, base = check
        peak = self._max_memory_allocated() - base
        predicted = plan.prediction.peak
        limit = plan.budget if plan.budget is not None else plan.speed_target
        # Upward always (the budget is at stake); downward (a faster plan) only on the first check and only when
        # the prediction was far too high.
        if peak <= predicted and (peak > 0.8 * predicted or plan.calibrations):
            plan._verified = True
            return
        working = max(0, plan.working_bytes + peak - predicted)
        if working == plan.working_bytes:
            plan._verified = True
            return
        try:
            new = plan.replan(budget=plan.budget, working_bytes=working)
        except BudgetError as e:
            # The plan just measured is over the limit; the leanest plan comes closest to it (H200: in run P5 the
            # plan that stayed peaked 4% over a Llama budget; in run P6 the leanest plan stayed under it).
            try:
                new = plan.replan(budget=e.minimum, working_bytes=working)
            except BudgetError:
                new = None
            warnings.warn(
                f"ssdtrain: the measured activation peak ({peak / 2**30:.2f} GiB) is above the plan's "
                f"prediction ({predicted / 2**30:.2f} GiB), and with that much working memory no plan fits "
                f"the budget ({e}); "
                + (
                    "the plan stays"
                    if new is None
                    else f"switching to the leanest plan (predicted peak {format_bytes(new.prediction.peak)})"
                ),
                OffloadWarning,
                stacklevel=3,
            )
            if new is None:
                plan._verified = True
                return
            new.notes.append(
                f"the budget {format_bytes(limit)} cannot be met with the measured working memory "
                f"({format_bytes(working)}): this is the leanest plan"
            )
        new.calibrations = plan.calibrations + [
            f"step {self._steps - 1}: measured peak {peak / 2**30:.2f} GiB, predicted {predicted / 2**30:.2f} GiB "
            f"(limit {limit / 2**30:.2f} GiB): working memory {plan.working_bytes / 2**30:.2f} -> "
            f"{working / 2**30:.2f} GiB"
        ]
        for key, value in list(self._plans.items()):
            if value is plan:
                self._plans[key] = new
        if self._latest_plan is plan:
            self._latest_plan = new
        if self.verbose:
            print(
                f"ssdtrain: {new.calibrations[-1]}; replanned: predicted peak {new.prediction.peak / 2**30:.2f} "
                f"GiB, forward+backward {new.prediction.seconds / new.keep_prediction.seconds:.2f}x keep's",
                file=sys.stderr,
            )

    def _can_measure_peak(self) -> bool:
        return self.device.type == "cuda"

    def _memory_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def _max_memory_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def _reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def _remove_cheap_hooks(self) -> None:
        for h in self._cheap_hooks:
            h.remove()
        self._cheap_hooks.clear()

    def _plan_key(self):
        return (
            self.budget,
            self.host_limit,
            self.nvme_limit,
            tuple(sorted(self.overrides.items())),
            self.min_bytes,
            self.prefetch_units,
        )

    def _finish_profile(self) -> None:
        profile, self._pending_profile = self._pending_profile, None
        self._profile = None
        self.cache.observer = None
        self._remove_cheap_hooks()  # they only serve profiling
        working = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self._mem_base
            saved = self._profile_kept + sum(profile.small) + self.cache.peak_gpu_saved_bytes
            working = max(0, peak - saved)
        units = self._units_from(profile)
        plan = self._make_plan(units, working)
        self._plans[(self._signature, self._plan_key())] = plan
        self._latest_plan = plan
        if self.verbose:
            p, k = plan.prediction, plan.keep_prediction
            counts = {}
            for c in plan.choices:
                counts[str(c)] = counts.get(str(c), 0) + 1
            mix = ", ".join(f"{v} {key}" for key, v in sorted(counts.items()))
            print(
                f"ssdtrain: plan for {plan.model} ({mix}): predicted activation peak {p.peak / 2**30:.2f} GiB "
                f"(keep: {k.peak / 2**30:.2f} GiB), forward+backward {p.seconds / k.seconds:.2f}x keep's; "
                "print(session.plan) for details",
                file=sys.stderr,
            )

    def _units_from(self, profile: _Profile) -> list[UnitProfile]:
        clock = self._clock
        n = len(self.unit_names)
        total_fwd = clock.seconds(self._profile_start, self._profile_end)
        block_time = [sum(clock.seconds(a, b) for a, b in profile.marks[i] if b is not None) for i in range(n)]
        units = []
        for i, name in enumerate(self.unit_names):
            kind = "stem" if i == 0 else ("head" if i == n - 1 else "block")
            saved = profile.saved[i]
            u = UnitProfile(
                name, kind, saved_bytes=sum(saved.values()), small_bytes=profile.small[i], tensors=profile.tensors[i]
            )
            if kind == "block":
                u.forward_s = block_time[i]
                inputs = profile.inputs[i]
                u.input_bytes = sum(inputs.values())
                if self.container:
                    for mname, _ in self.cheap[i - 1]:
                        inside = profile.cheap_inside.get(mname, {})
                        cin = profile.cheap_inputs.get(mname, {})
                        addresses = {profile.address[k] for k in saved}
                        net = sum(b for k, b in inside.items() if profile.address[k] not in cin)
                        extra = sum(b for s, b in cin.items() if s not in addresses)
                        if net - extra > 0:
                            u.cheap_bytes += net - extra
                            u.cheap_s += sum(
                                clock.seconds(a, b) for a, b in profile.cheap_marks.get(mname, []) if b is not None
                            )
                            u.cheap_modules.append(mname.removeprefix(name + "."))
                else:
                    u.kind = "segment"  # top-level children of a model without repeated blocks: never recomputed
            units.append(u)
        first = units[1] if len(units) > 2 else None
        for i in self._profile_checkpointed:
            # Checkpointed while profiling: its activations were not seen; it saves what the first block saved.
            u = units[i]
            u.saved_bytes, u.small_bytes, u.tensors = first.saved_bytes, first.small_bytes, first.tensors
            u.cheap_bytes, u.cheap_modules = first.cheap_bytes, list(first.cheap_modules)
            names = {f"{u.name}.{m}" for m in first.cheap_modules}
            u.cheap_s = (
                sum(clock.seconds(a, b) for m in names for a, b in profile.cheap_marks.get(m, []) if b is not None)
                or first.cheap_s
            )
        blocks_total = sum(block_time)
        rest = max(0.0, total_fwd - blocks_total)
        # Stem and head share the forward time outside blocks in proportion to their saved bytes.
        outside = units[0].saved_bytes + units[-1].saved_bytes + units[0].small_bytes + units[-1].small_bytes
        for u in (units[0], units[-1]):
            u.forward_s = rest * ((u.saved_bytes + u.small_bytes) / outside if outside else 0.5)
        if self.compiled:
            units = self._order_units(profile, total_fwd)
        return units

    def _order_units(self, profile: _Profile, total_fwd: float, parts: int = 8) -> list[UnitProfile]:
        total = sum(b for _, b in profile.order) or 1
        bounds, acc, units = [], 0, []
        current = UnitProfile("pack[0:]", "segment")
        start = 0
        for index, (_, nbytes) in enumerate(profile.order, 1):
            acc += nbytes
            current.saved_bytes += nbytes if nbytes >= self.min_bytes else 0
            current.small_bytes += nbytes if nbytes < self.min_bytes else 0
            current.tensors += 1
            if acc >= total * (len(units) + 1) / parts and len(units) < parts - 1:
                current.name = f"packs[{start}:{index}]"
                units.append(current)
                bounds.append(index)
                start = index
                current = UnitProfile(f"packs[{start}:]", "segment")
        units.append(current)
        for u in units:
            u.forward_s = total_fwd * (u.saved_bytes + u.small_bytes) / total
        self._order_bounds = bounds
        return units

    def _make_plan(self, units: list[UnitProfile], working: int = 0) -> Plan:
        bw = self._measure_bandwidth()
        nvme_limit = self._nvme_limit()
        speed_target = None
        if self.budget is None and self.device.type == "cuda":
            speed_target = int(_device_free(self.device) * 0.85)
        overrides = {k: v for k, v in self.overrides.items()}
        model_name = type(self.model._orig_mod if self.compiled else self.model).__name__

        def make(nvme):
            return make_plan(
                model_name,
                units,
                bw,
                self.budget,
                host_limit=self.host_limit,
                nvme_limit=nvme,
                block_container=self.container,
                overrides=overrides,
                window_units=self.prefetch_units,
                speed_target=speed_target,
                working_bytes=working,
            )

        # NVMe only where host memory is not enough (or an override asks for it): then measure the disk first.
        wants_nvme = any(Choice.parse(v).tier == "nvme" for v in overrides.values())
        plan = None
        if not wants_nvme:
            try:
                plan = make(0)
            except BudgetError:
                if nvme_limit <= 0:
                    raise
            if plan is not None and (
                nvme_limit <= 0 or (plan.notes == [] and plan.prediction.host_bytes < 0.9 * self.host_limit)
            ):
                return self._note_compiled(plan)
        if nvme_limit > 0:
            self._probe_disk(bw)
        plan = make(nvme_limit)
        return self._note_compiled(plan)

    def _note_compiled(self, plan: Plan) -> Plan:
        if self.compiled:
            plan.order_bounds = list(self._order_bounds)
            plan.notes.append(
                "torch.compile'd model: units are slices of the saved-tensor order (no module hooks "
                "run inside a compiled graph), so recompute is not planned; host/NVMe tiers apply"
            )
        return plan

    def _measure_bandwidth(self) -> Bandwidth:
        if self._bandwidth is not None:
            return self._bandwidth
        n = 256 * _MIB if self.device.type == "cuda" else 32 * _MIB
        if self.device.type == "cuda":
            host = huge_empty((n,), torch.uint8, pin_memory=True)
            dev = torch.empty(n, dtype=torch.uint8, device=self.device)
            rates = []
            for dst, src in ((host, dev), (dev, host)):
                dst.copy_(src, non_blocking=True)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(2):
                    dst.copy_(src, non_blocking=True)
                b.record()
                b.synchronize()
                rates.append(2 * n / (a.elapsed_time(b) / 1e3))
            del host, dev
            d2h, h2d = rates
        else:
            a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
            b.copy_(a)
            t0 = time.perf_counter()
            b.copy_(a)
            d2h = h2d = n / max(time.perf_counter() - t0, 1e-6)
        self._bandwidth = Bandwidth(d2h, h2d, disk_write=2e9, disk_read=2e9)
        return self._bandwidth

    def _probe_disk(self, bw: Bandwidth) -> None:
        """Measure the NVMe tier's write and read bandwidth (256 MiB through the engine, once per session)."""
        if bw.disk_measured:
            return
        engine = self.cache._engine()
        if engine is None:
            return
        n = min(256 * _MIB if self.device.type == "cuda" else 32 * _MIB, self._nvme_limit() // 4 // 4096 * 4096)
        if n < _MIB:
            return  # too little room to measure: the assumed bandwidth stays (the plan says so)
        buf = huge_empty((n,), torch.uint8, pin_memory=self.device.type == "cuda")
        buf.fill_(1)
        try:
            t0 = time.perf_counter()
            handle = engine.write(buf).result()
            t1 = time.perf_counter()
            engine.read(handle, out=buf).result()
            t2 = time.perf_counter()
            engine.free(handle)
        except OSError:
            return  # the disk refused (full, I/O error): the tier's own fallbacks handle it during the step
        bw.disk_write, bw.disk_read = n / max(t1 - t0, 1e-6), n / max(t2 - t1, 1e-6)
        bw.disk_measured = True

    def _dirs(self) -> list[str]:
        if self.directories is not None:
            d = self.directories
            return [os.fspath(x) for x in ([d] if isinstance(d, (str, os.PathLike)) else d)]
        return list(io_settings.directories)

    def _nvme_limit(self) -> int:
        if self.nvme_limit is not None:
            return self.nvme_limit
        try:
            return int(sum(shutil.disk_usage(d).free for d in self._dirs()) * 0.9)
        except OSError:
            return 0

    def _make_engine(self):
        if self._nvme_limit() <= 0:
            return None
        cap = self.nvme_limit // len(self._dirs()) if self.nvme_limit is not None else None
        return Engine(self._dirs(), capacity_per_directory=cap)

    # ----------------------------------------------------------------------------------------------- plans
    def _apply(self, plan: Plan | None) -> None:
        self._unwrap_all()
        self._recomputed = 0
        self.plan = plan
        if plan is None:
            self.cache.window_bytes = 1 << 30
            return
        if self.compiled:
            self._order_bounds = list(plan.order_bounds)
        moved = []
        for i, (u, c) in enumerate(zip(plan.units, plan.choices, strict=True)):
            if c.recompute != "none" and u.kind == "block" and not self.compiled:
                block = self.blocks[i - 1][1]
                if c.recompute == "full":
                    self._wrap(block)
                else:
                    for name, module in self.cheap[i - 1]:
                        if name.removeprefix(u.name + ".") in u.cheap_modules:
                            self._wrap(module)
            if c.tier != "keep":
                moved.append(u.saved_bytes if c.recompute == "none" else u.input_bytes)
        self._recomputed = len(self._wrapped)
        biggest = max(moved, default=0)
        self.cache.window_bytes = max(64 * _MIB, plan.window_units * biggest)
        if self.budget is not None and self.device.type == "cuda":
            resident = plan.prediction.peak - sum(moved)
            self.cache.max_inflight = max(256 * _MIB, self.budget - max(resident, 0), 2 * biggest)
        else:
            self.cache.max_inflight = float("inf")

    def _wrap(self, module: nn.Module, when=None) -> None:
        """Checkpoint `module` (non-reentrant: RNG state replayed, inputs saved through the hooks), always or
        when `when()` says so at call time."""
        if id(module) in self._wrapped:
            return
        had = module.__dict__.get("forward")
        original = module.forward

        def forward(*args, **kwargs):
            if not torch.is_grad_enabled() or (when is not None and not when()):
                return original(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)

        module.forward = forward
        self._wrapped[id(module)] = (module, had)

    def _unwrap_all(self) -> None:
        for module, had in self._wrapped.values():
            if had is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = had
        self._wrapped.clear()

    # ----------------------------------------------------------------------------------------------- facts
    def stats(self) -> dict:
        """Counters since the session started: bytes per tier, prefetch hits, forwards, misses, stalls, fallbacks,
        the host pool and the NVMe engine."""
        c = self.cache.counters
        engine = self.cache.engine
        out = {
            "steps": self._steps,
            "profiled_steps": self._profiled,
            "bytes_offloaded": {"host": c["bytes_to_host"], "nvme": c["bytes_to_nvme"]},
            "bytes_kept": c["kept_bytes"],
            "tensors_offloaded": c["packed_tensors"],
            "tensors_kept": c["kept_tensors"],
            "param_tensors_kept": c["kept_param_tensors"],
            "views_deduplicated": c["dedup_views"],
            "bytes_restored": c["bytes_restored"],
            "prefetch_hits": c["prefetch_hits"],
            "prefetch_retried": c["prefetch_retried"],  # restored on a second try: in flight at the first
            "forwarded": c["forwarded"],
            "misses": c["misses"],
            # Misses by cause: "not_reached" (the prefetch window had not come to its unit), "in_flight" (its copy
            # out was still running when its unit was prefetched, and done by the time backward used it),
            # "alive" (its original tensor was still alive then).
            "miss_reasons": {k.removeprefix("miss_"): v for k, v in c.items() if k.startswith("miss_")},
            "late_prefetches": c["late_prefetch"],
            "stalls": c["stalls"],
            "stall_seconds": c["stall_ns"] / 1e9,
            "throttle_waits": c["throttle_waits"],
            "throttle_seconds": c["throttle_ns"] / 1e9,
            "fallbacks": {k.removeprefix("fallback_"): v for k, v in c.items() if k.startswith("fallback_")},
            "host_pool": {
                "limit": self.pool.limit,
                "reserved": self.pool.reserved,
                "in_use": self.pool.in_use,
                "peak_in_use": self.pool.peak_in_use,
            },
            "peak_device_saved_bytes": self.cache.peak_gpu_saved_bytes,
            "recomputed_modules": self._recomputed,
            "nvme": self._engine_stats() if engine is not None else self._final_engine_stats,
        }
        return out

    def _engine_stats(self) -> dict:
        s = self.cache.engine.stats()
        return {
            k: s[k]
            for k in (
                "bytes_written",
                "bytes_read",
                "write_bandwidth_gbps",
                "read_bandwidth_gbps",
                "errors",
                "live_handles",
            )
            if k in s
        }


def offload(model: nn.Module, budget=None, **options) -> OffloadSession:
    """Offload `model`'s saved activations to fit `budget` (bytes, or a size such as ``"20GiB"``).

    ``budget=None`` plans for speed: keep what fits in the free device memory (measured when the plan is made)
    and move or recompute only the rest. Options: ``plan=`` (a Plan from ``ssdtrain.plan()``, used as is),
    ``overrides={"transformer.h.0": "keep", "transformer.h.5": "recompute+host"}``, ``host_memory=`` (pinned pool
    limit; default half the available RAM), ``nvme_memory=`` / ``directories=`` (the NVMe tier; default the
    SSDTRAIN_IO_DIRS directories or the temp dir, up to 90% of their free space), ``min_bytes="1M"`` (smaller saved
    tensors stay on the device), ``prefetch_units=2``, ``on_full="fallback"`` (or ``"raise"``), ``profile_steps=2``
    (forwards of a new input shape run with everything in host memory before the plan: warm-ups, then one measured
    step), ``verbose=True`` (one line on stderr when a plan is made).
    """
    return OffloadSession(model, budget, **options)


def plan(model: nn.Module, step_fn, budget=None, **options) -> Plan:
    """Profile `step_fn()` (a forward and backward of `model`; called ``profile_steps`` times, default 2: a
    warm-up, then the measured step) and return the plan ``offload()`` would use for `budget`. ``print()`` it for
    per-layer choices and predictions; pass it to ``offload(model, plan=...)`` (after ``plan.override(...)`` if you
    like). The steps are real: they accumulate gradients like any other."""
    options.setdefault("verbose", False)
    session = OffloadSession(model, budget, **options)
    session._plans = {}
    try:
        with session:
            for _ in range(session.profile_steps):
                step_fn()
            if session._pending_profile is None:
                raise RuntimeError(
                    "plan(): step_fn() did not call the model's forward; it must run model(...) "
                    "(and backward) on the model passed to plan()"
                )
            session._finish_profile()
    except BudgetError:
        raise
    return next(iter(session._plans.values()))
