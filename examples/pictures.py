"""Small PNG pictures for the demo without a plotting library: an RGB canvas
with lines, boxes, dots and 5x7 bitmap text, written with zlib.

``loss_curve_png`` draws a training loss curve with axes, ticks and labels;
``top_down_png`` draws scans seen from above, one panel per labelling, with a
class legend.

>>> c = Canvas(40, 20)
>>> c.text(2, 2, "L1", (0, 0, 0))  # returns the x after the text
14
>>> (c.pixels[2:9, 2, 0] == 0).tolist(), (c.pixels[8, 2:7, 0] == 0).tolist()  # the L's two strokes
([True, True, True, True, True, True, True], [True, True, True, True, True])
>>> png_bytes(c.pixels)[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
True
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["CLASS_COLOURS", "Canvas", "class_colours", "loss_curve_png", "png_bytes", "top_down_png"]

Colour = tuple[int, int, int]

#: One colour per class: ground, building, car, pole, vegetation.
CLASS_COLOURS: tuple[Colour, ...] = (
    (150, 150, 150),
    (214, 96, 77),
    (33, 102, 172),
    (240, 190, 0),
    (27, 150, 60),
)

# 5x7 glyphs, one row per string, "#" set. Lower case letters draw as upper case.
_GLYPHS = {
    "0": [".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."],
    "1": ["..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."],
    "2": [".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"],
    "3": ["#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."],
    "4": ["...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."],
    "5": ["#####", "#....", "####.", "....#", "....#", "#...#", ".###."],
    "6": ["..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."],
    "7": ["#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."],
    "8": [".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."],
    "9": [".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."],
    "A": [".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"],
    "B": ["####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."],
    "C": [".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."],
    "D": ["###..", "#..#.", "#...#", "#...#", "#...#", "#..#.", "###.."],
    "E": ["#####", "#....", "#....", "####.", "#....", "#....", "#####"],
    "F": ["#####", "#....", "#....", "####.", "#....", "#....", "#...."],
    "G": [".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".####"],
    "H": ["#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"],
    "I": [".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."],
    "J": ["..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."],
    "K": ["#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"],
    "L": ["#....", "#....", "#....", "#....", "#....", "#....", "#####"],
    "M": ["#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"],
    "N": ["#...#", "#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#"],
    "O": [".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."],
    "P": ["####.", "#...#", "#...#", "####.", "#....", "#....", "#...."],
    "Q": [".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"],
    "R": ["####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"],
    "S": [".####", "#....", "#....", ".###.", "....#", "....#", "####."],
    "T": ["#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."],
    "U": ["#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."],
    "V": ["#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."],
    "W": ["#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."],
    "X": ["#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"],
    "Y": ["#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."],
    "Z": ["#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"],
    " ": [".....", ".....", ".....", ".....", ".....", ".....", "....."],
    ".": [".....", ".....", ".....", ".....", ".....", ".##..", ".##.."],
    ",": [".....", ".....", ".....", ".....", ".##..", "..#..", ".#..."],
    ":": [".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."],
    "-": [".....", ".....", ".....", "#####", ".....", ".....", "....."],
    "+": [".....", "..#..", "..#..", "#####", "..#..", "..#..", "....."],
    "=": [".....", ".....", "#####", ".....", "#####", ".....", "....."],
    "/": [".....", "....#", "...#.", "..#..", ".#...", "#....", "....."],
    "(": ["...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."],
    ")": [".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."],
    "%": ["##...", "##..#", "...#.", "..#..", ".#...", "#..##", "...##"],
    "_": [".....", ".....", ".....", ".....", ".....", ".....", "#####"],
}
_FONT = {k: np.array([[c == "#" for c in row] for row in v]) for k, v in _GLYPHS.items()}


class Canvas:
    """An RGB image ``pixels`` ``(H, W, 3)`` uint8 on a white background."""

    def __init__(self, width: int, height: int, background: Colour = (255, 255, 255)) -> None:
        self.pixels = np.empty((height, width, 3), np.uint8)
        self.pixels[:] = background
        self.width, self.height = width, height

    def box(self, x0: int, y0: int, x1: int, y1: int, colour: Colour, fill: bool = False) -> None:
        """A rectangle outline (or filled) with corners (x0, y0), (x1, y1) inclusive."""
        x0, x1 = sorted((max(x0, 0), min(x1, self.width - 1)))
        y0, y1 = sorted((max(y0, 0), min(y1, self.height - 1)))
        if fill:
            self.pixels[y0 : y1 + 1, x0 : x1 + 1] = colour
            return
        self.pixels[y0, x0 : x1 + 1] = colour
        self.pixels[y1, x0 : x1 + 1] = colour
        self.pixels[y0 : y1 + 1, x0] = colour
        self.pixels[y0 : y1 + 1, x1] = colour

    def polyline(self, xs: np.ndarray, ys: np.ndarray, colour: Colour, width: int = 1) -> None:
        """Straight segments through the points (pixel coordinates), clipped."""
        for (ax, ay), (bx, by) in zip(
            zip(xs[:-1], ys[:-1], strict=True), zip(xs[1:], ys[1:], strict=True), strict=True
        ):
            n = int(max(abs(bx - ax), abs(by - ay))) + 1
            px = np.rint(np.linspace(ax, bx, n)).astype(int)
            py = np.rint(np.linspace(ay, by, n)).astype(int)
            self.dots(px, py, colour, size=width)

    def dots(self, xs: np.ndarray, ys: np.ndarray, colour, size: int = 1) -> None:
        """Square dots of ``size`` pixels; ``colour`` is one colour or ``(n, 3)``."""
        xs, ys = np.asarray(xs, int), np.asarray(ys, int)
        col = np.broadcast_to(np.asarray(colour, np.uint8), (len(xs), 3))
        for dy in range(size):
            for dx in range(size):
                x, y = xs + dx - size // 2, ys + dy - size // 2
                ok = (x >= 0) & (x < self.width) & (y >= 0) & (y < self.height)
                self.pixels[y[ok], x[ok]] = col[ok]

    def text(self, x: int, y: int, s: str, colour: Colour, scale: int = 1) -> int:
        """Draw ``s`` with its top-left at (x, y); returns the x after it."""
        for ch in s:
            glyph = _FONT.get(ch.upper(), _FONT[" "])
            big = np.kron(glyph, np.ones((scale, scale), bool))
            h, w = big.shape
            region = self.pixels[y : y + h, x : x + w]
            region[big[: region.shape[0], : region.shape[1]]] = colour
            x += 6 * scale
        return x

    @staticmethod
    def text_width(s: str, scale: int = 1) -> int:
        return 6 * scale * len(s) - scale


def png_bytes(pixels: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of ``(H, W, 3)`` uint8 pixels."""
    h, w, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[row].tobytes() for row in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    span = max(hi - lo, 1e-12)
    raw = span / count
    mag = 10 ** np.floor(np.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = np.ceil(lo / step) * step
    return [float(v) for v in np.arange(first, hi + step * 0.5, step) if v <= hi + 1e-9]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.2g}"


