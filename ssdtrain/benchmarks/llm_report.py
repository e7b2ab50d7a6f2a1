"""Reporting shared by the LLM benchmark suites (``llm.py`` and its ``--suite budget / rok / trainer``).

The result table, the CSV, the verdict line of a target and the run's end are written the same way by every suite;
what differs (the columns, the ratios, the targets) stays with the suite.
"""

from __future__ import annotations

import csv
import time

FAILED = ("error", "crashed", "timeout")  # a row with one of these statuses makes the run exit 1


def fmt(v, spec: str) -> str:
    """`v` formatted with `spec` (e.g. ``"{:9.1f} ms"``) if it is a number, else ``""``."""
    return spec.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else ""


def format_table(rows, columns, *, detail_chars: int) -> str:
    """A header, a rule, a line per row. `columns`: (title, key, width, spec): a text column (left-aligned) when
    `spec` is None, else a number column (right-aligned, formatted with ``f"{width}{spec}"``, blank when the row has
    no number there). The line ends with the row's plan, else the first `detail_chars` characters of its detail."""
    head = " ".join(f"{title:<{w}}" if spec is None else f"{title:>{w}}" for title, _, w, spec in columns) + "  plan"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [
            f"{r.get(key, ''):<{w}}" if spec is None else f"{fmt(r.get(key), '{:' + str(w) + spec + '}'):>{w}}"
            for _, key, w, spec in columns
        ]
        lines.append(" ".join(cells) + f"  {r.get('plan', '') or str(r.get('detail', ''))[:detail_chars]}")
    return "\n".join(lines)


def with_losses(r: dict) -> dict:
    """`r` with its losses as one CSV field: space-separated, 6 decimals."""
    return {**r, "losses": " ".join(f"{x:.6f}" for x in r.get("losses", []))}


def write_csv(path, rows, columns) -> None:
    """One line per row, `columns` in order (keys of a row not among them are left out, missing ones empty)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def ok_row(results, model: str, policy: str) -> dict | None:
    """The first row of `model` and `policy` that ran to the end, or None."""
    return next((r for r in results if r["model"] == model and r["policy"] == policy and r["status"] == "ok"), None)


def verdict(what: str, best: dict | None, met: bool, extra: str = "") -> str:
    """A target's line: `what`, the ssdtrain row that decides it (`best`, None: no run at that memory), and
    MET or MISSED."""
    if best is None:
        return f"{what}: no ssdtrain run at that memory -> MISSED"
    # No ratio where the run had no keep row to divide by (e.g. --groups compiled alone).
    ratio = f" ({best['x_keep_time']:.2f}x keep)" if best.get("x_keep_time") else ""
    return f"{what}: {best['policy']} {best['step_ms']:.1f} ms{ratio}, {best['peak_gib']:.2f} GiB{extra} -> " + (
        "MET" if met else "MISSED"
    )


def finish(start: float, results) -> int:
    """Print the run's total time; the exit code: 1 if a row failed, else 0."""
    print(f"\n# total {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if [r for r in results if r["status"] in FAILED] else 0
