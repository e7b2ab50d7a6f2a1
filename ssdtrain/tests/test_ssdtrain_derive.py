"""The `derive` choice: saved results of norms, activations and casts stored as recipes and made again in backward.

Counts of saved bytes need no GPU: a Llama-style block under CPU autocast saves the same tensors as under CUDA
autocast (fp32 RMSNorm, bf16 casts for the projections, a gated SiLU MLP), so the bytes per token checked here are
those of the benchmark's block.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import ssdtrain
from ssdtrain.derive import Derived, Deriver
from ssdtrain.entries import _param_derived
from ssdtrain.planner import Choice, make_plan
from ssdtrain.prediction import Bandwidth, UnitProfile, simulate

MIB = 1 << 20


def _llama(layers=2, hidden=64, heads=4, kv_heads=2, seq=64):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3 + 255) // 256 * 256 if hidden >= 256 else 176,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=211,
        max_position_embeddings=seq,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg), cfg


def _block_bytes(model, block, ids):
    """(bytes of the block's saved activations kept, bytes derived, derived tensors) with a Deriver in the hooks,
    and the loss and gradients of that step."""
    deriver = Deriver()
    inside = [False]
    kept, derived = {}, []

    def pre(*_):
        inside[0] = True
        deriver.reset()

    def post(*_):
        inside[0] = False
        deriver.reset()

    def pack(t):
        if not inside[0] or isinstance(t, torch.nn.Parameter):
            return t
        d = deriver.derive(t)
        storage = t.untyped_storage()
        if d is not None:
            derived.append(storage.nbytes())
            return d
        if not _param_derived(t):
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    def unpack(x):
        return x.materialize() if isinstance(x, Derived) else x

    handles = [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    return sum(kept.values()), sum(derived), len(derived), loss


def _expected_derived_per_token(hidden, inter):
    # Two RMSNorms: the normalised input (fp32); five bf16 casts of the norms' outputs (query, key, value; gate, up);
    # the SiLU's output and the product fed to the down projection (bf16).
    return 2 * 4 * hidden + 5 * 2 * hidden + 2 * 2 * inter


@pytest.mark.parametrize("shape", ["tiny", "benchmark"])
def test_llama_block_derived_bytes_and_exact_gradients(shape):
    """Per token, exactly what the recipes remove, and gradients bit for bit those of keeping everything."""
    if shape == "tiny":
        model, cfg = _llama()
        ids = torch.randint(0, 211, (2, 48), generator=torch.Generator().manual_seed(5))
    else:  # the ROK benchmark's block (16 heads, 4 key/value heads, 2048 hidden), few tokens
        model, cfg = _llama(layers=1, hidden=2048, heads=16, kv_heads=4, seq=32)
        ids = torch.randint(0, 211, (1, 32), generator=torch.Generator().manual_seed(5))
    ref = copy.deepcopy(model)
    block = model.model.layers[-1]
    kept, derived, count, loss = _block_bytes(model, block, ids)
    tokens = ids.numel()
    h, i = cfg.hidden_size, cfg.intermediate_size
    assert count == 9
    assert derived == tokens * _expected_derived_per_token(h, i)
    # What stays: the block's input and the residual after attention (fp32), query/key/value after the rotary
    # embedding, attention's output (bf16), the gate and up projections' outputs (bf16), small tensors.
    kv = h * cfg.num_key_value_heads // cfg.num_attention_heads
    big_kept = tokens * (2 * 4 * h + 2 * (h + 2 * kv) + 2 * h + 2 * 2 * i)
    assert big_kept <= kept < big_kept * 1.1
    assert derived / (derived + kept) > (0.5 if shape == "benchmark" else 0.45)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    assert torch.equal(loss, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_a_norms_half_precision_cast_is_made_by_one_multiply():
    """The cast of an RMSNorm's output (weight x normalised input, fp32) to bf16 is made in one multiply writing
    bf16, not a multiply and a cast: the same bits, the fp32 product never written."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    def run(hooks):
        torch.manual_seed(3)
        x = torch.randn(4, 8, 64, requires_grad=True)
        w = torch.randn(64, requires_grad=True)
        proj = torch.randn(32, 64).to(torch.bfloat16).requires_grad_()
        deriver = Deriver()

        def pack(t):
            d = deriver.derive(t)
            return t if d is None else d

        ops = Ops()

        def unpack(v):
            if not isinstance(v, Derived):
                return v
            with ops:
                return v.materialize()

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack) if hooks else contextlib.nullcontext():
            n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            y = torch.nn.functional.linear((w * n).to(torch.bfloat16), proj)
        y.float().square().sum().backward()
        return [x.grad, w.grad, proj.grad], ops.names

    want, _ = run(False)
    got, names = run(True)
    assert names.count("aten.mul.out") == 1 and "aten._to_copy.default" not in names, names
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_each_op_made_once_and_nothing_held_after_backward():
    """A result several saved tensors need (a norm's output cast for three projections) is made once in backward,
    and no result is held once backward is done."""
    model, _ = _llama()
    ids = torch.randint(0, 211, (2, 48), generator=torch.Generator().manual_seed(5))
    deriver, made, ops = Deriver(), [], {}

    def pack(t):
        d = deriver.derive(t) if not isinstance(t, torch.nn.Parameter) else None
        if d is None:
            return t
        for op in d.op.ops():
            if id(op) not in ops:
                ops[id(op)] = op
                op.fn = (lambda f, k: lambda *a: (made.append(k), f(*a))[1])(op.fn, id(op))
        return d

    def unpack(x):
        return x.materialize() if isinstance(x, Derived) else x

    pre = [b.register_forward_pre_hook(lambda *_: deriver.reset()) for b in model.model.layers]
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    for h in pre:
        h.remove()
    assert len(ops) >= 8 * len(model.model.layers)
    assert sorted(made) == sorted(ops)  # each op once
    assert all(op.value is None and op.refs == 0 for op in ops.values())


