#!/usr/bin/env bash
# ssdtrain's activation offload on the GPU machine: GPU tests, then the LLM benchmark (ssdtrain/benchmarks/llm.py).
# Run from the repo root with ssdtrain installed. torchtune 0.6.1 (for its rows) comes from a carried wheel,
# .whl/torchtune-0.6.1-py3-none-any.whl (`pip download --no-deps torchtune==0.6.1 -d .whl`), unpacked under /tmp
# (only its OffloadActivations file is used, see llm.py). Writes into ${OUT:-./out}: llm-gpu.log (everything),
# llm.csv, llm.json, llm-rok.png, llm-tests.log.
#
#   bash ssdtrain/benchmarks/llm_gpu_run.sh probe    # tests + keep / recompute / ssdtrain at 0.5x keep (~2 min)
#   bash ssdtrain/benchmarks/llm_gpu_run.sh full     # tests, then the whole matrix in priority order
#   bash ssdtrain/benchmarks/llm_gpu_run.sh bench    # the whole matrix, no tests
#
# LLM_END (epoch seconds; default: LLM_BUDGET seconds from now, default 480) is when everything must be done: the
# benchmark starts no job within 30 s of it and stops one still running 8 s before it, so a caller with a hard
# limit passes its own end (e.g. LLM_END=$(( $(date +%s) + 500 )) set before building the package).
set -u
MODE="${1:-full}"
OUT="${OUT:-./out}"
mkdir -p "$OUT"
LOG="$OUT/llm-gpu.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
END="${LLM_END:-$(( $(date +%s) + ${LLM_BUDGET:-480} ))}"
left() { echo $(( END - $(date +%s) )); }
{
  echo "== ssdtrain offload on $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  grep -E 'MemTotal|MemAvailable' /proc/meminfo
  nproc
  echo "time left: $(left) s"
} 2>&1 | tee -a "$LOG"

wheel=$(ls .whl/torchtune-*.whl 2>/dev/null | head -n 1)
if [ -n "$wheel" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/torchtune "$wheel" 2>&1 | tail -n 2 \
    | tee -a "$LOG"
  export PYTHONPATH=/tmp/torchtune${PYTHONPATH:+:$PYTHONPATH}
  echo "torchtune from $wheel" | tee -a "$LOG"
else
  echo "no .whl/torchtune-*.whl: the torchtune rows will say 'unavailable'" | tee -a "$LOG"
fi

tests_rc=0
if [ "$MODE" != "bench" ]; then
  echo "== GPU tests ($(date -u +%H:%M:%S), $(left) s left)" | tee -a "$LOG"
  limit=$(( $(left) / 4 ))
  [ "$limit" -gt 120 ] && limit=120
  timeout "$limit" python3 -m pytest -m gpu ssdtrain/tests/test_ssdtrain_offload_gpu.py -q -rfE -p no:cacheprovider \
    -o faulthandler_timeout=100 > "$OUT/llm-tests.log" 2>&1
  tests_rc=$?
  tail -n 60 "$OUT/llm-tests.log" | tee -a "$LOG"
  echo "== GPU tests exit code: $tests_rc ($(date -u +%H:%M:%S))" | tee -a "$LOG"
fi

remaining=$(left)
if [ "$MODE" = "probe" ]; then
  ARGS=(--models gpt2 --policies "keep,recompute,ssdtrain@keep*0.5,ssdtrain@recompute*1.2" --steps 3 \
        --no-determinism --oom-batch 0 --deadline 60)
else
  ARGS=(--deadline $(( remaining - 30 )) --hard-end $(( remaining - 8 )))
fi
echo "== LLM benchmark ($MODE, $(date -u +%H:%M:%S), $remaining s left)" | tee -a "$LOG"
python3 ssdtrain/benchmarks/llm.py "${ARGS[@]}" ${LLM_ARGS:-} --csv "$OUT/llm.csv" --json "$OUT/llm.json" \
  --png "$OUT/llm-rok.png" 2>&1 | grep -v -E '^\[transformers\]|Converting a tensor|Consider using tensor' | tee -a "$LOG"
bench_rc=${PIPESTATUS[0]}
echo "== summary: GPU tests rc=$tests_rc, benchmark rc=$bench_rc ($(date -u +%H:%M:%S), $(left) s left)" | tee -a "$LOG"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
