#!/usr/bin/env bash
# GPU run for hector, from the repo root with the package installed (~8 minutes on one H100/H200). Steps
# (HECTOR_STEPS, default tests,sanitize,bench):
#   tests      the GPU tests (generated kernels vs the float64 reference, autocast bf16/fp16 on CUDA, no host
#              synchronisation in a step on new edge_index tensors nor in a prepared graph's, one wait per new graph
#              in prepare_graph (ids, order and unique-pair count in one read), torch.compile, CUDA
#              graphs, 10,000 relations, edge cases, sums by source/pair sorted (target-centric) and atomic)
#   sanitize   compute-sanitizer memcheck over the small-graph GPU tests (out-of-bounds reads/writes, atomics), the
#              target-centric (sorted scatter) kernels included (HGT's: sums into pairs and into source nodes)
#   bench      bench_cuda.py on the eight twins, RGCN/RGAT/HGT hidden 64, train step and inference: hector vs PyG
#              eager and compiled, the plain-PyTorch baselines (grouped-GEMM bf16 eager/compiled, per-relation fp32),
#              with a new edge_index per call, compiled vs eager, autocast bf16, the HBM floor (roofline column),
#              GPU operations per train step and their busy time (torch.profiler), persistent and new edge_index,
#              the train step with sums by source/pair atomic and sorted (columns atomic_train_ms, sorted_train_ms;
#              the summary's "atomic/sorted" lines), torch.compile(mode="reduce-overhead") (CUDA graphs) where the
#              eager step is under 5 ms. Each row is written to the CSV as it finishes
#   relations  (not by default) relations.py: per-batch step and graph preparation at 16 / 1,000 / 10,000 relations,
#              and the step on a graph prepared ahead with its layer (prepare_graph(..., layers=...): the prepared_*
#              columns; prepared_host_ms against host_ms is the host time a loader thread takes off the step), the
#              MB of the per-relation weights and the MB tensor copies wrote per step (copy_mb: the batch's, never
#              the weights'); then RGAT as the GNN benchmark's second layer (64 -> 16 x 4 heads, attention shared by
#              the relations) on a batch of its size (165K edges) with nearly every relation present (skew 1), at 16
#              and 10,000 relations, and the GNN benchmark's whole model (gnn2: two such RGAT layers with root
#              terms and a classifier; input width 64 here) on the same batches (hector_relations_gnn.csv): the
#              weight-sized passes a step keeps at 10,000. Every row also has the host time per new graph split as a
#              mini-batch pays it (split_prepare_ms: prepare_graph with its one host read; split_plans_ms: the
#              layers' launch plans; split_step_host_ms: the step's launches; split_host_ms: their sum) and the
#              persistent-graph step ratios (new_vs_persistent, split_vs_persistent); a table of them ends the step
#   host       (not by default; CPU only, ~1 minute) host_overhead.py: launches and host ms per training step with a
#              null executor, persistent / new / prepared graphs (a prepared step should launch a persistent one's)
#              and the persistent step under torch.compile (vs_eager: eager host ms over compiled),
#              then --split: the host CPU ms, launches and Python calls per new graph of the GNN benchmark's model,
#              split into prepare / plans / step, and the part of prepare / plans that holds the GIL (outside the
#              TorchScript calls: prepare_gil_ms, plans_gil_ms) (hector_host_split.csv)
#   memory     (not by default) memory_table.py: materialised bytes vs PyG (cost model + measured peak)
#   split      (not by default; ~4-6 minutes) compute-sanitizer racecheck over the split walks' GPU test, then hub
#              destinations split over a block or not: bench_cuda.py --profile
#              rgat,hgt,rgcn on fb15k (HECTOR_SPLIT_DEGREE=0: one group per destination; 128; 32, the default),
#              bgs (0, 32) and am (0, 128): each generated kernel's ms and the step's wall ms (median of 7), then a
#              table of the step and of the traversal kernels' summed ms per degree. Alone: HECTOR_STEPS=split
#   compile    (not by default; ~3-4 minutes) bench_cuda.py --hector-only on aifb and fb15k, RGCN/RGAT/HGT hidden 64:
#              hector eager against torch.compile (inductor) and torch.compile(mode="reduce-overhead"): wall ms
#              per train step, host CPU ms per step (compiled_host_ratio: eager / compiled), GPU operations and busy
#              time of an eager and of a compiled step (equal when compiling recomputes nothing); no baseline
#              (hector_compile.csv). Alone: HECTOR_STEPS=compile
# Writes into "${OUT:-./out}" (at most 8 files): hector_gpu.log (everything printed, the final tables),
# hector_tests.log, hector_sanitize.log, hector_bench.csv, hector_bench_extras.csv, hector_relations.csv,
# hector_relations_gnn.csv (and
# hector_memory.csv for `memory`, hector_host.csv and hector_host_split.csv for `host`, hector_compile.csv for
# `compile`, hector_split.log for `split`). Every step runs even if an
# earlier one failed; the script exits non-zero if any
# step failed. HECTOR_BENCH_ARGS replaces bench_cuda's arguments below; HECTOR_LIMITS="tests sanitize bench
# relations memory host compile split" sets each step's time limit in seconds (default "290 60 230 100 200 120 240
# 90": the default steps end inside 9 minutes and 40 seconds; the GPU tests take ~180 s on a cold JIT cache;
# relations runs two invocations of up to its limit each, split seven). For the mini-batch
# preparation alone: HECTOR_STEPS=tests,relations,host.
set -uo pipefail
OUT="${OUT:-./out}"
STEPS="${HECTOR_STEPS:-tests,sanitize,bench}"
mkdir -p "$OUT"
LOG="$OUT/hector_gpu.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
read -r T_TESTS T_SANITIZE T_BENCH T_RELATIONS T_MEMORY T_HOST T_COMPILE T_SPLIT \
    <<< "${HECTOR_LIMITS:-290 60 230 100 200 120 240 90}"