def test_derived_input_changed_in_place_raises():
    deriver = Deriver()
    x = torch.randn(8, 16, requires_grad=True)
    a = x * 2  # saved below (by mul), then changed in place
    b = torch.randn(8, 16, requires_grad=True)

    def pack(t):
        d = deriver.derive(t)
        return d if d is not None else t

    def unpack(v):
        return v.materialize() if isinstance(v, Derived) else v

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        c = a * b  # saves a (real: mul by a constant is no recipe) and b
        d = torch.nn.functional.silu(c)  # saves c: derivable from a and b
        out = (d * b).sum()  # saves d (silu of c) and b
    with torch.no_grad():
        a.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.backward()


@pytest.mark.parametrize("mixed", [False, True])
def test_session_derive_override_equal_gradients(mixed):
    """Blocks planned `derive` in a session (alone, or beside moved and recomputed blocks): recipes are stored,
    gradients equal keeping everything."""
    model, _ = _llama(layers=3)
    ids = torch.randint(0, 211, (2, 48), generator=torch.Generator().manual_seed(5))
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss = ref(input_ids=ids, labels=ids).loss
    want_loss.backward()
    overrides = {f"model.layers.{k}": "derive" for k in range(3)}
    if mixed:
        overrides.update({"model.layers.0": "recompute+host", "model.layers.2": "host"})
    with ssdtrain.offload(model, min_bytes="2K", overrides=overrides, profile_steps=1, verbose=False) as s:
        for _ in range(2):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    assert torch.equal(loss, want_loss)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    derived = 1 if mixed else 3
    # One planned step: per block the 9 activations and the casts of its 7 weight matrices.
    assert s.stats()["tensors_derived"] == derived * (9 + 7)
    assert [str(c) for c in s.plan.choices[1:-1]].count("derive") == derived
    assert "derive =" in str(s.plan)
    if mixed:
        assert s.stats()["bytes_offloaded"]["host"] > 0


