"""Shared test helpers over built relations (loaded by path: this project's
pytest runs with ``--import-mode=importlib``, so test files cannot import one
another)."""

from __future__ import annotations

import numpy as np

__all__ = ["relation_lists"]


def relation_lists(rel) -> list[list[int]]:
    """Each output row's input rows in kernel-id order (a neighbour relation
    gives every output row's neighbours with kernel id = rank, checked)."""
    out: list[list[int]] = [[] for _ in range(int(rel.n_out_capacity))]
    for i, o, k in zip(
        np.array(rel.edges.in_rows),
        np.array(rel.edges.out_rows),
        np.array(rel.edges.kernel_ids),
        strict=True,
    ):
        assert k == len(out[o])  # kernel id = rank
        out[o].append(int(i))
    return out
