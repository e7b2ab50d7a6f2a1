"""ssdtrain in the user's own training stack, on CPU with tiny models built from configs: the Hugging Face Trainer
callback, an accelerate loop, FSDP2 and DDP (gloo, two processes), forwards that are no training steps
(evaluation, generation), autocast and gradient accumulation as cases of the plan."""

import copy
import os
import warnings

import pytest
import torch
from test_ssdtrain_offload import assert_same_grads, batch, grads, make_net, reference
from torch import nn

import ssdtrain
from ssdtrain.planning import state_of

transformers = pytest.importorskip("transformers")


def tiny_gpt2(seed=0, layers=3):
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, n_positions=64, vocab_size=128, bos_token_id=0, eos_token_id=0
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def token_rows(n, seq=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 128, (seq,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


# ------------------------------------------------------------------------------------------------ no steps
def test_forwards_without_grad_are_no_steps_and_get_no_plan():
    """Evaluation and generation inside a session: not counted, not profiled, no plan of their own, nothing saved."""
    model, ids = make_net(layers=4), batch()
    _, want = reference(model, ids)
    with ssdtrain.offload(model, 0.5, min_bytes="4K", verbose=False) as s:
        for _ in range(4):
            with torch.no_grad():
                model(batch(seed=9, shape=(5, 17)))  # another shape: would be profiled if it counted
            model.zero_grad()
            model(ids).backward()
            with torch.inference_mode():
                model(ids)
    assert_same_grads(grads(model), want)
    stats = s.stats()
    assert stats["steps"] == 4 and stats["profiled_steps"] == 1 and stats["planned_steps"] == 2
    assert len(state_of(model).plans) == 1 and len(state_of(model).warmups) == 1


def test_generate_inside_a_session_is_untouched():
    model = tiny_gpt2()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    model.eval()
    want = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False)
    model.train()
    with ssdtrain.offload(model, 0.8, min_bytes="1K", verbose=False) as s:
        for _ in range(3):
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
        model.eval()
        got = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False)
        model.train()
    assert torch.equal(got, want)
    assert s.stats()["steps"] == 3 and len(state_of(model).plans) == 1


# ---------------------------------------------------------------------------------------- autocast, accumulation
def test_autocast_and_plain_steps_get_their_own_plans():
    """The same input under autocast saves other tensors (bf16 copies, casts of the weights): its own plan."""
    model, ids = make_net(layers=3), batch()
    with ssdtrain.offload(model, 0.7, min_bytes="4K", verbose=False, profile_steps=1) as s:
        for amp in (False, True, False, True):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                model(ids).backward()
    plans = list(state_of(model).plans.values())
    assert s.stats()["profiled_steps"] == 2 and len(plans) == 2
    pinned = sorted(sum(u.pinned_bytes for u in p.units) for p in plans)
    assert pinned[0] == 0 and pinned[1] > 0  # the weights' bf16 casts: counted in the autocast plan only


def test_accumulation_under_autocast_offloads_every_micro_batch():
    """Four micro-batches per optimizer step under autocast: the first starts without gradients (backward
    allocates them: in the plan's peak), the others with; one plan serves all, and every micro-batch moves bytes."""
    model = make_net(layers=4)
    ref = copy.deepcopy(model)
    micro = [batch(seed=s) for s in range(4)]
    for ids in micro:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ref(ids) / 4
        loss.backward()
    want = grads(ref)
    # One block's activations go to host memory whatever the planner weighs (on CPU its host charge per moved
    # tensor is of the order of a tiny block's forward, so the budget alone may be met by recompute).
    with ssdtrain.offload(model, 0.75, min_bytes="4K", overrides={"blocks.1": "host"}, verbose=False) as s:
        for ids in micro:  # profiling (warm-up, measured) with the same shape
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(ids).backward()
        model.zero_grad(set_to_none=True)
        moved = []
        for ids in micro:
            before = s.stats()["bytes_offloaded"]["host"]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(ids) / 4
            loss.backward()
            moved.append(s.stats()["bytes_offloaded"]["host"] - before)
    assert_same_grads(grads(model), want)
    assert all(m > 0 for m in moved) and len(set(moved)) == 1
    plan = s.plan
    assert plan.grads and len(state_of(model).plans) == 1  # planned for steps that start without gradients


# ------------------------------------------------------------------------------------------------ Trainer
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_trainer_callback_says_once_when_nothing_moved(tmp_path):
    """A budget above keep's peak: the callback warns once, at the end of training, with the reason."""
    callback = ssdtrain.OffloadCallback(budget="10GiB", min_bytes="1K")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tiny_gpt2(), tmp_path / "idle", [callback]).train()
    idle = [w for w in caught if issubclass(w.category, ssdtrain.OffloadWarning)]
    assert len(idle) == 1 and "keeps everything" in str(idle[0].message)