def test_profile_measures_derivable_bytes():
    model, cfg = _llama(layers=3)
    ids = torch.randint(0, 211, (2, 48), generator=torch.Generator().manual_seed(5))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    plan = ssdtrain.plan(model, step, min_bytes="2K")
    per_token = _expected_derived_per_token(cfg.hidden_size, cfg.intermediate_size)
    for u in plan.units[1:-1]:
        assert u.derive_bytes == ids.numel() * per_token
        assert u.derive_s > 0
        assert Choice("derive") in u.options()
    # Without autocast the projections save the norms' fp32 outputs (made from the normalised input): derived too.
    plain = ssdtrain.plan(model, lambda: model(input_ids=ids, labels=ids).loss.backward(), min_bytes="2K")
    h, i = cfg.hidden_size, cfg.intermediate_size
    assert plain.units[1].derive_bytes == ids.numel() * (2 * 4 * h + 2 * 4 * h + 2 * 4 * i)


def test_head_derives_its_norm_and_weight_cast_with_equal_gradients():
    """The head (final norm, LM head, loss) may be `derive` too: its normalised input, the cast of that input (made
    through the alias HF's slice by `logits_to_keep` leaves) and the cast of the LM head's weight are recipes, bit
    for bit the gradients of keeping everything; the profile measures them and the planner offers it."""
    model, cfg = _llama(layers=2)
    ids = torch.randint(0, 211, (2, 48), generator=torch.Generator().manual_seed(5))
    ref = copy.deepcopy(model)

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    want = step(ref)
    plan = ssdtrain.plan(model, lambda: step(model), min_bytes="2K")
    head = plan.units[-1]
    assert head.kind == "head" and head.derive_bytes == ids.numel() * (4 + 2) * cfg.hidden_size
    assert head.derive_s > 0 and head.pinned_bytes == cfg.vocab_size * cfg.hidden_size * 2
    assert Choice("derive") in head.options() and Choice("full") not in head.options()
    model.zero_grad()
    with ssdtrain.offload(model, min_bytes="2K", overrides={head.name: "derive"}, profile_steps=1, verbose=False) as s:
        for _ in range(2):
            model.zero_grad()
            loss = step(model)
    assert str(s.plan.choices[-1]) == "derive" and all(str(c) == "keep" for c in s.plan.choices[:-1])
    assert s.stats()["tensors_derived"] == 3  # one planned step: the normalised input, its cast, the weight's cast
    assert torch.equal(loss, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    with pytest.raises(ValueError, match="only blocks can be recomputed"):
        s.plan.override(head.name, "recompute")


def test_head_derive_counts_its_recipes_after_the_logits_gradients():
    """At the head's backward the recipes are made after the loss's backward freed the logits' gradients: a derived
    head's peak there is lower by what it derives, unless the recipes outgrow half the working memory."""
    units = _units(n=2)
    units[-1] = UnitProfile(
        "<head>",
        "head",
        forward_s=0.004,
        saved_bytes=200 * MIB,
        derive_bytes=64 * MIB,
        derive_s=1e-4,
        pinned_bytes=128 * MIB,
    )
    bw = Bandwidth(50e9, 50e9)
    keep = [Choice()] * len(units)
    derived = keep[:-1] + [Choice("derive")]
    work = 1024 * MIB

    def peak(choices, working):
        p = simulate(units, choices, bw, working_bytes=working, forward_working=0, block_working=0)
        assert p.peak_at == "backward of <head>"
        return p

    a, b = peak(keep, work), peak(derived, work)
    assert a.peak - b.peak == 64 * MIB + 128 * MIB
    assert b.seconds > a.seconds
    # Recipes (made: half the derived bytes and the weight's cast, 160 MiB) larger than half the working memory
    # (32 MiB): the peak there is the recipes and that half, 128 MiB above the working memory alone.
    assert peak(keep, 64 * MIB).peak - peak(derived, 64 * MIB).peak == 64 * MIB + 128 * MIB - 128 * MIB


def test_derived_blocks_weight_casts_leave_autocast_cache():
    """A `derive` block's weight casts are recipes: autocast's cache is cleared when it returns, so none is held
    after forward; the plan counts them only while the block runs (as a recomputed block's)."""
    from test_ssdtrain_offload import batch, make_net
    from test_ssdtrain_reliability import alive_block_casts

    overrides = {f"blocks.{i}": "derive" for i in range(3)}
    alive, s = alive_block_casts(make_net(layers=3, width=64), batch(), overrides)
    assert alive == 0 and s.plan.clear_casts
    assert all(c.recompute == "derive" for c in s.plan.choices[1:-1])
    kept = make_plan("m", s.plan.units, s.plan.bandwidth, None, block_container="blocks")
    assert s.plan.prediction.peak < kept.keep_prediction.peak


def test_derive_choice_parsing():
    units = _units(n=2, derive=0, derive_s=0.0)
    with pytest.warns(UserWarning, match="found no saved tensor there"):
        plan = make_plan("m", units, Bandwidth(1e9, 1e9), None, block_container="b", overrides={"b.0": "derive"})
    assert plan.prediction.peak == plan.keep_prediction.peak
    assert str(Choice.parse("derive")) == "derive"
    assert Choice.parse("derive") == Choice("derive", "keep")
    assert Choice.parse("derive+host") == Choice("derive", "host") and str(Choice("derive", "host")) == "derive+host"
    with pytest.raises(ValueError, match="cheap"):
        Choice.parse("derive+cheap+tape")


def _units(n=8, fwd=0.004, saved=800 * MIB, derive=440 * MIB, derive_s=0.0004):
    units = [UnitProfile("<stem>", "stem", forward_s=fwd / 10, saved_bytes=MIB)]
    for k in range(n):
        units.append(
            UnitProfile(
                f"b.{k}",
                "block",
                forward_s=fwd,
                saved_bytes=saved,
                input_bytes=64 * MIB,
                derive_bytes=derive,
                derive_s=derive_s,
                tensors=30,
            )
        )
    units.append(UnitProfile("<head>", "head", forward_s=fwd, saved_bytes=200 * MIB))
    return units


def test_planner_prefers_derive_over_full_recompute():
    """Where deriving frees the bytes the budget needs at a tenth of a block's forward, the planner derives rather
    than recompute whole blocks, and its plan is faster than the best plan without deriving."""
    units = _units()
    without = _units(derive=0, derive_s=0.0)
    slow = Bandwidth(d2h=1e9, h2d=1e9)  # a slow link: moving is no way out here
    keep_peak = simulate(units, [Choice()] * len(units), slow).peak
    options = dict(host_limit=1 << 40, nvme_limit=0, block_container="b", async_copies=False)
    for removed in (4 * 440 * MIB, 6 * 440 * MIB, 8 * 440 * MIB):
        plan = make_plan("m", units, slow, keep_peak - removed, **options)
        assert plan.prediction.peak <= keep_peak - removed
        kinds = [c.recompute for c in plan.choices[1:-1]]
        assert kinds.count("derive") >= removed // (440 * MIB) - 1 and kinds.count("full") <= 1
        assert all(c.tier == "keep" for c in plan.choices if c.recompute == "derive")
        other = make_plan("m", without, slow, keep_peak - removed, **options)
        assert plan.prediction.seconds < other.prediction.seconds


def test_planner_derives_on_the_device_only():
    """`derive+host` is an override only (measured slower than whole-block recompute on an H100, see
    ``UnitProfile.options``): at budgets below deriving alone the planner derives on the device and recomputes or
    moves whole blocks, never `derive` with a tier, even where a fast link would hide the copies."""
    units = _units()
    fast = Bandwidth(d2h=50e9, h2d=50e9)
    derive_all = [Choice(), *[Choice("derive")] * 8, Choice()]
    for removed in (1, 3):
        target = simulate(units, derive_all, fast).peak - removed * 360 * MIB
        plan = make_plan("m", units, fast, target, host_limit=1 << 40, nvme_limit=0, block_container="b")
        assert plan.prediction.peak <= target
        assert all(c.tier == "keep" for c in plan.choices if c.recompute == "derive")
        assert any(c.recompute == "derive" for c in plan.choices)


def test_derive_with_host_moves_the_recipes_inputs_and_stays_exact():
    """A block planned `derive+host`: its recipes read the saved tensors they are made from back through the host
    tier, so that forward holds none of the block's moved tensors on the device (a recipe holding the tensor itself
    would keep its bytes however it was moved), and every loss and gradient equals the model's own, bit for bit, in
    the general search's steps and in the template's replays."""
    torch.manual_seed(0)
    model = _BranchModel(dim=32)
    ref = copy.deepcopy(model)
    overrides = {"layers.0": "derive+host", "layers.1": "derive", "layers.2": "host", "layers.3": "derive+host"}
    gen = torch.Generator().manual_seed(5)
    alive_after_forward = []
    with ssdtrain.offload(model, min_bytes=0, overrides=overrides, profile_steps=1, host_memory="64M") as s:
        for step in range(5):
            ids = torch.randint(0, 37, (3, 16), generator=gen)
            losses = []
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = m(ids)
                if m is model and s.plan is not None:
                    entries = [e for e in (r() for r in s.cache._live.values()) if e is not None and e.unit in (1, 4)]
                    alive_after_forward.append((len(entries), sum(e.alive_original() is not None for e in entries)))
                    del entries
                loss.backward()
                losses.append(loss.detach())
            assert torch.equal(losses[0], losses[1]), step
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), (step, name)
    stats = s.stats()
    assert [str(c) for c in s.plan.choices[1:-1]] == ["derive+host", "derive", "host", "derive+host"]
    assert stats["tensors_derived"] > 0 and stats["bytes_offloaded"]["host"] > 0 and stats["derive_replayed"] > 0
    assert alive_after_forward and all(n > 0 for n, _ in alive_after_forward)
    # No moved tensor of the derive+host blocks is still alive on its device once forward returned.
    assert all(alive == 0 for _, alive in alive_after_forward), alive_after_forward


