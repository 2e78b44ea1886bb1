import dataclasses

import pytest

import quantrules as qr
from quantrules import Rule


def test_defaults_and_normalization():
    r = Rule(weight_qtype="FP8", op_names="einsum")
    assert r.module_path == ".*"
    assert r.op_names == ("einsum",)
    assert r.weight_qtype == "float8_e4m3fn"
    assert r.mode == "ptq"
    assert not r.disabled
    assert Rule().disabled


def test_immutable_and_hashable():
    r = Rule(weight_qtype="int8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.weight_qtype = "int4"
    assert hash(r) == hash(Rule(weight_qtype="int8"))
    assert r == Rule(weight_qtype="int8") != Rule(weight_qtype="int4")
    assert len({r, Rule(weight_qtype="int8"), Rule(weight_qtype="int4")}) == 2


def test_replace_validates():
    r = Rule(weight_qtype="int8")
    assert r.replace(tile_size=64).tile_size == 64
    with pytest.raises(qr.RuleError, match="tile_size"):
        r.replace(tile_size=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"module_path": "enc/(unclosed"}, r"Rule.module_path: invalid regular expression"),
        ({"module_path": 3}, r"Rule.module_path: expected a regex string"),
        ({"op_names": ("matmul",)}, r"Rule.op_names: unknown op 'matmul'; expected one of"),
        ({"op_names": 5}, r"Rule.op_names: expected a sequence of op names"),
        ({"weight_qtype": "int9"}, r"Rule.weight_qtype: unknown qtype 'int9'"),
        ({"act_qtype": "bf16"}, r"Rule.act_qtype: unknown qtype 'bf16'"),
        ({"weight_qtype": "int8", "tile_size": 0}, r"tile size must be positive, got 0"),
        ({"weight_qtype": "int8", "tile_size": -4}, r"tile size must be positive, got -4"),
        ({"weight_qtype": "int8", "tile_size": 1.5}, r"must be in \(0, 1\], got 1.5"),
        ({"weight_qtype": "int8", "tile_size": True}, r"Rule.tile_size: expected a positive int"),
        ({"weight_qtype": "int8", "tile_size": "64"}, r"Rule.tile_size: expected a positive int"),
        ({"weight_qtype": "int8", "bwd_qtype": "int8"},
         r"Rule.bwd_qtype is a training \(QT\) field but the rule has mode='ptq'"),
        ({"weight_qtype": "int8", "bwd_stochastic_rounding": "uniform"},
         r"Rule.bwd_stochastic_rounding is a training \(QT\) field"),
        ({"weight_qtype": "int8", "mode": "qt", "bwd_stochastic_rounding": "gauss"},
         r"Rule.bwd_stochastic_rounding: expected None or one of"),
        ({"weight_qtype": "int8", "act_static_scale": True},
         r"act_static_scale is set but act_qtype is None"),
        ({"act_qtype": "int8", "act_static_scale": "yes"}, r"act_static_scale: expected a bool"),
        ({"weight_qtype": "int8", "mode": "train"}, r"Rule.mode: expected 'ptq' or 'qt'"),
        ({"weight_calibration_method": "mean"}, r"unknown calibration method 'mean'"),
        ({"weight_calibration_method": "rms"}, r"'rms' takes 1..1 numeric arguments"),
        ({"act_calibration_method": "absmax,x"}, r"arguments of 'absmax,x' must be numbers"),
        ({"weight_calibration_method": "fixed,1,2"}, r"fixed range of 'fixed,1,2' must contain 0"),
        ({"weight_calibration_method": 3}, r"weight_calibration_method: expected a string"),
        ({"act_batch_axes": (0, "1")}, r"act_batch_axes: expected a sequence of ints"),
        ({"channelwise_noise_axes": 1}, r"channelwise_noise_axes: expected a sequence of ints"),
        ({"mode": "qt", "additional_qt_config": [1]}, r"additional_qt_config: expected a mapping"),
        ({"bwd_weight_grad_tile_size": 0, "mode": "qt"}, r"bwd_weight_grad_tile_size"),
    ],
)
def test_invalid_rules_raise_precisely(kwargs, message):
    with pytest.raises(qr.QuantRulesError, match=message):
        Rule(**kwargs)


def test_valid_calibrations_and_qt_fields():
    r = Rule(weight_qtype="int8", act_qtype="int8", mode="qt", bwd_qtype="fp8",
             weight_calibration_method="fixed,-2,3", act_calibration_method="rms,2.5",
             bwd_calibration_method="minmax,0.9", bwd_weight_grad_tile_size=0.25,
             bwd_stochastic_rounding="low_bit_uniform", additional_qt_config={"a": 1})
    assert r.bwd_qtype == "float8_e4m3fn"
    assert dict(r.additional_qt_config) == {"a": 1}
    hash(r)


def test_op_registry_is_extensible():
    with pytest.raises(qr.UnknownOpError):
        Rule(op_names=("my_custom_op",))
    qr.register_op("my_custom_op")
    assert "my_custom_op" in qr.known_ops()
    assert Rule(op_names=("my_custom_op",)).matches_op("my_custom_op")
    with pytest.raises(qr.UnknownOpError, match="identifier"):
        qr.register_op("not valid!")


def test_einsum_matches_dot_general_rules_only_one_way():
    dot = Rule(op_names=("dot_general",), weight_qtype="int8")
    ein = Rule(op_names=("einsum",), weight_qtype="int8")
    assert dot.matches_op("einsum") and dot.matches_op("dot_general")
    assert ein.matches_op("einsum") and not ein.matches_op("dot_general")
    assert not dot.matches_op("conv_general_dilated")


def test_unsupported_stateless_fields():
    r = Rule(weight_qtype="int8", act_qtype="int8", act_static_scale=True, mode="qt",
             bwd_stochastic_rounding="uniform")
    assert r.unsupported_stateless_fields() == ("act_static_scale", "bwd_stochastic_rounding")
    assert Rule(weight_qtype="int8").unsupported_stateless_fields() == ()


@pytest.mark.parametrize("op", [[], ["einsum"], 3, None])
def test_non_string_op_names_raise_unknown_op(op):
    """Found by fuzzing: an unhashable op name raised a bare TypeError."""
    with pytest.raises(qr.UnknownOpError, match=r"Rule\.op_names: unknown op"):
        Rule(op_names=(op,))
    with pytest.raises(qr.ConfigError, match=r"rules\[0\]: Rule.op_names"):
        qr.rules_from_config([{"op_names": [op]}])
    with pytest.raises(qr.UnknownOpError, match="op: unknown op"):
        qr.resolve("int8", module_path="a", op=op)
