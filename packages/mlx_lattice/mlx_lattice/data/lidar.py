"""A seeded synthetic street scene seen by a spinning multi-beam LiDAR.

The scene has a ground plane, buildings (boxes along both sides of a
street), parked cars (boxes), poles (vertical cylinders) and vegetation
(trees: a trunk cylinder under a spherical crown; bushes: spheres near the
ground). Rays of a
64-beam sensor (elevations -24.8 to +2 degrees, like an HDL-64) are cast
against it; each ray returns its first hit within range, with a little range
noise. Everything is NumPy and deterministic for a given seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlx_lattice._errors import MlxLatticeError

__all__ = ["CLASS_NAMES", "LidarScan", "SceneConfig", "synthetic_lidar_scan", "voxelize_points"]

#: The semantic class of each label index.
CLASS_NAMES = ("ground", "building", "car", "pole", "vegetation")
# Synthetic intensity of each class's surface (before the fall-off with range).
_REFLECTIVITY = np.array([0.25, 0.45, 0.8, 0.6, 0.35])


@dataclass(frozen=True)
class SceneConfig:
    """Sensor and scene parameters (defaults give ~100k voxels at 5 cm)."""

    beams: int = 64
    azimuth_steps: int = 2200
    min_elevation_deg: float = -24.8
    max_elevation_deg: float = 2.0
    sensor_height: float = 1.8
    max_range: float = 60.0
    range_noise: float = 0.01
    buildings: int = 16
    cars: int = 24
    poles: int = 30
    trees: int = 16
    bushes: int = 12


@dataclass(frozen=True)
class LidarScan:
    """Points ``(M, 3)`` float32 in metres (sensor at the origin, z up), a
    class label per point (indices into ``CLASS_NAMES``) and, when the
    source has it, each return's ``intensity`` ``(M,)`` float32 (``None``:
    not measured)."""

    points: np.ndarray
    labels: np.ndarray
    intensity: np.ndarray | None = None


def _boxes(rng: np.random.Generator, cfg: SceneConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Axis-aligned boxes (lo, hi) and their class labels."""
    lo, hi, labels = [], [], []
    for i in range(cfg.buildings):
        side = 1 if i % 2 else -1
        x0 = rng.uniform(-cfg.max_range, cfg.max_range)
        width, depth, height = rng.uniform(6, 18), rng.uniform(6, 12), rng.uniform(4, 20)
        y0 = side * rng.uniform(9, 14)
        lo.append([x0, y0 if side > 0 else y0 - depth, 0.0])
        hi.append([x0 + width, y0 + depth if side > 0 else y0, height])
        labels.append(1)
    for i in range(cfg.cars):
        side = 1 if i % 2 else -1
        x0 = rng.uniform(-cfg.max_range * 0.8, cfg.max_range * 0.8)
        if abs(x0) < 4:
            x0 += 8
        y0 = side * rng.uniform(3.5, 6.0)
        length, width, height = rng.uniform(3.8, 4.8), rng.uniform(1.7, 2.0), rng.uniform(1.4, 1.7)
        lo.append([x0, y0 - width / 2, 0.2])
        hi.append([x0 + length, y0 + width / 2, 0.2 + height])
        labels.append(2)
    return np.array(lo), np.array(hi), np.array(labels)


def _poles(rng: np.random.Generator, cfg: SceneConfig) -> np.ndarray:
    """Vertical cylinders as rows (x, y, radius, height)."""
    x = rng.uniform(-cfg.max_range, cfg.max_range, cfg.poles)
    y = np.where(np.arange(cfg.poles) % 2, 1, -1) * rng.uniform(7.0, 8.5, cfg.poles)
    return np.stack([x, y, rng.uniform(0.08, 0.2, cfg.poles), rng.uniform(3, 9, cfg.poles)], axis=1)


def _vegetation(seed: int, cfg: SceneConfig) -> tuple[np.ndarray, np.ndarray]:
    """Trunks as cylinder rows (x, y, radius, height) and crowns/bushes as
    sphere rows (x, y, z, radius). Drawn from their own stream so the other
    objects of a seed do not move when vegetation is added."""
    rng = np.random.default_rng([seed, 1])
    side = np.where(np.arange(cfg.trees) % 2, 1, -1)
    x = rng.uniform(-cfg.max_range, cfg.max_range, cfg.trees)
    y = side * rng.uniform(6.5, 8.5, cfg.trees)
    crown_r = rng.uniform(1.0, 2.2, cfg.trees)
    crown_z = rng.uniform(3.0, 5.5, cfg.trees)
    trunks = np.stack([x, y, rng.uniform(0.12, 0.3, cfg.trees), crown_z], axis=1)
    bush_side = np.where(np.arange(cfg.bushes) % 2, 1, -1)
    bush_r = rng.uniform(0.5, 1.1, cfg.bushes)
    bushes = np.stack(
        [
            rng.uniform(-cfg.max_range, cfg.max_range, cfg.bushes),
            bush_side * rng.uniform(7.5, 9.0, cfg.bushes),
            bush_r * rng.uniform(0.3, 0.7, cfg.bushes),
            bush_r,
        ],
        axis=1,
    )
    crowns = np.stack([x, y, crown_z, crown_r], axis=1)
    return trunks.reshape(-1, 4), np.concatenate([crowns, bushes]).reshape(-1, 4)


