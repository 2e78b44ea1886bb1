"""The model zoo: structure, properties a sparse U-Net must have (translation
equivariance, batch independence), norms against mlx.nn, save/load bit
exactness (float and quantized), quantized error bounds, and training on the
built-in labelled scans."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as mlx_nn
import mlx.optimizers as optim
import numpy as np
import pytest

import mlx_lattice
import quantrules as qr
from mlx_lattice import SparseTensor, SparseTensorError
from mlx_lattice.data import (
    HEIGHT_SCALE,
    SceneConfig,
    confusion_matrix,
    iou_per_class,
    labelled_scans,
    make_batch,
    mean_iou,
)
from mlx_lattice.models import (
    SPVCNN,
    FloatBatchNorm,
    MinkUNet,
    class_weights,
    cross_entropy,
    point_cloud_input,
    predict,
    train_step,
)

SMALL = SceneConfig(beams=16, azimuth_steps=512)
VOXEL = 0.25
#: The training test's settings and the floor it must pass (seeded: the
#: run is deterministic; at these settings it reaches about 0.59 mIoU).
TRAIN_STEPS = 60
MIOU_FLOOR = 0.45


@pytest.fixture(scope="module")
def data():
    scans = labelled_scans(3, 1, seed=0, config=SMALL)
    return [make_batch([s], VOXEL) for s in scans.train], make_batch(scans.validation, VOXEL)


@pytest.fixture(scope="module")
def trained(data):
    """A tiny MinkUNet trained on three built-in scans, and its loss curve."""
    train, _ = data
    mx.random.seed(0)
    model = MinkUNet(2, 5, widths=(8, 16, 16))
    opt = optim.Adam(learning_rate=1e-2)
    weights = class_weights(np.concatenate([np.array(b.labels) for b in train]), 5)
    model.train()
    losses = [
        train_step(model, opt, train[i % 3].tensor, train[i % 3].labels, weights=weights)
        for i in range(TRAIN_STEPS)
    ]
    model.eval()
    return model, losses


def _random_tensor(seed: int, n: int = 300, channels: int = 2, extent: int = 12) -> SparseTensor:
    rng = np.random.default_rng(seed)
    coords = np.unique(rng.integers(0, extent, (n, 3)), axis=0)
    coords = np.concatenate([np.zeros((len(coords), 1), np.int64), coords], axis=1)
    feats = rng.standard_normal((len(coords), channels)).astype(np.float32)
    return SparseTensor(mx.array(coords.astype(np.int32)), mx.array(feats))


def test_module_paths_follow_widths_and_depths():
    model = MinkUNet(2, 5, widths=(4, 8, 8, 16), depths=(1, 2, 1, 3))
    paths = [
        p.replace(".", "/") for p, m in model.named_modules() if mlx_lattice.nn.is_sparse_conv(m)
    ]
    assert sorted(paths) == sorted(
        [
            "stem/conv",
            "encoder/block1/down", "encoder/block1/conv", "encoder/block1/conv2",
            "encoder/block2/down", "encoder/block2/conv",
            "encoder/block3/down", "encoder/block3/conv", "encoder/block3/conv2",
            "encoder/block3/conv3",
            "decoder/block1/up", "decoder/block1/conv",
            "decoder/block2/up", "decoder/block2/conv", "decoder/block2/conv2",
            "decoder/block3/up", "decoder/block3/conv",
        ]
    )  # fmt: skip
    # Decoder block1 goes from level 3 (16) to level 2 (8) with the level-2 skip.
    assert model.decoder.block1.conv.config.in_channels == 8 + 8
    assert model.head.weight.shape == (5, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"widths": (8,)}, "widths"),
        ({"widths": (8, 0)}, "widths"),
        ({"depths": 0}, "depths"),
        ({"depths": (1, 1)}, "depths"),
        ({"num_classes": 0}, "num_classes"),
    ],
)
def test_bad_configurations_raise(kwargs, match):
    args = {"in_channels": 2, "num_classes": 5, "widths": (4, 8, 8), **kwargs}
    with pytest.raises(SparseTensorError, match=match):
        MinkUNet(**args)


def test_outputs_are_translation_equivariant_and_batch_independent():
    seed = 11
    mx.random.seed(seed)
    model = MinkUNet(2, 3, widths=(4, 8, 8)).eval()
    x = _random_tensor(seed)
    y = np.array(model(x).feats)
    # A shift by a multiple of the coarsest stride (4) moves every level's grid with it.
    shifted = x.coords + mx.array([0, 8, -4, 12], dtype=mx.int32)
    y_shift = np.array(model(SparseTensor(shifted, x.feats)).feats)
    np.testing.assert_allclose(y_shift, y, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    # A second scan in the batch does not change the first one's outputs (eval mode).
    other = _random_tensor(seed + 1)
    coords = mx.concatenate([x.coords, other.coords + mx.array([1, 0, 0, 0], dtype=mx.int32)])
    both = SparseTensor(coords, mx.concatenate([x.feats, other.feats]))
    y_both = np.array(model(both).feats)[: x.num_points]
    np.testing.assert_allclose(y_both, y, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")


def test_float_batch_norm_matches_mlx_batch_norm_in_float32():
    seed = 4
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((500, 6)).astype(np.float32) * 3 + 1
    x = SparseTensor(
        mx.zeros((500, 4), dtype=mx.int32) + mx.arange(500)[:, None].astype(mx.int32),
        mx.array(feats),
    )
    ref = mlx_nn.BatchNorm(6)
    ours = FloatBatchNorm(6)
    expected = np.array(ref(mx.array(feats)))
    got16 = ours(x.astype(mx.float16))
    assert got16.dtype == mx.float16
    # One float16 rounding of the input and one of the output (|y| < 4: 2**-9 relative).
    np.testing.assert_allclose(
        np.array(got16.feats.astype(mx.float32)), expected, atol=4e-3 * 4, err_msg=f"seed {seed}"
    )
    np.testing.assert_allclose(
        np.array(ours.running_mean), np.array(ref.running_mean), atol=2e-3, err_msg=f"seed {seed}"
    )
    # float32: the fused norm folds mean, rstd and the affine map into one
    # scale and shift (mlx.nn applies them one by one): equal to rounding.
    np.testing.assert_allclose(
        np.array(FloatBatchNorm(6)(x).feats),
        np.array(mlx_nn.BatchNorm(6)(mx.array(feats))),
        rtol=1e-5,
        atol=1e-5,
        err_msg=f"seed {seed}",
    )


def test_cross_entropy_against_numpy():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((40, 5)).astype(np.float32) * 2
    labels = rng.integers(0, 5, 40)
    weights = rng.uniform(0.5, 2.0, 5).astype(np.float32)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    nll = -logp[np.arange(40), labels]
    got = cross_entropy(mx.array(logits), mx.array(labels))
    assert got.item() == pytest.approx(nll.mean(), rel=1e-5)
    got_w = cross_entropy(mx.array(logits), mx.array(labels), weights=mx.array(weights))
    w = weights[labels]
    assert got_w.item() == pytest.approx((w * nll).sum() / w.sum(), rel=1e-5)
    with pytest.raises(SparseTensorError, match="weights"):
        cross_entropy(mx.array(logits), mx.array(labels), weights=mx.ones((4,)))
    with pytest.raises(SparseTensorError, match="labels"):
        cross_entropy(mx.array(logits), mx.array(labels[:3]))


def test_training_lowers_the_loss_and_reaches_the_miou_floor(data, trained):
    _, val = data
    model, losses = trained
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < 0.5 * first, losses
    pred = predict(model, val.tensor)
    cm = confusion_matrix(pred[val.point_to_voxel], val.point_labels, 5)
    miou = mean_iou(cm)
    assert miou > MIOU_FLOOR, (miou, iou_per_class(cm))
    assert iou_per_class(cm)[0] > 0.9  # ground is easy: a broken model fails here first


def test_train_step_rejects_mismatched_labels(data):
    train, _ = data
    model = MinkUNet(2, 5, widths=(4, 8))
    with pytest.raises(SparseTensorError, match="labels"):
        train_step(model, optim.SGD(learning_rate=0.1), train[0].tensor, train[0].labels[:-1])


def test_save_load_is_bit_exact_float(tmp_path, data, trained):
    _, val = data
    model, _ = trained
    path = tmp_path / "minkunet.safetensors"
    model.save_weights(str(path))
    fresh = MinkUNet(2, 5, widths=(8, 16, 16))
    fresh.load_weights(str(path))
    fresh.eval()
    for (name, a), (_, b) in zip(
        sorted(mlx_lattice_flat(model)), sorted(mlx_lattice_flat(fresh)), strict=True
    ):
        assert mx.array_equal(a, b).item(), name
    assert mx.array_equal(model(val.tensor).feats, fresh(val.tensor).feats).item()


def mlx_lattice_flat(model: mlx_nn.Module) -> list:
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


RULES = [
    qr.Rule(module_path="stem/.*"),  # Cin=2: packing would grow the layer
    qr.Rule(module_path="encoder/.*", op_names=("sparse_conv",), weight_qtype="int4", tile_size=32),
    qr.Rule(op_names=("sparse_conv",), weight_qtype="int8", tile_size=32),
]


def _quantized_copy(model: MinkUNet, rules) -> MinkUNet:
    copy = MinkUNet(2, 5, widths=model.widths, depths=model.depths)
    copy.update(model.parameters())
    mlx_lattice.quantize(copy, rules)
    return copy.eval()


def test_save_load_is_bit_exact_quantized(tmp_path, data, trained):
    _, val = data
    model, _ = trained
    quantized = _quantized_copy(model, RULES)
    path = tmp_path / "minkunet_q.safetensors"
    quantized.save_weights(str(path))
    # Loading needs the same structure: quantize a fresh model with the same rules first.
    fresh = MinkUNet(2, 5, widths=(8, 16, 16))
    mlx_lattice.quantize(fresh, RULES)
    fresh.load_weights(str(path))
    fresh.eval()
    assert isinstance(fresh.encoder.block1.conv, mlx_lattice.nn.QuantizedConv)
    assert fresh.encoder.block1.conv.quantization.bits == 4
    assert mx.array_equal(quantized(val.tensor).feats, fresh(val.tensor).feats).item()


#: Documented bounds for the trained tiny model on the validation scan:
#: relative L2 error of the scores and mIoU lost, per weight format. Measured
#: 0.0017 / 0.0005 (int8) and 0.024 / 0.0005 (int4); the error bounds leave
#: ~3.5x room, the mIoU bounds allow a few validation points to flip class.
QUANT_BOUNDS = {"int8": (0.006, 0.01), "int4": (0.08, 0.03)}


@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_quantized_model_within_documented_bounds(data, trained, qtype):
    _, val = data
    model, _ = trained
    rules = [
        qr.Rule(module_path="stem/.*"),
        qr.Rule(op_names=("sparse_conv",), weight_qtype=qtype, tile_size=32),
    ]
    quantized = _quantized_copy(model, rules)
    ref = np.array(model(val.tensor).feats, np.float64)
    got = np.array(quantized(val.tensor).feats, np.float64)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    ref_miou = mean_iou(confusion_matrix(ref.argmax(1)[val.point_to_voxel], val.point_labels, 5))
    q_miou = mean_iou(confusion_matrix(got.argmax(1)[val.point_to_voxel], val.point_labels, 5))
    max_err, max_drop = QUANT_BOUNDS[qtype]
    assert 0 < err < max_err, err
    assert ref_miou - q_miou < max_drop, (ref_miou, q_miou)


# -- SPVCNN -------------------------------------------------------------------------------


def _cloud_input(scan):
    feats = np.stack([np.ones(len(scan.points)), scan.points[:, 2] / HEIGHT_SCALE], axis=1)
    return point_cloud_input(scan.points, feats.astype(np.float32), VOXEL), mx.array(scan.labels)


@pytest.fixture(scope="module")
def spv_trained():
    scans = labelled_scans(3, 1, seed=0, config=SMALL)
    train = [_cloud_input(s) for s in scans.train]
    val = _cloud_input(scans.validation[0])
    mx.random.seed(0)
    model = SPVCNN(2, 5, widths=(8, 16, 16))
    opt = optim.Adam(learning_rate=1e-2)
    weights = class_weights(np.concatenate([np.array(lab) for _, lab in train]), 5)
    model.train()
    losses = []
    for i in range(SPV_STEPS):
        inp, labels = train[i % 3]

        def loss(m, inp=inp, labels=labels):
            return cross_entropy(m(inp), labels, weights=weights)

        value, grads = mlx_nn.value_and_grad(model, loss)(model)
        opt.update(model, grads)
        mx.eval(value, model.parameters(), opt.state)
        losses.append(value.item())
    model.eval()
    return model, losses, val


#: SPVCNN's training test: 50 steps reach about 0.68 validation mIoU (seeded).
SPV_STEPS = 50
SPV_MIOU_FLOOR = 0.5


def test_spvcnn_trains_on_points_and_reaches_the_miou_floor(spv_trained):
    model, losses, (inp, labels) = spv_trained
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    scores = model(inp)
    assert scores.shape == (inp.num_points, 5)
    cm = confusion_matrix(np.array(mx.argmax(scores, axis=1)), np.array(labels), 5)
    assert mean_iou(cm) > SPV_MIOU_FLOOR, iou_per_class(cm)


def _dense_cloud(seed: int, n: int = 20000, size: float = 4.0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, size, (n, 3)).astype(np.float32)


@pytest.mark.parametrize("stride", [1, 2, 4])
def test_point_voxel_levels_against_numpy(stride):
    seed = 20 + stride
    pts = _dense_cloud(seed)
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((len(pts), 3)).astype(np.float32)
    inp = point_cloud_input(pts, feats, 0.25)
    x = inp.tensor
    while x.tensor_stride[0] < stride:  # the U-Net's coarser coordinate sets
        x = mlx_lattice.ops.conv3d(x, mx.ones((1, 2, 2, 2, x.num_channels)), stride=2)
    # to_voxels: the mean of the points in each of x's voxels, in x's row order.
    got = np.array(inp.to_voxels(x, mx.array(feats)).feats)
    cells = np.floor(pts / (0.25 * stride)).astype(np.int64)
    coords = np.array(x.coords)[:, 1:] // stride
    for r in rng.choice(len(coords), 40, replace=False):
        members = np.all(cells == coords[r], axis=1)
        np.testing.assert_allclose(got[r], feats[members].mean(0), rtol=1e-5, atol=1e-6)
    # to_points: trilinear interpolation of voxel-centre positions gives the
    # point back wherever all 8 surrounding voxels exist (interior points).
    centres = (coords + 0.5) * 0.25 * stride
    back = np.array(inp.to_points(x.replace(mx.array(centres.astype(np.float32)))))
    h = 0.25 * stride
    occupied = {tuple(c) for c in coords.tolist()}
    low = np.floor(pts / h - 0.5).astype(np.int64)  # the lowest of the 8 surrounding centres
    corners = np.array([(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)])
    interior = np.array([all(tuple(lo + k) in occupied for k in corners) for lo in low.tolist()])
    assert interior.sum() > 1000
    np.testing.assert_allclose(back[interior], pts[interior], atol=1e-4, err_msg=f"seed {seed}")


def test_to_voxels_gradient_matches_the_plain_gather(rng):
    # to_voxels' row permutation has a hand-written vjp (the inverse gather);
    # MLX's own gather gradient (a scatter-add) is the reference.
    pts = _dense_cloud(7, n=5000)
    feats = mx.array(rng.standard_normal((len(pts), 3)).astype(np.float32))
    inp = point_cloud_input(pts, feats, 0.25)
    x = mlx_lattice.ops.conv3d(inp.tensor, mx.ones((1, 2, 2, 2, 3)), stride=2)
    direction = mx.array(rng.standard_normal((x.num_points, 3)).astype(np.float32))
    vox, inverse, _ = inp.level(x)

    def ours(f):
        return (inp.to_voxels(x, f).feats * direction).sum()

    def plain(f):
        return (mlx_lattice.geometry.voxelize(f, vox, "mean")[inverse] * direction).sum()

    np.testing.assert_allclose(
        np.array(mx.grad(ours)(feats)), np.array(mx.grad(plain)(feats)), rtol=1e-6, atol=1e-7
    )


def test_spvcnn_rejects_a_voxel_tensor():
    x = _random_tensor(1)
    with pytest.raises(SparseTensorError, match="PointCloudInput"):
        SPVCNN(2, 5, widths=(4, 8))(x)
    with pytest.raises(SparseTensorError, match="feats"):
        point_cloud_input(_dense_cloud(0, 10), np.ones((9, 2), np.float32), 0.5)


def test_spvcnn_save_load_bit_exact_float_and_quantized(tmp_path, spv_trained):
    model, _, (inp, _) = spv_trained
    path = tmp_path / "spvcnn.safetensors"
    model.save_weights(str(path))
    fresh = SPVCNN(2, 5, widths=(8, 16, 16))
    fresh.load_weights(str(path))
    fresh.eval()
    assert mx.array_equal(model(inp), fresh(inp)).item()
    quantized = SPVCNN(2, 5, widths=(8, 16, 16))
    quantized.update(model.parameters())
    mlx_lattice.quantize(quantized, RULES)
    quantized.eval()
    q_path = tmp_path / "spvcnn_q.safetensors"
    quantized.save_weights(str(q_path))
    loaded = SPVCNN(2, 5, widths=(8, 16, 16))
    mlx_lattice.quantize(loaded, RULES)
    loaded.load_weights(str(q_path))
    loaded.eval()
    assert mx.array_equal(quantized(inp), loaded(inp)).item()
    # The quantized SPVCNN stays within the int8/int4 bounds documented for MinkUNet.
    ref, got = np.array(model(inp), np.float64), np.array(quantized(inp), np.float64)
    assert 0 < np.linalg.norm(got - ref) / np.linalg.norm(ref) < QUANT_BOUNDS["int4"][0]


def test_cross_entropy_rejects_labels_out_of_range():
    # MLX's gather (and the scatter of its gradient) read and write unchecked:
    # a label past the classes must raise, not corrupt memory.
    logits = mx.zeros((3, 4))
    for bad in ([0, 1, 4], [0, -1, 2]):
        with pytest.raises(SparseTensorError, match="labels must lie in"):
            cross_entropy(logits, mx.array(bad))