class _BranchBlock(torch.nn.Module):
    """A block whose saved-tensor sequence changes from step to step: an extra gated product only when `extra`."""

    def __init__(self, dim):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.up = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.down = torch.nn.Linear(dim, dim, bias=False)
        self.extra = False

    def forward(self, x):
        h = self.norm(x)
        a, b = self.up(h).chunk(2, dim=-1)
        g = torch.nn.functional.silu(a) * b
        if self.extra:
            g = g * torch.nn.functional.silu(g)
        return x + self.down(g)


class _BranchModel(torch.nn.Module):
    def __init__(self, dim=16, blocks=4):
        super().__init__()
        self.embed = torch.nn.Embedding(37, dim)
        self.layers = torch.nn.ModuleList(_BranchBlock(dim) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, 37, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def test_changing_saved_sequence_keeps_gradients_exact():
    """Steps whose saved tensors differ from the profiled step's (another sequence length, a branch taken only in
    some steps, an evaluation forward in between) under derive, keep and host blocks: every gradient and loss equals
    the model's own without ssdtrain, bit for bit (a decision for one saved tensor applied to another would not)."""
    torch.manual_seed(0)
    model = _BranchModel()
    ref = copy.deepcopy(model)
    overrides = {"layers.0": "derive", "layers.1": "keep", "layers.2": "host", "layers.3": "derive"}
    gen = torch.Generator().manual_seed(3)
    schedule = [(12, ()), (12, ()), (12, (0, 3)), (9, ()), (12, (1, 2, 3)), (9, (0,)), (12, ()), (12, (3,))]
    with ssdtrain.offload(model, min_bytes=0, overrides=overrides, profile_steps=1, host_memory="64M") as s:
        for step, (seq, extra) in enumerate(schedule):
            ids = torch.randint(0, 37, (2, seq), generator=gen)
            for m in (model, ref):
                for k, layer in enumerate(m.layers):
                    layer.extra = k in extra
            losses = []
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = m(ids)
                loss.backward()
                losses.append(loss.detach())
                if step % 3 == 1:
                    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                        m(ids)  # evaluation between steps: saves nothing, changes nothing
            assert torch.equal(losses[0], losses[1]), step
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), (step, name)
    stats = s.stats()
    assert stats["tensors_derived"] > 0 and stats["bytes_offloaded"]["host"] > 0
    # The steps that differ from the one before hand their derive blocks back to the general search; the others
    # replay the blocks' templates.
    assert stats["derive_template_misses"] > 0 and stats["derive_replayed"] > 0


