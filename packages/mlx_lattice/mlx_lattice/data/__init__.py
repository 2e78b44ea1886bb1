"""Built-in data: a seeded synthetic LiDAR scene, so demos need no download."""

from mlx_lattice.data.lidar import LidarScan, SceneConfig, synthetic_lidar_scan, voxelize_points

__all__ = ["LidarScan", "SceneConfig", "synthetic_lidar_scan", "voxelize_points"]
