"""The ROK suite of ``llm.py --suite rok``: step time against activation peak (the recompute-offload-keep curve)
for ssdtrain and every peer a user can pick today, in one run, on the user's setting: a Llama-style GQA model with
fp32 weights under ``torch.autocast(bf16)`` and gradient accumulation 4 (GPT-2 with ``--models llama,gpt2``).

Eager peers: keep; full recompute (Hugging Face ``gradient_checkpointing_enable``, non-reentrant: each block
checkpointed); torch's selective activation checkpointing of each block (``sac``: keep what matrix products and
attention output, recompute the rest: what torchtitan calls op-level SAC); ``torch.autograd.graph.save_on_cpu``;
torchtune 0.6.1 ``OffloadActivations`` and TRL's ``get_act_offloading_ctx_manager`` (their offloading module files,
loaded alone: see ``load_trl_offload``) around each forward. ssdtrain eager at budgets derived from those peaks in
this run (``ssdtrain@keep*0.5`` = half of keep's measured activation peak). Compiled peers (each block's forward
``torch.compile``'d): keep and ``activation_memory_budget`` 0.8 / 0.5 / 0.2. ssdtrain around them at their peaks,
two ways: ``ssdtrain+compile_budget_X@<peer>*1.0`` compiles the blocks under the looser budget X (the compiler
recomputes single ops inside each block) and leaves ssdtrain the rest (offload, and whole blocks recomputed only
where that is not enough); ``ssdtrain+compile@<peer>*1.0`` compiles them without a budget, so every byte ssdtrain
frees is a whole block's choice. Each job runs in its own forked process (``llm.run_child``), in priority order: a
deadline cuts from the end.

A step is one optimizer step: 4 micro-batches (forward under autocast, loss / 4, backward), then AdamW. Step time:
median of the timed steps (CUDA events). Activation peak: ``max_memory_allocated`` over the timed steps minus the
memory before them (gradients are set to None at each step, so they count, the same for every policy). The
optimizer's step is in it; ``optimizer_peak_gib`` is that step's own peak (AdamW's foreach step holds the gradients
and a temporary the size of the fp32 parameters), a floor that no activation plan goes below.

Targets, checked from this run (``targets``): eager ssdtrain at <= 0.5x keep's peak within 1.10x keep's time, and at
<= 1.2x full recompute's peak within 0.90x its time; and for each peer, an ssdtrain point of the same kind (eager
against eager, compiled against compiled) at <= that peer's peak that is faster.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import math
import os
import re
import statistics
import sys
import time
import types

import llm_report as report
import torch

GIB = float(1 << 30)
ACCUM = 4

# (policy, budget spec) in priority order. A spec "<policy>*f" is f times that policy's measured peak in this run.
EAGER = [
    ("keep", None),
    ("recompute", None),
    ("ssdtrain", "keep*0.5"),
    ("ssdtrain", "recompute*1.2"),
    # Every block planned `derive` (no budget): what deriving alone saves and costs, against keep.
    ("ssdtrain-derive", None),
    ("sac", None),
    ("ssdtrain", "sac*1.0"),
    ("ssdtrain", "keep*0.3"),
    ("ssdtrain", "keep*0.7"),
    ("ssdtrain", "recompute*1.0"),
    ("save_on_cpu", None),
    ("torchtune", None),
    ("trl", None),
    ("ssdtrain", "save_on_cpu*1.0"),
]
COMPILED = [
    ("compile", None),
    ("compile_budget_0.8", None),
    ("compile_budget_0.5", None),
    ("compile_budget_0.2", None),
    # At each budget point's peak, ssdtrain around blocks compiled with the next looser budget: the compiler's cheap
    # op-level recompute inside the blocks, ssdtrain's offload (hidden behind the forward) for what they still save.
    ("ssdtrain+compile_budget_0.8", "compile_budget_0.5*1.0"),
    ("ssdtrain+compile_budget_0.5", "compile_budget_0.2*1.0"),
    ("ssdtrain+compile_budget_0.9", "compile_budget_0.8*1.0"),
    ("ssdtrain+compile_budget_0.8", "compile_budget_0.2*1.0"),
    # ssdtrain around blocks compiled without a budget (whole-block choices only), at the same peaks.
    ("ssdtrain+compile", "compile_budget_0.5*1.0"),
    ("ssdtrain+compile", "compile*0.5"),
    ("ssdtrain+compile", "compile_budget_0.2*1.0"),
    ("ssdtrain+compile", "compile_budget_0.8*1.0"),
]
SLOW = ("save_on_cpu", "torchtune", "trl")
GROUPS = ("eager", "compiled")


def group_of(policy: str) -> str:
    return "compiled" if "compile" in policy else "eager"


def compile_memory_budget(policy: str) -> float | None:
    """X of a policy that compiles its blocks under ``activation_memory_budget`` X (``compile_budget_X``,
    ``ssdtrain+compile_budget_X``), else None."""
    match = re.search(r"compile_budget_([0-9.]+)$", policy)
    if "compile_budget" in policy and match is None:
        raise ValueError(f"policy {policy!r}: write the compiler's budget as compile_budget_X, X in (0, 1]")
    return float(match.group(1)) if match else None


def plan_jobs(models: list[str], groups=GROUPS, wanted=()) -> list[tuple[str, str, str | None]]:
    """(model, policy, spec): the first model's eager jobs, then its compiled ones, then the next model's; then, for
    the first model, any ``ssdtrain-derive+hostN`` policy named in ``wanted`` (an override plan: see
    :func:`derive_overrides`), which no suite runs by default."""
    jobs = []
    for model in models:
        jobs += [(model, p, s) for p, s in EAGER] if "eager" in groups else []
        jobs += [(model, p, s) for p, s in COMPILED] if "compiled" in groups else []
    jobs += [(models[0], p, None) for p in wanted if DERIVE_HOST.fullmatch(p)]
    return jobs


# `ssdtrain-derive+host<N>[first][+recompute<R>]`: every block `derive`, N of them `derive+host` (spread evenly over
# the blocks, or the first N with `first`), and R more `recompute` (the last R blocks not moved)
DERIVE_HOST = re.compile(r"ssdtrain-derive\+host(\d+)(first)?(?:\+recompute(\d+))?")


def derive_overrides(policy: str, blocks: list[str]) -> dict[str, str]:
    """The override plan of ``ssdtrain-derive`` (every block ``derive``) or ``ssdtrain-derive+hostN``: N blocks
    ``derive+host``, spread evenly from the first (each block's copies out get the forward of the blocks after it
    before the next moved block queues behind them on the link), or the first N with ``...hostNfirst`` (the most
    forward after them for their copies out before the head's drain, and the last needed in backward); with
    ``+recomputeR``, the last R blocks not moved ``recompute`` (a recomputed block frees its bytes wherever it
    sits)."""
    overrides = {name: "derive" for name in blocks}
    match = DERIVE_HOST.fullmatch(policy)
    moved = int(match.group(1)) if match else 0
    recomputed = int(match.group(3) or 0) if match else 0
    if moved + recomputed > len(blocks):
        raise ValueError(f"{policy}: the model has {len(blocks)} blocks")
    first = bool(match and match.group(2))
    for k in range(moved):
        overrides[blocks[k if first else k * len(blocks) // moved]] = "derive+host"
    rest = [name for name in blocks if overrides[name] == "derive"]
    for name in rest[len(rest) - recomputed:] if recomputed else []:
        overrides[name] = "recompute"
    return overrides


# --------------------------------------------------------------------------------------------------- peers
def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def load_trl_offload():
    """TRL's activation offloading (``trl/models/activation_offloading.py``), loaded from its own file.

    ``import trl`` pulls in datasets and more that this benchmark does not use; the module itself needs only
    psutil (a memory check), accelerate's logger and torch-version helper, and a transformers helper. Where
    accelerate or psutil is missing, small stand-ins take their place; TRL's code runs unchanged. Returns
    (``get_act_offloading_ctx_manager``, None) or (None, reason)."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return None, "trl not installed (carry its wheel: .whl/trl-*.whl)"
    path = os.path.join(list(spec.submodule_search_locations)[0], "models", "activation_offloading.py")
    if not os.path.exists(path):
        return None, f"this trl has no {path}"
    if importlib.util.find_spec("accelerate") is None:

        def is_torch_version(op, version):
            from packaging.version import Version

            return {">=": Version.__ge__, ">": Version.__gt__, "<": Version.__lt__, "<=": Version.__le__}[op](
                Version(torch.__version__.split("+")[0]), Version(version)
            )

        sys.modules.setdefault("accelerate", _stub("accelerate"))
        sys.modules.setdefault("accelerate.logging", _stub("accelerate.logging", get_logger=logging.getLogger))
        sys.modules.setdefault("accelerate.utils", _stub("accelerate.utils"))
        sys.modules.setdefault(
            "accelerate.utils.versions", _stub("accelerate.utils.versions", is_torch_version=is_torch_version)
        )
    if importlib.util.find_spec("psutil") is None:
        memory = types.SimpleNamespace(percent=0.0)
        sys.modules.setdefault("psutil", _stub("psutil", virtual_memory=lambda: memory))
    mspec = importlib.util.spec_from_file_location("trl_activation_offloading", path)
    module = importlib.util.module_from_spec(mspec)
    try:
        mspec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - reported as the row's reason, the run goes on
        return None, f"loading {path} failed: {type(e).__name__}: {e}"[:300]
    return module.get_act_offloading_ctx_manager, None


def selective_blocks(model, llm) -> None:
    """torch's selective activation checkpointing on each block, as a user would write it: keep the outputs of
    matrix products and attention, recompute the rest (the same policy ssdtrain's ``selective`` choice uses)."""
    from ssdtrain.model import selective_context

    for block in llm.blocks_of(model):
        original = block.forward

        def forward(*args, _original=original, **kwargs):
            return torch.utils.checkpoint.checkpoint(
                _original, *args, use_reentrant=False, context_fn=selective_context, **kwargs
            )

        block.forward = forward


# --------------------------------------------------------------------------------------------------- one job
def run_job(job: dict, llm) -> dict:
    """One policy on one model, in this (fresh) process: a result row."""
    import llm_budget

    a = argparse.Namespace(**job["args"])
    kind, policy, budget = job["model"], job["policy"], job.get("budget")
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    row = {
        "model": kind,
        "group": group_of(policy),
        "policy": job["name"],
        "batch": a.batch,
        "accum": a.accum,
        "status": "ok",
        "detail": "",
        "budget_gib": round(budget / GIB, 3) if isinstance(budget, int) else "",
    }
    memory_budget = compile_memory_budget(policy)
    if memory_budget is not None:  # read when each block is first compiled, in this fresh process
        import torch._functorch.config as fconfig

        fconfig.activation_memory_budget = memory_budget
    model, cfg = llm_budget.build(llm, kind, a, device, torch.float32)  # fp32 weights, autocast(bf16) below
    if policy == "recompute":
        llm.checkpoint_blocks(model)
    elif policy == "sac":
        selective_blocks(model, llm)
    if "compile" in policy:
        llm.compile_blocks(model, "inductor" if cuda else "aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator(device=device).manual_seed(1)
    micro = [torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=device, generator=gen) for _ in range(a.accum)]

    forward_ctx = contextlib.nullcontext
    session = None
    if policy == "save_on_cpu":

        def forward_ctx():
            return torch.autograd.graph.save_on_cpu(pin_memory=cuda)
    elif policy in ("torchtune", "trl"):
        if not cuda:
            return dict(row, status="unavailable", detail=f"{policy}'s activation offloading needs CUDA streams")
        if policy == "torchtune":
            cls, why = llm.load_torchtune_offload()
            ctx = cls(use_pin_memory=True, use_streams=True) if cls is not None else None
        else:
            make, why = load_trl_offload()
            ctx = make(model, use_pin_memory=True, use_streams=True) if make is not None else None
        if ctx is None:
            return dict(row, status="unavailable", detail=why)

        def forward_ctx():
            return ctx
    elif policy.startswith("ssdtrain"):
        import ssdtrain

        overrides = None
        if policy.startswith("ssdtrain-derive"):
            overrides = derive_overrides(policy, [name for name, _ in ssdtrain.find_blocks(model)[1]])
        session = ssdtrain.offload(model, budget=budget, min_bytes=a.min_bytes, overrides=overrides, verbose=False)
        if not isinstance(budget, int):
            row["budget_gib"] = ""

    slow = policy in SLOW
    warmup, timed = (a.slow_warmup, a.slow_steps) if slow else (a.warmup, a.steps)
    if session is not None:  # profiling forwards, then calibrated ones, counted in micro-batches
        warmup += math.ceil(session.settling_steps / a.accum)

    # The timed steps' peaks on the GPU, [forward and backward, the optimizer's step]: AdamW's foreach step makes a
    # temporary the size of the fp32 parameters while the gradients are held, a floor no activation plan goes below.
    peaks = [0, 0]

    def step(timed=False):
        total = 0.0
        for ids in micro:
            with forward_ctx(), torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / a.accum
            loss.backward()
            total = total + loss.detach()
        if timed and cuda:
            peaks[0] = max(peaks[0], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        opt.step()
        if timed and cuda:
            peaks[1] = max(peaks[1], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        opt.zero_grad(set_to_none=True)
        return total

    times, losses, base, before = [], [], 0, None
    try:
        with session if session is not None else contextlib.nullcontext():
            for i in range(warmup + timed):
                if i == warmup:
                    if cuda:
                        torch.cuda.synchronize()
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                    before = session.stats() if session is not None else None
                    if before is not None:  # a plan still calibrating would be timed with its checks (syncs)
                        before["plan"] = session.plan
                t0 = llm._mark(cuda)
                total = step(timed=i >= warmup)
                t1 = llm._mark(cuda)
                losses.append(float(total))
                if i >= warmup:
                    times.append(llm._seconds(t0, t1, cuda))
            if getattr(a, "profile", False):
                row["profile_text"] = profile_step(step, cuda)
            if getattr(a, "trace_dir", ""):
                name = re.sub(r"[^A-Za-z0-9.-]+", "_", f"{row['model']}-{row['group']}-{row['policy']}")
                trace_step(step, cuda, f"{a.trace_dir}/{name}.json.gz")
    except torch.cuda.OutOfMemoryError as e:
        return dict(row, status="oom", detail=str(e).split("\n")[0][:160])
    except Exception as e:
        if type(e).__name__ == "BudgetError":
            return dict(row, status="budget", detail=str(e)[:300])
        raise
    step = statistics.median(times)
    row["step_ms"] = round(step * 1e3, 2)
    row["tokens_per_s"] = round(a.batch * a.seq * a.accum / step, 1)
    row["losses"] = losses
    if cuda:
        row["peak_gib"] = round((max(peaks) - base) / GIB, 3)
        row["optimizer_peak_gib"] = round((peaks[1] - base) / GIB, 3)
        if isinstance(budget, int):
            row["peak_over_budget"] = round(row["peak_gib"] / (budget / GIB), 3)
    if session is not None:
        _ssdtrain_details(row, session, before)
    return row


def _kernel_kind(name: str) -> str:
    n = name.lower()
    if "memcpy" in n or "memset" in n:
        return "copies"
    if "gemm" in n or "cutlass" in n or "sm90_xmma" in n or "nvjet" in n:
        return "matmul"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "adam" in n or "multi_tensor" in n:
        return "optimizer"
    return "other kernels"


def profile_step(step, cuda: bool) -> str:
    """One more step under torch.profiler and cProfile: wall time, GPU kernel time by kind (the compute the step
    could not avoid, and what recompute or offload added), and the host's time in ssdtrain's own Python code (the
    hooks' overhead). A wall time well above the GPU's busy time means the host, not the GPU, set the pace."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    import ssdtrain

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof_py = cProfile.Profile()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        prof_py.enable()
        step()
        prof_py.disable()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    kinds: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kinds[_kernel_kind(e.name)] = kinds.get(_kernel_kind(e.name), 0.0) + e.device_time / 1e3
    busy = sum(v for k, v in kinds.items() if k != "copies")
    stats = pstats.Stats(prof_py)
    package = os.path.dirname(ssdtrain.__file__)
    own = {}
    for (path, _, func), (_, calls, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if path.startswith(package):
            key = f"{os.path.basename(path)}:{func}"
            c, t = own.get(key, (0, 0.0))
            own[key] = (c + calls, t + tottime)
    host = sum(t for _, t in own.values())
    top = sorted(own.items(), key=lambda kv: -kv[1][1])[:6]
    lines = [
        f"  one profiled step: wall {wall * 1e3:.1f} ms (under the profilers), GPU kernels {busy:.1f} ms "
        + "("
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
        + " ms)",
        f"  host time in ssdtrain's Python code: {host * 1e3:.1f} ms"
        + (": " + ", ".join(f"{k} {t * 1e3:.1f} ms/{c} calls" for k, (c, t) in top) if top else ""),
    ]
    return "\n".join(lines)


def trace_step(step, cuda: bool, path: str) -> None:
    """One more step under torch.profiler alone (no Python tracing, so the host runs at its own pace), written as a
    Chrome trace: the GPU's idle gaps and what the host threads did during them (launching, waiting, Python)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path)


def _ssdtrain_details(row, session, before) -> None:
    plan, stats = session.plan, session.stats()
    counts = {}
    for c in plan.choices:
        counts[str(c)] = counts.get(str(c), 0) + 1
    row["plan"] = " ".join(f"{v}x{k}" for k, v in sorted(counts.items()))
    row["predicted_peak_gib"] = round(plan.prediction.peak / GIB, 3)
    # What a block saves per micro-batch as profiled: under a compiler's memory budget, what the compiled graph
    # still saves (the bytes left for ssdtrain to move or recompute).
    row["block_saved_mib"] = round(plan.units[1].saved_bytes / 2**20, 3) if len(plan.units) > 2 else ""
    row["predicted_x_keep_time"] = round(plan.prediction.seconds / plan.keep_prediction.seconds, 3)
    row["calibrations"] = len(plan.calibrations)
    if not row["budget_gib"] and plan.budget:
        row["budget_gib"] = round(plan.budget / GIB, 3)
    d = {k: stats[k] - before[k] for k in ("prefetch_hits", "forwarded", "misses", "late_prefetches")}
    moved = {k: v - before["bytes_offloaded"][k] for k, v in stats["bytes_offloaded"].items()}
    steps = max(1, stats["steps"] - before["steps"])
    row["host_gib_per_micro_batch"] = round(moved.get("host", 0) / steps / GIB, 3)
    # The device's own wait for copies back (CUDA events) per micro-batch: late on the host alone is no stall.
    wait_ms = (stats["prefetch_wait_seconds"] - before["prefetch_wait_seconds"]) * 1e3 / steps
    late_mib = (stats["late_bytes"] + stats["missed_bytes"] - before["late_bytes"] - before["missed_bytes"]) / 2**20
    row["device_wait_ms_per_micro_batch"] = round(wait_ms, 2)
    # Host time inside ssdtrain's saved-tensor hooks per micro-batch: on a host-bound step, the device's time too.
    spent, spent_before = stats["hook_host_seconds"], before["hook_host_seconds"]
    hook_ms = {k: (spent[k] - spent_before[k]) * 1e3 / steps for k in ("pack", "unpack")}
    row["hook_host_ms_per_micro_batch"] = round(hook_ms["pack"] + hook_ms["unpack"], 2)
    row["detail"] = (
        f"timed: prefetch hits {d['prefetch_hits']}, forwarded {d['forwarded']}, misses {d['misses']}, late "
        f"{d['late_prefetches']} ({late_mib:.0f} MiB; the device waited {wait_ms:.2f} ms per micro-batch), "
        f"throttle waits {stats['throttle_waits'] - before['throttle_waits']} "
        f"({(stats['throttle_seconds'] - before['throttle_seconds']) * 1e3 / steps:.2f} ms per micro-batch); "
        f"hooks' host time {hook_ms['pack']:.2f} ms pack + {hook_ms['unpack']:.2f} ms unpack per micro-batch; "
        f"calibrated {len(plan.calibrations)}x"
        + ("" if plan is before.get("plan") else " (the plan changed during the timed steps)")
        + f"; fallbacks {stats['fallbacks']}"
    )
    row["plan_text"] = str(plan)


# --------------------------------------------------------------------------------------------------- the suite
def budget_of(spec: str, rows: dict, cuda: bool):
    """Bytes from '<policy>*f' and that policy's measured peak; on CPU (no peak) the fraction f of ssdtrain's own
    predicted keep peak (f <= 1) or no budget. -1: the reference has no measured peak."""
    ref, factor = spec.split("*")
    f = float(factor)
    if not cuda:
        return f if f <= 1 else None
    row = rows.get(ref)
    if row is None or row.get("status") != "ok" or not row.get("peak_gib"):
        return -1
    return int(row["peak_gib"] * f * GIB)


def main(a, llm) -> int:
    start = time.perf_counter()
    args = {k: v for k, v in vars(a).items() if k not in ("csv", "png", "json", "policies")}
    cuda = a.device == "cuda"
    results: list[dict] = []
    rows: dict[str, dict] = {}
    wanted = {p for p in a.policies.split(",") if p}
    groups = [g for g in a.groups.split(",") if g]
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise SystemExit(f"--groups: unknown {sorted(unknown)}: use eager, compiled or both")
    jobs = plan_jobs(a.models, groups, sorted(wanted))
    if wanted:
        llm.require_known(wanted, [p if s is None else f"{p}@{s}" for _, p, s in jobs], f"rok ({','.join(groups)})")
    for kind, policy, spec in jobs:
        name = policy if spec is None else f"{policy}@{spec}"
        if wanted and name not in wanted:
            continue
        base = {"model": kind, "group": group_of(policy), "policy": name}
        elapsed = time.perf_counter() - start
        budget = None
        if spec is not None:
            budget = budget_of(spec, {k.split("/", 1)[1]: v for k, v in rows.items() if k.startswith(kind + "/")}, cuda)
        if a.deadline and elapsed > a.deadline:
            r = dict(base, status="skipped", detail=f"deadline {a.deadline:.0f} s reached")
        elif budget == -1:
            r = dict(base, status="skipped", detail=f"no measured peak for {spec.split('*')[0]}")
        else:
            timeout = a.child_timeout if not a.hard_end else min(a.child_timeout, a.hard_end - elapsed)
            if timeout < 15:
                r = dict(base, status="skipped", detail=f"hard end {a.hard_end:.0f} s reached")
            else:
                job = {"fn": run_job, "llm": llm, "model": kind, "policy": policy, "name": name, "budget": budget}
                r = llm.run_child(dict(job, args=args), timeout)
                r.update(base)
        rows[f"{kind}/{name}"] = r
        results.append(r)
        _print(r)
    summary = targets(results, a)
    print("\n" + format_table(results))
    print("\n" + "\n".join(summary))
    llm.print_details(results)
    if a.csv:
        write_csv(a.csv, results)
    if a.png:
        plot(a.png, results, a)
    return report.finish(start, results)


# --------------------------------------------------------------------------------------------------- reporting
def _print(r):
    print(
        f"  {r['model']:<6} {r['policy']:<40} {r['status']:<11} {report.fmt(r.get('step_ms'), '{:9.1f} ms'):>12} "
        f"{report.fmt(r.get('peak_gib'), '{:7.2f} GiB'):>11}  {r.get('plan', '')} [{r.get('wall_s', '')} s] "
        f"{str(r.get('detail', ''))[:160]}",
        flush=True,
    )


def _ratios(results) -> None:
    keep = {(r["model"], r["group"]): r for r in results if r["policy"] in ("keep", "compile") and r["status"] == "ok"}
    for r in results:
        k = keep.get((r["model"], "eager"))  # every ratio against eager keep, the user's starting point
        if k and r.get("step_ms"):
            r["x_keep_time"] = round(r["step_ms"] / k["step_ms"], 3)
            if r.get("peak_gib") and k.get("peak_gib"):
                r["x_keep_peak"] = round(r["peak_gib"] / k["peak_gib"], 3)


COLUMNS = [
    "model",
    "group",
    "policy",
    "status",
    "step_ms",
    "x_keep_time",
    "peak_gib",
    "x_keep_peak",
    "budget_gib",
    "peak_over_budget",
    "optimizer_peak_gib",
    "predicted_peak_gib",
    "predicted_x_keep_time",
    "block_saved_mib",
    "tokens_per_s",
    "host_gib_per_micro_batch",
    "device_wait_ms_per_micro_batch",
    "hook_host_ms_per_micro_batch",
    "calibrations",
    "plan",
    "batch",
    "accum",
    "wall_s",
    "detail",
]


TABLE = [  # title, key, width, number format (None: text)
    ("model", "model", 6, None),
    ("group", "group", 8, None),
    ("policy", "policy", 40, None),
    ("status", "status", 11, None),
    ("step ms", "step_ms", 9, ".1f"),
    ("x keep", "x_keep_time", 7, ".2f"),
    ("peak GiB", "peak_gib", 9, ".2f"),
    ("x keep", "x_keep_peak", 7, ".2f"),
    ("budget", "budget_gib", 7, ".2f"),
]


def format_table(results) -> str:
    _ratios(results)
    return report.format_table(results, TABLE, detail_chars=70)


def write_csv(path, results) -> None:
    _ratios(results)
    report.write_csv(path, [report.with_losses(r) for r in results], COLUMNS + ["losses"])


def targets(results, a) -> list[str]:
    """The targets, met or missed with the numbers (peaks are measured on CUDA only)."""
    _ratios(results)
    out = ["# targets of the ROK suite, from this run"]
    for model in a.models:
        measured = [r for r in results if r["model"] == model and r["status"] == "ok" and r.get("peak_gib")]
        keep, rec = report.ok_row(measured, model, "keep"), report.ok_row(measured, model, "recompute")
        ssd = {g: [r for r in measured if r["policy"].startswith("ssdtrain") and r["group"] == g] for g in GROUPS}
        if not measured:
            out.append(f"{model}: no activation peak measured on {a.device}: targets not checked")
            continue
        if keep:
            best = _fastest(ssd["eager"], 0.5 * keep["peak_gib"])
            out.append(
                report.verdict(
                    f"(1) {model} eager: peak <= 0.5x keep ({0.5 * keep['peak_gib']:.2f} GiB), time <= 1.10x keep "
                    f"({1.10 * keep['step_ms']:.1f} ms)",
                    best,
                    best is not None and best["step_ms"] <= 1.10 * keep["step_ms"],
                )
            )
        if rec:
            best = _fastest(ssd["eager"], 1.2 * rec["peak_gib"])
            out.append(
                report.verdict(
                    f"(2) {model} eager: peak <= 1.2x full recompute ({1.2 * rec['peak_gib']:.2f} GiB), time <= "
                    f"0.90x recompute ({0.90 * rec['step_ms']:.1f} ms)",
                    best,
                    best is not None and best["step_ms"] <= 0.90 * rec["step_ms"],
                )
            )
        for peer in measured:
            if peer["policy"].startswith("ssdtrain") or peer["policy"] in ("keep", "compile"):
                continue
            best = _fastest(ssd[peer["group"]], peer["peak_gib"])
            out.append(
                report.verdict(
                    f"(3) {model} {peer['group']}: faster than {peer['policy']} ({peer['step_ms']:.1f} ms, "
                    f"{peer['peak_gib']:.2f} GiB) at <= its peak",
                    best,
                    best is not None and best["step_ms"] < peer["step_ms"],
                    extra=f" = {peer['step_ms'] / best['step_ms']:.2f}x faster" if best is not None else "",
                )
            )
            if peer["group"] == "compiled":
                out.append(_compiled_ways(ssd["compiled"], peer["peak_gib"]))
    return out


def _compiled_ways(rows, peak) -> str:
    """The fastest ssdtrain row at <= `peak` each way: around blocks compiled under a memory budget of their own
    (``ssdtrain+compile_budget_X``), and around blocks compiled without one (``ssdtrain+compile``)."""

    def say(r):
        return f"{r['policy']} {r['step_ms']:.1f} ms, {r['peak_gib']:.2f} GiB" if r else "no run at that memory"

    def inner(r):
        return compile_memory_budget(r["policy"].split("@", 1)[0])

    with_budget = _fastest([r for r in rows if inner(r) is not None], peak)
    without = _fastest([r for r in rows if inner(r) is None], peak)
    return f"    ssdtrain around blocks compiled with a budget: {say(with_budget)}; without one: {say(without)}"


def _fastest(rows, peak):
    fit = [r for r in rows if r["peak_gib"] <= peak]
    return min(fit, key=lambda r: r["step_ms"]) if fit else None


def plot(path, results, a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g in GROUPS if g in a.groups.split(",")]
    fig, axes = plt.subplots(len(a.models), len(groups), figsize=(7 * len(groups), 5 * len(a.models)), squeeze=False)
    for row_axes, model in zip(axes, a.models, strict=True):
        for ax, group in zip(row_axes, groups, strict=True):
            rows = [
                r
                for r in results
                if r["model"] == model and r["group"] == group and r["status"] == "ok" and r.get("step_ms")
            ]
            measured = [r for r in rows if r.get("peak_gib")]
            if not measured:
                ax.bar(range(len(rows)), [r["step_ms"] for r in rows], color="C0")
                ax.set_xticks(range(len(rows)), [r["policy"] for r in rows], rotation=60, ha="right", fontsize=7)
                ax.set_ylabel("step time (ms)")
                ax.set_title(f"{model}, {group}: no activation peak measured on {a.device}")
                continue
            ssd = sorted([r for r in measured if r["policy"].startswith("ssdtrain")], key=lambda r: r["peak_gib"])
            # Around blocks compiled under a budget of their own (X) and without one: a curve each.
            plain = "ssdtrain" if group == "eager" else "ssdtrain + compile"
            ways = [([r for r in ssd if "compile_budget" not in r["policy"].split("@", 1)[0]], plain, "o-")]
            ways.append(([r for r in ssd if r not in ways[0][0]], "ssdtrain + compile budget X", "o--"))
            for points, label, style in ways:
                if not points:
                    continue
                ax.plot([r["peak_gib"] for r in points], [r["step_ms"] for r in points], style, color="C0",
                        label=label)  # fmt: skip
                for r in points:
                    head, spec = r["policy"].split("@", 1) if "@" in r["policy"] else (r["policy"], "")
                    x = compile_memory_budget(head)
                    text = spec if x is None else f"X={x}: {spec}"
                    ax.annotate(text, (r["peak_gib"], r["step_ms"]), fontsize=7)
            peers = [r for r in measured if not r["policy"].startswith("ssdtrain")]
            for i, r in enumerate(peers):
                ax.scatter([r["peak_gib"]], [r["step_ms"]], marker="s^vD<>xP*"[i % 9], color=f"C{i % 9 + 1}",
                           label=r["policy"])  # fmt: skip
            ax.set_xlabel("activation peak (GiB)")
            ax.set_ylabel("step time (ms, 4 micro-batches + AdamW)")
            ax.set_yscale("log")
            ax.set_title(
                f"{model} {group}: {a.layers} x {a.hidden}, batch {a.batch} x {a.seq}, accumulation {a.accum}, "
                "fp32 weights + autocast bf16",
                fontsize=9,
            )
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Recompute-offload-keep: step time against activation peak (lower left is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
