#!/usr/bin/env bash
# ssdtrain on the GPU machine: GPU tests, then the LLM budget suite (benchmarks/llm.py --suite budget, models of
# 16 layers x 2048 at seq 2048: budget accuracy at 0.2-0.8 x keep on a Llama-style GQA model (eager, fp32 weights
# under autocast, accumulation 4) and GPT-2 (eager, bf16), Qwen2 compiled in bf16 at 0.3 / 0.6; budget=None at full
# recompute's largest GPT-2 batch; NVMe with host RAM capped), optionally the I/O benchmark.
# Run from the repo root with the packages installed. Ends within SSDTRAIN_GPU_SECONDS (default 480) seconds.
# Writes into ${OUT:-./out}: ssdtrain-gpu.log (everything printed), llm-budget.csv (every row), llm-budget.png
# (peak / budget per cell, step time vs peak), ssdtrain-io.csv when the io step runs.
#
#   SSDTRAIN_GPU_STEPS   steps to run, comma-separated (default tests,budget; add io for the I/O benchmark)
#   SSDTRAIN_BENCH_DIR   a directory on the machine's disk for NVMe files (default: a fresh one under the repo
#                        root; /tmp may be a tmpfs)
#   SSDTRAIN_BENCH_ARGS  extra arguments for llm.py (e.g. "--cells 4")
# Exit code: non-zero if the tests or a benchmark failed.
set -u
OUT="${OUT:-./out}"
mkdir -p "$OUT"
LOG="$OUT/ssdtrain-gpu.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
STEPS=",${SSDTRAIN_GPU_STEPS:-tests,budget},"
END=$(( $(date +%s) + ${SSDTRAIN_GPU_SECONDS:-480} ))
left() { echo $(( END - $(date +%s) )); }
BENCH_DIR="${SSDTRAIN_BENCH_DIR:-$(mktemp -d -p "$PWD" ssdtrain-bench.XXXXXX)}"
TIMEOUT_ARG=""
if python3 -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_ARG="--timeout=60"; fi
tests_rc=0
bench_rc=0
io_rc=0

{
  echo "== ssdtrain on $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -m ssdtrain info
  grep -E 'MemTotal|MemAvailable' /proc/meminfo
  df -hT "$BENCH_DIR"
} 2>&1 | tee -a "$LOG"

if [[ "$STEPS" == *,tests,* ]]; then
  echo "== GPU tests ($(date -u +%H:%M:%S), $(left) s left)" | tee -a "$LOG"
  # faulthandler_timeout dumps every thread's stack into the log when one test runs longer than 40 s.
  timeout 100 python3 -m pytest -m gpu ssdtrain/tests -q -rfE -p no:cacheprovider -o faulthandler_timeout=40 \
    $TIMEOUT_ARG 2>&1 | tail -n 60 | tee -a "$LOG"
  tests_rc=${PIPESTATUS[0]}
  echo "== GPU tests exit code: $tests_rc (124: timed out)" | tee -a "$LOG"
fi

if [[ "$STEPS" == *,io,* ]]; then
  echo "== I/O benchmark ($(date -u +%H:%M:%S), $(left) s left)" | tee -a "$LOG"
  timeout 150 python3 ssdtrain/benchmarks/io.py --dir "$BENCH_DIR" --sizes 256M,1G --repeat 2 \
    --csv "$OUT/ssdtrain-io.csv" 2>&1 | tee -a "$LOG"
  io_rc=${PIPESTATUS[0]}
fi

if [[ "$STEPS" == *,budget,* ]]; then
  remaining=$(left)
  echo "== LLM budget suite ($(date -u +%H:%M:%S), $remaining s left)" | tee -a "$LOG"
  # shellcheck disable=SC2086
  python3 ssdtrain/benchmarks/llm.py --suite budget --deadline $(( remaining - 45 )) --hard-end $(( remaining - 10 )) \
    --child-timeout 120 --nvme-dir "$BENCH_DIR" --csv "$OUT/llm-budget.csv" --png "$OUT/llm-budget.png" \
    ${SSDTRAIN_BENCH_ARGS:-} 2>&1 | grep -v -E '^\[transformers\]|Converting a tensor|Consider using tensor' \
    | tee -a "$LOG"
  bench_rc=${PIPESTATUS[0]}
fi
rm -rf "$BENCH_DIR"
echo "== summary: GPU tests rc=$tests_rc, budget suite rc=$bench_rc, io rc=$io_rc ($(date -u +%H:%M:%S))" \
  | tee -a "$LOG"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$io_rc" -eq 0 ]
