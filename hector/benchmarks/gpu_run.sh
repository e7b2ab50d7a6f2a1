#!/usr/bin/env bash
# GPU run for hector: GPU tests, then the benchmarks at full size. Run from the repo root with the package
# installed. Writes at most 3 files into "${OUT:-./out}": hector_gpu.log, hector_memory.csv, hector_speed.csv.
set -euxo pipefail
OUT="${OUT:-./out}"
mkdir -p "$OUT"
LOG="$OUT/hector_gpu.log"
python3 -c "import torch, hector; print(torch.__version__, torch.cuda.get_device_name(0)); print(hector.info())" \
    2>&1 | tee "$LOG"
python3 -m pytest -m gpu hector/tests -q 2>&1 | tee -a "$LOG"
# Memory: cost model on the full-size twins, CUDA peak measured on ~2M-edge twins (PyG RGAT skipped past 40 GB).
timeout 200 python3 hector/benchmarks/memory_table.py --device cuda --measure-edges 2000000 --pyg-limit 4e10 \
    --datasets aifb,mutag,bgs,am,fb15k,biokg,mag,wikikg2 --csv "$OUT/hector_memory.csv" --markdown \
    > "$OUT/memory.txt" 2>&1 || echo "memory_table exit code $?" | tee -a "$LOG"
# Speed: one training step, reference backend vs PyG, full-size twins (stops starting datasets after 90 s).
timeout 150 python3 hector/benchmarks/speed.py --device cuda --datasets aifb,mutag,bgs,fb15k,biokg,am \
    --budget-s 90 --csv "$OUT/hector_speed.csv" > "$OUT/speed.txt" 2>&1 || echo "speed exit code $?" | tee -a "$LOG"
cat "$OUT/memory.txt" "$OUT/speed.txt" >> "$LOG"
rm -f "$OUT/memory.txt" "$OUT/speed.txt"
echo "=== hector results ==="
grep -v USDT "$LOG" | tail -n 60
