#!/usr/bin/env bash
# ssdtrain on the GPU machine: GPU tests, then the I/O benchmark at full size (64 MiB .. 1 GiB, host and GPU memory,
# io_uring / threads / gds backends, against dd O_DIRECT and a multithreaded pread/pwrite loop; fio too if present).
# Run from the repo root with the packages installed. Writes at most three files into ${OUT:-./out}:
#   ssdtrain-gpu.log (everything printed), ssdtrain-io.csv (every benchmark row), ssdtrain-io.txt (the table).
# Exit code: non-zero if the tests or the benchmark failed. Ends in about 2-3 minutes on an H100/H200 machine.
#
# The benchmark writes into SSDTRAIN_BENCH_DIR (default: a fresh directory under the repo root, which lies on the
# machine's disk; /tmp may be a tmpfs). SSDTRAIN_BENCH_ARGS adds/overrides benchmark options, e.g. "--repeat 5".
set -u
OUT="${OUT:-./out}"
mkdir -p "$OUT"
LOG="$OUT/ssdtrain-gpu.log"
: > "$LOG"
BENCH_DIR="${SSDTRAIN_BENCH_DIR:-$(mktemp -d -p "$PWD" ssdtrain-bench.XXXXXX)}"
TIMEOUT_ARG=""
if python3 -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_ARG="--timeout=60"; fi

echo "== ssdtrain GPU tests ($(date -u +%H:%M:%S))" | tee -a "$LOG"
python3 -m ssdtrain info 2>&1 | tee -a "$LOG"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
ls /proc/driver/nvidia-fs 2>&1 | head -3 | tee -a "$LOG"
# Why GPU <-> file can beat host <-> file: huge pages decide whether a 1 MiB
# block is one device request or is split in two (max_segments), and pagemap (root only) shows physical layout.
{
  echo "== memory: uid $(id -u); THP enabled: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>&1);" \
    "defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag 2>&1)"
  grep -E 'AnonHugePages|HugePages_Total|MemFree' /proc/meminfo
} 2>&1 | tee -a "$LOG"
# faulthandler_timeout dumps every thread's stack into the log when one test runs longer than 40 s.
timeout 120 python3 -m pytest -m gpu ssdtrain/tests -q -rfE -p no:cacheprovider -o faulthandler_timeout=40 \
  $TIMEOUT_ARG 2>&1 | tail -n 80 | tee -a "$LOG"
tests_rc=${PIPESTATUS[0]}
echo "== GPU tests exit code: $tests_rc (124: timed out)" | tee -a "$LOG"
# cuFile's own log (the cufile.json ssdtrain writes sends it to the temp dir): says why cuFileHandleRegister failed.
for f in $(ls -t "${TMPDIR:-/tmp}"/cufile*.log 2>/dev/null | head -n 2); do
  echo "== tail of $f" | tee -a "$LOG"
  tail -n 25 "$f" 2>&1 | tee -a "$LOG"
done

echo "== ssdtrain I/O benchmark ($(date -u +%H:%M:%S)) in $BENCH_DIR" | tee -a "$LOG"
df -hT "$BENCH_DIR" 2>&1 | tee -a "$LOG"
# shellcheck disable=SC2086
# Memory kinds per backend: host (torch pinned tensor, default stage_host=auto: copied through the huge-page
# staging buffers), host-huge (ssdtrain.huge_empty, moved in place), host-4k (torch pinned tensor moved from its own
# 4 KiB pages: split requests), gpu. Columns dev/x and req KiB come from /proc/diskstats (see the header).
timeout 200 python3 ssdtrain/benchmarks/io.py --dir "$BENCH_DIR" --sizes 64M,256M,1G --repeat 3 \
  --csv "$OUT/ssdtrain-io.csv" ${SSDTRAIN_BENCH_ARGS:-} > "$OUT/ssdtrain-io.txt" 2>&1
bench_rc=$?
cat "$OUT/ssdtrain-io.txt" >> "$LOG"
rm -rf "$BENCH_DIR"
echo "== benchmark exit code: $bench_rc (124: timed out) ($(date -u +%H:%M:%S))" | tee -a "$LOG"
echo "== summary: GPU tests rc=$tests_rc, benchmark rc=$bench_rc" | tee -a "$LOG"
echo "== ssdtrain I/O benchmark table"
cat "$OUT/ssdtrain-io.txt"
if [ "$tests_rc" -ne 0 ] || [ "$bench_rc" -ne 0 ]; then exit 1; fi
exit 0