T_HOST="${T_HOST:-120}"
T_COMPILE="${T_COMPILE:-240}"
T_SPLIT="${T_SPLIT:-90}"
STATUS=0
has() { [[ ",$STEPS," == *",$1,"* ]]; }
note() { echo "$@" | tee -a "$LOG"; }

python3 -c "import torch, hector; print(torch.__version__, torch.cuda.get_device_name(0)); print(hector.info())" \
    2>&1 | tee -a "$LOG" || STATUS=1

if has tests; then
  note "=== tests ($(date -u +%T))"
  timeout "$T_TESTS" python3 -m pytest -m gpu hector/tests -q -rfEs -p no:cacheprovider -o faulthandler_timeout=100 \
      > "$OUT/hector_tests.log" 2>&1 || { note "tests: exit $?"; STATUS=1; }
  grep -E "passed|failed|error|FAILED|ERROR" "$OUT/hector_tests.log" | tail -n 40 | tee -a "$LOG"
fi

if has sanitize; then
  note "=== compute-sanitizer memcheck ($(date -u +%T))"
  # Small graphs only: memcheck slows every kernel (ours and torch's) by 10-100x.
  timeout "$T_SANITIZE" compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
      python3 -m pytest hector/tests/test_cuda_gpu.py -q -p no:cacheprovider \
      -k "edge_case or gradcheck or (sorted_scatter and centric-fp32 and hgt) or (split and deg16-fp32)" \
      > "$OUT/hector_sanitize.log" 2>&1 || { note "sanitize: exit $?"; STATUS=1; }
  grep -E "ERROR SUMMARY|passed|failed|Invalid|out of bounds" "$OUT/hector_sanitize.log" | head -n 20 | tee -a "$LOG"
fi

