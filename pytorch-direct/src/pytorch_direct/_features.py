"""Layer 5: the index features of a call, from a small sample of its indices (order, estimated duplicates), and the
synthetic index streams that calibration and the benchmarks use."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._cell import Features

# Index sample sizes: a contiguous window for the order, strided positions for the duplicates.
ORDER_WINDOW = 2048
DUPLICATE_SAMPLE = 4096
# Consecutive indices whose rows lie within this many bytes count as "near" (clustered reads).
NEAR_BYTES = 64 << 10


def estimate_duplicates(count: int, rows: int, sample: int, distinct: int, distinct_quarter: int) -> float:
    """Estimated fraction of `count` indices that repeat an earlier one, from a sample of `sample` of them holding
    `distinct` distinct values (and `distinct_quarter` in its first quarter). Distinct values grow like a power of
    the number drawn (``n ** a``: a = 1 for distinct indices, a < 1 for skewed ones such as Zipf); a is fitted on
    the two sample sizes and extrapolated to `count`. Exact when the sample is the whole index."""
    if count <= 0 or sample <= 0:
        return 0.0
    if sample >= count:
        return 1.0 - distinct / count
    quarter = max(1, sample // 4)
    a = 1.0
    if distinct_quarter > 0 and distinct > 0:
        a = min(1.0, max(0.0, math.log(distinct / distinct_quarter) / math.log(sample / quarter)))
    expected = distinct * (count / sample) ** a
    expected = min(expected, count, max(rows, 1))
    return max(0.0, 1.0 - expected / count)


def index_features(idx: Tensor, rows: int, row_bytes: int) -> tuple[Features, int, int]:
    """Features of 1-D indices (on the GPU, or the CPU), and their min and max (for the bounds check), with one
    host round trip. About 15 small kernels on samples of a few thousand indices, whatever the count."""
    n = idx.numel()
    window = idx[: min(n, ORDER_WINDOW)]
    step = window[1:] - window[:-1]
    near_rows = max(1, NEAR_BYTES // max(row_bytes, 1))
    sample = idx[:: max(1, n // DUPLICATE_SAMPLE)][:DUPLICATE_SAMPLE]
    s = sample.numel()
    values, position = torch.sort(sample, stable=True)
    first = torch.ones(s, dtype=torch.bool, device=idx.device)
    if s > 1:
        torch.ne(values[1:], values[:-1], out=first[1:])
    lo, hi = torch.aminmax(idx)
    stats = torch.stack([
        lo.long(), hi.long(), (step >= 0).sum(), (step.abs() <= near_rows).sum(), first.sum(),
        (first & (position < max(1, s // 4))).sum(), (step == 0).sum(),
    ]).tolist()
    lo, hi, ascending, near, distinct, distinct_quarter, repeats = stats
    pairs = max(window.numel() - 1, 1)
    # An index equal to the one before it repeats a row. In sorted indices every repeat is one of those, so the
    # window counts them where the strided sample cannot (its entries lie far apart in a sorted index and are all
    # distinct): 1M sorted uniform rows of a 1M-row table repeat 37% and were estimated at 0, so dedupe was never
    # measured on them.
    duplicates = max(estimate_duplicates(n, rows, s, distinct, distinct_quarter), repeats / pairs if n > 1 else 0.0)
    features = Features(ascending / pairs if n > 1 else 1.0, near / pairs if n > 1 else 1.0, duplicates)
    return features, lo, hi


def synthetic_indices(pattern: str, count: int, rows: int, generator: torch.Generator, *, zipf_s: float = 1.0,
                      cluster: int = 32) -> Tensor:
    """int64 row indices on the generator's device: ``uniform`` (random rows), ``sorted`` (the same, ascending),
    ``clustered`` (runs of `cluster` consecutive rows at random places), ``zipf`` (rank r drawn with probability
    ~ 1 / r**zipf_s, ranks spread over the table by a fixed permutation, :func:`zipf_rows`)."""
    device = generator.device
    if pattern in ("uniform", "sorted"):
        idx = torch.randint(0, rows, (count,), device=device, generator=generator)
        return torch.sort(idx).values if pattern == "sorted" else idx
    if pattern == "clustered":
        run = max(1, min(cluster, rows))
        starts = torch.randint(0, rows - run + 1, (-(-count // run),), device=device, generator=generator)
        return (starts[:, None] + torch.arange(run, device=device)).reshape(-1)[:count]
    if pattern == "zipf":
        u = torch.rand(count, device=device, generator=generator, dtype=torch.float64)
        if abs(zipf_s - 1.0) < 1e-9:
            x = torch.exp(u * math.log(rows))
        else:
            a = 1.0 - zipf_s
            x = ((float(rows) ** a - 1.0) * u + 1.0) ** (1.0 / a)
        rank = (x.floor().long() - 1).clamp_(0, rows - 1)
        return zipf_rows(rank, rows)
    raise ValueError(f"unknown index pattern {pattern!r}: uniform, sorted, clustered or zipf")


def zipf_rows(rank: Tensor, rows: int) -> Tensor:
    """The table row of each Zipf rank (0 = the most frequent): a fixed bijection that spreads the hot ranks all
    over the table."""
    return (rank * coprime_step(rows)) % rows


def coprime_step(rows: int) -> int:
    step = max(1, min(int(rows * 0.6180339887), (1 << 32) - 1)) | 1
    while math.gcd(step, rows) != 1:
        step += 2
    return step
