#!/usr/bin/env bash
# ssdtrain on the GPU machine, in steps chosen by SSDTRAIN_GPU_STEPS (comma-separated); each step fits one ~8 minute
# call on one H100 (80 GB) alone. Run from the repo root with the packages installed. The whole call ends within
# SSDTRAIN_GPU_SECONDS (default 480) seconds; the benchmark steps cut their job lists by that.
#
#   tests         GPU tests (pytest -m gpu ssdtrain/tests; at most 150 s)                              ~2 min
#   prefetch      the GPU tests of the copy-back path alone (recompute+host on a Llama model: every
#                 input restored ahead, the device's wait for on-demand copies measured; copies out
#                 released when backward begins); at most 60 s                                          ~30 s
#   io            I/O engine (io_uring and threads backends) against kvikio (1/4/16 threads) and the
#                 disk's own rate (O_DIRECT io_uring to pinned host memory) and the engine moving that
#                 host memory in place (no device copy), GPU tensors, 256M and 1G,
#                 1 warm-up + 5 interleaved rounds: every write with fsync, every read cold; median,
#                 spread and per-round ratios (io.py --compare)                                        ~1.5-3 min
#   host          the host time ssdtrain adds per micro-batch, on this machine's CPU (host_cost.py: a tiny
#                 Llama-style model on the CPU, keep / derive / host / recompute blocks against none and torch
#                 checkpointing; the proxy for a host-bound GPU step, on the host the GPU runs with)    ~30 s
#   rok           the ROK curve, eager: Llama-style GQA 16 x 2048, batch 4 x 2048, fp32 weights under
#                 autocast bf16, gradient accumulation 4: keep, full recompute (HF checkpointing),
#                 torch SAC, save_on_cpu, torchtune and TRL offloading, ssdtrain at budgets from their
#                 peaks and with every block 'derive' (what deriving alone saves and costs); the eager
#                 targets                                                                               ~6 min
#   rok-compiled  the same model, each block torch.compile'd: keep, activation_memory_budget 0.8 /
#                 0.5 / 0.2, then at their peaks ssdtrain around blocks compiled with the next looser
#                 budget (ssdtrain+compile_budget_X), then around blocks compiled without one (inductor
#                 compiles cost ~1 min a job on a cold cache: the deadline cuts the last ones)          ~8 min
#   trainer       a Hugging Face Trainer on GPT-2 1.3B (24 x 2048, bf16 autocast, accumulation 2, eval
#                 every 2 steps) with and without ssdtrain.OffloadCallback(budget=0.5): losses, peak,
#                 evaluation untouched                                                                  ~2 min
#   budget        budget accuracy (llm.py --suite budget): 16 x 2048 models at seq 2048, 0.2-0.8 x keep on a
#                 Llama-style GQA model (eager, fp32 weights under autocast, accumulation 4) and GPT-2 (eager,
#                 bf16), Qwen2 compiled at 0.3 / 0.6; budget=None at recompute's largest batch; NVMe with
#                 host RAM capped                                                                        ~8 min
# Default: tests,rok. Typical calls: SSDTRAIN_GPU_STEPS=tests,io,trainer (~7 min), =rok (or prefetch,rok, or
# tests,host,rok),
# =rok-compiled, =budget;
# SSDTRAIN_ROK_MODELS=gpt2 runs the ROK steps on GPT-2 instead (or llama,gpt2 with SSDTRAIN_GPU_SECONDS raised).
#
# Wheels carried to the machine (no package index there) go in SSDTRAIN_WHEELS (default .whl/): torchtune 0.6.1
# and trl (their offloading module files are loaded alone), kvikio-cu13 with libkvikio-cu13 and rapids-logger (the
# io step's kvikio rows; cupy is on the machine). They are unpacked under /tmp/ssdtrain-wheels (pip --target, no
# dependencies) and put on PYTHONPATH; a missing one only turns its rows into "unavailable" with the reason.
#
# Writes into ${OUT:-./out}: ssdtrain-gpu.log (everything printed), rok.csv + rok.png (rok step),
# rok-compiled.csv + rok-compiled.png, ssdtrain-io.csv (io step), host-cost.csv (host step), trainer.csv (trainer
# step), llm-budget.csv + llm-budget.png (budget step).
#
#   SSDTRAIN_BENCH_DIR   a directory on the machine's disk for NVMe files (default: a fresh one under the repo
#                        root; /tmp may be a tmpfs)
#   SSDTRAIN_BENCH_ARGS  extra arguments for llm.py (e.g. "--batch 8")
# Exit code: non-zero if the tests or a benchmark failed.
set -u
OUT="${OUT:-./out}"
mkdir -p "$OUT"
LOG="$OUT/ssdtrain-gpu.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
STEPS=",${SSDTRAIN_GPU_STEPS:-tests,rok},"
END=$(( $(date +%s) + ${SSDTRAIN_GPU_SECONDS:-480} ))
left() { echo $(( END - $(date +%s) )); }
BENCH_DIR="${SSDTRAIN_BENCH_DIR:-$(mktemp -d -p "$PWD" ssdtrain-bench.XXXXXX)}"
ROK_MODELS="${SSDTRAIN_ROK_MODELS:-llama}"
TIMEOUT_ARG=""
if python3 -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_ARG="--timeout=60"; fi
tests_rc=0
bench_rc=0
io_rc=0
rok_rc=0
trainer_rc=0
host_rc=0
quiet() { grep -v -E '^\[transformers\]|Converting a tensor|Consider using tensor'; }

