"""The session's promises on CPU: exceptions (caught inside the session or escaping it, in forward and backward)
leave it working and release everything; plans are reused by new sessions (one per step or per forward); nothing
fails silently (bad NVMe directories and sizes fail at offload(), a session that offloads nothing says why); the
budget counts each storage once, parameter casts and gradients included; the NVMe tier takes what the host pool
cannot and its disk rates are measured once and cached."""

import copy
import errno
import gc
import json
import os
import threading
import warnings

import pytest
import torch
from ssdtrain_testutil import mounted_tmpfs
from test_ssdtrain_offload import assert_same_grads, batch, grads, make_net, reference
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import ssdtrain
from ssdtrain import tiers as ssd_tiers
from ssdtrain.planner import Choice

KIB = 1 << 10


# A unit always moved: these tests are about bytes moving across sessions, and the budget alone may be met by
# recompute (which plan it gets depends on the CPU timings of the profile).
MOVED = {"blocks.0": "recompute+host"}


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _steps(model, ids, n, reference_grads=None):
    for _ in range(n):
        model.zero_grad()
        model(ids).backward()
    if reference_grads is not None:
        assert_same_grads(grads(model), reference_grads)


# ------------------------------------------------------------------------------------------------ exceptions
class _FailOnce:
    """Hooks on a block that raise in its forward (or, with `backward`, in backward) once `armed` is set.
    Installed after the session's own hooks, so the exception comes from inside the block's forward."""

    def __init__(self, block, backward=False):
        self.block, self.backward, self.armed = block, backward, False

    def install(self):
        self.block.register_forward_pre_hook(self._pre)
        self.block.register_forward_hook(self._post)

    def _pre(self, module, args):
        if self.armed and not self.backward:
            self.armed = False
            raise RuntimeError("boom in forward")

    def _post(self, module, args, output):
        if self.armed:
            self.armed = False
            return _Boom.apply(output)
        return None


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_caught_exception_leaves_the_session_working(where):
    """An exception raised in a block and caught inside the ``with`` block: later forwards are steps as before,
    prefetching works (hits, no misses), every activation of the failed step is released, gradients exact."""
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    wrapped = _FailOnce(model.blocks[2], backward=where == "backward")
    overrides = {f"blocks.{i}": "host" for i in range(4)}
    with ssdtrain.offload(model, overrides=overrides, min_bytes="4K", verbose=False, profile_steps=1) as s:
        wrapped.install()
        _steps(model, ids, 2)
        wrapped.armed = True
        with pytest.raises(RuntimeError, match=f"boom in {where}"):
            model.zero_grad()
            loss = model(ids)
            loss.backward()
        loss = None
        gc.collect()
        assert s.cache.live_entries() == 0  # the failed step's activations went with its graph
        assert s.hooks.depth == 0 and s.hooks.block_depth == 0
        before = s.stats()
        _steps(model, ids, 2, want)
        after = s.stats()
    assert after["steps"] == before["steps"] + 2 == 5
    assert after["prefetch_hits"] > before["prefetch_hits"]
    assert after["misses"] - before["misses"] <= 2  # each backward's first unpack only
    assert after["bytes_offloaded"]["host"] > before["bytes_offloaded"]["host"]
    assert s.cache.live_entries() == 0 and s.pool.reserved > 0  # the pool stays with the model for its next session
    assert ssdtrain.release(model) and s.pool.reserved == 0


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_escaping_exception_releases_everything_and_the_next_session_works(where, tmp_path):
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    wrapped = _FailOnce(model.blocks[2], backward=where == "backward")
    gc.collect()
    threads, native = set(threading.enumerate()), _native_threads()
    overrides = {"blocks.0": "nvme", "blocks.1": "host", "blocks.2": "nvme", "blocks.3": "host"}
    options = dict(overrides=overrides, min_bytes="4K", directories=[str(tmp_path)], verbose=False, profile_steps=1)
    session = ssdtrain.offload(model, **options)
    with pytest.raises(RuntimeError, match="boom"), session:
        wrapped.install()
        _steps(model, ids, 2)
        wrapped.armed = True
        _steps(model, ids, 1)
    assert session.pool.reserved == 0 and session.cache.engine is None
    assert set(threading.enumerate()) <= threads and _native_threads() <= native  # no thread of this session
    with ssdtrain.offload(model, **options) as again:  # the plan of the failed session is reused
        _steps(model, ids, 2, want)
    stats = again.stats()
    assert stats["profiled_steps"] == 0 and stats["steps"] == 2
    assert stats["bytes_offloaded"]["nvme"] > 0 and stats["bytes_written_to_nvme"] > 0
    assert again.cache.engine is not None  # kept with the model for its next session, until released
    ssdtrain.release(model)
    assert again.cache.engine is None and _native_threads() <= native


