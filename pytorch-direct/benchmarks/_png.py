"""A dependency-free PNG line plot for machines without matplotlib: one panel per (op, density, order), x = log2
row bytes, y = GB/s from 0 to the maximum, one colour per column (order given by the caller). No text."""

from __future__ import annotations

import math
import struct
import zlib

COLOURS = [(0, 0, 0), (230, 120, 0), (120, 120, 120), (200, 0, 0), (0, 90, 200), (0, 160, 60), (150, 0, 180),
           (0, 180, 180)]


def _png(width, height, pixels) -> bytes:
    raw = b"".join(b"\x00" + bytes(pixels[y * width * 3:(y + 1) * width * 3]) for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def line_grid_png(results, path, columns, panel=(320, 220)):
    panels = sorted({(r["op"], r["density"], r["order"]) for r in results if r["dtype"] == "f32"})
    if not panels:
        return
    cols = 3
    nrows = math.ceil(len(panels) / cols)
    pw, ph = panel
    width, height = pw * cols, ph * nrows
    px = bytearray([255] * (width * height * 3))

    def dot(x, y, c):
        if 0 <= x < width and 0 <= y < height:
            i = (y * width + x) * 3
            px[i:i + 3] = bytes(c)

    def line(x0, y0, x1, y1, c):
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(steps + 1):
            x = round(x0 + (x1 - x0) * s / steps)
            y = round(y0 + (y1 - y0) * s / steps)
            dot(x, y, c)
            dot(x, y + 1, c)

    for k, key in enumerate(panels):
        ox, oy = (k % cols) * pw, (k // cols) * ph
        rs = sorted((r for r in results if r["dtype"] == "f32" and (r["op"], r["density"], r["order"]) == key),
                    key=lambda r: r["row_bytes"])
        ymax = max([r.get(c, 0) for r in rs for c in columns if not math.isnan(r.get(c, float("nan")))] + [1e-9])
        xs = [math.log2(r["row_bytes"]) for r in rs]
        x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        line(ox + 20, oy + ph - 20, ox + pw - 10, oy + ph - 20, (0, 0, 0))
        line(ox + 20, oy + 10, ox + 20, oy + ph - 20, (0, 0, 0))
        for ci, c in enumerate(columns):
            pts = [(ox + 20 + (x - x_lo) / (x_hi - x_lo) * (pw - 40), oy + ph - 20 - r.get(c, float("nan")) / ymax * (ph - 40))
                   for x, r in zip(xs, rs)]
            pts = [(round(a), round(b)) for a, b in pts if not math.isnan(b)]
            for (a, b), (c2, d) in zip(pts, pts[1:]):
                line(a, b, c2, d, COLOURS[ci % len(COLOURS)])
    with open(path, "wb") as f:
        f.write(_png(width, height, px))
