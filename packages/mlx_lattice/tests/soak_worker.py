"""Child process of the soak test (tests/test_soak.py): a long run of mixed
small calls, resident memory sampled as it goes.

    python soak_worker.py SEED WARMUP CALLS SAMPLE_EVERY

Every call is one op on small inputs, evaluated: relation build,
convolution forward and backward, weight-only and int8 quantized
convolution, max pooling, kNN, quantize/voxelize/devoxelize and training
batch norm. Inputs rotate over more coordinate sets than the validation memo
keeps (so the memo evicts all the time) and over 44 quantized weights (each
one noted, then cached, then hit). ``SOAK_OPS=conv,knn`` (the functions'
names) runs a subset, to find the source of a growth. Every result is compared with the op's first result
on the same input, bit for bit (a cache that handed back a stale entry, or a
kernel that read freed memory, would change a result). Prints one JSON line:
RSS (bytes, from /proc/self/statm) after the warm-up and every SAMPLE_EVERY
calls after it, and the number of result checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import mlx.core as mx
import numpy as np

import mlx_lattice
from mlx_lattice import SparseTensor, geometry
from mlx_lattice import nn as lattice_nn
from mlx_lattice import ops as sparse_ops
from mlx_lattice.core import QuantizedWeight, build_kernel_relation, ops

SETS = 40  # coordinate sets: more than the validation memo's 32 entries
WEIGHTS = 80  # quantized weights: the int8 calls use all, the weight-only ones 44
PERIOD = 80  # every call's input is a function of its index modulo PERIOD
C = 8


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    seed, warmup, calls, every = (int(a) for a in sys.argv[1:5])
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    coords, feats, points = [], [], []
    for _ in range(SETS):
        rows = np.unique(
            np.concatenate([rng.integers(0, 2, (90, 1)), rng.integers(0, 6, (90, 3))], 1), axis=0
        ).astype(np.int32)
        coords.append(rows)
        feats.append(mx.array(rng.standard_normal((len(rows), C)).astype(np.float32)))
        points.append(rng.uniform(0, 4, (120, 3)).astype(np.float32))
    rels = [build_kernel_relation(mx.array(c)) for c in coords]
    w = mx.array(rng.standard_normal((27, C, C)).astype(np.float32) * 0.2)
    qws = [
        QuantizedWeight.from_float(
            mx.array(rng.standard_normal((27, C, C)).astype(np.float32) * 0.2),
            bits=4,
            group_size=32,
        )
        for _ in range(WEIGHTS)
    ]
    bn = lattice_nn.BatchNorm(C)
    bn.train()
    grad = mx.grad(lambda f, wt, r: ops.sparse_conv_features_from_relation(f, wt, r).sum(), (0, 1))

    def relation(i: int):
        r = build_kernel_relation(mx.array(coords[i % SETS]))
        return [r.edges.in_rows, r.edges.out_rows, r.edges.kernel_ids]

    def conv(i: int):
        s = i % SETS
        return [ops.sparse_conv_features_from_relation(feats[s], w, rels[s])]

    def conv_grad(i: int):
        s = i % SETS
        return list(grad(feats[s], w, rels[s]))

    def quantized(i: int):
        s = i % SETS
        # Even calls rotate over 40 weights, odd calls over 4: 44 entries.
        q = qws[i % WEIGHTS if i % 2 == 0 else i % 8]
        return [ops.sparse_quantized_conv_features_from_relation(feats[s], q, rels[s])]

    def int8(i: int):
        s = i % SETS
        return [
            ops.sparse_quantized_conv_features_from_relation(
                feats[s], qws[i % WEIGHTS], rels[s], act_bits=8
            )
        ]

    def pool(i: int):
        s = i % SETS
        y = sparse_ops.max_pool3d(SparseTensor(mx.array(coords[s]), feats[s]), 2, 2)
        return [y.feats, y.coords]

    def knn(i: int):
        p = points[i % SETS]
        r = geometry.knn_relation(p, p, 4)
        return [r.edges.in_rows, r.edges.out_rows]

    def voxels(i: int):
        p = points[i % SETS]
        vox = geometry.quantize_points(p, 0.5)
        f = mx.array(p[:, :2].copy())
        v = geometry.voxelize(f, vox, "mean")
        pvm = geometry.point_voxel_map(p, vox.coords, 0.5)
        return [vox.coords, vox.point_to_voxel, v, geometry.devoxelize(v, pvm)]

    def batch_norm(i: int):
        s = i % SETS
        y = bn(SparseTensor(mx.array(coords[s]), feats[s])).feats
        # The running statistics are lazy updates of the previous ones: left
        # unevaluated, each call's graph would hold the one before (as with
        # mlx.nn.BatchNorm; training loops evaluate the model's state).
        mx.eval(bn.state)
        return [y]

    calls_table = [relation, conv, conv_grad, quantized, int8, pool, knn, voxels]
    # Batch norm in training updates its running statistics: compare its
    # output (a function of the batch only) but not the state.
    calls_table.append(batch_norm)
    only = os.environ.get("SOAK_OPS")  # a comma-separated subset, to find a leak's source
    if only:
        calls_table = [f for f in calls_table if f.__name__ in only.split(",")]
    # Digests of each (op, input)'s first result: all filled in the warm-up.
    first: dict[tuple[int, int], str] = {}
    checks = 0
    samples: list[int] = []
    for n in range(warmup + calls):
        fn = calls_table[n % len(calls_table)]
        i = n // len(calls_table)
        out = fn(i)
        mx.eval(out)
        key = (n % len(calls_table), i % PERIOD)
        digest = hashlib.sha256()
        for o in out:
            a = np.array(o)
            digest.update(f"{a.dtype}{a.shape}".encode())
            digest.update(a.tobytes())
        if key not in first:
            first[key] = digest.hexdigest()
        elif first[key] != digest.hexdigest():
            raise SystemExit(f"call {n} ({fn.__name__}, input {i % PERIOD}) changed its result")
        else:
            checks += 1
        if n + 1 == warmup or (n + 1 > warmup and (n + 1 - warmup) % every == 0):
            samples.append(rss_bytes())
    info = mlx_lattice.weight_cache_info()
    print(json.dumps({"rss": samples, "checks": checks, "cache": info}))


if __name__ == "__main__":
    main()
