"""trace_gaps.py on hand-made traces: the busy union, and each gap charged to the thread that launched late."""

import gzip
import json

import pytest

import trace_gaps


def _kernel(ts, dur, corr, stream=7):
    return {"ph": "X", "cat": "kernel", "name": f"k{corr}", "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": corr}}


def _launch(ts, corr, tid):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
            "args": {"correlation": corr}}


def _op(name, ts, dur, tid):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {}}


def _trace():
    return [
        _op("forward", 0, 10, tid=1), _launch(1, 1, tid=1), _kernel(2, 10, 1),
        _launch(5, 2, tid=1), _kernel(30, 10, 2),  # queued in time: the 18 us gap is the GPU's own
        _op("sample", 60, 40, tid=2), _launch(80, 3, tid=2), _kernel(100, 10, 3),  # launched 40 us into a 60 us gap
        _launch(81, 4, tid=2), _kernel(102, 20, 4, stream=9),  # overlaps stream 7: no gap of its own
    ]


def test_gaps_are_charged_to_the_late_launching_thread():
    g = trace_gaps.analyse(_trace(), min_gap_us=5)
    assert g.busy_us == 10 + 10 + 22  # [2, 12], [30, 40], [100, 110] with [102, 122]
    assert g.stream_busy_us == {7: 30, 9: 20}
    assert g.gaps == 2 and g.gap_us == 18 + 60
    assert g.host_late_us == 60
    assert dict(g.late_by_thread) == {2: 60}
    assert dict(g.late_by_operation) == {(2, "sample"): 60}


def test_short_gaps_are_ignored():
    g = trace_gaps.analyse(_trace(), min_gap_us=100)
    assert g.gaps == 0 and g.host_late_us == 0


def test_cli_reads_gzipped_traces(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert trace_gaps.main([str(path), "--min-gap-us", "5"]) == 0
    out = capsys.readouterr().out
    assert "GPU busy 0.0 ms" in out and "thread 2" in out and "sample" in out


def test_a_trace_without_gpu_activity_says_so():
    with pytest.raises(ValueError, match="no GPU activity"):
        trace_gaps.analyse([_op("forward", 0, 10, tid=1)])


def test_the_compute_streams_own_gaps_and_the_hosts_blocking_calls_in_them():
    """With stream="compute" a gap of the busiest stream counts though a copy on another stream fills it (the union
    hides it), and a synchronize the late thread was blocked in during that gap is reported."""
    events = [
        _launch(0, 1, tid=1), _kernel(1, 50, 1),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 40, "dur": 60, "args": {"stream": 13}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 45, "dur": 45, "tid": 1,
         "args": {}},
        _op("aten::mm", 90, 5, tid=1), _launch(91, 2, tid=1), _kernel(92, 30, 2),  # stream 7 idle 51-92
    ]
    union = trace_gaps.analyse(events, min_gap_us=5)
    assert union.gaps == 0  # the copy covers stream 7's gap
    g = trace_gaps.analyse(events, min_gap_us=5, stream="compute")
    assert g.stream == 7 and g.busy_us == 80
    assert g.gaps == 1 and g.gap_us == 41 and g.host_late_us == 41
    assert dict(g.late_by_operation) == {(1, "aten::mm"): 41}
    assert dict(g.blocked_by) == {"cudaEventSynchronize": 39}  # 51-90 of the 45-90 call
    assert "blocked in: cudaEventSynchronize" in trace_gaps.report("t", g, 5)