def _train_steps(model, ref, steps, seq=12, user_hooks=None):
    """Run `steps` steps on `model` (in a session, by the caller) and on `ref`; assert equal losses and gradients."""
    gen = torch.Generator().manual_seed(11)
    for step in range(steps):
        ids = torch.randint(0, 37, (2, seq), generator=gen)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if user_hooks is not None and m is model:
                    with torch.autograd.graph.saved_tensors_hooks(*user_hooks):
                        loss = m(ids)
                else:
                    loss = m(ids)
            loss.backward()
            if m is model:
                got = loss.detach()
        assert torch.equal(got, loss.detach()), step
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (step, name)


@pytest.mark.parametrize(
    ("overrides", "bare"),
    [
        ({f"layers.{k}": "keep" for k in range(4)}, 4),  # nothing moved: every block without hooks
        ({"layers.0": "keep", "layers.1": "keep", "layers.2": "keep", "layers.3": "host"}, 3),  # moved on top
        ({"layers.0": "host", "layers.1": "keep", "layers.2": "keep", "layers.3": "keep"}, 0),  # moved below
        ({"layers.0": "keep", "layers.1": "derive", "layers.2": "keep", "layers.3": "recompute+host"}, 2),
    ],
)
def test_kept_blocks_without_hooks(overrides, bare):
    """Blocks kept whole with no moved unit below them run with ssdtrain's hooks off (each saved tensor's hook
    costs the host, and a host-bound step the device); a kept block above a moved one keeps them (its unpacks
    bring the moved blocks below back ahead of backward). Gradients stay exact."""
    torch.manual_seed(0)
    model = _BranchModel()
    ref = copy.deepcopy(model)
    with ssdtrain.offload(model, min_bytes=0, overrides=overrides, profile_steps=1, host_memory="64M") as s:
        _train_steps(model, ref, 4)
    stats = s.stats()
    planned = stats["planned_steps"]
    assert planned >= 2
    assert stats["bare_block_forwards"] == bare * planned
    if bare < 4:
        assert stats["bytes_offloaded"]["host"] > 0 or stats["tensors_derived"] > 0
    if any(v.endswith("host") for v in overrides.values()):
        assert stats["misses"] == 0  # the moved blocks were prefetched, not restored on demand


