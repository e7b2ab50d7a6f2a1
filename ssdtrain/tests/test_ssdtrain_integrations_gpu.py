"""ssdtrain in the user's training stack on a CUDA GPU: a one-rank FSDP2 run (NCCL), selective recompute
bit-identical to keep, per-step contexts reusing the model's pinned pool, the Trainer callback (same losses as
without, lower activation peak, evaluation untouched). Skipped where no GPU is usable."""

import copy
import os

import pytest
import torch
from test_ssdtrain_offload_gpu import _grads, _hf, _step, deterministic  # noqa: F401 - a fixture

import ssdtrain
from ssdtrain.planning import state_of

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
pytestmark = pytest.mark.gpu


def test_selective_recompute_bit_identical_to_keep_fp32(tmp_path, deterministic):  # noqa: F811
    model, container = _hf("llama", dropout=0.0)
    ids = torch.randint(0, 1000, (4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ref = copy.deepcopy(model)
    want_loss = _step(ref, ids)
    want = _grads(ref)
    overrides = {f"{container}.0": "selective", f"{container}.1": "selective+host", f"{container}.2": "host"}
    with ssdtrain.offload(model, overrides=overrides, min_bytes="64K", verbose=False) as s:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss = _step(model, ids)
    torch.cuda.synchronize()
    assert torch.equal(loss, want_loss)
    got = _grads(model)
    for k in want:
        assert torch.equal(got[k], want[k]), f"gradient of {k} differs"
    units = s.plan.units[1:-1]
    assert all(0 < u.selective_bytes < u.saved_bytes and u.selective_s > 0 for u in units)
    ssdtrain.release(model)


def test_per_step_contexts_pin_host_memory_once(monkeypatch):
    """A context per step on a GPU: the first planned step pins the pool's chunk, later steps pin nothing."""
    from ssdtrain import hostpool

    pinned = []
    real = hostpool.huge_empty
    monkeypatch.setattr(hostpool, "huge_empty", lambda *a, **k: pinned.append(a) or real(*a, **k))
    model, container = _hf("gpt2", layers=4, hidden=512)
    ids = torch.randint(0, 1000, (8, 512), device="cuda")
    counts = []
    for _ in range(6):
        with ssdtrain.offload(model, overrides={f"{container}.0": "host"}, min_bytes="64K", verbose=False) as s:
            model.zero_grad(set_to_none=True)
            _step(model, ids)
        counts.append(len(pinned))
    assert s.stats()["bytes_offloaded"]["host"] > 0
    assert counts[-1] == counts[2] >= 1  # no new pinned chunk after the first planned step
    assert ssdtrain.release(model) and s.pool.reserved == 0


def test_fsdp2_one_rank_nccl(tmp_path):
    """``fully_shard`` on one GPU (NCCL): DTensor parameters are never offloaded, gradients equal FSDP2 alone."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        ids = torch.randint(0, 1000, (4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        results = {}
        for mode in ("plain", "offload"):
            model, container = _hf("llama", dropout=0.0)
            for block in model.model.layers:
                fully_shard(block)
            fully_shard(model)
            overrides = {f"{container}.0": "host", f"{container}.1": "recompute+host", f"{container}.2": "selective"}
            session = ssdtrain.offload(model, overrides=overrides, min_bytes="64K", verbose=False)
            with session if mode == "offload" else _null():
                for _ in range(3):
                    model.zero_grad(set_to_none=True)
                    _step(model, ids)
            results[mode] = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        torch.cuda.synchronize()
        for k, want in results["plain"].items():
            torch.testing.assert_close(results["offload"][k], want, rtol=1e-5, atol=1e-6, msg=k)
        stats = session.stats()
        assert stats["bytes_offloaded"]["host"] > 0 and stats["recomputed_modules"] == 2
        ssdtrain.release(model)
    finally:
        dist.destroy_process_group()


def _null():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_trainer_callback_same_losses_lower_peak(tmp_path):
    """A GPT-2 config under the Trainer (bf16 autocast, accumulation 2, evaluation every 2 steps): the callback at
    half of keep's peak gives the same losses (to rounding: the GPU's kernels are not bit-reproducible run to run),
    a lower activation peak than without it, and evaluation is no step of its own."""
    transformers = pytest.importorskip("transformers")
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 1000, (48, 512))]

    class PeakFrom(transformers.TrainerCallback):
        """The activation peak of optimizer steps 5-8: after ssdtrain's profiling and calibration steps (which reset
        the peak statistic themselves), the same steps in both runs."""

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 4:
                torch.cuda.synchronize()
                self.base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()

        def on_train_end(self, args, state, control, **kwargs):
            self.peak = torch.cuda.max_memory_allocated() - self.base

    def train(callbacks):
        peak = PeakFrom()
        model, _ = _hf("gpt2", layers=8, hidden=768, dropout=0.0)
        args = transformers.TrainingArguments(
            str(tmp_path / f"run{len(callbacks)}"),
            max_steps=8,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=3,
            gradient_accumulation_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            logging_steps=1,
            bf16=True,
            save_strategy="no",
            report_to=[],
            seed=3,
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=rows, eval_dataset=rows[:6], callbacks=[peak, *callbacks]
        )
        trainer.train()
        history = trainer.state.log_history
        losses = [h.get("loss", h.get("eval_loss")) for h in history if "loss" in h or "eval_loss" in h]
        return losses, peak.peak, model

    plain_losses, plain_peak, _ = train([])
    callback = ssdtrain.OffloadCallback(budget=0.5, min_bytes="64K")
    losses, peak, model = train([callback])
    assert len(losses) == len(plain_losses)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=2e-2, atol=2e-2)
    stats = callback.stats()
    assert stats["steps"] == 16 and stats["profiled_steps"] == 1 and len(state_of(model).plans) == 1
    assert stats["bytes_offloaded"]["host"] > 0 or stats["recomputed_modules"] > 0
    assert peak < plain_peak
    ssdtrain.release(model)