def _trainer(model, out, callbacks=(), accumulation=2, steps=4):
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=3,
        gradient_accumulation_steps=accumulation,
        eval_strategy="steps",
        eval_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=7,
    )
    return transformers.Trainer(
        model=model,
        args=args,
        train_dataset=token_rows(2 * accumulation * steps),
        eval_dataset=token_rows(6, seed=2),
        callbacks=list(callbacks),
    )


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_trainer_callback_offloads_training_steps_only(tmp_path):
    plain = _trainer(tiny_gpt2(), tmp_path / "plain")
    plain.train()
    callback = ssdtrain.OffloadCallback(budget=0.8, min_bytes="1K", overrides={"transformer.h.2": "host"})
    model = tiny_gpt2()
    trainer = _trainer(model, tmp_path / "offload", [callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    # The first step profiles by design: no "offloaded nothing" warning for it (the last step moved bytes).
    assert not [w for w in caught if issubclass(w.category, ssdtrain.OffloadWarning)]
    # The callback's wrapper of the optimizer's step keeps the mark of torch's LR scheduler, which checks it.
    assert not [w for w in caught if "overridden after learning rate scheduler" in str(w.message)]

    def losses(t):
        return [(h["step"], h[k]) for h in t.state.log_history for k in ("loss", "eval_loss") if k in h]

    assert losses(trainer) == losses(plain)  # training and evaluation losses, bit for bit
    assert any("eval_loss" in h for h in trainer.state.log_history)
    for (name, p), q in zip(trainer.model.named_parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    stats = callback.stats()
    # 4 optimizer steps x 2 micro-batches; the evaluation batches (another shape) are no steps and have no plan.
    assert stats["steps"] == 8 and stats["profiled_steps"] == 1 and stats["planned_steps"] == 6
    assert stats["bytes_offloaded"]["host"] > 0 and stats["prefetch_hits"] > 0
    assert len(state_of(model).plans) == 1 and callback.plan is not None
    assert callback.session is None  # closed after the last step
    ssdtrain.release(model)


def _no_session_left(model, use_cache=None):
    """Nothing of an offload session is on the model or the thread: no saved-tensor hooks on autograd's stack, no
    forward hooks or wrappers, no mark of an active session (and the KV cache setting back, where given: the
    Trainer sets it itself)."""
    from ssdtrain import session as session_mod

    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None, "saved-tensor hooks left on"
    modules = list(model.modules())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in modules), "forward hooks left on the model"
    assert not any("forward" in vars(m) for m in modules), "a forward wrapper left on the model"
    assert not any(m in session_mod._ACTIVE for m in modules), "the model is still marked as in a session"
    if use_cache is not None:
        assert model.config.use_cache is use_cache


def _fail_once(at: int, what: str):
    """A function that raises RuntimeError("... (simulated)") at its `at`-th call and at no other; the exception it
    raised is kept in its `raised` list."""
    calls = {"n": 0}
    raised = []

    def fail(*_, **__):
        calls["n"] += 1
        if calls["n"] == at:
            raised.append(RuntimeError(f"CUDA out of memory in the {what} (simulated)"))
            raise raised[-1]

    fail.raised = raised
    return fail


class _RaisingCallback(transformers.TrainerCallback):
    """A user's callback whose on_step_end raises once (`fail`), before the offload callback's on_step_end runs."""

    def __init__(self, fail):
        self.fail = fail

    def on_step_end(self, args, state, control, **kwargs):
        self.fail()


class _FailingSchedule(torch.optim.lr_scheduler.LambdaLR):
    """A constant learning-rate schedule whose step calls `fail` first (its first call is the constructor's)."""

    def __init__(self, optimizer, fail):
        self.fail = None
        super().__init__(optimizer, lambda _: 1.0)
        self.fail = fail

    def step(self, *args, **kwargs):
        if self.fail is not None:
            self.fail()
        return super().step(*args, **kwargs)


def _same_as_without_ssdtrain(model):
    """A plain forward and backward of `model` gives the loss and gradients a copy of it without ssdtrain gives."""
    ref = tiny_gpt2()
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(5)  # (the same dropout)
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    model.zero_grad(set_to_none=True)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("added", ["Trainer(callbacks=...)", "add_callback"])
@pytest.mark.parametrize(
    "where", ["forward", "backward", "gradient clipping", "optimizer step", "scheduler step", "callback"]
)
def test_an_exception_leaving_train_leaves_no_session(where, added, tmp_path, caplog):
    # A step that raises never reaches on_step_end and the Trainer has no event for it. A session entered at
    # on_step_begin stayed entered after train() had raised (its saved-tensor hooks on the thread, its hooks on the
    # model, its pinned buffers), unless the callback had wrapped train() before the call: only at on_init_end,
    # so a callback added with add_callback() left the first train()'s failed step open. Whichever way the callback
    # is added, an exception from the forward or backward closes the session before it propagates, unchanged, and
    # one from anywhere else in the step finds none open; the model trains on.
    model = tiny_gpt2()
    callback = ssdtrain.OffloadCallback(budget=0.8, min_bytes="1K", overrides={"transformer.h.2": "host"})
    fail = _fail_once(3 if where in ("forward", "backward") else 2, where)  # the second optimizer step (2 x 2 micro)
    handle = None
    callbacks = [callback]
    if where == "forward":
        handle = model.transformer.h[1].register_forward_pre_hook(lambda *_: fail())
    elif where == "backward":
        handle = model.transformer.h[1].mlp.c_fc.weight.register_hook(fail)  # (raises inside autograd's engine)
    elif where == "optimizer step":
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        handle = register_optimizer_step_pre_hook(fail)  # (every optimizer's; removed below)
    elif where == "callback":
        callbacks = [_RaisingCallback(fail), callback]  # (called before the offload callback's on_step_end)
    trainer = _trainer(model, tmp_path / "fails", callbacks if added != "add_callback" else callbacks[:-1])
    if added == "add_callback":
        trainer.add_callback(callback)
    if where == "gradient clipping":
        clip = trainer.accelerator.clip_grad_norm_
        trainer.accelerator.clip_grad_norm_ = lambda *a, **k: (fail(), clip(*a, **k))[1]
    elif where == "scheduler step":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        trainer.optimizer, trainer.lr_scheduler = optimizer, _FailingSchedule(optimizer, fail)
    try:
        with caplog.at_level("WARNING", logger="ssdtrain"), pytest.raises(RuntimeError, match="simulated") as e:
            trainer.train()
    finally:
        if handle is not None:
            handle.remove()
    assert e.value is fail.raised[0]  # the original exception, unchanged
    assert not getattr(e.value, "__notes__", None)
    _no_session_left(model)  # (saved-tensor hooks on the thread first of all)
    assert callback.session is None and callback.last is not None and callback.last._closed
    if where in ("forward", "backward"):
        assert "RuntimeError left a training step: its session is closed" in caplog.text
    _same_as_without_ssdtrain(model)
    steps = callback.stats()["steps"]
    trainer.train()  # trains again, under the callback
    assert callback.session is None and callback.stats()["steps"] > steps
    _no_session_left(model)
    ssdtrain.release(model)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_trainer_callback_without_accumulation_checks_the_plan_by_measured_peaks(tmp_path, monkeypatch):
    """One micro-batch per optimizer step (a session each): every step's peak check outlives its session and is
    judged at the next step, so the plan is checked by measured peaks and trusted within a few steps, as under one
    session (each check was cancelled when its step's session closed, and no plan was ever checked)."""
    from ssdtrain_testutil import measured_cpu_memory
    from test_ssdtrain_budget import _peaks_only

    _peaks_only(monkeypatch)
    model = tiny_gpt2()
    callback = ssdtrain.OffloadCallback(budget=0.8, min_bytes="1K", profile_steps=1, nvme_memory=0)
    trainer = _trainer(model, tmp_path / "checked", [callback], accumulation=1, steps=6)
    with measured_cpu_memory(monkeypatch):
        trainer.train()
    plan = callback.plan
    assert plan is not None and callback.stats()["planned_steps"] == 5
    assert plan._verified, (plan.calibrations, getattr(plan, "_passes", 0))
    ssdtrain.release(model)


def test_trainer_callback_events_called_by_hand_close_a_failed_step_at_the_next():
    # The Trainer's calls, made directly (no Trainer on the stack, so no train() to wrap): a step whose forward
    # raised is closed by the next step's begin, or the next train()'s; nothing is put on the model's forward.
    model = tiny_gpt2()
    callback = ssdtrain.OffloadCallback(min_bytes="1K")  # (budget=None: the steps here are too short to plan for one)
    args, state, control = object(), transformers.TrainerState(), transformers.TrainerControl()
    callback.on_init_end(args, state, control)
    callback.on_train_begin(args, state, control, model=model)
    callback.on_step_begin(args, state, control, model=model)
    assert callback.session is not None and torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
    assert "forward" not in vars(model)
    bad = torch.full((2, 8), 500)  # ids past the vocabulary: the embedding raises
    with pytest.raises(IndexError):
        model(input_ids=bad, labels=bad)
    failed = callback.session
    ids = torch.randint(0, 128, (2, 8))
    callback.on_step_begin(args, state, control, model=model)  # the next step closes it, and opens its own
    assert failed._closed and callback.session is not failed
    loss = model(input_ids=ids, labels=ids).loss  # (a step that fails after its forward: backward never runs)
    del loss
    callback.on_train_begin(args, state, control, model=model)  # the next train() closes it
    assert callback.session is None
    _no_session_left(model, use_cache=True)
    callback.on_step_begin(args, state, control, model=model)
    model(input_ids=ids, labels=ids).loss.backward()
    callback.on_step_end(args, state, control, model=model)
    callback.on_train_end(args, state, control, model=model)
    _no_session_left(model, use_cache=True)
    ssdtrain.release(model)


# ------------------------------------------------------------------------------------------------ accelerate
def test_accelerate_loop_with_a_context_per_micro_batch():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # a Trainer in this process set it up otherwise
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision="bf16")
    rows = token_rows(8)
    results = {}
    for mode in ("plain", "ssdtrain"):
        model = tiny_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(rows, batch_size=2)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        host = {"transformer.h.2": "host"}
        losses = []
        for _epoch in range(2):
            for b in loader:
                context = ssdtrain.offload(model, 0.8, min_bytes="1K", overrides=host) if mode == "ssdtrain" else None
                with accelerator.accumulate(model), context or _null():
                    loss = model(**b).loss
                    accelerator.backward(loss)
                    opt.step()
                    opt.zero_grad()
                losses.append(loss.item())
        results[mode] = (losses, [p.detach().clone() for p in model.parameters()], context)
    (l0, w0, _), (l1, w1, last) = results["plain"], results["ssdtrain"]
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(w0, w1, strict=True))
    assert last.stats()["planned_steps"] == 1 and last.plan is not None
    assert last.stats()["bytes_offloaded"]["host"] > 0
    ssdtrain.release(accelerator.unwrap_model(model))