def test_kept_blocks_keep_hooks_a_user_pushed_inside_the_session():
    """Saved-tensor hooks the user pushes inside the session (around the forward) are on top of ssdtrain's: a
    kept block's forward leaves them alone (ssdtrain's are not on top, so they are not taken off), and the user's
    hooks see every tensor the model saves."""
    torch.manual_seed(0)
    model = _BranchModel()
    ref = copy.deepcopy(model)
    seen = []

    def pack(t):
        seen.append(1)
        return t

    overrides = {f"layers.{k}": "keep" for k in range(4)}
    with ssdtrain.offload(model, min_bytes=0, overrides=overrides, profile_steps=1) as s:
        _train_steps(model, ref, 3, user_hooks=(pack, lambda t: t))
    assert s.stats()["bare_block_forwards"] == 0
    assert len(seen) > 3 * 4 * 5  # every block's saved tensors, every step


def test_derive_recipes_replayed_from_templates():
    """After the first planned step each derive block's recipes are replayed from its template (decided once, checked
    per saved tensor), not searched again: the counters say so, and gradients stay equal to keeping everything."""
    model, _ = _llama(layers=3)
    ids = torch.randint(0, 211, (2, 48), generator=torch.Generator().manual_seed(5))
    ref = copy.deepcopy(model)
    overrides = {f"model.layers.{k}": "derive" for k in range(3)}
    with ssdtrain.offload(model, min_bytes="2K", overrides=overrides, profile_steps=1) as s:
        for step in range(4):
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
                if m is model:
                    got = loss.detach()
            assert torch.equal(got, loss.detach()), step
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), (step, name)
    stats = s.stats()
    per_step = 3 * (9 + 7)  # per block: 9 activations and the casts of its 7 weight matrices
    assert stats["planned_steps"] == 3 and stats["tensors_derived"] == 3 * per_step
    assert stats["derive_searched"] == per_step  # the first planned step searched and recorded
    assert stats["derive_replayed"] == 2 * per_step
    assert stats["derive_template_misses"] == 0