def test_session_ends_before_backward_then_releases_when_the_graph_goes(tmp_path):
    """Activations saved for a backward after the ``with`` block live on; released tiers (``ssdtrain.release``)
    wait for them: when the last is used, the pool, files and I/O threads go."""
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    gc.collect()
    native = _native_threads()
    overrides = {f"blocks.{i}": "nvme" for i in range(4)}
    with ssdtrain.offload(
        model, overrides=overrides, min_bytes="4K", directories=[str(tmp_path)], verbose=False, profile_steps=1
    ) as s:
        _steps(model, ids, 1)
        model.zero_grad()
        loss = model(ids)
    assert ssdtrain.release(model)
    assert s.cache.live_entries() > 0 and s.cache.engine is not None  # still needed by the graph
    loss.backward()
    del loss
    gc.collect()
    assert_same_grads(grads(model), want)
    assert s.cache.live_entries() == 0 and s.cache.engine is None and s.pool.reserved == 0
    assert _native_threads() <= native


def test_a_second_session_on_a_model_closes_the_first_and_leaves_no_wrapper_behind():
    """Two sessions at once on one model (an outer offload() around a loop whose steps enter their own, or a
    session left open by an exception in a training step): the new one closes the other, with a warning, so the
    two never install hooks and checkpoint wrappers over each other. Before, they took their wrappers off in an
    order that left a stale checkpoint wrapper on a block after both ended, recomputing it from then on."""
    model, ids = make_net(layers=3), batch()
    _, want = reference(model, ids)
    outer = ssdtrain.offload(model, overrides={"blocks.0": "recompute", "blocks.1": "host"}, **_QUIET)
    with outer:
        with pytest.warns(ssdtrain.OffloadWarning, match="another offload session was still active"):
            inner = ssdtrain.offload(model, overrides={"blocks.0": "recompute+host"}, **_QUIET).__enter__()
        _steps(model, ids, 4, want)
        inner.close()
    assert outer._closed and inner.stats()["steps"] == 4 and outer.stats()["steps"] == 0
    assert all("forward" not in block.__dict__ for block in model.blocks)
    assert not model._forward_pre_hooks and not any(block._forward_pre_hooks for block in model.blocks)
    with ssdtrain.offload(model, overrides={"blocks.1": "host"}, **_QUIET) as again:  # nothing left active
        _steps(model, ids, 2, want)
    assert again.stats()["bytes_offloaded"]["host"] > 0


_QUIET = dict(min_bytes="4K", verbose=False, profile_steps=1)


# ------------------------------------------------------------------------------------------------ plan reuse
def test_a_new_session_per_step_reuses_the_plan_and_offloads(monkeypatch):
    """The torchtune / save_on_cpu pattern: a context per step. The profile runs once across sessions, and the
    sessions after it run the plan: bytes move, nothing is profiled again, even when the available RAM (the
    default host limit's source) changes between calls."""
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    available = iter(range(8 << 30, 1 << 40, 1 << 28))
    monkeypatch.setattr(ssdtrain.options, "_host_available", lambda: next(available))
    sessions = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            with ssdtrain.offload(model, "1500K", min_bytes="4K", verbose=False, overrides=MOVED) as s:
                model.zero_grad()
                model(ids).backward()
            sessions.append(s.stats())
    assert_same_grads(grads(model), want)
    assert sum(st["profiled_steps"] for st in sessions) == 1
    assert all(st["profiled_steps"] == 0 and st["bytes_offloaded"]["host"] > 0 for st in sessions[2:])
    idle = [w for w in caught if "offloaded nothing" in str(w.message)]
    assert len(idle) == 1 and "still profiling" in str(idle[0].message)  # once, with the reason


def test_a_new_session_per_forward_with_backward_outside():
    """A context around the forward alone (backward after it): activations saved inside stay valid and move."""
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    moved = 0
    for _ in range(4):
        model.zero_grad()
        with ssdtrain.offload(model, "1500K", min_bytes="4K", verbose=False, overrides=MOVED) as s:
            loss = model(ids)
        loss.backward()
        moved = s.stats()["bytes_offloaded"]["host"]
    assert_same_grads(grads(model), want)
    assert moved > 0


# ------------------------------------------------------------------------------------------------ nothing silent
def test_a_budget_above_keep_warns_once_with_the_reason():
    model, ids = make_net(layers=3), batch()
    with pytest.warns(ssdtrain.OffloadWarning, match="plan keeps everything"):
        with ssdtrain.offload(model, "1G", min_bytes="4K", verbose=False) as s:
            _steps(model, ids, 3)
    assert s.stats()["bytes_offloaded"]["host"] == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ssdtrain.offload(model, "1G", min_bytes="4K", verbose=False):
            _steps(model, ids, 1)
    assert not [w for w in caught if "offloaded nothing" in str(w.message)]  # once per model