WHEELS="${SSDTRAIN_WHEELS:-.whl}"
carried=$(ls "$WHEELS"/torchtune-*.whl "$WHEELS"/trl-*.whl "$WHEELS"/kvikio*.whl "$WHEELS"/libkvikio*.whl \
  "$WHEELS"/rapids_logger*.whl 2>/dev/null)
if [ -n "$carried" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ssdtrain-wheels $carried 2>&1 \
    | tail -n 3 | tee -a "$LOG"
  export PYTHONPATH=/tmp/ssdtrain-wheels${PYTHONPATH:+:$PYTHONPATH}
fi

{
  echo "== ssdtrain on $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "carried wheels: ${carried:-none in $WHEELS}" | tr '\n' ' '; echo
  python3 -c "import kvikio; print('kvikio', kvikio.__version__)" 2>&1 | tail -n 1
  python3 -m ssdtrain info
  grep -E 'MemTotal|MemAvailable' /proc/meminfo
  df -hT "$BENCH_DIR"
} 2>&1 | tee -a "$LOG"

if [[ "$STEPS" == *,tests,* ]]; then
  echo "== GPU tests ($(date -u +%H:%M:%S), $(left) s left)" | tee -a "$LOG"
  # faulthandler_timeout dumps every thread's stack into the log when one test runs longer than 40 s.
  timeout 150 python3 -m pytest -m gpu ssdtrain/tests -q -rfE -p no:cacheprovider -o faulthandler_timeout=40 \
    $TIMEOUT_ARG 2>&1 | tail -n 60 | tee -a "$LOG"
  tests_rc=${PIPESTATUS[0]}
  echo "== GPU tests exit code: $tests_rc (124: timed out)" | tee -a "$LOG"
fi

if [[ "$STEPS" == *,prefetch,* ]]; then
  echo "== GPU tests of the copy-back path ($(date -u +%H:%M:%S), $(left) s left)" | tee -a "$LOG"
  timeout 60 python3 -m pytest -m gpu ssdtrain/tests/test_ssdtrain_offload_gpu.py -q -rfE -p no:cacheprovider \
    -k "recompute_plus_host or copies_out_released" $TIMEOUT_ARG 2>&1 | tail -n 30 | tee -a "$LOG"
  tests_rc=${PIPESTATUS[0]}
  echo "== copy-back GPU tests exit code: $tests_rc (124: timed out)" | tee -a "$LOG"
fi

if [[ "$STEPS" == *,io,* ]]; then
  echo "== I/O engine against kvikio and the disk's own rate ($(date -u +%H:%M:%S), $(left) s left)" | tee -a "$LOG"
  limit=$(( $(left) - 10 ))
  [ "$limit" -gt 220 ] && limit=220
  # On SIGTERM from timeout the benchmark still prints the table of the rounds that finished.
  timeout "$limit" python3 ssdtrain/benchmarks/io.py --compare --dir "$BENCH_DIR" --sizes 256M,1G --rounds 5 \
    --backends io_uring,threads --kvikio-threads 1,4,16 --csv "$OUT/ssdtrain-io.csv" 2>&1 | tee -a "$LOG"
  io_rc=${PIPESTATUS[0]}
fi

if [[ "$STEPS" == *,host,* ]]; then
  echo "== host cost per micro-batch, CPU ($(date -u +%H:%M:%S), $(left) s left)" | tee -a "$LOG"
  timeout 90 python3 ssdtrain/benchmarks/host_cost.py --csv "$OUT/host-cost.csv" 2>&1 | tee -a "$LOG"
  host_rc=${PIPESTATUS[0]}
fi

# The Trainer step runs after the ROK steps: they leave it its ~90 s.
RESERVE=0
[[ "$STEPS" == *,trainer,* ]] && RESERVE=90
rok() {  # rok <groups> <file stem>
  local remaining
  remaining=$(( $(left) - RESERVE ))
  echo "== ROK suite, $1 ($ROK_MODELS, $(date -u +%H:%M:%S), $remaining s left)" | tee -a "$LOG"
  # shellcheck disable=SC2086
  python3 ssdtrain/benchmarks/llm.py --suite rok --groups "$1" --models "$ROK_MODELS" \
    --deadline $(( remaining - 60 )) --hard-end $(( remaining - 10 )) --child-timeout 150 \
    --csv "$OUT/$2.csv" --png "$OUT/$2.png" ${SSDTRAIN_BENCH_ARGS:-} 2>&1 | quiet | tee -a "$LOG"
  return "${PIPESTATUS[0]}"
}
if [[ "$STEPS" == *,rok,* ]]; then
  rok eager rok || rok_rc=$?
fi
if [[ "$STEPS" == *,rok-compiled,* ]]; then
  rok compiled rok-compiled || rok_rc=$?
fi

if [[ "$STEPS" == *,trainer,* ]]; then
  remaining=$(left)
  echo "== Trainer check ($(date -u +%H:%M:%S), $remaining s left)" | tee -a "$LOG"
  limit=$(( remaining - 10 ))
  [ "$limit" -gt 200 ] && limit=200
  # shellcheck disable=SC2086
  python3 ssdtrain/benchmarks/llm.py --suite trainer --child-timeout $(( limit / 2 )) --csv "$OUT/trainer.csv" \
    ${SSDTRAIN_BENCH_ARGS:-} 2>&1 | quiet | grep -v -E "^\{'(loss|eval_loss|train_runtime)'" | tee -a "$LOG"
  trainer_rc=${PIPESTATUS[0]}
fi

if [[ "$STEPS" == *,budget,* ]]; then
  remaining=$(left)
  echo "== LLM budget suite ($(date -u +%H:%M:%S), $remaining s left)" | tee -a "$LOG"
  # shellcheck disable=SC2086
  python3 ssdtrain/benchmarks/llm.py --suite budget --deadline $(( remaining - 45 )) --hard-end $(( remaining - 10 )) \
    --child-timeout 120 --nvme-dir "$BENCH_DIR" --csv "$OUT/llm-budget.csv" --png "$OUT/llm-budget.png" \
    ${SSDTRAIN_BENCH_ARGS:-} 2>&1 | quiet | tee -a "$LOG"
  bench_rc=${PIPESTATUS[0]}
fi
rm -rf "$BENCH_DIR"
echo "== summary: GPU tests rc=$tests_rc, io rc=$io_rc, host rc=$host_rc, rok rc=$rok_rc, trainer rc=$trainer_rc," \
  "budget suite rc=$bench_rc" \
  "($(date -u +%H:%M:%S))" | tee -a "$LOG"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$io_rc" -eq 0 ] && [ "$rok_rc" -eq 0 ] && [ "$trainer_rc" -eq 0 ] \
  && [ "$host_rc" -eq 0 ]