class _SwapBlock(torch.nn.Module):
    """A block whose recipe's input changes between steps while every saved tensor keeps its class and shape: the
    product fed to SiLU is made from `a` or, when `swap`, from `b` (both projections). A replay checking classes only
    would make SiLU's input from the wrong projection."""

    def __init__(self, dim):
        super().__init__()
        self.a = torch.nn.Linear(dim, dim, bias=False)
        self.b = torch.nn.Linear(dim, dim, bias=False)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.swap = False

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        t = a * b
        r = (b if self.swap else a) * self.scale
        return x + self.out(torch.nn.functional.silu(r) + t)


class _SwapModel(_BranchModel):
    def __init__(self, dim=16, blocks=3):
        super().__init__(dim, blocks)
        self.layers = torch.nn.ModuleList(_SwapBlock(dim) for _ in range(blocks))


def test_template_replay_checks_inputs_not_only_classes():
    """Steps alternate which saved tensor a recipe is made from, with the same classes and shapes at every position:
    the replay notices (the input's node is not the one saved at the template's position), hands the block to the
    general search, and gradients equal the model's own bit for bit; unchanged steps are replayed."""
    torch.manual_seed(0)
    model = _SwapModel()
    ref = copy.deepcopy(model)
    overrides = {f"layers.{k}": "derive" for k in range(3)}
    gen = torch.Generator().manual_seed(7)
    schedule = [False, False, False, False, True, True, False, True, False, False]
    with ssdtrain.offload(model, min_bytes=0, overrides=overrides, profile_steps=1) as s:
        for step, swap in enumerate(schedule):
            ids = torch.randint(0, 37, (2, 12), generator=gen)
            losses = []
            for m in (model, ref):
                for layer in m.layers:
                    layer.swap = swap
                m.zero_grad(set_to_none=True)
                loss = m(ids)
                loss.backward()
                losses.append(loss.detach())
            assert torch.equal(losses[0], losses[1]), step
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), (step, swap, name)
    stats = s.stats()
    assert stats["derive_template_misses"] >= 3 * 3  # each change of `swap` after the first planned step, per block
    assert stats["derive_replayed"] > 0 and stats["derive_searched"] > 0
    assert stats["tensors_derived"] == stats["derive_replayed"] + stats["derive_searched"]


def test_template_replay_leaves_weight_casts_when_a_parameter_is_shared():
    """A block's weight used by another block too: autocast's cache is left alone, so the weights' casts are kept,
    not derived, on the general path and in the replay alike (the same count every step), and gradients are exact."""
    torch.manual_seed(0)
    model = _BranchModel()
    model.layers[1].down.weight = model.layers[0].down.weight
    ref = copy.deepcopy(model)
    overrides = {f"layers.{k}": "derive" for k in range(4)}
    with ssdtrain.offload(model, min_bytes=0, overrides=overrides, profile_steps=1) as s:
        counts = []
        for _ in range(4):
            before = s.stats()["tensors_derived"]
            _train_steps(model, ref, 1, seq=10)
            counts.append(s.stats()["tensors_derived"] - before)
    assert not s.cache.deriver.derive_casts
    stats = s.stats()
    assert stats["derive_replayed"] > 0 and stats["derive_template_misses"] == 0
    assert counts[1] > 0 and counts[1] == counts[2] == counts[3], counts


def _branch_batch():
    """The accumulation tests' batch for a `_BranchModel`."""
    return torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(11))


def _one_step(model):
    """A plain step of a `_BranchModel` (gradients set to None first): what ssdtrain.plan profiles."""
    ids = _branch_batch()

    def step():
        model.zero_grad(set_to_none=True)
        model(ids).backward()

    return step


def _accumulate(model, session_of, steps=4, micro=3):
    """`steps` optimizer steps of `micro` micro-batches each (the gradients set to None between steps) inside
    `session_of()`; returns the session and the plan each micro-batch ran under."""
    ids = _branch_batch()
    plans = []
    with session_of() as s:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            for _ in range(micro):
                model(ids).backward()
                plans.append(s.plan)
    return s, plans


def _distinct(plans):
    return len({id(p) for p in plans})  # (the list holds them: no id is reused)


