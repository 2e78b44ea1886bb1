"""The class colours of the demo's and the segment command's outputs: the
pictures (``pictures.py``) and the segment command's PLY files colour each
class the same way.

Plain NumPy and the standard library: the segment command colours a PLY
without importing matplotlib (whose import alone took longer than the
forward of the demo's model on an 88k-point scan).

>>> class_colours(3).tolist()
[[150, 150, 150], [214, 96, 77], [33, 102, 172]]
"""

from __future__ import annotations

import colorsys

import numpy as np

__all__ = ["CLASS_COLOURS", "MAX_CLASSES", "UNLABELED_COLOUR", "class_colours", "colour_columns"]

Colour = tuple[int, int, int]

#: One colour per class of the built-in scans: ground, building, car, pole, vegetation.
CLASS_COLOURS: tuple[Colour, ...] = (
    (150, 150, 150),
    (214, 96, 77),
    (33, 102, 172),
    (240, 190, 0),
    (27, 150, 60),
)

#: Points labelled past the named classes (a dataset's unlabeled points).
UNLABELED_COLOUR: Colour = (225, 225, 225)

#: The most classes :func:`class_colours` colours (no legend shows more).
MAX_CLASSES = 256

# Further classes: hues a golden angle apart (each new hue falls in the
# widest gap left), in turn at three (saturation, value) levels, so that
# neighbouring classes differ in hue and in lightness.
_GOLDEN = 0.6180339887498949
_LEVELS = ((0.70, 0.85), (0.45, 0.95), (0.80, 0.60))


def class_colours(n: int) -> np.ndarray:
    """``(n, 3)`` uint8 colours, all distinct: :data:`CLASS_COLOURS`, then
    generated ones for further classes (a dataset's 19 classes).

    >>> class_colours(7)[:5].tolist() == [list(c) for c in CLASS_COLOURS], class_colours(7).shape
    (True, (7, 3))
    >>> len({tuple(c) for c in class_colours(25).tolist()})  # all distinct
    25
    >>> class_colours(MAX_CLASSES + 1)
    Traceback (most recent call last):
    ...
    ValueError: class_colours: at most 256 classes, got n=257
    """
    if not 0 <= n <= MAX_CLASSES:
        raise ValueError(f"class_colours: at most {MAX_CLASSES} classes, got n={n}")
    out = list(CLASS_COLOURS[:n])
    taken = set(out) | {UNLABELED_COLOUR}
    k = 0
    while len(out) < n:
        saturation, value = _LEVELS[k % len(_LEVELS)]
        rgb = colorsys.hsv_to_rgb((0.1 + k * _GOLDEN) % 1.0, saturation, value)
        colour = (round(rgb[0] * 255), round(rgb[1] * 255), round(rgb[2] * 255))
        if colour not in taken:
            out.append(colour)
            taken.add(colour)
        k += 1
    return np.array(out, np.uint8).reshape(n, 3)


def colour_columns(labels: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """Each point's class colour as PLY properties: ``red``, ``green``,
    ``blue`` uint8 columns of :func:`class_colours` ``(n)`` by label
    (``mlx_lattice.io.write_ply``'s ``properties``).

    >>> {k: v.tolist() for k, v in colour_columns(np.array([2, 0]), 3).items()}
    {'red': [33, 150], 'green': [102, 150], 'blue': [172, 150]}
    """
    palette = class_colours(n).T.copy()  # one row of classes per channel: 1-D takes
    return {name: palette[c][labels] for c, name in enumerate(("red", "green", "blue"))}
