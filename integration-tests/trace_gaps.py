"""Where a GPU step waits on its host: the idle gaps of a torch profiler Chrome trace and who was late for them.

    python integration-tests/trace_gaps.py TRACE.json.gz [TRACE2 ...] [--min-gap-us 10] [--top 15]

Traces come from ``gnn_train.py --profile N --trace-dir DIR`` or ``ssdtrain/benchmarks/llm.py --suite rok
--trace-dir DIR`` (any ``torch.profiler`` Chrome trace with CPU and CUDA activities works). For each trace it prints:

* the span of the trace, the GPU's busy time (the union of every kernel, copy and fill on every stream) and its
  idle time, then each stream's busy time;
* the idle gaps longer than ``--min-gap-us`` (of the whole GPU, or with ``--stream compute`` of its busiest stream
  alone: where that stream idles while copies run on others, a union of every stream hides the gap), each charged
  to the host thread that launched the kernel ending it.
  A gap whose next kernel was launched after the gap began is the host's: the GPU had run out of queued work
  (a host-bound step). Those are summed per thread (the training thread, the autograd engine's, a loader's) and
  per outermost operation that was launching then (e.g. an ``autograd::engine::evaluate_function: MmBackward0``),
  and the host's blocking CUDA calls inside those gaps (a stream or event synchronize, pinning memory): the time a
  host thread waited for the GPU while the GPU waited for it.

The profiler slows the host down (it records every operation), so the idle time is an upper bound; compare traces
taken the same way (one policy against another, in one run), not against untraced step times.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import sys
from dataclasses import dataclass, field

GPU_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
# Runtime calls during which a host thread is blocked on the GPU (or on pinning host memory), not launching.
BLOCKING = ("Synchronize", "cudaHostAlloc", "cudaMallocHost", "cudaHostRegister", "cudaFreeHost", "cudaFree")
HOST_KINDS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")
OPERATION_KINDS = ("cpu_op", "user_annotation", "python_function")


@dataclass
class Gaps:
    """The idle gaps of one trace (microseconds)."""

    span_us: float
    busy_us: float
    stream_busy_us: dict
    gaps: int = 0
    gap_us: float = 0.0
    host_late_us: float = 0.0
    late_by_thread: collections.Counter = field(default_factory=collections.Counter)
    late_by_operation: collections.Counter = field(default_factory=collections.Counter)
    late_count: collections.Counter = field(default_factory=collections.Counter)
    blocked_by: collections.Counter = field(default_factory=collections.Counter)  # blocking call -> us in late gaps
    stream: object = None  # the stream whose gaps these are (None: the union of every stream)


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals: list[tuple[float, float]]) -> list[list[float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def analyse(events: list[dict], min_gap_us: float = 10.0, stream: str | None = None) -> Gaps:
    """Busy and idle time of the GPU in ``events`` and the gaps' attribution (see the module docstring).
    ``stream``: None for the gaps of the union of every stream; "compute" for those of the busiest stream alone."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = sorted((e for e in complete if e.get("cat") in GPU_KINDS), key=lambda e: e["ts"])
    host = [e for e in complete if e.get("cat") in HOST_KINDS]
    if not gpu:
        raise ValueError("this trace has no GPU activity (kernels, copies): was it taken with ProfilerActivity.CUDA "
                         "on a GPU machine?")
    begin = min(e["ts"] for e in gpu + host)
    end = max(e["ts"] + e["dur"] for e in gpu + host)
    per_stream: dict = collections.defaultdict(list)
    for e in gpu:
        per_stream[e.get("args", {}).get("stream")].append((e["ts"], e["ts"] + e["dur"]))
    stream_busy = {s: sum(b - a for a, b in _union(iv)) for s, iv in per_stream.items()}
    chosen = None
    if stream is not None:
        if stream != "compute":
            raise ValueError(f"stream must be None or 'compute', got {stream!r}")
        chosen = max(stream_busy, key=stream_busy.get)
        gpu = [e for e in gpu if e.get("args", {}).get("stream") == chosen]
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    result = Gaps(span_us=end - begin, busy_us=sum(b - a for a, b in busy), stream_busy_us=stream_busy,
                  stream=chosen)
    blocking = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in host
                      if e.get("cat") in ("cuda_runtime", "cuda_driver") and any(b in e["name"] for b in BLOCKING))
    launch_of = {e["args"]["correlation"]: e for e in host
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    operations: dict = collections.defaultdict(list)  # thread -> its operations, by start
    for e in host:
        if e.get("cat") in OPERATION_KINDS:
            operations[e["tid"]].append(e)
    for ops in operations.values():
        ops.sort(key=lambda e: e["ts"])
    starts = [e["ts"] for e in gpu]
    for (_, gap_start), (gap_end, _) in zip(busy, busy[1:], strict=False):
        if gap_end - gap_start <= min_gap_us:
            continue
        result.gaps += 1
        result.gap_us += gap_end - gap_start
        following = gpu[bisect.bisect_left(starts, gap_end)]
        launch = launch_of.get(following.get("args", {}).get("correlation"))
        if launch is None or launch["ts"] <= gap_start:
            continue  # launched in time: the gap is the GPU's own (a dependency, a wait on another stream)
        result.host_late_us += gap_end - gap_start
        thread = launch["tid"]
        outer = next((o["name"] for o in operations[thread]
                      if o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]), "(no operation recorded)")
        result.late_by_thread[thread] += gap_end - gap_start
        result.late_by_operation[(thread, outer)] += gap_end - gap_start
        result.late_count[(thread, outer)] += 1
        for start, stop, name in blocking:
            if start >= gap_end:
                break
            overlap = min(stop, gap_end) - max(start, gap_start)
            if overlap > 0:
                result.blocked_by[name] += overlap
    return result


