#!/usr/bin/env bash
# On the borrowed GPU machine, from the repo root: make liburing and nox available from carried files (it has no
# package registry), then run the `gpu` nox session. Arguments go to the session (e.g. --full for the benchmarks).
#
# Carry .device-kit (liburing .deb files + gpu-env.sh, see ../shared/device/README.md) and .whl (nox and its
# pure-Python dependencies, downloaded with `pip download` for Python 3.12).
set -uo pipefail
source .device-kit/gpu-env.sh || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# Every package writes its logs, CSV and plots under $OUT/results; they come back as one archive.
results_root=${OUT:-$PWD/out}
export OUT=$results_root/results
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
python3 -m nox -s gpu -- "$@" 2>&1 | tee "$OUT/gpu-session.log"
status=${PIPESTATUS[0]}
tar -czf "$results_root/results.tar.gz" -C "$results_root" results && rm -rf "$OUT"
exit "$status"
