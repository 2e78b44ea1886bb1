import json

import pytest

import quantrules as qr
from quantrules import PtqProvider, QtProvider, Rule

RULES = (
    Rule(module_path="enc/.*", op_names=("sparse_conv", "dot_general"), weight_qtype="int4",
         tile_size=64, act_batch_axes=(0, 1)),
    Rule(module_path="head"),
    Rule(weight_qtype="int8", act_qtype="fp8", mode="qt", bwd_qtype="e5m2",
         bwd_weight_grad_tile_size=0.5, additional_qt_config={"k": [1, 2]}),
)


@pytest.mark.parametrize("quant", [RULES, PtqProvider(RULES), QtProvider(RULES)])
def test_json_round_trip(tmp_path, quant):
    path = tmp_path / "rules.json"
    qr.dump_rules(quant, path)
    loaded = qr.load_rules(path)
    assert loaded == quant
    assert json.loads(path.read_text())["rules"][1] == {"module_path": "head"}


def test_dict_round_trip_each_rule():
    for rule in RULES:
        assert qr.rule_from_dict(json.loads(json.dumps(qr.rule_to_dict(rule)))) == rule


def test_bare_list_config():
    assert qr.rules_from_config([{"weight_qtype": "int8"}]) == (Rule(weight_qtype="int8"),)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"rules": [{"weight_qtype": "int8"}, {"weight_qtype": "int9"}]}',
         r"rules.json: rules\[1\]: Rule.weight_qtype: unknown qtype 'int9'"),
        ('{"rules": [{"tile_size": -1, "weight_qtype": "int8"}]}',
         r"rules.json: rules\[0\]: Rule.tile_size: tile size must be positive"),
        ('{"rules": [{}, {}, {"wieght_qtype": "int8"}]}',
         r"rules.json: rules\[2\]: unknown field 'wieght_qtype'"),
        ('{"rules": [3]}', r"rules.json: rules\[0\]: expected an object of rule fields"),
        ('{"provider": "fp", "rules": []}', r"provider must be null, 'ptq' or 'qt'"),
        ('{"rulez": []}', r"unknown key\(s\) \['rulez'\]"),
        ('{"rules": {}}', r"'rules' must be a list"),
        ('{"rules": [', r"rules.json: not valid JSON"),
    ],
)
def test_bad_files_name_index_and_field(tmp_path, content, message):
    path = tmp_path / "rules.json"
    path.write_text(content)
    with pytest.raises(qr.ConfigError, match=message):
        qr.load_rules(path)


@pytest.mark.parametrize(
    ("blob", "message"),
    [(b"\x80[]", "not UTF-8 text"), (b"[" * 100_000, "nested too deeply|not valid JSON")],
)
def test_undecodable_files_raise_config_error(tmp_path, blob, message):
    """Found by fuzzing: invalid UTF-8 raised UnicodeDecodeError, not ConfigError."""
    path = tmp_path / "rules.json"
    path.write_bytes(blob)
    with pytest.raises(qr.ConfigError, match=message):
        qr.load_rules(path)