def test_an_nvme_directory_given_and_never_written_warns_once(tmp_path):
    """directories= given by name, a plan that keeps every moved activation in host memory: the disk is never
    used, and the session says so (once per model); where the plan sends activations there, nothing is said."""
    model, ids = make_net(layers=3), batch()
    options = dict(min_bytes="4K", directories=[str(tmp_path)], verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with ssdtrain.offload(model, "1500K", overrides=MOVED, **options) as s:
                _steps(model, ids, 3)
    assert s.stats()["bytes_offloaded"]["host"] > 0 and s.stats()["bytes_offloaded"]["nvme"] == 0
    unused = [str(w.message) for w in caught if "never written" in str(w.message)]
    assert len(unused) == 1 and str(tmp_path) in unused[0]
    model, ids = make_net(layers=3), batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ssdtrain.offload(model, "1500K", overrides={"blocks.0": "recompute+nvme"}, **options) as s:
            _steps(model, ids, 3)
    assert s.stats()["bytes_offloaded"]["nvme"] > 0
    assert not [w for w in caught if "never written" in str(w.message)]


def test_sizes_that_are_no_whole_number_of_bytes_fail_at_offload():
    """A fraction is no size: host_memory=0.5 (as budget= takes fractions) was read as 0 bytes and switched the
    host tier off without a word. It fails at offload(), naming the option."""
    model = make_net(layers=2)
    for option in ("host_memory", "nvme_memory", "min_bytes"):
        with pytest.raises(ValueError, match=f"{option}=0.5: a size in bytes must be a whole number"):
            ssdtrain.offload(model, 0.5, **{option: 0.5})
    assert ssdtrain.offload(model, 0.5, host_memory="512M").host_limit == 1 << 29


def test_bad_nvme_settings_fail_at_offload(tmp_path):
    model = make_net(layers=2)
    with pytest.raises(FileNotFoundError, match="does not exist.*nvme_memory=0"):
        ssdtrain.offload(model, directories=[str(tmp_path / "missing")])
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        ssdtrain.offload(model, directories=[str(tmp_path / "file")])
    free = ssd_tiers.free_space([str(tmp_path)])
    with pytest.raises(ValueError, match="more than the free space"):
        ssdtrain.offload(model, directories=[str(tmp_path)], nvme_memory=free + (1 << 30))
    with pytest.raises(ValueError, match="directories= is empty"):
        ssdtrain.offload(model, directories=[])
    ssdtrain.offload(model, directories=[str(tmp_path / "missing")], nvme_memory=0)  # no NVMe tier: fine


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_unwritable_nvme_directory_fails_at_offload(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="not writable"):
            ssdtrain.offload(make_net(layers=2), directories=[str(d)])
    finally:
        d.chmod(0o700)


def test_a_float_budget_is_a_fraction_of_keeps_peak():
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    with ssdtrain.offload(model, 0.5, min_bytes="4K", verbose=False) as s:
        _steps(model, ids, 3, want)
    plan = s.plan
    assert plan.budget_fraction == 0.5 and plan.budget == int(plan.keep_prediction.peak * 0.5)
    assert plan.prediction.peak <= plan.budget and "0.5 x keep" in str(plan)
    assert s.stats()["bytes_offloaded"]["host"] > 0 or s.stats()["recomputed_modules"] > 0
    with pytest.raises(ValueError, match="positive"):
        ssdtrain.offload(model, 0.0)
    assert ssdtrain.offload(model, 2e6).budget == 2_000_000  # a float above 1 is bytes


# ------------------------------------------------------------------------------------------------ budget accuracy
def test_a_storage_saved_by_two_ops_is_counted_once():
    """q, k and v projections of one normalised input each save it: the profile counts its bytes once."""

    class Attn(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

        def forward(self, x):
            return self.q(x) * self.k(x) * self.v(x)

    torch.manual_seed(0)
    model = nn.Sequential(*[Attn(64) for _ in range(3)])
    x = torch.randn(64, 64)

    def step():
        model(x).sum().backward()

    p = ssdtrain.plan(model, step, min_bytes="1K")
    # Each block saves its input once (64 x 64 x 4 bytes), q(x), k(x), v(x) and the product q*k, whatever the
    # number of ops saving the input.
    act = 64 * 64 * 4
    assert [u.saved_bytes for u in p.units[1:-1]] == [5 * act, 5 * act, 5 * act]


def test_parameter_casts_and_gradients_are_in_the_peak():
    """fp32 weights under autocast: each block's bf16 weight copies are held until backward; a step that starts
    without gradients allocates them in backward. Both are part of the predicted peak."""
    model, ids = make_net(layers=3, width=64), batch()
    with ssdtrain.offload(model, min_bytes="4K", verbose=False) as s:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(ids).backward()
    plan = s.plan
    block_params = sum(p.numel() for p in model.blocks[0].parameters() if p.dim() == 2)
    assert plan.units[1].pinned_bytes >= block_params * 2  # its weight matrices in bf16
    assert plan.grads and sum(u.grad_bytes for u in plan.units) == sum(p.numel() * 4 for p in model.parameters())
    without = plan.predict(grads=False).peak
    assert plan.prediction.peak > without  # the gradients count where a step starts without them


class _CastWatch(torch.utils._python_dispatch.TorchDispatchMode):
    """Weak references to the memory of the casts of `params` made while active (autocast's bf16 weight copies):
    their storages, which outlive the tensor objects where autograd holds an alias of one."""

    def __init__(self, params):
        super().__init__()
        self.params = {id(p) for p in params}
        self.casts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.params:
            self.casts.append(StorageWeakRef(out.untyped_storage()))
        return out

    def alive(self) -> int:
        gc.collect()
        return sum(not r.expired() for r in self.casts)


def alive_block_casts(model, ids, overrides):
    """Casts of the blocks' weights still allocated when a planned step's forward returns, inside autocast (on the
    model's device)."""
    device = next(model.parameters()).device.type
    with ssdtrain.offload(model, min_bytes="4K", overrides=overrides) as s:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.bfloat16):
                model(ids).backward()
        model.zero_grad(set_to_none=True)
        watch = _CastWatch([p for b in model.blocks for p in b.parameters() if p.dim() == 2])
        with torch.autocast(device, dtype=torch.bfloat16):
            with watch:
                loss = model(ids)
            alive = watch.alive()
        loss.backward()
    assert watch.casts, "autocast made no weight casts: the test measures nothing"
    return alive, s


def test_recomputed_blocks_weight_casts_leave_autocast_cache_when_they_return():
    """Autocast keeps its weight casts cached until its region ends; a recomputed block saves none of them, so the
    session clears the cache when it returns and the plan counts them only while it runs. Where a block's weight
    is shared, a later user would cast it again unseen: the cache is left alone and the plan counts them all."""
    ids = batch()
    recompute = {f"blocks.{i}": "recompute" for i in range(3)}
    alive, s = alive_block_casts(make_net(layers=3, width=64), ids, recompute)
    assert alive == 0 and s.plan.clear_casts
    kept = {"blocks.0": "recompute", "blocks.1": "keep", "blocks.2": "recompute"}
    alive, s = alive_block_casts(make_net(layers=3, width=64), ids, kept)
    assert alive > 0  # the kept block's casts are saved for its backward
    tied = make_net(layers=3, width=64)
    tied.blocks[1].up.weight = tied.blocks[0].up.weight
    alive, s = alive_block_casts(tied, ids, recompute)
    assert alive > 0 and not s.plan.clear_casts  # shared: nothing cleared, every cast counted


def test_blocks_checkpointed_while_profiling_leave_no_casts_cached(monkeypatch):
    """Profiling checkpoints the blocks beyond its allowance; their weight casts leave autocast's cache when each
    returns, as under a plan, so the measured forward's working memory holds no casts of blocks that saved none."""
    monkeypatch.setattr(ssdtrain.OffloadSession, "_cpu_profile_allowance", 1 << 20)
    model, ids = make_net(layers=5, width=64), batch()
    weights = [p for b in model.blocks for p in b.parameters() if p.dim() == 2]
    with ssdtrain.offload(model, min_bytes="4K") as s:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids).backward()  # the warm-up
        watch = _CastWatch(weights)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with watch:
                loss = model(ids)  # the measured step
            alive = watch.alive()
        loss.backward()
        checkpointed = set(s.profiler.checkpointed)
    assert len(checkpointed) >= 2
    per_block = len(watch.casts) // len(model.blocks)
    assert alive == per_block * (len(model.blocks) - len(checkpointed))  # the blocks it kept hold theirs


