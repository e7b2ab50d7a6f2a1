"""The Trainer check of ``llm.py --suite trainer``: a Hugging Face ``Trainer`` on a GPT-2 config (24 x 2048, 1.3B
parameters by default; fp32 weights, ``bf16=True`` autocast, gradient accumulation 2, evaluation every 2 optimizer
steps with another batch size), once as is and once with ``ssdtrain.OffloadCallback(budget=0.5)``, each in its own
forked process.

Reported: training and evaluation losses of both runs (the same to rounding: the GPU's kernels are not bit for bit
reproducible from run to run), the activation peak of the optimizer steps after ssdtrain's profiling and calibration
steps against the plan's prediction and budget, the median step time, and what the callback counted: every
training micro-batch a step, one profile, one plan (evaluation is no step and gets no plan).
"""

from __future__ import annotations

import argparse
import statistics
import time

import llm_report as report
import torch

GIB = float(1 << 30)
MEASURE_FROM = 3  # optimizer steps before this one profile and calibrate: the peak is measured after them


def run_job(job: dict, llm) -> dict:
    import transformers

    import ssdtrain

    a = argparse.Namespace(**job["args"])
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    row = {"model": "gpt2", "policy": job["name"], "status": "ok", "detail": ""}

    class Probe(transformers.TrainerCallback):
        """Step times (host clock after a device sync) and the activation peak from optimizer step MEASURE_FROM."""

        def __init__(self):
            self.times, self.t0, self.base = [], None, None

        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            if state.global_step == MEASURE_FROM:
                self.base = torch.cuda.memory_allocated() if cuda else 0
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            if state.global_step > MEASURE_FROM:
                self.times.append(time.perf_counter() - self.t0)

    cls, cfg = llm.model_config("gpt2", a)
    cfg.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
    gen = torch.Generator().manual_seed(1)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, a.vocab, (64, a.seq), generator=gen)]
    probe = Probe()
    callbacks = [probe]
    offload = None
    if job["name"] != "plain":
        offload = ssdtrain.OffloadCallback(budget=job["budget"], min_bytes=a.min_bytes)
        callbacks.append(offload)
    args = transformers.TrainingArguments(
        output_dir=job["out"],
        max_steps=a.trainer_steps,
        per_device_train_batch_size=a.batch,
        per_device_eval_batch_size=max(1, a.batch // 2),
        gradient_accumulation_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        logging_steps=1,
        learning_rate=1e-5,
        bf16=cuda,
        use_cpu=not cuda,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=3,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=rows, eval_dataset=rows[:8], callbacks=callbacks
    )
    try:
        trainer.train()
    except torch.cuda.OutOfMemoryError as e:
        return dict(row, status="oom", detail=str(e).split("\n")[0][:160])
    history = trainer.state.log_history
    row["losses"] = [h["loss"] for h in history if "loss" in h]
    row["eval_losses"] = [h["eval_loss"] for h in history if "eval_loss" in h]
    row["step_ms"] = round(statistics.median(probe.times) * 1e3, 1) if probe.times else ""
    if cuda and probe.base is not None:
        row["peak_gib"] = round((torch.cuda.max_memory_allocated() - probe.base) / GIB, 3)
    if offload is not None:
        stats, plan = offload.stats(), offload.plan
        row["steps_counted"] = stats["steps"]
        row["profiled_steps"] = stats["profiled_steps"]
        row["plans"] = len(ssdtrain.planning.state_of(model).plans)
        row["micro_batches"] = a.trainer_steps * 2
        if plan is not None:
            row["predicted_peak_gib"] = round(plan.prediction.peak / GIB, 3)
            row["budget_gib"] = round(plan.budget / GIB, 3) if plan.budget else ""
            row["plan"] = str(plan)
        row["detail"] = (
            f"steps counted {stats['steps']} (training micro-batches {a.trainer_steps * 2}), profiled "
            f"{stats['profiled_steps']}, plans {row['plans']}; moved to host "
            f"{stats['bytes_offloaded']['host'] / max(1, stats['steps']) / GIB:.2f} GiB per micro-batch"
        )
    return row


def main(a, llm) -> int:
    import tempfile

    start = time.perf_counter()
    args = {k: v for k, v in vars(a).items() if k not in ("csv", "png", "json", "policies")}
    results = []
    with tempfile.TemporaryDirectory() as out:
        fraction = 0.8 if a.quick else 0.5  # a tiny model's logits and gradients leave less to save
        for name, budget in (("plain", None), (f"ssdtrain@{fraction:g}", fraction)):
            job = {"fn": run_job, "llm": llm, "model": "gpt2", "policy": name, "name": name, "budget": budget}
            r = llm.run_child(dict(job, args=args, out=out), a.child_timeout)
            r["policy"] = name
            results.append(r)
            print(
                f"  {name:<14} {r['status']:<8} step {r.get('step_ms', '')} ms, peak {r.get('peak_gib', '')} GiB, "
                f"losses {[round(x, 4) for x in r.get('losses', [])]}, eval {r.get('eval_losses', [])} "
                f"[{r.get('wall_s', '')} s] {r.get('detail', '')}",
                flush=True,
            )
    lines = verdicts(results)
    print("\n" + "\n".join(lines))
    for r in results:
        if r.get("plan"):
            print(f"\n# plan of {r['policy']}:\n{r['plan']}")
        if r.get("traceback"):
            print(f"\n# {r['policy']} failed:\n{r['traceback']}")
    if a.csv:
        # The losses as Python lists (the other suites' CSVs join them).
        keys = ["policy", "status", "step_ms", "peak_gib", "predicted_peak_gib", "budget_gib", "steps_counted"]
        report.write_csv(a.csv, results, keys + ["losses", "eval_losses", "detail"])
    return report.finish(start, results)


def verdicts(results) -> list[str]:
    """Same losses (to 1%), a lower peak within the plan's budget, evaluation no step."""
    out = ["# Trainer with ssdtrain.OffloadCallback(budget=...), from this run"]
    plain = next((r for r in results if r["policy"] == "plain" and r["status"] == "ok"), None)
    ssd = next((r for r in results if r["policy"] != "plain" and r["status"] == "ok"), None)
    if plain is None or ssd is None:
        return out + ["both runs must finish: " + ", ".join(f"{r['policy']} {r['status']}" for r in results)]
    pairs = list(zip(plain["losses"] + plain["eval_losses"], ssd["losses"] + ssd["eval_losses"], strict=False))
    worst = max((abs(x - y) / max(abs(x), 1e-6) for x, y in pairs), default=float("nan"))
    same = len(plain["losses"]) == len(ssd["losses"]) and worst <= 0.01
    out.append(
        f"losses (training and evaluation): worst relative difference {worst:.2e} -> {'MET' if same else 'MISSED'}"
    )
    if plain.get("peak_gib") and ssd.get("peak_gib"):
        lower = ssd["peak_gib"] < plain["peak_gib"]
        within = not ssd.get("budget_gib") or ssd["peak_gib"] <= 1.05 * ssd["budget_gib"]
        out.append(
            f"activation peak {ssd['peak_gib']:.2f} GiB vs {plain['peak_gib']:.2f} GiB without ("
            f"{ssd['peak_gib'] / plain['peak_gib']:.2f}x), planned {ssd.get('predicted_peak_gib')} GiB under budget "
            f"{ssd.get('budget_gib')} GiB -> {'MET' if lower and within else 'MISSED'}"
        )
    if ssd.get("step_ms") and plain.get("step_ms"):
        out.append(
            f"step time {ssd['step_ms']:.0f} ms vs {plain['step_ms']:.0f} ms ({ssd['step_ms'] / plain['step_ms']:.2f}x)"
        )
    untouched = ssd.get("steps_counted") == ssd.get("micro_batches") and ssd.get("plans") == 1
    out.append(
        f"evaluation untouched: steps counted {ssd.get('steps_counted')} = training micro-batches "
        f"{ssd.get('micro_batches')}, plans {ssd.get('plans')} -> {'MET' if untouched else 'MISSED'}"
    )
    return out
