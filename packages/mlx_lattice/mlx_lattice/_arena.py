"""The compiled graph's activation arena (``csrc/arena.h``).

:func:`with_arena` wraps the steps of a compiled inference graph
(:func:`mlx_lattice.compile`, unless ``arena=False``) so that
each runs with one arena of the graph active on the calling thread, and the
step that makes the graph's output evaluates it there. The extension's CPU
evaluations then take their large output buffers (4 KiB and up) from the
arena: buffers pooled by size (whole pages; a request also takes an idle
buffer up to 8 KiB larger, no more, or MLX would copy the array it holds),
handed back by the arrays' deleters when the last reference goes, so a
forward over a coordinate set seen before reuses the buffers of the
previous one instead of mapping, zero-filling and page-faulting fresh
memory (the concatenations too: they are the extension's
``concat_rows``). After each forward the arena frees the idle buffers
of the sizes that forward did not ask for: a stream of scans of other
sizes keeps the buffers of at most two forwards. Outputs of MLX's own ops in the graph
(SPVCNN's point moves, the head's ``mx.take``) still come from MLX's
allocator, as do outputs evaluated outside the forward.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx

__all__ = ["DEFAULT_MAX_BYTES", "arena_stats", "with_arena"]

# The most bytes one graph's arena keeps: the activations of a forward over a
# ~450k-voxel scan at 64 channels are ~115 MiB a layer in float32, and a
# MinkUNet forward holds about ten such buffers at once (its skips and the
# layers in flight), so 2 GiB keeps them; at most a quarter of the host's
# memory. Requests beyond the bound go to MLX's allocator (never an error).
_CAP = 2 << 30


def _default_max_bytes() -> int:
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return _CAP
    return min(_CAP, max(physical // 4, 0))


DEFAULT_MAX_BYTES = _default_max_bytes()


def _evaluate(out: Any) -> None:
    """Evaluate a step's output (a sparse tensor's features or arrays)."""
    feats = getattr(out, "feats", None)
    if isinstance(feats, mx.array):
        mx.eval(feats)
    elif isinstance(out, mx.array | list | tuple | dict):
        mx.eval(out)


class _InArena:
    """A graph step run with its graph's arena active; the output step also
    evaluates its result there, so the whole lazy forward is evaluated
    inside the arena."""

    __slots__ = ("arena", "evaluate", "step")

    def __init__(self, step: Callable, arena: Any, evaluate: bool) -> None:
        self.step, self.arena, self.evaluate = step, arena, evaluate

    def __call__(self, *args: Any) -> Any:
        with self.arena:
            out = self.step(*args)
            if self.evaluate:
                _evaluate(out)
        if self.evaluate:
            self.arena.trim()  # the forward's end: free what it left idle
        return out


def with_arena(
    graph: Mapping[str, Any], steps: list[Callable], max_bytes: int | None = None
) -> list[Callable]:
    """``steps`` (one per node of ``graph``) run with one new arena of at most
    ``max_bytes`` (default :data:`DEFAULT_MAX_BYTES`); 0 or an extension
    without arenas returns ``steps`` unchanged."""
    from mlx_lattice._native import ext

    limit = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    if limit <= 0 or not hasattr(ext, "ActivationArena"):
        return steps
    arena = ext.ActivationArena(limit)
    output = graph["output"]
    return [
        _InArena(step, arena, node["output"] == output)
        for node, step in zip(graph["nodes"], steps, strict=True)
    ]


def arena_stats(steps: list[Callable]) -> dict[str, int] | None:
    """The counters of the arena ``steps`` run with (``None``: none): buffers
    and bytes it owns, idle ones, hits, fresh allocations, requests bypassed
    to MLX's allocator over the bound, evictions, buffers trimmed after a
    forward that did not ask for their size, and the bound."""
    for step in steps:
        if isinstance(step, _InArena):
            return dict(step.arena.stats())
    return None
