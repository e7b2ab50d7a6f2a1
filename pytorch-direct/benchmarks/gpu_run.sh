#!/usr/bin/env bash
# pytorch-direct on the GPU machine: GPU tests, the GNN loader's host work per batch, the GPU cache benchmark, first
# use (import, table creation), then the gather benchmark (with WholeGraph where pylibwholegraph imports). Run from
# the repo root with the package installed. Writes into ${OUT:-./out}: pytorch-direct-gpu.log (everything printed),
# pytorch-direct-loader-host.csv, pytorch-direct-cache.csv, pytorch-direct-first-use.csv, pytorch-direct-gather.csv
# and pytorch-direct-gather.png. Exit code: non-zero if a step failed. Sized for ~8 minutes on one H100 (80 GB) with
# 128 GB of host RAM.
#
# PD_STEPS picks the steps ("tests loader cache firstuse bench" by default); PD_LOADER_ARGS, PD_CACHE_ARGS,
# PD_FIRST_USE_ARGS and PD_BENCH_ARGS override each benchmark's arguments, e.g.
#   PD_STEPS=bench PD_BENCH_ARGS="--table-gib 16 --row-bytes 64 1024" bash pytorch-direct/benchmarks/gpu_run.sh
# PD_PYTEST_K selects GPU tests by a pytest -k expression, passed as one argument (spaces allowed: "dedupe or auto";
# PD_PYTEST_ARGS is split at spaces, so an expression there must have none: "a|b" is rejected by pytest, and no test
# runs). PD_TESTS_TIMEOUT, PD_LOADER_TIMEOUT, PD_CACHE_TIMEOUT, PD_FIRST_USE_TIMEOUT and PD_BENCH_TIMEOUT cap the
# steps (280, 150, 125, 120 and 200 s; on an H100 host the tests ran past 170 s before the sampler kernels' tests were
# added, the cache step took 55 s, first use 60 s where it finished, the gather step 130 s). "tests loader" alone fits
# one 10-minute call; the loader step measures the sampler's paths (the CUDA kernels, a batch in one call; the same
# kernels launched hop by hop from Python; the torch path).
set -u
OUT="${OUT:-./out}"
mkdir -p "$OUT"
LOG="$OUT/pytorch-direct-gpu.log"
: > "$LOG"
# The measurements cache goes to a scratch directory (the benchmark clears it between cells anyway).
export PYTORCH_DIRECT_CACHE_DIR="${PYTORCH_DIRECT_CACHE_DIR:-$(mktemp -d)}"
STEPS=${PD_STEPS:-"tests loader cache firstuse bench"}
# The gather matrix at the sizes that fit beside WholeGraph's own copies of the table (1 and 16 GiB).
BENCH_ARGS=${PD_BENCH_ARGS:-"--table-gib 1 16 --row-bytes 64 256 1024 --patterns uniform sorted zipf1.2 --repeats 3 --fresh-check 0 --budget-s 110"}
CACHE_ARGS=${PD_CACHE_ARGS:-"--table-gib 32 --row-bytes 256"}
# the GNN loader at the large training preset's batch shape (1024 seeds, fan-outs 15, 10; a smaller graph)
LOADER_ARGS=${PD_LOADER_ARGS:-"--device cuda --nodes 2000000 --batches 30 --top 30 --sampler all"}
# (its own budget stops it before the step's time limit: what it measured is printed and written as it goes)
FIRST_USE_ARGS=${PD_FIRST_USE_ARGS:-"--table-gib 64 --budget-s 95"}
TIMEOUT_ARG=""
if python3 -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_ARG="--timeout=60"; fi

COMMIT="unknown (no git checkout)"
if git rev-parse --short HEAD >/dev/null 2>&1; then
  COMMIT="$(git rev-parse --short HEAD)"
  git diff --quiet HEAD -- pytorch-direct || COMMIT="$COMMIT + uncommitted changes in pytorch-direct"
fi
echo "== pytorch-direct on the GPU ($(date -u +%H:%M:%S)), commit $COMMIT, steps: $STEPS" | tee -a "$LOG"
echo "== kernel $(uname -r), $(nproc) CPUs usable, $(free -g | awk '/Mem:/ {print $2}') GiB RAM" | tee -a "$LOG"
python3 -m pytorch_direct info 2>&1 | tee -a "$LOG"
# Skipped GPU tests must not pass for a GPU run: fail loudly when CUDA is not usable from torch or from the package.
if ! python3 -c "import torch, pytorch_direct as pd, sys; sys.exit(0 if torch.cuda.is_available() and pd.cuda_usable() else 1)"; then
  echo "== ERROR: torch.cuda.is_available()/pytorch_direct.cuda_usable() is False: no GPU run possible" | tee -a "$LOG"
  exit 3