def report(path: str, gaps: Gaps, top: int) -> str:
    ms = 1e-3
    what = "GPU busy" if gaps.stream is None else f"stream {gaps.stream} (the busiest) busy"
    lines = [f"{path}: span {gaps.span_us * ms:.1f} ms, {what} {gaps.busy_us * ms:.1f} ms "
             f"({gaps.busy_us / max(gaps.span_us, 1):.0%}), idle {(gaps.span_us - gaps.busy_us) * ms:.1f} ms"]
    for stream, us in sorted(gaps.stream_busy_us.items(), key=lambda kv: -kv[1]):
        lines.append(f"  stream {stream}: busy {us * ms:.1f} ms")
    lines.append(f"  {gaps.gaps} gaps, {gaps.gap_us * ms:.1f} ms; the host launched the next kernel late in "
                 f"{gaps.host_late_us * ms:.1f} ms of them; by thread: "
                 + ", ".join(f"{t} {us * ms:.1f} ms" for t, us in gaps.late_by_thread.most_common()))
    if gaps.blocked_by:
        lines.append("  in those gaps a host thread was blocked in: "
                     + ", ".join(f"{name} {us * ms:.1f} ms" for name, us in gaps.blocked_by.most_common()))
    for (thread, op), us in gaps.late_by_operation.most_common(top):
        lines.append(f"    {us * ms:8.2f} ms {gaps.late_count[(thread, op)]:6d} gaps  thread {thread}  {op[:90]}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome trace files (.json or .json.gz)")
    p.add_argument("--min-gap-us", type=float, default=10.0, help="ignore idle gaps up to this long (microseconds)")
    p.add_argument("--top", type=int, default=15, help="operations listed per trace")
    p.add_argument("--stream", choices=["compute"], help="the gaps of the busiest stream alone, not of the union")
    a = p.parse_args(argv)
    for path in a.traces:
        print(report(path, analyse(load(path), a.min_gap_us, a.stream), a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
