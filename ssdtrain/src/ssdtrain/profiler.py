"""Profiling: what one step of a model saves, where, and how long each unit takes; the device's memory readings.

A profiled forward keeps activations on the device up to an allowance (so timings are clean and no link traffic
distorts them) and sends the rest to host memory; blocks after the first are checkpointed once keeping them would
pass the allowance (repeated blocks save the same bytes, so the first block's count stands for them). What a
profile records per unit: saved bytes by storage (each storage once), small bytes, casts of parameters (autocast's
weight copies), inputs, forward time; per cheap submodule, the storages saved inside it and its time.
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .derive import OP_HOST_S
from .io import huge_empty
from .model import group_firsts, is_compute_op, tensor_storages
from .prediction import Bandwidth, UnitProfile

_MIB = 1 << 20


class Clock:
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


class DeviceMemory:
    """The device's memory readings the session plans and calibrates with (CUDA only; tests stand in for them)."""

    def __init__(self, device: torch.device):
        self.device = device

    def can_measure(self) -> bool:
        return self.device.type == "cuda"

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def max_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def free(self) -> int:
        """Bytes torch can still allocate: free on the device plus what its caching allocator holds unused."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)


class PeakProbe:
    """The measured step's peaks, split where the working memory differs: the forward (read when the model's
    forward returns), the head's backward (read when the gradient of the last block's output arrives: the
    logits' gradients are gone by then) and the rest of backward (read when the step ends). Each reading resets
    the device's peak statistic for the next. Peaks are bytes above the step's starting allocation."""

    def __init__(self, memory: DeviceMemory):
        self.memory = memory
        self.base = 0
        self.forward: int | None = None
        self.head: int | None = None
        self.blocks: int | None = None
        self.finished = True

    def start(self) -> None:
        self.base = self.memory.allocated()
        self.forward = self.head = self.blocks = None
        self.finished = False
        self.memory.reset_peak()

    def _read(self) -> int:
        peak = self.memory.max_allocated() - self.base
        self.memory.reset_peak()
        return max(0, peak)

    def forward_done(self) -> None:
        if self.forward is None:
            self.forward = self._read()

    def head_done(self) -> None:
        if self.forward is not None and self.head is None:
            self.head = self._read()

    def finish(self) -> None:
        """Backward (or the step) ended: the last reading (the blocks' backward, or the whole backward without a
        head mark). Only the first call reads: the one at backward's end, when there is one, so what runs between
        backward and the next step (the optimizer's step, whose first call allocates its state) is not counted."""
        if self.finished:
            return
        self.finished = True
        if self.forward is None:
            self.forward = self._read()
        elif self.head is None:
            self.head = self._read()
        elif self.blocks is None:
            self.blocks = self._read()


def working_memory(probe: PeakProbe, saved: int, head_saved: int, grads: tuple[int, int, int], recomputed: int):
    """(forward, head's backward, a block's backward) working memory: each peak of `probe` minus what was saved at
    most (`saved`: every saved byte on the device, kept or in flight; the head's own (`head_saved`) are gone in the
    blocks' backward) and the gradients allocated by then (`grads`: (head, last block, all) bytes when the step
    started without them, else zeros). `recomputed`: bytes a block checkpointed while profiling re-creates in its
    backward (not working memory: the planner counts them as the recompute's). None where no peak was read."""
    head_grads, block_grads, all_grads = grads
    forward = None if probe.forward is None else max(0, probe.forward - saved)
    if probe.blocks is None:  # no mark between the head's backward and the blocks': one backward peak
        whole = probe.head
        head = None if whole is None else max(0, whole - saved - head_grads)
        return forward, head, head
    head = max(0, probe.head - saved - head_grads)
    blocks = max(0, probe.blocks - (saved - head_saved) - recomputed - head_grads - block_grads)
    return forward, head, blocks


def measure_link(device: torch.device) -> Bandwidth:
    """Device-to-host and host-to-device bytes per second with pinned memory (a memcpy rate on CPU)."""
    n = 256 * _MIB if device.type == "cuda" else 32 * _MIB
    if device.type == "cuda":
        host = huge_empty((n,), torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device=device)
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
        return Bandwidth(*rates)
    a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    b.copy_(a)
    t0 = time.perf_counter()
    b.copy_(a)
    rate = n / max(time.perf_counter() - t0, 1e-6)
    return Bandwidth(rate, rate)


class OpRecorder(TorchDispatchMode):
    """Watches the ops of one block's forward (the first block of the measured step) for selective recompute: the
    bytes of what its matrix products and attention output (what selective recompute keeps), and the time of
    everything else (what it runs again in backward)."""

    def __init__(self, clock: Clock):
        super().__init__()
        self.clock = clock
        self.compute_bytes = 0
        self._ptrs: set[int] = set()
        self.marks: list = []  # (start, end) of each op selective recompute runs again

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        compute = is_compute_op(func)
        start = None if compute else self.clock.mark()
        out = func(*args, **(kwargs or {}))
        if compute:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in self._ptrs:
                        self._ptrs.add(storage.data_ptr())
                        self.compute_bytes += storage.nbytes()
        else:
            self.marks.append((start, self.clock.mark()))
        return out


class Profile:
    """What one step measured: per unit, saved bytes by storage, small bytes, parameter casts, inputs, time; per
    cheap module, the storages saved inside it and its inputs."""

    def __init__(self, n_units: int):
        self.saved = [dict() for _ in range(n_units)]  # unit -> {sequence number: bytes}
        self.small = [0] * n_units
        self.pinned = [0] * n_units  # casts of parameters (never moved)
        self.tensors = [0] * n_units
        self.inputs = [dict() for _ in range(n_units)]
        # Per unit: saved bytes a recipe could make again (``ssdtrain.derive``), and those recipes' memory traffic
        # and ops.
        self.derivable = [0] * n_units
        self.derive_traffic = [0] * n_units
        self.derive_ops = [0] * n_units
        self.marks = [[] for _ in range(n_units)]  # (start, end) pairs
        self.cheap_inside: dict[str, dict[int, int]] = {}
        self.cheap_inputs: dict[str, dict[int, int]] = {}
        self.cheap_marks: dict[str, list] = {}
        self.cheap_stack: list[str] = []
        self.order: list[tuple[int, int]] = []  # (unit, bytes) in pack order (compiled models)
        # per list of blocks (keyed by its first block's unit): that block's compute output bytes, recompute marks
        self.selective: dict[int, tuple[int, list]] = {}
        self.count = 0
        self.address: dict[int, int] = {}  # sequence number -> storage address when saved
        self.start = None
        self.end = None

    def record(self, unit: int, key, nbytes: int, kind: str, traffic: int = 0, ops: int = 0) -> None:
        sptr = key[2]
        if kind == "derivable":  # besides its "saved" record: this storage has a recipe
            self.derivable[unit] += nbytes
            self.derive_traffic[unit] += traffic
            self.derive_ops[unit] += ops
            return
        if kind == "view":
            return
        if kind == "param_copy":
            self.pinned[unit] += nbytes
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


class Profiler:
    """Runs the warm-up and profiled steps of one input shape and turns the profile into ``UnitProfile``s."""

    def __init__(self, unit_names: list[str], blocks, cheap, container: str, compiled: bool, min_bytes: int, clock):
        self.unit_names = unit_names
        self.blocks = blocks
        self.cheap = cheap
        self.container = container
        self.compiled = compiled
        self.min_bytes = min_bytes
        self.clock = clock
        self.active = False  # a warm-up or profiled step is running (no plan)
        self.profile: Profile | None = None  # the measured step's profile, while it runs
        self.pending: Profile | None = None  # its forward ended; what is saved until the next step still counts
        self.signature = None
        self.allowance = float("inf")
        self.kept = 0
        self.seen = 0
        # The first block of each list of blocks (see model.group_firsts) stands for the others of its list: the
        # bytes it saved decide whether keeping another would pass the allowance, and what it saves and
        # recomputes is what a block of its list checkpointed while profiling would have.
        self.firsts = group_firsts(blocks)
        self.block_seen_start: dict[int, int] = {}
        self.first_bytes: dict[int, int] = {}
        self.checkpointed: set[int] = set()
        self.order_bounds: list[int] = []
        self._cheap_hooks: list = []
        self.on_head_done = None  # called when the gradient of the last block's output arrives (measured step)
        # Selective recompute is measured on the first block, when the blocks run eagerly (a compiled block's ops
        # are the compiler's: it fuses the elementwise code itself).
        self.selective = (
            bool(container)
            and not compiled
            and bool(blocks)
            and not any(hasattr(m.forward, "_torchdynamo_orig_callable") for _, m in blocks)
        )
        self._recorder: OpRecorder | None = None
        # Bytes per second of the device's elementwise kernels (set by the session before ``units``): what a
        # derived tensor's recipe costs in backward.
        self.derive_rate = 1e12

    # --------------------------------------------------------------------------------------------- one step
    def begin(self, signature, allowance: float) -> None:
        """A warm-up or profiled step starts under no plan: keep up to `allowance` bytes on the device."""
        self.active = True
        self.signature = signature
        self.allowance = allowance
        self.kept = 0
        self.seen = 0
        self.first_bytes = {}
        self.checkpointed = set()
        self.profile = None

    def measure(self) -> Profile:
        """This step is the measured one: record it."""
        self.profile = Profile(len(self.unit_names))
        if not self.compiled and self.container and self.blocks:
            self._cheap_hooks.append(self.blocks[-1][1].register_forward_hook(self._last_block_post))
        if not self.compiled:
            for block_cheap in self.cheap:
                for name, module in block_cheap:
                    self._cheap_hooks.append(module.register_forward_pre_hook(self._cheap_pre(name)))
                    self._cheap_hooks.append(module.register_forward_hook(self._cheap_post(name), always_call=True))
        self.profile.start = self.clock.mark()
        return self.profile

    def stop(self) -> None:
        """No plan-less step is running any more (a plan applies, or the session ends)."""
        self.active = False
        self.profile = None
        self.remove_hooks()
        self._stop_recorder()

    def _stop_recorder(self):
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)
        return recorder

    def remove_hooks(self) -> None:
        for h in self._cheap_hooks:
            h.remove()
        self._cheap_hooks.clear()

    def checkpoint_when(self, unit: int):
        """For the profiling wrapper of block `unit`: checkpoint it once keeping it would pass the allowance."""

        def decide() -> bool:
            first = self.first_bytes.get(self.firsts[unit])
            if first is None or self.kept + first <= self.allowance:
                return False
            self.checkpointed.add(unit)
            return True

        return decide

    def tier(self, nbytes: int) -> str:
        """Where a saved tensor goes while profiling: kept while the allowance lasts, then host memory."""
        self.seen += nbytes
        if self.kept + nbytes <= self.allowance:
            self.kept += nbytes
            return "keep"
        return "host"

    def block_started(self, unit: int, args) -> None:
        first = unit == self.firsts[unit]
        if first:
            self.block_seen_start[unit] = self.seen
        if self.profile is not None and self.pending is None:
            self.profile.marks[unit].append([self.clock.mark(), None])
            self.profile.inputs[unit].update(tensor_storages(args))
            if first and self.selective and unit not in self.profile.selective and self._recorder is None:
                self._recorder = OpRecorder(self.clock)
                self._recorder.__enter__()

    def block_done(self, unit: int) -> None:
        first = unit == self.firsts[unit]
        if first and unit not in self.first_bytes and unit in self.block_seen_start:
            self.first_bytes[unit] = self.seen - self.block_seen_start[unit]
        if first and self._recorder is not None:
            recorder = self._stop_recorder()
            if self.profile is not None:
                self.profile.selective[unit] = (recorder.compute_bytes, recorder.marks)
        if self.profile is not None and self.pending is None and self.profile.marks[unit]:
            self.profile.marks[unit][-1][1] = self.clock.mark()

    def forward_done(self, failed: bool) -> None:
        """The model's forward ended; a failed one leaves no profile (the next step measures again)."""
        if self.profile is None or self.pending is not None:
            return
        if failed:
            self.profile = None
            self.remove_hooks()
            self._stop_recorder()
            return
        self.profile.end = self.clock.mark()
        self.pending = self.profile

    def take(self) -> Profile | None:
        profile, self.pending = self.pending, None
        self.profile = None
        self.remove_hooks()
        return profile

    def _last_block_post(self, module, args, output):
        """The last block's forward returned in the measured step: mark its output's gradient (the head's backward
        ends there)."""
        if self.profile is None or self.pending is not None or not torch.is_grad_enabled():
            return
        t = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(t, torch.Tensor) and t.requires_grad and self.on_head_done is not None:
            done = self.on_head_done

            def hook(grad):
                done()

            t.register_hook(hook)

    def _cheap_pre(self, name: str):
        def hook(module, args):
            p = self.profile
            if p is not None and self.pending is None:  # forward only: not a recompute in backward
                p.cheap_stack.append(name)
                p.cheap_inputs.setdefault(name, {}).update(tensor_storages(args))
                p.cheap_marks.setdefault(name, []).append([self.clock.mark(), None])

        return hook

    def _cheap_post(self, name: str):
        def hook(module, args, output):
            p = self.profile
            if p is not None and self.pending is None and p.cheap_stack:
                p.cheap_stack.pop()
                p.cheap_marks[name][-1][1] = self.clock.mark()

        return hook

    # --------------------------------------------------------------------------------------------- units
    def units(self, profile: Profile, grad_bytes: list[int]) -> list[UnitProfile]:
        """The profile as one ``UnitProfile`` per unit (`grad_bytes`: each unit's parameter gradients)."""
        clock = self.clock
        n = len(self.unit_names)
        total_fwd = clock.seconds(profile.start, profile.end)
        block_time = [sum(clock.seconds(a, b) for a, b in profile.marks[i] if b is not None) for i in range(n)]
        units = []
        for i, name in enumerate(self.unit_names):
            kind = "stem" if i == 0 else ("head" if i == n - 1 else "block")
            saved = profile.saved[i]
            u = UnitProfile(
                name,
                kind,
                saved_bytes=sum(saved.values()),
                small_bytes=profile.small[i],
                tensors=profile.tensors[i],
                pinned_bytes=profile.pinned[i],
                grad_bytes=grad_bytes[i],
            )
            if kind in ("block", "head"):
                # (the head's recipes: its final norm, the cast of its input and of the LM head's weight)
                u.derive_bytes = profile.derivable[i]
                u.derive_s = profile.derive_traffic[i] / self.derive_rate + profile.derive_ops[i] * OP_HOST_S
            if kind == "block":
                u.forward_s = block_time[i]
                u.input_bytes = sum(profile.inputs[i].values())
                if self.container:
                    self._cheap_of(u, i, profile)
                else:
                    u.kind = "segment"  # top-level children of a model without repeated blocks: never recomputed
            units.append(u)
        if self.container:
            # The blocks of a list are of one class: what its first keeps and recomputes under selective recompute
            # holds for each of them.
            for i, u in enumerate(units[1:-1], start=1):
                if self.firsts[i] in profile.selective:
                    compute, marks = profile.selective[self.firsts[i]]
                    u.selective_bytes, u.selective_s = compute, sum(clock.seconds(a, b) for a, b in marks)
        for i in self.checkpointed:
            # Checkpointed while profiling: its activations were not seen; it saves what its list's first block
            # saved. (A list's last block also gets what is saved before the next list starts, an encoder's final
            # norm: not seen here either; on a GPU the calibration's measured peak corrects the plan.)
            u, first = units[i], units[self.firsts[i]]
            u.saved_bytes, u.small_bytes, u.tensors = first.saved_bytes, first.small_bytes, first.tensors
            u.pinned_bytes = max(u.pinned_bytes, first.pinned_bytes)
            u.cheap_bytes, u.cheap_modules = first.cheap_bytes, list(first.cheap_modules)
            u.derive_bytes, u.derive_s = first.derive_bytes, first.derive_s
            names = {f"{u.name}.{m}" for m in first.cheap_modules}
            u.cheap_s = (
                sum(clock.seconds(a, b) for m in names for a, b in profile.cheap_marks.get(m, []) if b is not None)
                or first.cheap_s
            )
        rest = max(0.0, total_fwd - sum(block_time))
        # Stem and head share the forward time outside blocks in proportion to their saved bytes.
        outside = units[0].saved_bytes + units[-1].saved_bytes + units[0].small_bytes + units[-1].small_bytes
        for u in (units[0], units[-1]):
            u.forward_s = rest * ((u.saved_bytes + u.small_bytes) / outside if outside else 0.5)
        if self.compiled:
            units = self._order_units(profile, total_fwd, sum(grad_bytes), sum(profile.pinned))
        return units

    def _cheap_of(self, u: UnitProfile, i: int, profile: Profile) -> None:
        clock = self.clock
        saved = profile.saved[i]
        addresses = {profile.address[k] for k in saved}
        for mname, _ in self.cheap[i - 1]:
            inside = profile.cheap_inside.get(mname, {})
            cin = profile.cheap_inputs.get(mname, {})
            net = sum(b for k, b in inside.items() if profile.address[k] not in cin)
            extra = sum(b for s, b in cin.items() if s not in addresses)
            if net - extra > 0:
                u.cheap_bytes += net - extra
                u.cheap_s += sum(clock.seconds(a, b) for a, b in profile.cheap_marks.get(mname, []) if b is not None)
                u.cheap_modules.append(mname.removeprefix(u.name + "."))

    def _order_units(self, profile: Profile, total_fwd: float, grads: int, pinned: int, parts: int = 8):
        """Compiled models: no hooks run inside the compiled graph, so units are slices of the pack order."""
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
        units[-1].grad_bytes = grads  # the slices do not map to parameters: all gradients at backward's start
        units[-1].pinned_bytes = pinned
        self.order_bounds = bounds
        return units