if has bench; then
  note "=== bench_cuda ($(date -u +%T))"
  # The issue's four comparison graphs first; compiled variants on two graphs (each compile costs seconds); no new
  # graph after 150 s, so the step ends inside its limit.
  DEFAULT_ARGS="--datasets aifb,fb15k,am,biokg,mutag,bgs,wikikg2,mag --configs rgcn:64:1,rgat:64:1,hgt:64:1
      --no-reference --compile-datasets aifb,am --budget-s 150 --extras-dataset am"
  # shellcheck disable=SC2086
  timeout "$T_BENCH" python3 hector/benchmarks/bench_cuda.py --csv "$OUT/hector_bench.csv" \
      ${HECTOR_BENCH_ARGS:-$DEFAULT_ARGS} 2>&1 | grep -v USDT | tee -a "$LOG" || { note "bench: exit $?"; STATUS=1; }
fi

if has relations; then
  note "=== relations ($(date -u +%T))"
  timeout "$T_RELATIONS" python3 hector/benchmarks/relations.py --device cuda --nodes 200000 --edges 400000 \
      --dim 64 --batches 5 --csv "$OUT/hector_relations.csv" 2>&1 | grep -v USDT | tee -a "$LOG" \
      || { note "relations: exit $?"; STATUS=1; }
  timeout "$T_RELATIONS" python3 hector/benchmarks/relations.py --device cuda --models rgat,gnn2 --relations 16,10000 \
      --nodes 170000 --edges 165000 --dim 64 --skew 1 --batches 5 --csv "$OUT/hector_relations_gnn.csv" 2>&1 \
      | grep -v USDT | tee -a "$LOG" || { note "relations (GNN layer): exit $?"; STATUS=1; }
  note "--- host ms per new graph (prepare / plans / step launches = total), and steps against the persistent graph's"
  python3 - "$OUT/hector_relations.csv" "$OUT/hector_relations_gnn.csv" <<'PY' 2>&1 | tee -a "$LOG"
import csv, sys
print(f"{'file':>14} {'model':>5} {'R':>6} {'prepare':>8} {'plans':>6} {'step':>6} {'total':>6} | {'new x':>6} "
      f"{'split x':>7} {'prepared x':>10}")
for path in sys.argv[1:]:
    try:
        rows = list(csv.DictReader(open(path)))
    except OSError:
        continue
    for r in rows:
        f = {k: float(v) for k, v in r.items() if k.startswith(("split", "new_", "prepared_vs"))}
        print(f"{path.rsplit('/', 1)[-1][:14]:>14} {r['model']:>5} {r['relations']:>6} {f['split_prepare_ms']:8.2f} "
              f"{f['split_plans_ms']:6.2f} {f['split_step_host_ms']:6.2f} {f['split_host_ms']:6.2f} | "
              f"{f['new_vs_persistent']:6.2f} {f['split_vs_persistent']:7.2f} {f['prepared_vs_persistent']:10.2f}")
PY
fi

if has memory; then
  note "=== memory_table ($(date -u +%T))"
  timeout "$T_MEMORY" python3 hector/benchmarks/memory_table.py --device cuda --measure-edges 2000000 --pyg-limit 4e10 \
      --datasets aifb,mutag,bgs,am,fb15k,biokg,mag,wikikg2 --csv "$OUT/hector_memory.csv" --markdown 2>&1 \
      | grep -v USDT | tee -a "$LOG" || { note "memory_table: exit $?"; STATUS=1; }
fi

if has host; then
  note "=== host_overhead ($(date -u +%T))"
  timeout "$T_HOST" python3 hector/benchmarks/host_overhead.py --graphs tiny,small,batch1000 --models rgcn,rgat,hgt \
      --modes persistent,new,prepared,compiled --steps 5 --csv "$OUT/hector_host.csv" 2>&1 | grep -v "top ops" | tee -a "$LOG" \
      || { note "host_overhead: exit $?"; STATUS=1; }
  timeout "$T_HOST" python3 hector/benchmarks/host_overhead.py --split --graphs minibatch --models gnn2,rgat \
      --steps 20 --csv "$OUT/hector_host_split.csv" 2>&1 | tee -a "$LOG" \
      || { note "host_overhead --split: exit $?"; STATUS=1; }
