"""Per-voxel training helpers: weighted cross-entropy, one optimizer step, argmax prediction."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as mlx_nn
import numpy as np

from mlx_lattice.tensor import SparseTensor, SparseTensorError

__all__ = ["class_weights", "cross_entropy", "predict", "train_step"]


def cross_entropy(
    logits: mx.array,
    labels: mx.array,
    *,
    weights: mx.array | None = None,
    ignore_index: int | None = None,
) -> mx.array:
    """Mean softmax cross-entropy of ``(N, K)`` scores against ``(N,)`` labels,
    computed in float32; ``weights`` ``(K,)`` weighs each class (the mean is
    then over the weights, as in PyTorch's ``CrossEntropyLoss``). Labels
    equal to ``ignore_index`` (e.g. ``K``, the unlabeled points of a
    dataset) add nothing and are left out of the mean.

    >>> round(cross_entropy(mx.array([[0.0, 0.0], [2.0, 0.0]]), mx.array([0, 0])).item(), 4)
    0.4100
    >>> round(cross_entropy(mx.array([[0.0, 0.0], [2.0, 0.0]]), mx.array([0, 2]), ignore_index=2).item(), 4)
    0.6931
    """
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise SparseTensorError(
            f"logits must be (N, K) and labels (N,), got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}."
        )
    keep = None
    if ignore_index is not None:
        keep = labels != ignore_index
        labels = mx.where(keep, labels, 0)
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= logits.shape[1]):
        # MLX gathers (and its gradient scatters) without bounds checks.
        raise SparseTensorError(
            f"labels must lie in [0, {logits.shape[1]}), got [{int(labels.min())}, "
            f"{int(labels.max())}]."
        )
    logits = logits.astype(mx.float32)
    nll = mx.logsumexp(logits, axis=1) - mx.take_along_axis(
        logits, labels.astype(mx.int32)[:, None], axis=1
    ).squeeze(1)
    if weights is None:
        if keep is None:
            return nll.mean()
        w = keep.astype(mx.float32)
    else:
        if weights.shape != (logits.shape[1],):
            raise SparseTensorError(
                f"weights must be ({logits.shape[1]},), got {tuple(weights.shape)}."
            )
        w = weights.astype(mx.float32)[labels]
        if keep is not None:
            w = w * keep.astype(mx.float32)
    return (w * nll).sum() / mx.maximum(w.sum(), 1e-12)


def class_weights(labels: np.ndarray, num_classes: int, power: float = 0.5) -> mx.array:
    """Inverse-frequency class weights ``(count_max / count_k) ** power``
    (absent classes get weight 1), for imbalanced scenes (ground dominates).

    >>> class_weights(np.array([0, 0, 0, 0, 1]), 3).tolist()
    [1.0, 2.0, 1.0]
    """
    counts = np.bincount(np.asarray(labels, np.int64).reshape(-1), minlength=num_classes)
    counts = counts[:num_classes].astype(np.float64)
    w = np.where(counts > 0, (counts.max() / np.maximum(counts, 1)) ** power, 1.0)
    return mx.array(w.astype(np.float32))


def train_step(
    model: mlx_nn.Module,
    optimizer: object,
    x: SparseTensor,
    labels: mx.array,
    *,
    weights: mx.array | None = None,
    loss_fn: Callable[[mx.array, mx.array], mx.array] | None = None,
    ignore_index: int | None = None,
) -> float:
    """One forward, backward and ``optimizer.update`` on a batch; returns the loss.

    ``ignore_index``: a label that adds no loss (see :func:`cross_entropy`).
    The model must be in ``train()`` mode for batch statistics. For float16
    training pass float16 features and keep the parameters float32 (mixed
    precision): the convolutions read their weights rounded to float16 and
    return float32 weight gradients, so the optimizer's state and update
    stay float32 (MLX's CPU float16 elementwise ops are several times slower).

    On Linux, call :func:`mlx_lattice.retain_freed_memory` once in a training
    process: otherwise glibc maps, zero-fills and page-faults every large
    array of every step anew.
    """
    if labels.shape != (x.num_points,):
        raise SparseTensorError(
            f"labels must be ({x.num_points},) for x's voxels, got {tuple(labels.shape)}."
        )

    def loss(m: mlx_nn.Module) -> mx.array:
        scores = m(x).feats
        if loss_fn is not None:
            return loss_fn(scores, labels)
        return cross_entropy(scores, labels, weights=weights, ignore_index=ignore_index)

    value, grads = mlx_nn.value_and_grad(model, loss)(model)
    optimizer.update(model, grads)  # type: ignore[attr-defined]
    mx.eval(value, model.parameters(), optimizer.state)  # type: ignore[attr-defined]
    return float(value.item())


def predict(model: mlx_nn.Module, x: SparseTensor) -> np.ndarray:
    """The argmax class per voxel, ``(N,)`` int32 (call ``model.eval()`` first)."""
    scores = model(x).feats
    return np.array(mx.argmax(scores, axis=1)).astype(np.int32)