def loss_curve_png(
    path: Path, losses: Sequence[float], *, title: str = "training loss", smooth: int = 10
) -> Path:
    """Loss per step (light) and its moving average over ``smooth`` steps (dark)."""
    losses = np.asarray(losses, np.float64)
    c = Canvas(720, 440)
    left, right, top, bottom = 80, 700, 50, 380
    c.text(left, 16, title, (0, 0, 0), scale=2)
    c.box(left, top, right, bottom, (0, 0, 0))
    steps = np.arange(1, len(losses) + 1)
    lo, hi = 0.0, float(losses.max()) * 1.05 if len(losses) else 1.0
    x_hi = max(len(losses), 2)

    def px(s: np.ndarray) -> np.ndarray:
        return left + (s - 1) / (x_hi - 1) * (right - left)

    def py(v: np.ndarray) -> np.ndarray:
        return bottom - (v - lo) / (hi - lo) * (bottom - top)

    for v in _ticks(lo, hi):
        y = int(py(np.array(v)))
        c.polyline(np.array([left, right]), np.array([y, y]), (230, 230, 230))
        c.polyline(np.array([left - 5, left]), np.array([y, y]), (0, 0, 0))
        label = _fmt(v)
        c.text(left - 10 - c.text_width(label, 2), y - 7, label, (0, 0, 0), scale=2)
    for v in _ticks(1, x_hi):
        x = int(px(np.array(v)))
        c.polyline(np.array([x, x]), np.array([bottom, bottom + 5]), (0, 0, 0))
        label = _fmt(v)
        c.text(x - c.text_width(label, 2) // 2, bottom + 10, label, (0, 0, 0), scale=2)
    c.box(left, top, right, bottom, (0, 0, 0))
    if len(losses) > 1:
        c.polyline(px(steps), py(losses), (150, 190, 230))
        k = max(1, min(smooth, len(losses)))
        avg = np.convolve(losses, np.ones(k) / k, mode="valid")
        c.polyline(px(steps[k - 1 :]), py(avg), (20, 60, 160), width=2)
    c.text((left + right) // 2 - c.text_width("step", 2) // 2, bottom + 34, "step", (0, 0, 0), 2)
    c.text(8, top - 4, "loss", (0, 0, 0), scale=2)
    legend = f"per step (light), mean of {smooth} (dark)"
    c.text(right - c.text_width(legend, 2), top + 8, legend, (20, 60, 160), scale=2)
    path = Path(path)
    path.write_bytes(png_bytes(c.pixels))
    return path


def class_colours(n: int) -> np.ndarray:
    """``(n, 3)`` uint8 colours: :data:`CLASS_COLOURS`, then evenly spread hues.

    >>> class_colours(7)[:5].tolist() == [list(c) for c in CLASS_COLOURS], class_colours(7).shape
    (True, (7, 3))
    """
    out = [np.array(c, np.float64) for c in CLASS_COLOURS[:n]]
    for k in range(len(out), n):
        hue = (k * 0.618034) % 1.0
        rgb = np.clip(np.abs((hue * 6 + np.array([0.0, 4.0, 2.0])) % 6 - 3) - 1, 0, 1)
        out.append(40 + 180 * rgb)
    return np.array(out, np.uint8).reshape(n, 3)


def top_down_png(
    path: Path,
    points: np.ndarray,
    panels: Sequence[tuple[str, np.ndarray]],
    class_names: Sequence[str],
    *,
    extent: float = 40.0,
    size: int = 480,
) -> Path:
    """The points seen from above (x right, y up, ``extent`` metres around the
    sensor), one panel per ``(title, labels)``, coloured by class, with a legend."""
    pts = np.asarray(points, np.float64)
    order = np.argsort(pts[:, 2])  # higher points drawn last, on top
    pad, head = 12, 40
    width = len(panels) * (size + pad) + pad
    # Labels past the named classes (unlabeled points) get colours of their own.
    top = max((int(np.max(lab)) + 1 for _, lab in panels if len(lab)), default=0)
    palette = class_colours(max(len(class_names), top))
    # Legend rows: entries wrap at the canvas' width.
    rows, x = 1, pad
    for name in class_names:
        step = 20 + Canvas.text_width(name, 2) + 2 + 18
        if x + step > width and x > pad:
            rows, x = rows + 1, pad
        x += step
    legend_h = 40 + 22 * (rows - 1)
    c = Canvas(width, size + head + legend_h + pad)
    inside = (np.abs(pts[:, 0]) < extent) & (np.abs(pts[:, 1]) < extent)
    for i, (title, labels) in enumerate(panels):
        x0 = pad + i * (size + pad)
        c.text(x0, 12, title, (0, 0, 0), scale=2)
        c.box(x0 - 1, head - 1, x0 + size, head + size, (0, 0, 0))
        sel = order[inside[order]]
        xs = x0 + (pts[sel, 0] + extent) / (2 * extent) * (size - 1)
        ys = head + (extent - pts[sel, 1]) / (2 * extent) * (size - 1)
        colours = palette[np.asarray(labels)[sel]]
        c.dots(xs, ys, colours, size=2)
    x = pad
    y = head + size + 14
    for k, name in enumerate(class_names):
        if x + 20 + Canvas.text_width(name, 2) + 20 > width and x > pad:
            x, y = pad, y + 22
        c.box(x, y, x + 14, y + 14, tuple(int(v) for v in palette[k]), fill=True)
        x = c.text(x + 20, y, name, (0, 0, 0), scale=2) + 18
    note = f"{2 * extent:.0f} m across"
    c.text(c.width - pad - c.text_width(note, 2), y, note, (90, 90, 90), scale=2)
    path = Path(path)
    path.write_bytes(png_bytes(c.pixels))
    return path