fi

if has split; then
  note "=== split: hub destinations over a block (HECTOR_SPLIT_DEGREE 0 = off, vs 128 and the default 32) ($(date -u +%T))"
  : > "$OUT/hector_split.log"
  # shared-memory races of the split walks' combine (racecheck: every kernel of one small test)
  timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 --print-limit 20 python3 -m pytest \
      hector/tests/test_cuda_gpu.py -q -p no:cacheprovider -k "split and deg16-fp32 and rgat" \
      >> "$OUT/hector_split.log" 2>&1 || { note "split racecheck: exit $?"; STATUS=1; }
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed|failed|hazard" "$OUT/hector_split.log" | head -n 10 | tee -a "$LOG"
  for run in "fb15k 0" "fb15k 128" "fb15k 32" "bgs 0" "bgs 32" "am 0" "am 128"; do
    read -r ds deg <<< "$run"
    echo "--- $ds HECTOR_SPLIT_DEGREE=$deg" >> "$OUT/hector_split.log"
    HECTOR_SPLIT_DEGREE=$deg timeout "$T_SPLIT" python3 hector/benchmarks/bench_cuda.py --profile rgat,hgt,rgcn \
        --extras-dataset "$ds" --no-reference >> "$OUT/hector_split.log" 2>&1 || { note "split $run: exit $?"; STATUS=1; }
  done
  python3 - "$OUT/hector_split.log" <<'PY' 2>&1 | tee -a "$LOG"
import re, sys
runs, cur, ds, deg = {}, None, "", ""
for line in open(sys.argv[1]):
    m = re.match(r"--- (\S+) HECTOR_SPLIT_DEGREE=(\d+)", line)
    if m:
        ds, deg = m.groups()
        continue
    m = re.match(r"profile \S+ (\S+) d=\d+ training step: ([\d.]+) ms wall", line)
    if m:
        cur = runs.setdefault((ds, m.group(1)), {}).setdefault(deg, {"wall": float(m.group(2)), "trav": 0.0})
        continue
    m = re.match(r"\s+([\d.]+) ms\s+(\S+)", line)
    if m and cur is not None and "traversal" in m.group(2):
        cur["trav"] += float(m.group(1))
print("train step and summed traversal-kernel ms per split degree; x = degree 0 (no split) over this degree")
print(f"{'dataset':>8} {'model':>5} {'degree':>6} | {'step ms':>8} {'x':>5} | {'trav ms':>8} {'x':>5}")
for (ds, model), by in runs.items():
    off = by.get("0")
    for deg, r in by.items():
        sx = off["wall"] / r["wall"] if off else float("nan")
        tx = off["trav"] / max(r["trav"], 1e-9) if off else float("nan")
        print(f"{ds:>8} {model:>5} {deg:>6} | {r['wall']:8.2f} {sx:5.2f} | {r['trav']:8.2f} {tx:5.2f}")
PY
fi

if has compile; then
  note "=== compile: hector eager vs torch.compile ($(date -u +%T))"
  # each compile (inductor, then reduce-overhead where the eager step is under 5 ms) takes seconds; no new graph
  # after 150 s, so the step ends inside its limit
  timeout "$T_COMPILE" python3 hector/benchmarks/bench_cuda.py --csv "$OUT/hector_compile.csv" --hector-only \
      --datasets aifb,fb15k --configs rgcn:64:1,rgat:64:1,hgt:64:1 --no-reference --compile-datasets aifb,fb15k \
      --budget-s 150 2>&1 | grep -v USDT | tee -a "$LOG" || { note "compile: exit $?"; STATUS=1; }
fi

note "=== hector GPU run done, status $STATUS ($(date -u +%T))"
exit "$STATUS"
