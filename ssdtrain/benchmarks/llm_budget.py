"""The budget suite of ``llm.py --suite budget``: is ssdtrain's activation budget a promise, does ``budget=None``
beat full recompute where recompute is the only thing that fits, and does the NVMe tier carry real load?

Three parts, each job in its own forked process (``llm.run_child``), in this order (a deadline cuts from the end):

1. Budget accuracy. Cells: a model family (GPT-2, a Llama-style GQA model, Qwen2; transformers configs built in
   code), eager or regional ``torch.compile``, fp32 weights under ``torch.autocast(bf16)`` or bf16 weights, gradient
   accumulation 1 or 4. Per cell: keep (its measured activation peak sets the budgets), ssdtrain at budget = 0.2,
   0.4, 0.6, 0.8 x that peak, full recompute (Hugging Face ``gradient_checkpointing_enable``, non-reentrant: the
   same thing as "full recompute" here), and in compiled cells ``activation_memory_budget`` 0.5. The full cross
   product (3 x 2 x 2 x 2 cells) does not fit one ~8 minute GPU call, so a subset is run in which every model
   meets eager and compiled, both precisions and both accumulations at least once (``CELLS``).
   Target: measured activation peak <= 1.05 x budget.
2. ``budget=None`` at full recompute's largest batch (estimated from recompute's measured peak and the device's
   memory, then run): no out-of-memory, tokens/s >= recompute's.
3. Host RAM capped (``host_memory`` small) so NVMe must carry activations: fp32, deterministic algorithms; keep,
   full recompute, ssdtrain with the planner's own choice under the cap, and ssdtrain with the first blocks forced to
   NVMe. Reported: bytes written to NVMe, first-step gradients bit-identical to keep, step times, and the
   arithmetic (NVMe bytes per step / measured disk rates against recompute's step time).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import tempfile
import time

import llm_report as report
import torch

GIB = float(1 << 30)
FRACTIONS = (0.2, 0.4, 0.6, 0.8)
# (model, compiled, weights, accumulation, budgets, batch): weights "autocast" = fp32 weights under autocast(bf16).
# Sized like real training on one 80 GB H100 (16 layers x 2048, seq 2048: activations dominate, keep's activation
# peak ~30-45 GiB), so that 0.2-0.8 of keep are budgets a plan can meet. One ~7 minute GPU call holds three cells
# (the full cross product of 3 models x eager/compiled x 2 precisions x 2 accumulations does not fit): a Llama-style
# GQA model eager with fp32 weights under autocast and accumulation 4, GPT-2 eager in bf16 (also the cell of part 2),
# and Qwen2 compiled in bf16 (cut first by a deadline).
CELLS = [
    ("llama", False, "autocast", 4, FRACTIONS, 8),
    ("gpt2", False, "bf16", 1, FRACTIONS, 8),
    ("qwen2", True, "bf16", 1, (0.3, 0.6), 12),
]


def cell_name(cell) -> str:
    model, compiled, weights, accum = cell[:4]
    return f"{model}/{'compile' if compiled else 'eager'}/{weights}/acc{accum}"


def build(llm, kind, a, device, dtype, seed=0):
    """The suite's models: ``llm.build`` with grouped-query attention (4 query heads per key/value head) for the
    Llama-style and Qwen2 models."""
    return llm.build(kind, a, device, dtype, seed=seed, kv_heads=max(1, a.heads // 4))


def cell_batch(cell, a) -> int:
    """The cell's batch (--batch, when given, for every cell)."""
    return a.batch or (cell[5] if len(cell) > 5 else 8)