def _null():
    import contextlib

    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------ FSDP2
def _fsdp_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import ssdtrain.cache
    from ssdtrain.cache import _Saved

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # Every saved tensor ssdtrain stores: none may be a parameter, sharded or gathered.
        running: list[set] = []
        offenders = []
        real_pack = ssdtrain.cache.TensorCache.pack

        def pack(self, t):
            out = real_pack(self, t)
            if isinstance(out, _Saved):
                gathered = set().union(*running) if running else set()
                if isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in gathered:
                    offenders.append(tuple(t.shape))
            return out

        ssdtrain.cache.TensorCache.pack = pack
        ids = batch(seed=rank + 1)
        results = {}
        for mode in ("plain", "offload"):
            model = make_net(layers=4)
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            for block in model.blocks:  # after FSDP's own pre-hook: the gathered parameters are in place
                block.register_forward_pre_hook(
                    lambda m, a: running.append({p.untyped_storage().data_ptr() for p in m.parameters()})
                )
                block.register_forward_hook(lambda m, a, o: running.pop() and None)
            overrides = {"blocks.0": "host", "blocks.1": "recompute+host", "blocks.2": "cheap", "blocks.3": "host"}
            session = ssdtrain.offload(model, min_bytes="4K", overrides=overrides, profile_steps=1)
            with session if mode == "offload" else _null():
                for _ in range(3):
                    model.zero_grad()
                    model(ids).backward()
            results[mode] = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
            if mode == "offload":
                stats = session.stats()
                results["stats"] = {
                    "host": stats["bytes_offloaded"]["host"],
                    "params": stats["param_tensors_kept"],
                    "recomputed": stats["recomputed_modules"],
                    "container": session.container,
                    "offenders": offenders,
                }
                ssdtrain.release(model)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_two_gloo_processes(tmp_path):
    """``fully_shard`` on the blocks and the root: parameters (DTensor shards, gathered ones during forward and
    backward) are never stored as activations, the plan runs (host, recompute, cheap), gradients are
    bit-identical to FSDP2 without ssdtrain."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    mp.start_processes(
        _fsdp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert_same_grads(got["offload"], got["plain"])
        s = got["stats"]
        assert s["host"] > 0 and s["params"] > 0 and s["recomputed"] >= 2 and s["container"] == "blocks"
        assert s["offenders"] == []


# ------------------------------------------------------------------------------------------------ README
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_readme_training_stack_examples_run(tmp_path, monkeypatch):
    """The README's Trainer, accelerate and FSDP2 examples, in order, in one scope (as a reader would paste them);
    the FSDP2 one in a one-process gloo group, as torchrun would set it up."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    section = readme[readme.index("## In your training stack") : readme.index("## ssdtrain with torch.compile")]
    blocks = [b.split("```", 1)[0] for b in section.split("```python\n")[1:]]
    assert len(blocks) == 3  # Trainer, accelerate, FSDP2
    monkeypatch.chdir(tmp_path)
    scope = {}
    for code in blocks:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        if "init_process_group" in code:  # what torchrun sets (accelerate would read it too, so only now)
            for name, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1")):
                monkeypatch.setenv(name, value)
            monkeypatch.setenv("MASTER_PORT", str(29400 + os.getpid() % 500))
        exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the documented examples must run
    assert scope["offload"].stats()["steps"] == 8