def _cylinder_hits(
    d: np.ndarray, origin: np.ndarray, x: float, y: float, r: float, h: float
) -> np.ndarray:
    """Ray parameter of the first hit on a vertical cylinder (inf: none)."""
    a = d[:, 0] ** 2 + d[:, 1] ** 2
    ox, oy = origin[0] - x, origin[1] - y
    bq = 2 * (ox * d[:, 0] + oy * d[:, 1])
    c = ox**2 + oy**2 - r**2
    disc = bq**2 - 4 * a * c
    with np.errstate(invalid="ignore", divide="ignore"):
        t = (-bq - np.sqrt(disc)) / (2 * a)
    z = origin[2] + t * d[:, 2]
    return np.where((disc >= 0) & (t > 0) & (z >= 0) & (z <= h), t, np.inf)


def _sphere_hits(d: np.ndarray, origin: np.ndarray, center: np.ndarray, r: float) -> np.ndarray:
    """Ray parameter of the first hit on a sphere (inf: none); rays are unit length."""
    oc = origin - center
    b = d @ oc
    disc = b * b - (oc @ oc - r * r)
    with np.errstate(invalid="ignore"):
        t = -b - np.sqrt(disc)
    return np.where((disc >= 0) & (t > 0), t, np.inf)


def synthetic_lidar_scan(seed: int = 0, config: SceneConfig | None = None) -> LidarScan:
    """Ray-cast one LiDAR sweep of a random street scene.

    >>> scan = synthetic_lidar_scan(seed=1)
    >>> scan.points.shape[1], scan.points.dtype.name, sorted(set(scan.labels.tolist())) == [0, 1, 2, 3, 4]
    (3, 'float32', True)
    """
    cfg = config or SceneConfig()
    rng = np.random.default_rng(seed)
    elevation = np.deg2rad(np.linspace(cfg.min_elevation_deg, cfg.max_elevation_deg, cfg.beams))
    azimuth = np.linspace(0, 2 * np.pi, cfg.azimuth_steps, endpoint=False)
    el, az = np.meshgrid(elevation, azimuth, indexing="ij")
    d = np.stack([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)], axis=-1).reshape(
        -1, 3
    )
    origin = np.array([0.0, 0.0, cfg.sensor_height])

    best = np.full(len(d), np.inf)
    label = np.full(len(d), -1)
    # Ground plane z = 0.
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(d[:, 2] < 0, -origin[2] / d[:, 2], np.inf)
    best, label = np.where(t < best, t, best), np.where(t < best, 0, label)
    # Boxes: slab test.
    lo, hi, box_labels = _boxes(rng, cfg)
    inv = np.divide(1.0, d, out=np.full_like(d, np.inf), where=d != 0)
    for b in range(len(lo)):
        t1 = (lo[b] - origin) * inv
        t2 = (hi[b] - origin) * inv
        near = np.nanmax(np.minimum(t1, t2), axis=1)
        far = np.nanmin(np.maximum(t1, t2), axis=1)
        hit = (near <= far) & (near > 0) & (near < best)
        best, label = np.where(hit, near, best), np.where(hit, box_labels[b], label)
    # Poles: ray / vertical cylinder in the xy-plane, clipped by height.
    for x, y, r, h in _poles(rng, cfg):
        t = _cylinder_hits(d, origin, x, y, r, h)
        hit = t < best
        best, label = np.where(hit, t, best), np.where(hit, 3, label)
    # Vegetation: tree trunks (cylinders) and crowns / bushes (spheres).
    trunks, spheres = _vegetation(seed, cfg)
    for x, y, r, h in trunks:
        t = _cylinder_hits(d, origin, x, y, r, h)
        hit = t < best
        best, label = np.where(hit, t, best), np.where(hit, 4, label)
    for x, y, z, r in spheres:
        t = _sphere_hits(d, origin, np.array([x, y, z]), r)
        hit = t < best
        best, label = np.where(hit, t, best), np.where(hit, 4, label)

    keep = best <= cfg.max_range
    rng_noise = rng.normal(0.0, cfg.range_noise, keep.sum())
    points = origin + d[keep] * (best[keep] + rng_noise)[:, None]
    labels = label[keep].astype(np.int32)
    # Intensity: the class's reflectivity, fading with range, with noise (its
    # own generator, so points and labels stay those of the seed).
    noise = np.random.default_rng([seed, 1]).normal(0.0, 0.05, len(labels))
    fade = 1.0 / (1.0 + 0.02 * best[keep])
    intensity = np.clip(_REFLECTIVITY[labels] * fade + noise, 0.0, 1.0).astype(np.float32)
    return LidarScan(points.astype(np.float32), labels, intensity)


def voxelize_points(points: np.ndarray, voxel_size: float, batch: int = 0) -> np.ndarray:
    """Unique ``(N, 4)`` int32 voxel coordinates ``(batch, x, y, z)`` of points.

    >>> voxelize_points(np.array([[0.01, 0.02, 0.0], [0.04, 0.0, 0.0], [0.06, 0.0, 0.0]]), 0.05).tolist()
    [[0, 0, 0, 0], [0, 1, 0, 0]]
    """
    if voxel_size <= 0:
        raise MlxLatticeError(f"voxel_size must be > 0, got {voxel_size}.")
    cells = np.floor(np.asarray(points, dtype=np.float64) / voxel_size).astype(np.int64)
    cells = np.unique(cells, axis=0)
    out = np.concatenate([np.full((len(cells), 1), batch), cells], axis=1)
    return out.astype(np.int32)
