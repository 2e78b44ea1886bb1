"""The demo's and the segment command's pictures, drawn with matplotlib.

``loss_curve_png`` plots a training loss per step with its moving average;
``top_down_png`` shows scans from above, one panel per labelling, coloured
by class with a class legend. Both draw on a ``matplotlib.figure.Figure``
with the Agg canvas (headless, no display) and leave pyplot's global state
and the user's chosen backend alone.

>>> import tempfile
>>> from pathlib import Path
>>> from matplotlib.image import imread
>>> out = Path(tempfile.mkdtemp())
>>> imread(loss_curve_png(out / "loss.png", np.linspace(2.0, 0.2, 50))).shape
(440, 720, 4)
>>> points = np.random.default_rng(0).uniform(-10, 10, (500, 3))
>>> labels = (points[:, 0] > 0).astype(int)
>>> path = top_down_png(out / "scan.png", points, [("truth", labels)], ["left", "right"], extent=10)
>>> imread(path).shape
(555, 520, 4)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from examples.palette import CLASS_COLOURS, UNLABELED_COLOUR, class_colours

__all__ = ["CLASS_COLOURS", "UNLABELED_COLOUR", "class_colours", "loss_curve_png", "top_down_png"]

DPI = 100


def _save(fig: Figure, path: Path) -> Path:
    path = Path(path)
    FigureCanvasAgg(fig).print_png(path)
    return path


def loss_curve_png(
    path: Path, losses: Sequence[float], *, title: str = "training loss", smooth: int = 10
) -> Path:
    """A 720x440 PNG of the loss per step and its moving average over
    ``smooth`` steps, with labelled axes and a legend; returns ``path``."""
    losses = np.asarray(losses, np.float64)
    steps = np.arange(1, len(losses) + 1)
    fig = Figure(figsize=(7.2, 4.4), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(steps, losses, color="#96bee6", linewidth=1, label="per step")
    k = max(1, min(smooth, len(losses)))
    if len(losses):
        avg = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], avg, color="#143ca0", linewidth=2, label=f"mean of {k} steps")
    ax.set(title=title, xlabel="step", ylabel="loss (cross-entropy)")
    ax.set_xlim(1, max(len(losses), 2))
    ax.set_ylim(bottom=0)
    ax.grid(True, color="#e6e6e6")
    ax.legend(loc="upper right")
    return _save(fig, path)


def top_down_png(
    path: Path,
    points: np.ndarray,
    panels: Sequence[tuple[str, np.ndarray]],
    class_names: Sequence[str],
    *,
    extent: float = 40.0,
) -> Path:
    """The points seen from above (x right, y up, ``extent`` metres around
    the sensor), one panel per ``(title, labels)``, each point coloured by
    its class (:func:`class_colours`; labels past ``class_names`` are
    unlabeled, light grey), with a legend of the classes below the panels.

    The PNG is ``500 * len(panels) + 20`` pixels wide and ``530 + 25 *
    rows`` high, ``rows`` being the legend's rows (about 150 pixels an
    entry); returns ``path``.
    """
    pts = np.asarray(points, np.float64)
    order = np.argsort(pts[:, 2])  # higher points drawn last, on top
    inside = (np.abs(pts[:, 0]) < extent) & (np.abs(pts[:, 1]) < extent)
    sel = order[inside[order]]
    unknown = len(class_names)
    palette = np.concatenate([class_colours(unknown), np.array([UNLABELED_COLOUR], np.uint8)])
    shown = [np.minimum(np.asarray(labels)[sel], unknown) for _, labels in panels]
    names = list(class_names) + (["unlabeled"] if any(np.any(lab == unknown) for lab in shown) else [])
    width = 500 * len(panels) + 20
    columns = max(1, min(len(names), width // 150))
    rows = -(-len(names) // columns)
    fig = Figure(figsize=(width / DPI, (530 + 25 * rows) / DPI), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, _), labels in zip(axes, panels, shown, strict=True):
        # Squares without anti-aliasing: every point is drawn in its class's exact colour.
        ax.scatter(pts[sel, 0], pts[sel, 1], c=palette[labels] / 255.0, s=2.0, marker="s",
                   linewidths=0, antialiased=False)  # fmt: skip
        ax.set(title=title, xlabel="x (m)", ylabel="y (m)", aspect="equal")
        ax.set_xlim(-extent, extent)
        ax.set_ylim(-extent, extent)
    handles = [Patch(color=palette[k] / 255.0, label=name) for k, name in enumerate(names)]
    fig.legend(handles=handles, loc="outside lower center", ncols=columns, frameon=False)
    return _save(fig, path)
