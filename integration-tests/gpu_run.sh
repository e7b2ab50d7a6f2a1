#!/usr/bin/env bash
# End-to-end runs on the GPU machine, from the repo root. Steps (E2E_STEPS, default "gnn-1 llm-1 gnn-2 llm-2"):
#   gnn-tests  the GPU tests of the sampler and loader (pytorch-direct) and of gnn_train.py
#   gnn-sampling  the sampler's time per batch against the number of edge types (pytorch-direct/benchmarks)
#   gnn-1      gnn_train.py --size large, 1 process: toolkit (pytorch-direct + hector, batches made by the loader
#              thread; also ahead by the training thread, by the loader thread with the sampler called from Python
#              instead of TorchScript, and with pytorch-direct's GPU feature cache holding 15% of the rows,
#              E2E_GNN_CACHE) against the plain PyTorch/PyG baseline made by a loader thread and in turn
#   gnn-r1000, gnn-r10000   the same on a 20M-node graph with 1,000 / 10,000 relations (relation skew 1.0), 2 epochs
#   llm-1      llm_train.py --size large, 1 process: keep at growing batches until out of memory, then recompute and
#              ssdtrain at 1.5x the largest batch keep fitted
#   gnn-2      gnn_train.py --size large, torchrun with 2 processes (DDP, one shared host copy of the features): toolkit
#   llm-2      llm_train.py --size large, torchrun with 2 processes: ssdtrain at the batch of llm-1
# then report.py over all of them (its last table: the toolkit against the fastest baseline way per GNN run, with
# the share of the epoch spent waiting for batches). Every step runs under its own time limit, whatever happened to
# the others. E2E_STEPS=gnn is "gnn-tests gnn-sampling gnn-1 gnn-r1000 gnn-r10000" (~7 minutes on one H100 or H200);
# "gnn-1 gnn-r1000 gnn-r10000" fits one 8-minute call.
#
#   bash integration-tests/gpu_run.sh                # installs the three packages first (no build isolation)
#   bash integration-tests/gpu_run.sh --no-install   # they are installed already (e.g. from `nox -s gpu`)
#   E2E_STEPS=gnn bash integration-tests/gpu_run.sh --no-install
#
# Files in $OUT (default ./out): e2e.tar.gz (logs, JSON, CSV, PNG of every step), e2e-report.txt, e2e.log.
# Exits non-zero if any step failed. About 5 minutes of wall time for the default steps, install excluded.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
RESULTS="$OUT/e2e"
mkdir -p "$RESULTS"
LOG="$OUT/e2e.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on the shared machines (see the device notes): NCCL, PyTorch and NVSHMEM.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# ssdtrain's pinned host pool per process. Its default (half of MemAvailable) reads too little on machines whose
# memory grows as it is used (MemTotal starts at ~31 GiB there); 2 x 96 GiB fits the 256 GiB of nvidia-h200-x2.
HOST_MEMORY="${E2E_HOST_MEMORY:-96GiB}"
# E2E_SIZE=tiny runs the same steps in seconds on a CPU (the 2-process steps on gloo): the script's own smoke test.
SIZE="${E2E_SIZE:-large}"
STEPS="${E2E_STEPS:-gnn-1 llm-1 gnn-2 llm-2}"
[ "$STEPS" = gnn ] && STEPS="gnn-tests gnn-sampling gnn-1 gnn-r1000 gnn-r10000"
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
STATUS=0
say() { echo "$@" | tee -a "$LOG"; }

if [ "${1:-}" != "--no-install" ]; then
  [ -f .device-kit/gpu-env.sh ] && source .device-kit/gpu-env.sh
  start=$(date +%s)
  python3 -m pip install -q --no-build-isolation --no-deps ./pytorch-direct ./hector ./ssdtrain >> "$LOG" 2>&1 \
    || { say "install failed (see $LOG)"; exit 1; }
  say "install: $(( $(date +%s) - start )) s"
fi
nvidia-smi --query-gpu=index,name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv \
  2>&1 | tee -a "$LOG"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
say "GPUs visible: $GPUS"

# step NAME SECONDS COMMAND...: run with a time limit, output to $RESULTS/NAME.log, one summary line.
declare -a SUMMARY=()
step() {
  local name=$1 limit=$2
  shift 2
  local start rc lines
  start=$(date +%s)
  say "=== $name (limit ${limit} s): $*"
  timeout --signal=TERM --kill-after=20 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  rc=$?
  local took=$(( $(date +%s) - start ))
  # (a failed step shows more of its log: a test's traceback, or the thread stacks of a hang)
  [ $rc -eq 0 ] && lines=25 || lines=120
  tail -n "$lines" "$RESULTS/$name.log" | tee -a "$LOG"
  if [ $rc -eq 0 ]; then
    SUMMARY+=("$(printf '%-8s ok       %4d s' "$name" "$took")")
  else
    [ $rc -eq 124 ] && what="timed out" || what="exit $rc"
    SUMMARY+=("$(printf '%-8s FAILED   %4d s  (%s)' "$name" "$took" "$what")")
    STATUS=1
  fi
}

TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc-per-node=2)
# E2E_GNN_ARGS / E2E_LLM_ARGS: extra arguments for the 1-process steps (e.g. E2E_LLM_ARGS="--batch-sizes 4,6,8,12"
# on an 80 GB GPU, where the preset's sweep from batch 8 may not fit at all).
if wanted gnn-tests; then
  # (faulthandler_timeout: a test that hangs prints every thread's stack after 60 s instead of dying silently at
  # the step's limit; -rfE: the failures' one-line reasons at the end, where the log's tail shows them)
  step gnn-tests 150 python3 -m pytest -q -x -rfE --tb=short -o faulthandler_timeout=60 -m gpu \
    pytorch-direct/tests/test_sampling.py integration-tests/test_gnn_train.py
fi
# The sampler alone, per batch, against the number of edge types (4 to 10,000): a HeteroData graph and the same
# edges as one graph with typed edges (2M nodes, 20M edges; ~1 minute, most of it building the graphs).
if wanted gnn-sampling; then
  [ "$SIZE" = tiny ] && SAMPLING_ARGS=(--nodes 3000 --edges 30000 --edge-types 2,50 --batches 2) || SAMPLING_ARGS=()
  step gnn-sampling 150 python3 pytorch-direct/benchmarks/sampling.py ${SAMPLING_ARGS[@]+"${SAMPLING_ARGS[@]}"} \
    --csv "$RESULTS/sampling.csv"
fi
# The baseline's two ways (PyG's best is the faster of them): a loader thread (the default) and in turn.
GNN_RUN=(python3 integration-tests/gnn_train.py --size "$SIZE" --no-progress --baseline-ways inturn)
if wanted gnn-1; then
  # (the toolkit also with batches made ahead by the training thread: how much the loader thread gains; with the
  # sampler's operations called from Python in the loader thread: what the GIL costs; and with the GPU feature
  # cache: what it adds on top of zero-copy reads)
  # shellcheck disable=SC2086
  # (then each again, -rerun, after the machine is warm; then 6 more steps of the toolkit and the baseline under
  # the profiler: host time and launches per thread)
  step gnn-1 240 "${GNN_RUN[@]}" --toolkit-ways ahead,thread-python --toolkit-cache "${E2E_GNN_CACHE:-0.15}" --rerun \
    --profile 6 --json "$RESULTS/gnn-1.json" ${E2E_GNN_ARGS:-}
fi
# Many relations (a 20M-node graph at the large size): the per-batch cost of relations.
[ "$SIZE" = tiny ] && RELATION_NODES=8000 || RELATION_NODES=20000000
for relations in 1000 10000; do
  if wanted "gnn-r$relations"; then
    # shellcheck disable=SC2086
    # (then 6 more steps of the toolkit and the baseline under the profiler: where the time per step goes)
    step "gnn-r$relations" 170 "${GNN_RUN[@]}" --num-nodes "$RELATION_NODES" --relations "$relations" \
      --relation-skew 1.0 --epochs 2 --profile 6 --json "$RESULTS/gnn-r$relations.json" ${E2E_GNN_ARGS:-}
  fi
done
if wanted llm-1; then
  # shellcheck disable=SC2086
  step llm-1 160 python3 integration-tests/llm_train.py --size "$SIZE" --no-progress --host-memory "$HOST_MEMORY" \
    --json "$RESULTS/llm-1.json" ${E2E_LLM_ARGS:-}
fi
if [ "$GPUS" -ge 2 ] || [ "$SIZE" = tiny ]; then
  if wanted gnn-2; then
    step gnn-2 90 "${TORCHRUN[@]}" integration-tests/gnn_train.py --size "$SIZE" --impl toolkit --no-progress \
      --json "$RESULTS/gnn-2.json"
  fi
  if wanted llm-2; then
    # The per-process batch of the 1-process ssdtrain run, so tokens/s compare like for like.
    BATCH=$(python3 - "$RESULTS/llm-1.json" "$SIZE" <<'EOF' 2>/dev/null || echo 24
import json, sys
runs = [r for r in json.load(open(sys.argv[1]))["runs"] if r["policy"] == "ssdtrain"]
print(runs[-1]["batch"] if runs else 4 if sys.argv[2] == "tiny" else 24)
EOF
)
    step llm-2 90 "${TORCHRUN[@]}" integration-tests/llm_train.py --size "$SIZE" --policies ssdtrain \
      --ssdtrain-batch "$BATCH" --no-progress --host-memory "$HOST_MEMORY" --json "$RESULTS/llm-2.json"
  fi
elif wanted gnn-2 || wanted llm-2; then
  say "fewer than 2 GPUs: the 2-process runs are skipped"
fi

# Optional (E2E_BIG_TABLE=1, ~3 more minutes): a feature table larger than the GPU's memory (40M x 1024 fp32 =
# 153 GiB in host memory; needs >= 192 GiB of RAM), toolkit only, one epoch.
if [ "${E2E_BIG_TABLE:-0}" = 1 ]; then
  step gnn-big 240 python3 integration-tests/gnn_train.py --size large --feature-dim 1024 --impl toolkit \
    --epochs 1 --no-progress --json "$RESULTS/gnn-big.json"
fi

shopt -s nullglob
python3 integration-tests/report.py --gnn "$RESULTS"/gnn-*.json --llm "$RESULTS"/llm-*.json --out "$RESULTS" \
  > "$OUT/e2e-report.txt" 2>&1 || STATUS=1
tar -czf "$OUT/e2e.tar.gz" -C "$OUT" e2e && rm -rf "$RESULTS"

say ""
say "=== end-to-end report ==="
tee -a "$LOG" < "$OUT/e2e-report.txt"
say ""
say "=== steps (status $STATUS) ==="
for line in "${SUMMARY[@]}"; do say "$line"; done
exit "$STATUS"