# --------------------------------------------------------------------------------------------------- one job
def run_job(job: dict, llm) -> dict:
    """One policy on one cell, in this (fresh) process: a result row."""
    a = argparse.Namespace(**job["args"])
    model_kind, compiled, weights, accum = job["cell"][:4]
    policy, budget = job["policy"], job.get("budget")
    batch = job.get("batch") or cell_batch(job["cell"], a)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    row = {
        "part": job["part"],
        "cell": cell_name(job["cell"]),
        "policy": job["name"],
        "batch": batch,
        "status": "ok",
        "detail": "",
        "budget_gib": round(budget / GIB, 3) if isinstance(budget, int) else "",
    }
    if policy.startswith("compile_budget"):
        import torch._functorch.config as fconfig

        fconfig.activation_memory_budget = float(policy.rsplit("_", 1)[1])
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    model, cfg = build(llm, model_kind, a, device, dtype)
    if policy == "recompute":
        llm.checkpoint_blocks(model)
    if compiled:
        llm.compile_blocks(model, "inductor" if cuda else "aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, a.seq), device=device, generator=gen)
    amp = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if weights == "autocast" else contextlib.nullcontext
    )
    session = None
    if policy == "ssdtrain":
        import ssdtrain

        session = ssdtrain.offload(model, budget=budget, min_bytes=a.min_bytes, verbose=False)
    warmup = a.warmup
    if session is not None:  # profiling forwards, then calibrated ones, counted in micro-batches
        warmup += math.ceil(session.settling_steps / accum)
    times, losses = [], []
    base = 0
    try:
        with session if session is not None else contextlib.nullcontext():
            for i in range(warmup + a.steps):
                if i == warmup and cuda:
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                t0 = llm._mark(cuda)
                for _ in range(accum):
                    with amp():
                        loss = model(input_ids=ids, labels=ids).loss / accum
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                t1 = llm._mark(cuda)
                losses.append(loss.item() * accum)
                if i >= warmup:
                    times.append(llm._seconds(t0, t1, cuda))
    except torch.cuda.OutOfMemoryError as e:
        return dict(row, status="oom", detail=str(e).split("\n")[0][:160])
    except Exception as e:
        if type(e).__name__ == "BudgetError":
            return dict(row, status="budget", detail=str(e)[:300], minimum_gib=round(e.minimum / GIB, 3))
        raise
    step = statistics.median(times)
    row["step_ms"] = round(step * 1e3, 2)
    row["tokens_per_s"] = round(batch * a.seq * accum / step, 1)
    if cuda:
        row["peak_gib"] = round((torch.cuda.max_memory_allocated() - base) / GIB, 3)
        row["base_gib"] = round(base / GIB, 3)
        row["device_gib"] = round(torch.cuda.get_device_properties(device).total_memory / GIB, 3)
        if isinstance(budget, int):
            row["peak_over_budget"] = round(row["peak_gib"] / (budget / GIB), 3)
    if session is not None:
        plan, stats = session.plan, session.stats()
        counts = {}
        for c in plan.choices:
            counts[str(c)] = counts.get(str(c), 0) + 1
        row["plan"] = " ".join(f"{v}x{k}" for k, v in sorted(counts.items()))
        row["predicted_peak_gib"] = round(plan.prediction.peak / GIB, 3)
        row["calibrations"] = len(plan.calibrations)
        row["working_gib"] = round(plan.working_bytes / GIB, 3)
        row["nvme_gib"] = round(stats["bytes_written_to_nvme"] / GIB, 3)
        if budget is None or not isinstance(budget, int):
            row["budget_gib"] = round(plan.budget / GIB, 3) if plan.budget else ""
        row["detail"] = f"fallbacks {stats['fallbacks']}; misses {stats['misses']}; plan: {row['plan']}"
        row["plan_text"] = str(plan)
    return row


