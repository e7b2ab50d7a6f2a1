#!/usr/bin/env bash
# GPU run for hector: GPU tests, then the benchmarks at full size. Run from the repo root with the package
# installed. Writes at most 3 files into "${OUT:-./out}": hector_gpu.log, hector_memory.csv, hector_speed.csv.
# Every step runs even if an earlier one failed; the script exits non-zero if any step failed.
set -uxo pipefail
OUT="${OUT:-./out}"
mkdir -p "$OUT"
LOG="$OUT/hector_gpu.log"
STATUS=0
python3 -c "import torch, hector; print(torch.__version__, torch.cuda.get_device_name(0)); print(hector.info())" \
    2>&1 | tee "$LOG" || STATUS=1
python3 -m pytest -m gpu hector/tests -q -rs 2>&1 | tee -a "$LOG" || { echo "gpu tests: exit $?" | tee -a "$LOG"; STATUS=1; }
# Memory: cost model on the full-size twins, CUDA peak measured on ~2M-edge twins (PyG skipped past 40 GB).
timeout 200 python3 hector/benchmarks/memory_table.py --device cuda --measure-edges 2000000 --pyg-limit 4e10 \
    --datasets aifb,mutag,bgs,am,fb15k,biokg,mag,wikikg2 --csv "$OUT/hector_memory.csv" --markdown \
    > "$OUT/memory.txt" 2>&1 || { echo "memory_table: exit $?" | tee -a "$LOG"; STATUS=1; }
# Speed: one training step (reference backend vs PyG) on full-size twins; no new dataset after 90 s.
timeout 150 python3 hector/benchmarks/speed.py --device cuda --datasets aifb,mutag,bgs,fb15k,biokg,am \
    --budget-s 90 --csv "$OUT/hector_speed.csv" > "$OUT/speed.txt" 2>&1 \
    || { echo "speed: exit $?" | tee -a "$LOG"; STATUS=1; }
{ echo "=== memory ==="; grep -v USDT "$OUT/memory.txt"; echo "=== speed ==="; grep -v USDT "$OUT/speed.txt"; } \
    >> "$LOG"
rm -f "$OUT/memory.txt" "$OUT/speed.txt"
set +x
echo "=== hector results (status $STATUS) ==="
grep -v USDT "$LOG" | tail -n 70
exit "$STATUS"
