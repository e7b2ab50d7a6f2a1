#!/usr/bin/env bash
# ssdtrain's activation offload on the GPU machine: GPU tests, then the LLM benchmark (ssdtrain/benchmarks/llm.py).
# Run from the repo root with ssdtrain installed (and torchtune 0.6.1 on PYTHONPATH for its rows). Writes into
# ${OUT:-./out}: llm-gpu.log (everything), llm.csv, llm.json, llm-rok.png, llm-tests.log.
#
#   bash ssdtrain/benchmarks/llm_gpu_run.sh probe    # tests + keep / recompute / ssdtrain at 0.5x keep (~2 min)
#   bash ssdtrain/benchmarks/llm_gpu_run.sh full     # the whole matrix within LLM_DEADLINE seconds (default 150)
#   bash ssdtrain/benchmarks/llm_gpu_run.sh bench    # the whole matrix, no tests
set -u
MODE="${1:-full}"
OUT="${OUT:-./out}"
mkdir -p "$OUT"
LOG="$OUT/llm-gpu.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
{
  echo "== ssdtrain offload on $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  grep -E 'MemTotal|MemAvailable' /proc/meminfo
  nproc
} 2>&1 | tee -a "$LOG"

tests_rc=0
if [ "$MODE" != "bench" ]; then
  echo "== GPU tests ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  timeout 240 python3 -m pytest -m gpu ssdtrain/tests/test_ssdtrain_offload_gpu.py -q -rfE -p no:cacheprovider \
    -o faulthandler_timeout=120 > "$OUT/llm-tests.log" 2>&1
  tests_rc=$?
  tail -n 60 "$OUT/llm-tests.log" | tee -a "$LOG"
  echo "== GPU tests exit code: $tests_rc ($(date -u +%H:%M:%S))" | tee -a "$LOG"
fi

if [ "$MODE" = "probe" ]; then
  ARGS=(--models gpt2 --policies "keep,recompute,ssdtrain@keep*0.5,ssdtrain@recompute*1.2" --steps 3 \
        --no-determinism --oom-batch 0 --deadline 60)
else
  ARGS=(--deadline "${LLM_DEADLINE:-150}")
fi
echo "== LLM benchmark ($MODE, $(date -u +%H:%M:%S))" | tee -a "$LOG"
python3 ssdtrain/benchmarks/llm.py "${ARGS[@]}" ${LLM_ARGS:-} --csv "$OUT/llm.csv" --json "$OUT/llm.json" \
  --png "$OUT/llm-rok.png" 2>&1 | grep -v -E '^\[transformers\]|Converting a tensor|Consider using tensor' | tee -a "$LOG"
bench_rc=${PIPESTATUS[0]}
echo "== summary: GPU tests rc=$tests_rc, benchmark rc=$bench_rc ($(date -u +%H:%M:%S))" | tee -a "$LOG"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