def run_nvme(job: dict, llm) -> dict:
    """Part 3 in one process: keep, recompute and ssdtrain with host RAM capped, fp32, deterministic."""
    import ssdtrain

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    a = argparse.Namespace(**job["args"])
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    # Bit-identity needs deterministic kernels: the memory-efficient and flash attention backwards are not (they
    # accumulate in a run-dependent order), so attention runs on the math backend here, and a second keep run is
    # the control that shows the model itself repeats bit for bit.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    small = argparse.Namespace(**dict(vars(a), layers=a.nvme_layers, hidden=a.nvme_hidden, seq=a.nvme_seq))
    directory = job["directory"]
    out = {"part": "nvme", "cell": f"gpt2/eager/fp32/acc1 x{a.nvme_layers}", "status": "ok", "batch": a.nvme_batch}
    results = {}

    def one(mode, budget=None):
        model, cfg = build(llm, "gpt2", small, device, torch.float32)
        if mode == "recompute":
            llm.checkpoint_blocks(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        gen = torch.Generator(device=device).manual_seed(3)
        ids = torch.randint(0, cfg.vocab_size, (a.nvme_batch, small.seq), device=device, generator=gen)
        session = contextlib.nullcontext()
        if mode.startswith("ssdtrain"):
            blocks = [n for n, _ in ssdtrain.find_blocks(model)[1]]
            overrides = {b: "nvme" for b in blocks[: len(blocks) // 2]} if mode.endswith("+nvme") else None
            session = ssdtrain.offload(
                model,
                budget=budget,
                host_memory=a.nvme_host,
                directories=[directory],
                overrides=overrides,
                min_bytes=a.min_bytes,
                verbose=False,
            )
        torch.manual_seed(5)
        compared, times, base = None, [], 0
        # The same steps in every mode (ssdtrain profiles and calibrates in the first ones): the gradients compared
        # are those of the first timed step, which runs under ssdtrain's final plan (NVMe included).
        warm = 6
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with session, sdpa_kernel(SDPBackend.MATH):
            for i in range(warm + 3):
                if i == warm and cuda:
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                torch.manual_seed(100 + i)  # the same dropout masks in every mode
                t0 = llm._mark(cuda)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                if i == warm:
                    compared = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                opt.step()
                opt.zero_grad(set_to_none=True)
                t1 = llm._mark(cuda)
                loss.item()
                if i >= warm:
                    times.append(llm._seconds(t0, t1, cuda))
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
        r = {"grads": compared, "step": statistics.median(times), "peak": peak}
        if mode.startswith("ssdtrain"):
            r["stats"], r["plan"] = session.stats(), session.plan
        return r

    for mode in ("keep", "keep (control)", "recompute", "ssdtrain@cap", "ssdtrain@cap+nvme"):
        # ssdtrain: 0.3 x keep's measured peak (CPU: of its predicted peak); the smallest budget if that is less.
        budget = int(results["keep"]["peak"] * 0.3) if mode.startswith("ssdtrain") and cuda else 0.3
        for _ in range(3):
            try:
                results[mode] = one(mode, budget if mode.startswith("ssdtrain") else None)
                break
            except ssdtrain.BudgetError as e:
                out[f"{mode}_refused"] = f"{budget if isinstance(budget, float) else round(budget / GIB, 3)}"
                budget = int(e.minimum * 1.05)
        else:
            raise RuntimeError(f"{mode}: BudgetError three times; last budget {budget} bytes")
    keep, rec = results["keep"], results["recompute"]
    control = _same_grads(keep["grads"], results["keep (control)"]["grads"])
    out["control_bit_identical"] = control[0]
    lines = [
        f"control: keep run twice, gradients bit-identical: {control[0]}"
        + ("" if control[0] else f" ({control[1]}: the model is not deterministic here, so neither can ssdtrain be)")
    ]
    for mode in ("ssdtrain@cap", "ssdtrain@cap+nvme"):
        r = results[mode]
        stats, plan = r["stats"], r["plan"]
        same, diff = _same_grads(keep["grads"], r["grads"])
        per_step = stats["bytes_written_to_nvme"] / max(1, stats["steps"])
        spec = plan.tiers["nvme"]
        disk_s = per_step / spec.write_rate + per_step / spec.read_rate if spec.write_rate else float("nan")
        # Writes overlap the forward and reads the backward at best: the step is at least the longer of the two;
        # within recompute's step time the disk can carry at most its step x the slower rate.
        bound_s = max(per_step / spec.write_rate, per_step / spec.read_rate) if spec.write_rate else float("nan")
        carry = rec["step"] * min(spec.write_rate, spec.read_rate) if spec.write_rate else float("nan")
        out[f"{mode}_nvme_gib_per_step"] = round(per_step / GIB, 3)
        out[f"{mode}_bit_identical"] = same
        out[f"{mode}_step_ms"] = round(r["step"] * 1e3, 2)
        out[f"{mode}_peak_gib"] = round(r["peak"] / GIB, 3)
        lines.append(
            f"{mode}: NVMe {per_step / GIB:.3f} GiB/step written (host pool {a.nvme_host}), disk write "
            f"{spec.write_rate / 1e9:.2f} / read {spec.read_rate / 1e9:.2f} GB/s measured -> {disk_s * 1e3:.0f} ms of "
            f"disk per step in series, {bound_s * 1e3:.0f} ms at best overlapped (writes behind forward, reads "
            f"behind backward), against recompute's step {rec['step'] * 1e3:.0f} ms (keep {keep['step'] * 1e3:.0f} "
            f"ms: within recompute's step the disk carries at most {carry / GIB:.2f} GiB); "
            f"step {r['step'] * 1e3:.0f} ms = {r['step'] / rec['step']:.2f}x recompute at "
            f"{r['peak'] / GIB:.2f} GiB (recompute {rec['peak'] / GIB:.2f}, keep {keep['peak'] / GIB:.2f}); "
            f"gradients bit-identical to keep: {same}{'' if same else f' ({diff})'}; plan {plan.as_dict()}"
        )
    out["keep_step_ms"], out["recompute_step_ms"] = round(keep["step"] * 1e3, 2), round(rec["step"] * 1e3, 2)
    out["detail"] = "\n    ".join(lines)
    out["policy"] = "nvme (host capped)"
    return out


def _same_grads(ref: dict, other: dict) -> tuple[bool, str]:
    """(bit-identical, a description of the largest difference)."""
    differ = [k for k in ref if not torch.equal(ref[k], other[k])]
    if not differ:
        return True, ""
    worst = max(differ, key=lambda k: (ref[k].float() - other[k].float()).abs().max().item())
    err = (ref[worst].float() - other[worst].float()).abs().max().item()
    return False, f"{len(differ)} of {len(ref)} tensors differ, largest |diff| {err:.3g} in {worst}"


# --------------------------------------------------------------------------------------------------- the suite
def _job(llm, part, cell, name, policy, a, **extra):
    return {"fn": run_job, "llm": llm, "part": part, "cell": cell, "name": name, "policy": policy, **extra}


def main(a, llm) -> int:
    start = time.perf_counter()
    args = {k: v for k, v in vars(a).items() if k not in ("csv", "png", "json", "policies")}
    results: list[dict] = []

    def run(job) -> dict:
        elapsed = time.perf_counter() - start
        name = f"{cell_name(job['cell']) if 'cell' in job else job['part']} {job.get('name', '')}"
        if a.deadline and elapsed > a.deadline:
            r = {"part": job["part"], "policy": job.get("name", ""), "status": "skipped", "detail": "deadline"}
        else:
            timeout = a.child_timeout if not a.hard_end else min(a.child_timeout, a.hard_end - elapsed)
            if timeout < 15:
                r = {"part": job["part"], "policy": job.get("name", ""), "status": "skipped", "detail": "hard end"}
            else:
                job = dict(job, args=args, model=name, policy=job.get("policy", job["part"]))
                r = llm.run_child(job, timeout)
                r["policy"] = job.get("name", r.get("policy"))
        r.setdefault("cell", cell_name(job["cell"]) if "cell" in job else "")
        r.setdefault("part", job["part"])
        results.append(r)
        _print(r)
        return r

    cells = CELLS[: a.cells] if a.cells else CELLS
    if a.quick:  # the smoke test: one budget per cell
        cells = [(m, c, w, acc, (0.8,), b) for m, c, w, acc, _, b in cells]
    maxbatch_cell = next((c for c in cells if c[0] == "gpt2" and not c[1]), cells[0])
    maxbatch_cell = maxbatch_cell[:4] + ((),) + maxbatch_cell[5:]
    for n, cell in enumerate(cells):
        keep = run(_job(llm, "budget", cell, "keep", "keep", a))
        keep_peak = keep.get("peak_gib") if keep.get("status") == "ok" else None
        for f in cell[4]:
            budget = int(keep_peak * f * GIB) if keep_peak else f  # CPU: no peak measured, the fraction itself
            run(_job(llm, "budget", cell, f"ssdtrain@{f:g}xkeep", "ssdtrain", a, budget=budget))
        run(_job(llm, "budget", cell, "recompute (HF checkpointing)", "recompute", a))
        if cell[1]:
            run(_job(llm, "budget", cell, "compile_budget_0.5", "compile_budget_0.5", a))
        if n == 1:  # after the two eager cells: parts 2 and 3, then the compiled cell
            _maxbatch(llm, a, run, maxbatch_cell, results)
            with tempfile.TemporaryDirectory(dir=a.nvme_dir or None) as d:
                run({"fn": run_nvme, "llm": llm, "part": "nvme", "directory": d, "name": "nvme (host capped)"})
    if len(cells) <= 1:
        _maxbatch(llm, a, run, maxbatch_cell, results)
        with tempfile.TemporaryDirectory(dir=a.nvme_dir or None) as d:
            run({"fn": run_nvme, "llm": llm, "part": "nvme", "directory": d, "name": "nvme (host capped)"})

    summary = targets(results, a)
    print("\n" + format_table(results))
    print("\n" + "\n".join(summary))
    for r in results:
        if r.get("plan_text") and (r.get("peak_over_budget") or 0) > 1.05:
            print(f"\n# plan of {r['cell']} {r['policy']} (over budget):\n{r['plan_text']}")
        if r.get("traceback"):
            print(f"\n# {r['cell']} {r['policy']} failed:\n{r['traceback']}")
    if a.csv:
        write_csv(a.csv, results)
    if a.png:
        plot(a.png, results)
    return report.finish(start, results)


def _maxbatch(llm, a, run, cell, results) -> None:
    """Part 2: recompute at the largest batch its measured peak allows, then budget=None at that batch."""
    rec = next((r for r in results if r.get("cell") == cell_name(cell) and r["policy"].startswith("recompute")), None)
    if rec is None:
        rec = run(_job(llm, "maxbatch", cell, "recompute (HF checkpointing)", "recompute", a))
    base_batch = cell_batch(cell, a)
    if rec.get("status") != "ok" or not rec.get("peak_gib"):
        batch = base_batch * 2  # CPU smoke: no memory to measure
    else:
        room = rec["device_gib"] * 0.92 - rec["base_gib"]
        batch = max(base_batch, int(base_batch * room / rec["peak_gib"]))
    for _ in range(3):
        r = run(_job(llm, "maxbatch", cell, f"recompute@batch{batch}", "recompute", a, batch=batch))
        if r.get("status") != "oom":
            break
        batch = int(batch * 0.85)
    if r.get("status") == "ok":
        run(_job(llm, "maxbatch", cell, f"ssdtrain@none,batch{batch}", "ssdtrain", a, batch=batch, budget=None))


# --------------------------------------------------------------------------------------------------- reporting
def _print(r):
    print(
        f"  {r.get('cell', ''):<28} {r.get('policy', ''):<34} {r['status']:<8} "
        f"{report.fmt(r.get('step_ms'), '{:9.1f} ms')} {report.fmt(r.get('peak_gib'), '{:7.2f} GiB')} "
        f"{report.fmt(r.get('peak_over_budget'), 'x{:.3f} budget')} [{r.get('wall_s', '')} s] "
        f"{str(r.get('detail', ''))[:200]}",
        flush=True,
    )


TABLE = [  # title, key, width, number format (None: text)
    ("cell", "cell", 28, None),
    ("policy", "policy", 34, None),
    ("status", "status", 8, None),
    ("step ms", "step_ms", 9, ".1f"),
    ("tok/s", "tokens_per_s", 9, ".0f"),
    ("peak GiB", "peak_gib", 9, ".2f"),
    ("budget", "budget_gib", 7, ".2f"),
    ("peak/budget", "peak_over_budget", 11, ".3f"),
    ("pred GiB", "predicted_peak_gib", 8, ".2f"),
]


def format_table(results) -> str:
    """Every row but the NVMe part's (the targets report that one)."""
    return report.format_table([r for r in results if r.get("part") != "nvme"], TABLE, detail_chars=80)


def targets(results, a) -> list[str]:
    out = ["# targets of the budget suite, from this run"]
    budgeted = [r for r in results if r.get("part") == "budget" and r["policy"].startswith("ssdtrain@")]
    ratios = [r for r in budgeted if r.get("peak_over_budget")]
    within = [r for r in ratios if r["peak_over_budget"] <= 1.05]
    out.append(
        f"(1) measured activation peak <= 1.05x budget: {len(within)} of {len(ratios)} runs with a measured peak"
        + (f"; worst {max(r['peak_over_budget'] for r in ratios):.3f}x" if ratios else "")
        + f" -> {'MET' if ratios and len(within) == len(ratios) else 'MISSED' if ratios else 'NOT MEASURED'}"
    )
    for r in ratios:
        if r["peak_over_budget"] > 1.05:
            out.append(f"    over: {r['cell']} {r['policy']}: {r['peak_gib']:.2f} GiB vs budget {r['budget_gib']:.2f}")
    for r in budgeted:
        if r["status"] != "ok":
            out.append(f"    {r['cell']} {r['policy']}: {r['status']} {str(r.get('detail', ''))[:160]}")
    calibrated = [r for r in budgeted if r["status"] == "budget" and "first step under the plan" in str(r["detail"])]
    out.append(
        f"(1b) budgets below every plan refused at the first plan (not by calibration): "
        f"{len([r for r in budgeted if r['status'] == 'budget']) - len(calibrated)} up front, {len(calibrated)} at "
        f"the first calibration -> {'MET' if not calibrated else 'MISSED'}"
    )
    for cell in sorted({r["cell"] for r in budgeted if r.get("minimum_gib")}):
        rec = next((x for x in results if x.get("cell") == cell and x["policy"].startswith("recompute (")), None)
        minimum = min(r["minimum_gib"] for r in budgeted if r["cell"] == cell and r.get("minimum_gib"))
        if rec and rec.get("peak_gib"):
            ok = minimum <= rec["peak_gib"] * 1.05
            out.append(
                f"(1c) {cell}: smallest budget ssdtrain accepts {minimum:.2f} GiB vs full recompute's measured peak "
                f"{rec['peak_gib']:.2f} GiB -> {'MET (at or below)' if ok else 'MISSED'}"
            )
    rec = [r for r in results if r.get("part") == "maxbatch" and r["policy"].startswith("recompute@")]
    ssd = [r for r in results if r.get("part") == "maxbatch" and r["policy"].startswith("ssdtrain@none")]
    if rec and ssd:
        r, s = [x for x in rec if x["status"] == "ok"] or rec[-1:], ssd[-1]
        r = r[-1]
        if s["status"] == "ok" and r["status"] == "ok":
            ratio = s["tokens_per_s"] / r["tokens_per_s"]
            out.append(
                f"(2) batch {r['batch']} (recompute's largest): recompute {r['tokens_per_s']:.0f} tok/s, "
                f"{r.get('peak_gib', '')} GiB; budget=None {s['tokens_per_s']:.0f} tok/s = {ratio:.2f}x, "
                f"{s.get('peak_gib', '')} GiB -> {'MET' if ratio >= 1.0 else 'MISSED'}"
            )
        else:
            out.append(f"(2) batch {r['batch']}: recompute {r['status']}, budget=None {s['status']} -> MISSED")
    for r in results:
        if r.get("part") == "nvme" and r["status"] == "ok":
            met = (
                r.get("ssdtrain@cap+nvme_nvme_gib_per_step", 0) > 0
                and r.get("ssdtrain@cap+nvme_bit_identical")
                and r.get("ssdtrain@cap_bit_identical")
            )
            out.append(f"(3) {r['detail']}\n    -> NVMe carries load, bit-identical: {'MET' if met else 'MISSED'}")
        elif r.get("part") == "nvme":
            out.append(f"(3) nvme: {r['status']} {str(r.get('detail', ''))[:300]}")
    return out


COLUMNS = [
    "part",
    "cell",
    "policy",
    "status",
    "batch",
    "step_ms",
    "tokens_per_s",
    "peak_gib",
    "budget_gib",
    "peak_over_budget",
    "predicted_peak_gib",
    "minimum_gib",
    "working_gib",
    "calibrations",
    "nvme_gib",
    "base_gib",
    "plan",
    "wall_s",
    "detail",
]


def write_csv(path, results):
    report.write_csv(path, results, COLUMNS)


def plot(path, results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    cells = sorted({r["cell"] for r in results if r.get("part") == "budget"})
    for i, cell in enumerate(cells):
        rows = [r for r in results if r.get("cell") == cell and r["status"] == "ok"]
        keep = next((r for r in rows if r["policy"] == "keep"), None)
        ssd = [r for r in rows if r["policy"].startswith("ssdtrain@") and r.get("peak_over_budget")]
        if ssd:
            fr = [float(r["policy"].split("@")[1].split("x")[0]) for r in ssd]
            ax1.plot(fr, [r["peak_over_budget"] for r in ssd], "o-", color=f"C{i % 10}", label=cell)
        if keep and keep.get("peak_gib"):
            pts = [r for r in rows if r.get("peak_gib") and r.get("step_ms")]
            ax2.scatter(
                [r["peak_gib"] / keep["peak_gib"] for r in pts],
                [r["step_ms"] / keep["step_ms"] for r in pts],
                color=f"C{i % 10}",
                label=cell,
                s=14,
            )
    ax1.axhline(1.05, color="k", ls="--", lw=0.8)
    ax1.set_xlabel("budget (fraction of keep's measured activation peak)")
    ax1.set_ylabel("measured activation peak / budget")
    ax1.set_title("ssdtrain budget accuracy (target <= 1.05)")
    if cells:
        ax1.legend(fontsize=7)
    ax1.grid(True, alpha=0.3)
    ax2.set_xlabel("activation peak (x keep)")
    ax2.set_ylabel("step time (x keep)")
    ax2.set_title("every row of the budget cells")
    ax2.grid(True, alpha=0.3)
    if not any(r.get("peak_gib") for r in results):
        ax1.set_title("no device memory measured (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