def test_a_given_plan_is_adjusted_for_accumulation_once(capsys):
    """A plan made from steps that started without gradients, given with plan=, under gradient accumulation: it is
    planned again for the held gradients once, at the first micro-batch that starts with them, and that plan is used
    from then on (not a new one every step, which cleared the derive templates every time: no replays), the
    adjustment said with its predicted peak; the caller's plan is unchanged."""
    torch.manual_seed(0)
    model = _BranchModel()
    step = _one_step(model)
    given = ssdtrain.plan(model, step, min_bytes=0, overrides={f"layers.{k}": "derive" for k in range(4)})
    assert given.grads and not given.held_grads
    s, plans = _accumulate(model, lambda: ssdtrain.offload(model, plan=given, min_bytes=0, verbose=True))
    assert plans[0] is given and plans[1].held_grads
    assert _distinct(plans) == 2 and all(p is plans[1] for p in plans[1:])
    assert not given.held_grads
    said = capsys.readouterr().err
    assert said.count("gradient accumulation began") == 1 and "predicted activation peak" in said
    stats = s.stats()
    per_step = stats["tensors_derived"] // len(plans)
    # The first micro-batch searched and recorded; the adjusted plan recomputes the same blocks, so it replays them.
    assert stats["derive_searched"] == per_step
    assert stats["derive_replayed"] == (len(plans) - 1) * per_step
    assert stats["derive_template_misses"] == 0


def test_a_given_plan_is_adjusted_once_across_sessions_per_step(capsys, monkeypatch):
    """A session per optimizer step with the same plan= (as the Trainer callback opens them): the first sees
    accumulation begin and adjusts the plan (said once); the later ones start with that plan, applied once per
    session (not the given plan first and the adjusted one at the first micro-batch that holds gradients), until the
    caller changes that plan."""
    torch.manual_seed(0)
    model = _BranchModel()
    step = _one_step(model)
    given = ssdtrain.plan(model, step, min_bytes=0)
    applied = []
    apply = ssdtrain.OffloadSession._apply
    monkeypatch.setattr(ssdtrain.OffloadSession, "_apply", lambda s, plan: (applied.append(plan), apply(s, plan)))
    adjusted = []
    for k in range(3):
        applied.clear()
        s, plans = _accumulate(model, lambda: ssdtrain.offload(model, plan=given, min_bytes=0, verbose=True), 1)
        assert plans[-1].held_grads
        adjusted.append(plans[-1])
        if k == 0:  # accumulation begins here: the given plan, then the adjusted one
            assert plans[0] is given and list(map(id, applied)) == [id(given), id(plans[-1])]
        else:
            assert all(p is adjusted[0] for p in plans) and list(map(id, applied)) == [id(adjusted[0])]
    assert adjusted[1] is adjusted[0] and adjusted[2] is adjusted[0]
    assert capsys.readouterr().err.count("gradient accumulation began") == 1
    given.override("layers.0", "recompute")  # the caller's plan changed: adjusted again, with the new choice
    _, plans = _accumulate(model, lambda: ssdtrain.offload(model, plan=given, min_bytes=0), 1)
    assert plans[0] is given and plans[-1] is not adjusted[0]
    assert plans[-1].choice("layers.0") == Choice.parse("recompute")


def test_a_profiled_plan_is_adjusted_for_accumulation_once_and_keeps_its_templates():
    """The same without plan=: the profiled plan is planned again once for the held gradients; the new plan recomputes
    the same blocks, so the templates recorded under the first one are kept and replayed."""
    torch.manual_seed(0)
    model = _BranchModel()
    overrides = {f"layers.{k}": "derive" for k in range(4)}
    # One plain step first, so the profiled plan is made before accumulation begins.
    ids = _branch_batch()
    with ssdtrain.offload(model, min_bytes=0, overrides=overrides, profile_steps=1) as s:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(ids).backward()
        first = s.plan
        assert first.grads and not first.held_grads
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            for _ in range(3):
                model(ids).backward()
    assert s.plan is not first and s.plan.held_grads
    assert s.stats()["planned_steps"] == 10
    # Searched once, at the first planned step; every later micro-batch replays (under both plans).
    stats = s.stats()
    per_step = stats["tensors_derived"] // 10
    assert stats["derive_searched"] == per_step
    assert stats["derive_replayed"] == 9 * per_step
    assert stats["derive_template_misses"] == 0