# ------------------------------------------------------------------------------------------------ NVMe tier
def test_host_pool_full_sends_host_and_nvme_planned_activations_to_nvme(tmp_path):
    model, ids = make_net(layers=4), batch()
    want_loss, want = reference(model, ids)
    overrides = {"blocks.0": "nvme", "blocks.1": "nvme", "blocks.2": "host", "blocks.3": "host"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ssdtrain.offload(
            model,
            overrides=overrides,
            host_memory="64K",
            directories=[str(tmp_path)],
            min_bytes="4K",
            verbose=False,
            profile_steps=1,
        ) as s:
            _steps(model, ids, 3, want)
    stats = s.stats()
    assert stats["bytes_offloaded"]["nvme"] > 0 and stats["bytes_written_to_nvme"] >= stats["bytes_offloaded"]["nvme"]
    assert "nvme_full" not in stats["fallbacks"]  # nothing stayed on the device
    messages = [str(w.message) for w in caught if issubclass(w.category, ssdtrain.OffloadWarning)]
    assert any("moving activations to NVMe" in m for m in messages)
    assert not any("keeping activations on the device" in m for m in messages)


def test_host_and_nvme_full_keep_activations_on_the_device_with_a_warning(tmp_path):
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    overrides = {f"blocks.{i}": "nvme" for i in range(4)}
    with pytest.warns(ssdtrain.OffloadWarning, match="NVMe tier is full: keeping activations on the device"):
        with ssdtrain.offload(
            model,
            overrides=overrides,
            host_memory="4K",
            nvme_memory="64K",
            directories=[str(tmp_path)],
            min_bytes="4K",
            verbose=False,
            profile_steps=1,
        ) as s:
            _steps(model, ids, 3, want)
    assert s.stats()["fallbacks"]["nvme_full"] > 0


def test_a_small_nvme_directory_is_measured_within_its_room(tmp_path):
    """A directory with less free space than the disk-rate probe (8 MiB on a CPU, 64 MiB on a GPU) is still a
    working NVMe tier: the probe takes at most the tier's share, never a crash when the plan is made."""
    with mounted_tmpfs(tmp_path / "small", "4M") as small:
        model, ids = make_net(layers=4), batch()
        _, want = reference(model, ids)
        overrides = {f"blocks.{i}": "nvme" for i in range(4)}
        with ssdtrain.offload(
            model, overrides=overrides, directories=[str(small)], min_bytes="4K", verbose=False, profile_steps=1
        ) as s:
            _steps(model, ids, 3, want)
        stats = s.stats()
        assert stats["bytes_offloaded"]["nvme"] > 0 and stats["bytes_written_to_nvme"] > 0
        assert s.plan.tiers["nvme"].write_rate > 0
        ssdtrain.release(model)


def test_a_disk_full_when_the_plan_is_made_drops_the_nvme_tier_loudly(tmp_path, monkeypatch):
    """The disk filled up between offload() (which checked it) and the plan: the plan is made without the NVMe tier,
    with an OffloadWarning naming the directory, and training goes on (its activations in host memory)."""

    def full(directory, nbytes, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", directory)

    monkeypatch.setattr(ssd_tiers, "disk_rates", full)
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    overrides = {f"blocks.{i}": "nvme" for i in range(4)}
    with pytest.warns(ssdtrain.OffloadWarning) as caught:
        with ssdtrain.offload(
            model, overrides=overrides, directories=[str(tmp_path)], min_bytes="4K", verbose=False, profile_steps=1
        ) as s:
            _steps(model, ids, 3, want)
    messages = [str(w.message) for w in caught]
    assert any("no NVMe tier" in m and str(tmp_path) in m for m in messages)
    assert s.plan.tiers["nvme"].capacity == 0
    assert s.stats()["bytes_offloaded"]["host"] > 0 and s.stats()["bytes_offloaded"]["nvme"] == 0


def test_disk_rates_are_measured_once_and_cached(tmp_path, monkeypatch):
    d = tmp_path / "disk"
    d.mkdir()
    write, read = ssd_tiers.disk_rates(str(d), 2 << 20)
    assert write > 0 and read > 0
    cached = json.load(open(os.path.join(ssd_tiers.cache_dir(), "disk-rates.json")))
    assert any(k.startswith(os.path.realpath(d)) for k in cached)

    def refuse(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(ssd_tiers, "Engine", refuse)
    assert ssd_tiers.disk_rates(str(d), 2 << 20) == (write, read)


def test_plans_use_the_measured_disk_rate(tmp_path):
    model, ids = make_net(layers=3), batch()
    with ssdtrain.offload(
        model, overrides={"blocks.0": "nvme"}, directories=[str(tmp_path)], min_bytes="4K", verbose=False
    ) as s:
        _steps(model, ids, 3)
    spec = s.plan.tiers["nvme"]
    assert spec.measured and spec.write_rate > 0
    assert "nvme write" in str(s.plan) and "assumed" not in str(s.plan)


def _open_files_under(path) -> int:
    opened = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            opened.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the directory listing's own descriptor, closed already
            pass
    return len([p for p in opened if p.startswith(str(path))])


def test_per_step_contexts_share_one_pinned_pool_and_engine(tmp_path, monkeypatch):
    """A session per step reuses the model's pinned pool (no new pinned chunk after the first step), its engine (one
    file, one set of threads) and its plan; ``ssdtrain.release(model)`` closes them, and the next session makes new
    ones."""
    from ssdtrain import hostpool

    chunks = []
    real = hostpool.huge_empty
    monkeypatch.setattr(hostpool, "huge_empty", lambda *a, **k: chunks.append(a) or real(*a, **k))
    model, ids = make_net(layers=3), batch()
    _, want = reference(model, ids)
    options = dict(
        overrides={"blocks.0": "nvme", "blocks.1": "host"},
        directories=[str(tmp_path)],
        min_bytes="4K",
        verbose=False,
        profile_steps=1,
    )
    sessions = []
    for _ in range(4):
        with ssdtrain.offload(model, **options) as s:
            _steps(model, ids, 1, want)
        sessions.append(s)
        assert _open_files_under(tmp_path) == (len(sessions) > 1)  # the engine's one file, kept between steps
    assert all(t.pool is sessions[0].pool and t.cache.engine is sessions[0].cache.engine for t in sessions)
    assert len(chunks) == 1 and sessions[-1].stats()["bytes_offloaded"]["nvme"] > 0
    assert sum(t.stats()["profiled_steps"] for t in sessions) == 1
    engine = sessions[-1].cache.engine
    assert ssdtrain.release(model) and not ssdtrain.release(model)  # the second call: nothing left
    assert sessions[0].pool.reserved == 0 and engine.closed and _open_files_under(tmp_path) == 0
    with ssdtrain.offload(model, **options) as again:
        _steps(model, ids, 1, want)
    assert again.pool is not sessions[0].pool and again.stats()["profiled_steps"] == 0  # new tiers, same plan
    ssdtrain.release(model)


def test_other_limits_get_other_tiers_and_the_old_ones_close(tmp_path):
    model, ids = make_net(layers=3), batch()
    with ssdtrain.offload(model, overrides={"blocks.0": "host"}, min_bytes="4K", profile_steps=1) as a:
        _steps(model, ids, 2)
    with ssdtrain.offload(
        model, overrides={"blocks.0": "host"}, min_bytes="4K", host_memory="64M", profile_steps=1
    ) as b:
        _steps(model, ids, 2)
    assert b.pool is not a.pool and a.pool.closed and a.pool.reserved == 0 and b.pool.reserved > 0
    ssdtrain.release(model)


def test_garbage_collecting_the_model_releases_its_tiers(tmp_path):
    model, ids = make_net(layers=3), batch()
    gc.collect()
    native = _native_threads()
    with ssdtrain.offload(
        model, overrides={"blocks.0": "nvme"}, directories=[str(tmp_path)], min_bytes="4K", profile_steps=1
    ) as s:
        _steps(model, ids, 2)
    pool, engine = s.pool, s.cache.engine
    assert pool.reserved > 0 and not engine.closed
    del model, s
    gc.collect()
    assert pool.reserved == 0 and engine.closed and _open_files_under(tmp_path) == 0
    assert _native_threads() <= native


def test_model_copy_has_its_own_plans():
    model, ids = make_net(layers=3), batch()
    with ssdtrain.offload(model, "1500K", min_bytes="4K", verbose=False) as s:
        _steps(model, ids, 3)
    other = copy.deepcopy(model)
    with ssdtrain.offload(other, "1500K", min_bytes="4K", verbose=False) as t:
        _steps(other, ids, 3)
    assert s.stats()["profiled_steps"] == 1 and t.stats()["profiled_steps"] == 1


def test_a_budget_given_with_a_plan_for_another_budget_is_refused():
    """offload(plan=p) uses p as is: a budget= passed with it was ignored without a word, so a plan made for no
    budget ran at its own peak (here ~3 MiB) under budget=1000 bytes. It is refused, naming plan.replan()."""
    model, ids = make_net(layers=2), batch()
    p = ssdtrain.plan(model, lambda: model(ids).backward(), min_bytes="4K")
    for budget in (1000, 0.5):
        with pytest.raises(ValueError, match=r"would be ignored.*plan\.replan\(budget=\.\.\.\)"):
            ssdtrain.offload(model, budget, plan=p, min_bytes="4K")
    tight = p.replan(budget=p.prediction.peak)
    with ssdtrain.offload(model, p.prediction.peak, plan=tight, min_bytes="4K", verbose=False) as s:  # its own
        model(ids).backward()
    assert s.plan is tight


def test_overrides_given_with_a_plan_are_refused():
    """offload(plan=p, overrides=...) ran p's choices and ignored the overrides without a word (the only warning
    said the plan keeps everything). It is refused, naming plan.override()."""
    model, ids = make_net(layers=2), batch()
    p = ssdtrain.plan(model, lambda: model(ids).backward(), min_bytes="4K")
    with pytest.raises(ValueError, match=r"overrides= would be ignored.*plan\.override"):
        ssdtrain.offload(model, plan=p, overrides={"blocks.0": "host"}, min_bytes="4K")
    p.override("blocks.0", "host")
    with ssdtrain.offload(model, plan=p, min_bytes="4K", verbose=False) as s:
        model(ids).backward()
    assert s.stats()["bytes_offloaded"]["host"] > 0


def test_prefetch_units_given_with_a_plan_apply_to_its_choices():
    """offload(plan=p, prefetch_units=n) ran with the window p was made with and ignored n without a word. How far
    ahead backward restores moved units is the session's to set, not a choice of the plan: p's choices now run with
    n units prefetched ahead (the cache's window and the plan's prediction follow; p itself is unchanged), and a
    window that puts the prediction above p's budget warns. Left out, p's own window is used."""
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    moved = {f"blocks.{i}": "host" for i in range(4)}
    p = ssdtrain.plan(model, lambda: model(ids).backward(), min_bytes="4K", overrides=moved)
    assert p.window_units == 2 and p.window_bytes > 0
    model.zero_grad()
    with ssdtrain.offload(model, plan=p, prefetch_units=1, verbose=False) as s:
        model(ids).backward()
    assert_same_grads(grads(model), want)
    assert s.cache.window_units == 1 and s.plan.window_units == 1 and s.plan.choices == p.choices
    assert s.cache.window_bytes == p.window_bytes // 2 and s.plan.prediction.peak < p.prediction.peak
    assert p.window_units == 2 and "prefetch window 1 units ahead" in str(s.plan)
    with ssdtrain.offload(model, plan=p, verbose=False) as s:
        model(ids).backward()
    assert s.plan is p and s.cache.window_units == 2
    p3 = ssdtrain.plan(model, lambda: model(ids).backward(), min_bytes="4K", overrides=moved, prefetch_units=3)
    assert p3.window_units == 3 and ssdtrain.offload(model, plan=p3).prefetch_units == 3
    tight = p.replan(budget=int(p.prediction.peak * 1.1))
    assert tight.with_window(4).prediction.peak > tight.budget  # (four blocks back at once: more than the margin)
    with pytest.warns(ssdtrain.OffloadWarning, match=r"prefetch_units=4\): with that window .* above its budget"):
        ssdtrain.offload(model, plan=tight, prefetch_units=4)


def test_profile_steps_given_with_a_plan_are_refused():
    """offload(plan=p) profiles no step, so a profile_steps= passed with it was ignored without a word. It is
    refused, naming ssdtrain.plan(), where it applies."""
    model, ids = make_net(layers=2), batch()
    p = ssdtrain.plan(model, lambda: model(ids).backward(), min_bytes="4K", profile_steps=1)
    with pytest.raises(ValueError, match=r"profile_steps=3 would be ignored.*ssdtrain\.plan\(model, step_fn"):
        ssdtrain.offload(model, plan=p, profile_steps=3)
    assert ssdtrain.offload(model, plan=p).profile_steps == 2  # (the default, used by nothing here)


def test_an_override_that_puts_a_plan_over_its_budget_warns():
    """plan.override() could make a budgeted plan keep more than its budget (here all blocks kept under 0.6 x
    keep's peak), and offload(plan=) then ran it past the budget without a word. The override now warns, naming
    the peak and the budget."""
    model, ids = make_net(layers=4), batch()
    p = ssdtrain.plan(model, lambda: model(ids).backward(), min_bytes="4K", nvme_memory=0)
    tight = p.replan(budget=int(p.keep_prediction.peak * 0.6))
    lean = [n for n, c in tight.as_dict().items() if c != "keep"]
    assert lean
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in lean:
            tight.override(name, "keep")
    over = [w for w in caught if issubclass(w.category, ssdtrain.OffloadWarning)]
    assert over and "is now above its budget" in str(over[-1].message)
    assert tight.prediction.peak > tight.budget
    with warnings.catch_warnings(record=True) as caught:  # an override within the budget says nothing
        warnings.simplefilter("always")
        p.override(lean[0], "recompute")  # (p has no budget)
    assert not [w for w in caught if "above its budget" in str(w.message)]


def test_a_forward_whose_graph_is_dropped_without_backward_releases_everything(tmp_path):
    """A forward whose loss is dropped unused (a skipped step, a NaN loss) left its whole graph alive: a tensor kept
    as it is and saved by the op that made it (tanh, softmax, exp save their outputs) was held by its own node,
    a cycle inside autograd that gc cannot see. The graph held every moved activation with it: their pinned
    buffers and NVMe space stayed in use for the rest of the session, step after step."""
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    overrides = {"blocks.1": "host", "blocks.2": "nvme"}
    options = dict(overrides=overrides, min_bytes="4K", directories=[str(tmp_path)], verbose=False, profile_steps=1)
    with ssdtrain.offload(model, **options) as s:
        _steps(model, ids, 1)
        for _ in range(2):
            loss = model(ids)
            assert s.cache.live_entries() > 0
            del loss
            gc.collect()
            s.cache.drain()  # (an entry whose NVMe write is still running is released when the write is done)
            assert s.cache.live_entries() == 0
            assert s.pool.in_use == 0 and s.cache.engine.stats()["live_handles"] == 0
        _steps(model, ids, 1, want)
        s.cache.drain()  # (as above: on a loaded machine the last step's NVMe writes may still be running)
        assert s.cache.live_entries() == 0


@pytest.mark.parametrize("step", ["planned", "profiled"])
def test_a_graph_dropped_through_a_derive_block_releases_everything(step, tmp_path):
    """The same through a block whose saved tensors recipes may start from (one the plan derives; every block of
    a profiled step): pack() kept those tensors as they were, for the recipes' weak references, so the cycle of an
    output saved by its own op (the block's softmax and tanh) stayed, and with it everything saved before the
    block: the last block's input, and the entries of the blocks moved to host memory and NVMe."""
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    overrides = {"blocks.0": "host", "blocks.1": "nvme", "blocks.3": "derive"}
    options = dict(overrides=overrides, min_bytes="4K", directories=[str(tmp_path)], verbose=False, profile_steps=1)
    inputs = []  # the last block's input (its norm saves it): alive while anything holds the graph before it
    handle = model.blocks[3].register_forward_pre_hook(
        lambda module, args: inputs.append(StorageWeakRef(args[0].untyped_storage()))
    )
    with ssdtrain.offload(model, **options) as s:
        if step == "planned":
            _steps(model, ids, 1)  # the profiled step
        inputs.clear()
        loss = model(ids)
        assert s.cache.derive_unit is not None and s.cache.derive_unit(4)  # the last block goes through derive
        if step == "planned":
            assert s.plan.choice("blocks.3") == Choice.parse("derive") and s.cache.live_entries() > 0
        del loss
        gc.collect()
        s.cache.drain()  # (an entry whose NVMe write is still running is released when the write is done)
        assert inputs[0].expired(), "the dropped graph is still alive"
        assert s.cache.live_entries() == 0
        engine = s.cache.engine  # (none yet where nothing was moved: a profiled step on CPU keeps all)
        assert s.pool.in_use == 0 and (engine is None or engine.stats()["live_handles"] == 0)
        handle.remove()
        _steps(model, ids, 2)
        _steps(model, ids, 1, want)  # (recipes made from the aliases: the same gradients)
        s.cache.drain()  # (on a loaded machine the last step's NVMe writes may still be running)
        assert s.stats()["tensors_derived"] > 0 and s.cache.live_entries() == 0


@pytest.mark.parametrize("where", ["kept", "moved"])
def test_a_keyboard_interrupt_in_forward_leaves_the_next_forwards_steps(where):
    """Ctrl-C in the middle of a forward inside the session (a notebook cell interrupted, then run again): torch
    runs forward hooks registered with always_call for an Exception only, so the session's post hooks never ran
    and it took every later forward for one nested in the interrupted one: no step was counted or started (no
    step reset, no calibration), and where the interrupted block ran with ssdtrain's saved-tensor hooks off (a
    block the plan keeps whole), they stayed off, so nothing was offloaded any more."""
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    # "kept": blocks.0-2 run without hooks (kept, nothing moved below them); "moved": every block moves.
    moved = ["blocks.3"] if where == "kept" else [f"blocks.{i}" for i in range(4)]
    overrides = {name: "host" for name in moved}
    interrupt = {"armed": False}

    def pre(module, args):
        if interrupt["armed"]:
            interrupt["armed"] = False
            raise KeyboardInterrupt

    with ssdtrain.offload(model, overrides=overrides, min_bytes="4K", verbose=False, profile_steps=1) as s:
        model.blocks[1].register_forward_pre_hook(pre)
        _steps(model, ids, 2)  # (the first one is profiled)
        planned = s.stats()["bytes_offloaded"]["host"]
        _steps(model, ids, 1)
        per_step = s.stats()["bytes_offloaded"]["host"] - planned
        interrupt["armed"] = True
        with pytest.raises(KeyboardInterrupt):
            model(ids)
        interrupt["armed"] = True
        with pytest.raises(KeyboardInterrupt), torch.no_grad():  # an evaluation forward interrupted: no step
            model(ids)
        gc.collect()
        before = s.stats()
        _steps(model, ids, 2, want)
        after = s.stats()
        assert s.hooks.depth == 0 and s.hooks.block_depth == 0 and not s._hooks_paused
    assert after["steps"] == before["steps"] + 2
    assert per_step > 0 and after["bytes_offloaded"]["host"] - before["bytes_offloaded"]["host"] == 2 * per_step


def test_a_plan_runs_with_the_min_bytes_it_was_profiled_with():
    """offload(model, plan=p) ran p under offload()'s default min_bytes (1 MiB), not the one p was profiled with:
    tensors between the two stayed on the device though the plan moves them (here every one: nothing moved, the
    budget's prediction meaningless). The README's own example did this. The plan's min_bytes is now used, and
    another one is refused."""
    model, ids = make_net(layers=2), batch()
    _, want = reference(model, ids)
    p = ssdtrain.plan(model, lambda: model(ids).backward(), min_bytes="4K", overrides=MOVED)
    model.zero_grad()
    with ssdtrain.offload(model, plan=p, verbose=False) as s:
        model(ids).backward()
    assert_same_grads(grads(model), want)
    assert s.min_bytes == 4 * KIB and s.stats()["bytes_offloaded"]["host"] > 0
    assert p.replan(budget=p.prediction.peak).min_bytes == 4 * KIB
    with pytest.raises(ValueError, match="the plan was profiled with min_bytes=4096"):
        ssdtrain.offload(model, plan=p, min_bytes="1M")
    p0 = p.replan()
    p0.min_bytes = 0  # (a plan profiled with min_bytes=0: 0 is a min_bytes too, not "none given")
    assert ssdtrain.offload(model, plan=p0).min_bytes == 0


def test_a_model_nothing_else_holds_is_named_as_the_problem():
    """offload(build_model()): the session holds the model weakly, so the model is gone before the with block;
    entering says so and what to do, instead of a TypeError from deep inside."""
    session = ssdtrain.offload(make_net(), verbose=False)
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists.*keep the model in a variable"):
        session.__enter__()