fi
tests_rc=0
if [[ " $STEPS " == *" tests "* ]]; then
  TESTS_TXT="$(mktemp)"
  # Full output (-v: one line per test as it finishes) into the log; the tail (summary, tracebacks, slowest tests)
  # on the console. --maxfail: a kernel fault poisons the CUDA context and would fail every later test.
  # shellcheck disable=SC2086
  timeout "${PD_TESTS_TIMEOUT:-280}" python3 -m pytest -m gpu pytorch-direct/tests -v -p no:cacheprovider --maxfail=15 \
    --tb=short --durations=10 $TIMEOUT_ARG ${PD_PYTEST_K:+-k "$PD_PYTEST_K"} ${PD_PYTEST_ARGS:-} > "$TESTS_TXT" 2>&1
  tests_rc=$?
  # pytest exit codes 2-4 (interrupted, internal error, usage error such as a bad -k expression) and 5 (nothing
  # collected) mean no GPU test ran: say so, a run must not read as tested.
  if [ "$tests_rc" -ge 2 ] && [ "$tests_rc" -le 5 ]; then
    echo "== ERROR: pytest exit code $tests_rc: the GPU tests did not run (see the log)" | tee -a "$LOG"
  fi
  cat "$TESTS_TXT" >> "$LOG"
  tail -n 45 "$TESTS_TXT"
  rm -f "$TESTS_TXT"
  echo "== GPU tests exit code: $tests_rc (124: timed out) ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  # Not a GPU test (CI runs it on CPU builds), but only here does torch's CUDA wheel load its CUDA libraries: import
  # pytorch_direct must add no CUDA initialisation, driver or NVRTC to what import torch loaded.
  timeout 120 python3 -m pytest pytorch-direct/tests/test_import.py -q -p no:cacheprovider 2>&1 | tail -n 15 \
    | tee -a "$LOG"
  import_rc=${PIPESTATUS[0]}
  echo "== import test exit code: $import_rc" | tee -a "$LOG"
  [ "$tests_rc" -eq 0 ] && tests_rc=$import_rc
fi
loader_rc=0
if [[ " $STEPS " == *" loader "* ]]; then
  echo "== pytorch-direct GNN loader host work per batch ($(date -u +%H:%M:%S)): $LOADER_ARGS" | tee -a "$LOG"
  # shellcheck disable=SC2086
  timeout "${PD_LOADER_TIMEOUT:-150}" python3 pytorch-direct/benchmarks/loader_host.py $LOADER_ARGS \
    --csv "$OUT/pytorch-direct-loader-host.csv" 2>&1 | tee -a "$LOG"
  loader_rc=${PIPESTATUS[0]}
  echo "== loader benchmark exit code: $loader_rc (124: timed out) ($(date -u +%H:%M:%S))" | tee -a "$LOG"
fi
cache_rc=0
if [[ " $STEPS " == *" cache "* ]]; then
  echo "== pytorch-direct GPU cache benchmark ($(date -u +%H:%M:%S)): $CACHE_ARGS" | tee -a "$LOG"
  # shellcheck disable=SC2086
  timeout "${PD_CACHE_TIMEOUT:-125}" python3 pytorch-direct/benchmarks/cache.py $CACHE_ARGS \
    --csv "$OUT/pytorch-direct-cache.csv" 2>&1 | tee -a "$LOG"
  cache_rc=${PIPESTATUS[0]}
  echo "== cache benchmark exit code: $cache_rc (124: timed out) ($(date -u +%H:%M:%S))" | tee -a "$LOG"
fi
first_rc=0
if [[ " $STEPS " == *" firstuse "* ]]; then
  echo "== pytorch-direct first use ($(date -u +%H:%M:%S)): $FIRST_USE_ARGS" | tee -a "$LOG"
  # shellcheck disable=SC2086
  timeout "${PD_FIRST_USE_TIMEOUT:-120}" python3 pytorch-direct/benchmarks/first_use.py $FIRST_USE_ARGS \
    --csv "$OUT/pytorch-direct-first-use.csv" 2>&1 | tee -a "$LOG"
  first_rc=${PIPESTATUS[0]}
  echo "== first-use benchmark exit code: $first_rc (124: timed out) ($(date -u +%H:%M:%S))" | tee -a "$LOG"
fi
bench_rc=0
if [[ " $STEPS " == *" bench "* ]]; then
  echo "== pytorch-direct gather benchmark ($(date -u +%H:%M:%S)): $BENCH_ARGS" | tee -a "$LOG"
  # shellcheck disable=SC2086
  timeout "${PD_BENCH_TIMEOUT:-200}" python3 pytorch-direct/benchmarks/gather.py $BENCH_ARGS \
    --csv "$OUT/pytorch-direct-gather.csv" --png "$OUT/pytorch-direct-gather.png" 2>&1 | tee -a "$LOG"
  bench_rc=${PIPESTATUS[0]}
  echo "== benchmark exit code: $bench_rc (124: timed out) ($(date -u +%H:%M:%S))" | tee -a "$LOG"
fi
echo "== pytorch-direct summary ($(date -u +%H:%M:%S)): tests rc=$tests_rc loader rc=$loader_rc cache rc=$cache_rc" \
  "first-use rc=$first_rc gather rc=$bench_rc" | tee -a "$LOG"
# The lines that state the targets, from every step's report.
grep -E "^(# \[ *[0-9.]+ s\] |# skewed streams|#   (degree|presample|counts):|#   auto below|# uniform:|# exact in|# pd.empty:|# import torch|# auto:|# ceiling|# wholegraph:)" \
  "$LOG" | tee -a "$LOG.summary" || true
cat "$LOG.summary" >> "$LOG" 2>/dev/null && rm -f "$LOG.summary"
[ "$tests_rc" -eq 0 ] && [ "$loader_rc" -eq 0 ] && [ "$cache_rc" -eq 0 ] && [ "$first_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
