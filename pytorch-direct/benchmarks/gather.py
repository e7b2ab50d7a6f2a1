"""What a user gets from ``pd.gather(table, idx)`` with default settings, against what they would use instead.

    python3 pytorch-direct/benchmarks/gather.py                  # the full matrix (needs ~50 GiB of host RAM)
    python3 pytorch-direct/benchmarks/gather.py --table-gib 1 16 --row-bytes 64 1024 --patterns uniform zipf1.2

Matrix: table sizes (--table-gib; one allocation of the largest, smaller tables are its first bytes) x row
widths (47 B rows of uint8, the others float32) x index patterns (uniform, sorted, clustered: runs of 32
consecutive rows, zipfS: Zipf with exponent S, hot rows spread over the table) x counts (capped at --max-call-mib).
Columns, in one run (useful GB/s = rows * row bytes / wall time, device synchronised around each call, best of
--repeats interleaved rounds after one warm-up each, every column once per round, each timed call right after an
untimed call of the same column: ``interleaved_best``; sync bounds checking, the default, for all of ours):

  memcpy        pinned cudaMemcpy of the same bytes (the link)
  torch         index_select on the CPU into a pinned buffer + copy to the GPU (CPU indices given)
  torch_dedupe  torch.unique on the GPU, CPU index_select of the distinct rows, copy, expand on the GPU
  naive         zero-copy, one warp per row, 4-byte loads (the PyTorch-Direct paper's kernel)
  wholegraph    WholeGraph's (pylibwholegraph) gather from a copy of the table in its own host memory, for tables
                up to --wholegraph-max-gib (each (row width, table) group copies the table); skipped, with the
                reason printed, where pylibwholegraph is not importable or cannot be set up
  wholegraph_cache  the same behind WholeGraph's device cache ("local_device", --wholegraph-cache-ratio of the
                rows; not a baseline for auto, which has no cache: compare with benchmarks/cache.py)
  vector sorted dedupe staged dedupe_staged split   ours, forced
  auto          ours, default settings, decisions forgotten first (cache file deleted: as a new process on a new
                machine); its first call (which measures the candidates on itself) is timed apart: first_ms
  auto_cal      ours after an explicit pd.calibrate(table=...) on that table and row width (time: calib_s)
  auto_pinned   ours, default settings, on the baselines' pinned table (what unified(t) of one's own memory gets)

Ours read the table a user gets from pd.empty (default settings: managed memory for tables of 256 MiB and more).
The baselines read a second copy in pinned memory (cudaHostAlloc; --baseline-memory pinned, the default): the
memory plain zero-copy uses, and as fast as ordinary memory for torch's CPU index_select. It needs host RAM for
two tables; with too little, or --baseline-memory same, the baselines read our table (said in the header).

Per cell, the link's ceiling for a gather without a cache (pinned memcpy x count / distinct rows: each distinct
row crosses the link once) and the share of it auto and the best baseline reach: where the best baseline is above
half the ceiling, 2x over it is physically impossible, and the report says so.

Prints a table and the targets (auto >= 0.95x the best forced strategy in every cell; auto >= 2x the best of
torch, torch_dedupe, naive and wholegraph as a geometric mean, >= 1.0x in every cell; rows >= 1 KB at >= 0.9x memcpy),
writes CSV
and PNG. --fresh-check N re-measures N cells in a new process, to show that clearing the decisions equals one.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import zlib

import torch

import pytorch_direct as pd
from pytorch_direct import _auto, _features, _memory

BASELINES = ("torch", "torch_dedupe", "naive", "wholegraph")
FORCED = ("vector", "sorted", "dedupe", "staged", "dedupe_staged", "split")
COLUMNS = ("memcpy",) + BASELINES + ("wholegraph_cache",) + FORCED + ("auto", "auto_cal", "auto_pinned")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table-gib", type=float, nargs="+", default=[1, 16, 48],
                   help='table sizes in GiB (one allocation; smaller tables are its first bytes)')
    p.add_argument("--row-bytes", type=int, nargs="+", default=[47, 64, 128, 256, 400, 1024, 4096],
                   help='row widths in bytes')
    p.add_argument("--patterns", nargs="+", default=["uniform", "sorted", "clustered", "zipf0.8", "zipf1.2"],
                   help='index patterns: uniform, sorted, clustered, zipfS (Zipf exponent S)')
    p.add_argument("--counts", type=int, nargs="+", default=[1 << 17, 1 << 20], help='rows gathered per call')
    p.add_argument("--max-call-mib", type=int, default=1024, help="cap on one call's bytes (fewer rows if wider)")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds (each column once per round) after one warm-up")
    p.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=COLUMNS,
                   help='which strategies and baselines to time')
    p.add_argument("--baseline-memory", choices=["pinned", "same"], default="pinned",
                   help="the table the baselines read: a pinned copy (default) or our own table")
    p.add_argument("--wholegraph-max-gib", type=float, default=16,
                   help="largest table WholeGraph gets a copy of (memory and time: one copy per group)")
    p.add_argument("--wholegraph-cache-ratio", type=float, default=0.2,
                   help="fraction of rows WholeGraph's device cache holds (wholegraph_cache column)")
    p.add_argument("--fresh-check", type=int, default=3, help="cells re-measured in a new process (smallest table)")
    p.add_argument("--budget-s", type=float, default=0, help="start no new (row width, table) group after this")
    p.add_argument("--csv", default=None, help='also write every cell to this CSV file')
    p.add_argument("--png", default=None, help='also plot auto against the best baseline to this PNG file')
    p.add_argument("--fresh-child", default=None, help=argparse.SUPPRESS)  # JSON list of cells, internal
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------- indices


def indices(pattern: str, count: int, rows: int, seed: int, device: str = "cuda") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    if pattern.startswith("zipf"):
        return _features.synthetic_indices("zipf", count, rows, g, zipf_s=float(pattern[4:]))
    return _features.synthetic_indices(pattern, count, rows, g, cluster=32)


def cell_seed(table_gib: float, row_bytes: int, pattern: str, count: int) -> int:
    """The same in every process (a new process re-creates a cell's indices in --fresh-check)."""
    return zlib.crc32(f"{table_gib:g}/{row_bytes}/{pattern}/{count}".encode())


def count_for(count: int, row_bytes: int, rows: int, max_call_mib: int) -> int:
    return max(1, min(count, rows, (max_call_mib << 20) // row_bytes))


def view_rows(flat: torch.Tensor, table_bytes: int, row_bytes: int) -> torch.Tensor:
    """The first table_bytes of `flat` as a table of row_bytes rows: uint8 rows for odd widths, float32 otherwise."""
    rows = table_bytes // row_bytes
    dtype = torch.float32 if row_bytes % 4 == 0 else torch.uint8
    width = row_bytes // (4 if dtype == torch.float32 else 1)
    return flat[: rows * row_bytes].view(dtype).view(rows, width)


def available_bytes() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    return 0


def mark(flat: torch.Tensor) -> None:
    """Non-zero bytes every MiB, so that check_same compares something (pinned pages start zeroed)."""
    ticks = flat[:: 1 << 20]
    ticks.copy_((torch.arange(ticks.numel()) % 251 + 1).to(torch.uint8))


# ---------------------------------------------------------------------------------------------------- timing


def sync_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def best_of(fn, repeats: int) -> float:
    """Best of `repeats` timed calls after one warm-up; more (up to 8) while they add up to < 20 ms: short calls
    vary more from call to call, and timing them is cheap."""
    sync_time(fn)
    times = [sync_time(fn) for _ in range(max(1, repeats))]
    while len(times) < 8 and sum(times) < 0.02:
        times.append(sync_time(fn))
    return min(times)


def first_auto_calls(fn) -> tuple[float, str, str]:
    """(first call seconds, where its plan came from, what it measured) of `fn`, an ``auto`` gather of a kind not
    seen in this process, then CHECK_CALLS + 1 more calls back to back (a gather loop): a host plan is watched on
    those (``_auto.CHECK_CALLS``), and watched while other columns run between its calls, it would take them for a
    busy caller. The measured rates ("vector=12.3 sorted=40.1 ...", GB/s) tell a wrong choice made on noisy
    measurements from one made on faithful ones."""
    before = set(_auto.measured_cells())
    first = sync_time(fn)
    decision = _auto.last_decision()
    new = [m for k, m in _auto.measured_cells().items() if k not in before]  # the cell this call measured
    measured = " ".join(f"{s}={v:.2f}" for s, v in new[0].gbps.items()) if len(new) == 1 else ""
    for _ in range(_auto.CHECK_CALLS + 1):
        sync_time(fn)
    source = decision.source if decision is not None else "?"
    return first, source, measured


def interleaved_best(fns: dict, repeats: int, label: str) -> dict:
    """Best seconds of each column, timed in rounds that run every column once (alternate rounds in reverse order)
    after one warm-up call each: every column sees the same GPU clocks and the same other work on the host, where
    timed one column after the other, the same plan timed 0.81-0.93x apart as ``auto`` and as its forced column.
    Within a round each timed call comes right after an untimed call of the same column (its lead-in), so every
    column is timed as in a loop of its own calls, with what its previous call left in the GPU's L2 cache and
    address translations. Timed right after whatever column came before it, a column that followed one reading the
    same rows of the same table (``sorted`` after ``vector``) found them in L2, while ``auto``, after
    ``wholegraph_cache`` or ``auto_pinned`` (other memory), never did: on an H100, ``auto`` ran the very plan of the
    best forced column at 0.79-0.92x that column in 8 cells of 24, 7 of them cells whose distinct rows fit in L2.
    At least `repeats` rounds, more (up to 8) while a round takes < 50 ms. A failing column is reported and left
    out (NaN)."""
    best = {}
    live = dict(fns)

    def call(name, timed: bool):
        try:
            if not timed:
                live[name]()
                return
            t = sync_time(live[name])
        except Exception as e:  # noqa: BLE001 - a failing column is reported, the run goes on
            print(f"# {label} {name}: {type(e).__name__}: {e}", flush=True)
            if isinstance(e, pd.CudaError) or "CUDA error" in str(e):
                raise  # the context is probably lost: every later call would fail too
            del live[name]
            best[name] = float("nan")
            return
        best[name] = min(best.get(name, math.inf), t)

    for name in list(live):
        call(name, timed=False)  # warm-up
    rounds, round_s = 0, 0.0
    while live and (rounds < max(1, repeats) or (rounds < 8 and round_s < 0.05)):
        t0 = time.perf_counter()
        for name in (list(live) if rounds % 2 == 0 else list(live)[::-1]):
            call(name, timed=False)  # lead-in
            if name in live:
                call(name, timed=True)
        round_s = time.perf_counter() - t0
        rounds += 1
    return best


def cell_columns(tab, utab, idx, idx_cpu, pin, dev, args, results_row, wholegraph=None):
    """Times every column of one cell into results_row (GB/s). ``auto`` first makes its decision from a clean slate
    (its first call timed apart); then every column's steady calls are timed in interleaved rounds. `tab`: the
    baselines' table (plain), `utab`: ours (unified), same rows."""
    n, rb = idx.numel(), results_row["row_bytes"]
    nbytes = n * rb
    out_pin = pin[:nbytes].view(tab.dtype).view((n,) + tuple(tab.shape[1:]))
    flat_pin, flat_dev = pin[:nbytes], dev[:nbytes]

    def torch_gather():
        torch.index_select(tab, 0, idx_cpu, out=out_pin)
        return out_pin.to("cuda", non_blocking=True)

    def torch_dedupe():
        unique, inverse = torch.unique(idx, return_inverse=True)
        u = unique.cpu()
        staged = out_pin[: u.numel()]
        torch.index_select(tab, 0, u, out=staged)
        return staged.to("cuda", non_blocking=True)[inverse]

    fns = {"memcpy": lambda: flat_dev.copy_(flat_pin, non_blocking=True), "torch": torch_gather,
           "torch_dedupe": torch_dedupe}
    base_u = tab.as_subclass(pd.UnifiedTensor)
    fns["naive"] = lambda: pd.gather(base_u, idx, strategy="naive")
    for s in FORCED:
        fns[s] = lambda s=s: pd.gather(utab, idx, strategy=s)
    if wholegraph is not None and wholegraph.tensor is not None:
        fns["wholegraph"] = lambda: wholegraph.gather(idx)
        if wholegraph.embedding is not None:
            fns["wholegraph_cache"] = lambda: wholegraph.gather_cached(idx)
    plans = {}

    def auto_on(table, col):
        def fn():
            out = pd.gather(table, idx)
            plans[col] = _auto.last_decision()
            return out
        return fn

    _auto.reset(delete_file=True)  # decisions forgotten: a new process on a new machine
    if "auto" in args.columns:
        fns["auto"] = auto_on(utab, "auto")
        first, source, measured = first_auto_calls(fns["auto"])
        results_row.update(first_ms=first * 1e3, source=source, auto_measured=measured)
    if "auto_pinned" in args.columns and tab.data_ptr() != utab.data_ptr():
        fns["auto_pinned"] = auto_on(base_u, "auto_pinned")  # (another memory kind: a cell of its own)
        first_auto_calls(fns["auto_pinned"])
    for col in list(fns):
        if col not in args.columns:
            del fns[col]
        elif col.startswith("wholegraph"):
            try:
                k = min(idx.numel(), 4096)
                got = fns[col]()[:k].cpu().view(torch.uint8)
                if not torch.equal(got.reshape(k, -1), tab[idx_cpu[:k]].view(torch.uint8).reshape(k, -1)):
                    raise AssertionError(f"{col} gathered wrong rows")
            except Exception as e:  # noqa: BLE001 - a failing column is reported, the run goes on
                results_row[col] = float("nan")
                print(f"# {results_row['label']} {col}: {type(e).__name__}: {e}", flush=True)
                del fns[col]
    seconds = interleaved_best(fns, args.repeats, results_row["label"])
    for col, t in seconds.items():
        results_row[col] = nbytes / t / 1e9 if t == t else float("nan")
    if "auto" in seconds:
        results_row["steady_ms"] = seconds["auto"] * 1e3
    for col, key in (("auto", "choice"), ("auto_pinned", "choice_pinned")):
        decision = plans.get(col)
        if col in fns:
            results_row[key] = decision.plan.strategy if decision is not None and decision.plan is not None else "?"
    # The link's ceiling for a gather without a cache: each distinct row crosses it once, at pinned memcpy's rate.
    distinct = torch.unique(idx).numel()
    results_row["distinct"] = distinct
    if results_row.get("memcpy", 0) > 0:
        results_row["ceiling"] = results_row["memcpy"] * n / distinct


def check_same(utab, tab, idx, idx_cpu) -> None:
    """auto's rows are the rows: compared with torch on a slice of the cell's indices."""
    k = min(idx.numel(), 4096)
    got = pd.gather(utab, idx[:k]).cpu()
    if not torch.equal(got.view(torch.uint8), tab[idx_cpu[:k]].view(torch.uint8)):
        raise AssertionError("auto gathered wrong rows")


# ---------------------------------------------------------------------------------------------------- the run


def run(args, results: list[dict]) -> None:
    if not torch.cuda.is_available() or not pd.cuda_usable():
        raise SystemExit("gather.py needs a CUDA GPU and pytorch_direct built with CUDA")
    start = time.perf_counter()
    sizes = sorted(args.table_gib)
    biggest = int(max(sizes) * (1 << 30))
    print(f"# device: {torch.cuda.get_device_name()} | tables {sizes} GiB (one allocation) | "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()} | cache {_auto.cache_path()}",
          flush=True)
    t0 = time.perf_counter()
    flat = pd.empty(biggest, dtype=torch.uint8).plain()  # resident (and zeroed) already
    mark(flat)
    kind = _memory.host_kind(flat)
    print(f"# ours: pd.empty of {biggest / (1 << 30):.0f} GiB ({kind}) in {time.perf_counter() - t0:.1f} s",
          flush=True)
    base_flat = flat
    if args.baseline_memory == "pinned" and kind != "pinned":
        if available_bytes() < biggest + (8 << 30):
            print(f"# baselines read our table: {available_bytes() / (1 << 30):.0f} GiB of RAM available, too "
                  "little for a pinned copy", flush=True)
        else:
            t0 = time.perf_counter()
            base_flat = pd.empty(biggest, dtype=torch.uint8, memory="pinned").plain()
            mark(base_flat)
            print(f"# baselines: a pinned copy (cudaHostAlloc) made in {time.perf_counter() - t0:.1f} s", flush=True)
    max_call = max(c * rb for c in args.counts for rb in args.row_bytes)
    max_call = min(max_call, args.max_call_mib << 20)
    pin = pd.empty(max_call, dtype=torch.uint8, memory="pinned").plain()  # the link: cudaMemcpy from pinned
    dev = torch.empty(max_call, dtype=torch.uint8, device="cuda")
    one = min(max_call, biggest)  # whole-tensor copies: ours (.cuda() of a unified tensor), torch's, the link
    src, dst = flat[:one], dev[:one]
    copies = {"ours .cuda()": lambda: src.as_subclass(pd.UnifiedTensor).cuda(),
              "torch copy_ of the same memory": lambda: dst.copy_(src),
              "pinned memcpy": lambda: dst.copy_(pin[:one], non_blocking=True)}
    print(f"# copy of {one >> 20} MiB of our table to the GPU, GB/s: "
          + ", ".join(f"{k} {one / best_of(f, 2) / 1e9:.1f}" for k, f in copies.items()), flush=True)
    wholegraph = None
    if {"wholegraph", "wholegraph_cache"} & set(args.columns):
        from _wholegraph import WholeGraph

        wholegraph = WholeGraph(args.wholegraph_cache_ratio)
        print(f"# wholegraph: {wholegraph.reason or 'pylibwholegraph ready'}"
              + ("; its columns are skipped" if wholegraph.reason else ""), flush=True)
    groups = [(rb, gib) for rb in args.row_bytes for gib in sizes]
    for g, (rb, gib) in enumerate(groups):
        if args.budget_s and time.perf_counter() - start > args.budget_s:
            print(f"# budget of {args.budget_s:.0f} s reached: {len(groups) - g} (row width, table) groups skipped",
                  flush=True)
            break
        tab = view_rows(base_flat, int(gib * (1 << 30)), rb)
        utab = view_rows(flat, int(gib * (1 << 30)), rb).as_subclass(pd.UnifiedTensor)
        rows = tab.shape[0]
        group = []
        if wholegraph is not None:
            wholegraph.drop()
            if wholegraph.reason is None and gib <= args.wholegraph_max_gib:
                t0 = time.perf_counter()
                wholegraph.load(tab)
                print(f"# wholegraph: {gib:g} GiB of {rb} B rows copied into its tables in "
                      f"{time.perf_counter() - t0:.1f} s" + (f" ({wholegraph.reason})" if wholegraph.reason else ""),
                      flush=True)
        for pattern in args.patterns:
            for count in sorted({count_for(c, rb, rows, args.max_call_mib) for c in args.counts}):
                idx = indices(pattern, count, rows, cell_seed(gib, rb, pattern, count))
                idx_cpu = idx.cpu()
                row = {"table_gib": gib, "row_bytes": rb, "pattern": pattern, "count": count,
                       "mbytes": count * rb / 1e6, "label": f"{gib:g}GiB {rb}B {pattern} {count}"}
                cell_columns(tab, utab, idx, idx_cpu, pin, dev, args, row, wholegraph)
                check_same(utab, tab, idx, idx_cpu)
                group.append((row, idx))
                results.append(row)
        if "auto_cal" in args.columns:
            _auto.reset(delete_file=True)
            calib = sync_time(lambda utab=utab: pd.calibrate(table=utab))
            for row, idx in group:
                # As a new process with this calibration on disk: no index features or decisions carried over from
                # the group's other cells (a kind re-samples its features only every RECHECK_EVERY calls: without
                # this reset the auto_cal column ran other patterns' decisions).
                _auto.reset()
                row["calib_s"] = calib
                seconds = best_of(lambda utab=utab, idx=idx: pd.gather(utab, idx), args.repeats)
                row["auto_cal"] = row["count"] * rb / seconds / 1e9
                decision = _auto.last_decision()
                row["choice_cal"] = decision.plan.strategy if decision and decision.plan else "?"
        for row, _ in group:
            print_row(row, time.perf_counter() - start)
        del group
    if args.fresh_check and results:
        fresh_check(args, results)


def fresh_check(args, results) -> None:
    """Re-measures a few cells of the smallest table in a new process with an empty cache directory: the same plan
    and speed as with the decisions forgotten in this process."""
    smallest = [r for r in results if r["table_gib"] == min(x["table_gib"] for x in results)]
    chosen = smallest[:: max(1, len(smallest) // args.fresh_check)][: args.fresh_check]
    spec = [{k: r[k] for k in ("table_gib", "row_bytes", "pattern", "count")} for r in chosen]
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PYTORCH_DIRECT_CACHE_DIR=cache)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--fresh-child", json.dumps(spec),
                            "--repeats", str(args.repeats)], capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0:
        print(f"# fresh-process check failed: {r.stderr[-1500:]}", flush=True)
        return
    fresh = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"# fresh-process check ({time.perf_counter() - t0:.1f} s incl. start): cell | this process: plan, "
          "first ms, GB/s | new process: plan, first ms, GB/s", flush=True)
    for mine, theirs in zip(chosen, fresh, strict=True):
        mine["fresh_choice"], mine["fresh_auto"], mine["fresh_first_ms"] = theirs["choice"], theirs["auto"], \
            theirs["first_ms"]
        print(f"#   {mine['label']:32} | {mine.get('choice')}, {mine.get('first_ms', 0):.1f}, {mine.get('auto', 0):.2f}"
              f" | {theirs['choice']}, {theirs['first_ms']:.1f}, {theirs['auto']:.2f}", flush=True)


def fresh_child(args) -> None:
    spec = json.loads(args.fresh_child)
    out = []
    flat = pd.empty(int(max(s["table_gib"] for s in spec) * (1 << 30)), dtype=torch.uint8).plain()
    mark(flat)
    for s in spec:
        tab = view_rows(flat, int(s["table_gib"] * (1 << 30)), s["row_bytes"])
        utab = tab.as_subclass(pd.UnifiedTensor)
        idx = indices(s["pattern"], s["count"], tab.shape[0], cell_seed(s["table_gib"], s["row_bytes"],
                                                                           s["pattern"], s["count"]))
        first = sync_time(lambda utab=utab, idx=idx: pd.gather(utab, idx))  # nothing measured in this process yet
        steady = best_of(lambda utab=utab, idx=idx: pd.gather(utab, idx), args.repeats)
        decision = _auto.last_decision()
        out.append({"choice": decision.plan.strategy if decision and decision.plan else "?",
                    "auto": s["count"] * s["row_bytes"] / steady / 1e9, "first_ms": first * 1e3})
    print(json.dumps(out))


# ---------------------------------------------------------------------------------------------------- report


def ratios(row: dict) -> dict:
    """auto (and auto_cal) against the best forced strategy, the best baseline and the link."""
    def best(cols):
        vals = [row[c] for c in cols if c in row and not math.isnan(row[c])]
        return max(vals) if vals else float("nan")

    forced, base = best(FORCED), best(BASELINES)
    ceiling = row.get("ceiling", float("nan"))
    out = {"best_forced": forced, "best_baseline": base, "ceiling": ceiling,
           "base_x_ceiling": base / ceiling if ceiling else float("nan"),
           "auto_x_ceiling": row.get("auto", float("nan")) / ceiling if ceiling else float("nan")}
    for col in ("auto", "auto_cal", "auto_pinned"):
        v = row.get(col, float("nan"))
        out[f"{col}_x_forced"] = v / forced if forced else float("nan")
        out[f"{col}_x_base"] = v / base if base else float("nan")
        out[f"{col}_x_link"] = v / row["memcpy"] if row.get("memcpy") else float("nan")
    return out


def print_row(row: dict, elapsed: float) -> None:
    r = ratios(row)
    nan = float("nan")
    print(f"[{elapsed:5.0f} s] {row['label']:32} auto {row.get('auto', nan):6.2f} GB/s "
          f"({row.get('choice', '?')}, {row.get('source', '?')}, first {row.get('first_ms', nan):.0f} ms) "
          f"x forced {r['auto_x_forced']:.2f} x base {r['auto_x_base']:.2f} | ceiling {r['ceiling']:.1f} GB/s: "
          f"auto {r['auto_x_ceiling']:.2f}, best baseline {r['base_x_ceiling']:.2f} of it | cal "
          f"{row.get('auto_cal', nan):.2f} ({row.get('choice_cal', '?')})", flush=True)


def geomean(values):
    values = [v for v in values if v > 0 and not math.isnan(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def print_table(results: list[dict]) -> None:
    if not results:
        return
    cols = [c for c in COLUMNS if any(c in r for r in results)]
    print("\n## gather, useful GB/s (default settings; x forced = auto / best forced, x base = auto / best of torch, "
          "torch_dedupe, naive, wholegraph; first = auto's first call)")
    print(f"{'table':>5} {'row':>5} {'pattern':9} {'count':>8} " + " ".join(f"{c[:9]:>9}" for c in cols)
          + f" {'choice':>13} {'first ms':>8} {'x forced':>8} {'x base':>6} {'x link':>6} {'cal x f':>7}"
          + f" {'ceiling':>8} {'auto/c':>6} {'base/c':>6}")
    for row in results:
        r = ratios(row)
        print(f"{row['table_gib']:5g} {row['row_bytes']:5d} {row['pattern']:9} {row['count']:8d} "
              + " ".join(f"{row.get(c, float('nan')):9.2f}" for c in cols)
              + f" {row.get('choice', '?'):>13} {row.get('first_ms', float('nan')):8.1f} {r['auto_x_forced']:8.2f}"
              f" {r['auto_x_base']:6.2f} {r['auto_x_link']:6.2f} {r['auto_cal_x_forced']:7.2f}"
              f" {r['ceiling']:8.1f} {r['auto_x_ceiling']:6.2f} {r['base_x_ceiling']:6.2f}")
    summary(results)


def summary(results: list[dict]) -> None:
    rs = [(row, ratios(row)) for row in results]
    for col in ("auto", "auto_cal", "auto_pinned"):
        got = [(row, r) for row, r in rs if not math.isnan(row.get(col, float("nan")))]
        if not got:
            continue
        n = len(got)
        forced_ok = sum(1 for _, r in got if r[f"{col}_x_forced"] >= 0.95)
        base = [r[f"{col}_x_base"] for _, r in got]
        base_ok = sum(1 for v in base if v >= 1.0)
        big = [(row, r) for row, r in got if row["row_bytes"] >= 1024]
        link_ok = sum(1 for _, r in big if r[f"{col}_x_link"] >= 0.9)
        print(f"# {col}: >= 0.95x best forced in {forced_ok}/{n} cells; x best baseline: geomean {geomean(base):.2f}, "
              f"min {min(base):.2f}, >= 1.0x in {base_ok}/{n}; rows >= 1 KB at >= 0.9x memcpy in {link_ok}/{len(big)}")
        choice = {"auto": "choice", "auto_cal": "choice_cal"}.get(col)
        below = [(row, r) for row, r in got if r[f"{col}_x_forced"] < 0.95]
        if choice and below:
            # A cell below 0.95x ran either the best forced column's own plan (the two timings differ) or another
            # plan (the decision missed): told apart, with the cells.
            same, other = [], []
            for row, r in below:
                best = max((c for c in FORCED if not math.isnan(row.get(c, float("nan")))), key=row.get)
                if row.get(choice) == best:
                    same.append(f"{row['label']} {r[f'{col}_x_forced']:.2f}")
                else:
                    other.append(f"{row['label']} {row.get(choice)} instead of {best} {r[f'{col}_x_forced']:.2f}")
            print(f"#   {col} below 0.95x: {len(same)} cells ran the best forced column's plan"
                  + "".join(f"; {c}" for c in same) + f" | {len(other)} ran another plan (a decision miss)"
                  + "".join(f"; {c}" for c in other))
    report_ceiling(rs)
    firsts = [row["first_ms"] - row["steady_ms"] for row in results if "first_ms" in row and "steady_ms" in row]
    if firsts:
        firsts.sort()
        print(f"# auto first-call overhead (first call - steady call, decisions forgotten before each cell): median "
              f"{firsts[len(firsts) // 2]:.0f} ms, max {firsts[-1]:.0f} ms over {len(firsts)} cells")
    cal = sorted({(row["table_gib"], row["row_bytes"], row["calib_s"]) for row in results if "calib_s" in row})
    if cal:
        print("# calibrate(table=...) seconds per (table GiB, row bytes): "
              + ", ".join(f"{g:g}/{rb}: {s:.1f}" for g, rb, s in cal))


def report_ceiling(rs: list) -> None:
    """The physical limit per cell: without a cache each distinct row crosses the link once, so no gather beats
    pinned memcpy's rate x count / distinct rows. Where the best baseline reaches more than half of that, 2x over it
    is impossible: the report says so, with the share of the ceiling auto and the best baseline reach."""
    got = [(row, r) for row, r in rs if not math.isnan(r["ceiling"]) and not math.isnan(row.get("auto", float("nan")))
           and not math.isnan(r["best_baseline"])]
    if not got:
        return
    capped = [(row, r) for row, r in got if 2 * r["best_baseline"] > r["ceiling"]]
    auto_share = geomean([r["auto_x_ceiling"] for _, r in got])
    print(f"# ceiling (pinned memcpy x count / distinct rows): 2x the best baseline exceeds it in {len(capped)}/"
          f"{len(got)} cells; share of the ceiling reached, geomean: auto {auto_share:.2f}"
          f", best baseline {geomean([r['base_x_ceiling'] for _, r in got]):.2f}"
          + (f"; in those {len(capped)} cells: auto {geomean([r['auto_x_ceiling'] for _, r in capped]):.2f}, "
             f"best baseline {geomean([r['base_x_ceiling'] for _, r in capped]):.2f}, auto x best baseline "
             f"{geomean([r['auto_x_base'] for _, r in capped]):.2f} (2x needs a baseline below half the ceiling)"
             if capped else ""))


def write_csv(results: list[dict], path: str) -> None:
    keys = ["table_gib", "row_bytes", "pattern", "count", "mbytes", *COLUMNS, "choice", "source", "first_ms",
            "steady_ms", "auto_measured", "choice_cal", "choice_pinned", "calib_s", "fresh_choice", "fresh_auto",
            "fresh_first_ms", "best_forced", "best_baseline", "distinct", "ceiling", "auto_x_ceiling",
            "base_x_ceiling"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for row in results:
            w.writerow({**row, **ratios(row)})


def write_png(results: list[dict], path: str) -> None:
    """One panel per (table size, pattern) at the largest count: GB/s against row width for auto, the best forced
    strategy, the best baseline and the link."""
    panels = []
    for gib in sorted({r["table_gib"] for r in results}):
        for pattern in dict.fromkeys(r["pattern"] for r in results):
            rs = [r for r in results if r["table_gib"] == gib and r["pattern"] == pattern]
            if not rs:
                continue
            largest = {}
            for r in rs:  # per row width, the cell with the most rows
                if r["count"] >= largest.get(r["row_bytes"], {"count": -1})["count"]:
                    largest[r["row_bytes"]] = r
            rs = [largest[rb] for rb in sorted(largest)]
            lines = {"auto": [r.get("auto", float("nan")) for r in rs],
                     "best forced": [ratios(r)["best_forced"] for r in rs],
                     "best baseline": [ratios(r)["best_baseline"] for r in rs],
                     "memcpy": [r.get("memcpy", float("nan")) for r in rs]}
            panels.append((f"{gib:g} GiB {pattern}", [r["row_bytes"] for r in rs], lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from _png import line_grid_png

        line_grid_png(panels, path)
        print(f"# matplotlib missing: wrote an unlabelled plot to {path}")
        return
    cols = min(5, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, (title, xs, lines) in zip(axes.flat, panels, strict=False):
        for label, ys in lines.items():
            ax.plot(xs, ys, marker="o", label=label, linewidth=2.5 if label == "auto" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("row bytes")
        ax.set_ylabel("useful GB/s")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv=None) -> int:
    args = parse(argv)
    if args.fresh_child:
        fresh_child(args)
        return 0
    results: list[dict] = []
    # A timeout (SIGTERM) still prints and saves what was measured.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    status = 0
    try:
        run(args, results)
    except KeyboardInterrupt:
        print("# interrupted: reporting the cells measured so far", flush=True)
        status = 1
    except Exception as e:  # noqa: BLE001 - report what was measured, then fail
        print(f"# stopped by {type(e).__name__}: {e}", flush=True)
        status = 1
    finally:
        print_table(results)
        if args.csv:
            write_csv(results, args.csv)
        if args.png and results:
            write_png(results, args.png)
    return status


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
