"""A dependency-free PNG line plot for machines without matplotlib: one panel per entry of ``panels`` (title, x
values, {label: y values}), x on a log2 scale, y from 0 to the panel's maximum (written in the title), one colour per
label, with a legend. Text uses a 3x5 pixel font drawn at 2x."""

from __future__ import annotations

import math
import struct
import zlib

COLOURS = [(200, 0, 0), (0, 90, 200), (230, 120, 0), (0, 0, 0), (0, 160, 60), (150, 0, 180), (120, 120, 120),
           (0, 180, 180)]


# 3x5 glyphs, rows top to bottom, 3 bits each (4 = left pixel).
_FONT = {
    "a": (2, 5, 7, 5, 5), "b": (6, 5, 6, 5, 6), "c": (3, 4, 4, 4, 3), "d": (6, 5, 5, 5, 6), "e": (7, 4, 6, 4, 7),
    "f": (7, 4, 6, 4, 4), "g": (3, 4, 5, 5, 3), "h": (5, 5, 7, 5, 5), "i": (7, 2, 2, 2, 7), "j": (1, 1, 1, 5, 2),
    "k": (5, 5, 6, 5, 5), "l": (4, 4, 4, 4, 7), "m": (5, 7, 7, 5, 5), "n": (6, 5, 5, 5, 5), "o": (2, 5, 5, 5, 2),
    "p": (6, 5, 6, 4, 4), "q": (2, 5, 5, 6, 3), "r": (6, 5, 6, 5, 5), "s": (3, 4, 2, 1, 6), "t": (7, 2, 2, 2, 2),
    "u": (5, 5, 5, 5, 7), "v": (5, 5, 5, 5, 2), "w": (5, 5, 7, 7, 5), "x": (5, 5, 2, 5, 5), "y": (5, 5, 2, 2, 2),
    "z": (7, 1, 2, 4, 7), "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (6, 1, 2, 4, 7), "3": (6, 1, 2, 1, 6),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 6, 1, 6), "6": (3, 4, 7, 5, 7), "7": (7, 1, 2, 2, 2), "8": (7, 5, 7, 5, 7),
    "9": (7, 5, 7, 1, 6), ".": (0, 0, 0, 0, 2), "%": (5, 1, 2, 4, 5), ":": (0, 2, 0, 2, 0), "/": (1, 1, 2, 4, 4),
    "-": (0, 0, 7, 0, 0), " ": (0, 0, 0, 0, 0),
}


def _png(width, height, pixels) -> bytes:
    raw = b"".join(b"\x00" + bytes(pixels[y * width * 3:(y + 1) * width * 3]) for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def line_grid_png(panels, path, panel=(360, 240)):
    if not panels:
        return
    cols = min(5, len(panels))
    nrows = math.ceil(len(panels) / cols)
    pw, ph = panel
    width, height = pw * cols, ph * nrows
    px = bytearray([255] * (width * height * 3))

    def dot(x, y, c):
        if 0 <= x < width and 0 <= y < height:
            i = (y * width + x) * 3
            px[i:i + 3] = bytes(c)

    def text(x, y, string, c=(0, 0, 0), scale=2):
        for ch in string.lower():
            glyph = _FONT.get(ch, _FONT[" "])
            for row, bits in enumerate(glyph):
                for col in range(3):
                    if bits & (4 >> col):
                        for dy in range(scale):
                            for dx in range(scale):
                                dot(x + col * scale + dx, y + row * scale + dy, c)
            x += 4 * scale

    def line(x0, y0, x1, y1, c):
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(steps + 1):
            x = round(x0 + (x1 - x0) * s / steps)
            y = round(y0 + (y1 - y0) * s / steps)
            dot(x, y, c)
            dot(x, y + 1, c)

    labels = list(dict.fromkeys(label for _, _, lines in panels for label in lines))
    for k, (title, xs_raw, lines) in enumerate(panels):
        ox, oy = (k % cols) * pw, (k // cols) * ph
        ymax = max([y for ys in lines.values() for y in ys if not math.isnan(y)] + [1e-9])
        xs = [math.log2(x) for x in xs_raw]
        x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        text(ox + 24, oy + 4, f"{title} max {ymax:.1f}gb/s", scale=1)
        text(ox + 24, oy + ph - 14, f"{xs_raw[0]}b", scale=1)
        text(ox + pw - 40, oy + ph - 14, f"{xs_raw[-1]}b", scale=1)
        line(ox + 20, oy + ph - 20, ox + pw - 10, oy + ph - 20, (0, 0, 0))
        line(ox + 20, oy + 10, ox + 20, oy + ph - 20, (0, 0, 0))
        for label, ys in lines.items():
            colour = COLOURS[labels.index(label) % len(COLOURS)]
            pts = [(ox + 20 + (x - x_lo) / (x_hi - x_lo) * (pw - 40), oy + ph - 20 - y / ymax * (ph - 40))
                   for x, y in zip(xs, ys, strict=True)]
            pts = [(round(a), round(b)) for a, b in pts if not math.isnan(b)]
            for (a, b), (c2, d) in zip(pts, pts[1:], strict=False):  # consecutive pairs
                line(a, b, c2, d, colour)
    for ci, label in enumerate(labels):  # legend over the first panel
        lx, ly = 30 + (ci % 4) * 80, 20 + (ci // 4) * 12
        line(lx, ly + 5, lx + 12, ly + 5, COLOURS[ci % len(COLOURS)])
        text(lx + 16, ly + 2, label, COLOURS[ci % len(COLOURS)], scale=1)
    with open(path, "wb") as f:
        f.write(_png(width, height, px))
