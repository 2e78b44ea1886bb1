"""Independent point-voxel references shared by the geometry tests: plain
loops over points written from the documented formulas (float64), and
float32 emulations of the kernels' documented summation order.

The tests run with ``--import-mode=importlib`` and cannot import one
another, so each test file loads this module by its path (``importlib``).
"""

from __future__ import annotations

import math

import numpy as np


def pvm_ref(points, coords, size, origin, batch):
    """Rows, weights and nearest voxel per point, from the documented formulas."""
    size = np.broadcast_to(np.asarray(size, np.float64), (3,))
    origin = np.zeros(3) if origin is None else np.asarray(origin, np.float64)
    batch = np.zeros(len(points), np.int64) if batch is None else batch
    table = {tuple(int(v) for v in c): i for i, c in enumerate(coords)}
    rows = np.full((len(points), 8), -1)
    weights = np.zeros((len(points), 8))
    nearest = np.full(len(points), -1)
    for p, (pt, b) in enumerate(zip(points.astype(np.float64), batch, strict=True)):
        u = [(pt[a] - origin[a]) / size[a] - 0.5 for a in range(3)]
        base = [math.floor(x) for x in u]
        t = [u[a] - base[a] for a in range(3)]
        w = np.zeros(8)
        for c in range(8):
            d = ((c >> 2) & 1, (c >> 1) & 1, c & 1)
            r = table.get((int(b), base[0] + d[0], base[1] + d[1], base[2] + d[2]), -1)
            rows[p, c] = r
            wc = 1.0
            for a in range(3):
                wc *= t[a] if d[a] else 1.0 - t[a]
            w[c] = wc if r >= 0 else 0.0
        if w.sum() > 0:
            weights[p] = w / w.sum()
            present = np.flatnonzero(rows[p] >= 0)
            nearest[p] = rows[p, present[np.argmax(w[present])]]
    return rows, weights, nearest


def devoxelize_f32_ref(vf, rows, weights):
    """Linear devoxelization in the kernel's order, in float32: each point
    starts at 0 and adds ``w * f`` (each product rounded) corner by corner."""
    vf = np.asarray(vf, np.float32)
    out = np.zeros((len(rows), vf.shape[1]), np.float32)
    for c in range(8):
        present = rows[:, c] >= 0
        term = weights[:, c : c + 1].astype(np.float32) * vf[np.maximum(rows[:, c], 0)]
        out = np.where(present[:, None], out + term, out).astype(np.float32)
    return out


def devoxelize_transpose_f32_ref(g, rows, weights, n_voxels):
    """The transpose in the kernel's order, in float32: every voxel adds
    ``w * g[p]`` over its (point, corner) entries in ascending order."""
    g = np.asarray(g, np.float32)
    out = np.zeros((n_voxels, g.shape[1]), np.float32)
    flat = rows.reshape(-1)
    entries = np.flatnonzero(flat >= 0)
    terms = weights.reshape(-1)[entries, None].astype(np.float32) * g[entries // 8]
    np.add.at(out, flat[entries], terms)  # unbuffered, in entry order
    return out
